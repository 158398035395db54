//! What every scenario shares: where the binaries are, the ports brokers listen on, the work
//! directory for child logs and loadgen reports, and where results go.

use std::cell::{Cell, OnceCell};
use std::net::{Ipv4Addr, SocketAddr};
use std::path::PathBuf;
use std::time::Duration;

use anyhow::{bail, Context, Result};
use clap::Args;
use serde_json::Value;

use crate::broker::Spec;
use crate::record;
use crate::redis;

/// Flags common to the measuring scenarios.
#[derive(Args, Debug, Clone)]
pub(crate) struct Common {
    /// Rounds; each round runs every broker once, in an order that rotates per round.
    #[arg(long, default_value_t = 3)]
    pub(crate) rounds: usize,
    /// Results directory (`<scenario>.json`, `<scenario>.md`). Default: bench/results of the
    /// source tree this binary was built from.
    #[arg(long, default_value = concat!(env!("CARGO_MANIFEST_DIR"), "/../results"), hide_default_value = true)]
    pub(crate) out: PathBuf,
    /// Directory holding fleetlink-fe, fleetlink-tokio-baseline and fleetlink-loadgen
    /// (default: this binary's own directory, i.e. the workspace's target/release).
    #[arg(long)]
    pub(crate) bin_dir: Option<PathBuf>,
    /// Rig websocket port of the broker under test (127.0.0.1). Keep ports out of the
    /// ephemeral range (net.ipv4.ip_local_port_range: 32768-60999 by default, 10000-65535 with
    /// tuning/sysctl.d), where the loadgen's client sockets may hold them. 0: each broker
    /// binds a port of the kernel's choosing, read back from its start-up line (no port to
    /// collide with, as the tests run it).
    #[arg(long, default_value_t = 25080)]
    pub(crate) listen_port: u16,
    /// Admin HTTP port of the broker under test (127.0.0.1); 0 as for `--listen-port`.
    #[arg(long, default_value_t = 25090)]
    pub(crate) admin_port: u16,
    /// Only these broker configurations (comma-separated names; the first is the reference
    /// for ratios). Default: all of the scenario's; an unknown name is refused with the list.
    #[arg(long, value_delimiter = ',')]
    pub(crate) brokers: Option<Vec<String>>,
    /// Suffix for the result files: `<scenario>-<name>.json` / `.md`.
    #[arg(long)]
    pub(crate) name: Option<String>,
}

/// Paths of the three binaries a scenario runs.
pub(crate) struct Bins {
    /// The broker under test.
    pub(crate) fe: PathBuf,
    /// The tokio + tokio-tungstenite comparison broker.
    pub(crate) baseline: PathBuf,
    /// Rigs and the admin sender.
    pub(crate) loadgen: PathBuf,
}

/// Shared state of one harness invocation.
pub(crate) struct Ctx {
    /// Binaries under test.
    pub(crate) bins: Bins,
    /// Child logs and loadgen reports; kept when a scenario fails.
    pub(crate) work: PathBuf,
    /// Results directory.
    pub(crate) out: PathBuf,
    /// Rig endpoint address brokers are told to bind (port 0: any).
    pub(crate) listen: SocketAddr,
    /// Admin endpoint address brokers are told to bind (port 0: any).
    pub(crate) admin: SocketAddr,
    /// Rig and admin addresses the running broker reported binding (its start-up line).
    bound: Cell<Option<(SocketAddr, SocketAddr)>>,
    /// Rounds per scenario.
    pub(crate) rounds: usize,
    /// Build time (mtime, UTC) of each binary, for the record.
    pub(crate) built: serde_json::Value,
    /// `--brokers`, if given.
    only: Option<Vec<String>>,
    /// `--name`, if given.
    name: Option<String>,
    /// Numbers log files so no run overwrites another's.
    seq: Cell<u32>,
    /// The fleet-mode brokers' redis-server, started when the first one needs it.
    redis: OnceCell<redis::Server>,
}

