//! Taking the token out of an `Authorization` header value. Apart because it is HTTP header
//! syntax (RFC 6750), not JWT: it runs before any token exists and knows nothing of keys or
//! claims.

/// The token from an `Authorization` header value: `Bearer` (any case) then one or more
/// spaces then a b64token (RFC 6750 §2.1), trailing whitespace ignored. `None` for another
/// scheme, an empty token or characters a token cannot have.
pub fn bearer(header: &str) -> Option<&str> {
    let scheme = header.get(..6)?;
    if !scheme.eq_ignore_ascii_case("bearer") {
        return None;
    }
    let rest = &header[6..];
    let token = rest.trim_start_matches(' ');
    if token.len() == rest.len() {
        return None;
    }
    let token = token.trim_end_matches([' ', '\t']);
    let body = token.trim_end_matches('=');
    let ok = !body.is_empty()
        && body.bytes().all(|b| {
            b.is_ascii_alphanumeric() || matches!(b, b'-' | b'.' | b'_' | b'~' | b'+' | b'/')
        });
    ok.then_some(token)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn bearer_header() {
        assert_eq!(bearer("Bearer abc.def.ghi"), Some("abc.def.ghi"));
        assert_eq!(bearer("bearer   x-y_z~+/=="), Some("x-y_z~+/=="));
        assert_eq!(bearer("BEARER tok \t"), Some("tok"));
        for bad in [
            "",
            "Bearer",
            "Bearer ",
            "Bearerabc",
            "Basic abc",
            "Bearer a b",
            "Bearer é",
            "Beé",
            "Bearer ==",
            "Bearer\tabc",
        ] {
            assert_eq!(bearer(bad), None, "{bad:?}");
        }
    }
}
