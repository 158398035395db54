//! Fleet mode: the Redis side of the watch on sessions holding commands unacked
//! (docs/protocol.md, "Sessions and resume"). Each is named in the sorted set `sess:lapses`
//! with the broker that kept its commands, so that they are reported `expired` as it lapses,
//! whether or not that broker is still there then:
//!
//! - `lapse_watch.lua` names the sessions of rigs that just left with commands unacked, and
//!   of rigs connected here whose connection had a command kept (those not named already);
//! - `session_lapse.lua` is the broker the rig left asking about one on time;
//! - `lapse_sweep.lua` is any broker asking about those that are due, which is a little
//!   later: those whose broker stopped, is stuck or late, or died with the rig still on it.
//!
//! All are built behind `lua/lease_holder.lua` and `lua/lapse_end.lua`, which holds what they
//! share.

use std::time::Duration;

use redis::{ConnectionLike, Script, Value};

use crate::ids::{BootId, RigId};
use crate::registry::scripts::{evalsha_many, RegistryError};
use crate::registry::sessions::ttl_ms;

/// The sorted set naming the watched sessions.
pub const LAPSES_KEY: &str = "sess:lapses";

/// Most sessions named in one `lapse_watch.lua` call.
pub const WATCH_CHUNK: usize = 500;

const OWNER: &str = concat!(
    include_str!("../../lua/before_event.lua"),
    include_str!("../../lua/lease_holder.lua"),
    include_str!("../../lua/lapse_end.lua"),
    include_str!("../../lua/session_lapse.lua")
);
const WATCH: &str = concat!(
    include_str!("../../lua/before_event.lua"),
    include_str!("../../lua/lease_holder.lua"),
    include_str!("../../lua/lapse_end.lua"),
    include_str!("../../lua/lapse_watch.lua")
);
const SWEEP: &str = concat!(
    include_str!("../../lua/before_event.lua"),
    include_str!("../../lua/lease_holder.lua"),
    include_str!("../../lua/lapse_end.lua"),
    include_str!("../../lua/lapse_sweep.lua")
);

/// What `session_lapse.lua` found of a session whose rig left with commands unacked.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Lapse {
    /// Nothing left for this broker to watch: no command unacked, ended by a newer boot, or
    /// the rig is connected with this boot (through a broker that is there; sweeps watch it).
    Done,
    /// The session was gone before it was asked about: it lapsed, or Redis lost it, with
    /// whatever it held unreported.
    Missed,
    /// Seen since: this long left; ask again nearer its end.
    Later(Duration),
    /// Ended now: this many commands reported `expired`.
    Reported(u64),
}

/// One session a sweep reported commands of, for a broker that stopped (or was late).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Swept {
    /// The session's rig.
    pub rig: RigId,
    /// The session's boot.
    pub boot: BootId,
    /// How many commands were reported `expired`.
    pub reported: u64,
    /// The broker that named it: the one the rig left, or the one it was connected to.
    pub owner: String,
}

/// One sweep's answer.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Sweep {
    /// Due sessions asked about.
    pub asked: usize,
    /// Of those, how many had lapsed (or Redis had lost them) before anyone asked.
    pub missed: u64,
    /// When the next one is due, if any is named.
    pub next: Option<Duration>,
    /// The sessions it reported commands of.
    pub reported: Vec<Swept>,
}

/// The three scripts, hashed once.
#[derive(Debug, Clone)]
pub struct LapseScripts {
    owner: Script,
    watch: Script,
    sweep: Script,
}

impl Default for LapseScripts {
    fn default() -> Self {
        Self {
            owner: Script::new(OWNER),
            watch: Script::new(WATCH),
            sweep: Script::new(SWEEP),
        }
    }
}

impl LapseScripts {
    /// Names `sessions`, which just left `broker_id` (which keeps sessions `ttl`), unless named
    /// already, [`WATCH_CHUNK`] per call, in one round trip. Returns how many it could not name
    /// because `sess:lapses` was full, and how many a failed call left unnamed; `Err` when
    /// Redis itself failed (nothing is known).
    pub fn watch(
        &self,
        con: &mut impl ConnectionLike,
        sessions: &[(RigId, BootId)],
        broker_id: &str,
        ttl: Duration,
    ) -> Result<(u64, u64), RegistryError> {
        self.name(con, sessions, broker_id, ttl, false)
    }

