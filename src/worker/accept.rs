//! Per-core accept loop: one SO_REUSEPORT listener, the core's share of the accept token
//! bucket and of `--max-connections`, and a bounded number of polite 503 answers.

use std::future::{poll_fn, Future};
use std::io;
use std::net::SocketAddr;
use std::os::fd::AsRawFd;
use std::pin::pin;
use std::rc::Rc;
use std::time::{Duration, Instant};

use monoio::net::{TcpListener, TcpStream};
use socket2::{Domain, Protocol, Socket, Type};

use crate::http_upgrade;
use crate::metrics::C;
use crate::worker::bucket::TokenBucket;
use crate::worker::conn;
use crate::worker::core::{Conn, Core};
use crate::worker::fd_room;
use crate::worker::listen_check;
use crate::worker::transport::Security;

/// 503 answers in flight per core; beyond it a storm's connections are closed unanswered
/// (counted as `shed`) so rejecting costs bounded memory.
const MAX_REJECTING: u32 = 1024;
/// The same for TLS, where each refusal holds a TLS session (tens of KB) through its
/// handshake.
const MAX_TLS_REJECTING: u32 = 256;

/// The core's share of the accept bucket, and of the budget for TLS refusals (`reject_tls`).
struct Buckets {
    accepts: TokenBucket,
    tls_refusals: TokenBucket,
}

/// Binds one listener per core on `addr`, all on the same port (SO_REUSEPORT lets the kernel
/// spread connections across them). Port 0 is resolved by the first bind. Unless `share`, a
/// port another process listens on is refused (see `listen_check`).
pub fn bind_listeners(
    addr: SocketAddr,
    cores: usize,
    backlog: i32,
    share: bool,
) -> io::Result<Vec<std::net::TcpListener>> {
    let mut out = Vec::with_capacity(cores);
    let mut bound = addr;
    for _ in 0..cores {
        let sock = Socket::new(
            Domain::for_address(bound),
            Type::STREAM,
            Some(Protocol::TCP),
        )?;
        sock.set_reuse_address(true)?;
        sock.set_reuse_port(true)?;
        sock.set_nonblocking(true)?;
        // Linux copies it to every accepted socket: one setsockopt per listener, not per rig.
        sock.set_nodelay(true)?;
        sock.bind(&bound.into())?;
        sock.listen(backlog)?;
        let listener: std::net::TcpListener = sock.into();
        bound = listener.local_addr()?;
        out.push(listener);
    }
    if addr.port() != 0 && !share {
        listen_check::alone_on(bound, &out)?;
    }
    Ok(out)
}

/// Accepts until the core starts draining, then drops the listener (closing it).
pub(crate) async fn run(core: Rc<Core>, listener: TcpListener) {
    let cores = core.cfg.cores as f64;
    let burst = (core.cfg.accept_burst as f64 / cores).max(1.0);
    let rate = core.cfg.accept_rate / cores;
    let mut buckets = Buckets {
        accepts: TokenBucket::new(rate, burst, Instant::now()),
        tls_refusals: TokenBucket::new(rate, burst, Instant::now()),
    };
    let fd = listener.as_raw_fd();
    let mut stopping = false;
    loop {
        let accepted = {
            let mut accept = pin!(listener.accept());
            poll_fn(|cx| {
                if !stopping && core.accept_stop.poll(cx) {
                    stopping = true;
                    // Stop listening by failing the pending accept rather than dropping it: a
                    // dropped io_uring accept that completed meanwhile would leave its socket
                    // accepted but never served (the drain's reset-after-the-window bug).
                    // SAFETY: fd is the listener this task owns.
                    unsafe { libc::shutdown(fd, libc::SHUT_RDWR) };
                }
                accept.as_mut().poll(cx)
            })
            .await
        };
        match accepted {
            Ok((stream, _peer)) if stopping => {
                // Accepted in the instant the drain began: closed now, not left hanging.
                core.metrics.inc(C::AcceptShed);
                drop(stream);
            }
            Ok((stream, _peer)) => admit(&core, &mut buckets, stream),
            Err(_) if stopping => return,
            Err(e) => {
                core.metrics.inc(C::AcceptError);
                // Out of descriptors or memory: back off instead of spinning on the error.
                let short = matches!(
                    e.raw_os_error(),
                    Some(libc::EMFILE | libc::ENFILE | libc::ENOBUFS | libc::ENOMEM)
                );
                let hint = match e.raw_os_error() {
                    Some(libc::EMFILE) => ": out of file descriptors, raise RLIMIT_NOFILE (ulimit -n, LimitNOFILE=) or set --max-connections below it (fleetlink-fe doctor --connections N)",
                    Some(libc::ENFILE) => ": the host is out of file descriptors (fs.file-max)",
                    _ => "",
                };
                note_accept_failure(&core, &format!("{e}{hint}"));
                if short {
                    monoio::time::sleep(Duration::from_millis(50)).await;
                }
            }
        }
    }
}

