//! Sessions waiting to be put back into Redis, one entry per session, and the bridge's work of
//! putting them back. A Redis that flaps makes every core send every connected session again
//! at each reconnect; keeping only the latest copy bounds the queue by the sessions this
//! broker holds.
//!
//! Two kinds go back. A connected rig's session comes from its core (see `Bridge::refresh`),
//! fenced by the rig's lease. A session parked here for a rig that disconnected (while Redis
//! was away, say, with commands delivered unkept) is queued by the bridge at the same
//! reconnect, and read from the registry when it is sent, so it goes as it then is: its lease
//! was released or lost with Redis, so `rekeep.lua` writes it only where no one else holds the
//! rig. Without it, a rig that disconnected during an outage and resumed on another broker
//! lost the commands its old broker still held.

use std::collections::{HashMap, HashSet, VecDeque};

use super::{Bridge, ALL_UNKEPT};
use crate::ids::{BootId, RigId, Seq};
use crate::registry::msg::{RekeepReq, ToCore};
use crate::registry::sessions::{Rekeep, RekeepMode, Rekept, Unkept};

/// Sessions put back into Redis per pass of the bridge loop (see `Bridge::rekeep_sessions`).
const REKEEP_PER_PASS: usize = 2000;

/// A session queued to be put back.
#[derive(Debug)]
pub(super) enum Pending {
    /// A connected rig's session, as its core sent it.
    Live(RekeepReq),
    /// A session parked in the registry for a disconnected rig, read when sent. `release`:
    /// its lease's release was taken back from the queue (see `Fleet::hold_releases`) and is
    /// queued again once this is written.
    Parked { release: bool },
    /// The session of a connection the first refresh after a reconnect found superseded
    /// (the same boot went on at another broker while each decided alone): not parked here,
    /// so kept as it closed. Written as a parked session is (`rekeep.lua` merges it into the
    /// rig's session there: it may hold commands delivered while Redis was away).
    Superseded(RekeepReq),
    /// A session parked here that the newer boot `by`, its hello decided here while Redis
    /// was away, ended (see [`EndedAlone`]): `rekeep.lua` reports what no report covered.
    Ended { req: RekeepReq, by: BootId },
}

/// The bytes [`EndedAlone`] may hold; past them, an ended session is reported from here at
/// once, as before Redis had a say (a report another broker made may then repeat).
const ENDED_ALONE_BYTES: usize = 256 << 20;

/// Sessions here that a newer boot's hello ended, waiting for Redis to settle their report:
/// parked ones a hello decided here alone while Redis was away ended, and live ones a newer
/// boot took over (Redis's copy lacks what was delivered unkept). Only Redis knows what
/// another report (`resume.lua`, a boot in between) covered already (its tombstone), so they
/// go through `rekeep.lua` rather than being reported from here. Bounded by bytes; each
/// leaves once Redis has answered for it.
#[derive(Default)]
pub(super) struct EndedAlone {
    /// Each session, with the boot that ended it.
    sessions: HashMap<(RigId, BootId), (RekeepReq, BootId)>,
    bytes: usize,
}

impl EndedAlone {
    fn cost(r: &RekeepReq) -> usize {
        r.cmds
            .iter()
            .map(|(_, json)| json.len() + 32)
            .sum::<usize>()
            + 64
    }

    /// Holds `r`, which boot `by` ended, until Redis answers; false (and not held) when there
    /// is no room.
    pub(super) fn push(&mut self, r: RekeepReq, by: BootId) -> bool {
        if self.bytes + Self::cost(&r) > ENDED_ALONE_BYTES {
            return false;
        }
        self.put_back(r, by);
        true
    }

    /// Holds `r` whatever the room: pushed before, and sent while Redis went away again.
    fn put_back(&mut self, r: RekeepReq, by: BootId) {
        self.bytes += Self::cost(&r);
        if let Some((was, _)) = self.sessions.insert((r.rig.clone(), r.boot), (r, by)) {
            self.bytes -= Self::cost(&was);
        }
    }

    pub(super) fn take_all(&mut self) -> Vec<(RekeepReq, BootId)> {
        self.bytes = 0;
        self.sessions.drain().map(|(_, v)| v).collect()
    }

    pub(super) fn is_empty(&self) -> bool {
        self.sessions.is_empty()
    }

    pub(super) fn len(&self) -> usize {
        self.sessions.len()
    }
}

/// Sessions to put back, oldest first; a newer copy of a queued session replaces it in place.
#[derive(Default)]
pub(super) struct Rekeeps {
    order: VecDeque<Key>,
    latest: HashMap<Key, Pending>,
}

/// A queued session: its rig and boot, and whether it is the report of a session a hello
/// decided alone ended ([`Pending::Ended`]). That report has a place of its own: the same
/// boot may be connected here again meanwhile (a stale process back after the newer boot
/// left), and its live copy, queued under the same rig and boot, replaced the report, whose
/// commands then went unreported.
type Key = (RigId, BootId, bool);

