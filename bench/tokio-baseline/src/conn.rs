//! The rig endpoint: accept loop and one task per connection. The task owns the websocket and
//! is its only writer; it `select!`s over inbound frames, its outbox, registry close requests and
//! the ping timer. This is the straightforward tokio design the thread-per-core broker is
//! compared against. With `--tls-cert` the TLS handshake (tokio-rustls) comes first, then the
//! same websocket code runs over the TLS stream; the plain path is the same code on `TcpStream`.

use std::collections::VecDeque;
use std::net::SocketAddr;
use std::sync::atomic::Ordering::Relaxed;
use std::sync::Arc;
use std::time::Duration;

use futures_util::{SinkExt, StreamExt};
use serde_json::{json, Value};
use tokio::io::{AsyncRead, AsyncWrite};
use tokio::net::{TcpListener, TcpSocket, TcpStream};
use tokio::time::{sleep_until, timeout, Instant};
use tokio_tungstenite::tungstenite::handshake::server::{
    Callback, ErrorResponse, Request, Response,
};
use tokio_tungstenite::tungstenite::http::StatusCode;
use tokio_tungstenite::tungstenite::protocol::frame::coding::CloseCode;
use tokio_tungstenite::tungstenite::protocol::CloseFrame;
use tokio_tungstenite::tungstenite::{Bytes, Error as WsError, Message};
use tokio_tungstenite::WebSocketStream;

use crate::hello::{parse_hello, Hello};
use crate::redis_mode::{broker_channel, Fleet, HelloOutcome};
use crate::registry::{unix_ms, RegisterError, RigConn};
use crate::App;

type Ws<S> = WebSocketStream<S>;

pub const CLOSE_PING_TIMEOUT: u16 = 4002;
pub const CLOSE_BAD_HELLO: u16 = 4400;
pub const CLOSE_HELLO_TIMEOUT: u16 = 4408;
pub const CLOSE_OLDER_BOOT: u16 = 4409;
/// Redis mode: the registry could not take the hello now.
pub const CLOSE_OVER_CAPACITY: u16 = 4503;
/// Ids of written commands kept for `ack` events; older ones are forgotten (the event then
/// carries `"id": null`, as fe's does for a command it no longer knows).
const WRITTEN_IDS: usize = 1024;
/// Recorded when the peer vanished without a close frame.
const CLOSE_ABNORMAL: u16 = 1006;
/// How long we wait for the peer's close reply before dropping the socket.
const CLOSE_LINGER: Duration = Duration::from_secs(2);

/// Binds the rig listener with an explicit backlog: the default overflows in accept storms.
pub fn bind(addr: SocketAddr, backlog: u32) -> std::io::Result<TcpListener> {
    let sock = if addr.is_ipv4() {
        TcpSocket::new_v4()?
    } else {
        TcpSocket::new_v6()?
    };
    sock.set_reuseaddr(true)?;
    sock.bind(addr)?;
    sock.listen(backlog)
}

pub async fn accept_loop(listener: TcpListener, app: Arc<App>) {
    loop {
        match listener.accept().await {
            // Separate tasks, so the plain path's task is exactly what it was before TLS.
            Ok((stream, _)) => match app.tls.clone() {
                None => {
                    let _ = stream.set_nodelay(true);
                    tokio::spawn(serve(stream, app.clone()));
                }
                Some(acceptor) => {
                    tokio::spawn(handle_tls(stream, acceptor, app.clone()));
                }
            },
            Err(e) => {
                // EMFILE and friends: back off instead of spinning on a full fd table.
                eprintln!("accept: {e}");
                tokio::time::sleep(Duration::from_millis(50)).await;
            }
        }
    }
}

/// Serves `/agent` only; every other path gets a 404 instead of an upgrade.
struct AgentPath;

impl Callback for AgentPath {
    fn on_request(self, req: &Request, resp: Response) -> Result<Response, ErrorResponse> {
        if req.uri().path() == "/agent" {
            return Ok(resp);
        }
        let mut e = ErrorResponse::new(Some("not found".into()));
        *e.status_mut() = StatusCode::NOT_FOUND;
        Err(e)
    }
}

/// How a welcomed connection ended, for the `disconnected` event.
type Ended = (u16, String);

/// The peer vanished without a close frame (or a write failed).
fn abnormal(app: &App) -> Ended {
    app.metrics.closed(CLOSE_ABNORMAL);
    (CLOSE_ABNORMAL, "connection lost".into())
}

