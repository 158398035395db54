//! Fleet mode: the sessions of rigs that left this broker with commands unacked, watched until
//! Redis would let them lapse (`--session-ttl`), so that what they still hold then is reported
//! `expired` (`lua/session_lapse.lua`) instead of vanishing with the key, after control was
//! told `ok`. Each is named in Redis too (`sess:lapses`, by `lua/lapse_watch.lua`: a second
//! after its connection's first command was kept, and as its rig leaves), and every broker
//! sweeps the named ones a
//! little after their broker should have asked (`lua/lapse_sweep.lua`), so a broker that dies
//! or drains first, with the rig gone or still on it, loses none. Standalone reports its own
//! parked copies (`Bridge::report_lapsed`).

use std::cmp::Reverse;
use std::collections::{BinaryHeap, HashSet};
use std::time::{Duration, Instant};

use super::upkeep::touch_every;
use super::Bridge;
use crate::ids::{BootId, RigId};
use crate::registry::lapse_scripts::{Lapse, WATCH_CHUNK};
use crate::thread_loss::Failpoint;

/// Most sessions watched at once: one per rig that left with commands unacked within a
/// `--session-ttl` (about 200 bytes each). Past it a session goes unwatched here, counted
/// (`session/unwatched`): only another broker's sweep can report it. Redis's `sess:lapses` names
/// at most as many (`session/unnamed` counts those it refused).
pub(super) const MAX_WATCHED: usize = 1_000_000;
/// How near its end a session is ended by the watch (a call that arrived later would find the
/// key gone): a tenth of `--session-ttl`, from 100 ms up to 30 s, so that Redis may stall (or
/// the connection to it break) for most of that and the reports still go out, the call being
/// made again each second. One with longer left is asked about again two thirds of that before
/// its end; a sweep, a third of it later (`lapse_timing` in `lua/lapse_end.lua` reckons the
/// same).
fn near(session_ttl: Duration) -> Duration {
    (session_ttl / 10).clamp(Duration::from_millis(100), Duration::from_secs(30))
}

fn ask_before(session_ttl: Duration) -> Duration {
    near(session_ttl) * 2 / 3
}

/// Longest between sweeps: one comes at least this often, so that a session named since the
/// last (by this broker or another) is asked about in time; sooner when Redis said the next
/// is due sooner.
const SWEEP_EVERY: Duration = Duration::from_secs(1);
/// Shortest between sweeps, but for one that found a full batch: entries due a few ms apart
/// wait for one call together, at most 20 a second however many sessions are named (a
/// session of a 3 s TTL is asked about 100 ms before its end, so this much late is in time).
const SWEEP_FLOOR: Duration = Duration::from_millis(50);

/// Redis did not answer: asked again this much later.
const RETRY: Duration = Duration::from_secs(1);
/// Most sessions asked about in one round trip.
const PER_CALL: usize = 1_000;
/// Most departures named in Redis in one round trip; the rest go at the next timer.
const NAMED_PER_ROUND: usize = 50_000;
/// Departures are named this long after the first of them at the soonest (or once a call's
/// worth wait), so that rigs leaving one by one cost the bridge a round trip per batch, not
/// one each: the bridge runs its timers on every wake. They are first asked about seconds
/// later.
const NAME_AFTER: Duration = Duration::from_millis(100);
/// A connected rig's session is named this long after its connection's first command was kept,
/// not in the keep's own call: the first commands of a fan-out to new connections would
/// otherwise wait behind one name each in Redis (about as costly as the keep; six alternated
/// pairs of 10,000-rig fan-outs read a p99 of 392 against 491 ms without the names in the
/// keeps, docs/benchmarks.md), and a second later the burst is over. The price: a broker
/// killed within this long of a connection's first command, with the rig still on it, leaves
/// that session unnamed, and its commands unreported should the rig never come back.
const HELD_NAME_AFTER: Duration = Duration::from_secs(1);

/// A session to name in Redis: since when, and whether its rig was connected here (`held`)
/// rather than gone from here.
type Unnamed = (Instant, RigId, BootId, bool);