    /// [`Self::watch`] for `held` sessions: of rigs connected to `broker_id` when it queued
    /// them, whose session takes its TTL only while the rig's lease is still its own.
    pub fn name(
        &self,
        con: &mut impl ConnectionLike,
        sessions: &[(RigId, BootId)],
        broker_id: &str,
        ttl: Duration,
        held: bool,
    ) -> Result<(u64, u64), RegistryError> {
        let ttl = ttl_ms(ttl).to_string();
        let chunks: Vec<&[(RigId, BootId)]> = sessions.chunks(WATCH_CHUNK).collect();
        let replies = evalsha_many(
            con,
            &self.watch,
            &chunks,
            |_| 1,
            |call, chunk| {
                call.arg(LAPSES_KEY).arg(broker_id).arg(&ttl).arg(if held {
                    "held"
                } else {
                    "left"
                });
                for (rig, boot) in chunk.iter() {
                    call.arg(rig.as_str()).arg(boot.as_str());
                }
            },
        )?;
        let (mut refused, mut failed) = (0, 0);
        for (chunk, reply) in chunks.iter().zip(replies) {
            match reply {
                Ok(Value::Int(n)) => refused += n.max(0) as u64,
                _ => failed += chunk.len() as u64,
            }
        }
        Ok((refused, failed))
    }

    /// Asks, as the broker they left (which keeps sessions `ttl`), about each session (rig,
    /// boot) (`session_lapse.lua`), in one round trip: one answer per session, None for one
    /// whose own call failed.
    pub fn ask_many(
        &self,
        con: &mut impl ConnectionLike,
        sessions: &[(RigId, BootId)],
        broker_id: &str,
        ttl: Duration,
    ) -> Result<Vec<Option<Lapse>>, RegistryError> {
        let at = crate::reply::rfc3339(std::time::SystemTime::now());
        let ttl = ttl_ms(ttl).to_string();
        let replies = evalsha_many(
            con,
            &self.owner,
            sessions,
            |_| 1,
            |call, (rig, boot)| {
                call.arg(LAPSES_KEY)
                    .arg(rig.as_str())
                    .arg(boot.as_str())
                    .arg(broker_id)
                    .arg(&at)
                    .arg(&ttl);
            },
        )?;
        Ok(replies.into_iter().map(|r| lapse(r.ok())).collect())
    }

    /// Asks about up to `most` sessions that are due, whoever named them (`lapse_sweep.lua`):
    /// those whose broker did not ask in time.
    pub fn sweep(
        &self,
        con: &mut impl ConnectionLike,
        broker_id: &str,
        most: usize,
    ) -> Result<Sweep, RegistryError> {
        let at = crate::reply::rfc3339(std::time::SystemTime::now());
        let reply = self
            .sweep
            .key(LAPSES_KEY)
            .arg(broker_id)
            .arg(at)
            .arg(most.max(1))
            .invoke::<Value>(con)?;
        parse_sweep(&reply)
            .ok_or_else(|| RegistryError::UnexpectedReply(format!("lapse_sweep: {reply:?}")))
    }
}

/// `lapse_end`'s answer (lua/lapse_end.lua) as the broker the rig left reads it.
fn lapse(reply: Option<Value>) -> Option<Lapse> {
    match reply? {
        Value::Int(n) if n >= 0 => Some(Lapse::Reported(n as u64)),
        Value::Int(-2) => Some(Lapse::Missed),
        Value::Int(_) => Some(Lapse::Done),
        Value::Array(a) => match a.as_slice() {
            [Value::Int(ms)] => Some(Lapse::Later(Duration::from_millis((*ms).max(0) as u64))),
            [Value::Int(_), Value::Int(_)] => Some(Lapse::Done),
            _ => None,
        },
        _ => None,
    }
}

fn parse_sweep(v: &Value) -> Option<Sweep> {
    let Value::Array(items) = v else { return None };
    let int = |v: &Value| match v {
        Value::Int(n) => Some((*n).max(0) as u64),
        _ => None,
    };
    let text = |v: &Value| match v {
        Value::BulkString(b) => std::str::from_utf8(b).ok().map(str::to_string),
        _ => None,
    };
    let mut it = items.iter();
    let asked = int(it.next()?)? as usize;
    let missed = int(it.next()?)?;
    let next = match it.next()? {
        Value::Int(ms) if *ms >= 0 => Some(Duration::from_millis(*ms as u64)),
        Value::Int(_) => None,
        _ => return None,
    };
    let rest: Vec<&Value> = it.collect();
    let mut reported = Vec::new();
    for entry in rest.chunks(4) {
        let [rig, boot, n, owner] = entry else {
            return None;
        };
        reported.push(Swept {
            rig: RigId::parse(&text(rig)?)?,
            boot: BootId::parse(&text(boot)?)?,
            reported: int(n)?,
            owner: text(owner)?,
        });
    }
    Some(Sweep {
        asked,
        missed,
        next,
        reported,
    })
}
