//! The bridge thread: the one place that owns the registry and the control plane. Cores and
//! the admin thread reach it only through its bounded inbox; it reaches cores only through
//! theirs.
//!
//! Standalone, the embedded registry is the whole truth. In fleet mode (`--redis`) it stays the
//! local index of which connection holds which rig, while Redis arbitrates between brokers
//! (Lua scripts), carries control messages (pub/sub) and events. The thread sleeps in `ppoll(2)`
//! on its inbox doorbell and its subscription socket, waking for the next timer at the latest.

use std::collections::HashMap;
use std::os::fd::AsRawFd;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use serde_json::{json, Value};

use crate::config::Config;
use crate::doorbell::{Full, Inbox, Mailbox};
use crate::ids::{BootId, ConnId, CoreId, RigId};
use crate::metrics::BridgeStats;
use crate::registry::control::{self, Control};
use crate::registry::embedded::{Action, Embedded};
use crate::registry::fleet::{self, Fleet};
use crate::registry::msg::{
    AdminAnswer, AdminReply, CommandReq, PersistReq, RekeepReq, ReplyTo, SeqCommand, ToBridge,
    ToCore, Verdict,
};
use crate::registry::offline::{Deadlines, Held, LocalHeld};
use crate::registry::pace::{Queued, WritePace};
use crate::registry::scripts::{HelloOutcome, RefreshStatus};
use crate::registry::sessions::{Persist, Rekeep, Resumed};
use crate::reply;

/// Inbox messages handled per wake before the bridge looks at Redis and its timers again.
const BATCH: usize = 4096;
/// Sessions put back into Redis per pass of the bridge loop (see `Bridge::rekeep_sessions`).
const REKEEP_PER_PASS: usize = 2000;
/// The shortest sleep for a due timer, so that one never handled cannot spin the thread.
const TIMER_FLOOR: Duration = Duration::from_millis(1);
/// The shortest sleep for a paced write: the kernel's default timer slack.
const PACED_FLOOR: Duration = Duration::from_micros(50);
/// How often the broker publishes a canary on its own channel.
const CANARY_EVERY: Duration = Duration::from_secs(1);
/// Readiness fails when no canary came back for this long.
const CANARY_STALE: Duration = Duration::from_secs(5);
/// The `broker:<id>` key: refreshed every 10 s with a 30 s TTL (CONTRACT.md §3).
const HEARTBEAT_EVERY: Duration = Duration::from_secs(10);
const HEARTBEAT_TTL: Duration = Duration::from_secs(30);
/// A broadcast reply goes out after this even if some rigs' cores never answered.
const BROADCAST_WAIT: Duration = Duration::from_secs(5);

/// Registry operations counted by (op, result), in this order.
pub const REGISTRY_OPS: [(&str, &str); 24] = [
    ("offline", "held"),
    ("offline", "full"),
    ("offline", "delivered"),
    ("offline", "expired"),
    ("offline_batch", "sent"),
    ("persist", "ok"),
    ("persist", "fenced"),
    ("persist", "unavailable"),
    ("rekeep", "ok"),
    ("rekeep", "fenced"),
    ("rekeep", "unavailable"),
    ("hello", "ok"),
    ("hello", "older"),
    ("hello", "unavailable"),
    ("hello_batch", "sent"),
    ("refresh", "ok"),
    ("refresh", "restored"),
    ("refresh", "superseded"),
    ("release", "sent"),
    ("evict", "sent"),
    ("evict", "received"),
    ("control", "bad_request"),
    ("reply", "orphaned"),
    ("publish", "dropped"),
];

/// Bridge figures the admin thread reads (written only by the bridge thread).
#[derive(Debug)]
pub struct BridgeShared {
    /// True in fleet mode.
    pub fleet: bool,
    /// 1 while Redis answers.
    pub redis_up: AtomicU64,
    /// True once the scripts are loaded and both channels are subscribed.
    pub subscribed: AtomicBool,
    /// Unix ms when our own canary last came back.
    pub canary_at_ms: AtomicU64,
    /// Messages the bridge could not hand to a full core inbox.
    pub core_queue_full: AtomicU64,
    /// Counters in [`REGISTRY_OPS`] order.
    pub ops: [AtomicU64; REGISTRY_OPS.len()],
    /// Pub/sub messages received.
    pub pubsub_in: AtomicU64,
    /// Pub/sub messages published.
    pub pubsub_out: AtomicU64,
}

impl BridgeShared {
    /// Fresh figures; `fleet` says whether Redis is configured.
    pub fn new(fleet: bool) -> Self {
        Self {
            fleet,
            redis_up: AtomicU64::new(0),
            subscribed: AtomicBool::new(false),
            canary_at_ms: AtomicU64::new(0),
            core_queue_full: AtomicU64::new(0),
            ops: Default::default(),
            pubsub_in: AtomicU64::new(0),
            pubsub_out: AtomicU64::new(0),
        }
    }

    fn count(&self, op: &str, result: &str) {
        if let Some(i) = REGISTRY_OPS
            .iter()
            .position(|&(o, r)| o == op && r == result)
        {
            self.ops[i].fetch_add(1, Ordering::Relaxed);
        }
    }

    /// Why the broker is not ready, if it is not (fleet mode: Redis, scripts, subscription and
    /// a recent canary; CONTRACT.md §4).
    pub fn not_ready(&self) -> Option<String> {
        if !self.fleet {
            return None;
        }
        if self.redis_up.load(Ordering::Relaxed) == 0 {
            return Some("redis unreachable".into());
        }
        if !self.subscribed.load(Ordering::Relaxed) {
            return Some("subscription not live".into());
        }
        let age = unix_ms().saturating_sub(self.canary_at_ms.load(Ordering::Relaxed));
        if age > CANARY_STALE.as_millis() as u64 {
            return Some(format!("no canary for {age} ms"));
        }
        None
    }

