//! The file descriptors rigs may not take. `--max-connections` is unlimited by default
//! (CONTRACT.md §1), and a storm of rigs then took every descriptor the open-file limit allows:
//! `/healthz` went unanswered (its connection waited in the kernel's backlog), and a broker
//! reconnecting to Redis lost the race for each freed descriptor to the next rig, so its rigs'
//! leases lapsed while they stayed connected. So past a ceiling just below the limit a rig's
//! connection is refused at once (`over_capacity`), and the descriptors above it stay for
//! Redis, the admin API, TLS and CRL reloads and log files.
//!
//! The check is the accepted socket's own number: the kernel gives each new descriptor the
//! lowest one free, so a socket numbered `n` means the `n` below it are all in use. No count
//! is kept, and no core asks another.

/// Descriptors kept from rigs, or a quarter of the limit when that is smaller: the bridge's
/// Redis connections and their reconnects, admin probes and scrapes, TLS and CRL files
/// being read, a log file.
pub const RESERVE: u64 = 128;

/// The lowest descriptor number a rig's connection may not have, by the soft open-file limit
/// now; `None` when the limit is unlimited (or past what a descriptor number holds).
pub fn ceiling() -> Option<i32> {
    let mut lim = libc::rlimit {
        rlim_cur: 0,
        rlim_max: 0,
    };
    // SAFETY: `lim` is a valid, writable rlimit for the duration of the call.
    if unsafe { libc::getrlimit(libc::RLIMIT_NOFILE, &mut lim) } != 0 {
        return None;
    }
    if lim.rlim_cur == libc::RLIM_INFINITY {
        return None;
    }
    ceiling_for(lim.rlim_cur)
}

fn ceiling_for(soft: u64) -> Option<i32> {
    i32::try_from(soft - reserve_for(soft)).ok()
}

/// The descriptors kept from rigs under a soft open-file limit of `soft`.
pub fn reserve_for(soft: u64) -> u64 {
    RESERVE.min(soft / 4)
}

/// Whether a socket numbered `fd` lies in the reserve.
pub(crate) fn in_reserve(ceiling: Option<i32>, fd: i32) -> bool {
    ceiling.is_some_and(|c| fd >= c)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_reserve_is_128_or_a_quarter_of_a_small_limit() {
        assert_eq!(ceiling_for(20_000), Some(19_872));
        assert_eq!(ceiling_for(256), Some(192));
        assert_eq!(
            ceiling_for(1 << 40),
            None,
            "no descriptor number reaches it"
        );
        assert!(in_reserve(Some(192), 192));
        assert!(!in_reserve(Some(192), 191));
        assert!(!in_reserve(None, i32::MAX));
    }
}
