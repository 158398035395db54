//! Runs `fleetlink-loadgen redis-publish` against a throwaway redis-server (which the test needs:
//! it fails when none can be started) with a subscriber standing in for the broker: the messages
//! must be the contract's command objects, stamped, one per rig (fan-out) or K to the first rig
//! (single).

use std::net::TcpListener;
use std::process::{Child, Command, Output, Stdio};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use serde_json::Value;

/// How long a redis-server may take to answer, and a publisher run to finish.
const WAIT: Duration = Duration::from_secs(20);
/// Fresh ports tried before giving up (each failure means the port was taken meanwhile).
const PORT_ATTEMPTS: usize = 5;

struct Server(Child);

impl Drop for Server {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// A redis-server of our own on a free port and its URL; panics (with the reason) when none
/// can be started. The port is the kernel's pick, released before the server binds it, so the
/// server is only accepted once `INFO server` names our child's pid, and one that exits at
/// start-up (port taken meanwhile) is retried on a fresh port.
fn redis_server() -> (Server, String) {
    let mut last_err = String::new();
    for _ in 0..PORT_ATTEMPTS {
        let port = TcpListener::bind("127.0.0.1:0")
            .expect("bind 127.0.0.1:0")
            .local_addr()
            .expect("local addr")
            .port();
        let child = Command::new("redis-server")
            .args(["--port", &port.to_string(), "--bind", "127.0.0.1"])
            .args(["--save", "", "--appendonly", "no"])
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .unwrap_or_else(|e| {
                panic!(
                    "cannot start redis-server ({e}): this test needs it \
                     (Debian/Ubuntu: apt-get install redis-server)"
                )
            });
        let mut server = Server(child);
        let url = format!("redis://127.0.0.1:{port}/");
        let deadline = Instant::now() + WAIT;
        loop {
            if let Ok(Some(status)) = server.0.try_wait() {
                last_err = format!("redis-server on port {port} exited: {status}");
                break;
            }
            if answers_as(&url, server.0.id()) {
                return (server, url);
            }
            if Instant::now() >= deadline {
                last_err = format!("redis-server on port {port} not answering after {WAIT:?}");
                break;
            }
            std::thread::sleep(Duration::from_millis(20));
        }
    }
    panic!("redis-server did not start on {PORT_ATTEMPTS} ports: {last_err}");
}

/// True once the server at `url` answers PING and reports `pid` as its process id.
fn answers_as(url: &str, pid: u32) -> bool {
    let Ok(client) = redis::Client::open(url) else {
        return false;
    };
    let Ok(mut con) = client.get_connection_with_timeout(Duration::from_secs(1)) else {
        return false;
    };
    let _ = con.set_read_timeout(Some(Duration::from_secs(1)));
    let pong: Result<String, _> = redis::cmd("PING").query(&mut con);
    let info: Result<String, _> = redis::cmd("INFO").arg("server").query(&mut con);
    let ours = format!("process_id:{pid}");
    pong.is_ok_and(|p| p == "PONG") && info.is_ok_and(|i| i.lines().any(|l| l.trim() == ours))
}

/// Runs `cmd` to completion with its output captured, or kills it and panics after `limit`.
fn output_within(cmd: &mut Command, limit: Duration) -> Output {
    let mut child = cmd
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("start fleetlink-loadgen");
    // Readers drain the pipes meanwhile, so a chatty child cannot block on a full pipe.
    let read = |mut r: Box<dyn std::io::Read + Send>| {
        std::thread::spawn(move || {
            let mut buf = Vec::new();
            let _ = r.read_to_end(&mut buf);
            buf
        })
    };
    let out = read(Box::new(child.stdout.take().expect("stdout")));
    let err = read(Box::new(child.stderr.take().expect("stderr")));
    let deadline = Instant::now() + limit;
    let status = loop {
        if let Some(status) = child.try_wait().expect("wait for fleetlink-loadgen") {
            break status;
        }
        if Instant::now() >= deadline {
            let _ = child.kill();
            let _ = child.wait();
            panic!("{cmd:?} still running after {limit:?}: killed");
        }
        std::thread::sleep(Duration::from_millis(20));
    };
    Output {
        status,
        stdout: out.join().expect("stdout reader"),
        stderr: err.join().expect("stderr reader"),
    }
}

fn now_us() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .unwrap()
        .as_micros() as u64
}

/// Runs the publisher; returns its exit code and its JSON summary.
fn publish(url: &str, args: &[&str]) -> (i32, Value) {
    let out = output_within(
        Command::new(env!("CARGO_BIN_EXE_fleetlink-loadgen"))
            .args(["redis-publish", "--redis", url, "--broker-id", "fe-t"])
            .args(args),
        WAIT,
    );
    let stdout = String::from_utf8_lossy(&out.stdout);
    let summary = serde_json::from_str(stdout.trim()).unwrap_or_else(|e| {
        panic!(
            "summary {stdout:?}: {e}; stderr: {}",
            String::from_utf8_lossy(&out.stderr)
        )
    });
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
    let (_server, url) = redis_server();
    let client = redis::Client::open(url.as_str()).unwrap();

    // Nobody subscribed yet: every PUBLISH reaches no broker, and the tool says so (exit 2).
    let (code, summary) = publish(&url, &["--rigs", "3"]);
    assert_eq!(code, 2);
    assert_eq!(summary["no_subscriber"], 3);

    let mut con = client
        .get_connection_with_timeout(Duration::from_secs(5))
        .unwrap();
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
