//! What each admin path answers (liveness, readiness, metrics, the rig list, events, drain),
//! and which methods a path takes.
//!
//! One routing table, so that a core, the acceptor and the pool answer a path alike; the
//! answers that need nothing but the request (`immediate`) are told apart from those that need
//! the broker's state, so liveness and 404s never wait behind the pool.

use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

use serde_json::json;

use super::commands::{command, command_rig, kick};
use super::http::{render_answered, Answer, Request};
use super::Admin;
use crate::event_log;
use crate::ids::RigId;
use crate::metrics::{self, CoreSnapshot};
use crate::registry::bridge::BridgeShared;
use crate::registry::msg::{RigPage, ToCore};

/// The first four segments of a path and whether a fifth follows (Some), for matching routes
/// without allocating.
type PathParts<'a> = (
    Option<&'a str>,
    Option<&'a str>,
    Option<&'a str>,
    Option<&'a str>,
    Option<&'a str>,
);

pub(super) fn path_parts(path: &str) -> PathParts<'_> {
    let mut parts = segments(path);
    (
        parts.next(),
        parts.next(),
        parts.next(),
        parts.next(),
        parts.next(),
    )
}

/// A path's segments as sent: one leading `/`, nothing trimmed or merged. `/v1/drain/` and
/// `//metrics` then name no route (an empty segment matches none), so a stray slash is a 404,
/// not the drain (operations.md: paths are matched as sent). A path without its leading `/`
/// is one empty segment: it matches nothing either.
fn segments(path: &str) -> std::str::Split<'_, char> {
    path.strip_prefix('/').unwrap_or("").split('/')
}

/// The methods a path takes, for a 405's `Allow` header (RFC 9110 §15.5.6).
pub fn allowed_methods(path: &str) -> &'static str {
    match path_parts(path) {
        (Some("v1"), Some("drain"), None, ..)
        | (Some("v1"), Some("rigs"), Some(_), Some("commands" | "kick"), None) => "POST",
        _ => "GET, HEAD",
    }
}

/// Answers that need nothing but the request itself: `/healthz`, and the 404s and 405s. A core
/// gives them at once, so liveness never waits on the admin pool (CONTRACT.md §6: 200 while
/// the process runs). None for a request that needs the broker's state (and for commands,
/// which [`command_rig`] picks out first).
pub fn immediate(req: &Request) -> Option<Answer> {
    let parts: Vec<&str> = segments(&req.path).collect();
    match (req.get_method(), parts.as_slice()) {
        ("GET", ["healthz"]) => Some((200, "text/plain", b"ok\n".to_vec())),
        ("GET", ["readyz" | "metrics"] | ["v1", "rigs"] | ["v1", "events"])
        | ("POST", ["v1", "rigs", _, "kick"] | ["v1", "drain"]) => None,
        (
            _,
            ["healthz" | "readyz" | "metrics"]
            | ["v1", "rigs"]
            | ["v1", "rigs", _, "commands" | "kick"]
            | ["v1", "drain"]
            | ["v1", "events"],
        ) => Some(error_answer(405, "method_not_allowed")),
        _ => Some(error_answer(404, "not_found")),
    }
}

