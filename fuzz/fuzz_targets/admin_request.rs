//! `admin::parse_request` on arbitrary bytes: never panics, and its answers keep their promises
//! (a request lies within the input and the size limit, is found again in its own bytes alone,
//! and "partial" only below the limit).
#![no_main]

include!("../checks/admin_request.rs");

libfuzzer_sys::fuzz_target!(|data: &[u8]| check(data));
