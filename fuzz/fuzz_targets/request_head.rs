//! `http_upgrade::parse_request` on arbitrary bytes: never panics, and its answers keep their
//! promises (a head within the limit and within the input; `Ok(None)` only below the limit).
#![no_main]

include!("../checks/request_head.rs");

libfuzzer_sys::fuzz_target!(|data: &[u8]| check(data));
