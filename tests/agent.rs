//! `fleetlink-agent` end to end: against the real standalone broker (commands, acks, kick and
//! resume, 503 + Retry-After, drain + goaway), against a scripted fake broker (duplicates, seq
//! gap, hello fields, refusal), and over TLS through a test TLS terminator (mTLS, TLS 1.2).

mod common;

use std::io::{BufRead, BufReader, ErrorKind, Read, Write};
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, ExitStatus, Stdio};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use common::broker::{eventually, Broker};
use common::jwt::{now_s, Signer};
use common::process::{output_within, RefusingPort};
use serde_json::{json, Value};
use tungstenite::protocol::frame::coding::CloseCode;
use tungstenite::protocol::CloseFrame;
use tungstenite::{Message, WebSocket};

/// A running agent process: its stderr log lines with arrival times, its exec log. Killed on
/// drop; its log is printed if the test failed.
struct Agent {
    child: Child,
    lines: Arc<Mutex<Vec<(Instant, String)>>>,
    exec_log: PathBuf,
    dir: PathBuf,
}

impl Agent {
    fn start(url: &str, rig: &str, extra: &[&str]) -> Agent {
        static N: AtomicUsize = AtomicUsize::new(0);
        let dir = std::env::temp_dir().join(format!(
            "fleetlink-agent-test-{}-{}",
            std::process::id(),
            N.fetch_add(1, Ordering::SeqCst)
        ));
        std::fs::create_dir_all(&dir).unwrap();
        let exec_log = dir.join("exec.log");
        let mut child = Command::new(env!("CARGO_BIN_EXE_fleetlink-agent"))
            .args(["--url", url, "--rig-id", rig, "--exec-log"])
            .arg(&exec_log)
            .args(extra)
            .env("RUST_LOG", "info")
            .stdout(Stdio::null())
            .stderr(Stdio::piped())
            .spawn()
            .expect("spawn fleetlink-agent");
        let stderr = child.stderr.take().unwrap();
        let lines = Arc::new(Mutex::new(Vec::new()));
        let sink = lines.clone();
        std::thread::spawn(move || {
            for line in BufReader::new(stderr).lines().map_while(Result::ok) {
                sink.lock().unwrap().push((Instant::now(), line));
            }
        });
        Agent {
            child,
            lines,
            exec_log,
            dir,
        }
    }

    /// The first log line containing `pat` (and when it arrived), waiting up to `limit`.
    fn wait_line(&self, pat: &str, limit: Duration) -> (Instant, String) {
        let deadline = Instant::now() + limit;
        loop {
            if let Some(hit) = self
                .lines
                .lock()
                .unwrap()
                .iter()
                .find(|(_, l)| l.contains(pat))
            {
                return hit.clone();
            }
            assert!(
                Instant::now() < deadline,
                "no agent log line with {pat:?}:\n{}",
                self.log()
            );
            std::thread::sleep(Duration::from_millis(10));
        }
    }

    fn has_line(&self, pat: &str) -> bool {
        self.lines
            .lock()
            .unwrap()
            .iter()
            .any(|(_, l)| l.contains(pat))
    }

    fn log(&self) -> String {
        self.lines
            .lock()
            .unwrap()
            .iter()
            .map(|(_, l)| format!("  {l}\n"))
            .collect()
    }

    /// The boot_id the agent announced.
    fn boot_id(&self) -> String {
        let (_, line) = self.wait_line(" boot_id ", Duration::from_secs(10));
        let boot = line
            .split(" boot_id ")
            .nth(1)
            .and_then(|s| s.split_whitespace().next())
            .unwrap();
        boot.to_string()
    }

    fn exec_lines(&self) -> Vec<String> {
        std::fs::read_to_string(&self.exec_log)
            .unwrap_or_default()
            .lines()
            .map(str::to_string)
            .collect()
    }

    fn wait_exit(&mut self, limit: Duration) -> ExitStatus {
        let deadline = Instant::now() + limit;
        loop {
            if let Some(status) = self.child.try_wait().unwrap() {
                return status;
            }
            assert!(
                Instant::now() < deadline,
                "agent did not exit:\n{}",
                self.log()
            );
            std::thread::sleep(Duration::from_millis(20));
        }
    }
}

impl Drop for Agent {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
        if std::thread::panicking() {
            eprintln!("agent log:\n{}", self.log());
        }
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

fn rigs(b: &Broker) -> Vec<Value> {
    let (status, body) = b.http("GET", "/v1/rigs", "");
    assert_eq!(status, 200, "{body}");
    serde_json::from_str::<Value>(&body)
        .unwrap()
        .as_array()
        .cloned()
        .unwrap_or_default()
}

fn rig(b: &Broker, id: &str) -> Option<Value> {
    rigs(b).into_iter().find(|r| r["rig_id"] == id)
}

fn wait_rig(b: &Broker, id: &str, what: &str, cond: impl Fn(&Value) -> bool) -> Value {
    let mut found = None;
    eventually(Duration::from_secs(15), what, || {
        found = rig(b, id).filter(|r| cond(r));
        found.is_some()
    });
    found.unwrap()
}

fn send(b: &Broker, rig: &str, name: &str, args: Value) -> u64 {
    let (status, reply) = b.command(rig, name, args);
    assert_eq!(status, 200, "{reply}");
    assert_eq!(reply["ok"], true, "{reply}");
    reply["seq"].as_u64().unwrap()
}

#[test]
fn runs_allowed_commands_once_and_acks_refused_ones() {
    let b = Broker::start(&[]);
    let agent = Agent::start(
        &b.url("/agent"),
        "rig-run",
        &["--allow", "echo", "--labels", "group=lab1,os=linux"],
    );
    let boot = agent.boot_id();
    let r = wait_rig(&b, "rig-run", "rig-run listed", |_| true);
    assert_eq!(r["boot_id"], boot.as_str());
    assert_eq!(r["labels"], json!({"group": "lab1", "os": "linux"}));

    let seq = send(&b, "rig-run", "echo", json!({"argv": ["hello", "fleet"]}));
    assert_eq!(seq, 1);
    wait_rig(&b, "rig-run", "ack of seq 1", |r| r["last_ack_seq"] == 1);
    eventually(Duration::from_secs(10), "exec-log line for seq 1", || {
        agent.exec_lines().len() == 1
    });
    let line = &agent.exec_lines()[0];
    assert!(
        line.starts_with("seq=1 id=") && line.ends_with(" name=echo ok=true"),
        "{line}"
    );
    agent.wait_line("finished seq=1 name=echo ok=true", Duration::from_secs(5));

    let seq = send(
        &b,
        "rig-run",
        "rm",
        json!({"argv": ["-rf", "/tmp/nothing-here"]}),
    );
    assert_eq!(seq, 2);
    wait_rig(&b, "rig-run", "ack of seq 2", |r| r["last_ack_seq"] == 2);
    agent.wait_line("finished seq=2 name=rm ok=false", Duration::from_secs(5));
    // The ack goes out on receipt, before the worker runs the command, so it proves nothing
    // about the exec log. One worker runs commands in seq order and writes a command's line
    // before taking the next, so once seq 3's line is there, seq 2's would be too.
    assert_eq!(send(&b, "rig-run", "echo", json!({"argv": ["fence"]})), 3);
    eventually(Duration::from_secs(10), "exec-log line for seq 3", || {
        agent.exec_lines().len() >= 2
    });
    let seqs: Vec<String> = agent
        .exec_lines()
        .iter()
        .map(|l| l.split_whitespace().next().unwrap().to_string())
        .collect();
    assert_eq!(seqs, ["seq=1", "seq=3"], "a refused command was executed");
}

/// With --token-file the agent sends its bearer token with each upgrade, reading the file
/// again at each attempt: refused 401 (its token expired), it retries rather than stop, and
/// gets in once the file holds a renewed token. A file missing at start is a startup error.
#[test]
fn a_bearer_token_is_read_at_each_attempt_and_a_renewed_one_gets_in() {
    let scratch = common::scratch::Scratch::new("agent-jwt");
    let dir = &scratch.0;
    let (signer, key) = Signer::new(dir);
    let b = Broker::start(&["--jwt-key", key.to_str().unwrap()]);
    let token =
        |exp: u64| signer.token(json!({"exp": exp, "rig_id": "rig-tok", "scope": "cmd:echo"}));
    let file = dir.join("token");
    std::fs::write(&file, token(now_s() - 3600)).unwrap();
    let agent = Agent::start(
        &b.url("/agent"),
        "rig-tok",
        &["--allow", "echo", "--token-file", file.to_str().unwrap()],
    );
    agent.wait_line("HTTP 401", Duration::from_secs(10));
    assert!(rig(&b, "rig-tok").is_none());
    std::fs::write(&file, format!("{}\n", token(now_s() + 600))).unwrap();
    wait_rig(&b, "rig-tok", "welcomed with the renewed token", |_| true);
    assert_eq!(send(&b, "rig-tok", "echo", json!({"argv": ["t"]})), 1);
    agent.wait_line("finished seq=1 name=echo ok=true", Duration::from_secs(10));
    assert!(!agent.has_line("not retrying"), "{}", agent.log());

    let missing = dir.join("none");
    let out = output_within(
        Command::new(env!("CARGO_BIN_EXE_fleetlink-agent")).args([
            "--url",
            &b.url("/agent"),
            "--rig-id",
            "rig-tok",
            "--token-file",
            missing.to_str().unwrap(),
        ]),
        Duration::from_secs(30),
    );
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "{stderr}");
    assert!(stderr.contains("--token-file"), "{stderr}");
}

