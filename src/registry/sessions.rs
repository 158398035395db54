//! Durable rig sessions in Redis (fleet mode, CONTRACT.md §5): every command enqueued for a
//! session is kept under `sess:<rig_id>:<boot_id>` until the rig acks it, so the session can
//! resume on any broker, including after its old broker died.
//!
//! - `persist.lua` adds commands, fenced by the lease: a broker that lost the rig cannot add.
//! - `resume.lua` tells a hello what its session holds, and hands back the unacked commands
//!   of the rig's previous boot (reported `rig_rebooted`, never replayed).
//! - `rekeep.lua` puts a session back after Redis lost it (it restarted empty) or missed
//!   commands (delivered while it was away): a connected rig's fenced like `persist.lua`, a
//!   session parked here for a disconnected rig only where no one else holds the rig.
//! - Acks delete with a plain `HDEL`, sent in paced batches by the bridge's Redis I/O
//!   (`fleet/writes.rs`): Redis kept the acked command under its seq before the rig had it.
//!   Not so for a seq delivered while Redis was away, which another broker may have given a
//!   command of its own in Redis: `forget.lua` removes that seq only where it holds the
//!   acked command, and publishes any other command there `lost`.

use std::time::Duration;

use redis::{ConnectionLike, Script, Value};

use crate::ids::{BootId, RigId, Seq};
use crate::registry::msg::Recall;
use crate::registry::scripts::{evalsha_chunks, only, rig_key, tuple, RegistryError};

/// `persist.lua`, which keeps commands in their sessions (and, since a fan-out's keeps should
/// not wait behind them, names no session in `sess:lapses`: `bridge/lapses.rs` does that).
pub const PERSIST: &str = include_str!("../../lua/persist.lua");

/// `resume.lua` as Redis runs it: behind the guard its events are published after.
pub const RESUME: &str = concat!(
    include_str!("../../lua/before_event.lua"),
    include_str!("../../lua/resume.lua")
);

/// `rekeep.lua` as Redis runs it, behind the same guard.
pub const REKEEP: &str = concat!(
    include_str!("../../lua/before_event.lua"),
    include_str!("../../lua/rekeep.lua")
);

/// `forget.lua` as Redis runs it, behind the same guard.
const FORGET: &str = concat!(
    include_str!("../../lua/before_event.lua"),
    include_str!("../../lua/forget.lua")
);

/// Commands sent in one persist call.
pub const PERSIST_CHUNK: usize = 500;
/// Most sessions read in one `resume.lua` call. A new session costs the script 5 writes and
/// reads; one with commands to hand back or a reboot to report, more: 128 keeps a call to about
/// a millisecond of Redis time.
pub const RESUME_CHUNK: usize = 128;
/// Sessions put back per round trip after Redis lost them.
pub const REKEEP_CHUNK: usize = 100;
/// Sessions whose TTL one round trip extends.
pub const TOUCH_CHUNK: usize = 1000;

/// A session's key.
pub fn session_key(rig: &RigId, boot: &BootId) -> String {
    format!("sess:{rig}:{boot}")
}

/// The pointer to a rig's latest session.
pub fn pointer_key(rig: &RigId) -> String {
    format!("sessof:{rig}")
}

/// One command to keep.
#[derive(Debug, Clone)]
pub struct Persist<'a> {
    /// The rig.
    pub rig: &'a RigId,
    /// Its session's boot.
    pub boot: &'a BootId,
    /// The command's seq.
    pub seq: Seq,
    /// The command as sent to the rig.
    pub json: &'a [u8],
}

/// What a hello found in Redis.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Resumed {
    /// The session's next seq, None when the session is new.
    pub next: Option<Seq>,
    /// Its unacked commands, by seq.
    pub commands: Vec<(Seq, Vec<u8>)>,
    /// Unacked commands of the previous boot's session, which the script reported
    /// `rig_rebooted` on `fleetlink:events` as it deleted the session.
    pub rebooted: u64,
    /// That previous boot.
    pub previous_boot: Option<String>,
    /// What the session's last broker wrote of it at the rig's disconnect (its `r` field).
    pub recall: Option<Recall>,
}

