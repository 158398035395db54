//! Admin HTTP connections served on a core (see `crate::admin`).
//!
//! A command POST is answered here: the core enqueues on the rig's connection itself when that
//! connection is one of its own, and otherwise hands the command to the connection's core or to
//! the bridge, all without blocking. The answer comes back into a slot of [`Waits`]. Any other
//! request goes to the admin pool, whose answer comes back the same way. A connection that
//! keeps commanding rigs of another core moves to that core.

use std::cell::{Cell, RefCell};
use std::collections::HashMap;
use std::future::poll_fn;
use std::os::fd::AsRawFd;
use std::rc::Rc;
use std::task::{Poll, Waker};
use std::time::{Duration, Instant};

use monoio::buf::{IoBuf, IoBufMut};
use monoio::io::{AsyncReadRent, AsyncWriteRent};

use crate::admin::{self, Answer, OnCore, Parsed, Request, Work};
use crate::doorbell::Full;
use crate::ids::CoreId;
use crate::metrics::C;
use crate::registry::msg::{AdminReply, ReplyTo, ToBridge, ToCore};
use crate::worker::core::Core;
use crate::worker::inbox;

/// Bytes asked of the socket per read.
const READ_CHUNK: usize = 4096;
/// Buffer a connection keeps between requests.
const KEEP_BUFFER: usize = 64 * 1024;
/// How long a request handed to the admin pool may take: the pool's own longest wait, and
/// time to hand its answer back.
const POOL_WAIT: Duration = Duration::from_secs(admin::IO_TIMEOUT.as_secs() + 1);
/// Bytes of unfinished requests past [`KEEP_BUFFER`] each that one core's admin connections
/// may hold together: without it, 1,024 connections trickling 1 MiB bodies held a gigabyte.
const CORE_REQUEST_BYTES: usize = 16 << 20;
/// Commands in a row taken on one other core before a connection moves there (see [`Streak`]).
const MOVE_AFTER: u32 = 16;

/// Admin requests this core waits on, by slot.
#[derive(Default)]
pub(crate) struct Waits {
    next: Cell<u64>,
    slots: RefCell<HashMap<u64, Slot>>,
}

enum Slot {
    Waiting(Option<Waker>),
    Done(AdminReply),
}

impl Waits {
    /// Opens a slot; it closes when the returned guard drops.
    fn open(&self) -> SlotGuard<'_> {
        let slot = self.next.get() + 1;
        self.next.set(slot);
        self.slots.borrow_mut().insert(slot, Slot::Waiting(None));
        SlotGuard { waits: self, slot }
    }

    /// Fills a slot and wakes its request. An answer for a closed slot (its request gave up)
    /// is dropped.
    pub(crate) fn answer(&self, slot: u64, reply: AdminReply) {
        let mut slots = self.slots.borrow_mut();
        let Some(entry) = slots.get_mut(&slot) else {
            return;
        };
        if let Slot::Waiting(Some(waker)) = std::mem::replace(entry, Slot::Done(reply)) {
            waker.wake();
        }
    }
}

struct SlotGuard<'a> {
    waits: &'a Waits,
    slot: u64,
}

impl SlotGuard<'_> {
    /// Waits for the slot's answer; None when none came within `limit`.
    async fn wait(&self, limit: Duration) -> Option<AdminReply> {
        let wait = poll_fn(|cx| {
            let mut slots = self.waits.slots.borrow_mut();
            match slots.get_mut(&self.slot) {
                Some(Slot::Waiting(waker)) => {
                    *waker = Some(cx.waker().clone());
                    Poll::Pending
                }
                Some(Slot::Done(_)) => match slots.remove(&self.slot) {
                    Some(Slot::Done(reply)) => Poll::Ready(Some(reply)),
                    _ => Poll::Ready(None),
                },
                None => Poll::Ready(None),
            }
        });
        monoio::time::timeout(limit, wait).await.ok().flatten()
    }
}

impl Drop for SlotGuard<'_> {
    fn drop(&mut self) {
        self.waits.slots.borrow_mut().remove(&self.slot);
    }
}

