//! The reconnect policy: from how a connection attempt ended to the wait before the next one,
//! or to the reason there is none. No IO and no clock reads beyond the goaway instant it is
//! given, so each rule has a unit test.
//!
//! Rules, in order:
//! - a goaway: reconnect at the instant it asked for, exactly (no jitter: the broker already
//!   spread its rigs over the drain window), and the failure count starts over;
//! - close 4400 / 4403 / 4409, or an upgrade answered with a final 4xx (404 for a wrong
//!   path, 426, 431, 401/403): the broker will refuse this rig every time; stop;
//! - HTTP 503 `Retry-After: N`, close 4503 `retry_after=N`: N s ± 10 %;
//! - anything else: `backoff::next_delay(n)`, n = consecutive failures, reset by a connection
//!   that got `welcome` and stayed up `HEALTHY_AFTER`, or that the broker closed with 1012
//!   (control's kick: "reconnect", which is no failure of the rig's);
//!
//! `--max-attempts` bounds the consecutive attempts that never got `welcome` (hinted ones
//! included): a welcomed connection is a successful attempt, however soon it ends. Before, a
//! kick counted as a failed attempt, so `--max-attempts 1` made one kick stop the agent.

use std::time::{Duration, Instant};

use fastrand::Rng;

use crate::backoff::{next_delay, parse_close_retry_after, retry_after_delay, HEALTHY_AFTER};

/// Why the agent stopped; the process exit code.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Exit {
    /// SIGTERM/SIGINT or `--run-for` elapsed: 0.
    Stopped,
    /// The worker thread died: 1.
    Fatal,
    /// `--max-attempts` consecutive failures: 3.
    GaveUp,
    /// A seq gap: commands were lost, so going on would hide it: 4.
    SeqGap,
    /// The broker refused this rig for good (4400 bad hello, 4403 identity, 4409 newer boot,
    /// or a final 4xx answer to the upgrade): 5.
    Refused,
}

impl Exit {
    pub(crate) fn code(self) -> u8 {
        match self {
            Exit::Stopped => 0,
            Exit::Fatal => 1,
            Exit::GaveUp => 3,
            Exit::SeqGap => 4,
            Exit::Refused => 5,
        }
    }
}

/// How one connection attempt ended.
#[derive(Debug)]
pub(crate) enum End {
    /// No websocket, or it broke or was closed.
    Lost {
        why: String,
        /// How long it was up after `welcome` (`None`: never welcomed).
        welcomed_for: Option<Duration>,
        /// The broker's close code and reason, if it sent one.
        close: Option<(u16, String)>,
    },
    /// HTTP 503, with the Retry-After seconds if usable.
    Unavailable(Option<u64>),
    /// An upgrade answer no retry would change (`dial::refusal_is_final`).
    Refused(String),
    /// The broker sent goaway: reconnect at this instant.
    Goaway(Instant),
    /// Stop the agent.
    Exit(Exit),
}

/// The failure count and the jitter source, across attempts.
pub(crate) struct Policy {
    /// Consecutive failed attempts: the backoff's n.
    failures: u32,
    /// Consecutive attempts that never got `welcome`: what `--max-attempts` bounds.
    unwelcomed: u32,
    max_attempts: Option<u32>,
    rng: Rng,
}

impl Policy {
    pub(crate) fn new(max_attempts: Option<u32>, rng: Rng) -> Policy {
        Policy {
            failures: 0,
            unwelcomed: 0,
            max_attempts,
            rng,
        }
    }

