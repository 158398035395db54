//! Whole-layer tests: RFC 6455 §5.7 vectors, chunking independence, and property tests of
//! encode→decode round trips and of decoding arbitrary bytes.

use proptest::prelude::*;

use super::*;

const LIMITS: Limits = Limits {
    max_message: 1 << 20,
    max_fragments: 1 << 10,
};

/// Decodes every frame of `input`; returns the messages and the error that ended it, if any.
fn decode_stream(input: &[u8]) -> (Vec<Message>, Option<ProtocolError>) {
    let mut decoder = Decoder::new(LIMITS);
    let mut rest = input;
    let mut out = Vec::new();
    loop {
        match decoder.decode(rest) {
            Ok(Some((used, msg))) => {
                assert!(used > 0 && used <= rest.len());
                out.extend(msg);
                rest = &rest[used..];
            }
            Ok(None) => return (out, None),
            Err(e) => return (out, Some(e)),
        }
    }
}

/// What RFC 6455 bounds in any message a decoder hands out, whatever the input: a control
/// frame's payload is at most 125 bytes (§5.5), and a message no larger than the limit.
/// Chunking alone cannot check this: a decoder that wrongly takes a frame agrees with itself.
fn within_the_spec(msgs: &[Message]) -> Result<(), TestCaseError> {
    for msg in msgs {
        match msg {
            Message::Ping(p) | Message::Pong(p) => prop_assert!(p.len() <= 125),
            Message::Close(Some(c)) => prop_assert!(2 + c.reason.len() <= 125),
            Message::Close(None) => {}
            Message::Text(t) => prop_assert!(t.len() <= LIMITS.max_message),
            Message::Binary(b) => prop_assert!(b.len() <= LIMITS.max_message),
        }
    }
    Ok(())
}

/// Same as `decode_stream`, but the bytes arrive one at a time into a growing buffer, the way
/// a connection with tiny reads would see them.
fn decode_byte_by_byte(input: &[u8]) -> (Vec<Message>, Option<ProtocolError>) {
    let mut decoder = Decoder::new(LIMITS);
    let mut buf = Vec::new();
    let mut out = Vec::new();
    for &byte in input {
        buf.push(byte);
        loop {
            match decoder.decode(&buf) {
                Ok(Some((used, msg))) => {
                    out.extend(msg);
                    buf.drain(..used);
                }
                Ok(None) => break,
                Err(e) => return (out, Some(e)),
            }
        }
    }
    (out, None)
}

#[test]
fn rfc_5_7_single_frame_masked_text() {
    let frame = b"\x81\x85\x37\xfa\x21\x3d\x7f\x9f\x4d\x51\x58";
    let got = Decoder::new(LIMITS).decode(frame);
    assert_eq!(got, Ok(Some((11, Some(Message::Text("Hello".into()))))));
}

#[test]
fn rfc_5_7_fragmented_text_masked() {
    // The RFC's unmasked "Hel" + "lo" example, masked as a client must send it.
    let mut stream = Vec::new();
    encode_client_frame(&mut stream, false, OpCode::Text, [1, 2, 3, 4], b"Hel");
    encode_client_frame(&mut stream, true, OpCode::Continuation, [5, 6, 7, 8], b"lo");
    assert_eq!(stream[0], 0x01);
    assert_eq!(stream[9], 0x80);
    assert_eq!(
        decode_stream(&stream),
        (vec![Message::Text("Hello".into())], None)
    );
}

#[test]
fn rfc_5_7_ping_and_masked_pong() {
    let ping = b"\x89\x85\x37\xfa\x21\x3d\x7f\x9f\x4d\x51\x58";
    let pong = b"\x8a\x85\x37\xfa\x21\x3d\x7f\x9f\x4d\x51\x58";
    let expect = vec![
        Message::Ping(b"Hello".to_vec()),
        Message::Pong(b"Hello".to_vec()),
    ];
    assert_eq!(
        decode_stream(&[&ping[..], &pong[..]].concat()),
        (expect, None)
    );
}

