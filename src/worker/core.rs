//! Per-core state (`Core`) and per-connection state (`Conn`). Neither is `Send`: a core's
//! connections live and die on its thread, so plain `Cell`/`RefCell` suffice.
//!
//! Writes to a socket happen only on its core thread and only through [`Conn::send_frame`] / [`Conn::send_raw`] (ordered,
//! one writer): bytes go straight to the kernel when nothing is queued ahead of them, and the
//! remainder waits in `out` for the connection task to flush on writability.

use std::borrow::Cow;
use std::cell::{Cell, RefCell};
use std::collections::HashMap;
use std::io;
use std::os::fd::RawFd;
use std::rc::Rc;
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::task::Waker;
use std::time::{Instant, SystemTime};

use crate::admin::Work;
use crate::config::Config;
use crate::doorbell::{Full, Mailbox};
use crate::ids::{BootId, ConnId, CoreId, RigId, Seq};
use crate::jwt::JwtVerifier;
use crate::metrics::{CoreMetrics, GroupSlot};
use crate::registry::bridge::{event_charge, BridgeShared, MAX_EVENT_BYTES};
use crate::registry::msg::{AdminReply, ToBridge, ToCore};
use crate::tls::ConfigCache;
use crate::worker::admin_conn::Waits;
use crate::worker::bucket::RigBucket;
use crate::worker::closing;
use crate::worker::crossed;
use crate::worker::queues::Queues;
use crate::worker::refusal_log::RefusalLog;
use crate::worker::session::HoldFetch;
use crate::worker::transport::{self, Security};
use crate::worker::wheel::{Tick, Wheel};
use crate::worker::ConnCap;
use crate::worker::Guard;
use crate::ws::{self, Decoder, Limits, OpCode};

/// Above this many unsent bytes a connection stops reading (so a peer that sends but does not
/// read cannot make us queue unbounded pongs or echoes).
pub(crate) const OUT_HIGH_WATER: usize = 256 * 1024;

/// One core's world.
pub(crate) struct Core {
    pub(crate) id: CoreId,
    pub(crate) cfg: &'static Config,
    /// `io_uring` or `epoll`, exported as a metric label.
    pub(crate) driver: &'static str,
    pub(crate) metrics: CoreMetrics,
    pub(crate) conns: RefCell<HashMap<ConnId, Rc<Conn>>>,
    pub(crate) wheel: RefCell<Wheel>,
    pub(crate) tick_ms: u64,
    pub(crate) started: Instant,
    /// The one read buffer of this core: every connection reads into it, then keeps only the
    /// bytes of an incomplete frame.
    pub(crate) scratch: RefCell<Box<[u8]>>,
    pub(crate) bridge: Mailbox<ToBridge>,
    /// Set when a drain starts: the accept loop stops, no new hello is taken.
    pub(crate) draining: Cell<bool>,
    /// The drain may end once no connection is left: set a moment into it
    /// ([`crate::worker::drain`]), and at its end.
    pub(crate) drain_may_end: Cell<bool>,
    /// Wakes the accept loop when a drain starts.
    pub(crate) accept_stop: LocalNotify,
    /// Wakes the inbox loop when the drain is over.
    pub(crate) done: LocalNotify,
    /// Set when a message was queued for the bridge without ringing yet.
    pub(crate) bridge_owed: LocalNotify,
    /// Set when the drain is over and every connection is gone.
    pub(crate) finished: Cell<bool>,
    next_conn: Cell<u64>,
    /// `--max-connections`, shared by every core of the broker.
    pub(crate) conn_cap: Option<Arc<ConnCap>>,
    /// The lowest descriptor a rig's connection may have no more (see `fd_room`).
    pub(crate) fd_ceiling: Option<i32>,
    /// Rejections (503) in progress, bounded so a storm cannot pile up tasks.
    pub(crate) rejecting: Cell<u32>,
    /// Fleet mode with `--session-ttl` above 0: commands are kept in Redis before they are
    /// written, and forgotten there when acked.
    pub(crate) persist: bool,
    /// This core's view of the TLS config (None: plain ws).
    pub(crate) tls: RefCell<Option<ConfigCache>>,
    /// Bearer-token verifier (None: no tokens).
    pub(crate) jwt: Option<Arc<JwtVerifier>>,
    /// Every core's inbox, this one's included (admin commands and their answers).
    pub(crate) peers: Vec<Mailbox<ToCore>>,
    /// The admin pool's queue, for admin requests a core must not block on.
    pub(crate) admin_pool: crossbeam_channel::Sender<Work>,
    /// Admin requests of this core's admin connections waiting for an answer.
    pub(crate) admin_waits: Waits,
    /// Bytes of unfinished admin requests this core's connections hold (see `admin_conn`).
    pub(crate) admin_request_bytes: Cell<usize>,
    /// Bytes of answers this core's admin connections are sending (`admin_conn`'s bound).
    pub(crate) admin_answer_bytes: Cell<usize>,
    /// The size of the last whole rig list this core's admin connections answered: what the
    /// next one reserves before it is built.
    pub(crate) admin_list_bytes: Cell<usize>,
    /// Closed sessions waiting for Redis's answer to commands they held.
    pub(crate) closing: RefCell<closing::Waiting>,
    /// Connections closed by the broker that still read what the rig sent before the close.
    pub(crate) crossed: RefCell<crossed::Closing>,
    /// Where the bytes of events queued for the bridge are counted.
    pub(crate) bridge_shared: Arc<BridgeShared>,
    /// Where this core leaves its last figures when it stops.
    pub(crate) retired: Arc<crate::metrics::Retired>,
    /// Failed TLS handshakes, logged at most once a second with the last one's reason: a rig
    /// refused for its certificate is told only the alert, so the log must say why.
    pub(crate) tls_refusals: RefCell<RefusalLog>,
    /// Hellos closed 4403, logged as the TLS failures are.
    pub(crate) identity_refusals: RefCell<RefusalLog>,
    /// Failed accepts, logged as the TLS failures are, with the fix for a full fd table.
    pub(crate) accept_failures: RefCell<RefusalLog>,
    /// Connections whose rig has held commands left in Redis (fleet mode), looked at once a
    /// second by the sweep.
    pub(crate) hold_left: RefCell<std::collections::HashSet<ConnId>>,
}

