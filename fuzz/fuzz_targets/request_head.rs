//! `http_upgrade::parse_request` on arbitrary bytes: never panics, and its answers keep their
//! promises (a head within the limit and within the input; `Ok(None)` only below the limit).
#![no_main]

use fleetlink::http_upgrade::{parse_request, switching_protocols};
use libfuzzer_sys::fuzz_target;

const MAX_HEAD: usize = 8192;

fuzz_target!(|data: &[u8]| {
    match parse_request(data, MAX_HEAD, |path| path == "/agent") {
        Ok(Some((len, req))) => {
            assert!(len <= data.len() && len <= MAX_HEAD);
            assert_eq!(req.path, "/agent");
            let _ = switching_protocols(&req.key);
        }
        Ok(None) => assert!(data.len() < MAX_HEAD),
        Err(reject) => {
            let _ = reject.response();
        }
    }
});
