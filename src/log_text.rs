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

/// A Redis URL with its password left out (the user info before `@`, and a `pass=` or
/// `password=` query value of a `unix://` URL), for messages that end up in logs.
pub fn redact_url(url: &str) -> String {
    let shown = match (url.split_once("://"), url.rfind('@')) {
        (Some((scheme, rest)), Some(_)) => match rest.rsplit_once('@') {
            Some((_, host)) => format!("{scheme}://***@{host}"),
            None => url.to_owned(),
        },
        _ => url.to_owned(),
    };
    match shown.split_once('?') {
        Some((base, query)) => {
            let pairs: Vec<String> = query
                .split('&')
                .map(|pair| match pair.split_once('=') {
                    Some((k @ ("pass" | "password"), _)) => format!("{k}=***"),
                    _ => pair.to_owned(),
                })
                .collect();
            format!("{base}?{}", pairs.join("&"))
        }
        None => shown,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn redis_urls_lose_their_passwords() {
        assert_eq!(redact_url("redis://user:pw@h:6379/"), "redis://***@h:6379/");
        assert_eq!(redact_url("redis://:p@ss@h/abc"), "redis://***@h/abc");
        assert_eq!(redact_url("redis://h:6379/"), "redis://h:6379/");
        assert_eq!(
            redact_url("unix:///run/r.sock?db=3&pass=pw&user=u"),
            "unix:///run/r.sock?db=3&pass=***&user=u"
        );
    }

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
