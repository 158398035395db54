//! Standalone mode: one broker's admin HTTP API (CONTRACT.md §6).
//!
//! A minimal HTTP/1.1 client over `std::net` (one request per connection, `Connection: close`,
//! response head parsed by httparse). Commands answer with the same reply JSON as the pub/sub
//! plane; a selector broadcast is done here, rig by rig, from `GET /v1/rigs`.

use std::io::{ErrorKind, Read, Write};
use std::net::{TcpStream, ToSocketAddrs};
use std::time::{Duration, Instant};

use anyhow::{bail, Context};
use fleetlink::admin::new_id;
use fleetlink::ids::RigId;
use serde_json::{json, Map, Value};

use crate::cli::{AdminUrl, Selector};
use crate::render::secs;
use crate::{error_reply, Broadcast, ControlPlane, Page, TimedOut};

/// Longest wait for the TCP connection.
const CONNECT_TIMEOUT: Duration = Duration::from_secs(5);
/// Longest wait for a read-only request (`/v1/rigs` asks every core, up to 2 s).
const IO_TIMEOUT: Duration = Duration::from_secs(10);
/// How often `events` asks a standalone broker for what is new.
const EVENTS_POLL: Duration = Duration::from_millis(200);
/// Largest response accepted (a `/v1/rigs` of a full broker is a few MiB).
const MAX_RESPONSE: usize = 256 << 20;

/// One broker's admin API.
pub(crate) struct AdminPlane {
    url: AdminUrl,
}

/// Status and body of one response.
struct Response {
    status: u16,
    body: Vec<u8>,
    /// The broker's id, which its admin API names in every answer (`Fleetlink-Broker-Id`).
    broker: Option<String>,
}

impl AdminPlane {
    /// Nothing is connected until a command runs.
    pub(crate) fn new(url: AdminUrl) -> AdminPlane {
        AdminPlane { url }
    }

    fn send_with_id(
        &self,
        id: &str,
        rig: &RigId,
        name: &str,
        args: &Map<String, Value>,
        timeout: Duration,
    ) -> anyhow::Result<Value> {
        let body = json!({"id": id, "name": name, "args": args});
        self.reply(
            id,
            rig,
            &format!("/v1/rigs/{rig}/commands"),
            Some(&body),
            timeout,
        )
    }

    /// POSTs and expects a reply object; no answer in time is a locally built `timeout` reply.
    fn reply(
        &self,
        id: &str,
        rig: &RigId,
        path: &str,
        body: Option<&Value>,
        timeout: Duration,
    ) -> anyhow::Result<Value> {
        let Some(resp) = self.call("POST", path, body, timeout)? else {
            // The request went: the broker may have carried it out all the same.
            let detail = format!(
                "no answer from the admin API within {}: it may have been carried out all the same",
                secs(timeout)
            );
            return Ok(error_reply(
                Some(id),
                Some(rig.as_str()),
                "timeout",
                &detail,
            ));
        };
        match serde_json::from_slice::<Value>(&resp.body) {
            Ok(v) if v.get("ok").is_some_and(Value::is_boolean) => Ok(v),
            _ => bail!(
                "admin API answered {} to POST {path}: {}",
                resp.status,
                excerpt(&resp.body)
            ),
        }
    }

    /// The rows of `GET /v1/rigs`.
    fn rigs(&self, timeout: Duration) -> anyhow::Result<Vec<Value>> {
        Ok(self.rigs_at("/v1/rigs", timeout)?.0)
    }

    /// The rows `GET path` (`/v1/rigs` with or without a page's query) answers, and the id of
    /// the broker that answered, if it said.
    fn rigs_at(
        &self,
        path: &str,
        timeout: Duration,
    ) -> anyhow::Result<(Vec<Value>, Option<String>)> {
        let resp = self
            .call("GET", path, None, timeout)?
            .ok_or_else(|| no_answer(&format!("GET {path}"), timeout))?;
        match serde_json::from_slice(&resp.body) {
            Ok(Value::Array(rows)) if resp.status == 200 => Ok((rows, resp.broker)),
            _ => bail!(
                "admin API answered {} to GET {path}: {}",
                resp.status,
                excerpt(&resp.body)
            ),
        }
    }

