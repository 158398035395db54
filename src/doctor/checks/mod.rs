//! The rules: whether a host's settings hold N connections, as one [`Finding`] per setting
//! (fine, a warning, or blocking) with its exact fix. [`check`] runs them all, in report order.
//!
//! Apart from reading the host and from printing because every rule is a pure function of a
//! [`HostSettings`], N, the cores and the transport, so each is tested with synthetic hosts.
//! One file per area, each with its tests: `fds` (file descriptors), `network` (accept queues,
//! conntrack, drain, client-side notes), `memory` (RAM, `tcp_mem`, socket buffers) and
//! `io_uring` (kernel, io_uring, memlock). What several areas share stays here.

mod fds;
mod io_uring;
mod memory;
mod network;

use self::fds::check_fds;
use self::io_uring::check_io_uring;
use self::memory::{check_buffer_min, check_memory, check_tcp_mem};
use self::network::{check_accept, check_clients, check_drain};
use super::model::{LISTEN_BACKLOG, MAX_CONNECTIONS};
use super::report::opt_text;
use super::{Finding, HostSettings, Transport};

/// The broker's own `--max-connections` against N: the kernel may hold N while the broker turns
/// away every upgrade past its cap (503), so a deploy gate must see both.
pub fn check_max_connections(cap: Option<u64>, connections: u64) -> Finding {
    let n = connections.min(MAX_CONNECTIONS);
    let needed = format!("unset, or at least {n}: past it the broker answers upgrades 503");
    match cap {
        None => Finding::ok("--max-connections", "unset (no cap)".into(), needed),
        Some(cap) if cap >= n => Finding::ok("--max-connections", cap.to_string(), needed),
        Some(cap) => Finding::block(
            "--max-connections",
            cap.to_string(),
            needed,
            format!("--max-connections {n} (FLEETLINK_MAX_CONNECTIONS={n}), or leave it unset"),
        ),
    }
}

/// Checks `host` against `connections` rigs over `transport`, served by `cores` worker
/// threads. Returns one finding per setting, in report order; pure, so tests feed it
/// synthetic hosts.
pub fn check(
    host: &HostSettings,
    connections: u64,
    cores: usize,
    transport: Transport,
    port: u16,
) -> Vec<Finding> {
    check_with_backlog(host, connections, cores, transport, port, LISTEN_BACKLOG)
}

/// As [`check`], for listeners that ask for `backlog` (the broker's `--backlog`).
pub fn check_with_backlog(
    host: &HostSettings,
    connections: u64,
    cores: usize,
    transport: Transport,
    port: u16,
    backlog: u64,
) -> Vec<Finding> {
    let n = connections.min(MAX_CONNECTIONS);
    let cores = cores.max(1) as u64;
    let mut out = check_fds(host, n, cores, port);
    out.extend(check_accept(host, cores, backlog.max(1)));
    out.push(check_memory(host, n, transport));
    out.push(check_tcp_mem(host, n));
    out.push(check_buffer_min(
        host,
        n,
        "net.ipv4.tcp_rmem",
        host.tcp_rmem,
    ));
    out.push(check_buffer_min(
        host,
        n,
        "net.ipv4.tcp_wmem",
        host.tcp_wmem,
    ));
    out.push(Finding::ok(
        "net.core.rmem_default/wmem_default",
        format!(
            "{} / {}",
            opt_text(host.rmem_default),
            opt_text(host.wmem_default)
        ),
        "informational: TCP sockets start from tcp_rmem[1]/tcp_wmem[1], not these".into(),
    ));
    out.extend(check_drain(host, n));
    out.extend(check_io_uring(host, cores));
    out.extend(check_clients(host, n));
    out
}

fn at_least(
    setting: &'static str,
    value: Option<u64>,
    need: u64,
    needed: String,
    fix: String,
    blocking: bool,
) -> Finding {
    match value {
        None => Finding::unreadable(setting, needed),
        Some(v) if v >= need => Finding::ok(setting, v.to_string(), needed),
        Some(v) if blocking => Finding::block(setting, v.to_string(), needed, fix),
        Some(v) => Finding::warn(setting, v.to_string(), needed, fix),
    }
}

fn sysctl_fix(name: &str, value: u64) -> String {
    format!("sysctl -w {name}={value} and persist it in /etc/sysctl.d/99-fleetlink.conf")
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::doctor::testing::{blocking, finding, tuned, warnings, MILLION};

    #[test]
    fn tuned_host_holds_a_million() {
        let fs = check(&tuned(), MILLION, 16, Transport::Plain, 8080);
        assert!(blocking(&fs).is_empty(), "{fs:#?}");
        assert!(warnings(&fs).is_empty(), "{fs:#?}");
        // The client-side note: 1M connections exceed one address's ephemeral ports, which is
        // said but is no warning on a broker host.
        let ports = finding(&fs, "net.ipv4.ip_local_port_range");
        assert!(
            ports.ok && ports.needed.contains("19 source address"),
            "{ports:?}"
        );
        assert!(fs.iter().filter(|f| f.ok).all(|f| f.fix.is_empty()));
        assert!(check(&tuned(), 50_000, 16, Transport::Plain, 8080)
            .iter()
            .all(|f| f.ok));
    }

    #[test]
    fn unreadable_host_warns_and_never_blocks() {
        let fs = check(
            &HostSettings::default(),
            MILLION,
            16,
            Transport::Plain,
            8080,
        );
        assert!(blocking(&fs).is_empty(), "{fs:#?}");
        assert!(warnings(&fs).contains(&"fs.nr_open"));
    }
}
