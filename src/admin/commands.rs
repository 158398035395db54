//! A rig's control requests over the admin API: a command POST and a kick, sent to the rig's
//! core or to the bridge, and the HTTP answer made from their reply.
//!
//! Apart from the other routes because a core answers a command POST itself while the pool
//! answers the rest: both build the command and read its answer here. Each thread also
//! remembers the connection that took a rig's last command, so the next one skips the
//! bridge's hop.

use std::cell::RefCell;
use std::collections::HashMap;
use std::time::{SystemTime, UNIX_EPOCH};

use serde::Deserialize;
use serde_json::value::RawValue;

use super::http::{Answer, Request};
use super::routes::{json_answer, path_parts};
use super::{Admin, IO_TIMEOUT};
use crate::args::Args;
use crate::doorbell::Full;
use crate::ids::{BootId, ConnId, RigId, CONTROL_NAME_MAX};
use crate::registry::msg::{AdminAnswer, CommandReq, ReplyTo, ToBridge, ToCore};
use crate::reply;

/// Rigs a request thread or core remembers a route to; past it the memory starts afresh.
const MAX_ROUTES: usize = 4096;

thread_local! {
    /// The connection that took this thread's last command for each rig (a core's, for the
    /// admin connections it serves; a pool thread's, for those it serves). The rig's next
    /// command goes straight to that connection (on this core, or to its core's inbox)
    /// instead of asking the bridge first; a route gone stale costs the extra hop once,
    /// through the bridge, whose answer brings the new route. Per thread, so nothing is shared
    /// or locked.
    static ROUTES: RefCell<HashMap<RigId, ConnId>> = RefCell::new(HashMap::new());
}

const NOT_AN_OBJECT: &str = r#"the body must be a JSON object: {"name": "...", "args": {...}}"#;

#[derive(Deserialize)]
struct CommandBody {
    name: String,
    #[serde(default)]
    args: Option<Box<RawValue>>,
    #[serde(default)]
    id: Option<String>,
    /// `null` is absent, as for `ttl_ms`.
    #[serde(default)]
    queue_if_offline: Option<bool>,
    #[serde(default)]
    ttl_ms: Option<u64>,
}

/// The rig of a command POST (`POST /v1/rigs/{id}/commands`), the one request a core answers
/// itself.
pub fn command_rig(req: &Request) -> Option<&str> {
    if req.method != "POST" {
        return None;
    }
    match path_parts(&req.path) {
        (Some("v1"), Some("rigs"), Some(rig), Some("commands"), None) => Some(rig),
        _ => None,
    }
}

/// The command a POST body asks for, its answer going to `reply`; or the 400 refusing it.
pub(crate) fn command_req(
    rig: &str,
    body: &[u8],
    reply: ReplyTo,
) -> Result<Box<CommandReq>, Answer> {
    let parsed: Result<CommandBody, _> = serde_json::from_slice(body);
    let id = parsed
        .as_ref()
        .ok()
        .and_then(|b| b.id.clone())
        .unwrap_or_else(new_id);
    let bad = |detail: &str| json_answer(400, &reply::error(&id, Some(rig), "bad_request", detail));
    let Some(rig_id) = RigId::parse(rig) else {
        return Err(bad("invalid rig id"));
    };
    if id.len() > CONTROL_NAME_MAX {
        return Err(bad(&format!("id longer than {CONTROL_NAME_MAX} bytes")));
    }
    // As on the command channel, where an empty id is refused too: replies and events would
    // name no command.
    if id.is_empty() {
        return Err(bad("id is empty: leave it out and the broker makes one"));
    }
    if !crate::json_text::opens_an_object(body) {
        return Err(bad(NOT_AN_OBJECT));
    }
    let (body, args) = match parsed {
        Ok(mut b) if !b.name.is_empty() && b.name.len() <= crate::ids::COMMAND_NAME_MAX => {
            let args = match b.args.take() {
                None => Ok(Args::empty()),
                Some(raw) => Args::checked(raw),
            };
            match args {
                Ok(args) => (b, args),
                Err(why) => return Err(bad(&why)),
            }
        }
        Ok(_) => {
            let max = crate::ids::COMMAND_NAME_MAX;
            return Err(bad(&format!("name must be 1-{max} bytes")));
        }
        Err(e) => return Err(bad(&e.to_string())),
    };
    Ok(Box::new(CommandReq {
        id,
        rig: rig_id,
        name: body.name,
        args,
        reply,
        offline_ttl: body
            .queue_if_offline
            .unwrap_or(false)
            .then(|| crate::registry::control::offline_ttl(body.ttl_ms)),
    }))
}

/// The 503 for a command the bridge's full inbox would not take.
pub(crate) fn overloaded(id: &str, rig: &RigId) -> Answer {
    json_answer(
        503,
        &reply::error(id, Some(rig.as_str()), "overloaded", "bridge queue full"),
    )
}

pub(super) fn command(admin: &Admin, rig: &str, body: &[u8]) -> Answer {
    let (tx, rx) = crossbeam_channel::bounded(1);
    let req = match command_req(rig, body, ReplyTo::Admin(tx)) {
        Ok(req) => req,
        Err(answer) => return answer,
    };
    let (id, rig) = (req.id.clone(), req.rig.clone());
    if send_command(admin, req).is_err() {
        return overloaded(&id, &rig);
    }
    let answer = rx.recv_timeout(IO_TIMEOUT).ok();
    command_answer(&id, &rig, answer)
}

