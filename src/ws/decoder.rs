//! Client→server frames to messages: reassembly of fragments, limits, UTF-8 (RFC 6455 §5.4,
//! §5.5, §5.6, §8.1).
//!
//! The caller owns the bytes: it hands `decode` whatever it has read and drops the `consumed`
//! prefix it gets back. A frame is consumed whole or not at all, so the caller's buffer must
//! hold one frame; `needed` says how big that frame is once its header has arrived. Limits are
//! enforced from the header, before the payload is buffered.
//!
//! Text is checked as early as the RFC allows (§8.1, Autobahn 6.4.x "fail fast"): a fragment
//! when it arrives, and even the arrived part of a text frame that is still incomplete. That
//! early scan keeps a cursor between calls, so `decode` must be called again with the same
//! unconsumed bytes (plus more), which is what "nothing consumed" means anyway. The scan only
//! ever refuses early; every message is still validated in full when its frames complete.

use super::frame::{close_frame, parse_header, FrameHeader};
use super::utf8::Utf8Validator;
use super::{apply_mask, Limits, Message, OpCode, ProtocolError};

/// Turns client frames into messages, one frame per `decode` call.
///
/// Idle, it is a `Limits`, a null pointer and a cursor (four words); the state of a
/// fragmented message is boxed and freed when the message completes.
#[derive(Debug)]
pub struct Decoder {
    limits: Limits,
    /// The fragmented message in progress, if any (§5.4).
    partial: Option<Box<Partial>>,
    /// Payload bytes of the incomplete text frame at the front of the input already scanned
    /// and found valid, up to a code point boundary; 0 whenever a frame is consumed.
    scanned: usize,
}

/// A data message whose first frame had FIN clear.
#[derive(Debug)]
struct Partial {
    /// Text (validated as it arrives) or binary.
    text: bool,
    /// Frames received so far, for `Limits::max_fragments`.
    frames: usize,
    /// Unmasked payload received so far.
    buf: Vec<u8>,
    /// UTF-8 state between fragments of a text message.
    utf8: Utf8Validator,
}

impl Decoder {
    /// A decoder for one connection, enforcing `limits` on data messages.
    pub fn new(limits: Limits) -> Decoder {
        Decoder {
            limits,
            partial: None,
            scanned: 0,
        }
    }

    /// Parses at most one frame from the front of `input` (client→server frames).
    ///
    /// `Ok(None)`: need more bytes, nothing consumed. `Ok(Some((consumed, msg)))`: `consumed`
    /// bytes used; `msg` is `Some` when the frame completed a data message or was a control
    /// frame, `None` for a non-final fragment. An error is fatal: fail the connection with
    /// [`ProtocolError::close_code`] and drop the decoder.
    pub fn decode(
        &mut self,
        input: &[u8],
    ) -> Result<Option<(usize, Option<Message>)>, ProtocolError> {
        let Some(header) = parse_header(input)? else {
            return Ok(None);
        };
        let end = self.check(&header)?;
        let Some(payload) = input.get(header.len..end) else {
            self.scan_arrived_text(&header, input.get(header.len..).unwrap_or_default())?;
            return Ok(None);
        };
        self.scanned = 0;
        let msg = match header.opcode {
            OpCode::Close => Some(Message::Close(close_frame(unmasked(payload, header.mask))?)),
            OpCode::Ping => Some(Message::Ping(unmasked(payload, header.mask))),
            OpCode::Pong => Some(Message::Pong(unmasked(payload, header.mask))),
            OpCode::Text | OpCode::Binary => self.start_message(&header, payload)?,
            OpCode::Continuation => self.continue_message(&header, payload)?,
        };
        Ok(Some((end, msg)))
    }

    /// True when no fragmented message is in progress (the caller may then free its buffers).
    pub fn is_idle(&self) -> bool {
        self.partial.is_none()
    }

    /// Bytes still missing from the frame at the front of `input`, once its header is complete
    /// and acceptable: `Some(0)` when the whole frame is there. `None` when the header is
    /// incomplete or `decode` will reject it. The answer is bounded by the limits, so the
    /// caller can size one allocation with it.
    pub fn needed(&self, input: &[u8]) -> Option<usize> {
        let header = parse_header(input).ok()??;
        let end = self.check(&header).ok()?;
        Some(end.saturating_sub(input.len()))
    }

