//! Fault injection, quick versions: the five faults of the issue at small N, each test well under
//! 20 s. The full-size runs (5,000 rigs, figures printed as JSON) are `bench/faults.sh`, which
//! runs `tests/faults/faults.py`.
//!
//! Rigs are of two kinds, and each test says which:
//! - a [`Swarm`]: N in-test websocket rigs driven by one thread (tungstenite, non-blocking after
//!   the welcome). They answer pings, ack every command and dedupe by seq as the agent does, and
//!   on a goaway reconnect at the instant it asked for, with the same boot_id and `last_seq`.
//! - real `fleetlink-agent` processes with `--exec-log`: exactly-once is judged on their logs,
//!   and the reconnect storm uses their own backoff and Retry-After handling.
//!
//! Every test prints its figures as `FAULT <test> <name>=<value>` lines and one `FAULT_JSON`
//! line (see them with `cargo test --test faults_quick -- --nocapture`). The tests take a shared
//! lock and so run one at a time: they measure timing on two shared cores.

mod common;

use std::collections::{BTreeMap, HashMap};
use std::fs::File;
use std::io::{BufRead, BufReader, ErrorKind, Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::os::fd::AsRawFd;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{mpsc, Arc, Mutex, MutexGuard};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use common::broker::{boot_id, eventually, http, Broker};
use common::redis::RedisServer;
use fleetlink::registry::pubsub::Subscriber;
use redis::{Commands, IntoConnectionInfo};
use serde_json::{json, Value};
use tungstenite::protocol::frame::coding::CloseCode;
use tungstenite::protocol::CloseFrame;
use tungstenite::{Message, WebSocket};

/// The faults measure timing on 2 shared cores: one test at a time.
static SERIAL: Mutex<()> = Mutex::new(());

fn serial() -> MutexGuard<'static, ()> {
    SERIAL.lock().unwrap_or_else(|e| e.into_inner())
}

/// Lifts the accept bucket where the test is not about it (the contract's default is 50/s).
const OPEN_BUCKET: [&str; 4] = ["--accept-rate", "100000", "--accept-burst", "100000"];

/// Prints one `FAULT` line per figure and a `FAULT_JSON` line with all of them.
fn report(test: &str, figures: &[(&str, Value)]) {
    let mut all = serde_json::Map::new();
    for (name, value) in figures {
        println!("FAULT {test} {name}={value}");
        all.insert(name.to_string(), value.clone());
    }
    println!(
        "FAULT_JSON {}",
        json!({"test": test, "quick": true, "figures": all})
    );
}

fn ms(d: Duration) -> Value {
    json!(d.as_millis() as u64)
}

// ---------------------------------------------------------------------------------------------
// Brokers, metrics, control through Redis
// ---------------------------------------------------------------------------------------------

fn fleet_broker(redis: &RedisServer, id: &str, extra: &[&str]) -> Broker {
    let url = redis.url();
    let mut args = vec!["--redis", url.as_str(), "--broker-id", id];
    args.extend_from_slice(extra);
    let b = Broker::start(&args);
    eventually(Duration::from_secs(10), "broker ready", || {
        b.http("GET", "/readyz", "").0 == 200
    });
    b
}

/// One scrape of `/metrics`.
struct Metrics(String);

impl Metrics {
    fn of(admin: SocketAddr) -> Metrics {
        Metrics(http(admin, "GET", "/metrics", "").1)
    }

    /// The value of one exact series (`name` or `name{labels}`): 0 when that series has no
    /// line, a panic when no series of its name is there (a renamed metric must not read 0).
    fn get(&self, series: &str) -> f64 {
        common::broker::series_value_f64(&self.0, series)
    }

    /// The sum over every series of metric `name`.
    fn sum(&self, name: &str) -> f64 {
        self.0
            .lines()
            .filter(|l| !l.starts_with('#'))
            .filter_map(|l| {
                let (k, v) = l.rsplit_once(' ')?;
                let base = k.split('{').next()?;
                (base == name).then(|| v.parse::<f64>().ok()).flatten()
            })
            .sum()
    }
}

fn rigs_listed(admin: SocketAddr) -> Vec<String> {
    let (status, body) = http(admin, "GET", "/v1/rigs", "");
    assert_eq!(status, 200, "GET /v1/rigs: {body}");
    let v: Value = serde_json::from_str(&body).expect("GET /v1/rigs is JSON");
    v.as_array()
        .expect("GET /v1/rigs is a list")
        .iter()
        .map(|r| r["rig_id"].as_str().expect("rig_id").to_string())
        .collect()
}

/// `rig:<id>` → broker id, straight from Redis.
fn owners(con: &mut redis::Connection) -> HashMap<String, String> {
    let keys: Vec<String> = redis::cmd("KEYS")
        .arg("rig:*")
        .query(con)
        .unwrap_or_default();
    if keys.is_empty() {
        return HashMap::new();
    }
    let values: Vec<Option<String>> = redis::cmd("MGET").arg(&keys).query(con).unwrap();
    keys.into_iter()
        .zip(values)
        .filter_map(|(k, v)| {
            let (_, broker) = v?
                .split_once('|')
                .map(|(a, b)| (a.to_string(), b.to_string()))?;
            Some((k.trim_start_matches("rig:").to_string(), broker))
        })
        .collect()
}

/// Control as an operator's code would be: look the rig up in the registry, publish to its
/// broker with a `reply_to`, read the replies.
struct Control {
    con: redis::Connection,
    sub: Subscriber,
    reply_to: String,
}

impl Control {
    fn new(redis: &RedisServer) -> Control {
        let reply_to = format!("fleetlink:reply:{}", boot_id());
        let info = redis.url().into_connection_info().unwrap();
        let mut sub = Subscriber::connect(
            &info,
            std::slice::from_ref(&reply_to),
            Duration::from_secs(5),
        )
        .unwrap();
        eventually(Duration::from_secs(5), "subscribed", || {
            sub.read().unwrap();
            sub.confirmed == 1
        });
        let con = redis.connection();
        Control { con, sub, reply_to }
    }

    fn owner(&mut self, rig: &str) -> Option<String> {
        let v: Option<String> = self.con.get(format!("rig:{rig}")).ok()?;
        Some(v?.split_once('|')?.1.to_string())
    }

    /// Publishes a command to the rig's owner; returns the broker when one was listening.
    fn send(&mut self, rig: &str, id: &str, name: &str) -> Option<String> {
        let broker = self.owner(rig)?;
        let msg = json!({"type":"command","id":id,"rig_id":rig,"name":name,"args":{},"reply_to":self.reply_to});
        let receivers: i64 = self
            .con
            .publish(format!("fleetlink:broker:{broker}"), msg.to_string())
            .unwrap();
        (receivers > 0).then_some(broker)
    }

    fn poll(&mut self) -> Vec<Value> {
        self.sub
            .read()
            .unwrap()
            .into_iter()
            .filter_map(|p| serde_json::from_slice(&p.payload).ok())
            .collect()
    }

    /// Sends and waits for the reply (other replies are returned to the caller's pile).
    fn command(&mut self, rig: &str, id: &str, pile: &mut Vec<Value>) -> Value {
        let deadline = Instant::now() + Duration::from_secs(10);
        while self.send(rig, id, "true").is_none() {
            assert!(Instant::now() < deadline, "no broker holds {rig}");
            std::thread::sleep(Duration::from_millis(10));
        }
        loop {
            pile.extend(self.poll());
            if let Some(i) = pile.iter().position(|r| r["id"] == id) {
                return pile.remove(i);
            }
            assert!(Instant::now() < deadline, "no reply to {id}");
            std::thread::sleep(Duration::from_millis(2));
        }
    }
}

// ---------------------------------------------------------------------------------------------
// Swarm: N in-test rigs on one thread
// ---------------------------------------------------------------------------------------------

type Ws = WebSocket<TcpStream>;