/// The queues a core sends on.
pub struct Links {
    /// The bridge's inbox.
    pub bridge: Mailbox<ToBridge>,
    /// Every core's inbox, by index (admin commands and their answers).
    pub peers: Vec<Mailbox<ToCore>>,
    /// The admin pool's queue.
    pub pool: crossbeam_channel::Sender<Work>,
    /// The bridge's figures; the cores count the bytes of the events they queue there.
    pub bridge_shared: Arc<BridgeShared>,
    /// `--max-connections`, one for the whole broker (None: no cap).
    pub conn_cap: Option<Arc<ConnCap>>,
    /// Where this core leaves its last figures when it stops.
    pub retired: Arc<crate::metrics::Retired>,
}

impl Core {
    pub(crate) fn new(
        index: usize,
        cfg: &'static Config,
        driver: &'static str,
        guard: Guard,
        links: Links,
    ) -> Self {
        let tick_ms = tick_ms(cfg);
        let horizon = [cfg.hello_timeout, cfg.ping_interval, cfg.pong_timeout]
            .iter()
            .map(|d| d.as_millis() as u64)
            .max()
            .unwrap_or(1000);
        Self {
            id: CoreId(index as u16),
            cfg,
            driver,
            metrics: CoreMetrics::default(),
            conns: RefCell::new(HashMap::new()),
            wheel: RefCell::new(Wheel::new((horizon / tick_ms) as usize + 2)),
            tick_ms,
            started: Instant::now(),
            scratch: RefCell::new(vec![0u8; 64 * 1024].into_boxed_slice()),
            bridge: links.bridge,
            draining: Cell::new(false),
            drain_may_end: Cell::new(false),
            accept_stop: LocalNotify::default(),
            done: LocalNotify::default(),
            bridge_owed: LocalNotify::default(),
            finished: Cell::new(false),
            next_conn: Cell::new(0),
            conn_cap: links.conn_cap,
            fd_ceiling: super::fd_room::ceiling(),
            rejecting: Cell::new(0),
            persist: cfg.redis.is_some() && !cfg.session_ttl.is_zero(),
            tls: RefCell::new(guard.tls.map(ConfigCache::new)),
            jwt: guard.jwt,
            peers: links.peers,
            admin_pool: links.pool,
            admin_waits: Waits::default(),
            admin_request_bytes: Cell::new(0),
            admin_answer_bytes: Cell::new(0),
            admin_list_bytes: Cell::new(0),
            closing: RefCell::new(closing::Waiting::new()),
            crossed: RefCell::new(crossed::Closing::new()),
            bridge_shared: links.bridge_shared,
            retired: links.retired,
            tls_refusals: RefCell::new(RefusalLog::tls()),
            identity_refusals: RefCell::new(RefusalLog::identity()),
            accept_failures: RefCell::new(RefusalLog::accepts()),
            hold_left: RefCell::default(),
        }
    }

    /// Core `id`'s inbox.
    pub(crate) fn peer(&self, id: CoreId) -> Option<&Mailbox<ToCore>> {
        self.peers.get(id.0 as usize)
    }

    /// Hands an admin answer to the request waiting for it in `core`'s slot `slot`.
    pub(crate) fn admin_reply(&self, core: CoreId, slot: u64, reply: AdminReply) {
        if core == self.id {
            return self.admin_waits.answer(slot, reply);
        }
        let full = self
            .peer(core)
            .map(|peer| {
                peer.send(ToCore::AdminReply {
                    slot,
                    reply: Box::new(reply),
                })
            })
            .is_some_and(|sent| sent.is_err());
        if full {
            // The request answers 504 when its wait ends.
            self.metrics.inc(crate::metrics::C::AdminAnswerDropped);
        }
    }

    /// Milliseconds since the core started (wraps after ~49 days; compare with wrapping_sub).
    pub(crate) fn now_ms(&self) -> u32 {
        self.started.elapsed().as_millis() as u32
    }

