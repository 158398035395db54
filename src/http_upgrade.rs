//! The HTTP/1.1 websocket opening handshake, server side (RFC 6455 §4.2), sans-IO.
//!
//! `worker/conn.rs` accumulates the first bytes of a connection and calls [`parse_request`]
//! until it answers; it then writes [`switching_protocols`] or the [`Reject`]'s response and
//! does all the IO. Bytes after the head (a client may send its first frames right away) stay
//! in the caller's buffer for the frame decoder. Invariants: a head is never longer than
//! `max_head` bytes (which bounds its header lines too), and nothing from the request is echoed
//! into a response except the accept key derived from `Sec-WebSocket-Key`.

use base64::engine::general_purpose::STANDARD as BASE64;
use base64::Engine as _;

/// Header lines parsed into an array on the stack; a head with more (still within `max_head`)
/// is parsed again into one on the heap, sized by its lines, so only its size can make a 431.
pub const MAX_HEADERS: usize = 64;

/// RFC 6455 §1.3: appended to the client's key before hashing.
const WEBSOCKET_GUID: &str = "258EAFA5-E914-47DA-95CA-C5AB0DC85B11";

/// A valid websocket upgrade request, as the connection loop needs it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct UpgradeRequest {
    /// The request path with any query string stripped, e.g. `/agent`.
    pub path: String,
    /// `Sec-WebSocket-Key`, checked to be base64 of 16 bytes; input to [`switching_protocols`].
    pub key: String,
    /// The `Authorization` header, if any, for the caller to check.
    pub authorization: Option<String>,
    /// The client offered `permessage-deflate`; we decline it by not answering it (RFC 7692
    /// §5.1), so this is only for metrics and logs.
    pub offered_deflate: bool,
}

/// Why an upgrade request is refused; each maps to an HTTP status and a ready response.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
pub enum Reject {
    /// 400: the head is not HTTP, or `Sec-WebSocket-Key` or `Host` is missing or invalid.
    #[error("400 bad request")]
    BadRequest,
    /// 404: no websocket endpoint at this path.
    #[error("404 not found")]
    NotFound,
    /// 405: a method other than GET (RFC 6455 §4.1).
    #[error("405 method not allowed")]
    MethodNotAllowed,
    /// 426: not a websocket upgrade (plain GET, HTTP/1.0) or a version other than 13
    /// (RFC 6455 §4.2.2).
    #[error("426 upgrade required")]
    UpgradeRequired,
    /// 431: a head over the size limit.
    #[error("431 request header fields too large")]
    HeaderTooLarge,
}

impl Reject {
    /// The HTTP status code.
    pub fn status(&self) -> u16 {
        match self {
            Reject::BadRequest => 400,
            Reject::NotFound => 404,
            Reject::MethodNotAllowed => 405,
            Reject::UpgradeRequired => 426,
            Reject::HeaderTooLarge => 431,
        }
    }

    /// The full HTTP/1.1 response; the caller closes the connection after writing it.
    pub fn response(&self) -> Vec<u8> {
        let (reason, extra) = match self {
            Reject::BadRequest => ("Bad Request", ""),
            Reject::NotFound => ("Not Found", ""),
            // RFC 9110 §15.5.6: a 405 MUST carry Allow.
            Reject::MethodNotAllowed => ("Method Not Allowed", "Allow: GET\r\n"),
            // RFC 9110 §15.5.22 (426 names the protocol) and RFC 6455 §4.4 (the versions we
            // speak).
            Reject::UpgradeRequired => (
                "Upgrade Required",
                "Upgrade: websocket\r\nSec-WebSocket-Version: 13\r\n",
            ),
            Reject::HeaderTooLarge => ("Request Header Fields Too Large", ""),
        };
        let status = self.status();
        format!(
            "HTTP/1.1 {status} {reason}\r\n{extra}Connection: close\r\nContent-Length: 0\r\n\r\n"
        )
        .into_bytes()
    }
}