impl Ctx {
    /// Resolves binaries (failing with the build command if one is missing) and makes the
    /// work directory.
    pub(crate) fn new(c: &Common) -> Result<Self> {
        let dir = match &c.bin_dir {
            Some(d) => d.clone(),
            None => std::env::current_exe()?
                .parent()
                .context("binary without a directory")?
                .to_path_buf(),
        };
        if c.rounds == 0 {
            bail!("--rounds must be at least 1");
        }
        let work = work_dir();
        std::fs::create_dir_all(work.join("bin"))?;
        std::fs::create_dir_all(&c.out)?;
        let out = c.out.canonicalize()?;
        // Every round runs private copies: other people rebuilding target/release mid-run
        // cannot mix two builds into one comparison.
        let mut built = serde_json::Map::new();
        let mut bin = |name: &str| -> Result<PathBuf> {
            let p = dir.join(name);
            if !p.is_file() {
                bail!(
                    "{} not found; build it: cargo build --release -p fleetlink -p fleetlink-bench \
                     -p fleetlink-loadgen -p fleetlink-tokio-baseline --bin fleetlink-fe",
                    p.display()
                );
            }
            let mtime = std::fs::metadata(&p)?.modified()?;
            built.insert(name.into(), crate::record::utc(mtime).into());
            let copy = work.join("bin").join(name);
            std::fs::copy(&p, &copy).with_context(|| format!("copying {}", p.display()))?;
            Ok(copy)
        };
        let bins = Bins {
            fe: bin("fleetlink-fe")?,
            baseline: bin("fleetlink-tokio-baseline")?,
            loadgen: bin("fleetlink-loadgen")?,
        };
        let local = |port| SocketAddr::from((Ipv4Addr::LOCALHOST, port));
        Ok(Self {
            bins,
            work,
            out,
            listen: local(c.listen_port),
            admin: local(c.admin_port),
            bound: Cell::new(None),
            rounds: c.rounds,
            built: built.into(),
            only: c.brokers.clone(),
            name: c.name.clone(),
            seq: Cell::new(0),
            redis: OnceCell::new(),
        })
    }

    /// Where the running broker takes rigs: what it reported binding, else what it was told.
    pub(crate) fn rig_addr(&self) -> SocketAddr {
        self.bound.get().map_or(self.listen, |(rigs, _)| rigs)
    }

    /// Where the running broker's admin API is (as [`Ctx::rig_addr`]).
    pub(crate) fn admin_addr(&self) -> SocketAddr {
        self.bound.get().map_or(self.admin, |(_, admin)| admin)
    }

    /// Records the addresses a starting broker reported (`None` before a new one starts).
    pub(crate) fn set_bound(&self, addrs: Option<(SocketAddr, SocketAddr)>) {
        self.bound.set(addrs);
    }

    /// The scenario's redis-server, started on first use.
    pub(crate) fn redis(&self) -> Result<&redis::Server> {
        if self.redis.get().is_none() {
            let server = redis::Server::start(&self.work_file("redis-server", "log"))?;
            // Set once: a scenario runs on one thread.
            let _ = self.redis.set(server);
        }
        self.redis.get().context("redis-server")
    }

    /// Its URL once started.
    pub(crate) fn redis_url(&self) -> Option<String> {
        self.redis.get().map(redis::Server::url)
    }

    /// The scenario's configurations, narrowed and ordered by `--brokers`.
    pub(crate) fn select(&self, all: &[Spec]) -> Result<Vec<Spec>> {
        let Some(only) = &self.only else {
            return Ok(all.to_vec());
        };
        only.iter()
            .map(|n| {
                all.iter().find(|s| s.name == n).cloned().with_context(|| {
                    let names: Vec<_> = all.iter().map(|s| s.name).collect();
                    format!(
                        "unknown broker {n:?}; this scenario has {}",
                        names.join(", ")
                    )
                })
            })
            .collect()
    }

    /// Result file stem: the scenario, plus `-<name>` with `--name`.
    pub(crate) fn result_name(&self, scenario: &str) -> String {
        match &self.name {
            Some(n) => format!("{scenario}-{n}"),
            None => scenario.to_string(),
        }
    }

    /// A fresh path in the work directory: `<nn>-<tag>.<ext>`.
    pub(crate) fn work_file(&self, tag: &str, ext: &str) -> PathBuf {
        let n = self.seq.get() + 1;
        self.seq.set(n);
        self.work.join(format!("{n:03}-{tag}.{ext}"))
    }

    /// The broker order for round `r` (0-based): the list rotated by `r`, so no broker always
    /// runs first (right after a build, or after the slowest one).
    pub(crate) fn rotation<T: Clone>(items: &[T], r: usize) -> Vec<T> {
        let mut v = items.to_vec();
        if !v.is_empty() {
            let k = r % v.len();
            v.rotate_left(k);
        }
        v
    }

