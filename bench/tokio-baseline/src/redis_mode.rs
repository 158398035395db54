//! Redis mode: the registry leases and the pub/sub control plane of CONTRACT.md §3-4, so the
//! benches can compare the baseline with `fleetlink-fe` on the distributed path, not only
//! standalone.
//!
//! Written the way a tokio team would: one `MultiplexedConnection` (cloned per call; concurrent
//! hellos from many connection tasks are pipelined on it) for the Lua scripts and publishes, and
//! one async PubSub connection read by a single task. The registry writes go through the
//! project's own `lua/` scripts by EVALSHA, exactly the scripts fe runs, so the registry's Redis
//! cost is the same for both brokers and the comparison is about the broker, not the scripts.
//!
//! Publishes (replies, events, evicts, canaries) go through one bounded queue to a publisher
//! task that sends whatever has accumulated as one pipeline, so the subscription reader never
//! waits for a Redis round trip. When the queue is full, lifecycle events and canaries are
//! dropped and counted (`fleetlink_publishes_total{result="dropped"}`); replies and evicts wait
//! for room instead, which stalls the subscription reader and lets Redis buffer (and at its
//! pub/sub output limit, drop the subscriber) rather than losing a reply control waits for.
//!
//! Out of the baseline's subset: session persistence, resume and the offline queue. While Redis
//! is unreachable, hellos are refused with 4503 (fe keeps serving from its embedded registry).
//! `--session-ttl` adds only the store's cost on the write path (`keep.rs`), for the benches.

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering::Relaxed};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use anyhow::{Context, Result};
use futures_util::StreamExt;
use redis::aio::MultiplexedConnection;
use redis::{AsyncConnectionConfig, ErrorKind, RedisError, RedisResult, Script};
use serde_json::{json, Map, Value};
use tokio::sync::{mpsc, Notify};
use tokio::time::{interval, sleep, timeout, MissedTickBehavior};

use crate::hello::valid_boot_id;
use crate::keep::{self, Job, Reply, KEEP_QUEUE};
use crate::metrics::RedisMetrics;
use crate::registry::{unix_ms, BootCheck, EnqueueError};
use crate::App;

/// Channel every broker subscribes to for broadcasts.
pub const BROADCAST: &str = "fleetlink:broadcast";
/// Channel of rig lifecycle events.
pub const EVENTS: &str = "fleetlink:events";
/// Most rig keys per refresh/release call: a script blocks Redis while it runs (same as fe).
const REFRESH_CHUNK: usize = 1000;
/// Publishes waiting for the publisher task.
const PUBLISH_QUEUE: usize = 65_536;
/// Most publishes sent in one pipeline.
const PUBLISH_BATCH: usize = 1024;
/// Connect and response timeout of every Redis call.
const IO_TIMEOUT: Duration = Duration::from_secs(2);
const CANARY_EVERY: Duration = Duration::from_secs(1);
/// `/readyz` fails when our own canary has not come back for this long.
const CANARY_STALE_MS: u64 = 5_000;
/// `broker:<id>`: refreshed every 10 s with a 30 s TTL (CONTRACT.md §3).
const HEARTBEAT_EVERY: Duration = Duration::from_secs(10);
const HEARTBEAT_TTL_MS: u64 = 30_000;
const MAX_BACKOFF: Duration = Duration::from_secs(5);

/// Logs to stderr without panicking when stderr is gone (`eprintln!` would, and take the Redis
/// tasks down with it).
macro_rules! log {
    ($($t:tt)*) => {{
        use std::io::Write as _;
        let _ = writeln!(
            std::io::stderr(),
            "fleetlink-tokio-baseline: {}",
            format_args!($($t)*)
        );
    }};
}

/// A broker's own control channel.
pub fn broker_channel(id: &str) -> String {
    format!("fleetlink:broker:{id}")
}

fn rig_key(rig_id: &str) -> String {
    format!("rig:{rig_id}")
}