    /// Copies the figures for `/metrics`.
    pub fn stats(&self, queue_depth: usize) -> BridgeStats {
        BridgeStats {
            redis_up: self.redis_up.load(Ordering::Relaxed),
            registry_ops: REGISTRY_OPS
                .iter()
                .zip(&self.ops)
                .map(|(&(op, result), n)| {
                    (
                        op.to_string(),
                        result.to_string(),
                        n.load(Ordering::Relaxed),
                    )
                })
                .collect(),
            queue_depth: queue_depth as u64,
            core_queue_full: self.core_queue_full.load(Ordering::Relaxed),
            pubsub: vec![
                ("in".into(), self.pubsub_in.load(Ordering::Relaxed)),
                ("out".into(), self.pubsub_out.load(Ordering::Relaxed)),
            ],
        }
    }
}

fn unix_ms() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_millis() as u64)
}

/// Starts the bridge thread.
pub fn spawn(
    cfg: &'static Config,
    inbox: Inbox<ToBridge>,
    cores: Vec<Mailbox<ToCore>>,
    shared: Arc<BridgeShared>,
) -> anyhow::Result<JoinHandle<()>> {
    let fleet = cfg
        .redis
        .as_deref()
        .map(|url| Fleet::new(url, &cfg.broker_id, cfg.session_ttl))
        .transpose()?;
    let handle = std::thread::Builder::new()
        .name("fleetlink-bridge".into())
        .spawn(move || {
            let now = Instant::now();
            let mut bridge = Bridge {
                cfg,
                registry: Embedded::new(cfg.registry_ttl, cfg.outbox),
                owed: vec![false; cores.len()],
                cores,
                batching: false,
                shared,
                fleet,
                broadcasts: HashMap::new(),
                held: LocalHeld::default(),
                deadlines: Deadlines::default(),
                hellos: Vec::new(),
                holds: Vec::new(),
                persists: Vec::new(),
                rekeeps: Vec::new(),
                rekeep_all: false,
                pace: WritePace::new(now),
                next_agg: 0,
                next_refresh: now + cfg.registry_refresh,
                next_touch: now + touch_every(cfg.session_ttl),
                next_heartbeat: now,
                next_canary: now,
                next_expire: now,
                started_at: reply::rfc3339(SystemTime::now()),
            };
            bridge.run(&inbox);
        })?;
    Ok(handle)
}

/// A broadcast waiting for its rigs' answers.
struct Broadcast {
    id: String,
    reply_to: String,
    matched: usize,
    enqueued: usize,
    failed: Vec<Value>,
    outstanding: usize,
    deadline: Instant,
}

/// A hello waiting for its batch's round trip.
struct PendingHello {
    conn: ConnId,
    rig: RigId,
    boot: BootId,
    labels: Vec<(String, String)>,
}

/// A command for an offline rig, its deadline running, waiting for its batch's round trip.
struct PendingHold {
    rig: RigId,
    entry: Held,
    ttl: Duration,
    reply_to: ReplyTo,
}

/// A hello the registry has answered, waiting for its session and held commands if accepted.
struct Decided {
    conn: ConnId,
    rig: RigId,
    boot: BootId,
    actions: Vec<Action>,
    accepted: bool,
}

struct Bridge {
    cfg: &'static Config,
    registry: Embedded,
    cores: Vec<Mailbox<ToCore>>,
    /// While set, messages to cores are queued without ringing (see [`Self::batched`]).
    batching: bool,
    /// Cores with messages queued but not rung for.
    owed: Vec<bool>,
    shared: Arc<BridgeShared>,
    fleet: Option<Fleet>,
    broadcasts: HashMap<u64, Broadcast>,
    /// Commands held for offline rigs here (standalone, or while Redis is away).
    held: LocalHeld,
    /// Deadlines of the commands this broker held.
    deadlines: Deadlines,
    /// Hellos read from the inbox and not yet answered (see [`Self::flush_hellos`]).
    hellos: Vec<PendingHello>,
    /// Commands for offline rigs not yet held (see [`Self::flush_holds`]).
    holds: Vec<PendingHold>,
    /// Commands waiting to be kept in Redis before they are written (fleet mode).
    persists: Vec<PersistReq>,
    /// Sessions to put back into Redis after it lost them (see [`Self::refresh`]).
    rekeeps: Vec<RekeepReq>,
    /// Redis just came back: the next refresh asks for every session, not only restored ones.
    rekeep_all: bool,
    /// When queued Redis writes may go out (see [`crate::registry::pace`]).
    pace: WritePace,
    next_agg: u64,
    next_refresh: Instant,
    /// When the connected rigs' session keys next get their TTL extended.
    next_touch: Instant,
    next_heartbeat: Instant,
    next_canary: Instant,
    next_expire: Instant,
    started_at: String,
}

