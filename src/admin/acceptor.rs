//! The admin listener's one accepting thread, the pool of request threads behind it, and how a
//! connection passes between them, the cores and the lobby.
//!
//! Apart from the routes because this part owns threads and sockets, not answers: it decides
//! who serves each connection (a core while the cores can take more, else the lobby and the
//! pool) so that a slow route, a slow client or a full pool never holds the acceptor or a core.

use std::io::{Read, Write};
use std::net::{TcpListener, TcpStream};
use std::os::fd::AsRawFd;
use std::os::unix::net::UnixStream;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use crossbeam_channel::{Receiver, Sender};

use super::commands::command_rig;
use super::http::{parse_request, response, Answer, Parsed, Refusal, Request};
use super::lobby::{Held, Lobby, MAX_WAITING};
use super::routes::{allowed_methods, immediate, route};
use super::{Admin, MAX_ON_CORES, MAX_PER_CONNECTION};
use crate::doorbell::Full;
use crate::ids::CoreId;
use crate::registry::msg::{AdminReply, ToCore};

/// Admin requests waiting for a request thread; more get 503 at once.
const MAX_ACTIVE: usize = 64;
/// Request threads. Requests that wait on a core or the bridge hold one for up to `IO_TIMEOUT`.
const WORKERS: usize = 8;
/// The admin acceptor's pause after a failed accept.
const ACCEPT_BACKOFF: Duration = Duration::from_millis(50);

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
        // Never full: the queue holds as many as the lobby, and at most the pool's queue and
        // threads hold connections away from it.
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
                // a burst of requests it does, once the burst has been quiet for a while, and
                // again at 3, 9, 27 and 81 times that: an answer read slowly (a long rig list
                // to a slow client) is freed long after the burst, and its pages stayed held
                // until the next request.
                let mut quiet_collects: Option<u32> = None;
                loop {
                    let work = if let Some(k) = quiet_collects.filter(|k| *k < 5) {
                        match rx.recv_timeout(crate::heap_trim::EVERY * 3u32.pow(k)) {
                            Ok(work) => work,
                            Err(crossbeam_channel::RecvTimeoutError::Timeout) => {
                                crate::heap_trim::collect();
                                quiet_collects = Some(k + 1);
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
                    quiet_collects = Some(0);
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
                        // Closed only when its answer's bytes would pass the lobby's bound.
                        let _ = lobby.take_back(conn, Instant::now());
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