/// Parses a request head from the front of `buf`.
///
/// `Ok(None)`: incomplete, and `buf` is shorter than `max_head`, so reading up to `max_head`
/// bytes is always enough for an answer. `Ok(Some((head_len, req)))`: a valid upgrade whose
/// head is the first `head_len` bytes. Checks, in order: a head longer than `max_head` or with
/// too many headers → 431; malformed → 400; path (query stripped) not `known_path` → 404;
/// method not GET → 405; no `Upgrade: websocket` or no `upgrade` token in `Connection`, or
/// HTTP/1.0 → 426; `Sec-WebSocket-Version` not 13 → 426; `Sec-WebSocket-Key` missing, repeated
/// or not base64 of 16 bytes, `Host` missing, `Authorization` not UTF-8 → 400.
pub fn parse_request(
    buf: &[u8],
    max_head: usize,
    known_path: impl Fn(&str) -> bool,
) -> Result<Option<(usize, UpgradeRequest)>, Reject> {
    let mut headers = [httparse::EMPTY_HEADER; MAX_HEADERS];
    if let Some(answer) = parse_into(buf, max_head, &known_path, &mut headers) {
        return answer;
    }
    // More lines than the stack array: CONTRACT.md section 2 refuses a head for its size
    // alone. A line takes at least 3 bytes ("a:\n": httparse takes a bare LF as a line's
    // end), so `max_head` bounds the array. One more for a line not yet ended (a partial
    // head).
    let lines = buf.iter().filter(|&&b| b == b'\n').count() + 1;
    let mut headers = vec![httparse::EMPTY_HEADER; lines.min(max_head / 3 + 1)];
    parse_into(buf, max_head, &known_path, &mut headers).unwrap_or(Err(Reject::HeaderTooLarge))
}

/// [`parse_request`] with `headers` to parse into; None when the head has more lines.
fn parse_into<'b>(
    buf: &'b [u8],
    max_head: usize,
    known_path: &impl Fn(&str) -> bool,
    headers: &mut [httparse::Header<'b>],
) -> Option<Result<Option<(usize, UpgradeRequest)>, Reject>> {
    let mut req = httparse::Request::new(headers);
    let head_len = match req.parse(buf) {
        Ok(httparse::Status::Complete(len)) if len <= max_head => len,
        Ok(httparse::Status::Complete(_)) => return Some(Err(Reject::HeaderTooLarge)),
        // The head does not end within `buf`, so it is longer than `buf`.
        Ok(httparse::Status::Partial) if buf.len() >= max_head => {
            return Some(Err(Reject::HeaderTooLarge))
        }
        Ok(httparse::Status::Partial) => return Some(Ok(None)),
        Err(httparse::Error::TooManyHeaders) => return None,
        Err(_) => return Some(Err(Reject::BadRequest)),
    };
    Some(check(head_len, req, known_path))
}

/// The path of an absolute-form target (`http://host:port/agent`, as a client that speaks to
/// proxies sends), which a server must accept (RFC 9112 §3.2.2); any other target as it is.
pub(crate) fn origin_form(target: &str) -> &str {
    let scheme_end = target.find("://").filter(|&i| {
        let scheme = &target[..i];
        scheme.eq_ignore_ascii_case("http") || scheme.eq_ignore_ascii_case("https")
    });
    let Some(i) = scheme_end else {
        return target;
    };
    let rest = &target[i + 3..];
    rest.find('/').map_or("/", |slash| &rest[slash..])
}

