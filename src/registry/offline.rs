//! Commands held for rigs that are not connected (`queue_if_offline` + `ttl_ms`, CONTRACT.md
//! §5). Fleet mode keeps them in Redis (`offline:<rig_id>`, a bounded list) so any broker can
//! deliver them at the rig's next hello; standalone keeps them in the bridge. Either way each
//! ends as delivered (then acked/result like any command) or `expired`.

use std::cmp::Reverse;
use std::collections::{BinaryHeap, HashMap, VecDeque};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use redis::{ConnectionLike, Script};
use serde::{Deserialize, Serialize};

use crate::args::Args;
use crate::ids::RigId;
use crate::registry::scripts::{evalsha_many, RegistryError};

/// Most commands held per rig.
pub const MAX_PER_RIG: usize = 1000;
/// Longest `ttl_ms` accepted (a day).
pub const MAX_TTL: Duration = Duration::from_secs(24 * 3600);
/// How long a rig's list outlives its latest deadline in Redis. The broker that held a command
/// removes it at its deadline and reports it `expired`; had Redis dropped the list at that very
/// moment, there would be nothing to remove and no report. A rig that connects within the
/// margin finds the command expired at delivery and it is reported then.
pub const LIST_GRACE: Duration = Duration::from_secs(60);

/// One held command, as stored.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
pub struct Held {
    /// Control's command id.
    pub id: String,
    /// Command name.
    pub name: String,
    /// Command args.
    pub args: Args,
    /// Unix ms after which it expires.
    pub deadline_ms: u64,
    /// Control's reply channel, if any (events carry the outcome; this is for the record).
    #[serde(default)]
    pub reply_to: Option<String>,
}

impl Held {
    /// About the bytes it holds: what [`Deadlines::MAX_BYTES`] counts.
    pub fn size(&self) -> usize {
        let args = self.args.len();
        self.id.len() + self.name.len() + args + self.reply_to.as_ref().map_or(0, String::len)
    }

    /// The same command without its payload: all a deadline needs of a command this broker
    /// holds itself (the id to remove and report), so the payload is not kept twice.
    pub fn stub(&self) -> Held {
        Held {
            id: self.id.clone(),
            name: String::new(),
            args: Args::null(),
            deadline_ms: self.deadline_ms,
            reply_to: None,
        }
    }

    /// Whether it expired at `now_ms`.
    pub fn expired(&self, now_ms: u64) -> bool {
        self.deadline_ms <= now_ms
    }
}

/// Unix time in ms.
pub fn unix_ms() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_millis() as u64)
}

/// The Redis key of a rig's held commands.
pub fn offline_key(rig: &RigId) -> String {
    format!("offline:{rig}")
}

/// The Redis key of the marks `offline_expire.lua` leaves of the rig's commands it removed.
pub fn expired_key(rig: &RigId) -> String {
    format!("offline:expired:{rig}")
}

/// Redis side (fleet mode).
#[derive(Debug, Clone)]
pub struct OfflineScripts {
    push: Script,
    put_back: Script,
    take: Script,
    expire: Script,
    due: Script,
}

/// The sorted set of held commands' deadlines that exiting brokers handed to Redis, for any
/// broker to report (`offline_due.lua`). Two colons: no rig's list (`offline:<rig_id>`, an id
/// has none) and no `offline:expired:` or `offline:for:` key can be named so.
pub const DUE_KEY: &str = "offline:due:handed";

/// Most handed-over deadlines one `offline_due.lua` call takes.
pub const DUE_MOST: usize = 1_000;

/// Most `offline_due.lua` calls a broker makes a second: 20,000 deadlines a second from one
/// broker, so a full hand-off of a million is reported in 50 s, inside the minute the rigs'
/// lists outlast their last deadline (at one call a second, bb110 saw 10,000 of 70,000
/// deadlines outlive their lists unreported).
pub const DUE_CALLS: usize = 20;

/// `offline_push.lua` as Redis runs it: behind the lease check it shares with
/// `offline_return.lua` (a script can call no other).
pub const PUSH: &str = concat!(
    include_str!("../../lua/lease_holder.lua"),
    include_str!("../../lua/offline_push.lua")
);