impl Bridge {
    fn run(&mut self, inbox: &Inbox<ToBridge>) {
        loop {
            let mut handled = 0;
            let mut shutdown = false;
            // Verdicts of an accept storm's hellos, say, reach each core with one ring.
            self.batched(|b| {
                while handled < BATCH {
                    match inbox.try_recv() {
                        Some(ToBridge::Shutdown) => {
                            shutdown = true;
                            break;
                        }
                        Some(msg) => b.handle(msg),
                        None => break,
                    }
                    handled += 1;
                }
                b.flush_hellos();
                b.flush_holds();
            });
            if shutdown {
                self.flush_hellos();
                self.flush_holds();
                return self.shutdown();
            }
            let now = Instant::now();
            self.redis_io(now);
            self.timers(now);
            if handled == BATCH || !inbox.arm() {
                continue;
            }
            self.sleep(inbox, now);
            inbox.clear();
        }
    }

    /// Sleeps until the doorbell rings, the subscription has data, or the next timer is due.
    fn sleep(&self, inbox: &Inbox<ToBridge>, now: Instant) {
        let mut next = self.next_expire;
        if self.fleet.is_some() {
            next = next
                .min(self.next_refresh)
                .min(self.next_touch)
                .min(self.next_heartbeat)
                .min(self.next_canary);
        }
        if let Some(b) = self.broadcasts.values().map(|b| b.deadline).min() {
            next = next.min(b);
        }
        if let Some(d) = self.deadlines.next_due() {
            next = next.min(d);
        }
        // Timers may fire a little late; a paced write may not: it holds a command back.
        let mut wait = next.saturating_duration_since(now).max(TIMER_FLOOR);
        if let Some(d) = self.write_due(now) {
            wait = wait.min(d.saturating_duration_since(now).max(PACED_FLOOR));
        }
        let wait = wait.min(Duration::from_secs(1));
        let timeout = libc::timespec {
            tv_sec: wait.as_secs() as libc::time_t,
            tv_nsec: wait.subsec_nanos() as libc::c_long,
        };
        let mut fds = vec![libc::pollfd {
            fd: inbox.listen.as_raw_fd(),
            events: libc::POLLIN,
            revents: 0,
        }];
        if let Some(fd) = self.fleet.as_ref().and_then(Fleet::fd) {
            fds.push(libc::pollfd {
                fd,
                events: libc::POLLIN,
                revents: 0,
            });
        }
        // SAFETY: `fds` is a valid array of initialized pollfd for its length, `timeout` a
        // valid timespec, and a null sigmask leaves the thread's mask as it is.
        unsafe {
            libc::ppoll(
                fds.as_mut_ptr(),
                fds.len() as libc::nfds_t,
                &timeout,
                std::ptr::null(),
            )
        };
    }

    fn handle(&mut self, msg: ToBridge) {
        if let ToBridge::Hello {
            conn,
            rig,
            boot,
            labels,
        } = msg
        {
            self.hellos.push(PendingHello {
                conn,
                rig,
                boot,
                labels,
            });
            return;
        }
        // Whatever follows a hello in the inbox sees the registry as that hello left it.
        self.flush_hellos();
        let actions = match msg {
            // Queued above, answered by `flush_hellos`.
            ToBridge::Hello { .. } => Vec::new(),
            ToBridge::Closed {
                conn,
                rig,
                boot,
                next_seq,
                carried,
            } => {
                let (actions, released) = self.registry.closed(
                    conn,
                    rig.clone(),
                    boot,
                    next_seq,
                    carried,
                    Instant::now(),
                );
                if released {
                    self.release(rig, boot);
                }
                actions
            }
            ToBridge::Abandoned { conn, rig } => {
                let (actions, released) = self.registry.abandoned(conn, &rig);
                if let Some(boot) = released {
                    self.release(rig, boot);
                }
                actions
            }
            ToBridge::Event(ev) => {
                self.publish(fleet::EVENTS.to_string(), &ev);
                Vec::new()
            }
            ToBridge::Reply { channel, body } => {
                self.publish(channel, &body);
                Vec::new()
            }
            ToBridge::Part { agg, body } => {
                self.broadcast_part(agg, &body);
                Vec::new()
            }
            ToBridge::Command(req) => self.registry.command(req),
            ToBridge::Kick { id, rig, reply } => self.registry.kick(id, rig, reply),
            ToBridge::Persist(p) => {
                self.persists.push(*p);
                Vec::new()
            }
            ToBridge::Rekeep(r) => {
                self.rekeeps.push(*r);
                Vec::new()
            }
            ToBridge::Forget { rig, boot, seq } => {
                if let Some(f) = self.fleet.as_mut() {
                    f.forget(rig, boot, seq);
                }
                Vec::new()
            }
            ToBridge::Shutdown => Vec::new(),
        };
        self.carry_out(actions);
    }

    /// Keeps the held commands in Redis (one batched, lease-fenced script call), then releases
    /// each to its core and answers control: `ok` only for what Redis kept. With Redis down,
    /// commands are released unkept (delivery goes on; only a cross-broker resume loses them).
    fn persist_held(&mut self) {
        if self.persists.is_empty() {
            return;
        }
        let held = std::mem::take(&mut self.persists);
        let ttl = self.cfg.session_ttl;
        let kept = self.fleet.as_mut().and_then(|f| {
            let batch: Vec<Persist<'_>> = held
                .iter()
                .map(|p| Persist {
                    rig: &p.rig,
                    boot: &p.boot,
                    seq: p.seq,
                    json: &p.json,
                })
                .collect();
            f.persist(&batch, ttl)
        });
        if kept.is_none() {
            self.shared.count("persist", "unavailable");
        }
        for (i, p) in held.into_iter().enumerate() {
            let ok = kept
                .as_ref()
                .is_none_or(|k| k.get(i).copied().unwrap_or(false));
            let (body, route) = if ok {
                self.shared.count("persist", "ok");
                (reply::enqueued(&p.id, &p.rig, p.seq), Some(p.conn))
            } else {
                self.shared.count("persist", "fenced");
                let body = reply::error(
                    &p.id,
                    Some(p.rig.as_str()),
                    "rig_not_connected",
                    "another broker owns this rig now",
                );
                (body, None)
            };
            self.send_to_core(
                p.conn,
                ToCore::Persisted {
                    conn: p.conn,
                    seq: p.seq,
                    kept: ok,
                },
            );
            self.reply_routed(p.reply, body, route);
        }
    }

