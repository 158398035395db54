//! `idle-cost`: what N connected, silent rigs cost the broker. Per broker and round: ramp N rigs,
//! let the ramp's tail settle, then read the broker's CPU time (utime + stime from /proc) across
//! a window (default 60 s = three default 20 s ping intervals, so every rig is pinged exactly
//! three times whatever the phase) and report CPU-seconds per minute. The rigs answer pings
//! (tungstenite does) and send nothing else. Rigs connected in one storm have their ping
//! timers bunched (a broker pinging per connection then wakes for many at once); `--waves`
//! spreads the connections over the ping interval, as a fleet that connected over time.

use std::time::{Duration, Instant};

use anyhow::Result;
use clap::Args;
use serde_json::{json, Value};

use crate::broker::{Broker, Spec};
use crate::ctx::{parse_duration, Common, Ctx};
use crate::loadgen::{u, RampEnd, Rigs, RigsOpts};
use crate::proc;
use crate::record::{self, fmt, list, median, ratio, series};

/// Flags of `idle-cost`.
#[derive(Args, Debug)]
pub(crate) struct Opts {
    #[command(flatten)]
    common: Common,
    /// Idle rigs held.
    #[arg(long, default_value_t = 10_000)]
    rigs: usize,
    /// Measurement window (keep it a multiple of the 20 s ping interval).
    #[arg(long, default_value = "60s", value_parser = parse_duration)]
    window: Duration,
    /// Wait after ALL_WELCOMED before the window opens. Keep it above the PONG timeout (10 s):
    /// fleetlink-fe reads a PONG at its deadline, so a rig's first PONG read comes an interval
    /// and a timeout after its welcome; a shorter settle leaves the last rigs' third read after
    /// the window, while the baseline's PONGs (read as they land) are all in it.
    #[arg(long, default_value = "15s", value_parser = parse_duration)]
    settle: Duration,
    /// Connect the rigs in this many equal waves (one loadgen each), `--spread / waves` apart,
    /// so the brokers' per-connection ping timers are spread over the interval as in a fleet
    /// that connected over time. 1 = all at once (timers bunched within the ramp).
    #[arg(long, default_value_t = 1)]
    waves: usize,
    /// Time from the first wave to the last (default: one ping interval).
    #[arg(long, default_value = "20s", value_parser = parse_duration)]
    spread: Duration,
}

/// The configurations compared; the first is the reference for ratios. The fe bucket is opened
/// only so the ramp is quick; it plays no part once the rigs are connected.
const BROKERS: [Spec; 3] = [
    Spec::fe(
        "fleetlink-fe",
        &["--accept-rate", "1000000", "--accept-burst", "1000000"],
    ),
    Spec::BASELINE_DEFAULT,
    Spec::BASELINE_RB4096,
];

/// Runs every round and writes `idle-cost.{json,md}`.
pub(crate) fn run(o: &Opts) -> Result<()> {
    let ctx = Ctx::new(&o.common)?;
    let brokers = ctx.select(&BROKERS)?;
    ctx.rounds(
        "idle-cost",
        &brokers,
        |spec, round| idle(&ctx, o, spec, round),
        |runs| summarize(&ctx, o, &brokers, runs),
    )
}

/// One window against a fresh broker holding N rigs.
fn idle(ctx: &Ctx, o: &Opts, spec: &Spec, round: usize) -> Result<Value> {
    let mut broker = Broker::start(ctx, spec)?;
    let waves = o.waves.clamp(1, o.rigs.max(1));
    let gap = o.spread / waves as u32;
    let mut gens = Vec::with_capacity(waves);
    for w in 0..waves {
        if w > 0 {
            proc::sleep(gap)?;
        }
        let (start, end) = (o.rigs * w / waves, o.rigs * (w + 1) / waves);
        let opts = RigsOpts {
            rigs: end - start,
            start_index: start,
            concurrency: 256,
            procs: None,
            hold: o.spread + o.settle + o.window + Duration::from_secs(60),
        };
        gens.push(Rigs::start(ctx, &opts, "idle")?);
    }
    let mut lines = Vec::new();
    let mut all_welcomed = true;
    for g in &mut gens {
        let ramp = g.wait_ramp(&mut broker, Instant::now() + Duration::from_secs(120))?;
        all_welcomed &= ramp.end == RampEnd::AllWelcomed;
        lines.push(ramp.line);
    }
    proc::sleep(o.settle)?;
    let by_thread0 = broker.cpu_by_thread()?;
    let (cpu0, (sched0, threads0), t0) = (broker.cpu()?, broker.cpu_threads()?, Instant::now());
    proc::sleep_shown("idle-cost window", o.window)?;
    let (cpu1, (sched1, threads1), t1) = (broker.cpu()?, broker.cpu_threads()?, Instant::now());
    broker.ensure_running()?;
    let by_thread1 = broker.cpu_by_thread()?;
    let rss_kb = broker.rss_kb()?;
    let (mut welcomed, mut dropped) = (0, 0);
    let mut close_codes = Vec::new();
    for g in gens {
        let report = g.finish()?;
        welcomed += u(&report, "welcomed");
        dropped += u(&report, "dropped_after_welcome");
        close_codes.push(report["close_codes"].clone());
    }
    broker.stop();
    let wall = (t1 - t0).as_secs_f64();
    let ticks = (cpu1 - cpu0).as_secs_f64();
    // Nanosecond figure when no thread came or went; otherwise the 10 ms-tick one.
    let same_threads = threads0 == threads1;
    let cpu = if same_threads {
        sched1.saturating_sub(sched0).as_secs_f64()
    } else {
        ticks
    };
    let per_min = cpu * 60.0 / wall;
    Ok(json!({
        "broker": spec.name,
        "round": round,
        "complete": all_welcomed && dropped == 0,
        "waves": waves,
        "ramp_lines": lines,
        "window_s": wall,
        "cpu_s": cpu,
        "cpu_source": if same_threads { "schedstat" } else { "stat_ticks" },
        "cpu_ticks_s": ticks,
        "threads": [threads0, threads1],
        "cpu_s_by_thread": Broker::thread_delta(&by_thread0, &by_thread1),
        "cpu_s_per_min": per_min,
        "core_pct": cpu / wall * 100.0,
        "us_per_rig_per_min": per_min * 1e6 / o.rigs as f64,
        "rss_mib": rss_kb as f64 / 1024.0,
        "welcomed": welcomed,
        "dropped_after_welcome": dropped,
        "close_codes": close_codes,
    }))
}

