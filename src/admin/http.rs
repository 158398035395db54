//! The admin API's HTTP/1.1 as bytes, with no I/O: a request parsed from what has been read so
//! far, the refusals, the clock a request must arrive by, and the bytes of an answer, counted.
//!
//! Without I/O because a core's async reader, the acceptor's lobby and the pool's threads all
//! read requests and write answers, each waiting in its own way: one parser and one writer keep
//! them agreeing on where a request ends, when it is late, and what a refusal says.

use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use serde_json::json;

use super::commands::command_rig;
use super::routes::immediate;
use super::{IO_TIMEOUT, KEEP_ALIVE, MAX_REQUEST};
use crate::metrics;

/// One admin request.
pub struct Request {
    /// The method.
    pub method: String,
    /// The path without its query.
    pub path: String,
    /// The query, after the `?` (empty without one).
    pub query: String,
    /// The body.
    pub body: Vec<u8>,
    /// The client asked to close after this request (or spoke HTTP/1.0).
    pub close: bool,
}

impl Request {
    /// A HEAD request: its answer has headers only (RFC 9110 §9.3.2), or the client would
    /// read the body as the start of the next answer.
    pub fn head_only(&self) -> bool {
        self.method == "HEAD"
    }

    /// The method to route by: HEAD is answered as GET would be (a load balancer's health
    /// check may use it), its body left out.
    pub(super) fn get_method(&self) -> &str {
        if self.head_only() {
            "GET"
        } else {
            &self.method
        }
    }
}

/// What the bytes read so far hold.
pub enum Parsed {
    /// A whole request, and how many bytes it took.
    Complete(Request, usize),
    /// Not all of it yet. `send_continue`: the head is in and asks for `100 Continue`
    /// before its body (curl does for bodies over 1 KiB and otherwise waits a second).
    Partial {
        /// The client waits for `100 Continue` before sending the body.
        send_continue: bool,
    },
    /// Malformed, or larger than [`MAX_REQUEST`]: answered so, and the connection closes.
    Bad(Refusal),
}

/// Why a request is refused before it can be routed.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Refusal {
    status: u16,
    detail: &'static str,
}

impl Refusal {
    const MALFORMED: Refusal = Refusal {
        status: 400,
        detail: "malformed HTTP request",
    };
    const TOO_LARGE: Refusal = Refusal {
        status: 413,
        detail: "request larger than 1 MiB, head and body",
    };
    const TOO_MANY_HEADERS: Refusal = Refusal {
        status: 431,
        detail: "more than 64 header lines",
    };
    const NO_LENGTH: Refusal = Refusal {
        status: 411,
        detail: "send the body with one Content-Length; Transfer-Encoding is not taken",
    };

    /// The answer: a JSON error as the routes give (`bad_request`), since a client of the
    /// commands route reads its answers as JSON.
    pub fn answer(self) -> Answer {
        let body = json!({"ok": false, "error": "bad_request", "detail": self.detail});
        (
            self.status,
            "application/json",
            body.to_string().into_bytes(),
        )
    }
}

/// Header lines a request may have: proxies and tracing add a few dozen at most; each slot
/// costs the parser's stack 32 bytes.
const MAX_HEADERS: usize = 64;

