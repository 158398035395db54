//! Admin HTTP (CONTRACT.md §6): health, readiness, metrics, the rig list, and the standalone
//! control plane (commands, kicks, drain). Plain HTTP/1.1 with keep-alive.
//!
//! Connections are served on the cores, in turn (`crate::worker::admin_conn`): a command POST
//! is the one request a core answers itself, since it only enqueues on a connection, which a
//! core does anyway. Everything else may wait (a snapshot of every core, the bridge's answer
//! to a kick), so a small pool of threads of its own works it out and hands the answer back,
//! and no core ever blocks. The pool also serves whole connections when the cores cannot take
//! them: while the broker drains (a core that has drained stops) or when many are open. Such a
//! connection waits in the acceptor's lobby (`crate::admin_lobby`) while each request arrives,
//! and a pool thread gets it only to answer a whole one.

use std::cell::RefCell;
use std::collections::HashMap;
use std::io::{Read, Write};
use std::net::{TcpListener, TcpStream};
use std::os::fd::AsRawFd;
use std::os::unix::net::UnixStream;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use crossbeam_channel::{Receiver, Sender};
use serde::Deserialize;
use serde_json::json;
use serde_json::value::RawValue;

use crate::admin_lobby::{Held, Lobby, MAX_WAITING};
use crate::args::Args;
use crate::doorbell::{Full, Mailbox};
use crate::event_log;
use crate::ids::{BootId, ConnId, CoreId, RigId, CONTROL_NAME_MAX};
use crate::metrics::{self, CoreSnapshot, Retired};
use crate::registry::bridge::BridgeShared;
use crate::registry::msg::{AdminAnswer, AdminReply, CommandReq, ReplyTo, ToBridge, ToCore};
use crate::reply;

/// Admin requests waiting for a request thread; more get 503 at once.
const MAX_ACTIVE: usize = 64;
/// Admin connections the cores serve at once; past it the lobby and the pool serve them.
/// Generous, since the cores serve a connection without handing it between threads. On a core
/// a silent connection costs a pending read (a 4 KiB buffer) until its 5 s to send a request
/// run out.
pub const MAX_ON_CORES: usize = 1024;
/// How long an idle keep-alive connection may stay open.
pub(crate) const KEEP_ALIVE: Duration = Duration::from_secs(2);
/// Requests served on one connection before it is closed (so no client holds a pool thread or a
/// core's slot forever).
pub(crate) const MAX_PER_CONNECTION: usize = 10_000;
/// Request threads. Requests that wait on a core or the bridge hold one for up to `IO_TIMEOUT`.
const WORKERS: usize = 8;
/// Largest request (head + body) accepted.
pub const MAX_REQUEST: usize = 1 << 20;
/// The admin acceptor's pause after a failed accept.
const ACCEPT_BACKOFF: Duration = Duration::from_millis(50);
/// How long a request may take to arrive, and a core or the bridge to answer.
pub(crate) const IO_TIMEOUT: Duration = Duration::from_secs(5);
/// How long a refused connection reads and drops what its client still sends before it
/// closes. A refusal leaves part of the request unread; closing on unread bytes sends a reset,
/// which fails the write of a client still sending its body and can destroy the answer in its
/// buffers before it reads it.
pub(crate) const LINGER: Duration = Duration::from_secs(2);
/// Bytes read and dropped from one refused connection at most, in the lobby and on a core
/// (admin requests and refused upgrades alike): twice the largest request, so a client
/// finishing its body reads the answer, while one streaming without pause holds neither the
/// lobby's one thread, which polls every waiting connection, nor a core for all of [`LINGER`].
pub(crate) const LINGER_BYTES: usize = 2 << 20;
/// Rigs a request thread or core remembers a route to; past it the memory starts afresh.
const MAX_ROUTES: usize = 4096;

thread_local! {
    /// The connection that took this thread's last command for each rig (a core's, for the
    /// admin connections it serves; a pool thread's, for those it serves). The rig's next
    /// command goes straight to that connection (on this core, or to its core's inbox)
    /// instead of asking the bridge first; a route gone stale costs the extra hop once,
    /// through the bridge, whose answer brings the new route. Per thread, so nothing is shared
    /// or locked.
    static ROUTES: RefCell<HashMap<RigId, ConnId>> = RefCell::new(HashMap::new());
}

/// What the admin thread needs from the rest of the broker.
pub struct Admin {
    /// The bridge inbox (commands, kicks).
    pub bridge: Mailbox<ToBridge>,
    /// Every core's inbox (snapshots).
    pub cores: Vec<Mailbox<ToCore>>,
    /// Bridge figures.
    pub bridge_stats: Arc<BridgeShared>,
    /// Set once a drain started; readiness fails from then on.
    pub draining: Arc<AtomicBool>,
    /// Asks the main thread to drain.
    pub drain: Sender<()>,
    /// The last figures of cores that stopped at the end of a drain.
    pub retired: Arc<Retired>,
    /// The TLS material in force, for its expiry in `/metrics` (None: plain ws).
    pub tls: Option<Arc<crate::tls::TlsReloader>>,
}

