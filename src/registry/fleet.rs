//! Fleet mode's Redis I/O, owned by the bridge thread: the command connection (Lua registry
//! scripts, batched publishes, heartbeats) and the subscription. Every call is bounded by a
//! socket timeout; any failure drops both connections and schedules a reconnect with capped,
//! jittered backoff, while the broker keeps serving its rigs from the embedded registry.

use std::collections::HashSet;
use std::os::fd::{AsRawFd, RawFd};
use std::time::{Duration, Instant};

use redis::{ConnectionInfo, IntoConnectionInfo};

use crate::ids::Seq;
use crate::ids::{BootId, RigId};
use crate::registry::command_con::CommandCon;
use crate::registry::exit_wait::ExitWait;
use crate::registry::msg::Recall;
use crate::registry::offline::{Held, OfflineScripts, Pushed};
use crate::registry::pubsub::{Push, Subscriber};
use crate::registry::scripts::{HelloOutcome, RefreshStatus, Scripts};
use crate::registry::sessions::{self, Kept, Persist, Rekeep, Rekept, Resumed, SessionScripts};
use crate::registry::throttle::Throttle;

/// Socket timeout for every Redis call: a hung Redis stalls the bridge at most this long.
const IO_TIMEOUT: Duration = Duration::from_secs(2);
/// How long a reconnect attempt waits for Redis to take its probe write before giving up.
const PROBE_TIMEOUT: Duration = Duration::from_millis(250);
/// The `broker:<id>` key's TTL (CONTRACT.md §3); the heartbeat sets it, and so does the
/// reconnect probe.
pub(crate) const HEARTBEAT_TTL: Duration = Duration::from_secs(30);
/// Publishes held while Redis is slow or down; beyond it they are dropped and counted.
const MAX_OUTGOING: usize = 100_000;
/// The bytes those publishes may hold (channel names and payloads). Rig events (up to
/// `--max-message` each) stop at [`EVENT_SHARE_BYTES`]; the 8 MiB above it stay for control's
/// replies and the brokers' own messages, small, owed, and each on a channel of its own.
const MAX_OUTGOING_BYTES: usize = 32 << 20;
/// Why 24 MiB: the backlog goes out in about a second once Redis is back, much faster than a
/// subscriber of `fleetlink:events` reads it, so nearly all of it sits in that subscriber's
/// Redis output buffer, and Redis's default `client-output-buffer-limit pubsub 32mb 8mb 60`
/// disconnects the subscriber once it passes 32 MiB: control would lose its stream exactly
/// when it matters. Each message costs the subscriber its payload plus about 50 bytes
/// (`*3 $7 message $16 fleetlink:events $N` and the CRLFs), of which the 16 of the channel
/// name are counted here, so at most [`MAX_OUTGOING`] × 36 B ≈ 3.6 MB uncounted: the whole
/// backlog stays under about 29 MB, 4.7 MB short of the limit. Events held beyond what a
/// subscriber can be sent would only cost it the ones it could have had. (The soft limit,
/// 8 MiB for 60 s, leaves a subscriber a minute to catch up.) The bound is per broker: when
/// several brokers flush at once, their backlogs add up in the subscriber's buffer.
const EVENT_SHARE_BYTES: usize = 24 << 20;
/// The publishes rig events may hold, by count: small events (a rig's `ack`s, 200 bytes each)
/// reach the count bound long before the bytes, and without a share of their own a few chatty
/// rigs during a Redis stall would leave no room for control's replies, which are owed.
const EVENT_SHARE_COUNT: usize = MAX_OUTGOING / 4 * 3;
/// Bytes of publishes sent in one pipeline: a Redis back from an outage gets the queue in
/// pieces, not as one write of everything held.
const FLUSH_BYTES: usize = 8 << 20;
/// Pipelines of publishes sent per pass of the bridge.
const FLUSH_PIPELINES: usize = 4;

/// Whether a failed connection attempt's error is Redis refusing who we are (a wrong
/// password, a user without the rights the broker needs) rather than Redis being away.
fn refuses_credentials(why: &str) -> bool {
    [
        "WRONGPASS",
        "NOAUTH",
        "NOPERM",
        "AuthenticationFailed",
        "invalid username-password",
        // A password in --redis for a Redis that asks for none.
        "without any password configured",
    ]
    .iter()
    .any(|code| why.contains(code))
}

/// A socket timeout reads as the OS's EAGAIN text ("Resource temporarily unavailable (os
/// error 11)"), which says nothing to an operator about a Redis that accepts connections but
/// does not answer (hung, or paused for writes during a failover): say that instead.
fn plain_timeout(why: String) -> String {
    let timed_out = ["(os error 11)", "(os error 110)", "timed out", "WouldBlock"]
        .iter()
        .any(|t| why.contains(t));
    if !timed_out {
        return why;
    }
    // The call's own timeout, or the reconnect probe's shorter one.
    format!("no answer in time (a hung Redis, or one paused for writes): {why}")
}

/// Whether `con` still answers, asked with a PING under [`PROBE_TIMEOUT`] (PING is not a write,
/// so a Redis paused for writes answers it).
fn answers_ping(con: &mut CommandCon) -> bool {
    let probe =
        con.set_timeout(PROBE_TIMEOUT).is_ok() && redis::cmd("PING").query::<String>(con).is_ok();
    probe && con.set_timeout(IO_TIMEOUT).is_ok()
}

/// Whether Redis answered a command with a refusal that sending it again would repeat, as
/// opposed to a broken connection or a passing state (loading, a failover, a busy script).
fn refused(e: &redis::RedisError) -> bool {
    e.code().is_some_and(|code| {
        !matches!(
            code,
            "LOADING" | "READONLY" | "MASTERDOWN" | "TRYAGAIN" | "CLUSTERDOWN" | "BUSY"
        )
    })
}

/// Whether a failed call leaves its connection sound: Redis refused it (OOM under `maxmemory`
/// with `noeviction`, an ACL's NOPERM, a script's own error) and redis-rs read every reply of
/// the call, so the connection is still in step. Dropping it would take the subscription,
/// which works through all of these, down with it, and reconnecting would change nothing.
/// NOSCRIPT is the exception: a reconnect loads the scripts again.
fn leaves_connection_sound(e: &redis::RedisError) -> bool {
    refused(e) && e.code() != Some("NOSCRIPT")
}

/// An error of a call on the command connection, and the Redis error inside it, if any.
trait CallError: std::fmt::Display {
    fn redis(&self) -> Option<&redis::RedisError>;
}

impl CallError for redis::RedisError {
    fn redis(&self) -> Option<&redis::RedisError> {
        Some(self)
    }
}