/// Sessions to ask about, soonest first, each once.
#[derive(Default)]
pub(super) struct Lapses {
    due: BinaryHeap<Reverse<(Instant, RigId, BootId)>>,
    /// What `due` holds: a rig that keeps coming back and leaving with the same boot is
    /// watched once, not once per departure (asked about at its first due time, its session,
    /// seen since, is asked about again nearer its new end).
    watched: HashSet<(RigId, BootId)>,
    /// Sessions not named in Redis yet (it was away, or they came since the last timer):
    /// departures, with when the rig left, and connected rigs' sessions once due (`held`);
    /// at most [`MAX_WATCHED`].
    unnamed: Vec<Unnamed>,
    /// Connected rigs' sessions to name, with when their connection's first command was kept
    /// (or the session resumed here with commands); at most [`MAX_WATCHED`]. They join
    /// `unnamed` [`HELD_NAME_AFTER`] later.
    held: Vec<(Instant, RigId, BootId)>,
    /// When the next sweep is due (None: at the next timer).
    next_sweep: Option<Instant>,
    /// No names before this: a naming call just failed.
    names_after: Option<Instant>,
}

impl Lapses {
    /// Watches (rig, boot) from `at` unless it is watched already; false when full.
    pub(super) fn watch(&mut self, at: Instant, rig: RigId, boot: BootId) -> bool {
        if self.watched.contains(&(rig.clone(), boot)) {
            return true;
        }
        if self.due.len() >= MAX_WATCHED {
            return false;
        }
        self.watched.insert((rig.clone(), boot));
        self.due.push(Reverse((at, rig, boot)));
        true
    }

    pub(super) fn next_due(&self) -> Option<Instant> {
        self.due.peek().map(|Reverse((at, _, _))| *at)
    }

    /// When the bridge must wake for these: a session due, a sweep, or names to give.
    pub(super) fn next_wake(&self) -> Option<Instant> {
        let held = self.held.first().map(|(at, _, _)| *at + HELD_NAME_AFTER);
        [self.next_due(), self.next_sweep, held]
            .into_iter()
            .flatten()
            .min()
    }

    /// Up to `max` sessions due by `now`, soonest first.
    fn take_due(&mut self, now: Instant, max: usize) -> Vec<(RigId, BootId)> {
        let mut out = Vec::new();
        while out.len() < max && self.next_due().is_some_and(|at| at <= now) {
            if let Some(Reverse((_, rig, boot))) = self.due.pop() {
                self.watched.remove(&(rig.clone(), boot));
                out.push((rig, boot));
            }
        }
        out
    }

    #[cfg(test)]
    fn len(&self) -> usize {
        self.due.len()
    }
}

/// When a session whose rig left at `left` is first asked about: its TTL counts from its last
/// touch, at most one touch interval before the rig left, so it lapses no sooner than this.
pub(super) fn first_ask(left: Instant, session_ttl: Duration) -> Instant {
    let earliest = session_ttl.saturating_sub(touch_every(session_ttl));
    left + earliest.saturating_sub(ask_before(session_ttl))
}

impl Bridge {
    /// A rig left with commands unacked: its session is watched (fleet mode, sessions kept).
    pub(super) fn watch_lapse(&mut self, rig: RigId, boot: BootId) {
        if self.fleet.is_none() || self.cfg.session_ttl.is_zero() {
            return;
        }
        let now = Instant::now();
        let at = first_ask(now, self.cfg.session_ttl);
        if !self.lapses.watch(at, rig.clone(), boot) {
            self.shared.count("session", "unwatched");
        }
        self.name_lapse(rig, boot, false);
    }

    /// Names session (rig, boot) in Redis's `sess:lapses` with the next batch: a departure's,
    /// or a connected rig's put back with commands after an outage (which this broker does
    /// not watch itself: the rig is here).
    ///
    /// `held`: the rig is connected here (the session takes this broker's TTL only while its
    /// lease is this broker's when Redis names it).
    pub(super) fn name_lapse(&mut self, rig: RigId, boot: BootId, held: bool) {
        if self.lapses.unnamed.len() < MAX_WATCHED {
            self.lapses.unnamed.push((Instant::now(), rig, boot, held));
        } else {
            self.shared.count("session", "unnamed");
        }
    }

