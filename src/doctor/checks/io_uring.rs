//! io_uring: the kernel version, `kernel.io_uring_disabled` and, before 5.12, the memlock each
//! core's ring is charged to.
//!
//! Apart because these never decide whether N connections fit, only which driver the cores run
//! (io_uring or the epoll fallback): they only warn, and they are the only rules that depend on
//! the kernel's version.

use super::sysctl_fix;
use crate::doctor::host::kernel_version;
use crate::doctor::model::RING_ENTRIES;
use crate::doctor::report::{bytes_text, limit_text_bytes};
use crate::doctor::{Finding, HostSettings};

/// Kernel version, `io_uring_disabled` and memlock. Without io_uring the broker runs on its
/// epoll fallback (and says so): slower, not broken, so these warn.
pub(super) fn check_io_uring(host: &HostSettings, cores: u64) -> Vec<Finding> {
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

#[cfg(test)]
mod tests {
    use super::*;
    use crate::doctor::testing::{blocking, finding, tuned, warnings, MILLION};
    use crate::doctor::{check, Transport};

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
}
