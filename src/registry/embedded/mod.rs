//! The standalone (no Redis) registry: which connection owns which rig, with the same rules the
//! Redis scripts enforce (CONTRACT.md §3), plus the session memory that lets a rig that
//! reconnects with the same boot_id keep its seq and its unacked commands.
//!
//! Pure state: the bridge feeds it inputs and carries out the [`Action`]s it returns.

use std::collections::{HashMap, VecDeque};
use std::time::{Duration, Instant};

use serde_json::Value;

use crate::ids::{BootId, ConnId, RigId, Seq};
use crate::registry::msg::{
    ClosedSession, CommandReq, Recall, ReplyTo, SeqCommand, ToCore, Verdict,
};
use crate::reply;

mod ended;
mod parked;

use parked::Parked;
pub use parked::MAX_PARKED_BYTES;

/// Something the bridge must do.
#[derive(Debug)]
pub enum Action {
    /// Send to the core that owns the connection.
    Core(ConnId, ToCore),
    /// Answer a control request.
    Reply(ReplyTo, Value),
    /// Publish a lifecycle event.
    Event(Value),
    /// Hold a command for a rig that is not connected, for this long.
    Offline(Box<CommandReq>, std::time::Duration),
}

#[derive(Debug)]
enum Owner {
    Live(ConnId),
    /// Same session moving to a new connection: the old one was told to close and its `Closed`
    /// (with the session's seq and unacked commands) completes the move. Boxed: rare, and it
    /// would otherwise widen every rig's entry.
    Handover(Box<Handover>),
}

#[derive(Debug)]
struct Handover {
    old: ConnId,
    /// The connection waiting for the session; None once it went before getting it, and the
    /// old connection's `Closed` then parks the session rather than hand it to nobody.
    new: Option<ConnId>,
    pending: Vec<CommandReq>,
    /// Redis lost the session meanwhile: the new connection puts it back once it holds it.
    rekeep: bool,
}

#[derive(Debug)]
struct Entry {
    boot: BootId,
    owner: Owner,
    labels: Box<[(String, String)]>,
    /// The bridge's Redis connection (its count) under which this session was last named in
    /// `sess:lapses`, 0 for never (fleet mode; see `lua/persist.lua`). In the entry's padding.
    lapse_named: u32,
}

/// Connections whose accepted session is on its way back from a core (see
/// [`Embedded::returned`]); only a lost message could leave one here, so this only guards.
const MAX_AWAITING_RETURN: usize = 65_536;

/// What became of a session its connection could not take ([`Embedded::returned`]).
#[derive(Debug, Default)]
pub struct Returned {
    /// What to carry out: the acceptance of a connection that waited for the session, or
    /// answers to commands that did.
    pub actions: Vec<Action>,
    /// The session's rig and boot, when it ended as at its connection's close.
    pub session: Option<(RigId, BootId)>,
    /// Whether the rig's entry went with it: its lease is to be released.
    pub release: bool,
}

/// A session ended by a newer boot of its rig while its connection was still up.
#[derive(Debug)]
pub struct Rebooted {
    /// The rig.
    pub rig: RigId,
    /// The session's boot.
    pub old: BootId,
    /// The boot that took the rig.
    pub new: BootId,
    /// Its unacked commands: never run.
    pub carried: Vec<SeqCommand>,
}

/// The in-process registry.
#[derive(Debug)]
pub struct Embedded {
    rigs: HashMap<RigId, Entry>,
    parked: HashMap<RigId, Parked>,
    parked_order: VecDeque<(Instant, RigId)>,
    /// Bytes of the commands parked sessions keep.
    parked_bytes: usize,
    max_parked_bytes: usize,
    /// Parked commands dropped for the bound since the bridge last asked.
    parked_dropped: u64,
    /// Those drops, logged at most once a second (a burst drops them rig after rig).
    parked_drop_log: crate::registry::throttle::Throttle,
    /// The session a newer boot took over while it was live, from the last [`Self::closed`]:
    /// its unacked commands never run (`rig_rebooted`).
    rebooted: Option<Rebooted>,
    /// Connections that went after their hello was accepted, before the verdict reached them:
    /// the verdict's session comes back ([`Self::returned`]) and ends as at their close.
    awaiting_return: HashMap<ConnId, (RigId, BootId)>,
    /// The next seq of sessions another boot ended, for the park window: that boot back
    /// numbers on from it.
    ended: ended::Ended,
    park_for: Duration,
    max_pending: usize,
}

impl Embedded {
    /// `park_for`: how long a disconnected session is remembered (the registry TTL);
    /// `max_pending`: commands held for a rig while it moves between connections (the outbox).
    pub fn new(park_for: Duration, max_pending: usize) -> Self {
        Self {
            rigs: HashMap::new(),
            parked: HashMap::new(),
            parked_order: VecDeque::new(),
            parked_bytes: 0,
            max_parked_bytes: MAX_PARKED_BYTES,
            parked_dropped: 0,
            parked_drop_log: Default::default(),
            rebooted: None,
            awaiting_return: HashMap::new(),
            ended: ended::Ended::default(),
            park_for,
            max_pending,
        }
    }

    /// The session the last [`Self::closed`] ended for a newer boot of its rig, if it did.
    pub fn take_rebooted(&mut self) -> Option<Rebooted> {
        self.rebooted.take()
    }

    /// Rigs currently owned by a connection.
    pub fn len(&self) -> usize {
        self.rigs.len()
    }

    /// True when no rig is connected.
    pub fn is_empty(&self) -> bool {
        self.rigs.is_empty()
    }

    /// Labels of every connected rig (for selectors).
    pub fn iter_labels(&self) -> impl Iterator<Item = (&RigId, &[(String, String)])> {
        self.rigs.iter().map(|(r, e)| (r, &e.labels[..]))
    }

    /// The boot of `rig`'s live session here.
    pub fn boot_of(&self, rig: &RigId) -> Option<BootId> {
        self.rigs.get(rig).map(|e| e.boot)
    }

    /// Under which Redis connection (the bridge's count) the live session (`rig`, `boot`)
    /// here was last named in `sess:lapses`: 0 for never, or for no such session.
    pub fn lapse_named(&self, rig: &RigId, boot: BootId) -> u32 {
        self.rigs
            .get(rig)
            .filter(|e| e.boot == boot)
            .map_or(0, |e| e.lapse_named)
    }