#[test]
fn kick_reconnects_and_resumes_the_same_session() {
    let b = Broker::start(&[]);
    let agent = Agent::start(&b.url("/agent"), "rig-kick", &["--allow", "echo"]);
    let boot = agent.boot_id();
    wait_rig(&b, "rig-kick", "rig-kick listed", |_| true);
    assert_eq!(send(&b, "rig-kick", "echo", json!({"argv": ["one"]})), 1);
    wait_rig(&b, "rig-kick", "ack of seq 1", |r| r["last_ack_seq"] == 1);

    let (status, body) = b.http("POST", "/v1/rigs/rig-kick/kick", "");
    assert_eq!(status, 200, "{body}");
    agent.wait_line("closed by broker: 1012", Duration::from_secs(5));
    let (_, line) = agent.wait_line("resumed=true", Duration::from_secs(15));
    assert!(
        line.contains(&format!("boot_id={boot}")) && line.contains("last_seq=Some(1)"),
        "{line}"
    );
    let r = wait_rig(&b, "rig-kick", "rig-kick back", |_| true);
    assert_eq!(r["boot_id"], boot.as_str());

    // The session went on: the next command is seq 2, and nothing ran twice. Acks go out on
    // receipt, not after the run; seq 3 is the fence: one worker runs in seq order, so when
    // its line is written, any rerun of 1 or 2 received before it has been written too.
    assert_eq!(send(&b, "rig-kick", "echo", json!({"argv": ["two"]})), 2);
    assert_eq!(send(&b, "rig-kick", "echo", json!({"argv": ["three"]})), 3);
    wait_rig(&b, "rig-kick", "ack of seq 3", |r| r["last_ack_seq"] == 3);
    eventually(Duration::from_secs(10), "three exec-log lines", || {
        agent.exec_lines().len() >= 3
    });
    let seqs: Vec<String> = agent
        .exec_lines()
        .iter()
        .map(|l| l.split_whitespace().next().unwrap().to_string())
        .collect();
    assert_eq!(seqs, ["seq=1", "seq=2", "seq=3"]);
}

#[test]
fn over_capacity_503_waits_for_retry_after() {
    let b = Broker::start(&["--max-connections", "0"]);
    let agent = Agent::start(&b.url("/agent"), "rig-full", &[]);
    let (seen, line) = agent.wait_line("HTTP 503: retry in ", Duration::from_secs(10));
    let secs: f64 = line
        .split("retry in ")
        .nth(1)
        .unwrap()
        .split('s')
        .next()
        .unwrap()
        .parse()
        .unwrap();
    let hint: f64 = line
        .split("Retry-After: ")
        .nth(1)
        .unwrap()
        .trim_end_matches(')')
        .parse()
        .unwrap();
    assert!((5.0..=15.0).contains(&hint), "{line}");
    assert!(secs >= hint * 0.9 && secs <= hint * 1.1, "{line}");
    // It really waits: the second attempt comes no sooner than the delay it announced, itself
    // at least 0.9 × Retry-After (4.5 s). Both times are when the test read the lines from the
    // agent's stderr; SLACK covers that pipe's delivery jitter.
    const SLACK: f64 = 0.25;
    let (retried, _) = agent.wait_line("attempt 2", Duration::from_secs(20));
    let waited = (retried - seen).as_secs_f64();
    assert!(
        waited + SLACK >= secs && waited + SLACK >= hint * 0.9,
        "reconnected {waited:.2}s after {line:?}:\n{}",
        agent.log()
    );
}

