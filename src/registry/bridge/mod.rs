//! The bridge thread: the one place that owns the registry and the control plane. Cores and
//! the admin thread reach it only through its bounded inbox; it reaches cores only through
//! theirs.
//!
//! Standalone, the embedded registry is the whole truth. In fleet mode (`--redis`) it stays the
//! local index of which connection holds which rig, while Redis arbitrates between brokers
//! (Lua scripts), carries control messages (pub/sub) and events. The thread sleeps in `ppoll(2)`
//! on its inbox doorbell and its subscription socket, waking for the next timer at the latest.
//!
//! This module holds the thread's loop, its inbox dispatch and its hand-offs to cores; the
//! rest of its work is split by job: `hellos`, `holds` (offline rigs), `broadcast`,
//! `redis_io` (the subscription and paced writes), `rekeeps` (sessions put back after Redis
//! lost them), `upkeep` (timers) and `shared` (what the admin thread reads).

mod broadcast;
mod hellos;
mod holds;
mod lapses;
mod redis_io;
mod rekeeps;
mod shared;
mod upkeep;

pub use shared::{event_charge, BridgeShared, MAX_EVENT_BYTES, REGISTRY_OPS};

use std::collections::{HashMap, HashSet};
use std::os::fd::AsRawFd;
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::{Duration, Instant, SystemTime};

use serde_json::{json, Value};

use broadcast::Broadcast;
use hellos::PendingHello;
use holds::PendingHold;
use upkeep::touch_every;

use crate::config::Config;
use crate::doorbell::{Full, Inbox, Mailbox};
use crate::ids::{BootId, ConnId, CoreId, RigId, Seq};
use crate::registry::embedded::{Action, Embedded};
use crate::registry::exit_wait::ExitWait;
use crate::registry::fleet::{self, Fleet};
use crate::registry::msg::{
    AdminAnswer, AdminReply, CommandReq, PersistReq, ReplyTo, ToBridge, ToCore,
};
use crate::registry::offline::{Deadlines, Held, LocalHeld};
use crate::registry::pace::WritePace;
use crate::registry::scripts::Owner;
use crate::registry::sessions::Resumed;
use crate::registry::sessions::{CheckedForget, Unkept};
use crate::reply;