impl Admin {
    /// Bundles the handles.
    pub fn new(
        bridge: Mailbox<ToBridge>,
        cores: Vec<Mailbox<ToCore>>,
        bridge_stats: Arc<BridgeShared>,
        draining: Arc<AtomicBool>,
        drain: Sender<()>,
        retired: Arc<Retired>,
        tls: Option<Arc<crate::tls::TlsReloader>>,
    ) -> Self {
        Self {
            bridge,
            cores,
            bridge_stats,
            draining,
            drain,
            retired,
            tls,
        }
    }
}

/// An admin connection handed to a core. It counts against the cores' limit until its ticket
/// drops.
pub struct OnCore {
    stream: TcpStream,
    ticket: Ticket,
}

impl OnCore {
    /// A connection moving from one core to another, with its ticket.
    pub fn from_parts(stream: TcpStream, ticket: Ticket) -> Self {
        Self { stream, ticket }
    }

    /// The connection, and the ticket to hold while serving it.
    pub fn into_parts(self) -> (TcpStream, Ticket) {
        (self.stream, self.ticket)
    }
}

impl std::fmt::Debug for OnCore {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("OnCore")
            .field("stream", &self.stream)
            .finish()
    }
}

/// Counts one connection the cores serve.
pub struct Ticket(Arc<AtomicUsize>);

impl Drop for Ticket {
    fn drop(&mut self) {
        self.0.fetch_sub(1, Ordering::Relaxed);
    }
}

/// What the pool's threads do.
pub enum Work {
    /// Answer a request the lobby read whole (or refused), then give the connection back.
    Lobbied(Box<Lobbied>),
    /// Answer a request a core read, into that core's waiting slot.
    Request {
        /// The request.
        req: Request,
        /// The core serving its connection.
        core: CoreId,
        /// Where it waits there.
        slot: u64,
    },
}

/// A connection from the lobby with the request it read.
pub struct Lobbied {
    conn: Held,
    req: Result<Request, Refusal>,
}

/// How a pool thread gives the lobby back a connection it answered: the queue, and the bell
/// that wakes the acceptor's `poll(2)` to take it.
struct GiveBack {
    queue: Sender<Held>,
    bell: UnixStream,
}

impl GiveBack {
    fn give(&self, conn: Held) {
        // A full queue means the lobby is full too: the connection closes, as a new one would
        // be refused.
        if self.queue.try_send(conn).is_ok() {
            // Non-blocking: a full bell has rung already.
            let _ = (&self.bell).write(&[1]);
        }
    }
}

/// Binds the admin listener with a backlog as deep as the connections the cores take: the
/// one accepting thread hands each on, and a burst of probes or clients must not meet SYN
/// drops and a retry a second later.
pub fn bind(addr: std::net::SocketAddr) -> std::io::Result<TcpListener> {
    use socket2::{Domain, Protocol, Socket, Type};
    let sock = Socket::new(Domain::for_address(addr), Type::STREAM, Some(Protocol::TCP))?;
    sock.set_reuse_address(true)?;
    sock.bind(&addr.into())?;
    sock.listen(MAX_ON_CORES as i32)?;
    Ok(sock.into())
}

/// The pool's queue: cores need its sending half before the pool exists.
pub fn pool_queue() -> (Sender<Work>, Receiver<Work>) {
    crossbeam_channel::bounded(MAX_ACTIVE)
}