/// The session's `r` field: what a broker remembers of a session besides its commands,
/// written when its rig disconnects so that a resume on another broker has it too. A small
/// JSON object, `{"a":last_ack,"t":last_ack_ms,"r":[[seq,id],…]}` (ids at most 256 bytes,
/// at most 16 of them).
pub fn encode_recall(recall: &Recall) -> String {
    let results: Vec<(u64, &str)> = recall.results.iter().map(|(s, id)| (s.0, &**id)).collect();
    serde_json::json!({"a": recall.last_ack.0, "t": recall.last_ack_ms, "r": results}).to_string()
}

/// Reads an `r` field; None when it is not one [`encode_recall`] wrote.
pub fn decode_recall(text: &[u8]) -> Option<Recall> {
    #[derive(serde::Deserialize)]
    struct Field {
        a: u64,
        t: u64,
        r: Vec<(u64, String)>,
    }
    let f: Field = serde_json::from_slice(text).ok()?;
    Some(Recall {
        results: f.r.into_iter().map(|(s, id)| (Seq(s), id.into())).collect(),
        last_ack: Seq(f.a),
        last_ack_ms: f.t,
    })
}

/// Writes what a broker remembers of these sessions into them (`r`), and gives each its TTL
/// afresh as a release does, [`TOUCH_CHUNK`] sessions per round trip.
pub fn remember(
    con: &mut impl ConnectionLike,
    sessions: &[(RigId, BootId, String)],
    ttl: Duration,
) -> Result<(), RegistryError> {
    let ms = ttl_ms(ttl) as i64;
    for chunk in sessions.chunks(TOUCH_CHUNK) {
        let mut pipe = redis::pipe();
        for (rig, boot, recall) in chunk {
            let key = session_key(rig, boot);
            pipe.hset(&key, "r", recall)
                .ignore()
                .pexpire(&key, ms)
                .ignore();
        }
        pipe.query::<()>(con)?;
    }
    Ok(())
}

/// A rig's session as its broker holds it, to put back into Redis.
#[derive(Debug, Clone)]
pub struct Rekeep<'a> {
    /// The rig.
    pub rig: &'a RigId,
    /// Its session's boot.
    pub boot: &'a BootId,
    /// The session's next seq.
    pub next: Seq,
    /// Its commands not yet acked, as sent to the rig.
    pub cmds: Vec<(Seq, &'a [u8])>,
    /// The seqs among them Redis may never have kept: a command outside them that Redis
    /// has forgotten below its `next` was acked (a connected rig's copy too, since stop 62).
    pub unkept: Unkept,
    /// How it is fenced.
    pub mode: RekeepMode,
}

/// The seqs of a session its broker delivered while Redis was away, and has not put back
/// since (`rekeep.lua`'s `unkept_from` and `unkept_to`). A connection delivers in seq order,
/// so they are one range; two outages without a put-back between make it wider, which only
/// counts a kept command as unkept (the cautious side).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct Unkept {
    /// The lowest.
    pub from: Seq,
    /// The highest; `Seq(0)` when there are none.
    pub to: Seq,
}

impl Unkept {
    /// None: Redis kept all of them.
    pub const NONE: Unkept = Unkept {
        from: Seq(0),
        to: Seq(0),
    };

    /// Every seq up to `to`: where only the highest is known (Redis lost keys, and with them
    /// whatever it had kept of the session).
    pub fn up_to(to: Seq) -> Unkept {
        Unkept { from: Seq(0), to }
    }

    /// Whether there are none.
    pub fn is_none(&self) -> bool {
        self.to == Seq(0)
    }

    /// Whether `seq` is among these.
    pub fn holds(&self, seq: Seq) -> bool {
        !self.is_none() && self.from <= seq && seq <= self.to
    }

    /// These and `seq`.
    pub fn with(self, seq: Seq) -> Unkept {
        self.union(Unkept { from: seq, to: seq })
    }

    /// These and `other`'s.
    pub fn union(self, other: Unkept) -> Unkept {
        if self.is_none() {
            other
        } else if other.is_none() {
            self
        } else {
            Unkept {
                from: self.from.min(other.from),
                to: self.to.max(other.to),
            }
        }
    }
}

/// Whose session a [`Rekeep`] is, which decides how `rekeep.lua` fences it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum RekeepMode {
    /// A rig connected here: written only under its lease.
    Live,
    /// The rig is not connected here: the broker holds the session parked for its return, and
    /// its lease was released (or lost). Then no lease is ours to fence by, and the session
    /// is written only where no one else holds the rig.
    Parked,
    /// A session parked here that this newer boot of the rig ended, its hello decided here
    /// while Redis was away: reported, what no report has covered yet, and never written back.
    EndedBy(BootId),
}