/// Inbox messages handled per wake before the bridge looks at Redis and its timers again.
const BATCH: usize = 4096;
/// The shortest sleep for a due timer, so that one never handled cannot spin the thread.
const TIMER_FLOOR: Duration = Duration::from_millis(1);
/// The shortest sleep for a paced write: the kernel's default timer slack.
const PACED_FLOOR: Duration = Duration::from_micros(50);

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
            let mut bridge = Bridge::new(cfg, cores, shared, fleet, Instant::now());
            bridge.run(&inbox);
        })?;
    Ok(handle)
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
    /// What Redis held for a rig whose hello waits for a same-boot hand-over here (its
    /// session and the commands held for it while offline), merged into the session when the
    /// connection before it hands it over: another broker may have numbered commands of the
    /// session since this one last did. At most one per connection waiting.
    handover_resumes: HashMap<ConnId, (Resumed, Vec<Held>)>,
    /// Evicts read this pass of a rig held here, each with the boot held: checked against the
    /// leases in one round trip after the read (see `Self::settle_evicts`).
    evicts_to_settle: Vec<(RigId, BootId)>,
    /// Commands for offline rigs not yet held (see [`Self::flush_holds`]).
    holds: Vec<PendingHold>,
    /// The sizes of `holds`' commands.
    holds_bytes: usize,
    /// Commands waiting to be kept in Redis before they are written (fleet mode).
    persists: Vec<PersistReq>,
    /// Sessions of rigs that left with commands unacked, watched to their TTL's end.
    lapses: lapses::Lapses,
    /// Which connection to Redis this is (1 for the first): sessions named in `sess:lapses`
    /// under an earlier one are named again (`Embedded::lapse_named`).
    lapse_count: u32,
    /// Whether both connections to Redis were up at the last pass (see `lapse_count`).
    lapse_listening: bool,
    /// Reports of held commands refused while `persists` waited, each with how many of them
    /// came before it: published among their answers (see [`ToBridge::HeldEvent`]).
    after_keeps: Vec<(usize, Box<[u8]>)>,
    /// Sessions to put back into Redis after it lost them (see [`Self::refresh`]).
    rekeeps: rekeeps::Rekeeps,
    /// Redis just came back: the next refresh asks for every session, not only restored ones.
    rekeep_all: bool,
    /// `Fleet::refusals` and `Fleet::dropped` already counted in the shared figures.
    refusals_counted: u64,
    drops_counted: u64,
    /// Connected rigs asked for their sessions since Redis came back (or since it was found to
    /// have lost one), until their cores answer.
    /// One that disconnects first has its session parked only after the reconnect queued the
    /// parked ones; it is queued when its close arrives (see `ToBridge::Closed`).
    rekeep_asked: HashSet<(RigId, BootId)>,
    /// Connections of these sessions closing because the first refresh after a reconnect found
    /// the same boot leased elsewhere: their sessions go back as they close, merged into the
    /// rig's session there. Kept across reconnects (unlike `rekeep_asked`); each entry goes at
    /// its connection's close. After an evict of the same boot only if it was given seqs
    /// unkept (`unkept_high`).
    merge_on_close: HashSet<(RigId, BootId)>,
    /// The seqs each live session here was delivered unkept, while Redis was away: Redis
    /// lacks them, so if another broker takes the same boot (its evict arrives as a partition
    /// of this broker heals), the session goes back as it closes, and only up to the highest.
    /// A connection that merely lost a hello race holds seqs it never wrote, and raising the
    /// session's `next` past them would refuse the winner's own commands as stale. The lowest
    /// tells `rekeep.lua` which commands below it Redis did keep. Gone at the close, or once
    /// the session is kept again.
    unkept_high: HashMap<(RigId, BootId), Unkept>,
    /// Hellos decided here while Redis was away. The older boot's session in Redis, or that
    /// of a boot in between on another broker, which only Redis knows, is reported by the
    /// first refresh after the reconnect (see `upkeep`), even where the hello's own call
    /// reached Redis late and took the lease, so that the refresh finds nothing amiss; and
    /// the rig's record of its latest boot then names this one. Gone at the close, or at that
    /// refresh. (A session parked here that the hello ended is reported through
    /// `ended_alone`; the tombstone each report leaves keeps the two from repeating.) Their
    /// refreshes follow the hello's rule (`refresh.lua`'s claims): a lease their rig's newer
    /// boot left free is taken, as the hello would have taken it, not refused as a stale
    /// process's (review bb150); but not at once (`pending_claims`).
    decided_alone: HashSet<(RigId, BootId)>,
    /// Hellos decided alone that would end a newer boot's session (the first refresh after
    /// the reconnect found the lease free and that boot on record, or the hello's own late
    /// call had taken the lease), since when. The newer boot may be connected still, its
    /// lease not yet back (its hello decided alone elsewhere too, or its lease lapsed during
    /// the outage): its broker restores it at its first refresh, which then supersedes this
    /// one. Taken, and that session reported, only a refresh interval and the longest
    /// reconnect later (reviews bb151, bb153).
    /// Gone at the close, or once taken or superseded.
    pending_claims: HashMap<(RigId, BootId), Instant>,
    /// Rigs welcomed here while Redis was away, whatever the session store: the commands Redis
    /// held for them while they were offline were not taken at their hello, so they are taken
    /// and delivered at the reconnect (see `holds`).
    held_unread: HashSet<RigId>,
    /// Fleet mode: commands held here (Redis away, or its answer to the push never came) that
    /// this broker then delivered itself. A push whose answer was lost may have run: the copy
    /// in Redis is removed at the reconnect, before anything takes from Redis again, or the
    /// rig would get the command twice, under two seqs.
    delivered_here: Vec<(RigId, Held)>,
    /// Held commands delivered here (fleet mode), so that a loss of Redis's keys before their
    /// deadline does not get them reported `lost` as well.
    delivered_holds: crate::registry::offline::DeliveredHolds,
    /// Sessions those hellos ended, and live ones a newer boot took over, waiting for Redis
    /// to say what is left to report.
    ended_alone: rekeeps::EndedAlone,
    /// When queued Redis writes may go out (see [`crate::registry::pace`]).
    pace: WritePace,
    /// Refused control messages that named no `reply_to`, logged at most once a second.
    unanswered: redis_io::UnansweredLog,
    next_agg: u64,
    next_refresh: Instant,
    /// When the connected rigs' session keys next get their TTL extended.
    next_touch: Instant,
    next_heartbeat: Instant,
    /// A loss of Redis's keys this broker's sentinel showed before the heartbeat did (see
    /// `Bridge::keys_lost_unseen`): the heartbeat then finds it too, and must not count it twice.
    keys_loss_counted: bool,
    /// What the last `broker:<id>` heartbeat said of the drain: a drain starting writes the
    /// key again at the next tick, so that control sees it at once.
    heartbeat_draining: bool,
    next_canary: Instant,
    /// Whether the canary's lateness (`/readyz` failing) has been logged, and not its return.
    canary_late: bool,
    next_expire: Instant,
    /// When the bridge next gives memory back ([`crate::heap_trim`]).
    next_trim: Instant,
    started_at: String,
    /// This process's mark in its canaries: another process's canary with our broker id is
    /// a twin on our channel.
    instance: String,
    /// Canaries of a twin, logged at most once a second.
    twin_log: crate::registry::throttle::Throttle,
}