    /// The live session (`rig`, `boot`) here was named in `sess:lapses` under Redis
    /// connection `count`.
    pub fn set_lapse_named(&mut self, rig: &RigId, boot: BootId, count: u32) {
        if let Some(e) = self.rigs.get_mut(rig).filter(|e| e.boot == boot) {
            e.lapse_named = count;
        }
    }

    /// Whether a live session of `rig` here has a boot newer than `boot` (a hello with `boot`
    /// is then refused 4409).
    pub fn holds_newer(&self, rig: &RigId, boot: BootId) -> bool {
        self.rigs.get(rig).is_some_and(|e| e.boot > boot)
    }

    /// A valid hello on `conn`. Newer-or-equal boot wins; equal boot continues the session.
    pub fn hello(
        &mut self,
        conn: ConnId,
        rig: RigId,
        boot: BootId,
        labels: Vec<(String, String)>,
    ) -> Vec<Action> {
        let mut out = Vec::new();
        if let Some(entry) = self.rigs.get_mut(&rig) {
            if entry.boot > boot {
                out.push(Action::Core(
                    conn,
                    ToCore::Verdict {
                        conn,
                        verdict: Verdict::Older,
                    },
                ));
                return out;
            }
            let same = entry.boot == boot;
            // During a hand-over the connection superseded is the one that was waiting (it never
            // got a verdict); the old one is closing already.
            let superseded = match &mut entry.owner {
                Owner::Live(old) => Some(*old),
                Owner::Handover(h) => h.new.replace(conn),
            };
            if let Some(c) = superseded {
                out.push(Action::Core(c, ToCore::Supersede { conn: c }));
            }
            entry.labels = labels.into_boxed_slice();
            if same {
                // Wait for the old connection's Closed: it carries the session's seq.
                if let Owner::Live(old) = entry.owner {
                    entry.owner = Owner::Handover(Box::new(Handover {
                        old,
                        new: Some(conn),
                        pending: Vec::new(),
                        rekeep: false,
                    }));
                }
                return out;
            }
            entry.boot = boot;
            entry.lapse_named = 0;
            let held = match std::mem::replace(&mut entry.owner, Owner::Live(conn)) {
                Owner::Handover(h) => h.pending,
                Owner::Live(_) => Vec::new(),
            };
            let next = self.ended.take(&rig, boot).unwrap_or(Seq(1));
            out.push(accept(conn, next, false, Vec::new(), None));
            out.extend(held.into_iter().map(|req| {
                Action::Core(
                    conn,
                    ToCore::Command {
                        conn,
                        req: Box::new(req),
                        direct: false,
                    },
                )
            }));
            return out;
        }
        let parked = self.unpark(&rig);
        let (next_seq, resumed, carried, recall) = match parked {
            Some(p) if p.boot == boot => (p.next_seq, true, p.carried, p.recall),
            other => {
                // This hello ends the session parked for another boot (the bridge reports
                // its commands), an older boot's as much as a newer one's.
                if let Some(p) = other {
                    self.ended.record(&rig, p.boot, p.next_seq, Instant::now());
                }
                let next = self.ended.take(&rig, boot).unwrap_or(Seq(1));
                (next, false, Vec::new(), None)
            }
        };
        self.rigs.insert(
            rig,
            Entry {
                boot,
                owner: Owner::Live(conn),
                labels: labels.into_boxed_slice(),
                lapse_named: 0,
            },
        );
        out.push(accept(conn, next_seq, resumed, carried, recall));
        out
    }

    /// A welcomed connection closed. Only the exact owner releases the entry; the flag says
    /// whether it did (fleet mode then releases the Redis lease too).
    pub fn closed(
        &mut self,
        conn: ConnId,
        session: ClosedSession,
        now: Instant,
    ) -> (Vec<Action>, bool) {
        let mut out = Vec::new();
        let Some(entry) = self.rigs.get_mut(&session.rig) else {
            self.closed_after_its_rig_left(session);
            return (out, false);
        };
        match &mut entry.owner {
            Owner::Live(c) if *c == conn => {
                self.rigs.remove(&session.rig);
                self.park(session, now);
                return (out, true);
            }
            Owner::Handover(h) if h.old == conn && h.new.is_none() => {
                // Nobody waits for the session any more: it is parked for the rig's return, as
                // if the old connection had closed alone.
                let pending = std::mem::take(&mut h.pending);
                out.extend(pending.into_iter().map(no_connection));
                self.rigs.remove(&session.rig);
                self.park(session, now);
                return (out, true);
            }
            Owner::Handover(h) if h.old == conn => {
                let Some(new) = h.new else {
                    return (out, false);
                };
                let pending = std::mem::take(&mut h.pending);
                let rekeep = h.rekeep;
                entry.owner = Owner::Live(new);
                out.push(accept(
                    new,
                    session.next_seq,
                    true,
                    session.carried,
                    session.recall,
                ));
                for req in pending {
                    out.push(Action::Core(
                        new,
                        ToCore::Command {
                            conn: new,
                            req: Box::new(req),
                            direct: false,
                        },
                    ));
                }
                if rekeep {
                    out.push(Action::Core(new, ToCore::Rekeep { conn: new }));
                }
            }
            // Superseded by a newer boot while live (`hello`): nothing will ever resume it.
            _ if entry.boot > session.boot => {
                let (new, now) = (entry.boot, Instant::now());
                self.ended
                    .record(&session.rig, session.boot, session.next_seq, now);
                if !session.carried.is_empty() {
                    self.rebooted = Some(Rebooted {
                        rig: session.rig,
                        old: session.boot,
                        new,
                        carried: session.carried,
                    });
                }
            }
            _ => {}
        }
        (out, false)
    }

    /// A session whose connection a newer boot superseded, closing only after that boot's
    /// own connection went too (its close overtook this one's on another core): the rig has
    /// no entry, and the newer boot's session is parked. This one ends as a reboot would end
    /// it (`rig_rebooted`); dropped, its commands went unreported. With nothing newer parked,
    /// nothing is kept: in fleet mode another broker took the rig (an evict, or a refresh that
    /// found the lease gone), the session goes back to Redis from the bridge as it closed, and
    /// a copy parked here would only be behind the one the rig has there.
    fn closed_after_its_rig_left(&mut self, session: ClosedSession) {
        let Some(newer) = self.parked.get(&session.rig).map(|p| p.boot) else {
            return;
        };
        if newer != session.boot {
            let now = Instant::now();
            self.ended
                .record(&session.rig, session.boot, session.next_seq, now);
        }
        if newer > session.boot && !session.carried.is_empty() {
            self.rebooted = Some(Rebooted {
                rig: session.rig,
                old: session.boot,
                new: newer,
                carried: session.carried,
            });
        }
    }

