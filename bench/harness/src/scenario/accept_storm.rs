//! `accept-storm`: N rigs connect at once (2 loadgen processes × 1,024 handshakes in flight,
//! 16 source addresses). Per broker and round: wall time from starting the loadgen to
//! `ALL_WELCOMED`, then to `GET /v1/rigs` listing all N, and the broker's CPU-seconds
//! (utime + stime from /proc) over the storm. fleetlink-fe runs with its accept bucket
//! effectively off and on; with it on, refused rigs get 503 + `Retry-After: 5..=15` and the
//! loadgen honours it (it has no cap), so that time includes the Retry-After waits.
//! The `-redis` configurations run in fleet mode against the scenario's own redis-server:
//! there a rig counts as registered once its lease `rig:<id>` is in Redis too, and Redis's CPU
//! over the storm is reported beside the broker's.

use std::time::{Duration, Instant};

use anyhow::Result;
use clap::Args;
use serde_json::{json, Value};

use crate::broker::{Broker, Spec};
use crate::ctx::{parse_duration, Common, Ctx};
use crate::loadgen::{u, u2, RampEnd, Rigs, RigsOpts};
use crate::record::{self, fmt, list, median, ratio, series};

/// Flags of `accept-storm`.
#[derive(Args, Debug)]
pub(crate) struct Opts {
    #[command(flatten)]
    common: Common,
    /// Rigs per storm.
    #[arg(long, default_value_t = 10_000)]
    rigs: usize,
    /// Handshakes in flight per loadgen process.
    #[arg(long, default_value_t = 1024)]
    concurrency: usize,
    /// Loadgen processes.
    #[arg(long, default_value_t = 2)]
    procs: usize,
    /// Bound on one storm (start to ALL_WELCOMED or RAMP_INCOMPLETE).
    #[arg(long, default_value = "120s", value_parser = parse_duration)]
    deadline: Duration,
}

/// The configurations compared; the first is the reference for ratios.
const BROKERS: [Spec; 7] = [
    Spec::fe(
        "fleetlink-fe-bucket-off",
        &["--accept-rate", "1000000", "--accept-burst", "1000000"],
    ),
    Spec::fe(
        "fleetlink-fe-bucket-on",
        &["--accept-rate", "2000", "--accept-burst", "500"],
    ),
    Spec::BASELINE_DEFAULT,
    Spec::BASELINE_RB4096,
    Spec::fe(
        "fleetlink-fe-redis",
        &["--accept-rate", "1000000", "--accept-burst", "1000000"],
    )
    .fleet(),
    Spec::baseline("tokio-baseline-redis-default", &[]).fleet(),
    Spec::baseline(
        "tokio-baseline-redis-rb4096",
        &["--read-buffer", "4096", "--write-buffer", "0"],
    )
    .fleet(),
];

/// Runs every round and writes `accept-storm.{json,md}`.
pub(crate) fn run(o: &Opts) -> Result<()> {
    let ctx = Ctx::new(&o.common)?;
    let brokers = ctx.select(&BROKERS)?;
    ctx.rounds(
        "accept-storm",
        &brokers,
        |spec, round| storm(&ctx, o, spec, round),
        |runs| summarize(&ctx, o, &brokers, runs),
    )
}