/// Serves `listener`: one accepting thread hands each connection to the next core, or to the
/// pool when the cores cannot take it. The pool is a fixed set of request threads behind a
/// bounded queue (a full queue answers 503 at once), not a thread per request: spawning costs
/// more than most admin requests take.
pub fn spawn(
    listener: TcpListener,
    admin: Arc<Admin>,
    pool: (Sender<Work>, Receiver<Work>),
) -> std::io::Result<JoinHandle<()>> {
    let (tx, rx) = pool;
    let (back_tx, back_rx) = crossbeam_channel::bounded::<Held>(MAX_WAITING);
    let (bell, ringer) = UnixStream::pair()?;
    bell.set_nonblocking(true)?;
    ringer.set_nonblocking(true)?;
    let give_back = Arc::new(GiveBack {
        queue: back_tx,
        bell: ringer,
    });
    for i in 0..WORKERS {
        let rx = rx.clone();
        let admin = admin.clone();
        let give_back = give_back.clone();
        std::thread::Builder::new()
            .name(format!("fleetlink-admin-{i}"))
            .spawn(move || {
                // An answer is built here and freed on the core that writes it: mimalloc gives
                // such pages back only when this thread collects (see `heap_trim`), so after
                // a burst of requests it does, once the burst has been quiet for a while.
                let mut busy = false;
                loop {
                    let work = if busy {
                        match rx.recv_timeout(crate::heap_trim::EVERY) {
                            Ok(work) => work,
                            Err(crossbeam_channel::RecvTimeoutError::Timeout) => {
                                crate::heap_trim::collect();
                                busy = false;
                                continue;
                            }
                            Err(crossbeam_channel::RecvTimeoutError::Disconnected) => break,
                        }
                    } else {
                        match rx.recv() {
                            Ok(work) => work,
                            Err(_) => break,
                        }
                    };
                    busy = true;
                    match work {
                        Work::Lobbied(l) => {
                            if let Some(conn) = answer_lobbied(&admin, *l) {
                                give_back.give(conn);
                            }
                        }
                        Work::Request { req, core, slot } => {
                            let answer = route(&admin, &req);
                            if let Some(core) = admin.cores.get(core.0 as usize) {
                                // A full core inbox: the core answers 504 when its wait ends.
                                let _ = core.send(ToCore::AdminReply {
                                    slot,
                                    reply: Box::new(AdminReply::Http(answer)),
                                });
                            }
                        }
                    }
                }
            })?;
    }
    listener.set_nonblocking(true)?;
    std::thread::Builder::new()
        .name("fleetlink-admin".into())
        .spawn(move || {
            let on_cores = Arc::new(AtomicUsize::new(0));
            let mut next = 0usize;
            let mut lobby = Lobby::default();
            // As on the pool threads: the bytes of requests that waited here are freed here,
            // and mimalloc gives their pages back only when this thread collects. A burst of
            // stalled bodies otherwise left the lobby's 32 MiB resident for good.
            let mut busy_at: Option<Instant> = None;
            loop {
                lobby.wake_by(busy_at.map(|at| at + crate::heap_trim::EVERY));
                let woken = lobby.wait(&listener, bell.as_raw_fd());
                if !woken.is_quiet() || !lobby.is_empty() {
                    busy_at = Some(Instant::now());
                } else if busy_at.is_some_and(|at| at.elapsed() >= crate::heap_trim::EVERY) {
                    crate::heap_trim::collect();
                    busy_at = None;
                }
                for (conn, req) in woken.ready {
                    let conn = match answer_here(conn, &req) {
                        Here::Pool(conn) => conn,
                        Here::Answered(conn) => {
                            // A full lobby closes it.
                            let _ = lobby.admit(conn, Instant::now());
                            continue;
                        }
                        Here::Closed => continue,
                    };
                    let work = Work::Lobbied(Box::new(Lobbied { conn, req }));
                    if let Err(crossbeam_channel::TrySendError::Full(Work::Lobbied(l))) =
                        tx.try_send(work)
                    {
                        lobby.refuse(l.conn, Instant::now());
                    }
                }
                if woken.rung {
                    let mut drain = [0u8; 64];
                    while matches!((&bell).read(&mut drain), Ok(n) if n > 0) {}
                    for conn in back_rx.try_iter() {
                        // A full lobby closes it.
                        let _ = lobby.admit(conn, Instant::now());
                    }
                }
                if !woken.accept {
                    continue;
                }
                loop {
                    let stream = match listener.accept() {
                        Ok((stream, _)) => stream,
                        Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => break,
                        Err(_) => {
                            // Out of file descriptors, say: the error repeats until some
                            // close, and retrying at once would spin this thread on a CPU the
                            // cores need.
                            std::thread::sleep(ACCEPT_BACKOFF);
                            break;
                        }
                    };
                    let Err(stream) = to_core(&admin, &on_cores, &mut next, stream) else {
                        continue;
                    };
                    if let Err(conn) = lobby.admit(Held::new(stream), Instant::now()) {
                        lobby.refuse(conn, Instant::now());
                    }
                }
            }
        })
}

/// The 503 for a connection nothing can serve now (it closes after it).
pub(crate) fn busy_answer() -> Vec<u8> {
    response(503, "text/plain", b"busy\n", true, false, "")
}

/// What the acceptor did with a request the lobby read.
enum Here {
    /// It needs the pool.
    Pool(Held),
    /// Answered here; the connection waits for its next request.
    Answered(Held),
    /// Answered here and closed, or dropped.
    Closed,
}

/// Gives the answers that need nothing but the request (`/healthz`, 404s, 405s) on the
/// acceptor itself, so that neither a busy pool nor a slow route ever holds liveness back.
fn answer_here(mut conn: Held, req: &Result<Request, Refusal>) -> Here {
    let Ok(req) = req else {
        return Here::Pool(conn);
    };
    if command_rig(req).is_some() {
        return Here::Pool(conn);
    }
    let Some(answer) = immediate(req) else {
        return Here::Pool(conn);
    };
    let (bytes, close) = lobby_response(&mut conn, req, answer);
    // What the socket does not take at once, the lobby sends as the client reads.
    if !conn.send(&bytes, close) || (close && conn.unsent.is_empty()) {
        return Here::Closed;
    }
    Here::Answered(conn)
}

/// The bytes of `answer` to `req` on a lobby connection, counted as served, and whether the
/// connection closes after them (asked to, or served its [`MAX_PER_CONNECTION`]).
fn lobby_response(
    conn: &mut Held,
    req: &Request,
    (status, ctype, body): Answer,
) -> (Vec<u8>, bool) {
    conn.served += 1;
    let close = req.close || conn.served >= MAX_PER_CONNECTION;
    let allow = allowed_methods(&req.path);
    let bytes = response(status, ctype, &body, close, req.head_only(), allow);
    (bytes, close)
}

