//! What a core counts, on its own hot path: plain `Cell`s only that core touches, so the
//! counting stays free of locks and atomics and of everything the admin thread does later.

use std::cell::{Cell, RefCell};
use std::collections::HashMap;
use std::time::Duration;

use super::snapshot::CoreSnapshot;

/// A counter's index. Keep `COUNTERS` in the same order.
#[derive(Clone, Copy, Debug)]
#[allow(missing_docs)]
pub enum C {
    AcceptOk,
    AcceptRateLimited,
    AcceptOverCapacity,
    AcceptShed,
    AcceptError,
    Upgraded,
    Reject400,
    Reject401,
    Reject404,
    Reject405,
    Reject426,
    Reject431,
    HeadTimeout,
    HeadAbandoned,
    MsgHello,
    MsgAck,
    MsgResult,
    MsgEvent,
    MsgUnknown,
    MsgInvalid,
    MsgBinary,
    CmdEnqueued,
    CmdWritten,
    CmdAcked,
    CmdOutboxFull,
    CmdNotConnected,
    CmdResumeSent,
    CmdResumeDropped,
    CmdSeqExhausted,
    CmdMemoryFull,
    PingsSent,
    PongsReceived,
    RigRatePaused,
    BridgeQueueFull,
    Kicks,
    TlsFailed,
    IdentityMismatch,
    Forbidden,
    AdminDirect,
    AdminRerouted,
    AdminAnswerDropped,
    AdminConnMoved,
    AdminRequestMemoryFull,
}

/// (metric name, label pair) for each counter, in [`C`] order.
pub(super) const COUNTERS: [(&str, &str); 43] = [
    ("fleetlink_accepts_total", "result=\"ok\""),
    ("fleetlink_accepts_total", "result=\"rate_limited\""),
    ("fleetlink_accepts_total", "result=\"over_capacity\""),
    ("fleetlink_accepts_total", "result=\"shed\""),
    ("fleetlink_accepts_total", "result=\"error\""),
    ("fleetlink_upgrades_total", "result=\"ok\""),
    ("fleetlink_upgrades_total", "result=\"400\""),
    ("fleetlink_upgrades_total", "result=\"401\""),
    ("fleetlink_upgrades_total", "result=\"404\""),
    ("fleetlink_upgrades_total", "result=\"405\""),
    ("fleetlink_upgrades_total", "result=\"426\""),
    ("fleetlink_upgrades_total", "result=\"431\""),
    ("fleetlink_upgrades_total", "result=\"head_timeout\""),
    ("fleetlink_upgrades_total", "result=\"abandoned\""),
    ("fleetlink_messages_in_total", "type=\"hello\""),
    ("fleetlink_messages_in_total", "type=\"ack\""),
    ("fleetlink_messages_in_total", "type=\"result\""),
    ("fleetlink_messages_in_total", "type=\"event\""),
    ("fleetlink_messages_in_total", "type=\"unknown\""),
    ("fleetlink_messages_in_total", "type=\"invalid\""),
    ("fleetlink_messages_in_total", "type=\"binary\""),
    ("fleetlink_commands_total", "result=\"enqueued\""),
    ("fleetlink_commands_total", "result=\"written\""),
    ("fleetlink_commands_total", "result=\"acked\""),
    ("fleetlink_commands_total", "result=\"outbox_full\""),
    ("fleetlink_commands_total", "result=\"not_connected\""),
    ("fleetlink_commands_total", "result=\"resent\""),
    ("fleetlink_commands_total", "result=\"resume_dropped\""),
    ("fleetlink_commands_total", "result=\"seq_exhausted\""),
    ("fleetlink_commands_total", "result=\"memory_full\""),
    ("fleetlink_pings_sent_total", ""),
    ("fleetlink_pongs_received_total", ""),
    ("fleetlink_rig_rate_paused_total", ""),
    ("fleetlink_bridge_queue_full_total", "from=\"core\""),
    ("fleetlink_kicks_total", ""),
    ("fleetlink_tls_handshake_failures_total", ""),
    ("fleetlink_identity_mismatch_total", ""),
    ("fleetlink_forbidden_total", ""),
    ("fleetlink_admin_routes_total", "result=\"direct\""),
    ("fleetlink_admin_routes_total", "result=\"rerouted\""),
    ("fleetlink_admin_routes_total", "result=\"answer_dropped\""),
    ("fleetlink_admin_connections_moved_total", ""),
    ("fleetlink_admin_refused_total", "reason=\"request_memory\""),
];

