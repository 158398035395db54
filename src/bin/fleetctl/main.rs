//! fleetctl: the control-plane CLI of fleetlink (CONTRACT.md §1, §3, §4, §6).
//!
//! The same commands speak to one of two planes:
//! - [`redis_plane`]: fleet mode. Reads the registry (`rig:*`, `broker:*`) and talks to brokers
//!   over pub/sub, subscribing to a fresh `fleetlink:reply:<id>` before publishing.
//! - [`admin_plane`]: standalone mode. One broker's admin HTTP API.
//!
//! Both return the contract's reply objects as JSON values; [`render`] prints them (a table or
//! sentence, or JSON lines with `--json`) and `main` turns them into the exit code:
//! 0 ok, 2 an error reply or an unreachable plane, 3 timeout, 64 usage.

mod admin_plane;
mod cli;
mod redis_plane;
mod render;

use std::collections::BTreeSet;
use std::process::ExitCode;
use std::time::Duration;

use fleetlink::ids::RigId;
use serde_json::{json, Map, Value};

use crate::admin_plane::AdminPlane;
use crate::cli::{Cli, Command, Plane, Selector, Target};
use crate::redis_plane::RedisPlane;
use crate::render::Render;

/// The contract's exit codes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Exit {
    /// The request succeeded.
    Ok = 0,
    /// An error reply, or the plane could not be reached.
    Error = 2,
    /// No (complete) answer within the timeout.
    Timeout = 3,
    /// Bad invocation.
    Usage = 64,
}

impl Exit {
    /// The exit code for a single-rig reply: `ok` true is 0, a `timeout` error 3, others 2.
    pub(crate) fn of_reply(reply: &Value) -> Exit {
        match (reply["ok"].as_bool(), reply["error"].as_str()) {
            (Some(true), _) => Exit::Ok,
            (_, Some("timeout")) => Exit::Timeout,
            _ => Exit::Error,
        }
    }
}

/// What a selector broadcast produced: one reply per broker that answered.
#[derive(Debug)]
pub(crate) struct Broadcast {
    /// The command id shared by every reply.
    pub(crate) id: String,
    /// Brokers expected to answer (the live `broker:*` keys).
    pub(crate) expected: Vec<String>,
    /// `{"id","ok","broker_id","matched","enqueued","failed"}` objects, in arrival order.
    pub(crate) replies: Vec<Value>,
    /// How long fleetctl waited.
    pub(crate) timeout: Duration,
}

impl Broadcast {
    /// Expected brokers that did not answer in time.
    pub(crate) fn missing(&self) -> Vec<&str> {
        let replied: BTreeSet<&str> = self
            .replies
            .iter()
            .filter_map(|r| r["broker_id"].as_str())
            .collect();
        self.expected
            .iter()
            .map(String::as_str)
            .filter(|b| !replied.contains(b))
            .collect()
    }

    /// 3 when a broker is missing, 2 when a broker or a rig failed, else 0.
    pub(crate) fn exit(&self) -> Exit {
        let failed = self.replies.iter().any(|r| {
            r["ok"].as_bool() != Some(true) || r["failed"].as_array().is_some_and(|f| !f.is_empty())
        });
        match (self.missing().is_empty(), failed) {
            (false, _) => Exit::Timeout,
            (true, true) => Exit::Error,
            (true, false) => Exit::Ok,
        }
    }
}

/// What both planes can do; each returns the contract's objects for [`render`] to print.
pub(crate) trait ControlPlane {
    /// `send RIG NAME`: the broker's reply, or a locally built `rig_not_connected`/`timeout`.
    fn send(
        &mut self,
        rig: &RigId,
        name: &str,
        args: &Map<String, Value>,
        timeout: Duration,
    ) -> anyhow::Result<Value>;
    /// `send --selector`: one reply per broker that answered in time.
    fn broadcast(
        &mut self,
        selector: &Selector,
        name: &str,
        args: &Map<String, Value>,
        timeout: Duration,
    ) -> anyhow::Result<Broadcast>;
    /// `kick RIG`: the broker's reply (the rig's socket closes with 1012).
    fn kick(&mut self, rig: &RigId, timeout: Duration) -> anyhow::Result<Value>;
    /// `status RIG`: an object with `ok: true`, or a `rig_not_connected` error reply.
    fn status(&mut self, rig: &RigId) -> anyhow::Result<Value>;
    /// `list`: one page from `cursor` ("0" for the first).
    fn list(&mut self, page_size: u64, cursor: &str) -> anyhow::Result<Page>;
    /// `brokers`: one object per broker.
    fn brokers(&mut self) -> anyhow::Result<Vec<Value>>;
    /// `events`: calls `each` per event until `limit` passes or `count` arrived; returns how
    /// many arrived.
    fn events(
        &mut self,
        limit: Option<Duration>,
        count: Option<u64>,
        each: &mut dyn FnMut(&Value),
    ) -> anyhow::Result<u64>;
}

