//! Reconnect delays. Pure functions of a failure count or a broker hint plus an RNG, so tests fix
//! the seed; `session` decides which one applies and sleeps.
//!
//! Proportional jitter (a uniform factor around the nominal delay, not an added constant) keeps a
//! fleet that lost its broker at the same instant from coming back in lockstep.

use std::time::Duration;

use fastrand::Rng;

/// Ceiling of the exponential part, in seconds.
pub(crate) const MAX_BACKOFF_S: u64 = 30;
/// A connection that got `welcome` and stayed up this long resets the failure count.
pub(crate) const HEALTHY_AFTER: Duration = Duration::from_secs(10);
/// Largest Retry-After the agent honours, in seconds; a bigger value is clamped to it.
pub(crate) const MAX_RETRY_AFTER_S: u64 = 600;

/// Delay before the next attempt after `n` consecutive failures (0 after a healthy connection):
/// uniform(0.5, 1.5) × min(2^n, 30) s.
pub(crate) fn next_delay(n: u32, rng: &mut Rng) -> Duration {
    let nominal = (1u64 << n.min(6)).min(MAX_BACKOFF_S) as f64;
    Duration::from_secs_f64(nominal * (0.5 + rng.f64()))
}

/// Delay for a broker's `Retry-After: secs` (HTTP 503, or close 4503 `retry_after=secs`):
/// secs ± 10 %, so the rigs one broker turned away do not all return in the same second.
pub(crate) fn retry_after_delay(secs: u64, rng: &mut Rng) -> Duration {
    let secs = secs.min(MAX_RETRY_AFTER_S) as f64;
    Duration::from_secs_f64(secs * (0.9 + 0.2 * rng.f64()))
}

/// The delta-seconds form of a `Retry-After` header value (RFC 9110 §10.2.3). The HTTP-date form
/// is not understood (the broker never sends it): `None`, and the caller backs off instead.
pub(crate) fn parse_retry_after(value: &str) -> Option<u64> {
    let v = value.trim();
    if v.is_empty() || !v.bytes().all(|b| b.is_ascii_digit()) {
        return None;
    }
    // All digits: only overflow fails, and a huge value means "a long time".
    Some(v.parse().unwrap_or(u64::MAX))
}

/// The seconds in a close-4503 reason, `retry_after=<s>` (CONTRACT.md §2).
pub(crate) fn parse_close_retry_after(reason: &str) -> Option<u64> {
    reason
        .split([' ', ';', ','])
        .find_map(|w| w.strip_prefix("retry_after="))
        .and_then(parse_retry_after)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn backoff_is_proportional_and_capped() {
        let mut rng = Rng::with_seed(7);
        for n in 0..40u32 {
            let nominal = (1u64 << n.min(6)).min(MAX_BACKOFF_S) as f64;
            for _ in 0..200 {
                let d = next_delay(n, &mut rng).as_secs_f64();
                assert!(d >= nominal * 0.5 && d < nominal * 1.5, "n={n} d={d}");
            }
        }
        assert!(next_delay(u32::MAX, &mut rng) < Duration::from_secs(45));
    }

    #[test]
    fn backoff_spreads_over_the_whole_window() {
        let mut rng = Rng::with_seed(1);
        let ds: Vec<f64> = (0..1000)
            .map(|_| next_delay(0, &mut rng).as_secs_f64())
            .collect();
        assert!(ds.iter().any(|&d| d < 0.6) && ds.iter().any(|&d| d > 1.4));
        let mean = ds.iter().sum::<f64>() / ds.len() as f64;
        assert!((mean - 1.0).abs() < 0.05, "{mean}");
    }

    #[test]
    fn same_seed_same_delays() {
        let (mut a, mut b) = (Rng::with_seed(42), Rng::with_seed(42));
        for n in 0..10 {
            assert_eq!(next_delay(n, &mut a), next_delay(n, &mut b));
        }
    }

    #[test]
    fn retry_after_is_jittered_ten_percent() {
        let mut rng = Rng::with_seed(3);
        for secs in 5..=15u64 {
            for _ in 0..100 {
                let d = retry_after_delay(secs, &mut rng).as_secs_f64();
                assert!(
                    d >= secs as f64 * 0.9 && d < secs as f64 * 1.1,
                    "{secs} {d}"
                );
            }
        }
        let long = retry_after_delay(u64::MAX, &mut rng).as_secs_f64();
        assert!(long < MAX_RETRY_AFTER_S as f64 * 1.1);
    }

    #[test]
    fn retry_after_values() {
        assert_eq!(parse_retry_after("7"), Some(7));
        assert_eq!(parse_retry_after(" 15 "), Some(15));
        assert_eq!(parse_retry_after("0"), Some(0));
        assert_eq!(parse_retry_after("99999999999999999999999"), Some(u64::MAX));
        assert_eq!(parse_retry_after("Wed, 21 Oct 2015 07:28:00 GMT"), None);
        assert_eq!(parse_retry_after("-1"), None);
        assert_eq!(parse_retry_after(""), None);
        assert_eq!(parse_close_retry_after("retry_after=12"), Some(12));
        assert_eq!(parse_close_retry_after("busy; retry_after=5"), Some(5));
        assert_eq!(parse_close_retry_after("retry_after="), None);
        assert_eq!(parse_close_retry_after("over capacity"), None);
    }
}
