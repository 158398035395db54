//! `throughput`: sustained commands through the admin API to N rigs that ack each one. Per
//! broker and round: ramp N rigs, then `fleetlink-loadgen admin-fanout` POSTs one command per
//! rig, round after round, over a few keep-alive connections until `--duration` ends it. The
//! figures are acks sent by the rigs (loadgen report) per wall second and per broker
//! CPU-second (utime + stime from /proc over the send window plus 1 s for the last acks).
//! The sender and the rigs share the machine's cores with the broker.

use std::time::{Duration, Instant};

use anyhow::Result;
use clap::Args;
use serde_json::{json, Value};

use crate::broker::{Broker, Spec};
use crate::ctx::{parse_duration, Common, Ctx};
use crate::loadgen::{admin_fanout, u, u2, RampEnd, Rigs, RigsOpts};
use crate::proc;
use crate::record::{self, fmt, list, median, ratio, series};

/// Flags of `throughput`.
#[derive(Args, Debug)]
pub(crate) struct Opts {
    #[command(flatten)]
    common: Common,
    /// Rigs receiving commands.
    #[arg(long, default_value_t = 1_000)]
    rigs: usize,
    /// How long commands are sent.
    #[arg(long, default_value = "30s", value_parser = parse_duration)]
    duration: Duration,
    /// Keep-alive admin connections the sender uses in parallel (fleetlink-fe serves 8 at once).
    #[arg(long, default_value_t = 8)]
    conns: usize,
}

/// The configurations compared; the first is the reference for ratios.
const BROKERS: [Spec; 4] = [
    Spec::fe(
        "fleetlink-fe-cores1",
        &[
            "--cores",
            "1",
            "--accept-rate",
            "1000000",
            "--accept-burst",
            "1000000",
            // A rig acks every command; with few rigs that is more messages a second than
            // the default --rig-rate lets a rig send, and the broker would stop reading it.
            // The baseline has no such limit, and the figure is the broker's work.
            "--rig-rate",
            "1000000",
            "--rig-burst",
            "1000000",
        ],
    ),
    Spec::fe(
        "fleetlink-fe-cores2",
        &[
            "--cores",
            "2",
            "--accept-rate",
            "1000000",
            "--accept-burst",
            "1000000",
            // A rig acks every command; with few rigs that is more messages a second than
            // the default --rig-rate lets a rig send, and the broker would stop reading it.
            // The baseline has no such limit, and the figure is the broker's work.
            "--rig-rate",
            "1000000",
            "--rig-burst",
            "1000000",
        ],
    ),
    Spec::BASELINE_DEFAULT,
    Spec::BASELINE_RB4096,
];

/// Runs every round and writes `throughput.{json,md}`.
pub(crate) fn run(o: &Opts) -> Result<()> {
    let ctx = Ctx::new(&o.common)?;
    let brokers = ctx.select(&BROKERS)?;
    ctx.rounds(
        "throughput",
        &brokers,
        |spec, round| sustain(&ctx, o, spec, round),
        |runs| summarize(&ctx, o, &brokers, runs),
    )
}

/// One send window against a fresh broker holding N rigs.
fn sustain(ctx: &Ctx, o: &Opts, spec: &Spec, round: usize) -> Result<Value> {
    let mut broker = Broker::start(ctx, spec)?;
    let opts = RigsOpts {
        rigs: o.rigs,
        start_index: 0,
        concurrency: 256,
        procs: None,
        hold: o.duration + Duration::from_secs(120),
    };
    let mut rigs = Rigs::start(ctx, &opts, "throughput")?;
    let ramp = rigs.wait_ramp(&mut broker, Instant::now() + Duration::from_secs(60))?;
    proc::sleep(Duration::from_secs(1))?;
    let (cpu0, threads0, t0) = (broker.cpu()?, broker.cpu_by_thread()?, Instant::now());
    // Enough rounds that the duration, not the count, ends the sender.
    let sender = admin_fanout(
        ctx,
        o.rigs,
        100_000_000 / o.rigs.max(1),
        o.conns,
        o.duration,
    )?;
    proc::sleep(Duration::from_secs(1))?; // the last commands' acks
    let (cpu1, threads1, t1) = (broker.cpu()?, broker.cpu_by_thread()?, Instant::now());
    broker.ensure_running()?;
    let report = rigs.finish()?;
    broker.stop();
    let cpu = (cpu1 - cpu0).as_secs_f64();
    let send_s = u(&sender, "elapsed_ms") as f64 / 1e3;
    let acks = u(&report, "acks_sent") as f64;
    // A refused POST, or a command answered ok that no rig received, makes the round
    // incomplete: its acks per second would otherwise read as a broker's rate.
    let refused: u64 = sender["errors"]
        .as_object()
        .map_or(0, |e| e.values().filter_map(Value::as_u64).sum());
    // Exact only when every POST written was answered (the sender waits for those in flight
    // at its deadline): then the rigs received exactly the commands answered ok, and one more
    // is a command taken without its answer, one fewer a command lost.
    let unanswered = u(&sender, "unanswered");
    let undelivered = u(&sender, "ok").abs_diff(u(&report, "commands_received"));
    Ok(json!({
        "broker": spec.name,
        "round": round,
        "complete": ramp.end == RampEnd::AllWelcomed
            && u(&report, "dropped_after_welcome") == 0
            && refused == 0
            && unanswered == 0
            && undelivered == 0,
        "send_s": send_s,
        "posts_ok": u(&sender, "ok"),
        "post_errors": sender["errors"],
        "posts_refused": refused,
        "undelivered": undelivered,
        "unanswered": unanswered,
        "commands_received": u(&report, "commands_received"),
        "acks": acks,
        "cpu_s": cpu,
        "cpu_window_s": (t1 - t0).as_secs_f64(),
        "acked_per_s": acks / send_s,
        "acked_per_cpu_s": acks / cpu,
        "broker_cores_busy": cpu / (t1 - t0).as_secs_f64(),
        "cpu_s_by_thread": Broker::thread_delta(&threads0, &threads1),
        "http_p50_us": u2(&sender, "http_us", "p50"),
        "http_p99_us": u2(&sender, "http_us", "p99"),
        "latency_p50_us": u2(&report, "latency_us", "p50"),
        "latency_p99_us": u2(&report, "latency_us", "p99"),
    }))
}

