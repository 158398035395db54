//! The only metrics types that cross threads: plain `Send` data, so what a core or the bridge
//! hands the admin thread carries none of the `Cell`s a core counts in.

use std::collections::HashMap;
use std::sync::Mutex;

use serde::Serialize;

use super::groups::GroupFigures;

/// A rig as `/v1/rigs` lists it.
#[derive(Debug, Clone, Serialize)]
pub struct RigInfo {
    /// Rig id.
    pub rig_id: String,
    /// Boot id of the session.
    pub boot_id: String,
    /// Hello labels.
    pub labels: HashMap<String, String>,
    /// RFC 3339 time of the welcome.
    pub connected_at: String,
    /// Last acked seq (0 = none).
    pub last_ack_seq: u64,
    /// RFC 3339 time of the last ack.
    pub last_ack_at: Option<String>,
    /// Commands queued, not yet written.
    pub outbox_depth: usize,
    /// Next seq to assign.
    pub next_seq: u64,
    /// Core holding the connection.
    pub core: usize,
}

/// The last figures of each core that has stopped (at the end of a drain), by core: `/metrics`
/// goes on reporting them, or every counter a stopped core held would fall back and read as a
/// counter reset in the middle of every deploy. Written once per core, read per scrape.
#[derive(Debug, Default)]
pub struct Retired(Mutex<Vec<Option<CoreSnapshot>>>);

impl Retired {
    /// Keeps `snap` as its core's last figures.
    pub fn keep(&self, snap: CoreSnapshot) {
        if let Ok(mut slots) = self.0.lock() {
            if slots.len() <= snap.core {
                slots.resize(snap.core + 1, None);
            }
            let core = snap.core;
            slots[core] = Some(snap);
        }
    }

    /// Core `core`'s last figures, if it has stopped.
    pub fn get(&self, core: usize) -> Option<CoreSnapshot> {
        self.0.lock().ok()?.get(core).cloned().flatten()
    }
}

/// What a core ships to the admin thread.
#[derive(Debug, Clone, Default)]
pub struct CoreSnapshot {
    /// Core index.
    pub core: usize,
    /// `io_uring` or `epoll`.
    pub driver: &'static str,
    /// Counters in [`C`](super::C) order.
    pub counters: Vec<u64>,
    /// Closes in [`CLOSE_CODES`](super::CLOSE_CODES) order, then other.
    pub closes: Vec<u64>,
    /// Ack latency buckets, then +Inf.
    pub ack_buckets: Vec<u64>,
    /// Sum of ack latencies in µs.
    pub ack_sum_us: u64,
    /// Open connections.
    pub connections: u64,
    /// Figures per group label value.
    pub groups: Vec<(String, GroupFigures)>,
    /// Rig list, when asked for.
    pub rigs: Vec<RigInfo>,
}

/// Bridge-side figures.
#[derive(Debug, Clone, Default)]
pub struct BridgeStats {
    /// 1 when Redis is reachable (always 0 standalone).
    pub redis_up: u64,
    /// Registry operations by (op, result).
    pub registry_ops: Vec<(String, String, u64)>,
    /// Messages waiting in the bridge inbox.
    pub queue_depth: u64,
    /// Messages the bridge could not hand to a core (its inbox was full).
    pub core_queue_full: u64,
    /// Commands the bridge answered `rig_not_connected` (no connection holds the rig).
    pub commands_not_connected: u64,
    /// Pub/sub messages (direction, count).
    pub pubsub: Vec<(String, u64)>,
}