/// RFC 3339 UTC with milliseconds, e.g. `2023-11-14T22:13:20.000Z` (fe's event timestamps).
pub fn rfc3339_ms(ms: u64) -> String {
    let (secs, milli) = (ms / 1000, ms % 1000);
    let (days, sod) = ((secs / 86_400) as i64, secs % 86_400);
    // Howard Hinnant's civil_from_days.
    let z = days + 719_468;
    let (era, doe) = (z.div_euclid(146_097), z.rem_euclid(146_097));
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let d = doy - (153 * mp + 2) / 5 + 1;
    let m = if mp < 10 { mp + 3 } else { mp - 9 };
    let y = yoe + era * 400 + i64::from(m <= 2);
    format!(
        "{y:04}-{m:02}-{d:02}T{:02}:{:02}:{:02}.{milli:03}Z",
        sod / 3600,
        sod / 60 % 60,
        sod % 60
    )
}

fn now_rfc3339() -> String {
    rfc3339_ms(unix_ms())
}

/// What hello.lua did.
#[derive(Debug, PartialEq, Eq)]
pub enum HelloOutcome {
    /// This boot on this broker owns the rig; `evict` names another broker that held it.
    Owned { evict: Option<String> },
    /// A newer boot owns the rig: nothing was written (close 4409).
    Older,
}

/// Splits hello.lua's `previous` (`<boot>|<broker>`, or "") into the broker to evict, if any.
fn broker_to_evict(previous: &str, own: &str) -> Option<String> {
    let (_, broker) = previous.split_once('|')?;
    (!broker.is_empty() && broker != own).then(|| broker.to_string())
}

struct Publish {
    channel: String,
    payload: String,
}

pub struct Fleet {
    client: redis::Client,
    con: Mutex<MultiplexedConnection>,
    /// Set when a call failed at the connection level; the upkeep task reopens it.
    broken: AtomicBool,
    hello: Script,
    refresh: Script,
    release: Script,
    broker: Script,
    /// `--session-ttl`: persist.lua, the session TTL in ms, and the keeper's queue.
    keeping: Option<Keeping>,
    broker_id: String,
    ttl_ms: u64,
    publish_tx: mpsc::Sender<Publish>,
    publish_rx: Mutex<Option<mpsc::Receiver<Publish>>>,
    canary_at_ms: AtomicU64,
    /// Woken after the subscription came back: leases and heartbeat are re-asserted at once
    /// (Redis may have restarted empty).
    reconnected: Notify,
    started_at: String,
}

async fn open_con(client: &redis::Client) -> RedisResult<MultiplexedConnection> {
    let cfg = AsyncConnectionConfig::new()
        .set_connection_timeout(IO_TIMEOUT)
        .set_response_timeout(IO_TIMEOUT);
    client
        .get_multiplexed_async_connection_with_config(&cfg)
        .await
}

fn unexpected(what: &str) -> RedisError {
    RedisError::from((
        ErrorKind::TypeError,
        "unexpected script reply",
        what.to_string(),
    ))
}

/// A TTL as the scripts take it: whole ms, 1 to 15 digits.
fn script_ms(d: Duration) -> u64 {
    (d.as_millis() as u64).clamp(1, 999_999_999_999_999)
}

struct Keeping {
    persist: Script,
    session_ttl_ms: u64,
    tx: mpsc::Sender<Job>,
    rx: Mutex<Option<mpsc::Receiver<Job>>>,
}

