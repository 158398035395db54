//! `fleetlink-loadgen` as a child process: `rigs` (open N rigs, hold them, ack every command)
//! and `admin-fanout` (POST commands through the admin API). The harness reads the one
//! `ALL_WELCOMED` / `RAMP_INCOMPLETE` line from the rigs' stdout file and their JSON report
//! once they are stopped; it never reimplements what the loadgen measures.

use std::path::PathBuf;
use std::process::Command;
use std::time::{Duration, Instant};

use anyhow::{bail, Context, Result};
use serde_json::Value;

use crate::broker::Broker;
use crate::ctx::{arg_duration, Ctx};
use crate::proc::{self, Proc};

/// What a `rigs` run does.
pub(crate) struct RigsOpts {
    /// Rigs to open.
    pub(crate) rigs: usize,
    /// Index of the first rig (`rig-<index:06>`), so several loadgens hold disjoint rigs.
    pub(crate) start_index: usize,
    /// Handshakes in flight per loadgen process.
    pub(crate) concurrency: usize,
    /// Loadgen processes (`None`: the loadgen's default, ≤ 18,000 sockets each).
    pub(crate) procs: Option<usize>,
    /// Upper bound on the hold; the harness normally ends it earlier with SIGTERM.
    pub(crate) hold: Duration,
}

/// How the ramp ended.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum RampEnd {
    /// Every rig was welcomed.
    AllWelcomed,
    /// Some rigs failed for good (the welcomed ones are still held).
    Incomplete,
}

/// The ramp's end line and when the harness saw it.
pub(crate) struct Ramp {
    /// Which line.
    pub(crate) end: RampEnd,
    /// The line itself (`ALL_WELCOMED rigs=N elapsed_ms=T` or `RAMP_INCOMPLETE …`).
    pub(crate) line: String,
    /// When the harness read it (polling every 10 ms).
    pub(crate) at: Instant,
}

/// A running `fleetlink-loadgen rigs`.
pub(crate) struct Rigs {
    proc: Proc,
    out: PathBuf,
    report: PathBuf,
    /// When the process was started.
    pub(crate) started: Instant,
}

impl Rigs {
    /// Starts the rigs against the running broker's rig address.
    pub(crate) fn start(ctx: &Ctx, o: &RigsOpts, tag: &str) -> Result<Self> {
        let out = ctx.work_file(tag, "out");
        let report = out.with_extension("json");
        let mut cmd = Command::new(&ctx.bins.loadgen);
        cmd.arg("rigs")
            .args(["--url", &format!("ws://{}/agent", ctx.rig_addr())])
            .args(["--rigs", &o.rigs.to_string()])
            .args(["--start-index", &o.start_index.to_string()])
            .args(["--concurrency", &o.concurrency.to_string()])
            .args(["--sources", "127.0.0.1-127.0.0.16"])
            .args(["--hold", &arg_duration(o.hold)])
            .args([
                "--max-time",
                &arg_duration(o.hold + Duration::from_secs(300)),
            ])
            .arg("--report")
            .arg(&report);
        if let Some(p) = o.procs {
            cmd.args(["--procs", &p.to_string()]);
        }
        let started = Instant::now();
        // The loadgen closes every rig with 1000 and merges its workers' reports on SIGTERM.
        let proc = Proc::spawn(
            &format!("loadgen {tag}"),
            &mut cmd,
            &out,
            Duration::from_secs(60),
        )?;
        Ok(Self {
            proc,
            out,
            report,
            started,
        })
    }

    /// Waits for the ramp's end line until `deadline`, failing if the loadgen or the broker
    /// exits first.
    pub(crate) fn wait_ramp(&mut self, broker: &mut Broker, deadline: Instant) -> Result<Ramp> {
        loop {
            let text = std::fs::read_to_string(&self.out).unwrap_or_default();
            for (prefix, end) in [
                ("ALL_WELCOMED", RampEnd::AllWelcomed),
                ("RAMP_INCOMPLETE", RampEnd::Incomplete),
            ] {
                if let Some(line) = text.lines().find(|l| l.starts_with(prefix)) {
                    return Ok(Ramp {
                        end,
                        line: line.to_string(),
                        at: Instant::now(),
                    });
                }
            }
            broker.ensure_running()?;
            if let Some(st) = self.proc.exited()? {
                bail!(
                    "loadgen exited during the ramp ({st}); see {}",
                    self.out.display()
                );
            }
            if Instant::now() >= deadline {
                bail!(
                    "ramp not over by the deadline; see {}.err",
                    self.out.display()
                );
            }
            proc::sleep(Duration::from_millis(10))?;
        }
    }

    /// Ends the hold (SIGTERM), waits for the loadgen to exit and returns its report.
    pub(crate) fn finish(mut self) -> Result<Value> {
        self.proc.stop();
        let text = std::fs::read_to_string(&self.report)
            .with_context(|| format!("no loadgen report; see {}.err", self.out.display()))?;
        serde_json::from_str(&text).context("loadgen report is not JSON")
    }
}

/// Runs `admin-fanout` to completion: `count` rounds of one command to each of `rigs` rigs over
/// `conns` keep-alive connections, ended by `max_time` at the latest. Returns its summary.
pub(crate) fn admin_fanout(
    ctx: &Ctx,
    rigs: usize,
    count: usize,
    conns: usize,
    max_time: Duration,
) -> Result<Value> {
    let out = ctx.work_file("admin-fanout", "out");
    let report = out.with_extension("json");
    let mut cmd = Command::new(&ctx.bins.loadgen);
    cmd.arg("admin-fanout")
        .args(["--admin", &format!("http://{}", ctx.admin_addr())])
        .args(["--rigs", &rigs.to_string()])
        .args(["--count", &count.to_string()])
        .args(["--concurrency", &conns.to_string()])
        .args(["--max-time", &arg_duration(max_time)])
        .arg("--report")
        .arg(&report);
    let mut p = Proc::spawn(
        "loadgen admin-fanout",
        &mut cmd,
        &out,
        Duration::from_secs(5),
    )?;
    // Exit 2 only means some commands were not sent (expected when max_time ends the run).
    if p.wait_until(Instant::now() + max_time + Duration::from_secs(30))?
        .is_none()
    {
        bail!("admin-fanout overran its --max-time; see {}", out.display());
    }
    let text = std::fs::read_to_string(&report)
        .with_context(|| format!("no admin-fanout report; see {}.err", out.display()))?;
    serde_json::from_str(&text).context("admin-fanout report is not JSON")
}

/// `v[key]` as u64 (0 when absent).
pub(crate) fn u(v: &Value, key: &str) -> u64 {
    v.get(key).and_then(Value::as_u64).unwrap_or(0)
}

/// `v[a][b]` as u64, if present.
pub(crate) fn u2(v: &Value, a: &str, b: &str) -> Option<u64> {
    v.get(a)?.get(b)?.as_u64()
}
