//! One simulated rig: connect from its source address, upgrade, hello, wait for welcome, then ack
//! every command until told to stop. Retries only what the contract says is retryable (503 with
//! Retry-After, close 4503 `retry_after=<s>`); everything else is a counted failure, because the
//! load generator measures the broker and must not hide its refusals behind reconnect loops.

use std::fs::File;
use std::io::{BufWriter, Write};
use std::net::{IpAddr, Ipv4Addr, SocketAddr};
use std::os::fd::AsRawFd;
use std::sync::atomic::Ordering::Relaxed;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use futures_util::{SinkExt, StreamExt};
use serde_json::Value;
use tokio::net::{TcpSocket, TcpStream};
use tokio::sync::{watch, Notify, Semaphore};
use tokio_tungstenite::tungstenite::client::IntoClientRequest;
use tokio_tungstenite::tungstenite::protocol::frame::coding::CloseCode;
use tokio_tungstenite::tungstenite::protocol::{CloseFrame, WebSocketConfig};
use tokio_tungstenite::tungstenite::{Error as WsError, Message};
use tokio_tungstenite::WebSocketStream;

use crate::report::Counters;
use crate::tls::{handshake_reason, RigStream, TlsClient};
use crate::uuid7;

type Ws = WebSocketStream<RigStream>;

/// What every rig of a worker shares.
#[derive(Debug)]
pub struct RigEnv {
    pub addr: SocketAddr,
    pub url: String,
    pub prefix: String,
    /// Digits of the zero-padded index in rig ids.
    pub id_width: usize,
    /// wss: the TLS client; None = plain ws.
    pub tls: Option<TlsClient>,
    /// The hello's `labels` object, serialised once.
    pub labels_json: String,
    pub sources: Vec<Ipv4Addr>,
    pub handshake_timeout: Duration,
    /// The run's `--max-time` bound: no retry is scheduled past it.
    pub deadline: tokio::time::Instant,
    pub ws_config: WebSocketConfig,
    pub counters: Arc<Counters>,
    /// Bounds handshakes in flight (`--concurrency`).
    pub permits: Semaphore,
    /// `--ramp-rate`: when each rig of this worker first connects; None = at once.
    pub ramp: Option<Ramp>,
    /// Signalled when the last rig of this worker reaches its ramp outcome.
    pub settled: Notify,
    /// `--reconnect`: the backoff base after a lost connection; None = a rig ends with its
    /// connection.
    pub reconnect: Option<Duration>,
    /// `--exec-log`: this worker's file.
    pub exec_log: Option<ExecLog>,
    /// `--timeline-bucket` in ms.
    pub timeline_bucket_ms: u64,
    /// `--no-ack`: commands are received and counted, never acked.
    pub no_ack: bool,
}

/// A paced ramp: this worker's rigs start evenly at its share of `--ramp-rate`, from when the
/// worker began.
#[derive(Debug, Clone, Copy)]
pub struct Ramp {
    origin: tokio::time::Instant,
    /// Between one of this worker's rigs and its next.
    every: Duration,
    /// The worker's first rig index.
    start: usize,
}

impl Ramp {
    /// The pacing of the worker of rigs `[start, start + count)` out of `total`, or None when
    /// `rate` is 0 (unpaced).
    pub fn new(rate: f64, total: usize, start: usize, count: usize) -> Option<Ramp> {
        // The worker's share of the rate, so that the processes together start `rate` a second.
        let share = rate * count as f64 / total.max(1) as f64;
        (share > 0.0).then(|| Ramp {
            origin: tokio::time::Instant::now(),
            every: Duration::from_secs_f64((1.0 / share).min(3600.0)),
            start,
        })
    }

    /// When rig `index` of this worker first connects.
    pub fn start_of(&self, index: usize) -> tokio::time::Instant {
        let nth = u32::try_from(index.saturating_sub(self.start)).unwrap_or(u32::MAX);
        self.origin + self.every.saturating_mul(nth)
    }
}

/// `--exec-log`: one line per command run, buffered (flushed by the worker's ticks and at the
/// end of the run).
#[derive(Debug)]
pub struct ExecLog(Mutex<BufWriter<File>>);

