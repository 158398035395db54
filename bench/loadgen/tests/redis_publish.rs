//! Runs `fleetlink-loadgen redis-publish` against a throwaway redis-server (skipped when none is
//! installed) with a subscriber standing in for the broker: the messages must be the contract's
//! command objects, stamped, one per rig (fan-out) or K to the first rig (single).

use std::net::TcpListener;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use serde_json::Value;

struct Server(Child);

impl Drop for Server {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// A redis-server on a free port, or `None` when redis-server is not installed.
fn redis_server() -> Option<(Server, String)> {
    let port = TcpListener::bind("127.0.0.1:0")
        .ok()?
        .local_addr()
        .ok()?
        .port();
    let child = Command::new("redis-server")
        .args(["--port", &port.to_string(), "--bind", "127.0.0.1"])
        .args(["--save", "", "--appendonly", "no"])
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .ok()?;
    let server = Server(child);
    let url = format!("redis://127.0.0.1:{port}/");
    let client = redis::Client::open(url.as_str()).ok()?;
    let deadline = Instant::now() + Duration::from_secs(10);
    while Instant::now() < deadline {
        if let Ok(mut c) = client.get_connection() {
            if redis::cmd("PING").query::<String>(&mut c).is_ok() {
                return Some((server, url));
            }
        }
        std::thread::sleep(Duration::from_millis(50));
    }
    None
}

fn now_us() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .unwrap()
        .as_micros() as u64
}

/// Runs the publisher; returns its exit code and its JSON summary.
fn publish(url: &str, args: &[&str]) -> (i32, Value) {
    let out = Command::new(env!("CARGO_BIN_EXE_fleetlink-loadgen"))
        .args(["redis-publish", "--redis", url, "--broker-id", "fe-t"])
        .args(args)
        .output()
        .unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout);
    let summary =
        serde_json::from_str(stdout.trim()).unwrap_or_else(|e| panic!("summary {stdout:?}: {e}"));
    (out.status.code().unwrap_or(-1), summary)
}

/// Reads up to `n` messages from the subscription (stops early after a quiet second).
fn drain(sub: &mut redis::PubSub<'_>, n: usize) -> Vec<Value> {
    let mut got = Vec::new();
    while got.len() < n {
        match sub.get_message() {
            Ok(m) => {
                assert_eq!(m.get_channel_name(), "fleetlink:broker:fe-t");
                let payload: String = m.get_payload().unwrap();
                got.push(serde_json::from_str(&payload).unwrap());
            }
            Err(_) => break, // read timeout
        }
    }
    got
}

#[test]
fn fanout_and_single_reach_the_broker_channel() {
    let Some((_server, url)) = redis_server() else {
        eprintln!("redis-server not available; skipping");
        return;
    };
    let client = redis::Client::open(url.as_str()).unwrap();

    // Nobody subscribed yet: every PUBLISH reaches no broker, and the tool says so (exit 2).
    let (code, summary) = publish(&url, &["--rigs", "3"]);
    assert_eq!(code, 2);
    assert_eq!(summary["no_subscriber"], 3);

    let mut con = client.get_connection().unwrap();
    con.set_read_timeout(Some(Duration::from_secs(1))).unwrap();
    let mut sub = con.as_pubsub();
    sub.subscribe("fleetlink:broker:fe-t").unwrap();

    let before = now_us();
    let (code, summary) = publish(
        &url,
        &[
            "--rigs",
            "5",
            "--start-index",
            "10",
            "--prefix",
            "r",
            "--count",
            "2",
            "--interval",
            "0s",
            "--reply-to",
            "void",
        ],
    );
    assert_eq!(code, 0, "{summary}");
    assert_eq!(
        (
            &summary["published"],
            &summary["no_subscriber"],
            &summary["mode"]
        ),
        (&Value::from(10), &Value::from(0), &Value::from("fanout"))
    );
    assert_eq!(summary["publish_us"]["count"], 2); // one pipeline per round
    let msgs = drain(&mut sub, 10);
    assert_eq!(msgs.len(), 10);
    let mut ids = std::collections::BTreeSet::new();
    for (i, m) in msgs.iter().enumerate() {
        assert_eq!(m["type"], "command");
        assert_eq!(m["rig_id"], format!("r-{:06}", 10 + i % 5));
        assert_eq!(m["name"], "bench");
        assert_eq!(m["reply_to"], "void");
        let sent = m["args"]["sent_at_us"].as_u64().unwrap();
        assert!(sent >= before && sent <= now_us());
        assert!(
            ids.insert(m["id"].as_str().unwrap().to_string()),
            "ids are unique"
        );
    }

    let (code, summary) = publish(
        &url,
        &[
            "--mode",
            "single",
            "--rigs",
            "5",
            "--prefix",
            "s",
            "--count",
            "3",
            "--interval",
            "20ms",
        ],
    );
    assert_eq!(code, 0, "{summary}");
    assert_eq!(summary["published"], 3);
    assert!(
        summary["elapsed_ms"].as_u64().unwrap() >= 40,
        "paused between commands"
    );
    let msgs = drain(&mut sub, 3);
    assert_eq!(msgs.len(), 3);
    assert!(msgs.iter().all(|m| m["rig_id"] == "s-000000"));
    let stamps: Vec<u64> = msgs
        .iter()
        .map(|m| m["args"]["sent_at_us"].as_u64().unwrap())
        .collect();
    assert!(stamps.windows(2).all(|w| w[1] >= w[0] + 20_000));
}