    /// The wait before the next attempt after `end` (as of `now`), or why there is none.
    /// Logs the decision: tests and operators read `retry in Xs (...)` lines.
    pub(crate) fn plan(&mut self, end: End, now: Instant) -> Result<Duration, Exit> {
        match end {
            End::Exit(exit) => Err(exit),
            End::Goaway(at) => {
                self.failures = 0;
                self.unwelcomed = 0;
                let delay = at.saturating_duration_since(now);
                log::info!(
                    "reconnecting in {}ms as the goaway asked",
                    delay.as_millis()
                );
                Ok(delay)
            }
            End::Unavailable(secs) => self.hinted(secs, "HTTP 503"),
            End::Refused(why) => {
                log::error!("!!! {why}; not retrying");
                Err(Exit::Refused)
            }
            End::Lost {
                why,
                welcomed_for,
                close,
            } => {
                match &close {
                    Some((code @ (4400 | 4403 | 4409), reason)) => {
                        log::error!(
                            "!!! broker refused this rig: close {code} {reason:?}; not retrying"
                        );
                        return Err(Exit::Refused);
                    }
                    Some((4503, reason)) => {
                        if let Some(secs) = parse_close_retry_after(reason) {
                            return self.hinted(Some(secs), "close 4503");
                        }
                    }
                    _ => {}
                }
                let Some(up) = welcomed_for else {
                    return self.backoff(&why);
                };
                self.unwelcomed = 0;
                let kicked = matches!(close, Some((1012, _)));
                if up >= HEALTHY_AFTER || kicked {
                    self.failures = 0;
                    return Ok(self.delay(&why));
                }
                // Welcomed, then lost soon: no failed attempt, but the backoff still grows,
                // so a rig that keeps being dropped at once does not reconnect in a loop.
                self.failures = self.failures.saturating_add(1);
                Ok(self.delay(&why))
            }
        }
    }

    /// A broker hint (`Retry-After`); without one, the ordinary backoff. `0` is no hint: taken
    /// at its word from a proxy that says it, every rig behind it would retry in a tight loop.
    fn hinted(&mut self, secs: Option<u64>, what: &str) -> Result<Duration, Exit> {
        let Some(secs) = secs.filter(|&s| s > 0) else {
            return self.backoff(&format!("{what} without a usable Retry-After"));
        };
        self.count_failure(what)?;
        let delay = retry_after_delay(secs, &mut self.rng);
        log::warn!(
            "{what}: retry in {:.2}s (Retry-After: {secs})",
            delay.as_secs_f64()
        );
        Ok(delay)
    }

    /// A failed attempt (never welcomed) and the backoff after it.
    fn backoff(&mut self, why: &str) -> Result<Duration, Exit> {
        self.count_failure(why)?;
        Ok(self.delay(why))
    }

    fn delay(&mut self, why: &str) -> Duration {
        let delay = next_delay(self.failures, &mut self.rng);
        log::warn!(
            "{why}; retry in {:.2}s (backoff n={})",
            delay.as_secs_f64(),
            self.failures
        );
        delay
    }

