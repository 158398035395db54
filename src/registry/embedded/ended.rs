//! Where sessions that another boot of their rig ended stopped numbering, kept for the park
//! window: a boot that comes back after a newer one (a stale process, a rig whose clock went
//! back) numbers on from there, as its tombstone in Redis has it do in fleet mode. Without it
//! a standalone broker numbered that boot from 1 again, under seqs the rig already had and
//! drops (CONTRACT.md §2: a session's seqs are never reused; review bb147).

use std::collections::{HashMap, VecDeque};
use std::time::{Duration, Instant};

use crate::ids::{BootId, RigId, Seq};

/// Ended sessions remembered at most: about 100 bytes each, so a reboot wave of a million
/// rigs costs about 100 MB for the park window, and one past that forgets the oldest.
pub(super) const MAX_ENDED: usize = 1 << 20;

#[derive(Debug, Default)]
pub(super) struct Ended {
    next: HashMap<(RigId, BootId), (Seq, Instant)>,
    /// When each was recorded, oldest first; an entry whose time no longer matches the map's
    /// (recorded again, or taken) is skipped.
    order: VecDeque<(Instant, RigId, BootId)>,
}

impl Ended {
    /// `rig`'s session of `boot` ended (another boot's hello), its next seq `next`.
    pub(super) fn record(&mut self, rig: &RigId, boot: BootId, next: Seq, now: Instant) {
        // Nothing numbered, nothing to repeat.
        if next.0 <= 1 {
            return;
        }
        while self.next.len() >= MAX_ENDED || self.order.len() >= 2 * MAX_ENDED {
            if !self.forget_oldest() {
                break;
            }
        }
        self.next.insert((rig.clone(), boot), (next, now));
        self.order.push_back((now, rig.clone(), boot));
    }

    /// The seq `rig`'s boot `boot` numbers on from, if a session of it ended here within the
    /// park window; taken, since the boot's session is live again.
    pub(super) fn take(&mut self, rig: &RigId, boot: BootId) -> Option<Seq> {
        self.next.remove(&(rig.clone(), boot)).map(|(next, _)| next)
    }

    /// Forgets what was recorded `keep` or more before `now`.
    pub(super) fn expire(&mut self, now: Instant, keep: Duration) {
        while self
            .order
            .front()
            .is_some_and(|(at, _, _)| now.duration_since(*at) >= keep)
        {
            self.forget_oldest();
        }
    }

    /// Drops the oldest record; false when there is none.
    fn forget_oldest(&mut self) -> bool {
        let Some((at, rig, boot)) = self.order.pop_front() else {
            return false;
        };
        let key = (rig, boot);
        if self.next.get(&key).is_some_and(|(_, t)| *t == at) {
            self.next.remove(&key);
        }
        true
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn rig() -> RigId {
        RigId::parse("rig-e").unwrap()
    }
    fn boot(ms: u64) -> BootId {
        BootId::generate(ms)
    }

    #[test]
    fn an_ended_session_is_numbered_on_once_within_the_window() {
        let (mut e, t0) = (Ended::default(), Instant::now());
        let b = boot(1);
        e.record(&rig(), b, Seq(4), t0);
        e.record(&rig(), boot(2), Seq(1), t0);
        assert_eq!(
            e.next.len(),
            1,
            "a session that numbered nothing is not kept"
        );
        e.expire(t0 + Duration::from_secs(59), Duration::from_secs(60));
        assert_eq!(e.take(&rig(), b), Some(Seq(4)));
        assert_eq!(e.take(&rig(), b), None, "taken once");
        e.record(&rig(), b, Seq(7), t0);
        e.expire(t0 + Duration::from_secs(60), Duration::from_secs(60));
        assert_eq!(e.take(&rig(), b), None, "forgotten after the window");
        assert!(e.order.is_empty());
    }

    #[test]
    fn a_session_recorded_again_keeps_its_latest_seq_past_its_first_record() {
        let (mut e, t0) = (Ended::default(), Instant::now());
        let b = boot(1);
        e.record(&rig(), b, Seq(4), t0);
        e.record(&rig(), b, Seq(9), t0 + Duration::from_secs(30));
        e.expire(t0 + Duration::from_secs(61), Duration::from_secs(60));
        assert_eq!(e.take(&rig(), b), Some(Seq(9)));
    }
}