/// `offline_due.lua` as Redis runs it: behind the guard its events are published after.
const DUE: &str = concat!(
    include_str!("../../lua/before_event.lua"),
    include_str!("../../lua/offline_due.lua")
);

/// `offline_return.lua` as Redis runs it, behind the same lease check.
const RETURN: &str = concat!(
    include_str!("../../lua/lease_holder.lua"),
    include_str!("../../lua/offline_return.lua")
);

impl Default for OfflineScripts {
    fn default() -> Self {
        Self {
            push: Script::new(PUSH),
            put_back: Script::new(RETURN),
            take: Script::new(include_str!("../../lua/offline_take.lua")),
            expire: Script::new(include_str!("../../lua/offline_expire.lua")),
            due: Script::new(DUE),
        }
    }
}

/// What asking Redis to hold a command came to.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Pushed {
    /// Held for the rig's next hello.
    Held,
    /// Not held: the rig's list is full.
    Full,
    /// Not held: the rig is connected to this other, live broker (its lease says so).
    ConnectedAt(String),
}

impl OfflineScripts {
    /// Holds `entry` for `rig`, asked by broker `broker_id`.
    pub fn push(
        &self,
        con: &mut impl ConnectionLike,
        rig: &RigId,
        entry: &Held,
        ttl: Duration,
        broker_id: &str,
    ) -> Result<Pushed, RegistryError> {
        let mut stored = self.push_many(con, &[(rig, entry, ttl)], broker_id)?;
        stored.pop().unwrap_or(Ok(Pushed::Full))
    }

    /// Holds many entries in one round trip (a pipeline, run in order): per entry, what came
    /// of it, or its own error.
    pub fn push_many(
        &self,
        con: &mut impl ConnectionLike,
        entries: &[(&RigId, &Held, Duration)],
        broker_id: &str,
    ) -> Result<Vec<Result<Pushed, RegistryError>>, RegistryError> {
        let replies = evalsha_many(
            con,
            &self.push,
            entries,
            |_| 2,
            |call, (rig, entry, ttl)| {
                call.arg(offline_key(rig))
                    .arg(crate::registry::scripts::rig_key(rig))
                    .arg(serde_json::to_string(entry).unwrap_or_default())
                    .arg(MAX_PER_RIG)
                    .arg(
                        (*ttl + LIST_GRACE)
                            .as_millis()
                            .clamp(1, 999_999_999_999_999) as u64,
                    )
                    .arg(broker_id);
            },
        )?;
        Ok(replies
            .into_iter()
            .map(|reply| match reply? {
                redis::Value::Int(len) if len > 0 => Ok(Pushed::Held),
                redis::Value::Int(_) => Ok(Pushed::Full),
                redis::Value::BulkString(holder) => Ok(Pushed::ConnectedAt(
                    String::from_utf8_lossy(&holder).into_owned(),
                )),
                other => Err(RegistryError::UnexpectedReply(format!(
                    "offline_push: {other:?}"
                ))),
            })
            .collect())
    }

    /// Takes the first held commands of each of `rigs`, at most `max` of them, in one round
    /// trip (one transaction of LRANGE + LTRIM per rig, plain commands: a storm's hellos cost
    /// Redis no script call each): what a new connection's outbox takes at once. The rest stay
    /// in Redis, where the connection takes them as it makes room (by bytes too), and where a
    /// broker killed meanwhile leaves them. One list per rig, in order.
    pub fn take_many(
        &self,
        con: &mut impl ConnectionLike,
        rigs: &[&RigId],
        max: usize,
    ) -> Result<Vec<Vec<Held>>, RegistryError> {
        if rigs.is_empty() {
            return Ok(Vec::new());
        }
        let max = max.max(1) as isize;
        let mut pipe = redis::pipe();
        pipe.atomic();
        for rig in rigs {
            let key = offline_key(rig);
            pipe.lrange(&key, 0, max - 1).ltrim(&key, max, -1);
        }
        // Every reply is read, none `ignore`d: the crate counts a transaction's replies from
        // the EXEC array, and subtracts the ignored ones from that count unchecked, so an
        // array shorter than them (a broken proxy or server) panicked the bridge (review
        // bb111). Its length is checked here instead.
        let replies: Vec<redis::Value> = pipe.query(con)?;
        if replies.len() != 2 * rigs.len() {
            return Err(RegistryError::UnexpectedReply(format!(
                "{} replies to a transaction of {} commands",
                replies.len(),
                2 * rigs.len()
            )));
        }
        replies
            .iter()
            .step_by(2)
            .map(|list| {
                let items: Vec<String> = redis::from_redis_value(list)?;
                Ok(items
                    .iter()
                    .filter_map(|s| serde_json::from_str(s).ok())
                    .collect())
            })
            .collect()
    }