impl Fleet {
    /// Connects the command connection and loads the scripts; the subscription comes up in
    /// [`spawn`]. Fails when Redis is unreachable at start-up. A `session_ttl` above zero keeps
    /// every command in Redis before it is written (`keep.rs`).
    pub async fn connect(
        url: &str,
        broker_id: &str,
        ttl: Duration,
        session_ttl: Duration,
    ) -> Result<Fleet> {
        let client = redis::Client::open(url).with_context(|| format!("--redis {url}"))?;
        let mut con = open_con(&client)
            .await
            .with_context(|| format!("connecting to {url}"))?;
        let hello = Script::new(include_str!("../../../lua/hello.lua"));
        let refresh = Script::new(include_str!("../../../lua/refresh.lua"));
        let release = Script::new(include_str!("../../../lua/release.lua"));
        let broker = Script::new(include_str!("../../../lua/broker.lua"));
        // EVALSHA would load them lazily; loading now makes a broken script fail at start-up.
        for s in [&hello, &refresh, &release, &broker] {
            s.load_async(&mut con).await.context("SCRIPT LOAD")?;
        }
        let keeping = if session_ttl.is_zero() {
            None
        } else {
            // Built as fleetlink-fe builds it, behind what it shares with the lapse scripts (it
            // names each session it adds to): the same script, the same cost.
            let persist = Script::new(concat!(
                include_str!("../../../lua/before_event.lua"),
                include_str!("../../../lua/lease_holder.lua"),
                include_str!("../../../lua/lapse_end.lua"),
                include_str!("../../../lua/persist.lua")
            ));
            persist.load_async(&mut con).await.context("SCRIPT LOAD")?;
            let (tx, rx) = mpsc::channel(KEEP_QUEUE);
            Some(Keeping {
                persist,
                session_ttl_ms: script_ms(session_ttl),
                tx,
                rx: Mutex::new(Some(rx)),
            })
        };
        let (publish_tx, publish_rx) = mpsc::channel(PUBLISH_QUEUE);
        Ok(Fleet {
            client,
            con: Mutex::new(con),
            broken: AtomicBool::new(false),
            hello,
            refresh,
            release,
            broker,
            keeping,
            broker_id: broker_id.to_string(),
            ttl_ms: script_ms(ttl),
            publish_tx,
            publish_rx: Mutex::new(Some(publish_rx)),
            canary_at_ms: AtomicU64::new(0),
            reconnected: Notify::new(),
            started_at: now_rfc3339(),
        })
    }

    /// A handle on the command connection (a clone shares the one multiplexed socket).
    fn con(&self) -> MultiplexedConnection {
        self.con.lock().unwrap_or_else(|e| e.into_inner()).clone()
    }

    fn check<T>(&self, r: RedisResult<T>) -> RedisResult<T> {
        if let Err(e) = &r {
            if e.is_io_error() || e.is_connection_dropped() || e.is_unrecoverable_error() {
                self.broken.store(true, Relaxed);
            }
        }
        r
    }

    fn tuple(&self, boot_id: &str) -> String {
        format!("{boot_id}|{}", self.broker_id)
    }

    /// hello.lua: claims `rig_id` for `boot_id` here unless a newer boot owns it. The script
    /// takes a batch of hellos; a task per connection sends its own, a batch of one.
    pub async fn hello(&self, rig_id: &str, boot_id: &str) -> RedisResult<HelloOutcome> {
        let r = self
            .hello
            .key(rig_key(rig_id))
            .arg(&self.broker_id)
            .arg(self.ttl_ms)
            .arg(boot_id)
            .invoke_async::<((String, Vec<u8>),)>(&mut self.con())
            .await;
        let ((status, previous),) = self.check(r)?;
        match status.as_str() {
            "ok" => Ok(HelloOutcome::Owned {
                evict: broker_to_evict(&String::from_utf8_lossy(&previous), &self.broker_id),
            }),
            "older" => Ok(HelloOutcome::Older),
            _ => Err(unexpected("hello")),
        }
    }

    /// release.lua: deletes the rig's entry if it is still exactly this broker's tuple.
    pub async fn release(&self, rig_id: &str, boot_id: &str) -> RedisResult<()> {
        let r = self
            .release
            .key(rig_key(rig_id))
            .arg(self.tuple(boot_id))
            .invoke_async::<i64>(&mut self.con())
            .await;
        self.check(r).map(drop)
    }

    /// True with `--session-ttl`: commands wait for the keeper before they are written.
    pub fn keeps_commands(&self) -> bool {
        self.keeping.is_some()
    }

    /// Hands a job to the keeper, waiting for room (a command's reply depends on it).
    async fn keep(&self, job: Job) {
        if let Some(k) = &self.keeping {
            // Fails only if the keeper task is gone; the dropped ticket then lets the
            // connection write the command unkept.
            let _ = k.tx.send(job).await;
        }
    }

    /// The rig acked `seq`. Dropped (and counted) when the keeper's queue is full: the
    /// session's TTL removes it later.
    pub fn forget(&self, m: &RedisMetrics, rig_id: &str, boot_id: &str, seq: u64) {
        if let Some(k) = &self.keeping {
            let job = Job::Forget {
                rig_id: rig_id.to_string(),
                boot_id: boot_id.to_string(),
                seq,
            };
            if k.tx.try_send(job).is_err() {
                m.forget_dropped.fetch_add(1, Relaxed);
            }
        }
    }