/// Sends a command straight to the core of the rig's remembered connection; without a route,
/// or when that core's inbox is full, through the bridge. Err: the bridge's inbox is full too.
fn send_command(admin: &Admin, req: Box<CommandReq>) -> Result<(), ()> {
    let route = route_of(&req.rig);
    let core = route.and_then(|conn| Some((conn, admin.cores.get(conn.core().0 as usize)?)));
    let req = match core {
        Some((conn, core)) => match core.send(ToCore::Command {
            conn,
            req,
            direct: true,
        }) {
            Ok(()) => return Ok(()),
            Err(Full(ToCore::Command { req, .. })) => req,
            Err(Full(_)) => return Err(()),
        },
        None => req,
    };
    admin.bridge.send(ToBridge::Command(req)).map_err(|_| ())
}

/// The connection this thread's last command for `rig` went to.
pub(crate) fn route_of(rig: &RigId) -> Option<ConnId> {
    ROUTES.with(|r| r.borrow().get(rig).copied())
}

/// Keeps (or forgets, when the answer names no connection) this thread's route to `rig`.
fn remember(rig: &RigId, route: Option<ConnId>) {
    ROUTES.with(|r| {
        let mut routes = r.borrow_mut();
        match route {
            Some(conn) => {
                if routes.len() >= MAX_ROUTES && !routes.contains_key(rig) {
                    routes.clear();
                }
                routes.insert(rig.clone(), conn);
            }
            None => {
                routes.remove(rig);
            }
        }
    });
}

/// The HTTP answer to a command, from its answer (None: none came in time); remembers the
/// route the answer brings.
pub(crate) fn command_answer(id: &str, rig: &RigId, answer: Option<AdminAnswer>) -> Answer {
    remember(rig, answer.as_ref().and_then(|a| a.route));
    reply_answer(id, rig.as_str(), answer)
}

pub(super) fn kick(admin: &Admin, rig: &str) -> Answer {
    let id = new_id();
    let Some(rig_id) = RigId::parse(rig) else {
        return json_answer(
            400,
            &reply::error(&id, Some(rig), "bad_request", "invalid rig id"),
        );
    };
    let (tx, rx) = crossbeam_channel::bounded(1);
    let msg = ToBridge::Kick {
        id: id.clone(),
        rig: rig_id.clone(),
        reply: ReplyTo::Admin(tx),
    };
    if admin.bridge.send(msg).is_err() {
        return overloaded(&id, &rig_id);
    }
    reply_answer(&id, rig, rx.recv_timeout(IO_TIMEOUT).ok())
}

/// The HTTP answer for a core's or the bridge's reply (None: none came in time).
fn reply_answer(id: &str, rig: &str, answer: Option<AdminAnswer>) -> Answer {
    match answer {
        Some(AdminAnswer { body: v, .. }) => {
            let status = match v["error"].as_str() {
                None => 200,
                Some("rig_not_connected") => 404,
                Some("bad_request") => 400,
                Some("forbidden") => 403,
                Some("seq_exhausted") => 409,
                Some(_) => 503,
            };
            json_answer(status, &v)
        }
        None => json_answer(
            504,
            &reply::error(
                id,
                Some(rig),
                "timeout",
                "no answer in time; the command may still reach the rig (it may be waiting on \
                 Redis, to be kept or forwarded to the broker that holds the rig), so look for \
                 its id in the rig's ack and result events before sending it again",
            ),
        ),
    }
}

/// A fresh command id (UUIDv7 text: unique and time-ordered).
pub fn new_id() -> String {
    let ms = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_millis() as u64);
    BootId::generate(ms).to_string()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::ids::CoreId;

    fn routes() -> usize {
        ROUTES.with(|r| r.borrow().len())
    }

    #[test]
    fn only_a_post_to_a_rigs_commands_is_a_command() {
        let req = |method: &str, path: &str| Request {
            method: method.into(),
            path: path.into(),
            query: String::new(),
            body: Vec::new(),
            close: false,
        };
        assert_eq!(command_rig(&req("POST", "/v1/rigs/a/commands")), Some("a"));
        for (m, p) in [
            ("POST", "/v1/rigs/a/commands/"),
            ("GET", "/v1/rigs/a/commands"),
            ("POST", "/v1/rigs/a/kick"),
            ("POST", "/v1/rigs/a/commands/b"),
            ("POST", "/v2/rigs/a/commands"),
            ("POST", "/v1/rigs"),
        ] {
            assert_eq!(command_rig(&req(m, p)), None, "{m} {p}");
        }
    }

    #[test]
    fn route_memory_is_bounded_and_an_answer_without_a_route_forgets() {
        let rig = |i: usize| RigId::parse(&format!("rig-{i}")).unwrap();
        let conn = |n: u64| ConnId::new(CoreId(1), n);
        for i in 0..MAX_ROUTES {
            remember(&rig(i), Some(conn(i as u64)));
        }
        assert_eq!(routes(), MAX_ROUTES);
        // A known rig's new connection replaces its route without starting afresh.
        remember(&rig(7), Some(conn(99_999)));
        assert_eq!(
            (routes(), route_of(&rig(7))),
            (MAX_ROUTES, Some(conn(99_999)))
        );
        // One rig more than the bound: the memory starts again from it.
        remember(&rig(MAX_ROUTES), Some(conn(1)));
        assert_eq!((routes(), route_of(&rig(MAX_ROUTES))), (1, Some(conn(1))));
        // An error, a held command or a timeout names no connection: the route goes.
        remember(&rig(MAX_ROUTES), None);
        assert_eq!(routes(), 0);
    }
}