#[test]
fn decodes_every_length_boundary() {
    for len in [0, 125, 126, 65_535, 65_536] {
        let payload: Vec<u8> = (0..len).map(|i| i as u8).collect();
        let mut frame = Vec::new();
        encode_client_frame(&mut frame, true, OpCode::Binary, [9, 8, 7, 6], &payload);
        let header = match len {
            0..=125 => 6,
            126..=65_535 => 8,
            _ => 14,
        };
        assert_eq!(frame.len(), header + len, "length {len}");
        let got = Decoder::new(LIMITS).decode(&frame);
        assert_eq!(
            got,
            Ok(Some((frame.len(), Some(Message::Binary(payload))))),
            "length {len}"
        );
    }
}

#[test]
fn byte_by_byte_matches_whole_buffer() {
    let key = [0x5a, 0xa5, 0x0f, 0xf0];
    let mut stream = Vec::new();
    encode_client_frame(&mut stream, true, OpCode::Text, key, "κόσμε".as_bytes());
    encode_client_frame(&mut stream, false, OpCode::Binary, key, &[1; 200]);
    encode_client_frame(&mut stream, true, OpCode::Ping, key, b"are you there");
    encode_client_frame(&mut stream, true, OpCode::Continuation, key, &[2; 70_000]);
    encode_client_frame(&mut stream, false, OpCode::Text, key, b"\xf0\x9f");
    encode_client_frame(&mut stream, true, OpCode::Continuation, key, b"\x98\x80");
    encode_client_frame(&mut stream, true, OpCode::Close, key, b"\x03\xe8done");
    let whole = decode_stream(&stream);
    assert_eq!(whole.0.len(), 5);
    assert_eq!(whole.1, None);
    assert_eq!(decode_byte_by_byte(&stream), whole);
    // And with a violation at the end, the same error either way.
    encode_client_frame(&mut stream, true, OpCode::Continuation, key, b"stray");
    let whole = decode_stream(&stream);
    assert_eq!(whole.1, Some(ProtocolError::UnexpectedContinuation));
    assert_eq!(decode_byte_by_byte(&stream), whole);
}

fn frame(fin: bool, opcode: OpCode, payload: &[u8]) -> Vec<u8> {
    let mut out = Vec::new();
    encode_client_frame(&mut out, fin, opcode, [0xa1, 0xb2, 0xc3, 0xd4], payload);
    out
}

/// Decodes every frame of `input`; the first error ends the stream.
fn decode_all(decoder: &mut Decoder, input: &[u8]) -> Result<Vec<Message>, ProtocolError> {
    let mut rest = input;
    let mut out = Vec::new();
    while let Some((used, msg)) = decoder.decode(rest)? {
        out.extend(msg);
        rest = &rest[used..];
    }
    Ok(out)
}

fn error_of(frames: &[Vec<u8>]) -> ProtocolError {
    decode_all(&mut Decoder::new(LIMITS), &frames.concat()).unwrap_err()
}

// Text: UTF-8 validity (§5.6, §8.1), fail fast per fragment and within a frame.

#[test]
fn invalid_utf8_closes_with_1007() {
    let err = error_of(&[frame(true, OpCode::Text, b"ok \xff")]);
    assert_eq!((err, err.close_code()), (ProtocolError::InvalidUtf8, 1007));
    // Binary messages are not text: the same bytes are fine.
    let ok = decode_all(
        &mut Decoder::new(LIMITS),
        &frame(true, OpCode::Binary, b"ok \xff"),
    );
    assert_eq!(ok, Ok(vec![Message::Binary(b"ok \xff".to_vec())]));
}