    /// A whole scenario: `one(spec, round)` (round 1-based) for every broker in every round, in
    /// the rotated order, then `summarize` over all runs, written as `<scenario>.{json,md}` and
    /// printed. The work directory is removed only on success, so a failed run's logs stay.
    pub(crate) fn rounds(
        &self,
        scenario: &str,
        brokers: &[Spec],
        mut one: impl FnMut(&Spec, usize) -> Result<Value>,
        summarize: impl FnOnce(Vec<Value>) -> (Value, String),
    ) -> Result<()> {
        let mut runs = Vec::new();
        for r in 0..self.rounds {
            for spec in Self::rotation(brokers, r) {
                eprintln!(
                    "bench: {scenario} round {}/{}: {}",
                    r + 1,
                    self.rounds,
                    spec.name
                );
                let started = record::now_utc();
                let mut run = one(&spec, r + 1)?;
                // Wall-clock bounds, to match a run against other load on the machine.
                run["started"] = started.into();
                run["ended"] = record::now_utc().into();
                eprintln!("bench:   {run}");
                runs.push(run);
            }
        }
        let (doc, md) = summarize(runs);
        record::write(&self.out, &self.result_name(scenario), &doc, &md)?;
        println!("{md}");
        self.clean();
        Ok(())
    }

    /// Removes the work directory (after a successful scenario).
    pub(crate) fn clean(&self) {
        let _ = std::fs::remove_dir_all(&self.work);
    }
}

/// This invocation's directory for child logs and loadgen reports.
pub(crate) fn work_dir() -> PathBuf {
    std::env::temp_dir().join(format!("fleetlink-bench.{}", std::process::id()))
}

/// `250ms`, `30s`, `2m` or a bare number of seconds.
pub(crate) fn parse_duration(s: &str) -> Result<Duration, String> {
    let split = s
        .find(|c: char| !c.is_ascii_digit() && c != '.')
        .unwrap_or(s.len());
    let (num, unit) = s.split_at(split);
    let n: f64 = num.parse().map_err(|_| format!("bad duration {s:?}"))?;
    let secs = match unit {
        "" | "s" => n,
        "ms" => n / 1000.0,
        "m" => n * 60.0,
        _ => return Err(format!("bad duration unit in {s:?} (use ms, s, m)")),
    };
    Duration::try_from_secs_f64(secs).map_err(|_| format!("bad duration {s:?}"))
}

/// A duration as the loadgen's flags take it (whole milliseconds).
pub(crate) fn arg_duration(d: Duration) -> String {
    format!("{}ms", d.as_millis())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn durations() {
        assert_eq!(parse_duration("250ms"), Ok(Duration::from_millis(250)));
        assert_eq!(parse_duration("30s"), Ok(Duration::from_secs(30)));
        assert_eq!(parse_duration("2m"), Ok(Duration::from_secs(120)));
        assert_eq!(parse_duration("5"), Ok(Duration::from_secs(5)));
        assert!(parse_duration("5h").is_err());
        assert_eq!(arg_duration(Duration::from_secs(2)), "2000ms");
    }

    #[test]
    fn rounds_rotate_stamp_and_write() {
        let dir = std::env::temp_dir().join(format!("fleetlink-bench-test.{}", std::process::id()));
        let (work, out) = (dir.join("work"), dir.join("out"));
        std::fs::create_dir_all(&work).unwrap();
        std::fs::create_dir_all(&out).unwrap();
        let local = |port| SocketAddr::from((Ipv4Addr::LOCALHOST, port));
        let ctx = Ctx {
            bins: Bins {
                fe: "fe".into(),
                baseline: "baseline".into(),
                loadgen: "loadgen".into(),
            },
            work: work.clone(),
            out: out.clone(),
            listen: local(1),
            admin: local(2),
            bound: Cell::new(None),
            rounds: 2,
            built: Value::Null,
            only: None,
            name: Some("t".into()),
            seq: Cell::new(0),
            redis: OnceCell::new(),
        };
        let brokers = [Spec::fe("a", &[]), Spec::baseline("b", &[])];
        let mut order = Vec::new();
        ctx.rounds(
            "scn",
            &brokers,
            |spec, round| {
                order.push((spec.name, round));
                Ok(serde_json::json!({"broker": spec.name}))
            },
            |runs| {
                assert!(runs
                    .iter()
                    .all(|r| r["started"].is_string() && r["ended"].is_string()));
                (serde_json::json!({"runs": runs.len()}), "| md |".into())
            },
        )
        .unwrap();
        assert_eq!(order, [("a", 1), ("b", 1), ("b", 2), ("a", 2)]);
        let doc = std::fs::read_to_string(out.join("scn-t.json")).unwrap();
        assert_eq!(doc, "{\n  \"runs\": 4\n}\n");
        assert!(!work.exists(), "work directory kept after success");
        let _ = std::fs::remove_dir_all(&dir);
    }

    #[test]
    fn rotation_moves_the_first_broker() {
        let b = ["a", "b", "c"];
        assert_eq!(Ctx::rotation(&b, 0), ["a", "b", "c"]);
        assert_eq!(Ctx::rotation(&b, 1), ["b", "c", "a"]);
        assert_eq!(Ctx::rotation(&b, 4), ["b", "c", "a"]);
    }
}