/// Answers a request the lobby read whole, and any whole requests pipelined behind it, writing
/// only what the socket takes at once. Returns the connection to give back to the lobby, which
/// sends the rest of an answer as the client reads and then waits for the next request; None
/// once closed.
fn answer_lobbied(admin: &Admin, l: Lobbied) -> Option<Held> {
    let Lobbied { mut conn, req } = l;
    let _ = conn.stream.set_nodelay(true);
    let mut next = Some(req);
    while let Some(req) = next.take() {
        let (bytes, close) = match req {
            Ok(req) => {
                let answer = route(admin, &req);
                lobby_response(&mut conn, &req, answer)
            }
            Err(refusal) => {
                conn.linger = true;
                conn.buf = Vec::new();
                let (status, ctype, body) = refusal.answer();
                (response(status, ctype, &body, true, false, ""), true)
            }
        };
        if !conn.send(&bytes, close) {
            return None;
        }
        // The lobby sends the rest, or reads what a refused client still sends.
        if !conn.unsent.is_empty() || conn.linger {
            return Some(conn);
        }
        if close {
            return None;
        }
        next = match parse_request(&conn.buf) {
            Parsed::Complete(req, len) => {
                conn.buf.drain(..len);
                Some(Ok(req))
            }
            Parsed::Bad(refusal) => Some(Err(refusal)),
            Parsed::Partial { .. } => None,
        };
    }
    Some(conn)
}

/// Hands a connection to the next core; gives it back when the broker drains, the cores
/// serve [`MAX_ON_CORES`] already, or the core's inbox is full.
fn to_core(
    admin: &Admin,
    on_cores: &Arc<AtomicUsize>,
    next: &mut usize,
    stream: TcpStream,
) -> Result<(), TcpStream> {
    if admin.cores.is_empty()
        || admin.draining.load(Ordering::SeqCst)
        || on_cores.load(Ordering::Relaxed) >= MAX_ON_CORES
    {
        return Err(stream);
    }
    on_cores.fetch_add(1, Ordering::Relaxed);
    let conn = OnCore {
        stream,
        ticket: Ticket(on_cores.clone()),
    };
    *next = (*next + 1) % admin.cores.len();
    let Some(core) = admin.cores.get(*next) else {
        return Err(conn.stream);
    };
    match core.send(ToCore::AdminConn(conn)) {
        Err(Full(ToCore::AdminConn(conn))) => Err(conn.stream),
        // A full queue hands back the message it was given, so nothing else comes back.
        Ok(()) | Err(Full(_)) => Ok(()),
    }
}

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
    fn get_method(&self) -> &str {
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
    /// The connection ended inside a request.
    pub const CUT_SHORT: Refusal = Refusal {
        status: 400,
        detail: "the connection ended inside a request",
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
    let (path, query) = req
        .path
        .unwrap_or("")
        .split_once('?')
        .unwrap_or((req.path.unwrap_or(""), ""));
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

/// The first four segments of a path and whether a fifth follows (Some), for matching routes
/// without allocating.
type PathParts<'a> = (
    Option<&'a str>,
    Option<&'a str>,
    Option<&'a str>,
    Option<&'a str>,
    Option<&'a str>,
);

fn path_parts(path: &str) -> PathParts<'_> {
    let mut parts = segments(path);
    (
        parts.next(),
        parts.next(),
        parts.next(),
        parts.next(),
        parts.next(),
    )
}

/// A path's segments as sent: one leading `/`, nothing trimmed or merged. `/v1/drain/` and
/// `//metrics` then name no route (an empty segment matches none), so a stray slash is a 404,
/// not the drain (operations.md: paths are matched as sent). A path without its leading `/`
/// is one empty segment: it matches nothing either.
fn segments(path: &str) -> std::str::Split<'_, char> {
    path.strip_prefix('/').unwrap_or("").split('/')
}

/// The methods a path takes, for a 405's `Allow` header (RFC 9110 §15.5.6).
pub fn allowed_methods(path: &str) -> &'static str {
    match path_parts(path) {
        (Some("v1"), Some("drain"), None, ..)
        | (Some("v1"), Some("rigs"), Some(_), Some("commands" | "kick"), None) => "POST",
        _ => "GET, HEAD",
    }
}

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

/// Counts a request closed unanswered at its deadline.
pub(crate) fn note_unfinished() {
    UNFINISHED.fetch_add(1, Ordering::Relaxed);
}

/// Counts an idle connection closed for a newer one (see `admin_lobby`).
pub(crate) fn note_evicted() {
    EVICTED.fetch_add(1, Ordering::Relaxed);
}

/// Idle connections closed for newer ones so far.
pub fn evicted() -> u64 {
    EVICTED.load(Ordering::Relaxed)
}

/// Writes `fleetlink_admin_responses_total`, one series per status,
/// `fleetlink_admin_unfinished_total` and `fleetlink_admin_idle_closed_total`.
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
}