#[test]
fn drain_goaway_delays_the_reconnect_and_the_boot_survives_a_broker_change() {
    let mut b1 = Broker::start(&["--drain", "500ms"]);
    let listen = b1.listen.to_string();
    let agent = Agent::start(&b1.url("/agent"), "rig-drain", &["--allow", "echo"]);
    let boot = agent.boot_id();
    wait_rig(&b1, "rig-drain", "rig-drain listed", |_| true);
    assert_eq!(
        send(&b1, "rig-drain", "echo", json!({"argv": ["before"]})),
        1
    );
    wait_rig(&b1, "rig-drain", "ack of seq 1", |r| r["last_ack_seq"] == 1);

    // A new broker on the same address, bound beside b1 (--share-port) while the agent is on
    // b1, so that the port is never free for another test to take. b1 closes its listener when
    // its drain starts, so the reconnect after the goaway reaches b2 (one the kernel handed b1
    // in the instant the drain began is closed, and the agent retries).
    let b2 = Broker::start(&["--listen", &listen, "--share-port"]);
    assert!(rig(&b2, "rig-drain").is_none(), "the agent is on b1");

    let drained_at = Instant::now();
    assert_eq!(b1.http("POST", "/v1/drain", "").0, 202);
    let (_, line) = agent.wait_line("goaway (reason", Duration::from_secs(5));
    let ms: u64 = line
        .split("reconnect in ")
        .nth(1)
        .unwrap()
        .trim_end_matches("ms")
        .parse()
        .unwrap();
    assert!(ms < 500, "{line}");
    let (reconnected, _) = agent.wait_line("attempt 2", Duration::from_secs(5));
    assert!(
        reconnected - drained_at >= Duration::from_millis(ms),
        "reconnected before the goaway delay ({ms} ms)"
    );
    assert!(b1
        .wait_exit(Duration::from_secs(10))
        .is_some_and(|s| s.success()));

    // The agent finds b2 with the same boot; b2 has no session for it (resumed: false) but
    // never reuses a seq the rig reported having, so its first command is seq 2, and it runs.
    let r = wait_rig(&b2, "rig-drain", "rig-drain on the second broker", |_| true);
    assert_eq!(r["boot_id"], boot.as_str());
    agent.wait_line("has no session for boot", Duration::from_secs(5));
    assert_eq!(
        send(&b2, "rig-drain", "echo", json!({"argv": ["after"]})),
        2
    );
    eventually(Duration::from_secs(10), "second exec-log line", || {
        agent.exec_lines().len() == 2
    });
    let lines = agent.exec_lines();
    assert!(lines[0].starts_with("seq=1 "), "{lines:?}");
    assert!(lines[1].starts_with("seq=2 "), "{lines:?}");
}

/// A scripted broker on a free port, speaking through tungstenite's server side.
struct FakeBroker {
    listener: TcpListener,
}

type ServerWs = WebSocket<TcpStream>;

impl FakeBroker {
    fn new() -> FakeBroker {
        FakeBroker {
            listener: TcpListener::bind("127.0.0.1:0").unwrap(),
        }
    }

    fn url(&self) -> String {
        format!("ws://{}/agent", self.listener.local_addr().unwrap())
    }

    /// Accepts the next rig connection and returns it with its hello.
    fn accept(&self) -> (ServerWs, Value) {
        self.listener.set_nonblocking(true).unwrap();
        let deadline = Instant::now() + Duration::from_secs(20);
        let stream = loop {
            match self.listener.accept() {
                Ok((stream, _)) => break stream,
                Err(e) if e.kind() == ErrorKind::WouldBlock && Instant::now() < deadline => {
                    std::thread::sleep(Duration::from_millis(10))
                }
                Err(e) => panic!("the agent did not connect: {e}"),
            }
        };
        stream.set_nonblocking(false).unwrap();
        stream
            .set_read_timeout(Some(Duration::from_secs(15)))
            .unwrap();
        let mut ws = tungstenite::accept(stream).unwrap();
        let hello = recv(&mut ws);
        assert_eq!(hello["type"], "hello", "{hello}");
        (ws, hello)
    }
}

fn recv(ws: &mut ServerWs) -> Value {
    loop {
        match ws.read().expect("read from agent") {
            Message::Text(t) => return serde_json::from_str(t.as_str()).unwrap(),
            Message::Ping(_) | Message::Pong(_) => continue,
            other => panic!("unexpected {other:?}"),
        }
    }
}

/// Reads up to the agent's next ping and sends its pong: the agent then knows this broker
/// read everything it sent before that ping.
fn answer_ping(ws: &mut ServerWs) {
    loop {
        match ws.read().expect("read from agent") {
            Message::Ping(_) => break,
            Message::Text(t) => panic!("unexpected {t}"),
            _ => continue,
        }
    }
    ws.flush().expect("the pong");
}

fn push(ws: &mut ServerWs, msg: Value) {
    ws.send(Message::text(msg.to_string())).unwrap();
}

fn welcome(ws: &mut ServerWs, resumed: bool) {
    push(
        ws,
        json!({"type": "welcome", "broker_id": "fake", "rig_id": "r", "ping_interval_ms": 20000, "resumed": resumed}),
    );
}

fn command(seq: u64, name: &str) -> Value {
    json!({"type": "command", "seq": seq, "id": format!("cmd-{seq}"), "name": name, "args": {"argv": [format!("#{seq}")]}})
}

/// Reads until an ack, returning its seq; results on the way are collected into `results`.
fn recv_ack(ws: &mut ServerWs, results: &mut Vec<Value>) -> u64 {
    loop {
        let msg = recv(ws);
        match msg["type"].as_str() {
            Some("ack") => return msg["seq"].as_u64().unwrap(),
            Some("result") => results.push(msg),
            _ => panic!("unexpected {msg}"),
        }
    }
}

fn close_with(ws: &mut ServerWs, code: u16, reason: &str) {
    let _ = ws.close(Some(CloseFrame {
        code: CloseCode::from(code),
        reason: reason.into(),
    }));
    while ws.read().is_ok() {}
}

/// Reads to the connection's end; the code of the close frame the agent sent, if any.
fn close_code_read(ws: &mut ServerWs) -> Option<u16> {
    let mut code = None;
    while let Ok(msg) = ws.read() {
        if let Message::Close(Some(f)) = msg {
            code = Some(u16::from(f.code));
        }
    }
    code
}

#[test]
fn hello_fields_duplicates_resume_and_seq_gap() {
    let fake = FakeBroker::new();
    let mut agent = Agent::start(
        &fake.url(),
        "rig-fake",
        &["--allow", "echo", "--labels", "group=g"],
    );
    let (mut ws, hello) = fake.accept();
    let boot = hello["boot_id"].as_str().unwrap().to_string();
    assert!(fleetlink::ids::BootId::parse(&boot).is_some(), "{hello}");
    assert_eq!(hello["rig_id"], "rig-fake");
    assert_eq!(hello["version"], env!("CARGO_PKG_VERSION"));
    assert_eq!(hello["labels"], json!({"group": "g"}));
    assert!(hello.get("last_seq").is_none(), "{hello}");
    assert!(fleetlink::protocol::parse_client_msg(hello.to_string().as_bytes()).is_ok());

    welcome(&mut ws, false);
    let mut results = Vec::new();
    push(&mut ws, command(1, "echo"));
    assert_eq!(recv_ack(&mut ws, &mut results), 1);
    // A replay of seq 1 is acked again and not run.
    push(&mut ws, command(1, "echo"));
    assert_eq!(recv_ack(&mut ws, &mut results), 1);
    while results.is_empty() {
        let msg = recv(&mut ws);
        assert_eq!(msg["type"], "result", "{msg}");
        results.push(msg);
    }
    assert_eq!(results[0]["seq"], 1);
    assert_eq!(results[0]["ok"], true);
    assert_eq!(results[0]["output"]["stdout"], "#1\n");
    close_with(&mut ws, 1012, "kicked");

    // Same boot, last_seq 1; a replay of 1 then 2: only 2 runs.
    let (mut ws, hello) = fake.accept();
    assert_eq!(hello["boot_id"], boot.as_str());
    assert_eq!(hello["last_seq"], 1);
    welcome(&mut ws, true);
    let mut results = Vec::new();
    // No ack or result again: this broker answered the agent's ping after them (as it closed),
    // so it read them (`results_sent_into_a_connection_that_broke_go_again` has the others).
    push(&mut ws, command(1, "echo"));
    push(&mut ws, command(2, "echo"));
    assert_eq!(recv_ack(&mut ws, &mut results), 1);
    assert_eq!(recv_ack(&mut ws, &mut results), 2);
    while !results.iter().any(|r| r["seq"] == 2) {
        results.push(recv(&mut ws));
    }
    // Seq 3 never comes: 4 is a gap, and the agent stops with exit code 4.
    push(&mut ws, command(4, "echo"));
    let status = agent.wait_exit(Duration::from_secs(10));
    assert_eq!(status.code(), Some(4), "{}", agent.log());
    assert!(agent.has_line("SEQ GAP"));
    let lines = agent.exec_lines();
    assert_eq!(lines.len(), 2, "{lines:?}");
    assert!(
        lines[0].starts_with("seq=1 id=cmd-1 name=echo") && lines[1].starts_with("seq=2 id=cmd-2 "),
        "{lines:?}"
    );
}

