//! What the bridge counts and reports, shared with the admin thread: operation counters,
//! Redis and subscription state, readiness.

use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Mutex, OnceLock};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use crate::event_log::EventLog;
use crate::metrics::BridgeStats;

/// Readiness fails when no canary came back for this long.
pub(super) const CANARY_STALE: Duration = Duration::from_secs(5);

/// Registry operations counted by (op, result), in this order.
pub const REGISTRY_OPS: [(&str, &str); 81] = [
    ("offline", "held"),
    ("offline", "full"),
    ("offline", "connected_elsewhere"),
    ("offline", "delivered"),
    ("offline", "expired"),
    ("offline", "expired_handed"),
    ("offline", "undelivered"),
    ("offline", "forwarded"),
    ("offline", "held_again"),
    ("offline", "returned"),
    ("offline", "found"),
    ("offline", "lost"),
    ("offline_batch", "sent"),
    ("persist", "ok"),
    ("persist", "fenced"),
    ("persist", "unavailable"),
    ("persist", "lease_restored"),
    ("persist", "stale"),
    ("persist", "created"),
    ("rekeep", "ok"),
    ("rekeep", "behind"),
    ("rekeep", "anew"),
    ("rekeep", "fenced"),
    ("rekeep", "unavailable"),
    ("rekeep", "dropped"),
    ("missed", "given"),
    ("missed", "unavailable"),
    ("rekeep_parked", "ok"),
    ("rekeep_parked", "behind"),
    ("rekeep_parked", "merged"),
    ("rekeep_parked", "fenced"),
    ("rekeep_parked", "reported"),
    ("rekeep_parked", "unavailable"),
    ("hello", "ok"),
    ("hello", "older"),
    ("hello", "unavailable"),
    ("hello_batch", "sent"),
    ("resume", "stale_dropped"),
    ("resume", "rebooted"),
    ("resume", "lost"),
    ("canary", "twin"),
    ("canary", "foreign"),
    ("refresh", "ok"),
    ("refresh", "restored"),
    ("refresh", "outlived"),
    ("refresh", "taken"),
    ("refresh", "superseded"),
    ("refresh", "vacant"),
    ("release", "sent"),
    ("release", "dropped"),
    ("forget", "dropped"),
    ("forget", "lost"),
    ("lease", "stale_removed"),
    ("remember", "dropped"),
    ("evict", "sent"),
    ("evict", "received"),
    ("evict", "stale"),
    ("control", "bad_request"),
    ("reply", "orphaned"),
    ("publish", "dropped"),
    ("publish", "unanswered_ran"),
    ("publish", "unanswered_resent"),
    ("subscription", "cut"),
    ("redis", "refused"),
    ("broadcast", "overloaded"),
    ("parked", "dropped"),
    ("parked", "expired"),
    ("session", "unwatched"),
    ("session", "unnamed"),
    ("session", "swept"),
    ("session", "missed"),
    ("session", "merged"),
    ("session", "merged_stale"),
    ("session", "key_lost"),
    ("session", "pointer_restored"),
    ("offline", "draining"),
    ("offline", "duplicate_removed"),
    ("refused", "rig_not_connected"),
    ("refused", "rig_unresponsive"),
    ("refused", "overloaded"),
    ("refused", "other"),
];

/// Bridge figures the admin thread reads (written only by the bridge thread).
#[derive(Debug)]
pub struct BridgeShared {
    /// True in fleet mode.
    pub fleet: bool,
    /// 1 while Redis answers.
    pub redis_up: AtomicU64,
    /// True once the scripts are loaded and both channels are subscribed.
    pub subscribed: AtomicBool,
    /// When our own canary last came back, in `mono_ms` milliseconds (0: never).
    pub canary_at_ms: AtomicU64,
    /// When a canary with our broker id came from another process, in `mono_ms` milliseconds
    /// (0: never).
    pub twin_at_ms: AtomicU64,
    /// Why the last attempt to reach Redis failed, while it is down. Written when that
    /// changes, read by `/readyz`: never on a hot path.
    pub redis_down_why: Mutex<Option<String>>,
    /// Messages the bridge could not hand to a full core inbox.
    pub core_queue_full: AtomicU64,
    /// Commands answered `rig_not_connected` here, for `fleetlink_commands_total`: what
    /// control sees as a command's outcome, whichever thread refused it.
    pub commands_not_connected: AtomicU64,
    /// Set once the broker drains: standalone, a command held for an offline rig now would
    /// only be lost with the process.
    pub draining: AtomicBool,
    /// Counters in [`REGISTRY_OPS`] order.
    pub ops: [AtomicU64; REGISTRY_OPS.len()],
    /// Pub/sub messages received.
    pub pubsub_in: AtomicU64,
    /// Pub/sub messages published.
    pub pubsub_out: AtomicU64,
    /// Bytes of rig events the cores have queued for the bridge and it has not taken yet: the
    /// inbox bounds messages, this bounds what they hold (see [`MAX_EVENT_BYTES`]).
    pub event_bytes: AtomicUsize,
    /// Standalone only: the events fleet mode would publish, for `GET /v1/events`. Written by
    /// the bridge as events come, read by admin requests: never on a command's path.
    pub event_log: Mutex<EventLog>,
}

/// Bytes of rig events that may wait in the bridge's inbox. A rig's `result` or `event` may be
/// `--max-message` long, so the inbox's bound on messages alone would allow gigabytes while
/// the bridge waits on a slow Redis; past this, events are dropped and counted.
pub const MAX_EVENT_BYTES: usize = 64 << 20;

