//! Memory: the idle fleet's share of MemTotal, TCP's `tcp_mem`, the socket buffers' minimums,
//! and the `tcp_mem` to suggest.
//!
//! Apart because these rules split one budget between them (docs/tuning.md): the connections at
//! most half of RAM, socket buffers at most a quarter. Kept together so the shares are read, and
//! changed, in one place.

use crate::doctor::model::{KERNEL_BYTES_PER_CONN, PAGES_PER_BUSY_CONN};
use crate::doctor::report::bytes_text;
use crate::doctor::{Finding, HostSettings, Transport};

/// Kernel slab (KERNEL_BYTES_PER_CONN) + broker heap (per [`Transport`]) per idle
/// connection. Past three quarters of MemTotal the idle fleet and the quarter socket buffers
/// may take under load (tcp_mem, by [`check_tcp_mem`]'s rule) no longer fit: block. Past half
/// there is little left for the page cache, Redis or anything else: warn.
pub(super) fn check_memory(host: &HostSettings, n: u64, transport: Transport) -> Finding {
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
pub(super) fn check_tcp_mem(host: &HostSettings, n: u64) -> Finding {
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
pub(super) fn check_buffer_min(
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
    // Said as what holds here, not as a rule that reads like a claim about N × min.
    let rule = if min <= page {
        format!("min ≤ one page ({page}): the tcp_mem rule covers it")
    } else {
        format!(
            "min over one page, so N × min = {} must fit tcp_mem high",
            bytes_text(floor)
        )
    };
    let needed = format!("{rule}; {queues}");
    let current = format!("{min} {default} {max}");
    match host.tcp_mem {
        Some([_, _, high]) if min > page && floor > high.saturating_mul(page) => {
            let fix = format!("sysctl -w {setting}=\"{page} 16384 {max}\" (min one page) and persist it in /etc/sysctl.d/99-fleetlink.conf");
            Finding::warn(setting, current, needed, fix)
        }
        _ => Finding::ok(setting, current, needed),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::doctor::check;
    use crate::doctor::testing::{blocking, finding, tuned, warnings, MILLION};

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
}