/// Serves one admin connection until the client closes, asks to close, sends something
/// malformed, or stays idle for the keep-alive time; or until it moves to another core.
pub(crate) async fn serve(core: Rc<Core>, conn: OnCore) {
    // The ticket counts this connection until it ends, wherever it moves.
    let (stream, mut ticket) = conn.into_parts();
    let _ = stream.set_nodelay(true);
    let Ok(mut stream) = stream
        .set_nonblocking(true)
        .and_then(|()| monoio::net::TcpStream::from_std(stream))
    else {
        return;
    };
    let mut streak = Streak::default();
    loop {
        let Ok(Some(to)) = serve_requests(&core, &mut stream, &mut streak).await else {
            return;
        };
        // The other core gets its own descriptor of the socket; ours closes with `stream`.
        // SAFETY: `stream` owns this descriptor and keeps it open for the whole call.
        let fd = unsafe { std::os::fd::BorrowedFd::borrow_raw(stream.as_raw_fd()) };
        let (Some(peer), Ok(owned)) = (core.peer(to), fd.try_clone_to_owned()) else {
            streak = Streak::stay();
            continue;
        };
        let moving = OnCore::from_parts(std::net::TcpStream::from(owned), ticket);
        match peer.send(ToCore::AdminConn(moving)) {
            Ok(()) => {
                core.metrics.inc(C::AdminConnMoved);
                return;
            }
            // That core is swamped: this one keeps the connection, for good.
            Err(Full(ToCore::AdminConn(back))) => {
                ticket = back.into_parts().1;
                streak = Streak::stay();
            }
            // A full queue hands back the message it was given, so nothing else comes back.
            Err(Full(_)) => return,
        }
    }
}

/// Consecutive commands answered from one other core: a connection that keeps commanding
/// rigs of that core moves there, where each command is enqueued without waking a core.
/// The run must be long, so that a client commanding rigs all over (a fan-out) stays put:
/// for rigs spread over two cores at random, 16 in a row from the other core is a 1-in-65,536
/// run.
#[derive(Default)]
struct Streak {
    core: Option<CoreId>,
    run: u32,
    never: bool,
}

impl Streak {
    /// Never moves.
    fn stay() -> Self {
        Self {
            never: true,
            ..Self::default()
        }
    }

    /// Counts a command taken by a connection of core `at`; Some: move to that core now.
    fn count(&mut self, here: CoreId, at: CoreId) -> Option<CoreId> {
        if at == here {
            self.core = None;
            self.run = 0;
        } else if self.core == Some(at) {
            self.run += 1;
        } else {
            self.core = Some(at);
            self.run = 1;
        }
        (!self.never && self.run >= MOVE_AFTER)
            .then_some(self.core)
            .flatten()
    }
}