impl RekeepMode {
    /// Not a connected rig's: fenced as a parked session is.
    pub fn parked(self) -> bool {
        self != RekeepMode::Live
    }
}

/// What `rekeep.lua` did with one session.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Rekept {
    /// Written.
    Kept,
    /// Written, and the session's next seq in Redis was already this one, above the one
    /// sent: another broker numbered commands of the session meanwhile (each deciding alone
    /// during an outage), and the rig's next command must take this seq or a later one.
    Behind(Seq),
    /// Refused by the fence: someone else holds the rig, or wrote its session since.
    Fenced,
    /// A parked session whose rig went on with the same boot on another broker while Redis
    /// was away: what it held that Redis lacked was added, and the session's next seq raised.
    Merged,
    /// A parked session that a newer boot of its rig ended: this many of its commands, which
    /// no report had covered yet, were published `rig_rebooted` (CONTRACT.md §5).
    Reported(u64),
}

/// `rekeep.lua`'s answer for one session in full.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RekeepAnswer {
    /// What became of the session.
    pub status: Rekept,
    /// The copy's commands gone from the session for good, which its broker drops from the
    /// copy: published `lost` (their seqs went to other commands the rig acked, or holds), or
    /// settled (Redis kept them, and the rig acked them on another broker since).
    pub dropped: Vec<Seq>,
    /// A connected rig's copy written ([`Rekept::Kept`]) into a session key that did not
    /// exist: Redis lost the session again after the copy was made, and with it any command
    /// the copy left to its own keep that was kept meanwhile.
    pub anew: bool,
}

/// The session scripts.
#[derive(Debug, Clone)]
pub struct SessionScripts {
    persist: Script,
    resume: Script,
    rekeep: Script,
    forget: Script,
}

/// The removal of an acked command its broker delivered while Redis was away: the seq may name
/// another command in Redis (`forget.lua`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CheckedForget {
    /// The rig.
    pub rig: RigId,
    /// Its session's boot.
    pub boot: BootId,
    /// The acked command's seq.
    pub seq: Seq,
    /// The acked command's id: another id under `seq` in Redis is another command.
    pub id: Box<str>,
    /// The ack may be another command's (reported `lost` by the core): another command under
    /// `seq` is left as it is, and the seq is not marked acked with this one.
    pub doubtful: bool,
}

/// Most removals in one `forget.lua` call.
const FORGET_CHUNK: usize = 500;

impl Default for SessionScripts {
    fn default() -> Self {
        Self::new()
    }
}

impl SessionScripts {
    /// Hashes the embedded scripts.
    pub fn new() -> Self {
        Self {
            persist: Script::new(PERSIST),
            resume: Script::new(RESUME),
            rekeep: Script::new(REKEEP),
            forget: Script::new(FORGET),
        }
    }

    /// Removes `forgets` from their sessions, each only where Redis holds the very command
    /// under its seq or nothing; another command there is published `lost` by `forget.lua`
    /// (`at` stamps those events) and removed too. Returns how many were published.
    pub fn forget_checked(
        &self,
        con: &mut impl ConnectionLike,
        forgets: &[CheckedForget],
        broker_id: &str,
        at: &str,
        ttl: Duration,
    ) -> Result<u64, RegistryError> {
        let mut lost = 0;
        for chunk in forgets.chunks(FORGET_CHUNK) {
            let mut call = self.forget.prepare_invoke();
            for f in chunk {
                call.key(session_key(&f.rig, &f.boot));
            }
            call.arg(broker_id).arg(at).arg(ttl_ms(ttl));
            for f in chunk {
                call.arg(f.rig.as_str())
                    .arg(f.boot.to_string())
                    .arg(f.seq.0)
                    .arg(&*f.id)
                    .arg(if f.doubtful { "doubtful" } else { "acked" });
            }
            lost += call.invoke::<u64>(con)?;
        }
        Ok(lost)
    }

