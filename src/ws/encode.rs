//! Frame encoding: unmasked server→client frames (RFC 6455 §5.1, §5.2) and masked
//! client→server frames for tests and load tools.
//!
//! Encoders append to a caller-owned `Vec` and never fail; they do not police the caller:
//! a control payload over 125 bytes or a fragmented control frame is written as asked (the
//! tests use that to build invalid frames).

use super::{apply_mask, OpCode};

/// Most bytes a close reason may take: a control payload is at most 125 bytes (§5.5), two of
/// which are the status code.
const MAX_CLOSE_REASON: usize = 123;

/// Appends one server→client frame: FIN set, no mask (§5.1: a server MUST NOT mask).
pub fn encode_frame(out: &mut Vec<u8>, opcode: OpCode, payload: &[u8]) {
    write_header(out, true, opcode, None, payload.len());
    out.extend_from_slice(payload);
}

/// Appends a close frame with status `code` and `reason` (§5.5.1), the reason cut at a
/// character boundary so the payload stays within 125 bytes.
///
/// For a close frame without a status code, use `encode_frame(out, OpCode::Close, &[])`.
pub fn encode_close(out: &mut Vec<u8>, code: u16, reason: &str) {
    let mut end = reason.len().min(MAX_CLOSE_REASON);
    while !reason.is_char_boundary(end) {
        end -= 1;
    }
    let reason = reason.get(..end).unwrap_or_default().as_bytes();
    write_header(out, true, OpCode::Close, None, 2 + reason.len());
    out.extend_from_slice(&code.to_be_bytes());
    out.extend_from_slice(reason);
}

/// Appends one client→server frame masked with `key` (§5.3).
pub fn encode_client_frame(
    out: &mut Vec<u8>,
    fin: bool,
    opcode: OpCode,
    key: [u8; 4],
    payload: &[u8],
) {
    write_header(out, fin, opcode, Some(key), payload.len());
    let start = out.len();
    out.extend_from_slice(payload);
    if let Some(written) = out.get_mut(start..) {
        apply_mask(written, key);
    }
}

/// Writes a frame header with the minimal length encoding (§5.2) and reserves room for the
/// payload.
fn write_header(out: &mut Vec<u8>, fin: bool, opcode: OpCode, key: Option<[u8; 4]>, len: usize) {
    let mask_bit = if key.is_some() { 0x80 } else { 0 };
    out.reserve(14 + len);
    out.push(if fin { 0x80 } else { 0 } | opcode as u8);
    match len {
        0..=125 => out.push(mask_bit | len as u8),
        126..=0xFFFF => {
            out.push(mask_bit | 126);
            out.extend_from_slice(&(len as u16).to_be_bytes());
        }
        _ => {
            out.push(mask_bit | 127);
            out.extend_from_slice(&(len as u64).to_be_bytes());
        }
    }
    if let Some(key) = key {
        out.extend_from_slice(&key);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rfc_5_7_unmasked_text_hello() {
        let mut out = Vec::new();
        encode_frame(&mut out, OpCode::Text, b"Hello");
        assert_eq!(out, b"\x81\x05\x48\x65\x6c\x6c\x6f");
    }

    #[test]
    fn rfc_5_7_masked_text_hello() {
        let mut out = Vec::new();
        encode_client_frame(
            &mut out,
            true,
            OpCode::Text,
            [0x37, 0xfa, 0x21, 0x3d],
            b"Hello",
        );
        assert_eq!(out, b"\x81\x85\x37\xfa\x21\x3d\x7f\x9f\x4d\x51\x58");
    }

    #[test]
    fn rfc_5_7_fragmented_unmasked_text() {
        let mut out = Vec::new();
        write_header(&mut out, false, OpCode::Text, None, 3);
        out.extend_from_slice(b"Hel");
        write_header(&mut out, true, OpCode::Continuation, None, 2);
        out.extend_from_slice(b"lo");
        assert_eq!(out, b"\x01\x03\x48\x65\x6c\x80\x02\x6c\x6f");
    }

    #[test]
    fn rfc_5_7_ping_and_pong() {
        let mut out = Vec::new();
        encode_frame(&mut out, OpCode::Ping, b"Hello");
        assert_eq!(out, b"\x89\x05\x48\x65\x6c\x6c\x6f");
        out.clear();
        encode_client_frame(
            &mut out,
            true,
            OpCode::Pong,
            [0x37, 0xfa, 0x21, 0x3d],
            b"Hello",
        );
        assert_eq!(out, b"\x8a\x85\x37\xfa\x21\x3d\x7f\x9f\x4d\x51\x58");
    }

    #[test]
    fn rfc_5_7_binary_256_and_64k() {
        let mut out = Vec::new();
        encode_frame(&mut out, OpCode::Binary, &[0; 256]);
        assert_eq!(out[..4], *b"\x82\x7e\x01\x00");
        assert_eq!(out.len(), 4 + 256);
        out.clear();
        encode_frame(&mut out, OpCode::Binary, &[0; 65_536]);
        assert_eq!(out[..10], *b"\x82\x7f\x00\x00\x00\x00\x00\x01\x00\x00");
        assert_eq!(out.len(), 10 + 65_536);
    }

    #[test]
    fn length_boundaries_use_the_minimal_encoding() {
        let cases: [(usize, &[u8]); 5] = [
            (0, b"\x82\x00"),
            (125, b"\x82\x7d"),
            (126, b"\x82\x7e\x00\x7e"),
            (65_535, b"\x82\x7e\xff\xff"),
            (65_536, b"\x82\x7f\x00\x00\x00\x00\x00\x01\x00\x00"),
        ];
        for (len, header) in cases {
            let mut out = Vec::new();
            encode_frame(&mut out, OpCode::Binary, &vec![7; len]);
            assert_eq!(&out[..header.len()], header, "length {len}");
            assert_eq!(out.len(), header.len() + len);
        }
    }

    #[test]
    fn close_with_code_and_reason() {
        let mut out = Vec::new();
        encode_close(&mut out, 1000, "bye");
        assert_eq!(out, b"\x88\x05\x03\xe8bye");
    }

    #[test]
    fn close_reason_is_cut_at_a_char_boundary_within_125_bytes() {
        let long = "é".repeat(100); // 200 bytes of 2-byte characters
        let mut out = Vec::new();
        encode_close(&mut out, 4503, &long);
        assert_eq!(out[1] as usize, out.len() - 2);
        assert!(out[1] <= 125);
        assert_eq!(out[1], 2 + 122); // 61 whole characters; the 62nd would reach byte 124
        assert!(std::str::from_utf8(&out[4..]).is_ok());
        out.clear();
        encode_close(&mut out, 4503, &"x".repeat(200));
        assert_eq!(out[1], 125);
    }
}
