//! What the operator sees: a [`Finding`] per setting, the report printed from them, the exit
//! code, and the entry point `main.rs` calls ([`main_with`], then [`run`]); and the helpers
//! that write a value as text, which the rules use for their findings too.
//!
//! Apart from the rules because the rules decide and this file says it: it owns the output and
//! the exit code, so a rule is tested without capturing output, and the report's layout changes
//! without touching a rule.

use std::io::Write;

use super::{check_max_connections, check_with_backlog, HostSettings, Transport, MAX_CONNECTIONS};

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
    pub(super) fn ok(setting: &'static str, current: String, needed: String) -> Finding {
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

    pub(super) fn warn(
        setting: &'static str,
        current: String,
        needed: String,
        fix: String,
    ) -> Finding {
        Finding::needs_fix(setting, current, needed, fix, false)
    }

    pub(super) fn block(
        setting: &'static str,
        current: String,
        needed: String,
        fix: String,
    ) -> Finding {
        Finding::needs_fix(setting, current, needed, fix, true)
    }

    /// A setting short of what N connections need: `blocking` when the host cannot hold them
    /// until it is fixed.
    fn needs_fix(
        setting: &'static str,
        current: String,
        needed: String,
        fix: String,
        blocking: bool,
    ) -> Finding {
        Finding {
            setting,
            current,
            needed,
            fix,
            blocking,
            ok: false,
        }
    }

    pub(super) fn unreadable(setting: &'static str, needed: String) -> Finding {
        let fix = format!("check that {setting} exists and is readable (run doctor on the host, not in a restricted container)");
        Finding::warn(setting, "unreadable".into(), needed, fix)
    }
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
    max_connections: Option<u64>,
) -> std::process::ExitCode {
    let cores = cores
        .or_else(|| std::thread::available_parallelism().ok())
        .map_or(1, std::num::NonZeroUsize::get);
    let port = listen.map_or(transport.default_port(), |a| a.port());
    let code = run(
        connections,
        cores,
        transport,
        (port, backlog, max_connections),
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
    (port, backlog, max_connections): (u16, u64, Option<u64>),
    out: &mut dyn Write,
) -> i32 {
    let host = HostSettings::read();
    let mut findings = check_with_backlog(&host, connections, cores, transport, port, backlog);
    findings.push(check_max_connections(max_connections, connections));
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

pub(super) fn limit_text(v: Option<u64>) -> String {
    v.map_or("unlimited".into(), |v| v.to_string())
}

pub(super) fn limit_text_bytes(v: Option<u64>) -> String {
    v.map_or("unlimited".into(), bytes_text)
}

pub(super) fn opt_text(v: Option<u64>) -> String {
    v.map_or("unreadable".into(), |v| v.to_string())
}

pub(super) fn bytes_text(b: u64) -> String {
    const GIB: u64 = 1 << 30;
    const MIB: u64 = 1 << 20;
    match b {
        b if b >= GIB => format!("{:.1} GiB", b as f64 / GIB as f64),
        b if b >= MIB => format!("{:.1} MiB", b as f64 / MIB as f64),
        b if b >= 1024 => format!("{:.1} KiB", b as f64 / 1024.0),
        b => format!("{b} B"),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::doctor::testing::{finding, tuned};
    use crate::doctor::{check, LISTEN_BACKLOG};

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
            (8080, LISTEN_BACKLOG, None),
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
    fn run_prints_every_setting() {
        let mut out = Vec::new();
        let code = run(
            1_000,
            2,
            Transport::Plain,
            (8080, LISTEN_BACKLOG, None),
            &mut out,
        );
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