    /// The checks that need the decoder's state; returns where the frame ends in the input.
    fn check(&self, header: &FrameHeader) -> Result<usize, ProtocolError> {
        // Control frames may come between the fragments of a message (§5.4); their length was
        // checked against 125 by `parse_header` (§5.5).
        let (frames, buffered) = match (header.opcode, &self.partial) {
            (op, _) if op.is_control() => (0, 0),
            (OpCode::Continuation, None) => return Err(ProtocolError::UnexpectedContinuation),
            (OpCode::Continuation, Some(p)) => (p.frames, p.buf.len()),
            (_, Some(_)) => return Err(ProtocolError::InterleavedMessage),
            (_, None) => (0, 0),
        };
        let limits = self.limits;
        if !header.opcode.is_control() && frames >= limits.max_fragments {
            return Err(ProtocolError::TooManyFragments {
                limit: limits.max_fragments,
            });
        }
        // Compared in u64 before any conversion: the wire length may exceed usize.
        let total = (buffered as u64).saturating_add(header.payload_len);
        if !header.opcode.is_control() && total > limits.max_message as u64 {
            return Err(ProtocolError::MessageTooBig {
                limit: limits.max_message,
            });
        }
        // The payload is at most max_message (data) or 125 (control) bytes, so it fits usize
        // and the sum cannot overflow; an error here would mean a limit near usize::MAX.
        usize::try_from(header.payload_len)
            .ok()
            .and_then(|len| header.len.checked_add(len))
            .ok_or(ProtocolError::MessageTooBig {
                limit: limits.max_message,
            })
    }

    /// §8.1 fail fast within a frame: validates the newly arrived payload of an incomplete
    /// text frame and moves the cursor to the last code point boundary, so each byte is
    /// scanned about once however the frame is cut into reads.
    fn scan_arrived_text(
        &mut self,
        header: &FrameHeader,
        arrived: &[u8],
    ) -> Result<(), ProtocolError> {
        let at_frame_start = match (header.opcode, &self.partial) {
            (OpCode::Text, _) => Utf8Validator::default(),
            (OpCode::Continuation, Some(partial)) if partial.text => partial.utf8,
            _ => return Ok(()),
        };
        // Past the cursor there is no carry: it sits on a code point boundary.
        let mut utf8 = match self.scanned {
            0 => at_frame_start,
            _ => Utf8Validator::default(),
        };
        let Some(new) = arrived.get(self.scanned..) else {
            // Not the bytes of the last call (the caller broke the contract): rescan later.
            self.scanned = 0;
            return Ok(());
        };
        utf8.feed_masked(new, header.mask, self.scanned)
            .map_err(|_| ProtocolError::InvalidUtf8)?;
        // The pending bytes are the tail of `new`, unless a code point carried in from the
        // previous fragment is still incomplete; then the cursor stays where it was.
        self.scanned = arrived.len().saturating_sub(utf8.pending().min(new.len()));
        Ok(())
    }

    /// A text or binary frame: a whole message, or the first fragment of one (§5.4).
    fn start_message(
        &mut self,
        header: &FrameHeader,
        payload: &[u8],
    ) -> Result<Option<Message>, ProtocolError> {
        let text = header.opcode == OpCode::Text;
        let buf = unmasked(payload, header.mask);
        if header.fin {
            return finish_message(text, buf).map(Some);
        }
        let mut utf8 = Utf8Validator::default();
        if text {
            utf8.feed(&buf).map_err(|_| ProtocolError::InvalidUtf8)?;
        }
        self.partial = Some(Box::new(Partial {
            text,
            frames: 1,
            buf,
            utf8,
        }));
        Ok(None)
    }

    /// A continuation frame of the message in progress (§5.4).
    fn continue_message(
        &mut self,
        header: &FrameHeader,
        payload: &[u8],
    ) -> Result<Option<Message>, ProtocolError> {
        // `check` returned UnexpectedContinuation when there is no message in progress.
        let Some(partial) = self.partial.as_mut() else {
            return Err(ProtocolError::UnexpectedContinuation);
        };
        let start = partial.buf.len();
        partial.buf.extend_from_slice(payload);
        let fragment = partial.buf.get_mut(start..).unwrap_or_default();
        apply_mask(fragment, header.mask);
        partial.frames += 1;
        if !header.fin {
            // §8.1: fail as soon as the text so far cannot be UTF-8, not at the final fragment.
            if partial.text {
                partial
                    .utf8
                    .feed(fragment)
                    .map_err(|_| ProtocolError::InvalidUtf8)?;
            }
            return Ok(None);
        }
        let Some(partial) = self.partial.take() else {
            return Err(ProtocolError::UnexpectedContinuation);
        };
        // The final fragment is validated with the whole message by `String::from_utf8`, which
        // also catches a code point left incomplete at the end.
        finish_message(partial.text, partial.buf).map(Some)
    }
}