    /// `conn`'s acceptance is withdrawn (Redis failed to read its session): a connection
    /// of the same boot waiting for its session stops waiting, and is returned to be turned
    /// away as well, with the answers owed to commands that waited for it.
    pub fn stop_waiting_for(&mut self, conn: ConnId, rig: &RigId) -> (Vec<Action>, Option<ConnId>) {
        let Some(Owner::Handover(h)) = self.rigs.get_mut(rig).map(|e| &mut e.owner) else {
            return (Vec::new(), None);
        };
        if h.old != conn {
            return (Vec::new(), None);
        }
        let answers = h.pending.drain(..).map(no_connection).collect();
        (answers, h.new.take())
    }

    /// A connection that said hello closed before its verdict was carried out. If it had been
    /// given the rig, its session is on the way back from its core ([`Self::returned`]); until
    /// then the rig is between connections as in a hand-over, so that a hello of the same boot
    /// waits for that session rather than start afresh without it (its commands would go
    /// unreported), another boot's hello reports it, and the lease stays until it is back.
    ///
    /// The returned boot is set when the rig's entry went at once (the guard below), for its
    /// lease to be released now.
    pub fn abandoned(&mut self, conn: ConnId, rig: &RigId) -> (Vec<Action>, Option<BootId>) {
        let mut out = Vec::new();
        let Some(entry) = self.rigs.get_mut(rig) else {
            return (out, None);
        };
        let boot = entry.boot;
        match &mut entry.owner {
            Owner::Live(c) if *c == conn => {
                entry.owner = Owner::Handover(Box::new(Handover {
                    old: conn,
                    new: None,
                    pending: Vec::new(),
                    rekeep: false,
                }));
            }
            Owner::Handover(h) if h.new == Some(conn) => {
                h.new = None;
                for req in h.pending.drain(..) {
                    out.push(no_connection(req));
                }
                return (out, None);
            }
            // The old connection of a hand-over, gone before its own verdict reached it.
            Owner::Handover(h) if h.old == conn => {}
            _ => return (out, None),
        }
        // One per connection, and each comes back: the bound is a guard against a lost
        // message. Past it the rig is not left waiting for a session that might not come: its
        // entry goes now (a connection waiting for the session is turned away, to come back),
        // and the session, when it does come, is dropped.
        if self.awaiting_return.len() >= MAX_AWAITING_RETURN {
            let (answers, waiting) = self.stop_waiting_for(conn, rig);
            out.extend(answers);
            out.extend(waiting.map(turned_away));
            self.rigs.remove(rig);
            return (out, Some(boot));
        }
        self.awaiting_return.insert(conn, (rig.clone(), boot));
        (out, None)
    }

    /// An accepted session its connection could not take. `rig` (with the hello's boot) is
    /// set when the connection was still there (closing); otherwise its `Abandoned` came
    /// first and said which rig. Either way the session ends as at that connection's close,
    /// whatever became of the rig since the verdict: parked if nobody else holds the rig
    /// (whose lease is then released), handed to a same-boot connection waiting for it,
    /// reported `rig_rebooted` if a newer boot took the rig.
    pub fn returned(
        &mut self,
        conn: ConnId,
        rig: Option<(RigId, BootId)>,
        next_seq: Seq,
        carried: Vec<SeqCommand>,
        recall: Option<Box<Recall>>,
        now: Instant,
    ) -> Returned {
        let Some((rig, boot)) = rig.or_else(|| self.awaiting_return.remove(&conn)) else {
            return Returned::default();
        };
        let session = ClosedSession {
            rig: rig.clone(),
            boot,
            next_seq,
            carried,
            recall,
        };
        let (actions, release) = self.closed(conn, session, now);
        Returned {
            actions,
            session: Some((rig, boot)),
            release,
        }
    }

    /// The connection holding `rig`; None while it moves between connections.
    pub fn conn_of(&self, rig: &RigId) -> Option<ConnId> {
        match self.rigs.get(rig)?.owner {
            Owner::Live(conn) => Some(conn),
            Owner::Handover(_) => None,
        }
    }

    /// Redis lost `rig`'s session: the connection that holds it now, to send it back; during a
    /// hand-over None, and the new connection is asked once the session has moved to it.
    pub fn rekeep_from(&mut self, rig: &RigId) -> Option<ConnId> {
        match &mut self.rigs.get_mut(rig)?.owner {
            Owner::Live(conn) => Some(*conn),
            Owner::Handover(h) => {
                h.rekeep = true;
                None
            }
        }
    }

    /// Whether `conn` holds `rig`: its live connection, or the one closing while the rig moves
    /// to a new connection of the same boot.
    pub fn held_by(&self, rig: &RigId, conn: ConnId) -> bool {
        self.rigs.get(rig).is_some_and(|e| match &e.owner {
            Owner::Live(c) => *c == conn,
            Owner::Handover(h) => h.old == conn,
        })
    }

    /// Whether `conn` waits for `rig`'s session from its connection before it (a same-boot
    /// hand-over on this broker).
    pub fn awaits_handover(&self, rig: &RigId, conn: ConnId) -> bool {
        self.rigs
            .get(rig)
            .is_some_and(|e| matches!(&e.owner, Owner::Handover(h) if h.new == Some(conn)))
    }

    /// Every rig this broker holds, with its boot (for lease refreshes).
    pub fn live_sessions(&self) -> Vec<(RigId, BootId)> {
        self.rigs.iter().map(|(r, e)| (r.clone(), e.boot)).collect()
    }

    /// Gives back the room of tables a burst grew and that now hold a quarter of it or less:
    /// 10,000 rigs that connected and left kept about 5 MB of empty table room here until
    /// the broker restarted. Called now and then, never on a rig's path.
    pub fn shrink_idle(&mut self) {
        fn shrink<K: std::hash::Hash + Eq, V>(map: &mut HashMap<K, V>) {
            if map.capacity() > 256 && map.len() < map.capacity() / 4 {
                map.shrink_to(map.len() * 2);
            }
        }
        shrink(&mut self.rigs);
        shrink(&mut self.parked);
        shrink(&mut self.awaiting_return);
        if self.parked_order.capacity() > 256
            && self.parked_order.len() < self.parked_order.capacity() / 4
        {
            self.parked_order.shrink_to(self.parked_order.len() * 2);
        }
    }

