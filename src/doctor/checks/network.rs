//! Connections arriving and leaving: the accept queues (`somaxconn`, the SYN backlog),
//! conntrack, the sockets a drain closes at once, and the client-side settings reported for
//! load generators on the same host.
//!
//! Apart because these rules are about connections over time (storms, drains, tracking) rather
//! than how many fit: most only warn, and their fixes are sysctls and firewall rules, not
//! limits.

use super::{at_least, sysctl_fix};
use crate::doctor::report::opt_text;
use crate::doctor::{Finding, HostSettings};

/// Each per-core listener asks `backlog`; the kernel silently uses min(backlog, somaxconn). On
/// overflow a client waits for its 1 s SYN retransmit (p99 handshake 1.23 s measured in a 10k
/// storm here), so a short queue slows storms; it does not block.
pub(super) fn check_accept(host: &HostSettings, cores: u64, backlog: u64) -> Vec<Finding> {
    let somaxconn = at_least(
        "net.core.somaxconn",
        host.somaxconn,
        backlog,
        format!("≥ {backlog}, the listen backlog per core (--backlog; {} queued handshakes on {cores} cores); the kernel silently cuts a longer backlog to it, and reconnect storms overflow a shorter queue, clients waiting 1 s for SYN retransmit", backlog.saturating_mul(cores)),
        sysctl_fix("net.core.somaxconn", backlog.max(16384)),
        false,
    );
    vec![somaxconn, check_syn_backlog(host, backlog)]
}

/// At the end of the drain window the broker closes every socket at once.
pub(super) fn check_drain(host: &HostSettings, n: u64) -> Vec<Finding> {
    let orphans = at_least(
        "net.ipv4.tcp_max_orphans",
        host.tcp_max_orphans,
        n,
        format!("≥ {n}: at the end of a drain all N sockets are closed at once and sit orphaned (FIN_WAIT1) until the rig ACKs; beyond the limit the kernel resets them and rigs see RST, not the 1001 close"),
        // A power of two, as tuning/sysctl.d sizes it (1,048,576 for a million).
        sysctl_fix(
            "net.ipv4.tcp_max_orphans",
            n.checked_next_power_of_two().unwrap_or(n).max(65536),
        ),
        false,
    );
    let tw = Finding::ok(
        "net.ipv4.tcp_max_tw_buckets",
        opt_text(host.tcp_max_tw_buckets),
        format!("informational: up to {n} TIME_WAIT sockets after a drain (256 B each); past the limit the kernel skips TIME_WAIT and logs an overflow, harmless for a listening server"),
    );
    let fin = Finding::ok(
        "net.ipv4.tcp_fin_timeout",
        opt_text(host.tcp_fin_timeout).replace("unreadable", "unreadable (default 60)"),
        "informational: how long a closed socket waits for a dead rig's FIN; 15–30 s frees orphans of a drain sooner".into(),
    );
    vec![orphans, tw, fin]
}

/// Client side: matters to load generators and rig agents on this host, never the broker.
pub(super) fn check_clients(host: &HostSettings, n: u64) -> Vec<Finding> {
    vec![
        check_port_range(host, n),
        Finding::ok(
            "net.ipv4.tcp_tw_reuse",
            opt_text(host.tcp_tw_reuse),
            "informational, clients only: 1 lets a load generator reuse TIME_WAIT ports on reconnect (2 = loopback only)".into(),
        ),
        Finding::ok(
            "net.core.netdev_max_backlog",
            opt_text(host.netdev_max_backlog),
            "informational: per-CPU packet queue before TCP; raise it if column 2 of /proc/net/softnet_stat (drops) grows during a storm".into(),
        ),
    ]
}

