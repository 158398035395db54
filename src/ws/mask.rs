//! Payload masking (RFC 6455 §5.3).
//!
//! Masking is an involution: the same call masks and unmasks. The decoder calls it once per
//! frame on the payload it copied out; tests and load tools call it to build client frames.

/// XORs `buf` with the 4-byte masking `key` (RFC 6455 §5.3), starting at key offset 0.
///
/// Works eight bytes at a time (the key repeated twice as a `u64`), which the compiler turns
/// into vector code; the tail of fewer than eight bytes is done byte by byte.
pub fn apply_mask(buf: &mut [u8], key: [u8; 4]) {
    let [k0, k1, k2, k3] = key;
    // Eight is a multiple of four, so every word starts at key offset 0 and the word mask is the
    // key twice; byte order does not matter since both sides use the same one.
    let wide = u64::from_ne_bytes([k0, k1, k2, k3, k0, k1, k2, k3]);
    let (words, tail) = buf.as_chunks_mut::<8>();
    for word in words {
        *word = (u64::from_ne_bytes(*word) ^ wide).to_ne_bytes();
    }
    for (byte, k) in tail.iter_mut().zip(key.iter().cycle()) {
        *byte ^= k;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn naive(buf: &mut [u8], key: [u8; 4]) {
        for (i, b) in buf.iter_mut().enumerate() {
            *b ^= key[i % 4];
        }
    }

    fn pattern(len: usize) -> Vec<u8> {
        (0..len)
            .map(|i| (i.wrapping_mul(31) ^ (i >> 8)) as u8)
            .collect()
    }

    #[test]
    fn rfc_5_7_hello_unmasks() {
        let mut masked = *b"\x7f\x9f\x4d\x51\x58";
        apply_mask(&mut masked, [0x37, 0xfa, 0x21, 0x3d]);
        assert_eq!(&masked, b"Hello");
    }

    #[test]
    fn matches_naive_reference_for_lengths_0_to_100() {
        let key = [0x12, 0x34, 0x56, 0x78];
        for len in 0..=100 {
            let mut fast = pattern(len);
            let mut slow = fast.clone();
            apply_mask(&mut fast, key);
            naive(&mut slow, key);
            assert_eq!(fast, slow, "length {len}");
        }
    }

    #[test]
    fn matches_naive_reference_for_large_and_unaligned_buffers() {
        let key = [0xde, 0xad, 0xbe, 0xef];
        for len in [4095, 4096, 65_535, 65_536, 1 << 20] {
            let data = pattern(len + 3);
            for start in 0..3 {
                let mut fast = data.clone();
                let mut slow = data.clone();
                apply_mask(&mut fast[start..start + len], key);
                naive(&mut slow[start..start + len], key);
                assert_eq!(fast, slow, "length {len}, start {start}");
            }
        }
    }

    #[test]
    fn masking_twice_is_identity() {
        let original = pattern(1000);
        let mut buf = original.clone();
        apply_mask(&mut buf, [1, 2, 3, 4]);
        assert_ne!(buf, original);
        apply_mask(&mut buf, [1, 2, 3, 4]);
        assert_eq!(buf, original);
    }
}
