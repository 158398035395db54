//! A handful of Prometheus counters: enough to see what a bench run did to the baseline.
//! Labels are fixed small sets (results, close codes), never one series per rig.

use std::collections::BTreeMap;
use std::fmt::Write;
use std::sync::atomic::{AtomicI64, AtomicU64, Ordering::Relaxed};
use std::sync::Mutex;

/// Registry operations by result, and the pub/sub traffic of Redis mode.
#[derive(Debug, Default)]
pub struct RedisMetrics {
    pub up: AtomicI64,
    pub hello_ok: AtomicU64,
    pub hello_older: AtomicU64,
    pub hello_unavailable: AtomicU64,
    pub refresh_ok: AtomicU64,
    pub refresh_restored: AtomicU64,
    pub refresh_superseded: AtomicU64,
    pub refresh_error: AtomicU64,
    pub release_ok: AtomicU64,
    pub release_error: AtomicU64,
    pub evict_sent: AtomicU64,
    pub evict_received: AtomicU64,
    pub control_in: AtomicU64,
    pub control_bad_request: AtomicU64,
    pub published: AtomicU64,
    /// Events dropped because the publish queue was full.
    pub publish_dropped: AtomicU64,
    /// Publishes lost because Redis failed the pipeline that carried them.
    pub publish_failed: AtomicU64,
    /// `--session-ttl`: commands Redis kept, fenced (not written), or could not be asked
    /// about (written unkept).
    pub persist_ok: AtomicU64,
    pub persist_fenced: AtomicU64,
    pub persist_unavailable: AtomicU64,
    /// Acked commands deleted from their session, lost with a failed pipeline, or dropped
    /// with the keeper's queue full.
    pub forget_ok: AtomicU64,
    pub forget_failed: AtomicU64,
    pub forget_dropped: AtomicU64,
}

#[derive(Debug, Default)]
pub struct Metrics {
    pub connections: AtomicI64,
    pub accepts_ok: AtomicU64,
    pub accepts_handshake_error: AtomicU64,
    pub accepts_handshake_timeout: AtomicU64,
    pub accepts_tls_error: AtomicU64,
    pub hellos_rejected: AtomicU64,
    pub acks: AtomicU64,
    pub results: AtomicU64,
    pub events: AtomicU64,
    pub unknown_messages: AtomicU64,
    pub commands_ok: AtomicU64,
    pub commands_not_connected: AtomicU64,
    pub commands_unresponsive: AtomicU64,
    pub commands_bad_request: AtomicU64,
    /// Redis mode only (rendered when `redis_mode` is set).
    pub redis: RedisMetrics,
    pub redis_mode: std::sync::atomic::AtomicBool,
    closes: Mutex<BTreeMap<u16, u64>>,
}

impl Metrics {
    pub fn closed(&self, code: u16) {
        *self
            .closes
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .entry(code)
            .or_insert(0) += 1;
    }

    pub fn render(&self) -> String {
        let mut s = String::new();
        let g = |s: &mut String, name: &str, kind: &str, v: i64| {
            let _ = writeln!(s, "# TYPE {name} {kind}\n{name} {v}");
        };
        g(
            &mut s,
            "fleetlink_connections",
            "gauge",
            self.connections.load(Relaxed),
        );
        let _ = writeln!(s, "# TYPE fleetlink_accepts_total counter");
        for (result, c) in [
            ("ok", &self.accepts_ok),
            ("handshake_error", &self.accepts_handshake_error),
            ("handshake_timeout", &self.accepts_handshake_timeout),
            ("tls_error", &self.accepts_tls_error),
            ("hello_rejected", &self.hellos_rejected),
        ] {
            let _ = writeln!(
                s,
                "fleetlink_accepts_total{{result=\"{result}\"}} {}",
                c.load(Relaxed)
            );
        }
        let _ = writeln!(s, "# TYPE fleetlink_commands_total counter");
        for (result, c) in [
            ("ok", &self.commands_ok),
            ("rig_not_connected", &self.commands_not_connected),
            ("rig_unresponsive", &self.commands_unresponsive),
            ("bad_request", &self.commands_bad_request),
        ] {
            let _ = writeln!(
                s,
                "fleetlink_commands_total{{result=\"{result}\"}} {}",
                c.load(Relaxed)
            );
        }
        let _ = writeln!(s, "# TYPE fleetlink_rig_messages_total counter");
        for (t, c) in [
            ("ack", &self.acks),
            ("result", &self.results),
            ("event", &self.events),
            ("unknown", &self.unknown_messages),
        ] {
            let _ = writeln!(
                s,
                "fleetlink_rig_messages_total{{type=\"{t}\"}} {}",
                c.load(Relaxed)
            );
        }
        let _ = writeln!(s, "# TYPE fleetlink_outbox_full_total counter");
        let _ = writeln!(
            s,
            "fleetlink_outbox_full_total {}",
            self.commands_unresponsive.load(Relaxed)
        );
        if self.redis_mode.load(Relaxed) {
            let r = &self.redis;
            g(&mut s, "fleetlink_redis_up", "gauge", r.up.load(Relaxed));
            let _ = writeln!(s, "# TYPE fleetlink_registry_ops_total counter");
            for (op, result, c) in [
                ("hello", "ok", &r.hello_ok),
                ("hello", "older", &r.hello_older),
                ("hello", "unavailable", &r.hello_unavailable),
                ("refresh", "ok", &r.refresh_ok),
                ("refresh", "restored", &r.refresh_restored),
                ("refresh", "superseded", &r.refresh_superseded),
                ("refresh", "error", &r.refresh_error),
                ("release", "ok", &r.release_ok),
                ("release", "error", &r.release_error),
                ("evict", "sent", &r.evict_sent),
                ("evict", "received", &r.evict_received),
                ("control", "received", &r.control_in),
                ("control", "bad_request", &r.control_bad_request),
                ("persist", "ok", &r.persist_ok),
                ("persist", "fenced", &r.persist_fenced),
                ("persist", "unavailable", &r.persist_unavailable),
                ("forget", "ok", &r.forget_ok),
                ("forget", "failed", &r.forget_failed),
                ("forget", "dropped", &r.forget_dropped),
            ] {
                let _ = writeln!(
                    s,
                    "fleetlink_registry_ops_total{{op=\"{op}\",result=\"{result}\"}} {}",
                    c.load(Relaxed)
                );
            }
            let _ = writeln!(s, "# TYPE fleetlink_publishes_total counter");
            for (result, c) in [
                ("ok", &r.published),
                ("dropped", &r.publish_dropped),
                ("failed", &r.publish_failed),
            ] {
                let _ = writeln!(
                    s,
                    "fleetlink_publishes_total{{result=\"{result}\"}} {}",
                    c.load(Relaxed)
                );
            }
        }
        let _ = writeln!(s, "# TYPE fleetlink_closes_total counter");
        for (code, n) in self.closes.lock().unwrap_or_else(|e| e.into_inner()).iter() {
            let _ = writeln!(s, "fleetlink_closes_total{{code=\"{code}\"}} {n}");
        }
        s
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn renders_prometheus_text() {
        let m = Metrics::default();
        m.connections.store(3, Relaxed);
        m.closed(4410);
        m.closed(4410);
        let t = m.render();
        assert!(t.contains("fleetlink_connections 3\n"));
        assert!(t.contains("fleetlink_closes_total{code=\"4410\"} 2\n"));
        assert!(t.contains("fleetlink_commands_total{result=\"ok\"} 0\n"));
    }
}