    /// persist.lua over `(rig_id, boot_id, seq, json)` commands: "ok" or "fenced" for each.
    pub async fn persist(&self, batch: &[(&str, &str, u64, &str)]) -> RedisResult<Vec<String>> {
        let Some(k) = &self.keeping else {
            return Err(unexpected("persist without --session-ttl"));
        };
        let mut call = k.persist.prepare_invoke();
        call.arg(k.session_ttl_ms);
        for &(rig_id, boot_id, seq, json) in batch {
            call.key(rig_key(rig_id))
                .key(keep::session_key(rig_id, boot_id))
                .arg(self.tuple(boot_id))
                .arg(seq)
                .arg(json);
        }
        let r = call.invoke_async::<Vec<String>>(&mut self.con()).await;
        let kept = self.check(r)?;
        if kept.len() != batch.len() {
            return Err(unexpected("persist"));
        }
        Ok(kept)
    }

    /// `HDEL <session> c:<seq>` for each acked command, as one pipeline.
    pub async fn forget_acked(&self, acked: &[(String, u64)]) -> RedisResult<()> {
        let mut pipe = redis::pipe();
        for (key, seq) in acked {
            pipe.cmd("HDEL").arg(key).arg(format!("c:{seq}")).ignore();
        }
        let r = pipe.query_async::<()>(&mut self.con()).await;
        self.check(r)
    }

    /// refresh.lua over `leases`, at most [`REFRESH_CHUNK`] keys per call.
    async fn refresh(&self, leases: &[(String, String)]) -> RedisResult<Vec<String>> {
        let mut out = Vec::with_capacity(leases.len());
        for chunk in leases.chunks(REFRESH_CHUNK) {
            let mut call = self.refresh.prepare_invoke();
            call.arg(self.ttl_ms);
            for (rig, boot) in chunk {
                call.key(rig_key(rig)).arg(self.tuple(boot));
            }
            let r = call.invoke_async::<Vec<String>>(&mut self.con()).await;
            let statuses = self.check(r)?;
            if statuses.len() != chunk.len() {
                return Err(unexpected("refresh"));
            }
            out.extend(statuses);
        }
        Ok(out)
    }

    /// Queues a publish that must not be lost (a reply, an evict): waits for room.
    pub async fn publish(&self, channel: String, v: &Value) {
        let p = Publish {
            channel,
            payload: v.to_string(),
        };
        // Err only when the publisher task is gone, i.e. the runtime is shutting down.
        let _ = self.publish_tx.send(p).await;
    }

    /// Queues a publish that may be dropped (events, canaries): counted when the queue is full.
    pub fn publish_lossy(&self, m: &RedisMetrics, channel: &str, v: &Value) {
        let p = Publish {
            channel: channel.to_string(),
            payload: v.to_string(),
        };
        if self.publish_tx.try_send(p).is_err() {
            m.publish_dropped.fetch_add(1, Relaxed);
        }
    }

    /// A lifecycle event on `fleetlink:events`; `v` gets `broker_id` and `at`.
    pub fn event(&self, m: &RedisMetrics, mut v: Value) {
        v["broker_id"] = json!(self.broker_id);
        v["at"] = json!(now_rfc3339());
        self.publish_lossy(m, EVENTS, &v);
    }

    /// Ready while our own canary keeps coming back through the subscription.
    pub fn not_ready(&self) -> Option<String> {
        let at = self.canary_at_ms.load(Relaxed);
        if at == 0 {
            return Some("redis subscription not confirmed yet".into());
        }
        let age = unix_ms().saturating_sub(at);
        (age > CANARY_STALE_MS).then(|| format!("no canary for {age} ms"))
    }
}

/// Starts the publisher, the subscription reader and the upkeep timers.
pub fn spawn(app: &Arc<App>) {
    let Some(fleet) = app.fleet.as_ref() else {
        return;
    };
    app.metrics.redis_mode.store(true, Relaxed);
    app.metrics.redis.up.store(1, Relaxed);
    if let Some(rx) = fleet
        .publish_rx
        .lock()
        .unwrap_or_else(|e| e.into_inner())
        .take()
    {
        tokio::spawn(publisher(app.clone(), rx));
    }
    if let Some(rx) = fleet
        .keeping
        .as_ref()
        .and_then(|k| k.rx.lock().unwrap_or_else(|e| e.into_inner()).take())
    {
        tokio::spawn(keep::keeper(app.clone(), rx));
    }
    tokio::spawn(subscriber(app.clone()));
    tokio::spawn(upkeep(app.clone()));
}