/// Parses one request from the front of `buf` (sans-IO: both the pool's blocking reader and a
/// core's reader use it).
pub fn parse_request(buf: &[u8]) -> Parsed {
    let mut headers = [httparse::EMPTY_HEADER; MAX_HEADERS];
    let mut req = httparse::Request::new(&mut headers);
    let head_len = match req.parse(buf) {
        Ok(httparse::Status::Complete(len)) => len,
        Ok(httparse::Status::Partial) if buf.len() < MAX_REQUEST => {
            return Parsed::Partial {
                send_continue: false,
            }
        }
        Ok(httparse::Status::Partial) => return Parsed::Bad(Refusal::TOO_LARGE),
        Err(httparse::Error::TooManyHeaders) => return Parsed::Bad(Refusal::TOO_MANY_HEADERS),
        Err(_) => return Parsed::Bad(Refusal::MALFORMED),
    };
    let header = |name: &str| {
        req.headers
            .iter()
            .find(|h| h.name.eq_ignore_ascii_case(name))
            .and_then(|h| std::str::from_utf8(h.value).ok())
            .map(str::trim)
    };
    // A body's end must be certain, or its bytes would be read as the next request: no
    // chunked bodies, and one Content-Length of digits only (repeats must agree).
    if header("transfer-encoding").is_some() {
        return Parsed::Bad(Refusal::NO_LENGTH);
    }
    let mut lengths = req
        .headers
        .iter()
        .filter(|h| h.name.eq_ignore_ascii_case("content-length"))
        .map(|h| std::str::from_utf8(h.value).map(str::trim));
    let content_length = match lengths.next() {
        None => 0,
        Some(Ok(v)) if !v.is_empty() && v.bytes().all(|b| b.is_ascii_digit()) => {
            match v.parse::<usize>() {
                Ok(n) => n,
                Err(_) => return Parsed::Bad(Refusal::TOO_LARGE),
            }
        }
        Some(_) => return Parsed::Bad(Refusal::MALFORMED),
    };
    if lengths.any(|other| other.ok().and_then(|v| v.parse::<usize>().ok()) != Some(content_length))
    {
        return Parsed::Bad(Refusal::MALFORMED);
    }
    let close = req.version == Some(0)
        || header("connection").is_some_and(|v| v.eq_ignore_ascii_case("close"));
    let Some(len) = head_len
        .checked_add(content_length)
        .filter(|&n| n <= MAX_REQUEST)
    else {
        return Parsed::Bad(Refusal::TOO_LARGE);
    };
    // The admin API answers absolute-form targets as the rigs' endpoint does (review bb130),
    // the query split off first: `http://h?x=/healthz` has the path `/` (review bb132).
    let target = req.path.unwrap_or("");
    let (target, query) = target.split_once('?').unwrap_or((target, ""));
    let path = crate::http_upgrade::origin_form(target);
    let request = |body: &[u8], close: bool| Request {
        method: req.method.unwrap_or("").to_string(),
        path: path.to_string(),
        query: query.to_string(),
        body: body.to_vec(),
        close,
    };
    let Some(body) = buf.get(head_len..len) else {
        let send_continue = req.version == Some(1)
            && header("expect").is_some_and(|v| v.eq_ignore_ascii_case("100-continue"));
        if send_continue {
            // Told to go on, the client would send its body only to hear 404 or 405: it hears
            // that now, and the connection closes, since the body may come all the same.
            let early = request(&[], true);
            if command_rig(&early).is_none() && immediate(&early).is_some() {
                return Parsed::Complete(early, head_len);
            }
        }
        return Parsed::Partial { send_continue };
    };
    Parsed::Complete(request(body, close), len)
}

/// How long a connection may wait for the rest of its current request, the same rule on the
/// cores and in the pool: from the request's first byte (or the connection's start) it has
/// [`IO_TIMEOUT`] to arrive whole, however it trickles; before its first byte, a connection
/// that has been served may idle [`KEEP_ALIVE`].
#[derive(Debug)]
pub(crate) struct RequestClock {
    kept_alive: bool,
    deadline: Option<Instant>,
}

impl RequestClock {
    /// For the next request; `kept_alive` once the connection has served one.
    pub(crate) fn new(kept_alive: bool) -> Self {
        RequestClock {
            kept_alive,
            deadline: None,
        }
    }

    /// How long the next read may wait, `holding` saying whether part of the request is in.
    /// Zero: the request is out of time.
    pub(crate) fn wait(&mut self, holding: bool, now: Instant) -> Duration {
        let until = match self.deadline {
            Some(d) => d,
            None if !holding && self.kept_alive => now + KEEP_ALIVE,
            None => *self.deadline.insert(now + IO_TIMEOUT),
        };
        until.saturating_duration_since(now)
    }

