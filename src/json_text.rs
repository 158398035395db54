//! What JSON text from the network opens with, checked before serde reads it: a derived
//! `Deserialize` builds a struct from an array of its fields as readily as from an object,
//! so `["ack",null,…,1]` passed for an ack (review bb130), where every message, body and
//! token the broker takes is one JSON object.

/// Whether `bytes`' first JSON token opens an object.
pub fn opens_an_object(bytes: &[u8]) -> bool {
    bytes.iter().find(|b| !b.is_ascii_whitespace()) == Some(&b'{')
}

#[cfg(test)]
mod tests {
    use super::opens_an_object;

    #[test]
    fn only_an_object_opens_an_object() {
        assert!(opens_an_object(b"{}"));
        assert!(opens_an_object(b" \r\n\t{\"type\":\"ack\"}"));
        for other in [
            &b"[\"ack\",1]"[..],
            b"",
            b"   ",
            b"\"{\"",
            b"null",
            b"1",
            b"x{",
        ] {
            assert!(
                !opens_an_object(other),
                "{:?}",
                String::from_utf8_lossy(other)
            );
        }
    }
}
