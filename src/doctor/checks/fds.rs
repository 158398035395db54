//! File descriptors: `RLIMIT_NOFILE` (soft and hard), `fs.nr_open` and `fs.file-max`, which
//! decide whether the broker can accept one socket per rig at all.
//!
//! Apart because these limits interlock (which one blocks depends on the other two, and the
//! fix offered depends on which can still be raised) and they are what most often blocks a
//! fleet; the cases that pin those rules down sit beside them.

use super::network::check_conntrack;
use super::{at_least, sysctl_fix};
use crate::doctor::model::{
    fd_floor, fd_kept, fd_own, fd_slack, recommended_nofile, FD_ADMIN, FD_BASE, FD_PER_CORE,
};
use crate::doctor::report::limit_text;
use crate::doctor::{Finding, HostSettings};

/// One fd per rig socket plus the broker's own and the ones it keeps from rigs
/// ([`fd_floor`]): below that the broker refuses rigs before N, which blocks. Up to
/// [`fd_slack`] it holds N, but once they are all connected the admin API has fewer
/// descriptors than the connections it lets in at once, which warns. `accept` fails with EMFILE
/// past the soft limit and ENFILE past `fs.file-max`. The broker never raises its own soft
/// limit, so the soft limit is the one that blocks. The hard limit only says whether the soft
/// one can be raised in place (`ulimit -Sn`); a new, higher limit (`LimitNOFILE=`, `ulimit -n`
/// as root) needs `fs.nr_open` at least as high. So `fs.nr_open` blocks only when the soft
/// limit is short of the floor and neither the hard limit nor `fs.nr_open` lets it reach that;
/// below the recommended `LimitNOFILE` (N + 10 %) it warns.
pub(super) fn check_fds(host: &HostSettings, n: u64, cores: u64, port: u16) -> Vec<Finding> {
    const SOFT: &str = "RLIMIT_NOFILE (soft)";
    const HARD: &str = "RLIMIT_NOFILE (hard)";
    const NR_OPEN: &str = "fs.nr_open";
    let slack = fd_slack(cores);
    let fds = n.saturating_add(slack);
    let floor = n.saturating_add(fd_floor(cores, host.nofile_soft));
    let kept = fd_kept(host.nofile_soft);
    let own = fd_own(cores);
    let nofile = recommended_nofile(n, cores);
    let all = format!(
        "≥ {fds} (N + {slack}: {FD_PER_CORE} per core for listeners, rings and eventfds, \
         {FD_BASE} for Redis, logs and files, {FD_ADMIN} admin connections)"
    );
    let needed = format!(
        "{all}; below {floor} (N + {own} + the {kept} the broker keeps from rigs) rigs are \
         refused before N"
    );
    let unit_fix = format!("LimitNOFILE={nofile} in the systemd unit (tuning/fleetlink-fe.service), or `ulimit -n {nofile}` in the starting shell (needs fs.nr_open ≥ {nofile}; raising the hard limit needs CAP_SYS_RESOURCE, which root in a container may lack)");
    let reaches_floor = |v: Option<u64>| v.is_none_or(|v| v >= floor);
    let hard_holds = host.nofile_hard.is_none_or(|v| v >= fds);
    let soft_fix = if hard_holds {
        format!("`ulimit -Sn {fds}` (within the hard limit), or {unit_fix}")
    } else {
        unit_fix.clone()
    };
    let soft = match host.nofile_soft {
        Some(v) if v < floor => Finding::block(SOFT, v.to_string(), needed.clone(), soft_fix),
        Some(v) if v < fds => Finding::warn(
            SOFT,
            v.to_string(),
            format!(
                "{needed}. It holds N rigs, but with all N connected the admin API has about \
                 {} descriptors, not the {FD_ADMIN} connections it lets in at once",
                v - n - own
            ),
            soft_fix,
        ),
        v => Finding::ok(SOFT, limit_text(v), needed.clone()),
    };
    let hard = match host.nofile_hard {
        Some(v) if v < fds => Finding::warn(
            HARD,
            v.to_string(),
            format!("{all} to raise the soft limit in place; below it only a new limit helps (the soft limit is what blocks)"),
            unit_fix,
        ),
        v => Finding::ok(HARD, limit_text(v), all),
    };
    let nr_needed = format!("≥ {nofile}, the LimitNOFILE to set (setrlimit above nr_open fails with EPERM); blocks only if the soft limit is below {floor} and neither the hard limit nor nr_open can raise it to {floor}");
    let nr_fix = sysctl_fix(NR_OPEN, nofile);
    let nr_open = match host.nr_open {
        None => Finding::unreadable(NR_OPEN, nr_needed),
        Some(v) if v >= nofile => Finding::ok(NR_OPEN, v.to_string(), nr_needed),
        Some(v)
            if v < floor
                && !reaches_floor(host.nofile_soft)
                && !reaches_floor(host.nofile_hard) =>
        {
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

#[cfg(test)]
mod tests {
    use crate::doctor::testing::{blocking, finding, tuned, warnings, MILLION};
    use crate::doctor::{check, HostSettings, Transport};

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
        // 2,124 fds besides the rigs' on 2 cores (2,048 of them for admin connections) hold
        // every admin connection beside the rigs.
        assert!(
            finding(
                &check(&host, 17_876, 2, Transport::Plain, 8080),
                "RLIMIT_NOFILE (soft)"
            )
            .ok
        );
        // Past that the broker still holds the rigs (the scenarios hold 19,000 here) and the
        // admin API has what rigs may not take: a warning, not a block.
        for n in [17_877, 19_000, 19_796] {
            let fs = check(&host, n, 2, Transport::Plain, 8080);
            assert!(blocking(&fs).is_empty(), "{n}: {fs:#?}");
            let f = finding(&fs, "RLIMIT_NOFILE (soft)");
            assert!(!f.ok, "{n}");
            let left = 20_000 - n - 76;
            assert!(
                f.needed
                    .contains(&format!("the admin API has about {left} descriptors")),
                "{}",
                f.needed
            );
        }
        // 76 of its own (as doctor counts them) and the 128 kept from rigs: past 19,796, blocks.
        assert_eq!(
            blocking(&check(&host, 19_797, 2, Transport::Plain, 8080)),
            ["RLIMIT_NOFILE (soft)"]
        );
    }

    /// Under a soft limit below 512 the broker keeps a quarter of it from rigs, not 128, and
    /// doctor counts as the broker does (its start-up line gives the same room).
    #[test]
    fn a_small_limit_keeps_a_quarter_of_itself_from_rigs() {
        let host = HostSettings {
            nofile_soft: Some(300),
            nofile_hard: Some(300),
            ..tuned()
        };
        // 300 less 76 of its own on 2 cores and 75 kept.
        assert!(blocking(&check(&host, 149, 2, Transport::Plain, 8080)).is_empty());
        let fs = check(&host, 150, 2, Transport::Plain, 8080);
        assert_eq!(blocking(&fs), ["RLIMIT_NOFILE (soft)"]);
        let f = finding(&fs, "RLIMIT_NOFILE (soft)");
        assert!(
            f.needed
                .contains("below 301 (N + 76 + the 75 the broker keeps"),
            "{}",
            f.needed
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
}
