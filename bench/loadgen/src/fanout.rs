//! `admin-fanout`: one command per rig through `POST /v1/rigs/{id}/commands`, each stamped with
//! `args.sent_at_us` just before it is written, so the rigs side can measure publish-to-receipt.
//! `--count` repeats the fan-out (with `--rigs 1`: single commands, `--interval` apart). The
//! Redis path of fleet mode is `redis-publish` (`redis_pub.rs`).

use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicUsize, Ordering::Relaxed};
use std::sync::{Arc, Mutex};
use std::time::Instant;

use anyhow::{Context, Result};
use serde::Serialize;
use serde_json::Value;

use crate::cli::{parse_plain_url, FanoutArgs, RigsArgs};
use crate::hist::{Histogram, Summary};
use crate::http::{never_sent, HttpConn};
use crate::rig::unix_us;

/// The `errors` key of POSTs that were never written (no connection could be opened): not
/// counted as sent.
const NOT_SENT: &str = "not_sent";

#[derive(Debug, Default)]
struct Tally {
    /// POSTs written (answered or not).
    sent: u64,
    ok: u64,
    errors: BTreeMap<String, u64>,
    http_us: Histogram,
    first_sent_unix_us: Option<u64>,
    last_sent_unix_us: Option<u64>,
}

/// Printed on stdout (and written to `--report`).
#[derive(Debug, Serialize)]
pub struct FanoutReport {
    pub rigs: u64,
    /// `--count`: how many times every rig was sent a command.
    pub rounds: u64,
    /// rigs × rounds.
    pub commands: u64,
    /// POSTs written: the others were never sent (`--max-time` came first, or the broker
    /// could not be reached: `errors.not_sent`).
    pub sent: u64,
    pub ok: u64,
    /// Not answered ok: `errors`, `unanswered` and the commands never sent.
    pub failed: u64,
    /// POSTs written whose answer never came (cut off [`ANSWER_GRACE`] past `--max-time`): the
    /// broker may have taken them.
    pub unanswered: u64,
    /// Reply `error` values (`rig_not_connected`, `rig_unresponsive`, …) or transport failures.
    pub errors: BTreeMap<String, u64>,
    pub elapsed_ms: u64,
    pub timed_out: bool,
    /// Request write to reply read, per POST answered (any status; transport errors are
    /// counted in `errors` only).
    pub http_us: Summary,
    pub first_sent_unix_us: Option<u64>,
    pub last_sent_unix_us: Option<u64>,
}

/// The `error` of a reply, or `None` when the command was accepted.
fn classify(status: u16, body: &[u8]) -> Option<String> {
    match serde_json::from_slice::<Value>(body) {
        Ok(v) if v.get("ok").and_then(Value::as_bool) == Some(true) => None,
        Ok(v) => Some(
            v.get("error")
                .and_then(Value::as_str)
                .map_or_else(|| format!("http_{status}"), str::to_string),
        ),
        Err(_) => Some(format!("http_{status}")),
    }
}

/// How long POSTs in flight at `--max-time` may take to be answered before they are cut off
/// and counted `unanswered`: cut at once, a command the broker took counted as neither ok nor
/// failed, and a harness comparing commands answered ok with commands received could not tell
/// one lost from one in flight.
const ANSWER_GRACE: std::time::Duration = std::time::Duration::from_secs(10);

