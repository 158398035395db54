//! Token buckets: one per core for accepts, one compact one per connection for inbound
//! messages (CONTRACT.md §1 `--accept-*`, §2 fairness).

use std::time::Instant;

/// A classic token bucket (per core, for accepts).
#[derive(Debug)]
pub struct TokenBucket {
    rate: f64,
    burst: f64,
    tokens: f64,
    last: Instant,
}

impl TokenBucket {
    /// `rate` tokens per second, at most `burst` stored; starts full.
    pub fn new(rate: f64, burst: f64, now: Instant) -> Self {
        Self {
            rate,
            burst,
            tokens: burst,
            last: now,
        }
    }

    /// Takes one token if there is one.
    pub fn try_take(&mut self, now: Instant) -> bool {
        let elapsed = now.saturating_duration_since(self.last).as_secs_f64();
        self.tokens = (self.tokens + elapsed * self.rate).min(self.burst);
        self.last = now;
        if self.tokens >= 1.0 {
            self.tokens -= 1.0;
            true
        } else {
            false
        }
    }
}

/// A per-connection bucket in 8 bytes: tokens and the core clock (ms) of the last refill.
/// Rate and burst are the broker's, passed in, so each connection stores only its state.
#[derive(Debug, Clone, Copy)]
pub struct RigBucket {
    tokens: f32,
    at_ms: u32,
}

impl RigBucket {
    /// A full bucket.
    pub fn full(burst: u32, now_ms: u32) -> Self {
        Self {
            tokens: burst as f32,
            at_ms: now_ms,
        }
    }

    /// Refills, then says whether a token is there, or how many ms until one is.
    pub fn ready(&mut self, rate: f64, burst: u32, now_ms: u32) -> Result<(), u32> {
        // wrapping_sub: the core clock wraps after ~49 days; intervals stay correct.
        let elapsed = now_ms.wrapping_sub(self.at_ms) as f64 / 1000.0;
        self.tokens = ((self.tokens as f64) + elapsed * rate).min(burst as f64) as f32;
        self.at_ms = now_ms;
        if self.tokens >= 1.0 {
            Ok(())
        } else {
            // At most a minute: the core compares pause deadlines on its wrapping u32 clock,
            // where a wait past 2^31 ms would read as already over (a rate of 1e-7/s).
            let wait = ((1.0 - self.tokens as f64) / rate * 1000.0).ceil();
            Err((wait.min(60_000.0) as u32).max(1))
        }
    }

    /// Spends `cost` of a token (less than one) without asking: for control frames, which
    /// cost the broker a decode and, for a PING, a PONG, but are not messages of their own.
    /// Never below empty, so a flood of them waits one token's refill, not its own length.
    pub fn spend(&mut self, cost: f32) {
        // Never below empty, nor back up to it: a debt [`RigBucket::owe`]d stays owed.
        self.tokens = (self.tokens - cost).max(self.tokens.min(0.0));
    }

    /// Spends `cost`, going into debt: the next token then takes as long as the debt to
    /// refill. For input whose cost is known only after it was read; the caller reads no more
    /// while the bucket is not ready, so the debt stays within one read's cost.
    pub fn owe(&mut self, cost: f32) {
        self.tokens -= cost;
    }

    /// Takes one token, or says how many ms until one is there.
    pub fn take(&mut self, rate: f64, burst: u32, now_ms: u32) -> Result<(), u32> {
        self.ready(rate, burst, now_ms)?;
        self.tokens -= 1.0;
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;

    #[test]
    fn accept_bucket_refills_at_rate() {
        let t0 = Instant::now();
        let mut b = TokenBucket::new(10.0, 2.0, t0);
        assert!(b.try_take(t0));
        assert!(b.try_take(t0));
        assert!(!b.try_take(t0));
        assert!(b.try_take(t0 + Duration::from_millis(100)));
        assert!(!b.try_take(t0 + Duration::from_millis(100)));
    }

    #[test]
    fn rig_bucket_says_how_long_to_wait() {
        let mut b = RigBucket::full(2, 0);
        assert!(b.take(100.0, 2, 0).is_ok());
        assert!(b.take(100.0, 2, 0).is_ok());
        assert_eq!(b.take(100.0, 2, 0), Err(10));
        assert!(b.take(100.0, 2, 10).is_ok());
        assert_eq!(std::mem::size_of::<RigBucket>(), 8);
    }

    #[test]
    fn control_frames_spend_part_of_a_token_and_waits_stay_under_a_minute() {
        let mut b = RigBucket::full(1, 0);
        for _ in 0..7 {
            b.spend(0.125);
        }
        assert!(
            b.ready(100.0, 1, 0).is_err(),
            "7/8 spent: not a whole token left"
        );
        for _ in 0..100 {
            b.spend(0.125);
        }
        assert_eq!(b.ready(100.0, 1, 0), Err(10), "empty, not below");
        assert_eq!(b.ready(1e-9, 1, 0), Err(60_000));
    }

    #[test]
    fn a_debt_waits_its_own_length() {
        let mut b = RigBucket::full(4, 0);
        b.owe(6.0);
        assert_eq!(b.ready(100.0, 4, 0), Err(30), "2 owed, 1 to take: 3 away");
        // A control frame's part of a token neither deepens the debt nor forgives it.
        b.spend(0.125);
        assert_eq!(b.ready(100.0, 4, 0), Err(30), "the debt stands");
        assert!(b.ready(100.0, 4, 29).is_err());
        assert!(b.ready(100.0, 4, 30).is_ok());
    }
}
