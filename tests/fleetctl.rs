//! fleetctl end to end: the built binary against a throwaway redis-server with fake brokers
//! (fleet mode), and against the real `fleetlink-fe` in standalone mode (admin API).

mod common;

use std::process::{Command, Output, Stdio};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{mpsc, Arc};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use common::broker::{boot_id, hello, read_close, read_json, Broker};
use common::process::{output_within, spawn_piped, RefusingPort};
use common::redis::RedisServer;
use serde_json::{json, Value};

/// What one fleetctl run left behind.
struct Run {
    code: i32,
    stdout: String,
    stderr: String,
}

impl Run {
    fn from(out: Output) -> Run {
        Run {
            code: out.status.code().unwrap_or(-1),
            stdout: String::from_utf8_lossy(&out.stdout).into_owned(),
            stderr: String::from_utf8_lossy(&out.stderr).into_owned(),
        }
    }

    /// stdout as JSON lines.
    fn lines(&self) -> Vec<Value> {
        self.stdout
            .lines()
            .map(|l| serde_json::from_str(l).unwrap_or_else(|e| panic!("not JSON: {l:?}: {e}")))
            .collect()
    }

    fn assert_code(&self, code: i32) -> &Run {
        assert_eq!(
            self.code, code,
            "exit code\nstdout:\n{}\nstderr:\n{}",
            self.stdout, self.stderr
        );
        assert!(
            !self.stderr.contains("panicked"),
            "fleetctl panicked:\n{}",
            self.stderr
        );
        self
    }
}

/// fleetctl with a clean environment (no FLEETCTL_* from the caller's shell).
fn fleetctl_cmd(args: &[&str]) -> Command {
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_fleetctl"));
    cmd.args(args)
        .env_remove("FLEETCTL_REDIS")
        .env_remove("FLEETCTL_ADMIN")
        .stdin(Stdio::null());
    cmd
}

/// The longest any fleetctl run here may take: well above the longest wait of any command
/// (10 s for an admin request), so that a hang fails the test instead of hanging it.
const RUN_LIMIT: Duration = Duration::from_secs(30);

/// Slack over a run's own window or timeout before the wait for it gives up.
const MARGIN: Duration = Duration::from_secs(15);

fn fleetctl(args: &[&str]) -> Run {
    Run::from(output_within(&mut fleetctl_cmd(args), RUN_LIMIT))
}

/// A stand-in for a fleet-mode broker: subscribes to its channel and `fleetlink:broadcast`,
/// records every message, and answers them unless silent.
struct FakeBroker {
    stop: Arc<AtomicBool>,
    thread: Option<JoinHandle<()>>,
    /// Every message received, in order.
    seen: mpsc::Receiver<Value>,
}

impl FakeBroker {
    /// Starts answering as `id`; `matched` is what its broadcast replies report.
    fn start(redis: &RedisServer, id: &str, answer: bool, matched: u64) -> FakeBroker {
        let mut con = redis.connection();
        let blob = json!({"broker_id": id, "address": "127.0.0.1:8080", "cores": 2,
                          "started_at": "2026-01-01T00:00:00.000Z", "connections": matched});
        let _: () = redis::cmd("SET")
            .arg(format!("broker:{id}"))
            .arg(blob.to_string())
            .arg("PX")
            .arg(30_000)
            .query(&mut con)
            .unwrap();
        let stop = Arc::new(AtomicBool::new(false));
        let (seen_tx, seen) = mpsc::channel();
        let (ready_tx, ready_rx) = mpsc::channel();
        let mut sub_con = redis.connection();
        let mut pub_con = redis.connection();
        let id = id.to_owned();
        let thread = std::thread::spawn({
            let stop = stop.clone();
            move || {
                let mut sub = sub_con.as_pubsub();
                sub.subscribe(vec![
                    format!("fleetlink:broker:{id}"),
                    "fleetlink:broadcast".to_owned(),
                ])
                .unwrap();
                sub.set_read_timeout(Some(Duration::from_millis(50)))
                    .unwrap();
                ready_tx.send(()).unwrap();
                while !stop.load(Ordering::SeqCst) {
                    let msg = match sub.get_message() {
                        Ok(msg) => msg,
                        Err(e) if e.is_timeout() => continue,
                        Err(e) => panic!("fake broker lost redis: {e}"),
                    };
                    let payload: String = msg.get_payload().unwrap();
                    let m: Value = serde_json::from_str(&payload).unwrap();
                    let _ = seen_tx.send(m.clone());
                    if !answer {
                        continue;
                    }
                    let reply = match (m["type"].as_str(), m.get("selector")) {
                        (Some("command"), Some(_)) => {
                            json!({"id": m["id"], "ok": true, "broker_id": id,
                            "matched": matched, "enqueued": matched, "failed": []})
                        }
                        (Some("command"), None) => {
                            json!({"id": m["id"], "ok": true, "rig_id": m["rig_id"], "seq": 1})
                        }
                        (Some("kick"), _) => {
                            json!({"id": m["id"], "ok": true, "rig_id": m["rig_id"]})
                        }
                        _ => continue,
                    };
                    let to = m["reply_to"].as_str().unwrap().to_owned();
                    let _: i64 = redis::cmd("PUBLISH")
                        .arg(to)
                        .arg(reply.to_string())
                        .query(&mut pub_con)
                        .unwrap();
                }
            }
        });
        ready_rx
            .recv_timeout(Duration::from_secs(10))
            .expect("fake broker subscribed");
        FakeBroker {
            stop,
            thread: Some(thread),
            seen,
        }
    }

    /// The next message it received (within 5 s).
    fn next(&self) -> Value {
        self.seen
            .recv_timeout(Duration::from_secs(5))
            .expect("fake broker got a message")
    }
}

impl Drop for FakeBroker {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::SeqCst);
        if let Some(t) = self.thread.take() {
            // A panic in the fake broker fails the test, unless it is failing already.
            if t.join().is_err() && !std::thread::panicking() {
                panic!("the fake broker thread panicked");
            }
        }
    }
}

