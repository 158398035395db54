//! Runs the real binary against a tiny in-test websocket server that checks each hello, sends
//! `welcome` and one stamped command, and records acks and peer addresses.

use std::collections::BTreeSet;
use std::net::{IpAddr, SocketAddr};
use std::process::Command;
use std::sync::atomic::{AtomicU64, Ordering::SeqCst};
use std::sync::{Arc, Mutex};
use std::time::{SystemTime, UNIX_EPOCH};

use fleetlink_loadgen::uuid7::is_canonical_v7;
use futures_util::{SinkExt, StreamExt};
use serde_json::Value;
use tokio::net::TcpListener;
use tokio_tungstenite::tungstenite::handshake::server::{ErrorResponse, Request, Response};
use tokio_tungstenite::tungstenite::http::StatusCode;
use tokio_tungstenite::tungstenite::Message;

#[derive(Default)]
struct Seen {
    upgrades: AtomicU64,
    rejected_503: AtomicU64,
    acks: AtomicU64,
    bad_hellos: AtomicU64,
    /// Upgrades on another path than /agent (counted here: a panic in the server's task would
    /// only end that task, and the test would not say why).
    bad_paths: AtomicU64,
    /// Text frames after the hello that are not JSON.
    bad_messages: AtomicU64,
    peers: Mutex<BTreeSet<IpAddr>>,
    rig_ids: Mutex<BTreeSet<String>>,
    /// Closes each connection once its command is acked, as a broker that dies would.
    hang_up: bool,
}

fn now_us() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .unwrap()
        .as_micros() as u64
}

/// Serves /agent; answers the first `reject_first` upgrades with 503 + Retry-After: 1.
async fn serve(listener: TcpListener, seen: Arc<Seen>, reject_first: u64) {
    loop {
        let Ok((tcp, peer)) = listener.accept().await else {
            return;
        };
        let seen = seen.clone();
        tokio::spawn(async move {
            handle(tcp, peer, seen, reject_first).await;
        });
    }
}

async fn handle(tcp: tokio::net::TcpStream, peer: SocketAddr, seen: Arc<Seen>, reject_first: u64) {
    let n = seen.upgrades.fetch_add(1, SeqCst);
    let _ = tcp.set_nodelay(true);
    // The callback's Result type is fixed by tungstenite.
    #[allow(clippy::result_large_err)]
    let callback = |req: &Request, resp: Response| -> Result<Response, ErrorResponse> {
        if n < reject_first {
            let mut e = ErrorResponse::new(None);
            *e.status_mut() = StatusCode::SERVICE_UNAVAILABLE;
            e.headers_mut().insert("Retry-After", "1".parse().unwrap());
            return Err(e);
        }
        if req.uri().path() != "/agent" {
            seen.bad_paths.fetch_add(1, SeqCst);
        }
        Ok(resp)
    };
    let Ok(mut ws) = tokio_tungstenite::accept_hdr_async(tcp, callback).await else {
        seen.rejected_503.fetch_add(1, SeqCst);
        return;
    };
    seen.peers.lock().unwrap().insert(peer.ip());
    let Some(Ok(Message::Text(hello))) = ws.next().await else {
        return;
    };
    let v: Value = serde_json::from_str(&hello).unwrap_or(Value::Null);
    let rig_id = v["rig_id"].as_str().unwrap_or_default().to_string();
    let ok = v["type"] == "hello"
        && v["version"] == "loadgen"
        && v["labels"]["group"] == "test"
        && is_canonical_v7(v["boot_id"].as_str().unwrap_or_default())
        && rig_id.starts_with("t-")
        && rig_id.len() == 8;
    if !ok {
        seen.bad_hellos.fetch_add(1, SeqCst);
    }
    seen.rig_ids.lock().unwrap().insert(rig_id.clone());
    let welcome = format!(
        r#"{{"type":"welcome","broker_id":"mini","rig_id":"{rig_id}","ping_interval_ms":20000,"resumed":false}}"#
    );
    let command = format!(
        r#"{{"type":"command","seq":1,"id":"c1","name":"x","args":{{"sent_at_us":{}}}}}"#,
        now_us()
    );
    if ws.send(Message::text(welcome)).await.is_err()
        || ws.send(Message::text(command)).await.is_err()
    {
        return;
    }
    while let Some(Ok(msg)) = ws.next().await {
        if let Message::Text(t) = msg {
            match serde_json::from_str::<Value>(&t) {
                Ok(v) if v["type"] == "ack" && v["seq"] == 1 => {
                    seen.acks.fetch_add(1, SeqCst);
                    if seen.hang_up {
                        return;
                    }
                }
                Ok(_) => {}
                Err(_) => {
                    seen.bad_messages.fetch_add(1, SeqCst);
                }
            }
        }
    }
}

fn run_loadgen(port: u16, procs: &str, report: &std::path::Path) -> (i32, String) {
    let out = loadgen(port, procs, report).output().expect("run loadgen");
    eprintln!("loadgen stderr:\n{}", String::from_utf8_lossy(&out.stderr));
    (
        out.status.code().unwrap_or(-1),
        String::from_utf8_lossy(&out.stdout).into_owned(),
    )
}