/// Connects, upgrades, says hello; returns the socket (non-blocking from now on) and welcome.
fn open_rig(
    addr: SocketAddr,
    rig: &str,
    boot: &str,
    last_seq: Option<u64>,
) -> Result<(Ws, Value), String> {
    let stream = TcpStream::connect_timeout(&addr, Duration::from_secs(5))
        .map_err(|e| format!("connect: {e}"))?;
    let _ = stream.set_nodelay(true);
    let _ = stream.set_read_timeout(Some(Duration::from_secs(5)));
    let (mut ws, _) = tungstenite::client(format!("ws://{addr}/agent"), stream)
        .map_err(|e| format!("upgrade: {e}"))?;
    let mut hello = json!({"type":"hello","rig_id":rig,"boot_id":boot,"version":"faults-quick"});
    if let Some(k) = last_seq {
        hello["last_seq"] = json!(k);
    }
    ws.send(Message::text(hello.to_string()))
        .map_err(|e| format!("hello: {e}"))?;
    loop {
        match ws.read().map_err(|e| format!("before welcome: {e}"))? {
            Message::Text(t) => {
                let v: Value = serde_json::from_str(t.as_str()).map_err(|e| e.to_string())?;
                if v["type"] != "welcome" {
                    return Err(format!("expected welcome, got {v}"));
                }
                ws.get_mut()
                    .set_nonblocking(true)
                    .map_err(|e| e.to_string())?;
                return Ok((ws, v));
            }
            Message::Close(f) => return Err(format!("closed before welcome: {f:?}")),
            _ => {}
        }
    }
}

/// One rig of a [`Swarm`].
struct SwarmRig {
    id: String,
    boot: String,
    ws: Option<Ws>,
    /// The agent's dedupe state: the highest seq run in this session.
    last_seq: u64,
    /// (seq, command id) of every command run (first receipt of its seq).
    executed: Vec<(u64, String)>,
    duplicates: u64,
    gaps: u64,
    /// The goaway's `reconnect_after_ms`, once one arrived.
    goaway_ms: Option<u64>,
    reconnect_at: Option<Instant>,
    /// How connections ended other than by our own close (close code or error).
    ended: Vec<String>,
    /// (when, resumed) of every welcome.
    welcomes: Vec<(Instant, bool)>,
}

impl SwarmRig {
    /// Reads everything available, acks commands, notes goaway and close; flushes pongs.
    fn pump(&mut self, now: Instant, reconnect: bool) {
        let Some(ws) = self.ws.as_mut() else {
            return;
        };
        let mut end = None;
        loop {
            match ws.read() {
                Ok(Message::Text(t)) => {
                    let v: Value = serde_json::from_str(t.as_str()).unwrap_or(Value::Null);
                    match v["type"].as_str() {
                        Some("command") => {
                            let seq = v["seq"].as_u64().unwrap_or(0);
                            if seq <= self.last_seq {
                                self.duplicates += 1;
                            } else {
                                if seq != self.last_seq + 1 {
                                    self.gaps += 1;
                                }
                                self.last_seq = seq;
                                let id = v["id"].as_str().unwrap_or_default().to_string();
                                self.executed.push((seq, id));
                            }
                            let ack = json!({"type":"ack","seq":seq}).to_string();
                            // On a full socket the frame stays queued and goes with a flush.
                            let _ = ws.send(Message::text(ack));
                        }
                        Some("goaway") => {
                            let after = v["reconnect_after_ms"].as_u64().unwrap_or(0);
                            self.goaway_ms = Some(after);
                            if reconnect {
                                self.reconnect_at = Some(now + Duration::from_millis(after));
                            }
                        }
                        _ => {}
                    }
                }
                Ok(Message::Close(frame)) => {
                    let _ = ws.flush();
                    end = Some(frame.map_or("1005".to_string(), |f| u16::from(f.code).to_string()));
                    break;
                }
                Ok(_) => {}
                Err(tungstenite::Error::Io(e)) if e.kind() == ErrorKind::WouldBlock => {
                    let _ = ws.flush();
                    break;
                }
                Err(e) => {
                    end = Some(format!("error: {e}"));
                    break;
                }
            }
        }
        if let Some(why) = end {
            self.ended.push(why);
            self.ws = None;
        }
    }

    /// Closes our socket (if still open) and connects again with the same boot and last_seq.
    fn reconnect(&mut self, addr: SocketAddr) -> bool {
        if let Some(mut ws) = self.ws.take() {
            let frame = CloseFrame {
                code: CloseCode::Normal,
                reason: "goaway".into(),
            };
            let _ = ws.close(Some(frame));
            let _ = ws.flush();
        }
        let last = (self.last_seq > 0).then_some(self.last_seq);
        match open_rig(addr, &self.id, &self.boot, last) {
            Ok((ws, welcome)) => {
                let resumed = welcome["resumed"] == true;
                if !resumed {
                    self.last_seq = 0;
                }
                self.ws = Some(ws);
                self.welcomes.push((Instant::now(), resumed));
                self.reconnect_at = None;
                true
            }
            Err(_) => {
                self.reconnect_at = Some(Instant::now() + Duration::from_millis(100));
                false
            }
        }
    }
}

#[derive(Default)]
struct SwarmState {
    rigs: Vec<SwarmRig>,
    reconnect_failures: u64,
}

/// N rigs on one pump thread (2 ms passes).
struct Swarm {
    addr: SocketAddr,
    state: Arc<Mutex<SwarmState>>,
    stop: Arc<AtomicBool>,
    pump: Option<JoinHandle<()>>,
}

impl Swarm {
    /// Starts the pump; `reconnect`: follow goaways to whatever answers on `addr`.
    fn start(addr: SocketAddr, reconnect: bool) -> Swarm {
        let state = Arc::new(Mutex::new(SwarmState::default()));
        let stop = Arc::new(AtomicBool::new(false));
        let (st, halt) = (state.clone(), stop.clone());
        let pump = std::thread::spawn(move || {
            while !halt.load(Ordering::SeqCst) {
                {
                    let mut guard = st.lock().unwrap();
                    let s = &mut *guard;
                    let now = Instant::now();
                    for r in &mut s.rigs {
                        r.pump(now, reconnect);
                        if r.reconnect_at.is_some_and(|t| t <= now) && !r.reconnect(addr) {
                            s.reconnect_failures += 1;
                        }
                    }
                }
                std::thread::sleep(Duration::from_millis(2));
            }
        });
        Swarm {
            addr,
            state,
            stop,
            pump: Some(pump),
        }
    }

    /// Connects rigs `<prefix>-0000` … one after another (the pump serves those already in).
    fn connect(&self, prefix: &str, n: usize) {
        for i in 0..n {
            let id = format!("{prefix}-{i:04}");
            let boot = boot_id();
            let (ws, welcome) = open_rig(self.addr, &id, &boot, None)
                .unwrap_or_else(|e| panic!("rig {id} not welcomed: {e}"));
            let rig = SwarmRig {
                id,
                boot,
                ws: Some(ws),
                last_seq: 0,
                executed: Vec::new(),
                duplicates: 0,
                gaps: 0,
                goaway_ms: None,
                reconnect_at: None,
                ended: Vec::new(),
                welcomes: vec![(Instant::now(), welcome["resumed"] == true)],
            };
            self.state.lock().unwrap().rigs.push(rig);
        }
    }

    fn with<R>(&self, f: impl FnOnce(&mut SwarmState) -> R) -> R {
        f(&mut self.state.lock().unwrap())
    }

    /// Connections that ended without us closing them.
    fn ended(&self) -> Vec<(String, Vec<String>)> {
        self.with(|s| {
            s.rigs
                .iter()
                .filter(|r| !r.ended.is_empty())
                .map(|r| (r.id.clone(), r.ended.clone()))
                .collect()
        })
    }
}

impl Drop for Swarm {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::SeqCst);
        if let Some(t) = self.pump.take() {
            let _ = t.join();
        }
    }
}

// ---------------------------------------------------------------------------------------------
// Real agents
// ---------------------------------------------------------------------------------------------

/// A `fleetlink-agent` process (killed on drop) with its exec log and stderr log. Its stderr
/// comes through a pipe, so every line is also kept with the instant the test read it.
struct Agent {
    child: Child,
    rig: String,
    exec_log: PathBuf,
    /// Its stderr lines (also written to `<rig>.err`), each with when it was read.
    lines: Arc<Mutex<Vec<(Instant, String)>>>,
    /// Set once its stderr reached end of file.
    stderr_done: Arc<AtomicBool>,
}