    /// The first command of a connection of `rig` (boot `boot`) was kept, or its session
    /// resumed here with commands: it is named in `sess:lapses` a little later
    /// ([`HELD_NAME_AFTER`]).
    pub(super) fn name_held_lapse(&mut self, rig: RigId, boot: BootId) {
        if self.fleet.is_none() || self.cfg.session_ttl.is_zero() {
            return;
        }
        if self.lapses.held.len() < MAX_WATCHED {
            self.lapses.held.push((Instant::now(), rig, boot));
        } else {
            self.shared.count("session", "unnamed");
        }
    }

    /// Connected sessions whose name is due (all of them with `all`) join the departures to
    /// name. Whether or not the rig is still here: one taken over by another broker since
    /// (superseded, so no departure named it) may hold commands that broker never kept, and
    /// the sweep drops an entry whose session holds nothing.
    fn held_names_due(&mut self, now: Instant, all: bool) {
        let due = self
            .lapses
            .held
            .iter()
            .take_while(|(at, _, _)| all || *at + HELD_NAME_AFTER <= now)
            .count();
        for (at, rig, boot) in self.lapses.held.drain(..due) {
            if self.lapses.unnamed.len() < MAX_WATCHED {
                self.lapses.unnamed.push((at, rig, boot, true));
            } else {
                self.shared.count("session", "unnamed");
            }
        }
    }

    /// When the bridge must wake to name what is queued: [`NAME_AFTER`] after the first
    /// (not while Redis is away, or sessions go back after an outage, or after a failed call).
    pub(super) fn lapse_names_due(&self) -> Option<Instant> {
        let (first, _, _, _) = self.lapses.unnamed.first()?;
        if self.fleet.as_ref().is_none_or(|f| !f.is_up())
            || self.sessions_going_back()
            || Failpoint::LapseNamesAtExitOnly.is_set()
        {
            return None;
        }
        let at = *first + NAME_AFTER;
        Some(self.lapses.names_after.map_or(at, |n| n.max(at)))
    }

    /// Whether sessions are going back into Redis after an outage: names wait for them.
    fn sessions_going_back(&self) -> bool {
        self.rekeep_all || !self.rekeeps.is_empty()
    }

    /// The watch's timers: departures named in Redis, due sessions asked about, and a sweep
    /// of what is due in Redis when one is due.
    pub(super) fn check_lapses(&mut self, now: Instant) {
        if self.fleet.is_none() || self.cfg.session_ttl.is_zero() {
            return;
        }
        self.name_lapses(now, false);
        self.ask_due(now);
        if self.lapses.next_sweep.is_none_or(|at| at <= now) {
            self.sweep_lapses(now);
        }
    }

    /// At exit after Redis came back, perhaps empty, with `sess:lapses` lost: the sessions
    /// this broker watches are named again, since its own watch of them ends here and only
    /// another broker's sweep can report them now (one whose rig never came back lapsed
    /// unreported).
    pub(super) fn name_watched_again(&mut self) {
        let queued: HashSet<(RigId, BootId)> = self
            .lapses
            .unnamed
            .iter()
            .map(|(_, rig, boot, _)| (rig.clone(), *boot))
            .collect();
        let again: Vec<(RigId, BootId)> = self
            .lapses
            .watched
            .iter()
            .filter(|key| !queued.contains(key))
            .cloned()
            .collect();
        for (rig, boot) in again {
            self.name_lapse(rig, boot, false);
        }
    }

    /// At exit, while Redis answers: the departures not named yet (a drain's last rigs among
    /// them) are named, so that another broker reports them should they lapse.
    pub(super) fn name_lapses_before_exit(&mut self) {
        self.held_names_due(Instant::now(), true);
        while !self.lapses.unnamed.is_empty() && self.fleet.as_ref().is_some_and(|f| f.is_up()) {
            if !self.name_lapses(Instant::now(), true) {
                break;
            }
        }
        if !self.lapses.unnamed.is_empty() {
            log::warn!(
                "exiting with {} sessions left with commands unacked not named in Redis: Redis did not take them, so should they lapse they go unreported",
                self.lapses.unnamed.len()
            );
        }
    }