#[test]
fn invalid_utf8_fails_fast_in_a_non_final_fragment() {
    let mut decoder = Decoder::new(LIMITS);
    assert_eq!(
        decoder
            .decode(&frame(false, OpCode::Text, b"fine"))
            .unwrap()
            .unwrap()
            .1,
        None
    );
    let bad = frame(false, OpCode::Continuation, b"\xce\xba\xed\xa0\x80");
    assert_eq!(decoder.decode(&bad), Err(ProtocolError::InvalidUtf8));
}

#[test]
fn invalid_utf8_fails_fast_inside_an_incomplete_frame() {
    // Autobahn 6.4.3: one text frame arriving in chops; the second chop makes it invalid.
    let part1: &[u8] = b"\xce\xba\xe1\xbd\xb9\xcf\x83\xce\xbc\xce\xb5";
    let part2: &[u8] = b"\xf4\x90\x80\x80";
    let f = frame(true, OpCode::Text, &[part1, part2, b"edited"].concat());
    let mut decoder = Decoder::new(LIMITS);
    assert_eq!(decoder.decode(&f[..6 + part1.len()]), Ok(None));
    assert_eq!(
        decoder.decode(&f[..6 + part1.len() + 2]),
        Err(ProtocolError::InvalidUtf8)
    );
    // The same inside a continuation frame, with a code point carried into it.
    let mut decoder = Decoder::new(LIMITS);
    decoder
        .decode(&frame(false, OpCode::Text, b"ok\xe2"))
        .unwrap();
    let f = frame(
        true,
        OpCode::Continuation,
        b"\x82\xac and then \xff and more",
    );
    assert_eq!(decoder.decode(&f[..8]), Ok(None));
    assert_eq!(decoder.decode(&f[..20]), Err(ProtocolError::InvalidUtf8));
}

#[test]
fn early_scan_never_refuses_valid_text_in_any_chops() {
    let text = "κόσμε €😀 ".repeat(40);
    let f = frame(true, OpCode::Text, text.as_bytes());
    for step in [1, 2, 3, 5, 7, 255, 256, 257, 300] {
        let mut decoder = Decoder::new(LIMITS);
        let mut end = 0;
        let got = loop {
            end = (end + step).min(f.len());
            match decoder.decode(&f[..end]).unwrap() {
                None => assert!(end < f.len()),
                Some((used, msg)) => break (used, msg),
            }
        };
        assert_eq!(
            got,
            (f.len(), Some(Message::Text(text.clone()))),
            "step {step}"
        );
    }
}

#[test]
fn invalid_byte_in_the_final_fragment_closes_with_1007() {
    let frames = [
        frame(false, OpCode::Text, b"ok"),
        frame(true, OpCode::Continuation, b"\xff"),
    ];
    assert_eq!(error_of(&frames), ProtocolError::InvalidUtf8);
}

#[test]
fn incomplete_code_point_at_the_final_fragment_closes_with_1007() {
    let frames = [
        frame(false, OpCode::Text, b"ab\xe2"),
        frame(true, OpCode::Continuation, b"\x82"),
    ];
    assert_eq!(error_of(&frames), ProtocolError::InvalidUtf8);
}

#[test]
fn code_point_split_across_fragments_at_every_position() {
    let text = "€😀é".as_bytes();
    for i in 0..=text.len() {
        for j in i..=text.len() {
            let frames = [
                frame(false, OpCode::Text, &text[..i]),
                frame(false, OpCode::Continuation, &text[i..j]),
                frame(true, OpCode::Continuation, &text[j..]),
            ];
            let got = decode_all(&mut Decoder::new(LIMITS), &frames.concat());
            assert_eq!(
                got,
                Ok(vec![Message::Text("€😀é".into())]),
                "split at {i}, {j}"
            );
        }
    }
}

