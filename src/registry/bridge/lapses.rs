//! Fleet mode: the sessions of rigs that left this broker with commands unacked, watched until
//! Redis would let them lapse (`--session-ttl`), so that what they still hold then is reported
//! `expired` (`lua/session_lapse.lua`) instead of vanishing with the key, after control was
//! told `ok`. Standalone reports its own parked copies (`Bridge::report_lapsed`).

use std::cmp::Reverse;
use std::collections::{BinaryHeap, HashSet};
use std::time::{Duration, Instant};

use super::upkeep::touch_every;
use super::Bridge;
use crate::ids::{BootId, RigId};
use crate::registry::sessions::Lapse;

/// Most sessions watched at once: one per rig that left with commands unacked within a
/// `--session-ttl` (about 200 bytes each). Past it a session goes unwatched, counted
/// (`session/unwatched`): its commands lapse unreported, as before this watch.
pub(super) const MAX_WATCHED: usize = 1_000_000;
/// How near its end a session is ended by the watch (a call that arrived later would find the
/// key gone): a tenth of `--session-ttl`, from 100 ms up to 30 s, so that Redis may stall (or
/// the connection to it break) for most of that and the reports still go out, the call being
/// made again each second. One with longer left is asked about again two thirds of that before
/// its end.
fn near(session_ttl: Duration) -> Duration {
    (session_ttl / 10).clamp(Duration::from_millis(100), Duration::from_secs(30))
}

fn ask_before(session_ttl: Duration) -> Duration {
    near(session_ttl) * 2 / 3
}
/// Redis did not answer: asked again this much later.
const RETRY: Duration = Duration::from_secs(1);
/// Most sessions asked about in one round trip.
const PER_CALL: usize = 1_000;

/// Sessions to ask about, soonest first, each once.
#[derive(Default)]
pub(super) struct Lapses {
    due: BinaryHeap<Reverse<(Instant, RigId, BootId)>>,
    /// What `due` holds: a rig that keeps coming back and leaving with the same boot is
    /// watched once, not once per departure (asked about at its first due time, its session,
    /// seen since, is asked about again nearer its new end).
    watched: HashSet<(RigId, BootId)>,
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

/// When a session whose rig just left is first asked about: its TTL counts from its last
/// touch, at most one touch interval before the rig left, so it lapses no sooner than this.
pub(super) fn first_ask(now: Instant, session_ttl: Duration) -> Instant {
    let earliest = session_ttl.saturating_sub(touch_every(session_ttl));
    now + earliest.saturating_sub(ask_before(session_ttl))
}

impl Bridge {
    /// A rig left with commands unacked: its session is watched (fleet mode, sessions kept).
    pub(super) fn watch_lapse(&mut self, rig: RigId, boot: BootId) {
        if self.fleet.is_none() || self.cfg.session_ttl.is_zero() {
            return;
        }
        let at = first_ask(Instant::now(), self.cfg.session_ttl);
        if !self.lapses.watch(at, rig, boot) {
            self.shared.count("session", "unwatched");
        }
    }

    /// Asks Redis about the watched sessions that are due, in one round trip.
    pub(super) fn check_lapses(&mut self, now: Instant) {
        let due = self.lapses.take_due(now, PER_CALL);
        if due.is_empty() {
            return;
        }
        let ttl = self.cfg.session_ttl;
        let answers = self
            .fleet
            .as_mut()
            .and_then(|f| f.session_lapses(&due, near(ttl)));
        let mut answers = answers.map(Vec::into_iter);
        for (rig, boot) in due {
            let answer = answers.as_mut().and_then(Iterator::next).flatten();
            let again = match answer {
                Some(Lapse::Done) => None,
                Some(Lapse::Reported(n)) => {
                    self.registry.drop_parked_commands(&rig, boot);
                    self.shared.count_n("parked", "expired", n);
                    if n > 0 {
                        log::info!(
                            "rig {rig} (boot {boot}) stayed away past --session-ttl: {n} unacked commands of its session reported expired"
                        );
                    }
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