impl CallError for crate::registry::scripts::RegistryError {
    fn redis(&self) -> Option<&redis::RedisError> {
        match self {
            Self::Redis(e) => Some(e),
            // The scripts on the server and this binary disagree: reconnecting loads ours.
            Self::UnexpectedReply(_) => None,
        }
    }
}

/// Backoff cap between reconnect attempts.
const MAX_BACKOFF: Duration = Duration::from_secs(5);

/// Between the attempts to reach Redis at the end of a drain (see `Fleet::flush_before_exit`).
const EXIT_RETRY: Duration = Duration::from_millis(100);
/// Removals of acked commands that find no publish to ride with (see [`Fleet::flush`]) wait up
/// to this long, or for [`FORGET_BATCH`] of them. Until then a resume elsewhere still finds
/// them, and drops them by the rig's `last_seq`: a rig acks only what it has.
const FORGET_PACE: Duration = Duration::from_secs(1);
const FORGET_BATCH: usize = 16_384;
/// Sessions whose queued forgets ride with the next publishes rather than wait for their
/// pace, one HDEL each. Acks from a few rigs at a time fit, however many each sends at once (a
/// rig acking a burst of commands); a fan-out's acks come from dozens of rigs per paced write,
/// and their removals' work inside the burst costs its last deliveries more than it is worth
/// (an A/B in docs/benchmarks-history.md).
const FORGET_RIDE_MAX: usize = 8;
/// At most this many acked commands ride, whatever their sessions.
const FORGET_RIDE_FIELDS: usize = 1024;

/// Channel every broker subscribes to for broadcasts (CONTRACT.md §4).
pub const BROADCAST: &str = "fleetlink:broadcast";
/// Channel of lifecycle events (CONTRACT.md §4).
pub const EVENTS: &str = "fleetlink:events";

/// What Redis says of a broker id at start ([`broker_id_in_use`]).
#[derive(Debug, PartialEq, Eq)]
pub enum IdCheck {
    /// Nothing is subscribed to the id's channel.
    Free,
    /// Something is: another broker runs with this id.
    Taken,
    /// Redis could not be reached in time; the broker starts and runs without it until it can.
    Unreachable,
    /// Redis answered, but not the question (an ACL refusing `PUBSUB`, say).
    Failed(String),
}

/// Whether another broker with `broker_id` is running on the Redis at `url`: something is
/// subscribed to its channel.
///
/// A predecessor that just died may still be listed for a moment, until Redis reads the close
/// of its connection; so a listed subscriber counts only when it is still there a second later.
/// Two brokers started at the same instant can both pass: each one's canaries then tell the
/// other at run time (`BridgeShared::not_ready`).
pub fn broker_id_in_use(url: &str, broker_id: &str) -> IdCheck {
    let timeout = Duration::from_millis(1000);
    let connect = || -> redis::RedisResult<redis::Connection> {
        let con = redis::Client::open(url)?.get_connection_with_timeout(timeout)?;
        con.set_read_timeout(Some(timeout))?;
        con.set_write_timeout(Some(timeout))?;
        Ok(con)
    };
    let Ok(mut con) = connect() else {
        return IdCheck::Unreachable;
    };
    let channel = broker_channel(broker_id);
    let deadline = Instant::now() + Duration::from_secs(1);
    loop {
        let subscribers = redis::cmd("PUBSUB")
            .arg("NUMSUB")
            .arg(&channel)
            .query::<(String, u64)>(&mut con);
        match subscribers {
            Ok((_, 0)) => return IdCheck::Free,
            Ok(_) if Instant::now() >= deadline => return IdCheck::Taken,
            Ok(_) => std::thread::sleep(Duration::from_millis(50)),
            Err(e) if e.is_timeout() || e.is_io_error() => return IdCheck::Unreachable,
            Err(e) => return IdCheck::Failed(e.to_string()),
        }
    }
}

/// A broker's own control channel.
pub fn broker_channel(id: &str) -> String {
    format!("fleetlink:broker:{id}")
}

/// Redis connections and what is waiting to be sent on them.
pub(crate) struct Fleet {
    info: ConnectionInfo,
    broker_id: String,
    scripts: Scripts,
    sessions: SessionScripts,
    offline: OfflineScripts,
    forgets: Vec<(RigId, BootId, Seq)>,
    /// When the oldest queued forget was queued.
    forgets_since: Option<Instant>,
    con: Option<CommandCon>,
    sub: Option<Subscriber>,
    outgoing: Vec<(String, Box<[u8]>)>,
    /// Bytes in `outgoing`, channel names and payloads.
    outgoing_bytes: usize,
    /// Rig events in `outgoing`.
    outgoing_events: usize,
    releases: Vec<(RigId, BootId)>,
    /// What this broker remembers of sessions whose rigs disconnected, to write into them
    /// (`sessions::remember`).
    recalls: Vec<(RigId, BootId, String)>,
    /// `--session-ttl`: touched and released sessions get it afresh (0 = no session kept).
    session_ttl: Duration,
    failures: u32,
    next_attempt: Instant,
    /// Why the last connection attempt failed, while Redis is down: `/readyz` says it.
    down_why: Option<String>,
    /// `down_why` changed since the bridge last took it.
    down_why_changed: bool,
    /// Publishes dropped because the queue was full while Redis was away.
    pub(crate) dropped: u64,
    /// Those drops, logged at most once a second.
    drop_log: Throttle,
    /// Bounds the lines about pipelines Redis refused part of.
    refused_log: Throttle,
    /// Publishes sent.
    pub(crate) published: u64,
    /// Set after every successful (re)connect; the bridge re-asserts its rigs then.
    pub(crate) just_connected: bool,
    /// Set when the heartbeat found this broker's liveness key gone on a live connection:
    /// Redis lost keys (FLUSHALL, eviction), and the sessions parked here go back.
    pub(crate) keys_lost: bool,
    /// Calls Redis refused on a sound connection (see [`leaves_connection_sound`]).
    pub(crate) refusals: u64,
    /// Subscriptions Redis ended while it still answered on the other connection, since the
    /// bridge last took them.
    pub(crate) subscription_cuts: u64,
    /// Those refusals, logged at most once a second.
    refusal_log: Throttle,
    /// Redis refused a write for want of memory since the last heartbeat that went through:
    /// when one does, the bridge re-asserts its rigs as after a reconnect, since what was
    /// refused was not kept.
    refusing: bool,
}