    /// Schedules the connection's next visit by the sweep, replacing any earlier entry.
    pub(crate) fn schedule(&self, st: &mut ConnState, at: Tick, id: ConnId) {
        st.live.wheel_at = self.wheel.borrow_mut().insert(at, id) as u32;
    }

    /// The current tick.
    pub(crate) fn now_tick(&self) -> Tick {
        self.started.elapsed().as_millis() as u64 / self.tick_ms
    }

    /// Ticks in `d` (at least one).
    pub(crate) fn ticks(&self, d: std::time::Duration) -> Tick {
        (d.as_millis() as u64).div_ceil(self.tick_ms).max(1)
    }

    /// The tick of a deadline `d` from now. The current tick has partly passed already, so
    /// one more: a deadline is never early (a head given 10 s got 9.5 s), and late by at most
    /// one tick.
    pub(crate) fn deadline_in(&self, d: std::time::Duration) -> Tick {
        self.now_tick() + self.ticks(d) + 1
    }

    pub(crate) fn next_conn_id(&self) -> ConnId {
        let n = self.next_conn.get() + 1;
        self.next_conn.set(n);
        ConnId::new(self.id, n)
    }

    /// Marks the core finished once a drain has emptied it.
    pub(crate) fn check_drained(&self) {
        // A closed session waiting for Redis still has its Closed to send.
        if self.draining.get()
            && self.drain_may_end.get()
            && self.conns.borrow().is_empty()
            && self.closing.borrow().is_empty()
            && !self.finished.get()
        {
            self.finished.set(true);
            self.done.notify();
        }
    }

    /// A TLS session for a new connection, when TLS is on. Err when TLS is on and no session
    /// can be started: the connection must then be closed, never served in plain text.
    pub(crate) fn new_security(&self) -> Result<Option<Box<Security>>, ()> {
        let mut cache = self.tls.borrow_mut();
        let tls = match cache.as_mut() {
            Some(cache) => match crate::tls::new_connection(cache.config().clone()) {
                Ok(conn) => Some(conn),
                Err(e) => {
                    log::warn!("tls: cannot start a session: {e}");
                    return Err(());
                }
            },
            None => None,
        };
        if tls.is_none() && self.jwt.is_none() {
            return Ok(None);
        }
        Ok(Some(Box::new(Security {
            tls,
            peer_ids: None,
            scope: None,
            token_rig: None,
            refusing: false,
            output_dead: false,
            records: Default::default(),
        })))
    }

    /// Sends to the bridge; a full bridge queue is counted and the message is dropped.
    pub(crate) fn to_bridge(&self, msg: ToBridge) -> bool {
        if self.push_to_bridge(msg).is_err() {
            self.metrics.inc(crate::metrics::C::BridgeQueueFull);
            return false;
        }
        true
    }

    /// Queues a lifecycle event for `fleetlink:events`, serialized here so that what waits in
    /// the bridge's inbox is its exact size, within [`MAX_EVENT_BYTES`]; past that, or a full
    /// inbox, it is dropped and counted like any event the bridge cannot take.
    pub(crate) fn event(&self, ev: serde_json::Value) -> bool {
        self.event_bytes(serde_json::to_vec(&ev).unwrap_or_default())
    }

    /// Whether the events waiting for the bridge are so near [`MAX_EVENT_BYTES`] that one more
    /// message from a rig on every core could pass it: rigs then wait before their next
    /// message is read, so that none is dropped at the bound.
    pub(crate) fn events_backlogged(&self) -> bool {
        let per_message = event_charge(self.cfg.max_message.saturating_add(EVENT_ENVELOPE));
        let headroom = per_message.saturating_mul(self.cfg.cores.max(1));
        self.bridge_shared.event_bytes.load(Ordering::Relaxed)
            > MAX_EVENT_BYTES.saturating_sub(headroom)
    }

    /// [`Self::event`] for the report of a held command, which in fleet mode keeps its place
    /// behind the reports still waiting for Redis (see [`ToBridge::HeldEvent`]).
    pub(crate) fn held_event(&self, ev: serde_json::Value) -> bool {
        let bytes = serde_json::to_vec(&ev).unwrap_or_default();
        self.queue_event(bytes, self.bridge_shared.fleet)
    }

    /// [`Self::event`] for an event already serialized.
    pub(crate) fn event_bytes(&self, bytes: Vec<u8>) -> bool {
        self.queue_event(bytes, false)
    }

    fn queue_event(&self, bytes: Vec<u8>, held: bool) -> bool {
        let bytes = bytes.into_boxed_slice();
        let charge = event_charge(bytes.len());
        let queued = &self.bridge_shared.event_bytes;
        if queued.fetch_add(charge, Ordering::Relaxed) + charge > MAX_EVENT_BYTES {
            queued.fetch_sub(charge, Ordering::Relaxed);
            self.metrics.inc(crate::metrics::C::BridgeQueueFull);
            return false;
        }
        let msg = match held {
            true => ToBridge::HeldEvent(bytes),
            false => ToBridge::Event(bytes),
        };
        let sent = if self.bridge_shared.fleet {
            self.to_bridge(msg)
        } else {
            // Standalone, the event only joins the list `GET /v1/events` pages through, which
            // nobody waits on: it goes with the bridge's next wake (a hello, a close, its
            // one-second timer, or enough events waiting) instead of waking it. Rung per batch
            // of acks, the otherwise idle bridge cost a third of the CPU per acked command.
            let pushed = self.bridge.push(msg).is_ok();
            let heavy = queued.load(Ordering::Relaxed) >= MAX_EVENT_BYTES / 4;
            if !pushed {
                self.metrics.inc(crate::metrics::C::BridgeQueueFull);
            } else if self.bridge.len() >= QUIET_EVENTS || heavy {
                // Many events, or large ones: rigs would soon wait on the bound.
                self.bridge_owed.notify();
            }
            pushed
        };
        if !sent {
            queued.fetch_sub(charge, Ordering::Relaxed);
            return false;
        }
        true
    }