impl Agent {
    fn spawn(url: &str, rig: &str, dir: &Path) -> Agent {
        let exec_log = dir.join(format!("{rig}.exec"));
        let mut file = File::create(dir.join(format!("{rig}.err"))).unwrap();
        let mut child = Command::new(env!("CARGO_BIN_EXE_fleetlink-agent"))
            .args(["--url", url, "--rig-id", rig, "--allow", "true"])
            .arg("--exec-log")
            .arg(&exec_log)
            .env("RUST_LOG", "info")
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::piped())
            .spawn()
            .expect("spawn fleetlink-agent");
        let stderr = child.stderr.take().expect("stderr");
        let lines = Arc::new(Mutex::new(Vec::new()));
        let stderr_done = Arc::new(AtomicBool::new(false));
        let (kept, done) = (lines.clone(), stderr_done.clone());
        std::thread::spawn(move || {
            for line in BufReader::new(stderr).lines().map_while(Result::ok) {
                let at = Instant::now();
                let _ = writeln!(file, "{line}");
                kept.lock().unwrap().push((at, line));
            }
            done.store(true, Ordering::SeqCst);
        });
        Agent {
            child,
            rig: rig.to_string(),
            exec_log,
            lines,
            stderr_done,
        }
    }

    /// `(seq, id)` per executed command, from `--exec-log`.
    fn executed(&self) -> Vec<(u64, String)> {
        let text = std::fs::read_to_string(&self.exec_log).unwrap_or_default();
        text.lines()
            .filter_map(|l| {
                let field = |k: &str| {
                    l.split_whitespace()
                        .find_map(|w| w.strip_prefix(k).map(str::to_string))
                };
                Some((field("seq=")?.parse().ok()?, field("id=")?))
            })
            .collect()
    }

    /// Its stderr so far.
    fn log(&self) -> String {
        self.timed_lines()
            .into_iter()
            .map(|(_, l)| l + "\n")
            .collect()
    }

    /// Its stderr lines so far, each with the instant the test read it.
    fn timed_lines(&self) -> Vec<(Instant, String)> {
        self.lines.lock().unwrap().clone()
    }

    fn sigterm(&self) {
        unsafe { libc::kill(self.child.id() as i32, libc::SIGTERM) };
    }

    /// Waits for the process to exit, then (briefly) for the last of its stderr.
    fn wait_exit(&mut self, limit: Duration) -> Option<std::process::ExitStatus> {
        let deadline = Instant::now() + limit;
        loop {
            if let Ok(Some(s)) = self.child.try_wait() {
                let drained = Instant::now() + Duration::from_secs(5);
                while !self.stderr_done.load(Ordering::SeqCst) && Instant::now() < drained {
                    std::thread::sleep(Duration::from_millis(5));
                }
                return Some(s);
            }
            if Instant::now() > deadline {
                return None;
            }
            std::thread::sleep(Duration::from_millis(10));
        }
    }
}

impl Drop for Agent {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// A fresh directory for one test's logs.
fn test_dir(name: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!(
        "fleetlink-faults-{name}-{}-{:08x}",
        std::process::id(),
        fastrand::u32(..)
    ));
    std::fs::create_dir_all(&dir).unwrap();
    dir
}

fn kill9(b: &mut Broker) {
    unsafe { libc::kill(b.pid() as i32, libc::SIGKILL) };
    b.wait_exit(Duration::from_secs(5)).expect("broker killed");
}

// ---------------------------------------------------------------------------------------------
// 1. Redis kill -9 under N rigs
// ---------------------------------------------------------------------------------------------

/// Redis is killed -9 under 200 in-test rigs (Swarm) for 3 s and comes back fresh and empty:
/// no rig connection closes, liveness keeps running, and the registry is whole again within one
/// `--registry-refresh` of the broker getting Redis back.
#[test]
fn redis_kill9_under_rigs_closes_nothing_and_leases_return_within_one_refresh() {
    let _serial = serial();
    const N: usize = 200;
    const REFRESH: Duration = Duration::from_millis(200);
    const OUTAGE: Duration = Duration::from_secs(3);
    /// The bridge's reconnect backoff while Redis refuses connections (killed, restarting):
    /// 0.5–1.5 × min(100 ms × 2ⁿ, 1 s).
    const MAX_BACKOFF: Duration = Duration::from_millis(1_500);
    let mut redis = RedisServer::start();
    let mut args = vec![
        "--registry-refresh",
        "200ms",
        "--registry-ttl",
        "3s",
        "--ping-interval",
        "500ms",
        "--pong-timeout",
        "400ms",
    ];
    args.extend(OPEN_BUCKET);
    let a = fleet_broker(&redis, "fe-a", &args);
    let swarm = Swarm::start(a.listen, false);
    swarm.connect("fq-redis", N);
    let mut con = redis.connection();
    eventually(Duration::from_secs(10), "N leases", || {
        owners(&mut con).len() == N
    });
    let boots: HashMap<String, String> = swarm.with(|s| {
        s.rigs
            .iter()
            .map(|r| (r.id.clone(), r.boot.clone()))
            .collect()
    });
    let pongs_before = Metrics::of(a.admin).get("fleetlink_pongs_received_total");

    redis.kill9();
    let killed = Instant::now();
    eventually(Duration::from_secs(10), "readyz 503", || {
        a.http("GET", "/readyz", "").0 == 503
    });
    let noticed = killed.elapsed();
    // The outage: nothing may close meanwhile; local control keeps working.
    let (status, reply) = a.command("fq-redis-0007", "during-outage", json!({}));
    assert_eq!(status, 200, "{reply}");
    eventually(Duration::from_secs(5), "command during the outage", || {
        swarm.with(|s| s.rigs[7].executed.len() == 1)
    });
    while killed.elapsed() < OUTAGE {
        assert_eq!(swarm.ended(), vec![], "rigs dropped during the outage");
        std::thread::sleep(Duration::from_millis(50));
    }
    let m = Metrics::of(a.admin);
    assert_eq!(m.get("fleetlink_redis_up"), 0.0);
    let pongs_during = m.get("fleetlink_pongs_received_total") - pongs_before;
    assert!(
        pongs_during >= N as f64,
        "liveness stalled in the outage: {pongs_during} pongs"
    );

    let restored_series = "fleetlink_registry_ops_total{op=\"refresh\",result=\"restored\"}";
    let restored_before = Metrics::of(a.admin).get(restored_series);
    redis.restart();
    let back = Instant::now();
    let mut con = redis.connection();
    let mut resubscribed = None;
    let whole = loop {
        if resubscribed.is_none() {
            let (_, n): (String, i64) = redis::cmd("PUBSUB")
                .arg("NUMSUB")
                .arg("fleetlink:broker:fe-a")
                .query::<(String, i64)>(&mut con)
                .unwrap();
            if n > 0 {
                resubscribed = Some(Instant::now());
            }
        }
        let keys: Vec<String> = redis::cmd("KEYS").arg("rig:*").query(&mut con).unwrap();
        if keys.len() == N {
            break Instant::now();
        }
        assert!(
            back.elapsed() < Duration::from_secs(20),
            "registry not whole: {} of {N}",
            keys.len()
        );
        std::thread::sleep(Duration::from_millis(2));
    };
    let resubscribed = resubscribed.unwrap_or(whole);
    // Every lease is this broker's, with the rig's own boot.
    let now_owned = owners(&mut con);
    for (rig, boot) in &boots {
        let v: String = con.get(format!("rig:{rig}")).unwrap();
        assert_eq!(v, format!("{boot}|fe-a"));
    }
    assert_eq!(now_owned.len(), N);
    // It was a refresh that put them back: the first pass after the reconnect restores every
    // lease it finds missing, so any other writer first would make this fewer, and a lease
    // lost again more.
    eventually(Duration::from_secs(5), "the restores counted", || {
        Metrics::of(a.admin).get(restored_series) - restored_before >= N as f64
    });
    let restored = Metrics::of(a.admin).get(restored_series) - restored_before;
    assert_eq!(restored, N as f64, "leases restored by refresh");
    eventually(Duration::from_secs(10), "readyz 200 again", || {
        a.http("GET", "/readyz", "").0 == 200
    });
    // Control through the fresh Redis reaches rigs again.
    let mut ctl = Control::new(&redis);
    let mut pile = Vec::new();
    for i in [0, 99, 199] {
        let rig = format!("fq-redis-{i:04}");
        let r = ctl.command(&rig, &format!("after-{i}"), &mut pile);
        assert_eq!(r["ok"], true, "{r}");
    }
    eventually(Duration::from_secs(5), "commands after the outage", || {
        swarm.with(|s| s.rigs[199].executed.len() == 1 && s.rigs[99].executed.len() == 1)
    });
    let m = Metrics::of(a.admin);
    let closes = m.sum("fleetlink_closes_total");
    let conns = m.sum("fleetlink_connections");
    assert_eq!(swarm.ended(), vec![], "rigs dropped");
    assert_eq!(closes, 0.0, "broker closed connections");
    assert_eq!(conns, N as f64);

    let lag = resubscribed.saturating_duration_since(back);
    let restore = whole.saturating_duration_since(resubscribed);
    let total = whole.saturating_duration_since(back);
    report(
        "redis_kill9",
        &[
            ("rigs", json!(N)),
            ("outage_ms", ms(OUTAGE)),
            ("readyz_503_after_ms", ms(noticed)),
            ("pongs_during_outage", json!(pongs_during)),
            ("rig_connections_dropped", json!(swarm.ended().len())),
            ("broker_closes_total", json!(closes)),
            ("redis_back_to_broker_resubscribed_ms", ms(lag)),
            ("resubscribed_to_registry_whole_ms", ms(restore)),
            ("redis_back_to_registry_whole_ms", ms(total)),
            ("registry_refresh_ms", ms(REFRESH)),
            ("leases_restored_by_refresh", json!(restored)),
        ],
    );
    // The count above shows one refresh pass did it; the clock bounds it only loosely, as the
    // test thread's polling on two busy cores adds its own delays.
    assert!(
        restore <= REFRESH + Duration::from_secs(1),
        "registry whole {restore:?} after the broker got Redis back (refresh {REFRESH:?})"
    );
    // The same second of slack for the polling as above.
    assert!(
        lag <= MAX_BACKOFF + Duration::from_secs(1),
        "resubscribed {lag:?} after Redis returned"
    );
    assert!(
        total <= MAX_BACKOFF + REFRESH + Duration::from_secs(1),
        "registry whole {total:?} after Redis returned"
    );
}

