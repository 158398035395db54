//! `redis-publish`: commands into a fleet-mode broker through its Redis channel
//! `fleetlink:broker:<id>` (CONTRACT.md §4), each stamped with `args.sent_at_us`, so the `rigs`
//! side measures publish-to-receipt through Redis, the broker's subscription and its cores.
//!
//! - `fanout`: one command per rig, all PUBLISHes of a round in ONE pipeline (one write, one
//!   read of all the replies). Each command is stamped as it is appended, so a stamp is never
//!   later than the write; the time to build the pipeline (a few ms for 10,000) is reported as
//!   `build_us` and is part of the measured latency of the earlier commands.
//! - `single`: `--count` commands to the first rig, one PUBLISH at a time (waiting for Redis'
//!   reply), `--interval` apart: the idle single-command latency.
//!
//! Replies go to `--reply-to`, which nobody needs to read. Sync client: the publisher has
//! nothing else to do while it waits for Redis.

use std::time::{Duration, Instant};

use anyhow::{Context, Result};
use serde::Serialize;

use crate::cli::{PublishMode, RedisPublishArgs, RigsArgs};
use crate::hist::{Histogram, Summary};
use crate::rig::unix_us;

/// Printed on stdout (and written to `--report`).
#[derive(Debug, Serialize)]
pub struct PublishReport {
    pub mode: &'static str,
    pub channel: String,
    pub rigs: u64,
    /// Fan-out rounds, or single commands.
    pub count: u64,
    /// Commands the run meant to publish.
    pub commands: u64,
    /// PUBLISHes Redis answered.
    pub published: u64,
    /// PUBLISHes Redis answered with 0 receivers (no broker subscribed to the channel).
    pub no_subscriber: u64,
    /// Redis errors (connection lost, error replies), by message.
    pub errors: Vec<String>,
    pub elapsed_ms: u64,
    pub timed_out: bool,
    /// Single: one PUBLISH round trip each. Fan-out: one whole pipeline round trip per round.
    pub publish_us: Summary,
    /// Fan-out: time to build (and stamp) one round's pipeline before it is written.
    pub build_us: Summary,
    pub first_sent_unix_us: Option<u64>,
    pub last_sent_unix_us: Option<u64>,
}

/// The JSON of one control-plane command (CONTRACT.md §4). Built by hand (the strings are
/// escaped by serde_json) so that a 10,000-command pipeline is quick to build and stamp.
pub fn command_json(id: &str, rig_id: &str, name: &str, sent_at_us: u64, reply_to: &str) -> String {
    let q = |s: &str| serde_json::to_string(s).unwrap_or_else(|_| "\"\"".to_string());
    format!(
        r#"{{"type":"command","id":{},"rig_id":{},"name":{},"args":{{"sent_at_us":{sent_at_us}}},"reply_to":{}}}"#,
        q(id),
        q(rig_id),
        q(name),
        q(reply_to)
    )
}

struct Run {
    report: PublishReport,
    publish: Histogram,
    build: Histogram,
}

impl Run {
    fn stamp(&mut self) -> u64 {
        let now = unix_us();
        self.report.first_sent_unix_us.get_or_insert(now);
        self.report.last_sent_unix_us = Some(now);
        now
    }
}

/// A client for `url`, or an error that says which URLs are taken: the redis crate's own
/// reads "Redis URL did not parse- InvalidClientConfig" for any other scheme.
fn open_client(url: &str) -> Result<redis::Client> {
    // Schemes are case-insensitive (RFC 3986 section 3.1): `REDIS://` is taken too.
    let scheme = url.split_once("://").map(|(s, _)| s.to_ascii_lowercase());
    if !matches!(scheme.as_deref(), Some("redis" | "unix" | "redis+unix")) {
        anyhow::bail!(
            "bad redis URL {url:?}: it must start with redis:// (or unix:// for Redis's socket)"
        );
    }
    redis::Client::open(url).with_context(|| format!("bad redis URL {url:?}"))
}