async fn publisher(app: Arc<App>, mut rx: mpsc::Receiver<Publish>) {
    let Some(fleet) = app.fleet.as_ref() else {
        return;
    };
    let m = &app.metrics.redis;
    let mut batch = Vec::with_capacity(PUBLISH_BATCH);
    // Whatever accumulated while the previous pipeline was in flight goes out as the next one.
    while rx.recv_many(&mut batch, PUBLISH_BATCH).await > 0 {
        let mut pipe = redis::pipe();
        for p in &batch {
            pipe.cmd("PUBLISH").arg(&p.channel).arg(&p.payload).ignore();
        }
        let r = pipe.query_async::<()>(&mut fleet.con()).await;
        match fleet.check(r) {
            Ok(()) => m.published.fetch_add(batch.len() as u64, Relaxed),
            Err(_) => m.publish_failed.fetch_add(batch.len() as u64, Relaxed),
        };
        batch.clear();
    }
}

async fn subscribe(fleet: &Fleet) -> RedisResult<redis::aio::PubSubStream> {
    let mut ps = fleet.client.get_async_pubsub().await?;
    ps.subscribe(&[broker_channel(&fleet.broker_id), BROADCAST.to_string()])
        .await?;
    Ok(ps.into_on_message())
}

async fn subscriber(app: Arc<App>) {
    let Some(fleet) = app.fleet.as_ref() else {
        return;
    };
    let m = &app.metrics.redis;
    let mut backoff = Duration::from_millis(100);
    let mut first = true;
    loop {
        match timeout(IO_TIMEOUT, subscribe(fleet)).await {
            Ok(Ok(mut stream)) => {
                m.up.store(1, Relaxed);
                backoff = Duration::from_millis(100);
                if !std::mem::take(&mut first) {
                    log!("redis subscription back");
                    fleet.reconnected.notify_one();
                }
                while let Some(msg) = stream.next().await {
                    m.control_in.fetch_add(1, Relaxed);
                    control(&app, fleet, msg.get_channel_name(), msg.get_payload_bytes()).await;
                }
                log!("redis subscription lost");
            }
            Ok(Err(e)) => log!("redis subscribe: {e}"),
            Err(_) => log!("redis subscribe: timed out"),
        }
        m.up.store(0, Relaxed);
        // The command connection most likely shares the outage.
        fleet.broken.store(true, Relaxed);
        sleep(backoff).await;
        backoff = (backoff * 2).min(MAX_BACKOFF);
    }
}

/// Lease refresh every `--registry-refresh`, `broker:<id>` every 10 s, the canary every second
/// (which also reopens a broken command connection).
async fn upkeep(app: Arc<App>) {
    let Some(fleet) = app.fleet.as_ref() else {
        return;
    };
    let every = app.cfg.registry_refresh.max(Duration::from_millis(100));
    let mut refresh = interval(every);
    let mut beat = interval(HEARTBEAT_EVERY);
    let mut canary = interval(CANARY_EVERY);
    for t in [&mut refresh, &mut beat, &mut canary] {
        t.set_missed_tick_behavior(MissedTickBehavior::Delay);
    }
    refresh.tick().await; // the first tick is immediate; hellos have just written the leases
    loop {
        tokio::select! {
            _ = refresh.tick() => refresh_leases(&app, fleet).await,
            _ = beat.tick() => heartbeat(&app, fleet).await,
            _ = fleet.reconnected.notified() => {
                repair(fleet).await;
                refresh_leases(&app, fleet).await;
                heartbeat(&app, fleet).await;
            }
            _ = canary.tick() => {
                repair(fleet).await;
                let v = json!({"type": "canary", "broker_id": fleet.broker_id, "at": unix_ms()});
                fleet.publish_lossy(&app.metrics.redis, &broker_channel(&fleet.broker_id), &v);
            }
        }
    }
}