/// What one event counts against [`MAX_EVENT_BYTES`] at least: small events (a rig's `ack`,
/// 200 bytes) would otherwise fill the inbox's 65,536 places first, and the hellos and
/// commands sharing it would be refused. At this charge, events take at most about three
/// quarters of the places.
pub(super) const MIN_EVENT_CHARGE: usize = 1_400;

/// What an event of `len` bytes counts against [`MAX_EVENT_BYTES`].
pub fn event_charge(len: usize) -> usize {
    len.max(MIN_EVENT_CHARGE)
}

impl BridgeShared {
    /// Fresh figures; `fleet` says whether Redis is configured.
    pub fn new(fleet: bool) -> Self {
        Self {
            fleet,
            redis_up: AtomicU64::new(0),
            subscribed: AtomicBool::new(false),
            canary_at_ms: AtomicU64::new(0),
            twin_at_ms: AtomicU64::new(0),
            redis_down_why: Mutex::new(None),
            core_queue_full: AtomicU64::new(0),
            commands_not_connected: AtomicU64::new(0),
            draining: AtomicBool::new(false),
            ops: std::array::from_fn(|_| AtomicU64::new(0)),
            pubsub_in: AtomicU64::new(0),
            pubsub_out: AtomicU64::new(0),
            event_bytes: AtomicUsize::new(0),
            event_log: Mutex::new(EventLog::default()),
        }
    }

    pub(super) fn count(&self, op: &str, result: &str) {
        self.count_n(op, result, 1);
    }

    /// Adds `n` to the counter of `op` with `result`.
    pub(super) fn count_n(&self, op: &str, result: &str, n: u64) {
        // Called with 0 on hot paths (every publish, every pass): no search for nothing.
        if n == 0 {
            return;
        }
        let i = REGISTRY_OPS
            .iter()
            .position(|&(o, r)| o == op && r == result);
        // A pair missing from the list would count nothing, silently.
        debug_assert!(i.is_some(), "{op}/{result} is not in REGISTRY_OPS");
        if let Some(i) = i {
            self.ops[i].fetch_add(n, Ordering::Relaxed);
        }
    }

    /// Why the broker is not ready, if it is not (fleet mode: Redis, scripts, subscription and
    /// a recent canary; CONTRACT.md §4).
    pub fn not_ready(&self) -> Option<String> {
        if !self.fleet {
            return None;
        }
        if self.redis_up.load(Ordering::Relaxed) == 0 {
            let why = self.redis_down_why.lock().ok().and_then(|w| w.clone());
            return Some(match why {
                // Says whether Redis was not reached, refused the credentials, or answered
                // with a refusal (fleet::connection, `back_off`).
                Some(why) => format!("redis {why}"),
                None => "redis unreachable".into(),
            });
        }
        if !self.subscribed.load(Ordering::Relaxed) {
            return Some("subscription not live".into());
        }
        let twin = self.twin_at_ms.load(Ordering::Relaxed);
        if twin != 0 && mono_ms().saturating_sub(twin) <= CANARY_STALE.as_millis() as u64 {
            // Both take every command sent to this id, and the one without the rig answers
            // rig_not_connected for what the other runs: neither should be sent rigs.
            return Some(
                "another broker runs with this --broker-id (its canaries reach this broker's \
                 channel): give each broker its own --broker-id"
                    .into(),
            );
        }
        let last = self.canary_at_ms.load(Ordering::Relaxed);
        if last == 0 {
            // Subscribed, yet none of our own publishes came back: Redis refuses them (an ACL
            // without PUBLISH on our channel), or the first is still on its way.
            return Some("no canary back yet (can this broker PUBLISH on its own channel?)".into());
        }
        let age = mono_ms().saturating_sub(last);
        if age > CANARY_STALE.as_millis() as u64 {
            return Some(format!("no canary for {age} ms"));
        }
        None
    }

    /// Copies the figures for `/metrics`.
    pub fn stats(&self, queue_depth: usize) -> BridgeStats {
        BridgeStats {
            redis_up: self.redis_up.load(Ordering::Relaxed),
            registry_ops: REGISTRY_OPS
                .iter()
                .zip(&self.ops)
                .map(|(&(op, result), n)| {
                    (
                        op.to_string(),
                        result.to_string(),
                        n.load(Ordering::Relaxed),
                    )
                })
                .collect(),
            queue_depth: queue_depth as u64,
            core_queue_full: self.core_queue_full.load(Ordering::Relaxed),
            commands_not_connected: self.commands_not_connected.load(Ordering::Relaxed),
            pubsub: vec![
                ("in".into(), self.pubsub_in.load(Ordering::Relaxed)),
                ("out".into(), self.pubsub_out.load(Ordering::Relaxed)),
            ],
        }
    }
}

/// Milliseconds since the process first asked, on a clock that only moves forward, and never
/// 0: for how old something this process saw is. The wall clock can step (NTP, a VM paused or
/// moved): in CI a step of about 20 s made a canary that had come back a second earlier look
/// 20 s old, and `/readyz` failed until the next one.
pub(super) fn mono_ms() -> u64 {
    static START: OnceLock<Instant> = OnceLock::new();
    let start = *START.get_or_init(Instant::now);
    (start.elapsed().as_millis() as u64).saturating_add(1)
}

pub(super) fn unix_ms() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_millis() as u64)
}
