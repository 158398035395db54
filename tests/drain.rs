//! Graceful drain (CONTRACT.md §7): readiness fails, every rig gets its own goaway delay within
//! the window, 1001 at the end, exit 0.

mod common;

use std::time::{Duration, Instant};

use common::broker::{eventually, read_close, read_json, Broker};
use serde_json::json;

fn drain_with(trigger: impl FnOnce(&Broker)) {
    let mut b = Broker::start(&["--drain", "600ms"]);
    let mut rigs: Vec<_> = (0..20).map(|i| b.rig(&format!("rig-{i:02}")).0).collect();
    assert_eq!(b.http("GET", "/readyz", "").0, 200);
    let started = Instant::now();
    trigger(&b);
    let mut delays = Vec::new();
    for ws in &mut rigs {
        let goaway = read_json(ws);
        assert_eq!(goaway["type"], "goaway");
        let d = goaway["reconnect_after_ms"].as_u64().unwrap();
        assert!(d < 600, "{d}");
        delays.push(d);
    }
    delays.sort();
    delays.dedup();
    assert!(delays.len() > 10, "delays should be spread, got {delays:?}");
    assert_eq!(b.http("GET", "/readyz", "").0, 503);
    for ws in &mut rigs {
        assert_eq!(read_close(ws), 1001);
    }
    assert!(started.elapsed() >= Duration::from_millis(550));
    let status = b
        .wait_exit(Duration::from_secs(10))
        .expect("broker did not exit");
    assert!(status.success(), "{status:?}");
}

/// A connection upgraded but not yet a rig's when the drain starts is told over capacity
/// (4503 `retry_after=1`: CONTRACT.md §2), at once, not closed 1001, the code for the end of a
/// drain (review bb106); so is a hello that arrives during the drain.
#[test]
fn a_connection_without_a_hello_at_a_drain_is_answered_4503_at_once() {
    let mut b = Broker::start(&["--drain", "5s"]);
    let (rig, _, _) = b.rig("rig-stays");
    let mut waiting = b.connect("/agent");
    let started = Instant::now();
    b.sigterm();
    let (code, reason) = close_of(&mut waiting);
    assert_eq!((code, reason.as_str()), (4503, "retry_after=1"));
    assert!(
        started.elapsed() < Duration::from_secs(4),
        "not at the window's end"
    );
    drop(rig);
    assert!(b
        .wait_exit(Duration::from_secs(10))
        .is_some_and(|s| s.success()));
}

/// The code and reason of the broker's close frame.
fn close_of(ws: &mut common::broker::Ws) -> (u16, String) {
    loop {
        match ws.read() {
            Ok(tungstenite::Message::Close(Some(f))) => {
                return (u16::from(f.code), f.reason.to_string())
            }
            Ok(_) => continue,
            Err(e) => panic!("no close frame: {e}"),
        }
    }
}

#[test]
fn sigterm_drains_and_exits_zero() {
    drain_with(|b| b.sigterm());
}

#[test]
fn admin_drain_route_drains_and_exits_zero() {
    drain_with(|b| assert_eq!(b.http("POST", "/v1/drain", "").0, 202));
}

#[test]
fn a_second_sigterm_ends_the_drain_at_once() {
    let mut b = Broker::start(&["--drain", "60s"]);
    let (mut ws, _, _) = b.rig("rig-cut");
    let started = Instant::now();
    b.sigterm();
    assert_eq!(read_json(&mut ws)["type"], "goaway");
    b.sigterm();
    assert_eq!(read_close(&mut ws), 1001);
    let status = b
        .wait_exit(Duration::from_secs(20))
        .expect("the second SIGTERM did not end the drain");
    assert!(status.success(), "{status:?}");
    assert!(started.elapsed() < Duration::from_secs(30));
}

#[test]
fn a_drain_ends_when_no_rig_is_left_not_at_the_end_of_its_window() {
    // No rigs at all: nothing to wait for past the drain's first second, which lets the
    // answer to POST /v1/drain out.
    let mut empty = Broker::start(&["--drain", "60s"]);
    let started = Instant::now();
    let (status, body) = empty.http("POST", "/v1/drain", "");
    assert_eq!(status, 202, "{body}");
    let status = empty
        .wait_exit(Duration::from_secs(20))
        .expect("an empty broker waited out its drain window");
    assert!(status.success(), "{status:?}");
    // The 60 s window was not waited out: the first second, and the answer, are all.
    assert!(
        started.elapsed() < Duration::from_secs(5),
        "{:?}",
        started.elapsed()
    );
    // A rig that leaves when told to: the broker goes once it has.
    let mut b = Broker::start(&["--drain", "60s"]);
    let (mut ws, _, _) = b.rig("rig-leaves");
    let started = Instant::now();
    b.sigterm();
    assert_eq!(read_json(&mut ws)["type"], "goaway");
    ws.close(None).unwrap();
    while ws.read().is_ok() {}
    let status = b
        .wait_exit(Duration::from_secs(20))
        .expect("the broker waited out its window after its last rig left");
    assert!(status.success(), "{status:?}");
    assert!(
        started.elapsed() < Duration::from_secs(5),
        "{:?}",
        started.elapsed()
    );
}