impl Fleet {
    pub(crate) fn new(url: &str, broker_id: &str, session_ttl: Duration) -> anyhow::Result<Self> {
        let info = url.into_connection_info()?;
        Ok(Self {
            info,
            broker_id: broker_id.to_string(),
            scripts: Scripts::new(),
            sessions: SessionScripts::new(),
            offline: OfflineScripts::default(),
            forgets: Vec::new(),
            forgets_since: None,
            con: None,
            sub: None,
            outgoing: Vec::new(),
            outgoing_bytes: 0,
            outgoing_events: 0,
            releases: Vec::new(),
            recalls: Vec::new(),
            session_ttl,
            failures: 0,
            next_attempt: Instant::now(),
            down_why: None,
            down_why_changed: false,
            dropped: 0,
            drop_log: Throttle::default(),
            refused_log: Throttle::default(),
            published: 0,
            just_connected: false,
            keys_lost: false,
            refusals: 0,
            subscription_cuts: 0,
            refusal_log: Throttle::default(),
            refusing: false,
        })
    }

    /// Why Redis is down, when that changed since the last call: `Some(None)` once it is back.
    pub(crate) fn take_down_why(&mut self) -> Option<Option<String>> {
        std::mem::take(&mut self.down_why_changed).then(|| self.down_why.clone())
    }

    /// When the next reconnect attempt is due, while a connection is down.
    pub(crate) fn reconnect_due(&self) -> Option<Instant> {
        (!self.is_up()).then_some(self.next_attempt)
    }

    /// True while both connections are up.
    pub(crate) fn is_up(&self) -> bool {
        self.con.is_some() && self.sub.is_some()
    }

    /// True once Redis confirmed both subscriptions.
    pub(crate) fn is_subscribed(&self) -> bool {
        self.sub.as_ref().is_some_and(|s| s.confirmed >= 2)
    }

    /// Connects what is down (the command connection, the subscription, or both) if the
    /// backoff allows. Returns true when both are up.
    pub(crate) fn ensure(&mut self, now: Instant) -> bool {
        if self.is_up() {
            return true;
        }
        if now < self.next_attempt {
            return false;
        }
        match self.open_missing() {
            Ok(()) => {
                log::info!("redis: connected, scripts loaded, subscribed");
                self.failures = 0;
                self.down_why_changed |= self.down_why.take().is_some();
                true
            }
            Err(e) => {
                self.back_off(now, &e);
                false
            }
        }
    }

    /// Opens whichever connection is down. The other is left as it is: a subscription that
    /// outlived its command connection (a `CLIENT KILL`, a refused write) has kept every
    /// message Redis pushed meanwhile, and each of those is a command control was told
    /// someone received.
    fn open_missing(&mut self) -> anyhow::Result<()> {
        if self.con.is_none() {
            self.con = Some(self.open_con()?);
            self.just_connected = true;
        }
        if self.sub.is_none() {
            let channels = [broker_channel(&self.broker_id), BROADCAST.to_string()];
            self.sub = Some(Subscriber::connect(&self.info, &channels, IO_TIMEOUT)?);
        }
        Ok(())
    }

    fn open_con(&mut self) -> anyhow::Result<CommandCon> {
        // The AUTH and SELECT are ours, on a connection of our own (`CommandCon`): redis-rs
        // turned a refused AUTH into "Password authentication failed" whatever Redis said,
        // and Redis's words tell a wrong password from a URL with one for a Redis that has
        // none. The connection speaks RESP2 whatever the URL asks (`?protocol=resp3`).
        //
        // A hung Redis (frozen, or a black-holed path) still accepts TCP connections; a short
        // probe keeps each reconnect attempt from stalling the bridge, and with it hellos and
        // admin commands, for a whole IO_TIMEOUT. The probe is a write, since a Redis paused
        // for writes (`CLIENT PAUSE … WRITE`, as in a failover) answers PING but holds every
        // write: a PING probe let each reconnect "work" and the next write stall IO_TIMEOUT.
        // It sets our own liveness key's TTL to what the heartbeat gives it (a key this
        // broker alone writes, which now says what is true: the broker is alive), and
        // creates nothing when the key is gone; the heartbeat after the reconnect writes it.
        let mut con = CommandCon::connect(&self.info, PROBE_TIMEOUT)?;
        let auth = &self.info.redis;
        if let Some(password) = &auth.password {
            redis::cmd("AUTH")
                .arg(&auth.username)
                .arg(password)
                .query::<()>(&mut con)?;
        }
        if auth.db != 0 {
            redis::cmd("SELECT").arg(auth.db).query::<()>(&mut con)?;
        }
        redis::cmd("PEXPIRE")
            .arg(crate::registry::scripts::broker_key(&self.broker_id))
            .arg(HEARTBEAT_TTL.as_millis() as u64)
            .query::<()>(&mut con)?;
        con.set_timeout(IO_TIMEOUT)?;
        self.scripts.load(&mut con)?;
        redis::cmd("SCRIPT")
            .arg("LOAD")
            .arg(include_str!("../../lua/persist.lua"))
            .query::<String>(&mut con)?;
        redis::cmd("SCRIPT")
            .arg("LOAD")
            .arg(include_str!("../../lua/resume.lua"))
            .query::<String>(&mut con)?;
        Ok(con)
    }

    /// A call's answer, or None once its failure is handled as [`Self::call_failed`] says.
    fn answered<T, E: CallError>(&mut self, r: Result<T, E>) -> Option<T> {
        r.map_err(|e| self.call_failed(&e)).ok()
    }

    /// A call on the command connection failed. A refusal on a sound connection is counted
    /// and logged (at most once a second), and both connections stay; anything else drops
    /// the command connection alone, and the subscription goes on delivering commands (kept
    /// or not as Redis allows, their replies queued until it is back).
    fn call_failed(&mut self, e: &dyn CallError) {
        let now = Instant::now();
        if let Some(redis) = e.redis().filter(|r| leaves_connection_sound(r)) {
            // Only a full Redis refuses the writes that keep leases and sessions; a refusal of
            // one command (an ACL without HDEL, say) would otherwise have every heartbeat
            // re-assert every session.
            self.refusing |= redis.code() == Some("OOM");
            return self.note_refusal(e);
        }
        self.con = None;
        self.back_off(now, e);
    }

    /// Counts a call Redis refused on a sound connection, and logs it at most once a second.
    fn note_refusal(&mut self, e: &dyn std::fmt::Display) {
        self.refusals += 1;
        if let Some(n) = self.refusal_log.note(Instant::now()) {
            log::warn!(
                "redis: {n} calls refused since the last such line (the last: {e}); the \
                 connections stay, and what was refused goes on without Redis: commands \
                 are delivered unkept, hellos decided here"
            );
        }
    }