/// One storm against a fresh broker.
fn storm(ctx: &Ctx, o: &Opts, spec: &Spec, round: usize) -> Result<Value> {
    let mut broker = Broker::start(ctx, spec)?;
    crate::proc::sleep(Duration::from_millis(500))?; // past start-up work
    let redis = if spec.redis { Some(ctx.redis()?) } else { None };
    let redis_cpu0 = redis.map(|r| r.cpu()).transpose()?;
    if let Some(r) = redis {
        r.reset_stats()?;
    }
    let cpu0 = broker.cpu()?;
    let opts = RigsOpts {
        rigs: o.rigs,
        start_index: 0,
        concurrency: o.concurrency,
        procs: Some(o.procs),
        hold: o.deadline + Duration::from_secs(60),
    };
    let mut rigs = Rigs::start(ctx, &opts, "storm")?;
    let ramp = rigs.wait_ramp(&mut broker, rigs.started + o.deadline)?;
    let cpu_welcomed = broker.cpu()? - cpu0;
    let redis_cpu = match (redis, redis_cpu0) {
        (Some(r), Some(c0)) => Some((r.cpu()? - c0).as_secs_f64()),
        _ => None,
    };
    let scripts = redis.map(|r| r.scripts()).transpose()?;
    // An incomplete ramp can never list all N: read the count once.
    let wait = match ramp.end {
        RampEnd::AllWelcomed => Duration::from_secs(30),
        RampEnd::Incomplete => Duration::ZERO,
    };
    let until = Instant::now() + wait;
    let (listed, mut listed_at) = broker.wait_registered(ctx, o.rigs, until)?;
    // Fleet mode: registered means the leases are in Redis as well.
    let mut leases = None;
    if let Some(r) = redis {
        loop {
            let n = r.count("rig:*")?;
            listed_at = listed_at.max(Instant::now());
            leases = Some(n);
            if n >= o.rigs || Instant::now() >= until {
                break;
            }
            crate::proc::sleep(Duration::from_millis(100))?;
        }
    }
    let cpu_listed = broker.cpu()? - cpu0;
    let started = rigs.started;
    let report = rigs.finish()?;
    broker.stop();
    let ms = |t: Instant| t.duration_since(started).as_secs_f64() * 1e3;
    let complete =
        ramp.end == RampEnd::AllWelcomed && listed == o.rigs && leases.is_none_or(|n| n == o.rigs);
    Ok(json!({
        "broker": spec.name,
        "round": round,
        "complete": complete,
        "ramp_line": ramp.line,
        "welcomed_ms": ms(ramp.at),
        "registered_ms": complete.then(|| ms(listed_at)),
        "listed": listed,
        "leases_in_redis": leases,
        "cpu_s": cpu_welcomed.as_secs_f64(),
        "redis_cpu_s": redis_cpu,
        "redis_script_calls": scripts.map(|s| s.calls),
        "redis_script_ms": scripts.map(|s| s.usec as f64 / 1e3),
        "cpu_to_listed_s": cpu_listed.as_secs_f64(),
        "loadgen_ramp_ms": report["ramp_ms"],
        "welcomed": u(&report, "welcomed"),
        "failed": u(&report, "failed"),
        "failed_by_reason": report["failed_by_reason"],
        "retries_503": u(&report, "retries_503"),
        "retries_4503": u(&report, "retries_4503"),
        "handshake_p50_us": u2(&report, "handshake_us", "p50"),
        "handshake_p99_us": u2(&report, "handshake_us", "p99"),
        "handshake_max_us": u2(&report, "handshake_us", "max"),
    }))
}