impl Rekeeps {
    pub(super) fn push(&mut self, r: RekeepReq) {
        // A connected rig's state replaces a parked copy of the same session: the rig came
        // back, and a release taken back for it would now delete the rig's current lease.
        self.insert((r.rig.clone(), r.boot, false), Pending::Live(r));
    }

    /// Queues the session parked for `rig`; `release` as in [`Pending::Parked`] (kept when it
    /// was queued already: that release is still held back).
    pub(super) fn push_parked(&mut self, rig: RigId, boot: BootId, release: bool) {
        let key = (rig, boot, false);
        let release = release
            || matches!(
                self.latest.get(&key),
                Some(Pending::Parked { release: true })
            );
        self.insert(key, Pending::Parked { release });
    }

    fn insert(&mut self, key: Key, p: Pending) {
        if self.latest.insert(key.clone(), p).is_none() {
            self.order.push_back(key);
        }
    }

    /// Queues the report of `req`'s session, which boot `by` ended, ahead of everything: a
    /// copy of the same boot's later session (connected here again) must go after it, or the
    /// report would cut that session's commands in Redis down to a tombstone.
    fn push_ended(&mut self, req: RekeepReq, by: BootId) {
        let key = (req.rig.clone(), req.boot, true);
        self.latest.insert(key.clone(), Pending::Ended { req, by });
        self.order.push_front(key);
    }

    /// The rig acked `seq` after its core sent the queued copy of its session: the copy must
    /// not put back a command whose removal may already have gone out (the acked command would
    /// then be reported `rig_rebooted` at the rig's next boot, as never run).
    pub(super) fn forget(&mut self, rig: &RigId, boot: BootId, seq: crate::ids::Seq) {
        // Called for every ack; the queue is empty but after a Redis reconnect.
        if self.latest.is_empty() {
            return;
        }
        if let Some(Pending::Live(r)) = self.latest.get_mut(&(rig.clone(), boot, false)) {
            r.cmds.retain(|(s, _)| *s != seq);
        }
    }

    /// Puts a queued connected session first: its lease is about to be released, after which
    /// Redis would refuse it. (Its old place in the order is skipped when reached.) A parked
    /// one holds its own release back.
    pub(super) fn hurry(&mut self, rig: &RigId, boot: BootId) {
        let key = (rig.clone(), boot, false);
        if matches!(self.latest.get(&key), Some(Pending::Live(_))) {
            self.order.push_front(key);
        }
    }

    /// Takes the parked session queued for `rig` and `boot`, if any: its `release` flag.
    pub(super) fn take_parked(&mut self, rig: &RigId, boot: BootId) -> Option<bool> {
        let key = (rig.clone(), boot, false);
        match self.latest.get(&key)? {
            Pending::Parked { release } => {
                let release = *release;
                self.latest.remove(&key);
                Some(release)
            }
            Pending::Live(_) | Pending::Superseded(_) | Pending::Ended { .. } => None,
        }
    }

    /// Queues the session of a superseded connection ([`Pending::Superseded`]).
    pub(super) fn push_superseded(&mut self, r: RekeepReq) {
        self.insert((r.rig.clone(), r.boot, false), Pending::Superseded(r));
    }

    pub(super) fn len(&self) -> usize {
        self.latest.len()
    }

    pub(super) fn is_empty(&self) -> bool {
        self.latest.is_empty()
    }

    /// Takes every queued report of a session a hello decided alone ended, in queue order.
    pub(super) fn take_ended(&mut self) -> Vec<(RigId, BootId, Pending)> {
        let keys: Vec<Key> = self.order.iter().filter(|k| k.2).cloned().collect();
        keys.into_iter()
            .filter_map(|k| self.latest.remove(&k).map(|p| (k.0, k.1, p)))
            .collect()
    }

    /// Takes up to `n`, oldest first.
    pub(super) fn take(&mut self, n: usize) -> Vec<(RigId, BootId, Pending)> {
        let mut out = Vec::with_capacity(n.min(self.len()));
        while out.len() < n {
            let Some(key) = self.order.pop_front() else {
                break;
            };
            if let Some(p) = self.latest.remove(&key) {
                out.push((key.0, key.1, p));
            }
        }
        out
    }
}

impl Bridge {
    /// At a reconnect (see `Bridge::refresh`): queues every session parked here to go back,
    /// holding back the queued releases of their leases until each is written.
    pub(super) fn queue_parked_rekeeps(&mut self) {
        let parked = self.registry.parked_sessions();
        self.queue_rekeeps_of(parked);
    }

    /// Queues these parked sessions to go back, as [`Self::queue_parked_rekeeps`] does.
    pub(super) fn queue_rekeeps_of(&mut self, parked: Vec<(RigId, BootId)>) {
        if parked.is_empty() {
            return;
        }
        let which: HashSet<(RigId, BootId)> = parked.iter().cloned().collect();
        let held = self
            .fleet
            .as_mut()
            .map(|f| f.hold_releases(&which))
            .unwrap_or_default();
        for (rig, boot) in parked {
            let release = held.contains(&(rig.clone(), boot));
            self.rekeeps.push_parked(rig, boot, release);
        }
    }

