//! `protocol::parse_client_msg` on arbitrary bytes: never panics, and nothing it takes nests
//! deeper than serde_json's own bound, which its parser applies only to what it builds, not
//! to the fields the broker keeps as text and passes on to control (`output`, `data`).
#![no_main]

include!("../checks/hello.rs");

libfuzzer_sys::fuzz_target!(|data: &[u8]| check(data));