/// Reopens the command connection after a connection-level failure.
async fn repair(fleet: &Fleet) {
    if fleet.broken.swap(false, Relaxed) {
        match open_con(&fleet.client).await {
            Ok(c) => *fleet.con.lock().unwrap_or_else(|e| e.into_inner()) = c,
            Err(e) => {
                fleet.broken.store(true, Relaxed);
                log!("redis reconnect: {e}");
            }
        }
    }
}

async fn refresh_leases(app: &App, fleet: &Fleet) {
    let leases = app.registry.leases();
    if leases.is_empty() {
        return;
    }
    let m = &app.metrics.redis;
    let statuses = match fleet.refresh(&leases).await {
        Ok(s) => s,
        Err(e) => {
            m.refresh_error.fetch_add(1, Relaxed);
            log!("refresh: {e}");
            return;
        }
    };
    let mut current = None;
    for ((rig, boot), status) in leases.iter().zip(statuses) {
        match status.as_str() {
            "ok" => m.refresh_ok.fetch_add(1, Relaxed),
            "restored" => {
                // The rig may have left while the call was in flight: give the key back.
                let held = current.get_or_insert_with(|| app.registry.leases());
                if !held.contains(&(rig.clone(), boot.clone())) {
                    let _ = fleet.release(rig, boot).await;
                }
                m.refresh_restored.fetch_add(1, Relaxed)
            }
            _ => {
                app.registry.supersede(rig, BootCheck::Exact(boot));
                m.refresh_superseded.fetch_add(1, Relaxed)
            }
        };
    }
}

async fn heartbeat(app: &App, fleet: &Fleet) {
    let cores = app.cfg.workers.unwrap_or_else(|| {
        std::thread::available_parallelism().map_or(1, std::num::NonZeroUsize::get)
    });
    let blob = json!({
        "broker_id": fleet.broker_id, "address": app.cfg.listen.to_string(), "cores": cores,
        "started_at": fleet.started_at, "connections": app.registry.len(),
    });
    let r = fleet
        .broker
        .key(format!("broker:{}", fleet.broker_id))
        .key(format!("sentinel:{}", fleet.broker_id))
        .arg(blob.to_string())
        .arg(HEARTBEAT_TTL_MS)
        .invoke_async::<String>(&mut fleet.con())
        .await;
    if let Err(e) = fleet.check(r) {
        log!("broker heartbeat: {e}");
    }
}

fn valid_rig_id(s: &str) -> bool {
    (1..=64).contains(&s.len())
        && s.bytes()
            .all(|c| c.is_ascii_alphanumeric() || matches!(c, b'.' | b'_' | b'-'))
}

fn error_reply(id: &str, rig: Option<&str>, error: &str, detail: &str) -> Value {
    json!({"id": id, "ok": false, "error": error, "rig_id": rig, "detail": detail})
}

/// How a command from control was queued.
enum Queued {
    /// In the outbox as `seq`; control's reply is due now.
    Now(u64),
    /// Behind its keep (`--session-ttl`): the keeper answers control once Redis has it.
    Keeping,
}

/// Enqueues through the same `Registry::enqueue` as the admin route (or its keeping variant);
/// an error is control's §4 reply.
async fn queue_command(
    app: &App,
    fleet: &Fleet,
    id: &str,
    rig_id: &str,
    name: &str,
    args: &Value,
    reply_to: Option<&str>,
) -> Result<Queued, Value> {
    let m = &app.metrics;
    let refused = if fleet.keeps_commands() {
        match app.registry.enqueue_kept(rig_id, id, name, args) {
            Ok(ticket) => {
                m.commands_ok.fetch_add(1, Relaxed);
                let reply = reply_to.map(|r| Reply {
                    reply_to: r.to_string(),
                    id: id.to_string(),
                });
                let rig_id = rig_id.to_string();
                fleet
                    .keep(Job::Keep {
                        rig_id,
                        ticket,
                        reply,
                    })
                    .await;
                return Ok(Queued::Keeping);
            }
            Err(e) => e,
        }
    } else {
        match app.registry.enqueue(rig_id, id, name, args) {
            Ok(seq) => {
                m.commands_ok.fetch_add(1, Relaxed);
                return Ok(Queued::Now(seq));
            }
            Err(e) => e,
        }
    };
    Err(match refused {
        EnqueueError::NotConnected => {
            m.commands_not_connected.fetch_add(1, Relaxed);
            error_reply(
                id,
                Some(rig_id),
                "rig_not_connected",
                "this broker does not hold the rig",
            )
        }
        EnqueueError::Full {
            depth,
            cap,
            oldest_age,
            last_ack_seq,
            last_ack_at_ms,
        } => {
            m.commands_unresponsive.fetch_add(1, Relaxed);
            json!({
                "id": id, "ok": false, "error": "rig_unresponsive", "rig_id": rig_id,
                "detail": format!("outbox full ({depth}/{cap}), oldest queued cmd age {}s", oldest_age.as_secs()),
                "last_ack_seq": last_ack_seq,
                "last_ack_at": (last_ack_at_ms > 0).then(|| rfc3339_ms(last_ack_at_ms)),
                "suggested_action": "force_reconnect",
            })
        }
    })
}

