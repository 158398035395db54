//! What a core counts, on its own hot path: plain `Cell`s only that core touches, so the
//! counting stays free of locks and atomics and of everything the admin thread does later.

use std::cell::{Cell, RefCell};
use std::time::Duration;

use super::groups::{count, GroupCount, GroupSlot, GroupTable};
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
    CmdStoreBacklog,
    CmdBroadcastAgain,
    CmdLostToSharedSeq,
    PingsSent,
    PongsReceived,
    RigRatePaused,
    EventsPaused,
    TinyReadsPaused,
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
    AdminAnswerMemoryFull,
}

/// (metric name, label pair) for each counter, in [`C`] order.
pub(super) const COUNTERS: [(&str, &str); 49] = [
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
    ("fleetlink_commands_total", "result=\"store_backlog\""),
    ("fleetlink_commands_total", "result=\"broadcast_again\""),
    ("fleetlink_commands_total", "result=\"lost_shared_seq\""),
    ("fleetlink_pings_sent_total", ""),
    ("fleetlink_pongs_received_total", ""),
    ("fleetlink_rig_rate_paused_total", ""),
    ("fleetlink_rig_events_paused_total", ""),
    ("fleetlink_tiny_reads_paused_total", ""),
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
    ("fleetlink_admin_refused_total", "reason=\"answer_memory\""),
];

/// Close codes counted one by one; anything else is `other`. 1006 = closed without a close
/// frame (peer vanished, I/O error).
pub const CLOSE_CODES: [u16; 18] = [
    1000, 1001, 1002, 1003, 1005, 1006, 1007, 1008, 1009, 1011, 1012, 4002, 4400, 4403, 4408, 4409,
    4410, 4503,
];

/// Upper bounds (ms) of the ack latency histogram buckets.
pub const ACK_BUCKETS_MS: [u64; 12] = [1, 5, 10, 25, 50, 100, 250, 500, 1000, 2500, 5000, 10000];

/// [`CLOSE_CODES`] index of `code`; anything else counts last, as other.
fn close_index(code: u16) -> usize {
    CLOSE_CODES
        .iter()
        .position(|&c| c == code)
        .unwrap_or(CLOSE_CODES.len())
}

/// One core's counters. Not `Send`: only its core touches it.
pub struct CoreMetrics {
    pub(super) counters: [Cell<u64>; COUNTERS.len()],
    closes: [Cell<u64>; CLOSE_CODES.len() + 1],
    ack_buckets: [Cell<u64>; ACK_BUCKETS_MS.len() + 1],
    ack_sum_us: Cell<u64>,
    /// Open TCP connections (any phase).
    pub connections: Cell<u64>,
    groups: RefCell<GroupTable>,
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
        let cell = &self.closes[close_index(code)];
        cell.set(cell.get() + 1);
    }

    /// Counts a welcomed rig's close in its group too.
    pub fn group_close(&self, slot: GroupSlot, code: u16) {
        if let Some(f) = self.groups.borrow_mut().figures(slot) {
            f.closes[close_index(code)] += 1;
        }
    }

    /// Counts a command outcome in the rig's group (broker-wide counts are [`C`]'s).
    pub fn group_count(&self, slot: GroupSlot, c: GroupCount) {
        if let Some(f) = self.groups.borrow_mut().figures(slot) {
            count(f, c);
        }
    }

    /// Records one ack latency. Summed in microseconds: acks on a LAN take well under a
    /// millisecond, and whole milliseconds summed them as 0.
    /// Counted broker-wide and in the rig's group `slot`.
    pub fn ack_latency(&self, latency: Duration, slot: GroupSlot) {
        let us = u64::try_from(latency.as_micros()).unwrap_or(u64::MAX);
        let i = ACK_BUCKETS_MS
            .iter()
            .position(|&b| us <= b * 1000)
            .unwrap_or(ACK_BUCKETS_MS.len());
        let cell = &self.ack_buckets[i];
        cell.set(cell.get() + 1);
        self.ack_sum_us
            .set(self.ack_sum_us.get().saturating_add(us));
        if let Some(f) = self.groups.borrow_mut().figures(slot) {
            f.ack_buckets[i] += 1;
            f.ack_sum_us = f.ack_sum_us.saturating_add(us);
        }
    }

    /// A welcomed rig joined group `g`: its slot, which the rig's counts and its leaving name.
    /// Past [`MAX_GROUPS`](super::MAX_GROUPS) values on this core a new value is counted as
    /// [`OTHER_GROUP`](super::OTHER_GROUP): label values come from the rigs, and one series
    /// per rig is what grouping exists to avoid.
    pub fn join_group(&self, g: &str) -> GroupSlot {
        self.groups.borrow_mut().join(g)
    }

    /// A welcomed rig counted in `slot` left.
    pub fn leave_group(&self, slot: GroupSlot) {
        self.groups.borrow_mut().leave(slot);
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
            groups: self.groups.borrow().snapshot(),
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
            m.ack_latency(Duration::from_micros(300), GroupSlot::NONE);
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
        m.ack_latency(Duration::from_millis(5), GroupSlot::NONE);
        m.ack_latency(Duration::from_micros(5001), GroupSlot::NONE);
        let snap = m.snapshot(0, "epoll");
        assert_eq!(&snap.ack_buckets[..3], &[0, 1, 1]);
    }
}