    /// Another broker owns `rig` now (a refresh said superseded, or an evict arrived with a boot
    /// at least as new as ours): close the local connection with 4410 and forget the entry.
    pub fn supersede(&mut self, rig: &RigId, at_least: Option<BootId>) -> Vec<Action> {
        let Some(entry) = self.rigs.get(rig) else {
            return Vec::new();
        };
        if at_least.is_some_and(|b| entry.boot > b) {
            return Vec::new();
        }
        let Some(entry) = self.rigs.remove(rig) else {
            return Vec::new();
        };
        let mut out = Vec::new();
        match entry.owner {
            Owner::Live(c) => out.push(Action::Core(c, ToCore::Supersede { conn: c })),
            Owner::Handover(h) => {
                out.push(Action::Core(h.old, ToCore::Supersede { conn: h.old }));
                if let Some(new) = h.new {
                    out.push(Action::Core(new, ToCore::Supersede { conn: new }));
                }
                out.extend(h.pending.into_iter().map(not_connected));
            }
        }
        out
    }

    /// Rigs whose labels include every `selector` pair.
    pub fn matching(&self, selector: &[(String, String)]) -> Vec<RigId> {
        self.rigs
            .iter()
            .filter(|(_, e)| selector.iter().all(|kv| e.labels.contains(kv)))
            .map(|(r, _)| r.clone())
            .collect()
    }

    /// Routes a command to the connection that holds the rig.
    pub fn command(&mut self, req: Box<CommandReq>) -> Vec<Action> {
        let max_pending = self.max_pending;
        match self.rigs.get_mut(&req.rig).map(|e| &mut e.owner) {
            Some(Owner::Live(conn)) => {
                vec![Action::Core(
                    *conn,
                    ToCore::Command {
                        conn: *conn,
                        req,
                        direct: false,
                    },
                )]
            }
            Some(Owner::Handover(h)) if h.pending.len() < max_pending => {
                h.pending.push(*req);
                Vec::new()
            }
            Some(Owner::Handover(_)) => {
                let body = reply::error(
                    &req.id,
                    Some(req.rig.as_str()),
                    "rig_unresponsive",
                    "rig is reconnecting and its hand-over queue is full",
                );
                vec![Action::Reply(req.reply, body)]
            }
            None => match req.offline_ttl {
                Some(ttl) => vec![Action::Offline(req, ttl)],
                None => vec![not_connected(*req)],
            },
        }
    }

    /// Routes a kick.
    pub fn kick(&mut self, id: String, rig: RigId, reply_to: ReplyTo) -> Vec<Action> {
        // During a hand-over the kick goes to the connection waiting for the session; with none
        // waiting, no connection holds the rig.
        let holder = self.rigs.get(&rig).and_then(|e| match &e.owner {
            Owner::Live(c) => Some(*c),
            Owner::Handover(h) => h.new,
        });
        match holder {
            Some(conn) => {
                vec![Action::Core(
                    conn,
                    ToCore::Kick {
                        conn,
                        id,
                        rig,
                        reply: reply_to,
                    },
                )]
            }
            None => {
                let body = reply::error(
                    &id,
                    Some(rig.as_str()),
                    "rig_not_connected",
                    "this broker holds no connection of this rig",
                );
                vec![Action::Reply(reply_to, body)]
            }
        }
    }

    /// At shutdown: the commands held for hand-overs, answered `rig_not_connected` (the rig
    /// will find its session on its next broker, but these were never numbered).
    pub fn end_hand_overs(&mut self) -> Vec<Action> {
        let mut out = Vec::new();
        for entry in self.rigs.values_mut() {
            if let Owner::Handover(h) = &mut entry.owner {
                out.extend(h.pending.drain(..).map(not_connected));
            }
        }
        out
    }
}

/// 4503 for `conn`, whose hello is not to be answered with a session after all: it comes back.
pub(crate) fn turned_away(conn: ConnId) -> Action {
    Action::Core(
        conn,
        ToCore::Verdict {
            conn,
            verdict: Verdict::Busy,
        },
    )
}

fn accept(
    conn: ConnId,
    next_seq: Seq,
    resumed: bool,
    carried: Vec<SeqCommand>,
    recall: Option<Box<Recall>>,
) -> Action {
    Action::Core(
        conn,
        ToCore::Verdict {
            conn,
            verdict: Verdict::Accept {
                next_seq,
                resumed,
                carried,
                recall,
            },
        },
    )
}

/// A command that waited for a hand-over no connection will finish: held for the rig's
/// return if control asked for that (`queue_if_offline`), as it would have been had it come a
/// moment later, otherwise `rig_not_connected`.
fn no_connection(req: CommandReq) -> Action {
    match req.offline_ttl {
        Some(ttl) => Action::Offline(Box::new(req), ttl),
        None => not_connected(req),
    }
}

fn not_connected(req: CommandReq) -> Action {
    let body = reply::error(
        &req.id,
        Some(req.rig.as_str()),
        "rig_not_connected",
        "this broker holds no connection of this rig",
    );
    Action::Reply(req.reply, body)
}

#[cfg(test)]
mod test_support {
    use super::*;
    use crate::ids::CoreId;
    use crate::registry::msg::AdminAnswer;