impl Bridge {
    fn new(
        cfg: &'static Config,
        cores: Vec<Mailbox<ToCore>>,
        shared: Arc<BridgeShared>,
        fleet: Option<Fleet>,
        now: Instant,
    ) -> Self {
        Bridge {
            cfg,
            registry: Embedded::new(cfg.park_for(), cfg.outbox),
            owed: vec![false; cores.len()],
            cores,
            batching: false,
            shared,
            fleet,
            broadcasts: HashMap::new(),
            held: LocalHeld::default(),
            deadlines: Deadlines::default(),
            hellos: Vec::new(),
            handover_resumes: HashMap::new(),
            evicts_to_settle: Vec::new(),
            holds: Vec::new(),
            holds_bytes: 0,
            persists: Vec::new(),
            after_keeps: Vec::new(),
            lapses: Default::default(),
            lapse_count: 1,
            lapse_listening: false,
            rekeeps: rekeeps::Rekeeps::default(),
            rekeep_all: false,
            refusals_counted: 0,
            drops_counted: 0,
            rekeep_asked: HashSet::new(),
            merge_on_close: HashSet::new(),
            unkept_high: HashMap::new(),
            decided_alone: HashSet::new(),
            pending_claims: HashMap::new(),
            held_unread: HashSet::new(),
            delivered_here: Vec::new(),
            delivered_holds: Default::default(),
            ended_alone: rekeeps::EndedAlone::default(),
            pace: WritePace::new(now),
            unanswered: redis_io::UnansweredLog::default(),
            next_agg: 0,
            next_refresh: now + cfg.registry_refresh,
            next_touch: now + touch_every(cfg.session_ttl),
            next_heartbeat: now,
            keys_loss_counted: false,
            heartbeat_draining: false,
            next_canary: now,
            canary_late: false,
            instance: format!("{}-{:016x}", std::process::id(), fastrand::u64(..)),
            twin_log: crate::registry::throttle::Throttle::default(),
            next_expire: now,
            next_trim: now + crate::heap_trim::EVERY,
            started_at: reply::rfc3339(SystemTime::now()),
        }
    }