/// A connection that breaks (a reset, no close handshake) may have lost the last results the
/// agent sent into it: they go again after the next welcome, beside its last acks. Before,
/// a result sent just before a broker crashed was gone for good, though the command ran. What
/// the broker confirmed reading (its pong to the agent's ping after a result) goes no second
/// time, even across a close.
#[test]
fn results_sent_into_a_connection_that_broke_go_again() {
    let fake = FakeBroker::new();
    let agent = Agent::start(&fake.url(), "rig-reset", &["--allow", "echo"]);
    let (mut ws, _) = fake.accept();
    welcome(&mut ws, false);
    let mut results = Vec::new();
    push(&mut ws, command(1, "echo"));
    assert_eq!(recv_ack(&mut ws, &mut results), 1);
    while results.is_empty() {
        results.push(recv(&mut ws));
    }
    assert_eq!(results[0]["seq"], 1, "{results:?}");
    // Gone with a reset, as a crashed broker's socket goes.
    socket2::SockRef::from(ws.get_ref())
        .set_linger(Some(Duration::ZERO))
        .unwrap();
    drop(ws);

    let (mut ws, hello) = fake.accept();
    assert_eq!(hello["last_seq"], 1, "{hello}");
    welcome(&mut ws, true);
    // The result again; not the ack, which this broker read (it answered the ping after it
    // while waiting for the result).
    let again = recv(&mut ws);
    assert_eq!(again, results[0], "the same result again");
    // Confirmed this time (the pong to the ping after the result), then a close: nothing is
    // sent twice.
    push(&mut ws, command(2, "echo"));
    let mut results = Vec::new();
    assert_eq!(recv_ack(&mut ws, &mut results), 2);
    while results.is_empty() {
        results.push(recv(&mut ws));
    }
    answer_ping(&mut ws);
    close_with(&mut ws, 1012, "kicked");
    let (mut ws, _) = fake.accept();
    welcome(&mut ws, true);
    let mut after = Vec::new();
    push(&mut ws, command(3, "echo"));
    assert_eq!(recv_ack(&mut ws, &mut after), 3);
    while !after.iter().any(|r| r["seq"] == 3) {
        after.push(recv(&mut ws));
    }
    assert_eq!(after.len(), 1, "only seq 3's result: {after:?}");
    assert_eq!(agent.exec_lines().len(), 3, "each ran once");
}

/// A broker that reads slowly (its per-rig rate limit) can have many results unread when the
/// connection breaks: every one it never confirmed reading goes again, with its ack, however
/// many. Before, only the last 32 did, and the others were lost with their acks (review bb98).
#[test]
fn every_result_the_broker_did_not_confirm_goes_again() {
    let fake = FakeBroker::new();
    let agent = Agent::start(&fake.url(), "rig-unread", &["--allow", "echo"]);
    let (mut ws, _) = fake.accept();
    welcome(&mut ws, false);
    for seq in 1..=40 {
        push(&mut ws, command(seq, "echo"));
    }
    // This broker reads nothing, so answers no ping, while the agent runs all forty.
    eventually(Duration::from_secs(20), "all forty run", || {
        agent.exec_lines().len() == 40
    });
    socket2::SockRef::from(ws.get_ref())
        .set_linger(Some(Duration::ZERO))
        .unwrap();
    drop(ws);
    let (mut ws, hello) = fake.accept();
    assert_eq!(hello["last_seq"], 40, "{hello}");
    welcome(&mut ws, true);
    let (mut acks, mut results) = (
        std::collections::BTreeSet::new(),
        std::collections::BTreeSet::new(),
    );
    while acks.len() < 40 || results.len() < 40 {
        let msg = recv(&mut ws);
        let seq = msg["seq"].as_u64().unwrap_or(0);
        match msg["type"].as_str() {
            Some("ack") => acks.insert(seq),
            Some("result") => results.insert(seq),
            _ => panic!("unexpected {msg}"),
        };
    }
    assert_eq!(results, (1..=40).collect());
    assert_eq!(agent.exec_lines().len(), 40, "each ran once");
}

/// Commands waiting for the agent's worker are bounded by bytes too (64 MiB), not only by
/// `--max-pending`: past it the next is not acked, and the agent closes 1013 and comes back
/// for it. Before, 200 commands of 1 MB behind a long one grew the agent by 200 MB.
#[test]
fn big_commands_waiting_behind_a_long_one_are_bounded_by_bytes() {
    let fake = FakeBroker::new();
    let agent = Agent::start(
        &fake.url(),
        "rig-bytes",
        &["--allow", "sleep", "--allow", "echo"],
    );
    let (mut ws, _) = fake.accept();
    welcome(&mut ws, false);
    push(
        &mut ws,
        json!({"type": "command", "seq": 1, "id": "long", "name": "sleep", "args": {"argv": ["60"]}}),
    );
    let pad = "x".repeat(12 << 20);
    for seq in 2..=7 {
        push(
            &mut ws,
            json!({"type": "command", "seq": seq, "id": format!("big-{seq}"), "name": "echo",
                   "args": {"argv": ["b"], "pad": pad}}),
        );
    }
    let mut results = Vec::new();
    for seq in 1..=6 {
        assert_eq!(recv_ack(&mut ws, &mut results), seq);
    }
    // 5 x 12 MiB wait; a sixth would pass 64 MiB.
    assert_eq!(close_code_read(&mut ws), Some(1013), "{}", agent.log());
    let (_ws, hello) = fake.accept();
    assert_eq!(
        hello["last_seq"], 6,
        "the sixth big one was not taken: {hello}"
    );
}