    /// Queues for the bridge past its inbox bound (see [`crate::doorbell::Mailbox::push_owed`]):
    /// a connection's end (lost, it would leave the rig registered to a dead connection, its
    /// lease renewed and its session never parked) or control's answer to a request.
    pub(crate) fn to_bridge_owed(&self, msg: ToBridge) {
        if self.bridge.push_owed(msg).is_ok() {
            self.bridge_owed.notify();
        }
    }

    /// Queues for the bridge; the doorbell rings once the tasks that are ready now have run
    /// (see [`ring_bridge`]), so a burst of acks wakes the bridge once, not once per ack.
    pub(crate) fn push_to_bridge(&self, msg: ToBridge) -> Result<(), Full<ToBridge>> {
        self.bridge.push(msg)?;
        self.bridge_owed.notify();
        Ok(())
    }
}

/// What an event adds to the rig's message it reports (its type, ids, broker id, seq): a
/// generous bound, for [`Core::events_backlogged`]'s headroom.
const EVENT_ENVELOPE: usize = 1024;

/// Standalone events waiting in the bridge's inbox past which a core rings it after all: a
/// second of acks at full speed would outgrow the inbox's share for events.
const QUIET_EVENTS: usize = 4_096;

/// Rings the bridge's doorbell for what this core queued. Woken by the first message of a
/// batch, it runs after the tasks that were already ready, which queue the rest of it.
pub(crate) async fn ring_bridge(core: Rc<Core>) {
    loop {
        std::future::poll_fn(|cx| {
            if core.bridge_owed.poll(cx) {
                std::task::Poll::Ready(())
            } else {
                std::task::Poll::Pending
            }
        })
        .await;
        core.bridge.ring();
    }
}

/// Sweep tick: fine enough for the shortest liveness setting, never finer than 5 ms nor
/// coarser than 250 ms.
fn tick_ms(cfg: &Config) -> u64 {
    let shortest = [cfg.hello_timeout, cfg.ping_interval, cfg.pong_timeout]
        .iter()
        .map(|d| d.as_millis() as u64)
        .min()
        .unwrap_or(1000);
    (shortest / 8).clamp(5, 250)
}

/// A single-waiter, single-thread notification.
#[derive(Default)]
pub(crate) struct LocalNotify {
    waker: Cell<Option<Waker>>,
    set: Cell<bool>,
}

impl LocalNotify {
    pub(crate) fn notify(&self) {
        self.set.set(true);
        if let Some(w) = self.waker.take() {
            w.wake();
        }
    }

    /// Polls for a notification (consumes it).
    pub(crate) fn poll(&self, cx: &std::task::Context<'_>) -> bool {
        if self.set.replace(false) {
            return true;
        }
        self.waker.set(Some(cx.waker().clone()));
        false
    }
}

/// Where a connection is in its life.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Phase {
    /// Reading the HTTP request head.
    Handshake,
    /// Upgraded on /agent; waiting for the hello.
    AwaitHello,
    /// Hello sent to the registry; waiting for its verdict.
    AwaitVerdict,
    /// Welcomed rig.
    Live,
    /// /echo (conformance): no hello, no pings.
    Echo,
    /// Close frame queued/sent; waiting for the peer's close.
    Closing,
    /// Finished; the task drops the socket.
    Done,
}

/// A rig's session on this connection (allocated at hello). Every idle rig holds one, so it is
/// kept to 128 bytes: times as unix ms, "none" as 0, the group derived from the labels.
pub(crate) struct Session {
    pub(crate) rig: RigId,
    pub(crate) boot: BootId,
    /// Protocol version the rig spoke.
    pub(crate) v: u32,
    /// The registry accepted the hello and `welcome` went out.
    pub(crate) welcomed: bool,
    /// Where the metrics count this rig's group (`--group-label`), from the welcome on.
    pub(crate) group: GroupSlot,
    /// What is left of the rig's offline hold in Redis (fleet mode).
    pub(crate) hold: HoldFetch,
    pub(crate) labels: Box<[(String, String)]>,
    pub(crate) next_seq: Seq,
    pub(crate) last_ack: Seq,
    /// Unix ms of the last ack (0: none yet).
    pub(crate) last_ack_ms: u64,
    /// Unix ms of the hello.
    pub(crate) connected_ms: u64,
    /// The hello's `last_seq` (0: none): carried commands up to it are already on the rig.
    pub(crate) resume_from: Seq,
    /// Command queues, allocated only while a command is in flight (idle rigs hold none).
    pub(crate) queues: Option<Box<Queues>>,
}