/// A fleet of one: fake broker `fe-t` (answering, or silent) with `rig-1` registered on it.
fn one_rig_fleet(answer: bool) -> (RedisServer, FakeBroker) {
    let redis = RedisServer::start();
    let fe = FakeBroker::start(&redis, "fe-t", answer, 0);
    register(&redis, "rig-1", "fe-t");
    (redis, fe)
}

/// Registers `rig` on `broker` the way the hello script would.
fn register(redis: &RedisServer, rig: &str, broker: &str) -> String {
    let boot = boot_id();
    let mut con = redis.connection();
    let _: () = redis::cmd("SET")
        .arg(format!("rig:{rig}"))
        .arg(format!("{boot}|{broker}"))
        .arg("PX")
        .arg(60_000)
        .query(&mut con)
        .unwrap();
    boot
}

#[test]
fn redis_send_prints_the_reply() {
    let (redis, fe) = one_rig_fleet(true);
    let run = fleetctl(&[
        "--redis",
        &redis.url(),
        "--json",
        "send",
        "rig-1",
        "reboot",
        "--args",
        r#"{"delay":3}"#,
    ]);
    run.assert_code(0);
    let cmd = fe.next();
    assert_eq!(cmd["type"], "command");
    assert_eq!(cmd["rig_id"], "rig-1");
    assert_eq!(cmd["name"], "reboot");
    assert_eq!(cmd["args"], json!({"delay": 3}));
    let id = cmd["id"].as_str().unwrap();
    assert_eq!(cmd["reply_to"], format!("fleetlink:reply:{id}"));
    assert_eq!(
        run.lines(),
        vec![json!({"id": id, "ok": true, "rig_id": "rig-1", "seq": 1})]
    );

    let human = fleetctl(&["--redis", &redis.url(), "send", "rig-1", "reboot"]);
    human.assert_code(0);
    assert!(
        human.stdout.starts_with("rig-1: enqueued as seq 1"),
        "{}",
        human.stdout
    );
}

#[test]
fn redis_send_to_unknown_rig_exits_2() {
    let redis = RedisServer::start();
    let run = fleetctl(&[
        "--redis",
        &redis.url(),
        "--json",
        "send",
        "nobody",
        "reboot",
    ]);
    run.assert_code(2);
    let reply = &run.lines()[0];
    assert_eq!(reply["ok"], false);
    assert_eq!(reply["error"], "rig_not_connected");
    assert_eq!(reply["rig_id"], "nobody");
}

#[test]
fn redis_send_to_a_gone_broker_is_rig_not_connected() {
    let redis = RedisServer::start();
    register(&redis, "rig-1", "fe-dead");
    let run = fleetctl(&["--redis", &redis.url(), "--json", "send", "rig-1", "reboot"]);
    run.assert_code(2);
    let reply = &run.lines()[0];
    assert_eq!(reply["error"], "rig_not_connected");
    assert!(
        reply["detail"].as_str().unwrap().contains("fe-dead"),
        "{reply}"
    );
}

/// A tool watching the fleet with `PSUBSCRIBE *` counts as a receiver of every PUBLISH: a
/// send to a gone broker still answers at once, rather than wait out its timeout.
#[test]
fn redis_send_to_a_gone_broker_is_rig_not_connected_while_a_pattern_watches() {
    let redis = RedisServer::start();
    register(&redis, "rig-1", "fe-dead");
    let mut watcher = redis.connection();
    let _: () = redis::cmd("PSUBSCRIBE")
        .arg("*")
        .query(&mut watcher)
        .unwrap();
    let started = Instant::now();
    let run = fleetctl(&[
        "--redis",
        &redis.url(),
        "--json",
        "send",
        "rig-1",
        "reboot",
        "--timeout",
        "20s",
    ]);
    run.assert_code(2);
    assert_eq!(run.lines()[0]["error"], "rig_not_connected");
    assert!(
        started.elapsed() < Duration::from_secs(10),
        "waited {:?}",
        started.elapsed()
    );
}

#[test]
fn redis_send_to_a_silent_broker_times_out() {
    let (redis, fe) = one_rig_fleet(false);
    let started = Instant::now();
    let run = fleetctl(&[
        "--redis",
        &redis.url(),
        "--json",
        "send",
        "rig-1",
        "reboot",
        "--timeout",
        "400ms",
    ]);
    let took = started.elapsed();
    run.assert_code(3);
    assert!(
        took >= Duration::from_millis(400),
        "gave up early: {took:?}"
    );
    assert!(
        took < Duration::from_secs(4),
        "timeout not honoured: {took:?}"
    );
    assert_eq!(fe.next()["name"], "reboot");
    let reply = &run.lines()[0];
    assert_eq!(reply["error"], "timeout");
}

#[test]
fn redis_kick_publishes_a_kick() {
    let (redis, fe) = one_rig_fleet(true);
    let run = fleetctl(&["--redis", &redis.url(), "--json", "kick", "rig-1"]);
    run.assert_code(0);
    let kick = fe.next();
    assert_eq!(kick["type"], "kick");
    assert_eq!(kick["rig_id"], "rig-1");
    assert!(kick.get("reply_to").is_some());
    assert_eq!(run.lines()[0]["ok"], true);
}

#[test]
fn redis_broadcast_collects_one_reply_per_broker() {
    let redis = RedisServer::start();
    let a = FakeBroker::start(&redis, "fe-a", true, 2);
    let b = FakeBroker::start(&redis, "fe-b", true, 1);
    let run = fleetctl(&[
        "--redis",
        &redis.url(),
        "--json",
        "send",
        "--selector",
        "group=lab,site=b",
        "update",
        "--args",
        r#"{"v":2}"#,
    ]);
    run.assert_code(0);
    for fe in [&a, &b] {
        let m = fe.next();
        assert_eq!(m["type"], "command");
        assert_eq!(m["selector"], json!({"group": "lab", "site": "b"}));
        assert_eq!(m["name"], "update");
        assert_eq!(m["args"], json!({"v": 2}));
    }
    let mut replies = run.lines();
    replies.sort_by_key(|r| r["broker_id"].as_str().unwrap().to_owned());
    assert_eq!(replies.len(), 2);
    assert_eq!(
        (
            replies[0]["broker_id"].as_str(),
            replies[0]["matched"].as_u64()
        ),
        (Some("fe-a"), Some(2))
    );
    assert_eq!(
        (
            replies[1]["broker_id"].as_str(),
            replies[1]["matched"].as_u64()
        ),
        (Some("fe-b"), Some(1))
    );

    let human = fleetctl(&[
        "--redis",
        &redis.url(),
        "send",
        "--selector",
        "group=lab",
        "update",
    ]);
    human.assert_code(0);
    assert!(
        human
            .stdout
            .contains("total: 2/2 brokers replied, 3 matched, 3 enqueued, 0 failed"),
        "{}",
        human.stdout
    );
}