/// The checks of a complete head, after the parse.
fn check(
    head_len: usize,
    req: httparse::Request<'_, '_>,
    known_path: &impl Fn(&str) -> bool,
) -> Result<Option<(usize, UpgradeRequest)>, Reject> {
    // httparse fills all three on Complete.
    let (Some(method), Some(target), Some(version)) = (req.method, req.path, req.version) else {
        return Err(Reject::BadRequest);
    };
    let path = target.split_once('?').map_or(target, |(path, _query)| path);
    let path = origin_form(path);
    if !known_path(path) {
        return Err(Reject::NotFound);
    }
    // RFC 6455 §4.1: "The method of the request MUST be GET".
    if method != "GET" {
        return Err(Reject::MethodNotAllowed);
    }
    let headers = req.headers;
    // §4.1: HTTP/1.1 or higher, an `Upgrade` including "websocket" and a `Connection` including
    // "Upgrade" (RFC 9110 §7.6.1, §7.8: comma lists, tokens case-insensitive).
    let upgrade = version == 1
        && has_token(headers, "upgrade", "websocket")
        && has_token(headers, "connection", "upgrade");
    if !upgrade {
        return Err(Reject::UpgradeRequired);
    }
    // §4.2.2: any other version is answered with 426 and the versions we speak; the header
    // twice is malformed (§11.3.5), and a 426 naming 13 would only have the client repeat it.
    match single_value(headers, "sec-websocket-version") {
        Ok(Some(b"13")) => {}
        Err(()) => return Err(Reject::BadRequest),
        Ok(_) => return Err(Reject::UpgradeRequired),
    }
    // §4.1/§11.3.1: exactly one key, base64 of a 16-byte nonce.
    let key = match single_value(headers, "sec-websocket-key") {
        Ok(Some(key)) if BASE64.decode(key).is_ok_and(|nonce| nonce.len() == 16) => key,
        _ => return Err(Reject::BadRequest),
    };
    // RFC 9110 §7.2 (and RFC 6455 §4.1): an HTTP/1.1 request without Host is answered 400.
    if !matches!(single_value(headers, "host"), Ok(Some(_))) {
        return Err(Reject::BadRequest);
    }
    // The bytes after the head are websocket frames: a body there would be read as frames
    // and fail as a protocol error, so a request that says it has one is refused plainly.
    let no_body = matches!(
        single_value(headers, "content-length"),
        Ok(None | Some(b"0"))
    ) && values(headers, "transfer-encoding").next().is_none();
    if !no_body {
        return Err(Reject::BadRequest);
    }
    let authorization = match single_value(headers, "authorization") {
        Ok(Some(value)) => Some(utf8(value)?.to_owned()),
        Ok(None) => None,
        Err(()) => return Err(Reject::BadRequest),
    };
    let request = UpgradeRequest {
        path: path.to_owned(),
        key: utf8(key)?.to_owned(),
        authorization,
        // RFC 6455 §9.1: extension offers are comma lists of `name; params`.
        offered_deflate: values(headers, "sec-websocket-extensions")
            .flat_map(|v| v.split(|&b| b == b','))
            .filter_map(|offer| offer.split(|&b| b == b';').next())
            .any(|name| {
                name.trim_ascii()
                    .eq_ignore_ascii_case(b"permessage-deflate")
            }),
    };
    Ok(Some((head_len, request)))
}

/// `Sec-WebSocket-Accept` for `key` (RFC 6455 §4.2.2): base64 of SHA-1 of key + GUID.
pub fn accept_key(key: &str) -> String {
    let mut sha1 = sha1_smol::Sha1::new();
    sha1.update(key.as_bytes());
    sha1.update(WEBSOCKET_GUID.as_bytes());
    BASE64.encode(sha1.digest().bytes())
}

/// The 101 response that completes the handshake (RFC 6455 §4.2.2). It names no extension, so
/// a `permessage-deflate` offer is declined, not refused (RFC 7692 §5.1).
pub fn switching_protocols(key: &str) -> Vec<u8> {
    let accept = accept_key(key);
    format!(
        "HTTP/1.1 101 Switching Protocols\r\nUpgrade: websocket\r\nConnection: Upgrade\r\n\
         Sec-WebSocket-Accept: {accept}\r\n\r\n"
    )
    .into_bytes()
}

/// How long a refused client is told to wait, in seconds: drawn from 5..=15 each time
/// (CONTRACT.md §2), so that clients refused together do not come back together.
pub fn retry_after_s() -> u32 {
    fastrand::u32(5..=15)
}

/// 503 for a connection over the accept bucket or `--max-connections` (CONTRACT.md §2).
pub fn service_unavailable(retry_after_s: u32) -> Vec<u8> {
    format!(
        "HTTP/1.1 503 Service Unavailable\r\nRetry-After: {retry_after_s}\r\nConnection: close\r\n\
         Content-Length: 0\r\n\r\n"
    )
    .into_bytes()
}

/// 401 for a request whose credentials the caller refused. RFC 9110 §15.5.2 requires a
/// challenge; the broker's token scheme is Bearer.
pub fn unauthorized() -> Vec<u8> {
    b"HTTP/1.1 401 Unauthorized\r\nWWW-Authenticate: Bearer realm=\"fleetlink\"\r\n\
      Connection: close\r\nContent-Length: 0\r\n\r\n"
        .to_vec()
}

/// Values of every header named `name` (ASCII case-insensitive), trimmed.
fn values<'a>(
    headers: &'a [httparse::Header<'a>],
    name: &'a str,
) -> impl Iterator<Item = &'a [u8]> {
    headers
        .iter()
        .filter(move |h| h.name.eq_ignore_ascii_case(name))
        .map(|h| h.value.trim_ascii())
}