    /// Schedules the next reconnect attempt after a failure.
    fn back_off(&mut self, now: Instant, why: &dyn std::fmt::Display) {
        let mut why = plain_timeout(why.to_string());
        if refuses_credentials(&why) {
            why = format!("credentials refused ({why})");
            // Not an outage that ends by itself: the log must say what to fix. Every attempt
            // up to the fourth, then at doubling counts, so a fix is seen to take.
            if self.failures < 4 || self.failures.is_power_of_two() {
                log::error!(
                    "redis: {why}: check the user and password in --redis and Redis's ACL; \
                     retrying, and serving from the local registry meanwhile"
                );
            }
        } else if self.failures == 0 {
            log::warn!("redis: {why}; serving from the local registry until it returns");
        } else if self.failures >= 4 && self.failures.is_power_of_two() {
            log::warn!(
                "redis: still unreachable after {} attempts (the last: {why})",
                self.failures
            );
        }
        if self.down_why.as_deref() != Some(why.as_str()) {
            self.down_why = Some(why);
            self.down_why_changed = true;
        }
        self.failures = self.failures.saturating_add(1);
        let base = Duration::from_millis(100)
            .saturating_mul(1 << self.failures.min(10))
            .min(MAX_BACKOFF);
        self.next_attempt = now + base.mul_f64(0.5 + fastrand::f64());
    }

    /// Runs `hello.lua` for many rigs in one round trip. None when Redis is unavailable.
    pub(crate) fn hello_many(
        &mut self,
        entries: &[(&RigId, &BootId)],
        ttl: Duration,
    ) -> Option<Vec<Result<HelloOutcome, String>>> {
        let con = self.con.as_mut()?;
        let r = self.scripts.hello_many(con, entries, &self.broker_id, ttl);
        let outcomes: Vec<Result<HelloOutcome, String>> = self
            .answered(r)?
            .into_iter()
            .map(|o| o.map_err(|e| e.to_string()))
            .collect();
        // Refused (a full Redis, an ACL): those hellos are decided here; counted and logged
        // like any refused call.
        if let Some(e) = outcomes.iter().find_map(|o| o.as_ref().err().cloned()) {
            self.note_refusal(&e);
        }
        Some(outcomes)
    }

    /// What Redis holds of many rigs' sessions, and the commands held for them while they
    /// were offline (taken), in one round trip each. None when Redis is unavailable; an
    /// entry's own error is a `None` in its place (with the session store off, every entry is
    /// an empty `Resumed`).
    #[allow(clippy::type_complexity)]
    pub(crate) fn resume_many(
        &mut self,
        entries: &[(&RigId, &BootId)],
        ttl: Duration,
    ) -> Option<(Vec<Option<Resumed>>, Vec<Vec<Held>>)> {
        let con = self.con.as_mut()?;
        let resumed = if ttl.is_zero() {
            Ok(vec![Some(Resumed::default()); entries.len()])
        } else {
            self.sessions
                .resume_many(con, entries, ttl, &self.broker_id)
                .map(|r| r.into_iter().map(Result::ok).collect())
        };
        let unreadable = resumed
            .as_ref()
            .map_or(0, |r| r.iter().filter(|x| x.is_none()).count());
        let rigs: Vec<&RigId> = entries.iter().map(|(r, _)| *r).collect();
        let outcome = resumed.and_then(|r| Ok((r, self.offline.take_many(con, &rigs)?)));
        if unreadable > 0 {
            // An entry that failed alone turns its hello away (4503): say so, as for any
            // refused call, or a rig locked out that way leaves no trace.
            let n = entries.len();
            self.note_refusal(&format!("resume: {unreadable} of {n} sessions unreadable"));
        }
        self.answered(outcome)
    }

    /// Runs the sessions of boots this broker took a rig for without Redis (decided while it
    /// was away, their leases taken back from an older boot since) through `resume.lua`, as
    /// their hellos would have: the older boot's session, still recorded as the rig's latest,
    /// has its unacked commands reported `rig_rebooted` and is deleted. What the script finds
    /// of these sessions is not used: the cores hold them, and put them back (`rekeep`) after.
    /// Returns how many commands were reported; None when Redis is unavailable.
    pub(crate) fn report_reboots(
        &mut self,
        entries: &[(&RigId, &BootId)],
        ttl: Duration,
    ) -> Option<u64> {
        let con = self.con.as_mut()?;
        let r = self
            .sessions
            .resume_many(con, entries, ttl, &self.broker_id);
        Some(self.answered(r)?.iter().flatten().map(|r| r.rebooted).sum())
    }

    /// Refreshes the leases of `entries`. None when Redis is unavailable.
    pub(crate) fn refresh(
        &mut self,
        entries: &[(RigId, BootId)],
        ttl: Duration,
    ) -> Option<Vec<RefreshStatus>> {
        let con = self.con.as_mut()?;
        let r = self.scripts.refresh(con, entries, &self.broker_id, ttl);
        self.answered(r)
    }

    /// Each rig's latest boot on record (`sessof:<rig>`; None where there is none or it is
    /// not a boot id), in one round trip. None when Redis is unavailable.
    pub(crate) fn latest_boots(&mut self, rigs: &[&RigId]) -> Option<Vec<Option<BootId>>> {
        let con = self.con.as_mut()?;
        let mut mget = redis::cmd("MGET");
        for rig in rigs {
            mget.arg(sessions::pointer_key(rig));
        }
        let r = mget.query::<Vec<Option<String>>>(con);
        Some(
            self.answered(r)?
                .into_iter()
                .map(|b| b.and_then(|b| BootId::parse(&b)))
                .collect(),
        )
    }

    /// For each entry, whether `rig:<rig>` names that very boot on this broker, in one round
    /// trip. None when Redis is unavailable.
    pub(crate) fn owns_many(&mut self, entries: &[(RigId, BootId)]) -> Option<Vec<bool>> {
        let con = self.con.as_mut()?;
        let mut mget = redis::cmd("MGET");
        for (rig, _) in entries {
            mget.arg(crate::registry::scripts::rig_key(rig));
        }
        let r = mget.query::<Vec<Option<String>>>(con);
        let owners = self.answered(r)?;
        Some(
            entries
                .iter()
                .zip(owners)
                .map(|((_, boot), owner)| {
                    owner == Some(crate::registry::scripts::tuple(boot, &self.broker_id))
                })
                .collect(),
        )
    }

    /// Extends these sessions' TTLs to `--session-ttl` (see [`sessions::touch`]).
    pub(crate) fn touch_sessions(&mut self, sessions: &[(RigId, BootId)]) {
        if self.session_ttl.is_zero() {
            return;
        }
        let Some(con) = self.con.as_mut() else { return };
        if let Err(e) = sessions::touch(con, sessions, self.session_ttl) {
            self.call_failed(&e);
        }
    }