    pub(super) fn rig() -> RigId {
        RigId::parse("rig-1").unwrap()
    }
    pub(super) fn boot(ms: u64) -> BootId {
        BootId::generate(ms)
    }
    pub(super) fn conn(n: u64) -> ConnId {
        ConnId::new(CoreId(0), n)
    }
    /// `rig`'s session of `boot` as its closed connection's core hands it over.
    pub(super) fn session(
        rig: RigId,
        boot: BootId,
        next_seq: Seq,
        carried: Vec<SeqCommand>,
        recall: Option<Box<Recall>>,
    ) -> ClosedSession {
        ClosedSession {
            rig,
            boot,
            next_seq,
            carried,
            recall,
        }
    }
    /// Command `x` for [`rig`] from the admin API, answered on `reply`.
    pub(super) fn admin_command(
        id: &str,
        reply: crossbeam_channel::Sender<AdminAnswer>,
    ) -> Box<CommandReq> {
        Box::new(CommandReq {
            id: id.into(),
            rig: rig(),
            name: "x".into(),
            args: crate::args::Args::null(),
            reply: ReplyTo::Admin(reply),
            offline_ttl: None,
        })
    }
    pub(super) fn verdict_of(actions: &[Action], c: ConnId) -> Option<&Verdict> {
        actions.iter().find_map(|a| match a {
            Action::Core(to, ToCore::Verdict { verdict, .. }) if *to == c => Some(verdict),
            _ => None,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::test_support::*;
    use super::*;

    /// A rig's entry is its cost here per connection: the flag naming its session in
    /// `sess:lapses` sits in what was padding.
    #[test]
    fn an_entry_stays_72_bytes() {
        assert_eq!(std::mem::size_of::<Entry>(), 72);
    }

    /// A session named under one Redis connection is named again under the next, and a new
    /// boot starts unnamed.
    #[test]
    fn a_session_is_named_once_per_redis_connection_and_boot() {
        let mut r = Embedded::new(Duration::from_secs(60), 4);
        let (old, new) = (boot(1), boot(2));
        r.hello(conn(1), rig(), old, vec![]);
        assert_eq!(r.lapse_named(&rig(), old), 0);
        r.set_lapse_named(&rig(), old, 3);
        assert_eq!(r.lapse_named(&rig(), old), 3);
        assert_eq!(r.lapse_named(&rig(), new), 0, "another boot's");
        r.hello(conn(2), rig(), new, vec![]);
        assert_eq!(r.lapse_named(&rig(), new), 0);
    }

    /// The old boot's connection closes after the new boot's (two cores, two inboxes): the
    /// rig's entry is gone by then, and the old session still ends as a reboot, not in silence.
    #[test]
    fn an_old_boot_closing_after_the_new_one_left_is_reported_rebooted() {
        let mut r = Embedded::new(Duration::from_secs(60), 4);
        let now = Instant::now();
        let (old, new) = (boot(1), boot(2));
        let command = SeqCommand::for_test(1, 8, false);
        r.hello(conn(1), rig(), old, vec![]);
        assert_eq!(superseded(&r.hello(conn(2), rig(), new, vec![])), [conn(1)]);
        let (_, released) = r.closed(conn(2), session(rig(), new, Seq(1), vec![], None), now);
        assert!(released);
        assert!(r.take_rebooted().is_none());
        let (_, released) = r.closed(
            conn(1),
            session(rig(), old, Seq(2), vec![command], None),
            now,
        );
        assert!(!released, "the lease is the new boot's");
        let rebooted = r.take_rebooted().expect("reported");
        assert_eq!((rebooted.old, rebooted.new), (old, new));
        assert_eq!(rebooted.carried.len(), 1);
        assert_eq!(
            r.parked(&rig()).map(|(b, ..)| b),
            Some(new),
            "the new boot's stays parked"
        );
    }

    /// A boot back after a newer one ended its session (review bb147) numbers on where it
    /// stopped, not from 1 under seqs the rig has: whether it was parked or live when the
    /// newer boot's hello came, and whichever boot is older.
    #[test]
    fn a_boot_back_after_another_ended_its_session_numbers_on() {
        let next_of = |actions: &[Action], c| match verdict_of(actions, c) {
            Some(Verdict::Accept {
                next_seq, resumed, ..
            }) => (next_seq.0, *resumed),
            other => panic!("{other:?}"),
        };
        let mut r = Embedded::new(Duration::from_secs(60), 4);
        let now = Instant::now();
        let (b1, b2) = (boot(1), boot(2));
        // Parked: b1 leaves at 4, b2's hello ends it, b2 leaves at 3, b1 is back.
        r.hello(conn(1), rig(), b1, vec![]);
        r.closed(conn(1), session(rig(), b1, Seq(4), vec![], None), now);
        assert_eq!(
            next_of(&r.hello(conn(2), rig(), b2, vec![]), conn(2)),
            (1, false)
        );
        r.closed(conn(2), session(rig(), b2, Seq(3), vec![], None), now);
        assert_eq!(
            next_of(&r.hello(conn(3), rig(), b1, vec![]), conn(3)),
            (4, false)
        );
        // Live: b2, newer, takes the rig from b1's connection, which closes at 6 after it.
        let taken = r.hello(conn(4), rig(), b2, vec![]);
        assert_eq!(next_of(&taken, conn(4)), (3, false));
        r.closed(conn(3), session(rig(), b1, Seq(6), vec![], None), now);
        r.closed(conn(4), session(rig(), b2, Seq(5), vec![], None), now);
        assert_eq!(
            next_of(&r.hello(conn(5), rig(), b1, vec![]), conn(5)),
            (6, false)
        );
        // Past the park window it is forgotten with the parked sessions.
        r.closed(conn(5), session(rig(), b1, Seq(8), vec![], None), now);
        r.hello(conn(6), rig(), b2, vec![]);
        r.closed(conn(6), session(rig(), b2, Seq(5), vec![], None), now);
        r.expire(Instant::now() + Duration::from_secs(61));
        assert_eq!(
            next_of(&r.hello(conn(7), rig(), b1, vec![]), conn(7)),
            (1, false)
        );
    }

    fn superseded(actions: &[Action]) -> Vec<ConnId> {
        actions
            .iter()
            .filter_map(|a| match a {
                Action::Core(_, ToCore::Supersede { conn }) => Some(*conn),
                _ => None,
            })
            .collect()
    }

    #[test]
    fn older_boot_is_refused_newer_takes_over() {
        let mut r = Embedded::new(Duration::from_secs(60), 4);
        let now = Instant::now();
        let a = r.hello(conn(1), rig(), boot(200), vec![]);
        assert!(matches!(
            verdict_of(&a, conn(1)),
            Some(Verdict::Accept { resumed: false, .. })
        ));
        let b = r.hello(conn(2), rig(), boot(100), vec![]);
        assert!(matches!(verdict_of(&b, conn(2)), Some(Verdict::Older)));
        assert!(superseded(&b).is_empty(), "an older hello writes nothing");
        let c = r.hello(conn(3), rig(), boot(300), vec![]);
        assert_eq!(superseded(&c), vec![conn(1)]);
        assert!(matches!(
            verdict_of(&c, conn(3)),
            Some(Verdict::Accept {
                next_seq: Seq(1),
                ..
            })
        ));
        // The stale connection's close must not release the new owner.
        let (_, released) = r.closed(
            conn(1),
            session(rig(), boot(200), Seq(5), vec![], None),
            now,
        );
        assert!(!released);
        assert_eq!(r.len(), 1);
        // A refresh that finds another owner supersedes the local connection.
        let a = r.supersede(&rig(), None);
        assert_eq!(superseded(&a), vec![conn(3)]);
        assert!(r.is_empty());
    }

    #[test]
    fn same_boot_hands_the_session_over() {
        let mut r = Embedded::new(Duration::from_secs(60), 4);
        let now = Instant::now();
        let b = boot(100);
        r.hello(conn(1), rig(), b, vec![]);
        let a = r.hello(conn(2), rig(), b, vec![]);
        assert_eq!(superseded(&a), vec![conn(1)]);
        assert!(
            verdict_of(&a, conn(2)).is_none(),
            "waits for the old connection's seq"
        );
        let (tx, _rx) = crossbeam_channel::bounded(1);
        let req = admin_command("c", tx);
        assert!(r.command(req).is_empty(), "held during the hand-over");
        let (done, released) = r.closed(conn(1), session(rig(), b, Seq(8), vec![], None), now);
        assert!(!released, "the session moved, the lease stays");
        assert!(matches!(
            verdict_of(&done, conn(2)),
            Some(Verdict::Accept {
                next_seq: Seq(8),
                resumed: true,
                ..
            })
        ));
        assert!(done
            .iter()
            .any(|a| matches!(a, Action::Core(c, ToCore::Command { .. }) if *c == conn(2))));
    }

    /// The new connection of a hand-over went (kicked, or timed out) before the old one's
    /// session reached it: the session is parked, and the rig's next connection resumes it
    /// instead of waiting forever for a connection that is gone.
    #[test]
    fn a_hand_over_whose_new_connection_went_parks_the_session_for_the_next_one() {
        let mut r = Embedded::new(Duration::from_secs(60), 4);
        let now = Instant::now();
        let b = boot(100);
        r.hello(conn(1), rig(), b, vec![]);
        r.hello(conn(2), rig(), b, vec![]);
        let (gone, _) = r.abandoned(conn(2), &rig());
        assert!(gone.is_empty());
        // Meanwhile no connection holds the rig: a kick is answered, not sent to the one gone.
        let (tx, _rx) = crossbeam_channel::bounded(1);
        let kicked = r.kick("k".into(), rig(), ReplyTo::Admin(tx));
        assert!(
            matches!(&kicked[..], [Action::Reply(_, body)] if body["error"] == "rig_not_connected"),
            "{kicked:?}"
        );
        let (done, released) = r.closed(conn(1), session(rig(), b, Seq(8), vec![], None), now);
        assert!(released, "nobody holds the rig now: its lease goes");
        assert!(verdict_of(&done, conn(2)).is_none(), "{done:?}");
        assert!(r.is_empty() && r.conn_of(&rig()).is_none());
        let back = r.hello(conn(3), rig(), b, vec![]);
        assert!(
            matches!(
                verdict_of(&back, conn(3)),
                Some(Verdict::Accept {
                    next_seq: Seq(8),
                    resumed: true,
                    ..
                })
            ),
            "{back:?}"
        );
        assert_eq!(r.conn_of(&rig()), Some(conn(3)));
    }

    /// A resumed session whose connection went before its verdict arrived comes back from the
    /// core and is parked: the rig's next connection resumes it, seq and commands.
    #[test]
    fn a_session_its_connection_could_not_take_is_parked_for_the_next_one() {
        let now = Instant::now();
        let b = boot(100);
        let cmd = || vec![SeqCommand::for_test(7, 10, false)];
        // The connection went first (Abandoned), then the verdict came back.
        let mut r = Embedded::new(Duration::from_secs(60), 4);
        r.hello(conn(1), rig(), b, vec![]);
        let (out, gone) = r.abandoned(conn(1), &rig());
        assert!(
            out.is_empty() && gone.is_none(),
            "the lease waits for the session"
        );
        assert!(
            r.conn_of(&rig()).is_none(),
            "between connections until it is back"
        );
        let back = r.returned(conn(1), None, Seq(8), cmd(), None, now);
        assert!(
            back.release,
            "its lease goes once its session is back and parked"
        );
        // The connection was closing when the verdict came: it goes back with the rig named.
        let mut r2 = Embedded::new(Duration::from_secs(60), 4);
        r2.hello(conn(1), rig(), b, vec![]);
        let back = r2.returned(conn(1), Some((rig(), b)), Seq(8), cmd(), None, now);
        assert!(back.release, "its lease is released");
        assert!(r2.abandoned(conn(1), &rig()).0.is_empty());
        assert!(r2.is_empty(), "nothing left to abandon");
        for r in [&mut r, &mut r2] {
            let again = r.hello(conn(2), rig(), b, vec![]);
            match verdict_of(&again, conn(2)) {
                Some(Verdict::Accept {
                    next_seq,
                    resumed,
                    carried,
                    ..
                }) => {
                    assert_eq!((*next_seq, *resumed), (Seq(8), true));
                    assert_eq!(carried.iter().map(|c| c.seq).collect::<Vec<_>>(), [Seq(7)]);
                }
                other => panic!("{other:?}"),
            }
        }
        // The rig's next hello came before the session did: it waits for it, and resumes it
        // (it started afresh without it, and the session's commands went unreported).
        let mut r3 = Embedded::new(Duration::from_secs(60), 4);
        r3.hello(conn(1), rig(), b, vec![]);
        r3.abandoned(conn(1), &rig());
        assert!(verdict_of(&r3.hello(conn(2), rig(), b, vec![]), conn(2)).is_none());
        let back = r3.returned(conn(1), None, Seq(8), cmd(), None, now);
        assert!(!back.release, "the lease is the waiting connection's");
        match verdict_of(&back.actions, conn(2)) {
            Some(Verdict::Accept {
                next_seq, resumed, ..
            }) => assert_eq!((*next_seq, *resumed), (Seq(8), true)),
            other => panic!("{other:?}"),
        }
        assert_eq!(r3.conn_of(&rig()), Some(conn(2)));
        // Another boot's hello came first: it starts afresh, and the session is reported.
        let mut r4 = Embedded::new(Duration::from_secs(60), 4);
        r4.hello(conn(1), rig(), b, vec![]);
        r4.abandoned(conn(1), &rig());
        let newer = boot(200);
        assert!(verdict_of(&r4.hello(conn(2), rig(), newer, vec![]), conn(2)).is_some());
        assert!(!r4.returned(conn(1), None, Seq(8), cmd(), None, now).release);
        let rebooted = r4.take_rebooted().expect("reported, not dropped");
        assert_eq!((rebooted.old, rebooted.new), (b, newer));
    }

    /// A closing connection's session comes back after the rig moved on: to the same boot's
    /// connection that waits for it (which was left waiting for a close that never came, and
    /// every later hello of that boot with it), or reported when a newer boot took the rig.
    #[test]
    fn a_returned_session_goes_where_the_rig_went_since_its_verdict() {
        let now = Instant::now();
        let b = boot(100);
        let mut r = Embedded::new(Duration::from_secs(60), 4);
        r.hello(conn(1), rig(), b, vec![]);
        assert_eq!(superseded(&r.hello(conn(2), rig(), b, vec![])), [conn(1)]);
        let cmd = vec![SeqCommand::for_test(7, 10, false)];
        let back = r.returned(conn(1), Some((rig(), b)), Seq(8), cmd, None, now);
        assert!(!back.release, "the lease stays with the waiting connection");
        let out = back.actions;
        match verdict_of(&out, conn(2)) {
            Some(Verdict::Accept {
                next_seq,
                resumed,
                carried,
                ..
            }) => {
                assert_eq!((*next_seq, *resumed, carried.len()), (Seq(8), true, 1));
            }
            other => panic!("{other:?}"),
        }
        assert_eq!(r.conn_of(&rig()), Some(conn(2)));

        // A newer boot took the rig before the old boot's closing connection sent it back.
        let mut r = Embedded::new(Duration::from_secs(60), 4);
        let newer = boot(200);
        r.hello(conn(1), rig(), b, vec![]);
        r.hello(conn(2), rig(), newer, vec![]);
        let cmd = vec![SeqCommand::for_test(7, 10, false)];
        assert!(
            !r.returned(conn(1), Some((rig(), b)), Seq(8), cmd, None, now)
                .release
        );
        let rebooted = r.take_rebooted().expect("reported, not dropped");
        assert_eq!(
            (rebooted.old, rebooted.new, rebooted.carried.len()),
            (b, newer, 1)
        );
        assert_eq!(r.conn_of(&rig()), Some(conn(2)));
    }

    /// The old connection of a hand-over goes before its own verdict reached it (`Abandoned`
    /// first, then its session back from the core): the hand-over completes with that session
    /// rather than wait for a close that never comes.
    #[test]
    fn a_hand_over_whose_old_connection_went_before_its_verdict_still_completes() {
        let now = Instant::now();
        let b = boot(100);
        let mut r = Embedded::new(Duration::from_secs(60), 4);
        r.hello(conn(1), rig(), b, vec![]);
        r.hello(conn(2), rig(), b, vec![]);
        assert!(r.abandoned(conn(1), &rig()).1.is_none());
        let cmd = vec![SeqCommand::for_test(7, 10, false)];
        let back = r.returned(conn(1), None, Seq(8), cmd, None, now);
        assert!(!back.release);
        assert_eq!(back.session, Some((rig(), b)));
        match verdict_of(&back.actions, conn(2)) {
            Some(Verdict::Accept {
                next_seq, resumed, ..
            }) => assert_eq!((*next_seq, *resumed), (Seq(8), true)),
            other => panic!("{other:?}"),
        }
        assert_eq!(r.conn_of(&rig()), Some(conn(2)));
    }

    /// Past the guard on sessions awaited back, a rig is not left waiting for one: its entry
    /// goes at once, its lease with it, and the connection waiting for the session is turned
    /// away to come back.
    #[test]
    fn past_the_guard_a_rig_does_not_wait_for_a_session_that_might_not_come() {
        let b = boot(100);
        let mut r = Embedded::new(Duration::from_secs(60), 4);
        for n in 0..MAX_AWAITING_RETURN as u64 {
            r.awaiting_return.insert(conn(1_000_000 + n), (rig(), b));
        }
        r.hello(conn(1), rig(), b, vec![]);
        r.hello(conn(2), rig(), b, vec![]);
        let (out, gone) = r.abandoned(conn(1), &rig());
        assert_eq!(gone, Some(b), "its lease goes now");
        assert!(
            matches!(verdict_of(&out, conn(2)), Some(Verdict::Busy)),
            "{out:?}"
        );
        assert!(r.is_empty());
        let back = r.hello(conn(3), rig(), b, vec![]);
        assert!(
            verdict_of(&back, conn(3)).is_some(),
            "a later hello is answered"
        );
    }

    /// An acceptance withdrawn while a same-boot connection waits for its session: that one
    /// stops waiting (to be turned away too), and the session parks for the rig's return.
    #[test]
    fn a_withdrawn_acceptance_takes_the_connection_waiting_for_it_along() {
        let now = Instant::now();
        let b = boot(100);
        let mut r = Embedded::new(Duration::from_secs(60), 4);
        r.hello(conn(1), rig(), b, vec![]);
        r.hello(conn(2), rig(), b, vec![]);
        assert_eq!(
            r.stop_waiting_for(conn(2), &rig()).1,
            None,
            "not the old one"
        );
        assert_eq!(r.stop_waiting_for(conn(1), &rig()).1, Some(conn(2)));
        let cmd = vec![SeqCommand::for_test(7, 10, false)];
        let back = r.returned(conn(1), Some((rig(), b)), Seq(8), cmd, None, now);
        assert!(back.release, "nobody holds the rig now");
        let out = back.actions;
        assert!(verdict_of(&out, conn(2)).is_none(), "{out:?}");
        assert_eq!(
            r.parked(&rig()).map(|(_, next, c)| (next, c.len())),
            Some((Seq(8), 1))
        );
    }

    /// Commands that waited for a hand-over no connection finishes: held for the rig's return
    /// when control asked for that, refused otherwise (both were refused).
    #[test]
    fn commands_left_by_a_hand_over_nobody_finishes_are_held_if_asked() {
        let now = Instant::now();
        let b = boot(100);
        let mut r = Embedded::new(Duration::from_secs(60), 4);
        r.hello(conn(1), rig(), b, vec![]);
        r.abandoned(conn(1), &rig());
        let (tx, _rx) = crossbeam_channel::bounded(4);
        let mut held = admin_command("held", tx.clone());
        held.offline_ttl = Some(Duration::from_secs(30));
        assert!(r.command(held).is_empty(), "waits for the session");
        assert!(r.command(admin_command("plain", tx)).is_empty());
        let back = r.returned(conn(1), None, Seq(3), vec![], None, now);
        assert!(back.release);
        let outcomes: Vec<&str> = back
            .actions
            .iter()
            .map(|a| match a {
                Action::Offline(req, ttl) if *ttl == Duration::from_secs(30) => &*req.id,
                Action::Reply(_, body) if body["error"] == "rig_not_connected" => "refused",
                other => panic!("{other:?}"),
            })
            .collect();
        assert_eq!(outcomes, ["held", "refused"]);
    }

    /// Shutdown answers what waited for a hand-over, once.
    #[test]
    fn commands_held_for_a_hand_over_are_answered_at_shutdown() {
        let mut r = Embedded::new(Duration::from_secs(60), 4);
        let b = boot(100);
        r.hello(conn(1), rig(), b, vec![]);
        r.hello(conn(2), rig(), b, vec![]);
        let (tx, rx) = crossbeam_channel::bounded(4);
        let req = admin_command("held", tx);
        assert!(r.command(req).is_empty());
        let out = r.end_hand_overs();
        assert_eq!(out.len(), 1);
        let Some(Action::Reply(_, body)) = out.first() else {
            panic!("{out:?}")
        };
        assert_eq!(body["error"], "rig_not_connected");
        assert_eq!(body["id"], "held");
        assert!(r.end_hand_overs().is_empty(), "answered once");
        drop(rx);
    }

    /// A third connection during a hand-over whose second went is the one the session waits
    /// for.
    #[test]
    fn a_newer_connection_after_the_new_one_went_still_gets_the_session() {
        let mut r = Embedded::new(Duration::from_secs(60), 4);
        let b = boot(100);
        r.hello(conn(1), rig(), b, vec![]);
        r.hello(conn(2), rig(), b, vec![]);
        r.abandoned(conn(2), &rig());
        r.hello(conn(3), rig(), b, vec![]);
        let (done, released) = r.closed(
            conn(1),
            session(rig(), b, Seq(4), vec![], None),
            Instant::now(),
        );
        assert!(!released);
        assert!(matches!(
            verdict_of(&done, conn(3)),
            Some(Verdict::Accept {
                next_seq: Seq(4),
                resumed: true,
                ..
            })
        ));
    }

    /// Redis lost the session while it moved between connections: the new connection is
    /// asked to put it back once it holds it, after its welcome.
    #[test]
    fn a_session_lost_in_redis_during_a_hand_over_is_put_back_by_the_new_connection() {
        let mut r = Embedded::new(Duration::from_secs(60), 4);
        let b = boot(100);
        r.hello(conn(1), rig(), b, vec![]);
        assert_eq!(r.rekeep_from(&rig()), Some(conn(1)));
        r.hello(conn(2), rig(), b, vec![]);
        assert_eq!(r.rekeep_from(&rig()), None, "asked later");
        let (done, _) = r.closed(
            conn(1),
            session(rig(), b, Seq(3), vec![], None),
            Instant::now(),
        );
        let accept = done
            .iter()
            .position(|a| matches!(a, Action::Core(c, ToCore::Verdict { .. }) if *c == conn(2)));
        let rekeep = done.iter().position(|a| {
            matches!(a, Action::Core(c, ToCore::Rekeep { conn: to }) if *c == conn(2) && *to == conn(2))
        });
        assert!(accept.is_some() && rekeep > accept, "{done:?}");
    }

    /// 2,000 rigs that came and went leave their tables' room behind until the next trim.
    #[test]
    fn tables_a_burst_grew_give_their_room_back_once_mostly_empty() {
        let mut r = Embedded::new(Duration::from_secs(60), 4);
        for i in 0..2000 {
            let rig = RigId::parse(&format!("rig-{i}")).unwrap();
            r.hello(conn(i), rig, boot(1), vec![]);
        }
        let grown = r.rigs.capacity();
        r.rigs.retain(|rig, _| rig.as_str() == "rig-7");
        r.shrink_idle();
        assert!(
            r.rigs.capacity() < grown / 8,
            "{} of {grown}",
            r.rigs.capacity()
        );
        assert!(r.rigs.contains_key(&RigId::parse("rig-7").unwrap()));
        // A table still a quarter full keeps its room: it would only grow again.
        let mut busy = Embedded::new(Duration::from_secs(60), 4);
        for i in 0..2000 {
            busy.hello(
                conn(i),
                RigId::parse(&format!("rig-{i}")).unwrap(),
                boot(1),
                vec![],
            );
        }
        let room = busy.rigs.capacity();
        busy.shrink_idle();
        assert_eq!(busy.rigs.capacity(), room);
    }

    #[test]
    fn selectors_match_every_pair() {
        let mut r = Embedded::new(Duration::from_secs(60), 4);
        let lab = |v: &str| {
            vec![
                ("lab".to_string(), v.to_string()),
                ("os".to_string(), "linux".to_string()),
            ]
        };
        r.hello(conn(1), RigId::parse("a").unwrap(), boot(1), lab("x"));
        r.hello(conn(2), RigId::parse("b").unwrap(), boot(1), lab("y"));
        assert_eq!(r.matching(&[("lab".into(), "x".into())]).len(), 1);
        assert_eq!(r.matching(&[("os".into(), "linux".into())]).len(), 2);
        assert_eq!(r.matching(&[("os".into(), "bsd".into())]).len(), 0);
    }

    #[test]
    fn unknown_rig_gets_not_connected() {
        let mut r = Embedded::new(Duration::from_secs(60), 4);
        let (tx, _rx) = crossbeam_channel::bounded(1);
        let req = admin_command("c", tx);
        let a = r.command(req);
        assert!(matches!(&a[..], [Action::Reply(_, v)] if v["error"] == "rig_not_connected"));
    }
}
