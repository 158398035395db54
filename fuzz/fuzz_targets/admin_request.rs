//! `admin::parse_request` on arbitrary bytes: never panics, and its answers keep their promises
//! (a request lies within the input and the size limit, is found again in its own bytes alone,
//! and "partial" only below the limit).
#![no_main]

use fleetlink::admin::{command_rig, parse_request, Parsed, MAX_REQUEST};
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| match parse_request(data) {
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
});