    /// One request; `Ok(None)` when the answer did not arrive within `timeout`.
    fn call(
        &self,
        method: &str,
        path: &str,
        body: Option<&Value>,
        timeout: Duration,
    ) -> anyhow::Result<Option<Response>> {
        let deadline = Instant::now() + timeout;
        let shown = format!("http://{}{}", self.url.authority, self.url.prefix);
        let mut stream = self
            .connect()
            .with_context(|| format!("cannot reach the admin API at {shown}"))?;
        let body = body.map(Value::to_string).unwrap_or_default();
        let head = format!(
            "{method} {}{path} HTTP/1.1\r\nHost: {}\r\nUser-Agent: fleetctl\r\nAccept: application/json\r\n\
             Content-Type: application/json\r\nContent-Length: {}\r\nConnection: close\r\n\r\n",
            self.url.prefix,
            self.url.authority,
            body.len()
        );
        stream.set_write_timeout(Some(CONNECT_TIMEOUT))?;
        stream
            .write_all(head.as_bytes())
            .and_then(|()| stream.write_all(body.as_bytes()))
            .with_context(|| format!("sending {method} {path} to {shown}"))?;
        let mut buf = Vec::new();
        let mut chunk = [0u8; 16 << 10];
        loop {
            let Some(left) = deadline
                .checked_duration_since(Instant::now())
                .filter(|d| !d.is_zero())
            else {
                return Ok(None);
            };
            stream.set_read_timeout(Some(left))?;
            let n = match stream.read(&mut chunk) {
                Ok(n) => n,
                Err(e) if matches!(e.kind(), ErrorKind::WouldBlock | ErrorKind::TimedOut) => {
                    return Ok(None)
                }
                Err(e) if e.kind() == ErrorKind::Interrupted => continue,
                Err(e) => {
                    return Err(e).with_context(|| {
                        format!("reading the answer to {method} {path} from {shown}")
                    })
                }
            };
            buf.extend_from_slice(chunk.get(..n).unwrap_or_default());
            if let Some(resp) = parse_response(&buf, n == 0)? {
                return Ok(Some(resp));
            }
            if n == 0 {
                bail!("{shown} closed the connection before a full answer to {method} {path}");
            }
            if buf.len() > MAX_RESPONSE {
                bail!("answer to {method} {path} is larger than {MAX_RESPONSE} bytes");
            }
        }
    }

    fn connect(&self) -> std::io::Result<TcpStream> {
        let mut last = None;
        for addr in self.url.authority.to_socket_addrs()? {
            match TcpStream::connect_timeout(&addr, CONNECT_TIMEOUT) {
                Ok(s) => return Ok(s),
                Err(e) => last = Some(e),
            }
        }
        Err(last.unwrap_or_else(|| {
            std::io::Error::new(ErrorKind::NotFound, "host resolved to no address")
        }))
    }

    /// The id the broker announces in `fleetlink_info` on `/metrics` (the admin API has no
    /// other route that says it); None from an older broker without it, or when `/metrics` is
    /// refused (a core not answering).
    fn broker_id(&mut self, timeout: Duration) -> anyhow::Result<Option<String>> {
        let metrics = self
            .call("GET", "/metrics", None, timeout)?
            .ok_or_else(|| no_answer("GET /metrics", timeout))?;
        let text = String::from_utf8_lossy(&metrics.body);
        Ok(info_label(&text, "broker_id").filter(|_| metrics.status == 200))
    }
}

/// Most rows one page of `fleetctl --admin list` asks for: one less than the broker lists in a
/// page of `/v1/rigs` (10,000), since the row past the page tells whether another follows.
const RIGS_PAGE_MAX: usize = 9_999;

impl ControlPlane for AdminPlane {
    /// `send RIG NAME`: `POST /v1/rigs/{rig}/commands`.
    fn send(
        &mut self,
        rig: &RigId,
        name: &str,
        args: &Map<String, Value>,
        timeout: Duration,
    ) -> anyhow::Result<Value> {
        self.send_with_id(&new_id(), rig, name, args, timeout)
    }

