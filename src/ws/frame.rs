//! Frame header parsing (RFC 6455 §5.2), opcodes, and close-code validity (§7.4).
//!
//! `parse_header` checks everything a header can violate on its own, in wire order, as soon as
//! the bytes that carry each field are present; checks that need the decoder's state (is a
//! message in progress, how big is it so far) are the decoder's.

use super::{CloseFrame, ProtocolError};

/// A frame opcode (RFC 6455 §5.2, §11.8). The reserved values have no variant.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[repr(u8)]
pub enum OpCode {
    /// 0x0: continues a fragmented message (§5.4).
    Continuation = 0x0,
    /// 0x1: first frame of a UTF-8 text message.
    Text = 0x1,
    /// 0x2: first frame of a binary message.
    Binary = 0x2,
    /// 0x8: connection close (§5.5.1).
    Close = 0x8,
    /// 0x9: ping (§5.5.2).
    Ping = 0x9,
    /// 0xA: pong (§5.5.3).
    Pong = 0xA,
}

impl OpCode {
    /// The opcode with wire value `bits`, or `None` for a reserved or out-of-range value.
    pub fn from_u8(bits: u8) -> Option<OpCode> {
        match bits {
            0x0 => Some(OpCode::Continuation),
            0x1 => Some(OpCode::Text),
            0x2 => Some(OpCode::Binary),
            0x8 => Some(OpCode::Close),
            0x9 => Some(OpCode::Ping),
            0xA => Some(OpCode::Pong),
            _ => None,
        }
    }

    /// Control frames are the opcodes with the high bit set (§5.5).
    pub fn is_control(self) -> bool {
        self as u8 & 0x8 != 0
    }
}

/// Whether a peer may send `code` in a close frame (§7.4.1, §7.4.2 and the IANA registry).
///
/// Accepted: 1000-1003, 1007-1011, the IANA-registered 1012-1014 (service restart, try again
/// later, bad gateway; the broker itself sends 1012 on kick, so rigs echo it), and 3000-4999
/// (registered and private use). Refused: 0-999 (unused), 1004 (reserved), 1005, 1006 and 1015
/// (MUST NOT be set in a close frame), 1016-2999 (reserved for the RFC and extensions), 5000+.
/// This matches Autobahn cases 7.7.x, 7.9.x and 7.13.x.
pub fn is_valid_close_code(code: u16) -> bool {
    matches!(code, 1000..=1003 | 1007..=1014 | 3000..=4999)
}

/// FIN bit (§5.2).
const FIN: u8 = 0x80;
/// RSV1, RSV2, RSV3 (§5.2).
const RSV: u8 = 0x70;
/// Opcode bits of the first byte.
const OPCODE: u8 = 0x0F;
/// MASK bit of the second byte.
const MASK: u8 = 0x80;
/// 7-bit payload length of the second byte.
const LEN7: u8 = 0x7F;

/// A parsed client frame header.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct FrameHeader {
    /// Last frame of its message (§5.2).
    pub(crate) fin: bool,
    pub(crate) opcode: OpCode,
    /// Masking key; every client frame has one (§5.3).
    pub(crate) mask: [u8; 4],
    /// Payload length as sent: unchecked against any limit yet.
    pub(crate) payload_len: u64,
    /// Header bytes before the payload (6, 8 or 14 for a masked frame).
    pub(crate) len: usize,
}