/// The loadgen's command line for 20 rigs against the mini server on `port`.
fn loadgen(port: u16, procs: &str, report: &std::path::Path) -> Command {
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_fleetlink-loadgen"));
    cmd.args(["rigs", "--url", &format!("ws://127.0.0.1:{port}/agent")])
        .args([
            "--rigs",
            "20",
            "--procs",
            procs,
            "--prefix",
            "t",
            "--labels",
            "group=test",
        ])
        .args([
            "--sources",
            "127.0.0.1-127.0.0.4",
            "--hold",
            "500ms",
            "--max-time",
            "30s",
        ])
        .arg("--report")
        .arg(report);
    cmd
}

/// A server on a free port, with what it saw.
fn mini_server(seen: Seen, reject_first: u64) -> (tokio::runtime::Runtime, u16, Arc<Seen>) {
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .unwrap();
    let listener = rt.block_on(TcpListener::bind("127.0.0.1:0")).unwrap();
    let port = listener.local_addr().unwrap().port();
    let seen = Arc::new(seen);
    rt.spawn(serve(listener, seen.clone(), reject_first));
    (rt, port, seen)
}

fn check(procs: &str, reject_first: u64) {
    let (_rt, port, seen) = mini_server(Seen::default(), reject_first);

    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("report.json");
    let (code, stdout) = run_loadgen(port, procs, &path);
    let lines: Vec<&str> = stdout
        .lines()
        .filter(|l| l.starts_with("ALL_WELCOMED"))
        .collect();
    assert_eq!(lines.len(), 1, "stdout: {stdout}");
    assert!(
        lines[0].starts_with("ALL_WELCOMED rigs=20 elapsed_ms="),
        "{}",
        lines[0]
    );
    assert_eq!(code, 0, "stdout: {stdout}");

    let r: Value = serde_json::from_str(&std::fs::read_to_string(&path).unwrap()).unwrap();
    assert_eq!(r["welcomed"], 20, "{r:#}");
    assert_eq!(r["failed"], 0, "{r:#}");
    assert_eq!(r["all_welcomed"], true);
    assert_eq!(r["commands_received"], 20);
    assert_eq!(r["acks_sent"], 20);
    assert_eq!(r["retries_503"], reject_first);
    assert_eq!(r["latency_us"]["count"], 20);
    assert!(r["latency_us"]["p99"].as_u64().is_some());
    assert_eq!(r["handshake_us"]["count"], 20);
    assert_eq!(r["exit_reason"], "hold_elapsed");
    assert_eq!(r["procs"], procs.parse::<u64>().unwrap());

    // The server side agrees: every rig acked, ids distinct, sources spread.
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(5);
    while seen.acks.load(SeqCst) < 20 && std::time::Instant::now() < deadline {
        std::thread::sleep(std::time::Duration::from_millis(20));
    }
    assert_eq!(seen.acks.load(SeqCst), 20);
    assert_eq!(seen.bad_hellos.load(SeqCst), 0);
    assert_eq!(seen.bad_paths.load(SeqCst), 0);
    assert_eq!(seen.bad_messages.load(SeqCst), 0);
    assert_eq!(seen.rejected_503.load(SeqCst), reject_first);
    assert_eq!(seen.rig_ids.lock().unwrap().len(), 20);
    assert!(seen.rig_ids.lock().unwrap().contains("t-000019"));
    assert_eq!(
        seen.peers.lock().unwrap().len(),
        4,
        "{:?}",
        seen.peers.lock().unwrap()
    );
}

#[test]
fn twenty_rigs_in_two_children() {
    check("2", 0);
}

#[test]
fn twenty_rigs_in_process_with_a_503_retry() {
    check("1", 1);
}

/// Rigs the server drops after their welcome (without `--reconnect`) were not held: the run
/// exits 2 and says so, although every rig was welcomed.
#[test]
fn rigs_dropped_after_their_welcome_make_the_run_incomplete() {
    let (_rt, port, seen) = mini_server(
        Seen {
            hang_up: true,
            ..Seen::default()
        },
        0,
    );
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("report.json");
    let (code, stdout) = run_loadgen(port, "1", &path);
    assert!(stdout.contains("ALL_WELCOMED rigs=20"), "{stdout}");
    let r: Value = serde_json::from_str(&std::fs::read_to_string(&path).unwrap()).unwrap();
    assert_eq!(
        (r["welcomed"].as_u64(), r["dropped_after_welcome"].as_u64()),
        (Some(20), Some(20)),
        "{r:#}"
    );
    assert_eq!(seen.acks.load(SeqCst), 20);
    assert_eq!(code, 2, "{r:#}");
}