    /// `kick RIG`: `POST /v1/rigs/{rig}/kick`.
    fn kick(&mut self, rig: &RigId, timeout: Duration) -> anyhow::Result<Value> {
        self.reply(
            &new_id(),
            rig,
            &format!("/v1/rigs/{rig}/kick"),
            None,
            timeout,
        )
    }

    /// `send --selector`: every rig of `GET /v1/rigs` whose labels match, one POST each, summed
    /// up as one broadcast reply from the broker, under the id it announces.
    fn broadcast(
        &mut self,
        selector: &Selector,
        name: &str,
        args: &Map<String, Value>,
        timeout: Duration,
    ) -> anyhow::Result<Broadcast> {
        let id = new_id();
        // One --timeout for the whole broadcast, as over Redis: each POST gets what is left,
        // and rigs it does not reach in time are reported failed, not waited for in turn.
        let deadline = Instant::now() + timeout;
        let (rows, named) = self.rigs_at("/v1/rigs", timeout)?;
        let matching: Vec<RigId> = rows
            .iter()
            .filter(|row| {
                selector
                    .iter()
                    .all(|(k, v)| row["labels"][k].as_str() == Some(v.as_str()))
            })
            .filter_map(|row| RigId::parse(row["rig_id"].as_str()?))
            .collect();
        let mut failed = Vec::new();
        for rig in &matching {
            let left = deadline.saturating_duration_since(Instant::now());
            if left.is_zero() {
                let why = "not sent: the broadcast's --timeout ran out before this rig";
                let reply = error_reply(Some(&id), Some(rig.as_str()), "timeout", why);
                failed.push(json!({"rig_id": rig.as_str(), "error": reply["error"], "detail": reply["detail"]}));
                continue;
            }
            let mut reply = match self.send_with_id(&id, rig, name, args, left) {
                Ok(reply) => reply,
                Err(e) => error_reply(
                    Some(&id),
                    Some(rig.as_str()),
                    "admin_error",
                    &format!("{e:#}"),
                ),
            };
            if reply["error"] == "timeout" {
                // Its own wait was only what the broadcast had left, which says nothing.
                reply["detail"] = format!(
                    "no answer before the broadcast's --timeout ({}) ran out: it may have reached the rig all the same",
                    secs(timeout)
                )
                .into();
            }
            if reply["ok"].as_bool() != Some(true) {
                failed.push(json!({"rig_id": rig.as_str(), "error": reply["error"], "detail": reply["detail"]}));
            }
        }
        // Named as its replies over Redis would name it: as its answer to the rig list did,
        // or, from a broker that names itself only on `/metrics`, as that says in the time
        // left; by its admin address otherwise (the commands went, and a broadcast that
        // reached its rigs must not read as one that timed out).
        let named = named.or_else(|| {
            let left = deadline.saturating_duration_since(Instant::now());
            match left.is_zero() {
                true => None,
                false => self.broker_id(left).ok().flatten(),
            }
        });
        let broker = named.unwrap_or_else(|| self.url.authority.clone());
        let reply = json!({"id": id, "ok": true, "broker_id": broker, "matched": matching.len(),
                           "enqueued": matching.len() - failed.len(), "failed": failed});
        Ok(Broadcast {
            id,
            expected: vec![broker],
            replies: vec![reply],
            timeout,
        })
    }

    /// `status RIG`: the rig's row of `GET /v1/rigs`.
    fn status(&mut self, rig: &RigId) -> anyhow::Result<Value> {
        let found = self
            .rigs(IO_TIMEOUT)?
            .into_iter()
            .find(|row| row["rig_id"].as_str() == Some(rig.as_str()));
        Ok(match found {
            Some(Value::Object(mut row)) => {
                row.insert("ok".into(), json!(true));
                Value::Object(row)
            }
            _ => {
                let detail = format!("not connected to the broker at {}", self.url.authority);
                error_reply(None, Some(rig.as_str()), "rig_not_connected", &detail)
            }
        })
    }