/// Parses the header of a client→server frame at the front of `input`; `Ok(None)` when more
/// bytes are needed.
pub(crate) fn parse_header(input: &[u8]) -> Result<Option<FrameHeader>, ProtocolError> {
    let Some(&[b0, b1]) = input.first_chunk::<2>() else {
        return Ok(None);
    };
    // §5.2: RSV1-3 MUST be 0 unless an extension defining them was negotiated; we negotiate none.
    if b0 & RSV != 0 {
        return Err(ProtocolError::ReservedBits);
    }
    // §5.2: an unknown opcode MUST fail the connection.
    let opcode = OpCode::from_u8(b0 & OPCODE).ok_or(ProtocolError::ReservedOpCode(b0 & OPCODE))?;
    // §5.1: a server MUST close the connection on a frame that is not masked.
    if b1 & MASK == 0 {
        return Err(ProtocolError::UnmaskedFrame);
    }
    let fin = b0 & FIN != 0;
    let len7 = b1 & LEN7;
    // §5.5: control frames have payloads of at most 125 bytes and MUST NOT be fragmented.
    if opcode.is_control() {
        if !fin {
            return Err(ProtocolError::FragmentedControl);
        }
        if len7 > 125 {
            return Err(ProtocolError::ControlTooLong);
        }
    }
    let rest = input.get(2..).unwrap_or_default();
    let (payload_len, len_bytes) = match len7 {
        126 => {
            let Some(&bytes) = rest.first_chunk::<2>() else {
                return Ok(None);
            };
            (u64::from(u16::from_be_bytes(bytes)), 2)
        }
        127 => {
            let Some(&bytes) = rest.first_chunk::<8>() else {
                return Ok(None);
            };
            let n = u64::from_be_bytes(bytes);
            // §5.2: the most significant bit of a 64-bit length MUST be 0.
            if n >> 63 != 0 {
                return Err(ProtocolError::LengthMsbSet);
            }
            (n, 8)
        }
        n => (u64::from(n), 0),
    };
    // §5.2: "the minimal number of bytes MUST be used to encode the length".
    let minimal = match len_bytes {
        2 => payload_len >= 126,
        8 => payload_len > 0xFFFF,
        _ => true,
    };
    if !minimal {
        return Err(ProtocolError::NonMinimalLength);
    }
    let Some(&mask) = rest.get(len_bytes..).and_then(<[u8]>::first_chunk::<4>) else {
        return Ok(None);
    };
    Ok(Some(FrameHeader {
        fin,
        opcode,
        mask,
        payload_len,
        len: 2 + len_bytes + 4,
    }))
}

