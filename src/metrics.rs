//! Per-core counters, shipped to the admin thread as snapshots, rendered as Prometheus text.
//!
//! A core bumps plain `Cell`s (no atomics, no sharing); the admin thread asks each core for a
//! [`CoreSnapshot`] through its inbox and sums them. Rig-level figures are aggregated by the
//! `--group-label` value, never one series per rig.

use std::cell::{Cell, RefCell};
use std::collections::HashMap;
use std::fmt::Write as _;
use std::sync::{Mutex, OnceLock};
use std::time::Duration;

use serde::Serialize;

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
const COUNTERS: [(&str, &str); 43] = [
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
    counters: [Cell<u64>; COUNTERS.len()],
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
    /// Counters in [`C`] order.
    pub counters: Vec<u64>,
    /// Closes in [`CLOSE_CODES`] order, then other.
    pub closes: Vec<u64>,
    /// Ack latency buckets, then +Inf.
    pub ack_buckets: Vec<u64>,
    /// Sum of ack latencies in µs.
    pub ack_sum_us: u64,
    /// Open connections.
    pub connections: u64,
    /// Welcomed rigs per group label value.
    pub groups: Vec<(String, u64)>,
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

/// Who this broker is: `fleetlink_info`'s labels, and whether the fleet-only families apply.
#[derive(Debug, Clone, Default)]
pub struct Identity {
    /// `--broker-id`.
    pub broker_id: String,
    /// Fleet mode (`--redis`); standalone otherwise.
    pub fleet: bool,
}

/// Set once by `main` before the admin thread starts. A process-wide value rather than an
/// argument of [`render`], whose caller (the admin thread) has no config to give it.
static IDENTITY: OnceLock<Identity> = OnceLock::new();

/// Records who this broker is, for every later [`render`]. The first call wins.
pub fn set_identity(identity: Identity) {
    let _ = IDENTITY.set(identity);
}

/// `# HELP` text of each family, in the order they are rendered.
const HELP: &[(&str, &str)] = &[
    (
        "fleetlink_admin_responses_total",
        "Admin HTTP answers given, by status code (\"other\" for any status not listed).",
    ),
    (
        "fleetlink_admin_unfinished_total",
        "Admin requests closed unanswered because they had not arrived whole within 5 s.",
    ),
    (
        "fleetlink_admin_idle_closed_total",
        "Idle admin keep-alive connections closed to make room for a new one when 1,024 were waiting.",
    ),
    (
        "fleetlink_admin_slow_refused_total",
        "Admin requests still arriving answered 503, the one arriving longest first, to make room for a new connection when 1,024 were waiting and none was idle.",
    ),
    (
        "fleetlink_info",
        "Always 1; labels say the mode (standalone or fleet), broker id and version.",
    ),
    (
        "fleetlink_connections",
        "Open TCP connections per core, in any phase.",
    ),
    (
        "fleetlink_driver",
        "Always 1; the driver label says the core's event loop: io_uring or epoll.",
    ),
    (
        "fleetlink_accepts_total",
        "Accepted TCP connections by result (503s and sheds included).",
    ),
    (
        "fleetlink_upgrades_total",
        "Websocket upgrade requests by result (ok or the HTTP status refused with).",
    ),
    (
        "fleetlink_messages_in_total",
        "Inbound rig messages by type.",
    ),
    (
        "fleetlink_commands_total",
        "Commands by what happened to them.",
    ),
    (
        "fleetlink_pings_sent_total",
        "Websocket PINGs sent to rigs.",
    ),
    (
        "fleetlink_pongs_received_total",
        "Websocket PONGs received from rigs in answer to the last PING.",
    ),
    (
        "fleetlink_rig_rate_paused_total",
        "Times a rig's reads were paused for exceeding --rig-rate.",
    ),
    (
        "fleetlink_bridge_queue_full_total",
        "Messages refused by a full cross-thread queue, by sender.",
    ),
    (
        "fleetlink_kicks_total",
        "Rigs kicked (closed with 1012) by control.",
    ),
    (
        "fleetlink_tls_handshake_failures_total",
        "TLS handshakes that failed.",
    ),
    (
        "fleetlink_identity_mismatch_total",
        "Hellos whose rig_id is not the TLS client identity (4403).",
    ),
    (
        "fleetlink_forbidden_total",
        "Commands or events a rig's token did not allow.",
    ),
    (
        "fleetlink_admin_routes_total",
        "Admin commands by the route they took to the rig's core.",
    ),
    (
        "fleetlink_admin_connections_moved_total",
        "Admin connections moved to the core holding the rigs they command.",
    ),
    (
        "fleetlink_admin_refused_total",
        "Admin requests refused 503 while they arrived: request_memory, a core's connections held all the unfinished request bytes they may.",
    ),
    (
        "fleetlink_closes_total",
        "Rig connections closed, by close code (1006: without a close frame).",
    ),
    (
        "fleetlink_outbox_full_total",
        "Commands answered rig_unresponsive because the rig's outbox was full.",
    ),
    (
        "fleetlink_ack_latency_seconds",
        "Time from writing a command to the rig's ack.",
    ),
    (
        "fleetlink_rigs",
        "Welcomed rigs by the value of their --group-label hello label.",
    ),
    (
        "fleetlink_redis_up",
        "1 while Redis answers; always 0 standalone, which has no Redis (see fleetlink_info's mode).",
    ),
    (
        "fleetlink_registry_ops_total",
        "Registry operations by op and result (standalone: op=refused, offline but for forwarded and connected_elsewhere, parked/dropped, and resume/rebooted: commands a new boot dropped).",
    ),
    (
        "fleetlink_pubsub_messages_total",
        "Redis pub/sub messages by direction (fleet mode only).",
    ),
    (
        "fleetlink_bridge_queue_depth",
        "Messages waiting in the bridge's inbox.",
    ),
    ("fleetlink_draining", "1 from the start of a drain."),
    (
        "fleetlink_tls_cert_expiry_timestamp_seconds",
        "When the served TLS certificate expires (Unix time).",
    ),
    (
        "fleetlink_tls_crl_next_update_timestamp_seconds",
        "The earliest nextUpdate of the CRLs in force (Unix time): past it they are stale.",
    ),
    (
        "fleetlink_tls_reloads_total",
        "TLS reloads by result: ok (put in force) or failed (a bad file; the config in force stays).",
    ),
    (
        "fleetlink_heap_live_bytes",
        "Live heap bytes (heap-stats builds only).",
    ),
    (
        "fleetlink_heap_live_allocations",
        "Live heap allocations (heap-stats builds only).",
    ),
];

/// Appends when the TLS material in force stops being usable, as far as it is known: an
/// expired certificate or a stale CRL shows only as rigs failing their next handshake.
pub fn render_tls(out: &mut String, validity: crate::tls::Validity, reloads: (u64, u64)) {
    let gauges = [
        (
            "fleetlink_tls_cert_expiry_timestamp_seconds",
            validity.cert_not_after,
        ),
        (
            "fleetlink_tls_crl_next_update_timestamp_seconds",
            validity.crl_next_update,
        ),
    ];
    for (name, at) in gauges {
        if let Some(at) = at {
            family(out, name, "gauge");
            let _ = writeln!(out, "{name} {at}");
        }
    }
    let name = "fleetlink_tls_reloads_total";
    family(out, name, "counter");
    let (ok, failed) = reloads;
    let _ = writeln!(
        out,
        "{name}{{result=\"ok\"}} {ok}\n{name}{{result=\"failed\"}} {failed}"
    );
}

/// Writes a family's `# HELP` and `# TYPE` lines.
pub(crate) fn family(out: &mut String, name: &str, kind: &str) {
    let help = HELP.iter().find(|(n, _)| *n == name).map_or("", |(_, h)| h);
    let _ = writeln!(out, "# HELP {name} {help}\n# TYPE {name} {kind}");
}

/// Renders all snapshots as Prometheus text exposition, for the identity `main` set.
pub fn render(cores: &[CoreSnapshot], bridge: &BridgeStats, draining: bool) -> String {
    let unknown = Identity::default();
    render_as(IDENTITY.get().unwrap_or(&unknown), cores, bridge, draining)
}

/// [`render`] for a given identity.
pub fn render_as(
    identity: &Identity,
    cores: &[CoreSnapshot],
    bridge: &BridgeStats,
    draining: bool,
) -> String {
    let mut out = String::with_capacity(8192);
    family(&mut out, "fleetlink_info", "gauge");
    let _ = writeln!(
        out,
        "fleetlink_info{{mode=\"{}\",broker_id=\"{}\",version=\"{}\"}} 1",
        if identity.fleet {
            "fleet"
        } else {
            "standalone"
        },
        escape(&identity.broker_id),
        env!("CARGO_PKG_VERSION")
    );
    let sum = |f: &dyn Fn(&CoreSnapshot) -> u64| cores.iter().map(f).sum::<u64>();
    family(&mut out, "fleetlink_connections", "gauge");
    for c in cores {
        let _ = writeln!(
            out,
            "fleetlink_connections{{core=\"{}\"}} {}",
            c.core, c.connections
        );
    }
    family(&mut out, "fleetlink_driver", "gauge");
    for c in cores {
        let _ = writeln!(
            out,
            "fleetlink_driver{{core=\"{}\",driver=\"{}\"}} 1",
            c.core, c.driver
        );
    }
    let mut last = "";
    for (i, (name, labels)) in COUNTERS.iter().enumerate() {
        if *name != last {
            family(&mut out, name, "counter");
            last = name;
        }
        let mut v = sum(&|c: &CoreSnapshot| c.counters.get(i).copied().unwrap_or(0));
        if i == C::CmdNotConnected as usize {
            // A core refuses a command whose rig left it in flight; the bridge, one whose rig
            // no connection here holds. Either is the same outcome to control.
            v += bridge.commands_not_connected;
        }
        if labels.is_empty() {
            let _ = writeln!(out, "{name} {v}");
        } else {
            let _ = writeln!(out, "{name}{{{labels}}} {v}");
        }
        // The bridge's side of the family: a family's samples must be contiguous.
        if i == C::BridgeQueueFull as usize {
            let _ = writeln!(out, "{name}{{from=\"bridge\"}} {}", bridge.core_queue_full);
        }
    }
    family(&mut out, "fleetlink_closes_total", "counter");
    for i in 0..=CLOSE_CODES.len() {
        let code = CLOSE_CODES
            .get(i)
            .map_or("other".to_string(), |c| c.to_string());
        let v = sum(&|c: &CoreSnapshot| c.closes.get(i).copied().unwrap_or(0));
        let _ = writeln!(out, "fleetlink_closes_total{{code=\"{code}\"}} {v}");
    }
    family(&mut out, "fleetlink_outbox_full_total", "counter");
    let _ = writeln!(
        out,
        "fleetlink_outbox_full_total {}",
        sum(&|c: &CoreSnapshot| c
            .counters
            .get(C::CmdOutboxFull as usize)
            .copied()
            .unwrap_or(0))
    );
    family(&mut out, "fleetlink_ack_latency_seconds", "histogram");
    let mut cumulative = 0;
    for i in 0..=ACK_BUCKETS_MS.len() {
        cumulative += sum(&|c: &CoreSnapshot| c.ack_buckets.get(i).copied().unwrap_or(0));
        let le = ACK_BUCKETS_MS
            .get(i)
            .map_or("+Inf".to_string(), |ms| format!("{}", *ms as f64 / 1000.0));
        let _ = writeln!(
            out,
            "fleetlink_ack_latency_seconds_bucket{{le=\"{le}\"}} {cumulative}"
        );
    }
    let _ = writeln!(
        out,
        "fleetlink_ack_latency_seconds_sum {}",
        sum(&|c: &CoreSnapshot| c.ack_sum_us) as f64 / 1e6
    );
    let _ = writeln!(out, "fleetlink_ack_latency_seconds_count {cumulative}");
    let mut groups: HashMap<&str, u64> = HashMap::new();
    for c in cores {
        for (g, n) in &c.groups {
            *groups.entry(g).or_default() += n;
        }
    }
    family(&mut out, "fleetlink_rigs", "gauge");
    let mut groups: Vec<_> = groups.into_iter().collect();
    groups.sort();
    for (g, n) in groups {
        let _ = writeln!(out, "fleetlink_rigs{{group=\"{}\"}} {n}", escape(g));
    }
    // In both modes, since CONTRACT.md §6 lists it among /metrics; standalone it reads 0, and
    // an alert on it should also ask `fleetlink_info{mode="fleet"}`. Only the bridge's own
    // refusals (op="refused"), a new boot's dropped commands (resume/rebooted, standalone's
    // only report of them besides its log) and commands held for offline rigs (standalone
    // holds them in the broker) are registry ops in both modes.
    family(&mut out, "fleetlink_redis_up", "gauge");
    let _ = writeln!(out, "fleetlink_redis_up {}", bridge.redis_up);
    family(&mut out, "fleetlink_registry_ops_total", "counter");
    for (op, result, n) in &bridge.registry_ops {
        if identity.fleet || in_both_modes(op, result) {
            let _ = writeln!(
                out,
                "fleetlink_registry_ops_total{{op=\"{op}\",result=\"{result}\"}} {n}"
            );
        }
    }
    if identity.fleet {
        family(&mut out, "fleetlink_pubsub_messages_total", "counter");
        for (dir, n) in &bridge.pubsub {
            let _ = writeln!(
                out,
                "fleetlink_pubsub_messages_total{{direction=\"{dir}\"}} {n}"
            );
        }
    }
    family(&mut out, "fleetlink_bridge_queue_depth", "gauge");
    let _ = writeln!(out, "fleetlink_bridge_queue_depth {}", bridge.queue_depth);
    family(&mut out, "fleetlink_draining", "gauge");
    let _ = writeln!(out, "fleetlink_draining {}", u8::from(draining));
    let (bytes, allocs) = crate::heap_stats::live();
    if allocs != 0 {
        family(&mut out, "fleetlink_heap_live_bytes", "gauge");
        let _ = writeln!(out, "fleetlink_heap_live_bytes {bytes}");
        family(&mut out, "fleetlink_heap_live_allocations", "gauge");
        let _ = writeln!(out, "fleetlink_heap_live_allocations {allocs}");
    }
    out
}

/// Registry ops that standalone has too (the rest need Redis, or another broker).
fn in_both_modes(op: &str, result: &str) -> bool {
    match op {
        "refused" => true,
        "parked" => true,
        "resume" => result == "rebooted",
        "offline" => !matches!(result, "forwarded" | "connected_elsewhere"),
        _ => false,
    }
}

fn escape(s: &str) -> String {
    s.replace('\\', "\\\\")
        .replace('"', "\\\"")
        .replace('\n', "\\n")
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::registry::bridge::BridgeShared;

    #[test]
    fn renders_counters_closes_groups() {
        let m = CoreMetrics::default();
        m.inc(C::AcceptOk);
        m.close(4002);
        m.close(4999);
        m.ack_latency(Duration::from_millis(3));
        m.join_group("lab-a");
        m.join_group("lab-a");
        m.leave_group("lab-a", false);
        let text = render(&[m.snapshot(0, "io_uring")], &BridgeStats::default(), false);
        assert!(text.contains("fleetlink_accepts_total{result=\"ok\"} 1"));
        assert!(text.contains("fleetlink_closes_total{code=\"4002\"} 1"));
        assert!(text.contains("fleetlink_closes_total{code=\"other\"} 1"));
        assert!(text.contains("fleetlink_ack_latency_seconds_bucket{le=\"0.005\"} 1"));
        assert!(text.contains("fleetlink_rigs{group=\"lab-a\"} 1"));
        assert!(text.contains("fleetlink_driver{core=\"0\",driver=\"io_uring\"} 1"));
    }

    /// The family a sample named `sample` belongs to, given the family types declared so far.
    fn family_of<'a>(sample: &'a str, types: &HashMap<&str, &str>) -> &'a str {
        for suffix in ["_bucket", "_sum", "_count"] {
            if let Some(base) = sample.strip_suffix(suffix) {
                if matches!(types.get(base), Some(&"histogram" | &"summary")) {
                    return base;
                }
            }
        }
        sample
    }

    /// Splits a sample line into (metric name, label text without braces, value text).
    fn split_sample(line: &str) -> Result<(&str, &str, &str), String> {
        let name_end = line.find(['{', ' ']).ok_or(format!("no value: {line:?}"))?;
        let name = &line[..name_end];
        let valid = |c: char| c.is_ascii_alphanumeric() || c == '_' || c == ':';
        if name.is_empty()
            || name.starts_with(|c: char| c.is_ascii_digit())
            || !name.chars().all(valid)
        {
            return Err(format!("bad metric name {name:?}"));
        }
        let mut rest = &line[name_end..];
        let mut labels = "";
        if let Some(body) = rest.strip_prefix('{') {
            // The closing brace is the first one outside a quoted, escaped label value.
            let (mut quoted, mut escaped, mut end) = (false, false, None);
            for (i, c) in body.char_indices() {
                match c {
                    _ if escaped => escaped = false,
                    '\\' if quoted => escaped = true,
                    '"' => quoted = !quoted,
                    '}' if !quoted => {
                        end = Some(i);
                        break;
                    }
                    _ => {}
                }
            }
            let end = end.ok_or(format!("unclosed labels: {line:?}"))?;
            labels = &body[..end];
            rest = &body[end + 1..];
        }
        let value = rest
            .strip_prefix(' ')
            .ok_or(format!("no value: {line:?}"))?;
        let number = value.split(' ').next().unwrap_or_default();
        if number.parse::<f64>().is_err() && !["+Inf", "-Inf", "NaN"].contains(&number) {
            return Err(format!("bad value in {line:?}"));
        }
        Ok((name, labels, value))
    }

    /// Checks Prometheus text exposition (format 0.0.4) the way a scraper reads it: each
    /// family has one `# TYPE` line, and all of its samples come right after it, together.
    /// Returns the families in order.
    fn check_exposition(text: &str) -> Result<Vec<String>, String> {
        let mut types: HashMap<&str, &str> = HashMap::new();
        let mut order: Vec<String> = Vec::new();
        let mut current: Option<&str> = None;
        let mut series = std::collections::HashSet::new();
        for line in text.lines() {
            if line.is_empty() {
                continue;
            }
            if let Some(comment) = line.strip_prefix('#') {
                let words: Vec<&str> = comment.split_whitespace().collect();
                if let ["TYPE", name, kind] = words.as_slice() {
                    let known = ["counter", "gauge", "histogram", "summary", "untyped"];
                    if !known.contains(kind) {
                        return Err(format!("{name}: unknown type {kind}"));
                    }
                    if types.insert(name, kind).is_some() {
                        return Err(format!("{name}: a second # TYPE line"));
                    }
                    order.push(name.to_string());
                    current = Some(name);
                }
                continue;
            }
            let (name, labels, _) = split_sample(line)?;
            let family = family_of(name, &types);
            if !types.contains_key(family) {
                return Err(format!("{line:?}: sample of {family} before its # TYPE"));
            }
            if current != Some(family) {
                return Err(format!(
                    "{line:?}: sample of {family} after # TYPE {} (samples of a family must be \
                     contiguous)",
                    current.unwrap_or_default()
                ));
            }
            if !series.insert((name, labels)) {
                return Err(format!("{line:?}: the same series twice"));
            }
        }
        Ok(order)
    }

    #[test]
    fn exposition_checker_catches_a_split_family() {
        let good = "# TYPE a_total counter\na_total{x=\"1\"} 1\na_total{x=\"}\\\"\"} 2\n\
                    # TYPE h histogram\nh_bucket{le=\"+Inf\"} 1\nh_sum 0.5\nh_count 1\n";
        assert_eq!(check_exposition(good).unwrap(), ["a_total", "h"]);
        for bad in [
            "# TYPE a counter\na{x=\"1\"} 1\n# TYPE b gauge\nb 1\na{x=\"2\"} 1\n",
            "a 1\n# TYPE a counter\n",
            "# TYPE a counter\na 1\n# TYPE a counter\n",
            "# TYPE a counter\na 1\na 2\n",
            "# TYPE a counter\na{x=\"1\" 1\n",
        ] {
            assert!(check_exposition(bad).is_err(), "{bad}");
        }
    }

    #[test]
    fn every_family_is_contiguous_after_its_type() {
        let cores: Vec<CoreSnapshot> = (0..3)
            .map(|core| {
                let m = CoreMetrics::default();
                for i in 0..COUNTERS.len() {
                    m.counters[i].set((core * 100 + i) as u64 + 1);
                }
                for code in CLOSE_CODES.iter().copied().chain([4999]) {
                    m.close(code);
                }
                for ms in [0, 3, 20, 400, 20_000] {
                    m.ack_latency(Duration::from_millis(ms));
                }
                m.connections.set(core as u64 + 5);
                m.join_group("lab-a");
                m.join_group(&format!("odd \"{core}\"\n\\ {{}}"));
                m.snapshot(core, if core == 0 { "io_uring" } else { "epoll" })
            })
            .collect();
        let bridge = BridgeStats {
            redis_up: 1,
            registry_ops: vec![
                ("hello".into(), "ok".into(), 3),
                ("refresh".into(), "error".into(), 1),
            ],
            queue_depth: 4,
            core_queue_full: 7,
            commands_not_connected: 5,
            pubsub: vec![("in".into(), 9), ("out".into(), 2)],
        };
        let fleet = Identity {
            broker_id: "fe-\"1\"".into(),
            fleet: true,
        };
        for (draining, identity) in [(false, &fleet), (true, &Identity::default())] {
            let text = render_as(identity, &cores, &bridge, draining);
            let families = check_exposition(&text).unwrap_or_else(|e| panic!("{e}\n{text}"));
            assert!(families
                .iter()
                .any(|f| f == "fleetlink_bridge_queue_full_total"));
            let from_cores: u64 = cores
                .iter()
                .map(|c| c.counters[C::BridgeQueueFull as usize])
                .sum();
            let full: Vec<&str> = text
                .lines()
                .filter(|l| l.starts_with("fleetlink_bridge_queue_full_total{"))
                .collect();
            assert_eq!(
                full,
                [
                    format!("fleetlink_bridge_queue_full_total{{from=\"core\"}} {from_cores}"),
                    "fleetlink_bridge_queue_full_total{from=\"bridge\"} 7".to_string(),
                ]
            );
            // A command no connection holds, refused by the bridge, is a command's outcome too.
            let refused: u64 = cores
                .iter()
                .map(|c| c.counters[C::CmdNotConnected as usize])
                .sum::<u64>()
                + 5;
            let line = format!("fleetlink_commands_total{{result=\"not_connected\"}} {refused}");
            assert!(text.lines().any(|l| l == line), "{line}");
        }
        // An idle standalone broker (no bridge figures, a core with no counters yet) too.
        let idle = render(&[CoreSnapshot::default()], &BridgeStats::default(), false);
        check_exposition(&idle).unwrap_or_else(|e| panic!("{e}\n{idle}"));
    }

    /// Every family has a `# HELP` with text, right before its `# TYPE`.
    fn check_help(text: &str) -> Result<usize, String> {
        let lines: Vec<&str> = text.lines().collect();
        let mut families = 0;
        for (i, line) in lines.iter().enumerate() {
            let Some(rest) = line.strip_prefix("# TYPE ") else {
                continue;
            };
            let name = rest.split(' ').next().unwrap_or_default();
            let help = i
                .checked_sub(1)
                .and_then(|j| lines[j].strip_prefix(&format!("# HELP {name} ")));
            if help.is_none_or(|h| h.trim().is_empty()) {
                return Err(format!("{name}: no # HELP right before its # TYPE"));
            }
            families += 1;
        }
        Ok(families)
    }

    #[test]
    fn every_family_has_help_and_type_and_fleet_families_only_in_fleet_mode() {
        let m = CoreMetrics::default();
        let bridge = BridgeShared::new(true).stats(0);
        let snaps = [m.snapshot(0, "epoll")];
        let standalone = Identity {
            broker_id: "fe-s".into(),
            fleet: false,
        };
        let text = render_as(&standalone, &snaps, &bridge, false);
        check_exposition(&text).unwrap_or_else(|e| panic!("{e}\n{text}"));
        let families = check_help(&text).unwrap_or_else(|e| panic!("{e}\n{text}"));
        assert!(families >= 20, "{families}");
        assert!(
            !text.contains("fleetlink_pubsub_messages_total"),
            "pubsub in standalone:\n{text}"
        );
        assert!(text.lines().any(|l| l == "fleetlink_redis_up 0"), "{text}");
        let ops: Vec<&str> = text
            .lines()
            .filter(|l| l.starts_with("fleetlink_registry_ops_total{"))
            .collect();
        assert!(
            !ops.is_empty()
                && ops.iter().all(|l| l.contains("op=\"refused\"")
                    || l.contains("op=\"resume\",result=\"rebooted\"")
                    || l.contains("op=\"parked\",result=\"dropped\"")
                    || (l.contains("op=\"offline\"") && !l.contains("forwarded"))),
            "{ops:?}"
        );
        // The parked sessions' bound is standalone's too (docs/operations.md, the queue table).
        assert!(
            ops.iter()
                .any(|l| l.contains("op=\"parked\",result=\"dropped\"")),
            "{ops:?}"
        );
        let version = env!("CARGO_PKG_VERSION");
        let info = format!(
            "fleetlink_info{{mode=\"standalone\",broker_id=\"fe-s\",version=\"{version}\"}} 1"
        );
        assert!(text.lines().any(|l| l == info), "{text}");

        let fleet = Identity {
            broker_id: "fe-f".into(),
            fleet: true,
        };
        let text = render_as(&fleet, &snaps, &bridge, true);
        check_exposition(&text).unwrap_or_else(|e| panic!("{e}\n{text}"));
        check_help(&text).unwrap_or_else(|e| panic!("{e}\n{text}"));
        assert!(text.lines().any(|l| l == "fleetlink_redis_up 0"));
        assert!(text.contains("fleetlink_pubsub_messages_total{direction=\"in\"} 0"));
        assert!(text.contains("fleetlink_registry_ops_total{op=\"hello\",result=\"ok\"} 0"));
        assert!(text.contains("fleetlink_info{mode=\"fleet\",broker_id=\"fe-f\""));
        // Every family rendered has its own help text in the table.
        for line in text.lines().filter(|l| l.starts_with("# TYPE ")) {
            let name = line.split(' ').nth(2).unwrap_or_default();
            assert!(HELP.iter().any(|(n, _)| *n == name), "{name} not in HELP");
        }
    }

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