fn summarize(ctx: &Ctx, o: &Opts, brokers: &[Spec], runs: Vec<Value>) -> (Value, String) {
    let date = record::now_utc();
    let reference = brokers[0].name;
    let med = |b: &str, k: &str| median(&series(&runs, b, k));
    let mut summary = serde_json::Map::new();
    let mut md = format!(
        "### throughput, {date}\n\n{} rigs acking every command; `admin-fanout` POSTs one \
         command per rig per round over {} keep-alive connections for {:.0} s; {} rounds, \
         brokers alternating. acked/s = rig acks / send time; per CPU-s = acks / broker \
         utime+stime over the window (+1 s for the last acks). Medians.\n\n\
         A round is complete when every rig was welcomed and stayed, no POST was refused or \
         left unanswered, and the rigs received exactly the commands answered ok; refused / \
         undelivered sum the rounds (undelivered: the difference either way).\n\n\
         | broker | complete | refused / undelivered | acked/s | per round | acked per broker CPU-s | per round | broker cores busy | POST p50 / p99 (ms) | publish→rig p50 / p99 (ms) | per CPU-s vs {reference} |\n\
         |---|---|---|---|---|---|---|---|---|---|---|\n",
        o.rigs,
        o.conns,
        o.duration.as_secs_f64(),
        ctx.rounds
    );
    for spec in brokers {
        let b = spec.name;
        let n = runs.iter().filter(|r| r["broker"] == b).count();
        let complete = runs
            .iter()
            .filter(|r| r["broker"] == b && r["complete"] == true)
            .count();
        let ms = |k: &str| fmt(med(b, k).map(|u| u / 1e3), 2);
        let total = |k: &str| -> u64 {
            runs.iter()
                .filter(|r| r["broker"] == b)
                .filter_map(|r| r[k].as_u64())
                .sum()
        };
        md += &format!(
            "| {b} | {complete}/{n} | {} / {} | {} | {} | {} | {} | {} | {} / {} | {} / {} | {} |\n",
            total("posts_refused"),
            total("undelivered"),
            fmt(med(b, "acked_per_s"), 0),
            list(&series(&runs, b, "acked_per_s"), 0),
            fmt(med(b, "acked_per_cpu_s"), 0),
            list(&series(&runs, b, "acked_per_cpu_s"), 0),
            fmt(med(b, "broker_cores_busy"), 2),
            ms("http_p50_us"),
            ms("http_p99_us"),
            ms("latency_p50_us"),
            ms("latency_p99_us"),
            ratio(med(b, "acked_per_cpu_s"), med(reference, "acked_per_cpu_s")),
        );
        summary.insert(
            b.into(),
            json!({"runs": n, "complete": complete, "acked_per_s_median": med(b, "acked_per_s"),
                   "acked_per_cpu_s_median": med(b, "acked_per_cpu_s"),
                   "broker_cores_busy_median": med(b, "broker_cores_busy"),
                   "command": spec.argv(ctx).join(" ")}),
        );
    }
    let doc = json!({
        "binaries_built": ctx.built, "scenario": "throughput", "date": date, "host": record::host(),
        "params": {"rigs": o.rigs, "rounds": ctx.rounds, "duration_s": o.duration.as_secs_f64(),
                   "sender": format!("fleetlink-loadgen admin-fanout, {} keep-alive connections, 1 process", o.conns)},
        "method": "per broker and round: fresh broker, N rigs ramped, 1 s settle; broker CPU read; \
                   admin-fanout runs until --max-time = duration; 1 s for trailing acks; CPU read \
                   again; rigs stopped and their report read (acks_sent). acked_per_s = acks / \
                   sender elapsed; acked_per_cpu_s = acks / broker CPU-s; summary = medians.",
        "summary": summary,
        "runs": runs,
    });
    (doc, md)
}
