//! `protocol::parse_client_msg` on arbitrary bytes: never panics.
#![no_main]

use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let _ = fleetlink::protocol::parse_client_msg(data);
});
