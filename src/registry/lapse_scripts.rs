//! Fleet mode: the Redis side of the watch on sessions whose rigs left with commands unacked
//! (docs/protocol.md, "Sessions and resume"). Each such session is named in the sorted set
//! `sess:lapses` with the broker it left, so that it is reported `expired` as it lapses whether or
//! not that broker is still there then:
//!
//! - `lapse_watch.lua` names the sessions of rigs that just left;
//! - `session_lapse.lua` is that broker asking about one on time;
//! - `lapse_sweep.lua` is any broker asking about those whose broker stopped (or is late).
//!
//! All three are built behind `lua/lapse_end.lua`, which holds what they share.

use std::time::Duration;

use redis::{ConnectionLike, Script, Value};

use crate::ids::{BootId, RigId};
use crate::registry::scripts::{evalsha_many, RegistryError};

/// The sorted set naming the watched sessions.
pub const LAPSES_KEY: &str = "sess:lapses";

/// Most sessions named in one `lapse_watch.lua` call.
pub const WATCH_CHUNK: usize = 500;

const OWNER: &str = concat!(
    include_str!("../../lua/lapse_end.lua"),
    include_str!("../../lua/session_lapse.lua")
);
const WATCH: &str = concat!(
    include_str!("../../lua/lapse_end.lua"),
    include_str!("../../lua/lapse_watch.lua")
);
const SWEEP: &str = concat!(
    include_str!("../../lua/lease_holder.lua"),
    include_str!("../../lua/lapse_end.lua"),
    include_str!("../../lua/lapse_sweep.lua")
);

/// What `session_lapse.lua` found of a session whose rig left with commands unacked.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Lapse {
    /// Nothing left to watch: gone, ended by a newer boot, or the rig is back with this boot.
    Done,
    /// Seen since: this long left; ask again nearer its end.
    Later(Duration),
    /// Ended now: this many commands reported `expired`.
    Reported(u64),
}

/// When sessions are asked about and ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Timing {
    /// How near its end a session is ended.
    pub near: Duration,
    /// How long before its new end one seen since is asked about again.
    pub before: Duration,
    /// How overdue a session must be before a sweep asks about it though the broker it left
    /// still listens.
    pub grace: Duration,
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
    /// The broker the rig had left.
    pub owner: String,
}

/// One sweep's answer.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Sweep {
    /// Due entries looked at.
    pub looked: usize,
    /// Of those, how many were asked about (and so left the due ones).
    pub asked: usize,
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

fn ms(d: Duration) -> String {
    d.as_millis().clamp(1, 999_999_999_999_999).to_string()
}

impl LapseScripts {
    /// Names `sessions`, which just left `broker_id`, to be first asked about `delay` from now
    /// (Redis's clock), `sess:lapses` naming at most `most`, [`WATCH_CHUNK`] per call, in one round
    /// trip. Returns how many it could not name because `sess:lapses` was full, and how many a
    /// failed call left unnamed; `Err` when Redis itself failed (nothing is known).
    pub fn watch(
        &self,
        con: &mut impl ConnectionLike,
        sessions: &[(RigId, BootId)],
        broker_id: &str,
        delay: Duration,
        most: usize,
    ) -> Result<(u64, u64), RegistryError> {
        let (delay, most) = (ms(delay), most.to_string());
        let chunks: Vec<&[(RigId, BootId)]> = sessions.chunks(WATCH_CHUNK).collect();
        let replies = evalsha_many(
            con,
            &self.watch,
            &chunks,
            |_| 1,
            |call, chunk| {
                call.arg(LAPSES_KEY).arg(&delay).arg(&most).arg(broker_id);
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

    /// Asks, as the broker they left, about each session (rig, boot) (`session_lapse.lua`),
    /// in one round trip: one answer per session, None for one whose own call failed.
    pub fn ask_many(
        &self,
        con: &mut impl ConnectionLike,
        sessions: &[(RigId, BootId)],
        broker_id: &str,
        timing: Timing,
    ) -> Result<Vec<Option<Lapse>>, RegistryError> {
        let at = crate::reply::rfc3339(std::time::SystemTime::now());
        let (near, before) = (ms(timing.near), ms(timing.before));
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
                    .arg(&near)
                    .arg(&before);
            },
        )?;
        Ok(replies
            .into_iter()
            .map(|reply| match reply {
                Ok(Value::Int(n)) if n >= 0 => Some(Lapse::Reported(n as u64)),
                Ok(Value::Int(_)) => Some(Lapse::Done),
                Ok(Value::Array(left)) => match left.first() {
                    Some(Value::Int(ms)) => {
                        Some(Lapse::Later(Duration::from_millis((*ms).max(0) as u64)))
                    }
                    _ => None,
                },
                _ => None,
            })
            .collect())
    }

    /// Asks about up to `most` due sessions of brokers no longer there to (`lapse_sweep.lua`).
    pub fn sweep(
        &self,
        con: &mut impl ConnectionLike,
        broker_id: &str,
        timing: Timing,
        most: usize,
    ) -> Result<Sweep, RegistryError> {
        let at = crate::reply::rfc3339(std::time::SystemTime::now());
        let reply = self
            .sweep
            .key(LAPSES_KEY)
            .arg(broker_id)
            .arg(at)
            .arg(ms(timing.near))
            .arg(ms(timing.before))
            .arg(ms(timing.grace))
            .arg(most.max(1))
            .invoke::<Value>(con)?;
        parse_sweep(&reply)
            .ok_or_else(|| RegistryError::UnexpectedReply(format!("lapse_sweep: {reply:?}")))
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
    let looked = int(it.next()?)? as usize;
    let asked = int(it.next()?)? as usize;
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
        looked,
        asked,
        reported,
    })
}