/// Serves requests; Ok(Some(core)): the connection should move to `core` (nothing of the
/// client's is buffered here).
async fn serve_requests(
    core: &Rc<Core>,
    stream: &mut monoio::net::TcpStream,
    streak: &mut Streak,
) -> std::io::Result<Option<CoreId>> {
    let mut buf: Vec<u8> = Vec::new();
    let mut charge = Charge::new(&core.admin_request_bytes, CORE_REQUEST_BYTES);
    for served in 0..admin::MAX_PER_CONNECTION {
        let mut clock = admin::RequestClock::new(served > 0);
        let mut continued = false;
        let req = loop {
            match admin::parse_request(&buf) {
                Parsed::Complete(req, len) => {
                    buf.drain(..len);
                    break Ok(req);
                }
                Parsed::Bad(refusal) => break Err(refusal),
                Parsed::Partial { send_continue } => {
                    if send_continue && !std::mem::replace(&mut continued, true) {
                        write_bytes(stream, admin::CONTINUE.to_vec()).await?;
                    }
                }
            }
            let wait = clock.wait(!buf.is_empty(), Instant::now());
            buf.reserve(READ_CHUNK);
            if !charge.hold(buf.capacity()) {
                core.metrics.inc(C::AdminRequestMemoryFull);
                return refuse(core, stream, buf, charge, request_memory_full()).await;
            }
            // A read fills a Vec from its start: read into the part after what it holds.
            let (len, cap) = (buf.len(), buf.capacity());
            let read = monoio::time::timeout(wait, stream.read(buf.slice_mut(len..cap))).await;
            let Ok((res, back)) = read else {
                // Timed out: the read was cancelled with the buffer, so nothing more comes.
                if len > 0 {
                    admin::note_unfinished();
                }
                return Ok(None);
            };
            buf = back.into_inner();
            match res {
                Ok(0) if buf.is_empty() => return Ok(None),
                // The client left inside a request: nothing to answer, and no status to count
                // (an alert on 400s would fire for clients giving up).
                Ok(0) => {
                    admin::note_unfinished();
                    return Ok(None);
                }
                Ok(_) => clock.got_bytes(Instant::now()),
                Err(e) => return Err(e),
            }
        };
        let req = match req {
            Ok(req) => req,
            Err(refusal) => return refuse(core, stream, buf, charge, refusal.answer()).await,
        };
        if buf.is_empty() && buf.capacity() > KEEP_BUFFER {
            // A big request's buffer does not stay with a connection that waits for the next.
            buf = Vec::new();
            charge.hold(0);
        }
        let close = req.close || served + 1 >= admin::MAX_PER_CONNECTION;
        let head_only = req.head_only();
        let allow = admin::allowed_methods(&req.path);
        let whole_list = whole_rig_list(&req);
        // `--admin-answer-bytes`: without a bound, 40 clients reading a 17 MB rig list slowly
        // held 1.4 GB. The first is always sent, however big.
        let mut sending = Charge::new(&core.admin_answer_bytes, core.cfg.admin_answer_bytes);
        // A burst of whole-list requests would each be built before the first is charged (40
        // clients at once peaked at 15 lists for 9 sent): each reserves the last one's size
        // before it is built, and is refused unbuilt when that does not fit. A page of events
        // reserves its own length, known before it is built.
        let reserve = if whole_list {
            core.admin_list_bytes.get()
        } else {
            admin::events_answer_len(&req, &core.bridge_shared).unwrap_or(0)
        };
        let events = req.path == "/v1/events";
        let (answer, taken_at) = match sending.hold_first(reserve) {
            true => answer(core, req).await,
            false => (refuse_answer(core, events), None),
        };
        if whole_list && answer.0 == 200 {
            core.admin_list_bytes.set(answer.2.len());
        }
        let body = if head_only { 0 } else { answer.2.len() };
        // The reservation becomes the answer's own size, or the answer is refused.
        let answer = match sending.hold_first(body) {
            true => answer,
            false => refuse_answer(core, events),
        };
        write(stream, answer, close, head_only, allow).await?;
        drop(sending);
        if close {
            return Ok(None);
        }
        // Only commands a connection took count; other requests leave the run as it is.
        let to = taken_at.and_then(|at| streak.count(core.id, at));
        if to.is_some() && buf.is_empty() {
            return Ok(to);
        }
    }
    Ok(None)
}

/// Answers a request refused before it was read whole, and ends the connection. Its bytes and
/// their charge are given back before the answer goes: a refused connection that kept its share
/// while its write was in flight got the next ones refused too, until every connection of a
/// burst was refused and none held.
async fn refuse(
    core: &Core,
    stream: &mut monoio::net::TcpStream,
    buf: Vec<u8>,
    mut charge: Charge<'_>,
    answer: Answer,
) -> std::io::Result<Option<CoreId>> {
    drop(buf);
    charge.hold(0);
    write(stream, answer, true, false, "").await?;
    linger(core, stream).await;
    Ok(None)
}

/// Closes a refused connection's sending side and reads what its client still sends, until
/// the client closes, [`admin::LINGER`] runs out (see there why) or [`admin::LINGER_BYTES`]
/// have come, as a rig's connection waits for its peer's FIN: into the core's scratch buffer,
/// so lingering holds none.
async fn linger(core: &Core, stream: &mut monoio::net::TcpStream) {
    if stream.shutdown().await.is_err() {
        return;
    }
    let deadline = monoio::time::Instant::now() + admin::LINGER;
    crate::worker::conn::await_fin(core, stream, deadline, admin::LINGER_BYTES).await;
}

/// One connection's part of a core-wide bound ([`CORE_REQUEST_BYTES`] for the request it
/// reads, `--admin-answer-bytes` for the answer it writes): what it holds past [`KEEP_BUFFER`],
/// given back when the charge drops.
struct Charge<'a> {
    total: &'a Cell<usize>,
    limit: usize,
    held: usize,
}

impl<'a> Charge<'a> {
    fn new(total: &'a Cell<usize>, limit: usize) -> Self {
        Charge {
            total,
            limit,
            held: 0,
        }
    }

    /// Charges a buffer of `capacity` bytes; false (nothing charged) when that would take the
    /// core past its bound. Shrinking always succeeds.
    fn hold(&mut self, capacity: usize) -> bool {
        self.charge(capacity, false)
    }

    /// As [`Charge::hold`], but succeeds whatever the size while no other connection of the
    /// core holds any: an answer bigger than the bound (a whole rig list of a large fleet) is
    /// then sent alone rather than never.
    fn hold_first(&mut self, capacity: usize) -> bool {
        self.charge(capacity, true)
    }