    /// Puts `entries` (oldest first) back at the head of `rig`'s hold, its list kept at least
    /// `ttl` plus the usual margin, unless the rig's lease names another live broker
    /// (`ConnectedAt`: nothing written).
    pub fn put_back(
        &self,
        con: &mut impl ConnectionLike,
        rig: &RigId,
        entries: &[Held],
        ttl: Duration,
        broker_id: &str,
    ) -> Result<Pushed, RegistryError> {
        let mut replies = evalsha_many(
            con,
            &self.put_back,
            &[entries],
            |_| 2,
            |call, entries| {
                call.arg(offline_key(rig))
                    .arg(crate::registry::scripts::rig_key(rig))
                    .arg((ttl + LIST_GRACE).as_millis().clamp(1, 999_999_999_999_999) as u64)
                    .arg(broker_id);
                for entry in entries.iter() {
                    call.arg(serde_json::to_string(entry).unwrap_or_default());
                }
            },
        )?;
        match replies.pop() {
            Some(Ok(redis::Value::Int(_))) => Ok(Pushed::Held),
            Some(Ok(redis::Value::BulkString(holder))) => Ok(Pushed::ConnectedAt(
                String::from_utf8_lossy(&holder).into_owned(),
            )),
            Some(Err(e)) => Err(e),
            other => Err(RegistryError::UnexpectedReply(format!(
                "offline_return: {other:?}"
            ))),
        }
    }

    /// Takes up to `max` of `rig`'s held commands, and `max_bytes` of them (but always the
    /// first), from the head of its hold; also says whether more are left.
    pub fn take_some(
        &self,
        con: &mut impl ConnectionLike,
        rig: &RigId,
        max: usize,
        max_bytes: usize,
    ) -> Result<(Vec<Held>, bool), RegistryError> {
        let mut replies = evalsha_many(
            con,
            &self.take,
            &[rig],
            |_| 1,
            |call, rig| {
                call.arg(offline_key(rig)).arg(max.max(1)).arg(max_bytes);
            },
        )?;
        let items = match replies.pop() {
            Some(Ok(redis::Value::Array(items))) => items,
            Some(Err(e)) => return Err(e),
            other => {
                return Err(RegistryError::UnexpectedReply(format!(
                    "offline_take: {other:?}"
                )))
            }
        };
        Ok(parse_taken(items))
    }

    /// Removes held commands whose deadline passed, in one round trip: per entry, whether an
    /// expiry removed it (this call, or an earlier one whose answer was lost), false when a
    /// hello took it, None when its own call failed (ask again).
    pub fn expire_many(
        &self,
        con: &mut impl ConnectionLike,
        entries: &[(&RigId, &Held)],
    ) -> Result<Vec<Option<bool>>, RegistryError> {
        let remembered = LIST_GRACE.as_millis() as u64;
        let replies = evalsha_many(
            con,
            &self.expire,
            entries,
            |_| 2,
            |call, (rig, entry)| {
                call.arg(offline_key(rig))
                    .arg(expired_key(rig))
                    .arg(serde_json::to_string(entry).unwrap_or_default())
                    .arg(remembered);
            },
        )?;
        Ok(replies
            .into_iter()
            .map(|reply| match reply {
                Ok(redis::Value::Int(n)) => Some(n > 0),
                _ => None,
            })
            .collect())
    }

