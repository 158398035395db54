// Included by fuzz/fuzz_targets/admin_request.rs (libFuzzer) and by tests/fuzz_checks.rs (the seeds and
// their mutations under `cargo test`): one set of checks for both.
use fleetlink::admin::{command_rig, parse_request, Parsed, MAX_REQUEST};

/// The checks on one input.
pub fn check(data: &[u8]) {
    match parse_request(data) {
    Parsed::Complete(req, len) => {
        assert!(len <= data.len() && len <= MAX_REQUEST);
        assert!(req.body.len() <= len);
        let _ = command_rig(&req);
        match parse_request(&data[..len]) {
            Parsed::Complete(again, n) => {
                assert_eq!(n, len);
                assert_eq!(
                    (again.method, again.path, again.body),
                    (req.method, req.path, req.body)
                );
            }
            _ => panic!("a request is not whole in its own bytes"),
        }
    }
    Parsed::Partial { .. } => assert!(data.len() < MAX_REQUEST),
    Parsed::Bad(_) => {}
}
}