/// The bytes of an answer; `head_only` leaves the body out (its length still said). A 405
/// names the methods `allow` (see [`allowed_methods`]).
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
    let head = format!(
        "HTTP/1.1 {status} {reason}\r\nContent-Type: {ctype}\r\nContent-Length: {}\r\n{allow}Connection: {connection}\r\n\r\n",
        body.len()
    );
    let mut out = head.into_bytes();
    if !head_only {
        out.extend_from_slice(body);
    }
    out
}

/// An HTTP answer: status, content type, body.
pub type Answer = (u16, &'static str, Vec<u8>);

/// Answers that need nothing but the request itself: `/healthz`, and the 404s and 405s. A core
/// gives them at once, so liveness never waits on the admin pool (CONTRACT.md §6: 200 while
/// the process runs). None for a request that needs the broker's state (and for commands,
/// which [`command_rig`] picks out first).
pub fn immediate(req: &Request) -> Option<Answer> {
    let parts: Vec<&str> = segments(&req.path).collect();
    match (req.get_method(), parts.as_slice()) {
        ("GET", ["healthz"]) => Some((200, "text/plain", b"ok\n".to_vec())),
        ("GET", ["readyz" | "metrics"] | ["v1", "rigs"] | ["v1", "events"])
        | ("POST", ["v1", "rigs", _, "kick"] | ["v1", "drain"]) => None,
        (
            _,
            ["healthz" | "readyz" | "metrics"]
            | ["v1", "rigs"]
            | ["v1", "rigs", _, "commands" | "kick"]
            | ["v1", "drain"]
            | ["v1", "events"],
        ) => Some(error_answer(405, "method_not_allowed")),
        _ => Some(error_answer(404, "not_found")),
    }
}

fn route(admin: &Admin, req: &Request) -> Answer {
    // The same test that sends a command POST on a core to that core's own handler.
    if let Some(rig) = command_rig(req) {
        return command(admin, rig, &req.body);
    }
    if let Some(answer) = immediate(req) {
        return answer;
    }
    let parts: Vec<&str> = segments(&req.path).collect();
    match (req.get_method(), parts.as_slice()) {
        ("GET", ["readyz"]) => readyz(admin),
        ("GET", ["metrics"]) => {
            let (snaps, asked) = snapshots(admin, false);
            // Without a core's counters a scrape would read as a counter reset, then as a
            // burst when the core answers again: no figures beat wrong ones.
            if let Some(answer) = cores_missing(admin, snaps.len(), asked) {
                return answer;
            }
            let stats = admin.bridge_stats.stats(admin.bridge.len());
            let mut text = metrics::render(&snaps, &stats, admin.draining.load(Ordering::SeqCst));
            if let Some(tls) = &admin.tls {
                let reloads = (tls.generation(), tls.failed_reloads());
                metrics::render_tls(&mut text, tls.validity(), reloads);
            }
            render_answered(&mut text);
            (200, "text/plain; version=0.0.4", text.into_bytes())
        }
        ("GET", ["v1", "rigs"]) => {
            let (snaps, asked) = snapshots(admin, true);
            // A list without a core's rigs would say they are not here.
            if let Some(answer) = cores_missing(admin, snaps.len(), asked) {
                return answer;
            }
            let mut rigs: Vec<_> = snaps.into_iter().flat_map(|s| s.rigs).collect();
            rigs.sort_by(|a, b| a.rig_id.cmp(&b.rig_id));
            // Straight to bytes: through a `Value` tree, 9,000 rigs took 18.8 ms against 10.0.
            json_answer(200, &rigs)
        }
        ("GET", ["v1", "events"]) => events(admin, &req.query),
        ("POST", ["v1", "rigs", rig, "kick"]) => kick(admin, rig),
        ("POST", ["v1", "drain"]) => {
            admin.draining.store(true, Ordering::SeqCst);
            let _ = admin.drain.try_send(());
            json_answer(202, &json!({"ok": true, "draining": true}))
        }
        _ => error_answer(404, "not_found"),
    }
}

/// `GET /v1/events?after=N&limit=M`: standalone's lifecycle events after event N (see
/// [`crate::event_log`]). In fleet mode they are on `fleetlink:events` instead.
fn events(admin: &Admin, query: &str) -> Answer {
    if admin.bridge_stats.fleet {
        let body = json!({"ok": false, "error": "not_found",
            "detail": "fleet mode: events are published on fleetlink:events"});
        return (404, "application/json", body.to_string().into_bytes());
    }
    let mut after = 0u64;
    let mut limit = event_log::PAGE_MAX;
    for pair in query.split('&').filter(|p| !p.is_empty()) {
        let parsed = match pair.split_once('=') {
            Some(("after", v)) => v.parse().map(|n| after = n).ok(),
            Some(("limit", v)) => v
                .parse()
                .ok()
                .filter(|n| (1..=event_log::PAGE_MAX).contains(n))
                .map(|n| limit = n),
            _ => None,
        };
        if parsed.is_none() {
            let body = json!({"ok": false, "error": "bad_request",
                "detail": "query: after=N (an event number, 0 for the oldest kept) and limit=1..1000"});
            return (400, "application/json", body.to_string().into_bytes());
        }
    }
    match admin.bridge_stats.event_log.lock() {
        Ok(log) => (200, "application/json", log.page_json(after, limit)),
        Err(_) => error_answer(503, "unavailable"),
    }
}

/// A refusal in the JSON every other admin error uses, so a client reads all of them alike.
fn error_answer(status: u16, error: &str) -> Answer {
    let body = json!({"ok": false, "error": error});
    (status, "application/json", body.to_string().into_bytes())
}

fn readyz(admin: &Admin) -> Answer {
    if admin.draining.load(Ordering::SeqCst) {
        return (503, "text/plain", b"draining\n".to_vec());
    }
    if let Some(why) = admin.bridge_stats.not_ready() {
        return (503, "text/plain", format!("{why}\n").into_bytes());
    }
    // Every core must answer: a wedged core is not ready.
    let (snaps, asked) = snapshots(admin, false);
    if let Some(answer) = cores_missing(admin, snaps.len(), asked) {
        return answer;
    }
    (200, "text/plain", b"ready\n".to_vec())
}

/// The 503 for an answer that needs every core when some did not answer in time. A core whose
/// inbox is full counts as not answering; while the broker drains, only the cores `asked`
/// count, since a core that has drained has stopped.
fn cores_missing(admin: &Admin, answered: usize, asked: usize) -> Option<Answer> {
    let cores = if admin.draining.load(Ordering::SeqCst) {
        asked
    } else {
        admin.cores.len()
    };
    (answered < cores).then(|| {
        let why = format!("{answered}/{cores} cores answered\n");
        (503, "text/plain", why.into_bytes())
    })
}

/// Asks every core for a snapshot; cores that do not answer in time are left out. Also says
/// how many cores were asked (not those whose inbox is full or gone).
fn snapshots(admin: &Admin, rigs: bool) -> (Vec<CoreSnapshot>, usize) {
    let (tx, rx) = crossbeam_channel::bounded(admin.cores.len());
    let asked = admin
        .cores
        .iter()
        .filter(|core| {
            core.send(ToCore::Snapshot {
                rigs,
                reply: tx.clone(),
            })
            .is_ok()
        })
        .count();
    let deadline = Instant::now() + Duration::from_secs(2);
    let mut out: Vec<CoreSnapshot> = (0..asked)
        .map_while(|_| rx.recv_deadline(deadline).ok())
        .collect();
    // A core that stopped at the end of a drain answers with the figures it stopped with.
    for core in 0..admin.cores.len() {
        if !out.iter().any(|s| s.core == core) {
            out.extend(admin.retired.get(core));
        }
    }
    out.sort_by_key(|s| s.core);
    (out, asked)
}

const NOT_AN_OBJECT: &str = r#"the body must be a JSON object: {"name": "...", "args": {...}}"#;

/// Whether a body's first JSON token opens something other than an object.
fn body_is_not_an_object(body: &[u8]) -> bool {
    body.iter().find(|b| !b.is_ascii_whitespace()) != Some(&b'{')
}

#[derive(Deserialize)]
struct CommandBody {
    name: String,
    #[serde(default)]
    args: Option<Box<RawValue>>,
    #[serde(default)]
    id: Option<String>,
    #[serde(default)]
    queue_if_offline: bool,
    #[serde(default)]
    ttl_ms: Option<u64>,
}

/// The rig of a command POST (`POST /v1/rigs/{id}/commands`), the one request a core answers
/// itself.
pub fn command_rig(req: &Request) -> Option<&str> {
    if req.method != "POST" {
        return None;
    }
    match path_parts(&req.path) {
        (Some("v1"), Some("rigs"), Some(rig), Some("commands"), None) => Some(rig),
        _ => None,
    }
}

/// The command a POST body asks for, its answer going to `reply`; or the 400 refusing it.
pub(crate) fn command_req(
    rig: &str,
    body: &[u8],
    reply: ReplyTo,
) -> Result<Box<CommandReq>, Answer> {
    let parsed: Result<CommandBody, _> = serde_json::from_slice(body);
    let id = parsed
        .as_ref()
        .ok()
        .and_then(|b| b.id.clone())
        .unwrap_or_else(new_id);
    let bad = |detail: &str| json_answer(400, &reply::error(&id, Some(rig), "bad_request", detail));
    let Some(rig_id) = RigId::parse(rig) else {
        return Err(bad("invalid rig id"));
    };
    if id.len() > CONTROL_NAME_MAX {
        return Err(bad(&format!("id longer than {CONTROL_NAME_MAX} bytes")));
    }
    // As on the command channel, where an empty id is refused too: replies and events would
    // name no command.
    if id.is_empty() {
        return Err(bad("id is empty: leave it out and the broker makes one"));
    }
    // serde takes a struct from an array of its fields too; the contract's body is an object.
    if body_is_not_an_object(body) {
        return Err(bad(NOT_AN_OBJECT));
    }
    let (body, args) = match parsed {
        Ok(mut b) if !b.name.is_empty() && b.name.len() <= crate::ids::COMMAND_NAME_MAX => {
            let args = match b.args.take() {
                None => Ok(Args::empty()),
                Some(raw) => Args::checked(raw),
            };
            match args {
                Ok(args) => (b, args),
                Err(why) => return Err(bad(&why)),
            }
        }
        Ok(_) => {
            let max = crate::ids::COMMAND_NAME_MAX;
            return Err(bad(&format!("name must be 1-{max} bytes")));
        }
        Err(e) => return Err(bad(&e.to_string())),
    };
    Ok(Box::new(CommandReq {
        id,
        rig: rig_id,
        name: body.name,
        args,
        reply,
        offline_ttl: body
            .queue_if_offline
            .then(|| crate::registry::control::offline_ttl(body.ttl_ms)),
    }))
}

/// The 503 for a command the bridge's full inbox would not take.
pub(crate) fn overloaded(id: &str, rig: &RigId) -> Answer {
    json_answer(
        503,
        &reply::error(id, Some(rig.as_str()), "overloaded", "bridge queue full"),
    )
}

fn command(admin: &Admin, rig: &str, body: &[u8]) -> Answer {
    let (tx, rx) = crossbeam_channel::bounded(1);
    let req = match command_req(rig, body, ReplyTo::Admin(tx)) {
        Ok(req) => req,
        Err(answer) => return answer,
    };
    let (id, rig) = (req.id.clone(), req.rig.clone());
    if send_command(admin, req).is_err() {
        return overloaded(&id, &rig);
    }
    let answer = rx.recv_timeout(IO_TIMEOUT).ok();
    command_answer(&id, &rig, answer)
}

/// Sends a command straight to the core of the rig's remembered connection; without a route,
/// or when that core's inbox is full, through the bridge. Err: the bridge's inbox is full too.
fn send_command(admin: &Admin, req: Box<CommandReq>) -> Result<(), ()> {
    let route = route_of(&req.rig);
    let core = route.and_then(|conn| Some((conn, admin.cores.get(conn.core().0 as usize)?)));
    let req = match core {
        Some((conn, core)) => match core.send(ToCore::Command {
            conn,
            req,
            direct: true,
        }) {
            Ok(()) => return Ok(()),
            Err(Full(ToCore::Command { req, .. })) => req,
            Err(Full(_)) => return Err(()),
        },
        None => req,
    };
    admin.bridge.send(ToBridge::Command(req)).map_err(|_| ())
}

/// The connection this thread's last command for `rig` went to.
pub(crate) fn route_of(rig: &RigId) -> Option<ConnId> {
    ROUTES.with(|r| r.borrow().get(rig).copied())
}

/// Keeps (or forgets, when the answer names no connection) this thread's route to `rig`.
fn remember(rig: &RigId, route: Option<ConnId>) {
    ROUTES.with(|r| {
        let mut routes = r.borrow_mut();
        match route {
            Some(conn) => {
                if routes.len() >= MAX_ROUTES && !routes.contains_key(rig) {
                    routes.clear();
                }
                routes.insert(rig.clone(), conn);
            }
            None => {
                routes.remove(rig);
            }
        }
    });
}

/// The HTTP answer to a command, from its answer (None: none came in time); remembers the
/// route the answer brings.
pub(crate) fn command_answer(id: &str, rig: &RigId, answer: Option<AdminAnswer>) -> Answer {
    remember(rig, answer.as_ref().and_then(|a| a.route));
    reply_answer(id, rig.as_str(), answer)
}

fn kick(admin: &Admin, rig: &str) -> Answer {
    let id = new_id();
    let Some(rig_id) = RigId::parse(rig) else {
        return json_answer(
            400,
            &reply::error(&id, Some(rig), "bad_request", "invalid rig id"),
        );
    };
    let (tx, rx) = crossbeam_channel::bounded(1);
    let msg = ToBridge::Kick {
        id: id.clone(),
        rig: rig_id.clone(),
        reply: ReplyTo::Admin(tx),
    };
    if admin.bridge.send(msg).is_err() {
        return overloaded(&id, &rig_id);
    }
    reply_answer(&id, rig, rx.recv_timeout(IO_TIMEOUT).ok())
}

/// The HTTP answer for a core's or the bridge's reply (None: none came in time).
fn reply_answer(id: &str, rig: &str, answer: Option<AdminAnswer>) -> Answer {
    match answer {
        Some(AdminAnswer { body: v, .. }) => {
            let status = match v["error"].as_str() {
                None => 200,
                Some("rig_not_connected") => 404,
                Some("bad_request") => 400,
                Some("forbidden") => 403,
                Some("seq_exhausted") => 409,
                Some(_) => 503,
            };
            json_answer(status, &v)
        }
        None => json_answer(
            504,
            &reply::error(
                id,
                Some(rig),
                "timeout",
                "no answer in time; the command may still reach the rig (it may be waiting on \
                 Redis, to be kept or forwarded to the broker that holds the rig), so look for \
                 its id in the rig's ack and result events before sending it again",
            ),
        ),
    }
}

fn json_answer<T: serde::Serialize + ?Sized>(status: u16, v: &T) -> Answer {
    let mut body = serde_json::to_vec(v).unwrap_or_default();
    body.push(b'\n');
    (status, "application/json", body)
}

/// A fresh command id (UUIDv7 text: unique and time-ordered).
pub fn new_id() -> String {
    let ms = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_millis() as u64);
    BootId::generate(ms).to_string()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::ids::CoreId;

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

    fn routes() -> usize {
        ROUTES.with(|r| r.borrow().len())
    }

    fn complete(bytes: &[u8]) -> (Request, usize) {
        match parse_request(bytes) {
            Parsed::Complete(req, len) => (req, len),
            Parsed::Partial { .. } => panic!("partial: {:?}", String::from_utf8_lossy(bytes)),
            Parsed::Bad(r) => panic!("bad ({r:?}): {:?}", String::from_utf8_lossy(bytes)),
        }
    }

    #[test]
    fn liveness_and_the_fixed_answers_need_no_broker_state() {
        let status = |head: &str| {
            let (req, _) = complete(format!("{head} HTTP/1.1\r\n\r\n").as_bytes());
            immediate(&req).map(|(status, _, _)| status)
        };
        assert_eq!(status("GET /healthz"), Some(200));
        assert_eq!(status("DELETE /healthz"), Some(405));
        assert_eq!(status("GET /v1/rigs/r1/kick"), Some(405));
        assert_eq!(status("GET /v1/rigs/r1/commands"), Some(405));
        assert_eq!(status("DELETE /v1/rigs"), Some(405));
        assert_eq!(status("GET /nope"), Some(404));
        // Under /v1/rigs only the routes exist: a 405 there would name methods it refuses.
        for unknown in [
            "GET /v1/rigs/r1",
            "HEAD /v1/rigs/r1",
            "POST /v1/rigs/r1",
            "GET /v1/rigs/r1/foo",
            "POST /v1/rigs/a/b/c",
            "POST /v1/rigs/r1/commands/x",
            // Matched as sent: a stray slash names no route (it used to be trimmed, and
            // `POST /v1/drain/` drained the broker).
            "POST /v1/drain/",
            "POST //v1/drain",
            "GET /healthz/",
            "GET //metrics",
            "GET /v1/rigs/",
            "POST /v1/rigs/r1/commands/",
            "GET /",
        ] {
            assert_eq!(status(unknown), Some(404), "{unknown}");
        }
        for stateful in [
            "GET /readyz",
            "GET /metrics",
            "GET /v1/rigs",
            "POST /v1/drain",
        ] {
            assert_eq!(status(stateful), None, "{stateful}");
        }
        assert_eq!(status("POST /v1/rigs/r1/kick"), None);
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
    fn a_405_says_which_methods_the_path_takes() {
        for (path, allow) in [
            ("/v1/drain", "POST"),
            ("/v1/rigs/r1/commands", "POST"),
            ("/v1/rigs/r1/kick", "POST"),
            ("/v1/rigs", "GET, HEAD"),
            ("/metrics", "GET, HEAD"),
        ] {
            let text = String::from_utf8(response(
                405,
                "text/plain",
                b"",
                true,
                false,
                allowed_methods(path),
            ))
            .expect("text");
            assert!(
                text.contains(&format!("\r\nAllow: {allow}\r\n")),
                "{path}: {text}"
            );
        }
        let ok =
            String::from_utf8(response(200, "text/plain", b"", true, false, "POST")).expect("text");
        assert!(!ok.contains("Allow:"), "only a 405 says it");
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

    #[test]
    fn only_a_post_to_a_rigs_commands_is_a_command() {
        let req = |method: &str, path: &str| Request {
            method: method.into(),
            path: path.into(),
            query: String::new(),
            body: Vec::new(),
            close: false,
        };
        assert_eq!(command_rig(&req("POST", "/v1/rigs/a/commands")), Some("a"));
        for (m, p) in [
            ("POST", "/v1/rigs/a/commands/"),
            ("GET", "/v1/rigs/a/commands"),
            ("POST", "/v1/rigs/a/kick"),
            ("POST", "/v1/rigs/a/commands/b"),
            ("POST", "/v2/rigs/a/commands"),
            ("POST", "/v1/rigs"),
        ] {
            assert_eq!(command_rig(&req(m, p)), None, "{m} {p}");
        }
    }

    #[test]
    fn route_memory_is_bounded_and_an_answer_without_a_route_forgets() {
        let rig = |i: usize| RigId::parse(&format!("rig-{i}")).unwrap();
        let conn = |n: u64| ConnId::new(CoreId(1), n);
        for i in 0..MAX_ROUTES {
            remember(&rig(i), Some(conn(i as u64)));
        }
        assert_eq!(routes(), MAX_ROUTES);
        // A known rig's new connection replaces its route without starting afresh.
        remember(&rig(7), Some(conn(99_999)));
        assert_eq!(
            (routes(), route_of(&rig(7))),
            (MAX_ROUTES, Some(conn(99_999)))
        );
        // One rig more than the bound: the memory starts again from it.
        remember(&rig(MAX_ROUTES), Some(conn(1)));
        assert_eq!((routes(), route_of(&rig(MAX_ROUTES))), (1, Some(conn(1))));
        // An error, a held command or a timeout names no connection: the route goes.
        remember(&rig(MAX_ROUTES), None);
        assert_eq!(routes(), 0);
    }
}