/// The complete payload of a data message as a message (§5.6: text MUST be UTF-8).
fn finish_message(text: bool, buf: Vec<u8>) -> Result<Message, ProtocolError> {
    if !text {
        return Ok(Message::Binary(buf));
    }
    String::from_utf8(buf)
        .map(Message::Text)
        .map_err(|_| ProtocolError::InvalidUtf8)
}

fn unmasked(payload: &[u8], key: [u8; 4]) -> Vec<u8> {
    let mut buf = payload.to_vec();
    apply_mask(&mut buf, key);
    buf
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::ws::encode_client_frame;

    const LIMITS: Limits = Limits {
        max_message: 1000,
        max_fragments: 4,
    };
    const KEY: [u8; 4] = [0xa1, 0xb2, 0xc3, 0xd4];

    fn frame(fin: bool, opcode: OpCode, payload: &[u8]) -> Vec<u8> {
        let mut out = Vec::new();
        encode_client_frame(&mut out, fin, opcode, KEY, payload);
        out
    }

    /// Decodes every frame in `input`; the first error ends the stream.
    fn decode_all(decoder: &mut Decoder, mut input: &[u8]) -> Result<Vec<Message>, ProtocolError> {
        let mut out = Vec::new();
        while let Some((used, msg)) = decoder.decode(input)? {
            out.extend(msg);
            input = &input[used..];
        }
        assert!(input.is_empty(), "left over: {input:x?}");
        Ok(out)
    }

    fn error_of(frames: &[Vec<u8>]) -> ProtocolError {
        decode_all(&mut Decoder::new(LIMITS), &frames.concat()).unwrap_err()
    }

    #[test]
    fn idle_decoder_is_four_words() {
        assert!(std::mem::size_of::<Decoder>() <= 4 * std::mem::size_of::<usize>());
        let decoder = Decoder::new(LIMITS);
        assert!(decoder.is_idle());
    }

    #[test]
    fn control_frames_between_fragments_are_delivered_at_once() {
        let stream = [
            frame(false, OpCode::Text, b"fra"),
            frame(true, OpCode::Ping, b"p1"),
            frame(false, OpCode::Continuation, b"gm"),
            frame(true, OpCode::Pong, b""),
            frame(true, OpCode::Continuation, b"ents"),
        ];
        let mut decoder = Decoder::new(LIMITS);
        let mut delivered = Vec::new();
        for f in &stream {
            let (used, msg) = decoder.decode(f).unwrap().unwrap();
            assert_eq!(used, f.len());
            delivered.push(msg);
        }
        let expect = [
            None,
            Some(Message::Ping(b"p1".to_vec())),
            None,
            Some(Message::Pong(vec![])),
            Some(Message::Text("fragments".into())),
        ];
        assert_eq!(delivered, expect);
        assert!(decoder.is_idle());
    }

    #[test]
    fn is_idle_only_between_messages() {
        let mut decoder = Decoder::new(LIMITS);
        decoder.decode(&frame(false, OpCode::Binary, b"a")).unwrap();
        assert!(!decoder.is_idle());
        decoder.decode(&frame(true, OpCode::Ping, b"")).unwrap();
        assert!(!decoder.is_idle());
        decoder
            .decode(&frame(true, OpCode::Continuation, b"b"))
            .unwrap();
        assert!(decoder.is_idle());
    }

    #[test]
    fn protocol_violations_close_with_1002() {
        let mut unmasked = frame(true, OpCode::Text, b"hi");
        unmasked[1] &= 0x7f;
        let mut rsv1 = frame(true, OpCode::Text, b"hi");
        rsv1[0] |= 0x40;
        let mut reserved_op = frame(true, OpCode::Binary, b"hi");
        reserved_op[0] = 0x80 | 0xB;
        let cases = [
            (vec![unmasked], ProtocolError::UnmaskedFrame),
            (vec![rsv1], ProtocolError::ReservedBits),
            (vec![reserved_op], ProtocolError::ReservedOpCode(0xB)),
            (
                vec![frame(false, OpCode::Ping, b"")],
                ProtocolError::FragmentedControl,
            ),
            (
                vec![frame(true, OpCode::Pong, &[0; 126])],
                ProtocolError::ControlTooLong,
            ),
            (
                vec![frame(true, OpCode::Continuation, b"x")],
                ProtocolError::UnexpectedContinuation,
            ),
            (
                vec![frame(false, OpCode::Continuation, b"x")],
                ProtocolError::UnexpectedContinuation,
            ),
            (
                vec![
                    frame(false, OpCode::Text, b"a"),
                    frame(true, OpCode::Text, b"b"),
                ],
                ProtocolError::InterleavedMessage,
            ),
            (
                vec![
                    frame(false, OpCode::Binary, b"a"),
                    frame(false, OpCode::Binary, b"b"),
                ],
                ProtocolError::InterleavedMessage,
            ),
            (
                vec![frame(true, OpCode::Close, b"\x03")],
                ProtocolError::CloseTooShort,
            ),
        ];
        for (frames, err) in cases {
            assert_eq!(error_of(&frames), err);
            assert_eq!(err.close_code(), 1002);
        }
    }

    #[test]
    fn oversized_message_is_refused_from_the_header_alone() {
        let whole = frame(true, OpCode::Binary, &[0; 1001]);
        let header_only = &whole[..8];
        let err = Decoder::new(LIMITS).decode(header_only).unwrap_err();
        assert_eq!(
            (err, err.close_code()),
            (ProtocolError::MessageTooBig { limit: 1000 }, 1009)
        );
        let at_limit = frame(true, OpCode::Binary, &[0; 1000]);
        assert!(decode_all(&mut Decoder::new(LIMITS), &at_limit).is_ok());
        // A 64-bit length far beyond usize on 32-bit targets is refused, not converted.
        let huge = b"\x82\xff\x7f\xff\xff\xff\xff\xff\xff\xff\x01\x02\x03\x04";
        assert_eq!(
            Decoder::new(LIMITS).decode(huge),
            Err(ProtocolError::MessageTooBig { limit: 1000 })
        );
    }

    #[test]
    fn oversized_fragmented_message_is_refused_at_the_fragment_that_crosses() {
        let mut decoder = Decoder::new(LIMITS);
        decoder
            .decode(&frame(false, OpCode::Text, &[b'a'; 600]))
            .unwrap();
        let crossing = frame(true, OpCode::Continuation, &[b'a'; 401]);
        let err = decoder.decode(&crossing[..8]).unwrap_err();
        assert_eq!(err, ProtocolError::MessageTooBig { limit: 1000 });
    }

    #[test]
    fn too_many_fragments_closes_with_1009() {
        let mut frames = vec![frame(false, OpCode::Binary, b"")];
        frames.extend((0..3).map(|_| frame(false, OpCode::Continuation, b"")));
        let mut decoder = Decoder::new(LIMITS);
        assert_eq!(decode_all(&mut decoder, &frames.concat()), Ok(vec![]));
        let fifth = frame(true, OpCode::Continuation, b"");
        let err = decoder.decode(&fifth).unwrap_err();
        assert_eq!(
            (err, err.close_code()),
            (ProtocolError::TooManyFragments { limit: 4 }, 1009)
        );
        // Four frames is the limit, not over it.
        frames.push(frame(true, OpCode::Continuation, b"!"));
        frames.remove(3);
        let ok = decode_all(&mut Decoder::new(LIMITS), &frames.concat());
        assert_eq!(ok, Ok(vec![Message::Binary(b"!".to_vec())]));
    }

    #[test]
    fn needed_sizes_the_rest_of_the_frame() {
        let decoder = Decoder::new(LIMITS);
        let f = frame(true, OpCode::Binary, &[5; 300]);
        assert_eq!(decoder.needed(&f[..3]), None);
        assert_eq!(decoder.needed(&f[..8]), Some(300));
        assert_eq!(decoder.needed(&f[..100]), Some(208));
        assert_eq!(decoder.needed(&f), Some(0));
        let mut longer = f.clone();
        longer.extend_from_slice(b"next frame");
        assert_eq!(decoder.needed(&longer), Some(0));
        let too_big = frame(true, OpCode::Binary, &[5; 1001]);
        assert_eq!(decoder.needed(&too_big), None);
    }

    #[test]
    fn nothing_is_consumed_until_the_frame_is_complete() {
        let f = frame(true, OpCode::Text, b"complete");
        let mut decoder = Decoder::new(LIMITS);
        for end in 0..f.len() {
            assert_eq!(decoder.decode(&f[..end]), Ok(None), "cut at {end}");
        }
        let whole = decoder.decode(&f).unwrap().unwrap();
        assert_eq!(whole, (f.len(), Some(Message::Text("complete".into()))));
    }
}
