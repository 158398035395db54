//! The brokers under test: a named command line ([`Spec`]) and a running instance
//! ([`Broker`]) that is ready (`GET /readyz` = 200) before a scenario uses it and is stopped
//! (SIGTERM, 15 s grace, SIGKILL) when dropped. The addresses a broker actually bound come from
//! its start-up line, so `--listen-port 0 --admin-port 0` works (the tests run it that way).

use std::collections::BTreeMap;
use std::net::{SocketAddr, TcpListener};
use std::process::Command;
use std::time::{Duration, Instant};

use anyhow::{bail, Context, Result};

use crate::ctx::Ctx;
use crate::http;
use crate::proc::{self, Proc};

/// Which binary a spec runs.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Kind {
    /// fleetlink-fe (monoio, thread per core).
    Fe,
    /// fleetlink-tokio-baseline (tokio multi-thread + tokio-tungstenite).
    Baseline,
}

/// One broker configuration, as it appears in results.
#[derive(Clone, Debug)]
pub(crate) struct Spec {
    /// Row label in tables and plots.
    pub(crate) name: &'static str,
    /// Binary.
    pub(crate) kind: Kind,
    /// Flags beyond the listen/admin addresses and broker id.
    pub(crate) extra: &'static [&'static str],
    /// Fleet mode: `--redis` on the scenario's own redis-server, emptied before each session;
    /// fleetlink-fe also gets `--cores` = CPUs - 1, the playbook's fleet setting.
    pub(crate) redis: bool,
}

