//! `fleetlink-fe doctor --connections N`: can this host hold N rig connections?
//!
//! Pure core, thin IO shell. [`HostSettings::read`] is the only code that touches the host
//! (procfs, `getrlimit`, `sysconf`); it never panics, and a setting it cannot read is `None`.
//! [`check`] is a pure function of the settings, the target connection count and the core count,
//! so every rule is unit-tested with synthetic hosts. [`run`] prints the report and returns the
//! exit code. Called by `main.rs` for the `doctor` subcommand.
//!
//! A finding is *blocking* only when the broker cannot hold N connections (it would fail
//! accept with EMFILE/ENFILE, or run out of memory, or the firewall would drop rigs). Anything
//! that degrades behaviour under load (storms, broadcasts, drain) is a warning. Each rule's
//! model is written next to it and, at length, in `docs/tuning.md`.
//!
//! Limits (`RLIMIT_*`) are those of the process running `doctor`. A systemd unit sets its own
//! (`LimitNOFILE=`), so run `doctor` the way the broker runs, e.g.
//! `systemd-run --pty -p LimitNOFILE=1100000 fleetlink-fe doctor --connections N`.

use std::io::Write;

/// File descriptors beyond one per rig: per core a listener, the io_uring fd, monoio's eventfd
/// and poller; plus the Redis connection(s), the admin listener and its clients, log files,
/// TLS/CRL files being reloaded, stdio. 1024 covers 128 cores at 8 fds each.
const FD_SLACK: u64 = 1024;

/// Listen backlog each per-core `SO_REUSEPORT` listener asks for: the default of `--backlog`.
/// The kernel uses `min(backlog, net.core.somaxconn)`, silently.
const LISTEN_BACKLOG: u64 = 4096;

/// Kernel memory of one established idle socket, bytes (the shared platform measurements,
/// FACTS.md, matching /proc/slabinfo on the dev machine): `TCP` 2,368 + `sock_inode_cache` 832 + `filp` 192 + `dentry` 192 + the
/// pending poll (`io_kiocb` 256 under io_uring, `eventpoll_epi` 128 under epoll).
const KERNEL_BYTES_PER_CONN: u64 = 3_900;

/// Broker memory per idle plain-ws connection, bytes: the RSS slope `bench/run density`
/// measures (1,128 B, docs/benchmarks.md). A floor, not a promise: a TLS session adds about
/// 7.8 KB (docs/benchmarks.md, TLS), labels and queued commands add more.
const BROKER_BYTES_PER_CONN: u64 = 1_130;

/// TCP memory (`tcp_mem`, pages) a connection holds while busy. An idle socket has empty queues
/// and holds ~0 pages. During a command to every rig at once each socket holds one skb in its
/// send queue until the rig ACKs and one in its receive queue (the rig's ack/result) until the
/// broker reads it. The kernel charges socket memory in whole pages, so 2 pages per connection.
const PAGES_PER_BUSY_CONN: u64 = 2;

/// io_uring submission queue entries per core: `URING_ENTRIES` in `worker/mod.rs`.
const RING_ENTRIES: u64 = 4096;

/// What `doctor` knows about the host. Every field is `None` when it could not be read (a
/// missing `/proc` file, a kernel without the knob), except the `RLIMIT_*` fields, where `None`
/// means `RLIM_INFINITY` (`getrlimit` cannot fail for a valid resource).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct HostSettings {
    /// `kernel.osrelease`, e.g. `6.18.44`: before 5.12 io_uring rings are charged to memlock.
    pub kernel_release: Option<String>,
    /// Page size in bytes: the unit of `net.ipv4.tcp_mem`.
    pub page_size: Option<u64>,
    /// `MemTotal` from /proc/meminfo, in bytes: the ceiling for socket and broker memory.
    pub mem_total_bytes: Option<u64>,
    /// `fs.nr_open`: the ceiling for any process's `RLIMIT_NOFILE`.
    pub nr_open: Option<u64>,
    /// `fs.file-max`: open files system-wide.
    pub file_max: Option<u64>,
    /// First field of `fs.file-nr`: files open system-wide right now.
    pub files_allocated: Option<u64>,
    /// `RLIMIT_NOFILE` soft: what `accept` is held to (EMFILE beyond it).
    pub nofile_soft: Option<u64>,
    /// `RLIMIT_NOFILE` hard: how far the process may raise its soft limit itself.
    pub nofile_hard: Option<u64>,
    /// `RLIMIT_MEMLOCK` soft, bytes: io_uring ring memory on kernels before 5.12.
    pub memlock_soft: Option<u64>,
    /// `RLIMIT_MEMLOCK` hard, bytes.
    pub memlock_hard: Option<u64>,
    /// `net.core.somaxconn`: caps each listener's accept queue.
    pub somaxconn: Option<u64>,
    /// `net.ipv4.tcp_max_syn_backlog`: SYN queue bound, used only when syncookies are off.
    pub tcp_max_syn_backlog: Option<u64>,
    /// `net.ipv4.tcp_syncookies`: 0 off, 1 on SYN queue overflow, 2 always.
    pub tcp_syncookies: Option<u64>,
    /// `net.core.netdev_max_backlog`: per-CPU queue of received packets before TCP.
    pub netdev_max_backlog: Option<u64>,
    /// `net.ipv4.tcp_mem` in pages: low, pressure, high for all TCP sockets together.
    pub tcp_mem: Option<[u64; 3]>,
    /// `net.ipv4.tcp_rmem` in bytes: min (guaranteed under pressure), default, max.
    pub tcp_rmem: Option<[u64; 3]>,
    /// `net.ipv4.tcp_wmem` in bytes: min, default, max.
    pub tcp_wmem: Option<[u64; 3]>,
    /// `net.core.rmem_default`: receive buffer of non-TCP sockets (TCP uses `tcp_rmem[1]`).
    pub rmem_default: Option<u64>,
    /// `net.core.wmem_default`: send buffer of non-TCP sockets (TCP uses `tcp_wmem[1]`).
    pub wmem_default: Option<u64>,
    /// `net.ipv4.ip_local_port_range`: ephemeral ports, which limit clients, not the broker.
    pub ip_local_port_range: Option<(u32, u32)>,
    /// `net.ipv4.tcp_fin_timeout`, seconds: how long orphaned FIN_WAIT2 sockets live.
    pub tcp_fin_timeout: Option<u64>,
    /// `net.ipv4.tcp_tw_reuse`: lets clients reuse TIME_WAIT ports (2 = loopback only).
    pub tcp_tw_reuse: Option<u64>,
    /// `net.ipv4.tcp_max_orphans`: closed-but-not-finished sockets before the kernel resets them.
    pub tcp_max_orphans: Option<u64>,
    /// `net.ipv4.tcp_max_tw_buckets`: TIME_WAIT sockets kept before the kernel skips TIME_WAIT.
    pub tcp_max_tw_buckets: Option<u64>,
    /// `kernel.io_uring_disabled` (6.6+): 0 all, 1 privileged or `io_uring_group`, 2 nobody.
    pub io_uring_disabled: Option<u64>,
    /// `kernel.io_uring_group`: the group allowed io_uring when `io_uring_disabled` is 1.
    pub io_uring_group: Option<i64>,
    /// `net.netfilter.nf_conntrack_max`; `None` when conntrack is not loaded.
    pub nf_conntrack_max: Option<u64>,
    /// `net.netfilter.nf_conntrack_count`: > 0 means connections are being tracked now.
    pub nf_conntrack_count: Option<u64>,
}