impl ExecLog {
    /// Creates (truncates) `path`.
    pub fn create(path: &std::path::Path) -> std::io::Result<ExecLog> {
        Ok(ExecLog(Mutex::new(BufWriter::new(File::create(path)?))))
    }

    fn record(&self, rig: &str, seq: u64, id: &str, name: &str) {
        let mut w = self.0.lock().unwrap_or_else(|e| e.into_inner());
        let _ = writeln!(
            w,
            "rig={rig} seq={seq} id={} name={}",
            token(id),
            token(name)
        );
    }

    pub fn flush(&self) {
        let _ = self.0.lock().unwrap_or_else(|e| e.into_inner()).flush();
    }
}

/// One whitespace-free token per log field (as the agent writes them); empty is `-`.
fn token(s: &str) -> String {
    if s.is_empty() {
        return "-".into();
    }
    s.chars()
        .map(|c| {
            if c.is_whitespace() || c.is_control() {
                '_'
            } else {
                c
            }
        })
        .collect()
}

/// The agent's half of "at-least-once on the wire, once in effect": the highest seq run in
/// this session; anything at or below it is a replay.
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub struct SeqState {
    pub last_seen: u64,
    /// Welcomed with `resumed: false` after having seen commands, and no command since: the
    /// broker lost the session, so the next seq goes on from `last_seen` (fleetlink-fe never
    /// reuses one) or starts a new count at 1 (a broker that numbers afresh). Neither is a gap.
    pub fresh: bool,
}

/// What to do with a command's seq.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SeqVerdict {
    /// Run it (`missing` seqs were skipped before it: the broker lost them).
    Run { missing: u64 },
    /// Already run: ack again, do not run.
    Duplicate,
}

impl SeqState {
    pub fn judge(&mut self, seq: u64) -> SeqVerdict {
        if std::mem::take(&mut self.fresh) && seq == 1 {
            self.last_seen = 1;
            return SeqVerdict::Run { missing: 0 };
        }
        if seq <= self.last_seen {
            return SeqVerdict::Duplicate;
        }
        let missing = seq - self.last_seen - 1;
        self.last_seen = seq;
        SeqVerdict::Run { missing }
    }

    /// The hello's `last_seq`: none before the first command.
    pub fn last_seq(&self) -> Option<u64> {
        (self.last_seen > 0).then_some(self.last_seen)
    }
}

/// How a welcomed connection ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum End {
    /// We were told to stop.
    Stopped,
    /// A goaway asked us back at this instant (`--reconnect`).
    Goaway(tokio::time::Instant),
    /// Closed by the broker, or broken.
    Lost,
}

impl RigEnv {
    /// The client config the brief asks for: we measure the broker's buffers, not ours.
    pub fn small_ws_config() -> WebSocketConfig {
        WebSocketConfig::default()
            .read_buffer_size(4096)
            .write_buffer_size(0)
    }

    fn mark_settled_if_done(&self) {
        if self.counters.ramp_settled() {
            self.settled.notify_one();
        }
    }
}

/// Why an attempt did not end in a welcome.
enum AttemptError {
    /// Contractual back-pressure; try again after the delay.
    Retry {
        after: Duration,
        close_4503: bool,
    },
    Fail(String),
}

/// Decrements the worker's open-socket gauge when the websocket goes away.
struct OpenGuard(Arc<Counters>);

impl OpenGuard {
    fn new(c: &Arc<Counters>) -> Self {
        c.open.fetch_add(1, Relaxed);
        Self(c.clone())
    }
}

impl Drop for OpenGuard {
    fn drop(&mut self) {
        self.0.open.fetch_sub(1, Relaxed);
    }
}

pub fn unix_us() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_micros() as u64)
        .unwrap_or(0)
}

/// Waits until `stop` flips to true (or its sender is gone, which also means stop).
async fn stopped(stop: &mut watch::Receiver<bool>) {
    while !*stop.borrow_and_update() {
        if stop.changed().await.is_err() {
            return;
        }
    }
}

