//! What `doctor` learns from this host and process: sysctls under /proc/sys, /proc/meminfo,
//! `getrlimit` and `sysconf`, gathered into a [`HostSettings`].
//!
//! Apart because this is the only code in `doctor` that touches the host. Everything else is a
//! pure function of a `HostSettings`, which tests build by hand; and what cannot be read here
//! becomes `None` for the rules to report, never a panic.

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

/// `6.18.44-fc-v669` → (6, 18).
pub(super) fn kernel_version(release: &str) -> Option<(u32, u32)> {
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

/// How many rigs this process's soft `RLIMIT_NOFILE` leaves room for, past the descriptors a
/// broker of `cores` cores holds itself (`model::fd_own`) and those it keeps from rigs
/// (`worker::fd_room`), as `doctor` counts them; None when it is unlimited. What the broker
/// says at start, so that a refusal at the limit is not its operator's first sign.
pub fn rig_room(cores: u64) -> Option<u64> {
    let (soft, _) = rlimit(libc::RLIMIT_NOFILE);
    soft.map(|soft| soft.saturating_sub(super::model::fd_floor(cores, Some(soft))))
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
    use crate::doctor::model::recommended_nofile;
    use crate::doctor::testing::MILLION;

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
}
