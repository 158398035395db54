//! Runs the real `fleetlink-fe` binary on free ports (port 0) and talks to it like a user:
//! tungstenite for rigs, plain HTTP for the admin API.

use std::io::{BufRead, BufReader, ErrorKind, Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::process::{Child, Command, ExitStatus, Stdio};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::mpsc;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use serde_json::{json, Value};
use tungstenite::stream::MaybeTlsStream;
use tungstenite::{Message, WebSocket};

/// A websocket client over a plain TCP stream.
pub type Ws = WebSocket<MaybeTlsStream<TcpStream>>;

/// A running broker process, killed on drop.
pub struct Broker {
    child: Child,
    /// Rig endpoint.
    pub listen: SocketAddr,
    /// Admin endpoint.
    pub admin: SocketAddr,
    /// The broker id it announced.
    pub broker_id: String,
    /// Its log so far, when started with [`Broker::start_logged`] (otherwise it goes to the
    /// test's own stderr).
    log: Option<std::sync::Arc<std::sync::Mutex<String>>>,
}

impl Broker {
    /// Starts the broker with `args` (plus loopback port-0 listeners unless given).
    pub fn start(args: &[&str]) -> Broker {
        Broker::start_with_env(args, &[])
    }

    /// [`Broker::start`] with extra environment variables (e.g. `FLEETLINK_FAILPOINT`).
    pub fn start_with_env(args: &[&str], env: &[(&str, &str)]) -> Broker {
        Broker::spawn(args, env, false, None)
    }

    /// [`Broker::start`] with its log (warnings and up) kept for [`Broker::wait_log`].
    pub fn start_logged(args: &[&str]) -> Broker {
        Broker::spawn(args, &[], true, None)
    }

    /// [`Broker::start_logged`] under a soft open-file limit of `nofile`.
    pub fn start_logged_with_nofile(args: &[&str], nofile: u64) -> Broker {
        Broker::spawn(args, &[], true, Some(nofile))
    }

    fn spawn(args: &[&str], env: &[(&str, &str)], keep_log: bool, nofile: Option<u64>) -> Broker {
        let mut cmd = Command::new(env!("CARGO_BIN_EXE_fleetlink-fe"));
        cmd.envs(env.iter().copied());
        if let Some(soft) = nofile {
            use std::os::unix::process::CommandExt;
            // SAFETY: only setrlimit, which is async-signal-safe, runs between fork and exec.
            unsafe {
                cmd.pre_exec(move || {
                    let mut lim = libc::rlimit {
                        rlim_cur: 0,
                        rlim_max: 0,
                    };
                    if libc::getrlimit(libc::RLIMIT_NOFILE, &mut lim) != 0 {
                        return Err(std::io::Error::last_os_error());
                    }
                    lim.rlim_cur = soft.min(lim.rlim_max);
                    if libc::setrlimit(libc::RLIMIT_NOFILE, &lim) != 0 {
                        return Err(std::io::Error::last_os_error());
                    }
                    Ok(())
                });
            }
        }
        if !args.contains(&"--listen") {
            cmd.args(["--listen", "127.0.0.1:0"]);
        }
        if !args.contains(&"--admin") {
            cmd.args(["--admin", "127.0.0.1:0"]);
        }
        cmd.args(args)
            .env("RUST_LOG", "warn")
            .stdout(Stdio::piped())
            .stderr(if keep_log {
                Stdio::piped()
            } else {
                Stdio::inherit()
            });
        let mut child = cmd.spawn().expect("spawn fleetlink-fe");
        let log = child.stderr.take().map(|stderr| {
            let log = std::sync::Arc::new(std::sync::Mutex::new(String::new()));
            let sink = log.clone();
            std::thread::spawn(move || {
                for line in BufReader::new(stderr).lines().map_while(Result::ok) {
                    let mut log = sink.lock().unwrap();
                    log.push_str(&line);
                    log.push('\n');
                }
            });
            log
        });
        let stdout = child.stdout.take().expect("stdout");
        let (tx, rx) = mpsc::channel();
        std::thread::spawn(move || {
            for line in BufReader::new(stdout).lines().map_while(Result::ok) {
                let _ = tx.send(line);
            }
        });
        let line = rx
            .recv_timeout(Duration::from_secs(20))
            .expect("broker printed no ready line");
        let field = |k: &str| {
            line.split_whitespace()
                .find_map(|w| w.strip_prefix(&format!("{k}=")))
                .unwrap_or_else(|| panic!("no {k} in {line:?}"))
                .to_string()
        };
        Broker {
            listen: field("listen").parse().unwrap(),
            admin: field("admin").parse().unwrap(),
            broker_id: field("broker_id"),
            child,
            log,
        }
    }

    /// Waits (up to 10 s) for a line of the broker's log containing every one of `parts`; the
    /// line. The broker must have been started with [`Broker::start_logged`].
    pub fn wait_log(&self, parts: &[&str]) -> String {
        let log = self.log.as_ref().expect("started with start_logged");
        let found = || {
            log.lock()
                .unwrap()
                .lines()
                .find(|l| parts.iter().all(|p| l.contains(p)))
                .map(str::to_string)
        };
        eventually(
            Duration::from_secs(10),
            &format!("a log line with {parts:?}"),
            || found().is_some(),
        );
        found().unwrap_or_default()
    }

    /// The broker's log so far. The broker must have been started with
    /// [`Broker::start_logged`].
    #[allow(dead_code)] // not every test binary reads the whole log
    pub fn log_text(&self) -> String {
        let log = self.log.as_ref().expect("started with start_logged");
        log.lock().unwrap().clone()
    }

    /// ws URL for `path`.
    pub fn url(&self, path: &str) -> String {
        format!("ws://{}{path}", self.listen)
    }

    /// Opens a websocket on `path` (read timeout 10 s so a broken test fails, not hangs).
    pub fn connect(&self, path: &str) -> Ws {
        let stream = TcpStream::connect(self.listen).unwrap();
        stream
            .set_read_timeout(Some(Duration::from_secs(10)))
            .unwrap();
        let (ws, _resp) =
            tungstenite::client(self.url(path), MaybeTlsStream::Plain(stream)).unwrap();
        ws
    }

    /// Connects as `rig` with a fresh boot and returns the socket after `welcome`.
    pub fn rig(&self, rig: &str) -> (Ws, String, Value) {
        let boot = boot_id();
        let mut ws = self.connect("/agent");
        let welcome = hello(&mut ws, rig, &boot, json!({}));
        (ws, boot, welcome)
    }

    /// One admin HTTP request; returns status and body.
    pub fn http(&self, method: &str, path: &str, body: &str) -> (u16, String) {
        http(self.admin, method, path, body)
    }

    /// The rig `event`s named `name` in the first page of `GET /v1/events` (standalone).
    #[allow(dead_code)] // not every test binary reads events
    pub fn events_named(&self, name: &str) -> Vec<Value> {
        self.events_where(|e| e["type"] == "event" && e["name"] == name)
    }

    /// The events `want` accepts in the first page of `GET /v1/events` (standalone).
    #[allow(dead_code)] // not every test binary reads events
    pub fn events_where(&self, want: impl Fn(&Value) -> bool) -> Vec<Value> {
        let (_, page) = self.http("GET", "/v1/events?after=0", "");
        let page: Value = serde_json::from_str(&page).unwrap();
        page["events"]
            .as_array()
            .unwrap()
            .iter()
            .filter(|e| want(e))
            .cloned()
            .collect()
    }

    /// Sends a command through the admin API and returns the reply.
    pub fn command(&self, rig: &str, name: &str, args: Value) -> (u16, Value) {
        let body = json!({"name": name, "args": args}).to_string();
        let (status, text) = self.http("POST", &format!("/v1/rigs/{rig}/commands"), &body);
        (status, serde_json::from_str(&text).unwrap_or(Value::Null))
    }

    /// POSTs command `id` (name `n`, no args) to `rig` through the admin API: the status and
    /// the reply's text.
    pub fn command_with_id(&self, rig: &str, id: &str) -> (u16, String) {
        let body = json!({"id": id, "name": "n", "args": {}}).to_string();
        self.http("POST", &format!("/v1/rigs/{rig}/commands"), &body)
    }

    /// Waits up to `limit` for `/readyz` to answer `status` (200 on Redis, 503 off it).
    pub fn wait_readyz(&self, status: u16, limit: Duration, what: &str) {
        eventually(limit, what, || self.http("GET", "/readyz", "").0 == status);
    }

    /// Polls `/metrics` until `line` shows up (or panics at the deadline).
    pub fn wait_metric(&self, line: &str) {
        let deadline = Instant::now() + Duration::from_secs(10);
        loop {
            let (_, text) = self.http("GET", "/metrics", "");
            if text.lines().any(|l| l == line) {
                return;
            }
            assert!(
                Instant::now() < deadline,
                "metric {line:?} never appeared:\n{text}"
            );
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    /// The value of one series in `/metrics` now, e.g.
    /// `fleetlink_registry_ops_total{op="hello",result="ok"}`: 0 when that series has no line
    /// yet, but a panic when no series of its name is there at all, so that a renamed metric
    /// fails the tests that expect it to stay 0 instead of passing them.
    pub fn metric(&self, series: &str) -> u64 {
        let (_, text) = self.http("GET", "/metrics", "");
        series_value(&text, series)
    }

    /// Whether `/metrics` has a series named `name` (some exist only in some builds).
    pub fn has_metric(&self, name: &str) -> bool {
        let (_, text) = self.http("GET", "/metrics", "");
        text.lines().any(|l| l.starts_with(&format!("{name} ")))
    }

    /// Sends SIGTERM.
    pub fn sigterm(&self) {
        unsafe { libc::kill(self.child.id() as i32, libc::SIGTERM) };
    }

    /// Sends `signal` (e.g. `libc::SIGHUP`).
    pub fn signal(&self, signal: i32) {
        // SAFETY: kill(2) has no memory preconditions; the pid is our own child's.
        unsafe { libc::kill(self.child.id() as i32, signal) };
    }

    /// Waits for the process to exit, up to `limit`.
    pub fn wait_exit(&mut self, limit: Duration) -> Option<ExitStatus> {
        let deadline = Instant::now() + limit;
        loop {
            if let Ok(Some(status)) = self.child.try_wait() {
                return Some(status);
            }
            if Instant::now() > deadline {
                return None;
            }
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    /// Resident set size of the broker process in bytes.
    pub fn rss(&self) -> u64 {
        self.status_bytes("VmRSS:")
    }

    /// The broker process's peak resident set size so far, in bytes.
    pub fn peak_rss(&self) -> u64 {
        self.status_bytes("VmHWM:")
    }

    /// A size from /proc/PID/status (`field` with its colon), in bytes.
    fn status_bytes(&self, field: &str) -> u64 {
        let status = std::fs::read_to_string(format!("/proc/{}/status", self.child.id())).unwrap();
        let kb: u64 = status
            .lines()
            .find_map(|l| l.strip_prefix(field))
            .and_then(|v| v.split_whitespace().next()?.parse().ok())
            .unwrap();
        kb * 1024
    }

    /// The process id.
    pub fn pid(&self) -> u32 {
        self.child.id()
    }
}

impl Drop for Broker {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// A fresh UUIDv7 boot id, newer than every one made before it in this test process: two
/// boots of the same millisecond compare by their random bits, so a "newer" boot made in the
/// same millisecond would be older half the time.
pub fn boot_id() -> String {
    static LAST_MS: AtomicU64 = AtomicU64::new(0);
    let now = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .unwrap()
        .as_millis() as u64;
    let ms = LAST_MS
        .fetch_update(Ordering::SeqCst, Ordering::SeqCst, |last| {
            Some(now.max(last + 1))
        })
        .map_or(now, |last| now.max(last + 1));
    fleetlink::ids::BootId::generate(ms).to_string()
}

/// Sends hello and returns the welcome (panics on anything else).
pub fn hello(ws: &mut Ws, rig: &str, boot: &str, labels: Value) -> Value {
    let msg = json!({"type": "hello", "rig_id": rig, "boot_id": boot, "version": "test", "labels": labels});
    ws.send(Message::Text(msg.to_string().into())).unwrap();
    let welcome = read_json(ws);
    assert_eq!(welcome["type"], "welcome", "{welcome}");
    welcome
}

/// How long the read helpers wait in all: each read has its own timeout, but a broker that
/// keeps PINGing a rig would keep a loop that skips them going for ever.
pub const READ_LIMIT: Duration = Duration::from_secs(30);

/// Reads until a text message arrives (answering pings as tungstenite does) and parses it.
pub fn read_json(ws: &mut Ws) -> Value {
    let deadline = Instant::now() + READ_LIMIT;
    loop {
        assert!(
            Instant::now() < deadline,
            "no text message within {READ_LIMIT:?}"
        );
        match ws.read().expect("read") {
            Message::Text(t) => return serde_json::from_str(t.as_str()).unwrap(),
            Message::Ping(_) | Message::Pong(_) => continue,
            other => panic!("expected text, got {other:?}"),
        }
    }
}

/// Reads the rig's next message, which must be command `id` numbered `seq`.
pub fn read_command(ws: &mut Ws, seq: u64, id: impl Into<Value>) {
    let cmd = read_json(ws);
    assert_eq!(
        (&cmd["seq"], &cmd["id"]),
        (&json!(seq), &id.into()),
        "{cmd}"
    );
}

/// Sends the rig's ack of `seq`.
pub fn ack(ws: &mut Ws, seq: u64) {
    ws.send(Message::Text(
        json!({"type":"ack","seq":seq}).to_string().into(),
    ))
    .unwrap();
}

/// Reads until the broker's close frame; returns its code.
pub fn read_close(ws: &mut Ws) -> u16 {
    let deadline = Instant::now() + READ_LIMIT;
    loop {
        assert!(
            Instant::now() < deadline,
            "no close frame within {READ_LIMIT:?}"
        );
        match ws.read() {
            Ok(Message::Close(Some(frame))) => return u16::from(frame.code),
            Ok(Message::Close(None)) => return 1005,
            Ok(_) => continue,
            Err(e) => panic!("connection ended without a close frame: {e}"),
        }
    }
}

/// One HTTP/1.1 request with `Connection: close`; returns status and body.
pub fn http(addr: SocketAddr, method: &str, path: &str, body: &str) -> (u16, String) {
    let mut s = TcpStream::connect(addr).unwrap();
    s.set_read_timeout(Some(Duration::from_secs(15))).unwrap();
    write!(
        s,
        "{method} {path} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{body}",
        body.len()
    )
    .unwrap();
    let mut resp = String::new();
    s.read_to_string(&mut resp).unwrap();
    let status = resp
        .split_whitespace()
        .nth(1)
        .and_then(|c| c.parse().ok())
        .unwrap_or(0);
    let body = resp
        .split_once("\r\n\r\n")
        .map(|(_, b)| b.to_string())
        .unwrap_or_default();
    (status, body)
}

/// One keep-alive admin connection: every request on it is served by the same core.
pub struct KeepAlive {
    stream: BufReader<TcpStream>,
}

impl KeepAlive {
    /// Opens the connection.
    pub fn open(addr: SocketAddr) -> KeepAlive {
        let s = TcpStream::connect(addr).unwrap();
        s.set_read_timeout(Some(Duration::from_secs(15))).unwrap();
        s.set_nodelay(true).unwrap();
        KeepAlive {
            stream: BufReader::new(s),
        }
    }

    /// POSTs `body` and returns the status and the body parsed as JSON.
    pub fn post(&mut self, path: &str, body: &str) -> (u16, Value) {
        let (status, body) = self.request("POST", path, body);
        (status, serde_json::from_str(&body).unwrap_or(Value::Null))
    }

    /// Sends one request and returns the status and the body.
    pub fn request(&mut self, method: &str, path: &str, body: &str) -> (u16, String) {
        // One write: a request in pieces would wait on Nagle and the server's delayed ACK.
        let request = format!(
            "{method} {path} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: {}\r\n\r\n{body}",
            body.len()
        );
        self.stream.get_mut().write_all(request.as_bytes()).unwrap();
        self.answer()
    }

    /// Reads one answer: the status and the body.
    pub fn answer(&mut self) -> (u16, String) {
        let mut status_line = String::new();
        self.stream.read_line(&mut status_line).unwrap();
        let status = status_line
            .split_whitespace()
            .nth(1)
            .and_then(|c| c.parse().ok())
            .unwrap_or(0);
        let mut length = 0;
        loop {
            let mut line = String::new();
            self.stream.read_line(&mut line).unwrap();
            let line = line.trim_end();
            if line.is_empty() {
                break;
            }
            if let Some((name, value)) = line.split_once(':') {
                if name.eq_ignore_ascii_case("content-length") {
                    length = value.trim().parse().unwrap();
                }
            }
        }
        let mut body = vec![0; length];
        self.stream.read_exact(&mut body).unwrap();
        (status, String::from_utf8_lossy(&body).into_owned())
    }

    /// The connection, for writing raw bytes.
    pub fn raw(&mut self) -> &mut TcpStream {
        self.stream.get_mut()
    }
}

/// Sends raw bytes on a fresh TCP connection and returns everything until the server closes.
pub fn raw_exchange(addr: SocketAddr, bytes: &[u8]) -> String {
    let mut s = TcpStream::connect(addr).unwrap();
    s.set_read_timeout(Some(Duration::from_secs(15))).unwrap();
    s.write_all(bytes).unwrap();
    let mut out = Vec::new();
    // The server's close is the end: EOF, or a reset when it closed with our bytes unread. A
    // timeout is a server that answered and then never closed, which these tests rule out.
    match s.read_to_end(&mut out) {
        Ok(_) => {}
        Err(e) if e.kind() == std::io::ErrorKind::ConnectionReset => {}
        Err(e) => panic!(
            "no close from the server ({e}) after {:?}",
            String::from_utf8_lossy(&out)
        ),
    }
    String::from_utf8_lossy(&out).into_owned()
}

/// Sends `head` to `addr`, waits for the broker's answer (a refusal), then writes without
/// pause until the broker cuts the connection off (a reset or a broken pipe), and returns how
/// many bytes went after the head; panics past `limit` bytes, still taken.
#[allow(dead_code)]
pub fn bytes_until_cut_off(addr: SocketAddr, head: &[u8], limit: usize) -> usize {
    let mut s = TcpStream::connect(addr).expect("connect");
    s.write_all(head).expect("head");
    s.set_read_timeout(Some(Duration::from_secs(10)))
        .expect("timeout");
    assert!(s.peek(&mut [0u8; 16]).expect("an answer to the head") > 0);
    let chunk = vec![b'x'; 64 << 10];
    let mut sent = 0;
    loop {
        match s.write(&chunk) {
            Ok(n) => sent += n,
            Err(e) => {
                use std::io::ErrorKind::{BrokenPipe, ConnectionReset};
                assert!(matches!(e.kind(), BrokenPipe | ConnectionReset), "{e}");
                return sent;
            }
        }
        assert!(sent < limit, "the broker took {sent} bytes and still reads");
    }
}

/// Polls `cond` every 10 ms until it holds, panicking with `what` after `limit`.
pub fn eventually(limit: Duration, what: &str, mut cond: impl FnMut() -> bool) {
    let deadline = Instant::now() + limit;
    while !cond() {
        assert!(Instant::now() < deadline, "timed out waiting for {what}");
        std::thread::sleep(Duration::from_millis(10));
    }
}

/// A rig on a raw socket: it never answers pings on its own (tungstenite would), so tests can
/// play a peer that has gone silent.
pub struct RawRig {
    stream: TcpStream,
    buf: Vec<u8>,
}

impl RawRig {
    /// Another handle on the connection, for reading or writing from a second thread.
    pub fn stream_clone(&self) -> TcpStream {
        self.stream.try_clone().expect("clone the socket")
    }

    /// Upgrades on /agent and sends a hello; returns after the welcome frame.
    pub fn hello(b: &Broker, rig: &str) -> RawRig {
        let mut rig_conn = RawRig::upgraded(b);
        let hello =
            json!({"type":"hello","rig_id":rig,"boot_id":boot_id(),"version":"raw"}).to_string();
        rig_conn.send_text(&hello);
        let (op, payload) = rig_conn.read_frame();
        assert_eq!(op, 0x1);
        assert!(String::from_utf8_lossy(&payload).contains("welcome"));
        rig_conn
    }

    /// Upgrades on /agent; returns once the 101 is read, before any message.
    pub fn upgraded(b: &Broker) -> RawRig {
        RawRig::upgraded_on(b, "/agent")
    }

    /// Upgrades on `path`; returns once the 101 is read.
    pub fn upgraded_on(b: &Broker, path: &str) -> RawRig {
        let mut stream = TcpStream::connect(b.listen).unwrap();
        stream
            .set_read_timeout(Some(Duration::from_secs(10)))
            .unwrap();
        write!(stream, "GET {path} HTTP/1.1\r\nHost: x\r\nUpgrade: websocket\r\nConnection: Upgrade\r\nSec-WebSocket-Key: dGhlIHNhbXBsZSBub25jZQ==\r\nSec-WebSocket-Version: 13\r\n\r\n").unwrap();
        let mut rig_conn = RawRig {
            stream,
            buf: Vec::new(),
        };
        while !rig_conn.buf.windows(4).any(|w| w == b"\r\n\r\n") {
            rig_conn.fill();
        }
        let end = rig_conn
            .buf
            .windows(4)
            .position(|w| w == b"\r\n\r\n")
            .unwrap()
            + 4;
        assert!(rig_conn.buf.starts_with(b"HTTP/1.1 101"));
        rig_conn.buf.drain(..end);
        rig_conn
    }

    /// Shrinks the socket's receive buffer, making this rig a slow link when it reads slowly.
    pub fn set_rcvbuf(&self, bytes: i32) {
        use std::os::fd::AsRawFd;
        // SAFETY: setsockopt with a pointer to a c_int and its size, on our own socket.
        let rc = unsafe {
            libc::setsockopt(
                self.stream.as_raw_fd(),
                libc::SOL_SOCKET,
                libc::SO_RCVBUF,
                std::ptr::from_ref(&bytes).cast(),
                std::mem::size_of::<i32>() as libc::socklen_t,
            )
        };
        assert_eq!(rc, 0, "SO_RCVBUF");
    }

    /// Sends one masked text frame.
    pub fn send_text(&mut self, text: &str) {
        self.send_frame(fleetlink::ws::OpCode::Text, text.as_bytes());
    }

    /// Writes bytes as they are (frames cut anywhere, several in one write).
    pub fn write_raw(&mut self, bytes: &[u8]) {
        self.stream.write_all(bytes).unwrap();
    }

    /// Sends one masked, final frame.
    pub fn send_frame(&mut self, op: fleetlink::ws::OpCode, payload: &[u8]) {
        let mut frame = Vec::new();
        fleetlink::ws::encode_client_frame(&mut frame, true, op, [1, 2, 3, 4], payload);
        self.stream.write_all(&frame).unwrap();
    }

    fn fill(&mut self) {
        let mut chunk = [0u8; 4096];
        let n = self.stream.read(&mut chunk).expect("read");
        assert!(n > 0, "connection closed");
        self.buf.extend_from_slice(&chunk[..n]);
    }

    /// Reads one (unmasked, server) frame: opcode and payload.
    pub fn read_frame(&mut self) -> (u8, Vec<u8>) {
        let deadline = Instant::now() + READ_LIMIT;
        loop {
            if let Some(frame) = self.take_frame() {
                return frame;
            }
            assert!(
                Instant::now() < deadline,
                "no whole frame within {READ_LIMIT:?}"
            );
            self.fill();
        }
    }

    /// Reads one frame as a slow link would: at most 4 KiB per `pause`.
    pub fn read_frame_paced(&mut self, pause: Duration) -> (u8, Vec<u8>) {
        let deadline = Instant::now() + READ_LIMIT;
        loop {
            if let Some(frame) = self.take_frame() {
                return frame;
            }
            assert!(
                Instant::now() < deadline,
                "no whole frame within {READ_LIMIT:?}"
            );
            std::thread::sleep(pause);
            self.fill();
        }
    }

    /// One frame if one arrives within `wait`, else None.
    pub fn read_frame_within(&mut self, wait: Duration) -> Option<(u8, Vec<u8>)> {
        if let Some(frame) = self.take_frame() {
            return Some(frame);
        }
        self.stream.set_read_timeout(Some(wait)).unwrap();
        let mut chunk = [0u8; 4096];
        let read = self.stream.read(&mut chunk);
        self.stream
            .set_read_timeout(Some(Duration::from_secs(10)))
            .unwrap();
        match read {
            Ok(0) => panic!("connection closed"),
            Ok(n) => self.buf.extend_from_slice(&chunk[..n]),
            Err(e) if matches!(e.kind(), ErrorKind::WouldBlock | ErrorKind::TimedOut) => {}
            Err(e) => panic!("read: {e}"),
        }
        self.take_frame()
    }

    fn take_frame(&mut self) -> Option<(u8, Vec<u8>)> {
        {
            if self.buf.len() >= 2 {
                let op = self.buf[0] & 0x0f;
                let (len, off) = match self.buf[1] & 0x7f {
                    126 if self.buf.len() >= 4 => {
                        (u16::from_be_bytes([self.buf[2], self.buf[3]]) as usize, 4)
                    }
                    127 if self.buf.len() >= 10 => (
                        u64::from_be_bytes(self.buf[2..10].try_into().unwrap()) as usize,
                        10,
                    ),
                    n @ 0..=125 => (n as usize, 2),
                    _ => (usize::MAX, 0),
                };
                if len != usize::MAX && self.buf.len() >= off + len {
                    let payload = self.buf[off..off + len].to_vec();
                    self.buf.drain(..off + len);
                    return Some((op, payload));
                }
            }
            None
        }
    }

    /// Reads frames until a close frame; returns its code.
    pub fn read_close(&mut self) -> u16 {
        let deadline = Instant::now() + READ_LIMIT;
        loop {
            assert!(
                Instant::now() < deadline,
                "no close frame within {READ_LIMIT:?}"
            );
            let (op, payload) = self.read_frame();
            if op == 0x8 {
                return u16::from_be_bytes([payload[0], payload[1]]);
            }
        }
    }
}

/// The value of `series` (a name, or a name and labels, with or without the space before the
/// value) in a `/metrics` text: 0 when the series has no line, a panic when its name has none.
pub fn series_value(text: &str, series: &str) -> u64 {
    series_value_f64(text, series) as u64
}

/// [`series_value`] for a series whose value is not a whole number.
pub fn series_value_f64(text: &str, series: &str) -> f64 {
    let series = series.trim_end();
    let name = series.split('{').next().unwrap_or(series);
    assert!(
        text.lines().any(|l| {
            let family = l.strip_prefix("# TYPE ").unwrap_or(l);
            family
                .strip_prefix(name)
                .is_some_and(|rest| rest.starts_with([' ', '{']))
        }),
        "no metric named {name} in /metrics:\n{text}"
    );
    text.lines()
        .find_map(|l| {
            let (k, v) = l.rsplit_once(' ')?;
            (k == series).then(|| v.parse::<f64>().ok()).flatten()
        })
        .unwrap_or(0.0)
}