    /// Puts back the sessions the cores sent after a reconnect or a restored lease (see
    /// [`Self::refresh`]).
    fn rekeep_sessions(&mut self) {
        if self.rekeeps.is_empty() {
            return;
        }
        // A pass at a time, so that after a reconnect with a big fleet hellos and commands
        // get their turn between passes.
        let n = self.rekeeps.len().min(REKEEP_PER_PASS);
        let sent: Vec<RekeepReq> = self.rekeeps.drain(..n).collect();
        let sessions: Vec<Rekeep<'_>> = sent
            .iter()
            .map(|r| Rekeep {
                rig: &r.rig,
                boot: &r.boot,
                next: r.next,
                cmds: &r.cmds,
            })
            .collect();
        let ttl = self.cfg.session_ttl;
        match self.fleet.as_mut().and_then(|f| f.rekeep(&sessions, ttl)) {
            Some(kept) => {
                for ok in kept {
                    self.shared
                        .count("rekeep", if ok { "ok" } else { "fenced" });
                }
            }
            None => {
                for _ in &sessions {
                    self.shared.count("rekeep", "unavailable");
                }
            }
        }
    }

    /// Fleet mode: what Redis holds of this session, merged into the local verdict; the
    /// previous boot's unacked commands are reported `rig_rebooted` (CONTRACT.md §5).
    fn resume(
        &mut self,
        conn: ConnId,
        rig: &RigId,
        boot: &BootId,
        found: Resumed,
        mut actions: Vec<Action>,
    ) -> Vec<Action> {
        if let Some(previous) = &found.previous_boot {
            for json in &found.rebooted {
                let cmd: Value = serde_json::from_slice(json).unwrap_or(Value::Null);
                let ev = json!({"type": "rig_rebooted", "rig_id": rig.as_str(), "boot_id": previous,
                    "new_boot_id": boot.as_str(), "seq": cmd["seq"], "id": cmd["id"],
                    "broker_id": self.cfg.broker_id, "at": reply::rfc3339(SystemTime::now())});
                self.publish(fleet::EVENTS.to_string(), &ev);
            }
        }
        let Some(next) = found.next else {
            return actions;
        };
        for action in &mut actions {
            if let Action::Core(
                c,
                ToCore::Verdict {
                    verdict:
                        Verdict::Accept {
                            next_seq,
                            resumed,
                            carried,
                        },
                    ..
                },
            ) = action
            {
                if *c != conn {
                    continue;
                }
                *next_seq = (*next_seq).max(next);
                *resumed = true;
                for (seq, json) in &found.commands {
                    if carried.iter().all(|c| c.seq != *seq) {
                        carried.push(SeqCommand {
                            seq: *seq,
                            id: command_id(json),
                            json: json.clone().into_boxed_slice(),
                            queued_at: Instant::now(),
                            written_at: None,
                            held: false,
                        });
                    }
                }
                carried.sort_by_key(|c| c.seq);
            }
        }
        actions
    }

    /// Answers the hellos read from the inbox, all at once: in fleet mode one round trip
    /// claims every rig's lease (`hello.lua`, pipelined) and, for those accepted, one more
    /// reads their sessions and takes what was held for them offline. A storm of 10,000
    /// hellos costs a few round trips per inbox batch instead of three per rig.
    fn flush_hellos(&mut self) {
        if self.hellos.is_empty() {
            return;
        }
        // A hello must find in Redis what was held for its rig before it.
        self.flush_holds();
        let hellos = std::mem::take(&mut self.hellos);
        let ttl = self.cfg.registry_ttl;
        if self.fleet.is_some() {
            // The verdicts already decided must not wait on these hellos' round trips.
            self.ring_owed();
        }
        let outcomes = self.fleet.as_mut().map(|f| {
            let entries: Vec<(&RigId, &BootId)> =
                hellos.iter().map(|h| (&h.rig, &h.boot)).collect();
            f.hello_many(&entries, ttl)
        });
        if matches!(outcomes, Some(Some(_))) {
            self.shared.count("hello_batch", "sent");
        }
        let mut outcomes = outcomes.map(|o| o.map(Vec::into_iter));
        let mut decided = Vec::with_capacity(hellos.len());
        for h in hellos {
            let outcome = match outcomes.as_mut() {
                None => None,
                Some(None) => Some(None),
                Some(Some(each)) => Some(each.next()),
            };
            let actions = self.decide_hello(h.conn, h.rig.clone(), h.boot, h.labels, outcome);
            let accepted = actions.iter().any(|a| {
                matches!(a, Action::Core(c, ToCore::Verdict { verdict: Verdict::Accept { .. }, .. }) if *c == h.conn)
            });
            decided.push(Decided {
                conn: h.conn,
                rig: h.rig,
                boot: h.boot,
                actions,
                accepted,
            });
        }
        let accepted: Vec<(&RigId, &BootId)> = decided
            .iter()
            .filter(|d| d.accepted)
            .map(|d| (&d.rig, &d.boot))
            .collect();
        let session_ttl = self.cfg.session_ttl;
        let found = match self.fleet.as_mut() {
            Some(f) if !accepted.is_empty() => f.resume_many(&accepted, session_ttl),
            _ => None,
        };
        let (mut sessions, mut held) = match found {
            Some((s, h)) => (s.into_iter(), h.into_iter()),
            None => (Vec::new().into_iter(), Vec::new().into_iter()),
        };
        for d in decided {
            let mut actions = d.actions;
            if d.accepted {
                if let Some(found) = sessions.next().flatten() {
                    actions = self.resume(d.conn, &d.rig, &d.boot, found, actions);
                }
                let from_redis = held.next().unwrap_or_default();
                self.deliver_held(d.conn, &d.rig, from_redis, &mut actions);
            }
            self.carry_out(actions);
        }
    }