impl HostSettings {
    /// Reads the settings of this host and process. Never panics; unreadable values are `None`.
    pub fn read() -> HostSettings {
        let nofile = rlimit(libc::RLIMIT_NOFILE);
        let memlock = rlimit(libc::RLIMIT_MEMLOCK);
        HostSettings {
            kernel_release: read_sys("kernel/osrelease").map(|s| s.trim().to_owned()),
            // SAFETY: sysconf has no memory-safety preconditions.
            page_size: u64::try_from(unsafe { libc::sysconf(libc::_SC_PAGESIZE) }).ok(),
            mem_total_bytes: std::fs::read_to_string("/proc/meminfo")
                .ok()
                .and_then(|m| mem_total(&m)),
            nr_open: sys_u64("fs/nr_open"),
            file_max: sys_u64("fs/file-max"),
            files_allocated: sys_nums("fs/file-nr").and_then(|v| v.first().copied()),
            nofile_soft: nofile.0,
            nofile_hard: nofile.1,
            memlock_soft: memlock.0,
            memlock_hard: memlock.1,
            somaxconn: sys_u64("net/core/somaxconn"),
            tcp_max_syn_backlog: sys_u64("net/ipv4/tcp_max_syn_backlog"),
            tcp_syncookies: sys_u64("net/ipv4/tcp_syncookies"),
            netdev_max_backlog: sys_u64("net/core/netdev_max_backlog"),
            tcp_mem: sys_triple("net/ipv4/tcp_mem"),
            tcp_rmem: sys_triple("net/ipv4/tcp_rmem"),
            tcp_wmem: sys_triple("net/ipv4/tcp_wmem"),
            rmem_default: sys_u64("net/core/rmem_default"),
            wmem_default: sys_u64("net/core/wmem_default"),
            ip_local_port_range: sys_nums("net/ipv4/ip_local_port_range").and_then(
                |v| match v[..] {
                    [lo, hi] => Some((u32::try_from(lo).ok()?, u32::try_from(hi).ok()?)),
                    _ => None,
                },
            ),
            tcp_fin_timeout: sys_u64("net/ipv4/tcp_fin_timeout"),
            tcp_tw_reuse: sys_u64("net/ipv4/tcp_tw_reuse"),
            tcp_max_orphans: sys_u64("net/ipv4/tcp_max_orphans"),
            tcp_max_tw_buckets: sys_u64("net/ipv4/tcp_max_tw_buckets"),
            io_uring_disabled: sys_u64("kernel/io_uring_disabled"),
            io_uring_group: read_sys("kernel/io_uring_group").and_then(|s| s.trim().parse().ok()),
            nf_conntrack_max: sys_u64("net/netfilter/nf_conntrack_max"),
            nf_conntrack_count: sys_u64("net/netfilter/nf_conntrack_count"),
        }
    }
}

/// One checked setting: what it is, what N connections need, and the exact fix.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Finding {
    /// The sysctl or limit name, as an operator would type it.
    pub setting: &'static str,
    /// Its value on this host (`unreadable` when it could not be read).
    pub current: String,
    /// What N connections need, with the reason.
    pub needed: String,
    /// The exact change (sysctl line, `LimitNOFILE=`, ulimit); empty when `ok`.
    pub fix: String,
    /// The host cannot hold N connections until this is fixed.
    pub blocking: bool,
    /// The setting is fine; `ok` findings never block.
    pub ok: bool,
}