#[test]
fn redis_broadcast_with_a_silent_live_broker_exits_3() {
    let redis = RedisServer::start();
    let _a = FakeBroker::start(&redis, "fe-a", true, 2);
    let _quiet = FakeBroker::start(&redis, "fe-quiet", false, 0);
    let run = broadcast_to_lab(&redis, "500ms");
    run.assert_code(3);
    assert_eq!(line_of(&run, "fe-quiet")["error"], "timeout");
}

/// The one line of `broker` among the two a broadcast to two brokers printed.
fn line_of(run: &Run, broker: &str) -> Value {
    let lines = run.lines();
    assert_eq!(lines.len(), 2, "{lines:?}");
    lines
        .into_iter()
        .find(|l| l["broker_id"] == broker)
        .unwrap_or_else(|| panic!("no line for {broker}"))
}

/// `send --selector group=lab x --json` through `redis`, waiting `timeout` for the replies.
fn broadcast_to_lab(redis: &RedisServer, timeout: &str) -> Run {
    let url = redis.url();
    fleetctl(&[
        "--redis",
        &url,
        "--json",
        "send",
        "--selector",
        "group=lab",
        "x",
        "--timeout",
        timeout,
    ])
}

/// The `broker:<id>` key a SIGKILLed broker leaves for its TTL, with nothing on its channel.
fn killed_brokers_key(redis: &RedisServer, id: &str) {
    let _: () = redis::cmd("SET")
        .arg(format!("broker:{id}"))
        .arg("{}")
        .arg("PX")
        .arg(30_000)
        .query(&mut redis.connection())
        .unwrap();
}

/// A SIGKILLed broker's key lives on for its TTL, but pub/sub reaches only subscribers: the
/// broadcast cannot reach it, so it is reported at once (exit 2), not waited for (exit 3).
#[test]
fn redis_broadcast_reports_a_broker_with_nothing_on_its_channel_at_once() {
    let redis = RedisServer::start();
    let _a = FakeBroker::start(&redis, "fe-a", true, 2);
    killed_brokers_key(&redis, "fe-killed");
    let started = Instant::now();
    let run = broadcast_to_lab(&redis, "20s");
    run.assert_code(2);
    assert!(
        started.elapsed() < Duration::from_secs(15),
        "waited for the dead broker: {:?}",
        started.elapsed()
    );
    let dead = line_of(&run, "fe-killed");
    assert_eq!(
        (&dead["ok"], &dead["error"]),
        (&json!(false), &json!("broker_not_listening"))
    );
    assert_eq!(line_of(&run, "fe-a")["matched"], 2);
    let url = redis.url();
    let human = fleetctl(&["--redis", &url, "send", "--selector", "group=lab", "x"]);
    human.assert_code(2);
    // The dead broker's line is fleetctl's, not a reply of the broker's.
    assert!(
        human
            .stdout
            .contains("total: 1/2 brokers replied, 1 not listening, 2 matched"),
        "{}",
        human.stdout
    );
}

#[test]
fn redis_status_tells_live_from_dead_brokers() {
    let redis = RedisServer::start();
    let _fe = FakeBroker::start(&redis, "fe-t", true, 5);
    let boot = register(&redis, "rig-live", "fe-t");
    register(&redis, "rig-stale", "fe-dead");

    let live = fleetctl(&["--redis", &redis.url(), "--json", "status", "rig-live"]);
    live.assert_code(0);
    let s = &live.lines()[0];
    assert_eq!(s["boot_id"], boot.as_str());
    assert_eq!(s["broker_id"], "fe-t");
    assert_eq!(s["broker_live"], true);
    assert_eq!(s["broker"]["connections"], 5);
    assert!(s["ttl_ms"].as_i64().unwrap() > 0);

    // A rig whose broker is gone cannot be reached: what `send` would say, with the entry.
    let dead = fleetctl(&["--redis", &redis.url(), "--json", "status", "rig-stale"]);
    dead.assert_code(2);
    assert_eq!(dead.lines()[0]["broker_live"], false);
    assert_eq!(dead.lines()[0]["error"], "rig_not_connected");
    assert_eq!(dead.lines()[0]["broker_id"], "fe-dead");
    let human = fleetctl(&["--redis", &redis.url(), "status", "rig-stale"]);
    assert!(human.stdout.contains("fe-dead (dead"), "{}", human.stdout);

    // A SIGKILLed broker: its key lives on for its TTL, but its channel has no subscriber.
    killed_brokers_key(&redis, "fe-killed");
    register(&redis, "rig-orphan", "fe-killed");
    let killed = fleetctl(&["--redis", &redis.url(), "--json", "status", "rig-orphan"]);
    killed.assert_code(2);
    assert_eq!(killed.lines()[0]["broker_live"], false);
    assert_eq!(killed.lines()[0]["broker_key"], true);
    let human = fleetctl(&["--redis", &redis.url(), "status", "rig-orphan"]);
    assert!(
        human.stdout.contains("fe-killed (dead: nothing listens"),
        "{}",
        human.stdout
    );
    let list = fleetctl(&["--redis", &redis.url(), "--json", "list"]);
    let live: std::collections::BTreeMap<String, bool> = list
        .lines()
        .iter()
        .map(|r| {
            let rig = r["rig_id"].as_str().unwrap().to_owned();
            (rig, r["broker_live"].as_bool().unwrap())
        })
        .collect();
    assert!(live["rig-live"]);
    assert!(!live["rig-orphan"]);
    assert!(!live["rig-stale"]);

    fleetctl(&["--redis", &redis.url(), "status", "rig-none"]).assert_code(2);
}

