//! UUIDv7 (RFC 9562) in canonical lowercase text, the form the contract requires for `boot_id`.
//! Hand-rolled (a dozen lines) so the load generator does not pull in another crate.

use std::time::{SystemTime, UNIX_EPOCH};

/// A fresh UUIDv7 for the current time with random bits from `fastrand`.
pub fn new_v7() -> String {
    let ms = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_millis() as u64)
        .unwrap_or(0);
    format_v7(ms, fastrand::u16(..), fastrand::u64(..))
}

/// Formats a UUIDv7 from a unix-millisecond timestamp (low 48 bits), 12 bits of `rand_a` and 62
/// bits of `rand_b`; the version and variant bits are set here.
pub fn format_v7(unix_ms: u64, rand_a: u16, rand_b: u64) -> String {
    let ts = unix_ms & 0xFFFF_FFFF_FFFF;
    let ver_rand_a = 0x7000 | (rand_a & 0x0FFF);
    let var_rand_b = (rand_b & 0x3FFF_FFFF_FFFF_FFFF) | 0x8000_0000_0000_0000;
    format!(
        "{:08x}-{:04x}-{:04x}-{:04x}-{:012x}",
        ts >> 16,
        ts & 0xFFFF,
        ver_rand_a,
        var_rand_b >> 48,
        var_rand_b & 0xFFFF_FFFF_FFFF
    )
}

/// True for canonical lowercase UUIDv7 text (36 chars, version 7, RFC variant).
pub fn is_canonical_v7(s: &str) -> bool {
    let b = s.as_bytes();
    b.len() == 36
        && b.iter().enumerate().all(|(i, &c)| match i {
            8 | 13 | 18 | 23 => c == b'-',
            _ => c.is_ascii_digit() || (b'a'..=b'f').contains(&c),
        })
        && b[14] == b'7'
        && matches!(b[19], b'8' | b'9' | b'a' | b'b')
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn known_vector() {
        // RFC 9562 appendix A.6 example: 017F22E2-79B0-7CC3-98C4-DC0C0C07398F
        let u = format_v7(0x017F_22E2_79B0, 0xCC3, 0x18C4_DC0C_0C07_398F);
        assert_eq!(u, "017f22e2-79b0-7cc3-98c4-dc0c0c07398f");
        assert!(is_canonical_v7(&u));
    }

    #[test]
    fn fresh_ids_are_canonical_and_time_ordered() {
        let a = new_v7();
        std::thread::sleep(std::time::Duration::from_millis(2));
        let b = new_v7();
        assert!(is_canonical_v7(&a), "{a}");
        assert!(is_canonical_v7(&b), "{b}");
        assert!(a < b, "text order follows time: {a} {b}");
        assert_ne!(new_v7(), new_v7());
    }

    #[test]
    fn rejects_non_canonical() {
        assert!(!is_canonical_v7("017F22E2-79B0-7CC3-98C4-DC0C0C07398F"));
        assert!(!is_canonical_v7("017f22e2-79b0-4cc3-98c4-dc0c0c07398f"));
        assert!(!is_canonical_v7("017f22e279b07cc398c4dc0c0c07398f"));
    }
}
