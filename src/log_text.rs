//! Text that a peer or a publisher chose, cut short for a log line. Such text can be as long
//! as the message that carried it (a 64 MiB pub/sub payload), and a throttled log line is
//! still a line per second of whatever size the sender likes.

use std::borrow::Cow;

/// Characters of peer text a log line quotes before cutting it off with "…".
pub const LOG_CHARS: usize = 64;

/// `s` cut to its first `max` characters, marked "…" when cut.
pub fn clip(s: &str, max: usize) -> Cow<'_, str> {
    match s.char_indices().nth(max) {
        Some((cut, _)) => Cow::Owned(format!("{}…", s.get(..cut).unwrap_or_default())),
        None => Cow::Borrowed(s),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn cuts_at_a_character_not_a_byte() {
        assert_eq!(clip("abc", 3), "abc");
        assert_eq!(clip("abcd", 3), "abc…");
        assert_eq!(clip("ééé", 2), "éé…");
        assert_eq!(clip("", 0), "");
        assert_eq!(
            clip(&"x".repeat(1 << 20), LOG_CHARS).chars().count(),
            LOG_CHARS + 1
        );
    }
}