/// Why `welcome` gave up.
enum NoWelcome {
    Stopped,
    Fail(String),
}

/// Runs rig `index` until stopped. Counts its outcome in `env.counters`.
pub async fn run_rig(env: Arc<RigEnv>, index: usize, mut stop: watch::Receiver<bool>) {
    let rig_id = crate::cli::RigsArgs::rig_id(&env.prefix, env.id_width, index);
    let boot_id = uuid7::new_v7();
    let source = (!env.sources.is_empty()).then(|| env.sources[index % env.sources.len()]);
    let c = &env.counters;
    let mut seqs = SeqState::default();
    let mut first = true;
    // Consecutive failed reconnect attempts, and when the last connection ended.
    let mut failures = 0u32;
    let mut ended_at = Instant::now();
    if let Some(ramp) = &env.ramp {
        tokio::select! {
            _ = tokio::time::sleep_until(ramp.start_of(index)) => {}
            _ = stop.changed() => return,
        }
    }
    loop {
        let hello = hello_json(&rig_id, &boot_id, &env.labels_json, seqs.last_seq());
        match welcome(&env, &hello, source, &mut stop).await {
            Ok((ws, guard, resumed)) => {
                failures = 0;
                if first {
                    first = false;
                    c.welcomed.fetch_add(1, Relaxed);
                    env.mark_settled_if_done();
                } else {
                    c.rewelcome(
                        resumed,
                        unix_us() / 1000,
                        env.timeline_bucket_ms,
                        ended_at.elapsed().as_micros() as u64,
                    );
                }
                if !resumed && seqs.last_seen > 0 {
                    c.sessions_restarted.fetch_add(1, Relaxed);
                }
                seqs.fresh = !resumed && seqs.last_seen > 0;
                let end = session(&env, &rig_id, &mut seqs, ws, &mut stop).await;
                drop(guard);
                ended_at = Instant::now();
                let Some(backoff) = env.reconnect else {
                    return;
                };
                let wake = match end {
                    End::Stopped => return,
                    End::Goaway(at) => at,
                    End::Lost => tokio::time::Instant::now() + jitter(backoff, 0),
                };
                if !pause_until(&env, wake, &mut stop).await {
                    return;
                }
            }
            Err(NoWelcome::Stopped) => {
                if first {
                    fail_settle(&env, "stopped_before_welcome");
                }
                return;
            }
            Err(NoWelcome::Fail(reason)) => {
                let Some(backoff) = env.reconnect.filter(|_| !first) else {
                    if first {
                        fail_settle(&env, &reason);
                    }
                    return;
                };
                c.reconnect_fail(&reason);
                failures = failures.saturating_add(1);
                let wake = tokio::time::Instant::now() + jitter(backoff, failures);
                if !pause_until(&env, wake, &mut stop).await {
                    return;
                }
            }
        }
    }
}