/// Waiting commands cost about their text, not the parsed value's size: an array of 30,000
/// zeros is 60 KB of text but about 1 MB parsed, so 200 of them behind a long command held
/// about 200 MB before they were kept as text (review bb98); now the agent stays near 12 MB
/// of them.
#[test]
fn waiting_commands_are_kept_as_their_text() {
    let fake = FakeBroker::new();
    let agent = Agent::start(&fake.url(), "rig-arrays", &["--allow", "sleep"]);
    let (mut ws, _) = fake.accept();
    welcome(&mut ws, false);
    push(
        &mut ws,
        json!({"type": "command", "seq": 1, "id": "long", "name": "sleep", "args": {"argv": ["60"]}}),
    );
    let zeros = vec![0u8; 30_000];
    for seq in 2..=201 {
        push(
            &mut ws,
            json!({"type": "command", "seq": seq, "id": format!("z-{seq}"), "name": "nope",
                   "args": {"pad": zeros}}),
        );
    }
    let mut results = Vec::new();
    for seq in 1..=201 {
        assert_eq!(recv_ack(&mut ws, &mut results), seq);
    }
    let status = std::fs::read_to_string(format!("/proc/{}/status", agent.child.id())).unwrap();
    let rss_kb: u64 = status
        .lines()
        .find_map(|l| l.strip_prefix("VmRSS:"))
        .and_then(|v| v.trim().trim_end_matches(" kB").trim().parse().ok())
        .expect("VmRSS");
    assert!(rss_kb < 80 * 1024, "agent RSS {rss_kb} kB with 200 waiting");
}

/// A broker that lost the rig's session (`resumed: false`) still gets the results of commands
/// the agent acked before: it numbers new commands above the hello's `last_seq`, so control
/// can join them to their acks. The agent used to drop them, and control heard nothing.
#[test]
fn results_of_a_lost_session_still_go_out() {
    let fake = FakeBroker::new();
    let _agent = Agent::start(&fake.url(), "rig-lost-session", &["--allow", "sleep,echo"]);
    let (mut ws, _) = fake.accept();
    welcome(&mut ws, false);
    push(
        &mut ws,
        json!({"type": "command", "seq": 1, "id": "cmd-1", "name": "sleep", "args": {"argv": ["1"]}}),
    );
    let mut results = Vec::new();
    assert_eq!(recv_ack(&mut ws, &mut results), 1);
    // Gone before the result: the next broker has no session for this boot.
    close_with(&mut ws, 1012, "kicked");
    let (mut ws, hello) = fake.accept();
    assert_eq!(hello["last_seq"], 1);
    welcome(&mut ws, false);
    push(&mut ws, command(2, "echo"));
    assert_eq!(recv_ack(&mut ws, &mut results), 2);
    // One worker runs in seq order: seq 1's result comes before seq 2's.
    while !results.iter().any(|r| r["seq"] == 2) {
        results.push(recv(&mut ws));
    }
    let seqs: Vec<_> = results.iter().map(|r| r["seq"].clone()).collect();
    assert_eq!(seqs, [json!(1), json!(2)], "{results:?}");
    assert_eq!(results[0]["ok"], true, "{results:?}");
}

/// A kick (close 1012) after a welcome is no failed attempt: `--max-attempts 1` does not stop
/// the agent, and it reconnects at the first step of its backoff each time. A kick used to
/// count, so one kick stopped it (agent and fleetctl audit).
#[test]
fn kicks_are_no_failed_attempts() {
    let fake = FakeBroker::new();
    let mut agent = Agent::start(&fake.url(), "rig-kicked", &["--max-attempts", "1"]);
    for _ in 0..3 {
        let (mut ws, _) = fake.accept();
        welcome(&mut ws, true);
        close_with(&mut ws, 1012, "kicked by control; reconnect");
    }
    let (_ws, _) = fake.accept();
    assert!(agent.child.try_wait().unwrap().is_none(), "{}", agent.log());
    assert!(agent.has_line("(backoff n=0)"), "{}", agent.log());
    assert!(!agent.has_line("giving up"), "{}", agent.log());
}

#[test]
fn retry_after_close_and_refusal() {
    let fake = FakeBroker::new();
    let mut agent = Agent::start(&fake.url(), "rig-refused", &[]);
    let (mut ws, _) = fake.accept();
    close_with(&mut ws, 4503, "retry_after=7");
    let (_, line) = agent.wait_line("close 4503: retry in ", Duration::from_secs(5));
    assert!(line.ends_with("(Retry-After: 7)"), "{line}");
    // The delay it chose is the hint ± 10 %, not its ordinary backoff.
    let secs: f64 = line
        .split("retry in ")
        .nth(1)
        .and_then(|s| s.split('s').next())
        .and_then(|s| s.parse().ok())
        .unwrap_or_else(|| panic!("no delay in {line:?}"));
    assert!((6.3..=7.7).contains(&secs), "{line}");
    drop(ws);

    // A newer boot owns this rig id: the agent gives up for good (exit 5), it does not fight.
    let fake = FakeBroker::new();
    let mut agent2 = Agent::start(&fake.url(), "rig-refused", &[]);
    let (mut ws, _) = fake.accept();
    close_with(&mut ws, 4409, "a newer boot of this rig is connected");
    assert_eq!(agent2.wait_exit(Duration::from_secs(10)).code(), Some(5));
    let _ = agent.child.kill();
    agent.wait_exit(Duration::from_secs(5));
}

#[test]
fn a_wrong_url_path_stops_the_agent_instead_of_knocking_forever() {
    // The broker answers any path but /agent with 404: no retry can change that, so the agent
    // exits 5 at once rather than backing off for ever (it used to).
    let b = Broker::start(&[]);
    let mut agent = Agent::start(&b.url("/agnet"), "rig-lost", &[]);
    let status = agent.wait_exit(Duration::from_secs(10));
    assert_eq!(status.code(), Some(5), "{}", agent.log());
    let (_, line) = agent.wait_line("upgrade refused with HTTP 404", Duration::from_secs(5));
    assert!(line.ends_with("not retrying"), "{line}");
    assert!(!agent.has_line("retry in"), "{}", agent.log());
}

#[test]
fn unknown_messages_and_garbage_do_not_stop_the_agent() {
    let fake = FakeBroker::new();
    let agent = Agent::start(&fake.url(), "rig-odd", &["--allow", "echo"]);
    let (mut ws, _) = fake.accept();
    welcome(&mut ws, false);
    for text in [
        "not json",
        "[1,2]",
        r#"{"type":"news","x":1}"#,
        r#"{"type":"command","seq":"1"}"#,
    ] {
        ws.send(Message::text(text)).unwrap();
    }
    ws.send(Message::binary(vec![0u8, 159, 146, 150])).unwrap();
    push(&mut ws, command(1, "echo"));
    assert_eq!(recv_ack(&mut ws, &mut Vec::new()), 1);
    agent.wait_line("ignoring a bad message", Duration::from_secs(5));
    agent.wait_line(
        "binary message from the broker, ignored",
        Duration::from_secs(5),
    );
}

/// A stopping agent ends every command it acked in a result: the one running is killed, the
/// ones not started are reported not run (and are not run), all before its close. The broker
/// holds none of them any more, so without these results control would hear nothing.
#[test]
fn a_sigterm_reports_every_acked_command_before_the_close() {
    stop_reports_every_acked_command(libc::SIGTERM);
}