pub(super) fn route(admin: &Admin, req: &Request) -> Answer {
    // The same test that sends a command POST on a core to that core's own handler.
    if let Some(rig) = command_rig(req) {
        return command(admin, rig, &req.body);
    }
    if let Some(answer) = immediate(req) {
        return answer;
    }
    let parts: Vec<&str> = segments(&req.path).collect();
    match (req.get_method(), parts.as_slice()) {
        ("GET", ["readyz"]) => readyz(admin),
        ("GET", ["metrics"]) => {
            let (snaps, asked) = snapshots(admin, None);
            // Without a core's counters a scrape would read as a counter reset, then as a
            // burst when the core answers again: no figures beat wrong ones.
            if let Some(answer) = cores_missing(admin, snaps.len(), asked) {
                return answer;
            }
            let stats = admin.bridge_stats.stats(admin.bridge.len());
            let mut text = metrics::render(&snaps, &stats, admin.draining.load(Ordering::SeqCst));
            if let Some(tls) = &admin.tls {
                let reloads = (tls.generation(), tls.failed_reloads());
                metrics::render_tls(&mut text, tls.validity(), reloads);
            }
            render_answered(&mut text);
            (200, "text/plain; version=0.0.4", text.into_bytes())
        }
        ("GET", ["v1", "rigs"]) => {
            let page = match rig_page(&req.query) {
                Ok(page) => page,
                Err(answer) => return answer,
            };
            let limit = page.limit;
            let (snaps, asked) = snapshots(admin, Some(page));
            // A list without a core's rigs would say they are not here.
            if let Some(answer) = cores_missing(admin, snaps.len(), asked) {
                return answer;
            }
            let mut rigs: Vec<_> = snaps.into_iter().flat_map(|s| s.rigs).collect();
            rigs.sort_by(|a, b| a.rig_id.cmp(&b.rig_id));
            rigs.truncate(limit);
            // Straight to bytes: through a `Value` tree, 9,000 rigs took 18.8 ms against 10.0.
            json_answer(200, &rigs)
        }
        ("GET", ["v1", "events"]) => events(admin, &req.query),
        ("POST", ["v1", "rigs", rig, "kick"]) => kick(admin, rig),
        ("POST", ["v1", "drain"]) => {
            admin.draining.store(true, Ordering::SeqCst);
            let _ = admin.drain.try_send(());
            json_answer(202, &json!({"ok": true, "draining": true}))
        }
        _ => error_answer(404, "not_found"),
    }
}

/// `GET /v1/events?after=N&limit=M`: standalone's lifecycle events after event N (see
/// [`crate::event_log`]). In fleet mode they are on `fleetlink:events` instead.
fn events(admin: &Admin, query: &str) -> Answer {
    if admin.bridge_stats.fleet {
        let body = json!({"ok": false, "error": "not_found",
            "detail": "fleet mode: events are published on fleetlink:events"});
        return (404, "application/json", body.to_string().into_bytes());
    }
    let Some((after, limit)) = events_query(query) else {
        let body = json!({"ok": false, "error": "bad_request",
            "detail": "query: after=N (an event number, 0 for the oldest kept) and limit=1..1000, each at most once"});
        return (400, "application/json", body.to_string().into_bytes());
    };
    match admin.bridge_stats.event_log.lock() {
        Ok(log) => (200, "application/json", log.page_json(after, limit)),
        Err(_) => error_answer(503, "unavailable"),
    }
}

/// The length of the page a `GET /v1/events` request (standalone) would be answered, before
/// it is built; None for any other request, or one refused. A page of the whole log is 16 MiB:
/// a burst of such requests from clients that do not read, each built before its answer was
/// weighed against `--admin-answer-bytes`, held about 1 GB (review bb108).
pub fn events_answer_len(req: &Request, bridge: &BridgeShared) -> Option<usize> {
    // HEAD too: its page is built (for its length) though not sent (review bb109).
    if bridge.fleet || !matches!(req.method.as_str(), "GET" | "HEAD") || req.path != "/v1/events" {
        return None;
    }
    let (after, limit) = events_query(&req.query)?;
    bridge
        .event_log
        .lock()
        .ok()
        .map(|log| log.page_json_len(after, limit))
}