    /// One hello's verdict, given what `hello.lua` said (None: standalone; Some(None): Redis
    /// unavailable, so the local registry decides alone until the next refresh).
    fn decide_hello(
        &mut self,
        conn: ConnId,
        rig: RigId,
        boot: BootId,
        labels: Vec<(String, String)>,
        outcome: Option<Option<Result<HelloOutcome, String>>>,
    ) -> Vec<Action> {
        match outcome {
            None => self.shared.count("hello", "ok"),
            Some(None) | Some(Some(Err(_))) => self.shared.count("hello", "unavailable"),
            Some(Some(Ok(HelloOutcome::Older { .. }))) => {
                self.shared.count("hello", "older");
                return vec![Action::Core(
                    conn,
                    ToCore::Verdict {
                        conn,
                        verdict: Verdict::Older,
                    },
                )];
            }
            Some(Some(Ok(HelloOutcome::Owned { previous }))) => {
                self.shared.count("hello", "ok");
                // Takeover from another broker: tell it now, not at its next refresh.
                if let Some(prev) = previous
                    .filter(|p| !p.broker_id.is_empty() && p.broker_id != self.cfg.broker_id)
                {
                    self.shared.count("evict", "sent");
                    let evict =
                        json!({"type": "evict", "rig_id": rig.as_str(), "boot_id": boot.as_str()});
                    self.publish(fleet::broker_channel(&prev.broker_id), &evict);
                }
            }
        }
        self.registry.hello(conn, rig, boot, labels)
    }

    fn release(&mut self, rig: RigId, boot: BootId) {
        if let Some(f) = self.fleet.as_mut() {
            self.shared.count("release", "sent");
            f.release(rig, boot);
        }
    }

    fn publish(&mut self, channel: String, body: &Value) {
        let Some(f) = self.fleet.as_mut() else { return };
        let before = f.dropped;
        f.publish(channel, serde_json::to_vec(body).unwrap_or_default());
        if f.dropped > before {
            self.shared.count("publish", "dropped");
        }
    }

    fn carry_out(&mut self, actions: Vec<Action>) {
        for action in actions {
            match action {
                Action::Offline(req, ttl) => self.hold(*req, ttl),
                Action::Core(conn, msg) => self.send_to_core(conn, msg),
                Action::Reply(to, body) => self.reply(to, body),
                Action::Event(ev) => self.publish(fleet::EVENTS.to_string(), &ev),
            }
        }
    }

    /// Runs `f` with the cores' doorbells held, then rings each core it queued for once: a
    /// burst of commands (a subscription read, a persist batch) wakes a core once, not once per
    /// command. Only for work that does not wait on Redis in between.
    fn batched(&mut self, f: impl FnOnce(&mut Self)) {
        self.batching = true;
        f(self);
        self.batching = false;
        self.ring_owed();
    }

    /// Rings every core that has messages queued without a ring; due before anything that
    /// waits on Redis, so a core never waits on a round trip that is not its own.
    fn ring_owed(&mut self) {
        for (core, owed) in self.cores.iter().zip(self.owed.iter_mut()) {
            if std::mem::take(owed) {
                core.ring();
            }
        }
    }

    fn send_to_core(&mut self, conn: ConnId, msg: ToCore) {
        self.send_to(conn.core(), msg);
    }

    fn send_to(&mut self, core: CoreId, msg: ToCore) {
        let i = core.0 as usize;
        let Some(core) = self.cores.get(i) else {
            return;
        };
        let queued = if self.batching {
            core.push(msg)
        } else {
            core.send(msg)
        };
        let Err(Full(msg)) = queued else {
            if let Some(owed) = self.owed.get_mut(i) {
                *owed |= self.batching;
            }
            return;
        };
        self.shared.core_queue_full.fetch_add(1, Ordering::Relaxed);
        // The core cannot take it: answer for what we hold. A lost verdict is covered by the
        // core's own hello deadline; a lost supersede by the next refresh or ping timeout; a
        // lost admin answer by its request's own timeout (504).
        match msg {
            ToCore::Command { req, .. } => {
                let body = reply::error(
                    &req.id,
                    Some(req.rig.as_str()),
                    "overloaded",
                    "broker core queue full",
                );
                self.reply(req.reply, body);
            }
            ToCore::Kick {
                id, rig, reply: to, ..
            } => {
                let body = reply::error(
                    &id,
                    Some(rig.as_str()),
                    "overloaded",
                    "broker core queue full",
                );
                self.reply(to, body);
            }
            _ => {}
        }
    }

    fn reply(&mut self, to: ReplyTo, body: Value) {
        self.reply_routed(to, body, None);
    }