/// The usual stop after a drain through the API (`POST /v1/drain`, then `systemctl stop`'s
/// SIGTERM) keeps the window: only a second signal means "now".
#[test]
fn a_sigterm_after_an_api_drain_keeps_the_window() {
    let mut b = Broker::start(&["--drain", "3s"]);
    let (mut ws, _, _) = b.rig("rig-api");
    let started = Instant::now();
    assert_eq!(b.http("POST", "/v1/drain", "").0, 202);
    assert_eq!(read_json(&mut ws)["type"], "goaway");
    b.sigterm();
    assert_eq!(read_close(&mut ws), 1001);
    assert!(
        started.elapsed() >= Duration::from_millis(2900),
        "closed {:?} into a 3 s window",
        started.elapsed()
    );
    let status = b
        .wait_exit(Duration::from_secs(20))
        .expect("broker did not exit");
    assert!(status.success(), "{status:?}");
}

#[test]
fn sighup_on_a_plain_broker_reloads_nothing_and_keeps_serving() {
    let mut b = Broker::start(&["--drain", "200ms"]);
    let (mut ws, _, _) = b.rig("rig-hup");
    b.signal(libc::SIGHUP);
    // Still serving after the signal: a command still reaches the connected rig.
    let (_, reply) = b.command("rig-hup", "ping", json!({}));
    assert_eq!(reply["ok"], true, "{reply}");
    assert_eq!(read_json(&mut ws)["type"], "command");
    assert_eq!(b.http("GET", "/healthz", "").0, 200);
    // And it still stops the graceful way: SIGHUP's default action used to kill it (129).
    b.sigterm();
    assert_eq!(read_json(&mut ws)["type"], "goaway");
    assert_eq!(read_close(&mut ws), 1001);
    let status = b
        .wait_exit(Duration::from_secs(10))
        .expect("broker did not exit");
    assert!(status.success(), "{status:?}");
}

/// A core that has no rig left stops at its first second into the drain, while the other core
/// still has one. `/metrics` must go on reporting the stopped core's figures: a counter that
/// falls back reads as a reset to Prometheus, at every deploy.
#[test]
fn a_stopped_cores_counters_stay_in_metrics_through_the_drain() {
    let mut b = Broker::start(&["--drain", "4s", "--cores", "2"]);
    // A rig on each core (the kernel spreads connections over the cores' listeners).
    let mut by_core: [Option<common::broker::Ws>; 2] = [None, None];
    for i in 0..64 {
        if by_core.iter().all(Option::is_some) {
            break;
        }
        let rig = format!("rig-{i:02}");
        let (mut ws, _, _) = b.rig(&rig);
        let (_, r) = b.command(&rig, "n", json!({}));
        assert_eq!(r["seq"], 1, "{r}");
        assert_eq!(read_json(&mut ws)["seq"], 1);
        let ack = json!({"type": "ack", "seq": 1}).to_string();
        ws.send(tungstenite::Message::Text(ack.into())).unwrap();
        let rigs: serde_json::Value =
            serde_json::from_str(&b.http("GET", "/v1/rigs", "").1).unwrap();
        let core = rigs
            .as_array()
            .unwrap()
            .iter()
            .find(|r| r["rig_id"] == rig.as_str())
            .and_then(|r| r["core"].as_u64())
            .expect("rig listed with its core") as usize;
        if by_core[core].is_none() {
            by_core[core] = Some(ws);
        }
    }
    let [Some(mut on0), Some(mut on1)] = by_core else {
        panic!("64 rigs all landed on one core");
    };
    assert_eq!(core_threads(b.pid()), 2);
    let acked = |text: &str| -> Option<u64> {
        text.lines()
            .find_map(|l| l.strip_prefix("fleetlink_commands_total{result=\"acked\"} "))
            .and_then(|v| v.trim().parse().ok())
    };
    common::broker::eventually(Duration::from_secs(5), "every ack counted", || {
        let n = acked(&b.http("GET", "/metrics", "").1).unwrap_or(0) as usize;
        n >= 2 && b.metric("fleetlink_connections{core=\"0\"}") >= 1
    });
    let before = acked(&b.http("GET", "/metrics", "").1).unwrap();
    assert_eq!(b.http("POST", "/v1/drain", "").0, 202);
    // Core 0's rig leaves at its goaway; core 1's stays, holding its core (and the broker) up.
    assert_eq!(read_json(&mut on0)["type"], "goaway");
    on0.close(None).unwrap();
    while on0.read().is_ok() {}
    assert_eq!(read_json(&mut on1)["type"], "goaway");
    // The drain's first 3 s: core 0 stops at its 1 s floor, core 1 runs on.
    let started = Instant::now();
    let mut samples = 0;
    let mut core0_stopped = false;
    while started.elapsed() < Duration::from_secs(3) {
        // Thread names are cut to 15 bytes ("fleetlink-core-"): count them.
        core0_stopped |= core_threads(b.pid()) == 1;
        let (status, text) = b.http("GET", "/metrics", "");
        assert_eq!(status, 200, "{text}");
        assert_eq!(acked(&text), Some(before), "{text}");
        assert!(
            text.contains("fleetlink_connections{core=\"0\"}"),
            "core 0 left /metrics:\n{text}"
        );
        samples += 1;
        std::thread::sleep(Duration::from_millis(50));
    }
    assert!(samples > 10, "{samples} scrapes");
    // Else the scrapes above read a live core's counters, not a stopped one's.
    assert!(
        core0_stopped,
        "both cores ran through the drain's first 3 s"
    );
    assert_eq!(core_threads(b.pid()), 1, "core 1 holds a rig and runs on");
    drop(on1);
    let status = b.wait_exit(Duration::from_secs(10)).expect("no exit");
    assert!(status.success(), "{status:?}");
}