    /// Redis answers again: the sessions a hello decided alone ended go back to it (see
    /// [`EndedAlone`]).
    pub(super) fn queue_ended_alone(&mut self) {
        if self.ended_alone.is_empty() || !self.fleet.as_ref().is_some_and(|f| f.is_up()) {
            return;
        }
        for (req, by) in self.ended_alone.take_all() {
            self.rekeeps.push_ended(req, by);
        }
    }

    /// Sends now the reports of sessions that hellos decided alone ended, before a refresh:
    /// until one goes, the rig's record names the boot whose session it ended, and a refresh
    /// of the older boot that hello welcomed (a stale process, or a rig whose clock went back,
    /// in after the newer one left) found that newer boot on record and closed the connection
    /// 4410, though nothing else held the rig; its commands given meanwhile were then reported
    /// `rig_rebooted` or given again under their seqs (review bb149).
    pub(super) fn send_ended_alone(&mut self) {
        self.queue_ended_alone();
        let ended = self.rekeeps.take_ended();
        if !ended.is_empty() {
            self.rekeep_now(ended);
        }
    }

    /// Puts back the sessions queued after a reconnect or a restored lease, a pass's worth.
    pub(super) fn rekeep_sessions(&mut self) {
        if self.rekeeps.is_empty() {
            return;
        }
        // A pass at a time, so that after a reconnect with a big fleet hellos and commands
        // get their turn between passes.
        let taken = self.rekeeps.take(REKEEP_PER_PASS);
        self.rekeep_now(taken);
    }

