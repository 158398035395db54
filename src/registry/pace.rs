//! When the bridge's queued Redis writes (persists, publishes, releases) go out.
//!
//! Redis shares the CPUs with the deliveries, so during a 10,000-rig fan-out the bridge should
//! send a few dozen big round trips, not thousands of small ones: a write waits [`PACE`] after
//! the previous one, or goes at once when [`BATCH`] are queued.
//!
//! A persist is different: it holds its command back from the rig. It must not wait behind the
//! canary's publish or last second's forgets, so persists have a token bucket (GCRA) of their
//! own: up to [`BURST`] go out back to back, then one per [`PACE`]. Everything else queued
//! leaves with them. A session's note (its `r`) written as its rig leaves goes with the
//! persists too: a rig back on another broker at once is read there within a millisecond.
//! Replies and events stay paced: sent at once they would take the CPU from the delivery they
//! report on.
//!
//! With one fixed gap for all, an idle single-command run (1,000 commands 10 ms apart) had 5
//! persists wait 1.1 ms each behind a canary or a forget: a p99 of their own.

use std::time::{Duration, Instant};

/// One write per this, once the burst is spent.
pub(crate) const PACE: Duration = Duration::from_millis(1);
/// Persists that may go out back to back before the pace applies to them.
pub(crate) const BURST: u32 = 4;
/// This many queued writes go out at once, whatever the pace.
pub(crate) const BATCH: usize = 1024;

/// What is queued for the next write.
#[derive(Clone, Copy, Debug, Default)]
pub(crate) struct Queued {
    /// Persists: commands held back until Redis keeps them; and sessions' notes for a resume
    /// elsewhere, which the rig's next broker may read within a millisecond.
    pub persists: usize,
    /// Everything else: publishes, releases, session re-keeps.
    pub others: usize,
}

#[derive(Debug)]
pub(crate) struct WritePace {
    /// When the last write went out.
    last: Instant,
    /// The persists' bucket as its "theoretical arrival time" (generic cell rate algorithm):
    /// each write pushes it one [`PACE`] further.
    tat: Instant,
}

impl WritePace {
    pub(crate) fn new(now: Instant) -> Self {
        WritePace {
            last: now.checked_sub(PACE).unwrap_or(now),
            tat: now,
        }
    }

    /// When what is queued may go out: None when nothing is; `now` or earlier means at once.
    pub(crate) fn due(&self, q: Queued, now: Instant) -> Option<Instant> {
        if q.persists + q.others >= BATCH {
            return Some(now);
        }
        let persists =
            (q.persists > 0).then(|| self.tat.checked_sub(PACE * (BURST - 1)).unwrap_or(now));
        let others = (q.others > 0).then(|| self.last + PACE);
        persists.into_iter().chain(others).min()
    }

    /// A write went out at `now`.
    pub(crate) fn wrote(&mut self, now: Instant) {
        self.last = now;
        self.tat = self.tat.max(now) + PACE;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const PERSIST: Queued = Queued {
        persists: 1,
        others: 0,
    };
    const PUBLISH: Queued = Queued {
        persists: 0,
        others: 1,
    };

    fn at_once(p: &WritePace, q: Queued, now: Instant) -> bool {
        p.due(q, now).is_some_and(|d| d <= now)
    }

    #[test]
    fn nothing_queued_is_never_due() {
        let now = Instant::now();
        assert_eq!(WritePace::new(now).due(Queued::default(), now), None);
    }

    #[test]
    fn after_an_idle_spell_anything_goes_at_once() {
        let t0 = Instant::now();
        let p = WritePace::new(t0);
        assert!(at_once(&p, PERSIST, t0));
        assert!(at_once(&p, PUBLISH, t0));
    }

    #[test]
    fn a_persist_does_not_wait_behind_a_maintenance_write() {
        // The canary's publish, then a persist 300 us later: the persist goes at once.
        let t0 = Instant::now();
        let mut p = WritePace::new(t0);
        p.wrote(t0);
        let later = t0 + Duration::from_micros(300);
        assert!(at_once(&p, PERSIST, later));
    }

    #[test]
    fn a_reply_waits_one_pace_after_the_persist_it_reports() {
        let t0 = Instant::now();
        let mut p = WritePace::new(t0);
        p.wrote(t0);
        assert_eq!(p.due(PUBLISH, t0), Some(t0 + PACE));
        let both = Queued {
            persists: 1,
            others: 1,
        };
        assert!(at_once(&p, both, t0), "a persist takes the reply with it");
    }

    #[test]
    fn persists_go_in_a_burst_then_one_per_pace() {
        let t0 = Instant::now();
        let mut p = WritePace::new(t0);
        for i in 0..BURST {
            assert!(at_once(&p, PERSIST, t0), "persist {i} of the burst waits");
            p.wrote(t0);
        }
        assert_eq!(
            p.due(PERSIST, t0),
            Some(t0 + PACE),
            "the next waits one pace"
        );
        p.wrote(t0 + PACE);
        assert_eq!(p.due(PERSIST, t0 + PACE), Some(t0 + 2 * PACE));
    }

    #[test]
    fn a_full_batch_goes_out_at_once_even_when_paced() {
        let t0 = Instant::now();
        let mut p = WritePace::new(t0);
        for _ in 0..2 * BURST {
            p.wrote(t0);
        }
        let almost = Queued {
            persists: BATCH / 2,
            others: BATCH / 2 - 1,
        };
        assert!(!at_once(&p, almost, t0));
        let full = Queued {
            persists: BATCH / 2,
            others: BATCH / 2,
        };
        assert!(at_once(&p, full, t0));
    }

    #[test]
    fn the_bucket_refills_with_time() {
        let t0 = Instant::now();
        let mut p = WritePace::new(t0);
        for _ in 0..BURST {
            p.wrote(t0);
        }
        assert!(!at_once(&p, PERSIST, t0));
        let rested = t0 + PACE * BURST;
        for i in 0..BURST {
            assert!(
                at_once(&p, PERSIST, rested),
                "persist {i} after a rest waits"
            );
            p.wrote(rested);
        }
        assert!(!at_once(&p, PERSIST, rested));
    }
}