impl Spec {
    /// A fleetlink-fe configuration.
    pub(crate) const fn fe(name: &'static str, extra: &'static [&'static str]) -> Self {
        Self {
            name,
            kind: Kind::Fe,
            extra,
            redis: false,
        }
    }

    /// The same configuration in fleet mode (see [`Spec::redis`]).
    pub(crate) const fn fleet(self) -> Self {
        Self {
            redis: true,
            ..self
        }
    }

    /// The tokio baseline as tokio-tungstenite ships it (128 KiB buffers).
    pub(crate) const BASELINE_DEFAULT: Self = Self::baseline("tokio-baseline-default", &[]);

    /// The tokio baseline tuned for many idle connections: every scenario runs both.
    pub(crate) const BASELINE_RB4096: Self = Self::baseline(
        "tokio-baseline-rb4096",
        &["--read-buffer", "4096", "--write-buffer", "0"],
    );

    /// A tokio baseline configuration.
    pub(crate) const fn baseline(name: &'static str, extra: &'static [&'static str]) -> Self {
        Self {
            name,
            kind: Kind::Baseline,
            extra,
            redis: false,
        }
    }

    /// The full command line (binary name first) for `ctx`'s addresses.
    pub(crate) fn argv(&self, ctx: &Ctx) -> Vec<String> {
        let (bin, id) = match self.kind {
            Kind::Fe => (&ctx.bins.fe, "fe-bench"),
            Kind::Baseline => (&ctx.bins.baseline, "tb-bench"),
        };
        let name = bin.file_name().unwrap_or_default().to_string_lossy();
        let mut v = vec![
            name.into_owned(),
            "--listen".into(),
            ctx.listen.to_string(),
            "--admin".into(),
            ctx.admin.to_string(),
            "--broker-id".into(),
            id.into(),
        ];
        if self.kind == Kind::Fe {
            // A short drain so stopping between runs is quick; it does not affect a measurement.
            v.extend(["--drain".into(), "1s".into()]);
        }
        if self.redis {
            let url = ctx
                .redis_url()
                .unwrap_or_else(|| "redis://(not started)".into());
            v.extend(["--redis".into(), url]);
            if self.kind == Kind::Fe {
                let cpus = std::thread::available_parallelism().map_or(1, |n| n.get());
                v.extend(["--cores".into(), cpus.saturating_sub(1).max(1).to_string()]);
            }
        }
        v.extend(self.extra.iter().map(|s| s.to_string()));
        v
    }
}

/// A running, ready broker.
pub(crate) struct Broker {
    proc: Proc,
}

impl Broker {
    /// Starts `spec` on the context's ports (which must be free, unless 0: any), reads the
    /// addresses it bound from its start-up line into `ctx`, and waits for `/readyz`; 30 s in
    /// all.
    pub(crate) fn start(ctx: &Ctx, spec: &Spec) -> Result<Self> {
        for addr in [ctx.listen, ctx.admin] {
            if addr.port() != 0 {
                TcpListener::bind(addr).with_context(|| {
                    format!("port {addr} is in use (pass --listen-port/--admin-port)")
                })?;
            }
        }
        ctx.set_bound(None);
        if spec.redis {
            ctx.redis()?.flush()?;
        }
        let argv = spec.argv(ctx);
        let bin = match spec.kind {
            Kind::Fe => &ctx.bins.fe,
            Kind::Baseline => &ctx.bins.baseline,
        };
        let mut cmd = Command::new(bin);
        cmd.args(&argv[1..]);
        let log = ctx.work_file(spec.name, "log");
        let proc = Proc::spawn(
            &format!("broker {}", spec.name),
            &mut cmd,
            &log,
            Duration::from_secs(15),
        )?;
        let mut b = Self { proc };
        let deadline = Instant::now() + Duration::from_secs(30);
        // fleetlink-fe prints its start-up line on stdout, the baseline on stderr.
        let banner = match spec.kind {
            Kind::Fe => log.clone(),
            Kind::Baseline => log.with_extension("err"),
        };
        let bound = loop {
            b.ensure_running()?;
            let text = std::fs::read_to_string(&banner).unwrap_or_default();
            if let Some(addrs) = bound_addrs(spec.kind, &text) {
                break addrs;
            }
            if Instant::now() >= deadline {
                bail!(
                    "{} printed no start-up line with its addresses in 30 s (log: {})",
                    spec.name,
                    banner.display()
                );
            }
            proc::sleep(Duration::from_millis(20))?;
        };
        ctx.set_bound(Some(bound));
        loop {
            b.ensure_running()?;
            let ready = http::get(ctx.admin_addr(), "/readyz", Duration::from_secs(2));
            if ready.is_ok_and(|r| r.status == 200) {
                return Ok(b);
            }
            if Instant::now() >= deadline {
                bail!(
                    "{} not ready after 30 s (log: {})",
                    spec.name,
                    log.display()
                );
            }
            proc::sleep(Duration::from_millis(50))?;
        }
    }

    /// Fails if the broker process has ended.
    pub(crate) fn ensure_running(&mut self) -> Result<()> {
        if let Some(st) = self.proc.exited()? {
            bail!("{} exited ({st})", self.proc.name());
        }
        Ok(())
    }

    /// CPU time (user + system, all threads) the broker has used since it started.
    pub(crate) fn cpu(&self) -> Result<Duration> {
        self.proc.cpu()
    }

    /// Nanosecond CPU time over live threads, and their count (see [`Proc::cpu_threads`]).
    pub(crate) fn cpu_threads(&self) -> Result<(Duration, usize)> {
        self.proc.cpu_threads()
    }

    /// CPU time per thread group (see [`Proc::cpu_by_thread`]).
    pub(crate) fn cpu_by_thread(&self) -> Result<BTreeMap<String, Duration>> {
        self.proc.cpu_by_thread()
    }

    /// CPU-seconds per thread group between two [`Broker::cpu_by_thread`] readings.
    pub(crate) fn thread_delta(
        before: &BTreeMap<String, Duration>,
        after: &BTreeMap<String, Duration>,
    ) -> serde_json::Value {
        let m: serde_json::Map<String, serde_json::Value> = after
            .iter()
            .map(|(k, v)| {
                let d = v.saturating_sub(before.get(k).copied().unwrap_or_default());
                (
                    k.clone(),
                    ((d.as_secs_f64() * 100.0).round() / 100.0).into(),
                )
            })
            .collect();
        m.into()
    }

    /// Resident set size in KiB.
    pub(crate) fn rss_kb(&self) -> Result<u64> {
        self.proc.rss_kb()
    }

    /// Polls `GET /v1/rigs` every 100 ms until it lists `n` rigs or `deadline` passes; returns
    /// the last count seen and when that reply arrived.
    pub(crate) fn wait_registered(
        &mut self,
        ctx: &Ctx,
        n: usize,
        deadline: Instant,
    ) -> Result<(usize, Instant)> {
        loop {
            self.ensure_running()?;
            let (count, at) = http::rig_count(ctx.admin_addr())?;
            if count >= n || at >= deadline {
                return Ok((count, at));
            }
            proc::sleep(Duration::from_millis(100))?;
        }
    }

    /// Stops the broker now (dropping it does the same).
    pub(crate) fn stop(mut self) {
        self.proc.stop();
    }
}

/// The rig and admin addresses from a broker's start-up line in `log` (complete lines only):
/// fleetlink-fe's `fleetlink-fe ready listen=A admin=B ...`, the baseline's
/// `fleetlink-tokio-baseline: ... rigs on A admin on B ...`.
fn bound_addrs(kind: Kind, log: &str) -> Option<(SocketAddr, SocketAddr)> {
    let complete = &log[..log.rfind('\n')?];
    complete.lines().find_map(|line| {
        let words: Vec<&str> = line.split_whitespace().collect();
        let (rigs, admin) = match kind {
            Kind::Fe
                if words.first() == Some(&"fleetlink-fe") && words.get(1) == Some(&"ready") =>
            {
                let field = |k: &str| words.iter().find_map(|w| w.strip_prefix(k));
                (field("listen=")?, field("admin=")?)
            }
            Kind::Baseline if words.first() == Some(&"fleetlink-tokio-baseline:") => {
                let after = |k: &str| {
                    let at = words.windows(2).position(|w| w == [k, "on"])?;
                    words.get(at + 2).copied()
                };
                (after("rigs")?, after("admin")?)
            }
            _ => return None,
        };
        Some((rigs.parse().ok()?, admin.parse().ok()?))
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn start_up_lines_give_the_bound_addresses() {
        let a = |s: &str| s.parse::<SocketAddr>().unwrap();
        let fe = "fleetlink-fe ready listen=127.0.0.1:41234 admin=127.0.0.1:41235 \
                  broker_id=fe-bench cores=1 driver=io_uring\n";
        assert_eq!(
            bound_addrs(Kind::Fe, fe),
            Some((a("127.0.0.1:41234"), a("127.0.0.1:41235")))
        );
        let tb = "fleetlink-tokio-baseline: broker_id=tb rigs on 127.0.0.1:5 admin on \
                  127.0.0.1:6 read_buffer=4096 write_buffer=0 tls=off redis=off\n";
        assert_eq!(
            bound_addrs(Kind::Baseline, tb),
            Some((a("127.0.0.1:5"), a("127.0.0.1:6")))
        );
        // A line still being written, or another binary's line, is not an answer.
        assert_eq!(bound_addrs(Kind::Fe, fe.trim_end()), None);
        assert_eq!(bound_addrs(Kind::Baseline, fe), None);
        assert_eq!(bound_addrs(Kind::Fe, "warming up\n"), None);
    }
}