/// Unix ms now.
pub(crate) fn unix_ms() -> u64 {
    SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_millis() as u64)
}

/// A unix-ms stamp as a time (None for 0, "never").
pub(crate) fn stamp(ms: u64) -> Option<SystemTime> {
    (ms > 0).then(|| std::time::UNIX_EPOCH + std::time::Duration::from_millis(ms))
}

impl Session {
    /// The value of the metrics grouping label, if the rig declared it.
    pub(crate) fn group(&self, label: &str) -> Option<&str> {
        self.labels
            .iter()
            .find(|(k, _)| k == label)
            .map(|(_, v)| v.as_str())
    }

    /// The queues, allocated on first use.
    pub(crate) fn queues(&mut self) -> &mut Queues {
        self.queues.get_or_insert_with(Box::default)
    }

    /// Commands queued and not yet written.
    pub(crate) fn outbox_len(&self) -> usize {
        self.queues
            .as_ref()
            .map_or(0, |q| q.outbox().iter().filter(|c| !c.held).count())
    }

    /// Commands the session holds for the rig: queued (those waiting for Redis too) and written
    /// but unacked, what its next connection would be given.
    pub(crate) fn commands_len(&self) -> usize {
        self.queues
            .as_ref()
            .map_or(0, |q| q.outbox().len() + q.unacked().len())
    }

    /// Whether it keeps ids of acked commands for their results.
    pub(crate) fn awaits_results(&self) -> bool {
        self.queues.as_ref().is_some_and(|q| q.awaits_results())
    }

    /// Commands still waiting for Redis to keep them (fleet mode).
    pub(crate) fn held_len(&self) -> usize {
        self.queues
            .as_ref()
            .map_or(0, |q| q.outbox().iter().filter(|c| c.held).count())
    }

    /// Frees the queues once nothing is in flight, and their lines' room once only ids
    /// awaiting results are left.
    pub(crate) fn shrink_queues(&mut self) {
        if self.queues.as_ref().is_some_and(|q| q.is_empty()) {
            self.queues = None;
        } else if let Some(q) = self.queues.as_mut() {
            q.release_lines();
        }
    }
}

/// Liveness and the sweep's bookkeeping, in ticks.
#[derive(Debug, Clone, Copy, Default)]
pub(crate) struct Liveness {
    pub(crate) last_ping: Tick,
    pub(crate) awaiting_pong: bool,
    pub(crate) missed: u8,
    /// The socket's low-water mark is raised so a bare PONG waits for the sweep
    /// ([`crate::worker::quiet_pong`]); the sweep then visits at the PONG deadline.
    pub(crate) pong_hidden: bool,
    /// The rate bucket held back this rig's input since the PING: its PONG may be waiting
    /// behind messages the broker declined to read, so a PONG missing at the deadline is the
    /// broker's doing, not a miss (CONTRACT.md §2: a rig over its rate is never dropped).
    pub(crate) throttled: bool,
    /// The tick of this connection's current wheel entry. Each phase schedules its own
    /// deadline; an entry visited at any other tick was overtaken by a later one and is dropped,
    /// so a connection keeps one entry and one visit per deadline, not one per phase it passed.
    /// Its low 32 bits suffice (kept small: every idle connection holds this): entries lie
    /// within the wheel's horizon, far fewer than 2^32 ticks apart.
    pub(crate) wheel_at: u32,
}

/// Where a connection was upgraded.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
pub(crate) enum Upgraded {
    /// Not (yet): an HTTP request.
    Not,
    /// `/agent`: a rig, held to `--rig-rate` from its upgrade to its last read.
    Rig,
    /// `/echo` (conformance suites): no rig and no `--rig-rate`, closing included.
    Echo,
}

/// The mutable state of one connection.
pub(crate) struct ConnState {
    pub(crate) phase: Phase,
    /// Whether and where the upgrade was answered 101: how the connection ends is then a
    /// websocket close (for `fleetlink_closes_total`), not a refused or abandoned HTTP request.
    pub(crate) upgraded: Upgraded,
    pub(crate) decoder: Decoder,
    /// Partial input and unsent output; None (no allocation at all) while idle.
    pub(crate) bufs: Option<Box<Bufs>>,
    pub(crate) session: Option<Box<Session>>,
    pub(crate) live: Liveness,
    /// Tick by which the head / hello / verdict must have arrived.
    pub(crate) deadline: Tick,
    pub(crate) bucket: RigBucket,
    /// Core clock (ms) until which reading is paused because the rig is over its rate.
    pub(crate) paused_until: Option<u32>,
    /// Core clock (ms) by which a closing connection is dropped, set when closing starts (and
    /// then the registry has been told).
    pub(crate) linger_until: Option<u32>,
    /// `rbuf` holds input that was left unprocessed on purpose (paused), not a partial frame.
    pub(crate) rbuf_ready: bool,
    /// The echo of the rig's close waits in the output until the bridge has written the
    /// session's note into Redis (`ToCore::Noted`), or until `paused_until`, which bounds the
    /// wait (reading is over by then): see [`crate::worker::conn::ECHO_HOLD`].
    pub(crate) echo_held: bool,
    /// TLS session and token scope; None on plain, token-less connections.
    pub(crate) sec: Option<Box<Security>>,
    /// Close code we sent (or echoed), for metrics and events.
    pub(crate) close_code: Option<u16>,
    pub(crate) close_reason: Cow<'static, str>,
}