    /// Bytes arrived: the request's own clock runs from the first.
    pub(crate) fn got_bytes(&mut self, now: Instant) {
        self.deadline.get_or_insert(now + IO_TIMEOUT);
    }
}

/// The interim answer to `Expect: 100-continue`.
pub(crate) const CONTINUE: &[u8] = b"HTTP/1.1 100 Continue\r\n\r\n";

/// An HTTP answer: status, content type, body.
pub type Answer = (u16, &'static str, Vec<u8>);

/// Every status an admin answer can carry, each counted in [`ANSWERED`].
const STATUSES: [u16; 13] = [
    200, 202, 400, 403, 404, 405, 409, 411, 413, 431, 503, 504, 0,
];

/// Admin answers given, by status ([`STATUSES`]; the last slot counts any other): a refused
/// request is counted like any other bad input. Shared by the cores and the admin pool, off
/// the rigs' hot path.
static ANSWERED: [AtomicU64; STATUSES.len()] = [const { AtomicU64::new(0) }; STATUSES.len()];

/// Requests closed unanswered because they had not come whole within [`IO_TIMEOUT`] (an
/// idle keep-alive connection that times out between requests is not one).
static UNFINISHED: AtomicU64 = AtomicU64::new(0);

/// Idle keep-alive connections the lobby closed to make room for a new one.
static EVICTED: AtomicU64 = AtomicU64::new(0);

/// Requests still arriving that the lobby refused, the one arriving longest first, to make
/// room for a new connection when none was idle.
static SLOW_REFUSED: AtomicU64 = AtomicU64::new(0);

/// Counts a request closed unanswered at its deadline.
pub(crate) fn note_unfinished() {
    UNFINISHED.fetch_add(1, Ordering::Relaxed);
}

/// Requests closed unanswered so far.
#[cfg(test)]
pub(crate) fn unfinished() -> u64 {
    UNFINISHED.load(Ordering::Relaxed)
}

/// Counts an idle connection closed for a newer one (see `lobby`).
pub(crate) fn note_evicted() {
    EVICTED.fetch_add(1, Ordering::Relaxed);
}

/// Counts a request refused for a newer connection (see `lobby`).
pub(crate) fn note_slow_refused() {
    SLOW_REFUSED.fetch_add(1, Ordering::Relaxed);
}

/// Requests refused for newer connections so far.
pub fn slow_refused() -> u64 {
    SLOW_REFUSED.load(Ordering::Relaxed)
}

/// Idle connections closed for newer ones so far.
pub fn evicted() -> u64 {
    EVICTED.load(Ordering::Relaxed)
}

/// Writes `fleetlink_admin_responses_total`, one series per status,
/// `fleetlink_admin_unfinished_total`, `fleetlink_admin_idle_closed_total` and
/// `fleetlink_admin_slow_refused_total`.
pub fn render_answered(out: &mut String) {
    metrics::family(out, "fleetlink_admin_responses_total", "counter");
    for (status, n) in STATUSES.iter().zip(&ANSWERED) {
        let code = match status {
            0 => "other".to_string(),
            s => s.to_string(),
        };
        let n = n.load(Ordering::Relaxed);
        out.push_str(&format!(
            "fleetlink_admin_responses_total{{code=\"{code}\"}} {n}\n"
        ));
    }
    metrics::family(out, "fleetlink_admin_unfinished_total", "counter");
    let n = UNFINISHED.load(Ordering::Relaxed);
    out.push_str(&format!("fleetlink_admin_unfinished_total {n}\n"));
    metrics::family(out, "fleetlink_admin_idle_closed_total", "counter");
    out.push_str(&format!(
        "fleetlink_admin_idle_closed_total {}\n",
        evicted()
    ));
    metrics::family(out, "fleetlink_admin_slow_refused_total", "counter");
    out.push_str(&format!(
        "fleetlink_admin_slow_refused_total {}\n",
        slow_refused()
    ));
}

/// The header naming the broker in every admin answer.
const BROKER_HEADER: &str = "Fleetlink-Broker-Id";

/// The bytes of an answer; `head_only` leaves the body out (its length still said). A 405
/// names the methods `allow` (see [`allowed_methods`](super::allowed_methods)).
pub(crate) fn response(
    status: u16,
    ctype: &str,
    body: &[u8],
    close: bool,
    head_only: bool,
    allow: &str,
) -> Vec<u8> {
    let reason = match status {
        200 => "OK",
        202 => "Accepted",
        400 => "Bad Request",
        403 => "Forbidden",
        404 => "Not Found",
        409 => "Conflict",
        405 => "Method Not Allowed",
        411 => "Length Required",
        413 => "Content Too Large",
        431 => "Request Header Fields Too Large",
        503 => "Service Unavailable",
        504 => "Gateway Timeout",
        _ => "Error",
    };
    let slot = STATUSES
        .iter()
        .position(|s| *s == status)
        .unwrap_or(STATUSES.len() - 1);
    if let Some(n) = ANSWERED.get(slot) {
        n.fetch_add(1, Ordering::Relaxed);
    }
    let connection = if close { "close" } else { "keep-alive" };
    let allow = if status == 405 {
        format!("Allow: {allow}\r\n")
    } else {
        String::new()
    };
    // Every answer names the broker, so that a client that asked several (fleetctl's
    // broadcast through the admin API) can say which answered without asking `/metrics`.
    // `--broker-id` takes no byte a header cannot carry.
    let broker = metrics::broker_id()
        .map(|id| format!("{BROKER_HEADER}: {id}\r\n"))
        .unwrap_or_default();
    let head = format!(
        "HTTP/1.1 {status} {reason}\r\nContent-Type: {ctype}\r\nContent-Length: {}\r\n{allow}{broker}Connection: {connection}\r\n\r\n",
        body.len()
    );
    let mut out = head.into_bytes();
    if !head_only {
        out.extend_from_slice(body);
    }
    out
}

#[cfg(test)]
pub(super) mod tests {
    use super::*;

    #[test]
    fn a_request_has_io_timeout_from_its_first_byte_however_it_trickles() {
        let t0 = Instant::now();
        let mut clock = RequestClock::new(true);
        // Idle between requests: keep-alive, and the request's clock has not started.
        assert_eq!(clock.wait(false, t0), KEEP_ALIVE);
        let first = t0 + Duration::from_secs(1);
        clock.got_bytes(first);
        let later = first + Duration::from_secs(3);
        clock.got_bytes(later);
        assert_eq!(clock.wait(true, later), IO_TIMEOUT - Duration::from_secs(3));
        assert_eq!(clock.wait(true, first + IO_TIMEOUT), Duration::ZERO);
    }

    #[test]
    fn a_first_request_has_io_timeout_from_the_connections_start() {
        let t0 = Instant::now();
        let mut clock = RequestClock::new(false);
        assert_eq!(clock.wait(false, t0), IO_TIMEOUT);
        let later = t0 + Duration::from_secs(2);
        clock.got_bytes(later);
        assert_eq!(clock.wait(true, later), IO_TIMEOUT - Duration::from_secs(2));
    }

    pub(in crate::admin) fn complete(bytes: &[u8]) -> (Request, usize) {
        match parse_request(bytes) {
            Parsed::Complete(req, len) => (req, len),
            Parsed::Partial { .. } => panic!("partial: {:?}", String::from_utf8_lossy(bytes)),
            Parsed::Bad(r) => panic!("bad ({r:?}): {:?}", String::from_utf8_lossy(bytes)),
        }
    }

    #[test]
    fn a_client_expecting_100_continue_is_told_to_go_on_once_its_head_is_in() {
        let head = b"POST /v1/rigs/r1/commands HTTP/1.1\r\nExpect: 100-continue\r\nContent-Length: 12\r\n\r\n";
        let partial = |bytes: &[u8]| match parse_request(bytes) {
            Parsed::Partial { send_continue } => Some(send_continue),
            _ => None,
        };
        // Not before the head is whole, then until the body is.
        assert_eq!(partial(&head[..head.len() - 1]), Some(false));
        assert_eq!(partial(head), Some(true));
        let mut whole = head.to_vec();
        whole.extend_from_slice(b"{\"name\":\"a\"}");
        assert_eq!(partial(&whole[..whole.len() - 1]), Some(true));
        assert!(matches!(parse_request(&whole), Parsed::Complete(..)));
        // A request its body cannot save is answered on its head, and closes the connection.
        let nowhere =
            b"POST /v1/nowhere HTTP/1.1\r\nExpect: 100-continue\r\nContent-Length: 9\r\n\r\n";
        let (req, len) = complete(nowhere);
        assert_eq!((len, req.close), (nowhere.len(), true));
        assert_eq!(immediate(&req).map(|a| a.0), Some(404));
    }

    /// Every status the admin API answers with carries its RFC 9110 reason phrase: a 431 once
    /// went out as `431 Error` while the rig endpoint said what it was.
    #[test]
    fn every_admin_status_has_its_reason_phrase() {
        for &status in STATUSES.iter().filter(|&&s| s != 0) {
            let head = response(status, "application/json", b"{}", true, false, "");
            let line = String::from_utf8_lossy(&head);
            let line = line.lines().next().unwrap_or_default();
            assert!(
                line.starts_with(&format!("HTTP/1.1 {status} ")) && !line.ends_with(" Error"),
                "{line}"
            );
        }
        let head = response(431, "application/json", b"{}", true, false, "");
        assert!(head.starts_with(b"HTTP/1.1 431 Request Header Fields Too Large\r\n"));
    }

    /// Up to 64 header lines are taken; more get 431, not "malformed".
    #[test]
    fn a_request_with_too_many_header_lines_gets_431() {
        let with = |n: usize| {
            let lines: String = (0..n).map(|i| format!("X-Trace-{i}: v\r\n")).collect();
            parse_request(format!("GET /healthz HTTP/1.1\r\n{lines}\r\n").as_bytes())
        };
        assert!(matches!(with(64), Parsed::Complete(..)));
        let Parsed::Bad(refusal) = with(65) else {
            panic!("65 header lines taken");
        };
        assert_eq!(refusal.answer().0, 431);
    }

    #[test]
    fn a_head_request_is_answered_without_a_body() {
        let (req, _) = complete(b"HEAD /healthz HTTP/1.1\r\n\r\n");
        assert!(req.head_only());
        let (status, ctype, body) = immediate(&req).unwrap_or((0, "", Vec::new()));
        assert_eq!(status, 200);
        let bytes = response(status, ctype, &body, false, req.head_only(), "");
        let text = String::from_utf8_lossy(&bytes);
        assert!(text.ends_with("\r\n\r\n"), "{text}");
        assert!(text.contains(&format!("Content-Length: {}\r\n", body.len())));
    }

    #[test]
    fn a_body_whose_length_is_unclear_is_refused() {
        for (head, status) in [
            (
                "POST /v1/drain HTTP/1.1\r\nTransfer-Encoding: chunked\r\n\r\n",
                411,
            ),
            ("POST /v1/drain HTTP/1.1\r\nContent-Length: 2x\r\n\r\n", 400),
            (
                "POST /v1/drain HTTP/1.1\r\nContent-Length: 0\r\nContent-Length: 27\r\n\r\n",
                400,
            ),
        ] {
            match parse_request(head.as_bytes()) {
                Parsed::Bad(r) => assert_eq!(r.answer().0, status, "{head}"),
                _ => panic!("not refused: {head}"),
            }
        }
        let same = b"POST /v1/drain HTTP/1.1\r\nContent-Length: 2\r\nContent-Length: 2\r\n\r\n{}";
        assert!(matches!(parse_request(same), Parsed::Complete(..)));
    }

    #[test]
    fn a_request_is_whole_only_with_its_body_and_leaves_the_next_one_alone() {
        let post =
            b"POST /v1/rigs/r1/commands?x=1 HTTP/1.1\r\nContent-Length: 12\r\n\r\n{\"name\":\"a\"}";
        // Every prefix, cut inside the head or the body, asks for more.
        for cut in 0..post.len() {
            assert!(
                matches!(
                    parse_request(&post[..cut]),
                    Parsed::Partial {
                        send_continue: false
                    }
                ),
                "cut at {cut}"
            );
        }
        let mut two = post.to_vec();
        two.extend_from_slice(b"GET /healthz HTTP/1.1\r\nConnection: close\r\n\r\n");
        let (req, len) = complete(&two);
        assert_eq!(len, post.len());
        assert_eq!(
            (
                req.method.as_str(),
                req.path.as_str(),
                req.body.as_slice(),
                req.close
            ),
            (
                "POST",
                "/v1/rigs/r1/commands",
                &b"{\"name\":\"a\"}"[..],
                false
            )
        );
        assert_eq!(command_rig(&req), Some("r1"));
        let (next, _) = complete(&two[len..]);
        assert_eq!((next.path.as_str(), next.close), ("/healthz", true));
        assert_eq!(command_rig(&next), None);
        let (old, _) = complete(b"GET /metrics HTTP/1.0\r\n\r\n");
        assert!(old.close, "HTTP/1.0 closes after one answer");
    }

    /// A server must take an absolute-form target (RFC 9112 §3.2.2): it was answered 404.
    #[test]
    fn an_absolute_form_target_is_taken_by_its_path_and_query() {
        let (req, _) = complete(b"GET http://127.0.0.1:9090/v1/rigs?x=1 HTTP/1.1\r\n\r\n");
        assert_eq!((req.path.as_str(), req.query.as_str()), ("/v1/rigs", "x=1"));
        let (req, _) = complete(b"GET HTTPS://admin.example HTTP/1.1\r\n\r\n");
        assert_eq!(req.path, "/");
        // A `/` in the query is the query's (review bb132: `?x=/healthz` answered /healthz).
        let (req, _) = complete(b"GET http://admin.example?x=/v1/drain HTTP/1.1\r\n\r\n");
        assert_eq!(
            (req.path.as_str(), req.query.as_str()),
            ("/", "x=/v1/drain")
        );
    }

    #[test]
    fn malformed_or_oversized_requests_are_refused() {
        for (bad, status) in [
            (&b"NOT HTTP\r\n\r\n"[..], 400),
            (b"GET / HTTP/1.1\r\nContent-Length: 2000000\r\n\r\n", 413),
            (
                b"GET / HTTP/1.1\r\nContent-Length: 18446744073709551615\r\n\r\n",
                413,
            ),
        ] {
            match parse_request(bad) {
                Parsed::Bad(r) => {
                    let (code, ctype, body) = r.answer();
                    assert_eq!((code, ctype), (status, "application/json"));
                    let body: serde_json::Value = serde_json::from_slice(&body).expect("JSON");
                    assert_eq!(body["error"], "bad_request");
                }
                _ => panic!("not refused: {:?}", String::from_utf8_lossy(bad)),
            }
        }
        // A head that never ends is refused once it reaches the size limit.
        let mut endless = b"GET / HTTP/1.1\r\nX: ".to_vec();
        endless.resize(MAX_REQUEST, b'a');
        assert!(matches!(
            parse_request(&endless),
            Parsed::Bad(Refusal::TOO_LARGE)
        ));
    }
}
