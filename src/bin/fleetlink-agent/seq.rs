//! Which commands to run: the agent's half of "at-least-once on the wire, once in effect"
//! (CONTRACT.md §5).
//!
//! Invariant: `last_seen` is the highest seq of the current broker session that was handed to
//! the worker. It is what the hello's `last_seq` carries on a reconnect, so the broker replays
//! only what came after it; anything at or below it that arrives again is a duplicate.

use std::ops::RangeInclusive;

/// What to do with an incoming command's seq.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum SeqVerdict {
    /// The next one: ack it and run it.
    Run,
    /// Already run (a replay after resume): ack again, do not run.
    Duplicate,
    /// Commands were skipped, so the broker lost them: refuse to go on.
    Gap {
        /// The seqs that never arrived.
        missing: RangeInclusive<u64>,
    },
}

/// The seq state of one broker session (rig_id + boot_id).
#[derive(Debug, Default)]
pub(crate) struct SeqTracker {
    last_seen: u64,
    /// Welcomed with `resumed: false` and no command since: the next seq may start a new count.
    fresh: bool,
}

impl SeqTracker {
    /// Judges `seq` against what this session already ran.
    pub(crate) fn judge(&self, seq: u64) -> SeqVerdict {
        if self.fresh && seq == 1 {
            SeqVerdict::Run
        } else if seq <= self.last_seen {
            SeqVerdict::Duplicate
        } else if seq == self.last_seen + 1 {
            SeqVerdict::Run
        } else {
            SeqVerdict::Gap {
                missing: self.last_seen + 1..=seq - 1,
            }
        }
    }

    /// Records that `seq` (judged `Run`) was handed to the worker.
    pub(crate) fn record(&mut self, seq: u64) {
        if std::mem::take(&mut self.fresh) && seq == 1 {
            self.last_seen = 1;
            return;
        }
        self.last_seen = self.last_seen.max(seq);
    }

    /// The hello's `last_seq`: `None` before the first command.
    pub(crate) fn last_seq(&self) -> Option<u64> {
        (self.last_seen > 0).then_some(self.last_seen)
    }

    /// A welcome arrived. With `resumed: false` the broker has no session for this boot any
    /// more (it restarted, or the session expired): fleetlink-fe never reuses a seq, so it
    /// numbers on from the hello's `last_seq` + 1, while a broker that counts from 1 again
    /// starts a new count. The first command after the welcome tells which, and either runs.
    pub(crate) fn welcomed(&mut self, resumed: bool) {
        self.fresh = !resumed;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn in_order_runs_then_replays_are_duplicates() {
        let mut t = SeqTracker::default();
        assert_eq!(t.last_seq(), None);
        for seq in 1..=5 {
            assert_eq!(t.judge(seq), SeqVerdict::Run);
            t.record(seq);
        }
        assert_eq!(t.last_seq(), Some(5));
        for seq in 1..=5 {
            assert_eq!(t.judge(seq), SeqVerdict::Duplicate);
        }
        assert_eq!(t.judge(6), SeqVerdict::Run);
    }

    #[test]
    fn seq_zero_never_runs() {
        assert_eq!(SeqTracker::default().judge(0), SeqVerdict::Duplicate);
    }

    #[test]
    fn a_skipped_seq_is_a_gap() {
        let mut t = SeqTracker::default();
        assert_eq!(t.judge(2), SeqVerdict::Gap { missing: 1..=1 });
        t.record(1);
        assert_eq!(t.judge(5), SeqVerdict::Gap { missing: 2..=4 });
        assert_eq!(
            t.judge(u64::MAX),
            SeqVerdict::Gap {
                missing: 2..=u64::MAX - 1
            }
        );
    }

    #[test]
    fn after_a_restart_the_count_goes_on_or_starts_again_at_one() {
        let mut t = SeqTracker::default();
        t.record(1);
        t.record(2);
        t.welcomed(false);
        assert_eq!(
            t.last_seq(),
            Some(2),
            "the next hello still says what it has"
        );
        assert_eq!(t.judge(3), SeqVerdict::Run);
        assert_eq!(t.judge(1), SeqVerdict::Run);
        assert_eq!(t.judge(2), SeqVerdict::Duplicate);
        assert_eq!(t.judge(4), SeqVerdict::Gap { missing: 3..=3 });

        let mut on = SeqTracker::default();
        on.record(2);
        on.welcomed(false);
        on.record(3);
        assert_eq!(on.judge(1), SeqVerdict::Duplicate, "the count went on");
        assert_eq!(on.judge(4), SeqVerdict::Run);

        let mut again = SeqTracker::default();
        again.record(2);
        again.welcomed(false);
        again.record(1);
        assert_eq!(again.last_seq(), Some(1), "a new count from 1");
        assert_eq!(again.judge(2), SeqVerdict::Run);
    }

    #[test]
    fn a_resumed_welcome_after_a_restart_replays_nothing_twice() {
        let mut t = SeqTracker::default();
        t.record(1);
        t.record(2);
        t.welcomed(false);
        t.welcomed(true);
        assert_eq!(t.judge(1), SeqVerdict::Duplicate);
        assert_eq!(t.judge(3), SeqVerdict::Run);
    }
}
