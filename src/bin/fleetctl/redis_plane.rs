//! Fleet mode: the registry keys and pub/sub channels of CONTRACT.md §3–4.
//!
//! A request subscribes to a fresh `fleetlink:reply:<id>` on its own connection and only then
//! publishes, so a reply can never arrive before anyone listens. Everything read from Redis is
//! untrusted: a malformed payload is skipped with a warning, never unwrapped.

use std::collections::BTreeSet;
use std::time::{Duration, Instant};

use anyhow::{anyhow, bail, Context};
use fleetlink::admin::new_id;
use fleetlink::ids::RigId;
use fleetlink::registry::scripts::{broker_key, rig_key, Owner};
use redis::{Client, Connection, IntoConnectionInfo, PubSub, RedisConnectionInfo};
use serde_json::{json, Map, Value};

use crate::cli::{redact, Selector};
use crate::render::secs;
use crate::{error_reply, Broadcast, ControlPlane, Page, TimedOut};

/// How long `status`, `list`, `brokers` (which have no `--timeout`) and the start of an
/// `events` tail without `--for` wait for Redis; their `--help` says so.
const DEFAULT_WAIT: Duration = Duration::from_secs(5);
/// SCAN COUNT used when walking `broker:*` (brokers are few).
const BROKER_SCAN_COUNT: u64 = 1000;
/// Where every broker listens for selector commands.
const BROADCAST_CHANNEL: &str = "fleetlink:broadcast";
/// Where brokers publish rig and command lifecycle events.
const EVENTS_CHANNEL: &str = "fleetlink:events";

/// A lazily connected view of the fleet's Redis.
pub(crate) struct RedisPlane {
    /// Connects to the URL's address and says nothing: the AUTH and SELECT are `open`'s, so
    /// that together they get what is left of the command's wait, not a wait each.
    client: Client,
    /// The URL's user, password and database.
    auth: RedisConnectionInfo,
    /// The command connection, opened on first use so usage errors never need Redis.
    con: Option<Connection>,
    /// The URL without its password, for messages.
    shown: String,
    /// The running command's wait (its `--timeout`, or [`DEFAULT_WAIT`]), for messages.
    wait: Duration,
    /// When that wait runs out: every connect, command and read of the command's Redis
    /// traffic gets only what is left of it, so a hung Redis (one that accepts connections
    /// and never answers) costs `--timeout`, not a fixed time of its own.
    deadline: Instant,
}

impl RedisPlane {
    /// Checks the URL; no connection is made yet.
    pub(crate) fn new(url: &str) -> anyhow::Result<RedisPlane> {
        let shown = redact(url);
        let mut info = url
            .into_connection_info()
            .with_context(|| format!("invalid Redis URL {shown}"))?;
        let auth = std::mem::take(&mut info.redis);
        let client = Client::open(info).with_context(|| format!("invalid Redis URL {shown}"))?;
        Ok(RedisPlane {
            client,
            auth,
            con: None,
            shown,
            wait: DEFAULT_WAIT,
            deadline: Instant::now() + DEFAULT_WAIT,
        })
    }

    /// Starts a command's wait of `wait`; returns its deadline.
    fn begin(&mut self, wait: Duration) -> Instant {
        self.wait = wait;
        self.deadline = Instant::now() + wait;
        self.deadline
    }

    /// What is left of the command's wait, or the timeout error (exit 3) when nothing is.
    fn left(&self) -> Result<Duration, TimedOut> {
        match self.deadline.checked_duration_since(Instant::now()) {
            Some(left) if !left.is_zero() => Ok(left),
            _ => Err(self.no_answer()),
        }
    }

    fn no_answer(&self) -> TimedOut {
        TimedOut(format!(
            "Redis at {} did not answer within {}",
            self.shown,
            secs(self.wait)
        ))
    }

