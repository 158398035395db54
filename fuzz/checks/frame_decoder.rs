// Included by fuzz/fuzz_targets/frame_decoder.rs (libFuzzer) and by tests/fuzz_checks.rs (the seeds and
// their mutations under `cargo test`): one set of checks for both.
use fleetlink::ws::{Decoder, Limits, Message, ProtocolError};

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

/// What RFC 6455 bounds in any message handed out: a control frame's payload is at most 125
/// bytes (section 5.5), a message within the limit. A decoder that wrongly takes a frame
/// agrees with itself across reads; these do not depend on it.
fn within_the_spec(msgs: &[Message]) {
    for msg in msgs {
        match msg {
            Message::Ping(p) | Message::Pong(p) => assert!(p.len() <= 125),
            Message::Close(Some(c)) => assert!(2 + c.reason.len() <= 125),
            Message::Close(None) => {}
            Message::Text(t) => assert!(t.len() <= LIMITS.max_message),
            Message::Binary(b) => assert!(b.len() <= LIMITS.max_message),
        }
    }
}

/// The checks on one input.
pub fn check(data: &[u8]) {
    let Some((&first, frames)) = data.split_first() else {
        return;
    };
    let read = usize::from(first % 16) + 1;
    let whole = decode_in_reads(frames, frames.len().max(1));
    within_the_spec(&whole.0);
    // Nothing comes out of a stream whose first frame is unmasked (section 5.1).
    if frames.get(1).is_some_and(|b| b & 0x80 == 0) {
        assert!(whole.0.is_empty());
    }
    assert_eq!(decode_in_reads(frames, read), whole);
}