    /// Before hellos of these rigs are answered: the sessions parked for them and still
    /// queued go back first, so the hello's session read finds them (a rig back on this
    /// broker merges them with its parked state; a new boot has them reported
    /// `rig_rebooted`), and the release held back for a lease the hello claims again is
    /// queued before the hello drops it.
    pub(super) fn rekeep_parked_of<'a>(&mut self, rigs: impl Iterator<Item = &'a RigId>) {
        if self.rekeeps.is_empty() {
            return;
        }
        let mut taken = Vec::new();
        for rig in rigs {
            let Some((boot, _, _)) = self.registry.parked(rig) else {
                continue;
            };
            if let Some(release) = self.rekeeps.take_parked(rig, boot) {
                taken.push((rig.clone(), boot, Pending::Parked { release }));
            }
        }
        if !taken.is_empty() {
            self.rekeep_now(taken);
        }
    }

    /// The seqs of a connected rig's session delivered while Redis was away (all it holds,
    /// once Redis lost keys: up to the last of `cmds`).
    fn live_unkept(&self, rig: &RigId, boot: BootId, cmds: &[(Seq, Box<[u8]>)]) -> Unkept {
        match self.unkept_high.get(&(rig.clone(), boot)) {
            None => Unkept::NONE,
            Some(&ALL_UNKEPT) => {
                Unkept::up_to(cmds.iter().map(|(seq, _)| *seq).max().unwrap_or(Seq(0)))
            }
            Some(u) => *u,
        }
    }

    /// `rekeep.lua` found the copy's commands `seqs` gone for good (published `lost`, or acked
    /// elsewhere): they leave the copy, which would give or report them again. A connected
    /// rig's copy is its connection's (told by message); any other is the parked session, or
    /// a superseded connection's, gone already. Only the copy that was sent: another (a new
    /// connection of the boot) may hold another command under one of these seqs.
    fn forget_dropped(&mut self, parked: bool, rig: &RigId, boot: BootId, seqs: &[Seq]) {
        self.shared.count_n("rekeep", "dropped", seqs.len() as u64);
        if parked {
            self.registry.forget_parked(rig, boot, seqs);
        } else if self.registry.boot_of(rig) == Some(boot) {
            if let Some(conn) = self.registry.conn_of(rig) {
                let seqs = seqs.into();
                self.send_to_core(conn, ToCore::Forget { conn, seqs });
            }
        }
    }

    /// A connected rig's copy went back into a session key Redis had lost again since the
    /// copy was made (see [`RekeepReq::left_held`]): a command the copy left to its own keep
    /// may have been kept into the key lost in between, so its core sends the session once
    /// more, now with that command. Counted `rekeep/anew`.
    fn ask_again_lost_twice(&mut self, rig: RigId, boot: BootId) -> &'static str {
        match self.registry.conn_of(&rig) {
            Some(conn) if self.registry.boot_of(&rig) == Some(boot) => {
                // Should the connection close before its core answers, its session goes
                // back from its close (see `ToBridge::Closed`).
                self.rekeep_asked.insert((rig, boot));
                self.send_to_core(conn, ToCore::Rekeep { conn });
            }
            // Closed since the copy was sent: parked here with every keep answered, it goes
            // back whole, fenced as any parked session.
            _ if self
                .registry
                .parked(&rig)
                .is_some_and(|(b, _, _)| b == boot) =>
            {
                self.rekeeps.push_parked(rig, boot, false);
            }
            _ => {}
        }
        "anew"
    }

    /// A session's seqs are all in Redis again (or reported `lost` there): none is unkept any
    /// longer.
    fn kept_again(&mut self, parked: bool, rig: &RigId, boot: BootId) {
        if parked {
            self.registry.mark_parked_unkept(rig, boot, Unkept::NONE);
        } else {
            self.unkept_high.remove(&(rig.clone(), boot));
        }
    }

    /// One batch of `rekeep.lua` calls, counted by kind and outcome; then the releases held
    /// back for the parked sessions among them are queued again.
    fn rekeep_now(&mut self, taken: Vec<(RigId, BootId, Pending)>) {
        let mut releases = Vec::new();
        let mut sessions = Vec::with_capacity(taken.len());
        // Whether each connected rig's copy left commands to their own keep.
        let mut left_held = Vec::with_capacity(taken.len());
        for (rig, boot, pending) in &taken {
            match pending {
                Pending::Live(r) | Pending::Superseded(r) | Pending::Ended { req: r, .. } => {
                    // A connected rig's core does not know which of its commands Redis never
                    // kept; the bridge does. Without them, one under a seq another broker
                    // gave meanwhile (its command since acked) was written back there.
                    let unkept = match pending {
                        Pending::Live(_) => self.live_unkept(rig, *boot, &r.cmds),
                        _ => r.unkept,
                    };
                    left_held.push(matches!(pending, Pending::Live(_)) && r.left_held);
                    sessions.push(Rekeep {
                        rig,
                        boot,
                        next: r.next,
                        cmds: r.cmds.iter().map(|(seq, json)| (*seq, &json[..])).collect(),
                        unkept,
                        mode: match pending {
                            Pending::Live(_) => RekeepMode::Live,
                            Pending::Ended { by, .. } => RekeepMode::EndedBy(*by),
                            // A superseded connection's session is no longer held here:
                            // fenced as a parked one is.
                            _ => RekeepMode::Parked,
                        },
                    })
                }
                Pending::Parked { release } => {
                    if *release {
                        releases.push((rig.clone(), *boot));
                    }
                    // Gone since it was queued (expired, or its rig is back and holds it).
                    let Some((_, next, carried)) =
                        self.registry.parked(rig).filter(|(b, _, _)| b == boot)
                    else {
                        continue;
                    };
                    left_held.push(false);
                    sessions.push(Rekeep {
                        rig,
                        boot,
                        next,
                        // Held commands never reach a parked session (the connection waits
                        // for their persists before it hands its session over); filtered in
                        // case.
                        cmds: carried
                            .iter()
                            .filter(|c| !c.held)
                            .map(|c| (c.seq, &c.json[..]))
                            .collect(),
                        unkept: self.registry.parked_unkept(rig),
                        mode: RekeepMode::Parked,
                    });
                }
            }
        }
        let parked: Vec<bool> = sessions.iter().map(|s| s.mode.parked()).collect();
        // A connected rig's session put back with commands: those were delivered while Redis
        // was away, so no persist named it for them (`sess:lapses`).
        let to_name: Vec<bool> = sessions
            .iter()
            .map(|s| matches!(s.mode, RekeepMode::Live) && !s.cmds.is_empty())
            .collect();
        let whose: Vec<(RigId, BootId, Seq)> = sessions
            .iter()
            .map(|s| (s.rig.clone(), *s.boot, s.next))
            .collect();
        let ttl = self.cfg.session_ttl;
        let kept = match sessions.is_empty() {
            true => Some(Vec::new()),
            false => self.fleet.as_mut().and_then(|f| f.rekeep(&sessions, ttl)),
        };
        drop(sessions);
        for (i, (parked, (rig, boot, sent_next))) in parked.into_iter().zip(whose).enumerate() {
            let op = if parked { "rekeep_parked" } else { "rekeep" };
            let answer = kept.as_ref().map(|k| k.get(i));
            if let Some(Some(a)) = answer.filter(|a| a.is_some_and(|a| !a.dropped.is_empty())) {
                self.forget_dropped(parked, &rig, boot, &a.dropped);
            }
            let anew = answer.is_some_and(|a| a.is_some_and(|a| a.anew));
            let result = match answer.map(|a| a.map(|a| a.status)) {
                Some(Some(Rekept::Kept)) => {
                    self.kept_again(parked, &rig, boot);
                    if to_name.get(i) == Some(&true) {
                        self.name_lapse(rig.clone(), boot, true);
                    }
                    if anew && left_held.get(i) == Some(&true) {
                        self.ask_again_lost_twice(rig.clone(), boot)
                    } else {
                        "ok"
                    }
                }
                Some(Some(Rekept::Behind(next))) => {
                    self.kept_again(parked, &rig, boot);
                    if to_name.get(i) == Some(&true) {
                        self.name_lapse(rig.clone(), boot, true);
                    }
                    // A parked session takes Redis's next at its rig's hello (`resume`).
                    if !parked && self.registry.boot_of(&rig) == Some(boot) {
                        if let Some(conn) = self.registry.conn_of(&rig) {
                            let missed = self.missed(&rig, boot, sent_next, next);
                            self.send_to_core(conn, ToCore::RaiseSeq { conn, next, missed });
                        }
                    }
                    "behind"
                }
                Some(Some(Rekept::Merged)) => {
                    // A parked copy merged is settled as one written is: taken again later
                    // (another reconnect), its commands would count as unkept, and one
                    // reported `lost` now would be reported again. (A superseded copy's
                    // connection is gone, and with it what this broker knew of its seqs.)
                    if parked {
                        self.kept_again(true, &rig, boot);
                    }
                    "merged"
                }
                Some(Some(Rekept::Reported(n))) => {
                    self.shared.count_n("resume", "rebooted", n);
                    "reported"
                }
                Some(_) => "fenced",
                None => "unavailable",
            };
            self.shared.count(op, result);
        }
        // Redis away again: an ended session waits for it, as it did before this try.
        if kept.is_none() {
            for (_, _, pending) in taken {
                if let Pending::Ended { req, by } = pending {
                    self.ended_alone.put_back(req, by);
                }
            }
        }
        // Redis away again: the release waits in the queue as any other, and the next
        // reconnect takes it back again with its session.
        for (rig, boot) in releases {
            self.release_again(rig, boot);
        }
    }
}

