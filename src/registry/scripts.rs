//! The registry's Lua scripts (`lua/*.lua`, embedded at build time) and typed EVALSHA wrappers.
//!
//! Every write to `rig:*` and `broker:*` goes through these four scripts (CONTRACT.md §3), so
//! each check-then-write is atomic in Redis. Each script's header states its KEYS, ARGV and
//! reply; the parsers here accept exactly those shapes and turn anything else into
//! [`RegistryError::UnexpectedReply`] (a `lua/` and a binary from different builds).
//!
//! Called from the single Redis thread (`registry::bridge`); nothing here keeps state between
//! calls, so one `Scripts` serves every reconnect. Invocations use EVALSHA and, on `NOSCRIPT`
//! (Redis restarted, `SCRIPT FLUSH`, failover to a replica), load the script and retry once:
//! `redis::ScriptInvocation::invoke` does exactly that.

use std::collections::HashMap;
use std::time::Duration;

use redis::{ConnectionLike, Script, Value};

use crate::ids::{BootId, RigId};

/// Most rig keys sent in one refresh or release call. A script blocks Redis while it runs; a
/// 1000-key refresh takes about 1.5 ms of Redis time (`registry_upkeep_cost` in
/// tests/lua_scripts.rs), so a broker with 19,000 rigs sends 19 short calls, not one 27 ms one.
pub const REFRESH_CHUNK: usize = 1000;

/// Most hellos in one `hello.lua` call: about a millisecond of Redis time (3-4 µs each), so a
/// storm's batch of a thousand hellos is a few short calls in one pipeline.
pub const HELLO_CHUNK: usize = 256;

/// Longest TTL the scripts accept (they take at most 15 decimal digits of milliseconds).
const MAX_TTL_MS: u128 = 999_999_999_999_999;

/// The four registry scripts, hashed once; cheap to share by reference.
#[derive(Debug, Clone)]
pub struct Scripts {
    /// Claims a rig on hello: `lua/hello.lua`.
    hello: Script,
    /// Extends this broker's leases in batches: `lua/refresh.lua`.
    refresh: Script,
    /// Compare-and-deletes this broker's entries: `lua/release.lua`.
    release: Script,
    /// Writes the broker liveness key: `lua/broker.lua`.
    broker: Script,
}

/// What a heartbeat found of this broker id's past in Redis (`broker.lua`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Heartbeat {
    /// Redis kept its keys since this id last wrote them.
    Kept,
    /// Redis lost its keys since this id last wrote them (or the id is new).
    New,
    /// As [`Self::Kept`], at the start of a process whose predecessor under this id did not
    /// exit cleanly: leases naming this id may be left over from it.
    Unclean,
}

/// What a hello did to the rig's entry.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum HelloOutcome {
    /// This boot on this broker now owns the rig. `previous` is the entry it replaced, so the
    /// caller can tell another broker to evict its stale socket.
    Owned {
        /// The replaced entry, `None` when the key was empty. It may name this very broker
        /// (the same rig process reconnecting here), which needs no evict.
        previous: Option<Owner>,
    },
    /// A newer boot owns the rig; nothing was written and the socket closes with 4409.
    Older {
        /// The entry that won.
        current: Owner,
    },
}

/// A stored `<boot_id>|<broker_id>` entry, split at the first `|`.
///
/// Redis may hold anything under a rig key, so parsing never fails: text without a `|` is kept
/// whole in `boot_id` with an empty `broker_id`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Owner {
    /// The owning boot, or the raw stored text when it has no `|`.
    pub boot_id: String,
    /// The owning broker, empty when the stored text has no `|`.
    pub broker_id: String,
}