    /// Names the departures not yet named in Redis, up to [`NAMED_PER_ROUND`], once the first
    /// has waited [`NAME_AFTER`] (at once with `now_all`); false when Redis did not answer.
    fn name_lapses(&mut self, now: Instant, now_all: bool) -> bool {
        if !now_all && Failpoint::LapseNamesAtExitOnly.is_set() {
            return true;
        }
        self.held_names_due(now, now_all);
        let Some((first, _, _, _)) = self.lapses.unnamed.first() else {
            return true;
        };
        let due = now_all
            || (self.lapses.names_after.is_none_or(|at| at <= now)
                && (*first + NAME_AFTER <= now || self.lapses.unnamed.len() >= WATCH_CHUNK));
        // Sessions going back after an outage first: named in between, 10,000 of them took
        // 12% longer to go back (`bench/redis-restart.sh`).
        let rekeeping = !now_all && self.sessions_going_back();
        if !due || rekeeping || self.fleet.as_ref().is_none_or(|f| !f.is_up()) {
            return true;
        }
        let n = self.lapses.unnamed.len().min(NAMED_PER_ROUND);
        let (mut left, mut held) = (Vec::new(), Vec::new());
        for (_, rig, boot, h) in &self.lapses.unnamed[..n] {
            if *h { &mut held } else { &mut left }.push((rig.clone(), *boot));
        }
        let (mut refused, mut failed) = (0, 0);
        for (batch, held) in [(left, false), (held, true)] {
            if batch.is_empty() {
                continue;
            }
            let answer = self
                .fleet
                .as_mut()
                .and_then(|f| f.watch_lapses(&batch, held));
            let Some((r, f)) = answer else {
                // Redis away: named after the reconnect (naming twice is harmless).
                self.lapses.names_after = Some(now + RETRY);
                return false;
            };
            (refused, failed) = (refused + r, failed + f);
        }
        self.lapses.unnamed.drain(..n);
        self.lapses.names_after = None;
        self.shared.count_n("session", "unnamed", refused + failed);
        if refused + failed > 0 {
            log::warn!(
                "{} sessions left with commands unacked are not named in Redis's `sess:lapses` ({refused} refused, it names {MAX_WATCHED} already; {failed} failed): only this broker will report them should they lapse",
                refused + failed
            );
        }
        true
    }

    /// Asks Redis about the watched sessions that are due, in one round trip.
    fn ask_due(&mut self, now: Instant) {
        let due = self.lapses.take_due(now, PER_CALL);
        if due.is_empty() {
            return;
        }
        let ttl = self.cfg.session_ttl;
        let answers = self.fleet.as_mut().and_then(|f| f.session_lapses(&due));
        let mut answers = answers.map(Vec::into_iter);
        for (rig, boot) in due {
            let answer = answers.as_mut().and_then(Iterator::next).flatten();
            let again = match answer {
                Some(Lapse::Done) => None,
                Some(Lapse::Missed) => {
                    self.lapse_missed(1);
                    None
                }
                Some(Lapse::Reported(n)) => {
                    self.lapse_reported(&rig, boot, n, None);
                    None
                }
                Some(Lapse::Later(left)) => Some(now + left.saturating_sub(ask_before(ttl))),
                None => Some(now + RETRY),
            };
            if let Some(at) = again {
                // Back in the heap it was just taken from: there is room.
                let _ = self.lapses.watch(at, rig, boot);
            }
        }
    }

    /// Asks about the sessions due in Redis, whoever named them: those their broker did not
    /// ask about in time. Again at once while each call finds a full batch.
    fn sweep_lapses(&mut self, now: Instant) {
        self.lapses.next_sweep = Some(now + SWEEP_EVERY);
        let Some(fleet) = self.fleet.as_mut().filter(|f| f.is_up()) else {
            return;
        };
        let Some(sweep) = fleet.sweep_lapses(PER_CALL) else {
            return;
        };
        for s in &sweep.reported {
            self.shared.count("session", "swept");
            self.lapse_reported(&s.rig, s.boot, s.reported, Some(&s.owner));
        }
        self.lapse_missed(sweep.missed);
        let wait = match sweep.next {
            _ if sweep.asked >= PER_CALL => Duration::ZERO,
            Some(next) => next.clamp(SWEEP_FLOOR, SWEEP_EVERY),
            None => SWEEP_EVERY,
        };
        self.lapses.next_sweep = Some(now + wait);
    }

