//! Only the admin thread renders, once a scrape: the exposition format's rules (one `# TYPE`
//! per family, its samples together, escaped label values) live here and nowhere else.

use std::fmt::Write as _;
use std::sync::OnceLock;

use super::counting::{ACK_BUCKETS_MS, C, CLOSE_CODES, COUNTERS};
use super::help::HELP;
use super::snapshot::{BridgeStats, CoreSnapshot};

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

/// This broker's id, once `main` has said it.
pub fn broker_id() -> Option<&'static str> {
    IDENTITY.get().map(|i| i.broker_id.as_str())
}

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
    let buckets: Vec<u64> = (0..=ACK_BUCKETS_MS.len())
        .map(|i| sum(&|c: &CoreSnapshot| c.ack_buckets.get(i).copied().unwrap_or(0)))
        .collect();
    let sum_us = sum(&|c: &CoreSnapshot| c.ack_sum_us);
    ack_histogram(
        &mut out,
        "fleetlink_ack_latency_seconds",
        "",
        &buckets,
        sum_us,
    );
    super::groups::render_groups(&mut out, cores.iter().map(|c| &c.groups[..]));
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

/// One ack latency histogram's samples: `buckets` (per [`ACK_BUCKETS_MS`], then +Inf) made
/// cumulative, the sum in seconds and the count. `labels` are the series' own, ahead of `le`
/// (empty for none).
pub(super) fn ack_histogram(
    out: &mut String,
    name: &str,
    labels: &str,
    buckets: &[u64],
    sum_us: u64,
) {
    let (open, close, sep) = match labels.is_empty() {
        true => ("", "", ""),
        false => ("{", "}", ","),
    };
    let mut cumulative = 0;
    for (i, n) in buckets.iter().enumerate() {
        cumulative += n;
        let le = ACK_BUCKETS_MS
            .get(i)
            .map_or("+Inf".to_string(), |ms| format!("{}", *ms as f64 / 1000.0));
        let _ = writeln!(
            out,
            "{name}_bucket{{{labels}{sep}le=\"{le}\"}} {cumulative}"
        );
    }
    let sum = sum_us as f64 / 1e6;
    let _ = writeln!(out, "{name}_sum{open}{labels}{close} {sum}");
    let _ = writeln!(out, "{name}_count{open}{labels}{close} {cumulative}");
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

pub(super) fn escape(s: &str) -> String {
    s.replace('\\', "\\\\")
        .replace('"', "\\\"")
        .replace('\n', "\\n")
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::metrics::{CoreMetrics, GroupCount};
    use crate::registry::bridge::BridgeShared;
    use std::collections::HashMap;
    use std::time::Duration;

    #[test]
    fn renders_counters_closes_groups() {
        let m = CoreMetrics::default();
        m.inc(C::AcceptOk);
        m.close(4002);
        m.close(4999);
        m.ack_latency(Duration::from_millis(3), crate::metrics::GroupSlot::NONE);
        let slot = m.join_group("lab-a");
        m.join_group("lab-a");
        m.leave_group(slot);
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
                let lab = m.join_group("lab-a");
                let odd = m.join_group(&format!("odd \"{core}\"\n\\ {{}}"));
                for code in CLOSE_CODES.iter().copied().chain([4999]) {
                    m.close(code);
                    m.group_close(odd, code);
                }
                for ms in [0, 3, 20, 400, 20_000] {
                    m.ack_latency(Duration::from_millis(ms), lab);
                    m.group_count(odd, GroupCount::Written);
                }
                m.connections.set(core as u64 + 5);
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
                    || l.contains("op=\"parked\"")
                    || (l.contains("op=\"offline\"") && !l.contains("forwarded"))),
            "{ops:?}"
        );
        // The parked sessions' bound is standalone's too (docs/operations.md, the queue table),
        // and so is their expiry (standalone reports it).
        for result in ["dropped", "expired"] {
            let series = format!("op=\"parked\",result=\"{result}\"");
            assert!(ops.iter().any(|l| l.contains(&series)), "{ops:?}");
        }
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
}