/// One control message from our channel or the broadcast channel.
async fn control(app: &App, fleet: &Fleet, channel: &str, payload: &[u8]) {
    let m = &app.metrics.redis;
    let broadcast = channel == BROADCAST;
    let Ok(Value::Object(msg)) = serde_json::from_slice::<Value>(payload) else {
        m.control_bad_request.fetch_add(1, Relaxed);
        return;
    };
    let s = |k: &str| msg.get(k).and_then(Value::as_str);
    let id = s("id").map(str::to_string).unwrap_or_else(|| {
        format!(
            "{}-{}",
            fleet.broker_id,
            app.next_command_id.fetch_add(1, Relaxed)
        )
    });
    let reply_to = s("reply_to").filter(|r| !r.is_empty());
    let rig = s("rig_id").filter(|r| valid_rig_id(r));
    let why = match (s("type"), broadcast) {
        (Some("canary"), _) => {
            if s("broker_id") == Some(fleet.broker_id.as_str()) {
                fleet.canary_at_ms.store(unix_ms(), Relaxed);
            }
            return;
        }
        (Some("evict"), false) => match (rig, s("boot_id").filter(|b| valid_boot_id(b))) {
            (Some(rig), Some(boot)) => {
                m.evict_received.fetch_add(1, Relaxed);
                app.registry.supersede(rig, BootCheck::AtMost(boot));
                return;
            }
            _ => "evict needs a valid rig_id and boot_id",
        },
        (Some("kick"), false) => match (rig, reply_to) {
            (Some(rig), Some(reply_to)) => {
                let v = if app.registry.kick(rig) {
                    json!({"id": id, "ok": true, "rig_id": rig})
                } else {
                    error_reply(
                        &id,
                        Some(rig),
                        "rig_not_connected",
                        "this broker does not hold the rig",
                    )
                };
                return fleet.publish(reply_to.to_string(), &v).await;
            }
            _ => "kick needs a valid rig_id and reply_to",
        },
        (Some("command"), _) => match command_fields(&msg, broadcast) {
            Ok((name, args, selector)) => {
                let Some(reply_to) = reply_to else {
                    m.control_bad_request.fetch_add(1, Relaxed);
                    return;
                };
                let v = match (selector, rig) {
                    (Some(sel), _) => broadcast_reply(app, fleet, &id, &sel, name, &args).await,
                    (None, Some(rig)) => {
                        match queue_command(app, fleet, &id, rig, name, &args, Some(reply_to)).await
                        {
                            Ok(Queued::Now(seq)) => {
                                json!({"id": id, "ok": true, "rig_id": rig, "seq": seq})
                            }
                            Ok(Queued::Keeping) => return,
                            Err(v) => v,
                        }
                    }
                    (None, None) => {
                        app.metrics.commands_bad_request.fetch_add(1, Relaxed);
                        error_reply(
                            &id,
                            s("rig_id"),
                            "bad_request",
                            "command needs a valid rig_id",
                        )
                    }
                };
                return fleet.publish(reply_to.to_string(), &v).await;
            }
            Err(why) => why,
        },
        _ => "unknown control message type",
    };
    m.control_bad_request.fetch_add(1, Relaxed);
    if let Some(reply_to) = reply_to {
        let v = error_reply(&id, s("rig_id"), "bad_request", why);
        fleet.publish(reply_to.to_string(), &v).await;
    }
}

