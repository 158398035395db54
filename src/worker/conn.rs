//! The only per-connection IO loop. An idle connection is this task parked on one readiness
//! op (io_uring PollAdd / epoll interest): no read buffer, no write buffer, no timer. When the
//! socket is readable it reads into the core's scratch buffer and keeps only the bytes of an
//! incomplete frame. A bare PONG does not make it readable: the sweep reads that one
//! ([`crate::worker::quiet_pong`]).

use std::future::{poll_fn, Future};
use std::pin::pin;
use std::rc::Rc;
use std::task::Poll;
use std::time::Duration;

use std::os::fd::AsRawFd;

use monoio::net::TcpStream;

use crate::metrics::C;
use crate::worker::core::{flush, recv, Conn, ConnState, Core, Phase, Upgraded};
use crate::worker::transport::{self, TlsRead, Wire};
use crate::worker::{crossed, quiet_pong, session};

/// The close reason recorded when the peer ended the TCP connection first.
const PEER_CLOSED: &str = "peer closed the connection";
/// Why a connection ended when its TLS handshake or a TLS record failed.
const TLS_FAILED: &str = "tls error";
/// A TLS error on a session whose handshake had finished: a failed handshake it is not.
const TLS_BROKEN: &str = "tls error after the handshake";

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
///
/// This future is what every idle connection holds, so its state is kept small: the rare
/// timers and the write-readiness op are boxed, the close deadline lives in the connection
/// state, and the wait is inlined rather than a separate async fn.
pub(crate) async fn serve(core: Rc<Core>, stream: TcpStream, conn: Rc<Conn>) {
    loop {
        let (read, write, until) = {
            let mut st = conn.st.borrow_mut();
            if st.echo_held && st.paused_until.is_none() {
                // Held as long as it may be: the rig's reconnect waits no longer.
                st.echo_held = false;
            }
            if st.has_output() && !st.echo_held {
                match flush(conn.fd, &mut st) {
                    Ok(true) => session::pump(&core, &conn, &mut st),
                    Ok(false) => {}
                    // The peer is gone: nothing more can be written, so drop what is queued
                    // (else the task would wait forever to write to a socket that is always
                    // "writable" with EPIPE).
                    Err(_) => {
                        st.phase = Phase::Done;
                        st.output_failed();
                    }
                }
            }
            // Released before paused input is read on: what the rig sent before our close is
            // then read as crossing it (`crossed`), with the session already in the registry.
            if matches!(st.phase, Phase::Closing | Phase::Done) && st.linger_until.is_none() {
                released(&core, &conn, &mut st);
            }
            if st.rbuf_ready && st.can_consume(core.now_ms()) {
                let buf = st.take_rbuf();
                let used = session::consume(&core, &conn, &mut st, &buf);
                keep_rest(&mut st, buf, used);
                continue;
            }
            let pending_out = st.has_output();
            if st.phase == Phase::Done && !pending_out {
                break;
            }
            // The linger is over whatever is ready (see `await_fin`: on epoll a peer that keeps
            // sending would hide the timer below).
            if st
                .linger_until
                .is_some_and(|l| (core.now_ms().wrapping_sub(l) as i32) >= 0)
            {
                break;
            }
            let read = st.phase != Phase::Done && st.can_consume(core.now_ms());
            let until = match (st.linger_until, st.paused_until) {
                (Some(a), Some(b)) => Some(if (a.wrapping_sub(b) as i32) < 0 { a } else { b }),
                (a, b) => a.or(b),
            };
            (read, pending_out && !st.echo_held, until)
        };
        let mut readable = pin!(read.then(|| stream.readable(false)));
        // Boxed: a full socket buffer is rare, so its op must not widen every idle task.
        let mut writable = write.then(|| Box::pin(stream.writable(false)));
        // Boxed: timers are rare (rate pause, close linger) and must not either.
        let mut timer = until.map(|t| {
            let ms = t.wrapping_sub(core.now_ms()) as i32;
            Box::pin(monoio::time::sleep(Duration::from_millis(ms.max(0) as u64)))
        });
        let woke = poll_fn(|cx| {
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
        .await;
        match woke {
            Woke::Readable => {
                on_readable(&core, &conn);
            }
            Woke::Writable | Woke::Notified => {}
            Woke::Timer => {
                let mut st = conn.st.borrow_mut();
                st.paused_until = None;
                let now = core.now_ms();
                if st
                    .linger_until
                    .is_some_and(|l| (now.wrapping_sub(l) as i32) >= 0)
                {
                    break;
                }
            }
            Woke::Failed => break,
        }
    }
    // Boxed: the close path's timer state must not widen every idle connection's task.
    Box::pin(finish(&core, &conn, &stream)).await;
}

/// Reads what the socket holds while the task sleeps on its readiness op: the sweep's read of
/// a PONG kept below the low-water mark ([`crate::worker::quiet_pong`]). The task is woken
/// only when what was read left it something to do; a bare PONG does not.
pub(crate) fn read_while_parked(core: &Core, conn: &Conn) {
    let n = on_readable(core, conn);
    let st = conn.st.borrow();
    if (n != 0 && n != quiet_pong::PONG_LEN)
        || st.phase != Phase::Live
        || st.has_output()
        || st.rbuf_ready
        || !st.rbuf_is_empty()
    {
        drop(st);
        conn.notify();
    }
}

/// Reads and consumes what is ready; returns how many bytes came off the socket (0 for none,
/// and for EOF or an error, which end the connection).
fn on_readable(core: &Core, conn: &Conn) -> usize {
    let mut scratch = core.scratch.borrow_mut();
    let mut st = conn.st.borrow_mut();
    let mut wire = Wire::default();
    let (n, last) = match read_some(core, conn.fd, &mut st, &mut scratch, &mut wire) {
        Ok(Some(read)) => read,
        Ok(None) => {
            // Bytes came, but no whole TLS record.
            charge_tiny_read(core, &mut st, wire.bytes, true);
            return 0;
        }
        Err(reason) => {
            input_ended(core, &mut st, reason);
            return 0;
        }
    };
    // The rig is talking: the last bytes of a message may come as small as a PONG and must not
    // wait below the mark.
    quiet_pong::lower(conn.fd, &mut st.live);
    let data = scratch.get(..n).unwrap_or_default();
    if st.rbuf_is_empty() {
        let used = session::consume(core, conn, &mut st, data);
        if let Some(rest) = data.get(used..).filter(|r| !r.is_empty()) {
            st.put_rbuf(rest.to_vec());
        }
    } else {
        let mut buf = st.take_rbuf();
        buf.extend_from_slice(data);
        let used = session::consume(core, conn, &mut st, &buf);
        keep_rest(&mut st, buf, used);
    }
    // A frame cut short, or a message whose fragments are still coming: whole 6-byte frames of
    // a fragmented message, one a segment, cost what single bytes do (review bb109).
    let unfinished = (!st.rbuf_is_empty() && !st.rbuf_ready) || !st.decoder.is_idle();
    charge_tiny_read(core, &mut st, wire.bytes, unfinished);
    if last {
        // The peer's TLS close_notify came with these bytes: it sends nothing more, and no
        // readiness will tell us, so the connection ends as at EOF.
        input_ended(core, &mut st, PEER_CLOSED);
    }
    n
}

/// Reads under this many bytes that leave input unfinished are charged (see
/// [`charge_tiny_read`]).
const TINY_READ: usize = 256;
/// What such a read takes from the connection's `--rig-rate` bucket: 1,600 of them a second
/// at the default rate once its burst is spent.
const TINY_READ_COST: f32 = 1.0 / 16.0;

/// A peer that sends its bytes a few at a time (one per TCP segment, or one per TLS record)
/// costs a wakeup and a read for each: 3 µs a byte measured, plain or TLS, against 8 ns in
/// whole segments, so one connection could keep a core busy for as long as it sent (review
/// bb108). A read of fewer than [`TINY_READ`] bytes that leaves a frame, a fragmented message,
/// a request head or a TLS record unfinished takes [`TINY_READ_COST`] of the connection's
/// bucket, in every phase,
/// and reading pauses while the bucket is empty, as over `--rig-rate`. A rig whose messages
/// come whole is never charged: a read that ends them leaves nothing unfinished.
fn charge_tiny_read(core: &Core, st: &mut ConnState, wire: usize, unfinished: bool) {
    if wire == 0 || wire >= TINY_READ || !unfinished {
        return;
    }
    st.bucket.spend(TINY_READ_COST);
    pause_while_empty(core, st);
}

/// Records read together whose plaintext averages under this many bytes are charged each.
const TINY_RECORD: usize = 16;

/// Records that come several to a read escape [`charge_tiny_read`]: 100 one-byte records make
/// a read of 2,300 bytes, yet each is decrypted on its own (about 0.5 µs a record here, review
/// bb108). After the handshake, a read that completed records averaging under [`TINY_RECORD`]
/// bytes of plaintext takes [`TINY_READ_COST`] for each. The records are counted from the
/// peer's own framing ([`transport::RecordCount`]), not estimated from the bytes: a small
/// record read with the start of a large one is one record, not the 180 the large one's
/// missing plaintext made it look like (review bb114). A rig's ordinary messages (an ack is
/// 28 bytes framed), one or several to a record, never come near it.
fn charge_tiny_records(core: &Core, st: &mut ConnState, records: usize, plain: usize) {
    if records < 2 || plain >= records.saturating_mul(TINY_RECORD) {
        return;
    }
    // Owed, not clamped at empty: a read of 4 KiB of records (what rustls takes at once) then
    // waits its own length, where the clamp would let one through per token.
    st.bucket.owe(records as f32 * TINY_READ_COST);
    pause_while_empty(core, st);
}

/// Pauses the connection's reading while its bucket is empty, as over `--rig-rate`.
fn pause_while_empty(core: &Core, st: &mut ConnState) {
    if st.echo_held {
        // Reading is over, and the deadline is the hold's, which a pause must not stretch
        // past the linger (the echo would never go).
        return;
    }
    let now = core.now_ms();
    if let Err(wait_ms) = st.bucket.ready(core.cfg.rig_rate, core.cfg.rig_burst, now) {
        core.metrics.inc(C::TinyReadsPaused);
        let until = now.wrapping_add(wait_ms);
        let later = st
            .paused_until
            .filter(|t| (t.wrapping_sub(until) as i32) > 0);
        st.paused_until = Some(later.unwrap_or(until));
        if st.phase == Phase::Live {
            // A PONG may wait behind the paused input: not the rig's miss.
            st.live.throttled = true;
        }
    }
}

/// The connection's input is over (EOF, reset, a TLS failure or close_notify): it ends, with
/// `reason` unless a close already gave one.
fn input_ended(core: &Core, st: &mut ConnState, reason: &'static str) {
    // Gone before its request head was complete: the upgrade request's result. (A failed TLS
    // handshake has its own counter; a refusal was counted at accept.)
    if st.phase == Phase::Handshake
        && st.close_code.is_none()
        && reason != TLS_FAILED
        && !st.refusing()
    {
        core.metrics.inc(C::HeadAbandoned);
    }
    if st.phase != Phase::Closing && st.close_code.is_none() {
        st.close_reason = reason.into();
    }
    st.phase = Phase::Done;
    st.drop_output();
}

/// Reads plaintext into `buf`: Ok(Some((n, last))) with n > 0 (`last`: the peer sends nothing
/// after these), Ok(None) when nothing is there yet, or Err(reason) when the connection is over
/// (EOF, reset, TLS failure).
fn read_some(
    core: &Core,
    fd: std::os::fd::RawFd,
    st: &mut ConnState,
    buf: &mut [u8],
    wire: &mut Wire,
) -> Result<Option<(usize, bool)>, &'static str> {
    let Some((tls, records)) = st
        .sec
        .as_mut()
        .and_then(|s| Some((s.tls.as_mut()?, &mut s.records)))
    else {
        return match recv(fd, buf) {
            Ok(0) => Err(PEER_CLOSED),
            Ok(n) => {
                wire.bytes = n;
                Ok(Some((n, false)))
            }
            Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => Ok(None),
            Err(_) => Err("socket error"),
        };
    };
    let was_handshaking = tls.is_handshaking();
    let read = transport::read_tls(fd, tls, records, buf, wire);
    if was_handshaking && !tls.is_handshaking() {
        // None only without a client certificate (no `--client-ca`): a certificate that
        // grants no name must not pass as one that was never asked for.
        let ids = tls
            .peer_certificates()
            .map(|_| crate::tls::peer_identities(tls));
        if let Some(sec) = st.sec.as_mut() {
            sec.peer_ids = ids;
        }
    }
    let result = match read {
        Ok(TlsRead::Data(0)) => Ok(None),
        Ok(TlsRead::Data(n)) => Ok(Some((n, false))),
        Ok(TlsRead::Last(n)) => Ok(Some((n, true))),
        Ok(TlsRead::Closed) => Err(PEER_CLOSED),
        // A client giving up mid-handshake with a close_notify has left, as at EOF there:
        // rustls raises the alert as an error, but nothing failed on our side.
        Ok(TlsRead::Failed {
            why: rustls::Error::AlertReceived(rustls::AlertDescription::CloseNotify),
            ..
        }) if was_handshaking => Err(PEER_CLOSED),
        Ok(TlsRead::Failed {
            why,
            plain_alert,
            plain_http,
        }) => {
            let now = std::time::Instant::now();
            if let Some(line) = core.tls_refusals.borrow_mut().note(now, Some(fd), &why) {
                log::warn!("{line}");
            }
            // Send the alert rustls queued, or ours where it queued none, then end; plain
            // HTTP gets an answer it can show instead.
            let tls = st.sec.as_mut().and_then(|s| s.tls.as_mut());
            if let (true, Some(tls)) = (plain_http, tls) {
                transport::send_plain_http_refusal(fd, tls);
            } else {
                if plain_alert {
                    transport::send_plain_alert(fd);
                }
                let _ = flush(fd, st);
            }
            // A session that breaks later (a bad record, a fatal alert) is counted where its
            // connection ends: an abandoned request, or a close without a close frame (1006).
            if was_handshaking {
                core.metrics.inc(C::TlsFailed);
                Err(TLS_FAILED)
            } else {
                Err(TLS_BROKEN)
            }
        }
        Err(_) => Err("socket error"),
    };
    // Handshake messages are large and carry no plaintext: only data records are counted.
    if let (false, Ok(Some((n, _)))) = (was_handshaking, &result) {
        charge_tiny_records(core, st, wire.records, *n);
    }
    // Handshake records and session tickets go out as soon as rustls has them.
    if st.has_output() {
        let _ = flush(fd, st);
    }
    result
}

/// Keeps `buf[used..]` as the connection's pending input; frees it when nothing is left so
/// idle connections hold none.
fn keep_rest(st: &mut ConnState, mut buf: Vec<u8>, used: usize) {
    if used >= buf.len() {
        return st.put_rbuf(Vec::new());
    }
    buf.drain(..used);
    st.put_rbuf(buf);
}

/// Reads and drops input until the peer's FIN (or `deadline`, or `budget` bytes), after our
/// half-close: closing a socket with unread input makes the kernel send RST, which can destroy
/// our last bytes in flight.
pub(crate) async fn await_fin(
    core: &Core,
    stream: &TcpStream,
    deadline: monoio::time::Instant,
    budget: usize,
) {
    let fd = stream.as_raw_fd();
    let mut dropped = 0usize;
    loop {
        // Checked first: on epoll a socket that keeps receiving is ready at every poll, and
        // `timeout_at` polls the read before its timer, so a peer streaming without pause
        // would never let the deadline be seen.
        if monoio::time::Instant::now() >= deadline {
            return;
        }
        let ready = monoio::time::timeout_at(deadline, stream.readable(false)).await;
        if !matches!(ready, Ok(Ok(()))) {
            return;
        }
        let mut scratch = core.scratch.borrow_mut();
        match recv(fd, &mut scratch) {
            Ok(0) => return,
            Ok(n) => {
                dropped += n;
                if dropped >= budget {
                    return;
                }
            }
            Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => {}
            Err(_) => return,
        }
    }
}

/// The longest a rig's close waits for its echo while the session's note goes to Redis: a
/// Redis that is slow or away delays the rig's reconnect by this much at most, and the note
/// then may come after its resume elsewhere (its results' ids null, as before the hold).
pub(crate) const ECHO_HOLD: Duration = Duration::from_millis(500);
// Past the linger, the connection would end with the echo never sent.
const _: () = assert!(ECHO_HOLD.as_millis() < CLOSE_LINGER.as_millis());

/// Holds the echo of the rig's close (already in the output) until the bridge says the
/// session's note is in Redis, or [`ECHO_HOLD`] has passed.
pub(crate) fn hold_echo(core: &Core, st: &mut ConnState) {
    st.echo_held = true;
    // Reading is over (the phase is Done), so the pause's deadline is free to bound the hold.
    st.paused_until = Some(core.now_ms().wrapping_add(ECHO_HOLD.as_millis() as u32));
}

/// The bridge wrote (or gave up on) the note a held echo waits for.
pub(crate) fn noted(conn: &Conn) {
    let mut st = conn.st.borrow_mut();
    if st.echo_held {
        st.echo_held = false;
        st.paused_until = None;
        drop(st);
        conn.notify();
    }
}

/// The rig is gone as far as the registry is concerned: released now, once, so a reconnect
/// is not kept waiting on this socket's close handshake; the linger for the peer's FIN starts.
pub(crate) fn released(core: &Core, conn: &Conn, st: &mut ConnState) {
    if st.linger_until.is_some() {
        return;
    }
    st.linger_until = Some(core.now_ms().wrapping_add(CLOSE_LINGER.as_millis() as u32));
    session::on_closed(core, conn, st);
}

/// Closes the TCP connection (after a half-close so the peer reads our last bytes), removes the
/// connection from the core and tells the registry.
async fn finish(core: &Core, conn: &Conn, stream: &TcpStream) {
    let (released, left_ms) = {
        let st = conn.st.borrow();
        let left = st
            .linger_until
            .map_or(CLOSE_LINGER.as_millis() as i32, |l| {
                l.wrapping_sub(core.now_ms()) as i32
            });
        (st.linger_until.is_some(), left.max(0) as u64)
    };
    let deadline = monoio::time::Instant::now() + Duration::from_millis(left_ms);
    if !released {
        // Ended without a close of ours (a readiness op failed): the rig is gone for the
        // registry now, not after the wait for a FIN below, during which the connection would
        // still take commands for a socket that is broken.
        let mut st = conn.st.borrow_mut();
        st.phase = Phase::Done;
        session::on_closed(core, conn, &mut st);
    }
    let fd = conn.fd;
    if let Some(sec) = conn.st.borrow_mut().sec.as_mut().filter(|s| !s.output_dead) {
        if let Some(tls) = sec.tls.as_mut() {
            transport::send_close_notify(fd, tls);
        }
    }
    // SAFETY: fd is this task's open socket.
    unsafe { libc::shutdown(fd, libc::SHUT_WR) };
    // Only our own marker counts (borrowed): a rig's close reason is owned text and may say
    // anything, these very words included.
    let peer_closed = matches!(
        &conn.st.borrow().close_reason,
        std::borrow::Cow::Borrowed(r) if *r == PEER_CLOSED
    );
    if !peer_closed {
        // Read and drop until the peer's FIN so our close frame or HTTP answer is not reset.
        // Unbounded in bytes once upgraded: a rig closed for a message over `--max-message`
        // may still be sending the rest of it, and must read the 1009 that says why. A
        // refused request is bounded as the accept's 503 is.
        let budget = match conn.st.borrow().upgraded {
            Upgraded::Rig | Upgraded::Echo => usize::MAX,
            Upgraded::Not => crate::admin::LINGER_BYTES,
        };
        await_fin(core, stream, deadline, budget).await;
    }
    core.conns.borrow_mut().remove(&conn.id);
    crossed::forget(core, conn.id);
    if conn.st.borrow().refusing() {
        // A refusal held no place under the cap and was never counted as a connection.
        core.rejecting.set(core.rejecting.get().saturating_sub(1));
    } else {
        core.metrics
            .connections
            .set(core.metrics.connections.get().saturating_sub(1));
        if let Some(cap) = &core.conn_cap {
            cap.give_back();
        }
    }
    conn.st.borrow_mut().phase = Phase::Done;
    core.check_drained();
}