fn admit(core: &Rc<Core>, buckets: &mut Buckets, stream: TcpStream) {
    if fd_room::in_reserve(core.fd_ceiling, stream.as_raw_fd()) {
        return refuse_in_reserve(core, stream);
    }
    let cap = core.conn_cap.as_ref();
    if cap.is_some_and(|cap| !cap.try_take()) {
        return reject(core, buckets, stream, C::AcceptOverCapacity);
    }
    // The connection holds a place under the cap from here; an end before its task starts
    // gives it back (the task's end does otherwise).
    let give_back = || cap.inspect(|cap| cap.give_back());
    if !buckets.accepts.try_take(Instant::now()) {
        give_back();
        return reject(core, buckets, stream, C::AcceptRateLimited);
    }
    let Ok(sec) = core.new_security() else {
        give_back();
        core.metrics.inc(C::AcceptError);
        return;
    };
    core.metrics.inc(C::AcceptOk);
    core.metrics
        .connections
        .set(core.metrics.connections.get() + 1);
    spawn_conn(core, stream, sec);
}

/// Starts the task of an accepted connection.
fn spawn_conn(core: &Rc<Core>, stream: TcpStream, sec: Option<Box<Security>>) {
    let id = core.next_conn_id();
    let conn = Rc::new(Conn::new(core, id, stream.as_raw_fd()));
    {
        let mut st = conn.st.borrow_mut();
        st.sec = sec;
        let deadline = st.deadline;
        core.schedule(&mut st, deadline, id);
    }
    core.conns.borrow_mut().insert(id, conn.clone());
    let rsz = std::mem::size_of_val(&stream.readable(false));
    let task = conn::serve(core.clone(), stream, conn);
    if id.0 & 0xffff_ffff_ffff == 1 {
        log::debug!(
            "core {}: connection task {} B (readiness op {rsz} B), state {} B",
            core.id.0,
            std::mem::size_of_val(&task),
            std::mem::size_of::<crate::worker::core::ConnState>()
        );
    }
    monoio::spawn(task);
}

/// `503 Service Unavailable` with `Retry-After: 5..=15` (CONTRACT.md §2), then close.
fn reject(core: &Rc<Core>, buckets: &mut Buckets, stream: TcpStream, why: C) {
    // One result per connection: a shed one is counted as shed alone, so the results add up
    // to the connections accepted.
    if core.rejecting.get() >= MAX_REJECTING {
        core.metrics.inc(C::AcceptShed);
        return;
    }
    if core.tls.borrow().is_some() {
        return reject_tls(core, buckets, stream, why);
    }
    core.metrics.inc(why);
    core.rejecting.set(core.rejecting.get() + 1);
    let core = core.clone();
    monoio::spawn(async move {
        answer_503_and_shut(&stream);
        // Read the request (and the peer's FIN) so closing does not reset our answer away.
        conn::await_fin(
            &core,
            &stream,
            monoio::time::Instant::now() + Duration::from_secs(1),
            crate::admin::LINGER_BYTES,
        )
        .await;
        core.rejecting.set(core.rejecting.get() - 1);
    });
}