pub async fn run_fanout(args: FanoutArgs) -> Result<i32> {
    let url = parse_plain_url(&args.admin, "http", 80)?;
    let addr: SocketAddr = tokio::net::lookup_host((url.host.as_str(), url.port))
        .await
        .with_context(|| format!("resolving {}", url.host))?
        .next()
        .context("no address for admin host")?;
    let base = Arc::new(url.path.trim_end_matches('/').to_string());
    let host = format!("{}:{}", url.host, url.port);
    let name_json = Arc::new(serde_json::to_string(&args.name)?);
    let tally = Arc::new(Mutex::new(Tally::default()));
    let started = Instant::now();
    let deadline = tokio::time::Instant::now() + args.max_time;
    let rounds = args.count.max(1);
    let width = args.concurrency.clamp(1, args.rigs.max(1));
    // Keep-alive connections live across rounds: each round's tasks hand theirs back.
    let mut conns: Vec<HttpConn> = (0..width)
        .map(|_| HttpConn::new(addr, host.clone()))
        .collect();
    let mut timed_out = false;

    for round in 0..rounds {
        let next = Arc::new(AtomicUsize::new(0));
        let mut tasks = tokio::task::JoinSet::new();
        for mut conn in conns.drain(..) {
            let (next, tally, base, name_json, prefix) = (
                next.clone(),
                tally.clone(),
                base.clone(),
                name_json.clone(),
                args.prefix.clone(),
            );
            let (rigs, start, width) = (args.rigs, args.start_index, args.id_width);
            tasks.spawn(async move {
                loop {
                    // At --max-time no new POST goes; those in flight get their answers.
                    if tokio::time::Instant::now() >= deadline {
                        break;
                    }
                    let i = next.fetch_add(1, Relaxed);
                    if i >= rigs {
                        break;
                    }
                    let path = format!(
                        "{base}/v1/rigs/{}/commands",
                        RigsArgs::rig_id(&prefix, width, start + i)
                    );
                    let sent = unix_us();
                    tally.lock().unwrap_or_else(|e| e.into_inner()).sent += 1;
                    let body = format!(r#"{{"name":{name_json},"args":{{"sent_at_us":{sent}}}}}"#);
                    let t0 = Instant::now();
                    let result = conn.request("POST", &path, body.as_bytes()).await;
                    let took = t0.elapsed().as_micros() as u64;
                    let mut t = tally.lock().unwrap_or_else(|e| e.into_inner());
                    t.first_sent_unix_us = Some(t.first_sent_unix_us.map_or(sent, |f| f.min(sent)));
                    t.last_sent_unix_us = t.last_sent_unix_us.max(Some(sent));
                    // Answered ones only: a transport error's time is no reply's.
                    if result.is_ok() {
                        t.http_us.record(took);
                    }
                    let error = match result {
                        Ok(r) => classify(r.status, &r.body),
                        Err(e) if never_sent(&e) => {
                            t.sent -= 1;
                            Some(NOT_SENT.to_string())
                        }
                        Err(_) => Some("transport_error".to_string()),
                    };
                    match error {
                        None => t.ok += 1,
                        Some(e) => *t.errors.entry(e).or_insert(0) += 1,
                    }
                }
                conn
            });
        }
        let joined = tokio::time::timeout_at(deadline + ANSWER_GRACE, async {
            let mut back = Vec::new();
            while let Some(r) = tasks.join_next().await {
                if let Ok(conn) = r {
                    back.push(conn);
                }
            }
            back
        })
        .await;
        match joined {
            Ok(_) if tokio::time::Instant::now() >= deadline && round + 1 < rounds => {
                timed_out = true;
                break;
            }
            Ok(back) => conns = back,
            Err(_) => {
                tasks.abort_all();
                timed_out = true;
                break;
            }
        }
        if conns.is_empty() {
            break; // every task panicked; the tally says what was done
        }
        if round + 1 < rounds
            && !args.interval.is_zero()
            && tokio::time::timeout_at(deadline, tokio::time::sleep(args.interval))
                .await
                .is_err()
        {
            timed_out = true;
            break;
        }
    }

    let t = tally.lock().unwrap_or_else(|e| e.into_inner());
    let total = (args.rigs * rounds) as u64;
    let not_sent = t.errors.get(NOT_SENT).copied().unwrap_or(0);
    let answered = t.ok + t.errors.values().sum::<u64>() - not_sent;
    // --max-time came before the last POST, even in the last round (a POST that could not
    // connect was tried, not cut off).
    timed_out |= t.sent + not_sent < total;
    let report = FanoutReport {
        rigs: args.rigs as u64,
        rounds: rounds as u64,
        commands: total,
        sent: t.sent,
        ok: t.ok,
        failed: total - t.ok,
        unanswered: t.sent.saturating_sub(answered),
        errors: t.errors.clone(),
        elapsed_ms: started.elapsed().as_millis() as u64,
        timed_out,
        http_us: t.http_us.summary(),
        first_sent_unix_us: t.first_sent_unix_us,
        last_sent_unix_us: t.last_sent_unix_us,
    };
    let json = serde_json::to_string(&report)?;
    println!("{json}");
    if let Some(path) = &args.report {
        std::fs::write(path, format!("{json}\n")).with_context(|| format!("writing {path}"))?;
    }
    Ok(if report.failed == 0 { 0 } else { 2 })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn classify_replies() {
        assert_eq!(
            classify(200, br#"{"id":"1","ok":true,"rig_id":"r","seq":1}"#),
            None
        );
        assert_eq!(
            classify(404, br#"{"ok":false,"error":"rig_not_connected"}"#).as_deref(),
            Some("rig_not_connected")
        );
        assert_eq!(classify(500, b"oops").as_deref(), Some("http_500"));
    }
}
