// Included by fuzz/fuzz_targets/hello.rs (libFuzzer) and by tests/fuzz_checks.rs (the seeds and
// their mutations under `cargo test`): one set of checks for both.
/// The checks on one input.
pub fn check(data: &[u8]) {
    let taken = fleetlink::protocol::parse_client_msg(data).is_ok();
    // Only text messages reach the parser, checked as UTF-8 by the websocket layer (RFC 6455
    // section 8.1). Other parse errors of a whole `Value` are the broker's choice: a lone
    // surrogate escape or `1e400` is passed on as sent, which Python's json reads.
    if taken && std::str::from_utf8(data).is_ok() {
        if let Err(e) = serde_json::from_slice::<serde_json::Value>(data) {
            assert!(
                !e.to_string().starts_with("recursion limit exceeded"),
                "taken but deeper than serde_json reads: {e}"
            );
        }
    }
}