/// A connection as its core sees it.
pub(crate) struct Conn {
    pub(crate) id: ConnId,
    pub(crate) fd: RawFd,
    pub(crate) st: RefCell<ConnState>,
    waker: Cell<Option<Waker>>,
    woken: Cell<bool>,
}

impl Conn {
    pub(crate) fn new(core: &Core, id: ConnId, fd: RawFd) -> Self {
        let limits = Limits {
            max_message: core.cfg.max_message,
            max_fragments: 1024,
        };
        Self {
            id,
            fd,
            st: RefCell::new(ConnState {
                phase: Phase::Handshake,
                upgraded: Upgraded::Not,
                decoder: Decoder::new(limits),
                bufs: None,
                session: None,
                live: Liveness::default(),
                deadline: core.deadline_in(core.cfg.hello_timeout),
                bucket: RigBucket::full(core.cfg.rig_burst, core.now_ms()),
                paused_until: None,
                linger_until: None,
                rbuf_ready: false,
                echo_held: false,
                sec: None,
                close_code: None,
                close_reason: Cow::Borrowed(""),
            }),
            waker: Cell::new(None),
            woken: Cell::new(false),
        }
    }

    /// Wakes the connection task (it re-checks its state: output to flush, close to finish).
    pub(crate) fn notify(&self) {
        self.woken.set(true);
        if let Some(w) = self.waker.take() {
            w.wake();
        }
    }

    /// For the task: consumes a pending notification, or registers to be woken.
    pub(crate) fn poll_notified(&self, cx: &std::task::Context<'_>) -> bool {
        if self.woken.replace(false) {
            return true;
        }
        let w = self.waker.take();
        match w {
            Some(w) if w.will_wake(cx.waker()) => self.waker.set(Some(w)),
            _ => self.waker.set(Some(cx.waker().clone())),
        }
        false
    }

    /// Queues one server frame behind anything already queued and tries to write now.
    pub(crate) fn send_frame(&self, st: &mut ConnState, op: OpCode, payload: &[u8]) {
        ws::encode_frame(st.out(), op, payload);
        self.flush_or_wake(st);
    }

    /// Queues raw bytes (HTTP responses) and tries to write now.
    pub(crate) fn send_raw(&self, st: &mut ConnState, bytes: &[u8]) {
        st.out().extend_from_slice(bytes);
        self.flush_or_wake(st);
    }

    fn flush_or_wake(&self, st: &mut ConnState) {
        match flush(self.fd, st) {
            Ok(true) => {}
            // The task waits for writability (or sees the error) once woken.
            Ok(false) | Err(_) => self.notify(),
        }
    }

    /// Starts the close handshake with `code` (RFC 6455 §7.1.2). The task finishes it.
    pub(crate) fn close(
        &self,
        st: &mut ConnState,
        code: u16,
        reason: impl Into<Cow<'static, str>>,
    ) {
        match st.phase {
            Phase::Closing | Phase::Done => return,
            Phase::Handshake => {
                st.phase = Phase::Done;
                self.notify();
                return;
            }
            _ => {}
        }
        // The peer's close reply may be a bare 6-byte frame: it must wake us.
        crate::worker::quiet_pong::lower(self.fd, &mut st.live);
        let reason = reason.into();
        let mut frame = Vec::new();
        ws::encode_close(&mut frame, code, &reason);
        st.out().extend_from_slice(&frame);
        st.close_code = Some(code);
        st.close_reason = reason;
        st.phase = Phase::Closing;
        let _ = flush(self.fd, st);
        self.notify();
    }
}

/// Writes as much of `st.out` as the kernel takes (through TLS when the connection has it).
/// Ok(true) when all of it went out.
pub(crate) fn flush(fd: RawFd, st: &mut ConnState) -> io::Result<bool> {
    let tls = st.sec.as_mut().and_then(|s| s.tls.as_mut());
    let Some(b) = st.bufs.as_mut() else {
        // No plaintext waiting; TLS may still hold records (a handshake, an alert).
        return match tls {
            Some(tls) => transport::flush_tls(fd, tls, &[], &mut 0),
            None => Ok(true),
        };
    };
    let done = match tls {
        Some(tls) => transport::flush_tls(fd, tls, &b.out, &mut b.out_pos)?,
        None => flush_plain(fd, &b.out, &mut b.out_pos)?,
    };
    if b.out_pos >= b.out.len() {
        b.out = Vec::new();
        b.out_pos = 0;
        st.tidy();
    }
    Ok(done)
}