impl Finding {
    fn ok(setting: &'static str, current: String, needed: String) -> Finding {
        let fix = String::new();
        Finding {
            setting,
            current,
            needed,
            fix,
            blocking: false,
            ok: true,
        }
    }

    fn warn(setting: &'static str, current: String, needed: String, fix: String) -> Finding {
        Finding {
            setting,
            current,
            needed,
            fix,
            blocking: false,
            ok: false,
        }
    }

    fn block(setting: &'static str, current: String, needed: String, fix: String) -> Finding {
        Finding {
            setting,
            current,
            needed,
            fix,
            blocking: true,
            ok: false,
        }
    }

    fn unreadable(setting: &'static str, needed: String) -> Finding {
        let fix = format!("check that {setting} exists and is readable (run doctor on the host, not in a restricted container)");
        Finding::warn(setting, "unreadable".into(), needed, fix)
    }
}

/// Checks `host` against `connections` rigs served by `cores` worker threads. Returns one
/// finding per setting, in report order; pure, so tests feed it synthetic hosts.
pub fn check(host: &HostSettings, connections: u64, cores: usize) -> Vec<Finding> {
    let n = connections;
    let cores = cores.max(1) as u64;
    let mut out = check_fds(host, n);
    out.extend(check_accept(host, cores));
    out.push(check_memory(host, n));
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

/// Entry point of `fleetlink-fe doctor --connections N`: checks for the cores the broker uses by
/// default (`available_parallelism`, which honours the CPU affinity a unit sets) and prints the
/// report to stdout. Exit code as [`run`].
pub fn main(connections: u64) -> std::process::ExitCode {
    let cores = std::thread::available_parallelism().map_or(1, std::num::NonZeroUsize::get);
    let code = run(connections, cores, &mut std::io::stdout().lock());
    std::process::ExitCode::from(u8::try_from(code).unwrap_or(1))
}

/// Prints a report of every setting to `out` and returns the exit code: 1 when a finding blocks
/// (or the report could not be written), else 0.
pub fn run(connections: u64, cores: usize, out: &mut dyn Write) -> i32 {
    let host = HostSettings::read();
    let findings = check(&host, connections, cores);
    let blocking = findings.iter().filter(|f| f.blocking).count();
    match report(&host, &findings, connections, cores, out) {
        Ok(()) if blocking == 0 => 0,
        _ => 1,
    }
}

fn report(
    host: &HostSettings,
    findings: &[Finding],
    n: u64,
    cores: usize,
    out: &mut dyn Write,
) -> std::io::Result<()> {
    writeln!(
        out,
        "fleetlink doctor: can this host hold {n} rig connections on {cores} cores?"
    )?;
    writeln!(
        out,
        "kernel {}, MemTotal {}, page {} B",
        host.kernel_release.as_deref().unwrap_or("unknown"),
        host.mem_total_bytes.map_or("unknown".into(), bytes_text),
        opt_text(host.page_size),
    )?;
    writeln!(
        out,
        "RLIMIT_* are this process's; a systemd unit applies its own LimitNOFILE=/LimitMEMLOCK=."
    )?;
    writeln!(out)?;
    for f in findings {
        let tag = match (f.ok, f.blocking) {
            (true, _) => "ok",
            (false, false) => "warn",
            (false, true) => "BLOCKS",
        };
        writeln!(out, "[{tag:>6}] {} = {}", f.setting, f.current)?;
        writeln!(out, "         needed: {}", f.needed)?;
        if !f.fix.is_empty() {
            writeln!(out, "         fix:    {}", f.fix)?;
        }
    }
    let blocking = findings.iter().filter(|f| f.blocking).count();
    let warnings = findings.iter().filter(|f| !f.ok && !f.blocking).count();
    writeln!(out)?;
    if blocking == 0 {
        writeln!(
            out,
            "result: this host can hold {n} connections ({warnings} warnings)"
        )
    } else {
        writeln!(out, "result: {blocking} blocking, {warnings} warnings: this host cannot hold {n} connections")
    }
}

/// `LimitNOFILE` to recommend: N + 10 % headroom, at least N + slack, rounded up to 1,000
/// (1,100,000 for a million rigs, the value in tuning/fleetlink-fe.service).
fn recommended_nofile(n: u64) -> u64 {
    let want = n.saturating_add(n / 10).max(n.saturating_add(FD_SLACK));
    want.div_ceil(1000).saturating_mul(1000)
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

/// One fd per rig socket plus FD_SLACK. `accept` fails with EMFILE past the soft limit and
/// ENFILE past `fs.file-max`; the soft limit cannot exceed the hard one, nor hard `fs.nr_open`.
fn check_fds(host: &HostSettings, n: u64) -> Vec<Finding> {
    let fds = n.saturating_add(FD_SLACK);
    let nofile = recommended_nofile(n);
    let needed =
        format!("≥ {fds} (N + {FD_SLACK}: listeners, rings, eventfds, redis, admin, logs)");
    let unit_fix = format!("LimitNOFILE={nofile} in the systemd unit (tuning/fleetlink-fe.service), or `ulimit -n {nofile}` in the starting shell (needs fs.nr_open ≥ {nofile})");
    let soft = match host.nofile_soft {
        Some(v) if v < fds => {
            let fix = if host.nofile_hard.is_none_or(|h| h >= fds) {
                format!("`ulimit -Sn {fds}` (within the hard limit), or {unit_fix}")
            } else {
                unit_fix.clone()
            };
            Finding::block("RLIMIT_NOFILE (soft)", v.to_string(), needed.clone(), fix)
        }
        v => Finding::ok("RLIMIT_NOFILE (soft)", limit_text(v), needed.clone()),
    };
    let hard = match host.nofile_hard {
        Some(v) if v < fds => {
            Finding::block("RLIMIT_NOFILE (hard)", v.to_string(), needed, unit_fix)
        }
        v => Finding::ok("RLIMIT_NOFILE (hard)", limit_text(v), needed),
    };
    let nr_open = at_least(
        "fs.nr_open",
        host.nr_open,
        nofile,
        format!("≥ {nofile}, the LimitNOFILE to set (setrlimit above nr_open fails with EPERM)"),
        sysctl_fix("fs.nr_open", nofile.max(host.nr_open.unwrap_or(0))),
        true,
    );
    let in_use = host.files_allocated.unwrap_or(0);
    let system = fds.saturating_add(in_use);
    let file_max = at_least(
        "fs.file-max",
        host.file_max,
        system,
        format!(
            "≥ {system} ({fds} for the broker + {in_use} open now, system-wide; ENFILE past it)"
        ),
        sysctl_fix(
            "fs.file-max",
            system.saturating_mul(2).max(host.file_max.unwrap_or(0)),
        ),
        true,
    );
    vec![soft, hard, nr_open, file_max, check_conntrack(host, fds)]
}

/// Each per-core listener asks LISTEN_BACKLOG; the kernel silently uses min(backlog,
/// somaxconn). On overflow a client waits for its 1 s SYN retransmit (the shared FACTS.md:
/// p99 handshake 1.23 s in a 10k storm), so a short queue slows storms; it does not block.
fn check_accept(host: &HostSettings, cores: u64) -> Vec<Finding> {
    let somaxconn = at_least(
        "net.core.somaxconn",
        host.somaxconn,
        LISTEN_BACKLOG,
        format!("≥ {LISTEN_BACKLOG}, the listen backlog per core ({} queued handshakes on {cores} cores); reconnect storms overflow a shorter queue and clients wait 1 s for SYN retransmit", LISTEN_BACKLOG * cores),
        sysctl_fix("net.core.somaxconn", LISTEN_BACKLOG.max(16384)),
        false,
    );
    vec![somaxconn, check_syn_backlog(host)]
}

/// At the end of the drain window the broker closes every socket at once.
fn check_drain(host: &HostSettings, n: u64) -> Vec<Finding> {
    let orphans = at_least(
        "net.ipv4.tcp_max_orphans",
        host.tcp_max_orphans,
        n,
        format!("≥ {n}: at the end of a drain all N sockets are closed at once and sit orphaned (FIN_WAIT1) until the rig ACKs; beyond the limit the kernel resets them and rigs see RST, not the 1001 close"),
        sysctl_fix("net.ipv4.tcp_max_orphans", n.max(65536)),
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
fn check_clients(host: &HostSettings, n: u64) -> Vec<Finding> {
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
fn check_conntrack(host: &HostSettings, fds: u64) -> Finding {
    const SETTING: &str = "net.netfilter.nf_conntrack_max";
    let Some(max) = host.nf_conntrack_max else {
        return Finding::ok(
            SETTING,
            "not loaded".into(),
            "conntrack not loaded: nothing to size".into(),
        );
    };
    let count = host.nf_conntrack_count.unwrap_or(0);
    let needed = format!("≥ {fds} if conntrack tracks rig connections (tracking {count} now)");
    let fix = format!("{}, or exempt the rig port (--listen, 8443 here) from tracking: `iptables -t raw -A PREROUTING -p tcp --dport 8443 -j NOTRACK` and `iptables -t raw -A OUTPUT -p tcp --sport 8443 -j NOTRACK`", sysctl_fix(SETTING, fds.next_power_of_two()));
    match (max >= fds, count > 0) {
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
fn check_syn_backlog(host: &HostSettings) -> Finding {
    const SETTING: &str = "net.ipv4.tcp_max_syn_backlog";
    let need = LISTEN_BACKLOG * 4 / 3;
    let cookies = host.tcp_syncookies;
    let needed = format!(
        "≥ {need} (4/3 of the {LISTEN_BACKLOG} backlog) when tcp_syncookies=0; tcp_syncookies = {}",
        opt_text(cookies)
    );
    let fix = format!(
        "{} (or keep net.ipv4.tcp_syncookies=1)",
        sysctl_fix(SETTING, 16384)
    );
    match (host.tcp_max_syn_backlog, cookies) {
        (Some(v), Some(0)) if v < need => Finding::warn(SETTING, v.to_string(), needed, fix),
        (v, _) => Finding::ok(SETTING, opt_text(v), needed),
    }
}

/// Kernel slab (KERNEL_BYTES_PER_CONN) + broker heap (BROKER_BYTES_PER_CONN) per idle
/// connection. More than MemTotal cannot work; more than half leaves too little for socket
/// buffers under load (tcp_mem), TLS state and the page cache: warn.
fn check_memory(host: &HostSettings, n: u64) -> Finding {
    const SETTING: &str = "MemTotal";
    let per_conn = KERNEL_BYTES_PER_CONN + BROKER_BYTES_PER_CONN;
    let need = n.saturating_mul(per_conn);
    let needed = format!(
        "≥ {} = N × ({KERNEL_BYTES_PER_CONN} B kernel slab + {BROKER_BYTES_PER_CONN} B broker heap) for idle rigs; warn above half of MemTotal",
        bytes_text(need)
    );
    let fewer = |total: u64| {
        format!(
            "fewer connections per host (≤ {} at half of MemTotal), or more RAM",
            total / 2 / per_conn
        )
    };
    match host.mem_total_bytes {
        None => Finding::unreadable(SETTING, needed),
        Some(t) if need > t => Finding::block(SETTING, bytes_text(t), needed, fewer(t)),
        Some(t) if need > t / 2 => Finding::warn(SETTING, bytes_text(t), needed, fewer(t)),
        Some(t) => Finding::ok(SETTING, bytes_text(t), needed),
    }
}

/// Idle sockets hold ~0 tcp_mem pages; a command to every rig holds PAGES_PER_BUSY_CONN each.
/// Past `tcp_mem[1]` TCP enters memory pressure (buffers clamped to tcp_rmem/tcp_wmem min);
/// past `tcp_mem[2]` socket allocations fail ("TCP: out of memory"). Holding N is unaffected,
/// so this warns.
fn check_tcp_mem(host: &HostSettings, n: u64) -> Finding {
    const SETTING: &str = "net.ipv4.tcp_mem";
    let page = host.page_size.unwrap_or(4096);
    let busy = n.saturating_mul(PAGES_PER_BUSY_CONN);
    let needed = format!(
        "pressure and high ≥ {busy} pages ({}) = N × {PAGES_PER_BUSY_CONN} pages (one skb each way) for a command to every rig at once; idle rigs hold ~0",
        bytes_text(busy.saturating_mul(page))
    );
    let Some([_, pressure, high]) = host.tcp_mem else {
        return Finding::unreadable(SETTING, needed);
    };
    let current = format!(
        "{:?} pages (high {})",
        [host.tcp_mem.unwrap_or_default()[0], pressure, high],
        bytes_text(high.saturating_mul(page))
    );
    if pressure >= busy && high >= busy {
        return Finding::ok(SETTING, current, needed);
    }
    let fix = format!(
        "sysctl -w net.ipv4.tcp_mem=\"{} {} {}\" (N, 2N, 3N pages) and persist it in /etc/sysctl.d/99-fleetlink.conf",
        n,
        n.saturating_mul(2),
        n.saturating_mul(3)
    );
    Finding::warn(SETTING, current, needed, fix)
}

/// Below `tcp_mem[2]` each socket is granted `min` bytes even under pressure, so a minimum above
/// one page makes N × min compete with `tcp_mem` (a one-page minimum is already covered by the
/// `tcp_mem` rule). Also reports the worst case when every queue fills up to `default`: rigs the
/// broker stopped reading (over `--rig-rate`) and slow rigs behind their commands; `tcp_mem`
/// caps that by putting TCP under pressure.
fn check_buffer_min(
    host: &HostSettings,
    n: u64,
    setting: &'static str,
    v: Option<[u64; 3]>,
) -> Finding {
    let page = host.page_size.unwrap_or(4096);
    let Some([min, default, max]) = v else {
        return Finding::unreadable(setting, format!("min ≤ {page} (one page)"));
    };
    let floor = n.saturating_mul(min);
    let worst = n.saturating_mul(default);
    let needed = format!(
        "min ≤ one page, or N × min = {} within tcp_mem high; worst case N × default = {} if every queue fills (tcp_mem caps it)",
        bytes_text(floor),
        bytes_text(worst)
    );
    let current = format!("{min} {default} {max}");
    match host.tcp_mem {
        Some([_, _, high]) if min > page && floor > high.saturating_mul(page) => {
            let fix = format!("sysctl -w {setting}=\"{page} 16384 {max}\" (min one page) and persist it in /etc/sysctl.d/99-fleetlink.conf");
            Finding::warn(setting, current, needed, fix)
        }
        _ => Finding::ok(setting, current, needed),
    }
}

/// Kernel version, `io_uring_disabled` and memlock. Without io_uring the broker runs on its
/// epoll fallback (and says so): slower, not broken, so these warn.
fn check_io_uring(host: &HostSettings, cores: u64) -> Vec<Finding> {
    let version = host.kernel_release.as_deref().and_then(kernel_version);
    let release = host
        .kernel_release
        .clone()
        .unwrap_or_else(|| "unreadable".into());
    let kernel = match version {
        Some(v) if v >= (5, 6) => Finding::ok("kernel.osrelease", release, "≥ 5.6 for monoio's io_uring driver".into()),
        _ => Finding::warn("kernel.osrelease", release, "≥ 5.6 for monoio's io_uring driver".into(), "a kernel ≥ 5.12 (io_uring ring memory moved from memlock to memcg); otherwise the broker uses epoll".into()),
    };
    const DISABLED: &str = "kernel.io_uring_disabled";
    let fix_disabled = format!(
        "{}, or with 1 add the service's user to the group in kernel.io_uring_group",
        sysctl_fix(DISABLED, 0)
    );
    let disabled = match host.io_uring_disabled {
        None => Finding::ok(
            DISABLED,
            "absent".into(),
            "absent before 6.6: io_uring allowed".into(),
        ),
        Some(0) => Finding::ok(DISABLED, "0".into(), "0: io_uring for every process".into()),
        Some(v) => Finding::warn(
            DISABLED,
            format!(
                "{v} (group {})",
                host.io_uring_group
                    .map_or("unreadable".into(), |g| g.to_string())
            ),
            "0, else io_uring_setup fails (EPERM) and the broker falls back to epoll".into(),
            fix_disabled,
        ),
    };
    // monoio's rings: SQEs (64 B), CQEs (2 per SQE, 16 B), the SQ index array (4 B), plus the
    // ring headers. Before 5.12 these pages count against RLIMIT_MEMLOCK (io_uring_setup ENOMEM).
    let ring_bytes = RING_ENTRIES * (64 + 2 * 16 + 4) + 2 * host.page_size.unwrap_or(4096);
    let need = ring_bytes * cores;
    const MEMLOCK: &str = "RLIMIT_MEMLOCK (soft)";
    let current = match host.memlock_soft {
        None => "unlimited".into(),
        Some(v) => bytes_text(v),
    };
    let needed = format!("before 5.12: ≥ {} ({cores} rings × {} for {RING_ENTRIES} entries); 5.12+ charges rings to memcg", bytes_text(need), bytes_text(ring_bytes));
    let memlock = match (version, host.memlock_soft) {
        (Some(v), _) if v >= (5, 12) => Finding::ok(MEMLOCK, current, needed),
        (_, Some(soft)) if soft < need => Finding::warn(
            MEMLOCK,
            current,
            needed,
            "LimitMEMLOCK=infinity in the systemd unit, or `ulimit -l unlimited`".into(),
        ),
        _ => Finding::ok(MEMLOCK, current, needed),
    };
    vec![kernel, disabled, memlock]
}

/// One client address reaches one broker address:port through at most the ephemeral range; a
/// load generator holding N connections needs ceil(N / range) source addresses.
fn check_port_range(host: &HostSettings, n: u64) -> Finding {
    const SETTING: &str = "net.ipv4.ip_local_port_range";
    let Some((lo, hi)) = host.ip_local_port_range else {
        return Finding::unreadable(SETTING, "clients only".into());
    };
    let ports = u64::from(hi.saturating_sub(lo)) + 1;
    let current = format!("{lo} {hi} ({ports} ports)");
    let sources = n.div_ceil(ports);
    let needed = format!("clients only (load generators, agents): N ≤ ports × source addresses; {sources} source address(es) for {n} connections to one broker address");
    if n <= ports {
        return Finding::ok(SETTING, current, needed);
    }
    let fix = format!("on a load-generator host: spread over ≥ {sources} source addresses (e.g. 127.0.0.2..) and `sysctl -w {SETTING}=\"10000 65535\"`; the broker itself needs nothing");
    Finding::warn(SETTING, current, needed, fix)
}

fn sysctl_fix(name: &str, value: u64) -> String {
    format!("sysctl -w {name}={value} and persist it in /etc/sysctl.d/99-fleetlink.conf")
}

fn limit_text(v: Option<u64>) -> String {
    v.map_or("unlimited".into(), |v| v.to_string())
}

fn opt_text(v: Option<u64>) -> String {
    v.map_or("unreadable".into(), |v| v.to_string())
}

fn bytes_text(b: u64) -> String {
    const GIB: u64 = 1 << 30;
    const MIB: u64 = 1 << 20;
    match b {
        b if b >= GIB => format!("{:.1} GiB", b as f64 / GIB as f64),
        b if b >= MIB => format!("{:.1} MiB", b as f64 / MIB as f64),
        b if b >= 1024 => format!("{:.1} KiB", b as f64 / 1024.0),
        b => format!("{b} B"),
    }
}

/// `6.18.44-fc-v669` → (6, 18).
fn kernel_version(release: &str) -> Option<(u32, u32)> {
    let mut parts = release.split(|c: char| !c.is_ascii_digit());
    Some((parts.next()?.parse().ok()?, parts.next()?.parse().ok()?))
}

fn mem_total(meminfo: &str) -> Option<u64> {
    let line = meminfo.lines().find(|l| l.starts_with("MemTotal:"))?;
    let kib: u64 = line.split_whitespace().nth(1)?.parse().ok()?;
    kib.checked_mul(1024)
}

fn read_sys(name: &str) -> Option<String> {
    std::fs::read_to_string(format!("/proc/sys/{name}")).ok()
}

fn sys_nums(name: &str) -> Option<Vec<u64>> {
    read_sys(name)?
        .split_whitespace()
        .map(|s| s.parse().ok())
        .collect()
}

fn sys_u64(name: &str) -> Option<u64> {
    match sys_nums(name)?[..] {
        [v] => Some(v),
        _ => None,
    }
}

fn sys_triple(name: &str) -> Option<[u64; 3]> {
    sys_nums(name)?.try_into().ok()
}

/// (soft, hard); `None` is `RLIM_INFINITY`.
fn rlimit(resource: libc::__rlimit_resource_t) -> (Option<u64>, Option<u64>) {
    let mut lim = libc::rlimit {
        rlim_cur: 0,
        rlim_max: 0,
    };
    // SAFETY: `lim` is a valid, writable rlimit for the duration of the call.
    if unsafe { libc::getrlimit(resource, &mut lim) } != 0 {
        return (None, None);
    }
    let finite = |v: libc::rlim_t| (v != libc::RLIM_INFINITY).then_some(v);
    (finite(lim.rlim_cur), finite(lim.rlim_max))
}

#[cfg(test)]
mod tests {
    use super::*;

    const MILLION: u64 = 1_000_000;

    /// A host tuned with tuning/sysctl.d/99-fleetlink.conf and the unit's limits, 64 GiB.
    fn tuned() -> HostSettings {
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

    fn finding<'a>(fs: &'a [Finding], setting: &str) -> &'a Finding {
        fs.iter()
            .find(|f| f.setting == setting)
            .unwrap_or_else(|| panic!("no finding for {setting}"))
    }

    fn blocking(fs: &[Finding]) -> Vec<&'static str> {
        fs.iter()
            .filter(|f| f.blocking)
            .map(|f| f.setting)
            .collect()
    }

    /// Warnings other than the client-side port-range note, which any N > 64k raises.
    fn warnings(fs: &[Finding]) -> Vec<&'static str> {
        fs.iter()
            .filter(|f| !f.ok && !f.blocking && f.setting != "net.ipv4.ip_local_port_range")
            .map(|f| f.setting)
            .collect()
    }

    #[test]
    fn tuned_host_holds_a_million() {
        let fs = check(&tuned(), MILLION, 16);
        assert!(blocking(&fs).is_empty(), "{fs:#?}");
        assert!(warnings(&fs).is_empty(), "{fs:#?}");
        // The client-side note: 1M connections exceed one address's ephemeral ports.
        assert!(!finding(&fs, "net.ipv4.ip_local_port_range").ok);
        assert!(fs.iter().filter(|f| f.ok).all(|f| f.fix.is_empty()));
        assert!(check(&tuned(), 50_000, 16).iter().all(|f| f.ok));
    }

    #[test]
    fn nofile_soft_blocks_and_fix_stays_within_hard() {
        let host = HostSettings {
            nofile_soft: Some(1024),
            ..tuned()
        };
        let fs = check(&host, MILLION, 16);
        assert_eq!(blocking(&fs), ["RLIMIT_NOFILE (soft)"]);
        let f = finding(&fs, "RLIMIT_NOFILE (soft)");
        assert_eq!(f.current, "1024");
        assert!(f.fix.contains("ulimit -Sn 1001024"), "{}", f.fix);
    }

    #[test]
    fn nofile_hard_blocks_like_this_machine() {
        // This machine's fact: soft = hard = 20,000, nr_open = 1,048,576.
        let host = HostSettings {
            nofile_soft: Some(20_000),
            nofile_hard: Some(20_000),
            nr_open: Some(1_048_576),
            ..tuned()
        };
        let fs = check(&host, MILLION, 2);
        assert_eq!(
            blocking(&fs),
            ["RLIMIT_NOFILE (soft)", "RLIMIT_NOFILE (hard)", "fs.nr_open"]
        );
        let f = finding(&fs, "RLIMIT_NOFILE (hard)");
        assert!(f.fix.contains("LimitNOFILE=1100000"), "{}", f.fix);
        assert!(check(&host, 18_000, 2).iter().all(|f| !f.blocking));
        assert_eq!(
            blocking(&check(&host, 19_000, 2)),
            ["RLIMIT_NOFILE (soft)", "RLIMIT_NOFILE (hard)"]
        );
    }

    #[test]
    fn nr_open_blocks_below_the_limit_to_set() {
        let host = HostSettings {
            nr_open: Some(1_048_576),
            ..tuned()
        };
        let fs = check(&host, MILLION, 16);
        assert_eq!(blocking(&fs), ["fs.nr_open"]);
        assert!(finding(&fs, "fs.nr_open")
            .fix
            .contains("fs.nr_open=1100000"));
        // Enough for a smaller fleet.
        assert!(blocking(&check(&host, 900_000, 16)).is_empty());
    }

    #[test]
    fn file_max_counts_files_open_elsewhere() {
        let host = HostSettings {
            file_max: Some(1_002_000),
            files_allocated: Some(5_000),
            ..tuned()
        };
        let fs = check(&host, MILLION, 16);
        assert_eq!(blocking(&fs), ["fs.file-max"]);
        assert!(finding(&fs, "fs.file-max").needed.starts_with("≥ 1006024"));
    }

    #[test]
    fn somaxconn_and_syn_backlog_warn_only() {
        let host = HostSettings {
            somaxconn: Some(128),
            tcp_max_syn_backlog: Some(128),
            ..tuned()
        };
        let fs = check(&host, MILLION, 16);
        assert!(blocking(&fs).is_empty());
        assert_eq!(warnings(&fs), ["net.core.somaxconn"]);
        // The SYN backlog matters only without syncookies.
        let host = HostSettings {
            tcp_syncookies: Some(0),
            ..host
        };
        assert_eq!(
            warnings(&check(&host, MILLION, 16)),
            ["net.core.somaxconn", "net.ipv4.tcp_max_syn_backlog"]
        );
    }

    #[test]
    fn memory_blocks_past_mem_total_and_warns_past_half() {
        let small = HostSettings {
            mem_total_bytes: Some(4 << 30),
            ..tuned()
        };
        assert_eq!(blocking(&check(&small, MILLION, 16)), ["MemTotal"]);
        let eight = HostSettings {
            mem_total_bytes: Some(8 << 30),
            ..tuned()
        };
        assert_eq!(warnings(&check(&eight, MILLION, 16)), ["MemTotal"]);
    }

    #[test]
    fn default_tcp_mem_warns_for_broadcasts() {
        // This machine's kernel defaults (24 GiB of RAM).
        let host = HostSettings {
            tcp_mem: Some([287_898, 383_867, 575_796]),
            ..tuned()
        };
        let fs = check(&host, MILLION, 16);
        assert!(blocking(&fs).is_empty());
        assert_eq!(warnings(&fs), ["net.ipv4.tcp_mem"]);
        assert!(finding(&fs, "net.ipv4.tcp_mem")
            .fix
            .contains("\"1000000 2000000 3000000\""));
        assert!(warnings(&check(&host, 100_000, 16)).is_empty());
    }

    #[test]
    fn big_buffer_minimum_warns() {
        let host = HostSettings {
            tcp_rmem: Some([65536, 131072, 6_291_456]),
            ..tuned()
        };
        assert_eq!(warnings(&check(&host, MILLION, 16)), ["net.ipv4.tcp_rmem"]);
    }

    #[test]
    fn io_uring_off_warns_and_never_blocks() {
        for v in [1, 2] {
            let host = HostSettings {
                io_uring_disabled: Some(v),
                ..tuned()
            };
            let fs = check(&host, MILLION, 16);
            assert!(blocking(&fs).is_empty());
            assert_eq!(warnings(&fs), ["kernel.io_uring_disabled"]);
        }
        let old = HostSettings {
            io_uring_disabled: None,
            ..tuned()
        };
        assert!(warnings(&check(&old, MILLION, 16)).is_empty());
    }

    #[test]
    fn memlock_matters_only_before_5_12() {
        let host = HostSettings {
            kernel_release: Some("5.10.0-28-amd64".into()),
            memlock_soft: Some(64 << 10),
            ..tuned()
        };
        assert_eq!(
            warnings(&check(&host, MILLION, 16)),
            ["RLIMIT_MEMLOCK (soft)"]
        );
        let new = HostSettings {
            kernel_release: Some("5.15.0".into()),
            ..host.clone()
        };
        assert!(warnings(&check(&new, MILLION, 16)).is_empty());
        let unlimited = HostSettings {
            memlock_soft: None,
            ..host
        };
        assert!(warnings(&check(&unlimited, MILLION, 16)).is_empty());
    }

    #[test]
    fn conntrack_blocks_only_while_tracking() {
        let host = HostSettings {
            nf_conntrack_max: Some(262_144),
            nf_conntrack_count: Some(0),
            ..tuned()
        };
        assert_eq!(
            warnings(&check(&host, MILLION, 16)),
            ["net.netfilter.nf_conntrack_max"]
        );
        let tracking = HostSettings {
            nf_conntrack_count: Some(12),
            ..host
        };
        assert_eq!(
            blocking(&check(&tracking, MILLION, 16)),
            ["net.netfilter.nf_conntrack_max"]
        );
    }

    #[test]
    fn port_range_warns_for_clients_only() {
        let host = HostSettings {
            ip_local_port_range: Some((32768, 60999)),
            ..tuned()
        };
        let fs = check(&host, MILLION, 16);
        assert!(blocking(&fs).is_empty());
        assert!(finding(&fs, "net.ipv4.ip_local_port_range")
            .needed
            .contains("36 source address"));
        assert!(check(&host, 20_000, 16).iter().all(|f| f.ok));
    }

    #[test]
    fn unreadable_host_warns_and_never_blocks() {
        let fs = check(&HostSettings::default(), MILLION, 16);
        assert!(blocking(&fs).is_empty(), "{fs:#?}");
        assert!(warnings(&fs).contains(&"fs.nr_open"));
    }

    #[test]
    fn parses_kernel_release_and_meminfo() {
        assert_eq!(kernel_version("6.18.44-fc-v669"), Some((6, 18)));
        assert_eq!(kernel_version("5.4"), Some((5, 4)));
        assert_eq!(kernel_version("garbage"), None);
        assert_eq!(
            mem_total("MemTotal:       24684084 kB\nMemFree: 1 kB\n"),
            Some(24_684_084 * 1024)
        );
        assert_eq!(recommended_nofile(MILLION), 1_100_000);
        assert_eq!(recommended_nofile(10), 2000);
    }

    #[test]
    fn reads_this_host() {
        let host = HostSettings::read();
        // This machine: nofile soft = hard = 20,000 (FACTS.md); assert shape, not the number.
        let (soft, hard) = (
            host.nofile_soft.unwrap_or(u64::MAX),
            host.nofile_hard.unwrap_or(u64::MAX),
        );
        assert!(soft <= hard && soft > 0);
        assert!(host.nr_open.is_some() && host.file_max.is_some() && host.somaxconn.is_some());
        assert!(
            host.tcp_mem.is_some() && host.mem_total_bytes.is_some() && host.page_size.is_some()
        );
        assert!(host
            .kernel_release
            .as_deref()
            .and_then(kernel_version)
            .is_some());
    }

    #[test]
    fn run_prints_every_setting() {
        let mut out = Vec::new();
        let code = run(1_000, 2, &mut out);
        let text = String::from_utf8(out).unwrap_or_default();
        assert_eq!(code, i32::from(text.contains("BLOCKS")), "{text}");
        for f in check(&HostSettings::read(), 1_000, 2) {
            assert!(
                text.contains(f.setting),
                "{} missing from\n{text}",
                f.setting
            );
        }
        assert!(text.contains("result:"));
    }
}
