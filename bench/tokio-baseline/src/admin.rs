//! Admin HTTP (plain HTTP/1.1 with keep-alive, parsed with httparse): health, metrics, the rig
//! list and the standalone control plane (`POST /v1/rigs/{id}/commands`, `/kick`).
//! Hand-rolled to keep the baseline's dependency set small; it only has to be correct for the
//! few routes below and robust against bad input.

use std::sync::atomic::Ordering::Relaxed;
use std::sync::Arc;

use serde_json::{json, Value};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};

use crate::registry::EnqueueError;
use crate::App;

const MAX_HEAD: usize = 8 * 1024;
const MAX_BODY: usize = 64 * 1024;

pub async fn serve(listener: TcpListener, app: Arc<App>) {
    loop {
        match listener.accept().await {
            Ok((s, _)) => {
                tokio::spawn(connection(s, app.clone()));
            }
            Err(e) => {
                eprintln!("admin accept: {e}");
                tokio::time::sleep(std::time::Duration::from_millis(50)).await;
            }
        }
    }
}

/// One parsed request head, owned (the read buffer is reused).
struct Head {
    method: String,
    path: String,
    content_length: usize,
    head_len: usize,
    close: bool,
}

enum Parsed {
    Complete(Head),
    Partial,
    Invalid,
}

fn parse_head(buf: &[u8]) -> Parsed {
    let mut headers = [httparse::EMPTY_HEADER; 32];
    let mut req = httparse::Request::new(&mut headers);
    match req.parse(buf) {
        Ok(httparse::Status::Complete(head_len)) => {
            let mut content_length = 0;
            let mut close = req.version == Some(0);
            for h in req.headers.iter() {
                if h.name.eq_ignore_ascii_case("content-length") {
                    match std::str::from_utf8(h.value)
                        .ok()
                        .and_then(|v| v.trim().parse().ok())
                    {
                        Some(n) => content_length = n,
                        None => return Parsed::Invalid,
                    }
                } else if h.name.eq_ignore_ascii_case("connection") {
                    close = h.value.eq_ignore_ascii_case(b"close");
                } else if h.name.eq_ignore_ascii_case("transfer-encoding") {
                    return Parsed::Invalid; // chunked bodies are not needed by any client here
                }
            }
            Parsed::Complete(Head {
                method: req.method.unwrap_or_default().to_string(),
                path: req.path.unwrap_or_default().to_string(),
                content_length,
                head_len,
                close,
            })
        }
        Ok(httparse::Status::Partial) => Parsed::Partial,
        Err(_) => Parsed::Invalid,
    }
}

/// An HTTP reply.
pub struct Reply {
    pub status: u16,
    pub content_type: &'static str,
    pub body: String,
}

impl Reply {
    fn json(status: u16, v: Value) -> Self {
        Self {
            status,
            content_type: "application/json",
            body: v.to_string() + "\n",
        }
    }

    fn text(status: u16, body: impl Into<String>) -> Self {
        Self {
            status,
            content_type: "text/plain; charset=utf-8",
            body: body.into(),
        }
    }
}

fn reason(status: u16) -> &'static str {
    match status {
        200 => "OK",
        400 => "Bad Request",
        404 => "Not Found",
        405 => "Method Not Allowed",
        413 => "Payload Too Large",
        431 => "Request Header Fields Too Large",
        503 => "Service Unavailable",
        _ => "Unknown",
    }
}

async fn write_reply(s: &mut TcpStream, r: &Reply, close: bool) -> std::io::Result<()> {
    let head = format!(
        "HTTP/1.1 {} {}\r\nContent-Type: {}\r\nContent-Length: {}\r\n{}\r\n",
        r.status,
        reason(r.status),
        r.content_type,
        r.body.len(),
        if close { "Connection: close\r\n" } else { "" }
    );
    s.write_all(&[head.as_bytes(), r.body.as_bytes()].concat())
        .await
}

async fn connection(mut s: TcpStream, app: Arc<App>) {
    let _ = s.set_nodelay(true);
    let mut buf = Vec::with_capacity(1024);
    let mut chunk = [0u8; 4096];
    loop {
        let head = loop {
            match parse_head(&buf) {
                Parsed::Complete(h) => break h,
                Parsed::Invalid => {
                    let _ = write_reply(&mut s, &Reply::text(400, "bad request\n"), true).await;
                    return;
                }
                Parsed::Partial if buf.len() > MAX_HEAD => {
                    let _ = write_reply(&mut s, &Reply::text(431, "head too large\n"), true).await;
                    return;
                }
                Parsed::Partial => match s.read(&mut chunk).await {
                    Ok(0) | Err(_) => return,
                    Ok(n) => buf.extend_from_slice(&chunk[..n]),
                },
            }
        };
        if head.content_length > MAX_BODY {
            let _ = write_reply(&mut s, &Reply::text(413, "body too large\n"), true).await;
            return;
        }
        let end = head.head_len + head.content_length;
        while buf.len() < end {
            match s.read(&mut chunk).await {
                Ok(0) | Err(_) => return,
                Ok(n) => buf.extend_from_slice(&chunk[..n]),
            }
        }
        let reply = route(&app, &head.method, &head.path, &buf[head.head_len..end]);
        if write_reply(&mut s, &reply, head.close).await.is_err() || head.close {
            return;
        }
        buf.drain(..end);
    }
}

