//! End-to-end: the baseline binary against the load generator (20 rigs + admin fan-out) and
//! against hand-driven clients for the registry's close codes.

use std::time::{Duration, Instant};

use clap::Parser;
use fleetlink_loadgen::cli::{Cli, Command as LgCommand};
use futures_util::{SinkExt, StreamExt};
use serde_json::Value;
use tokio_tungstenite::tungstenite::Message;

mod common;
use common::{http_get, Broker};

fn start_broker(extra: &[&str]) -> Broker {
    let mut args = vec!["--workers", "2"];
    args.extend_from_slice(extra);
    common::start("baseline", &args)
}

fn loadgen(args: &[&str]) -> LgCommand {
    let mut full = vec!["fleetlink-loadgen"];
    full.extend_from_slice(args);
    Cli::parse_from(full).cmd
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn twenty_rigs_get_one_command_each() {
    let b = start_broker(&["--read-buffer", "4096", "--write-buffer", "0"]);
    let dir = tempfile::tempdir().unwrap();
    let report = dir.path().join("rigs.json");
    let url = format!("ws://{}/agent", b.rigs);
    let LgCommand::Rigs(rigs) = loadgen(&[
        "rigs",
        "--url",
        &url,
        "--rigs",
        "20",
        "--procs",
        "1",
        "--prefix",
        "it",
        "--hold",
        "3s",
        "--max-time",
        "30s",
        "--report",
        report.to_str().unwrap(),
    ]) else {
        unreachable!()
    };
    let run = tokio::spawn(fleetlink_loadgen::orchestrator::run_parent(rigs));

    let deadline = Instant::now() + Duration::from_secs(10);
    while !http_get(&b.admin, "/metrics")
        .await
        .contains("fleetlink_connections 20\n")
    {
        assert!(Instant::now() < deadline, "rigs did not all connect");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let list = http_get(&b.admin, "/v1/rigs").await;
    assert!(list.contains("\"rig_id\":\"it-000019\""), "{list}");

    let admin = format!("http://{}", b.admin);
    let LgCommand::AdminFanout(f) = loadgen(&[
        "admin-fanout",
        "--admin",
        &admin,
        "--prefix",
        "it",
        "--rigs",
        "20",
    ]) else {
        unreachable!()
    };
    assert_eq!(
        fleetlink_loadgen::fanout::run_fanout(f).await.unwrap(),
        0,
        "every POST accepted"
    );
    // An unknown rig is refused with the contract's error.
    let LgCommand::AdminFanout(f) = loadgen(&[
        "admin-fanout",
        "--admin",
        &admin,
        "--prefix",
        "nobody",
        "--rigs",
        "1",
    ]) else {
        unreachable!()
    };
    assert_eq!(fleetlink_loadgen::fanout::run_fanout(f).await.unwrap(), 2);

    assert_eq!(run.await.unwrap().unwrap(), 0);
    let r: Value = serde_json::from_str(&std::fs::read_to_string(&report).unwrap()).unwrap();
    assert_eq!(r["welcomed"], 20, "{r:#}");
    assert_eq!(r["commands_received"], 20, "{r:#}");
    assert_eq!(r["acks_sent"], 20);
    assert_eq!(r["latency_us"]["count"], 20);
    assert_eq!(r["dropped_after_welcome"], 0);

    let metrics = http_get(&b.admin, "/metrics").await;
    assert!(
        metrics.contains("fleetlink_commands_total{result=\"ok\"} 20\n"),
        "{metrics}"
    );
    assert!(metrics.contains("fleetlink_commands_total{result=\"rig_not_connected\"} 1\n"));
    assert!(
        metrics.contains("fleetlink_rig_messages_total{type=\"ack\"} 20\n"),
        "{metrics}"
    );
}

type Client =
    tokio_tungstenite::WebSocketStream<tokio_tungstenite::MaybeTlsStream<tokio::net::TcpStream>>;

async fn hello(b: &Broker, rig: &str, boot: &str) -> Client {
    let (mut ws, _) = tokio_tungstenite::connect_async(format!("ws://{}/agent", b.rigs))
        .await
        .unwrap();
    let h = format!(r#"{{"type":"hello","rig_id":"{rig}","boot_id":"{boot}","version":"t"}}"#);
    ws.send(Message::text(h)).await.unwrap();
    ws
}

/// The next close code the client sees (skipping other messages), or the welcome's rig_id.
/// Bounded as a whole: pings arriving now and then cannot keep it waiting past the deadline.
async fn next_event(ws: &mut Client) -> String {
    let deadline = tokio::time::Instant::now() + Duration::from_secs(5);
    loop {
        match tokio::time::timeout_at(deadline, ws.next())
            .await
            .expect("no welcome or close within 5 s")
        {
            Some(Ok(Message::Text(t))) => {
                let v: Value = serde_json::from_str(&t).unwrap();
                return format!(
                    "{}:{}",
                    v["type"].as_str().unwrap(),
                    v["rig_id"].as_str().unwrap_or("")
                );
            }
            Some(Ok(Message::Close(f))) => {
                return format!("close:{}", f.map_or(0, |f| u16::from(f.code)))
            }
            Some(Ok(_)) => {}
            other => return format!("end:{other:?}"),
        }
    }
}

/// The value of one series in the baseline's `/metrics` (0 when absent).
async fn metric(b: &Broker, series: &str) -> u64 {
    let text = http_get(&b.admin, "/metrics").await;
    text.lines()
        .find_map(|l| l.strip_prefix(series)?.strip_prefix(' ')?.parse().ok())
        .unwrap_or(0)
}

/// A pong timeout longer than the ping interval: each unanswered ping is its own miss, so a
/// silent rig is closed 4002 about `max-missed-pongs` intervals plus one timeout after its
/// welcome (1.6 s here), as fleetlink-fe closes it; one deadline at a time took a timeout
/// and an interval per miss (3.6 s).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_unanswered_ping_is_a_miss_when_the_timeout_outlasts_the_interval() {
    let b = start_broker(&[
        "--ping-interval",
        "200ms",
        "--pong-timeout",
        "1s",
        "--max-missed-pongs",
        "3",
    ]);
    const PING_TIMEOUT_CLOSE: &str = "fleetlink_closes_total{code=\"4002\"}";
    let started = Instant::now();
    let _silent = hello(&b, "quiet", "019f22e2-79b0-7cc3-98c4-dc0c0c07398f").await;
    let deadline = started + Duration::from_secs(10);
    while metric(&b, PING_TIMEOUT_CLOSE).await == 0 {
        assert!(Instant::now() < deadline, "never closed 4002");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let took = started.elapsed();
    assert!(
        took >= Duration::from_millis(1500) && took < Duration::from_millis(2800),
        "closed after {took:?}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn registry_close_codes() {
    let b = start_broker(&[
        "--ping-interval",
        "300ms",
        "--pong-timeout",
        "200ms",
        "--max-missed-pongs",
        "2",
    ]);
    const OLD: &str = "017f22e2-79b0-7cc3-98c4-dc0c0c07398f";
    const NEW: &str = "019f22e2-79b0-7cc3-98c4-dc0c0c07398f";

    let mut a = hello(&b, "r1", NEW).await;
    assert_eq!(next_event(&mut a).await, "welcome:r1");
    let mut older = hello(&b, "r1", OLD).await;
    assert_eq!(next_event(&mut older).await, "close:4409");
    let mut same = hello(&b, "r1", NEW).await;
    assert_eq!(next_event(&mut same).await, "welcome:r1");
    assert_eq!(next_event(&mut a).await, "close:4410");

    let mut bad = hello(&b, "bad id", NEW).await;
    assert_eq!(next_event(&mut bad).await, "close:4400");

    // `same` keeps reading (tungstenite answers pings only while reading) in a task through
    // the silence below; it hands back everything it saw other than pings.
    let (stop_tx, mut stop_rx) = tokio::sync::oneshot::channel::<()>();
    let reader = tokio::spawn(async move {
        let mut seen = Vec::new();
        loop {
            tokio::select! {
                _ = &mut stop_rx => return (same, seen),
                m = same.next() => match m {
                    Some(Ok(Message::Ping(_) | Message::Pong(_))) => {}
                    Some(Ok(m)) => seen.push(format!("{m:?}")),
                    other => {
                        seen.push(format!("end:{other:?}"));
                        return (same, seen);
                    }
                },
            }
        }
    });

    // Not reading means not answering pings (tungstenite pongs on read): 4002 after 2 misses.
    const PING_TIMEOUT_CLOSE: &str = "fleetlink_closes_total{code=\"4002\"}";
    let mut silent = hello(&b, "quiet", NEW).await;
    let deadline = Instant::now() + Duration::from_secs(10);
    while metric(&b, PING_TIMEOUT_CLOSE).await == 0 {
        assert!(
            Instant::now() < deadline,
            "the silent rig was never closed 4002"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    // Up to its close (a deadline for the whole read: it answers pings from now on, which
    // the broker keeps sending if it did not close it).
    let mut saw = Vec::new();
    let deadline = tokio::time::Instant::now() + Duration::from_secs(5);
    while let Ok(Some(Ok(m))) = tokio::time::timeout_at(deadline, silent.next()).await {
        let closed = matches!(m, Message::Close(_));
        saw.push(m);
        if closed {
            break;
        }
    }
    assert!(
        saw.iter()
            .any(|m| matches!(m, Message::Close(Some(f)) if u16::from(f.code) == 4002)),
        "{saw:?}"
    );
    // The answering rig survived the same pings: through one more detection window (interval
    // × misses + timeout = 800 ms) after the silent one was closed it saw no close, and the
    // broker closed nobody else for missed pongs.
    tokio::time::sleep(Duration::from_millis(1000)).await;
    // (If the reader already ended, `seen` says how.)
    let _ = stop_tx.send(());
    let (_same, seen) = tokio::time::timeout(Duration::from_secs(5), reader)
        .await
        .expect("reader stops")
        .unwrap();
    assert!(seen.is_empty(), "the answering rig got {seen:?}");
    assert_eq!(metric(&b, PING_TIMEOUT_CLOSE).await, 1);
    let list = http_get(&b.admin, "/v1/rigs").await;
    assert!(list.contains("\"rig_id\":\"r1\""), "{list}");

    let r = tokio_tungstenite::connect_async(format!("ws://{}/elsewhere", b.rigs)).await;
    match r {
        Err(tokio_tungstenite::tungstenite::Error::Http(resp)) => assert_eq!(resp.status(), 404),
        other => panic!("expected 404, got {other:?}"),
    }
}