/// `after` and `limit` of a `/v1/events` query; None when it is not one.
fn events_query(query: &str) -> Option<(u64, usize)> {
    let mut after = 0u64;
    let mut limit = event_log::PAGE_MAX;
    // Plain digits, each key at most once, as the rig list takes them.
    let digits = |v: &str| !v.is_empty() && v.bytes().all(|b| b.is_ascii_digit());
    let (mut after_seen, mut limit_seen) = (false, false);
    for pair in query.split('&').filter(|p| !p.is_empty()) {
        let parsed = match pair.split_once('=') {
            // Empty is the default, so a pager can start with an empty cursor.
            Some(("after", "")) if !std::mem::replace(&mut after_seen, true) => Some(()),
            Some(("after", v)) if digits(v) && !std::mem::replace(&mut after_seen, true) => {
                v.parse().map(|n| after = n).ok()
            }
            Some(("limit", v)) if digits(v) && !std::mem::replace(&mut limit_seen, true) => v
                .parse()
                .ok()
                .filter(|n| (1..=event_log::PAGE_MAX).contains(n))
                .map(|n| limit = n),
            _ => None,
        };
        parsed?;
    }
    Some((after, limit))
}

/// Most rigs one page of `GET /v1/rigs` lists.
const RIGS_PAGE_MAX: usize = 10_000;

/// `GET /v1/rigs?after=RIG&limit=N`: the rigs whose id sorts after RIG, at most N. Without a
/// query the whole list, as CONTRACT.md §6 has it; a query it does not know is refused, as
/// `/v1/events` refuses one, rather than answered as if it had not been asked.
fn rig_page(query: &str) -> Result<RigPage, Answer> {
    let mut page = RigPage::ALL;
    // A key given twice is refused: which one counts would be a guess.
    let (mut after, mut limit) = (false, false);
    for pair in query.split('&').filter(|p| !p.is_empty()) {
        let parsed = match pair.split_once('=') {
            // Empty is the start of the list, so a pager can begin with an empty cursor.
            Some(("after", "")) if !std::mem::replace(&mut after, true) => Some(()),
            Some(("after", v)) if !std::mem::replace(&mut after, true) => {
                RigId::parse(v).map(|r| page.after = Some(r.as_str().into()))
            }
            Some(("limit", v))
                if v.bytes().all(|b| b.is_ascii_digit())
                    && !std::mem::replace(&mut limit, true) =>
            {
                v.parse()
                    .ok()
                    .filter(|n| (1..=RIGS_PAGE_MAX).contains(n))
                    .map(|n| page.limit = n)
            }
            _ => None,
        };
        if parsed.is_none() {
            let detail = format!(
                "query: after=RIG (a rig id; the list is sorted by it) and limit=1..{RIGS_PAGE_MAX}, each at most once"
            );
            let body = json!({"ok": false, "error": "bad_request", "detail": detail});
            return Err((400, "application/json", body.to_string().into_bytes()));
        }
    }
    Ok(page)
}

/// A refusal in the JSON every other admin error uses, so a client reads all of them alike.
fn error_answer(status: u16, error: &str) -> Answer {
    let body = json!({"ok": false, "error": error});
    (status, "application/json", body.to_string().into_bytes())
}

fn readyz(admin: &Admin) -> Answer {
    if admin.draining.load(Ordering::SeqCst) {
        return (503, "text/plain", b"draining\n".to_vec());
    }
    if let Some(why) = admin.bridge_stats.not_ready() {
        return (503, "text/plain", format!("{why}\n").into_bytes());
    }
    // Every core must answer: a wedged core is not ready.
    let (snaps, asked) = snapshots(admin, None);
    if let Some(answer) = cores_missing(admin, snaps.len(), asked) {
        return answer;
    }
    (200, "text/plain", b"ready\n".to_vec())
}

/// The 503 for an answer that needs every core when some did not answer in time. A core whose
/// inbox is full counts as not answering; while the broker drains, only the cores `asked`
/// count, since a core that has drained has stopped.
fn cores_missing(admin: &Admin, answered: usize, asked: usize) -> Option<Answer> {
    let cores = if admin.draining.load(Ordering::SeqCst) {
        asked
    } else {
        admin.cores.len()
    };
    (answered < cores).then(|| {
        let why = format!("{answered}/{cores} cores answered\n");
        (503, "text/plain", why.into_bytes())
    })
}