#[test]
fn redis_list_pages_over_2500_rigs() {
    let redis = RedisServer::start();
    let mut con = redis.connection();
    let mut pipe = redis::pipe();
    for i in 0..2500 {
        pipe.cmd("SET")
            .arg(format!("rig:rig-{i:04}"))
            .arg(format!("{}|fe-{}", boot_id(), i % 3))
            .ignore();
    }
    pipe.cmd("SET").arg("broker:fe-0").arg("{}").ignore();
    let _: () = pipe.query(&mut con).unwrap();

    // --json follows the pages itself and prints rig objects only, each rig once.
    let run = fleetctl(&[
        "--redis",
        &redis.url(),
        "--json",
        "list",
        "--page-size",
        "400",
    ]);
    run.assert_code(0);
    let mut seen = std::collections::BTreeSet::new();
    for row in run.lines() {
        assert!(
            row["boot_id"].as_str().unwrap().len() == 36
                && row["broker_id"].as_str().unwrap().starts_with("fe-"),
            "{row}"
        );
        assert!(
            seen.insert(row["rig_id"].as_str().unwrap().to_owned()),
            "{row} twice"
        );
    }
    assert_eq!(seen.len(), 2500);

    let human = fleetctl(&["--redis", &redis.url(), "list", "--page-size", "10"]);
    human.assert_code(0);
    assert!(human.stdout.starts_with("RIG"), "{}", human.stdout);
    assert!(human.stdout.contains("next: --cursor"), "{}", human.stdout);
}

#[test]
fn redis_brokers_lists_live_broker_keys() {
    let redis = RedisServer::start();
    let _a = FakeBroker::start(&redis, "fe-a", true, 7);
    let run = fleetctl(&["--redis", &redis.url(), "--json", "brokers"]);
    run.assert_code(0);
    let rows = run.lines();
    assert_eq!(rows.len(), 1);
    assert_eq!(rows[0]["broker_id"], "fe-a");
    assert_eq!(rows[0]["connections"], 7);
    assert!(rows[0]["ttl_ms"].as_i64().unwrap() > 20_000);
    assert_eq!(rows[0]["listening"], true);

    // A SIGKILLed broker's key outlives it; nothing listens on its channel.
    let _: () = redis::cmd("SET")
        .arg("broker:fe-killed")
        .arg("{}")
        .arg("PX")
        .arg(30_000)
        .query(&mut redis.connection())
        .unwrap();
    let run = fleetctl(&["--redis", &redis.url(), "--json", "brokers"]);
    let rows = run.lines();
    assert_eq!(rows.len(), 2);
    assert_eq!(rows[1]["broker_id"], "fe-killed");
    assert_eq!(rows[1]["listening"], false);
    let human = fleetctl(&["--redis", &redis.url(), "brokers"]);
    assert!(
        human.stdout.contains("(1 live brokers; 1 dead"),
        "{}",
        human.stdout
    );
}

/// A broker that starts draining says so in its `broker:` key at once, and `brokers` shows it:
/// it still listens, but its rigs are leaving it.
#[test]
fn redis_brokers_shows_a_draining_broker() {
    let redis = RedisServer::start();
    let b = Broker::start(&[
        "--redis",
        &redis.url(),
        "--broker-id",
        "fe-d",
        "--drain",
        "30s",
    ]);
    b.wait_readyz(200, Duration::from_secs(10), "broker ready");
    // A rig that stays keeps the drain going for its window.
    let mut ws = b.connect("/agent");
    hello(&mut ws, "rig-d", &boot_id(), json!({}));
    let blob = || -> Value {
        let raw: Option<String> = redis::cmd("GET")
            .arg("broker:fe-d")
            .query(&mut redis.connection())
            .unwrap();
        raw.and_then(|r| serde_json::from_str(&r).ok())
            .unwrap_or(Value::Null)
    };
    common::broker::eventually(Duration::from_secs(10), "the heartbeat written", || {
        blob()["draining"] == false
    });
    assert_eq!(b.http("POST", "/v1/drain", "").0, 202);
    common::broker::eventually(Duration::from_secs(5), "the drain in the key", || {
        blob()["draining"] == true
    });
    let human = fleetctl(&["--redis", &redis.url(), "brokers"]);
    human.assert_code(0);
    assert!(human.stdout.contains("yes (draining)"), "{}", human.stdout);
}

/// Returns once fleetctl listens on `fleetlink:events`: an event published earlier is lost.
fn wait_for_events_subscriber(con: &mut redis::Connection) {
    common::broker::eventually(Duration::from_secs(10), "fleetctl subscribed", || {
        let subs: (String, i64) = redis::cmd("PUBSUB")
            .arg("NUMSUB")
            .arg("fleetlink:events")
            .query(con)
            .unwrap();
        subs.1 == 1
    });
}

#[test]
fn redis_events_tail_stops_after_count() {
    let redis = RedisServer::start();
    let mut con = redis.connection();
    let child = spawn_piped(&mut fleetctl_cmd(&[
        "--redis",
        &redis.url(),
        "--json",
        "events",
        "--count",
        "2",
        "--for",
        "20s",
    ]));
    wait_for_events_subscriber(&mut con);
    let events = [
        json!({"type": "connected", "rig_id": "rig-1", "boot_id": boot_id(), "broker_id": "fe-t", "at": "2026-01-01T00:00:00.000Z"}),
        json!({"type": "disconnected", "rig_id": "rig-1", "code": 1012, "reason": "kick", "at": "2026-01-01T00:00:01.000Z"}),
        json!({"type": "ack", "rig_id": "rig-1", "seq": 1}),
    ];
    for e in &events {
        let _: i64 = redis::cmd("PUBLISH")
            .arg("fleetlink:events")
            .arg(e.to_string())
            .query(&mut con)
            .unwrap();
    }
    let run = Run::from(child.output_within(Duration::from_secs(20) + MARGIN));
    run.assert_code(0);
    assert_eq!(run.lines(), events[..2].to_vec());

    // Human lines, and a window that ends before the count: exit 3.
    let child = spawn_piped(&mut fleetctl_cmd(&[
        "--redis",
        &redis.url(),
        "events",
        "--count",
        "5",
        "--for",
        "1500ms",
    ]));
    wait_for_events_subscriber(&mut con);
    let _: i64 = redis::cmd("PUBLISH")
        .arg("fleetlink:events")
        .arg(events[1].to_string())
        .query(&mut con)
        .unwrap();
    let run = Run::from(child.output_within(Duration::from_millis(1500) + MARGIN));
    run.assert_code(3);
    assert_eq!(
        run.stdout.trim(),
        "2026-01-01T00:00:01.000Z disconnected rig-1 code=1012 reason=kick"
    );

    fleetctl(&["--redis", &redis.url(), "events", "--for", "200ms"]).assert_code(0);
}