    /// Hands the deadlines of `entries` (held in Redis by this broker, which is exiting) to
    /// Redis, for any broker to report as they come due (`offline_due.lua`). The set lasts a
    /// minute past the last of them.
    pub fn hand_off(
        &self,
        con: &mut impl ConnectionLike,
        entries: &[(&RigId, &Held)],
    ) -> Result<(), RegistryError> {
        let Some(last) = entries.iter().map(|(_, e)| e.deadline_ms).max() else {
            return Ok(());
        };
        // One round trip, a ZADD per chunk: this runs at the end of a drain, against its wait.
        let mut pipe = redis::pipe();
        for chunk in entries.chunks(DUE_MOST) {
            let add = pipe.cmd("ZADD").arg(DUE_KEY).ignore();
            for (rig, entry) in chunk {
                let json = serde_json::to_string(entry).unwrap_or_default();
                add.arg(entry.deadline_ms).arg(format!("{rig}\n{json}"));
            }
        }
        pipe.query::<()>(con)?;
        let lasts = last.saturating_sub(unix_ms()) + LIST_GRACE.as_millis() as u64;
        let left: i64 = redis::cmd("PTTL").arg(DUE_KEY).query(con)?;
        if left == -1 || (left >= 0 && (left as u64) < lasts) {
            redis::cmd("PEXPIRE")
                .arg(DUE_KEY)
                .arg(lasts)
                .query::<()>(con)?;
        }
        Ok(())
    }

    /// Reports the handed-over deadlines that are due (`offline_due.lua`), as broker
    /// `broker_id`, [`DUE_MOST`] a call while calls find that many, up to `calls` calls; how
    /// many were published `expired`.
    pub fn report_due(
        &self,
        con: &mut impl ConnectionLike,
        broker_id: &str,
        calls: usize,
    ) -> Result<u64, RegistryError> {
        let at = crate::reply::rfc3339(std::time::SystemTime::now());
        let mut reported = 0;
        for _ in 0..calls {
            let (taken, n): (usize, u64) = self
                .due
                .key(DUE_KEY)
                .arg(broker_id)
                .arg(&at)
                .arg(DUE_MOST)
                .invoke(con)?;
            reported += n;
            if taken < DUE_MOST {
                break;
            }
        }
        Ok(reported)
    }

    /// Removes held commands if they are still there (a copy this broker delivered itself),
    /// in one round trip: per entry, true when it was there.
    pub fn remove_many(
        &self,
        con: &mut impl ConnectionLike,
        entries: &[(&RigId, &Held)],
    ) -> Result<Vec<bool>, RegistryError> {
        if entries.is_empty() {
            return Ok(Vec::new());
        }
        let mut pipe = redis::pipe();
        for (rig, entry) in entries {
            pipe.cmd("LREM")
                .arg(offline_key(rig))
                .arg(1)
                .arg(serde_json::to_string(entry).unwrap_or_default());
        }
        let removed: Vec<i64> = pipe.query(con)?;
        Ok(removed.into_iter().map(|n| n > 0).collect())
    }
}

/// `offline_take.lua`'s answer: the commands taken, and whether more are left.
fn parse_taken(items: Vec<redis::Value>) -> (Vec<Held>, bool) {
    let mut items = items.into_iter();
    let left = matches!(items.next(), Some(redis::Value::Int(n)) if n > 0);
    let held = items
        .filter_map(|v| match v {
            redis::Value::BulkString(b) => serde_json::from_slice(&b).ok(),
            _ => None,
        })
        .collect();
    (held, left)
}

/// Standalone side: per-rig bounded queues in the bridge, each entry with its key in
/// [`Deadlines`] so that a delivered command's deadline is forgotten with it.
#[derive(Debug, Default)]
pub struct LocalHeld {
    rigs: HashMap<RigId, VecDeque<(u64, Held)>>,
}

impl LocalHeld {
    /// How many commands are held, and the ids of the first `ids` of them.
    pub fn summary(&self, ids: usize) -> (usize, Vec<&str>) {
        let n = self.rigs.values().map(VecDeque::len).sum();
        let first = self
            .rigs
            .values()
            .flatten()
            .take(ids)
            .map(|(_, h)| h.id.as_str())
            .collect();
        (n, first)
    }

    /// Whether `rig`'s queue has room for one more.
    pub fn has_room(&self, rig: &RigId) -> bool {
        self.rigs.get(rig).is_none_or(|q| q.len() < MAX_PER_RIG)
    }

    /// Holds `entry` (its deadline's key `key`); false when the rig's queue is full.
    pub fn push(&mut self, rig: &RigId, key: u64, entry: Held) -> bool {
        let q = self.rigs.entry(rig.clone()).or_default();
        if q.len() >= MAX_PER_RIG {
            return false;
        }
        q.push_back((key, entry));
        true
    }