    /// Maps a failed Redis command to one readable line (the redis error already names its
    /// cause), and a read or write that ran out of time to the timeout error.
    fn failed(&self, what: &'static str) -> impl FnOnce(redis::RedisError) -> anyhow::Error + '_ {
        move |e| {
            if e.is_timeout() {
                anyhow!(self.no_answer())
            } else {
                anyhow!("Redis {what} failed: {e}")
            }
        }
    }

    /// Looks up the owner, subscribes, publishes `build(id, reply_to)`, waits for one reply.
    fn request(
        &mut self,
        rig: &RigId,
        timeout: Duration,
        build: impl FnOnce(&str, &str) -> Value,
    ) -> anyhow::Result<Value> {
        let deadline = self.begin(timeout);
        let id = new_id();
        let fail =
            |error: &str, detail: &str| error_reply(Some(&id), Some(rig.as_str()), error, detail);
        let key = rig_key(rig);
        let entry: Option<String> = redis::cmd("GET")
            .arg(&key)
            .query(self.con()?)
            .map_err(self.failed("GET"))?;
        let Some(entry) = entry else {
            let detail = format!("no registry entry {key}: the rig is not connected to any broker");
            return Ok(fail("rig_not_connected", &detail));
        };
        let owner = Owner::parse(&entry);
        if owner.broker_id.is_empty() {
            let detail = format!("registry entry {key} is malformed: {entry:?}");
            return Ok(fail("rig_not_connected", &detail));
        }
        let channel = format!("fleetlink:broker:{}", owner.broker_id);
        // PUBLISH counts pattern subscribers too (a `PSUBSCRIBE *` watching the fleet): its
        // receiver count alone would have a dead broker's command wait out the timeout.
        let broker = BTreeSet::from([owner.broker_id.clone()]);
        if self.listening(&broker)?.is_empty() {
            let detail = format!(
                "{key} names broker {} but nothing subscribes to {channel}: the broker is gone \
                 or cut off from Redis (the stale entry expires with its TTL); nothing was sent",
                owner.broker_id
            );
            return Ok(fail("rig_not_connected", &detail));
        }
        let build = |reply_to: &str| build(&id, reply_to);
        self.round_trip(&id, &channel, build, |sub, receivers| {
            if receivers == 0 {
                let detail = format!(
                    "{key} names broker {} but nothing listens on {channel}: the broker is gone \
                     (the stale entry expires with its TTL)",
                    owner.broker_id
                );
                return Ok(fail("rig_not_connected", &detail));
            }
            while let Some(reply) = next_json(sub, Some(deadline), None)? {
                if reply["id"].as_str().is_none_or(|r| r == id) {
                    return Ok(reply);
                }
            }
            let detail = format!(
                "no reply from broker {} within {}",
                owner.broker_id,
                secs(timeout)
            );
            Ok(fail("timeout", &detail))
        })
    }

    /// Subscribes to a fresh `fleetlink:reply:<id>` on its own connection, publishes
    /// `build(reply_to)` on `channel`, then hands the subscription and the number of receivers
    /// to `collect`.
    fn round_trip<T>(
        &mut self,
        id: &str,
        channel: &str,
        build: impl FnOnce(&str) -> Value,
        collect: impl FnOnce(&mut PubSub<'_>, i64) -> anyhow::Result<T>,
    ) -> anyhow::Result<T> {
        let reply_to = format!("fleetlink:reply:{id}");
        let mut sub_con = self.open()?;
        let mut sub = sub_con.as_pubsub();
        sub.subscribe(&reply_to).map_err(self.failed("SUBSCRIBE"))?;
        let receivers = self.publish(channel, &build(&reply_to))?;
        collect(&mut sub, receivers)
    }

    /// `key`'s value, if any, and its PTTL. Two commands, not a pipeline: against a hung
    /// Redis, redis-rs waits out the read timeout once per reply a pipeline expects, which
    /// would make the command's wait twice what it says.
    fn get_with_ttl(&mut self, key: &str) -> anyhow::Result<(Option<String>, i64)> {
        let value = redis::cmd("GET")
            .arg(key)
            .query(self.con()?)
            .map_err(self.failed("GET"))?;
        let pttl = redis::cmd("PTTL")
            .arg(key)
            .query(self.con()?)
            .map_err(self.failed("PTTL"))?;
        Ok((value, pttl))
    }

    /// Which of `brokers` have a subscriber on their `fleetlink:broker:<id>` channel. A
    /// broker's key outlives a SIGKILL by up to its TTL; its subscription ends with its
    /// connection, so this is what tells a running broker from a dead one at once.
    fn listening(&mut self, brokers: &BTreeSet<String>) -> anyhow::Result<BTreeSet<String>> {
        if brokers.is_empty() {
            return Ok(BTreeSet::new());
        }
        let mut cmd = redis::cmd("PUBSUB");
        cmd.arg("NUMSUB");
        for b in brokers {
            cmd.arg(format!("fleetlink:broker:{b}"));
        }
        let counts: Vec<(String, i64)> = cmd.query(self.con()?).map_err(self.failed("PUBSUB"))?;
        Ok(counts
            .into_iter()
            .filter(|(_, n)| *n > 0)
            .filter_map(|(ch, _)| ch.strip_prefix("fleetlink:broker:").map(str::to_owned))
            .collect())
    }

    /// Every key matching `pattern` (a full SCAN walk).
    fn scan_all(&mut self, pattern: &str, count: u64) -> anyhow::Result<Vec<String>> {
        let mut keys = BTreeSet::new();
        let mut cursor = 0u64;
        loop {
            let (next, batch): (u64, Vec<String>) = redis::cmd("SCAN")
                .arg(cursor)
                .arg("MATCH")
                .arg(pattern)
                .arg("COUNT")
                .arg(count)
                .query(self.con()?)
                .map_err(self.failed("SCAN"))?;
            keys.extend(batch);
            cursor = next;
            if cursor == 0 {
                return Ok(keys.into_iter().collect());
            }
        }
    }

    fn publish(&mut self, channel: &str, msg: &Value) -> anyhow::Result<i64> {
        redis::cmd("PUBLISH")
            .arg(channel)
            .arg(msg.to_string())
            .query(self.con()?)
            .map_err(self.failed("PUBLISH"))
    }

    /// The command connection, opened on first use, its reads and writes bounded by what is
    /// left of the command's wait.
    fn con(&mut self) -> anyhow::Result<&mut Connection> {
        let con = match self.con.take() {
            Some(con) => con,
            None => self.open()?,
        };
        let left = self.left()?;
        con.set_read_timeout(Some(left))?;
        con.set_write_timeout(Some(left))?;
        Ok(self.con.insert(con))
    }

    /// A new connection, its connect (with the client's hello to Redis), reads and writes
    /// bounded by what is left of the command's wait. A Redis that accepts the connection
    /// but does not answer in time is a timeout (exit 3); one that refuses it, an error.
    fn open(&self) -> anyhow::Result<Connection> {
        let con = self
            .client
            .get_connection_with_timeout(self.left()?)
            .map_err(|e| {
                if e.is_timeout() {
                    anyhow!(self.no_answer())
                } else {
                    anyhow!("cannot connect to Redis at {}: {e}", self.shown)
                }
            })?;
        let mut con = con;
        let left = self.left()?;
        con.set_read_timeout(Some(left))?;
        con.set_write_timeout(Some(left))?;
        if let Some(password) = &self.auth.password {
            let mut auth = redis::cmd("AUTH");
            if let Some(user) = &self.auth.username {
                auth.arg(user);
            }
            auth.arg(password)
                .query::<()>(&mut con)
                .map_err(self.failed("AUTH"))?;
        }
        if self.auth.db != 0 {
            let left = self.left()?;
            con.set_read_timeout(Some(left))?;
            redis::cmd("SELECT")
                .arg(self.auth.db)
                .query::<()>(&mut con)
                .map_err(self.failed("SELECT"))?;
        }
        Ok(con)
    }
}

impl ControlPlane for RedisPlane {
    /// `send RIG NAME`: one command through the rig's broker channel.
    fn send(
        &mut self,
        rig: &RigId,
        name: &str,
        args: &Map<String, Value>,
        timeout: Duration,
    ) -> anyhow::Result<Value> {
        self.request(rig, timeout, |id, reply_to| {
            json!({"type": "command", "id": id, "rig_id": rig.as_str(), "name": name, "args": args,
                   "reply_to": reply_to})
        })
    }

    /// `kick RIG`: the rig's broker closes its socket with 1012.
    fn kick(&mut self, rig: &RigId, timeout: Duration) -> anyhow::Result<Value> {
        self.request(rig, timeout, |id, reply_to| {
            json!({"type": "kick", "id": id, "rig_id": rig.as_str(), "reply_to": reply_to})
        })
    }

    /// `send --selector`: one broadcast; collects a reply per live broker until the deadline.
    fn broadcast(
        &mut self,
        selector: &Selector,
        name: &str,
        args: &Map<String, Value>,
        timeout: Duration,
    ) -> anyhow::Result<Broadcast> {
        let deadline = self.begin(timeout);
        let id = new_id();
        let expected: Vec<String> = self
            .scan_all("broker:*", BROKER_SCAN_COUNT)?
            .iter()
            .filter_map(|k| k.strip_prefix("broker:").map(str::to_owned))
            .collect();
        if expected.is_empty() {
            bail!(
                "no live brokers (no broker:* keys in {}); nothing was sent",
                self.shown
            );
        }
        // A broker's key outlives a SIGKILL by up to its TTL, but pub/sub reaches only those
        // subscribed now: one with nothing on its channel will not get this broadcast, so it
        // is reported at once rather than waited for until the timeout.
        let listening = self.listening(&expected.iter().cloned().collect())?;
        let replies = expected
            .iter()
            .filter(|b| !listening.contains(*b))
            .map(|b| {
                let detail = format!(
                    "broker:{b} is there but nothing subscribes to fleetlink:broker:{b}: the \
                     broker is down or cut off from Redis, and did not get this broadcast"
                );
                json!({"id": id, "ok": false, "error": "broker_not_listening", "broker_id": b,
                       "detail": detail})
            })
            .collect();
        let mut out = Broadcast {
            id: id.clone(),
            expected,
            replies,
            timeout,
        };
        let build = |reply_to: &str| {
            json!({"type": "command", "id": id, "selector": selector, "name": name, "args": args,
                   "reply_to": reply_to})
        };
        self.round_trip(&id, BROADCAST_CHANNEL, build, |sub, _| {
            let mut waiting = listening;
            let mut replied = BTreeSet::new();
            while !waiting.is_empty() {
                let Some(reply) = next_json(sub, Some(deadline), None)? else {
                    break;
                };
                if reply["id"].as_str() != Some(id.as_str()) {
                    continue;
                }
                // Brokers reply once; a repeat must not count its rigs twice.
                let broker = reply["broker_id"].as_str().unwrap_or_default().to_owned();
                let reported = out.expected.contains(&broker) && !waiting.contains(&broker);
                if reported && !replied.contains(&broker) {
                    // Subscribed just after it was found not listening: reported as such.
                    continue;
                }
                if !replied.insert(broker.clone()) {
                    eprintln!("fleetctl: warning: ignoring a second reply from broker {broker:?}");
                    continue;
                }
                waiting.remove(&broker);
                out.replies.push(reply);
            }
            Ok(out)
        })
    }

    /// `status RIG`: the registry entry, its lease, and whether its broker is alive.
    fn status(&mut self, rig: &RigId) -> anyhow::Result<Value> {
        self.begin(DEFAULT_WAIT);
        let key = rig_key(rig);
        let (entry, pttl) = self.get_with_ttl(&key)?;
        let Some(entry) = entry else {
            let detail = format!("no registry entry {key}: the rig is not connected to any broker");
            return Ok(error_reply(
                None,
                Some(rig.as_str()),
                "rig_not_connected",
                &detail,
            ));
        };
        let owner = Owner::parse(&entry);
        let bkey = broker_key(&owner.broker_id);
        let (blob, broker_pttl) = self.get_with_ttl(&bkey)?;
        let listening = blob.is_some()
            && !self
                .listening(&BTreeSet::from([owner.broker_id.clone()]))?
                .is_empty();
        let mut status = json!({
            "ok": true,
            "rig_id": rig.as_str(),
            "boot_id": owner.boot_id,
            "broker_id": owner.broker_id,
            "ttl_ms": pttl,
            "broker_live": listening,
            "broker_key": blob.is_some(),
            "broker_ttl_ms": blob.as_ref().map(|_| broker_pttl),
            "broker": blob.as_deref().map(parse_blob),
        });
        if !listening {
            // The entry outlives its broker until the lease ends, but nothing can reach the rig
            // through it: a script testing `status` before `send` must hear what `send` would.
            let detail = format!(
                "its registry entry names broker {}, which is not running (nothing subscribes \
                 to its channel); the entry is stale until its lease ends",
                owner.broker_id
            );
            status["ok"] = json!(false);
            status["error"] = json!("rig_not_connected");
            status["detail"] = json!(detail);
        }
        Ok(status)
    }

    /// `list`: SCAN `rig:*` from `cursor` until at least `page_size` rigs or the end.
    fn list(&mut self, page_size: u64, cursor: &str) -> anyhow::Result<Page> {
        let mut cursor: u64 = cursor.parse().map_err(|_| {
            clap::Error::raw(clap::error::ErrorKind::InvalidValue, format!(
                "--cursor {cursor}: with --redis, a cursor is the number a page printed (0 = start)\n"
            ))
        })?;
        self.begin(DEFAULT_WAIT);
        let mut keys = Vec::new();
        loop {
            let (next, batch): (u64, Vec<String>) = redis::cmd("SCAN")
                .arg(cursor)
                .arg("MATCH")
                .arg("rig:*")
                .arg("COUNT")
                .arg(page_size)
                .query(self.con()?)
                .map_err(self.failed("SCAN"))?;
            keys.extend(batch);
            cursor = next;
            if cursor == 0 || keys.len() as u64 >= page_size {
                break;
            }
        }
        let values: Vec<Option<String>> = if keys.is_empty() {
            Vec::new()
        } else {
            redis::cmd("MGET")
                .arg(&keys)
                .query(self.con()?)
                .map_err(self.failed("MGET"))?
        };
        // A key that expired between SCAN and MGET is simply gone from the page.
        let mut rows: Vec<Value> = keys
            .iter()
            .zip(values)
            .filter_map(|(key, value)| {
                let owner = Owner::parse(&value?);
                let rig = key.strip_prefix("rig:")?;
                Some(json!({"rig_id": rig, "boot_id": owner.boot_id, "broker_id": owner.broker_id}))
            })
            .collect();
        let brokers = rows
            .iter()
            .filter_map(|r| r["broker_id"].as_str().map(str::to_owned))
            .collect();
        let live = self.listening(&brokers)?;
        for row in &mut rows {
            let up = row["broker_id"].as_str().is_some_and(|b| live.contains(b));
            row["broker_live"] = json!(up);
        }
        rows.sort_by(|a, b| a["rig_id"].as_str().cmp(&b["rig_id"].as_str()));
        Ok(Page {
            rows,
            next_cursor: (cursor != 0).then(|| cursor.to_string()),
            admin: false,
        })
    }

    /// `brokers`: every live `broker:*` key with its blob and remaining TTL.
    fn brokers(&mut self) -> anyhow::Result<Vec<Value>> {
        self.begin(DEFAULT_WAIT);
        let mut keys = self.scan_all("broker:*", BROKER_SCAN_COUNT)?;
        keys.sort();
        let ids = keys
            .iter()
            .filter_map(|k| k.strip_prefix("broker:").map(str::to_owned))
            .collect();
        let live = self.listening(&ids)?;
        let mut rows = Vec::with_capacity(keys.len());
        for key in keys {
            let (blob, pttl) = self.get_with_ttl(&key)?;
            let Some(blob) = blob else { continue };
            let mut row = match parse_blob(&blob) {
                Value::Object(map) => map,
                other => Map::from_iter([("raw".to_owned(), other)]),
            };
            let id = key.strip_prefix("broker:").unwrap_or(&key);
            row.insert("broker_id".into(), json!(id));
            row.insert("ttl_ms".into(), json!(pttl));
            row.insert("listening".into(), json!(live.contains(id)));
            rows.push(Value::Object(row));
        }
        Ok(rows)
    }

    /// `events`: calls `each` for every event until `limit` passes or `count` events arrived;
    /// returns how many arrived.
    fn events(
        &mut self,
        limit: Option<Duration>,
        count: Option<u64>,
        each: &mut dyn FnMut(&Value),
    ) -> anyhow::Result<u64> {
        // Without --for the tail runs until stopped, but its start (connect, subscribe) is
        // bounded all the same.
        let start = self.begin(limit.unwrap_or(DEFAULT_WAIT));
        let deadline = limit.map(|_| start);
        let mut sub_con = self.open()?;
        let mut sub = sub_con.as_pubsub();
        let mut tail = |sub: &mut PubSub<'_>| -> anyhow::Result<u64> {
            sub.subscribe(EVENTS_CHANNEL)
                .map_err(self.failed("SUBSCRIBE"))?;
            let mut seen = 0;
            while count.is_none_or(|n| seen < n) {
                let Some(event) = next_json(sub, deadline, Some(&self.shown))? else {
                    break;
                };
                each(&event);
                seen += 1;
            }
            Ok(seen)
        };
        let seen = tail(&mut sub);
        // Dropped, a subscription unsubscribes and waits for Redis's confirmation as long as
        // its last read could: from a Redis that stopped answering, a second whole wait.
        // fleetctl exits next, which ends the subscription all the same.
        let _ = sub.set_read_timeout(Some(Duration::from_millis(1)));
        seen
    }
}

/// How long a tail listens to silence before it asks Redis whether it is still there. A Redis
/// that hangs under a subscription (stopped, or its path black-holed) sends nothing, which
/// reads the same as a quiet fleet; a dead one closes the socket and is noticed at once.
const QUIET_PROBE: Duration = Duration::from_secs(2);

/// What is left until `deadline` (`None`: no deadline), or `Err(())` once it has passed.
fn until(deadline: Option<Instant>) -> Result<Option<Duration>, ()> {
    match deadline {
        Some(d) => match d.checked_duration_since(Instant::now()) {
            Some(left) if !left.is_zero() => Ok(Some(left)),
            _ => Err(()),
        },
        None => Ok(None),
    }
}

/// The next JSON object on `sub`, or `None` once `deadline` passes. Payloads that are not JSON
/// objects are skipped with a warning. With `probe` (the Redis's name for the error), after
/// [`QUIET_PROBE`] without a message a PING must be answered within [`DEFAULT_WAIT`] (or what
/// is left of the deadline), or the wait gives up with the timeout error (exit 3). A reply's
/// wait has its own deadline and goes without.
fn next_json(
    sub: &mut PubSub<'_>,
    deadline: Option<Instant>,
    probe: Option<&str>,
) -> anyhow::Result<Option<Value>> {
    loop {
        let Ok(left) = until(deadline) else {
            return Ok(None);
        };
        let wait = match probe {
            Some(_) => Some(left.map_or(QUIET_PROBE, |l| l.min(QUIET_PROBE))),
            None => left,
        };
        sub.set_read_timeout(wait)?;
        let msg = match sub.get_message() {
            Ok(msg) => msg,
            Err(e) if e.is_timeout() => {
                let Some(shown) = probe else {
                    return Ok(None);
                };
                let Ok(left) = until(deadline) else {
                    return Ok(None);
                };
                let answer_within = left.map_or(DEFAULT_WAIT, |l| l.min(DEFAULT_WAIT));
                sub.set_read_timeout(Some(answer_within))?;
                match sub.ping::<redis::Value>() {
                    Ok(_) => continue,
                    Err(e) if e.is_timeout() => {
                        if until(deadline).is_err() {
                            return Ok(None);
                        }
                        return Err(TimedOut(format!(
                            "Redis at {shown} stopped answering: no answer to a PING on the \
                             subscription within {}",
                            secs(answer_within)
                        ))
                        .into());
                    }
                    Err(e) => bail!("lost the Redis subscription: {e}"),
                }
            }
            Err(e) => bail!("lost the Redis subscription: {e}"),
        };
        let payload: Vec<u8> = match msg.get_payload() {
            Ok(p) => p,
            Err(e) => {
                eprintln!(
                    "fleetctl: warning: unreadable message on {}: {e}",
                    msg.get_channel_name()
                );
                continue;
            }
        };
        match serde_json::from_slice(&payload) {
            Ok(v @ Value::Object(_)) => return Ok(Some(v)),
            _ => eprintln!(
                "fleetctl: warning: ignoring a non-JSON message on {}: {}",
                msg.get_channel_name(),
                String::from_utf8_lossy(&payload)
            ),
        }
    }
}

/// A `broker:*` blob as JSON, or the raw text when it is not JSON.
fn parse_blob(blob: &str) -> Value {
    serde_json::from_str(blob).unwrap_or_else(|_| Value::String(blob.to_owned()))
}