    /// Replies; `route` is the connection that took the command, for an admin thread to use.
    fn reply_routed(&mut self, to: ReplyTo, body: Value, route: Option<ConnId>) {
        match to {
            ReplyTo::Admin(tx) => {
                if tx.try_send(AdminAnswer { body, route }).is_err() {
                    self.shared.count("reply", "orphaned");
                }
            }
            ReplyTo::Core { core, slot } => {
                let reply = Box::new(AdminReply::Command(AdminAnswer { body, route }));
                self.send_to(core, ToCore::AdminReply { slot, reply });
            }
            ReplyTo::Channel(channel) => self.publish(channel, &body),
            ReplyTo::Aggregate(agg) => self.broadcast_part(agg, &body),
            ReplyTo::Event => {
                let ev = crate::events::offline_delivered(&self.cfg.broker_id, body);
                self.publish(fleet::EVENTS.to_string(), &ev);
            }
        }
    }

    /// Holds a command for a rig that is not connected (Redis in fleet mode, else here).
    fn hold(&mut self, req: CommandReq, ttl: Duration) {
        let entry = Held {
            id: req.id,
            name: req.name,
            args: req.args,
            deadline_ms: unix_ms() + ttl.as_millis() as u64,
            reply_to: match &req.reply {
                ReplyTo::Channel(c) => Some(c.clone()),
                _ => None,
            },
        };
        self.holds.push(PendingHold {
            rig: req.rig,
            entry,
            ttl,
            reply_to: req.reply,
        });
    }

    /// Holds the commands queued by [`Self::hold`]: in fleet mode in one round trip to Redis
    /// (`offline_push.lua`, pipelined), so a fan-out to rigs that are all away costs one round
    /// trip per batch, not one per rig; standalone, or with Redis away, here.
    fn flush_holds(&mut self) {
        if self.holds.is_empty() {
            return;
        }
        let holds = std::mem::take(&mut self.holds);
        if self.fleet.is_some() {
            // The verdicts and commands already decided must not wait on this round trip.
            self.ring_owed();
        }
        let stored = self.fleet.as_mut().and_then(|f| {
            let batch: Vec<(&RigId, &Held, Duration)> =
                holds.iter().map(|h| (&h.rig, &h.entry, h.ttl)).collect();
            f.offline_push_many(&batch)
        });
        if stored.is_some() {
            self.shared.count("offline_batch", "sent");
        }
        let mut stored = stored.map(Vec::into_iter);
        for h in holds {
            let stored = match stored.as_mut().map(|s| s.next().flatten()) {
                Some(Some(stored)) => stored,
                // Standalone, Redis away, or this entry's call failed: held here (delivered
                // only by this broker).
                _ => self.held.push(&h.rig, h.entry.clone()),
            };
            self.held_reply(h, stored);
        }
    }

    /// Answers control for one held (or refused) command and arms its deadline.
    fn held_reply(&mut self, hold: PendingHold, stored: bool) {
        let PendingHold {
            rig,
            entry,
            ttl,
            reply_to,
        } = hold;
        let body = if stored {
            self.shared.count("offline", "held");
            let body = json!({"id": entry.id, "ok": true, "rig_id": rig.as_str(), "queued": true});
            self.deadlines.add(Instant::now() + ttl, rig, entry);
            body
        } else {
            self.shared.count("offline", "full");
            reply::error(
                &entry.id,
                Some(rig.as_str()),
                "offline_queue_full",
                "too many commands held for this rig",
            )
        };
        self.reply(reply_to, body);
    }

    /// At a rig's welcome: the commands held for it (`held`, taken from Redis, then any held
    /// here while Redis was away), in order, behind the verdict; expired ones are reported
    /// instead.
    fn deliver_held(
        &mut self,
        conn: ConnId,
        rig: &RigId,
        mut held: Vec<Held>,
        actions: &mut Vec<Action>,
    ) {
        held.extend(self.held.take(rig));
        let now = unix_ms();
        for h in held {
            if h.expired(now) {
                self.report_expired(rig, &h.id);
                continue;
            }
            self.shared.count("offline", "delivered");
            let req = CommandReq {
                id: h.id,
                rig: rig.clone(),
                name: h.name,
                args: h.args,
                reply: ReplyTo::Event,
                offline_ttl: None,
            };
            actions.push(Action::Core(
                conn,
                ToCore::Command {
                    conn,
                    req: Box::new(req),
                    direct: false,
                },
            ));
        }
    }

    fn report_expired(&mut self, rig: &RigId, id: &str) {
        self.shared.count("offline", "expired");
        let ev = crate::events::expired(&self.cfg.broker_id, rig, id);
        self.publish(fleet::EVENTS.to_string(), &ev);
    }

    /// Commands this broker held whose deadline passed: reported `expired` if still held.
    fn expire_held(&mut self, now: Instant) {
        let due = self.deadlines.due(now);
        if due.is_empty() {
            return;
        }
        // A fan-out held for many rigs expires at once: one round trip removes it all.
        let in_redis = self.fleet.as_mut().and_then(|f| {
            let entries: Vec<(&RigId, &Held)> = due.iter().map(|(r, e)| (r, e)).collect();
            f.offline_remove_many(&entries)
        });
        let mut in_redis = in_redis.map(Vec::into_iter);
        for (rig, entry) in due {
            let from_redis = in_redis.as_mut().and_then(Iterator::next).unwrap_or(false);
            if from_redis || self.held.remove(&rig, &entry.id) {
                self.report_expired(&rig, &entry.id);
            }
        }
    }