    fn charge(&mut self, capacity: usize, first_fits: bool) -> bool {
        let want = capacity.saturating_sub(KEEP_BUFFER);
        let others = self.total.get() - self.held;
        let alone = first_fits && others == 0;
        if want > self.held && others + want > self.limit && !alone {
            return false;
        }
        self.total.set(others + want);
        self.held = want;
        true
    }
}

impl Drop for Charge<'_> {
    fn drop(&mut self) {
        self.total.set(self.total.get() - self.held);
    }
}

/// The answer to a request refused because this core's admin connections hold as many
/// unfinished request bytes as they may.
fn request_memory_full() -> Answer {
    overloaded("admin requests in progress hold as much memory as this core allows; retry")
}

/// A 503 `overloaded` saying which of the core's bounds refused the request.
fn overloaded(detail: &str) -> Answer {
    let body = serde_json::json!({"ok": false, "error": "overloaded", "detail": detail});
    (503, "application/json", body.to_string().into_bytes())
}

/// Whether `req` asks for every rig at once: the one answer that grows with the fleet.
fn whole_rig_list(req: &Request) -> bool {
    matches!(req.method.as_str(), "GET" | "HEAD")
        && req.path == "/v1/rigs"
        && !req.query.split('&').any(|p| p.starts_with("limit="))
}

/// Counts and answers a request refused for `--admin-answer-bytes` (`events`: one for a page
/// of events, which names its own way to ask for less).
fn refuse_answer(core: &Core, events: bool) -> Answer {
    core.metrics.inc(C::AdminAnswerMemoryFull);
    if events {
        return overloaded(
            "admin answers being sent hold as much memory as this core allows; retry, or ask \
             for fewer events with ?limit=",
        );
    }
    answer_memory_full()
}

/// The answer to a request whose answer would take this core's admin connections past what
/// they may hold in answers being sent.
fn answer_memory_full() -> Answer {
    overloaded(
        "admin answers being sent hold as much memory as this core allows; retry, or page the \
         rig list with ?limit=",
    )
}

async fn write(
    stream: &mut monoio::net::TcpStream,
    (status, ctype, body): Answer,
    close: bool,
    head_only: bool,
    allow: &str,
) -> std::io::Result<()> {
    let bytes = admin::response(status, ctype, &body, close, head_only, allow);
    // A slow client holds the answer for as long as it reads: once, not twice.
    drop(body);
    write_bytes(stream, bytes).await
}

async fn write_bytes(stream: &mut monoio::net::TcpStream, bytes: Vec<u8>) -> std::io::Result<()> {
    write_with_progress(stream, bytes, admin::IO_TIMEOUT).await
}

/// Writes all of `bytes`, giving up only when the peer takes nothing for `stall`. A deadline
/// for the whole answer, as this once had, cut a big answer (a long rig list) to a client that
/// reads steadily but slowly; the lobby keeps the same rule.
async fn write_with_progress<S: AsyncWriteRent>(
    stream: &mut S,
    bytes: Vec<u8>,
    stall: Duration,
) -> std::io::Result<()> {
    let mut buf = bytes;
    let mut sent = 0;
    while sent < buf.len() {
        let (res, rest) = monoio::time::timeout(stall, stream.write(buf.slice(sent..)))
            .await
            .map_err(|_| std::io::Error::from(std::io::ErrorKind::TimedOut))?;
        buf = rest.into_inner();
        match res? {
            0 => return Err(std::io::ErrorKind::WriteZero.into()),
            n => sent += n,
        }
    }
    Ok(())
}

/// The answer, and for a command a connection took, that connection's core.
async fn answer(core: &Rc<Core>, req: Request) -> (Answer, Option<CoreId>) {
    if let Some(rig) = admin::command_rig(&req) {
        return command(core, rig, &req.body).await;
    }
    if let Some(answer) = admin::immediate(&req) {
        return (answer, None);
    }
    // Anything else may block (snapshots of every core, this one included): a pool thread
    // works it out. Whether its answer fits the answers being sent is checked once it is
    // built: most are small (`/readyz`, `/metrics`, a kick, a page), which always fit.
    let slot = core.admin_waits.open();
    let work = Work::Request {
        req,
        core: core.id,
        slot: slot.slot,
    };
    if core.admin_pool.try_send(work).is_err() {
        return ((503, "text/plain", b"busy\n".to_vec()), None);
    }
    // Longer than the pool thread's own waits (a kick's answer, the cores' snapshots), so that
    // its answer to them, a JSON 504 for a kick, is the one the client gets.
    let answer = match slot.wait(POOL_WAIT).await {
        Some(AdminReply::Http(answer)) => answer,
        _ => (504, "text/plain", b"no answer in time\n".to_vec()),
    };
    (answer, None)
}