/// A report to stdout whose reader has gone (`| head -1`) is not a panic: the run still ends
/// with its own exit code.
#[test]
fn a_report_to_a_closed_stdout_is_not_a_panic() {
    let (_rt, port, _seen) = mini_server(Seen::default(), 0);
    let mut child = loadgen(port, "1", std::path::Path::new("-"))
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .expect("run loadgen");
    drop(child.stdout.take());
    let out = child.wait_with_output().expect("wait");
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(!stderr.contains("panicked"), "{stderr}");
    assert!(
        stderr.contains("could not be written to stdout"),
        "{stderr}"
    );
    assert_eq!(out.status.code(), Some(0), "{stderr}");
}

/// A port nothing listens on, and a listener that accepts and never answers.
fn dead_ends() -> (u16, std::net::TcpListener) {
    let closed = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let port = closed.local_addr().unwrap().port();
    drop(closed);
    (port, std::net::TcpListener::bind("127.0.0.1:0").unwrap())
}

/// Every rig refused: nothing is open, so the run ends at once rather than holding no rig
/// for all of `--hold`; and a ramp cut off by `--max-time` still prints its one line.
#[test]
fn a_run_with_nothing_to_hold_ends_and_a_cut_ramp_says_so() {
    let (closed, silent) = dead_ends();
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("report.json");
    let run = |port: u16, max_time: &str| {
        let started = std::time::Instant::now();
        let out = Command::new(env!("CARGO_BIN_EXE_fleetlink-loadgen"))
            .args(["rigs", "--url", &format!("ws://127.0.0.1:{port}/agent")])
            .args(["--rigs", "5", "--procs", "1", "--hold", "60s"])
            .args(["--max-time", max_time, "--report"])
            .arg(&path)
            .output()
            .expect("run loadgen");
        let report: Value = serde_json::from_str(&std::fs::read_to_string(&path).unwrap()).unwrap();
        let stdout = String::from_utf8_lossy(&out.stdout).into_owned();
        (out.status.code(), stdout, report, started.elapsed())
    };
    let (code, stdout, report, took) = run(closed, "60s");
    assert!(
        stdout.starts_with("RAMP_INCOMPLETE rigs=5 welcomed=0 failed=5"),
        "{stdout}"
    );
    assert_eq!(report["exit_reason"], "none_open", "{report:#}");
    assert!(
        took < std::time::Duration::from_secs(20),
        "held for {took:?}"
    );
    assert_eq!(code, Some(2));
    let (code, stdout, report, _) = run(silent.local_addr().unwrap().port(), "2s");
    assert_eq!(stdout.lines().count(), 1, "{stdout}");
    assert!(
        stdout.starts_with("RAMP_INCOMPLETE rigs=5 welcomed=0")
            && stdout.trim_end().ends_with("stopped_by=max_time"),
        "{stdout}"
    );
    assert_eq!(report["exit_reason"], "max_time", "{report:#}");
    assert_eq!(code, Some(2));
}

/// POSTs to an admin port nothing listens on were never written: not counted as sent.
#[test]
fn admin_posts_that_could_not_connect_are_not_counted_sent() {
    let (closed, _silent) = dead_ends();
    let out = Command::new(env!("CARGO_BIN_EXE_fleetlink-loadgen"))
        .args([
            "admin-fanout",
            "--admin",
            &format!("http://127.0.0.1:{closed}"),
        ])
        .args(["--rigs", "4", "--max-time", "10s"])
        .output()
        .expect("run loadgen");
    let report: Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(report["sent"], 0, "{report:#}");
    assert_eq!(report["unanswered"], 0, "{report:#}");
    assert_eq!(report["failed"], 4, "{report:#}");
    assert_eq!(report["errors"]["not_sent"], 4, "{report:#}");
    assert_eq!(report["timed_out"], false, "{report:#}");
    assert_eq!(out.status.code(), Some(2));
}

/// `--ramp-rate` paces the ramp over the whole run: 20 rigs at 20 a second in two processes
/// take about a second to start, where unpaced they start at once.
#[test]
fn a_paced_ramp_starts_its_rigs_at_the_rate_asked() {
    let (_rt, port, _seen) = mini_server(Seen::default(), 0);
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("report.json");
    let out = loadgen(port, "2", &path)
        .args(["--ramp-rate", "20"])
        .output()
        .expect("run loadgen");
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(stdout.contains("ALL_WELCOMED rigs=20"), "{stdout}");
    let r: Value = serde_json::from_str(&std::fs::read_to_string(&path).unwrap()).unwrap();
    // Each process starts its 10 rigs 100 ms apart: the last at 900 ms.
    let ramp = r["ramp_ms"].as_u64().unwrap();
    assert!((900..5_000).contains(&ramp), "ramp took {ramp} ms");
    assert_eq!(out.status.code(), Some(0));
    let bad = Command::new(env!("CARGO_BIN_EXE_fleetlink-loadgen"))
        .args([
            "rigs",
            "--url",
            "ws://127.0.0.1:1/agent",
            "--ramp-rate",
            "-1",
        ])
        .output()
        .expect("run loadgen");
    assert_eq!(bad.status.code(), Some(64));
}
