//! `ws::Decoder` on arbitrary client bytes: never panics, consumes only what it was given, and
//! yields the same messages and error whether the bytes come at once or in small reads.
//! The first byte picks the read size; limits are small so the 1009 paths are reached.
#![no_main]

use fleetlink::ws::{Decoder, Limits, Message, ProtocolError};
use libfuzzer_sys::fuzz_target;

const LIMITS: Limits = Limits {
    max_message: 4096,
    max_fragments: 8,
};

fn decode_in_reads(input: &[u8], read: usize) -> (Vec<Message>, Option<ProtocolError>) {
    let mut decoder = Decoder::new(LIMITS);
    let mut buf = Vec::new();
    let mut out = Vec::new();
    for chunk in input.chunks(read) {
        buf.extend_from_slice(chunk);
        loop {
            let needed = decoder.needed(&buf);
            match decoder.decode(&buf) {
                Ok(Some((used, msg))) => {
                    assert!(used > 0 && used <= buf.len());
                    assert_eq!(needed, Some(0));
                    if let Some(Message::Text(_) | Message::Binary(_)) = msg {
                        assert!(decoder.is_idle());
                    }
                    out.extend(msg);
                    buf.drain(..used);
                }
                Ok(None) => {
                    assert_ne!(needed, Some(0));
                    break;
                }
                Err(e) => return (out, Some(e)),
            }
        }
    }
    (out, None)
}

fuzz_target!(|data: &[u8]| {
    let Some((&first, frames)) = data.split_first() else {
        return;
    };
    let read = usize::from(first % 16) + 1;
    let whole = decode_in_reads(frames, frames.len().max(1));
    assert_eq!(decode_in_reads(frames, read), whole);
});