    /// Reads the subscription, then sends queued persists, publishes and releases unless
    /// [`Self::write_due`] says to wait; reconnects when down.
    fn redis_io(&mut self, now: Instant) {
        let Some(f) = self.fleet.as_mut() else { return };
        let was_up = f.is_up();
        if !f.ensure(now) {
            self.persist_held();
            if was_up || self.shared.redis_up.load(Ordering::Relaxed) == 1 {
                self.shared.redis_up.store(0, Ordering::Relaxed);
                self.shared.subscribed.store(false, Ordering::Relaxed);
            }
            return;
        }
        self.shared.redis_up.store(1, Ordering::Relaxed);
        let pushes = f.read();
        self.shared
            .subscribed
            .store(f.is_subscribed(), Ordering::Relaxed);
        if std::mem::take(&mut f.just_connected) {
            // Re-assert every lease we hold: Redis may have restarted empty. And put every
            // session back: commands delivered while Redis was away were not kept.
            self.rekeep_all = true;
            self.next_refresh = now;
            self.next_heartbeat = now;
            self.next_canary = now;
        }
        self.batched(|b| {
            for push in pushes {
                b.shared.pubsub_in.fetch_add(1, Ordering::Relaxed);
                b.control(&push.channel, &push.payload, now);
            }
            b.flush_holds();
        });
        if self.write_due(now).is_none_or(|due| due > now) {
            return;
        }
        self.pace.wrote(now);
        self.batched(Self::persist_held);
        self.rekeep_sessions();
        let Some(f) = self.fleet.as_mut() else { return };
        let published = f.published;
        f.flush(Some(now));
        self.shared
            .pubsub_out
            .fetch_add(f.published - published, Ordering::Relaxed);
    }

    /// When the queued Redis writes should go out: None when nothing is queued.
    fn write_due(&self, now: Instant) -> Option<Instant> {
        // While Redis is away the reconnect backoff paces the bridge, not this.
        if !self.fleet.as_ref().is_some_and(Fleet::is_up) {
            return None;
        }
        let queued = Queued {
            persists: self.persists.len(),
            others: self.rekeeps.len() + self.fleet.as_ref().map_or(0, Fleet::queued),
        };
        let writes = self.pace.due(queued, now);
        let forgets = self.fleet.as_ref().and_then(Fleet::forget_due);
        writes.into_iter().chain(forgets).min()
    }

    fn control(&mut self, channel: &str, payload: &[u8], now: Instant) {
        let broadcast = channel == fleet::BROADCAST;
        match control::parse(payload, broadcast) {
            Ok(Control::Canary { broker_id }) => {
                if broker_id == self.cfg.broker_id {
                    self.shared.canary_at_ms.store(unix_ms(), Ordering::Relaxed);
                }
            }
            Ok(Control::Command(req)) => {
                let actions = self.registry.command(Box::new(req));
                self.carry_out(actions);
            }
            Ok(Control::Kick { id, rig, reply_to }) => {
                let actions = self.registry.kick(id, rig, ReplyTo::Channel(reply_to));
                self.carry_out(actions);
            }
            Ok(Control::Evict { rig, boot }) => {
                self.shared.count("evict", "received");
                let actions = self.registry.supersede(&rig, Some(boot));
                self.carry_out(actions);
            }
            Ok(Control::Broadcast {
                id,
                selector,
                name,
                args,
                reply_to,
            }) => {
                self.broadcast(id, &selector, name, args, reply_to, now);
            }
            Err(bad) => {
                self.shared.count("control", "bad_request");
                if let Some((id, reply_to)) = bad.reply_to {
                    self.publish(
                        reply_to,
                        &reply::error(&id, bad.rig.as_deref(), "bad_request", &bad.why),
                    );
                }
            }
        }
    }

    fn broadcast(
        &mut self,
        id: String,
        selector: &[(String, String)],
        name: String,
        args: Value,
        reply_to: String,
        now: Instant,
    ) {
        let rigs = self.registry.matching(selector);
        let agg = self.next_agg;
        self.next_agg += 1;
        self.broadcasts.insert(
            agg,
            Broadcast {
                id: id.clone(),
                reply_to,
                matched: rigs.len(),
                enqueued: 0,
                failed: Vec::new(),
                outstanding: rigs.len(),
                deadline: now + BROADCAST_WAIT,
            },
        );
        for rig in rigs {
            let req = CommandReq {
                id: id.clone(),
                rig,
                name: name.clone(),
                args: args.clone(),
                reply: ReplyTo::Aggregate(agg),
                offline_ttl: None,
            };
            let actions = self.registry.command(Box::new(req));
            self.carry_out(actions);
        }
        self.finish_broadcast(agg, false);
    }

    fn broadcast_part(&mut self, agg: u64, body: &Value) {
        let Some(b) = self.broadcasts.get_mut(&agg) else {
            return;
        };
        b.outstanding = b.outstanding.saturating_sub(1);
        if body["ok"] == true {
            b.enqueued += 1;
        } else {
            b.failed
                .push(json!({"rig_id": body["rig_id"], "error": body["error"]}));
        }
        self.finish_broadcast(agg, false);
    }

    /// Publishes the broadcast's one reply once every rig answered (or at its deadline).
    fn finish_broadcast(&mut self, agg: u64, timed_out: bool) {
        let done = self
            .broadcasts
            .get(&agg)
            .is_some_and(|b| b.outstanding == 0 || timed_out);
        if !done {
            return;
        }
        let Some(b) = self.broadcasts.remove(&agg) else {
            return;
        };
        let body = json!({
            "id": b.id, "ok": true, "broker_id": self.cfg.broker_id, "matched": b.matched,
            "enqueued": b.enqueued, "failed": b.failed, "unanswered": b.outstanding,
        });
        self.publish(b.reply_to, &body);
    }