fn flush_plain(fd: RawFd, out: &[u8], pos: &mut usize) -> io::Result<bool> {
    while *pos < out.len() {
        let rest = out.get(*pos..).unwrap_or_default();
        // SAFETY: `rest` is a valid initialized slice; fd is owned by the live connection task
        // (the table entry, and with it this call, is removed before the socket is dropped).
        let n = unsafe {
            libc::send(
                fd,
                rest.as_ptr().cast(),
                rest.len(),
                libc::MSG_DONTWAIT | libc::MSG_NOSIGNAL,
            )
        };
        if n < 0 {
            let err = io::Error::last_os_error();
            return match err.kind() {
                io::ErrorKind::WouldBlock => Ok(false),
                io::ErrorKind::Interrupted => continue,
                _ => Err(err),
            };
        }
        *pos += n as usize;
    }
    Ok(true)
}

/// Reads what is ready into `buf`. Ok(0) is EOF; WouldBlock means nothing (yet).
pub(crate) fn recv(fd: RawFd, buf: &mut [u8]) -> io::Result<usize> {
    loop {
        // SAFETY: `buf` is a valid writable slice; see `flush` for fd validity.
        let n = unsafe { libc::recv(fd, buf.as_mut_ptr().cast(), buf.len(), libc::MSG_DONTWAIT) };
        if n >= 0 {
            return Ok(n as usize);
        }
        let err = io::Error::last_os_error();
        if err.kind() != io::ErrorKind::Interrupted {
            return Err(err);
        }
    }
}

/// A connection's buffers, boxed together so an idle connection pays one null pointer.
#[derive(Default)]
pub(crate) struct Bufs {
    /// Unparsed input (a partial head or frame).
    pub(crate) rbuf: Vec<u8>,
    /// Unsent output, from `out_pos` on.
    pub(crate) out: Vec<u8>,
    pub(crate) out_pos: usize,
}

impl ConnState {
    /// The output buffer (allocated on first use).
    pub(crate) fn out(&mut self) -> &mut Vec<u8> {
        &mut self.bufs.get_or_insert_with(Box::default).out
    }

    /// Refused at accept and served only to hand its 503 through TLS (`accept::reject`).
    pub(crate) fn refusing(&self) -> bool {
        self.sec.as_ref().is_some_and(|s| s.refusing)
    }

    /// Whether the connection runs over TLS.
    pub(crate) fn has_tls(&self) -> bool {
        self.sec.as_ref().is_some_and(|s| s.tls.is_some())
    }

    /// Output bytes not yet sent.
    pub(crate) fn unsent(&self) -> usize {
        self.bufs
            .as_ref()
            .map_or(0, |b| b.out.len().saturating_sub(b.out_pos))
    }

    /// Forgets unsent output (the connection is over).
    pub(crate) fn drop_output(&mut self) {
        if let Some(b) = self.bufs.as_mut() {
            b.out = Vec::new();
            b.out_pos = 0;
        }
        self.tidy();
    }

    /// A write failed: the socket takes nothing more, so what is queued is dropped, and so is
    /// what rustls holds, which no flush would ever empty.
    pub(crate) fn output_failed(&mut self) {
        if let Some(sec) = self.sec.as_mut() {
            sec.output_dead = true;
        }
        self.drop_output();
    }

    /// Takes the pending input out (to parse it alongside new bytes).
    pub(crate) fn take_rbuf(&mut self) -> Vec<u8> {
        self.bufs
            .as_mut()
            .map(|b| std::mem::take(&mut b.rbuf))
            .unwrap_or_default()
    }

    /// Puts pending input back (empty: nothing pending).
    pub(crate) fn put_rbuf(&mut self, rbuf: Vec<u8>) {
        if rbuf.is_empty() {
            if let Some(b) = self.bufs.as_mut() {
                b.rbuf = Vec::new();
            }
            self.tidy();
        } else {
            self.bufs.get_or_insert_with(Box::default).rbuf = rbuf;
        }
    }

    /// Whether input is pending.
    pub(crate) fn rbuf_is_empty(&self) -> bool {
        self.bufs.as_ref().is_none_or(|b| b.rbuf.is_empty())
    }

    /// Frees the buffers once both are empty.
    fn tidy(&mut self) {
        if self
            .bufs
            .as_ref()
            .is_some_and(|b| b.rbuf.is_empty() && b.out.is_empty())
        {
            self.bufs = None;
        }
    }

    /// Bytes (or TLS records) still waiting to go out.
    pub(crate) fn has_output(&self) -> bool {
        self.unsent() > 0
            || self
                .sec
                .as_ref()
                .is_some_and(|s| !s.output_dead && s.tls.as_ref().is_some_and(|t| t.wants_write()))
    }

    /// Whether input may be parsed now (not waiting for a verdict, not over the rate, not
    /// backed up on output, not finished).
    pub(crate) fn can_consume(&self, now_ms: u32) -> bool {
        let paused = self
            .paused_until
            .is_some_and(|t| (t.wrapping_sub(now_ms) as i32) > 0);
        !paused
            && !matches!(self.phase, Phase::AwaitVerdict | Phase::Done)
            && self.unsent() < OUT_HIGH_WATER
    }
}

#[cfg(test)]
pub(crate) mod tests {
    use std::io::Read;

    use super::*;
    use crate::doorbell;