    /// Takes every held command of `rig`, with its deadline's key.
    pub fn take(&mut self, rig: &RigId) -> Vec<(u64, Held)> {
        self.rigs.remove(rig).map(Vec::from).unwrap_or_default()
    }

    /// Takes every held command of every rig, with its deadline's key.
    pub fn take_all(&mut self) -> Vec<(RigId, Vec<(u64, Held)>)> {
        self.rigs
            .drain()
            .map(|(rig, q)| (rig, Vec::from(q)))
            .collect()
    }

    /// Removes the held command whose deadline's key is `key`; true when it was there. By
    /// key, not id: control may hold two commands with one id, each with its own deadline.
    pub fn remove(&mut self, rig: &RigId, key: u64) -> bool {
        let Some(q) = self.rigs.get_mut(rig) else {
            return false;
        };
        let Some(at) = q.iter().position(|(k, _)| *k == key) else {
            return false;
        };
        q.remove(at);
        if q.is_empty() {
            self.rigs.remove(rig);
        }
        true
    }
}

/// Held commands this broker delivered itself, its `offline_delivered` published, the newest
/// [`DeliveredHolds::MAX`]. Redis may then lose its keys before the command's deadline; the
/// holding broker cannot tell a command a hello took before the loss from one the loss took,
/// and reports `lost`. When the hello was its own it can: that command's story is told
/// (review bb138 saw `offline_delivered`, `ack`, `result`, then `lost` from one broker).
#[derive(Debug, Default)]
pub struct DeliveredHolds {
    /// Oldest first, each with the number it was noted under; one taken since stays here,
    /// stale, until it comes up for eviction.
    order: VecDeque<((RigId, Box<str>), u64)>,
    noted: HashMap<(RigId, Box<str>), u64>,
    next: u64,
}

impl DeliveredHolds {
    /// Most remembered: about 2.5 MB at most. An older delivery is reported `lost` after a
    /// loss, as before, which errs toward sending it again (the rig checks the `id`).
    pub const MAX: usize = 16_384;

    /// Remembers that `id` for `rig` was delivered here.
    pub fn note(&mut self, rig: RigId, id: &str) {
        if self.order.len() >= Self::MAX {
            if let Some((old, n)) = self.order.pop_front() {
                if self.noted.get(&old) == Some(&n) {
                    self.noted.remove(&old);
                }
            }
        }
        self.next += 1;
        let key = (rig, Box::from(id));
        self.noted.insert(key.clone(), self.next);
        self.order.push_back((key, self.next));
    }

    /// Whether `id` for `rig` was delivered here; forgotten as it is asked (its deadline came).
    pub fn take(&mut self, rig: &RigId, id: &str) -> bool {
        // Asked at every deadline, most often with nothing noted: no key built for that.
        !self.noted.is_empty() && self.noted.remove(&(rig.clone(), Box::from(id))).is_some()
    }
}

#[cfg(test)]
mod delivered_tests {
    use super::*;

    #[test]
    fn delivered_holds_are_remembered_once_and_the_oldest_go_first() {
        let rig = RigId::parse("r").unwrap();
        let mut d = DeliveredHolds::default();
        d.note(rig.clone(), "a");
        assert!(d.take(&rig, "a"));
        assert!(!d.take(&rig, "a"), "taken once");
        for i in 0..DeliveredHolds::MAX {
            d.note(rig.clone(), &i.to_string());
        }
        // "0" is the oldest; one more pushes it out, and the rest stay.
        d.note(rig.clone(), "new");
        assert!(!d.take(&rig, "0"));
        assert!(d.take(&rig, "1") && d.take(&rig, "new"));
        assert!(d.order.len() <= DeliveredHolds::MAX && d.noted.len() < DeliveredHolds::MAX);
    }
}

/// Deadlines of the commands this broker put on hold, so it can report them `expired` on time.
/// Bounded by [`Deadlines::MAX`]: past it, a command for an offline rig is refused.
#[derive(Debug, Default)]
pub struct Deadlines {
    heap: BinaryHeap<Reverse<(Instant, u64)>>,
    /// Each with the [`Self::epoch`] it was added in.
    entries: HashMap<u64, (RigId, Held, usize, u32)>,
    /// The sizes of the commands behind `entries` ([`Held::size`]).
    bytes: usize,
    next: u64,
    /// How many times this broker has seen Redis lose its keys (see [`Self::keys_lost`]).
    epoch: u32,
}