async fn command(core: &Rc<Core>, rig: &str, body: &[u8]) -> (Answer, Option<CoreId>) {
    let slot = core.admin_waits.open();
    let reply = ReplyTo::Core {
        core: core.id,
        slot: slot.slot,
    };
    let req = match admin::command_req(rig, body, reply) {
        Ok(req) => req,
        Err(answer) => return (answer, None),
    };
    let (id, rig) = (req.id.clone(), req.rig.clone());
    let route = admin::route_of(&rig);
    let req = match route {
        // Its connection is ours: enqueue now, as the inbox would.
        Some(conn) if conn.core() == core.id => {
            inbox::handle(
                core,
                ToCore::Command {
                    conn,
                    req,
                    direct: true,
                },
            );
            None
        }
        Some(conn) => match core.peer(conn.core()) {
            Some(peer) => match peer.send(ToCore::Command {
                conn,
                req,
                direct: true,
            }) {
                Ok(()) => None,
                // That core is swamped: the bridge takes it.
                Err(Full(ToCore::Command { req, .. })) => Some(req),
                // A full queue hands back the message it was given, so nothing else comes back.
                Err(Full(_)) => return (admin::overloaded(&id, &rig), None),
            },
            None => Some(req),
        },
        None => Some(req),
    };
    if let Some(req) = req {
        if core.push_to_bridge(ToBridge::Command(req)).is_err() {
            return (admin::overloaded(&id, &rig), None);
        }
    }
    let answer = match slot.wait(admin::IO_TIMEOUT).await {
        Some(AdminReply::Command(a)) => Some(a),
        _ => None,
    };
    let taken_at = answer
        .as_ref()
        .and_then(|a| a.route)
        .map(|conn| conn.core());
    (admin::command_answer(&id, &rig, answer), taken_at)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::registry::msg::AdminAnswer;

    fn reply(n: u64) -> AdminReply {
        AdminReply::Command(AdminAnswer {
            body: serde_json::json!({ "seq": n }),
            route: None,
        })
    }

    fn seq(r: Option<AdminReply>) -> Option<u64> {
        match r {
            Some(AdminReply::Command(a)) => a.body["seq"].as_u64(),
            _ => None,
        }
    }

    #[test]
    fn a_connection_moves_after_a_long_run_on_one_other_core_only() {
        let (here, other, third) = (CoreId(0), CoreId(1), CoreId(2));
        let mut s = Streak::default();
        for _ in 1..MOVE_AFTER {
            assert_eq!(s.count(here, other), None);
        }
        assert_eq!(s.count(here, other), Some(other));
        // A command for a rig of this core, or of a third core, starts the run again.
        let mut s = Streak::default();
        for i in 0..10 * MOVE_AFTER {
            let at = match i % 7 {
                0 => here,
                3 => third,
                _ => other,
            };
            assert_eq!(s.count(here, at), None, "command {i}");
        }
        // A connection that could not move stays, however long the run.
        let mut s = Streak::stay();
        for _ in 0..2 * MOVE_AFTER {
            assert_eq!(s.count(here, other), None);
        }
    }

    #[test]
    fn each_request_gets_its_own_answer_and_a_late_one_is_dropped() {
        let mut rt = monoio::RuntimeBuilder::<monoio::LegacyDriver>::new()
            .enable_timer()
            .build()
            .unwrap();
        rt.block_on(async {
            let waits = Waits::default();
            let (a, b) = (waits.open(), waits.open());
            // An answer before its request waits is kept for it; each goes to its own slot.
            waits.answer(b.slot, reply(2));
            assert_eq!(seq(b.wait(admin::IO_TIMEOUT).await), Some(2));
            waits.answer(a.slot, reply(1));
            assert_eq!(seq(a.wait(admin::IO_TIMEOUT).await), Some(1));
            // A request that gave up closes its slot: a late answer finds nothing.
            let c = waits.open();
            let slot = c.slot;
            drop(c);
            waits.answer(slot, reply(3));
            assert!(waits.slots.borrow().is_empty());
            drop((a, b));
            assert!(waits.slots.borrow().is_empty());
        });
    }

    #[test]
    fn a_waiting_request_wakes_when_its_answer_arrives() {
        let mut rt = monoio::RuntimeBuilder::<monoio::LegacyDriver>::new()
            .enable_timer()
            .build()
            .unwrap();
        rt.block_on(async {
            let waits = Rc::new(Waits::default());
            let w = waits.clone();
            // Slots are numbered in turn: the waiter's is the next one.
            let next = waits.open().slot + 1;
            let waiter = monoio::spawn(async move {
                let guard = w.open();
                (guard.slot, seq(guard.wait(admin::IO_TIMEOUT).await))
            });
            // Let the waiter start waiting, then answer it (without a wake it would time out).
            monoio::spawn(async {}).await;
            waits.answer(next, reply(7));
            assert_eq!(waiter.await, (next, Some(7)));
        });
    }

    /// A client that reads a big answer slowly but steadily gets all of it, however long that
    /// takes; one that stops reading is given up after the stall time.
    #[test]
    fn an_answer_past_the_bound_is_refused_unless_it_would_be_alone() {
        let total = Cell::new(0);
        let limit = 10 * KEEP_BUFFER;
        let mut big = Charge::new(&total, limit);
        assert!(big.hold_first(50 * KEEP_BUFFER), "alone, any size goes");
        assert!(!Charge::new(&total, limit).hold_first(2 * KEEP_BUFFER));
        assert!(
            Charge::new(&total, limit).hold_first(KEEP_BUFFER),
            "what a connection keeps anyway is not charged"
        );
        drop(big);
        assert_eq!(total.get(), 0);
        let mut a = Charge::new(&total, limit);
        assert!(a.hold_first(6 * KEEP_BUFFER));
        assert!(!Charge::new(&total, limit).hold_first(7 * KEEP_BUFFER));
        assert!(!Charge::new(&total, limit).hold(7 * KEEP_BUFFER));
        assert!(Charge::new(&total, limit).hold_first(6 * KEEP_BUFFER));
        assert_eq!(
            total.get(),
            5 * KEEP_BUFFER,
            "the charges dropped gave theirs back"
        );
    }

    #[test]
    fn an_answer_is_cut_only_when_the_client_stops_taking_it() {
        use std::io::Read;
        let mut rt = monoio::RuntimeBuilder::<monoio::LegacyDriver>::new()
            .enable_timer()
            .build()
            .unwrap();
        // More than loopback's socket buffers hold, so the write must wait on the reader.
        const ANSWER: usize = 24 << 20;
        let stall = Duration::from_millis(300);
        rt.block_on(async {
            let listener = monoio::net::TcpListener::bind("127.0.0.1:0").unwrap();
            let addr = listener.local_addr().unwrap();
            // 256 KiB every 20 ms: the whole answer takes well over `stall`, no gap reaches it.
            let slow = std::thread::spawn(move || {
                let mut c = std::net::TcpStream::connect(addr).unwrap();
                c.set_read_timeout(Some(Duration::from_secs(30))).unwrap();
                let (mut buf, mut got) = (vec![0u8; 256 << 10], 0);
                let t0 = Instant::now();
                while got < ANSWER {
                    let n = c.read(&mut buf).unwrap();
                    assert!(n > 0, "closed after {got} bytes");
                    got += n;
                    std::thread::sleep(Duration::from_millis(20));
                }
                t0.elapsed()
            });
            let (mut s, _) = listener.accept().await.unwrap();
            write_with_progress(&mut s, vec![7u8; ANSWER], stall)
                .await
                .unwrap();
            drop(s);
            let took = slow.join().unwrap();
            assert!(
                took > 2 * stall,
                "the reader was not slow enough to test: {took:?}"
            );

            // A client that reads nothing: the write ends when the buffers are full and the
            // stall time has passed, not later.
            let idle = std::thread::spawn(move || {
                let c = std::net::TcpStream::connect(addr).unwrap();
                c.set_read_timeout(Some(Duration::from_secs(30))).unwrap();
                let mut b = [0u8; 1];
                // Hold the socket open, unread, until the server gives up and closes it.
                let _ = c.peek(&mut b);
                c
            });
            let (mut s, _) = listener.accept().await.unwrap();
            let t0 = Instant::now();
            let err = write_with_progress(&mut s, vec![7u8; ANSWER], stall)
                .await
                .unwrap_err();
            assert_eq!(err.kind(), std::io::ErrorKind::TimedOut);
            assert!(t0.elapsed() < 10 * stall, "{:?}", t0.elapsed());
            drop(s);
            drop(idle.join().unwrap());
        });
    }
}