#[test]
fn redis_unreachable_is_a_clear_error() {
    // Bound, never listening: refused, and no other test's server can take the port meanwhile.
    let closed = RefusingPort::new();
    let run = fleetctl(&[
        "--redis",
        &format!("redis://127.0.0.1:{}/", closed.port()),
        "send",
        "rig-1",
        "reboot",
    ]);
    drop(closed);
    run.assert_code(2);
    assert!(
        run.stderr.contains("cannot connect to Redis"),
        "{}",
        run.stderr
    );
}

#[test]
fn admin_send_reaches_the_rig() {
    let b = Broker::start(&["--cores", "1"]);
    let (mut ws, _boot, _) = b.rig("rig-a");
    let admin = format!("http://{}", b.admin);
    let run = fleetctl(&[
        "--admin",
        &admin,
        "--json",
        "send",
        "rig-a",
        "reboot",
        "--args",
        r#"{"n":1}"#,
    ]);
    run.assert_code(0);
    let reply = &run.lines()[0];
    assert_eq!(
        (
            reply["ok"].as_bool(),
            reply["rig_id"].as_str(),
            reply["seq"].as_u64()
        ),
        (Some(true), Some("rig-a"), Some(1))
    );
    let cmd = read_json(&mut ws);
    assert_eq!(cmd["type"], "command");
    assert_eq!(cmd["name"], "reboot");
    assert_eq!(cmd["args"], json!({"n": 1}));
    assert_eq!(cmd["seq"], 1);
    assert_eq!(cmd["id"], reply["id"]);
}

#[test]
fn admin_send_to_unknown_rig_exits_2() {
    let b = Broker::start(&["--cores", "1"]);
    let admin = format!("http://{}", b.admin);
    let run = fleetctl(&["--admin", &admin, "--json", "send", "nobody", "reboot"]);
    run.assert_code(2);
    assert_eq!(run.lines()[0]["error"], "rig_not_connected");
    // Env selects the plane too.
    let run = Run::from(output_within(
        fleetctl_cmd(&["send", "nobody", "reboot"]).env("FLEETCTL_ADMIN", &admin),
        RUN_LIMIT,
    ));
    run.assert_code(2);
    assert!(
        run.stdout.starts_with("nobody: rig_not_connected"),
        "{}",
        run.stdout
    );
}

/// An admin API that takes the connection and never answers: every request is a timeout,
/// exit 3 (CONTRACT.md §1), and a selector send waits its own `--timeout`, not a fixed one.
#[test]
fn admin_requests_that_get_no_answer_exit_3() {
    let silent = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let admin = format!("http://{}", silent.local_addr().unwrap());
    // The kernel completes the handshakes (the backlog); nobody ever reads or answers.
    let status = spawn_piped(&mut fleetctl_cmd(&["--admin", &admin, "status", "rig-1"]));
    let started = Instant::now();
    let run = fleetctl(&[
        "--admin",
        &admin,
        "send",
        "--selector",
        "group=a",
        "uptime",
        "--timeout",
        "1s",
    ]);
    run.assert_code(3);
    assert!(
        started.elapsed() < Duration::from_secs(5),
        "the selector send took {:?} with --timeout 1s",
        started.elapsed()
    );
    assert!(run.stderr.contains("no answer"), "{}", run.stderr);
    // A read-only request waits 10 s for its answer.
    Run::from(status.output_within(Duration::from_secs(10) + MARGIN)).assert_code(3);
    drop(silent);
}

#[test]
fn admin_kick_closes_the_rig_with_1012() {
    let b = Broker::start(&["--cores", "1"]);
    let (mut ws, _boot, _) = b.rig("rig-k");
    let run = fleetctl(&["--admin", &format!("http://{}", b.admin), "kick", "rig-k"]);
    run.assert_code(0);
    assert_eq!(read_close(&mut ws), 1012);
}

/// Rigs leaving between two pages of `list --admin` make none of the others skipped: the
/// cursor names the last rig shown, not its place (with an offset, the two rigs after the
/// leavers were never listed).
#[test]
fn admin_list_pages_skip_no_rig_when_rigs_leave_between_pages() {
    let b = Broker::start(&["--cores", "1"]);
    let admin = format!("http://{}", b.admin);
    let mut rigs: Vec<_> = (0..7).map(|i| b.rig(&format!("rig-{i}")).0).collect();
    let first = fleetctl(&["--admin", &admin, "list", "--page-size", "2"]);
    first.assert_code(0);
    assert!(
        first.stdout.contains("next: --cursor after:rig-1"),
        "{}",
        first.stdout
    );
    // The two rigs of the first page leave.
    for mut ws in rigs.drain(..2) {
        ws.close(None).unwrap();
        while ws.read().is_ok() {}
    }
    common::broker::eventually(Duration::from_secs(10), "two rigs gone", || {
        b.http("GET", "/v1/rigs", "").1.matches("rig_id").count() == 5
    });
    let rest = fleetctl(&[
        "--admin",
        &admin,
        "--json",
        "list",
        "--page-size",
        "2",
        "--cursor",
        "after:rig-1",
    ]);
    let ids: Vec<_> = rest.lines().iter().map(|l| l["rig_id"].clone()).collect();
    assert_eq!(
        ids,
        ["rig-2", "rig-3", "rig-4", "rig-5", "rig-6"].map(|id| json!(id)),
        "{}",
        rest.stdout
    );
}