    /// A core of one, without TLS or tokens, whose bridge is `bridge`.
    pub(crate) fn test_core(bridge: Mailbox<ToBridge>) -> Rc<Core> {
        let guard = Guard {
            tls: None,
            jwt: None,
        };
        let links = Links {
            bridge,
            peers: Vec::new(),
            pool: crate::admin::pool_queue().0,
            bridge_shared: Arc::new(BridgeShared::new(true)),
            conn_cap: None,
            retired: Arc::default(),
        };
        Rc::new(Core::new(
            0,
            crate::config::test_config(),
            "test",
            guard,
            links,
        ))
    }

    /// Every idle connection holds these: growing them shows up in the density figure.
    #[test]
    fn per_connection_state_stays_small() {
        assert!(std::mem::size_of::<Session>() <= 128, "Session grew");
        assert!(std::mem::size_of::<ConnState>() <= 136, "ConnState grew");
        assert!(std::mem::size_of::<Conn>() <= 176, "Conn grew");
    }

    /// Accept, upgrade and verdict each schedule a visit; the overtaken ones must not live on
    /// as extra entries, each visited and re-scheduled forever.
    #[test]
    fn a_connection_keeps_one_wheel_entry_whatever_it_scheduled_before() {
        let (tx, _rx) = doorbell::channel::<ToBridge>(16).expect("channel");
        let core = test_core(tx);
        let id = core.next_conn_id();
        let conn = Rc::new(Conn::new(&core, id, -1));
        core.conns.borrow_mut().insert(id, conn.clone());
        {
            let mut st = conn.st.borrow_mut();
            st.deadline = 40;
            for at in [5, 9, 12] {
                core.schedule(&mut st, at, id);
            }
        }
        assert_eq!(core.wheel.borrow().len(), 3);
        let mut visits = 0;
        for _ in 0..30 {
            let due = core.wheel.borrow_mut().advance();
            for id in &due {
                visits += 1;
                crate::worker::sweep::visit(&core, *id);
            }
            core.wheel.borrow_mut().recycle(due);
            assert!(core.wheel.borrow().len() <= 3);
        }
        // Ticks 5 and 9 were overtaken and dropped; tick 12 re-scheduled the deadline.
        assert_eq!(visits, 3);
        assert_eq!(core.wheel.borrow().len(), 1);
        assert_eq!(conn.st.borrow().live.wheel_at, 40);
    }

    #[test]
    fn events_queued_for_the_bridge_are_bounded_by_their_bytes() {
        let (tx, rx) = doorbell::channel::<ToBridge>(16).expect("channel");
        let core = test_core(tx);
        let ev = serde_json::json!({"type": "event", "data": "x".repeat(100)});
        let len = serde_json::to_vec(&ev).expect("json").len();
        let charge = event_charge(len);
        assert!(charge > len, "a small event counts as more than its bytes");
        assert!(core.event(ev.clone()));
        let queued = &core.bridge_shared.event_bytes;
        assert_eq!(queued.load(Ordering::Relaxed), charge);
        queued.store(MAX_EVENT_BYTES - charge + 1, Ordering::Relaxed);
        assert!(!core.event(ev), "past the byte bound: dropped");
        assert_eq!(queued.load(Ordering::Relaxed), MAX_EVENT_BYTES - charge + 1);
        // However small, events leave a quarter of the bridge's 65,536 places to the rest.
        assert!(MAX_EVENT_BYTES / event_charge(0) <= 65_536 / 4 * 3);
        let got: Vec<usize> = std::iter::from_fn(|| rx.try_recv())
            .map(|m| match m {
                ToBridge::Event(bytes) => bytes.len(),
                _ => 0,
            })
            .collect();
        assert_eq!(got, [len], "only the first went, exactly its size");
    }

    #[test]
    fn a_burst_for_the_bridge_rings_once_after_the_ready_tasks() {
        let (tx, rx) = doorbell::channel::<ToBridge>(16).expect("channel");
        let core = test_core(tx);
        assert!(rx.arm(), "the bridge sleeps");
        let mut rt = monoio::RuntimeBuilder::<monoio::LegacyDriver>::new()
            .build()
            .expect("runtime");
        // In a task of its own: block_on's own future is re-polled before other tasks run.
        let rx = Rc::new(rx);
        let bell = rx.clone();
        let rung_during_burst = rt.block_on(async move {
            let test = async move {
                let rx = bell;
                monoio::spawn(ring_bridge(core.clone()));
                // Let the ringer park on its notification first.
                monoio::spawn(async {}).await;
                let mut buf = [0u8; 8];
                let mut rung_early = false;
                for _ in 0..3 {
                    assert!(core.to_bridge(ToBridge::Shutdown {
                        now: Default::default()
                    }));
                    rung_early |= (&rx.listen).read(&mut buf).is_ok();
                }
                // A task spawned now queues behind the woken ringer.
                monoio::spawn(async {}).await;
                let rung = (&rx.listen).read(&mut buf).ok();
                assert_eq!(rung, Some(1), "one ring for three");
                rung_early
            };
            monoio::spawn(test).await
        });
        assert!(
            !rung_during_burst,
            "no ring while the burst was being queued"
        );
        let got = std::iter::from_fn(|| rx.try_recv()).count();
        assert_eq!(got, 3);
    }
}