/// The value of a header that may appear at most once: `Err(())` when it is repeated.
fn single_value<'a>(
    headers: &'a [httparse::Header<'a>],
    name: &'a str,
) -> Result<Option<&'a [u8]>, ()> {
    let mut all = values(headers, name);
    match (all.next(), all.next()) {
        (first, None) => Ok(first),
        (Some(_), Some(_)) | (None, Some(_)) => Err(()),
    }
}

/// Whether any `name` header lists `token` in its comma-separated value.
fn has_token(headers: &[httparse::Header<'_>], name: &str, token: &str) -> bool {
    values(headers, name)
        .flat_map(|v| v.split(|&b| b == b','))
        .any(|t| t.trim_ascii().eq_ignore_ascii_case(token.as_bytes()))
}

fn utf8(bytes: &[u8]) -> Result<&str, Reject> {
    std::str::from_utf8(bytes).map_err(|_| Reject::BadRequest)
}

#[cfg(test)]
mod tests {
    use super::*;

    const MAX_HEAD: usize = 8192;

    /// The client handshake of RFC 6455 §1.2, with our path.
    const RFC_HEAD: &[u8] = b"GET /agent HTTP/1.1\r\n\
        Host: server.example.com\r\n\
        Upgrade: websocket\r\n\
        Connection: Upgrade\r\n\
        Sec-WebSocket-Key: dGhlIHNhbXBsZSBub25jZQ==\r\n\
        Origin: http://example.com\r\n\
        Sec-WebSocket-Protocol: chat, superchat\r\n\
        Sec-WebSocket-Version: 13\r\n\r\n";

    fn parse(head: &[u8]) -> Result<Option<(usize, UpgradeRequest)>, Reject> {
        parse_request(head, MAX_HEAD, |path| path == "/agent")
    }

    /// `RFC_HEAD` with the header line starting with `name` replaced by `line` (dropped when
    /// `line` is empty).
    fn with_header(name: &str, line: &str) -> Vec<u8> {
        let text = std::str::from_utf8(RFC_HEAD).unwrap();
        let mut out = String::new();
        for l in text.split_inclusive("\r\n") {
            match l.starts_with(name) {
                true if !line.is_empty() => out.push_str(&format!("{line}\r\n")),
                true => {}
                false => out.push_str(l),
            }
        }
        out.into_bytes()
    }

    fn request_of(head: &[u8]) -> UpgradeRequest {
        parse(head).unwrap().unwrap().1
    }

    fn status_line(response: &[u8]) -> (u16, Vec<(String, String)>) {
        let mut headers = [httparse::EMPTY_HEADER; 16];
        let mut res = httparse::Response::new(&mut headers);
        assert_eq!(
            res.parse(response).unwrap(),
            httparse::Status::Complete(response.len())
        );
        let code = res.code.unwrap();
        let pairs = res.headers.iter();
        let pairs = pairs.map(|h| {
            (
                h.name.to_owned(),
                String::from_utf8(h.value.to_vec()).unwrap(),
            )
        });
        (code, pairs.collect())
    }

    #[test]
    fn rfc_accept_key_sample() {
        assert_eq!(
            accept_key("dGhlIHNhbXBsZSBub25jZQ=="),
            "s3pPLMBiTxaQ9kYGzzhZRbK+xOo="
        );
    }

    #[test]
    fn rfc_handshake_is_accepted() {
        let (len, req) = parse(RFC_HEAD).unwrap().unwrap();
        assert_eq!(len, RFC_HEAD.len());
        let expect = UpgradeRequest {
            path: "/agent".into(),
            key: "dGhlIHNhbXBsZSBub25jZQ==".into(),
            authorization: None,
            offered_deflate: false,
        };
        assert_eq!(req, expect);
        // An empty body said out loud is no body.
        let empty = with_header("Host", "Host: x\r\nContent-Length: 0");
        assert!(matches!(parse(&empty), Ok(Some(_))));
    }

    #[test]
    fn switching_protocols_carries_the_accept_key_and_no_extension() {
        let response = switching_protocols("dGhlIHNhbXBsZSBub25jZQ==");
        let expect =
            b"HTTP/1.1 101 Switching Protocols\r\nUpgrade: websocket\r\nConnection: Upgrade\r\n\
            Sec-WebSocket-Accept: s3pPLMBiTxaQ9kYGzzhZRbK+xOo=\r\n\r\n";
        assert_eq!(response, expect);
    }

    #[test]
    fn bytes_after_the_head_are_left_for_the_frame_decoder() {
        let mut buf = RFC_HEAD.to_vec();
        buf.extend_from_slice(b"\x81\x85\x37\xfa\x21\x3d\x7f\x9f\x4d\x51\x58");
        assert_eq!(parse(&buf).unwrap().unwrap().0, RFC_HEAD.len());
    }

    #[test]
    fn every_prefix_of_a_head_is_incomplete() {
        for end in 0..RFC_HEAD.len() {
            assert_eq!(parse(&RFC_HEAD[..end]), Ok(None), "cut at {end}");
        }
    }

    #[test]
    fn an_absolute_form_target_is_taken_by_its_path() {
        for (target, want) in [
            ("GET http://127.0.0.1:8080/agent HTTP/1.1", Ok("/agent")),
            ("GET HTTP://rigs.example/agent?x=1 HTTP/1.1", Ok("/agent")),
            ("GET http://rigs.example HTTP/1.1", Err(Reject::NotFound)),
            (
                "GET http://rigs.example/other HTTP/1.1",
                Err(Reject::NotFound),
            ),
            (
                "GET ftp://rigs.example/agent HTTP/1.1",
                Err(Reject::NotFound),
            ),
        ] {
            let head = with_header("GET", target);
            let got = parse_request(&head, MAX_HEAD, |path| path == "/agent")
                .map(|r| r.map(|(_, req)| req.path));
            assert_eq!(got, want.map(|p| Some(p.to_string())), "{target}");
        }
    }

    #[test]
    fn query_is_stripped_before_the_path_check() {
        let head = with_header("GET", "GET /agent?token=abc&x=%20 HTTP/1.1");
        assert_eq!(request_of(&head).path, "/agent");
        let seen = std::cell::RefCell::new(String::new());
        let known = |p: &str| {
            *seen.borrow_mut() = p.to_owned();
            false
        };
        assert_eq!(parse_request(&head, MAX_HEAD, known), Err(Reject::NotFound));
        assert_eq!(*seen.borrow(), "/agent");
    }

    #[test]
    fn header_names_and_tokens_are_case_insensitive_and_listed() {
        let head = with_header("Upgrade", "upgrade:   WebSocket  ");
        let head = String::from_utf8(head)
            .unwrap()
            .replace("Connection: Upgrade", "CONNECTION: keep-alive, UPGRADE");
        assert!(parse(head.as_bytes()).unwrap().is_some());
        // `Connection` may also come as two header lines.
        let split = with_header(
            "Connection",
            "connection: keep-alive\r\nConnection: upgrade",
        );
        assert!(parse(&split).unwrap().is_some());
        // Tokens are whole list members, not substrings.
        let near_miss = with_header("Connection", "Connection: keep-alive, upgraded");
        assert_eq!(parse(&near_miss), Err(Reject::UpgradeRequired));
    }

    #[test]
    fn folded_header_lines_are_refused() {
        // RFC 9112 §5.2: a server MUST reject obs-fold with 400 or unfold it; we reject.
        let head = with_header("Connection", "Connection: keep-alive,\r\n Upgrade");
        assert_eq!(parse(&head), Err(Reject::BadRequest));
    }

    #[test]
    fn deflate_offer_is_noted() {
        let offered = |line: &str| request_of(&with_header("Origin", line)).offered_deflate;
        assert!(offered(
            "Sec-WebSocket-Extensions: permessage-deflate; client_max_window_bits"
        ));
        assert!(offered(
            "sec-websocket-extensions: x-webkit-deflate-frame, PerMessage-Deflate"
        ));
        assert!(!offered("Sec-WebSocket-Extensions: x-webkit-deflate-frame"));
        assert!(!offered("Origin: http://example.com"));
    }

    #[test]
    fn authorization_is_passed_through() {
        let req = request_of(&with_header("Origin", "Authorization: Bearer s3cr3t"));
        assert_eq!(req.authorization.as_deref(), Some("Bearer s3cr3t"));
        let twice = with_header(
            "Origin",
            "Authorization: Bearer a\r\nAuthorization: Bearer b",
        );
        assert_eq!(parse(&twice), Err(Reject::BadRequest));
    }

    #[test]
    fn every_reject_in_order() {
        let post_elsewhere = with_header("GET", "POST /nowhere HTTP/1.1");
        let cases: Vec<(Vec<u8>, Reject)> = vec![
            (b"NOT HTTP AT ALL\r\n\r\n".to_vec(), Reject::BadRequest),
            (b"GET /agent HTTP/1.1\r\nBad Header\r\n\r\n".to_vec(), Reject::BadRequest),
            (with_header("GET", "GET /other HTTP/1.1"), Reject::NotFound),
            (post_elsewhere, Reject::NotFound),
            (with_header("GET", "POST /agent HTTP/1.1"), Reject::MethodNotAllowed),
            (b"GET /agent HTTP/1.1\r\nHost: x\r\n\r\n".to_vec(), Reject::UpgradeRequired),
            (with_header("Upgrade", ""), Reject::UpgradeRequired),
            (with_header("Upgrade", "Upgrade: h2c"), Reject::UpgradeRequired),
            (with_header("Connection", "Connection: keep-alive"), Reject::UpgradeRequired),
            (with_header("GET", "GET /agent HTTP/1.0"), Reject::UpgradeRequired),
            (with_header("Sec-WebSocket-Version", "Sec-WebSocket-Version: 8"), Reject::UpgradeRequired),
            (with_header("Sec-WebSocket-Version", "Sec-WebSocket-Version: 12"), Reject::UpgradeRequired),
            (with_header("Sec-WebSocket-Version", "Sec-WebSocket-Version: 14"), Reject::UpgradeRequired),
            (with_header("Sec-WebSocket-Version", "Sec-WebSocket-Version: 13, 8"), Reject::UpgradeRequired),
            (with_header("Sec-WebSocket-Version", ""), Reject::UpgradeRequired),
            (
                with_header("Sec-WebSocket-Version", "Sec-WebSocket-Version: 13\r\nSec-WebSocket-Version: 13"),
                Reject::BadRequest,
            ),
            (with_header("Sec-WebSocket-Key", ""), Reject::BadRequest),
            (with_header("Sec-WebSocket-Key", "Sec-WebSocket-Key: c2hvcnQ="), Reject::BadRequest),
            // 17 and 20 bytes: the key is exactly 16.
            (with_header("Sec-WebSocket-Key", "Sec-WebSocket-Key: dGhlIHNhbXBsZSBub25jZXg="), Reject::BadRequest),
            (with_header("Sec-WebSocket-Key", "Sec-WebSocket-Key: AAAAAAAAAAAAAAAAAAAAAAAAAAA="), Reject::BadRequest),
            (with_header("Sec-WebSocket-Key", "Sec-WebSocket-Key: not base64 at all!!!!"), Reject::BadRequest),
            (
                with_header("Sec-WebSocket-Key", "Sec-WebSocket-Key: dGhlIHNhbXBsZSBub25jZQ==\r\nSec-WebSocket-Key: dGhlIHNhbXBsZSBub25jZQ=="),
                Reject::BadRequest,
            ),
            (with_header("Host", ""), Reject::BadRequest),
            (with_header("Host", "Host: x\r\nContent-Length: 5"), Reject::BadRequest),
            (with_header("Host", "Host: x\r\nContent-Length: 0\r\nContent-Length: 0"), Reject::BadRequest),
            (with_header("Host", "Host: x\r\nTransfer-Encoding: chunked"), Reject::BadRequest),
        ];
        for (head, reject) in cases {
            assert_eq!(
                parse(&head),
                Err(reject),
                "{}",
                String::from_utf8_lossy(&head)
            );
        }
    }

    #[test]
    fn reject_responses() {
        let all = [
            (Reject::BadRequest, 400),
            (Reject::NotFound, 404),
            (Reject::MethodNotAllowed, 405),
            (Reject::UpgradeRequired, 426),
            (Reject::HeaderTooLarge, 431),
        ];
        for (reject, status) in all {
            assert_eq!(reject.status(), status);
            let (code, headers) = status_line(&reject.response());
            assert_eq!(code, status);
            assert!(headers.contains(&("Connection".into(), "close".into())));
            assert!(headers.contains(&("Content-Length".into(), "0".into())));
        }
        let (_, headers) = status_line(&Reject::UpgradeRequired.response());
        assert!(headers.contains(&("Upgrade".into(), "websocket".into())));
        assert!(headers.contains(&("Sec-WebSocket-Version".into(), "13".into())));
        let (_, headers) = status_line(&Reject::MethodNotAllowed.response());
        assert!(headers.contains(&("Allow".into(), "GET".into())));
    }

    #[test]
    fn other_responses() {
        let (code, headers) = status_line(&service_unavailable(7));
        assert_eq!(code, 503);
        assert!(headers.contains(&("Retry-After".into(), "7".into())));
        assert!(headers.contains(&("Connection".into(), "close".into())));
        let (code, headers) = status_line(&unauthorized());
        assert_eq!(code, 401);
        assert!(headers.contains(&("Connection".into(), "close".into())));
        assert!(headers.iter().any(|(name, _)| name == "WWW-Authenticate"));
    }

    /// Only the head's size makes a 431 (CONTRACT.md section 2): many short lines within it
    /// are parsed, whole or arriving in pieces.
    #[test]
    fn many_header_lines_within_the_size_are_taken() {
        let extra: String = (0..MAX_HEADERS * 4)
            .map(|i| format!("X-Filler-{i}: y\r\n"))
            .collect();
        let head = with_header("Origin", extra.trim_end());
        assert!(head.len() < MAX_HEAD);
        let (len, req) = parse(&head).expect("valid").expect("complete");
        assert_eq!((len, req.path.as_str()), (head.len(), "/agent"));
        for cut in [head.len() / 2, head.len() - 3, head.len() - 1] {
            assert_eq!(parse(&head[..cut]), Ok(None), "cut at {cut}");
        }
        // The shortest lines a head can have, up to the size limit.
        let fill = "a:\r\n".repeat((MAX_HEAD - RFC_HEAD.len()) / 4 - 8);
        let head = with_header("Origin", fill.trim_end());
        assert!(head.len() <= MAX_HEAD, "{}", head.len());
        assert!(matches!(parse(&head), Ok(Some(_))));
        let over = with_header("Origin", "a:\r\n".repeat(MAX_HEAD / 4).trim_end());
        assert_eq!(parse(&over), Err(Reject::HeaderTooLarge));
    }

    #[test]
    fn head_size_boundary_at_8_kib() {
        // Pad the head with one header so that it is exactly `len` bytes long.
        let head_of = |len: usize| {
            let pad = len - RFC_HEAD.len() - "X-Pad: \r\n".len();
            with_header(
                "Origin",
                &format!("Origin: http://example.com\r\nX-Pad: {}", "p".repeat(pad)),
            )
        };
        let exact = head_of(MAX_HEAD);
        assert_eq!(exact.len(), MAX_HEAD);
        assert_eq!(parse(&exact).unwrap().unwrap().0, MAX_HEAD);
        let over = head_of(MAX_HEAD + 1);
        assert_eq!(parse(&over), Err(Reject::HeaderTooLarge));
        // Incomplete: fine below the limit, 431 once the buffer reaches it without an end.
        assert_eq!(parse(&over[..MAX_HEAD - 1]), Ok(None));
        assert_eq!(parse(&over[..MAX_HEAD]), Err(Reject::HeaderTooLarge));
        assert_eq!(parse(&[b'a'; 100_000]), Err(Reject::HeaderTooLarge));
    }

    /// Lines ended by a bare LF, as short as a line gets (`a:\n`): a head of 8 KiB made of
    /// them is taken whole, however many lines that is, and one byte more is refused for its
    /// size. (The array was sized for 4-byte lines, and 431'd such a head from about 6 KiB.)
    #[test]
    fn a_head_of_the_shortest_lines_is_refused_for_its_size_only() {
        let head_of = |len: usize| {
            let mut head = RFC_HEAD[..RFC_HEAD.len() - 2].to_vec();
            // Three bytes a line, then one line of 3 to 5 bytes to make up `len`.
            while len - head.len() - 2 > 5 {
                head.extend_from_slice(b"a:\n");
            }
            let last = len - head.len() - 2;
            head.extend_from_slice(format!("{}:\n", "b".repeat(last - 2)).as_bytes());
            head.extend_from_slice(b"\r\n");
            head
        };
        let exact = head_of(MAX_HEAD);
        assert_eq!(exact.len(), MAX_HEAD);
        assert_eq!(parse(&exact).unwrap().unwrap().0, MAX_HEAD);
        let over = head_of(MAX_HEAD + 1);
        assert_eq!(over.len(), MAX_HEAD + 1);
        assert_eq!(parse(&over), Err(Reject::HeaderTooLarge));
    }
}