    /// Puts `sessions` back into Redis, each fenced by `broker_id`'s lease (a parked one as
    /// `rekeep.lua` says), [`REKEEP_CHUNK`] script calls per round trip; one status per
    /// session. `at` stamps the `rig_rebooted` events of a parked session a newer boot ended.
    pub fn rekeep(
        &self,
        con: &mut impl ConnectionLike,
        sessions: &[Rekeep<'_>],
        broker_id: &str,
        ttl: Duration,
        at: &str,
    ) -> Result<Vec<Rekept>, RegistryError> {
        let answers = self.rekeep_answers(con, sessions, broker_id, ttl, at)?;
        Ok(answers.into_iter().map(|a| a.status).collect())
    }

    /// [`Self::rekeep`], with the commands of each copy gone for good (published `lost`, or
    /// acked elsewhere).
    pub fn rekeep_answers(
        &self,
        con: &mut impl ConnectionLike,
        sessions: &[Rekeep<'_>],
        broker_id: &str,
        ttl: Duration,
        at: &str,
    ) -> Result<Vec<RekeepAnswer>, RegistryError> {
        // A pipeline of EVALSHAs does not load a missing script by itself (Script::invoke
        // does); this rare path loads it first instead.
        self.rekeep.prepare_invoke().load(con)?;
        let mut out = Vec::with_capacity(sessions.len());
        for chunk in sessions.chunks(REKEEP_CHUNK) {
            let mut pipe = redis::pipe();
            for s in chunk {
                let call = pipe
                    .cmd("EVALSHA")
                    .arg(self.rekeep.get_hash())
                    .arg(3)
                    .arg(rig_key(s.rig))
                    .arg(session_key(s.rig, s.boot))
                    .arg(pointer_key(s.rig))
                    .arg(ttl_ms(ttl))
                    .arg(tuple(s.boot, broker_id))
                    .arg(s.next.0)
                    .arg(match s.mode {
                        RekeepMode::Live => "live".to_string(),
                        RekeepMode::Parked => "parked".to_string(),
                        RekeepMode::EndedBy(boot) => format!("ended|{boot}"),
                    })
                    .arg(at)
                    .arg(s.unkept.to.0)
                    .arg(s.unkept.from.0);
                for (seq, json) in &s.cmds {
                    call.arg(seq.0).arg(*json);
                }
            }
            let replies: Vec<Value> = pipe.query(con)?;
            for reply in &replies {
                out.push(
                    kept(reply).ok_or_else(|| {
                        RegistryError::UnexpectedReply(format!("rekeep: {reply:?}"))
                    })?,
                );
            }
        }
        Ok(out)
    }

    /// Keeps `cmds` (each fenced by `broker_id`'s lease); one status per command.
    pub fn persist(
        &self,
        con: &mut impl ConnectionLike,
        cmds: &[Persist<'_>],
        broker_id: &str,
        ttl: Duration,
    ) -> Result<Vec<Kept>, RegistryError> {
        let mut out = Vec::with_capacity(cmds.len());
        for chunk in cmds.chunks(PERSIST_CHUNK) {
            let mut call = self.persist.prepare_invoke();
            call.arg(ttl_ms(ttl));
            for c in chunk {
                call.key(rig_key(c.rig)).key(session_key(c.rig, c.boot));
                call.arg(tuple(c.boot, broker_id)).arg(c.seq.0).arg(c.json);
            }
            let reply: Value = call.invoke(con)?;
            let parsed = match &reply {
                Value::Array(items) if items.len() == chunk.len() => {
                    items.iter().map(persisted).collect::<Option<Vec<_>>>()
                }
                _ => None,
            };
            out.extend(
                parsed
                    .ok_or_else(|| RegistryError::UnexpectedReply(format!("persist: {reply:?}")))?,
            );
        }
        Ok(out)
    }

    /// Reads (and claims) the session of `boot` at its hello; `broker_id` (the caller) is
    /// named in the `rig_rebooted` events the script publishes for an older boot's session.
    pub fn resume(
        &self,
        con: &mut impl ConnectionLike,
        rig: &RigId,
        boot: &BootId,
        ttl: Duration,
        broker_id: &str,
    ) -> Result<Resumed, RegistryError> {
        only(
            self.resume_many(con, &[(rig, boot)], ttl, broker_id)?,
            "resume",
        )
    }

    /// [`Self::resume`] for many sessions in one round trip: one `resume.lua` call per
    /// [`RESUME_CHUNK`] sessions, pipelined (run in order). One result per entry, in order; a
    /// call's error fails the entries of its chunk alone.
    pub fn resume_many(
        &self,
        con: &mut impl ConnectionLike,
        entries: &[(&RigId, &BootId)],
        ttl: Duration,
        broker_id: &str,
    ) -> Result<Vec<Result<Resumed, RegistryError>>, RegistryError> {
        let ttl = ttl_ms(ttl);
        let at = crate::reply::rfc3339(std::time::SystemTime::now());
        evalsha_chunks(
            con,
            &self.resume,
            "resume",
            entries,
            RESUME_CHUNK,
            2,
            |call, chunk| {
                for (rig, boot) in chunk {
                    call.arg(session_key(rig, boot)).arg(pointer_key(rig));
                }
                call.arg(ttl).arg(broker_id).arg(&at);
                for (rig, boot) in chunk {
                    call.arg(boot.as_str()).arg(rig.as_str());
                }
            },
            |entry| {
                parse_resumed(entry)
                    .ok_or_else(|| RegistryError::UnexpectedReply(format!("resume: {entry:?}")))
            },
        )
    }
}

fn parse_resumed(reply: &Value) -> Option<Resumed> {
    let Value::Array(items) = reply else {
        return None;
    };
    let [next, cmds, rebooted, previous, recall] = items.as_slice() else {
        return None;
    };
    let next: u64 = text(next)?.parse().ok()?;
    let Value::Array(cmds) = cmds else {
        return None;
    };
    let rebooted = match rebooted {
        Value::Int(n) => u64::try_from(*n).ok()?,
        _ => return None,
    };
    let mut commands = Vec::with_capacity(cmds.len() / 2);
    for pair in cmds.chunks(2) {
        let [seq, json] = pair else { return None };
        commands.push((Seq(text(seq)?.parse().ok()?), bytes(json)?));
    }
    commands.sort_by_key(|(seq, _)| *seq);
    let previous = text(previous)?;
    Some(Resumed {
        next: (next > 0).then_some(Seq(next)),
        commands,
        rebooted,
        previous_boot: (!previous.is_empty()).then(|| previous.to_string()),
        // Unreadable, it is as if never written: the resume goes on without it.
        recall: bytes(recall).and_then(|b| decode_recall(&b)),
    })
}

/// What `persist.lua` did with one command.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Kept {
    /// Kept in its session under our lease.
    Yes,
    /// Kept, in a session key this command created: Redis had lost the session of a rig this
    /// broker holds (a key deleted or evicted on its own), so what else it held is gone.
    Anew,
    /// Not kept: another broker's lease.
    Fenced,
    /// Not kept: no lease at all (Redis lost it); the holder may put it back and retry.
    LeaseMissing,
    /// Not kept: the session's next seq in Redis is already this one, above the command's:
    /// another broker numbered commands of the session while this one could not reach Redis.
    Stale(Seq),
    /// Not the script's answer: Redis went away while the bridge was putting the lease back,
    /// so the command goes out unkept, as every command does while Redis is away.
    Unavailable,
}

fn persisted(v: &Value) -> Option<Kept> {
    match text(v)? {
        "ok" => Some(Kept::Yes),
        "created" => Some(Kept::Anew),
        "fenced" => Some(Kept::Fenced),
        "missing" => Some(Kept::LeaseMissing),
        other => match other.split_once('|')? {
            ("stale", n) => n.parse().ok().map(|n| Kept::Stale(Seq(n))),
            _ => None,
        },
    }
}

/// `rekeep.lua`'s answer for one session; None for an answer it never gives.
fn kept(v: &Value) -> Option<RekeepAnswer> {
    let (status, dropped) = match text(v)?.split_once(';') {
        Some((status, seqs)) => {
            let dropped = seqs
                .split(',')
                .map(|n| n.parse().ok().map(Seq))
                .collect::<Option<Vec<Seq>>>()?;
            (status, dropped)
        }
        None => (text(v)?, Vec::new()),
    };
    let anew = status == "anew";
    let status = match status {
        "ok" | "anew" => Rekept::Kept,
        "fenced" => Rekept::Fenced,
        "merged" => Rekept::Merged,
        other => match other.split_once('|')? {
            ("reported", n) => Rekept::Reported(n.parse().ok()?),
            ("ok", n) => Rekept::Behind(Seq(n.parse().ok()?)),
            _ => return None,
        },
    };
    Some(RekeepAnswer {
        status,
        dropped,
        anew,
    })
}

/// The commands a session in Redis holds under `seqs` (those it lacks are left out), in seq
/// order: what another broker gave the rig while this one could not reach Redis, for the
/// rig's live connection here to be given too. Bounded by the caller's range.
pub fn read_commands(
    con: &mut impl ConnectionLike,
    rig: &RigId,
    boot: &BootId,
    seqs: std::ops::Range<u64>,
) -> Result<Vec<(Seq, Vec<u8>)>, RegistryError> {
    if seqs.is_empty() {
        return Ok(Vec::new());
    }
    let mut cmd = redis::cmd("HMGET");
    cmd.arg(session_key(rig, boot));
    for seq in seqs.clone() {
        cmd.arg(format!("c:{seq}"));
    }
    let found: Vec<Option<Vec<u8>>> = cmd.query(con)?;
    Ok(seqs
        .zip(found)
        .filter_map(|(seq, json)| json.map(|j| (Seq(seq), j)))
        .collect())
}

/// What [`touch`] found gone.
#[derive(Debug, Default, PartialEq, Eq)]
pub struct Touched {
    /// Sessions whose key was missing: Redis lost them while their rigs were connected. The
    /// key stays missing; the caller puts the session back.
    pub missing: Vec<(RigId, BootId)>,
    /// `sessof:` pointers that were missing and were written again, naming the touched boot.
    pub pointers_restored: usize,
}

/// Extends the TTL of these sessions' keys and of their rigs' `sessof:` pointers,
/// [`TOUCH_CHUNK`] sessions per round trip. A missing pointer is written again (only where
/// none is: a newer boot's, written meanwhile, stays): without it, the rig's next boot would
/// find no session to report `rig_rebooted`, and its commands would come out `expired` a TTL
/// later.
pub fn touch(
    con: &mut impl ConnectionLike,
    sessions: &[(RigId, BootId)],
    ttl: Duration,
) -> Result<Touched, RegistryError> {
    let ms = ttl_ms(ttl) as i64;
    let mut touched = Touched::default();
    for chunk in sessions.chunks(TOUCH_CHUNK) {
        let mut pipe = redis::pipe();
        for (rig, boot) in chunk {
            pipe.pexpire(session_key(rig, boot), ms)
                .cmd("SET")
                .arg(pointer_key(rig))
                .arg(boot.as_str())
                .arg("NX")
                .arg("PX")
                .arg(ms)
                .pexpire(pointer_key(rig), ms)
                .ignore();
        }
        let found: Vec<(bool, Option<String>)> = pipe.query(con)?;
        for (s, (kept, restored)) in chunk.iter().zip(found) {
            if !kept {
                touched.missing.push(s.clone());
            }
            touched.pointers_restored += usize::from(restored.is_some());
        }
    }
    Ok(touched)
}

fn text(v: &Value) -> Option<&str> {
    match v {
        Value::BulkString(b) => std::str::from_utf8(b).ok(),
        Value::SimpleString(s) => Some(s),
        _ => None,
    }
}

fn bytes(v: &Value) -> Option<Vec<u8>> {
    match v {
        Value::BulkString(b) => Some(b.clone()),
        _ => None,
    }
}

/// A TTL as the scripts take it: whole ms, 1 to 15 digits.
pub(crate) fn ttl_ms(ttl: Duration) -> u128 {
    ttl.as_millis().clamp(1, 999_999_999_999_999)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Seqs delivered unkept grow one range from none; a range meets another, or every seq
    /// up to a last (Redis lost keys), as the range spanning both.
    #[test]
    fn unkept_seqs_are_one_range_spanning_all_of_them() {
        let r = Unkept::NONE.with(Seq(7)).with(Seq(5)).with(Seq(9));
        assert_eq!(
            r,
            Unkept {
                from: Seq(5),
                to: Seq(9)
            }
        );
        assert!(Unkept::NONE.is_none() && !r.is_none());
        assert_eq!(r.union(Unkept::NONE), r);
        assert_eq!(Unkept::NONE.union(r), r);
        assert_eq!(r.union(Unkept::up_to(Seq(6))), Unkept::up_to(Seq(9)));
    }
}