async fn close<S>(app: &App, ws: &mut Ws<S>, code: u16, reason: &str) -> Ended
where
    S: AsyncRead + AsyncWrite + Unpin,
{
    app.metrics.closed(code);
    let frame = CloseFrame {
        code: CloseCode::from(code),
        reason: reason.to_string().into(),
    };
    let _ = timeout(CLOSE_LINGER, async {
        ws.close(Some(frame)).await?;
        while ws.next().await.is_some() {}
        Ok::<_, WsError>(())
    })
    .await;
    (code, reason.to_string())
}

/// wss: the TLS handshake (bounded by the hello timeout), then the websocket as on plain TCP.
async fn handle_tls(stream: TcpStream, acceptor: tokio_rustls::TlsAcceptor, app: Arc<App>) {
    let _ = stream.set_nodelay(true);
    match timeout(app.cfg.hello_timeout, acceptor.accept(stream)).await {
        Ok(Ok(tls)) => serve(tls, app).await,
        Ok(Err(_)) => {
            app.metrics.accepts_tls_error.fetch_add(1, Relaxed);
        }
        Err(_) => {
            app.metrics.accepts_handshake_timeout.fetch_add(1, Relaxed);
        }
    }
}

/// Upgrade, hello, session: over a TCP stream or a TLS stream.
async fn serve<S>(stream: S, app: Arc<App>)
where
    S: AsyncRead + AsyncWrite + Unpin,
{
    let hello_timeout = app.cfg.hello_timeout;
    let mut ws = match timeout(
        hello_timeout,
        tokio_tungstenite::accept_hdr_async_with_config(stream, AgentPath, Some(app.ws_config)),
    )
    .await
    {
        Ok(Ok(ws)) => ws,
        Ok(Err(_)) => {
            app.metrics.accepts_handshake_error.fetch_add(1, Relaxed);
            return;
        }
        Err(_) => {
            app.metrics.accepts_handshake_timeout.fetch_add(1, Relaxed);
            return;
        }
    };
    app.metrics.accepts_ok.fetch_add(1, Relaxed);

    let hello = match timeout(hello_timeout, ws.next()).await {
        Err(_) => {
            close(&app, &mut ws, CLOSE_HELLO_TIMEOUT, "no hello").await;
            return;
        }
        Ok(Some(Ok(Message::Text(t)))) => match parse_hello(&t) {
            Ok(h) => h,
            Err(reason) => {
                app.metrics.hellos_rejected.fetch_add(1, Relaxed);
                close(&app, &mut ws, CLOSE_BAD_HELLO, reason).await;
                return;
            }
        },
        Ok(Some(Ok(Message::Close(_)))) | Ok(None) | Ok(Some(Err(_))) => return,
        Ok(Some(Ok(_))) => {
            app.metrics.hellos_rejected.fetch_add(1, Relaxed);
            close(
                &app,
                &mut ws,
                CLOSE_BAD_HELLO,
                "first message must be a hello",
            )
            .await;
            return;
        }
    };

    let conn_id = app.next_conn_id.fetch_add(1, Relaxed);
    let Hello {
        rig_id,
        boot_id,
        labels,
        v,
        ..
    } = hello;
    let conn = Arc::new(RigConn::new(conn_id, rig_id, boot_id, labels));
    if let Some(fleet) = &app.fleet {
        if let Err((code, reason)) = claim(&app, fleet, &conn).await {
            close(&app, &mut ws, code, reason).await;
            return;
        }
    }
    let outbox = match app.registry.register(conn.clone()) {
        Ok(rx) => rx,
        Err(RegisterError::OlderBootId) => {
            if let Some(fleet) = &app.fleet {
                // hello.lua let this boot in while a newer one is live here (the key had
                // expired or Redis restarted empty): hand the key back, so the next refresh
                // restores the live session's tuple instead of superseding it.
                let _ = fleet.release(&conn.rig_id, &conn.boot_id).await;
            }
            close(
                &app,
                &mut ws,
                CLOSE_OLDER_BOOT,
                "a newer boot_id owns this rig",
            )
            .await;
            return;
        }
    };
    app.metrics.connections.fetch_add(1, Relaxed);
    let (code, reason) = session(&app, &mut ws, &conn, outbox, v).await;
    let owned = app.registry.unregister(&conn);
    app.metrics.connections.fetch_sub(1, Relaxed);
    if let Some(fleet) = &app.fleet {
        // Only the owner releases: a superseded connection's tuple is no longer in Redis, and
        // a same-boot reconnect here has the very same tuple, which must stay.
        if owned {
            let m = &app.metrics.redis;
            match fleet.release(&conn.rig_id, &conn.boot_id).await {
                Ok(()) => m.release_ok.fetch_add(1, Relaxed),
                Err(_) => m.release_error.fetch_add(1, Relaxed),
            };
        }
        let ev = json!({"type": "disconnected", "rig_id": conn.rig_id, "boot_id": conn.boot_id,
                        "code": code, "reason": reason});
        fleet.event(&app.metrics.redis, ev);
    }
}