#[test]
fn admin_status_list_and_selector() {
    let b = Broker::start(&["--cores", "1"]);
    let admin = format!("http://{}", b.admin);
    let mut lab = b.connect("/agent");
    hello(&mut lab, "rig-lab", &boot_id(), json!({"group": "lab"}));
    let mut other = b.connect("/agent");
    hello(
        &mut other,
        "rig-other",
        &boot_id(),
        json!({"group": "other"}),
    );

    let status = fleetctl(&["--admin", &admin, "--json", "status", "rig-lab"]);
    status.assert_code(0);
    assert_eq!(status.lines()[0]["labels"], json!({"group": "lab"}));
    fleetctl(&["--admin", &admin, "status", "rig-none"]).assert_code(2);

    // Pages of one are followed to the end; every line is a rig, none a cursor.
    let page = fleetctl(&["--admin", &admin, "--json", "list", "--page-size", "1"]);
    page.assert_code(0);
    let ids: Vec<_> = page.lines().iter().map(|l| l["rig_id"].clone()).collect();
    assert_eq!(
        ids,
        [json!("rig-lab"), json!("rig-other")],
        "{}",
        page.stdout
    );
    let page = fleetctl(&[
        "--admin",
        &admin,
        "--json",
        "list",
        "--page-size",
        "1",
        "--cursor",
        "after:rig-lab",
    ]);
    let ids: Vec<_> = page.lines().iter().map(|l| l["rig_id"].clone()).collect();
    assert_eq!(ids, [json!("rig-other")], "{}", page.stdout);
    let human = fleetctl(&["--admin", &admin, "list", "--page-size", "1"]);
    assert!(
        human.stdout.contains("next: --cursor after:rig-lab"),
        "{}",
        human.stdout
    );
    // Another plane's cursor is a usage error, not a silent first page.
    fleetctl(&["--admin", &admin, "list", "--cursor", "1"]).assert_code(64);
    // A page past the end is empty, with this broker's columns all the same.
    let past = fleetctl(&["--admin", &admin, "list", "--cursor", "after:zzz"]);
    past.assert_code(0);
    assert!(
        past.stdout.contains("CONNECTED_AT") && !past.stdout.contains("BROKER"),
        "{}",
        past.stdout
    );

    // brokers: the broker's own id, not the admin address.
    let brokers = fleetctl(&["--admin", &admin, "--json", "brokers"]);
    brokers.assert_code(0);
    let rows = brokers.lines();
    assert_eq!(rows.len(), 1, "{}", brokers.stdout);
    assert_eq!(rows[0]["broker_id"], b.broker_id.as_str());
    assert_eq!(rows[0]["healthz"], 200);

    let run = fleetctl(&[
        "--admin",
        &admin,
        "--json",
        "send",
        "--selector",
        "group=lab",
        "ping",
    ]);
    run.assert_code(0);
    let summary = &run.lines()[0];
    assert_eq!(
        (summary["matched"].as_u64(), summary["enqueued"].as_u64()),
        (Some(1), Some(1))
    );
    assert_eq!(summary["broker_id"], b.broker_id.as_str(), "{summary}");
    assert_eq!(read_json(&mut lab)["name"], "ping");
    // Where that name comes from: every admin answer says it.
    let head = {
        use std::io::{Read, Write};
        let mut s = std::net::TcpStream::connect(admin.trim_start_matches("http://")).unwrap();
        s.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
        write!(
            s,
            "GET /healthz HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n"
        )
        .unwrap();
        let mut answer = String::new();
        s.read_to_string(&mut answer).unwrap();
        answer
    };
    let named = format!("\r\nFleetlink-Broker-Id: {}\r\n", b.broker_id);
    assert!(head.contains(&named), "{head}");

    let health = fleetctl(&["--admin", &admin, "--json", "brokers"]);
    health.assert_code(0);
    assert_eq!(health.lines()[0]["healthz"], 200);
    // A path that is no broker's admin API (its /healthz is 404) is an error, not a broker
    // listed as not ready.
    let wrong = format!("{admin}/prefix");
    let typo = fleetctl(&["--admin", &wrong, "--json", "brokers"]);
    typo.assert_code(2);
    assert!(typo.stderr.contains("answered 404"), "{}", typo.stderr);
}

#[test]
fn usage_errors_exit_64() {
    let long_name = "n".repeat(129);
    let cases: &[&[&str]] = &[
        &[],
        &["frobnicate"],
        &["send", "rig-1"],
        &["send", "rig-1", "reboot", "--args", "[1,2]"],
        &["send", "rig-1", "reboot", "--args", "{nope"],
        &["send", "rig-1", "reboot", "--timeout", "soon"],
        &["send", "--selector", "group", "reboot"],
        &["send", "--selector", "group=lab", "rig-1", "reboot"],
        &["send", "bad rig!", "reboot"],
        &["send", "rig-1", ""],
        &["send", "rig-1", &long_name],
        &["send", "--selector", "group=lab", ""],
        &[
            "--redis",
            "redis://127.0.0.1:1/",
            "--admin",
            "http://127.0.0.1:1",
            "list",
        ],
        &["--redis", "http://127.0.0.1:1", "list"],
        &["list", "--page-size", "0"],
    ];
    for args in cases {
        let run = fleetctl(args);
        assert_eq!(
            run.code, 64,
            "fleetctl {args:?}\nstdout: {}\nstderr: {}",
            run.stdout, run.stderr
        );
        assert!(!run.stderr.is_empty(), "fleetctl {args:?} gave no message");
    }
    let both = Run::from(output_within(
        fleetctl_cmd(&["list"])
            .env("FLEETCTL_REDIS", "redis://127.0.0.1:1/")
            .env("FLEETCTL_ADMIN", "http://x:1"),
        RUN_LIMIT,
    ));
    both.assert_code(64);
    fleetctl(&["--help"]).assert_code(0);
}

