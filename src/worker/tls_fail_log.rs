//! The log of failed TLS handshakes: a peer can fail them as fast as it connects, so a core
//! writes at most one line a second, with how many failed since the last line and the last
//! one's reason. A burst that stops is logged by the sweep within the next second, not only
//! when the next failure comes (which may be hours later, with another reason).

use std::time::Instant;

use crate::registry::throttle::Throttle;

/// The held-back count and the reason of the last failure noted.
#[derive(Debug, Default)]
pub(crate) struct TlsFailLog {
    gate: Throttle,
    last: String,
}

impl TlsFailLog {
    /// Notes a failure; the line to log when one is due now.
    pub(crate) fn note(&mut self, now: Instant, why: &dyn std::fmt::Display) -> Option<String> {
        self.last = why.to_string();
        self.gate.note(now).map(|n| self.line(n))
    }

    /// The line for failures held back, once a second has passed since the last line.
    pub(crate) fn due(&mut self, now: Instant) -> Option<String> {
        self.gate.due(now).map(|n| self.line(n))
    }

    fn line(&self, n: u64) -> String {
        format!(
            "tls: {n} connections failed TLS since the last such line (the last: {})",
            self.last
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;

    #[test]
    fn a_burst_that_stops_is_logged_with_its_own_last_reason() {
        let mut log = TlsFailLog::default();
        let t0 = Instant::now();
        let ms = |n| t0 + Duration::from_millis(n);
        let first = log.note(t0, &"unknown ca");
        assert!(first.is_some_and(|l| l.contains(" 1 connections") && l.ends_with("unknown ca)")));
        for i in 1..=5 {
            assert_eq!(log.note(ms(i * 30), &"unknown ca"), None);
        }
        assert_eq!(log.due(ms(900)), None, "not before a second");
        let held = log.due(ms(1000));
        assert!(
            held.as_deref().is_some_and(
                |l| l.contains(" 5 connections") && l.ends_with("(the last: unknown ca)")
            ),
            "{held:?}"
        );
        assert_eq!(log.due(ms(3000)), None, "nothing since");
    }
}