/// A rig's connection whose descriptor lies in the reserve kept for Redis and the admin API
/// (see `fd_room`): answered and closed at once, since a refusal that lingers for the rig's
/// FIN, as `reject` does, would hold the very descriptors the reserve keeps. Plain ws gets its
/// 503 (what already came of the request is read first, so the close is no reset that
/// could destroy the answer); TLS, which needs a handshake to answer, is closed unanswered.
fn refuse_in_reserve(core: &Rc<Core>, stream: TcpStream) {
    let limit = core.fd_ceiling.unwrap_or_default();
    let why = format!(
        "rig refused (503): the broker holds {limit} file descriptors or more, and keeps the \
         rest of its open-file limit for Redis and the admin API; raise RLIMIT_NOFILE \
         (ulimit -n, LimitNOFILE=), see `fleetlink-fe doctor --connections N`"
    );
    note_accept_failure(core, &why);
    if core.tls.borrow().is_some() {
        core.metrics.inc(C::AcceptShed);
        return;
    }
    core.metrics.inc(C::AcceptOverCapacity);
    answer_503_and_shut(&stream);
    let fd = stream.as_raw_fd();
    let mut scratch = [0u8; 4096];
    // SAFETY: fd is the open socket owned by `stream`, and `scratch` a writable buffer of
    // its length; non-blocking.
    unsafe {
        for _ in 0..16 {
            let n = libc::recv(
                fd,
                scratch.as_mut_ptr().cast(),
                scratch.len(),
                libc::MSG_DONTWAIT,
            );
            if n <= 0 {
                break;
            }
        }
    }
}

/// Logs a failed or refused accept, a line a second at most: a storm past the limit fails
/// thousands a second.
fn note_accept_failure(core: &Core, why: &str) {
    let line = core
        .accept_failures
        .borrow_mut()
        .note(Instant::now(), None, &why);
    if let Some(line) = line {
        log::warn!("{line}");
    }
}

/// Writes the 503 (CONTRACT.md §2) without waiting, and shuts the sending side.
fn answer_503_and_shut(stream: &TcpStream) {
    let fd = stream.as_raw_fd();
    let answer = http_upgrade::service_unavailable(http_upgrade::retry_after_s());
    // SAFETY: fd is the open socket owned by `stream`; the answer fits an empty send buffer.
    unsafe {
        libc::send(
            fd,
            answer.as_ptr().cast(),
            answer.len(),
            libc::MSG_DONTWAIT | libc::MSG_NOSIGNAL,
        );
        libc::shutdown(fd, libc::SHUT_WR);
    }
}

/// A TLS client can read a 503 only after a full handshake, so a refused connection is served
/// as far as its request (the session answers it; `ConnState::refusing`). Those handshakes
/// have a budget of their own, the accept bucket's rate and burst, so refusing a storm costs
/// at most the CPU admitting it would; past the budget a connection is closed unanswered
/// (`shed`), and its client retries as after any failed connect.
fn reject_tls(core: &Rc<Core>, buckets: &mut Buckets, stream: TcpStream, why: C) {
    if core.rejecting.get() >= MAX_TLS_REJECTING || !buckets.tls_refusals.try_take(Instant::now()) {
        core.metrics.inc(C::AcceptShed);
        return;
    }
    let Ok(Some(mut sec)) = core.new_security() else {
        core.metrics.inc(C::AcceptError);
        return;
    };
    sec.refusing = true;
    core.metrics.inc(why);
    // Counted among the refusals in flight, not the connections: the task's end gives it back.
    core.rejecting.set(core.rejecting.get() + 1);
    spawn_conn(core, stream, Some(sec));
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A second broker on a port already served is refused, not let in beside the first by
    /// SO_REUSEPORT.
    #[test]
    fn a_port_another_listener_holds_is_refused() {
        let first =
            bind_listeners("127.0.0.1:0".parse().expect("addr"), 2, 8, false).expect("bind");
        let addr = first[0].local_addr().expect("addr");
        let err = bind_listeners(addr, 2, 8, false).expect_err("the port is taken");
        assert_eq!(err.kind(), io::ErrorKind::AddrInUse, "{err}");
        assert!(err.to_string().contains("another process"), "{err}");
        // Asked for: beside the first, as a successor about to take over from it.
        let beside = bind_listeners(addr, 2, 8, true).expect("shared on purpose");
        drop((first, beside));
        // Free again once the first has closed, connections in TIME_WAIT or not.
        bind_listeners(addr, 2, 8, false).expect("the port is free again");
    }

    /// Accepted sockets must not wait on Nagle for the welcome or a command, though the core
    /// no longer sets it on each of them.
    #[test]
    fn accepted_sockets_inherit_nodelay_from_the_listener() {
        let listeners =
            bind_listeners("127.0.0.1:0".parse().expect("addr"), 1, 8, false).expect("bind");
        let listener = &listeners[0];
        listener.set_nonblocking(false).expect("blocking");
        let _client =
            std::net::TcpStream::connect(listener.local_addr().expect("addr")).expect("connect");
        let (accepted, _) = listener.accept().expect("accept");
        assert!(accepted.nodelay().expect("getsockopt"));
    }
}
