//! The only per-connection IO loop. An idle connection is this task parked on one readiness
//! op (io_uring PollAdd / epoll interest): no read buffer, no write buffer, no timer. When the
//! socket is readable it reads into the core's scratch buffer and keeps only the bytes of an
//! incomplete frame.

use std::future::{poll_fn, Future};
use std::pin::pin;
use std::rc::Rc;
use std::task::Poll;
use std::time::Duration;

use monoio::net::TcpStream;

use crate::worker::core::{flush, recv, Conn, Core, Phase};
use crate::worker::session;

/// How long a closing connection waits for the peer's close frame / FIN.
const CLOSE_LINGER: Duration = Duration::from_secs(2);

enum Woke {
    Readable,
    Writable,
    Notified,
    Timer,
    Failed,
}

/// Serves one accepted connection until it closes, then tells the registry.
pub(crate) async fn serve(core: Rc<Core>, stream: TcpStream, conn: Rc<Conn>) {
    let mut linger: Option<monoio::time::Instant> = None;
    let mut released = false;
    loop {
        let (read, write, until) = {
            let mut st = conn.st.borrow_mut();
            if st.out_pos < st.out.len() {
                match flush(conn.fd, &mut st) {
                    Ok(true) => session::pump(&core, &conn, &mut st),
                    Ok(false) => {}
                    Err(_) => st.phase = Phase::Done,
                }
            }
            if st.rbuf_ready && st.can_consume(core.now_ms()) {
                let buf = std::mem::take(&mut st.rbuf);
                let used = session::consume(&core, &conn, &mut st, &buf);
                keep_rest(&mut st.rbuf, buf, used);
                continue;
            }
            let pending_out = st.out_pos < st.out.len();
            if matches!(st.phase, Phase::Closing | Phase::Done) && linger.is_none() {
                linger = Some(monoio::time::Instant::now() + CLOSE_LINGER);
                // The rig is gone as far as the registry is concerned: release now, so a
                // reconnect is not kept waiting on this socket's close handshake.
                session::on_closed(&core, &conn, &mut st);
                released = true;
            }
            if st.phase == Phase::Done && !pending_out {
                break;
            }
            let read = st.phase != Phase::Done && st.can_consume(core.now_ms());
            let paused = st.paused_until.map(|t| {
                let ms = t.wrapping_sub(core.now_ms()) as i32;
                monoio::time::Instant::now() + Duration::from_millis(ms.max(0) as u64)
            });
            let until = match (linger, paused) {
                (Some(a), Some(b)) => Some(a.min(b)),
                (a, b) => a.or(b),
            };
            (read, pending_out, until)
        };
        match wait(&stream, &conn, read, write, until).await {
            Woke::Readable => on_readable(&core, &conn),
            Woke::Writable | Woke::Notified => {}
            Woke::Timer => {
                let mut st = conn.st.borrow_mut();
                st.paused_until = None;
                if linger.is_some_and(|l| l <= monoio::time::Instant::now()) {
                    break;
                }
            }
            Woke::Failed => break,
        }
    }
    let deadline = linger.unwrap_or_else(|| monoio::time::Instant::now() + CLOSE_LINGER);
    // Boxed: the close path's timer state must not widen every idle connection's task.
    Box::pin(finish(&core, &conn, &stream, deadline, released)).await;
}