/// Dispatches one request.
pub fn route(app: &App, method: &str, path: &str, body: &[u8]) -> Reply {
    let path = path.split('?').next().unwrap_or_default();
    let segs: Vec<&str> = path.trim_matches('/').split('/').collect();
    match (method, segs.as_slice()) {
        ("GET", ["healthz"]) => Reply::text(200, "ok\n"),
        // Standalone mode has nothing to warm up; there is no drain in the baseline. Redis mode
        // is ready while its own canary keeps coming back through the subscription.
        ("GET", ["readyz"]) => match app.fleet.as_ref().and_then(|f| f.not_ready()) {
            Some(why) => Reply::text(503, why + "\n"),
            None => Reply::text(200, "ready\n"),
        },
        ("GET", ["metrics"]) => Reply {
            status: 200,
            content_type: "text/plain; version=0.0.4",
            body: app.metrics.render(),
        },
        ("GET", ["v1", "rigs"]) => Reply::json(200, Value::Array(app.registry.list())),
        ("POST", ["v1", "rigs", rig_id, "commands"]) => command(app, rig_id, body),
        ("POST", ["v1", "rigs", rig_id, "kick"]) => {
            if app.registry.kick(rig_id) {
                Reply::json(200, json!({"ok": true, "rig_id": rig_id}))
            } else {
                Reply::json(
                    404,
                    json!({"ok": false, "error": "rig_not_connected", "rig_id": rig_id}),
                )
            }
        }
        (_, ["healthz" | "readyz" | "metrics"]) | (_, ["v1", "rigs", ..]) => {
            Reply::text(405, "method not allowed\n")
        }
        _ => Reply::text(404, "not found\n"),
    }
}

fn command(app: &App, rig_id: &str, body: &[u8]) -> Reply {
    let m = &app.metrics;
    let parsed: Option<Value> = serde_json::from_slice(body).ok();
    let req = parsed.as_ref().and_then(Value::as_object);
    let name = req.and_then(|o| o.get("name")).and_then(Value::as_str);
    let empty = json!({});
    let args = match req.and_then(|o| o.get("args")) {
        None | Some(Value::Null) => Some(&empty),
        Some(a @ Value::Object(_)) => Some(a),
        Some(_) => None,
    };
    let id = req
        .and_then(|o| o.get("id"))
        .and_then(Value::as_str)
        .map(str::to_string)
        .unwrap_or_else(|| {
            format!(
                "{}-{}",
                app.broker_id,
                app.next_command_id.fetch_add(1, Relaxed)
            )
        });
    let (Some(name), Some(args)) = (name, args) else {
        m.commands_bad_request.fetch_add(1, Relaxed);
        return Reply::json(
            400,
            json!({"id": id, "ok": false, "error": "bad_request", "rig_id": rig_id,
                   "detail": "body must be {\"name\": string, \"args\": object}"}),
        );
    };
    match app.registry.enqueue(rig_id, &id, name, args) {
        Ok(seq) => {
            m.commands_ok.fetch_add(1, Relaxed);
            Reply::json(
                200,
                json!({"id": id, "ok": true, "rig_id": rig_id, "seq": seq}),
            )
        }
        Err(EnqueueError::NotConnected) => {
            m.commands_not_connected.fetch_add(1, Relaxed);
            Reply::json(
                404,
                json!({"id": id, "ok": false, "error": "rig_not_connected", "rig_id": rig_id}),
            )
        }
        Err(EnqueueError::Full {
            depth,
            cap,
            oldest_age,
            last_ack_seq,
            last_ack_at_ms,
        }) => {
            m.commands_unresponsive.fetch_add(1, Relaxed);
            Reply::json(
                503,
                json!({
                    "id": id, "ok": false, "error": "rig_unresponsive", "rig_id": rig_id,
                    "detail": format!("outbox full ({depth}/{cap}), oldest queued cmd age {}s", oldest_age.as_secs()),
                    "last_ack_seq": last_ack_seq,
                    "last_ack_at": (last_ack_at_ms > 0).then_some(last_ack_at_ms),
                    "suggested_action": "force_reconnect",
                }),
            )
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_heads() {
        let req = b"POST /v1/rigs/r/commands HTTP/1.1\r\nHost: x\r\nContent-Length: 2\r\n\r\n{}";
        match parse_head(req) {
            Parsed::Complete(h) => {
                assert_eq!(
                    (h.method.as_str(), h.path.as_str()),
                    ("POST", "/v1/rigs/r/commands")
                );
                assert_eq!(
                    (h.content_length, h.head_len, h.close),
                    (2, req.len() - 2, false)
                );
            }
            _ => panic!("not complete"),
        }
        assert!(matches!(
            parse_head(b"GET / HTTP/1.1\r\nHo"),
            Parsed::Partial
        ));
        assert!(matches!(
            parse_head(b"\x01\x02 nonsense\r\n\r\n"),
            Parsed::Invalid
        ));
        assert!(matches!(
            parse_head(b"GET / HTTP/1.1\r\nContent-Length: x\r\n\r\n"),
            Parsed::Invalid
        ));
    }
}