/// Close codes counted one by one; anything else is `other`. 1006 = closed without a close
/// frame (peer vanished, I/O error).
pub const CLOSE_CODES: [u16; 18] = [
    1000, 1001, 1002, 1003, 1005, 1006, 1007, 1008, 1009, 1011, 1012, 4002, 4400, 4403, 4408, 4409,
    4410, 4503,
];

/// Upper bounds (ms) of the ack latency histogram buckets.
pub const ACK_BUCKETS_MS: [u64; 12] = [1, 5, 10, 25, 50, 100, 250, 500, 1000, 2500, 5000, 10000];

/// Distinct `--group-label` values one core counts apart; more share [`OTHER_GROUP`].
pub const MAX_GROUPS: usize = 1000;
/// The series rigs beyond [`MAX_GROUPS`] values are counted in.
pub const OTHER_GROUP: &str = "(other)";

/// One core's counters. Not `Send`: only its core touches it.
pub struct CoreMetrics {
    pub(super) counters: [Cell<u64>; COUNTERS.len()],
    closes: [Cell<u64>; CLOSE_CODES.len() + 1],
    ack_buckets: [Cell<u64>; ACK_BUCKETS_MS.len() + 1],
    ack_sum_us: Cell<u64>,
    /// Open TCP connections (any phase).
    pub connections: Cell<u64>,
    groups: RefCell<HashMap<Box<str>, u64>>,
}

impl Default for CoreMetrics {
    fn default() -> Self {
        Self {
            counters: std::array::from_fn(|_| Cell::new(0)),
            closes: Default::default(),
            ack_buckets: Default::default(),
            ack_sum_us: Cell::new(0),
            connections: Cell::new(0),
            groups: RefCell::default(),
        }
    }
}

impl CoreMetrics {
    /// Adds one to counter `c`.
    pub fn inc(&self, c: C) {
        self.add(c, 1);
    }

    /// Adds `n` to counter `c`.
    pub fn add(&self, c: C, n: u64) {
        let cell = &self.counters[c as usize];
        cell.set(cell.get() + n);
    }

    /// Counts a close by its code.
    pub fn close(&self, code: u16) {
        let i = CLOSE_CODES
            .iter()
            .position(|&c| c == code)
            .unwrap_or(CLOSE_CODES.len());
        let cell = &self.closes[i];
        cell.set(cell.get() + 1);
    }

    /// Records one ack latency. Summed in microseconds: acks on a LAN take well under a
    /// millisecond, and whole milliseconds summed them as 0.
    pub fn ack_latency(&self, latency: Duration) {
        let us = u64::try_from(latency.as_micros()).unwrap_or(u64::MAX);
        let i = ACK_BUCKETS_MS
            .iter()
            .position(|&b| us <= b * 1000)
            .unwrap_or(ACK_BUCKETS_MS.len());
        let cell = &self.ack_buckets[i];
        cell.set(cell.get() + 1);
        self.ack_sum_us
            .set(self.ack_sum_us.get().saturating_add(us));
    }