/// A Redis that takes connections but never answers (SIGSTOP: hung, or a black-holed path)
/// costs `send` its `--timeout`, `events` its `--for`, and the commands without one their
/// stated 5 s, then exit 3 saying so, not a fixed 10 s and an exit 2 "cannot connect". (The
/// tail's subscription, dropped, waited once more for Redis to confirm its unsubscribe.)
#[test]
fn a_hung_redis_is_a_timeout_within_the_commands_wait() {
    let (redis, _fe) = one_rig_fleet(true);
    redis.freeze(true);
    let url = redis.url();
    let started = Instant::now();
    let spawn = |args: &[&str]| {
        let mut all = vec!["--redis", url.as_str()];
        all.extend_from_slice(args);
        spawn_piped(&mut fleetctl_cmd(&all))
    };
    // All at once, so the test waits 5 s, not 12; the shortest first.
    let runs = [
        (spawn(&["send", "rig-1", "reboot", "--timeout", "2s"]), 2),
        (spawn(&["events", "--for", "3s"]), 3),
        (spawn(&["status", "rig-1"]), 5),
        (spawn(&["brokers"]), 5),
    ];
    for (child, wait) in runs {
        let run = Run::from(child.output_within(Duration::from_secs(wait) + MARGIN));
        let took = started.elapsed();
        run.assert_code(3);
        assert!(
            run.stderr
                .contains(&format!("Redis at {url} did not answer within {wait}s")),
            "{}",
            run.stderr
        );
        assert!(
            took < Duration::from_millis(wait * 1000 + 1500),
            "{wait}s wait took {took:?}"
        );
    }
    redis.freeze(false);
}

/// A Redis that hangs once the tail is subscribed: `events --for 3s` still ends at its 3 s
/// (exit 0, nothing arrived), not 3 s more, which its dropped subscription spent waiting for
/// Redis to confirm the unsubscribe.
#[test]
fn an_events_tail_ends_at_its_for_when_redis_hangs_under_it() {
    let redis = RedisServer::start();
    let mut con = redis.connection();
    let started = Instant::now();
    let child = spawn_piped(&mut fleetctl_cmd(&[
        "--redis",
        &redis.url(),
        "events",
        "--for",
        "3s",
    ]));
    wait_for_events_subscriber(&mut con);
    redis.freeze(true);
    let run = Run::from(child.output_within(Duration::from_secs(3) + MARGIN));
    let took = started.elapsed();
    redis.freeze(false);
    run.assert_code(0);
    assert!(
        took < Duration::from_millis(4500),
        "a 3 s tail took {took:?}"
    );
}

/// How many PINGs Redis has served since it started (`INFO commandstats`).
fn pings_served(con: &mut redis::Connection) -> u64 {
    let info: String = redis::cmd("INFO").arg("commandstats").query(con).unwrap();
    info.lines()
        .find_map(|l| l.strip_prefix("cmdstat_ping:calls="))
        .and_then(|rest| rest.split(',').next())
        .map_or(0, |n| n.parse().unwrap())
}

/// A tail with no `--for` asks a quiet Redis whether it is still there: a live one answers
/// and the tail goes on (an event after the PING still arrives); a hung one (SIGSTOP after
/// the subscription) ends the tail with exit 3 within the probe's 2 s and the PING's 5 s,
/// where before it waited for ever.
#[test]
fn an_events_tail_without_for_notices_a_redis_that_hangs_under_it() {
    let redis = RedisServer::start();
    let mut con = redis.connection();
    let child = spawn_piped(&mut fleetctl_cmd(&[
        "--redis",
        &redis.url(),
        "--json",
        "events",
        "--count",
        "1",
    ]));
    wait_for_events_subscriber(&mut con);
    let before = pings_served(&mut con);
    common::broker::eventually(Duration::from_secs(10), "the tail's PING", || {
        pings_served(&mut con) > before
    });
    let event = json!({"type": "ack", "rig_id": "rig-1", "seq": 1});
    let _: i64 = redis::cmd("PUBLISH")
        .arg("fleetlink:events")
        .arg(event.to_string())
        .query(&mut con)
        .unwrap();
    let run = Run::from(child.output_within(MARGIN));
    run.assert_code(0);
    assert_eq!(run.lines(), vec![event]);

    let child = spawn_piped(&mut fleetctl_cmd(&["--redis", &redis.url(), "events"]));
    wait_for_events_subscriber(&mut con);
    let started = Instant::now();
    redis.freeze(true);
    let run = Run::from(child.output_within(Duration::from_secs(7) + MARGIN));
    let took = started.elapsed();
    redis.freeze(false);
    run.assert_code(3);
    assert!(
        run.stderr.contains(&format!(
            "Redis at {} stopped answering: no answer to a PING on the subscription within 5s",
            redis.url()
        )),
        "{}",
        run.stderr
    );
    assert!(took < Duration::from_millis(8500), "noticed after {took:?}");
}

/// With `--admin`, `events` tails a standalone broker's kept events (`GET /v1/events`) from
/// the newest when it starts.
#[test]
fn admin_events_tail_a_standalone_brokers_events() {
    // No accept bucket to speak of: the rig below reconnects as fast as its handshakes go.
    let b = Broker::start(&["--accept-rate", "100000", "--accept-burst", "100000"]);
    let admin = format!("http://{}", b.admin);
    let child = spawn_piped(&mut fleetctl_cmd(&[
        "--admin", &admin, "--json", "events", "--count", "3", "--for", "20s",
    ]));
    // Events keep coming until the tail has its three: when it first asked is its own affair.
    let stop = Arc::new(AtomicBool::new(false));
    let listen = b.listen;
    let making = {
        let stop = stop.clone();
        std::thread::spawn(move || {
            while !stop.load(Ordering::SeqCst) {
                let url = format!("ws://{listen}/agent");
                let (mut ws, _) = tungstenite::connect(url).expect("connect");
                hello(&mut ws, "tail-1", &boot_id(), json!({}));
                ws.close(None).unwrap();
                while ws.read().is_ok() {}
            }
        })
    };
    let run = Run::from(child.output_within(Duration::from_secs(20) + MARGIN));
    stop.store(true, Ordering::SeqCst);
    making.join().unwrap();
    run.assert_code(0);
    let lines = run.lines();
    assert_eq!(lines.len(), 3, "{lines:?}");
    for (e, next) in lines.iter().zip(lines.iter().skip(1)) {
        assert_eq!(e["rig_id"], "tail-1", "{e}");
        // In the order they happened: each connect is followed by its disconnect.
        let pair = (e["type"].as_str(), next["type"].as_str());
        assert!(
            matches!(
                pair,
                (Some("connected"), Some("disconnected"))
                    | (Some("disconnected"), Some("connected"))
            ),
            "{lines:?}"
        );
    }
    // A broker in fleet mode keeps none: the broker's refusal (exit 2), not a usage error (64):
    // the command line was right.
    let redis = RedisServer::start();
    let fe = Broker::start(&["--redis", &redis.url(), "--broker-id", "fe-tail"]);
    let run = fleetctl(&[
        "--admin",
        &format!("http://{}", fe.admin),
        "events",
        "--for",
        "1s",
    ]);
    assert_eq!(run.code, 2, "{}", run.stderr);
    assert!(run.stderr.contains("keeps no events"), "{}", run.stderr);
}