/// The hello, with `last_seq` once the session has seen a command.
fn hello_json(rig_id: &str, boot_id: &str, labels_json: &str, last_seq: Option<u64>) -> String {
    let last = last_seq.map_or(String::new(), |k| format!(r#","last_seq":{k}"#));
    format!(
        r#"{{"type":"hello","rig_id":"{rig_id}","boot_id":"{boot_id}","version":"loadgen","labels":{labels_json}{last}}}"#
    )
}

/// uniform(0.5, 1.5) × base × 2^failures, capped at 30 s.
fn jitter(base: Duration, failures: u32) -> Duration {
    let nominal = base
        .saturating_mul(1 << failures.min(10))
        .min(Duration::from_secs(30));
    nominal.mul_f64(0.5 + fastrand::f64())
}

/// Sleeps until `wake`; false if stopped first or `wake` is past the run's bound.
async fn pause_until(
    env: &RigEnv,
    wake: tokio::time::Instant,
    stop: &mut watch::Receiver<bool>,
) -> bool {
    if wake >= env.deadline {
        return false;
    }
    tokio::select! {
        _ = tokio::time::sleep_until(wake) => true,
        _ = stopped(stop) => false,
    }
}

/// Connects until welcomed, retrying what the contract says is retryable (503 Retry-After,
/// close 4503): the welcomed socket, its open-socket guard and `resumed`.
async fn welcome(
    env: &Arc<RigEnv>,
    hello: &str,
    source: Option<Ipv4Addr>,
    stop: &mut watch::Receiver<bool>,
) -> Result<(Ws, OpenGuard, bool), NoWelcome> {
    loop {
        let permit = tokio::select! {
            p = env.permits.acquire() => match p {
                Ok(p) => p,
                Err(_) => return Err(NoWelcome::Fail("internal".into())),
            },
            _ = stopped(stop) => return Err(NoWelcome::Stopped),
        };
        let started = Instant::now();
        let outcome = tokio::select! {
            r = tokio::time::timeout(env.handshake_timeout, attempt(env, hello, source)) => {
                r.unwrap_or_else(|_| Err(AttemptError::Fail("handshake_timeout".into())))
            }
            _ = stopped(stop) => return Err(NoWelcome::Stopped),
        };
        drop(permit);
        match outcome {
            Ok(done) => {
                env.counters
                    .lock()
                    .handshake_us
                    .record(started.elapsed().as_micros() as u64);
                return Ok(done);
            }
            Err(AttemptError::Fail(reason)) => return Err(NoWelcome::Fail(reason)),
            Err(AttemptError::Retry { after, close_4503 }) => {
                let c = &env.counters;
                if close_4503 {
                    &c.retries_4503
                } else {
                    &c.retries_503
                }
                .fetch_add(1, Relaxed);
                let wake = tokio::time::Instant::now() + after;
                if wake >= env.deadline {
                    return Err(NoWelcome::Fail("retry_after_past_max_time".into()));
                }
                tokio::select! {
                    _ = tokio::time::sleep_until(wake) => {}
                    _ = stopped(stop) => return Err(NoWelcome::Stopped),
                }
            }
        }
    }
}

fn fail_settle(env: &RigEnv, reason: &str) {
    env.counters.fail(reason);
    env.mark_settled_if_done();
}

/// Opens a TCP connection from `source` (port chosen at connect time, so a source address is
/// limited by 4-tuples rather than by bind()'s port search).
async fn connect(addr: SocketAddr, source: Option<Ipv4Addr>) -> std::io::Result<TcpStream> {
    let domain = socket2::Domain::for_address(addr);
    let sock = socket2::Socket::new(domain, socket2::Type::STREAM, Some(socket2::Protocol::TCP))?;
    sock.set_nonblocking(true)?;
    sock.set_nodelay(true)?;
    if let Some(ip) = source {
        set_bind_address_no_port(&sock);
        sock.bind(&SocketAddr::new(IpAddr::V4(ip), 0).into())?;
    }
    let stream: std::net::TcpStream = sock.into();
    TcpSocket::from_std_stream(stream).connect(addr).await
}

/// IP_BIND_ADDRESS_NO_PORT: best effort (an error only means bind() picks the port itself).
fn set_bind_address_no_port(sock: &socket2::Socket) {
    let one: libc::c_int = 1;
    // SAFETY: valid fd owned by `sock`, pointer/len describe a live c_int.
    unsafe {
        libc::setsockopt(
            sock.as_raw_fd(),
            libc::IPPROTO_IP,
            libc::IP_BIND_ADDRESS_NO_PORT,
            (&one as *const libc::c_int).cast(),
            std::mem::size_of::<libc::c_int>() as libc::socklen_t,
        );
    }
}

fn io_reason(e: &std::io::Error) -> String {
    use std::io::ErrorKind::*;
    if let Some(tls) = handshake_reason(e) {
        // TLS 1.3: a refused client certificate shows up as an alert on the first read.
        return tls;
    }
    match e.kind() {
        ConnectionRefused => "connect_refused".into(),
        ConnectionReset => "connection_reset".into(),
        AddrInUse | AddrNotAvailable => "no_source_port".into(),
        TimedOut => "connect_timeout".into(),
        UnexpectedEof => "eof".into(),
        _ if e.raw_os_error() == Some(libc::EMFILE) => "too_many_open_files".into(),
        k => format!("io_{k:?}").to_lowercase(),
    }
}

/// Retry-After in whole seconds (the contract's form); missing or odd values mean 5 s.
fn retry_after(headers: &tokio_tungstenite::tungstenite::http::HeaderMap) -> Duration {
    let secs = headers
        .get("retry-after")
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.trim().parse::<u64>().ok())
        .unwrap_or(5);
    Duration::from_secs(secs)
}

fn close_code_text(frame: &Option<CloseFrame>) -> String {
    frame
        .as_ref()
        .map_or_else(|| "none".to_string(), |f| u16::from(f.code).to_string())
}

/// One connect + upgrade + hello + welcome.
async fn attempt(
    env: &Arc<RigEnv>,
    hello: &str,
    source: Option<Ipv4Addr>,
) -> Result<(Ws, OpenGuard, bool), AttemptError> {
    let tcp = connect(env.addr, source)
        .await
        .map_err(|e| AttemptError::Fail(io_reason(&e)))?;
    let stream = match &env.tls {
        None => RigStream::Plain(tcp),
        Some(tls) => {
            let s = tls
                .connector
                .connect(tls.server_name.clone(), tcp)
                .await
                .map_err(|e| AttemptError::Fail(io_reason(&e)))?;
            RigStream::Tls(Box::new(s))
        }
    };
    let req = env
        .url
        .as_str()
        .into_client_request()
        .map_err(|_| AttemptError::Fail("bad_url".into()))?;
    let (mut ws, _) = tokio_tungstenite::client_async_with_config(req, stream, Some(env.ws_config))
        .await
        .map_err(|e| match e {
            WsError::Http(resp) if resp.status().as_u16() == 503 => AttemptError::Retry {
                after: retry_after(resp.headers()),
                close_4503: false,
            },
            WsError::Http(resp) => AttemptError::Fail(format!("http_{}", resp.status().as_u16())),
            WsError::Io(e) => AttemptError::Fail(io_reason(&e)),
            _ => AttemptError::Fail("upgrade_error".into()),
        })?;
    let guard = OpenGuard::new(&env.counters);
    ws.send(Message::text(hello))
        .await
        .map_err(|_| AttemptError::Fail("hello_write_error".into()))?;
    loop {
        match ws.next().await {
            Some(Ok(Message::Text(t))) => {
                let v: Value = serde_json::from_str(&t)
                    .map_err(|_| AttemptError::Fail("bad_json_before_welcome".into()))?;
                if v.get("type").and_then(Value::as_str) == Some("welcome") {
                    let resumed = v.get("resumed").and_then(Value::as_bool) == Some(true);
                    return Ok((ws, guard, resumed));
                }
            }
            Some(Ok(Message::Close(frame))) => {
                env.counters.close_code(&close_code_text(&frame));
                if let Some(f) = frame.as_ref().filter(|f| u16::from(f.code) == 4503) {
                    let secs = f
                        .reason
                        .strip_prefix("retry_after=")
                        .and_then(|s| s.parse::<u64>().ok())
                        .unwrap_or(5);
                    return Err(AttemptError::Retry {
                        after: Duration::from_secs(secs),
                        close_4503: true,
                    });
                }
                return Err(AttemptError::Fail(format!(
                    "closed_{}",
                    close_code_text(&frame)
                )));
            }
            Some(Ok(_)) => {}
            Some(Err(WsError::Io(e))) => return Err(AttemptError::Fail(io_reason(&e))),
            Some(Err(_)) => return Err(AttemptError::Fail("protocol_error_before_welcome".into())),
            None => return Err(AttemptError::Fail("eof_before_welcome".into())),
        }
    }
}

/// After the welcome: ack commands (running each seq once), note their latency, until the
/// broker closes, we stop, or (with `--reconnect`) a goaway's instant comes.
async fn session(
    env: &RigEnv,
    rig_id: &str,
    seqs: &mut SeqState,
    mut ws: Ws,
    stop: &mut watch::Receiver<bool>,
) -> End {
    let c = &env.counters;
    let mut goaway_at: Option<tokio::time::Instant> = None;
    let lost = |goaway_at: Option<tokio::time::Instant>| goaway_at.map_or(End::Lost, End::Goaway);
    loop {
        tokio::select! {
            msg = ws.next() => match msg {
                Some(Ok(Message::Text(t))) => match on_text(env, rig_id, seqs, &mut ws, &t).await {
                    Ok(Some(after_ms)) if env.reconnect.is_some() => {
                        goaway_at.get_or_insert(
                            tokio::time::Instant::now() + Duration::from_millis(after_ms),
                        );
                    }
                    Ok(_) => {}
                    Err(reason) => {
                        c.dropped.fetch_add(1, Relaxed);
                        c.close_code(reason);
                        return lost(goaway_at);
                    }
                },
                Some(Ok(Message::Close(frame))) => {
                    c.dropped.fetch_add(1, Relaxed);
                    c.close_code(&close_code_text(&frame));
                    // Let tungstenite write its close reply, briefly.
                    let _ = tokio::time::timeout(Duration::from_secs(2), ws.next()).await;
                    return lost(goaway_at);
                }
                Some(Ok(_)) => {} // pings are answered by tungstenite on the next read/write
                Some(Err(_)) | None => {
                    c.dropped.fetch_add(1, Relaxed);
                    c.close_code("abnormal");
                    return lost(goaway_at);
                }
            },
            _ = async { tokio::time::sleep_until(goaway_at.unwrap_or_else(tokio::time::Instant::now)).await }, if goaway_at.is_some() => {
                close(&mut ws, "goaway").await;
                return lost(goaway_at);
            }
            _ = stopped(stop) => {
                close(&mut ws, "loadgen done").await;
                return End::Stopped;
            }
        }
    }
}

/// Closes with 1000 and waits (briefly) for the broker's close.
async fn close(ws: &mut Ws, reason: &str) {
    let frame = CloseFrame {
        code: CloseCode::Normal,
        reason: reason.to_string().into(),
    };
    let _ = tokio::time::timeout(Duration::from_secs(2), async {
        ws.close(Some(frame)).await?;
        while ws.next().await.is_some() {}
        Ok::<_, WsError>(())
    })
    .await;
}

/// Handles one text message of a live session; `Ok(Some(ms))` = a goaway asking to come back
/// in `ms`; `Err` = the connection is unusable.
async fn on_text(
    env: &RigEnv,
    rig_id: &str,
    seqs: &mut SeqState,
    ws: &mut Ws,
    text: &str,
) -> Result<Option<u64>, &'static str> {
    let c = &env.counters;
    let Ok(v) = serde_json::from_str::<Value>(text) else {
        return Ok(None); // not ours to judge; the broker's conformance is tested elsewhere
    };
    match v.get("type").and_then(Value::as_str) {
        Some("command") => {
            let now = unix_us();
            let sent = v
                .get("args")
                .and_then(|a| a.get("sent_at_us"))
                .and_then(Value::as_u64);
            c.command(now, sent);
            if let Some(seq) = v.get("seq").and_then(Value::as_u64) {
                match seqs.judge(seq) {
                    SeqVerdict::Duplicate => {
                        c.duplicates.fetch_add(1, Relaxed);
                    }
                    SeqVerdict::Run { missing } => {
                        if missing > 0 {
                            c.seq_gaps.fetch_add(1, Relaxed);
                            c.seqs_missing.fetch_add(missing, Relaxed);
                        }
                        c.executed.fetch_add(1, Relaxed);
                        if let Some(log) = &env.exec_log {
                            let s = |k: &str| v.get(k).and_then(Value::as_str).unwrap_or_default();
                            log.record(rig_id, seq, s("id"), s("name"));
                        }
                    }
                }
                if !env.no_ack {
                    ws.send(Message::text(format!(r#"{{"type":"ack","seq":{seq}}}"#)))
                        .await
                        .map_err(|_| "ack_write_error")?;
                    c.acks.fetch_add(1, Relaxed);
                }
            }
        }
        Some("goaway") => {
            c.goaways.fetch_add(1, Relaxed);
            let after = v
                .get("reconnect_after_ms")
                .and_then(Value::as_u64)
                .unwrap_or(0);
            c.lock().goaway_delay_ms.record(after);
            return Ok(Some(after));
        }
        _ => {}
    }
    Ok(None)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Each worker takes its share of the rate; its rigs start evenly from its origin.
    #[tokio::test]
    async fn a_ramp_spreads_each_workers_share_of_the_rate() {
        assert!(Ramp::new(0.0, 100, 0, 50).is_none());
        // 100 a second over 100 rigs, this worker holding 25 of them (indices 50..75): 25 a
        // second, 40 ms apart.
        let r = Ramp::new(100.0, 100, 50, 25).unwrap();
        assert_eq!(r.start_of(50), r.origin);
        assert_eq!(r.start_of(51) - r.origin, Duration::from_millis(40));
        assert_eq!(r.start_of(74) - r.origin, Duration::from_millis(960));
        // A rate too low to matter is capped, not infinite.
        let slow = Ramp::new(1e-12, 1, 0, 1).unwrap();
        assert_eq!(slow.every, Duration::from_secs(3600));
    }

    #[test]
    fn seqs_run_once_and_gaps_are_counted() {
        let mut s = SeqState::default();
        assert_eq!(s.last_seq(), None);
        assert_eq!(s.judge(1), SeqVerdict::Run { missing: 0 });
        assert_eq!(s.judge(2), SeqVerdict::Run { missing: 0 });
        assert_eq!(s.judge(2), SeqVerdict::Duplicate);
        assert_eq!(s.judge(1), SeqVerdict::Duplicate);
        assert_eq!(s.judge(5), SeqVerdict::Run { missing: 2 });
        assert_eq!(s.last_seq(), Some(5));
        assert_eq!(SeqState::default().judge(0), SeqVerdict::Duplicate);
    }

    #[test]
    fn a_lost_session_may_go_on_or_count_from_one_without_a_gap() {
        let on = |first| {
            let mut s = SeqState {
                last_seen: 4,
                fresh: true,
            };
            (s.judge(first), s.judge(first + 1))
        };
        let run = SeqVerdict::Run { missing: 0 };
        assert_eq!(on(5), (run, run), "numbering goes on above last_seq");
        assert_eq!(on(1), (run, run), "a new count from 1");
        let mut s = SeqState {
            last_seen: 4,
            fresh: true,
        };
        assert_eq!(
            s.judge(7),
            SeqVerdict::Run { missing: 2 },
            "a real gap still counts"
        );
    }

    #[test]
    fn hello_carries_last_seq_once_known() {
        let h: Value = serde_json::from_str(&hello_json("r-1", "b", "{}", None)).unwrap();
        assert!(h.get("last_seq").is_none());
        assert_eq!(h["rig_id"], "r-1");
        let h: Value =
            serde_json::from_str(&hello_json("r-1", "b", r#"{"g":"x"}"#, Some(7))).unwrap();
        assert_eq!(h["last_seq"], 7);
        assert_eq!(h["labels"]["g"], "x");
    }

    #[test]
    fn reconnect_backoff_is_jittered_and_capped() {
        for _ in 0..100 {
            let d = jitter(Duration::from_secs(1), 0);
            assert!(d >= Duration::from_millis(500) && d <= Duration::from_millis(1500));
            let d = jitter(Duration::from_secs(1), 20);
            assert!(d >= Duration::from_secs(15) && d <= Duration::from_secs(45));
        }
        assert_eq!(token("a b"), "a_b");
        assert_eq!(token(""), "-");
    }

    #[test]
    fn retry_after_parsing() {
        let mut h = tokio_tungstenite::tungstenite::http::HeaderMap::new();
        assert_eq!(retry_after(&h), Duration::from_secs(5));
        h.insert("Retry-After", "12".parse().unwrap());
        assert_eq!(retry_after(&h), Duration::from_secs(12));
    }
}