    /// `n` watched sessions were gone before anyone asked: whatever they held lapsed
    /// unreported (Redis lost them, or no broker reached Redis in their last tenth).
    fn lapse_missed(&mut self, n: u64) {
        if n == 0 {
            return;
        }
        self.shared.count_n("session", "missed", n);
        log::warn!(
            "{n} watched sessions were gone from Redis when asked about: their unacked commands lapsed unreported (Redis lost them, or was out of reach in their last tenth of --session-ttl), unless their session ended first under a broker keeping sessions shorter (with brokers of different --session-ttl: its commands acked, or reported by that broker)"
        );
    }

    /// `n` unacked commands of session (rig, boot) were reported `expired`; by a sweep when
    /// `owner` names the broker the rig had left.
    fn lapse_reported(&mut self, rig: &RigId, boot: BootId, n: u64, owner: Option<&str>) {
        // This broker's own copy of the session must not hand them out again.
        self.registry.drop_parked_commands(rig, boot);
        self.shared.count_n("parked", "expired", n);
        match owner {
            Some(owner) => log::info!(
                "rig {rig} (boot {boot}) stayed away past --session-ttl after leaving broker {owner}, which is no longer there to say so: {n} unacked commands of its session reported expired"
            ),
            None if n > 0 => log::info!(
                "rig {rig} (boot {boot}) stayed away past --session-ttl: {n} unacked commands of its session reported expired"
            ),
            None => {}
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::ids::Seq;

    #[test]
    fn a_session_is_first_asked_about_before_it_can_lapse() {
        let now = Instant::now();
        // 10 min: touched every 200 s, so it lapses 400 s after the rig left at the soonest;
        // asked 20 s before (two thirds of its last 30 s, the most a tenth of the TTL gets).
        let ttl = Duration::from_secs(600);
        assert_eq!(first_ask(now, ttl), now + Duration::from_secs(380));
        // 3 s: touched every second, so 2 s at the soonest; asked 200 ms before.
        let ttl = Duration::from_secs(3);
        assert_eq!(first_ask(now, ttl), now + Duration::from_millis(1800));
    }

    /// A rig that leaves with commands unacked is watched; with Redis away, a due session is
    /// asked about again a second later, not left due (which would wake the bridge at once,
    /// over and over, for the whole outage).
    #[test]
    fn a_due_session_waits_a_second_while_redis_is_away() {
        let (mut b, _core) = super::super::testing::bridge();
        let rig = RigId::parse("rig-l").expect("rig");
        let boot = BootId::generate(1);
        let cmd = crate::registry::msg::SeqCommand::for_test(1, 2, false);
        let conn = crate::ids::ConnId::new(crate::ids::CoreId(0), 1);
        b.registry.hello(conn, rig.clone(), boot, Vec::new());
        let closed = super::super::testing::closed(conn, rig, boot, Seq(2), vec![cmd]);
        b.handle(closed);
        let first = b.lapses.next_due().expect("watched");
        let now = first + Duration::from_millis(5);
        b.timers(now);
        assert_eq!(b.lapses.next_due(), Some(now + RETRY));
    }

    #[test]
    fn watched_sessions_come_due_soonest_first_within_the_bound() {
        let now = Instant::now();
        let mut l = Lapses::default();
        let rig = |n: u8| RigId::parse(&format!("rig-{n}")).expect("rig");
        let boot = BootId::generate(1);
        assert!(l.watch(now + Duration::from_secs(2), rig(2), boot));
        assert!(l.watch(now + Duration::from_secs(1), rig(1), boot));
        assert!(l.watch(now + Duration::from_secs(9), rig(9), boot));
        assert_eq!(l.next_due(), Some(now + Duration::from_secs(1)));
        let due = l.take_due(now + Duration::from_secs(3), 10);
        assert_eq!(due, vec![(rig(1), boot), (rig(2), boot)]);
        assert_eq!(l.len(), 1);
        assert!(l.take_due(now + Duration::from_secs(3), 10).is_empty());
        // A rig that leaves again with the same boot while watched is not watched twice.
        assert!(l.watch(now + Duration::from_secs(20), rig(9), boot));
        assert_eq!(l.len(), 1);
    }
}