/// A SIGHUP (a closed terminal, a supervisor's reload) stops the agent the same way. Before,
/// it killed the agent outright, and the running command's process group lived on past its
/// timeout (review bb98).
#[test]
fn a_sighup_stops_the_agent_as_a_sigterm_does() {
    stop_reports_every_acked_command(libc::SIGHUP);
}

fn stop_reports_every_acked_command(signal: i32) {
    let fake = FakeBroker::new();
    let mut agent = Agent::start(
        &fake.url(),
        "rig-stop",
        &["--allow", "sleep", "--allow", "touch"],
    );
    let (mut ws, _) = fake.accept();
    welcome(&mut ws, false);
    let marks: Vec<PathBuf> = (2..=3)
        .map(|i| agent.dir.join(format!("ran-{i}")))
        .collect();
    push(
        &mut ws,
        json!({"type":"command","seq":1,"id":"cmd-1","name":"sleep","args":{"argv":["30"]}}),
    );
    for (seq, mark) in (2u64..).zip(&marks) {
        let args = json!({"argv": [mark.to_str().unwrap()]});
        push(
            &mut ws,
            json!({"type":"command","seq":seq,"id":format!("cmd-{seq}"),"name":"touch","args":args}),
        );
    }
    let mut results = Vec::new();
    for seq in 1..=3 {
        assert_eq!(recv_ack(&mut ws, &mut results), seq);
    }
    agent.wait_line("command seq=3", Duration::from_secs(5));
    // The first command's process has started (the log line above says only that seq 3
    // arrived): the stop must kill it, not report it not run.
    let agent_pid = agent.child.id();
    eventually(Duration::from_secs(5), "sleep 30 running", || {
        children_named(agent_pid, "sleep") > 0
    });
    unsafe { libc::kill(agent.child.id() as i32, signal) };
    let mut close = None;
    while let Ok(msg) = ws.read() {
        match msg {
            Message::Text(t) => results.push(serde_json::from_str::<Value>(t.as_str()).unwrap()),
            Message::Close(f) => close = f.map(|f| u16::from(f.code)),
            _ => {}
        }
    }
    assert_eq!(close, Some(1001), "{}", agent.log());
    let by_seq: std::collections::BTreeMap<u64, &Value> = results
        .iter()
        .map(|r| (r["seq"].as_u64().unwrap(), r))
        .collect();
    assert_eq!(
        by_seq.keys().copied().collect::<Vec<_>>(),
        [1, 2, 3],
        "{results:?}"
    );
    assert!(by_seq.values().all(|r| r["ok"] == false), "{results:?}");
    assert_eq!(by_seq[&1]["output"]["signal"], 9, "{}", by_seq[&1]);
    for seq in [2, 3] {
        assert_eq!(
            by_seq[&seq]["output"]["error"],
            "not run: the agent stopped first"
        );
    }
    assert_eq!(agent.wait_exit(Duration::from_secs(10)).code(), Some(0));
    assert!(marks.iter().all(|m| !m.exists()), "a command not run ran");
}

#[test]
fn run_for_and_sigterm_stop_with_exit_zero_and_max_attempts_gives_up() {
    let fake = FakeBroker::new();
    let mut agent = Agent::start(&fake.url(), "rig-brief", &["--run-for", "1s"]);
    let (mut ws, _) = fake.accept();
    welcome(&mut ws, false);
    assert_eq!(agent.wait_exit(Duration::from_secs(10)).code(), Some(0));
    // The agent closed politely (1001) rather than dropping the socket.
    assert_eq!(close_code_read(&mut ws), Some(1001));

    // SIGTERM: the same polite stop, exit 0 after a close 1001.
    let mut agent = Agent::start(&fake.url(), "rig-brief", &[]);
    let (mut ws, _) = fake.accept();
    welcome(&mut ws, false);
    agent.wait_line("connected to", Duration::from_secs(5));
    unsafe { libc::kill(agent.child.id() as i32, libc::SIGTERM) };
    assert_eq!(agent.wait_exit(Duration::from_secs(10)).code(), Some(0));
    assert_eq!(close_code_read(&mut ws), Some(1001));

    // Bound, never listening: refused, and no other test's broker can take the port meanwhile.
    let closed = RefusingPort::new();
    let mut agent = Agent::start(
        &format!("ws://{}/agent", closed.addr),
        "rig-brief",
        &["--max-attempts", "1"],
    );
    assert_eq!(agent.wait_exit(Duration::from_secs(10)).code(), Some(3));
    drop(closed);
}

#[test]
fn a_stop_does_not_wait_for_a_stalled_connection_attempt() {
    // A listener that never answers the upgrade: the handshake would wait out its 10 s
    // timeout. SIGTERM, and --run-for, must end the agent well before that.
    let silent = TcpListener::bind("127.0.0.1:0").unwrap();
    let url = format!("ws://{}/agent", silent.local_addr().unwrap());
    let mut agent = Agent::start(&url, "rig-stalled", &[]);
    agent.wait_line("connecting to", Duration::from_secs(5));
    let signalled = Instant::now();
    unsafe { libc::kill(agent.child.id() as i32, libc::SIGTERM) };
    assert_eq!(agent.wait_exit(Duration::from_secs(10)).code(), Some(0));
    let took = signalled.elapsed();
    assert!(took < Duration::from_secs(3), "SIGTERM took {took:?}");

    let started = Instant::now();
    let mut agent = Agent::start(&url, "rig-stalled", &["--run-for", "1s"]);
    assert_eq!(agent.wait_exit(Duration::from_secs(10)).code(), Some(0));
    let took = started.elapsed();
    assert!(took < Duration::from_secs(4), "--run-for 1s took {took:?}");
    drop(silent);
}

#[test]
fn bad_command_lines_exit_64() {
    for args in [
        vec!["--url", "http://x/agent", "--rig-id", "r"],
        vec!["--url", "ws://x/agent", "--rig-id", "bad id"],
        vec!["--url", "ws://x/agent", "--rig-id", "r", "--ca", "ca.pem"],
        vec!["--url", "ws://x/agent"],
    ] {
        // Bounded: a command line taken for a good one would have the agent retry forever.
        let out = output_within(
            Command::new(env!("CARGO_BIN_EXE_fleetlink-agent")).args(&args),
            Duration::from_secs(30),
        );
        assert_eq!(
            out.status.code(),
            Some(64),
            "{args:?}\nstderr:\n{}",
            String::from_utf8_lossy(&out.stderr)
        );
    }
}

/// Per TLS handshake: the negotiated version and whether the client presented a certificate.
type Handshakes = Arc<Mutex<Vec<(rustls::ProtocolVersion, bool)>>>;