/// One page of `list`.
#[derive(Debug)]
pub(crate) struct Page {
    /// One object per rig.
    pub(crate) rows: Vec<Value>,
    /// Cursor of the next page; None when this was the last.
    pub(crate) next_cursor: Option<String>,
    /// One broker's rows from its admin API, rather than the registry's: the table's columns,
    /// which an empty page cannot tell from its rows.
    pub(crate) admin: bool,
}

/// An error reply built by fleetctl itself (the same shape the brokers use, CONTRACT.md §4).
pub(crate) fn error_reply(id: Option<&str>, rig: Option<&str>, error: &str, detail: &str) -> Value {
    json!({"id": id, "ok": false, "error": error, "rig_id": rig, "detail": detail})
}

fn main() -> ExitCode {
    // SAFETY: restoring the default disposition of SIGPIPE before any thread starts, so
    // `fleetctl events | head` ends quietly instead of panicking on a closed stdout.
    unsafe { libc::signal(libc::SIGPIPE, libc::SIG_DFL) };
    let code = match Cli::load(std::env::args_os().collect()) {
        Ok((cli, plane)) => run(cli, plane).unwrap_or_else(|e| match e.downcast::<clap::Error>() {
            Ok(usage) => print_usage(&usage),
            Err(e) => {
                eprintln!("fleetctl: error: {e:#}");
                if timed_out(&e) {
                    Exit::Timeout
                } else {
                    Exit::Error
                }
            }
        }),
        Err(e) => print_usage(&e),
    };
    ExitCode::from(code as u8)
}

/// A wait for the control plane that ran out: exit 3, whichever request it was.
#[derive(Debug)]
pub(crate) struct TimedOut(pub(crate) String);

impl std::fmt::Display for TimedOut {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.0)
    }
}

impl std::error::Error for TimedOut {}

/// Whether an error is a wait that ran out (exit 3) rather than a refusal or an unreachable
/// plane (exit 2), wherever in its chain the wait ran out.
fn timed_out(e: &anyhow::Error) -> bool {
    e.chain().any(|cause| {
        cause.is::<TimedOut>()
            || cause.downcast_ref::<std::io::Error>().is_some_and(|io| {
                matches!(
                    io.kind(),
                    std::io::ErrorKind::TimedOut | std::io::ErrorKind::WouldBlock
                )
            })
            || cause
                .downcast_ref::<redis::RedisError>()
                .is_some_and(redis::RedisError::is_timeout)
    })
}

/// Prints a clap error (or help/version) and picks its exit code: 0 for help, else 64.
fn print_usage(e: &clap::Error) -> Exit {
    let _ = e.print();
    if e.use_stderr() {
        Exit::Usage
    } else {
        Exit::Ok
    }
}

fn run(cli: Cli, plane: Plane) -> anyhow::Result<Exit> {
    let mut plane: Box<dyn ControlPlane> = match plane {
        Plane::Redis(url) => Box::new(RedisPlane::new(&url)?),
        Plane::Admin(url) => Box::new(AdminPlane::new(url)),
    };
    let out = Render { json: cli.json };
    Ok(match cli.command {
        Command::Send(args) => match args.target()? {
            (Target::Rig(rig), name) => {
                out.reply(&plane.send(&rig, name, &args.args, args.timeout)?, "ok")
            }
            (Target::Selector(sel), name) => {
                out.broadcast(&plane.broadcast(&sel, name, &args.args, args.timeout)?)
            }
        },
        Command::Kick { rig, timeout } => out.reply(
            &plane.kick(&rig, timeout)?,
            "kicked (its socket closes with 1012)",
        ),
        Command::Status { rig } => out.status(&plane.status(&rig)?),
        Command::List { page_size, cursor } if cli.json => {
            // Lines of `--json` are rig objects, so a cursor has no line of its own: follow the
            // pages instead. SCAN may return a key twice; a rig is printed once.
            let mut seen = std::collections::HashSet::new();
            let mut cursor = cursor;
            loop {
                let page = plane.list(page_size, &cursor)?;
                for row in &page.rows {
                    if seen.insert(row["rig_id"].as_str().unwrap_or_default().to_owned()) {
                        println!("{row}");
                    }
                }
                match page.next_cursor {
                    None => break Exit::Ok,
                    Some(next) => cursor = next,
                }
            }
        }
        Command::List { page_size, cursor } => out.page(&plane.list(page_size, &cursor)?),
        Command::Brokers => out.brokers(&plane.brokers()?),
        Command::Events { count, for_ } => {
            match plane.events(for_, count, &mut |event| out.event(event))? {
                seen if count.is_some_and(|n| seen < n) => Exit::Timeout,
                _ => Exit::Ok,
            }
        }
    })
}
