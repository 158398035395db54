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
//! that degrades behaviour under load (storms, broadcasts, drain) or moves cores from io_uring
//! to the epoll driver is a warning. Each rule's model is written next to it and, at length,
//! in `docs/tuning.md`.
//!
//! Limits (`RLIMIT_*`) are those of the process running `doctor`. A systemd unit sets its own
//! (`LimitNOFILE=`, `LimitMEMLOCK=`), so run `doctor` the way the broker runs, e.g.
//! `systemd-run --pty -p LimitNOFILE=1100000 fleetlink-fe doctor --connections N`. The broker
//! never raises its own limits: the soft `RLIMIT_NOFILE` it starts with is the one `accept`
//! is held to.

use std::io::Write;

/// File descriptors beyond one per rig and per core: the Redis connections, the admin
/// listener, log files, TLS/CRL files being reloaded, stdio, the start-up probe.
const FD_BASE: u64 = 64;
/// Per core: a listener, the io_uring fd, monoio's eventfd and poller, the inbox doorbell
/// (an idle broker measured about 5 a core, 17 fds on 1 core and 1,512 on 300).
const FD_PER_CORE: u64 = 6;
/// Admin connections the broker lets in at once: those served on the cores and those
/// waiting in the lobby. A host full to its limit of rigs must still answer `/metrics`.
const FD_ADMIN: u64 = (crate::admin::MAX_ON_CORES + crate::admin::lobby::MAX_WAITING) as u64;

/// File descriptors beyond one per rig, on `cores` cores.
fn fd_slack(cores: u64) -> u64 {
    FD_BASE + FD_PER_CORE * cores + FD_ADMIN
}

/// Most connections `doctor` checks for. Far past what one host's memory holds (~5 KB each with
/// the kernel's share), and it keeps every sum below in range: a larger N is checked as this
/// many, and the report says so.
pub const MAX_CONNECTIONS: u64 = 100_000_000;

/// Listen backlog each per-core `SO_REUSEPORT` listener asks for by default (`--backlog`).
/// The kernel uses `min(backlog, net.core.somaxconn)`, silently.
pub const LISTEN_BACKLOG: u64 = 4096;

/// Kernel memory of one established idle socket, bytes (the shared platform measurements,
/// FACTS.md, matching /proc/slabinfo on the dev machine): `TCP` 2,368 + `sock_inode_cache` 832 + `filp` 192 + `dentry` 192 + the
/// pending poll (`io_kiocb` 256 under io_uring, `eventpoll_epi` 128 under epoll).
const KERNEL_BYTES_PER_CONN: u64 = 3_900;

/// Broker memory per idle plain-ws connection, bytes: the RSS slope `bench/run density`
/// measures (1,128–1,144 B, docs/benchmarks.md and its history). A floor, not a promise:
/// labels and queued commands add more.
const BROKER_BYTES_PER_CONN: u64 = 1_130;

/// Broker memory per idle wss connection, bytes: the RSS slope `bench/tls.sh` measured
/// (9,018 B, `density.wss` in bench/results/tls-fleetlink-fe.json: TLS 1.3, no client
/// certificates). The rustls session state is most of it. Also a floor: with `--client-ca`
/// each session keeps the rig's certificate chain as well, which was not measured.
const BROKER_BYTES_PER_TLS_CONN: u64 = 9_018;

/// TCP memory (`tcp_mem`, pages) a connection holds while busy. An idle socket has empty queues
/// and holds ~0 pages. During a command to every rig at once each socket holds one skb in its
/// send queue until the rig ACKs and one in its receive queue (the rig's ack/result) until the
/// broker reads it. The kernel charges socket memory in whole pages, so 2 pages per connection.
const PAGES_PER_BUSY_CONN: u64 = 2;

/// io_uring submission queue entries per core: `URING_ENTRIES` in `worker/mod.rs`. The
/// startup probe builds one ring of the same size.
const RING_ENTRIES: u64 = 4096;

/// How the rigs connect, which decides the broker's memory per idle connection.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub enum Transport {
    /// Plain `ws://`: the broker runs without `--tls-cert`.
    #[default]
    Plain,
    /// `wss://`: the broker runs with `--tls-cert`/`--tls-key`, as tuning/fleetlink-fe.service
    /// does.
    Tls,
}

impl Transport {
    /// Broker memory per idle connection, bytes.
    fn broker_bytes(self) -> u64 {
        match self {
            Transport::Plain => BROKER_BYTES_PER_CONN,
            Transport::Tls => BROKER_BYTES_PER_TLS_CONN,
        }
    }

    fn name(self) -> &'static str {
        match self {
            Transport::Plain => "plain ws",
            Transport::Tls => "TLS",
        }
    }

    /// The broker's `--listen` port when none is given (CONTRACT.md §1).
    pub fn default_port(self) -> u16 {
        match self {
            Transport::Plain => 8080,
            Transport::Tls => 8443,
        }
    }
}

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

/// Entry point of `fleetlink-fe doctor --connections N [--tls]`: checks for `cores` (the
/// broker's `--cores`), else for the cores the broker uses by default (`available_parallelism`,
/// which honours the CPU affinity a unit sets), and for the rig port of `listen` (the broker's
/// `--listen`), else the broker's default for the transport, and prints the report to stdout.
/// Exit code as [`run`].
pub fn main_with(
    connections: u64,
    cores: Option<std::num::NonZeroUsize>,
    transport: Transport,
    listen: Option<std::net::SocketAddr>,
    backlog: u64,
) -> std::process::ExitCode {
    let cores = cores
        .or_else(|| std::thread::available_parallelism().ok())
        .map_or(1, std::num::NonZeroUsize::get);
    let port = listen.map_or(transport.default_port(), |a| a.port());
    let code = run(
        connections,
        cores,
        transport,
        (port, backlog),
        &mut std::io::stdout().lock(),
    );
    std::process::ExitCode::from(u8::try_from(code).unwrap_or(1))
}