fn summarize(ctx: &Ctx, o: &Opts, brokers: &[Spec], runs: Vec<Value>) -> (Value, String) {
    let date = record::now_utc();
    let reference = brokers[0].name;
    let med = |b: &str, k: &str| median(&series(&runs, b, k));
    let mut summary = serde_json::Map::new();
    let mut md = format!(
        "### idle-cost, {date}\n\n{} idle rigs, default ping interval (20 s), {}, {:.0} s \
         window after a {:.0} s settle, {} rounds, brokers alternating. Broker CPU time over the \
         window (thread schedstat, ns), as CPU-seconds per minute (medians).\n\n\
         | broker | complete | CPU-s/min | per round | % of one core | µs per rig per min | RSS (MiB) | vs {reference} |\n\
         |---|---|---|---|---|---|---|---|\n",
        o.rigs,
        if o.waves > 1 {
            format!("connected in {} waves over {:.0} s", o.waves, o.spread.as_secs_f64())
        } else {
            "connected at once".to_string()
        },
        o.window.as_secs_f64(),
        o.settle.as_secs_f64(),
        ctx.rounds
    );
    if o.window < Duration::from_secs(20) {
        // No ping falls in it for every rig, and a broker that did nothing reads 0.000, its
        // ratio 0.00x: a figure of the window's shortness, not of the brokers.
        md.insert_str(
            0,
            "**The window is shorter than the 20 s ping interval: not every rig is pinged in it, \
             and the figures below (zeros and their ratios among them) do not compare brokers.**\n\n",
        );
    }
    for spec in brokers {
        let b = spec.name;
        let n = runs.iter().filter(|r| r["broker"] == b).count();
        let complete = runs
            .iter()
            .filter(|r| r["broker"] == b && r["complete"] == true)
            .count();
        let per_min = med(b, "cpu_s_per_min");
        md += &format!(
            "| {b} | {complete}/{n} | {} | {} | {} | {} | {} | {} |\n",
            fmt(per_min, 3),
            list(&series(&runs, b, "cpu_s_per_min"), 3),
            fmt(med(b, "core_pct"), 2),
            fmt(med(b, "us_per_rig_per_min"), 1),
            fmt(med(b, "rss_mib"), 1),
            ratio(per_min, med(reference, "cpu_s_per_min")),
        );
        summary.insert(
            b.into(),
            json!({"runs": n, "complete": complete, "cpu_s_per_min_median": per_min,
                   "core_pct_median": med(b, "core_pct"),
                   "us_per_rig_per_min_median": med(b, "us_per_rig_per_min"),
                   "rss_mib_median": med(b, "rss_mib"), "command": spec.argv(ctx).join(" ")}),
        );
    }
    let doc = json!({
        "binaries_built": ctx.built, "scenario": "idle-cost", "date": date, "host": record::host(),
        "params": {"rigs": o.rigs, "rounds": ctx.rounds, "window_s": o.window.as_secs_f64(),
                   "settle_s": o.settle.as_secs_f64(), "ping_interval": "20s (both brokers' default)",
                   "waves": o.waves, "spread_s": o.spread.as_secs_f64()},
        "method": "per broker and round: fresh broker, loadgen ramps N rigs (256 handshakes in \
                   flight per process; with waves > 1, one loadgen per wave of N/waves rigs, \
                   started spread/waves apart), settle after the last wave, then broker utime+stime (/proc/PID/stat, all \
                   threads) read at both ends of the window; cpu_s from the threads' schedstat \
                   (ns) when the thread set did not change, else from utime+stime ticks (10 ms); \
                   cpu_s_per_min = cpu_s * 60 / window. \
                   complete = all welcomed and none dropped. Summary = medians over rounds.",
        "summary": summary,
        "runs": runs,
    });
    (doc, md)
}
