//! How long the end of a drain waits for a Redis that is away: until a deadline, or until a
//! second signal says "now", whichever comes first.
//!
//! The second signal can come while the bridge is already waiting (a `systemctl stop`
//! repeated during an outage), so the bridge reads it as it waits rather than once when the
//! wait begins: read once, a second SIGTERM after the drain's window still waited out the
//! whole 5 s.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

/// The end of a drain's wait for Redis.
#[derive(Debug, Clone)]
pub struct ExitWait {
    until: Instant,
    /// Set by a second SIGTERM or SIGINT.
    now: Arc<AtomicBool>,
}

impl ExitWait {
    /// A wait of `window` from `start`, cut short once `now` is set.
    pub fn new(start: Instant, window: Duration, now: Arc<AtomicBool>) -> Self {
        ExitWait {
            until: start + window,
            now,
        }
    }

    /// Whether the wait is over at `at`: its deadline passed, or "now" was said.
    pub fn over(&self, at: Instant) -> bool {
        at >= self.until || self.now.load(Ordering::SeqCst)
    }

    /// How long to pause before the next attempt: `step`, or less at the end of the wait.
    pub fn pause(&self, at: Instant, step: Duration) -> Duration {
        step.min(self.until.saturating_duration_since(at))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_wait_ends_at_its_deadline_or_at_once_when_now_is_said() {
        let t0 = Instant::now();
        let now = Arc::new(AtomicBool::new(false));
        let wait = ExitWait::new(t0, Duration::from_secs(5), now.clone());
        assert!(!wait.over(t0 + Duration::from_secs(4)));
        assert!(wait.over(t0 + Duration::from_secs(5)));
        assert_eq!(
            wait.pause(
                t0 + Duration::from_millis(4_950),
                Duration::from_millis(100)
            ),
            Duration::from_millis(50)
        );
        now.store(true, Ordering::SeqCst);
        assert!(wait.over(t0), "said while waiting: over at once");
    }
}