/// A TLS terminator in front of the broker: rustls server with `versions`, client certificates
/// required from `ca`; forwards plaintext to `upstream`. Returns its address and, per
/// handshake, the negotiated version and whether the client presented a certificate.
fn tls_proxy(
    upstream: SocketAddr,
    cert: &Path,
    key: &Path,
    ca: &Path,
    versions: &[&'static rustls::SupportedProtocolVersion],
) -> (SocketAddr, Handshakes) {
    let provider = Arc::new(rustls::crypto::ring::default_provider());
    let mut roots = rustls::RootCertStore::empty();
    for c in pem_certs(ca) {
        roots.add(c).unwrap();
    }
    let verifier = rustls::server::WebPkiClientVerifier::builder_with_provider(
        Arc::new(roots),
        provider.clone(),
    )
    .build()
    .unwrap();
    let key_pem = std::fs::read(key).unwrap();
    let key = rustls_pemfile::private_key(&mut key_pem.as_slice())
        .unwrap()
        .unwrap();
    let config = rustls::ServerConfig::builder_with_provider(provider)
        .with_protocol_versions(versions)
        .unwrap()
        .with_client_cert_verifier(verifier)
        .with_single_cert(pem_certs(cert), key)
        .unwrap();
    let config = Arc::new(config);
    let listener = TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = listener.local_addr().unwrap();
    let seen = Arc::new(Mutex::new(Vec::new()));
    let seen2 = seen.clone();
    std::thread::spawn(move || {
        for tcp in listener.incoming().map_while(Result::ok) {
            let config = config.clone();
            let seen = seen2.clone();
            std::thread::spawn(move || {
                let _ = relay(tcp, config, upstream, seen);
            });
        }
    });
    (addr, seen)
}

fn relay(
    tcp: TcpStream,
    config: Arc<rustls::ServerConfig>,
    upstream: SocketAddr,
    seen: Handshakes,
) -> std::io::Result<()> {
    let mut tls = rustls::StreamOwned::new(
        rustls::ServerConnection::new(config).map_err(std::io::Error::other)?,
        tcp,
    );
    tls.sock.set_read_timeout(Some(Duration::from_secs(10)))?;
    while tls.conn.is_handshaking() {
        tls.conn.complete_io(&mut tls.sock)?;
    }
    let version = tls.conn.protocol_version().unwrap();
    seen.lock()
        .unwrap()
        .push((version, tls.conn.peer_certificates().is_some()));
    let mut plain = TcpStream::connect(upstream)?;
    plain.set_read_timeout(Some(Duration::from_millis(5)))?;
    tls.sock.set_read_timeout(Some(Duration::from_millis(5)))?;
    let mut buf = [0u8; 16384];
    let idle = |e: &std::io::Error| matches!(e.kind(), ErrorKind::WouldBlock | ErrorKind::TimedOut);
    loop {
        match tls.read(&mut buf) {
            Ok(0) => return Ok(()),
            Ok(n) => plain.write_all(&buf[..n])?,
            Err(e) if idle(&e) => {}
            Err(e) => return Err(e),
        }
        match plain.read(&mut buf) {
            Ok(0) => return Ok(()),
            Ok(n) => {
                tls.write_all(&buf[..n])?;
                tls.flush()?;
            }
            Err(e) if idle(&e) => {}
            Err(e) => return Err(e),
        }
    }
}

fn pem_certs(path: &Path) -> Vec<rustls::pki_types::CertificateDer<'static>> {
    let pem = std::fs::read(path).unwrap();
    rustls_pemfile::certs(&mut pem.as_slice())
        .collect::<Result<_, _>>()
        .unwrap()
}

fn tls_dir() -> (PathBuf, fleetlink::dev_certs::Summary) {
    static N: AtomicUsize = AtomicUsize::new(0);
    let dir = std::env::temp_dir().join(format!(
        "fleetlink-agent-tls-{}-{}",
        std::process::id(),
        N.fetch_add(1, Ordering::SeqCst)
    ));
    let pki = fleetlink::dev_certs::generate(&dir, 1, &[]).unwrap();
    (dir, pki)
}

#[test]
fn wss_with_mtls_over_tls13_and_tls12() {
    let b = Broker::start(&[]);
    let (dir, pki) = tls_dir();
    let rig_cert = &pki.rigs[0];
    for (versions, expect) in [
        (
            &[&rustls::version::TLS13][..],
            rustls::ProtocolVersion::TLSv1_3,
        ),
        (
            &[&rustls::version::TLS12][..],
            rustls::ProtocolVersion::TLSv1_2,
        ),
    ] {
        let (proxy, seen) = tls_proxy(
            b.listen,
            &pki.broker_cert,
            &pki.broker_key,
            &pki.ca_cert,
            versions,
        );
        let url = format!("wss://localhost:{}/agent", proxy.port());
        let ca = pki.ca_cert.to_str().unwrap();
        let (cert, key) = (
            rig_cert.cert.to_str().unwrap(),
            rig_cert.key.to_str().unwrap(),
        );
        let agent = Agent::start(
            &url,
            &rig_cert.rig_id,
            &[
                "--ca",
                ca,
                "--tls-cert",
                cert,
                "--tls-key",
                key,
                "--allow",
                "echo",
            ],
        );
        let boot = agent.boot_id();
        wait_rig(&b, &rig_cert.rig_id, "rig over TLS", |r| {
            r["boot_id"] == boot.as_str()
        });
        let seq = send(&b, &rig_cert.rig_id, "echo", json!({"argv": ["over tls"]}));
        wait_rig(&b, &rig_cert.rig_id, "ack over TLS", |r| {
            r["last_ack_seq"] == seq
        });
        assert_eq!(seen.lock().unwrap()[0], (expect, true));
        drop(agent);
        b.http("POST", &format!("/v1/rigs/{}/kick", rig_cert.rig_id), "");
        eventually(Duration::from_secs(10), "rig gone", || {
            rig(&b, &rig_cert.rig_id).is_none()
        });
    }

    // Without a client certificate the terminator refuses the handshake: no connection.
    let (proxy, _) = tls_proxy(
        b.listen,
        &pki.broker_cert,
        &pki.broker_key,
        &pki.ca_cert,
        rustls::ALL_VERSIONS,
    );
    let url = format!("wss://localhost:{}/agent", proxy.port());
    let mut agent = Agent::start(
        &url,
        "rig-anon",
        &["--ca", pki.ca_cert.to_str().unwrap(), "--max-attempts", "1"],
    );
    assert_eq!(agent.wait_exit(Duration::from_secs(10)).code(), Some(3));
    assert!(rig(&b, "rig-anon").is_none());
    // And an agent that does not trust the broker's CA never sends its hello.
    let other = tls_dir();
    let mut agent = Agent::start(
        &url,
        "rig-0001",
        &[
            "--ca",
            other.1.ca_cert.to_str().unwrap(),
            "--tls-cert",
            rig_cert.cert.to_str().unwrap(),
            "--tls-key",
            rig_cert.key.to_str().unwrap(),
            "--max-attempts",
            "1",
        ],
    );
    assert_eq!(agent.wait_exit(Duration::from_secs(10)).code(), Some(3));
    assert!(agent.has_line("certificate"), "{}", agent.log());
    let _ = std::fs::remove_dir_all(dir);
    let _ = std::fs::remove_dir_all(other.0);
}