    /// A welcomed rig joined group `g`. Past [`MAX_GROUPS`] values on this core, a new value
    /// is counted as [`OTHER_GROUP`]: label values come from the rigs, and one series per rig
    /// is what grouping exists to avoid. True when it was: the rig leaves from there.
    pub fn join_group(&self, g: &str) -> bool {
        let mut groups = self.groups.borrow_mut();
        let listed = groups.len() - usize::from(groups.contains_key(OTHER_GROUP));
        let other = !groups.contains_key(g) && listed >= MAX_GROUPS;
        let g = if other { OTHER_GROUP } else { g };
        *groups.entry(g.into()).or_default() += 1;
        other
    }

    /// A welcomed rig left group `g`, or the overflow when it was counted there.
    pub fn leave_group(&self, g: &str, other: bool) {
        let g = if other { OTHER_GROUP } else { g };
        let mut groups = self.groups.borrow_mut();
        if let Some(n) = groups.get_mut(g) {
            *n = n.saturating_sub(1);
            if *n == 0 {
                groups.remove(g);
            }
        }
    }

    /// Copies everything into a `Send` snapshot.
    pub fn snapshot(&self, core: usize, driver: &'static str) -> CoreSnapshot {
        CoreSnapshot {
            core,
            driver,
            counters: self.counters.iter().map(Cell::get).collect(),
            closes: self.closes.iter().map(Cell::get).collect(),
            ack_buckets: self.ack_buckets.iter().map(Cell::get).collect(),
            ack_sum_us: self.ack_sum_us.get(),
            connections: self.connections.get(),
            groups: self
                .groups
                .borrow()
                .iter()
                .map(|(k, v)| (k.to_string(), *v))
                .collect(),
            rigs: Vec::new(),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::metrics::{render, BridgeStats};

    #[test]
    fn ack_latency_sums_real_time_below_a_millisecond() {
        let m = CoreMetrics::default();
        for _ in 0..3 {
            m.ack_latency(Duration::from_micros(300));
        }
        let text = render(&[m.snapshot(0, "epoll")], &BridgeStats::default(), false);
        assert!(text.contains("fleetlink_ack_latency_seconds_bucket{le=\"0.001\"} 3"));
        assert!(text.contains("fleetlink_ack_latency_seconds_count 3"));
        let sum: f64 = text
            .lines()
            .find_map(|l| l.strip_prefix("fleetlink_ack_latency_seconds_sum "))
            .and_then(|v| v.parse().ok())
            .unwrap_or(0.0);
        assert!((sum - 0.0009).abs() < 1e-9, "{sum}");
        // Bucket edges are inclusive, as Prometheus' `le` says.
        let m = CoreMetrics::default();
        m.ack_latency(Duration::from_millis(5));
        m.ack_latency(Duration::from_micros(5001));
        let snap = m.snapshot(0, "epoll");
        assert_eq!(&snap.ack_buckets[..3], &[0, 1, 1]);
    }

    #[test]
    fn group_values_beyond_the_cap_share_one_series_and_leave_it_again() {
        let m = CoreMetrics::default();
        for i in 0..MAX_GROUPS {
            assert!(!m.join_group(&format!("g{i}")));
        }
        let late_1 = m.join_group("late");
        assert!(late_1 && m.join_group("late-2"));
        assert!(!m.join_group("g0"), "a listed value keeps its series");
        let count = |g: &str| m.groups.borrow().get(g).copied();
        assert_eq!(m.groups.borrow().len(), MAX_GROUPS + 1);
        assert_eq!((count(OTHER_GROUP), count("g0")), (Some(2), Some(2)));
        // Room again: the same value gets its own series for the next rig...
        m.leave_group("g1", false);
        m.leave_group("late-2", true);
        assert!(!m.join_group("late"));
        // ...and the first rig still leaves from the overflow, where it was counted.
        m.leave_group("late", late_1);
        assert_eq!((count(OTHER_GROUP), count("late")), (None, Some(1)));
        let total: u64 = m.groups.borrow().values().sum();
        assert_eq!(total, MAX_GROUPS as u64 + 1);
    }
}
