//! Value parsers, apart from the flags that name them: a value that does not parse fails the load
//! (exit 2, or 64 from the file), not validation; `fleetctl` and the agent parse durations here.

use std::net::SocketAddr;
use std::time::Duration;

use super::settings::MAX_CORES;

/// The longest duration any flag takes: a deadline that far ahead always fits the clock.
pub const MAX_DURATION: Duration = Duration::from_secs(365 * 24 * 3600);

/// `--cores`: a whole number; its range (1 to 1024) is checked with the other values',
/// wherever the value came from.
pub(super) fn parse_cores(s: &str) -> Result<usize, String> {
    s.trim()
        .parse()
        .map_err(|_| format!("{s:?} is not a number of cores (1 to {MAX_CORES})"))
}

/// [`parse_duration`] for the broker's flags, whose values may also come from its `--config`
/// file, where a duration is a string.
pub(super) fn parse_broker_duration(s: &str) -> Result<Duration, String> {
    parse_duration(s).map_err(|e| {
        // A bare number is what a TOML file's `ping-interval = 20` hands over.
        if s.trim().bytes().all(|b| b.is_ascii_digit() || b == b'.') {
            format!("{e} (in a --config file, a string: \"20s\")")
        } else {
            e
        }
    })
}

/// A whole-number flag (`--outbox`, `--max-message`, ...), said plainly when it is not one:
/// clap's own parser answered "invalid digit found in string", and a negative value never
/// reached it ("unexpected argument '-1' found": hence `allow_negative_numbers` on these flags).
/// Its range is checked with the other values', wherever the value came from.
fn whole<T: TryFrom<u64>>(s: &str, max: u64) -> Result<T, String> {
    let refused = || format!("{s:?} is not a whole number from 0 to {max} in plain digits");
    // Rust's parser takes a leading `+`, which plain digits do not have (review bb132).
    if s.trim().starts_with('+') {
        return Err(refused());
    }
    let n = s.trim().parse::<u64>().map_err(|e| match e.kind() {
        std::num::IntErrorKind::PosOverflow => format!("{s} is more than {max}"),
        _ => refused(),
    })?;
    T::try_from(n).map_err(|_| format!("{s} is more than {max}"))
}

/// [`whole`] for a `u32` flag.
pub(super) fn parse_u32(s: &str) -> Result<u32, String> {
    whole(s, u32::MAX.into())
}

/// [`whole`] for a `u64` flag.
pub(super) fn parse_u64(s: &str) -> Result<u64, String> {
    whole(s, u64::MAX)
}

/// [`whole`] for a `usize` flag.
pub(super) fn parse_usize(s: &str) -> Result<usize, String> {
    whole(s, usize::MAX as u64)
}

/// [`whole`] for an `i32` flag (`--backlog`, which the kernel takes as an int).
pub(super) fn parse_i32(s: &str) -> Result<i32, String> {
    whole(s, i32::MAX as u64)
}

/// A rate flag (`--accept-rate`, `--rig-rate`): a decimal number; its range (more than 0, and
/// finite) is checked with the other values'.
pub(super) fn parse_rate(s: &str) -> Result<f64, String> {
    s.trim()
        .parse::<f64>()
        .map_err(|_| format!("{s:?} is not a number per second, such as 50 or 2.5"))
}

/// `dev-certs --rigs`: at most 100,000.
pub(super) fn parse_rig_count(s: &str) -> Result<usize, String> {
    match s.parse::<usize>() {
        Ok(n) if n <= 100_000 => Ok(n),
        _ => Err(format!(
            "{s:?}: a number of rig certificates from 0 to 100000"
        )),
    }
}

/// An address to bind: `ADDRESS:PORT`, `HOST:PORT` (the first address it resolves to) or
/// `:PORT` (every IPv4 address, as the defaults are written).
pub fn parse_addr(s: &str) -> Result<SocketAddr, String> {
    use std::net::ToSocketAddrs;
    if let Some(port) = s.strip_prefix(':') {
        let port: u16 = port.parse().map_err(|_| format!("{s:?}: not a port"))?;
        return Ok(SocketAddr::from(([0, 0, 0, 0], port)));
    }
    if let Ok(addr) = s.parse() {
        return Ok(addr);
    }
    s.to_socket_addrs()
        .map_err(|e| format!("{s:?}: {e} (expected ADDRESS:PORT, HOST:PORT or :PORT)"))?
        .next()
        .ok_or_else(|| format!("{s:?}: the name resolves to no address"))
}