/// How many core threads (`fleetlink-core-N`) the broker runs now.
fn core_threads(pid: u32) -> usize {
    let tasks = std::fs::read_dir(format!("/proc/{pid}/task")).expect("the broker's tasks");
    tasks
        .filter_map(|t| std::fs::read_to_string(t.ok()?.path().join("comm")).ok())
        .filter(|comm| comm.starts_with("fleetlink-core"))
        .count()
}

/// A SIGTERM while the broker is still starting (here held a second by a Redis that accepts
/// and never answers) drains and exits 0 once it runs. The default action killed it: its
/// handler was installed only at the end of start-up.
#[test]
fn a_sigterm_during_start_up_drains_and_exits_zero() {
    use std::net::TcpListener;
    use std::process::{Command, Stdio};
    let silent = TcpListener::bind("127.0.0.1:0").unwrap();
    let url = format!("redis://{}/", silent.local_addr().unwrap());
    let mut child = Command::new(env!("CARGO_BIN_EXE_fleetlink-fe"))
        .args(["--listen", "127.0.0.1:0", "--admin", "127.0.0.1:0"])
        .args(["--redis", &url, "--broker-id", "fe-early"])
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    // Its first call to Redis: start-up has bound its ports and waits for the answer.
    let (_held, _) = silent.accept().unwrap();
    // SAFETY: kill(2) on our own child's pid.
    assert_eq!(unsafe { libc::kill(child.id() as i32, libc::SIGTERM) }, 0);
    let deadline = Instant::now() + Duration::from_secs(30);
    let status = loop {
        if let Some(status) = child.try_wait().unwrap() {
            break status;
        }
        if Instant::now() > deadline {
            let _ = child.kill();
            panic!("the broker did not exit within 30 s of its SIGTERM");
        }
        std::thread::sleep(Duration::from_millis(20));
    };
    assert_eq!(status.code(), Some(0), "{status:?}");
}

/// Sends `rig`'s hello on a fresh connection without waiting for an answer: the failpoint
/// makes the broker's thread panic on it, so none comes.
fn doomed_hello(b: &Broker, rig: &str) -> common::broker::Ws {
    let mut ws = b.connect("/agent");
    let msg = json!({"type": "hello", "rig_id": rig, "boot_id": common::broker::boot_id(), "version": "test", "labels": {}});
    ws.send(tungstenite::Message::Text(msg.to_string().into()))
        .expect("send hello");
    ws
}

#[test]
fn a_core_that_panics_takes_the_broker_down_with_a_failure_exit() {
    // Left running, the process would hold its listener's port, answer /healthz and keep
    // the rigs of its other cores, with none of the panicked core's: a supervisor would
    // never restart it.
    let mut b = Broker::start_with_env(
        &["--cores", "1", "--drain", "300ms"],
        &[("FLEETLINK_FAILPOINT", "core-panic-on-hello=rig-doomed")],
    );
    let _doomed = doomed_hello(&b, "rig-doomed");
    let status = b
        .wait_exit(Duration::from_secs(20))
        .expect("the broker kept running without its only core");
    assert_eq!(status.code(), Some(1), "{status:?}");
}