/// What a refresh did to one rig's entry.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum RefreshStatus {
    /// Still ours: the TTL was extended.
    Ok,
    /// The key was gone (expired, or Redis restarted empty): it was written again as ours.
    Restored,
    /// As [`Self::Restored`], but the rig's latest session on record is another boot's,
    /// `other`: it outlived its lease (while Redis was away longer than the lease, or after
    /// its broker released it), and the caller reports it `rig_rebooted` (`resume.lua`), as
    /// this boot's hello would have. An older boot's, or, for a boot whose hello was decided
    /// alone ([`Scripts::refresh_claiming`]), a newer one's that its rig had left.
    Outlived {
        /// The boot on record.
        other: BootId,
    },
    /// The key named an older boot, `from` (welcomed elsewhere while this broker decided the
    /// newer one's hello alone, Redis being away): written as ours, as a hello would have.
    /// The caller evicts the older boot from its broker.
    Taken {
        /// The entry replaced.
        from: Owner,
    },
    /// Someone else's entry (or garbage): untouched; the caller closes that socket with 4410.
    Superseded,
    /// A boot whose hello was decided alone, asked with [`Claim::Ask`]: the lease is free (or
    /// an older boot's) but the rig's record names a newer boot, which may be connected still
    /// with its lease not yet put back. Untouched; the caller asks again, with
    /// [`Claim::Take`], once that boot's broker has had time to put it back.
    Vacant,
}

/// How a refresh treats a boot whose hello this broker decided alone while Redis was away
/// (`refresh.lua`'s marked values).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Claim {
    /// Where the hello's rule would take the lease and the refresh's would not (a newer boot
    /// on record), answer [`RefreshStatus::Vacant`] and touch nothing.
    Ask,
    /// Take it by the hello's rule.
    Take,
}

/// Why a registry call failed.
#[derive(Debug, thiserror::Error)]
pub enum RegistryError {
    /// Redis was unreachable or refused the command (including a script's own error reply);
    /// the bridge reconnects and calls [`Scripts::load`] again. Shown as Redis's own error:
    /// the lines that report it say `redis:` already.
    #[error(transparent)]
    Redis(#[from] redis::RedisError),
    /// A script answered with a shape its `lua/` header does not promise: the scripts on the
    /// server and this binary disagree. Never retried blindly.
    #[error("unexpected reply from a registry script: {0}")]
    UnexpectedReply(String),
}

impl Scripts {
    /// Embeds and hashes the scripts; no Redis traffic.
    pub fn new() -> Scripts {
        Scripts {
            hello: Script::new(include_str!("../../lua/hello.lua")),
            refresh: Script::new(include_str!("../../lua/refresh.lua")),
            release: Script::new(include_str!("../../lua/release.lua")),
            broker: Script::new(include_str!("../../lua/broker.lua")),
        }
    }

    /// Sends SCRIPT LOAD for all four scripts. EVALSHA would load them lazily anyway; loading
    /// up front makes a broken script fail at startup, and lets `/readyz` say "scripts loaded".
    pub fn load(&self, con: &mut impl ConnectionLike) -> Result<(), RegistryError> {
        for script in [&self.hello, &self.refresh, &self.release, &self.broker] {
            script.load(con)?;
        }
        Ok(())
    }

    /// Claims `rig` for `boot` on `broker_id` unless a newer boot holds it (CONTRACT.md §3).
    pub fn hello(
        &self,
        con: &mut impl ConnectionLike,
        rig: &RigId,
        boot: &BootId,
        broker_id: &str,
        ttl: Duration,
    ) -> Result<HelloOutcome, RegistryError> {
        only(
            self.hello_many(con, &[(rig, boot)], broker_id, ttl)?,
            "hello",
        )
    }

