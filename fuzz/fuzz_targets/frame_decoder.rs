//! `ws::Decoder` on arbitrary client bytes: never panics, consumes only what it was given, and
//! yields the same messages and error whether the bytes come at once or in small reads.
//! The first byte picks the read size; limits are small so the 1009 paths are reached.
#![no_main]

include!("../checks/frame_decoder.rs");

libfuzzer_sys::fuzz_target!(|data: &[u8]| check(data));