#[test]
fn a_bridge_that_panics_drains_the_cores_rigs_and_exits_with_a_failure() {
    let mut b = Broker::start_with_env(
        &["--cores", "1", "--drain", "300ms"],
        &[("FLEETLINK_FAILPOINT", "bridge-panic-on-hello=rig-doomed")],
    );
    let (mut kept, _, _) = b.rig("rig-kept");
    let _doomed = doomed_hello(&b, "rig-doomed");
    // The rigs a core still holds are drained as for SIGTERM: told to go, then closed.
    assert_eq!(read_json(&mut kept)["type"], "goaway");
    assert_eq!(read_close(&mut kept), 1001);
    let status = b
        .wait_exit(Duration::from_secs(20))
        .expect("the broker kept running without its bridge");
    assert_eq!(status.code(), Some(1), "{status:?}");
}

/// A drain says what becomes of the commands the broker holds for offline rigs, since control
/// was told each was `queued`: standalone they are lost with the process (the log names them);
/// in fleet mode they stay in Redis, and their deadlines, this broker's to report, are handed
/// to Redis for the brokers still running.
#[test]
fn a_drain_says_what_becomes_of_commands_held_for_offline_rigs() {
    let hold = |b: &Broker, n: usize| {
        for i in 0..n {
            let body = json!({"id": format!("held-{i}"), "name": "n", "args": {},
                              "queue_if_offline": true, "ttl_ms": 60_000});
            let (status, text) = b.http("POST", "/v1/rigs/rig-away/commands", &body.to_string());
            assert_eq!(status, 200, "{text}");
        }
    };
    let mut b = Broker::start_logged(&["--drain", "100ms"]);
    hold(&b, 3);
    b.sigterm();
    assert!(b
        .wait_exit(Duration::from_secs(10))
        .is_some_and(|s| s.success()));
    let line = b.wait_log(&["exiting with 3 commands held for offline rigs"]);
    assert!(line.contains("held-0") && line.contains("held-2"), "{line}");

    let redis = common::redis::RedisServer::start();
    let url = redis.url();
    let mut b = Broker::start_logged(&["--drain", "100ms", "--redis", &url]);
    b.wait_readyz(200, Duration::from_secs(10), "fleet broker ready");
    hold(&b, 2);
    b.sigterm();
    assert!(b
        .wait_exit(Duration::from_secs(10))
        .is_some_and(|s| s.success()));
    // Handed to Redis, for a broker still running to report as they come due.
    let handed: usize =
        redis::Commands::zcard(&mut redis.connection(), "offline:due:handed").expect("ZCARD");
    assert_eq!(handed, 2);
}

/// A standalone broker keeps sessions in memory: a drain says, at exit, which commands it
/// leaves unacked in them (queued, or written and maybe run), rather than let them go without
/// a word after control was told `ok`; and once draining it holds no new command for an
/// offline rig, which it could only lose.
#[test]
fn a_standalone_drain_names_the_commands_it_exits_with_and_holds_no_more() {
    let mut b = Broker::start_logged(&["--drain", "1s"]);
    let (mut ws, _, _) = b.rig("rig-busy");
    for i in 1..=2u64 {
        let (status, reply) = b.command_with_id("rig-busy", &format!("busy-{i}"));
        assert_eq!(status, 200, "{reply}");
        assert_eq!(read_json(&mut ws)["seq"], i);
    }
    let (status, _) = b.http("POST", "/v1/drain", "");
    assert_eq!(status, 202);
    assert_eq!(read_json(&mut ws)["type"], "goaway");
    let body = json!({"id": "late", "name": "n", "args": {}, "queue_if_offline": true});
    let refused = "fleetlink_registry_ops_total{op=\"offline\",result=\"draining\"}";
    // Readiness fails first; the bridge hears of the drain a moment later.
    eventually(
        Duration::from_secs(5),
        "a hold refused while draining",
        || {
            let (status, text) = b.http("POST", "/v1/rigs/rig-away/commands", &body.to_string());
            assert!(status == 200 || status == 404, "{status} {text}");
            status == 404 && text.contains("draining")
        },
    );
    assert!(b.metric(refused) >= 1);
    assert!(b
        .wait_exit(Duration::from_secs(15))
        .is_some_and(|s| s.success()));
    let line = b.wait_log(&["exiting with 2 commands of 1 rigs' sessions never acked"]);
    assert!(line.contains("rig-busy: busy-1"), "{line}");
    drop(ws);
}