    /// [`Self::hello`] for many rigs in one round trip: one `hello.lua` call per
    /// [`HELLO_CHUNK`] hellos, pipelined (Redis runs them in order). One outcome per entry, in
    /// order. A storm's hellos then cost the bridge a round trip per batch, and Redis a
    /// script call per chunk, not per rig. A call's error fails the entries of its chunk
    /// alone; `Err` means Redis itself failed.
    pub fn hello_many(
        &self,
        con: &mut impl ConnectionLike,
        entries: &[(&RigId, &BootId)],
        broker_id: &str,
        ttl: Duration,
    ) -> Result<Vec<Result<HelloOutcome, RegistryError>>, RegistryError> {
        let ttl = ttl_ms(ttl);
        evalsha_chunks(
            con,
            &self.hello,
            "hello",
            entries,
            HELLO_CHUNK,
            1,
            |call, chunk| {
                for (rig, _) in chunk {
                    call.arg(rig_key(rig));
                }
                call.arg(broker_id).arg(ttl);
                for (_, boot) in chunk {
                    call.arg(boot.as_str());
                }
            },
            parse_hello,
        )
    }

    /// Extends the lease of every `(rig, boot)` this broker holds, in calls of at most
    /// [`REFRESH_CHUNK`] keys; statuses come back in `entries` order.
    ///
    /// On an error, the chunks before it have been applied and their statuses are lost; that
    /// is harmless because the next tick sends the same tuples and gets the same answers
    /// (a superseded entry is never touched, so it is still reported as superseded).
    pub fn refresh(
        &self,
        con: &mut impl ConnectionLike,
        entries: &[(RigId, BootId)],
        broker_id: &str,
        ttl: Duration,
    ) -> Result<Vec<RefreshStatus>, RegistryError> {
        self.refresh_claiming(con, entries, broker_id, ttl, &HashMap::new())
    }

    /// [`Self::refresh`], where the entries in `claims` are boots whose hellos this broker
    /// decided alone while Redis was away: their refresh follows the hello's rule, which
    /// takes a free lease (or an older boot's) whatever boot the rig's record names, as
    /// their [`Claim`] says. A lease so taken answers [`RefreshStatus::Outlived`] when that
    /// record names another boot, newer ones too.
    pub fn refresh_claiming(
        &self,
        con: &mut impl ConnectionLike,
        entries: &[(RigId, BootId)],
        broker_id: &str,
        ttl: Duration,
        claims: &HashMap<(RigId, BootId), Claim>,
    ) -> Result<Vec<RefreshStatus>, RegistryError> {
        let mut statuses = Vec::with_capacity(entries.len());
        for chunk in entries.chunks(REFRESH_CHUNK) {
            let mut call = self.refresh.prepare_invoke();
            call.arg(ttl_ms(ttl));
            for entry @ (rig, boot) in chunk {
                let value = tuple(boot, broker_id);
                let value = match claims.get(entry) {
                    None => value,
                    Some(Claim::Ask) => format!("+{value}"),
                    Some(Claim::Take) => format!("!{value}"),
                };
                call.key(rig_key(rig)).arg(value);
            }
            let reply: Value = call.invoke(con)?;
            let parsed = match &reply {
                Value::Array(items) if items.len() == chunk.len() => {
                    items.iter().map(refresh_status).collect::<Option<Vec<_>>>()
                }
                _ => None,
            };
            statuses.extend(parsed.ok_or_else(|| unexpected("refresh", &reply))?);
        }
        Ok(statuses)
    }

    /// Deletes the entries that are still exactly this broker's tuple (disconnect, drain), in
    /// calls of at most [`REFRESH_CHUNK`] keys; returns how many were deleted.
    pub fn release(
        &self,
        con: &mut impl ConnectionLike,
        entries: &[(RigId, BootId)],
        broker_id: &str,
    ) -> Result<usize, RegistryError> {
        let mut deleted = 0;
        for chunk in entries.chunks(REFRESH_CHUNK) {
            let mut call = self.release.prepare_invoke();
            for (rig, boot) in chunk {
                call.key(rig_key(rig)).arg(tuple(boot, broker_id));
            }
            let reply: Value = call.invoke(con)?;
            deleted += match reply {
                Value::Int(n) if (0..=chunk.len() as i64).contains(&n) => n as usize,
                _ => return Err(unexpected("release", &reply)),
            };
        }
        Ok(deleted)
    }