    /// `list`: one page of `GET /v1/rigs?after=RIG&limit=N` (sorted by rig id), one row more
    /// than the page to tell whether another follows. The cursor names the last rig of the
    /// page before, not its place: rigs leaving between pages would shift every place, and
    /// the rigs past them would be skipped.
    fn list(&mut self, page_size: u64, cursor: &str) -> anyhow::Result<Page> {
        let after = match cursor {
            "0" => None,
            c => Some(c.strip_prefix("after:").and_then(RigId::parse).ok_or_else(|| {
                clap::Error::raw(clap::error::ErrorKind::InvalidValue, format!(
                    "--cursor {c}: with --admin, a cursor is `after:RIG` as a page printed (0 = start)\n"
                ))
            })?),
        };
        let page = usize::try_from(page_size).map_or(RIGS_PAGE_MAX, |p| p.min(RIGS_PAGE_MAX));
        let mut path = format!("/v1/rigs?limit={}", page + 1);
        if let Some(a) = after {
            path.push_str(&format!("&after={a}"));
        }
        let mut rest = self.rigs_at(&path, IO_TIMEOUT)?.0.into_iter().peekable();
        let rows: Vec<Value> = rest.by_ref().take(page).collect();
        let next_cursor = match (rest.peek(), rows.last()) {
            (Some(_), Some(last)) => last["rig_id"].as_str().map(|id| format!("after:{id}")),
            _ => None,
        };
        Ok(Page {
            rows,
            next_cursor,
            admin: true,
        })
    }

    /// `brokers`: liveness and readiness of this one broker, under the id it announces in
    /// `fleetlink_info` on `/metrics` (the admin API has no other route that says it).
    fn brokers(&mut self) -> anyhow::Result<Vec<Value>> {
        // Unknown (an older broker, or /metrics refused): null, which is not the admin address.
        let broker_id = self
            .broker_id(IO_TIMEOUT)?
            .map_or(Value::Null, Value::String);
        let health = self
            .call("GET", "/healthz", None, IO_TIMEOUT)?
            .ok_or_else(|| no_answer("GET /healthz", IO_TIMEOUT))?;
        // A broker answers /healthz 200 for as long as it runs, draining or not: anything else
        // is no broker's admin API (a wrong port or path prefix), and listing it as a broker
        // that is merely not ready would exit 0 on a typo.
        if health.status != 200 {
            anyhow::bail!(
                "{} is no fleetlink admin API: GET /healthz answered {}",
                format_args!("http://{}{}", self.url.authority, self.url.prefix),
                health.status
            );
        }
        let ready = self
            .call("GET", "/readyz", None, IO_TIMEOUT)?
            .ok_or_else(|| no_answer("GET /readyz", IO_TIMEOUT))?;
        Ok(vec![json!({
            "broker_id": broker_id,
            "admin": format!("http://{}{}", self.url.authority, self.url.prefix),
            "healthz": health.status,
            "readyz": ready.status,
            "ready": ready.status == 200,
            "detail": excerpt(&ready.body),
        })])
    }