pub fn run_publish(args: RedisPublishArgs) -> Result<i32> {
    let started = Instant::now();
    let deadline = started + args.max_time;
    let client = open_client(&args.redis)?;
    let io_timeout = args
        .max_time
        .clamp(Duration::from_secs(1), Duration::from_secs(60));
    let mut con = client
        .get_connection_with_timeout(io_timeout)
        .with_context(|| format!("connecting to {}", args.redis))?;
    con.set_read_timeout(Some(io_timeout))?;
    con.set_write_timeout(Some(io_timeout))?;

    let channel = format!("fleetlink:broker:{}", args.broker_id);
    let count = args.effective_count();
    let rigs = match args.mode {
        PublishMode::Fanout => args.rigs,
        PublishMode::Single => 1,
    };
    let rig_ids: Vec<String> = (0..rigs)
        .map(|i| RigsArgs::rig_id(&args.prefix, args.id_width, args.start_index + i))
        .collect();
    let pid = std::process::id();
    let mut run = Run {
        report: PublishReport {
            mode: match args.mode {
                PublishMode::Fanout => "fanout",
                PublishMode::Single => "single",
            },
            channel: channel.clone(),
            rigs: rigs as u64,
            count: count as u64,
            commands: (rigs * count) as u64,
            published: 0,
            no_subscriber: 0,
            errors: Vec::new(),
            elapsed_ms: 0,
            timed_out: false,
            publish_us: Summary::default(),
            build_us: Summary::default(),
            first_sent_unix_us: None,
            last_sent_unix_us: None,
        },
        publish: Histogram::default(),
        build: Histogram::default(),
    };

    for round in 0..count {
        if Instant::now() >= deadline {
            run.report.timed_out = true;
            break;
        }
        let ok = match args.mode {
            PublishMode::Single => {
                let sent = run.stamp();
                let id = format!("lg{pid}-{round}");
                let payload = command_json(&id, &rig_ids[0], &args.name, sent, &args.reply_to);
                let t0 = Instant::now();
                let r: redis::RedisResult<i64> = redis::cmd("PUBLISH")
                    .arg(&channel)
                    .arg(payload)
                    .query(&mut con);
                run.publish.record(t0.elapsed().as_micros() as u64);
                record(&mut run.report, r.map(|n| vec![n]))
            }
            PublishMode::Fanout => {
                let t0 = Instant::now();
                let mut pipe = redis::pipe();
                for (i, rig) in rig_ids.iter().enumerate() {
                    let sent = run.stamp();
                    let id = format!("lg{pid}-{round}-{i}");
                    let payload = command_json(&id, rig, &args.name, sent, &args.reply_to);
                    pipe.cmd("PUBLISH").arg(&channel).arg(payload);
                }
                let t1 = Instant::now();
                run.build.record((t1 - t0).as_micros() as u64);
                let r: redis::RedisResult<Vec<i64>> = pipe.query(&mut con);
                run.publish.record(t1.elapsed().as_micros() as u64);
                record(&mut run.report, r)
            }
        };
        if !ok {
            break; // the connection is in an unknown state; the report says what happened
        }
        if round + 1 < count && !args.interval.is_zero() {
            let left = deadline.saturating_duration_since(Instant::now());
            if left < args.interval {
                run.report.timed_out = true;
                break;
            }
            std::thread::sleep(args.interval);
        }
    }

    let mut report = run.report;
    report.elapsed_ms = started.elapsed().as_millis() as u64;
    report.publish_us = run.publish.summary();
    report.build_us = run.build.summary();
    let json = serde_json::to_string(&report)?;
    println!("{json}");
    if let Some(path) = &args.report {
        std::fs::write(path, format!("{json}\n")).with_context(|| format!("writing {path}"))?;
    }
    let all_delivered = report.published == report.commands && report.no_subscriber == 0;
    Ok(if all_delivered && report.errors.is_empty() {
        0
    } else {
        2
    })
}

/// Counts one reply (or pipeline of replies); `false` when Redis failed.
fn record(report: &mut PublishReport, r: redis::RedisResult<Vec<i64>>) -> bool {
    match r {
        Ok(receivers) => {
            report.published += receivers.len() as u64;
            report.no_subscriber += receivers.iter().filter(|&&n| n == 0).count() as u64;
            true
        }
        Err(e) => {
            report.errors.push(e.to_string());
            false
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_url_of_another_scheme_says_which_are_taken() {
        let e = open_client("http://x").unwrap_err().to_string();
        assert!(e.contains("it must start with redis://"), "{e}");
        assert!(open_client("redis://127.0.0.1:1/").is_ok());
        assert!(open_client("REDIS://127.0.0.1:1/").is_ok());
        assert!(open_client("unix:///tmp/redis.sock").is_ok());
    }

    #[test]
    fn command_matches_the_contract() {
        let j = command_json("c1", "rig-000007", "be\"nch", 1_234, "void");
        let v: serde_json::Value = serde_json::from_str(&j).unwrap();
        assert_eq!(v["type"], "command");
        assert_eq!(v["id"], "c1");
        assert_eq!(v["rig_id"], "rig-000007");
        assert_eq!(v["name"], "be\"nch");
        assert_eq!(v["args"]["sent_at_us"], 1_234);
        assert_eq!(v["reply_to"], "void");
    }

    #[test]
    fn records_receivers_and_errors() {
        let mut r = PublishReport {
            mode: "fanout",
            channel: "c".into(),
            rigs: 3,
            count: 1,
            commands: 3,
            published: 0,
            no_subscriber: 0,
            errors: Vec::new(),
            elapsed_ms: 0,
            timed_out: false,
            publish_us: Summary::default(),
            build_us: Summary::default(),
            first_sent_unix_us: None,
            last_sent_unix_us: None,
        };
        assert!(record(&mut r, Ok(vec![1, 0, 1])));
        assert_eq!((r.published, r.no_subscriber), (3, 1));
        let e = redis::RedisError::from((redis::ErrorKind::IoError, "gone"));
        assert!(!record(&mut r, Err(e)));
        assert_eq!(r.errors.len(), 1);
    }
}