/// A loaded conntrack tracks every connection once any rule uses it (`-m state`, `ct state`,
/// NAT); past `nf_conntrack_max` new connections are dropped ("nf_conntrack: table full").
pub(super) fn check_conntrack(host: &HostSettings, fds: u64, port: u16) -> Finding {
    const SETTING: &str = "net.netfilter.nf_conntrack_max";
    let Some(max) = host.nf_conntrack_max else {
        return Finding::ok(
            SETTING,
            "not loaded".into(),
            "conntrack not loaded: nothing to size".into(),
        );
    };
    let count = host.nf_conntrack_count.unwrap_or(0);
    // What is tracked now takes room too, as open files do for file-max: the rigs get what is
    // left (beside a live broker, its own rigs are counted twice, erring toward room).
    let want = fds.saturating_add(count);
    let needed =
        format!("≥ {want} ({fds} if conntrack tracks rig connections + {count} tracked now)");
    // Twice that, to a power of two, as tuning/sysctl.d sizes it (2^21 for a million):
    // conntrack also tracks Redis, admin and outbound connections, and entries of closed ones
    // linger in TIME_WAIT.
    let max_fix = want
        .saturating_mul(2)
        .checked_next_power_of_two()
        .unwrap_or(want);
    let exempt = match port {
        // The kernel picks the port at bind: a rule for port 0 would match nothing.
        0 => "or give --listen a fixed port and exempt it from tracking (`iptables -t raw -A PREROUTING -p tcp --dport PORT -j NOTRACK` and `iptables -t raw -A OUTPUT -p tcp --sport PORT -j NOTRACK`)".to_string(),
        _ => format!("or exempt the rig port (--listen, {port} here) from tracking: `iptables -t raw -A PREROUTING -p tcp --dport {port} -j NOTRACK` and `iptables -t raw -A OUTPUT -p tcp --sport {port} -j NOTRACK`"),
    };
    let fix = format!("{}, {exempt}", sysctl_fix(SETTING, max_fix));
    match (max >= want, count > 0) {
        (true, _) => Finding::ok(SETTING, max.to_string(), needed),
        (false, true) => Finding::block(SETTING, max.to_string(), needed, fix),
        (false, false) => Finding::warn(
            SETTING,
            format!("{max} (loaded, tracking nothing now)"),
            needed,
            fix,
        ),
    }
}

/// With syncookies on (the default), SYN queue overflow answers with cookies and
/// `tcp_max_syn_backlog` is not consulted; with them off, the kernel drops SYNs once a listener's
/// SYN queue passes 3/4 of `tcp_max_syn_backlog`.
fn check_syn_backlog(host: &HostSettings, backlog: u64) -> Finding {
    const SETTING: &str = "net.ipv4.tcp_max_syn_backlog";
    let need = backlog.saturating_mul(4) / 3;
    let cookies = host.tcp_syncookies;
    let needed = format!(
        "≥ {need} (4/3 of the {backlog} backlog) when tcp_syncookies=0; tcp_syncookies = {}",
        opt_text(cookies)
    );
    let fix = format!(
        "{} (or keep net.ipv4.tcp_syncookies=1)",
        sysctl_fix(SETTING, need.max(16384))
    );
    match (host.tcp_max_syn_backlog, cookies) {
        (Some(v), Some(0)) if v < need => Finding::warn(SETTING, v.to_string(), needed, fix),
        (v, _) => Finding::ok(SETTING, opt_text(v), needed),
    }
}

/// One client address reaches one broker address:port through at most the ephemeral range; a
/// load generator holding N connections needs ceil(N / range) source addresses. Said, never
/// warned: the broker host this checks needs no ephemeral ports for its rigs.
fn check_port_range(host: &HostSettings, n: u64) -> Finding {
    const SETTING: &str = "net.ipv4.ip_local_port_range";
    let Some((lo, hi)) = host.ip_local_port_range else {
        return Finding::ok(
            SETTING,
            "unreadable".into(),
            "informational, clients only".into(),
        );
    };
    let ports = u64::from(hi.saturating_sub(lo)) + 1;
    let current = format!("{lo} {hi} ({ports} ports)");
    let sources = n.div_ceil(ports);
    let mut needed = format!("informational, clients only (load generators, agents; the broker needs no ephemeral ports): {sources} source address(es) for {n} connections to one broker address");
    if n > ports {
        needed.push_str(&format!("; on such a host spread them over ≥ {sources} source addresses (e.g. 127.0.0.2..) and widen the range with tuning/sysctl.d/99-fleetlink-loadgen.conf (10000 65535)"));
    }
    Finding::ok(SETTING, current, needed)
}

#[cfg(test)]
mod tests {
    use crate::doctor::testing::{blocking, finding, tuned, warnings, MILLION};
    use crate::doctor::{check, check_with_backlog, HostSettings, Transport};

    #[test]
    fn somaxconn_is_checked_against_the_brokers_backlog() {
        // tuned(): somaxconn 16384, enough for the default 4096 but not for --backlog 32768.
        let fs = check_with_backlog(&tuned(), 1_000, 2, Transport::Plain, 8080, 32_768);
        let f = finding(&fs, "net.core.somaxconn");
        assert!(!f.ok && !f.blocking, "{f:?}");
        assert!(f.fix.contains("somaxconn=32768"), "{}", f.fix);
        assert!(
            finding(
                &check(&tuned(), 1_000, 2, Transport::Plain, 8080),
                "net.core.somaxconn"
            )
            .ok
        );
    }