/// Redis mode: hello.lua claims the rig for this boot here, and the broker that held it (if
/// another) is told to evict its stale socket. Err = close with this code and reason.
async fn claim(app: &App, fleet: &Fleet, conn: &RigConn) -> Result<(), (u16, &'static str)> {
    let m = &app.metrics.redis;
    match fleet.hello(&conn.rig_id, &conn.boot_id).await {
        Ok(HelloOutcome::Older) => {
            m.hello_older.fetch_add(1, Relaxed);
            Err((CLOSE_OLDER_BOOT, "a newer boot_id owns this rig"))
        }
        Ok(HelloOutcome::Owned { evict }) => {
            m.hello_ok.fetch_add(1, Relaxed);
            if let Some(broker) = evict {
                m.evict_sent.fetch_add(1, Relaxed);
                let ev = json!({"type": "evict", "rig_id": conn.rig_id, "boot_id": conn.boot_id});
                fleet.publish(broker_channel(&broker), &ev).await;
            }
            Ok(())
        }
        Err(_) => {
            m.hello_unavailable.fetch_add(1, Relaxed);
            Err((CLOSE_OVER_CAPACITY, "retry_after=5"))
        }
    }
}

/// Liveness state: a ping every interval; a pong must follow each within the timeout. One
/// deadline per unanswered ping: with a timeout longer than the interval, several are out at
/// once, and each counts its own miss (as fleetlink-fe does), not one per timeout.
struct Liveness {
    next_ping: Instant,
    pong_deadlines: VecDeque<Instant>,
    missed: u32,
}