/// The body of a close frame (§5.5.1): empty, or a 2-byte status code and a UTF-8 reason.
pub(crate) fn close_frame(payload: Vec<u8>) -> Result<Option<CloseFrame>, ProtocolError> {
    let (code, reason) = match payload.split_first_chunk::<2>() {
        Some((&code, reason)) => (u16::from_be_bytes(code), reason),
        None if payload.is_empty() => return Ok(None),
        None => return Err(ProtocolError::CloseTooShort),
    };
    if !is_valid_close_code(code) {
        return Err(ProtocolError::InvalidCloseCode(code));
    }
    let reason = std::str::from_utf8(reason).map_err(|_| ProtocolError::InvalidCloseReason)?;
    Ok(Some(CloseFrame {
        code,
        reason: reason.to_owned(),
    }))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn opcodes_have_their_rfc_values() {
        let all = [
            (OpCode::Continuation, 0x0),
            (OpCode::Text, 0x1),
            (OpCode::Binary, 0x2),
            (OpCode::Close, 0x8),
            (OpCode::Ping, 0x9),
            (OpCode::Pong, 0xA),
        ];
        for (op, bits) in all {
            assert_eq!(op as u8, bits);
            assert_eq!(OpCode::from_u8(bits), Some(op));
            assert_eq!(op.is_control(), bits >= 0x8);
        }
        for bits in (0x3..=0x7).chain(0xB..=0xF).chain([0x10, 0xFF]) {
            assert_eq!(OpCode::from_u8(bits), None);
        }
    }

    #[test]
    fn close_codes_follow_section_7_4_and_autobahn() {
        let valid = [
            1000, 1001, 1002, 1003, 1007, 1008, 1009, 1010, 1011, 1012, 1013, 1014,
        ];
        let valid_app = [3000, 3999, 4000, 4999];
        for code in valid.into_iter().chain(valid_app) {
            assert!(is_valid_close_code(code), "{code}");
        }
        let invalid = [
            0, 999, 1004, 1005, 1006, 1015, 1016, 1100, 2000, 2999, 5000, 65535,
        ];
        for code in invalid {
            assert!(!is_valid_close_code(code), "{code}");
        }
    }

    #[test]
    fn header_of_rfc_masked_hello() {
        let frame = b"\x81\x85\x37\xfa\x21\x3d\x7f\x9f\x4d\x51\x58";
        let h = parse_header(frame).unwrap().unwrap();
        let expect = FrameHeader {
            fin: true,
            opcode: OpCode::Text,
            mask: [0x37, 0xfa, 0x21, 0x3d],
            payload_len: 5,
            len: 6,
        };
        assert_eq!(h, expect);
    }

    #[test]
    fn every_proper_prefix_of_a_header_needs_more() {
        let headers: [&[u8]; 3] = [
            b"\x82\x85\x01\x02\x03\x04",
            b"\x82\xfe\x00\x7e\x01\x02\x03\x04",
            b"\x82\xff\x00\x00\x00\x00\x00\x01\x00\x00\x01\x02\x03\x04",
        ];
        for header in headers {
            for end in 0..header.len() {
                assert_eq!(
                    parse_header(&header[..end]),
                    Ok(None),
                    "{header:x?} cut at {end}"
                );
            }
            assert_eq!(parse_header(header).unwrap().unwrap().len, header.len());
        }
    }

    #[test]
    fn length_encodings_at_the_boundaries() {
        let cases: [(&[u8], u64); 5] = [
            (b"\x82\x80", 0),
            (b"\x82\xfd", 125),
            (b"\x82\xfe\x00\x7e", 126),
            (b"\x82\xfe\xff\xff", 65_535),
            (b"\x82\xff\x00\x00\x00\x00\x00\x01\x00\x00", 65_536),
        ];
        for (prefix, len) in cases {
            let frame = [prefix, &[9, 9, 9, 9]].concat();
            assert_eq!(parse_header(&frame).unwrap().unwrap().payload_len, len);
        }
    }

    #[test]
    fn header_violations() {
        let cases: [(&[u8], ProtocolError); 12] = [
            (b"\xc1\x80", ProtocolError::ReservedBits),
            (b"\xa1\x80", ProtocolError::ReservedBits),
            (b"\x91\x80", ProtocolError::ReservedBits),
            (b"\x83\x80", ProtocolError::ReservedOpCode(0x3)),
            (b"\x8f\x80", ProtocolError::ReservedOpCode(0xF)),
            (b"\x81\x05", ProtocolError::UnmaskedFrame),
            (b"\x09\x80", ProtocolError::FragmentedControl),
            (b"\x89\xfe", ProtocolError::ControlTooLong),
            (b"\x8a\xfe", ProtocolError::ControlTooLong),
            (b"\x88\xfe", ProtocolError::ControlTooLong),
            (b"\x82\xfe\x00\x7d", ProtocolError::NonMinimalLength),
            (
                b"\x82\xff\x80\x00\x00\x00\x00\x00\x00\x00",
                ProtocolError::LengthMsbSet,
            ),
        ];
        for (bytes, err) in cases {
            assert_eq!(parse_header(bytes), Err(err), "{bytes:x?}");
        }
        let non_minimal_64 = b"\x82\xff\x00\x00\x00\x00\x00\x00\xff\xff";
        assert_eq!(
            parse_header(non_minimal_64),
            Err(ProtocolError::NonMinimalLength)
        );
    }

    #[test]
    fn close_frame_bodies() {
        let close = |payload: &[u8]| close_frame(payload.to_vec());
        assert_eq!(close(b""), Ok(None));
        let reason = [&b"\x03\xe8"[..], "bye ✓".as_bytes()].concat();
        let normal = CloseFrame {
            code: 1000,
            reason: "bye ✓".into(),
        };
        assert_eq!(close(&reason), Ok(Some(normal)));
        for code in [1001u16, 1012, 1014, 3000, 4999] {
            let frame = CloseFrame {
                code,
                reason: String::new(),
            };
            assert_eq!(close(&code.to_be_bytes()), Ok(Some(frame)));
        }
        for code in [0u16, 999, 1004, 1005, 1006, 1015, 1016, 2999, 5000, 65535] {
            let err = close(&code.to_be_bytes()).unwrap_err();
            assert_eq!(
                (err, err.close_code()),
                (ProtocolError::InvalidCloseCode(code), 1002)
            );
        }
        let short = close(b"\x03").unwrap_err();
        assert_eq!(
            (short, short.close_code()),
            (ProtocolError::CloseTooShort, 1002)
        );
        let bad_reason = close(b"\x03\xe8\xce\xba\xed\xa0\x80").unwrap_err();
        assert_eq!(
            (bad_reason, bad_reason.close_code()),
            (ProtocolError::InvalidCloseReason, 1007)
        );
    }
}