impl Deadlines {
    /// Most deadlines one broker keeps, each with a copy of its command. In fleet mode another
    /// broker may deliver a command held here, so its deadline stays until due (at most
    /// [`MAX_TTL`]) and counts until then; standalone, delivery forgets it.
    pub const MAX: usize = 1_000_000;
    /// Most bytes of commands held by one broker: a command may be as large as an admin
    /// request (1 MiB), so the count alone would allow a terabyte.
    pub const MAX_BYTES: usize = 256 << 20;

    /// Whether `n` more deadlines, for commands of `bytes` in all, would pass the bounds.
    pub fn would_overflow(&self, n: usize, bytes: usize) -> bool {
        self.entries.len().saturating_add(n) > Self::MAX
            || self.bytes.saturating_add(bytes) > Self::MAX_BYTES
    }

    /// Remembers `entry` until `at`, counting `size` bytes for it; returns its key.
    pub fn add(&mut self, at: Instant, rig: RigId, entry: Held, size: usize) -> u64 {
        self.add_from(at, rig, entry, size, self.epoch)
    }

    /// [`Self::add`] for an entry held since `epoch` (one due earlier, asked about again).
    pub fn add_from(
        &mut self,
        at: Instant,
        rig: RigId,
        entry: Held,
        size: usize,
        epoch: u32,
    ) -> u64 {
        self.next += 1;
        self.heap.push(Reverse((at, self.next)));
        self.entries.insert(self.next, (rig, entry, size, epoch));
        self.bytes += size;
        self.next
    }

    /// Redis lost its keys (restarted empty, flushed): the commands held there before are
    /// gone with them, so one not found at its deadline was not necessarily delivered.
    pub fn keys_lost(&mut self) {
        self.epoch = self.epoch.wrapping_add(1);
    }

    /// Whether an entry added in `epoch` was held in Redis across a loss of its keys.
    pub fn held_across_a_loss(&self, epoch: u32) -> bool {
        epoch != self.epoch
    }

    /// Takes out the entries held across a loss of Redis's keys that `whole` says were held
    /// in Redis (not here): what is left to report of them is that the loss took them.
    pub fn take_held_across_a_loss(&mut self, whole: impl Fn(&Held) -> bool) -> Vec<(RigId, Held)> {
        let keys: Vec<u64> = self
            .entries
            .iter()
            .filter(|(_, (_, entry, _, epoch))| *epoch != self.epoch && whole(entry))
            .map(|(k, _)| *k)
            .collect();
        keys.into_iter()
            .filter_map(|k| {
                let (rig, entry, size, _) = self.entries.remove(&k)?;
                self.bytes -= size;
                Some((rig, entry))
            })
            .collect()
    }

    /// Drops a command delivered before its deadline. Its heap slot is skipped when due, and
    /// the heap is rebuilt once such slots outnumber the live ones, so that it stays within
    /// twice [`Self::MAX`].
    pub fn forget(&mut self, key: u64) {
        if let Some((_, _, size, _)) = self.entries.remove(&key) {
            self.bytes -= size;
        }
        if self.heap.len() > 2 * self.entries.len() + 1024 {
            let entries = &self.entries;
            self.heap.retain(|Reverse((_, k))| entries.contains_key(k));
        }
    }

    /// Every deadline kept, with its rig and command.
    pub fn iter(&self) -> impl Iterator<Item = (&RigId, &Held)> {
        self.entries.values().map(|(rig, entry, _, _)| (rig, entry))
    }

    /// How many deadlines are kept.
    pub fn len(&self) -> usize {
        self.entries.len()
    }

    /// Whether none is.
    pub fn is_empty(&self) -> bool {
        self.entries.is_empty()
    }

    /// The next deadline, if any.
    pub fn next_due(&self) -> Option<Instant> {
        self.heap.peek().map(|Reverse((at, _))| *at)
    }