    /// Writes `broker:<broker_id>` = `json` with `ttl`, so control can count live brokers, and
    /// says what `sentinel:<broker_id>` told of this id's past (see `broker.lua`). `start`: the
    /// process's first heartbeat, which asks whether the last process under this id exited
    /// cleanly.
    pub fn broker_heartbeat(
        &self,
        con: &mut impl ConnectionLike,
        broker_id: &str,
        json: &str,
        ttl: Duration,
        start: bool,
    ) -> Result<Heartbeat, RegistryError> {
        let mut call = self.broker.key(broker_key(broker_id));
        call.key(sentinel_key(broker_id)).arg(json).arg(ttl_ms(ttl));
        if start {
            call.arg("start");
        }
        let reply: Value = call.invoke(con)?;
        match text(&reply) {
            Some("ok") => Ok(Heartbeat::Kept),
            Some("new") => Ok(Heartbeat::New),
            Some("unclean") if start => Ok(Heartbeat::Unclean),
            _ => Err(unexpected("broker", &reply)),
        }
    }
}

impl Default for Scripts {
    fn default() -> Self {
        Self::new()
    }
}

impl Owner {
    /// Splits a stored entry at its first `|` (a boot id never contains one); never fails.
    pub fn parse(raw: &str) -> Owner {
        let (boot_id, broker_id) = raw.split_once('|').unwrap_or((raw, ""));
        Owner {
            boot_id: boot_id.to_owned(),
            broker_id: broker_id.to_owned(),
        }
    }
}

/// The registry key of a rig: `rig:<rig_id>`.
pub fn rig_key(rig: &RigId) -> String {
    format!("rig:{rig}")
}

/// The liveness key of a broker: `broker:<broker_id>`.
pub fn broker_key(id: &str) -> String {
    format!("broker:{id}")
}

/// The key, without a TTL, whose absence tells broker `id` that Redis lost its keys.
pub fn sentinel_key(id: &str) -> String {
    format!("sentinel:{id}")
}

/// The value of a rig key: `<boot_id>|<broker_id>`.
pub fn tuple(boot: &BootId, broker: &str) -> String {
    format!("{boot}|{broker}")
}

/// A TTL in the scripts' unit. Redis rejects `PX 0` and the scripts reject more than 15
/// digits, so the value is clamped to that range rather than failing mid-refresh.
fn ttl_ms(ttl: Duration) -> u64 {
    // Cannot truncate: the clamp bound is below u64::MAX.
    ttl.as_millis().clamp(1, MAX_TTL_MS) as u64
}

/// hello.lua's reply: `{ "ok" | "older", <the entry it found> }`.
fn parse_hello(reply: &Value) -> Result<HelloOutcome, RegistryError> {
    let (status, value) = match reply {
        Value::Array(items) if items.len() == 2 => (text(&items[0]), lossy(&items[1])),
        _ => (None, None),
    };
    match (status, value) {
        (Some("ok"), Some(v)) if v.is_empty() => Ok(HelloOutcome::Owned { previous: None }),
        (Some("ok"), Some(v)) => Ok(HelloOutcome::Owned {
            previous: Some(Owner::parse(&v)),
        }),
        (Some("older"), Some(v)) => Ok(HelloOutcome::Older {
            current: Owner::parse(&v),
        }),
        _ => Err(unexpected("hello", reply)),
    }
}

/// The one result of a one-entry `*_many` call.
pub(crate) fn only<T>(
    mut results: Vec<Result<T, RegistryError>>,
    what: &str,
) -> Result<T, RegistryError> {
    results
        .pop()
        .unwrap_or_else(|| Err(RegistryError::UnexpectedReply(format!("{what}: no reply"))))
}

/// Runs a script that takes a batch of entries (`keys_each` keys per entry), one call per
/// `chunk` entries, all calls in one pipeline ([`evalsha_many`]): `args` adds a chunk's keys,
/// then its ARGV. The reply of each call is an array with one entry per entry of its chunk,
/// each parsed by `parse`; the results come back in `entries` order. A failed call, or a reply
/// of another length, fails the entries of its chunk alone; `Err` means Redis itself failed.
#[allow(clippy::too_many_arguments)]
pub(crate) fn evalsha_chunks<E, T>(
    con: &mut impl ConnectionLike,
    script: &Script,
    what: &str,
    entries: &[E],
    chunk: usize,
    keys_each: usize,
    args: impl Fn(&mut redis::Cmd, &[E]),
    parse: impl Fn(&Value) -> Result<T, RegistryError>,
) -> Result<Vec<Result<T, RegistryError>>, RegistryError> {
    let chunks: Vec<&[E]> = entries.chunks(chunk.max(1)).collect();
    let replies = evalsha_many(
        con,
        script,
        &chunks,
        |c| keys_each * c.len(),
        |call, c| args(call, c),
    )?;
    let mut out = Vec::with_capacity(entries.len());
    for (c, reply) in chunks.iter().zip(replies) {
        let n = c.len();
        let failed = |why: String| {
            (0..n)
                .map(|_| Err(RegistryError::UnexpectedReply(why.clone())))
                .collect::<Vec<_>>()
        };
        out.extend(match reply {
            Ok(Value::Array(items)) if items.len() == n => items.iter().map(&parse).collect(),
            Ok(other) => failed(format!(
                "{what}.lua answered {} ({n} entries expected)",
                shown(&other)
            )),
            Err(e) => failed(format!("{what}.lua failed: {e}")),
        });
    }
    Ok(out)
}

/// Runs `script` once per item, all in one pipeline (one round trip, run by Redis in order):
/// `args` adds an item's `numkeys` keys, then its ARGV, to its EVALSHA. Returns each call's
/// reply in order, a script's error reply as that entry's `Err`. Scripts are loaded at
/// connect; should Redis have lost them since (a restart, `SCRIPT FLUSH`), the entries that
/// answer NOSCRIPT did not run, so the script is loaded and those entries alone are sent once
/// more. (A `SCRIPT FLUSH` landing in the middle of the pipeline leaves the entries before it
/// run: sent again, an `offline_push` would hold its command twice.)
pub fn evalsha_many<T>(
    con: &mut impl ConnectionLike,
    script: &Script,
    items: &[T],
    numkeys: impl Fn(&T) -> usize,
    args: impl Fn(&mut redis::Cmd, &T),
) -> Result<Vec<Result<Value, RegistryError>>, RegistryError> {
    let n = items.len();
    if n == 0 {
        return Ok(Vec::new());
    }
    // Each call packed once; a pipeline is their bytes end to end.
    let calls: Vec<Vec<u8>> = items
        .iter()
        .map(|item| {
            let mut call = redis::cmd("EVALSHA");
            call.arg(script.get_hash()).arg(numkeys(item));
            args(&mut call, item);
            call.get_packed_command()
        })
        .collect();
    let send = |con: &mut _, which: &[usize]| -> Result<Vec<Value>, RegistryError> {
        let mut packed = Vec::new();
        for call in which.iter().filter_map(|&i| calls.get(i)) {
            packed.extend_from_slice(call);
        }
        let replies = ConnectionLike::req_packed_commands(con, &packed, 0, which.len())?;
        if replies.len() != which.len() {
            return Err(RegistryError::UnexpectedReply(format!(
                "{} replies to a pipeline of {} script calls",
                replies.len(),
                which.len()
            )));
        }
        Ok(replies)
    };
    let noscript = |v: &Value| matches!(v, Value::ServerError(e) if e.code() == "NOSCRIPT");
    let all: Vec<usize> = (0..n).collect();
    let mut replies = send(con, &all)?;
    let again: Vec<usize> = all
        .into_iter()
        .filter(|&i| replies.get(i).is_some_and(noscript))
        .collect();
    if !again.is_empty() {
        script.load(con)?;
        for (i, reply) in again.iter().zip(send(con, &again)?) {
            if let Some(slot) = replies.get_mut(*i) {
                *slot = reply;
            }
        }
    }
    Ok(replies
        .into_iter()
        .map(|reply| match reply {
            Value::ServerError(e) => Err(RegistryError::Redis(e.into())),
            other => Ok(other),
        })
        .collect())
}

/// One refresh status as the script spells it.
fn refresh_status(v: &Value) -> Option<RefreshStatus> {
    match text(v)? {
        "ok" => Some(RefreshStatus::Ok),
        "restored" => Some(RefreshStatus::Restored),
        "superseded" => Some(RefreshStatus::Superseded),
        "vacant" => Some(RefreshStatus::Vacant),
        other => match other.split_once('|') {
            Some(("taken", from)) => Some(RefreshStatus::Taken {
                from: Owner::parse(from),
            }),
            Some(("restored", other)) => {
                BootId::parse(other).map(|other| RefreshStatus::Outlived { other })
            }
            _ => None,
        },
    }
}

/// A string reply as UTF-8 text; `None` for other types and for bytes that are not UTF-8.
fn text(v: &Value) -> Option<&str> {
    match v {
        Value::BulkString(b) => std::str::from_utf8(b).ok(),
        Value::SimpleString(s) => Some(s),
        _ => None,
    }
}

/// A stored value echoed back by a script; any bytes are accepted, since Redis may hold garbage.
fn lossy(v: &Value) -> Option<String> {
    match v {
        Value::BulkString(b) => Some(String::from_utf8_lossy(b).into_owned()),
        Value::SimpleString(s) => Some(s.clone()),
        _ => None,
    }
}

/// The error for a reply of the wrong shape, quoting (the start of) what arrived.
fn unexpected(script: &str, reply: &Value) -> RegistryError {
    RegistryError::UnexpectedReply(format!("{script}.lua answered {}", shown(reply)))
}

/// A reply as text for an error, cut at 200 bytes.
fn shown(reply: &Value) -> String {
    let mut shown = format!("{reply:?}");
    if shown.len() > 200 {
        let cut = (0..=200)
            .rev()
            .find(|&i| shown.is_char_boundary(i))
            .unwrap_or(0);
        shown.truncate(cut);
        shown.push('…');
    }
    shown
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::registry::canned::Canned;

    const BOOT: &str = "01890a5d-ac96-774b-bcce-b302099a8057";

    /// A batched call's reply is split among its chunk's entries; a call that failed, or
    /// answered for another number of entries, fails its own chunk's entries and no others.
    #[test]
    fn a_chunk_that_fails_fails_its_own_entries_alone() {
        let ok = |s: &str| Value::SimpleString(s.into());
        let busy = redis::parse_redis_value(b"-BUSY Redis is busy running a script.\r\n")
            .expect("an error reply");
        let mut con = Canned {
            replies: vec![vec![
                Value::Array(vec![ok("a"), ok("b")]),
                Value::Array(vec![ok("c")]),
                busy,
                Value::Array(vec![ok("g"), ok("h")]),
            ]],
            sent: Vec::new(),
        };
        let script = Script::new("return 1");
        let entries = [1, 2, 3, 4, 5, 6, 7, 8];
        let out = evalsha_chunks(
            &mut con,
            &script,
            "test",
            &entries,
            2,
            1,
            |call, chunk| {
                for e in chunk {
                    call.arg(*e);
                }
            },
            |v| {
                text(v)
                    .map(str::to_string)
                    .ok_or_else(|| unexpected("test", v))
            },
        )
        .expect("replies");
        assert_eq!(con.sent, [4], "one pipeline of four calls");
        let got: Vec<Option<String>> = out.into_iter().map(Result::ok).collect();
        let want = [
            Some("a"),
            Some("b"),
            None,
            None,
            None,
            None,
            Some("g"),
            Some("h"),
        ];
        assert_eq!(got, want.map(|w| w.map(str::to_string)));
    }

    /// A `SCRIPT FLUSH` in the middle of a pipeline: the entries before it ran, and only the
    /// ones that answered NOSCRIPT go again (an `offline_push` sent twice holds twice).
    #[test]
    fn only_the_entries_that_answered_noscript_are_sent_again() {
        let noscript =
            redis::parse_redis_value(b"-NOSCRIPT No matching script.\r\n").expect("an error reply");
        assert!(matches!(noscript, Value::ServerError(_)), "{noscript:?}");
        let ok = |s: &str| Value::SimpleString(s.into());
        let mut con = Canned {
            replies: vec![
                vec![ok("a"), noscript.clone(), noscript],
                vec![ok("b"), ok("c")],
            ],
            sent: Vec::new(),
        };
        let script = Script::new("return 1");
        let out = evalsha_many(
            &mut con,
            &script,
            &[1, 2, 3],
            |_| 0,
            |c, i| {
                c.arg(*i);
            },
        )
        .expect("replies");
        let texts: Vec<String> = out
            .into_iter()
            .map(|r| text(&r.expect("ok")).unwrap_or_default().to_string())
            .collect();
        assert_eq!(texts, ["a", "b", "c"]);
        assert_eq!(con.sent, [3, 2]);
    }

    #[test]
    fn keys_and_tuples() {
        let rig = RigId::parse("rig-0414").unwrap();
        let boot = BootId::parse(BOOT).unwrap();
        assert_eq!(rig_key(&rig), "rig:rig-0414");
        assert_eq!(broker_key("fe-1:8080"), "broker:fe-1:8080");
        assert_eq!(tuple(&boot, "fe-1"), format!("{BOOT}|fe-1"));
    }

    #[test]
    fn owner_parse_tolerates_garbage() {
        let owner = Owner::parse(&format!("{BOOT}|fe|odd"));
        assert_eq!(owner.boot_id, BOOT);
        assert_eq!(owner.broker_id, "fe|odd");
        let raw = Owner::parse("garbage");
        assert_eq!(
            (raw.boot_id.as_str(), raw.broker_id.as_str()),
            ("garbage", "")
        );
    }

    #[test]
    fn ttl_is_clamped_to_what_the_scripts_accept() {
        assert_eq!(ttl_ms(Duration::ZERO), 1);
        assert_eq!(ttl_ms(Duration::from_micros(1500)), 1);
        assert_eq!(ttl_ms(Duration::from_secs(60)), 60_000);
        assert_eq!(ttl_ms(Duration::MAX).to_string().len(), 15);
    }

    #[test]
    fn wrong_shapes_are_unexpected() {
        assert_eq!(
            refresh_status(&Value::BulkString(b"ok".to_vec())),
            Some(RefreshStatus::Ok)
        );
        assert_eq!(refresh_status(&Value::BulkString(b"OK".to_vec())), None);
        assert_eq!(
            refresh_status(&Value::BulkString(
                format!("taken|{BOOT}|fe-b").into_bytes()
            )),
            Some(RefreshStatus::Taken {
                from: Owner::parse(&format!("{BOOT}|fe-b"))
            })
        );
        assert_eq!(refresh_status(&Value::BulkString(b"taken".to_vec())), None);
        assert_eq!(refresh_status(&Value::Int(1)), None);
        let long = Value::BulkString(vec![b'x'; 1000]);
        let RegistryError::UnexpectedReply(msg) = unexpected("refresh", &long) else {
            panic!("wrong variant");
        };
        assert!(msg.len() < 300, "{msg}");
    }
}