#[cfg(test)]
mod tests {
    use std::sync::atomic::Ordering;

    use super::*;
    use crate::ids::{ConnId, CoreId, Seq};
    use crate::registry::bridge::testing::{bridge, closed};
    use crate::registry::bridge::REGISTRY_OPS;
    use crate::registry::msg::{SeqCommand, ToBridge};

    fn boot() -> BootId {
        BootId::parse("0190f5c2-0000-7000-8000-000000000001").expect("boot")
    }

    fn rig(name: &str) -> RigId {
        RigId::parse(name).expect("rig")
    }

    fn req(name: &str, next: u64) -> RekeepReq {
        RekeepReq {
            rig: rig(name),
            boot: boot(),
            next: Seq(next),
            cmds: Vec::new(),
            unkept: Unkept::NONE,
            left_held: false,
        }
    }

    fn rigs(taken: &[(RigId, BootId, Pending)]) -> Vec<String> {
        taken.iter().map(|(r, _, _)| r.to_string()).collect()
    }

    #[test]
    fn a_session_sent_again_is_queued_once_with_its_latest_state() {
        let mut q = Rekeeps::default();
        q.push(req("rig-a", 1));
        q.push(req("rig-b", 1));
        q.push(req("rig-a", 5));
        assert_eq!(q.len(), 2);
        let first = q.take(1);
        assert_eq!(first.len(), 1);
        match &first[..] {
            [(r, _, Pending::Live(req))] => assert_eq!((r.as_str(), req.next), ("rig-a", Seq(5))),
            other => panic!("{other:?}"),
        }
        let rest = q.take(10);
        assert_eq!(rigs(&rest), ["rig-b"]);
        assert!(q.is_empty());
    }

    /// The report of a session a hello decided alone ended, and a copy of the same boot's
    /// later session (a stale process connected here again): both go, the report first.
    /// Before, they shared one place, and the later one replaced the other.
    #[test]
    fn an_ended_sessions_report_and_the_same_boots_live_copy_both_go_the_report_first() {
        let mut q = Rekeeps::default();
        let newer = BootId::parse("01a24000-0000-7000-8000-000000000000").expect("boot");
        q.push(req("rig-e", 3));
        q.push(req("rig-o", 1));
        q.push_ended(req("rig-e", 2), newer);
        let taken = q.take(10);
        let kinds: Vec<(String, &str)> = taken
            .iter()
            .map(|(r, _, p)| {
                let kind = match p {
                    Pending::Ended { .. } => "ended",
                    Pending::Live(_) => "live",
                    _ => "other",
                };
                (r.to_string(), kind)
            })
            .collect();
        let want = [("rig-e", "ended"), ("rig-e", "live"), ("rig-o", "live")];
        assert_eq!(kinds, want.map(|(r, k)| (r.to_string(), k)));
        assert!(q.is_empty());
    }

    #[test]
    fn a_hurried_session_goes_first_and_only_once() {
        let mut q = Rekeeps::default();
        for name in ["rig-a", "rig-b", "rig-c"] {
            q.push(req(name, 1));
        }
        q.hurry(&rig("rig-c"), boot());
        q.hurry(&rig("rig-z"), boot());
        assert_eq!(rigs(&q.take(10)), ["rig-c", "rig-a", "rig-b"]);
        assert!(q.is_empty());
        assert!(q.take(10).is_empty());
    }