/// `events --for` bounds the tail even when the admin API never answers: it used to wait
/// for its poll's own 10 s (agent and fleetctl audit).
#[test]
fn an_admin_events_tail_ends_at_its_for_when_nothing_answers() {
    let silent = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let admin = format!("http://{}", silent.local_addr().unwrap());
    let started = Instant::now();
    let run = fleetctl(&["--admin", &admin, "events", "--for", "2s"]);
    let took = started.elapsed();
    run.assert_code(3);
    assert!(run.stderr.contains("no answer"), "{}", run.stderr);
    assert!(
        took >= Duration::from_secs(2) && took < Duration::from_secs(6),
        "a 2 s tail took {took:?}"
    );
    drop(silent);
}

/// An admin API listing three rigs at once, answering each command POST after 1 s and never
/// answering `/metrics` in time; its answers name `named` as the broker, if given.
fn slow_admin(named: Option<&'static str>) -> (String, std::thread::JoinHandle<()>) {
    use std::io::{BufRead, BufReader, Read, Write};
    let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let admin = format!("http://{}", listener.local_addr().unwrap());
    let server = std::thread::spawn(move || {
        for conn in listener.incoming().take(8) {
            let Ok(mut conn) = conn else { break };
            let mut reader = BufReader::new(conn.try_clone().unwrap());
            let mut request = String::new();
            let (mut line, mut length) = (String::new(), 0usize);
            let _ = reader.read_line(&mut request);
            while reader.read_line(&mut line).is_ok_and(|n| n > 2) {
                if let Some(v) = line.to_ascii_lowercase().strip_prefix("content-length:") {
                    length = v.trim().parse().unwrap_or(0);
                }
                line.clear();
            }
            let mut body = vec![0u8; length];
            let _ = reader.read_exact(&mut body);
            let answer = if request.starts_with("GET /v1/rigs") {
                json!([0, 1, 2].map(|i| json!({"rig_id": format!("rig-{i}"),
                    "labels": {"group": "a"}})))
                .to_string()
            } else if request.starts_with("POST /v1/rigs/") {
                std::thread::sleep(Duration::from_secs(1));
                json!({"id": "x", "ok": true, "rig_id": "rig", "seq": 1}).to_string()
            } else if request.starts_with("GET /metrics") {
                // Where an older broker's id is read, last: it must not add its own wait,
                // nor turn a broadcast that went into a timeout.
                std::thread::sleep(Duration::from_secs(5));
                String::new()
            } else {
                json!({"ok": false, "error": "not_found"}).to_string()
            };
            let status = if request.starts_with("GET /metrics") {
                "404 Not Found"
            } else {
                "200 OK"
            };
            let named = named
                .map(|id| format!("Fleetlink-Broker-Id: {id}\r\n"))
                .unwrap_or_default();
            let _ = write!(
                conn,
                "HTTP/1.1 {status}\r\nContent-Type: application/json\r\nContent-Length: {}\r\n{named}Connection: close\r\n\r\n{answer}",
                answer.len()
            );
        }
    });
    (admin, server)
}

/// `send --selector` against the admin API is one POST per matching rig, and the whole of it
/// keeps to one `--timeout`, as a broadcast over Redis does: each POST gets what is left, and
/// rigs not reached in time are reported failed rather than waited for in turn (three rigs
/// behind a broker taking 1 s a POST used to take up to three timeouts). The broker is named
/// as its answers name it (`Fleetlink-Broker-Id`), whatever time is left; one that does not
/// is named by `/metrics`, read last and not waited for past the timeout (one that did not
/// answer in a whole fresh timeout failed the broadcast, exit 3, though its commands went),
/// else by its address. Before the header, a broadcast that ran out of time named the broker
/// by its address and one that did not by its id: two names for one broker.
#[test]
fn an_admin_broadcast_keeps_to_one_timeout() {
    for named in [None, Some("fe-named")] {
        let (admin, server) = slow_admin(named);
        let started = Instant::now();
        let run = fleetctl(&[
            "--admin",
            &admin,
            "--json",
            "send",
            "--selector",
            "group=a",
            "reboot",
            "--timeout",
            "1500ms",
        ]);
        let took = started.elapsed();
        assert!(
            took < Duration::from_millis(2900),
            "took {took:?}: {}",
            run.stderr
        );
        run.assert_code(2);
        let reply: Value = serde_json::from_str(run.stdout.lines().next().unwrap_or("")).unwrap();
        assert_eq!(
            reply["broker_id"],
            named.unwrap_or(admin.trim_start_matches("http://")),
            "{reply}"
        );
        assert_eq!(
            (reply["matched"].as_u64(), reply["enqueued"].as_u64()),
            (Some(3), Some(1)),
            "{reply}"
        );
        let failed = reply["failed"].as_array().cloned().unwrap_or_default();
        assert_eq!(failed.len(), 2, "{reply}");
        assert_eq!(failed[1]["error"], "timeout", "{reply}");
        let detail = failed[0]["detail"].as_str().unwrap_or_default();
        assert!(
            detail.contains("--timeout (1500ms)") && detail.contains("may have reached"),
            "the one in flight may have gone: {reply}"
        );
        drop(server);
    }
}