type CommandFields<'a> = (&'a str, Value, Option<Vec<(String, String)>>);

/// A command's name, args (default `{}`) and, on the broadcast channel, its selector.
fn command_fields(msg: &Map<String, Value>, broadcast: bool) -> Result<CommandFields<'_>, &str> {
    let name = msg
        .get("name")
        .and_then(Value::as_str)
        .filter(|n| !n.is_empty() && n.len() <= 128)
        .ok_or("command needs a name of 1-128 bytes")?;
    let args = match msg.get("args") {
        None | Some(Value::Null) => Value::Object(Map::new()),
        Some(a @ Value::Object(_)) => a.clone(),
        Some(_) => return Err("args must be an object"),
    };
    if !broadcast {
        return Ok((name, args, None));
    }
    let Some(Value::Object(sel)) = msg.get("selector") else {
        return Err("a broadcast command needs a selector");
    };
    let mut pairs = Vec::with_capacity(sel.len());
    for (k, v) in sel {
        let Value::String(v) = v else {
            return Err("selector values must be strings");
        };
        pairs.push((k.clone(), v.clone()));
    }
    Ok((name, args, Some(pairs)))
}

/// Enqueues to every matching rig; this broker's one reply.
async fn broadcast_reply(
    app: &App,
    fleet: &Fleet,
    id: &str,
    selector: &[(String, String)],
    name: &str,
    args: &Value,
) -> Value {
    let rigs = app.registry.matching(selector);
    let mut enqueued = 0;
    let mut failed = Vec::new();
    for rig in &rigs {
        // Kept commands count as enqueued at once: a broadcast has one reply per broker, and
        // a fenced one is for a rig another broker now holds.
        match queue_command(app, fleet, id, rig, name, args, None).await {
            Ok(_) => enqueued += 1,
            Err(r) => failed.push(json!({"rig_id": rig, "error": r["error"]})),
        }
    }
    json!({
        "id": id, "ok": true, "broker_id": fleet.broker_id, "matched": rigs.len(),
        "enqueued": enqueued, "failed": failed, "unanswered": 0,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rfc3339_dates() {
        assert_eq!(rfc3339_ms(0), "1970-01-01T00:00:00.000Z");
        assert_eq!(rfc3339_ms(1_700_000_000_123), "2023-11-14T22:13:20.123Z");
        assert_eq!(rfc3339_ms(951_782_400_000), "2000-02-29T00:00:00.000Z");
        assert_eq!(rfc3339_ms(4_102_444_799_999), "2099-12-31T23:59:59.999Z");
    }

    #[test]
    fn evict_only_another_broker() {
        let b = "017f22e2-79b0-7cc3-98c4-dc0c0c07398f";
        assert_eq!(broker_to_evict("", "a"), None);
        assert_eq!(broker_to_evict(&format!("{b}|a"), "a"), None);
        assert_eq!(broker_to_evict(&format!("{b}|b"), "a"), Some("b".into()));
        assert_eq!(broker_to_evict("garbage", "a"), None);
    }

    #[test]
    fn command_fields_follow_fe() {
        let msg = |s: &str| match serde_json::from_str::<Value>(s) {
            Ok(Value::Object(m)) => m,
            _ => panic!("{s}"),
        };
        let m = msg(r#"{"name":"x"}"#);
        let (name, args, sel) = command_fields(&m, false).unwrap();
        assert_eq!((name, args, sel), ("x", json!({}), None));
        assert!(command_fields(&msg(r#"{"name":"x","args":[1]}"#), false).is_err());
        assert!(command_fields(&msg(r#"{"name":""}"#), false).is_err());
        assert!(command_fields(&msg(r#"{"name":"x"}"#), true).is_err());
        assert!(command_fields(&msg(r#"{"name":"x","selector":{"a":1}}"#), true).is_err());
        let m = msg(r#"{"name":"x","selector":{"a":"b"}}"#);
        let (_, _, sel) = command_fields(&m, true).unwrap();
        assert_eq!(sel, Some(vec![("a".into(), "b".into())]));
    }
}