    /// A parked session keeps the release held back for it however often it is queued, and
    /// is taken out by itself (a hello of its rig) but not as a connected one.
    #[test]
    fn a_parked_session_keeps_its_held_release_and_is_taken_alone() {
        let mut q = Rekeeps::default();
        q.push_parked(rig("rig-p"), boot(), true);
        q.push(req("rig-l", 1));
        q.push_parked(rig("rig-p"), boot(), false);
        q.hurry(&rig("rig-p"), boot());
        assert_eq!(q.take_parked(&rig("rig-l"), boot()), None, "a live one");
        assert_eq!(q.take_parked(&rig("rig-p"), boot()), Some(true));
        assert_eq!(q.take_parked(&rig("rig-p"), boot()), None, "taken once");
        assert_eq!(rigs(&q.take(10)), ["rig-l"]);
        // The rig came back: its connection's state replaces the parked copy.
        q.push_parked(rig("rig-p"), boot(), true);
        q.push(req("rig-p", 3));
        match &q.take(10)[..] {
            [(_, _, Pending::Live(r))] => assert_eq!(r.next, Seq(3)),
            other => panic!("{other:?}"),
        }
    }

    /// The rig acks a command after its core sent its session and before the bridge writes
    /// it: the copy written must not bring the command back after its removal.
    #[test]
    fn an_ack_after_the_sessions_copy_was_queued_takes_the_command_out_of_it() {
        let (mut b, _core) = bridge();
        let mut r = req("rig-k", 4);
        r.cmds = (1..4)
            .map(|s| (Seq(s), b"{}".to_vec().into_boxed_slice()))
            .collect();
        b.handle(ToBridge::Rekeep(Box::new(r)));
        b.handle(ToBridge::Forget {
            rig: rig("rig-k"),
            boot: boot(),
            seq: Seq(2),
            id: "c2".into(),
            doubtful: false,
            read_back: false,
        });
        match &b.rekeeps.take(10)[..] {
            [(_, _, Pending::Live(r))] => {
                let seqs: Vec<u64> = r.cmds.iter().map(|(s, _)| s.0).collect();
                assert_eq!(seqs, [1, 3]);
            }
            other => panic!("{other:?}"),
        }
    }

    fn counted(b: &Bridge, op: (&str, &str)) -> u64 {
        let i = REGISTRY_OPS.iter().position(|&o| o == op).expect("op");
        b.shared.ops[i].load(Ordering::Relaxed)
    }

    /// A rig parked on a bridge whose Redis is away: its lease's release is queued.
    fn parked_rig(b: &mut Bridge) -> (RigId, ConnId) {
        let (rig, conn) = (rig("rig-p"), ConnId::new(CoreId(0), 1));
        b.registry.hello(conn, rig.clone(), boot(), vec![]);
        let carried = vec![SeqCommand::for_test(2, 4, false)];
        b.handle(closed(conn, rig.clone(), boot(), Seq(3), carried));
        (rig, conn)
    }

    fn releases(b: &Bridge) -> usize {
        b.fleet.as_ref().map_or(0, |f| f.queued())
    }

    /// Redis away: command `seq` of `rig`'s session (boot [`boot`]), held by `conn`, is
    /// answered unkept.
    fn answer_unkept(b: &mut Bridge, conn: ConnId, rig: &RigId, seq: u64) {
        let p = crate::registry::msg::PersistReq {
            conn,
            rig: rig.clone(),
            boot: boot(),
            seq: Seq(seq),
            id: "c".into(),
            json: Box::new([]),
            reply: crate::registry::msg::ReplyTo::Channel("r".into()),
            hold_left: None,
        };
        b.answer_persists(vec![p], None, true, Vec::new());
    }

    /// A rig on this broker, given seq `delivered` unkept (Redis away) if any, then evicted
    /// by another broker's hello of the same boot; its connection closes holding seqs 4 and 5
    /// with `next` 6. What goes back into Redis, if anything.
    fn evicted_after(delivered: Option<u64>) -> Option<RekeepReq> {
        superseded_after(delivered, false)
    }

    /// [`evicted_after`], or (`by_refresh`) superseded at the first refresh after a
    /// reconnect instead.
    fn superseded_after(delivered: Option<u64>, by_refresh: bool) -> Option<RekeepReq> {
        superseded_after_with(delivered, by_refresh, false)
    }