fn summarize(ctx: &Ctx, o: &Opts, brokers: &[Spec], runs: Vec<Value>) -> (Value, String) {
    let date = record::now_utc();
    let reference = brokers[0].name;
    let med = |b: &str, k: &str| median(&series(&runs, b, k));
    let mut summary = serde_json::Map::new();
    let mut md = format!(
        "### accept-storm, {date}\n\n{} rigs at once ({} loadgen processes × {} handshakes in \
         flight, 16 source addresses), {} rounds, brokers alternating. Time = loadgen start to \
         `GET /v1/rigs` listing all rigs, and for the `-redis` (fleet-mode) brokers every \
         `rig:<id>` lease in Redis too (medians, s); CPU = broker utime+stime from start to \
         ALL_WELCOMED (median CPU-s), Redis's own beside it in fleet mode, with the time Redis \
         spent in the registry's scripts by its own count (`INFO commandstats`) and their calls. \
         Bucket on = \
         `--accept-rate 2000 --accept-burst 500`: its time includes the 5–15 s Retry-After \
         waits the loadgen honours.\n\n\
         | broker | complete | time (s) | per round | CPU-s | per round | Redis CPU-s | Redis scripts: ms (calls) | handshake p50 / p99 (ms) | 503 retries | failed | time, CPU vs {reference} |\n\
         |---|---|---|---|---|---|---|---|---|---|---|---|\n",
        o.rigs, o.procs, o.concurrency, ctx.rounds
    );
    for spec in brokers {
        let b = spec.name;
        let n = runs.iter().filter(|r| r["broker"] == b).count();
        let complete = runs
            .iter()
            .filter(|r| r["broker"] == b && r["complete"] == true)
            .count();
        let secs: Vec<f64> = series(&runs, b, "registered_ms")
            .iter()
            .map(|m| m / 1e3)
            .collect();
        let (t, cpu) = (median(&secs), med(b, "cpu_s"));
        let (hs50, hs99) = (med(b, "handshake_p50_us"), med(b, "handshake_p99_us"));
        let (t_ref, cpu_ref) = (
            median(&series(&runs, reference, "registered_ms")).map(|m| m / 1e3),
            med(reference, "cpu_s"),
        );
        md += &format!(
            "| {b} | {complete}/{n} | {} | {} | {} | {} | {} | {} | {} / {} | {} | {} | {}, {} |\n",
            fmt(t, 2),
            list(&secs, 2),
            fmt(cpu, 2),
            list(&series(&runs, b, "cpu_s"), 2),
            if spec.redis {
                fmt(med(b, "redis_cpu_s"), 2)
            } else {
                "—".to_string()
            },
            if spec.redis {
                format!(
                    "{} ({})",
                    fmt(med(b, "redis_script_ms"), 1),
                    fmt(med(b, "redis_script_calls"), 0)
                )
            } else {
                "—".to_string()
            },
            fmt(hs50.map(|u| u / 1e3), 1),
            fmt(hs99.map(|u| u / 1e3), 1),
            fmt(med(b, "retries_503"), 0),
            series(&runs, b, "failed").iter().sum::<f64>(),
            ratio(t, t_ref),
            ratio(cpu, cpu_ref),
        );
        summary.insert(
            b.into(),
            json!({"runs": n, "complete": complete, "registered_s_median": t, "cpu_s_median": cpu,
                   "redis_cpu_s_median": med(b, "redis_cpu_s"),
                   "redis_script_ms_median": med(b, "redis_script_ms"),
                   "redis_script_calls_median": med(b, "redis_script_calls"),
                   "welcomed_ms_median": med(b, "welcomed_ms"),
                   "loadgen_ramp_ms_median": med(b, "loadgen_ramp_ms"),
                   "handshake_p50_us_median": hs50, "handshake_p99_us_median": hs99,
                   "command": spec.argv(ctx).join(" ")}),
        );
    }
    let doc = json!({
        "binaries_built": ctx.built, "scenario": "accept-storm", "date": date, "host": record::host(),
        "params": {"rigs": o.rigs, "rounds": ctx.rounds, "loadgen_procs": o.procs,
                   "concurrency_per_proc": o.concurrency, "sources": "127.0.0.1-127.0.0.16",
                   "deadline_s": o.deadline.as_secs_f64()},
        "method": "per broker and round: fresh broker, 0.5 s idle, CPU read; loadgen rigs started; \
                   welcomed_ms = loadgen start to its ALL_WELCOMED line (polled every 10 ms); cpu_s \
                   = broker utime+stime over that span; then GET /v1/rigs polled every 100 ms until \
                   it lists all N, and in fleet mode until Redis holds all N rig:<id> leases \
                   (a SCAN inside Redis every 100 ms): registered_ms (cpu_to_listed_s includes those \
                   GETs). redis_cpu_s = redis-server utime+stime over the same span as cpu_s, \
                   fleet mode only, with redis_script_ms/_calls from INFO commandstats (EVALSHA and \
                   EVAL, reset when the span opens); Redis is emptied before each session. Summary = \
                   medians over rounds; ratios vs fleetlink-fe-bucket-off.",
        "summary": summary,
        "runs": runs,
    });
    (doc, md)
}