/// Asks every core for a snapshot; cores that do not answer in time are left out. Also says
/// how many cores were asked (not those whose inbox is full or gone).
fn snapshots(admin: &Admin, rigs: Option<RigPage>) -> (Vec<CoreSnapshot>, usize) {
    let (tx, rx) = crossbeam_channel::bounded(admin.cores.len());
    let asked = admin
        .cores
        .iter()
        .filter(|core| {
            core.send(ToCore::Snapshot {
                rigs: rigs.clone(),
                reply: tx.clone(),
            })
            .is_ok()
        })
        .count();
    let deadline = Instant::now() + Duration::from_secs(2);
    let mut out: Vec<CoreSnapshot> = (0..asked)
        .map_while(|_| rx.recv_deadline(deadline).ok())
        .collect();
    // A core that stopped at the end of a drain answers with the figures it stopped with.
    for core in 0..admin.cores.len() {
        if !out.iter().any(|s| s.core == core) {
            out.extend(admin.retired.get(core));
        }
    }
    out.sort_by_key(|s| s.core);
    (out, asked)
}

pub(super) fn json_answer<T: serde::Serialize + ?Sized>(status: u16, v: &T) -> Answer {
    let mut body = serde_json::to_vec(v).unwrap_or_default();
    body.push(b'\n');
    (status, "application/json", body)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::admin::http::response;
    use crate::admin::http::tests::complete;

    #[test]
    fn liveness_and_the_fixed_answers_need_no_broker_state() {
        let status = |head: &str| {
            let (req, _) = complete(format!("{head} HTTP/1.1\r\n\r\n").as_bytes());
            immediate(&req).map(|(status, _, _)| status)
        };
        assert_eq!(status("GET /healthz"), Some(200));
        assert_eq!(status("DELETE /healthz"), Some(405));
        assert_eq!(status("GET /v1/rigs/r1/kick"), Some(405));
        assert_eq!(status("GET /v1/rigs/r1/commands"), Some(405));
        assert_eq!(status("DELETE /v1/rigs"), Some(405));
        assert_eq!(status("GET /nope"), Some(404));
        // Under /v1/rigs only the routes exist: a 405 there would name methods it refuses.
        for unknown in [
            "GET /v1/rigs/r1",
            "HEAD /v1/rigs/r1",
            "POST /v1/rigs/r1",
            "GET /v1/rigs/r1/foo",
            "POST /v1/rigs/a/b/c",
            "POST /v1/rigs/r1/commands/x",
            // Matched as sent: a stray slash names no route (it used to be trimmed, and
            // `POST /v1/drain/` drained the broker).
            "POST /v1/drain/",
            "POST //v1/drain",
            "GET /healthz/",
            "GET //metrics",
            "GET /v1/rigs/",
            "POST /v1/rigs/r1/commands/",
            "GET /",
        ] {
            assert_eq!(status(unknown), Some(404), "{unknown}");
        }
        for stateful in [
            "GET /readyz",
            "GET /metrics",
            "GET /v1/rigs",
            "POST /v1/drain",
        ] {
            assert_eq!(status(stateful), None, "{stateful}");
        }
        assert_eq!(status("POST /v1/rigs/r1/kick"), None);
    }

    #[test]
    fn a_405_says_which_methods_the_path_takes() {
        for (path, allow) in [
            ("/v1/drain", "POST"),
            ("/v1/rigs/r1/commands", "POST"),
            ("/v1/rigs/r1/kick", "POST"),
            ("/v1/rigs", "GET, HEAD"),
            ("/metrics", "GET, HEAD"),
        ] {
            let text = String::from_utf8(response(
                405,
                "text/plain",
                b"",
                true,
                false,
                allowed_methods(path),
            ))
            .expect("text");
            assert!(
                text.contains(&format!("\r\nAllow: {allow}\r\n")),
                "{path}: {text}"
            );
        }
        let ok =
            String::from_utf8(response(200, "text/plain", b"", true, false, "POST")).expect("text");
        assert!(!ok.contains("Allow:"), "only a 405 says it");
    }
}