    /// An attempt that never got `welcome`.
    fn count_failure(&mut self, why: &str) -> Result<(), Exit> {
        self.failures = self.failures.saturating_add(1);
        self.unwelcomed = self.unwelcomed.saturating_add(1);
        match self.max_attempts {
            Some(max) if self.unwelcomed >= max => {
                log::error!("{why}; giving up after {max} consecutive failed attempts");
                Err(Exit::GaveUp)
            }
            _ => Ok(()),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn lost(welcomed_for: Option<u64>, close: Option<(u16, &str)>) -> End {
        End::Lost {
            why: "test".into(),
            welcomed_for: welcomed_for.map(Duration::from_secs),
            close: close.map(|(c, r)| (c, r.to_string())),
        }
    }

    fn secs(d: Result<Duration, Exit>) -> f64 {
        d.unwrap().as_secs_f64()
    }

    #[test]
    fn failures_grow_the_backoff_and_a_healthy_connection_resets_it() {
        let mut p = Policy::new(None, Rng::with_seed(5));
        let now = Instant::now();
        let first = secs(p.plan(lost(None, None), now));
        assert!((1.0..3.0).contains(&first), "{first}");
        let second = secs(p.plan(lost(Some(2), Some((4410, "superseded"))), now));
        assert!((2.0..6.0).contains(&second), "{second}");
        for _ in 0..10 {
            p.plan(lost(None, None), now).unwrap();
        }
        let capped = secs(p.plan(lost(None, None), now));
        assert!((15.0..45.0).contains(&capped), "{capped}");
        let healthy = secs(p.plan(lost(Some(10), Some((1001, ""))), now));
        assert!((0.5..1.5).contains(&healthy), "{healthy}");
    }

    #[test]
    fn a_kick_or_a_short_welcomed_connection_is_no_failed_attempt() {
        let now = Instant::now();
        // Kicked at once, again and again: reconnect promptly, never give up.
        let mut p = Policy::new(Some(1), Rng::with_seed(6));
        for _ in 0..5 {
            let kicked = lost(Some(0), Some((1012, "kicked by control; reconnect")));
            let d = secs(p.plan(kicked, now));
            assert!((0.5..1.5).contains(&d), "{d}");
        }
        // Dropped soon after each welcome: no failed attempt, but the backoff grows.
        let mut p = Policy::new(Some(1), Rng::with_seed(6));
        for _ in 0..3 {
            p.plan(lost(Some(1), Some((4410, "superseded"))), now)
                .unwrap();
        }
        let fourth = secs(p.plan(lost(Some(1), Some((4410, "superseded"))), now));
        assert!((8.0..24.0).contains(&fourth), "{fourth}");
        // The first attempt that fails after them is the first failed attempt.
        assert_eq!(p.plan(lost(None, None), now), Err(Exit::GaveUp));
    }

    #[test]
    fn goaway_is_exact_and_resets_the_count() {
        let mut p = Policy::new(None, Rng::with_seed(1));
        let now = Instant::now();
        p.plan(lost(None, None), now).unwrap();
        p.plan(lost(None, None), now).unwrap();
        let at = now + Duration::from_millis(321);
        assert_eq!(p.plan(End::Goaway(at), now), Ok(Duration::from_millis(321)));
        assert_eq!(
            p.plan(End::Goaway(now), now + Duration::from_secs(1)),
            Ok(Duration::ZERO)
        );
        assert!((1.0..3.0).contains(&secs(p.plan(lost(None, None), now))));
    }

    #[test]
    fn retry_after_hints() {
        let mut p = Policy::new(None, Rng::with_seed(2));
        let now = Instant::now();
        let d = secs(p.plan(End::Unavailable(Some(10)), now));
        assert!((9.0..11.0).contains(&d), "{d}");
        let d = secs(p.plan(lost(None, Some((4503, "retry_after=5"))), now));
        assert!((4.5..5.5).contains(&d), "{d}");
        // No usable hint: the backoff (third failure in a row, n=3).
        let d = secs(p.plan(End::Unavailable(None), now));
        assert!((4.0..12.0).contains(&d), "{d}");
        let d = secs(p.plan(lost(None, Some((4503, "busy"))), now));
        assert!((8.0..24.0).contains(&d), "{d}");
        // Zero is no hint either (a proxy's `Retry-After: 0` made a tight loop): the backoff.
        for zero in [
            End::Unavailable(Some(0)),
            lost(None, Some((4503, "retry_after=0"))),
        ] {
            let d = secs(p.plan(zero, now));
            assert!((4.0..46.0).contains(&d), "{d}");
        }
    }

    #[test]
    fn permanent_refusals_stop() {
        for code in [4400, 4403, 4409] {
            let mut p = Policy::new(None, Rng::with_seed(3));
            assert_eq!(
                p.plan(lost(Some(60), Some((code, "no"))), Instant::now()),
                Err(Exit::Refused)
            );
        }
        let mut p = Policy::new(None, Rng::with_seed(3));
        assert_eq!(
            p.plan(End::Refused("HTTP 404".into()), Instant::now()),
            Err(Exit::Refused)
        );
        assert!(p
            .plan(lost(Some(1), Some((4410, "superseded"))), Instant::now())
            .is_ok());
        assert_eq!(
            p.plan(End::Exit(Exit::SeqGap), Instant::now()),
            Err(Exit::SeqGap)
        );
    }

    #[test]
    fn max_attempts_counts_consecutive_failures() {
        let mut p = Policy::new(Some(3), Rng::with_seed(4));
        let now = Instant::now();
        assert!(p.plan(lost(None, None), now).is_ok());
        assert!(p.plan(End::Unavailable(Some(5)), now).is_ok());
        assert_eq!(p.plan(lost(None, None), now), Err(Exit::GaveUp));
        let mut p = Policy::new(Some(2), Rng::with_seed(4));
        assert!(p.plan(lost(None, None), now).is_ok());
        assert!(p.plan(lost(Some(30), None), now).is_ok());
        assert!(p.plan(lost(None, None), now).is_ok());
        assert_eq!(p.plan(lost(None, None), now), Err(Exit::GaveUp));
    }
}