    fn timers(&mut self, now: Instant) {
        self.expire_held(now);
        if now >= self.next_expire {
            self.registry.expire(now);
            self.next_expire = now + Duration::from_secs(1);
        }
        let late: Vec<u64> = self
            .broadcasts
            .iter()
            .filter(|(_, b)| b.deadline <= now)
            .map(|(k, _)| *k)
            .collect();
        for agg in late {
            self.finish_broadcast(agg, true);
        }
        if self.fleet.as_ref().is_none_or(|f| !f.is_up()) {
            return;
        }
        if now >= self.next_canary {
            self.next_canary = now + CANARY_EVERY;
            let canary =
                json!({"type": "canary", "broker_id": self.cfg.broker_id, "at": unix_ms()});
            self.publish(fleet::broker_channel(&self.cfg.broker_id), &canary);
        }
        if now >= self.next_heartbeat {
            self.next_heartbeat = now + HEARTBEAT_EVERY;
            let blob = json!({
                "broker_id": self.cfg.broker_id, "address": self.cfg.listen.to_string(),
                "cores": self.cfg.cores, "started_at": self.started_at, "connections": self.registry.len(),
            });
            if let Some(f) = self.fleet.as_mut() {
                f.heartbeat(&blob.to_string(), HEARTBEAT_TTL);
            }
        }
        if now >= self.next_refresh {
            self.next_refresh = now + self.cfg.registry_refresh;
            self.refresh();
        }
        if now >= self.next_touch {
            self.next_touch = now + touch_every(self.cfg.session_ttl);
            self.touch_sessions();
        }
    }

    /// `--session-ttl` counts from when the rig was last seen, and a connected rig is seen
    /// all along; commands do not extend it (`persist.lua`). Without this, a connected rig's
    /// session (its `next` and unacked commands) would expire, and a resume after this broker
    /// died would find nothing.
    fn touch_sessions(&mut self) {
        if self.cfg.session_ttl.is_zero() {
            return;
        }
        let sessions = self.registry.live_sessions();
        if let Some(f) = self.fleet.as_mut() {
            f.touch_sessions(&sessions);
        }
    }

    /// One batched lease refresh for every rig this broker holds (CONTRACT.md §3).
    fn refresh(&mut self) {
        // Taken here: a failed refresh means Redis is away again, and its return sets it anew.
        let everyone = std::mem::take(&mut self.rekeep_all);
        let entries = self.registry.live_sessions();
        if entries.is_empty() {
            return;
        }
        let ttl = self.cfg.registry_ttl;
        let Some(statuses) = self.fleet.as_mut().and_then(|f| f.refresh(&entries, ttl)) else {
            return;
        };
        for ((rig, _), status) in entries.iter().zip(statuses) {
            // A restored lease means Redis may have lost the session too (it restarted empty);
            // after any reconnect, commands delivered while Redis was away were never kept.
            // Either way the core holding the rig sends its session back to be kept again.
            let rekeep =
                status == RefreshStatus::Restored || (everyone && status == RefreshStatus::Ok);
            if rekeep && !self.cfg.session_ttl.is_zero() {
                if let Some(conn) = self.registry.conn_of(rig) {
                    self.send_to_core(conn, ToCore::Rekeep { conn });
                }
            }
            match status {
                RefreshStatus::Ok => self.shared.count("refresh", "ok"),
                RefreshStatus::Restored => self.shared.count("refresh", "restored"),
                RefreshStatus::Superseded => {
                    self.shared.count("refresh", "superseded");
                    let actions = self.registry.supersede(rig, None);
                    self.carry_out(actions);
                }
            }
        }
    }

    /// Releases every lease this broker holds, then returns (the end of a drain).
    fn shutdown(&mut self) {
        for (rig, boot) in self.registry.live_sessions() {
            self.release(rig, boot);
        }
        if let Some(f) = self.fleet.as_mut() {
            f.flush(None);
        }
    }
}

/// How often connected rigs' sessions get their TTL extended: a few times per TTL, so one
/// late or failed round never lets a session lapse (and at least hourly). With no sessions
/// kept (`--session-ttl 0`) the timer only idles, hourly, rather than waking the bridge.
fn touch_every(session_ttl: Duration) -> Duration {
    const HOURLY: Duration = Duration::from_secs(3600);
    if session_ttl.is_zero() {
        return HOURLY;
    }
    (session_ttl / 3).clamp(Duration::from_millis(100), HOURLY)
}

/// The `id` inside an encoded command (for replayed commands' bookkeeping).
fn command_id(json: &[u8]) -> Box<str> {
    serde_json::from_slice::<Value>(json)
        .ok()
        .and_then(|v| v["id"].as_str().map(Into::into))
        .unwrap_or_default()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sessions_are_touched_a_few_times_per_ttl_and_never_busily() {
        let s = Duration::from_secs;
        assert_eq!(touch_every(s(600)), s(200), "the default 10 min TTL");
        assert_eq!(touch_every(s(2)), s(2) / 3);
        assert_eq!(
            touch_every(Duration::from_millis(30)),
            Duration::from_millis(100)
        );
        assert_eq!(touch_every(s(365 * 86_400)), s(3600));
        assert_eq!(
            touch_every(Duration::ZERO),
            s(3600),
            "--session-ttl 0 keeps no session"
        );
    }
}