    /// [`superseded_after`], where the broker first found that Redis had lost keys
    /// (`keys_lost`) while the rig was connected.
    fn superseded_after_with(
        delivered: Option<u64>,
        by_refresh: bool,
        keys_lost: bool,
    ) -> Option<RekeepReq> {
        let (mut b, _core) = bridge();
        let (rig, conn) = (rig("rig-e"), ConnId::new(CoreId(0), 1));
        b.registry.hello(conn, rig.clone(), boot(), vec![]);
        if keys_lost {
            b.unkept_high
                .insert((rig.clone(), boot()), crate::registry::bridge::ALL_UNKEPT);
        }
        if let Some(seq) = delivered {
            answer_unkept(&mut b, conn, &rig, seq);
        }
        if by_refresh {
            b.merge_on_close.insert((rig.clone(), boot()));
            let actions = b.registry.supersede(&rig, None);
            b.carry_out(actions);
        } else {
            b.evicts_to_settle.push((rig.clone(), boot()));
            b.settle_evicts();
        }
        let carried = vec![
            SeqCommand::for_test(4, 4, false),
            SeqCommand::for_test(5, 4, false),
        ];
        b.handle(closed(conn, rig, boot(), Seq(6), carried));
        assert!(b.unkept_high.is_empty() && b.merge_on_close.is_empty());
        b.rekeeps
            .take(10)
            .into_iter()
            .find_map(|(_, _, p)| match p {
                Pending::Superseded(r) => Some(r),
                _ => None,
            })
    }

    /// Evicted after delivering seq 4 unkept, the session goes back up to seq 4 alone: seq 5
    /// was numbered and never written (fenced), and raising `next` past it would refuse the
    /// new broker's own seq 5 as stale. Evicted with nothing delivered unkept (a hello race
    /// lost with Redis up), nothing goes back.
    #[test]
    fn an_evicted_session_goes_back_up_to_the_last_seq_it_delivered_unkept() {
        let r = evicted_after(Some(4)).expect("merged at the close");
        let seqs: Vec<u64> = r.cmds.iter().map(|(s, _)| s.0).collect();
        assert_eq!((r.next, seqs), (Seq(5), vec![4]));
        // Only seq 4 counts as unkept: a command below it Redis kept (rekeep.lua's unkept_from).
        assert_eq!(
            r.unkept,
            Unkept {
                from: Seq(4),
                to: Seq(4)
            }
        );
        assert!(evicted_after(None).is_none());
    }

    /// A command's unkept answer that comes after another connection of the same boot took
    /// the session over counts for the session, live there or parked once it closed. Before,
    /// only the answers of the session's own connection counted, and the copy parked later
    /// took the command for one Redis had kept, dropped unreported once Redis was back
    /// (review bb123).
    #[test]
    fn an_unkept_answer_after_a_same_boot_takeover_counts_for_the_session() {
        let (mut b, _core) = bridge();
        let rig = rig("rig-t");
        let (old, new) = (ConnId::new(CoreId(0), 1), ConnId::new(CoreId(0), 2));
        b.registry.hello(new, rig.clone(), boot(), vec![]);
        answer_unkept(&mut b, old, &rig, 3);
        let live = b.unkept_high.get(&(rig.clone(), boot())).copied();
        assert!(live.is_some_and(|u| u.holds(Seq(3))), "{live:?}");
        b.handle(closed(new, rig.clone(), boot(), Seq(5), Vec::new()));
        answer_unkept(&mut b, old, &rig, 4);
        assert_eq!(
            b.registry.parked_unkept(&rig),
            Unkept {
                from: Seq(3),
                to: Seq(4)
            }
        );
    }

    /// The same when the first refresh after a reconnect finds the rig superseded. Before, a
    /// connection with nothing delivered unkept put its whole session back, `next` counting
    /// seq 5, which it had numbered for a command Redis fenced (never delivered): the rig's
    /// next broker numbered from 6, and the rig saw a gap.
    #[test]
    fn a_session_superseded_at_a_refresh_goes_back_only_with_what_it_delivered_unkept() {
        let r = superseded_after(Some(4), true).expect("merged at the close");
        let seqs: Vec<u64> = r.cmds.iter().map(|(s, _)| s.0).collect();
        assert_eq!((r.next, seqs), (Seq(5), vec![4]));
        assert!(superseded_after(None, true).is_none());
    }

    /// After Redis lost keys (an empty restart) every command a live session holds may be
    /// gone from Redis: superseded then, it puts back all it holds (4 and 5), with `next`
    /// past the last of them rather than its own next seq.
    #[test]
    fn a_session_superseded_after_redis_lost_keys_goes_back_whole() {
        let r = superseded_after_with(None, true, true).expect("merged at the close");
        let seqs: Vec<u64> = r.cmds.iter().map(|(s, _)| s.0).collect();
        assert_eq!(
            (r.next, seqs, r.unkept),
            (Seq(6), vec![4, 5], Unkept::up_to(Seq(5)))
        );
    }

