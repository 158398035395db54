//! A gate for log lines about things that can happen thousands of times a second (refused
//! control messages, dropped publishes): one line a second at most, each saying how many
//! happened since the last line, so the log stays readable and still adds up. The bridge
//! thread owns each one; `now` is passed in so tests drive the clock.

use std::time::{Duration, Instant};

/// Shortest time between two lines.
const EVERY: Duration = Duration::from_secs(1);

/// Occurrences noted, and when the last line went out.
#[derive(Debug, Default)]
pub(crate) struct Throttle {
    last: Option<Instant>,
    /// Occurrences noted since the last line that did not get one of their own.
    pending: u64,
}

impl Throttle {
    /// Notes one occurrence. Some(n) when a line is due now, `n` the occurrences it stands for
    /// (this one and those held back since the last line).
    pub(crate) fn note(&mut self, now: Instant) -> Option<u64> {
        self.pending += 1;
        self.due(now)
    }

    /// Some(n) when occurrences were held back and a line is due now: a burst that stopped
    /// still gets its count logged, not only when the next one comes.
    pub(crate) fn due(&mut self, now: Instant) -> Option<u64> {
        if self.pending == 0
            || self
                .last
                .is_some_and(|t| now.saturating_duration_since(t) < EVERY)
        {
            return None;
        }
        self.last = Some(now);
        Some(std::mem::take(&mut self.pending))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn one_line_a_second_and_each_counts_what_came_since_the_last() {
        let mut t = Throttle::default();
        let t0 = Instant::now();
        let ms = |n| t0 + Duration::from_millis(n);
        assert_eq!(t.due(t0), None, "nothing noted");
        assert_eq!(t.note(t0), Some(1), "the first goes out at once");
        assert_eq!(t.note(ms(500)), None);
        assert_eq!(t.note(ms(900)), None);
        assert_eq!(t.due(ms(999)), None, "not before a second");
        assert_eq!(t.note(ms(1000)), Some(3), "two held back and this one");
        assert_eq!(t.due(ms(1200)), None, "nothing since");
        assert_eq!(t.note(ms(1500)), None);
        assert_eq!(
            t.due(ms(2000)),
            Some(1),
            "a stopped burst is logged by due()"
        );
        assert_eq!(t.note(ms(9000)), Some(1));
    }
}