// ---------------------------------------------------------------------------------------------
// 2. Broker A killed -9 while commands flow; agents resume on B
// ---------------------------------------------------------------------------------------------

/// What control sent and what came back.
#[derive(Default)]
struct Flow {
    /// id → (rig, broker it was published to)
    sent: HashMap<String, (String, String)>,
    /// id → (rig, seq, broker)
    oks: HashMap<String, (String, u64, String)>,
    /// ids answered with an error.
    failed: std::collections::HashSet<String>,
    errors: BTreeMap<String, u64>,
    /// Commands not published: no owner in the registry, or nobody on its channel.
    undeliverable: u64,
}

impl Flow {
    fn send(&mut self, ctl: &mut Control, rig: &str, id: String) {
        match ctl.send(rig, &id, "true") {
            Some(broker) => {
                self.sent.insert(id, (rig.to_string(), broker));
            }
            None => self.undeliverable += 1,
        }
    }

    fn absorb(&mut self, replies: Vec<Value>) {
        for r in replies {
            let id = r["id"].as_str().unwrap_or_default().to_string();
            let Some((rig, broker)) = self.sent.get(&id) else {
                continue;
            };
            if r["ok"] == true {
                let seq = r["seq"].as_u64().expect("seq in an ok reply");
                assert_eq!(r["rig_id"], rig.as_str(), "{r}");
                self.oks.insert(id, (rig.clone(), seq, broker.clone()));
            } else {
                let e = r["error"].as_str().unwrap_or("?").to_string();
                *self.errors.entry(e).or_default() += 1;
                self.failed.insert(id);
            }
        }
    }

    fn ok_from(&self, broker: &str) -> usize {
        self.oks.values().filter(|(_, _, b)| b == broker).count()
    }
}