async fn session<S>(
    app: &App,
    ws: &mut Ws<S>,
    conn: &RigConn,
    mut outbox: tokio::sync::mpsc::Receiver<crate::registry::Outgoing>,
    v: u64,
) -> Ended
where
    S: AsyncRead + AsyncWrite + Unpin,
{
    let mut welcome = json!({
        "type": "welcome",
        "broker_id": app.broker_id,
        "rig_id": conn.rig_id,
        "ping_interval_ms": app.cfg.ping_interval.as_millis() as u64,
        "resumed": false,
    });
    if v != 1 {
        welcome["v"] = v.into();
    }
    if ws.send(Message::text(welcome.to_string())).await.is_err() {
        return abnormal(app);
    }
    // Redis mode: the ids of written commands, so `ack` events can name them.
    let mut written = app.fleet.as_ref().map(|f| {
        let ev = json!({"type": "connected", "rig_id": conn.rig_id, "boot_id": conn.boot_id,
                        "resumed": false});
        f.event(&app.metrics.redis, ev);
        VecDeque::new()
    });
    let cfg = &app.cfg;
    let mut live = Liveness {
        next_ping: Instant::now() + cfg.ping_interval,
        pong_deadlines: VecDeque::new(),
        missed: 0,
    };

    loop {
        let wake = live
            .pong_deadlines
            .front()
            .map_or(live.next_ping, |d| (*d).min(live.next_ping));
        tokio::select! {
            msg = ws.next() => match msg {
                Some(Ok(Message::Text(t))) => on_text(app, conn, &t, written.as_mut()),
                Some(Ok(Message::Pong(_))) => {
                    live.pong_deadlines.clear();
                    live.missed = 0;
                }
                Some(Ok(Message::Close(frame))) => {
                    let (code, reason) = frame.map_or((1005, String::new()), |f| (u16::from(f.code), f.reason.to_string()));
                    app.metrics.closed(code);
                    let _ = timeout(CLOSE_LINGER, ws.flush()).await; // our close reply
                    return (code, reason);
                }
                Some(Ok(_)) => {} // binary: ignored; pings are answered by tungstenite
                Some(Err(WsError::Capacity(_))) => return close(app, ws, 1009, "message too big").await,
                Some(Err(WsError::Utf8(_))) => return close(app, ws, 1007, "invalid utf-8").await,
                Some(Err(WsError::Protocol(_))) => return close(app, ws, 1002, "protocol error").await,
                Some(Err(_)) | None => return abnormal(app),
            },
            out = outbox.recv() => {
                // The sender lives in the registry until we unregister or another owner
                // supersedes us (Redis mode), which also asks us to close with 4410.
                let Some(out) = out else { return close(app, ws, crate::registry::CLOSE_SUPERSEDED, "superseded").await };
                // --session-ttl: wait until Redis has it; a fenced command is not written. A
                // keeper that went away without answering leaves it to be written unkept.
                if let Some(kept) = out.kept {
                    if !kept.await.unwrap_or(true) {
                        continue;
                    }
                }
                if ws.send(Message::text(out.text)).await.is_err() {
                    return abnormal(app);
                }
                conn.written_seq.store(out.seq, Relaxed);
                if let Some(w) = written.as_mut() {
                    if w.len() == WRITTEN_IDS {
                        w.pop_front();
                    }
                    w.push_back((out.seq, out.id));
                }
            }
            _ = conn.close.notified() => {
                let code = conn.close_code.load(Relaxed);
                let reason = if code == crate::registry::CLOSE_KICKED { "kicked" } else { "superseded" };
                return close(app, ws, code, reason).await;
            }
            _ = sleep_until(wake) => {
                let now = Instant::now();
                while live.pong_deadlines.front().is_some_and(|d| now >= *d) {
                    live.pong_deadlines.pop_front();
                    live.missed += 1;
                    if live.missed >= cfg.max_missed_pongs {
                        return close(app, ws, CLOSE_PING_TIMEOUT, "ping timeout").await;
                    }
                }
                if now >= live.next_ping {
                    if ws.send(Message::Ping(Bytes::new())).await.is_err() {
                        return abnormal(app);
                    }
                    live.next_ping = now + cfg.ping_interval;
                    live.pong_deadlines.push_back(now + cfg.pong_timeout);
                }
            }
        }
    }
}

/// A rig message after the hello: acks are recorded; results/events counted (and in Redis
/// mode published on `fleetlink:events`); the rest ignored.
fn on_text(app: &App, conn: &RigConn, text: &str, written: Option<&mut VecDeque<(u64, String)>>) {
    let m = &app.metrics;
    let Ok(v) = serde_json::from_str::<Value>(text) else {
        m.unknown_messages.fetch_add(1, Relaxed);
        return;
    };
    let fleet = app.fleet.as_ref();
    match v.get("type").and_then(Value::as_str) {
        Some("ack") => {
            if let Some(seq) = v.get("seq").and_then(Value::as_u64) {
                conn.last_ack_seq.fetch_max(seq, Relaxed);
                conn.last_ack_at_ms.store(unix_ms(), Relaxed);
                m.acks.fetch_add(1, Relaxed);
                if let (Some(f), Some(w)) = (fleet, written) {
                    while w.front().is_some_and(|&(s, _)| s < seq) {
                        w.pop_front();
                    }
                    let id = w
                        .front()
                        .filter(|(s, _)| *s == seq)
                        .map(|(_, id)| id.as_str());
                    let ev = json!({"type": "ack", "rig_id": conn.rig_id, "seq": seq, "id": id});
                    f.event(&m.redis, ev);
                    f.forget(&m.redis, &conn.rig_id, &conn.boot_id, seq);
                }
            }
        }
        Some("result") => {
            m.results.fetch_add(1, Relaxed);
            if let Some(f) = fleet {
                let ev = json!({"type": "result", "rig_id": conn.rig_id, "seq": v.get("seq"),
                                "ok": v.get("ok"), "output": v.get("output")});
                f.event(&m.redis, ev);
            }
        }
        Some("event") => {
            m.events.fetch_add(1, Relaxed);
            if let Some(f) = fleet {
                let ev = json!({"type": "event", "rig_id": conn.rig_id, "name": v.get("name"),
                                "data": v.get("data")});
                f.event(&m.redis, ev);
            }
        }
        _ => {
            m.unknown_messages.fetch_add(1, Relaxed);
        }
    }
}
