//! `registry::control::parse` on arbitrary pub/sub payloads (anyone who can PUBLISH to Redis
//! sends them), on a broker's own channel and on `fleetlink:broadcast`: never panics; a message
//! it takes keeps the contract's rules (ids valid, id and reply_to 1-256 bytes, name 1-128
//! bytes, args a JSON object a rig can parse, hold at most a day, kick/evict never from the
//! broadcast channel, a broadcast only from it); the `command` frame a rig would get is JSON;
//! and the message as the broker itself publishes it (forwarded hold, evict, canary) parses
//! back to the same request.
#![no_main]

include!("../checks/control_msg.rs");

libfuzzer_sys::fuzz_target!(|data: &[u8]| check(data));
