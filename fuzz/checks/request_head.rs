// Included by fuzz/fuzz_targets/request_head.rs (libFuzzer) and by tests/fuzz_checks.rs (the seeds and
// their mutations under `cargo test`): one set of checks for both.
use fleetlink::http_upgrade::{parse_request, switching_protocols};

const MAX_HEAD: usize = 8192;

/// The header lines of `head` named `name` (any case), their values trimmed.
fn values<'h>(head: &'h str, name: &'h str) -> impl Iterator<Item = &'h str> + 'h {
    head.lines().skip(1).filter_map(move |line| {
        let (n, v) = line.split_once(':')?;
        n.trim().eq_ignore_ascii_case(name).then(|| v.trim())
    })
}

/// What RFC 6455 section 4.2.1 asks of a head the parser took, read from its text by a
/// reader of its own: GET, a Host, one version and it is 13, one key of 16 bytes in base64
/// (24 characters, the last two `=`).
fn within_the_spec(head: &[u8]) {
    // Header values may carry obs-text (RFC 9110 section 5.5); the lines checked are ASCII.
    let head = String::from_utf8_lossy(head);
    let head = head.as_ref();
    assert!(head.starts_with("GET "), "{head:?}");
    assert!(values(head, "host").next().is_some(), "{head:?}");
    let versions: Vec<_> = values(head, "sec-websocket-version").collect();
    assert_eq!(versions, ["13"], "{head:?}");
    let keys: Vec<_> = values(head, "sec-websocket-key").collect();
    assert_eq!(keys.len(), 1, "{head:?}");
    let key = keys[0].as_bytes();
    assert!(key.len() == 24 && key.ends_with(b"==") && key[..22].iter().all(|b| b.is_ascii_alphanumeric() || *b == b'+' || *b == b'/'), "{head:?}");
}

/// The checks on one input.
pub fn check(data: &[u8]) {
    match parse_request(data, MAX_HEAD, |path| path == "/agent") {
        Ok(Some((len, req))) => {
            assert!(len <= data.len() && len <= MAX_HEAD);
            assert_eq!(req.path, "/agent");
            within_the_spec(&data[..len]);
            let _ = switching_protocols(&req.key);
        }
        Ok(None) => assert!(data.len() < MAX_HEAD),
        Err(reject) => {
            let _ = reject.response();
        }
    }
}