/// The agent against the real broker's own TLS listener (no terminator): mTLS with `--client-ca`,
/// TLS 1.3 by default. The rig's certificate is its identity: rig-0001 connects, is listed and
/// runs an allowed command; an agent presenting rig-0002's certificate but claiming rig-0001 is
/// closed with 4403, gives up for good (exit 5), and does not disturb the real rig-0001.
#[test]
fn wss_mtls_against_the_real_tls_broker_and_4403_for_a_borrowed_identity() {
    let (dir, pki) = {
        static N: AtomicUsize = AtomicUsize::new(0);
        let dir = std::env::temp_dir().join(format!(
            "fleetlink-agent-realtls-{}-{}",
            std::process::id(),
            N.fetch_add(1, Ordering::SeqCst)
        ));
        let pki = fleetlink::dev_certs::generate(&dir, 2, &[]).unwrap();
        (dir, pki)
    };
    let path = |p: &PathBuf| p.to_str().unwrap().to_string();
    let (ca, broker_cert, broker_key) = (
        path(&pki.ca_cert),
        path(&pki.broker_cert),
        path(&pki.broker_key),
    );
    let b = Broker::start(&[
        "--tls-cert",
        &broker_cert,
        "--tls-key",
        &broker_key,
        "--client-ca",
        &ca,
    ]);
    // The broker listens on 127.0.0.1; its certificate names `localhost` (and 127.0.0.1).
    let url = format!("wss://localhost:{}/agent", b.listen.port());
    let (rig1, rig2) = (&pki.rigs[0], &pki.rigs[1]);
    assert_eq!(
        (rig1.rig_id.as_str(), rig2.rig_id.as_str()),
        ("rig-0001", "rig-0002")
    );

    let agent = Agent::start(
        &url,
        "rig-0001",
        &[
            "--tls-cert",
            &path(&rig1.cert),
            "--tls-key",
            &path(&rig1.key),
            "--ca",
            &ca,
            "--allow",
            "echo",
        ],
    );
    let boot = agent.boot_id();
    wait_rig(&b, "rig-0001", "rig-0001 listed over wss", |r| {
        r["boot_id"] == boot.as_str()
    });
    let seq = send(
        &b,
        "rig-0001",
        "echo",
        json!({"argv": ["over", "real", "tls"]}),
    );
    assert_eq!(seq, 1);
    wait_rig(&b, "rig-0001", "ack of seq 1 over wss", |r| {
        r["last_ack_seq"] == seq
    });
    eventually(Duration::from_secs(10), "exec-log line for seq 1", || {
        agent.exec_lines().len() == 1
    });
    let line = &agent.exec_lines()[0];
    assert!(
        line.starts_with("seq=1 id=") && line.ends_with(" name=echo ok=true"),
        "{line}"
    );
    agent.wait_line("finished seq=1 name=echo ok=true", Duration::from_secs(5));

    // rig-0002's certificate is valid, but it does not grant rig-0001: 4403, exit 5, no retry.
    let mut impostor = Agent::start(
        &url,
        "rig-0001",
        &[
            "--tls-cert",
            &path(&rig2.cert),
            "--tls-key",
            &path(&rig2.key),
            "--ca",
            &ca,
        ],
    );
    assert_eq!(
        impostor.wait_exit(Duration::from_secs(15)).code(),
        Some(5),
        "{}",
        impostor.log()
    );
    assert!(
        impostor.has_line("close 4403"),
        "no 4403 in the impostor's log:\n{}",
        impostor.log()
    );
    assert!(
        !impostor.has_line("attempt 2"),
        "retried after 4403:\n{}",
        impostor.log()
    );
    // An agent given ws:// for the TLS port is told so by the broker, in its log, and stops.
    let plain_url = format!("ws://127.0.0.1:{}/agent", b.listen.port());
    let mut plain = Agent::start(&plain_url, "rig-0002", &[]);
    assert_eq!(
        plain.wait_exit(Duration::from_secs(10)).code(),
        Some(5),
        "{}",
        plain.log()
    );
    let (_, line) = plain.wait_line("upgrade refused with HTTP 400", Duration::from_secs(5));
    assert!(line.contains("connect with wss://"), "{line}");
    // The real rig-0001 keeps its session and still takes commands.
    let r = rig(&b, "rig-0001").expect("rig-0001 still listed");
    assert_eq!(r["boot_id"], boot.as_str(), "{r}");
    assert_eq!(send(&b, "rig-0001", "echo", json!({"argv": ["still"]})), 2);
    wait_rig(&b, "rig-0001", "ack of seq 2", |r| r["last_ack_seq"] == 2);
    assert!(!agent.has_line("closed by broker"), "{}", agent.log());
    drop(agent);
    drop(impostor);
    let _ = std::fs::remove_dir_all(dir);
}

/// How many processes whose parent is `pid` run the program `name` (from /proc).
fn children_named(pid: u32, name: &str) -> usize {
    child_pids_named(pid, name).len()
}

/// The processes whose parent is `pid` and that run the program `name` (from /proc).
fn child_pids_named(pid: u32, name: &str) -> Vec<u32> {
    let Ok(dir) = std::fs::read_dir("/proc") else {
        return Vec::new();
    };
    dir.filter_map(Result::ok)
        .filter_map(|e| std::fs::read_to_string(e.path().join("stat")).ok())
        .filter_map(|stat| {
            // "pid (comm) state ppid ...": comm may hold spaces, so split after its ')'.
            let (head, rest) = stat.rsplit_once(") ")?;
            let (child, comm) = head.split_once(" (")?;
            let ppid = rest
                .split_whitespace()
                .nth(1)
                .and_then(|p| p.parse::<u32>().ok());
            (comm == name && ppid == Some(pid))
                .then(|| child.parse().ok())
                .flatten()
        })
        .collect()
}

/// Whether `pid` has ended: no such process, or a zombie waiting for its new parent.
fn ended(pid: u32) -> bool {
    match std::fs::read_to_string(format!("/proc/{pid}/stat")) {
        Err(_) => true,
        Ok(stat) => stat
            .rsplit_once(") ")
            .is_some_and(|(_, rest)| rest.starts_with('Z') || rest.starts_with('X')),
    }
}

/// An agent killed outright (SIGKILL, a crash) cannot kill what it runs. Before, its running
/// command went on unobserved, beside whatever the next agent ran; now the kernel kills it
/// with the agent.
#[test]
fn a_command_dies_with_an_agent_killed_outright() {
    let fake = FakeBroker::new();
    let mut agent = Agent::start(&fake.url(), "rig-sigkill", &["--allow", "sleep"]);
    let (mut ws, _) = fake.accept();
    welcome(&mut ws, false);
    push(
        &mut ws,
        json!({"type":"command","seq":1,"id":"cmd-1","name":"sleep","args":{"argv":["30"]}}),
    );
    let agent_pid = agent.child.id();
    let mut running = Vec::new();
    eventually(Duration::from_secs(5), "sleep 30 running", || {
        running = child_pids_named(agent_pid, "sleep");
        !running.is_empty()
    });
    agent.child.kill().unwrap();
    agent.child.wait().unwrap();
    for pid in running {
        eventually(
            Duration::from_secs(5),
            "the command killed with its agent",
            || ended(pid),
        );
    }
}