    /// Puts sessions back (see [`SessionScripts::rekeep`]). None when Redis is unavailable.
    pub(crate) fn rekeep(&mut self, sessions: &[Rekeep<'_>], ttl: Duration) -> Option<Vec<Rekept>> {
        let con = self.con.as_mut()?;
        let at = crate::reply::rfc3339(std::time::SystemTime::now());
        let r = self
            .sessions
            .rekeep(con, sessions, &self.broker_id, ttl, &at);
        self.answered(r)
    }

    /// The commands `rig`'s session holds under `seqs` (see [`sessions::read_commands`]).
    /// None when Redis is unavailable.
    pub(crate) fn session_commands(
        &mut self,
        rig: &RigId,
        boot: &BootId,
        seqs: std::ops::Range<u64>,
    ) -> Option<Vec<(Seq, Vec<u8>)>> {
        let con = self.con.as_mut()?;
        let r = sessions::read_commands(con, rig, boot, seqs);
        self.answered(r)
    }

    /// Keeps commands in their sessions (fenced by our leases). None when Redis is unavailable.
    pub(crate) fn persist(&mut self, cmds: &[Persist<'_>], ttl: Duration) -> Option<Vec<Kept>> {
        let con = self.con.as_mut()?;
        let r = self.sessions.persist(con, cmds, &self.broker_id, ttl);
        self.answered(r)
    }

    /// Takes the commands held for `rigs`, in one round trip. None when Redis is unavailable.
    pub(crate) fn offline_take_many(&mut self, rigs: &[&RigId]) -> Option<Vec<Vec<Held>>> {
        let con = self.con.as_mut()?;
        let taken = self.offline.take_many(con, rigs);
        self.answered(taken)
    }

    /// Holds commands for offline rigs, in one round trip: per entry, what came of it (`None`
    /// for an entry whose own call failed). None when Redis is unavailable.
    pub(crate) fn offline_push_many(
        &mut self,
        entries: &[(&RigId, &Held, Duration)],
    ) -> Option<Vec<Option<Pushed>>> {
        let con = self.con.as_mut()?;
        let r = self.offline.push_many(con, entries, &self.broker_id);
        Some(self.answered(r)?.into_iter().map(Result::ok).collect())
    }

    /// Removes held commands that are still there, in one round trip. None when Redis is
    /// unavailable.
    pub(crate) fn offline_remove_many(&mut self, entries: &[(&RigId, &Held)]) -> Option<Vec<bool>> {
        let con = self.con.as_mut()?;
        let removed = self.offline.remove_many(con, entries);
        self.answered(removed)
    }

    /// Queues the removal of an acked command from its session (sent when
    /// [`Self::forget_due`]). False when the queue is full: the command then stays in the
    /// session until the session expires, where a resume drops it by the rig's `last_seq`.
    pub(crate) fn forget(&mut self, rig: RigId, boot: BootId, seq: Seq) -> bool {
        if self.forgets.len() >= MAX_OUTGOING {
            return false;
        }
        self.forgets.push((rig, boot, seq));
        self.forgets_since.get_or_insert_with(Instant::now);
        true
    }

    /// Sends the queued forgets now, in one round trip. False when Redis failed.
    fn send_forgets(&mut self) -> bool {
        if self.forgets.is_empty() {
            return true;
        }
        let Some(con) = self.con.as_mut() else {
            return false;
        };
        let mut pipe = redis::pipe();
        hdel_by_session(&mut pipe, &self.forgets);
        if let Err(e) = pipe.query::<()>(con) {
            self.call_failed(&e);
            return false;
        }
        self.forgets.clear();
        self.forgets_since = None;
        true
    }

    /// Sends these lease releases in one round trip; false when the call failed (the
    /// connection is then dropped).
    fn send_releases(&mut self, releases: Vec<(RigId, BootId)>) -> bool {
        let Some(con) = self.con.as_mut() else {
            self.releases.extend(releases);
            return false;
        };
        if let Err(e) = self.scripts.release(con, &releases, &self.broker_id) {
            // Sent again on the next connection (the script deletes only this broker's
            // exact tuple, so twice is harmless): dropped, the lease would outlive its rig
            // by a TTL, and commands held for the rig meanwhile would be refused as for a
            // rig connected here. Not when Redis refused them on a sound connection (an
            // ACL without EVALSHA, say): sent again, they were refused again at every pass
            // of the bridge, 800 calls a second; those leases lapse by their TTL.
            if !e.redis().is_some_and(leaves_connection_sound) {
                self.releases.extend(releases);
            }
            self.call_failed(&e);
            return false;
        }
        // A released session's TTL counts from its disconnect, not from its last touch.
        self.touch_sessions(&releases);
        true
    }

    /// Before these rigs' sessions are read: their acked commands leave Redis first (a new
    /// boot would otherwise report an acked command `rig_rebooted`), and a release queued for
    /// the very lease a hello is about to claim again is dropped (sent after the claim, its
    /// compare-and-delete would find the same tuple and delete the new claim). One queued
    /// for another boot of a rig saying hello goes first: left for the paced flush, the
    /// claim would find the lease of a connection already closed, and an older boot (a rig
    /// whose clock stepped back, restarting at once) would be turned away 4409.
    pub(crate) fn settle_before_hellos(&mut self, hellos: &[(&RigId, &BootId)]) {
        let claimed: HashSet<(&RigId, &BootId)> = hellos.iter().copied().collect();
        let rigs: HashSet<&RigId> = hellos.iter().map(|(rig, _)| *rig).collect();
        self.releases
            .retain(|(rig, boot)| !claimed.contains(&(rig, boot)));
        if self.con.is_some() && self.releases.iter().any(|(rig, _)| rigs.contains(rig)) {
            let (first, rest) = std::mem::take(&mut self.releases)
                .into_iter()
                .partition(|(rig, _)| rigs.contains(rig));
            self.releases = rest;
            self.send_releases(first);
        }
        if self.forgets.iter().any(|(rig, _, _)| rigs.contains(rig)) {
            self.send_forgets();
        }
    }

    /// When the queued forgets are to go out: None when there are none.
    pub(crate) fn forget_due(&self) -> Option<Instant> {
        let since = self.forgets_since?;
        if self.forgets.len() >= FORGET_BATCH {
            return Some(since);
        }
        Some(since + FORGET_PACE)
    }

    /// Removes the `broker:<id>` liveness key on a clean exit, so that control stops counting
    /// this broker among those that answer a broadcast at once, not 30 s later.
    pub(crate) fn retire(&mut self) {
        let Some(con) = self.con.as_mut() else { return };
        let key = crate::registry::scripts::broker_key(&self.broker_id);
        if let Err(e) = redis::cmd("DEL").arg(key).query::<()>(con) {
            log::warn!("redis: broker key not removed at exit ({e}); it lapses by its TTL");
        }
    }

    /// Writes the `broker:<id>` liveness key.
    pub(crate) fn heartbeat(&mut self, json: &str, ttl: Duration) {
        let Some(con) = self.con.as_mut() else { return };
        match self
            .scripts
            .broker_heartbeat(con, &self.broker_id, json, ttl)
        {
            Ok(_) if std::mem::take(&mut self.refusing) => {
                log::info!("redis: writes go through again; leases and sessions are put back");
                self.just_connected = true;
            }
            Ok(had) => self.keys_lost |= !had,
            Err(e) => self.call_failed(&e),
        }
    }

    /// Tries to reach Redis until `wait` is over, every [`EXIT_RETRY`] rather than at the
    /// backoff's pace; true once both connections are up.
    pub(crate) fn wait_up(&mut self, wait: &ExitWait) -> bool {
        loop {
            let now = Instant::now();
            // After "now", only a Redis already there: no attempt that could take a probe's
            // wait.
            if wait.over(now) {
                return false;
            }
            self.next_attempt = self.next_attempt.min(now);
            if self.ensure(now) {
                return true;
            }
            std::thread::sleep(wait.pause(now, EXIT_RETRY));
        }
    }

    /// The end of a drain: sends everything queued, waiting as `wait` allows for a Redis that is
    /// away (or paused) to answer again, then says what could not be sent. Before, a broker
    /// that drained during an outage exited at once, and the `ack` events it held (acks it
    /// took while Redis could not keep them) were lost without a word.
    pub(crate) fn flush_before_exit(&mut self, wait: &ExitWait) {
        loop {
            let now = Instant::now();
            // At its own pace, not the backoff's: after a long outage that is seconds.
            self.next_attempt = self.next_attempt.min(now);
            self.ensure(now);
            if self.con.is_some() {
                self.flush(None);
            }
            let (publishes, forgets, writes) = (
                self.outgoing.len(),
                self.forgets.len(),
                self.releases.len() + self.recalls.len(),
            );
            if publishes + forgets + writes == 0 {
                return;
            }
            if wait.over(now) {
                log::warn!(
                    "redis: exiting with {publishes} events and replies unpublished, {forgets} removals of acked commands and {writes} lease releases and session notes unwritten: Redis did not answer by the end of the drain's wait for it (the leases lapse by their TTL; an acked command whose removal is lost may be reported rig_rebooted at its rig's next boot)"
                );
                return;
            }
            std::thread::sleep(wait.pause(now, EXIT_RETRY));
        }
    }

    /// Writes waiting for the next [`Self::flush`], forgets aside (see [`Self::forget_due`]).
    pub(crate) fn queued(&self) -> usize {
        self.outgoing.len() + self.releases.len() + self.recalls.len()
    }

    /// Queues what this broker remembers of a session whose rig disconnected (acked commands'
    /// ids awaiting results, the last ack's time), for a resume on another broker; sent with
    /// the next flush. False when not queued: no session is kept, or the queue is full.
    pub(crate) fn remember(&mut self, rig: RigId, boot: BootId, recall: &Recall) -> bool {
        if self.session_ttl.is_zero() || self.recalls.len() >= MAX_OUTGOING {
            return false;
        }
        let text = sessions::encode_recall(recall);
        self.recalls.push((rig, boot, text));
        true
    }

    /// Queues a compare-and-delete of a released lease, and a fresh `--session-ttl` for its
    /// session (sent with the next flush). False when the queue is full: the lease then lapses
    /// by its own TTL, and the rig's next hello anywhere takes it over before that.
    pub(crate) fn release(&mut self, rig: RigId, boot: BootId) -> bool {
        if self.releases.len() >= MAX_OUTGOING {
            return false;
        }
        self.releases.push((rig, boot));
        true
    }

    /// Takes back the queued releases of these leases, and returns the ones it found, for the
    /// caller to queue again later: a session parked for a rig must be put back before its
    /// lease goes. If Redis kept the lease through the outage, `rekeep.lua` merges under it;
    /// released first, the script would find only the session Redis kept from before the
    /// outage, leave it as someone's newer truth, and the commands delivered since were lost.
    pub(crate) fn hold_releases(
        &mut self,
        which: &HashSet<(RigId, BootId)>,
    ) -> HashSet<(RigId, BootId)> {
        let mut held = HashSet::new();
        if which.is_empty() {
            return held;
        }
        self.releases.retain(|r| {
            if which.contains(r) {
                held.insert(r.clone());
                return false;
            }
            true
        });
        held
    }

    /// Queues a PUBLISH (sent with the next flush, in order). Past the bounds it is dropped
    /// and counted in `dropped`.
    pub(crate) fn publish(&mut self, channel: String, payload: Vec<u8>) {
        let event = channel == EVENTS;
        let (cap, full) = if event {
            (EVENT_SHARE_BYTES, self.outgoing_events >= EVENT_SHARE_COUNT)
        } else {
            (MAX_OUTGOING_BYTES, false)
        };
        let size = channel.len() + payload.len();
        if full || self.outgoing.len() >= MAX_OUTGOING || self.outgoing_bytes + size > cap {
            self.dropped += 1;
            if let Some(n) = self.drop_log.note(Instant::now()) {
                self.log_drops(n);
            }
            return;
        }
        self.outgoing_bytes += size;
        self.outgoing_events += usize::from(event);
        self.outgoing.push((channel, payload.into_boxed_slice()));
    }

    /// Logs the drops held back by the once-a-second bound, once it allows: a burst that
    /// stopped is logged too, not only when the next drop comes.
    pub(crate) fn log_pending_drops(&mut self, now: Instant) {
        if let Some(n) = self.drop_log.due(now) {
            self.log_drops(n);
        }
        if let Some(n) = self.refused_log.due(now) {
            log::warn!("redis: {n} more pipelines of publishes were refused in part");
        }
    }

    fn log_drops(&self, n: u64) {
        log::warn!(
            "redis: {n} publishes (events or replies) dropped since the last such line: {} \
             messages, {} bytes are waiting to be sent (bounds {MAX_OUTGOING}, \
             {MAX_OUTGOING_BYTES}; events {EVENT_SHARE_BYTES})",
            self.outgoing.len(),
            self.outgoing_bytes
        );
    }

    /// Forgets queued and not yet sent.
    #[cfg(test)]
    pub(crate) fn queued_forgets(&self) -> usize {
        self.forgets.len()
    }

    /// Publishes queued and not yet sent, oldest first.
    #[cfg(test)]
    pub(crate) fn queued_publishes(&self) -> &[(String, Box<[u8]>)] {
        &self.outgoing
    }

    /// Sends queued releases and publishes, and the forgets (all of them when `now` is None),
    /// each batch in one round trip, publishes in pipelines of [`FLUSH_BYTES`].
    ///
    /// The queued forgets of up to [`FORGET_RIDE_MAX`] sessions lead the first pipeline of
    /// publishes: an ack's removal reaches Redis in the round trip that publishes its `ack`
    /// event, ahead of it (the core queues the removal first). Held back for their own pace, a
    /// broker killed within that second left the acked command in its session: the rig's next
    /// boot reported it `rig_rebooted`, and a resume with a lower `last_seq` replayed it, after
    /// control had seen it acked. Forgets of more sessions than that (a fan-out's acks), or
    /// with no publishes to ride with, go at their own pace: there that window remains.
    pub(crate) fn flush(&mut self, now: Option<Instant>) {
        let ride = !self.outgoing.is_empty()
            && self.forgets.len() <= FORGET_RIDE_FIELDS
            && sessions_up_to(&self.forgets, FORGET_RIDE_MAX + 1) <= FORGET_RIDE_MAX;
        let forgets_due = !ride
            && match now {
                Some(now) => self.forget_due().is_some_and(|due| due <= now),
                None => true,
            };
        if self.con.is_none() {
            return;
        }
        if !self.releases.is_empty() {
            let releases = std::mem::take(&mut self.releases);
            if !self.send_releases(releases) {
                return;
            }
        }
        if !self.recalls.is_empty() {
            let Some(con) = self.con.as_mut() else { return };
            // Not sent again: a resume without it still has every command, only results
            // without their ids and a null `last_ack_at`.
            let recalls = std::mem::take(&mut self.recalls);
            if let Err(e) = sessions::remember(con, &recalls, self.session_ttl) {
                self.call_failed(&e);
                return;
            }
        }
        if forgets_due && !self.send_forgets() {
            return;
        }
        // A queue held through an outage goes out over a few passes, not in one long stall of
        // the bridge; all of it at the end of a drain.
        let mut pipelines = if now.is_some() {
            FLUSH_PIPELINES
        } else {
            usize::MAX
        };
        while !self.outgoing.is_empty() && pipelines > 0 {
            pipelines -= 1;
            let Some(con) = self.con.as_mut() else { return };
            let mut pipe = redis::pipe();
            let forgets = if ride { self.forgets.len() } else { 0 };
            hdel_by_session(&mut pipe, &self.forgets[..forgets]);
            let (mut n, mut bytes, mut events) = (0, 0, 0);
            for (channel, payload) in &self.outgoing {
                let size = channel.len() + payload.len();
                if n > 0 && bytes + size > FLUSH_BYTES {
                    break;
                }
                pipe.publish(channel, &payload[..]).ignore();
                n += 1;
                bytes += size;
                events += usize::from(channel == EVENTS);
            }
            match pipe.query::<()>(con) {
                Ok(()) => self.published += n as u64,
                // Redis ran the pipeline and refused some of it (say, a `reply_to` this
                // broker's ACL may not publish to): the rest went out, and sending it all
                // again would refuse it again, forever.
                Err(e) if refused(&e) => {
                    // At most a line a second: a refusal that lasts (an ACL) meets every pass.
                    if let Some(more) = self.refused_log.note(Instant::now()) {
                        log::warn!(
                            "redis: part of a pipeline of {n} publishes (and the removals of \
                             acked commands riding with them) was refused ({e}); the refused \
                             ones are dropped, counted as one per pipeline ({more} such \
                             pipelines, this one included, since the last line)"
                        );
                    }
                    self.dropped += 1;
                }
                // Kept for the next connection: publishes are events and replies control
                // waits for.
                Err(e) => return self.call_failed(&e),
            }
            self.outgoing_bytes -= bytes;
            self.outgoing_events -= events;
            self.outgoing.drain(..n);
            self.forgets.drain(..forgets);
            if self.forgets.is_empty() {
                self.forgets_since = None;
            }
        }
    }

    /// Messages that arrived on the subscription.
    pub(crate) fn read(&mut self) -> Vec<Push> {
        let Some(sub) = self.sub.as_mut() else {
            return Vec::new();
        };
        match sub.read() {
            Ok(pushes) => pushes,
            Err(e) => {
                // The subscription alone, unless the command connection is gone too: a
                // subscription usually ends because Redis did (a restart), and the command
                // connection would only find out at its next call, a heartbeat later, and
                // start its own reconnect then, putting the leases and sessions back a second
                // or two late. Asked now, both reconnect together. A sound one stays, with
                // what it holds (queued publishes, the scripts).
                self.sub = None;
                match self.con.as_mut().map(answers_ping) {
                    Some(false) => self.con = None,
                    // Redis is up and ended this one client: its output buffer for the
                    // subscription passed `client-output-buffer-limit pubsub` (control published
                    // faster than this broker reads), or someone ran CLIENT KILL. What was
                    // published to this broker until it is subscribed again is lost, unanswered.
                    Some(true) => {
                        self.subscription_cuts += 1;
                        log::warn!(
                            "redis: ended this broker's subscription while still answering: a CLIENT KILL, or its client-output-buffer-limit for pubsub (messages published faster than this broker reads them; Redis's own log names that one); what is published to it until it resubscribes is lost, unanswered"
                        );
                    }
                    None => {}
                }
                self.back_off(Instant::now(), &e);
                Vec::new()
            }
        }
    }

    /// The subscription socket, for poll(2).
    pub(crate) fn fd(&self) -> Option<RawFd> {
        self.sub.as_ref().map(AsRawFd::as_raw_fd)
    }
}

/// How many distinct sessions `forgets` name, counting no further than `limit`.
fn sessions_up_to(forgets: &[(RigId, BootId, Seq)], limit: usize) -> usize {
    let mut seen: Vec<(&RigId, &BootId)> = Vec::new();
    for (rig, boot, _) in forgets {
        if !seen.contains(&(rig, boot)) {
            seen.push((rig, boot));
            if seen.len() >= limit {
                break;
            }
        }
    }
    seen.len()
}

/// One HDEL per session for `forgets`, naming all its acked commands, in the order the
/// sessions first appear: a rig's burst of acks costs Redis one command, not one each.
fn hdel_by_session(pipe: &mut redis::Pipeline, forgets: &[(RigId, BootId, Seq)]) {
    let mut fields: Vec<((&RigId, &BootId), Vec<String>)> = Vec::new();
    let mut at: std::collections::HashMap<(&RigId, &BootId), usize> =
        std::collections::HashMap::new();
    for (rig, boot, seq) in forgets {
        let i = *at.entry((rig, boot)).or_insert_with(|| {
            fields.push(((rig, boot), Vec::new()));
            fields.len() - 1
        });
        if let Some((_, f)) = fields.get_mut(i) {
            f.push(format!("c:{}", seq.0));
        }
    }
    for ((rig, boot), f) in fields {
        pipe.hdel(sessions::session_key(rig, boot), f).ignore();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn fleet() -> Fleet {
        Fleet::new("redis://127.0.0.1:1/", "fx", Duration::from_secs(600)).expect("url")
    }

    #[test]
    fn credential_refusals_are_told_from_outages() {
        for why in [
            "NOAUTH: Authentication required.",
            "WRONGPASS: invalid username-password pair or user is disabled.",
            "Password authentication failed- AuthenticationFailed",
            "NOPERM: this user has no permissions to run the 'pexpire' command",
        ] {
            assert!(refuses_credentials(why), "{why}");
        }
        for why in [
            "Connection refused (os error 111)",
            "LOADING: Redis is loading the dataset in memory",
            "timed out",
        ] {
            assert!(!refuses_credentials(why), "{why}");
        }
    }

    #[test]
    fn a_timeout_says_redis_did_not_answer() {
        let why = plain_timeout("Resource temporarily unavailable (os error 11)".into());
        assert!(why.starts_with("no answer in time"), "{why}");
        let refused = "Connection refused (os error 111)".to_string();
        assert_eq!(plain_timeout(refused.clone()), refused);
    }

    #[test]
    fn the_reason_redis_is_down_is_handed_over_once_and_cleared_on_reconnect() {
        let mut f = fleet();
        assert_eq!(f.take_down_why(), None);
        let now = Instant::now();
        f.back_off(now, &"Connection refused (os error 111)");
        assert_eq!(
            f.take_down_why(),
            Some(Some("Connection refused (os error 111)".into()))
        );
        f.back_off(now, &"Connection refused (os error 111)");
        assert_eq!(f.take_down_why(), None, "unchanged: nothing to hand over");
        f.back_off(now, &"WRONGPASS: invalid username-password pair");
        let why = f.take_down_why().flatten().unwrap_or_default();
        assert!(why.starts_with("credentials refused ("), "{why}");
    }

    fn rig() -> (RigId, BootId) {
        let rig = RigId::parse("rig-1").expect("rig");
        let boot = BootId::parse("0190f5c2-0000-7000-8000-000000000001").expect("boot");
        (rig, boot)
    }

    #[test]
    fn forgets_wait_for_the_pace_and_are_not_counted_as_writes() {
        let mut f = fleet();
        assert_eq!(f.forget_due(), None);
        let before = Instant::now();
        let (rig, boot) = rig();
        assert!(f.forget(rig.clone(), boot, Seq(1)));
        assert!(f.forget(rig, boot, Seq(2)));
        let due = f.forget_due().expect("due");
        assert!(due >= before + FORGET_PACE, "not before the pace");
        assert!(
            due <= Instant::now() + FORGET_PACE,
            "paced from the first forget"
        );
        assert_eq!(f.queued(), 0, "forgets do not make a write due");
    }

    /// A release queued for the very lease a hello batch is about to claim again is dropped:
    /// sent after the claim, its compare-and-delete would find the same tuple and delete it.
    /// Releases of other rigs, or of another boot of the same rig, stay.
    #[test]
    fn a_release_of_a_lease_being_claimed_again_is_dropped() {
        let mut f = fleet();
        let (rig, boot) = rig();
        let other = RigId::parse("rig-2").expect("rig");
        let older = BootId::parse("0190f5c2-0000-7000-8000-000000000000").expect("boot");
        assert!(f.release(rig.clone(), boot));
        assert!(f.release(rig.clone(), older));
        assert!(f.release(other.clone(), boot));
        f.settle_before_hellos(&[(&rig, &boot)]);
        assert_eq!(f.releases, vec![(rig, older), (other, boot)]);
    }

    #[test]
    fn a_full_batch_of_forgets_is_due_at_once() {
        let mut f = fleet();
        let (rig, boot) = rig();
        for seq in 1..=FORGET_BATCH as u64 {
            f.forget(rig.clone(), boot, Seq(seq));
        }
        let due = f.forget_due().expect("due");
        assert!(
            due <= Instant::now(),
            "a full batch goes out with the next flush"
        );
    }

    #[test]
    fn forgets_and_releases_past_the_bound_are_refused_not_queued() {
        let mut f = fleet();
        let (rig, boot) = rig();
        for seq in 0..MAX_OUTGOING as u64 {
            assert!(f.forget(rig.clone(), boot, Seq(seq)));
            assert!(f.release(rig.clone(), boot));
        }
        assert!(!f.forget(rig.clone(), boot, Seq(u64::MAX)), "full: refused");
        assert!(!f.release(rig, boot), "full: refused");
        assert_eq!(f.forgets.len(), MAX_OUTGOING);
        assert_eq!(f.releases.len(), MAX_OUTGOING);
    }

    #[test]
    fn publishes_are_bounded_by_bytes_and_events_leave_room_for_replies() {
        let mut f = fleet();
        let mib = vec![0u8; 1 << 20];
        while f.dropped == 0 {
            f.publish(EVENTS.to_string(), mib.clone());
        }
        let event = EVENTS.len() + mib.len();
        assert!(f.outgoing_bytes <= EVENT_SHARE_BYTES);
        assert!(f.outgoing_bytes + event > EVENT_SHARE_BYTES);
        f.publish("reply".into(), b"{}".to_vec());
        assert_eq!(f.dropped, 1, "a reply still has room");
        while f.dropped == 1 {
            f.publish("reply".into(), mib.clone());
        }
        assert!(f.outgoing_bytes <= MAX_OUTGOING_BYTES);
        assert!(f.outgoing_bytes + mib.len() > MAX_OUTGOING_BYTES);
    }

    #[test]
    fn small_events_leave_room_for_replies_by_count_too() {
        let mut f = fleet();
        let ack = br#"{"type":"ack","rig_id":"r","seq":1}"#.to_vec();
        while f.dropped == 0 {
            f.publish(EVENTS.to_string(), ack.clone());
        }
        assert_eq!(f.outgoing.len(), EVENT_SHARE_COUNT);
        assert!(f.outgoing_bytes < EVENT_SHARE_BYTES, "stopped by count");
        for _ in 0..MAX_OUTGOING - EVENT_SHARE_COUNT {
            f.publish("reply".into(), b"{}".to_vec());
        }
        assert_eq!(f.dropped, 1, "every reply up to the whole bound has room");
        assert_eq!(f.outgoing.len(), MAX_OUTGOING);
    }
}