/// 8 real agents (`--exec-log`) on broker A; control publishes commands through Redis to each
/// rig's owner (looked up in the registry) without pause; A is killed -9 mid-flow; the agents
/// reconnect (same port, SO_REUSEPORT: B) and resume. Every command control got `ok` for is in
/// its agent's exec log exactly once, with the seq of the reply.
#[test]
fn broker_kill9_while_commands_flow_every_ok_command_runs_exactly_once() {
    let _serial = serial();
    const AGENTS: usize = 8;
    const OK_BEFORE: usize = 120;
    const OK_AFTER: usize = 120;
    const BURST: usize = 64;
    let redis = RedisServer::start();
    let mut open = vec!["--cores", "1"];
    open.extend(OPEN_BUCKET);
    let mut a_args = vec!["--listen", "127.0.0.1:0"];
    a_args.extend(&open);
    let mut a = fleet_broker(&redis, "fe-a", &a_args);
    let listen = format!("127.0.0.1:{}", a.listen.port());
    let url = format!("ws://{listen}/agent");
    let dir = test_dir("exactly-once");
    let rigs: Vec<String> = (0..AGENTS).map(|i| format!("fq-exec-{i}")).collect();
    let mut agents: Vec<Agent> = rigs.iter().map(|r| Agent::spawn(&url, r, &dir)).collect();
    let mut con = redis.connection();
    eventually(Duration::from_secs(15), "agents on A", || {
        let o = owners(&mut con);
        rigs.iter()
            .all(|r| o.get(r).map(String::as_str) == Some("fe-a"))
    });
    let mut b_args = vec!["--listen", listen.as_str(), "--share-port"];
    b_args.extend(&open);
    let b = fleet_broker(&redis, "fe-b", &b_args);

    let mut ctl = Control::new(&redis);
    let mut flow = Flow::default();
    let mut killed_at: Option<Instant> = None;
    let mut all_on_b: Option<Instant> = None;
    let started = Instant::now();
    let mut n = 0usize;
    let next_id = |n: &mut usize| {
        *n += 1;
        (rigs[*n % AGENTS].clone(), format!("cmd-{n:05}"))
    };
    loop {
        let (rig, id) = next_id(&mut n);
        flow.send(&mut ctl, &rig, id);
        flow.absorb(ctl.poll());
        if killed_at.is_none() && flow.ok_from("fe-a") >= OK_BEFORE {
            // A burst, and the kill as soon as its first replies are in: when A dies some of
            // it is kept but not written, some written but not acked, some not kept yet.
            let first = n + 1;
            for _ in 0..BURST {
                let (rig, id) = next_id(&mut n);
                flow.send(&mut ctl, &rig, id);
            }
            let deadline = Instant::now() + Duration::from_secs(5);
            while (first..=n)
                .filter(|i| flow.oks.contains_key(&format!("cmd-{i:05}")))
                .count()
                < BURST / 8
            {
                assert!(Instant::now() < deadline, "the burst got no replies");
                flow.absorb(ctl.poll());
            }
            kill9(&mut a);
            killed_at = Some(Instant::now());
        }
        if killed_at.is_some() && all_on_b.is_none() && n.is_multiple_of(16) {
            let o = owners(&mut con);
            if rigs
                .iter()
                .all(|r| o.get(r).map(String::as_str) == Some("fe-b"))
            {
                all_on_b = Some(Instant::now());
            }
        }
        if all_on_b.is_some() && flow.ok_from("fe-b") >= OK_AFTER {
            break;
        }
        assert!(
            started.elapsed() < Duration::from_secs(30),
            "flow stalled: {} ok from A, {} from B, killed {killed_at:?}, all on B {all_on_b:?}",
            flow.ok_from("fe-a"),
            flow.ok_from("fe-b")
        );
        std::thread::sleep(Duration::from_millis(3));
    }
    let killed_at = killed_at.unwrap();
    let recovery = all_on_b.unwrap() - killed_at;
    // Every command published to B gets its reply (B is alive).
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        flow.absorb(ctl.poll());
        let answered_b = flow
            .sent
            .iter()
            .filter(|(_, (_, b))| b == "fe-b")
            .all(|(id, _)| flow.oks.contains_key(id) || flow.failed.contains(id));
        if answered_b {
            break;
        }
        assert!(Instant::now() < deadline, "B left commands unanswered");
        std::thread::sleep(Duration::from_millis(5));
    }
    let Flow {
        sent,
        oks,
        errors,
        undeliverable,
        ..
    } = flow;
    let count_ok = |broker: &str| oks.values().filter(|(_, _, b)| b == broker).count();
    // A marker per rig after everything else: once it has run, so has all that came before.
    let mut pile = Vec::new();
    for rig in &rigs {
        let r = ctl.command(rig, &format!("marker-{rig}"), &mut pile);
        assert_eq!(r["ok"], true, "{r}");
    }
    for agent in &agents {
        let marker = format!("marker-{}", agent.rig);
        eventually(Duration::from_secs(15), "marker executed", || {
            agent.executed().iter().any(|(_, id)| *id == marker)
        });
    }
    for agent in &agents {
        agent.sigterm();
    }
    for agent in &mut agents {
        let status = agent
            .wait_exit(Duration::from_secs(10))
            .expect("agent exit");
        assert!(status.success(), "{} exited {status:?}", agent.rig);
    }

    // Judge on the agents' logs.
    let mut runs: HashMap<String, Vec<(String, u64)>> = HashMap::new();
    let mut resumed_on_b = 0;
    let mut duplicate_lines = 0;
    for agent in &agents {
        for (seq, id) in agent.executed() {
            runs.entry(id).or_default().push((agent.rig.clone(), seq));
        }
        let log = agent.log();
        resumed_on_b += usize::from(log.contains("broker_id=fe-b resumed=true"));
        duplicate_lines += log.matches("duplicate seq=").count();
    }
    let mut lost = Vec::new();
    let mut twice = Vec::new();
    let mut wrong = Vec::new();
    for (id, (rig, seq, _)) in &oks {
        match runs.get(id).map(Vec::as_slice) {
            None | Some([]) => lost.push(id.clone()),
            Some([(r, s)]) if r == rig && s == seq => {}
            Some([one]) => wrong.push((id.clone(), one.clone(), (rig.clone(), *seq))),
            Some(_) => twice.push(id.clone()),
        }
    }
    let twice_any: Vec<&String> = runs
        .iter()
        .filter(|(_, v)| v.len() > 1)
        .map(|(id, _)| id)
        .collect();
    let without_ok = runs
        .keys()
        .filter(|id| !oks.contains_key(*id) && !id.starts_with("marker-"))
        .count();
    let unanswered_a = sent
        .iter()
        .filter(|(id, (_, b))| b == "fe-a" && !oks.contains_key(*id))
        .count();
    let resent = Metrics::of(b.admin).get("fleetlink_commands_total{result=\"resent\"}");
    report(
        "broker_kill9_exactly_once",
        &[
            ("agents", json!(AGENTS)),
            ("published", json!(sent.len())),
            ("ok_from_a", json!(count_ok("fe-a"))),
            ("ok_from_b", json!(count_ok("fe-b"))),
            ("unanswered_at_kill", json!(unanswered_a)),
            ("undeliverable_no_owner", json!(undeliverable)),
            ("errors", json!(errors)),
            ("kill_to_all_on_b_ms", ms(recovery)),
            ("agents_resumed_on_b", json!(resumed_on_b)),
            ("b_commands_resent", json!(resent)),
            ("agent_duplicates_dropped", json!(duplicate_lines)),
            ("executed_without_ok", json!(without_ok)),
            ("lost", json!(lost.len())),
            ("executed_twice", json!(twice_any.len())),
        ],
    );
    assert!(lost.is_empty(), "ok'd but never executed: {lost:?}");
    assert!(
        twice.is_empty() && twice_any.is_empty(),
        "executed twice: {twice_any:?}"
    );
    assert!(
        wrong.is_empty(),
        "executed under another rig/seq: {wrong:?}"
    );
    assert_eq!(resumed_on_b, AGENTS, "every agent resumes its session on B");
    let _ = std::fs::remove_dir_all(&dir);
}

// ---------------------------------------------------------------------------------------------
// 3. A peer that vanishes: stops answering pings / loses every packet (netns)
// ---------------------------------------------------------------------------------------------

/// A rig on a raw socket that answers pings only while told to.
struct PeerRig {
    stream: TcpStream,
    buf: Vec<u8>,
    pongs: u64,
    /// Pings read while told not to answer.
    unanswered: u64,
    close: Option<u16>,
}

impl PeerRig {
    fn connect(addr: SocketAddr, rig: &str) -> PeerRig {
        let mut stream = TcpStream::connect_timeout(&addr, Duration::from_secs(5)).unwrap();
        stream
            .set_read_timeout(Some(Duration::from_secs(5)))
            .unwrap();
        write!(stream, "GET /agent HTTP/1.1\r\nHost: x\r\nUpgrade: websocket\r\nConnection: Upgrade\r\nSec-WebSocket-Key: dGhlIHNhbXBsZSBub25jZQ==\r\nSec-WebSocket-Version: 13\r\n\r\n").unwrap();
        let mut rig_conn = PeerRig {
            stream,
            buf: Vec::new(),
            pongs: 0,
            unanswered: 0,
            close: None,
        };
        let end = loop {
            if let Some(p) = rig_conn.buf.windows(4).position(|w| w == b"\r\n\r\n") {
                break p + 4;
            }
            let mut chunk = [0u8; 4096];
            let n = rig_conn.stream.read(&mut chunk).unwrap();
            assert!(n > 0, "closed during the upgrade");
            rig_conn.buf.extend_from_slice(&chunk[..n]);
        };
        assert!(rig_conn.buf.starts_with(b"HTTP/1.1 101"));
        rig_conn.buf.drain(..end);
        let hello = json!({"type":"hello","rig_id":rig,"boot_id":boot_id(),"version":"peer"});
        rig_conn.send(fleetlink::ws::OpCode::Text, hello.to_string().as_bytes());
        rig_conn
            .stream
            .set_read_timeout(Some(Duration::from_millis(20)))
            .unwrap();
        let deadline = Instant::now() + Duration::from_secs(5);
        while !String::from_utf8_lossy(&rig_conn.buf).contains("welcome") {
            assert!(Instant::now() < deadline, "no welcome");
            rig_conn.fill();
        }
        rig_conn.buf.clear();
        rig_conn
    }

    fn send(&mut self, op: fleetlink::ws::OpCode, payload: &[u8]) {
        let mut frame = Vec::new();
        fleetlink::ws::encode_client_frame(&mut frame, true, op, [7, 1, 3, 9], payload);
        let _ = self.stream.write_all(&frame);
    }

    /// Reads what arrives within the 20 ms read timeout.
    fn fill(&mut self) {
        let mut chunk = [0u8; 4096];
        match self.stream.read(&mut chunk) {
            Ok(0) => self.close = self.close.or(Some(1006)),
            Ok(n) => self.buf.extend_from_slice(&chunk[..n]),
            Err(_) => {}
        }
    }

    /// One step: read frames; answer pings when `answer`; note a close.
    fn step(&mut self, answer: bool) {
        self.fill();
        while self.buf.len() >= 2 {
            let op = self.buf[0] & 0x0f;
            let len = (self.buf[1] & 0x7f) as usize;
            let (len, off) = match len {
                126 if self.buf.len() >= 4 => {
                    (u16::from_be_bytes([self.buf[2], self.buf[3]]) as usize, 4)
                }
                126 | 127 => break,
                n => (n, 2),
            };
            if self.buf.len() < off + len {
                break;
            }
            let payload = self.buf[off..off + len].to_vec();
            self.buf.drain(..off + len);
            match op {
                0x9 if answer => {
                    self.send(fleetlink::ws::OpCode::Pong, &payload);
                    self.pongs += 1;
                }
                0x9 => self.unanswered += 1,
                0x8 if payload.len() >= 2 => {
                    self.close = Some(u16::from_be_bytes([payload[0], payload[1]]));
                }
                _ => {}
            }
        }
    }
}