    fn run(&mut self, inbox: &Inbox<ToBridge>) {
        loop {
            // A command connection Redis closed while idle is replaced before this pass's
            // hellos make their calls: on it they would fail, and be decided here alone though
            // Redis is there. Replaced as any reconnect is (leases, sessions put back), so
            // they find in Redis what this broker holds for their rigs.
            let now = Instant::now();
            if self.fleet.as_mut().is_some_and(|f| f.drop_if_closed(now)) {
                self.redis_and_timers(now);
            }
            let mut handled = 0;
            let mut shutdown = None;
            // Verdicts of an accept storm's hellos, say, reach each core with one ring.
            self.batched(|b| {
                while handled < BATCH {
                    match inbox.try_recv() {
                        Some(ToBridge::Shutdown { now }) => {
                            shutdown = Some(now);
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
            if let Some(now) = shutdown {
                self.flush_hellos();
                self.flush_holds();
                return self.shutdown(ExitWait::new(Instant::now(), EXIT_FLUSH_WAIT, now));
            }
            let now = Instant::now();
            self.redis_and_timers(now);
            if handled == BATCH || !inbox.arm() {
                continue;
            }
            self.sleep(inbox, now);
            inbox.clear();
        }
    }

    /// A pass's turn at Redis and the timers, then what it left of Redis told to `/readyz`.
    fn redis_and_timers(&mut self, now: Instant) {
        self.redis_io(now);
        self.timers(now);
        self.report_redis();
    }

    /// Sleeps until the doorbell rings, the subscription has data, or the next timer is due.
    fn sleep(&self, inbox: &Inbox<ToBridge>, now: Instant) {
        let mut next = self.next_expire;
        if let Some(f) = self.fleet.as_ref() {
            // Redis timers wait for the reconnect: left due while Redis is away, they would
            // wake the bridge every `TIMER_FLOOR` for the whole outage.
            if f.is_up() {
                next = next
                    .min(self.next_refresh)
                    .min(self.next_touch)
                    .min(self.next_heartbeat)
                    .min(self.next_canary);
                if let Some(at) = f.stale_sweep_due() {
                    next = next.min(at);
                }
            }
            // A reconnect is due at its backoff, not at whatever timer comes next (up to a
            // second later: the sessions after a Redis restart went back that late).
            if let Some(at) = f.reconnect_due() {
                next = next.min(at);
            }
        }
        if let Some(b) = self.broadcasts.values().map(|b| b.deadline).min() {
            next = next.min(b);
        }
        if let Some(d) = self.deadlines.next_due() {
            next = next.min(d);
        }
        if let Some(d) = self.lapses.next_wake() {
            next = next.min(d);
        }
        if let Some(d) = self.lapse_names_due() {
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
        // Nothing is owed on the command connection between calls: its peer's close is all
        // there is to wake for, and it is reconnected at once (`Fleet::drop_if_closed`).
        if let Some(fd) = self.fleet.as_ref().and_then(Fleet::con_fd) {
            fds.push(libc::pollfd {
                fd,
                events: libc::POLLRDHUP,
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
            crate::thread_loss::Failpoint::BridgeHello.check(rig.as_str());
            self.queue_hello(conn, rig, boot, labels);
            return;
        }
        // Whatever follows a hello in the inbox sees the registry as that hello left it.
        self.flush_hellos();
        let held = matches!(msg, ToBridge::HeldEvent(_));
        let actions = match msg {
            // Queued above, answered by `flush_hellos`.
            ToBridge::Hello { .. } => Vec::new(),
            ToBridge::Closed { conn, session } => {
                // The registry takes the session; what is left to do with it here needs these.
                let (rig, boot, next_seq) = (session.rig.clone(), session.boot, session.next_seq);
                let carried = &session.carried;
                let unacked = !carried.is_empty();
                // For a resume on another broker: written into the session once its lease goes
                // (fleet mode only; standalone, the parked session is the only copy needed).
                let remember = session
                    .recall
                    .as_ref()
                    .filter(|_| self.fleet.is_some())
                    .cloned();
                // Superseded at the first refresh after a reconnect: the registry no longer
                // holds the rig, so the session does not park; it goes back as it closed.
                self.decided_alone.remove(&(rig.clone(), boot));
                self.pending_claims.remove(&(rig.clone(), boot));
                let high = self
                    .unkept_high
                    .remove(&(rig.clone(), boot))
                    .map(|h| match h {
                        // Everything it holds (Redis lost keys): up to its last command, not
                        // its next seq, which may count one fenced since. Its last ack too:
                        // the rig holds that seq, and the session Redis started meanwhile
                        // (a resume elsewhere found nothing) would give it to another command.
                        ALL_UNKEPT => Unkept::up_to(
                            carried
                                .iter()
                                .map(|c| c.seq)
                                .chain(session.recall.as_ref().map(|r| r.last_ack))
                                .max()
                                .unwrap_or(Seq(0)),
                        ),
                        h => h,
                    })
                    .filter(|h| !h.is_none());
                // Only what it delivered unkept: a connection that gave nothing unkept left
                // Redis all it needs, and its own next seq may count a command fenced at its
                // persist (never delivered), which would leave the rig a gap.
                let superseded = (self.merge_on_close.remove(&(rig.clone(), boot))
                    && high.is_some()
                    && self.registry.boot_of(&rig) != Some(boot))
                .then(|| crate::registry::msg::RekeepReq {
                    rig: rig.clone(),
                    boot,
                    next: high.map_or(next_seq, |h| next_seq.min(Seq(h.to.0.saturating_add(1)))),
                    cmds: carried
                        .iter()
                        .filter(|c| high.is_none_or(|h| c.seq <= h.to))
                        .map(|c| (c.seq, c.json.clone()))
                        .collect(),
                    unkept: high.unwrap_or(Unkept::NONE),
                    // Its connection waited for every keep before it closed.
                    left_held: false,
                });
                let (mut actions, released) = self.registry.closed(conn, *session, Instant::now());
                // Its core may hold the echo of the rig's close until the note is written (only
                // when it awaits results): told at once when nothing is to be waited for.
                let mut noted = remember.as_ref().is_some_and(|r| !r.results.is_empty());
                if let (true, Some(recall), Some(f)) = (released, &remember, self.fleet.as_mut()) {
                    // While Redis is away the note waits for the reconnect: the hold ends by
                    // itself rather than wait with it.
                    let waits = (noted && f.is_up()).then_some(conn);
                    if !f.remember(rig.clone(), boot, recall, waits) {
                        self.shared.count("remember", "dropped");
                    } else if waits.is_some() {
                        noted = false;
                    }
                }
                if noted {
                    actions.push(Action::Core(conn, ToCore::Noted { conn }));
                }
                if let Some(high) = high {
                    if self.registry.boot_of(&rig) == Some(boot) {
                        // Handed over to the same boot's new connection here: still its own.
                        self.unkept_high.insert((rig.clone(), boot), high);
                    } else {
                        self.registry.mark_parked_unkept(&rig, boot, high);
                    }
                }
                let dropped = self.registry.take_parked_dropped();
                self.shared.count_n("parked", "dropped", dropped);
                // A live session a newer boot took over. In fleet mode the new boot's hello
                // reported it from the session's copy in Redis, but that copy lacks what was
                // delivered while Redis was away (or all of it, after an empty restart): it
                // goes to Redis as an ended session (`rekeep.lua`), which reports what no
                // report covered. Standalone, or with no sessions kept, it is reported here.
                if let Some(r) = self.registry.take_rebooted() {
                    self.report_taken_over(r, next_seq, high.unwrap_or(Unkept::NONE));
                }
                // A connection that waited for this one's session, and what Redis held for it.
                let actions = self.merge_handover(&rig, boot, actions);
                // It was itself waiting for a hand-over, and went first.
                self.drop_handover_resume(conn, &rig);
                if released && unacked {
                    self.watch_lapse(rig.clone(), boot);
                }
                let asked = self.rekeep_asked.remove(&(rig.clone(), boot));
                if let Some(r) = superseded {
                    self.rekeeps.push_superseded(r);
                } else if asked {
                    // Gone before its core could send the session back: it goes back from
                    // here, and its lease is released only once it has (counted now, as
                    // any release is when decided; queued then by `release_again`).
                    if released {
                        self.shared.count("release", "sent");
                    }
                    self.rekeeps.push_parked(rig, boot, released);
                } else if released {
                    self.release(rig, boot);
                }
                actions
            }
            ToBridge::Returned {
                conn,
                rig,
                next_seq,
                carried,
                recall,
            } => self.take_back(conn, rig.map(|r| *r), next_seq, carried, recall),
            ToBridge::Abandoned { conn, rig } => {
                self.drop_handover_resume(conn, &rig);
                // Its lease, if it had the rig, goes once its session is back (`take_back`).
                let (actions, gone) = self.registry.abandoned(conn, &rig);
                if let Some(boot) = gone {
                    self.release(rig, boot);
                }
                actions
            }
            ToBridge::Event(ev) | ToBridge::HeldEvent(ev) => {
                self.shared
                    .event_bytes
                    .fetch_sub(event_charge(ev.len()), Ordering::Relaxed);
                if held {
                    // An `offline_delivered` the core made itself (no session kept: nothing
                    // went through the bridge's reply path): remembered as that path does.
                    self.note_delivered_hold(&ev);
                }
                if held && !self.persists.is_empty() {
                    // Bounded by the persists it waits for: one per inbox message at most.
                    self.after_keeps.push((self.persists.len(), ev));
                } else {
                    self.publish_bytes(fleet::EVENTS.to_string(), ev.into_vec());
                }
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
            ToBridge::Command(req) => self.route_command(req),
            ToBridge::Undelivered { conn, req } => self.undelivered(conn, req),
            ToBridge::HeldBack { rig, reqs } => {
                self.put_back_held(rig, reqs.into_vec());
                Vec::new()
            }
            ToBridge::TakeHeld {
                conn,
                rig,
                max,
                max_bytes,
            } => self.take_held(conn, rig, max, max_bytes),
            ToBridge::Kick { id, rig, reply } => self.registry.kick(id, rig, reply),
            ToBridge::Persist(p) => {
                self.persists.push(*p);
                Vec::new()
            }
            ToBridge::Rekeep(r) => {
                self.rekeep_asked.remove(&(r.rig.clone(), r.boot));
                self.rekeeps.push(*r);
                Vec::new()
            }
            ToBridge::Forget {
                rig,
                boot,
                seq,
                id,
                doubtful,
                read_back,
            } => {
                self.rekeeps.forget(&rig, boot, seq);
                self.forget(rig, boot, seq, id, doubtful || read_back, doubtful);
                Vec::new()
            }
            ToBridge::Shutdown { .. } => Vec::new(),
        };
        self.carry_out(actions);
    }

    /// Queues the removal of an acked command from its session: a plain one, or, for a seq
    /// this connection was given while Redis was away (which another broker may have given
    /// a command of its own in Redis), one that reports that other command `lost`. `checked`
    /// asks for the second anyway: a command read back from Redis, whose removal must leave
    /// the seq marked acked with its id (`SeqCommand::read_back`).
    fn forget(
        &mut self,
        rig: RigId,
        boot: BootId,
        seq: Seq,
        id: Box<str>,
        checked: bool,
        doubtful: bool,
    ) {
        let Some(f) = self.fleet.as_mut() else { return };
        let unkept = self
            .unkept_high
            .get(&(rig.clone(), boot))
            .is_some_and(|u| u.holds(seq));
        let queued = if unkept || checked {
            f.forget_checked(CheckedForget {
                rig,
                boot,
                seq,
                id,
                doubtful,
            })
        } else {
            f.forget(rig, boot, seq)
        };
        if !queued {
            self.shared.count("forget", "dropped");
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
        // A persist's answer goes in past the bound: the core holds that command, and every
        // one behind it, until it hears whether Redis kept it. So does a request to put a
        // session back (one per connection): lost, Redis would lack that session for good.
        // So does a raise of its next seq (one per put-back session): lost, the core would
        // give a seq the rig holds to another command.
        // And a hello's verdict and a supersede (at most one each per connection): a lost
        // verdict loses the session it carries, and a lost supersede leaves a stale socket
        // the registry has already forgotten, which no refresh would close. So does the end of
        // a delivery from the offline hold (one per delivery): lost, the connection would keep
        // what it could not number in memory and never take the rest from Redis.
        let owed = matches!(
            msg,
            ToCore::Persisted { .. }
                | ToCore::Rekeep { .. }
                | ToCore::RaiseSeq { .. }
                | ToCore::Verdict { .. }
                | ToCore::Supersede { .. }
                | ToCore::HoldDelivered { .. }
                | ToCore::Forget { .. }
        );
        let queued = if owed {
            core.push_owed(msg)
        } else {
            core.push(msg)
        };
        if queued.is_ok() && !self.batching {
            core.ring();
        }
        let Err(Full(msg)) = queued else {
            if let Some(owed) = self.owed.get_mut(i) {
                *owed |= self.batching;
            }
            return;
        };
        self.shared.core_queue_full.fetch_add(1, Ordering::Relaxed);
        // The core cannot take it: answer for what we hold. A lost admin answer is covered by
        // its request's own timeout (504).
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
        // The cores count the refusals they answer; these are the bridge's own (the rig is
        // not here, its hand-over queue is full, its core's inbox is full, Redis fenced it).
        if body["ok"] == false {
            match body["error"].as_str() {
                Some(e @ ("rig_not_connected" | "rig_unresponsive" | "overloaded")) => {
                    self.shared.count("refused", e)
                }
                _ => self.shared.count("refused", "other"),
            }
        }
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
                self.note_delivered(body["rig_id"].as_str(), body["id"].as_str());
                let ev = crate::events::offline_delivered(&self.cfg.broker_id, body);
                self.publish(fleet::EVENTS.to_string(), &ev);
            }
        }
    }

    /// Remembers the held command an `offline_delivered` event names as delivered here, so
    /// that a loss of Redis's keys before its deadline does not report it `lost`.
    fn note_delivered_hold(&mut self, ev: &[u8]) {
        #[derive(serde::Deserialize)]
        struct Named<'a> {
            #[serde(borrow)]
            rig_id: Option<std::borrow::Cow<'a, str>>,
            #[serde(borrow)]
            id: Option<std::borrow::Cow<'a, str>>,
        }
        if let Ok(named) = serde_json::from_slice::<Named<'_>>(ev) {
            self.note_delivered(named.rig_id.as_deref(), named.id.as_deref());
        }
    }

    /// Remembers that the held command `id` for `rig` was delivered here.
    fn note_delivered(&mut self, rig: Option<&str>, id: Option<&str>) {
        if let (Some(rig), Some(id)) = (rig.and_then(RigId::parse), id) {
            self.delivered_holds.note(rig, id);
        }
    }

    /// An accepted session that never reached its connection goes back to the registry
    /// (see `Embedded::returned`): the lease it held, if any, is released; a connection of the
    /// same boot that waited for it takes it (with what Redis held for that one); a session a
    /// newer boot took over meanwhile is reported.
    fn take_back(
        &mut self,
        conn: ConnId,
        rig: Option<(RigId, BootId)>,
        next_seq: crate::ids::Seq,
        carried: Vec<crate::registry::msg::SeqCommand>,
        recall: Option<Box<crate::registry::msg::Recall>>,
    ) -> Vec<Action> {
        let back = self
            .registry
            .returned(conn, rig, next_seq, carried, recall, Instant::now());
        let dropped = self.registry.take_parked_dropped();
        self.shared.count_n("parked", "dropped", dropped);
        if let Some(r) = self.registry.take_rebooted() {
            // Never written: nothing of it went out while Redis was away.
            self.report_taken_over(r, next_seq, Unkept::NONE);
        }
        let Some((rig, boot)) = back.session else {
            return back.actions;
        };
        if back.release {
            self.release(rig.clone(), boot);
        }
        self.merge_handover(&rig, boot, back.actions)
    }

    /// Queues the release of `rig`'s lease for `boot`, counted `release/sent` (or `dropped`
    /// when the queue is full).
    fn release(&mut self, rig: RigId, boot: BootId) {
        self.queue_release(rig, boot, true);
    }

    /// Queues again a release that [`Self::release`] counted already and a put-back held
    /// back (see `Fleet::hold_releases`): counted only if the queue refuses it now.
    fn release_again(&mut self, rig: RigId, boot: BootId) {
        self.queue_release(rig, boot, false);
    }

    /// `count_sent`: a release queued is counted `release/sent`; one refused is counted
    /// `release/dropped` either way.
    fn queue_release(&mut self, rig: RigId, boot: BootId, count_sent: bool) {
        // A session waiting to be put back goes before the release, which would fence it.
        self.rekeeps.hurry(&rig, boot);
        if let Some(f) = self.fleet.as_mut() {
            match f.release(rig, boot) {
                true if count_sent => self.shared.count("release", "sent"),
                true => {}
                false => self.shared.count("release", "dropped"),
            }
        }
    }

    /// Routes a command to the connection holding its rig, counting one that none holds.
    fn route_command(&mut self, req: Box<CommandReq>) -> Vec<Action> {
        let actions = self.registry.command(req);
        let refused = actions
            .iter()
            .filter(|a| matches!(a, Action::Reply(_, body) if body["error"] == "rig_not_connected"))
            .count();
        self.shared
            .commands_not_connected
            .fetch_add(refused as u64, Ordering::Relaxed);
        actions
    }

    /// This broker took `rig` over for `boot` from `prev`, the entry it replaced: when that
    /// names another broker, tells it now (CONTRACT.md section 3), not at its next refresh.
    fn evict(&mut self, rig: &RigId, boot: BootId, prev: &Owner) {
        if prev.broker_id.is_empty() || prev.broker_id == self.cfg.broker_id {
            return;
        }
        self.shared.count("evict", "sent");
        let evict = json!({"type": "evict", "rig_id": rig.as_str(), "boot_id": boot.as_str()});
        self.publish(fleet::broker_channel(&prev.broker_id), &evict);
    }

    fn publish(&mut self, channel: String, body: &Value) {
        self.publish_bytes(channel, serde_json::to_vec(body).unwrap_or_default());
    }

    fn publish_bytes(&mut self, channel: String, payload: Vec<u8>) {
        let Some(f) = self.fleet.as_mut() else {
            // Standalone: what fleet mode would put on the events channel is kept for the
            // admin API; replies have gone to their HTTP request already.
            if channel == fleet::EVENTS {
                if let Ok(mut log) = self.shared.event_log.lock() {
                    log.push(payload.into_boxed_slice());
                }
            }
            return;
        };
        f.publish(channel, payload);
        self.count_publish_drops();
    }

    /// Counts the publishes dropped since the last count: refused by a full queue, or by
    /// Redis when the queue was sent (see [`Fleet::flush`]).
    fn count_publish_drops(&mut self) {
        let Some(f) = self.fleet.as_ref() else { return };
        let dropped = f.dropped - self.drops_counted;
        self.drops_counted = f.dropped;
        self.shared.count_n("publish", "dropped", dropped);
    }

    /// Answers the commands still waiting to be kept, releases every lease this broker holds,
    /// then returns (the end of a drain, after the cores have stopped).
    fn shutdown(&mut self, wait: ExitWait) {
        // Kept before the leases go (a released lease fences the persist), a command reaches
        // its rig by resume wherever it reconnects, so control is told `ok`. With Redis away it
        // was neither written nor kept: control hears that instead of nothing.
        let held = std::mem::take(&mut self.persists);
        let kept = match self.fleet.as_ref().is_some_and(Fleet::is_up) {
            true => self.keep(held.iter()),
            false => None,
        };
        let after = std::mem::take(&mut self.after_keeps);
        self.answer_persists(held, kept, false, after);
        // Sessions Redis lost go back before the leases are released, or the resume elsewhere
        // would miss their commands: so do the rigs the drain closed holding commands
        // delivered while Redis was away (queued otherwise only at the next reconnect, which
        // does not come), and the reports owed for sessions that hellos decided here alone
        // ended. Redis away (an outage, a pause) gets the same wait as the events below.
        let unkept = self.registry.parked_unkept_sessions();
        self.queue_rekeeps_of(unkept);
        // Redis away as the drain ends may come back empty (a restart), and with it what it
        // held of the sessions parked here: back within the wait, it gets every one of them,
        // as at any reconnect. Else a rig that resumed elsewhere meanwhile never got their
        // commands, and nothing said so.
        let away = self.fleet.as_ref().is_some_and(|f| !f.is_up());
        let parked_owed = away && !self.cfg.session_ttl.is_zero() && self.registry.has_parked();
        if parked_owed {
            log::warn!(
                "draining while Redis is away: waiting for it (up to {} s) to put back the \
                 sessions parked here, which it may have lost",
                EXIT_FLUSH_WAIT.as_secs()
            );
        }
        if parked_owed && self.fleet.as_mut().is_some_and(|f| f.wait_up(&wait)) {
            self.queue_parked_rekeeps();
            self.name_watched_again();
        }
        loop {
            let owed = !self.rekeeps.is_empty() || !self.ended_alone.is_empty();
            // After a second signal ("now"), only a Redis already there.
            let up = self
                .fleet
                .as_mut()
                .is_some_and(|f| f.is_up() || f.wait_up(&wait));
            if !owed || !up {
                break;
            }
            self.queue_ended_alone();
            self.rekeep_sessions();
            if wait.over(Instant::now()) {
                break;
            }
        }
        self.name_lapses_before_exit();
        // Every broker answers a broadcast once: those still waiting say who never answered.
        let waiting: Vec<u64> = self.broadcasts.keys().copied().collect();
        for agg in waiting {
            self.finish_broadcast(agg, true);
        }
        // Commands waiting for a hand-over that will not happen now.
        let stranded = self.registry.end_hand_overs();
        self.carry_out(stranded);
        for (rig, boot) in self.registry.live_sessions() {
            self.release(rig, boot);
        }
        // Before the last flush, which takes their events out.
        self.report_holds_lost_with_the_keys();
        if let Some(f) = self.fleet.as_mut() {
            f.flush_before_exit(&wait);
            f.retire();
        }
        self.hand_off_holds();
        if !self.ended_alone.is_empty() || !self.rekeeps.is_empty() {
            log::warn!(
                "exiting with {} ended sessions unreported and {} sessions not put back: \
                 Redis did not take them (commands delivered while it was away are lost to a \
                 resume elsewhere, and ended sessions' commands are not reported rig_rebooted)",
                self.ended_alone.len(),
                self.rekeeps.len()
            );
        }
    }
}

/// An `unkept_high` that stands for every command the session holds: Redis lost keys while
/// it was live here, and with them what it had kept of it.
pub(super) const ALL_UNKEPT: Unkept = Unkept {
    from: Seq(0),
    to: Seq(u64::MAX),
};

/// How long the end of a drain waits for an absent Redis to take what the broker still holds
/// for it (events, removals of acked commands, lease releases).
pub(super) const EXIT_FLUSH_WAIT: Duration = Duration::from_secs(5);

#[cfg(test)]
pub(super) mod testing {

    use super::*;
    use crate::doorbell;
    use crate::registry::msg::{ClosedSession, SeqCommand};

    /// A bridge of one core whose Redis is never reached: its publishes stay queued for the
    /// test to read, and so do its messages to the core.
    pub(super) fn bridge() -> (Bridge, Inbox<ToCore>) {
        let fleet = Fleet::new("redis://127.0.0.1:1/", "b1", Duration::from_secs(600));
        let shared = Arc::new(BridgeShared::new(true));
        let (core, inbox) = doorbell::channel::<ToCore>(16).expect("channel");
        let b = Bridge::new(
            crate::config::test_config(),
            vec![core],
            shared,
            fleet.ok(),
            Instant::now(),
        );
        (b, inbox)
    }

    /// The close of `conn`, whose session of `rig` and `boot` holds `carried` unacked and
    /// remembers nothing besides them.
    pub(super) fn closed(
        conn: ConnId,
        rig: RigId,
        boot: BootId,
        next_seq: Seq,
        carried: Vec<SeqCommand>,
    ) -> ToBridge {
        let session = ClosedSession {
            rig,
            boot,
            next_seq,
            carried,
            recall: None,
        };
        ToBridge::Closed {
            conn,
            session: Box::new(session),
        }
    }
}

#[cfg(test)]
mod tests {
    use serde_json::Value;

    use super::testing::bridge;
    use super::*;
    use crate::ids::Seq;

    #[test]
    fn an_event_taken_from_the_inbox_leaves_the_byte_count_and_is_published_as_is() {
        let (mut b, _core) = bridge();
        let ev: Box<[u8]> = Box::new(*br#"{"type":"ack"}"#);
        let charge = event_charge(ev.len());
        b.shared.event_bytes.store(charge + 7, Ordering::Relaxed);
        b.handle(ToBridge::Event(ev.clone()));
        assert_eq!(b.shared.event_bytes.load(Ordering::Relaxed), 7);
        let sent = b.fleet.as_ref().expect("fleet").queued_publishes();
        assert_eq!(sent.last(), Some(&(fleet::EVENTS.to_string(), ev)));
    }

    /// An ack's removal checks whose command Redis holds under the seq, and marks the seq
    /// acked, only where the connection was given that seq while Redis was away, or the
    /// command was read back from Redis (another broker kept it); every other is a plain HDEL.
    #[test]
    fn only_the_removal_of_a_seq_delivered_unkept_or_read_back_is_checked() {
        let (mut b, _core) = bridge();
        let (rig, boot) = (RigId::parse("rig-7").expect("rig"), BootId::generate(1));
        b.unkept_high.insert(
            (rig.clone(), boot),
            Unkept {
                from: Seq(4),
                to: Seq(6),
            },
        );
        let other = BootId::generate(2);
        let seqs = [
            (boot, 3, false),
            (boot, 4, false),
            (boot, 6, false),
            (boot, 7, false),
            (other, 5, false),
            (boot, 8, true),
            (other, 9, true),
        ];
        for (boot, seq, read_back) in seqs {
            b.handle(ToBridge::Forget {
                rig: rig.clone(),
                boot,
                seq: Seq(seq),
                id: format!("c{seq}").into(),
                doubtful: false,
                read_back,
            });
        }
        let f = b.fleet.as_ref().expect("fleet");
        assert_eq!(f.queued_forgets(), 3);
        let checked: Vec<(u64, &str, bool)> = f
            .queued_checked_forgets()
            .iter()
            .map(|c| (c.seq.0, &*c.id, c.doubtful))
            .collect();
        assert_eq!(
            checked,
            [
                (4, "c4", false),
                (6, "c6", false),
                (8, "c8", false),
                (9, "c9", false)
            ]
        );
    }

    #[test]
    fn commands_waiting_to_be_kept_are_answered_at_shutdown_with_redis_away() {
        let (mut b, _core) = bridge();
        for seq in 1..=2 {
            b.persists.push(PersistReq {
                conn: ConnId::new(CoreId(0), 1),
                rig: RigId::parse("rig-7").expect("rig"),
                boot: BootId::generate(1),
                seq: Seq(seq),
                id: format!("c{seq}").into(),
                json: Box::new(*b"{}"),
                reply: ReplyTo::Channel("back".into()),
                hold_left: None,
            });
        }
        b.shutdown(ExitWait::new(
            Instant::now(),
            EXIT_FLUSH_WAIT,
            Default::default(),
        ));
        assert!(b.persists.is_empty());
        let sent = b.fleet.as_ref().expect("fleet").queued_publishes();
        let bodies: Vec<Value> = sent
            .iter()
            .filter(|(channel, _)| channel == "back")
            .map(|(_, body)| serde_json::from_slice(body).expect("json"))
            .collect();
        assert_eq!(bodies.len(), 2, "one answer per command: {bodies:?}");
        for (body, id) in bodies.iter().zip(["c1", "c2"]) {
            assert_eq!(body["id"], id);
            assert_eq!(body["ok"], false);
            assert_eq!(body["error"], "rig_not_connected");
        }
    }
}
