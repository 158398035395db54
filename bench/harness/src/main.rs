//! `fleetlink-bench`: end-to-end scenarios comparing fleetlink-fe with the tokio baseline, each
//! broker run alternately in one invocation, plus SVG plots of the results.
//!
//! ```text
//! fleetlink-bench accept-storm [--rigs 10000] [--rounds 3] [--out bench/results]
//! fleetlink-bench idle-cost    [--rigs 10000] [--window 60s]
//! fleetlink-bench throughput   [--rigs 1000] [--duration 30s] [--conns 8]
//! fleetlink-bench plots        [--out bench/results] [--name SFX]
//! fleetlink-bench density|latency|tls|redis-restart [ARGS…]   # the bench/*.sh scenarios
//! ```
//!
//! Module map: `ctx` (binaries, ports, work dir), `proc` (children stopped on drop, /proc CPU),
//! `broker` (configurations, start until ready), `loadgen` (the existing load generator as a
//! child), `http` (admin GETs), `record` (JSON + markdown output, medians), `scenario::*`,
//! `plots`. Everything started is stopped on return, error, panic or SIGINT/SIGTERM.

#![warn(missing_docs, unreachable_pub)]

mod broker;
mod ctx;
mod http;
mod loadgen;
mod plots;
mod proc;
mod record;
mod redis;
mod scenario;
mod scripts;

use anyhow::Result;
use clap::{Parser, Subcommand};

#[derive(Parser)]
#[command(
    version,
    about = "fleetlink end-to-end benchmarks against the tokio baseline"
)]
struct Cli {
    #[command(subcommand)]
    scenario: Scenario,
}

#[derive(Subcommand)]
enum Scenario {
    /// N rigs connect at once: time until all are welcomed and listed, broker CPU-seconds.
    AcceptStorm(scenario::accept_storm::Opts),
    /// Broker CPU-seconds per minute with N idle rigs at the default ping interval.
    IdleCost(scenario::idle_cost::Opts),
    /// Commands/s acked through the admin API, per wall second and per broker CPU-second.
    Throughput(scenario::throughput::Opts),
    /// SVGs from one run's density-*.json and latency-*.json (`--name`: which run).
    Plots(plots::Opts),
    /// Bytes per idle connection at 1k-19k rigs, each broker (bench/compare-density.sh;
    /// `density --help` for its flags).
    Density(scripts::Passed),
    /// Fan-out and single-command latency through Redis and the admin API
    /// (bench/latency.sh; `latency --help` for its flags).
    Latency(scripts::Passed),
    /// TLS memory per connection and handshake rate (bench/tls.sh).
    Tls(scripts::Passed),
    /// Sessions kept again after Redis restarts empty (bench/redis-restart.sh).
    RedisRestart(scripts::Passed),
}

fn main() -> Result<()> {
    proc::install_signal_flag()?;
    let result = match Cli::parse().scenario {
        Scenario::AcceptStorm(o) => scenario::accept_storm::run(&o),
        Scenario::IdleCost(o) => scenario::idle_cost::run(&o),
        Scenario::Throughput(o) => scenario::throughput::run(&o),
        Scenario::Plots(o) => plots::run(&o),
        Scenario::Density(a) => scripts::exec("compare-density.sh", &a),
        Scenario::Latency(a) => scripts::exec("latency.sh", &a),
        Scenario::Tls(a) => scripts::exec("tls.sh", &a),
        Scenario::RedisRestart(a) => scripts::exec("redis-restart.sh", &a),
    };
    if result.is_err() {
        let work = ctx::work_dir();
        // The logs are what a failed run leaves for its reader; the copied binaries (about
        // 125 MB) would only pile up in /tmp run after run.
        let _ = std::fs::remove_dir_all(work.join("bin"));
        let kept = std::fs::read_dir(&work).is_ok_and(|mut d| d.next().is_some());
        if kept {
            eprintln!("bench: child logs kept in {}", work.display());
        } else {
            let _ = std::fs::remove_dir(&work);
        }
    }
    result
}