const PING_MS: u64 = 300;
const PONG_MS: u64 = 200;
const MISSES: u64 = 3;
/// The sweep tick for these settings: min(interval, timeout, hello timeout) / 8, clamped 5..250.
const TICK_MS: u64 = 25;

fn liveness_args() -> Vec<String> {
    [
        "--ping-interval",
        &format!("{PING_MS}ms"),
        "--pong-timeout",
        &format!("{PONG_MS}ms"),
        "--max-missed-pongs",
        &MISSES.to_string(),
    ]
    .iter()
    .map(|s| s.to_string())
    .collect()
}

/// Detection bounds: no earlier than the last allowed miss after the first unanswered ping,
/// no later than the interval × misses + timeout (plus the sweep tick, and 500 ms for
/// our polling and scheduling on two busy cores).
fn detection_bounds() -> (Duration, Duration) {
    let lower = PING_MS * (MISSES - 1) + PONG_MS;
    let upper = PING_MS * MISSES + PONG_MS + TICK_MS + 500;
    (
        Duration::from_millis(lower.saturating_sub(TICK_MS + 50)),
        Duration::from_millis(upper),
    )
}

/// A rig that stops answering pings (its kernel still ACKs: the socket is alive, the peer is
/// not) is closed with 4002 within interval × misses + timeout; a healthy neighbour stays.
#[test]
fn a_rig_that_stops_answering_pings_is_closed_4002_in_time() {
    let _serial = serial();
    let args = liveness_args();
    let args: Vec<&str> = args.iter().map(String::as_str).collect();
    let b = Broker::start(&args);
    let mut healthy = PeerRig::connect(b.listen, "fq-healthy");
    let mut mute = PeerRig::connect(b.listen, "fq-mute");
    // Both answer for a while: at least two pings each.
    let deadline = Instant::now() + Duration::from_secs(5);
    while healthy.pongs < 2 || mute.pongs < 2 {
        assert!(Instant::now() < deadline, "no pings");
        healthy.step(true);
        mute.step(true);
    }
    let stopped = Instant::now();
    let detected = loop {
        healthy.step(true);
        mute.step(false);
        if Metrics::of(b.admin).get("fleetlink_closes_total{code=\"4002\"}") >= 1.0 {
            break Instant::now();
        }
        assert!(
            stopped.elapsed() < Duration::from_secs(5),
            "silent rig never closed"
        );
    };
    let took = detected - stopped;
    let deadline = Instant::now() + Duration::from_secs(2);
    while mute.close.is_none() && Instant::now() < deadline {
        mute.step(false);
    }
    let listed = rigs_listed(b.admin);
    let (lower, upper) = detection_bounds();
    report(
        "silent_rig",
        &[
            ("ping_interval_ms", json!(PING_MS)),
            ("pong_timeout_ms", json!(PONG_MS)),
            ("max_missed_pongs", json!(MISSES)),
            ("detected_after_ms", ms(took)),
            ("bound_ms", ms(upper)),
            ("unanswered_pings", json!(mute.unanswered)),
            ("close_code", json!(mute.close)),
        ],
    );
    assert_eq!(mute.close, Some(4002));
    // The clock's slack is more than an interval: the count says it was the last allowed miss.
    assert_eq!(
        mute.unanswered, MISSES,
        "pings left unanswered before the close"
    );
    assert!(
        took >= lower && took <= upper,
        "detected after {took:?}, expected {lower:?}..={upper:?}"
    );
    assert_eq!(listed, vec!["fq-healthy".to_string()]);
    assert_eq!(healthy.close, None);
}

/// Three network namespaces, deleted on drop: the broker's, the rig's, and a router between
/// them (a veth pair to each side). The drop happens on the router, so for both ends it is a
/// loss in the network, as a vanished peer's would be: their TCP retransmits with backoff. (A
/// drop on an end's own device is a local congestion drop instead: that TCP gives up after 15
/// window probes, ~10 s, and the broker would see a socket error rather than silence.)
struct Netns {
    broker_ns: String,
    router_ns: String,
    rig_ns: String,
}

const NS_BROKER_IP: &str = "10.254.7.1";

fn ip(args: &[&str]) -> Result<(), String> {
    let out = Command::new("ip")
        .args(args)
        .output()
        .map_err(|e| format!("ip: {e}"))?;
    if out.status.success() {
        Ok(())
    } else {
        Err(format!(
            "ip {}: {}",
            args.join(" "),
            String::from_utf8_lossy(&out.stderr).trim()
        ))
    }
}

impl Netns {
    fn create() -> Result<Netns, String> {
        let tag = format!("{}-{:04x}", std::process::id(), fastrand::u16(..));
        let ns = Netns {
            broker_ns: format!("flq-b-{tag}"),
            router_ns: format!("flq-x-{tag}"),
            rig_ns: format!("flq-r-{tag}"),
        };
        let (b, x, r) = (
            ns.broker_ns.as_str(),
            ns.router_ns.as_str(),
            ns.rig_ns.as_str(),
        );
        for name in [b, x, r] {
            ip(&["netns", "add", name])?;
        }
        ip(&[
            "link", "add", "vb", "netns", b, "type", "veth", "peer", "name", "xb", "netns", x,
        ])?;
        ip(&[
            "link", "add", "vr", "netns", r, "type", "veth", "peer", "name", "xr", "netns", x,
        ])?;
        for (name, addr, dev) in [
            (b, "10.254.7.1/30", "vb"),
            (x, "10.254.7.2/30", "xb"),
            (r, "10.254.8.2/30", "vr"),
            (x, "10.254.8.1/30", "xr"),
        ] {
            ip(&["-n", name, "addr", "add", addr, "dev", dev])?;
        }
        for (name, dev) in [
            (b, "vb"),
            (x, "xb"),
            (x, "xr"),
            (r, "vr"),
            (b, "lo"),
            (x, "lo"),
            (r, "lo"),
        ] {
            ip(&["-n", name, "link", "set", dev, "up"])?;
        }
        ip(&["-n", b, "route", "add", "default", "via", "10.254.7.2"])?;
        ip(&["-n", r, "route", "add", "default", "via", "10.254.8.1"])?;
        ip(&[
            "netns",
            "exec",
            x,
            "sh",
            "-c",
            "echo 1 > /proc/sys/net/ipv4/ip_forward",
        ])?;
        Ok(ns)
    }

    /// Every packet either way is dropped in the router from now on: a pfifo of length 0 on
    /// both of its devices (netem is not in this kernel). No FIN, no RST, nothing.
    fn drop_all(&self) -> Result<(), String> {
        for dev in ["xb", "xr"] {
            ip(&[
                "netns",
                "exec",
                &self.router_ns,
                "tc",
                "qdisc",
                "add",
                "dev",
                dev,
                "root",
                "pfifo",
                "limit",
                "0",
            ])?;
        }
        Ok(())
    }
}

impl Drop for Netns {
    fn drop(&mut self) {
        for name in [&self.broker_ns, &self.router_ns, &self.rig_ns] {
            let _ = ip(&["netns", "del", name]);
        }
    }
}

/// Runs `f` on a thread that entered network namespace `ns` (sockets it opens live there).
fn in_netns<R: Send + 'static>(ns: &str, f: impl FnOnce() -> R + Send + 'static) -> R {
    let path = format!("/var/run/netns/{ns}");
    std::thread::spawn(move || {
        let file = File::open(&path).unwrap();
        let rc = unsafe { libc::setns(file.as_raw_fd(), libc::CLONE_NEWNET) };
        assert_eq!(rc, 0, "setns {path}: {}", std::io::Error::last_os_error());
        f()
    })
    .join()
    .unwrap()
}

/// A broker started inside a network namespace (`ip netns exec`), killed on drop.
struct NsBroker {
    child: Child,
    listen: SocketAddr,
    admin: SocketAddr,
}