    /// A session a hello decided alone ended waits for Redis, within its bytes: queued only
    /// while Redis is up, and held again when Redis goes away before it is written.
    #[test]
    fn an_ended_session_waits_for_redis_within_its_bytes() {
        let newer = BootId::parse("0190f5c2-0000-7000-8000-000000000002").expect("boot");
        let ended = |len: usize| RekeepReq {
            cmds: vec![(Seq(1), vec![b' '; len].into())],
            ..req("rig-x", 2)
        };
        let mut held = EndedAlone::default();
        assert!(!held.push(ended(ENDED_ALONE_BYTES), newer), "no room");
        assert!(held.is_empty());
        assert!(held.push(ended(10), newer));

        let (mut b, _core) = bridge();
        assert!(b.ended_alone.push(ended(10), newer));
        b.queue_ended_alone();
        assert!(
            !b.ended_alone.is_empty() && b.rekeeps.is_empty(),
            "Redis is away"
        );
        b.rekeeps.push_ended(ended(10), newer);
        b.ended_alone.take_all();
        b.rekeep_sessions();
        assert_eq!(counted(&b, ("rekeep_parked", "unavailable")), 1);
        let back = b.ended_alone.take_all();
        assert_eq!(back.len(), 1, "held again");
        assert_eq!((back[0].0.boot, back[0].1), (boot(), newer));
    }

    /// The release of a parked session's lease waits for the session to be put back: sent
    /// first, it would fence the session where Redis kept the lease through the outage.
    /// Queued again, it is not counted again (`release/sent` counted it twice).
    #[test]
    fn a_parked_sessions_release_waits_for_its_rekeep() {
        let (mut b, _core) = bridge();
        parked_rig(&mut b);
        let queued = releases(&b);
        assert!(queued >= 1, "the release queued");
        let sent = counted(&b, ("release", "sent"));
        assert_eq!(sent as usize, queued);
        b.queue_parked_rekeeps();
        assert_eq!(releases(&b), queued - 1, "held back");
        assert_eq!(b.rekeeps.len(), 1);
        // Redis is away here: counted, and the release goes back to its queue.
        b.rekeep_sessions();
        assert!(b.rekeeps.is_empty());
        assert_eq!(releases(&b), queued);
        assert_eq!(counted(&b, ("release", "sent")), sent, "counted once");
        assert_eq!(counted(&b, ("rekeep_parked", "unavailable")), 1);
        assert_eq!(counted(&b, ("rekeep", "unavailable")), 0);
    }

    /// A connected rig asked for its session after a reconnect that disconnects before its
    /// core answers is parked after the parked sessions were queued: its close queues it, and
    /// its lease's release waits for it like theirs. A rig that answers is not queued twice.
    #[test]
    fn a_rig_gone_before_answering_the_reconnects_rekeep_is_put_back_from_its_parked_session() {
        let (mut b, _core) = bridge();
        let (gone, answered) = (rig("rig-g"), rig("rig-a"));
        b.rekeep_asked.insert((gone.clone(), boot()));
        b.rekeep_asked.insert((answered.clone(), boot()));
        b.handle(ToBridge::Rekeep(Box::new(req("rig-a", 2))));
        let conn = ConnId::new(CoreId(0), 1);
        b.registry.hello(conn, gone.clone(), boot(), vec![]);
        let queued = releases(&b);
        let carried = vec![SeqCommand::for_test(2, 4, false)];
        b.handle(closed(conn, gone.clone(), boot(), Seq(3), carried));
        assert!(b.rekeep_asked.is_empty());
        assert_eq!(releases(&b), queued, "the release waits for the session");
        let sent = counted(&b, ("release", "sent"));
        assert_eq!(sent as usize, queued + 1, "counted as decided");
        let taken = b.rekeeps.take(10);
        assert_eq!(rigs(&taken), ["rig-a", "rig-g"]);
        assert!(matches!(taken[1].2, Pending::Parked { release: true }));
        b.rekeep_now(taken);
        assert_eq!(releases(&b), queued + 1, "queued once the session went");
        assert_eq!(
            counted(&b, ("release", "sent")),
            sent,
            "and not counted again"
        );
    }

    /// The rig says hello on this broker again while its parked session waits to go back: it
    /// goes before the hello (with Redis away, it is counted and dropped: the rig's
    /// connection holds the session now), the release held back is queued again and then
    /// dropped, since the hello claims that very lease, and the rig resumes from what was
    /// parked.
    #[test]
    fn a_hello_of_a_parked_rig_puts_its_session_back_first() {
        let (mut b, core) = bridge();
        let (rig, _) = parked_rig(&mut b);
        let queued = releases(&b);
        b.queue_parked_rekeeps();
        let conn = ConnId::new(CoreId(0), 2);
        b.handle(ToBridge::Hello {
            conn,
            rig,
            boot: boot(),
            labels: vec![],
        });
        b.flush_hellos();
        assert!(b.rekeeps.is_empty());
        assert_eq!(counted(&b, ("rekeep_parked", "unavailable")), 1);
        assert_eq!(
            releases(&b),
            queued - 1,
            "the claimed lease is not released"
        );
        let resumed = std::iter::from_fn(|| core.try_recv()).any(|m| {
            matches!(m, crate::registry::msg::ToCore::Verdict {
                conn: c,
                verdict: crate::registry::msg::Verdict::Accept { next_seq: Seq(3), resumed: true, .. },
            } if c == conn)
        });
        assert!(resumed, "resumed from the parked session");
    }
}