    /// `events` on a standalone broker: `GET /v1/events` polled from the events after the
    /// newest when it starts, as a subscription would have them. A broker in fleet mode
    /// answers 404 there: its events are on Redis.
    fn events(
        &mut self,
        limit: Option<Duration>,
        count: Option<u64>,
        each: &mut dyn FnMut(&Value),
    ) -> anyhow::Result<u64> {
        let deadline = limit.map(|l| Instant::now() + l);
        // Past the newest event: the broker answers with the newest's number, and nothing.
        let mut after = u64::MAX;
        let mut seen = 0;
        let mut answered = false;
        loop {
            let path = format!("/v1/events?after={after}");
            // No poll outlasts --for: a broker that does not answer ends the tail on time.
            let wait = deadline.map_or(IO_TIMEOUT, |d| {
                d.saturating_duration_since(Instant::now())
                    .clamp(Duration::from_millis(1), IO_TIMEOUT)
            });
            let resp = match self.call("GET", &path, None, wait)? {
                Some(resp) => resp,
                // --for ran out during a poll of a broker that has answered before.
                None if answered && deadline.is_some_and(|d| Instant::now() >= d) => {
                    return Ok(seen)
                }
                None => return Err(no_answer("GET /v1/events", wait).into()),
            };
            answered = true;
            let mut page: Value = match serde_json::from_slice(&resp.body) {
                Ok(v) if resp.status == 200 => v,
                // The broker's refusal, not a usage error: exit 2.
                _ if resp.status == 404 => {
                    bail!("this broker keeps no events (fleet mode: use --redis URL)")
                }
                _ => bail!(
                    "admin API answered {} to GET /v1/events: {}",
                    resp.status,
                    excerpt(&resp.body)
                ),
            };
            let missed = page["missed"].as_u64().unwrap_or(0);
            if missed > 0 && after != u64::MAX {
                eprintln!("fleetctl: warning: {missed} events were dropped before they were read (the broker keeps the latest 10,000)");
            }
            let fresh = match page["events"].take() {
                Value::Array(events) => events,
                _ => Vec::new(),
            };
            let caught_up = fresh.is_empty();
            for event in &fresh {
                if count.is_some_and(|n| seen >= n) {
                    break;
                }
                each(event);
                seen += 1;
            }
            if count.is_some_and(|n| seen >= n) {
                return Ok(seen);
            }
            after = page["next"].as_u64().unwrap_or(0);
            let now = Instant::now();
            if deadline.is_some_and(|d| now >= d) {
                return Ok(seen);
            }
            if caught_up {
                let nap = deadline.map_or(EVENTS_POLL, |d| (d - now).min(EVENTS_POLL));
                std::thread::sleep(nap);
            }
        }
    }
}

/// A complete response in `buf`, `None` when more bytes are needed. Without Content-Length the
/// body runs to EOF (`eof`).
/// The value of `label` on the `fleetlink_info` line of a Prometheus text, unescaped.
fn info_label(metrics: &str, label: &str) -> Option<String> {
    let line = metrics
        .lines()
        .find_map(|l| l.strip_prefix("fleetlink_info{"))?;
    let start = line.find(&format!("{label}=\""))? + label.len() + 2;
    let mut value = String::new();
    let mut chars = line[start..].chars();
    while let Some(c) = chars.next() {
        match c {
            '"' => return Some(value),
            '\\' => match chars.next()? {
                'n' => value.push('\n'),
                other => value.push(other),
            },
            c => value.push(c),
        }
    }
    None
}

fn parse_response(buf: &[u8], eof: bool) -> anyhow::Result<Option<Response>> {
    let mut headers = [httparse::EMPTY_HEADER; 32];
    let mut resp = httparse::Response::new(&mut headers);
    let head_len = match resp.parse(buf).context("malformed HTTP response")? {
        httparse::Status::Complete(n) => n,
        httparse::Status::Partial => return Ok(None),
    };
    let status = resp.code.unwrap_or(0);
    let length = resp
        .headers
        .iter()
        .find(|h| h.name.eq_ignore_ascii_case("content-length"))
        .and_then(|h| {
            std::str::from_utf8(h.value)
                .ok()?
                .trim()
                .parse::<usize>()
                .ok()
        });
    let broker = resp
        .headers
        .iter()
        .find(|h| h.name.eq_ignore_ascii_case("fleetlink-broker-id"))
        .and_then(|h| std::str::from_utf8(h.value).ok())
        .map(|v| v.trim().to_string())
        .filter(|v| !v.is_empty());
    let rest = buf.get(head_len..).unwrap_or_default();
    match length {
        Some(n) if rest.len() >= n => Ok(Some(Response {
            status,
            body: rest.get(..n).unwrap_or_default().to_vec(),
            broker,
        })),
        None if eof => Ok(Some(Response {
            status,
            body: rest.to_vec(),
            broker,
        })),
        _ => Ok(None),
    }
}

/// The error of a request the admin API did not answer in time (exit 3).
fn no_answer(request: &str, timeout: Duration) -> TimedOut {
    TimedOut(format!(
        "{request}: no answer from the admin API within {}",
        secs(timeout)
    ))
}

/// The start of a body as one line of text, for error messages.
fn excerpt(body: &[u8]) -> String {
    let text = String::from_utf8_lossy(body);
    let text = text.trim();
    match text.char_indices().nth(200) {
        Some((i, _)) => format!("{}…", &text[..i]),
        None => text.to_owned(),
    }
}