/// Parses `250ms`, `20s`, `5m`, `1h`, at most [`MAX_DURATION`]. A number without a unit is
/// refused (`--drain 120000` meant as ms would be 33 hours), except `0`, which is the same in
/// every unit.
pub fn parse_duration(s: &str) -> Result<Duration, String> {
    let s = s.trim();
    if s.chars().all(|c| c.is_ascii_digit() || c == '.') && !s.is_empty() {
        if s.parse::<f64>() == Ok(0.0) {
            return Ok(Duration::ZERO);
        }
        return Err(format!(
            "{s:?} has no unit: write it as 250ms, 20s, 5m or 1h"
        ));
    }
    let split = s
        .find(|c: char| !c.is_ascii_digit() && c != '.')
        .unwrap_or(s.len());
    let (num, unit) = s.split_at(split);
    let n: f64 = num
        .parse()
        .map_err(|_| format!("bad duration {s:?} (use e.g. 250ms, 20s, 5m)"))?;
    let secs = match unit {
        "ms" => n / 1000.0,
        "s" => n,
        "m" => n * 60.0,
        "h" => n * 3600.0,
        _ => return Err(format!("bad duration unit in {s:?} (ms, s, m, h)")),
    };
    // Only digits and dots got here, so `secs` is never negative, but it can be beyond what a
    // Duration holds, or infinite (hundreds of digits): an error, not `from_secs_f64`'s panic.
    Duration::try_from_secs_f64(secs)
        .ok()
        .filter(|d| *d <= MAX_DURATION)
        .ok_or_else(|| format!("duration {s:?} is too long: at most 365 days"))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::testing::{config_file, load};

    /// The contract writes the TLS default as `:8443`; an operator writes host names.
    #[test]
    fn addresses_take_a_bare_port_and_host_names() {
        let c = load(&["--listen", ":8443", "--admin", "localhost:9191"]).unwrap();
        assert_eq!(c.listen, "0.0.0.0:8443".parse().unwrap());
        assert!(
            c.admin.ip().is_loopback() && c.admin.port() == 9191,
            "{}",
            c.admin
        );
        assert_eq!(
            load(&["--listen", "[::1]:80"]).unwrap().listen,
            "[::1]:80".parse().unwrap()
        );
        for bad in [":", ":99999", "8080", "no-such-host.invalid:80"] {
            assert!(load(&["--listen", bad]).is_err(), "{bad}");
        }
    }

    #[test]
    fn durations() {
        assert_eq!(parse_duration("250ms"), Ok(Duration::from_millis(250)));
        assert_eq!(parse_duration("20s"), Ok(Duration::from_secs(20)));
        assert_eq!(parse_duration("5m"), Ok(Duration::from_secs(300)));
        assert_eq!(parse_duration("1.5s"), Ok(Duration::from_millis(1500)));
        assert!(parse_duration("5x").is_err());
        assert!(parse_duration("").is_err());
    }

    #[test]
    fn a_duration_without_a_unit_is_refused_except_zero() {
        for bare in ["3", "120000", "0.5", "5."] {
            let e = parse_duration(bare).unwrap_err();
            assert!(
                e.contains("no unit") && e.contains("250ms, 20s, 5m"),
                "{bare}: {e}"
            );
        }
        assert_eq!(parse_duration("0"), Ok(Duration::ZERO));
        assert_eq!(parse_duration("0.0"), Ok(Duration::ZERO));
        // Flags, environment and config file alike.
        let e = load(&["--ping-interval", "5"]).unwrap_err().to_string();
        assert!(e.contains("no unit"), "{e}");
        let file = config_file("bare-duration.toml", "drain = 120000\n");
        let e = load(&["--config", file.to_str().unwrap()]).unwrap_err();
        assert!(
            e.downcast_ref::<clap::Error>().is_none(),
            "a config-file error"
        );
        let e = e.to_string();
        assert!(
            e.starts_with("config ") && e.contains("--drain") && e.contains("no unit"),
            "{e}"
        );
        assert!(!e.contains("Usage"), "one line: {e}");
        let file = config_file("unit-duration.toml", "drain = \"2m\"\n");
        let c = load(&["--config", file.to_str().unwrap()]).unwrap();
        assert_eq!(c.drain, Duration::from_secs(120));
    }

    #[test]
    fn huge_durations_are_errors_not_panics() {
        for huge in [
            "99999999999999999999s",
            "99999999999999999999999ms",
            "9999999999999999999m",
            "99999999999999999999h",
            format!("{}s", "1".repeat(400)).as_str(),
        ] {
            let e = parse_duration(huge).unwrap_err();
            assert!(e.contains("too long"), "{huge}: {e}");
        }
        // Up to a year parses; a second more does not.
        assert_eq!(parse_duration("8760h"), Ok(MAX_DURATION));
        assert!(parse_duration("31536001s").is_err());
        let e = load(&["--drain", "99999999999999999999s"]).unwrap_err();
        let e = e.downcast::<clap::Error>().expect("a clap error");
        assert_eq!(e.kind(), clap::error::ErrorKind::ValueValidation);
        assert!(e.to_string().contains("too long"), "{e}");
    }
}