    #[test]
    fn somaxconn_and_syn_backlog_warn_only() {
        let host = HostSettings {
            somaxconn: Some(128),
            tcp_max_syn_backlog: Some(128),
            ..tuned()
        };
        let fs = check(&host, MILLION, 16, Transport::Plain, 8080);
        assert!(blocking(&fs).is_empty());
        assert_eq!(warnings(&fs), ["net.core.somaxconn"]);
        // The SYN backlog matters only without syncookies.
        let host = HostSettings {
            tcp_syncookies: Some(0),
            ..host
        };
        assert_eq!(
            warnings(&check(&host, MILLION, 16, Transport::Plain, 8080)),
            ["net.core.somaxconn", "net.ipv4.tcp_max_syn_backlog"]
        );
    }

    #[test]
    fn conntrack_blocks_only_while_tracking() {
        let host = HostSettings {
            nf_conntrack_max: Some(262_144),
            nf_conntrack_count: Some(0),
            ..tuned()
        };
        assert_eq!(
            warnings(&check(&host, MILLION, 16, Transport::Plain, 8080)),
            ["net.netfilter.nf_conntrack_max"]
        );
        let tracking = HostSettings {
            nf_conntrack_count: Some(12),
            ..host
        };
        assert_eq!(
            blocking(&check(&tracking, MILLION, 16, Transport::Plain, 8080)),
            ["net.netfilter.nf_conntrack_max"]
        );
    }

    /// Entries tracked now leave that much less room: 12,500 with 5,000 tracked cannot take
    /// 10,000 rigs' connections.
    #[test]
    fn conntrack_counts_what_it_tracks_now() {
        let host = |max, count| HostSettings {
            nf_conntrack_max: Some(max),
            nf_conntrack_count: Some(count),
            ..tuned()
        };
        let for_10k = |max| check(&host(max, 5_000), 10_000, 16, Transport::Plain, 8080);
        let fs = for_10k(1 << 21);
        let verdict = finding(&fs, "net.netfilter.nf_conntrack_max");
        assert!(verdict.needed.contains("tracked now"), "{}", verdict.needed);
        assert!(!blocking(&fs).contains(&"net.netfilter.nf_conntrack_max"));
        let fds = verdict
            .needed
            .split_once('(')
            .and_then(|(_, rest)| rest.split_once(' '))
            .and_then(|(n, _)| n.parse::<u64>().ok())
            .expect("the rigs' share");
        assert_eq!(
            blocking(&for_10k(fds + 4_999)),
            ["net.netfilter.nf_conntrack_max"]
        );
        assert!(!blocking(&for_10k(fds + 5_000)).contains(&"net.netfilter.nf_conntrack_max"));
    }

    #[test]
    fn conntrack_fix_names_the_broker_port() {
        let host = HostSettings {
            nf_conntrack_max: Some(262_144),
            nf_conntrack_count: Some(12),
            ..tuned()
        };
        for (transport, port) in [
            (Transport::Plain, 8080),
            (Transport::Tls, 8443),
            (Transport::Plain, 9000),
        ] {
            let fs = check(&host, MILLION, 16, transport, port);
            let fix = &finding(&fs, "net.netfilter.nf_conntrack_max").fix;
            assert!(fix.contains(&format!("--listen, {port} here")), "{fix}");
            assert!(fix.contains(&format!("--dport {port} -j NOTRACK")), "{fix}");
            assert!(fix.contains(&format!("--sport {port} -j NOTRACK")), "{fix}");
            let other = if port == 8443 { "8080" } else { "8443" };
            assert!(!fix.contains(other), "{fix}");
        }
        // Port 0 is the kernel's choice at bind: no rule can name it in advance.
        let fs = check(&host, MILLION, 16, Transport::Plain, 0);
        let fix = &finding(&fs, "net.netfilter.nf_conntrack_max").fix;
        assert!(fix.contains("give --listen a fixed port"), "{fix}");
        assert!(!fix.contains("--dport 0"), "{fix}");
        assert_eq!(Transport::Plain.default_port(), 8080);
        assert_eq!(Transport::Tls.default_port(), 8443);
    }

    #[test]
    fn port_range_is_said_for_clients_only() {
        let host = HostSettings {
            ip_local_port_range: Some((32768, 60999)),
            ..tuned()
        };
        let fs = check(&host, MILLION, 16, Transport::Plain, 8080);
        assert!(blocking(&fs).is_empty());
        assert!(finding(&fs, "net.ipv4.ip_local_port_range")
            .needed
            .contains("36 source address"));
        assert!(check(&host, 20_000, 16, Transport::Plain, 8080)
            .iter()
            .all(|f| f.ok));
    }
}
