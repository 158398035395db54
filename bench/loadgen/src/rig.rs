//! One simulated rig: connect from its source address, upgrade, hello, wait for welcome, then ack
//! every command until told to stop. Retries only what the contract says is retryable (503 with
//! Retry-After, close 4503 `retry_after=<s>`); everything else is a counted failure, because the
//! load generator measures the broker and must not hide its refusals behind reconnect loops.

use std::net::{IpAddr, Ipv4Addr, SocketAddr};
use std::os::fd::AsRawFd;
use std::sync::atomic::Ordering::Relaxed;
use std::sync::Arc;
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
    /// Signalled when the last rig of this worker reaches its ramp outcome.
    pub settled: Notify,
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

/// Runs rig `index` until stopped. Counts its outcome in `env.counters`.
pub async fn run_rig(env: Arc<RigEnv>, index: usize, mut stop: watch::Receiver<bool>) {
    let rig_id = crate::cli::RigsArgs::rig_id(&env.prefix, env.id_width, index);
    let boot_id = uuid7::new_v7();
    let source = (!env.sources.is_empty()).then(|| env.sources[index % env.sources.len()]);
    let hello = format!(
        r#"{{"type":"hello","rig_id":"{rig_id}","boot_id":"{boot_id}","version":"loadgen","labels":{}}}"#,
        env.labels_json
    );

    let (ws, guard) = loop {
        let permit = tokio::select! {
            p = env.permits.acquire() => match p {
                Ok(p) => p,
                Err(_) => return env.counters.fail("internal"),
            },
            _ = stopped(&mut stop) => return fail_settle(&env, "stopped_before_welcome"),
        };
        let started = Instant::now();
        let outcome = tokio::select! {
            r = tokio::time::timeout(env.handshake_timeout, attempt(&env, &hello, source)) => {
                r.unwrap_or_else(|_| Err(AttemptError::Fail("handshake_timeout".into())))
            }
            _ = stopped(&mut stop) => return fail_settle(&env, "stopped_before_welcome"),
        };
        drop(permit);
        match outcome {
            Ok(done) => {
                env.counters
                    .lock()
                    .handshake_us
                    .record(started.elapsed().as_micros() as u64);
                break done;
            }
            Err(AttemptError::Fail(reason)) => return fail_settle(&env, &reason),
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
                    return fail_settle(&env, "retry_after_past_max_time");
                }
                tokio::select! {
                    _ = tokio::time::sleep_until(wake) => {}
                    _ = stopped(&mut stop) => return fail_settle(&env, "stopped_before_welcome"),
                }
            }
        }
    };
    env.counters.welcomed.fetch_add(1, Relaxed);
    env.mark_settled_if_done();
    session(&env, ws, &mut stop).await;
    drop(guard);
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
) -> Result<(Ws, OpenGuard), AttemptError> {
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
                    return Ok((ws, guard));
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

/// After the welcome: ack commands, note their latency, until the broker closes or we stop.
async fn session(env: &RigEnv, mut ws: Ws, stop: &mut watch::Receiver<bool>) {
    let c = &env.counters;
    loop {
        tokio::select! {
            msg = ws.next() => match msg {
                Some(Ok(Message::Text(t))) => {
                    if let Err(reason) = on_text(c, &mut ws, &t).await {
                        c.dropped.fetch_add(1, Relaxed);
                        c.close_code(reason);
                        return;
                    }
                }
                Some(Ok(Message::Close(frame))) => {
                    c.dropped.fetch_add(1, Relaxed);
                    c.close_code(&close_code_text(&frame));
                    // Let tungstenite write its close reply, briefly.
                    let _ = tokio::time::timeout(Duration::from_secs(2), ws.next()).await;
                    return;
                }
                Some(Ok(_)) => {} // pings are answered by tungstenite on the next read/write
                Some(Err(_)) | None => {
                    c.dropped.fetch_add(1, Relaxed);
                    c.close_code("abnormal");
                    return;
                }
            },
            _ = stopped(stop) => {
                let frame = CloseFrame { code: CloseCode::Normal, reason: "loadgen done".into() };
                let _ = tokio::time::timeout(Duration::from_secs(2), async {
                    ws.close(Some(frame)).await?;
                    while ws.next().await.is_some() {}
                    Ok::<_, WsError>(())
                })
                .await;
                return;
            }
        }
    }
}

/// Handles one text message of a live session; `Err` = the connection is unusable.
async fn on_text(c: &Counters, ws: &mut Ws, text: &str) -> Result<(), &'static str> {
    let Ok(v) = serde_json::from_str::<Value>(text) else {
        return Ok(()); // not ours to judge; the broker's conformance is tested elsewhere
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
                ws.send(Message::text(format!(r#"{{"type":"ack","seq":{seq}}}"#)))
                    .await
                    .map_err(|_| "ack_write_error")?;
                c.acks.fetch_add(1, Relaxed);
            }
        }
        Some("goaway") => {
            c.goaways.fetch_add(1, Relaxed);
        }
        _ => {}
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn retry_after_parsing() {
        let mut h = tokio_tungstenite::tungstenite::http::HeaderMap::new();
        assert_eq!(retry_after(&h), Duration::from_secs(5));
        h.insert("Retry-After", "12".parse().unwrap());
        assert_eq!(retry_after(&h), Duration::from_secs(12));
    }
}
