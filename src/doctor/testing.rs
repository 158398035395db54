//! Test fixtures that `doctor`'s tests share: `tuned()`, a synthetic host set up as tuning/
//! ships it, and helpers that pick findings out of a report; and the test that keeps `tuned()`
//! equal to the shipped sysctl files.
//!
//! Apart because the tests of the rules and of the report all start from the same host, and
//! that host must match tuning/sysctl.d in one place.

use super::{Finding, HostSettings};

pub(super) const MILLION: u64 = 1_000_000;

/// A host tuned with tuning/sysctl.d/99-fleetlink.conf and the unit's limits, 64 GiB.
pub(super) fn tuned() -> HostSettings {
    HostSettings {
        kernel_release: Some("6.8.0-45-generic".into()),
        page_size: Some(4096),
        mem_total_bytes: Some(64 << 30),
        nr_open: Some(2_097_152),
        file_max: Some(4_194_304),
        files_allocated: Some(2_000),
        nofile_soft: Some(1_100_000),
        nofile_hard: Some(1_100_000),
        memlock_soft: None,
        memlock_hard: None,
        somaxconn: Some(16384),
        tcp_max_syn_backlog: Some(16384),
        tcp_syncookies: Some(1),
        netdev_max_backlog: Some(16384),
        tcp_mem: Some([1_048_576, 2_097_152, 3_145_728]),
        tcp_rmem: Some([4096, 16384, 4_194_304]),
        tcp_wmem: Some([4096, 16384, 4_194_304]),
        rmem_default: Some(212_992),
        wmem_default: Some(212_992),
        ip_local_port_range: Some((10000, 65535)),
        tcp_fin_timeout: Some(30),
        tcp_tw_reuse: Some(1),
        tcp_max_orphans: Some(1_048_576),
        tcp_max_tw_buckets: Some(1_048_576),
        io_uring_disabled: Some(0),
        io_uring_group: Some(-1),
        nf_conntrack_max: None,
        nf_conntrack_count: None,
    }
}

pub(super) fn finding<'a>(fs: &'a [Finding], setting: &str) -> &'a Finding {
    fs.iter()
        .find(|f| f.setting == setting)
        .unwrap_or_else(|| panic!("no finding for {setting}"))
}

pub(super) fn blocking(fs: &[Finding]) -> Vec<&'static str> {
    fs.iter()
        .filter(|f| f.blocking)
        .map(|f| f.setting)
        .collect()
}

/// Settings that warn.
pub(super) fn warnings(fs: &[Finding]) -> Vec<&'static str> {
    fs.iter()
        .filter(|f| !f.ok && !f.blocking)
        .map(|f| f.setting)
        .collect()
}

/// The settings `tuning/sysctl.d` ships, key by key, as `tuned()` holds them.
fn tuned_as_sysctl(h: &HostSettings) -> Vec<(&'static str, String)> {
    let nums = |v: &Option<[u64; 3]>| v.map(|[a, b, c]| format!("{a} {b} {c}"));
    let opt = |v: Option<u64>| v.map(|v| v.to_string());
    let range = h.ip_local_port_range.map(|(lo, hi)| format!("{lo} {hi}"));
    [
        ("fs.nr_open", opt(h.nr_open)),
        ("fs.file-max", opt(h.file_max)),
        ("net.core.somaxconn", opt(h.somaxconn)),
        ("net.ipv4.tcp_max_syn_backlog", opt(h.tcp_max_syn_backlog)),
        ("net.ipv4.tcp_syncookies", opt(h.tcp_syncookies)),
        ("net.core.netdev_max_backlog", opt(h.netdev_max_backlog)),
        ("net.ipv4.tcp_mem", nums(&h.tcp_mem)),
        ("net.ipv4.tcp_rmem", nums(&h.tcp_rmem)),
        ("net.ipv4.tcp_wmem", nums(&h.tcp_wmem)),
        ("net.core.rmem_default", opt(h.rmem_default)),
        ("net.core.wmem_default", opt(h.wmem_default)),
        ("net.ipv4.tcp_max_orphans", opt(h.tcp_max_orphans)),
        ("net.ipv4.tcp_fin_timeout", opt(h.tcp_fin_timeout)),
        ("net.ipv4.tcp_max_tw_buckets", opt(h.tcp_max_tw_buckets)),
        ("kernel.io_uring_disabled", opt(h.io_uring_disabled)),
        ("net.ipv4.ip_local_port_range", range),
        ("net.ipv4.tcp_tw_reuse", opt(h.tcp_tw_reuse)),
    ]
    .into_iter()
    .map(|(k, v)| (k, v.unwrap_or_default()))
    .collect()
}

/// `key = value` lines of a sysctl.d file ("-" marks a key the kernel may lack).
fn sysctl_lines(text: &str) -> Vec<(String, String)> {
    text.lines()
        .map(str::trim)
        .filter(|l| !l.is_empty() && !l.starts_with('#'))
        .filter_map(|l| l.split_once('='))
        .map(|(k, v)| {
            (
                k.trim().trim_start_matches('-').to_string(),
                v.trim().to_string(),
            )
        })
        .collect()
}

#[test]
fn the_tuned_host_is_what_the_shipped_sysctl_files_set() {
    let broker = sysctl_lines(include_str!("../../tuning/sysctl.d/99-fleetlink.conf"));
    let loadgen = sysctl_lines(include_str!(
        "../../tuning/sysctl.d/99-fleetlink-loadgen.conf"
    ));
    let client_only = ["net.ipv4.ip_local_port_range", "net.ipv4.tcp_tw_reuse"];
    for (key, _) in &broker {
        assert!(
            !client_only.contains(&key.as_str()),
            "{key} is for hosts that open connections: it goes in the loadgen file"
        );
    }
    let loadgen_keys: Vec<&str> = loadgen.iter().map(|(k, _)| k.as_str()).collect();
    assert_eq!(loadgen_keys, client_only);
    let shipped: std::collections::HashMap<String, String> =
        broker.into_iter().chain(loadgen).collect();
    let checked = tuned_as_sysctl(&tuned());
    for (key, value) in &checked {
        assert_eq!(shipped.get(*key), Some(value), "{key}");
    }
    // conntrack is only set where the module is loaded: not part of the tuned host here.
    let unchecked: Vec<&String> = shipped
        .keys()
        .filter(|k| !checked.iter().any(|(c, _)| c == k))
        .collect();
    assert_eq!(unchecked, ["net.netfilter.nf_conntrack_max"]);
}