/// One message as a client might send it: its opcode, payload and where it is cut into frames.
fn message_strategy() -> impl Strategy<Value = (bool, Vec<u8>, Vec<usize>)> {
    let text = any::<String>().prop_map(|s| (true, s.into_bytes()));
    let binary = proptest::collection::vec(any::<u8>(), 0..300).prop_map(|b| (false, b));
    let cuts = proptest::collection::vec(0usize..300, 0..5);
    (prop_oneof![text, binary], cuts).prop_map(|((is_text, payload), mut cuts)| {
        cuts.iter_mut().for_each(|c| *c = (*c).min(payload.len()));
        cuts.sort_unstable();
        (is_text, payload, cuts)
    })
}

proptest! {
    #[test]
    fn fragmented_messages_round_trip(
        messages in proptest::collection::vec(message_strategy(), 1..6),
        key in any::<[u8; 4]>(),
        ping in proptest::collection::vec(any::<u8>(), 0..=125),
    ) {
        let mut stream = Vec::new();
        let mut expect = Vec::new();
        for (is_text, payload, cuts) in &messages {
            let bounds: Vec<usize> = [0].into_iter().chain(cuts.iter().copied()).chain([payload.len()]).collect();
            let pieces: Vec<&[u8]> = bounds.windows(2).map(|w| &payload[w[0]..w[1]]).collect();
            for (i, piece) in pieces.iter().enumerate() {
                let opcode = match (i, is_text) {
                    (0, true) => OpCode::Text,
                    (0, false) => OpCode::Binary,
                    _ => OpCode::Continuation,
                };
                encode_client_frame(&mut stream, i + 1 == pieces.len(), opcode, key, piece);
                if i == 0 {
                    // A control frame inside every message that has more than one frame.
                    if pieces.len() > 1 {
                        encode_client_frame(&mut stream, true, OpCode::Ping, key, &ping);
                        expect.push(Message::Ping(ping.clone()));
                    }
                }
            }
            let msg = if *is_text {
                Message::Text(String::from_utf8(payload.clone()).unwrap())
            } else {
                Message::Binary(payload.clone())
            };
            expect.push(msg);
        }
        let (got, err) = decode_stream(&stream);
        prop_assert_eq!(err, None);
        prop_assert_eq!(got, expect);
    }

    #[test]
    fn arbitrary_bytes_never_panic_and_chunking_does_not_matter(bytes in proptest::collection::vec(any::<u8>(), 0..512)) {
        let whole = decode_stream(&bytes);
        within_the_spec(&whole.0)?;
        // No message comes out of a stream whose first frame is unmasked (§5.1).
        if bytes.get(1).is_some_and(|b| b & 0x80 == 0) {
            prop_assert!(whole.0.is_empty());
        }
        prop_assert_eq!(decode_byte_by_byte(&bytes), whole);
    }

    #[test]
    fn arbitrary_masked_frames_never_panic(
        frames in proptest::collection::vec((any::<bool>(), 0u8..16, any::<u8>(), proptest::collection::vec(any::<u8>(), 0..200), proptest::bool::weighted(0.05)), 0..8),
    ) {
        // Valid-looking headers with random opcodes and RSV bits get past the first checks far
        // more often than random bytes do. One in twenty is sent unmasked.
        let mut stream = Vec::new();
        let mut unmasked_at = None;
        for (i, (fin, op, rsv, payload, unmasked)) in frames.iter().enumerate() {
            let start = stream.len();
            encode_client_frame(&mut stream, *fin, OpCode::Binary, [3, 1, 4, 1], payload);
            stream[start] = (stream[start] & 0x80) | (rsv & 0x70) | op;
            if *unmasked {
                stream[start + 1] &= 0x7f;
                unmasked_at.get_or_insert(i);
            }
        }
        let whole = decode_stream(&stream);
        within_the_spec(&whole.0)?;
        // Nothing from the unmasked frame on: the stream ends in an error at it or before.
        if let Some(i) = unmasked_at {
            prop_assert!(whole.0.len() <= i);
            prop_assert!(whole.1.is_some());
        }
        prop_assert_eq!(decode_byte_by_byte(&stream), whole);
    }
}