/// Prints a report of every setting to `out` and returns the exit code: 1 when a finding blocks
/// (or the report could not be written), else 0.
pub fn run(
    connections: u64,
    cores: usize,
    transport: Transport,
    (port, backlog): (u16, u64),
    out: &mut dyn Write,
) -> i32 {
    let host = HostSettings::read();
    let findings = check_with_backlog(&host, connections, cores, transport, port, backlog);
    let blocking = findings.iter().filter(|f| f.blocking).count();
    if connections > MAX_CONNECTIONS
        && writeln!(out, "--connections {connections} is more than one host can hold; checking for {MAX_CONNECTIONS}").is_err()
    {
        return 1;
    }
    let n = connections.min(MAX_CONNECTIONS);
    match report(&host, &findings, n, cores, transport, out) {
        Ok(()) if blocking == 0 => 0,
        _ => 1,
    }
}

fn report(
    host: &HostSettings,
    findings: &[Finding],
    n: u64,
    cores: usize,
    transport: Transport,
    out: &mut dyn Write,
) -> std::io::Result<()> {
    writeln!(
        out,
        "fleetlink doctor: can this host hold {n} rig connections ({}) on {cores} cores?",
        transport.name()
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
fn recommended_nofile(n: u64, cores: u64) -> u64 {
    let want = n
        .saturating_add(n / 10)
        .max(n.saturating_add(fd_slack(cores)));
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

/// One fd per rig socket plus [`fd_slack`]. `accept` fails with EMFILE past the soft limit and
/// ENFILE past `fs.file-max`. The broker never raises its own soft limit, so the soft limit is
/// the one that blocks. The hard limit only says whether the soft one can be raised in place
/// (`ulimit -Sn`); a new, higher limit (`LimitNOFILE=`, `ulimit -n` as root) needs `fs.nr_open`
/// at least as high. So `fs.nr_open` blocks only when the soft limit is short of N + slack and
/// neither the hard limit nor `fs.nr_open` lets it reach that; below the recommended
/// `LimitNOFILE` (N + 10 %) it warns.
fn check_fds(host: &HostSettings, n: u64, cores: u64, port: u16) -> Vec<Finding> {
    const SOFT: &str = "RLIMIT_NOFILE (soft)";
    const HARD: &str = "RLIMIT_NOFILE (hard)";
    const NR_OPEN: &str = "fs.nr_open";
    let slack = fd_slack(cores);
    let fds = n.saturating_add(slack);
    let nofile = recommended_nofile(n, cores);
    let needed = format!(
        "≥ {fds} (N + {slack}: {FD_PER_CORE} per core for listeners, rings and eventfds, \
         {FD_ADMIN} admin connections, {FD_BASE} for Redis, logs and files)"
    );
    let unit_fix = format!("LimitNOFILE={nofile} in the systemd unit (tuning/fleetlink-fe.service), or `ulimit -n {nofile}` in the starting shell (needs fs.nr_open ≥ {nofile}; raising the hard limit needs CAP_SYS_RESOURCE, which root in a container may lack)");
    let soft_holds = host.nofile_soft.is_none_or(|v| v >= fds);
    let hard_holds = host.nofile_hard.is_none_or(|v| v >= fds);
    let soft = match host.nofile_soft {
        Some(v) if v < fds => {
            let fix = if hard_holds {
                format!("`ulimit -Sn {fds}` (within the hard limit), or {unit_fix}")
            } else {
                unit_fix.clone()
            };
            Finding::block(SOFT, v.to_string(), needed.clone(), fix)
        }
        v => Finding::ok(SOFT, limit_text(v), needed.clone()),
    };
    let hard = match host.nofile_hard {
        Some(v) if v < fds => Finding::warn(
            HARD,
            v.to_string(),
            format!("{needed} to raise the soft limit in place; below it only a new limit helps (the soft limit is what blocks)"),
            unit_fix,
        ),
        v => Finding::ok(HARD, limit_text(v), needed),
    };
    let nr_needed = format!("≥ {nofile}, the LimitNOFILE to set (setrlimit above nr_open fails with EPERM); blocks only if the soft limit is below {fds} and neither the hard limit nor nr_open can raise it to {fds}");
    let nr_fix = sysctl_fix(NR_OPEN, nofile);
    let nr_open = match host.nr_open {
        None => Finding::unreadable(NR_OPEN, nr_needed),
        Some(v) if v >= nofile => Finding::ok(NR_OPEN, v.to_string(), nr_needed),
        Some(v) if v < fds && !soft_holds && !hard_holds => {
            Finding::block(NR_OPEN, v.to_string(), nr_needed, nr_fix)
        }
        Some(v) => {
            // Holds N now, or can through the hard limit: a warning. Between N + slack and
            // N + 10 % a smaller LimitNOFILE also works.
            let fix = if v >= fds {
                format!("{nr_fix}; or set LimitNOFILE between {fds} and {v}, which holds N with less headroom")
            } else {
                nr_fix
            };
            Finding::warn(NR_OPEN, v.to_string(), nr_needed, fix)
        }
    };
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
    vec![
        soft,
        hard,
        nr_open,
        file_max,
        check_conntrack(host, fds, port),
    ]
}

/// Each per-core listener asks `backlog`; the kernel silently uses min(backlog, somaxconn). On
/// overflow a client waits for its 1 s SYN retransmit (p99 handshake 1.23 s measured in a 10k
/// storm here), so a short queue slows storms; it does not block.
fn check_accept(host: &HostSettings, cores: u64, backlog: u64) -> Vec<Finding> {
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
fn check_drain(host: &HostSettings, n: u64) -> Vec<Finding> {
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
fn check_conntrack(host: &HostSettings, fds: u64, port: u16) -> Finding {
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
    // Twice the fds, to a power of two, as tuning/sysctl.d sizes it (2^21 for a million):
    // conntrack also tracks Redis, admin and outbound connections, and entries of closed ones
    // linger in TIME_WAIT.
    let max_fix = fds
        .saturating_mul(2)
        .checked_next_power_of_two()
        .unwrap_or(fds);
    let fix = format!("{}, or exempt the rig port (--listen, {port} here) from tracking: `iptables -t raw -A PREROUTING -p tcp --dport {port} -j NOTRACK` and `iptables -t raw -A OUTPUT -p tcp --sport {port} -j NOTRACK`", sysctl_fix(SETTING, max_fix));
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

/// Kernel slab (KERNEL_BYTES_PER_CONN) + broker heap (per [`Transport`]) per idle
/// connection. Past three quarters of MemTotal the idle fleet and the quarter socket buffers
/// may take under load (tcp_mem, by [`check_tcp_mem`]'s rule) no longer fit: block. Past half
/// there is little left for the page cache, Redis or anything else: warn.
fn check_memory(host: &HostSettings, n: u64, transport: Transport) -> Finding {
    const SETTING: &str = "MemTotal";
    let broker = transport.broker_bytes();
    let per_conn = KERNEL_BYTES_PER_CONN + broker;
    let need = n.saturating_mul(per_conn);
    let needed = format!(
        "≥ {} = N × ({KERNEL_BYTES_PER_CONN} B kernel slab + {broker} B broker heap over {}) for idle rigs; warn above half of MemTotal, block above three quarters (the last quarter is for socket buffers under load)",
        bytes_text(need),
        transport.name()
    );
    let fewer = |total: u64| {
        format!(
            "fewer connections per host (≤ {} at half of MemTotal), or more RAM",
            total / 2 / per_conn
        )
    };
    match host.mem_total_bytes {
        None => Finding::unreadable(SETTING, needed),
        Some(t) if need > t / 4 * 3 => Finding::block(SETTING, bytes_text(t), needed, fewer(t)),
        Some(t) if need > t / 2 => Finding::warn(SETTING, bytes_text(t), needed, fewer(t)),
        Some(t) => Finding::ok(SETTING, bytes_text(t), needed),
    }
}

/// Idle sockets hold ~0 tcp_mem pages; a command to every rig holds PAGES_PER_BUSY_CONN each.
/// Past `tcp_mem[1]` TCP enters memory pressure (buffers clamped to tcp_rmem/tcp_wmem min);
/// past `tcp_mem[2]` socket allocations fail ("TCP: out of memory"). Holding N is unaffected,
/// so this warns. The rule (docs/tuning.md): `high` at most a quarter of MemTotal, so socket
/// buffers and the connections themselves (at most half, [`check_memory`]) leave a quarter of
/// RAM for everything else. A `high` above that warns too, and the suggested values respect it.
fn check_tcp_mem(host: &HostSettings, n: u64) -> Finding {
    const SETTING: &str = "net.ipv4.tcp_mem";
    let page = host.page_size.unwrap_or(4096);
    let busy = n.saturating_mul(PAGES_PER_BUSY_CONN);
    let cap = host.mem_total_bytes.map(|t| t / 4 / page);
    let cap_text = cap.map_or(String::new(), |c| {
        format!(
            "; high ≤ {c} pages ({}), a quarter of MemTotal",
            bytes_text(c.saturating_mul(page))
        )
    });
    let needed = format!(
        "pressure and high ≥ {busy} pages ({}) = N × {PAGES_PER_BUSY_CONN} pages (one skb each way) for a command to every rig at once; idle rigs hold ~0{cap_text}",
        bytes_text(busy.saturating_mul(page))
    );
    let Some([low, pressure, high]) = host.tcp_mem else {
        return Finding::unreadable(SETTING, needed);
    };
    let current = format!(
        "{:?} pages (high {})",
        [low, pressure, high],
        bytes_text(high.saturating_mul(page))
    );
    let over_cap = cap.is_some_and(|c| high > c);
    if pressure >= busy && high >= busy && !over_cap {
        return Finding::ok(SETTING, current, needed);
    }
    let suggested = suggested_tcp_mem(n, cap, [low, pressure, high]);
    let [low, pressure, high] = suggested;
    let mut fix = format!(
        "sysctl -w net.ipv4.tcp_mem=\"{low} {pressure} {high}\" and persist it in /etc/sysctl.d/99-fleetlink.conf"
    );
    if pressure < busy {
        fix.push_str(&format!(" (scaled 1 : 2 : 3 down to a quarter of RAM: a command to every rig will put TCP under memory pressure; hold ≤ {} rigs per host to avoid it)", pressure / PAGES_PER_BUSY_CONN));
    } else if cap == Some(high) {
        fix.push_str(" (scaled 1 : 2 : 3 down to a quarter of RAM)");
    } else {
        fix.push_str(" (N, 2N, 3N pages, and no value below the current one)");
    }
    Finding::warn(SETTING, current, needed, fix)
}

/// `tcp_mem` to suggest, in pages: N, 2N, 3N, or the current value where it is larger (a
/// fix that shrinks TCP's memory below what the host has would starve everything else on
/// it); all three scaled down together (1 : 2 : 3) when `high` would be more than `cap`, a
/// quarter of RAM.
fn suggested_tcp_mem(n: u64, cap: Option<u64>, current: [u64; 3]) -> [u64; 3] {
    let want = [n, n.saturating_mul(2), n.saturating_mul(3)];
    let up = [0, 1, 2].map(|i| want[i].max(current[i]));
    match cap {
        Some(c) if up[2] > c => {
            let third = c / 3;
            [third, third * 2, c]
        }
        _ => up,
    }
}

/// Below `tcp_mem[2]` each socket is granted `min` bytes even under pressure, so a minimum above
/// one page makes N × min compete with `tcp_mem` (a one-page minimum is already covered by the
/// `tcp_mem` rule). Also says what `default` bounds. Receive: a rig the broker stopped reading
/// (over `--rig-rate`) queues up to its receive buffer, which starts at `default` and grows
/// only while the broker reads. Send: the buffer starts at `default` and the kernel grows it
/// with the congestion window up to `max` (while TCP memory is below `tcp_mem[0]`), so
/// N × default bounds nothing. Only `tcp_mem` caps either total.
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
    let queues = if setting == "net.ipv4.tcp_wmem" {
        format!("send buffers start at default and grow with the congestion window up to max ({}), so N × default bounds nothing; only tcp_mem caps the total", bytes_text(max))
    } else {
        format!("a rig the broker stops reading queues up to its receive buffer, default unless autotuning grew it: N × default = {} if none grew; tcp_mem caps the total", bytes_text(worst))
    };
    let needed = format!(
        "min ≤ one page, or N × min = {} within tcp_mem high; {queues}",
        bytes_text(floor)
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
    vec![kernel, disabled, check_memlock(host, version, cores)]
}

/// Before 5.12 the kernel charges each ring to the user's `RLIMIT_MEMLOCK` (per user: rings of
/// the user's other processes count too) and `io_uring_setup` fails with ENOMEM past it; from
/// 5.12 rings are charged to the memory cgroup. A core whose ring cannot be built runs on the
/// epoll driver (logged as an error, `fleetlink_driver{core=..,driver="epoll"}`), and a failed
/// startup probe puts every core on epoll. The broker still holds N connections (epoll needs
/// less kernel memory per idle socket than io_uring's pending poll), so this warns.
fn check_memlock(host: &HostSettings, version: Option<(u32, u32)>, cores: u64) -> Finding {
    const MEMLOCK: &str = "RLIMIT_MEMLOCK (soft)";
    let ring = ring_memlock_bytes(RING_ENTRIES, host.page_size.unwrap_or(4096));
    // The startup probe's ring too: a closed ring is freed, and uncharged, by a kernel worker
    // after close, so it may still count when the cores build theirs.
    let rings = cores + 1;
    let need = ring.saturating_mul(rings);
    let needed = format!("before 5.12: ≥ {} = {rings} rings ({cores} cores + the startup probe) × {} ({RING_ENTRIES} entries); 5.12+ charges rings to the memory cgroup", bytes_text(need), bytes_text(ring));
    let soft = match (version, host.memlock_soft) {
        (Some(v), _) if v >= (5, 12) => None,
        (Some(v), _) if v < (5, 6) => None, // no io_uring at all: kernel.osrelease warns
        (_, Some(soft)) if soft < need => Some(soft),
        _ => None,
    };
    let Some(soft) = soft else {
        return Finding::ok(MEMLOCK, limit_text_bytes(host.memlock_soft), needed);
    };
    let fits = soft / ring;
    let current = if fits == 0 {
        format!(
            "{}: no ring fits, so all {cores} cores would run on epoll, not io_uring",
            bytes_text(soft)
        )
    } else {
        format!(
            "{}: room for {fits} of {rings} rings, so up to {} of {cores} cores would run on epoll, not io_uring",
            bytes_text(soft),
            (rings - fits).min(cores)
        )
    };
    let fix = format!("LimitMEMLOCK=infinity in the systemd unit (or at least LimitMEMLOCK={need}), or `ulimit -l unlimited` in the starting shell; each core that falls back logs an error and shows as fleetlink_driver{{driver=\"epoll\"}} on the admin /metrics");
    Finding::warn(MEMLOCK, current, needed, fix)
}

/// Memlock charged for one ring of `entries` SQEs before 5.12 (the kernel's `ring_pages()`, as
/// liburing's `io_uring_mlock_size` computes it). Two allocations, each rounded up to a power
/// of two pages: the rings (a header of at most 320 B, 2 × entries CQEs of 16 B, the SQ index
/// array of 4 B per entry) and the SQEs (64 B each). 512 KiB for 4,096 entries.
fn ring_memlock_bytes(entries: u64, page: u64) -> u64 {
    let pow2_pages = |bytes: u64| {
        bytes
            .div_ceil(page)
            .next_power_of_two()
            .saturating_mul(page)
    };
    pow2_pages(320 + entries * 2 * 16 + entries * 4) + pow2_pages(entries * 64)
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

fn sysctl_fix(name: &str, value: u64) -> String {
    format!("sysctl -w {name}={value} and persist it in /etc/sysctl.d/99-fleetlink.conf")
}

fn limit_text(v: Option<u64>) -> String {
    v.map_or("unlimited".into(), |v| v.to_string())
}

fn limit_text_bytes(v: Option<u64>) -> String {
    v.map_or("unlimited".into(), bytes_text)
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
        let broker = sysctl_lines(include_str!("../tuning/sysctl.d/99-fleetlink.conf"));
        let loadgen = sysctl_lines(include_str!("../tuning/sysctl.d/99-fleetlink-loadgen.conf"));
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

    /// Settings that warn.
    fn warnings(fs: &[Finding]) -> Vec<&'static str> {
        fs.iter()
            .filter(|f| !f.ok && !f.blocking)
            .map(|f| f.setting)
            .collect()
    }

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
    fn nofile_soft_blocks_and_fix_stays_within_hard() {
        let host = HostSettings {
            nofile_soft: Some(1024),
            ..tuned()
        };
        let fs = check(&host, MILLION, 16, Transport::Plain, 8080);
        assert_eq!(blocking(&fs), ["RLIMIT_NOFILE (soft)"]);
        let f = finding(&fs, "RLIMIT_NOFILE (soft)");
        assert_eq!(f.current, "1024");
        assert!(f.fix.contains("ulimit -Sn 1002208"), "{}", f.fix);
    }

    #[test]
    fn nofile_soft_blocks_like_this_machine() {
        // This machine's fact: soft = hard = 20,000, nr_open = 1,048,576. The soft limit is
        // what the broker gets; the hard limit and nr_open only decide which fix works.
        let host = HostSettings {
            nofile_soft: Some(20_000),
            nofile_hard: Some(20_000),
            nr_open: Some(1_048_576),
            ..tuned()
        };
        let fs = check(&host, MILLION, 2, Transport::Plain, 8080);
        assert_eq!(blocking(&fs), ["RLIMIT_NOFILE (soft)"]);
        assert_eq!(
            warnings(&fs),
            ["RLIMIT_NOFILE (hard)", "fs.nr_open"],
            "{fs:#?}"
        );
        for setting in ["RLIMIT_NOFILE (soft)", "RLIMIT_NOFILE (hard)"] {
            let f = finding(&fs, setting);
            assert!(f.fix.contains("LimitNOFILE=1100000"), "{}", f.fix);
            assert!(!f.fix.contains("ulimit -Sn"), "{}", f.fix);
        }
        // 2,124 fds besides the rigs' on 2 cores (2,048 of them for admin connections).
        assert!(check(&host, 17_876, 2, Transport::Plain, 8080)
            .iter()
            .all(|f| !f.blocking));
        assert_eq!(
            blocking(&check(&host, 17_877, 2, Transport::Plain, 8080)),
            ["RLIMIT_NOFILE (soft)"]
        );
    }

    #[test]
    fn nr_open_below_n_blocks_when_no_limit_reaches_n() {
        // Soft and hard short of N + the slack, and nr_open too low to set a limit that is not.
        let host = HostSettings {
            nofile_soft: Some(20_000),
            nofile_hard: Some(20_000),
            nr_open: Some(1_000_000),
            ..tuned()
        };
        let fs = check(&host, MILLION, 16, Transport::Plain, 8080);
        assert_eq!(blocking(&fs), ["RLIMIT_NOFILE (soft)", "fs.nr_open"]);
        let f = finding(&fs, "fs.nr_open");
        assert!(f.fix.contains("fs.nr_open=1100000"), "{}", f.fix);
        assert!(!f.fix.contains("between"), "{}", f.fix);
        // Enough for a smaller fleet: nr_open ≥ N + 10 %, only the soft limit blocks.
        assert_eq!(
            blocking(&check(&host, 900_000, 16, Transport::Plain, 8080)),
            ["RLIMIT_NOFILE (soft)"]
        );
        assert!(
            finding(
                &check(&host, 900_000, 16, Transport::Plain, 8080),
                "fs.nr_open"
            )
            .ok
        );
    }

    #[test]
    fn nr_open_below_the_limit_to_set_only_warns_when_the_limit_holds_n() {
        // systemd's maximum for every limit on a host it boots: 1,048,576 holds N + the slack but
        // not the recommended N + 10 %.
        let host = HostSettings {
            nofile_soft: Some(1_048_576),
            nofile_hard: Some(1_048_576),
            nr_open: Some(1_048_576),
            ..tuned()
        };
        let fs = check(&host, MILLION, 16, Transport::Plain, 8080);
        assert!(blocking(&fs).is_empty(), "{fs:#?}");
        assert_eq!(warnings(&fs), ["fs.nr_open"]);
        let f = finding(&fs, "fs.nr_open");
        assert!(f.fix.contains("fs.nr_open=1100000"), "{}", f.fix);
        assert!(
            f.fix.contains("LimitNOFILE between 1002208 and 1048576"),
            "{}",
            f.fix
        );
        // The old rule blocked here; a limit lowered after the fact (nr_open below the
        // process's own limit) warns as well.
        let lowered = HostSettings {
            nofile_soft: Some(1_100_000),
            nofile_hard: Some(1_100_000),
            ..host.clone()
        };
        assert!(blocking(&check(&lowered, MILLION, 16, Transport::Plain, 8080)).is_empty());
        let lowered = HostSettings {
            nr_open: Some(1_000_000),
            ..lowered
        };
        let fs = check(&lowered, MILLION, 16, Transport::Plain, 8080);
        assert!(blocking(&fs).is_empty(), "{fs:#?}");
        assert_eq!(warnings(&fs), ["fs.nr_open"]);
        // Enough for a smaller fleet.
        assert!(check(&host, 900_000, 16, Transport::Plain, 8080)
            .iter()
            .all(|f| f.ok));
    }

    #[test]
    fn nr_open_never_blocks_while_the_hard_limit_lets_the_soft_one_rise() {
        // `ulimit -Sn` within the hard limit needs no new limit, so nr_open is no obstacle.
        let host = HostSettings {
            nofile_soft: Some(1024),
            nofile_hard: Some(1_100_000),
            nr_open: Some(1_000_000),
            ..tuned()
        };
        let fs = check(&host, MILLION, 16, Transport::Plain, 8080);
        assert_eq!(blocking(&fs), ["RLIMIT_NOFILE (soft)"]);
        assert_eq!(warnings(&fs), ["fs.nr_open"]);
        assert!(finding(&fs, "RLIMIT_NOFILE (soft)")
            .fix
            .contains("ulimit -Sn 1002208"));
        assert!(finding(&fs, "RLIMIT_NOFILE (hard)").ok);
    }

    #[test]
    fn file_max_counts_files_open_elsewhere() {
        let host = HostSettings {
            file_max: Some(1_002_000),
            files_allocated: Some(5_000),
            ..tuned()
        };
        let fs = check(&host, MILLION, 16, Transport::Plain, 8080);
        assert_eq!(blocking(&fs), ["fs.file-max"]);
        assert!(finding(&fs, "fs.file-max").needed.starts_with("≥ 1007208"));
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
    fn memory_blocks_past_three_quarters_of_mem_total_and_warns_past_half() {
        // tcp_mem at a quarter of this RAM: it still warns (a broadcast to 1M rigs needs more),
        // but never blocks.
        let small = HostSettings {
            mem_total_bytes: Some(4 << 30),
            tcp_mem: Some([87_381, 174_762, 262_144]),
            ..tuned()
        };
        assert_eq!(
            blocking(&check(&small, MILLION, 16, Transport::Plain, 8080)),
            ["MemTotal"]
        );
        let eight = HostSettings {
            mem_total_bytes: Some(8 << 30),
            tcp_mem: Some([174_762, 349_524, 524_288]),
            ..tuned()
        };
        let fs = check(&eight, MILLION, 16, Transport::Plain, 8080);
        assert!(blocking(&fs).is_empty());
        assert_eq!(warnings(&fs), ["MemTotal", "net.ipv4.tcp_mem"]);
        // 1.4M plain rigs need 6.6 GiB: over three quarters of 8 GiB, which leaves no room for
        // buffers under load.
        let fs = check(&eight, 1_400_000, 16, Transport::Plain, 8080);
        assert!(finding(&fs, "MemTotal").blocking, "{fs:#?}");
        let fs = check(&eight, 1_200_000, 16, Transport::Plain, 8080);
        assert!(!finding(&fs, "MemTotal").blocking, "5.6 GiB is under 6");
        assert!(finding(&fs, "MemTotal")
            .needed
            .contains("1130 B broker heap over plain ws"));
    }

    #[test]
    fn tls_memory_uses_the_tls_figure() {
        // 1M rigs: 4.7 GiB over plain ws, 12.0 GiB over TLS (3,900 + 9,018 B each).
        let eight = HostSettings {
            mem_total_bytes: Some(8 << 30),
            ..tuned()
        };
        let plain = check(&eight, MILLION, 16, Transport::Plain, 8080);
        assert!(!finding(&plain, "MemTotal").ok && !finding(&plain, "MemTotal").blocking);
        let fs = check(&eight, MILLION, 16, Transport::Tls, 8443);
        assert_eq!(blocking(&fs), ["MemTotal"]);
        let f = finding(&fs, "MemTotal");
        assert!(f.needed.starts_with("≥ 12.0 GiB"), "{}", f.needed);
        assert!(
            f.needed.contains("9018 B broker heap over TLS"),
            "{}",
            f.needed
        );
        // ≤ 332,479 TLS rigs fit in half of 8 GiB.
        assert!(f.fix.contains("≤ 332479"), "{}", f.fix);
        // This machine's 23.5 GiB: plain fits in half of RAM, TLS does not.
        let here = HostSettings {
            mem_total_bytes: Some(24_684_084 * 1024),
            ..tuned()
        };
        assert!(
            finding(
                &check(&here, MILLION, 2, Transport::Plain, 8080),
                "MemTotal"
            )
            .ok
        );
        let f = check(&here, MILLION, 2, Transport::Tls, 8443);
        assert!(!finding(&f, "MemTotal").ok && !finding(&f, "MemTotal").blocking);
        // The tuned 64 GiB host holds a million TLS rigs.
        let fs = check(&tuned(), MILLION, 16, Transport::Tls, 8443);
        assert!(
            blocking(&fs).is_empty() && warnings(&fs).is_empty(),
            "{fs:#?}"
        );
    }

    #[test]
    fn default_tcp_mem_warns_for_broadcasts() {
        // This machine's kernel defaults (24 GiB of RAM).
        let host = HostSettings {
            tcp_mem: Some([287_898, 383_867, 575_796]),
            ..tuned()
        };
        let fs = check(&host, MILLION, 16, Transport::Plain, 8080);
        assert!(blocking(&fs).is_empty());
        assert_eq!(warnings(&fs), ["net.ipv4.tcp_mem"]);
        assert!(finding(&fs, "net.ipv4.tcp_mem")
            .fix
            .contains("\"1000000 2000000 3000000\""));
        assert!(warnings(&check(&host, 100_000, 16, Transport::Plain, 8080)).is_empty());
    }

    #[test]
    fn big_buffer_minimum_warns() {
        let host = HostSettings {
            tcp_rmem: Some([65536, 131072, 6_291_456]),
            ..tuned()
        };
        assert_eq!(
            warnings(&check(&host, MILLION, 16, Transport::Plain, 8080)),
            ["net.ipv4.tcp_rmem"]
        );
    }

    #[test]
    fn io_uring_off_warns_and_never_blocks() {
        for v in [1, 2] {
            let host = HostSettings {
                io_uring_disabled: Some(v),
                ..tuned()
            };
            let fs = check(&host, MILLION, 16, Transport::Plain, 8080);
            assert!(blocking(&fs).is_empty());
            assert_eq!(warnings(&fs), ["kernel.io_uring_disabled"]);
        }
        let old = HostSettings {
            io_uring_disabled: None,
            ..tuned()
        };
        assert!(warnings(&check(&old, MILLION, 16, Transport::Plain, 8080)).is_empty());
    }

    #[test]
    fn memlock_matters_only_before_5_12() {
        let host = HostSettings {
            kernel_release: Some("5.10.0-28-amd64".into()),
            memlock_soft: Some(64 << 10),
            ..tuned()
        };
        assert_eq!(
            warnings(&check(&host, MILLION, 16, Transport::Plain, 8080)),
            ["RLIMIT_MEMLOCK (soft)"]
        );
        let new = HostSettings {
            kernel_release: Some("5.15.0".into()),
            ..host.clone()
        };
        assert!(warnings(&check(&new, MILLION, 16, Transport::Plain, 8080)).is_empty());
        let unlimited = HostSettings {
            memlock_soft: None,
            ..host.clone()
        };
        assert!(warnings(&check(&unlimited, MILLION, 16, Transport::Plain, 8080)).is_empty());
        // Before 5.6 there is no io_uring to lose: kernel.osrelease warns, memlock does not.
        let ancient = HostSettings {
            kernel_release: Some("5.4.0-150-generic".into()),
            ..host
        };
        assert_eq!(
            warnings(&check(&ancient, MILLION, 16, Transport::Plain, 8080)),
            ["kernel.osrelease"]
        );
    }

    #[test]
    fn memlock_short_of_the_rings_puts_cores_on_epoll_without_blocking() {
        // The kernel default before 5.16: 64 KiB, less than one 512 KiB ring.
        let host = HostSettings {
            kernel_release: Some("5.10.0-28-amd64".into()),
            memlock_soft: Some(64 << 10),
            memlock_hard: Some(64 << 10),
            ..tuned()
        };
        let fs = check(&host, MILLION, 16, Transport::Plain, 8080);
        assert!(blocking(&fs).is_empty(), "{fs:#?}");
        let f = finding(&fs, "RLIMIT_MEMLOCK (soft)");
        assert!(
            f.current
                .contains("no ring fits, so all 16 cores would run on epoll, not io_uring"),
            "{}",
            f.current
        );
        // 17 rings (16 cores + the startup probe) × 512 KiB.
        assert!(
            f.needed.starts_with("before 5.12: ≥ 8.5 MiB = 17 rings"),
            "{}",
            f.needed
        );
        assert!(f.fix.contains("LimitMEMLOCK=infinity"), "{}", f.fix);
        assert!(f.fix.contains("LimitMEMLOCK=8912896"), "{}", f.fix);
        assert!(f.fix.contains("fleetlink_driver"), "{}", f.fix);
        // 8 MiB (the default from 5.16, and systemd's): 16 of 17 rings fit.
        let eight = HostSettings {
            memlock_soft: Some(8 << 20),
            ..host.clone()
        };
        let f = check(&eight, MILLION, 16, Transport::Plain, 8080);
        let f = finding(&f, "RLIMIT_MEMLOCK (soft)");
        assert!(!f.ok && !f.blocking);
        assert!(
            f.current
                .contains("room for 16 of 17 rings, so up to 1 of 16 cores would run on epoll"),
            "{}",
            f.current
        );
        // ... and is plenty for 2 cores, as on this machine.
        assert!(
            finding(
                &check(&eight, MILLION, 2, Transport::Plain, 8080),
                "RLIMIT_MEMLOCK (soft)"
            )
            .ok
        );
        // Unknown kernel: assume it may be old.
        let unknown = HostSettings {
            kernel_release: None,
            ..host
        };
        let f = check(&unknown, MILLION, 16, Transport::Plain, 8080);
        assert!(!finding(&f, "RLIMIT_MEMLOCK (soft)").ok);
    }

    #[test]
    fn ring_memlock_rounds_each_allocation_to_a_power_of_two_pages() {
        // Rings: 320 + 8,192 × 16 + 4,096 × 4 = 147,776 B → 64 pages; SQEs: 256 KiB → 64 pages.
        assert_eq!(ring_memlock_bytes(4096, 4096), 512 << 10);
        // 64 KiB pages (arm64): 3 pages → 4, and 4 pages.
        assert_eq!(ring_memlock_bytes(4096, 65536), 512 << 10);
        // liburing's io_uring_mlock_size for 128 entries: 2 + 2 pages.
        assert_eq!(ring_memlock_bytes(128, 4096), 16 << 10);
    }

    #[test]
    fn tcp_mem_fix_keeps_high_within_a_quarter_of_ram() {
        // This machine: 23.5 GiB, kernel default tcp_mem. A quarter of RAM is 1,542,755 pages,
        // less than 3N: the fix scales N, 2N, 3N down and says broadcasts will hit pressure.
        let here = HostSettings {
            mem_total_bytes: Some(24_684_084 * 1024),
            tcp_mem: Some([287_898, 383_867, 575_796]),
            ..tuned()
        };
        let fs = check(&here, MILLION, 2, Transport::Plain, 8080);
        let f = finding(&fs, "net.ipv4.tcp_mem");
        assert!(!f.ok && !f.blocking);
        assert!(f.needed.contains("high ≤ 1542755 pages"), "{}", f.needed);
        assert!(f.fix.contains("\"514251 1028502 1542755\""), "{}", f.fix);
        assert!(f.fix.contains("hold ≤ 514251 rigs per host"), "{}", f.fix);
        let kernel = [287_892, 383_858, 575_784];
        assert_eq!(
            suggested_tcp_mem(MILLION, Some(1_542_755), kernel),
            [514_251, 1_028_502, 1_542_755]
        );
        assert_eq!(
            suggested_tcp_mem(MILLION, None, kernel),
            [1_000_000, 2_000_000, 3_000_000]
        );
        // A small fleet is never told to shrink TCP's memory below the kernel's own.
        assert_eq!(suggested_tcp_mem(100_000, Some(1_542_755), kernel), kernel);
        assert_eq!(
            suggested_tcp_mem(200_000, Some(1_542_755), kernel),
            [287_892, 400_000, 600_000]
        );
        // Over the quarter of RAM, for any fleet: scaled down to it, never to N, 2N, 3N.
        let conf = [1_048_576, 2_097_152, 3_145_728];
        assert_eq!(
            suggested_tcp_mem(1_000, Some(1_542_755), conf),
            [514_251, 1_028_502, 1_542_755]
        );
        // The conf's values (high 12 GiB) on this RAM: over a quarter, so they warn even for a
        // fleet they would carry.
        let conf = HostSettings {
            tcp_mem: Some([1_048_576, 2_097_152, 3_145_728]),
            ..here.clone()
        };
        assert_eq!(
            warnings(&check(&conf, 100_000, 2, Transport::Plain, 8080)),
            ["net.ipv4.tcp_mem"]
        );
        // 48 GiB is the least RAM for which they are within the rule (docs/tuning.md).
        let fits = HostSettings {
            mem_total_bytes: Some(48 << 30),
            ..conf
        };
        assert!(
            finding(
                &check(&fits, MILLION, 2, Transport::Plain, 8080),
                "net.ipv4.tcp_mem"
            )
            .ok
        );
        let short = HostSettings {
            mem_total_bytes: Some((48 << 30) - (1 << 20)),
            ..fits
        };
        assert!(
            !finding(
                &check(&short, MILLION, 2, Transport::Plain, 8080),
                "net.ipv4.tcp_mem"
            )
            .ok
        );
    }

    #[test]
    fn send_buffer_text_does_not_bound_sends_by_the_default() {
        let fs = check(&tuned(), MILLION, 16, Transport::Plain, 8080);
        let w = &finding(&fs, "net.ipv4.tcp_wmem").needed;
        assert!(
            w.contains("grow with the congestion window up to max"),
            "{w}"
        );
        assert!(w.contains("only tcp_mem caps the total"), "{w}");
        let r = &finding(&fs, "net.ipv4.tcp_rmem").needed;
        assert!(r.contains("N × default = 15.3 GiB if none grew"), "{r}");
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
        assert_eq!(Transport::Plain.default_port(), 8080);
        assert_eq!(Transport::Tls.default_port(), 8443);
    }

    #[test]
    fn a_huge_connection_count_is_capped_not_overflowed() {
        let host = HostSettings {
            nf_conntrack_max: Some(262_144),
            nf_conntrack_count: Some(12),
            nr_open: Some(1_048_576),
            ..tuned()
        };
        let capped = check(&host, MAX_CONNECTIONS, 16, Transport::Plain, 8080);
        let fs = check(&host, u64::MAX, 16, Transport::Plain, 8080);
        assert_eq!(fs, capped, "u64::MAX is checked as MAX_CONNECTIONS");
        let conntrack = &finding(&fs, "net.netfilter.nf_conntrack_max").fix;
        assert!(
            conntrack.contains("nf_conntrack_max=268435456"),
            "{conntrack}"
        );
        let nr_open = &finding(&fs, "fs.nr_open").fix;
        assert!(nr_open.contains("fs.nr_open=110000000"), "{nr_open}");
        let mut out = Vec::new();
        run(
            u64::MAX,
            2,
            Transport::Plain,
            (8080, LISTEN_BACKLOG),
            &mut out,
        );
        let out = String::from_utf8_lossy(&out);
        assert!(
            out.starts_with(&format!(
                "--connections {} is more than one host can hold; checking for {MAX_CONNECTIONS}",
                u64::MAX
            )),
            "{out}"
        );
        assert!(!out.contains("=0 "), "{out}");
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

    #[test]
    fn parses_kernel_release_and_meminfo() {
        assert_eq!(kernel_version("6.18.44-fc-v669"), Some((6, 18)));
        assert_eq!(kernel_version("5.4"), Some((5, 4)));
        assert_eq!(kernel_version("garbage"), None);
        assert_eq!(
            mem_total("MemTotal:       24684084 kB\nMemFree: 1 kB\n"),
            Some(24_684_084 * 1024)
        );
        assert_eq!(recommended_nofile(MILLION, 2), 1_100_000);
        assert_eq!(recommended_nofile(10, 2), 3000);
        // Many cores take their own fds: 300 cores idle at about 1,500.
        assert_eq!(recommended_nofile(10, 300), 4000);
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
        let code = run(1_000, 2, Transport::Plain, (8080, LISTEN_BACKLOG), &mut out);
        let text = String::from_utf8(out).unwrap_or_default();
        assert_eq!(code, i32::from(text.contains("BLOCKS")), "{text}");
        for f in check(&HostSettings::read(), 1_000, 2, Transport::Plain, 8080) {
            assert!(
                text.contains(f.setting),
                "{} missing from\n{text}",
                f.setting
            );
        }
        assert!(text.contains("result:"));
    }
}