impl NsBroker {
    fn start(ns: &str, args: &[&str]) -> NsBroker {
        let mut child = Command::new("ip")
            .args(["netns", "exec", ns, env!("CARGO_BIN_EXE_fleetlink-fe")])
            .args(["--admin", "127.0.0.1:0"])
            .args(args)
            .env("RUST_LOG", "warn")
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit())
            .spawn()
            .unwrap();
        let stdout = child.stdout.take().unwrap();
        let (tx, rx) = mpsc::channel();
        std::thread::spawn(move || {
            for line in BufReader::new(stdout).lines().map_while(Result::ok) {
                let _ = tx.send(line);
            }
        });
        let line = rx.recv_timeout(Duration::from_secs(20)).unwrap();
        let field = |k: &str| -> SocketAddr {
            line.split_whitespace()
                .find_map(|w| w.strip_prefix(&format!("{k}=")))
                .unwrap()
                .parse()
                .unwrap()
        };
        NsBroker {
            listen: field("listen"),
            admin: field("admin"),
            child,
        }
    }
}

impl Drop for NsBroker {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// A rig in its own network namespace loses every packet (both directions dropped in a router
/// namespace between it and the broker; no FIN ever arrives): the broker in the other namespace closes it with 4002 within
/// interval × misses + timeout of the drop. Needs root and `ip netns`: without them it fails,
/// unless `FLEETLINK_SKIP_NETNS=1` is set, where it says SKIP and passes (for machines that
/// cannot make namespaces; CI runs as root and must not skip it silently).
#[test]
fn a_rig_that_vanishes_without_fin_in_a_netns_is_closed_4002_in_time() {
    let _serial = serial();
    let netns = match Netns::create() {
        Ok(p) => p,
        Err(e) if std::env::var("FLEETLINK_SKIP_NETNS").as_deref() == Ok("1") => {
            println!("FAULT vanished_peer_netns SKIP (FLEETLINK_SKIP_NETNS=1): {e}");
            return;
        }
        Err(e) => panic!(
            "cannot create network namespaces (needs root and `ip netns`; set \
             FLEETLINK_SKIP_NETNS=1 to skip this test where that is impossible): {e}"
        ),
    };
    let mut args = liveness_args();
    args.extend(["--listen".to_string(), format!("{NS_BROKER_IP}:0")]);
    let args: Vec<&str> = args.iter().map(String::as_str).collect();
    let b = NsBroker::start(&netns.broker_ns, &args);
    let addr = b.listen;
    let admin = b.admin;
    let mut victim = in_netns(&netns.rig_ns, move || PeerRig::connect(addr, "fq-vanish"));
    let stop = Arc::new(AtomicBool::new(false));
    let halt = stop.clone();
    let pumping = std::thread::spawn(move || {
        while !halt.load(Ordering::SeqCst) {
            victim.step(true);
        }
        victim
    });
    let ns = netns.broker_ns.clone();
    eventually(Duration::from_secs(5), "pings answered", move || {
        let ns = ns.clone();
        in_netns(&ns, move || {
            Metrics::of(admin).get("fleetlink_pongs_received_total") >= 2.0
        })
    });
    netns.drop_all().expect("tc qdisc");
    let dropped = Instant::now();
    let detected = in_netns(&netns.broker_ns, move || loop {
        if Metrics::of(admin).get("fleetlink_closes_total{code=\"4002\"}") >= 1.0 {
            return Some(Instant::now());
        }
        if dropped.elapsed() > Duration::from_secs(5) {
            return None;
        }
        std::thread::sleep(Duration::from_millis(5));
    });
    stop.store(true, Ordering::SeqCst);
    let victim = pumping.join().unwrap();
    let took = detected.expect("vanished rig never closed") - dropped;
    let listed = in_netns(&netns.broker_ns, move || rigs_listed(admin));
    let (lower, upper) = detection_bounds();
    report(
        "vanished_peer_netns",
        &[
            ("ping_interval_ms", json!(PING_MS)),
            ("pong_timeout_ms", json!(PONG_MS)),
            ("max_missed_pongs", json!(MISSES)),
            ("detected_after_ms", ms(took)),
            ("bound_ms", ms(upper)),
            ("rig_saw_close", json!(victim.close)),
        ],
    );
    assert!(
        took >= lower && took <= upper,
        "detected after {took:?}, expected {lower:?}..={upper:?}"
    );
    assert!(listed.is_empty(), "{listed:?}");
    assert_eq!(victim.close, None, "a packet got through the drop");
}

// ---------------------------------------------------------------------------------------------
// 4. SIGTERM drain: reconnects spread over the window
// ---------------------------------------------------------------------------------------------

/// 200 in-test rigs (Swarm) on A; B listens on the same port (SO_REUSEPORT); A gets SIGTERM
/// with a 2 s drain: every rig gets its own goaway delay, reconnects to B at that instant, and
/// the reconnect times fill the window (a histogram over 10 buckets, no spike).
#[test]
fn sigterm_drain_spreads_reconnects_over_the_window() {
    let _serial = serial();
    const N: usize = 200;
    const WINDOW: Duration = Duration::from_secs(2);
    const BUCKETS: usize = 10;
    let mut a_args = vec!["--listen", "127.0.0.1:0", "--drain", "2s"];
    a_args.extend(OPEN_BUCKET);
    let mut a = Broker::start(&a_args);
    let listen = format!("127.0.0.1:{}", a.listen.port());
    let swarm = Swarm::start(a.listen, true);
    swarm.connect("fq-drain", N);
    let mut b_args = vec!["--listen", listen.as_str(), "--share-port"];
    b_args.extend(OPEN_BUCKET);
    let b = Broker::start(&b_args);
    a.sigterm();
    let t0 = Instant::now();
    eventually(WINDOW + Duration::from_secs(8), "all rigs on B", || {
        swarm.with(|s| s.rigs.iter().all(|r| r.welcomes.len() == 2))
    });
    let status = a.wait_exit(Duration::from_secs(10)).expect("A exits");
    assert!(status.success(), "{status:?}");
    let (delays, reconnects, ended) = swarm.with(|s| {
        let delays: Vec<u64> = s.rigs.iter().filter_map(|r| r.goaway_ms).collect();
        let reconnects: Vec<Duration> = s
            .rigs
            .iter()
            .map(|r| r.welcomes[1].0.saturating_duration_since(t0))
            .collect();
        let ended: Vec<String> = s.rigs.iter().flat_map(|r| r.ended.clone()).collect();
        (delays, reconnects, ended)
    });
    assert_eq!(delays.len(), N, "every rig gets a goaway");
    let width = WINDOW.as_millis() as u64 / BUCKETS as u64;
    let mut goaway_hist = [0usize; BUCKETS];
    for d in &delays {
        assert!(
            *d < WINDOW.as_millis() as u64,
            "delay {d} outside the window"
        );
        goaway_hist[(*d / width) as usize] += 1;
    }
    let mut reconnect_hist = vec![0usize; BUCKETS + 3];
    for r in &reconnects {
        let i = (r.as_millis() as u64 / width) as usize;
        reconnect_hist[i.min(BUCKETS + 2)] += 1;
    }
    let listed = rigs_listed(b.admin).len();
    let last = reconnects.iter().max().copied().unwrap_or_default();
    report(
        "drain_spread",
        &[
            ("rigs", json!(N)),
            ("window_ms", ms(WINDOW)),
            ("bucket_ms", json!(width)),
            ("goaway_delay_hist", json!(goaway_hist)),
            ("reconnect_hist_from_sigterm", json!(reconnect_hist)),
            ("last_reconnect_ms", ms(last)),
            ("closed_by_broker", json!(ended.len())),
            ("on_b", json!(listed)),
        ],
    );
    // Uniform over 10 buckets: 20 expected each; a spike would put most in one.
    let expect = N / BUCKETS;
    for (i, n) in goaway_hist.iter().enumerate() {
        assert!(
            *n >= 3 && *n <= 3 * expect,
            "goaway bucket {i}: {n} {goaway_hist:?}"
        );
    }
    for (i, n) in reconnect_hist[..BUCKETS].iter().enumerate() {
        assert!(
            *n >= 3 && *n <= 3 * expect,
            "reconnect bucket {i}: {n} {reconnect_hist:?}"
        );
    }
    // The delays the broker handed out are checked exactly above (each inside the window);
    // this only catches a reconnect held up far past its instant (e.g. by B's accept path).
    // One pump thread serves all the rigs on two busy cores, hence the loose slack.
    assert!(
        last < WINDOW + Duration::from_millis(1500),
        "last reconnect {last:?}"
    );
    assert_eq!(listed, N);
}

// ---------------------------------------------------------------------------------------------
// 5. Reconnect storm against the accept bucket
// ---------------------------------------------------------------------------------------------

/// 50 real agents on A; A is killed -9 and they all reconnect at once (their own backoff,
/// 1–3 s after a short-lived connection) to B, whose accept bucket is 10/s with a burst of 10:
/// the excess gets 503 + Retry-After (5–15 s) and each agent honours it (±10 %). All are back
/// within the expected time, and nothing is overloaded: no shed or over-capacity answers, no
/// 4503 (registry), readiness stays up, Redis answers quickly throughout.
#[test]
fn reconnect_storm_of_agents_against_the_accept_bucket() {
    let _serial = serial();
    const N: usize = 50;
    const RATE: f64 = 10.0;
    const BURST: usize = 10;
    let redis = RedisServer::start();
    let mut a_args = vec!["--listen", "127.0.0.1:0", "--cores", "1"];
    a_args.extend(OPEN_BUCKET);
    let mut a = fleet_broker(&redis, "fe-a", &a_args);
    let listen = format!("127.0.0.1:{}", a.listen.port());
    let url = format!("ws://{listen}/agent");
    let dir = test_dir("storm");
    let rigs: Vec<String> = (0..N).map(|i| format!("fq-storm-{i:03}")).collect();
    let mut agents: Vec<Agent> = rigs.iter().map(|r| Agent::spawn(&url, r, &dir)).collect();
    eventually(Duration::from_secs(20), "agents on A", || {
        rigs_listed(a.admin).len() == N
    });
    let b = fleet_broker(
        &redis,
        "fe-b",
        &[
            "--listen",
            &listen,
            "--share-port",
            "--cores",
            "1",
            "--accept-rate",
            "10",
            "--accept-burst",
            "10",
        ],
    );
    kill9(&mut a);
    let t0 = Instant::now();
    // Worst case: the agent's backoff (≤ 3 s), the bucket's own pace, one Retry-After (≤ 15 s
    // + 10 %), a second one for the unlucky, plus slack.
    let bound = Duration::from_secs(3)
        + Duration::from_secs_f64((N - BURST) as f64 / RATE)
        + Duration::from_secs_f64(16.5)
        + Duration::from_secs(2);
    let mut con = redis.connection();
    let mut not_ready = 0;
    let mut redis_max = Duration::ZERO;
    let mut polls = 0;
    let all_in = loop {
        let t = Instant::now();
        let _: String = redis::cmd("PING").query(&mut con).unwrap();
        redis_max = redis_max.max(t.elapsed());
        if b.http("GET", "/readyz", "").0 != 200 {
            not_ready += 1;
        }
        polls += 1;
        if rigs_listed(b.admin).len() == N {
            break t0.elapsed();
        }
        assert!(
            t0.elapsed() < bound,
            "only {} of {N} agents back after {:?}",
            rigs_listed(b.admin).len(),
            t0.elapsed()
        );
        std::thread::sleep(Duration::from_millis(20));
    };
    let m = Metrics::of(b.admin);
    let accepted = m.get("fleetlink_accepts_total{result=\"ok\"}");
    let limited = m.get("fleetlink_accepts_total{result=\"rate_limited\"}");
    let shed = m.get("fleetlink_accepts_total{result=\"shed\"}");
    let over = m.get("fleetlink_accepts_total{result=\"over_capacity\"}");
    let c4503 = m.get("fleetlink_closes_total{code=\"4503\"}");
    let queue_full = m.sum("fleetlink_bridge_queue_full_total");
    for agent in &mut agents {
        assert!(
            agent.child.try_wait().unwrap().is_none(),
            "{} exited",
            agent.rig
        );
    }
    // Every 503 an agent saw: the Retry-After, the wait the agent announced, and the time from
    // that log line to its next attempt's (`connecting to ... (attempt n`), as the test read
    // them. Every agent is back, so each 503 has its next attempt (read soon, if not yet).
    let refusals = |agent: &Agent| -> Option<Vec<(f64, f64, Duration)>> {
        let lines = agent.timed_lines();
        let mut out = Vec::new();
        for (i, (at, line)) in lines.iter().enumerate() {
            let Some(rest) = line.split("HTTP 503: retry in ").nth(1) else {
                continue;
            };
            let announced: f64 = rest.split('s').next().unwrap().parse().unwrap();
            let hint: f64 = rest
                .split("Retry-After: ")
                .nth(1)
                .unwrap()
                .trim_end_matches(')')
                .parse()
                .unwrap();
            let (next, _) = lines[i + 1..]
                .iter()
                .find(|(_, l)| l.contains("connecting to ") && l.contains("(attempt "))?;
            out.push((announced, hint, next.saturating_duration_since(*at)));
        }
        Some(out)
    };
    let mut retry_afters = Vec::new();
    for agent in &agents {
        let deadline = Instant::now() + Duration::from_secs(5);
        let found = loop {
            if let Some(found) = refusals(agent) {
                break found;
            }
            assert!(
                Instant::now() < deadline,
                "{}: a 503 without a next attempt",
                agent.rig
            );
            std::thread::sleep(Duration::from_millis(10));
        };
        retry_afters.extend(found);
    }
    let owners_b = owners(&mut con)
        .values()
        .filter(|b| b.as_str() == "fe-b")
        .count();
    report(
        "reconnect_storm",
        &[
            ("agents", json!(N)),
            ("accept_rate", json!(RATE)),
            ("accept_burst", json!(BURST)),
            ("all_back_ms", ms(all_in)),
            ("bound_ms", ms(bound)),
            ("accepted", json!(accepted)),
            ("rate_limited_503", json!(limited)),
            ("shed", json!(shed)),
            ("over_capacity", json!(over)),
            ("closes_4503", json!(c4503)),
            ("bridge_queue_full", json!(queue_full)),
            ("readyz_not_200", json!(not_ready)),
            ("readyz_polls", json!(polls)),
            ("redis_ping_max_ms", json!(redis_max.as_secs_f64() * 1000.0)),
            ("agent_503s", json!(retry_afters.len())),
            (
                "min_waited_over_announced",
                json!(retry_afters
                    .iter()
                    .map(|(a, _, g)| g.as_secs_f64() / a)
                    .fold(f64::INFINITY, f64::min)),
            ),
            ("registry_on_b", json!(owners_b)),
        ],
    );
    assert!(limited > 0.0, "the storm never met the bucket");
    assert_eq!(shed, 0.0);
    assert_eq!(over, 0.0);
    assert_eq!(c4503, 0.0);
    assert_eq!(queue_full, 0.0);
    assert_eq!(not_ready, 0, "B's readiness failed during the storm");
    // A PING measured from the test thread, which shares two cores with 50 agents, two brokers
    // and Redis: scheduling alone can take a few hundred ms. A Redis blocked by the storm (a
    // long script, a pile of hellos in one go) takes longer than this.
    assert!(
        redis_max < Duration::from_secs(1),
        "Redis slow: {redis_max:?}"
    );
    assert!(!retry_afters.is_empty());
    for (announced, hint, gap) in &retry_afters {
        assert!((5.0..=15.0).contains(hint), "Retry-After {hint}");
        // What the agent meant to wait: Retry-After ± 10 % ...
        assert!(
            *announced >= 0.9 * hint - 0.01 && *announced <= 1.1 * hint + 0.01,
            "announced {announced}s for Retry-After {hint}"
        );
        // ... and what it did wait before its next attempt.
        assert!(
            gap.as_secs_f64() >= 0.9 * announced,
            "tried again {gap:?} after announcing {announced}s (Retry-After {hint})"
        );
    }
    assert_eq!(owners_b, N);
    let _ = std::fs::remove_dir_all(&dir);
}