    /// Entries due at `now`, each with its key and the epoch it was added in.
    pub fn due(&mut self, now: Instant) -> Vec<(u64, RigId, Held, u32)> {
        let mut out = Vec::new();
        while let Some(Reverse((at, k))) = self.heap.peek().copied() {
            if at > now {
                break;
            }
            self.heap.pop();
            if let Some((rig, entry, size, epoch)) = self.entries.remove(&k) {
                self.bytes -= size;
                out.push((k, rig, entry, epoch));
            }
        }
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::registry::canned::Canned;
    use redis::Value;

    /// A connection that answers a transaction with `exec`, its EXEC reply.
    fn exec(exec: Value) -> Canned {
        Canned {
            replies: vec![vec![exec]],
            sent: Vec::new(),
        }
    }

    fn held(id: &str) -> Held {
        Held {
            id: id.into(),
            name: "n".into(),
            args: Args::null(),
            deadline_ms: 1,
            reply_to: None,
        }
    }

    /// A transaction's replies are counted from its EXEC array, which a broken server or proxy
    /// can cut short: an error, where the crate's own count of ignored replies panicked.
    #[test]
    fn a_take_answered_with_too_few_replies_is_an_error_not_a_panic() {
        let (r1, r2) = (RigId::parse("r1").unwrap(), RigId::parse("r2").unwrap());
        let offline = OfflineScripts::default();
        let list = |items: &[&str]| {
            Value::Array(
                items
                    .iter()
                    .map(|s| Value::BulkString(s.as_bytes().to_vec()))
                    .collect(),
            )
        };
        let entry = serde_json::to_string(&held("a")).unwrap();
        let ok = Value::Okay;
        let whole = Value::Array(vec![list(&[&entry]), ok.clone(), list(&[]), ok.clone()]);
        let taken = offline.take_many(&mut exec(whole), &[&r1, &r2], 5).unwrap();
        assert_eq!(taken, vec![vec![held("a")], vec![]]);
        for short in [
            Value::Array(vec![]),
            Value::Array(vec![list(&[]), ok.clone()]),
        ] {
            match offline.take_many(&mut exec(short), &[&r1, &r2], 5) {
                Err(RegistryError::UnexpectedReply(why)) => {
                    assert!(why.contains("of 4 commands"), "{why}")
                }
                other => panic!("{other:?}"),
            }
        }
        // A reply of another type in a list's place fails the take too.
        let odd = Value::Array(vec![ok.clone(), ok.clone(), list(&[]), ok]);
        assert!(offline.take_many(&mut exec(odd), &[&r1, &r2], 5).is_err());
    }

    #[test]
    fn local_queue_is_bounded_and_takes_in_order() {
        let rig = RigId::parse("r").unwrap();
        let mut q = LocalHeld::default();
        for i in 0..MAX_PER_RIG {
            assert!(q.has_room(&rig));
            assert!(q.push(&rig, i as u64, held(&i.to_string())));
        }
        assert!(!q.has_room(&rig));
        assert!(!q.push(&rig, 0, held("over")));
        assert!(q.remove(&rig, 0));
        assert!(!q.remove(&rig, 0));
        let taken = q.take(&rig);
        assert_eq!(taken.len(), MAX_PER_RIG - 1);
        assert_eq!(taken[0], (1, held("1")));
        assert!(q.take(&rig).is_empty());
    }

    /// Two held commands with one id: the deadline of one removes that one only.
    #[test]
    fn a_deadline_removes_its_own_command_not_another_with_the_same_id() {
        let rig = RigId::parse("r").unwrap();
        let mut q = LocalHeld::default();
        assert!(q.push(&rig, 7, held("dup")));
        assert!(q.push(&rig, 8, held("dup")));
        assert!(q.remove(&rig, 7));
        assert_eq!(q.take(&rig), [(8, held("dup"))]);
    }

    #[test]
    fn deadlines_come_due_in_order() {
        let mut d = Deadlines::default();
        let t0 = Instant::now();
        let rig = RigId::parse("r").unwrap();
        d.add(t0 + Duration::from_secs(2), rig.clone(), held("b"), 1);
        d.add(t0 + Duration::from_secs(1), rig.clone(), held("a"), 1);
        assert_eq!(d.next_due(), Some(t0 + Duration::from_secs(1)));
        assert!(d.due(t0).is_empty());
        let due = d.due(t0 + Duration::from_secs(3));
        assert_eq!(
            due.iter()
                .map(|(_, _, h, _)| h.id.as_str())
                .collect::<Vec<_>>(),
            ["a", "b"]
        );
    }

    /// A deadline tells whether its command was held in Redis before a loss of its keys, also
    /// when it is asked about again (added back with the epoch it came due with).
    #[test]
    fn a_deadline_knows_whether_redis_lost_its_keys_since_its_command_was_held() {
        let mut d = Deadlines::default();
        let t0 = Instant::now();
        let rig = RigId::parse("r").unwrap();
        d.add(t0, rig.clone(), held("before"), 1);
        d.keys_lost();
        d.add(t0, rig.clone(), held("after"), 1);
        let across: Vec<(String, bool)> = d
            .due(t0)
            .into_iter()
            .map(|(_, _, h, epoch)| (h.id, d.held_across_a_loss(epoch)))
            .collect();
        assert_eq!(across, [("before".into(), true), ("after".into(), false)]);
        let (_, _, h, epoch) = {
            d.add(t0, rig.clone(), held("again"), 1);
            d.keys_lost();
            d.due(t0).remove(0)
        };
        d.add_from(t0, rig.clone(), h, 1, epoch);
        let (_, _, _, epoch) = d.due(t0).remove(0);
        assert!(d.held_across_a_loss(epoch), "still held across the loss");
        // At a drain: those held across the loss, in Redis, are taken out; the rest stay.
        d.add(t0, rig.clone(), held("whole"), 1);
        d.add(t0, rig.clone(), held("here").stub(), 1);
        d.keys_lost();
        d.add(t0, rig, held("new"), 1);
        let taken: Vec<String> = d
            .take_held_across_a_loss(|h| !h.name.is_empty())
            .into_iter()
            .map(|(_, h)| h.id)
            .collect();
        assert_eq!(taken, ["whole"]);
        assert_eq!(d.len(), 2);
    }

    #[test]
    fn a_forgotten_deadline_reports_nothing_and_counts_no_more() {
        let mut d = Deadlines::default();
        let t0 = Instant::now();
        let rig = RigId::parse("r").unwrap();
        let a = d.add(t0, rig.clone(), held("a"), 1);
        d.add(t0, rig.clone(), held("b"), 1);
        d.forget(a);
        let due = d.due(t0);
        assert_eq!(due.len(), 1);
        assert_eq!(due[0].2.id, "b");
        assert!(!d.would_overflow(Deadlines::MAX, 0));
        d.add(t0 + Duration::from_secs(60), rig.clone(), held("c"), 1);
        assert!(d.would_overflow(Deadlines::MAX, 0));
        assert!(!d.would_overflow(Deadlines::MAX - 1, 0));
        // Delivered ones neither count nor pile up in the heap.
        let keys: Vec<u64> = (0..5000)
            .map(|i| {
                d.add(
                    t0 + Duration::from_secs(60),
                    rig.clone(),
                    held(&i.to_string()),
                    1,
                )
            })
            .collect();
        for k in keys {
            d.forget(k);
        }
        assert!(!d.would_overflow(Deadlines::MAX - 1, 0));
        assert!(d.heap.len() <= 2 + 1024, "{}", d.heap.len());
        let due = d.due(t0 + Duration::from_secs(61));
        assert_eq!(due.len(), 1);
        assert_eq!(due[0].2.id, "c");
    }

    #[test]
    fn held_bytes_are_bounded_and_given_back() {
        let mut d = Deadlines::default();
        let t0 = Instant::now();
        let rig = RigId::parse("r").unwrap();
        let k = d.add(t0, rig.clone(), held("a"), Deadlines::MAX_BYTES - 10);
        assert!(!d.would_overflow(1, 10));
        assert!(d.would_overflow(1, 11), "past the bytes");
        d.forget(k);
        assert!(!d.would_overflow(1, Deadlines::MAX_BYTES));
        d.add(t0, rig, held("b"), 5);
        assert_eq!(d.due(t0).len(), 1);
        assert!(
            !d.would_overflow(1, Deadlines::MAX_BYTES),
            "a due one gives its bytes back"
        );
        let big = Held {
            args: Args::from_value(&serde_json::json!({"p": "x".repeat(1000)})),
            ..held("c")
        };
        assert!(big.size() > 1000);
        assert_eq!(big.stub().args, Args::null());
        assert_eq!(big.stub().id, "c");
    }
}