/// Waits for whichever comes first: readability (if `read`), writability (if `write`), a
/// notification from the core, or `until`.
async fn wait(
    stream: &TcpStream,
    conn: &Conn,
    read: bool,
    write: bool,
    until: Option<monoio::time::Instant>,
) -> Woke {
    let mut readable = pin!(read.then(|| stream.readable(false)));
    // Boxed: a full socket buffer is rare, so its op must not widen every idle task either.
    let mut writable = write.then(|| Box::pin(stream.writable(false)));
    // Boxed: timers are rare (rate pause, close linger) and must not grow every idle task.
    let mut timer = until.map(|t| Box::pin(monoio::time::sleep_until(t)));
    poll_fn(|cx| {
        if conn.poll_notified(cx) {
            return Poll::Ready(Woke::Notified);
        }
        if let Some(f) = readable.as_mut().as_pin_mut() {
            if let Poll::Ready(r) = f.poll(cx) {
                return Poll::Ready(if r.is_ok() {
                    Woke::Readable
                } else {
                    Woke::Failed
                });
            }
        }
        if let Some(f) = writable.as_mut() {
            if let Poll::Ready(r) = f.as_mut().poll(cx) {
                return Poll::Ready(if r.is_ok() {
                    Woke::Writable
                } else {
                    Woke::Failed
                });
            }
        }
        if let Some(t) = timer.as_mut() {
            if t.as_mut().poll(cx).is_ready() {
                return Poll::Ready(Woke::Timer);
            }
        }
        Poll::Pending
    })
    .await
}

fn on_readable(core: &Core, conn: &Conn) {
    let mut scratch = core.scratch.borrow_mut();
    let mut st = conn.st.borrow_mut();
    let n = match recv(conn.fd, &mut scratch) {
        Ok(0) => {
            // Peer closed: without a close frame that is 1006 (abnormal), unless we were
            // already closing.
            if st.phase != Phase::Closing && st.close_code.is_none() {
                st.close_reason = "peer closed the connection".into();
            }
            st.phase = Phase::Done;
            st.out = Vec::new();
            st.out_pos = 0;
            return;
        }
        Ok(n) => n,
        Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => return,
        Err(_) => {
            st.phase = Phase::Done;
            st.out = Vec::new();
            st.out_pos = 0;
            return;
        }
    };
    let data = scratch.get(..n).unwrap_or_default();
    if st.rbuf.is_empty() {
        let used = session::consume(core, conn, &mut st, data);
        if let Some(rest) = data.get(used..) {
            st.rbuf.extend_from_slice(rest);
        }
    } else {
        let mut buf = std::mem::take(&mut st.rbuf);
        buf.extend_from_slice(data);
        let used = session::consume(core, conn, &mut st, &buf);
        keep_rest(&mut st.rbuf, buf, used);
    }
}

/// Keeps `buf[used..]` as the connection's pending input; frees the buffer when nothing is
/// left so idle connections hold none.
fn keep_rest(slot: &mut Vec<u8>, mut buf: Vec<u8>, used: usize) {
    if used >= buf.len() {
        *slot = Vec::new();
        return;
    }
    buf.drain(..used);
    *slot = buf;
}

/// Closes the TCP connection (after a half-close so the peer reads our last bytes), removes the
/// connection from the core and tells the registry.
async fn finish(
    core: &Core,
    conn: &Conn,
    stream: &TcpStream,
    deadline: monoio::time::Instant,
    released: bool,
) {
    let fd = conn.fd;
    // SAFETY: fd is this task's open socket.
    unsafe { libc::shutdown(fd, libc::SHUT_WR) };
    let peer_closed = conn.st.borrow().close_reason == "peer closed the connection";
    if !peer_closed {
        // Read and drop until the peer's FIN so our close frame or HTTP answer is not reset.
        loop {
            let ready = monoio::time::timeout_at(deadline, stream.readable(false)).await;
            if !matches!(ready, Ok(Ok(()))) {
                break;
            }
            let mut scratch = core.scratch.borrow_mut();
            match recv(fd, &mut scratch) {
                Ok(0) => break,
                Ok(_) => {}
                Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => {}
                Err(_) => break,
            }
        }
    }
    core.conns.borrow_mut().remove(&conn.id);
    core.metrics
        .connections
        .set(core.metrics.connections.get().saturating_sub(1));
    {
        let mut st = conn.st.borrow_mut();
        st.phase = Phase::Done;
        if !released {
            session::on_closed(core, conn, &mut st);
        }
    }
    core.check_drained();
}
