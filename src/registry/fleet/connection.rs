//! Getting and keeping fleet mode's two Redis connections: the start-time check of the broker
//! id, connecting (with its short probe), whether both are up, what a failed call does to a
//! connection, the subscription's reads, and the capped, jittered backoff between attempts.
//! Apart because the rest of fleet mode only asks whether a connection is there and hands its
//! failures here: when to drop a connection and when to try again is decided in this one place.

use std::collections::HashMap;
use std::os::fd::{AsRawFd, RawFd};
use std::time::{Duration, Instant};

use super::errors::{
    answered_refusal, answers_ping, leaves_connection_sound, plain_timeout, refuses_credentials,
    CallError,
};
use super::{Fleet, BROADCAST, EXIT_RETRY, HEARTBEAT_TTL, IO_TIMEOUT, PROBE_TIMEOUT};
use crate::registry::command_con::CommandCon;
use crate::registry::exit_wait::ExitWait;
use crate::registry::pubsub::{Push, Subscriber};

/// Backoff cap between reconnect attempts that each held the bridge: a hung Redis or a
/// black-holed path keeps an attempt up to its probe's 250 ms, and hellos and admin commands
/// wait behind it, so such attempts come at most one every 2.5–7.5 s.
const MAX_BACKOFF: Duration = Duration::from_secs(5);
/// The longest a broker can take to get back to a Redis that returned: [`MAX_BACKOFF`] at the
/// jitter's longest (1.5 times), and an attempt's connect and probe. Another broker's first
/// refresh after an outage may come that long after this one's.
pub(crate) const LONGEST_RECONNECT: Duration =
    Duration::from_millis((MAX_BACKOFF.as_millis() * 3 / 2 + PROBE_TIMEOUT.as_millis() * 2) as u64);
/// The cap once an attempt failed at once (refused: Redis restarting, or loading its data).
/// Trying again costs next to nothing then, and every second saved is a second sooner that
/// commands published through Redis reach this broker again.
const MAX_BACKOFF_REFUSED: Duration = Duration::from_secs(1);
/// Between the two caps, an attempt's cap is this many times what it took, so that attempts
/// hold the bridge about a twentieth of the time (a tenth at the shortest jitter).
const CAP_PER_ATTEMPT_TIME: u32 = 20;

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

/// The key prefixes the broker reads and writes (CONTRACT.md §3 names the first two).
const KEY_PREFIXES: [&str; 6] = [
    "rig:",
    "broker:",
    "sess:",
    "sessof:",
    "offline:",
    "sentinel:",
];

/// Checks that Redis's ACL lets this user read and write every key prefix the broker uses, on
/// names no rig or broker can have (ids never hold a space), so nothing real is touched. An
/// ACL that left out the session keys (`~sess:*`) had every hello turned away (4503) with
/// `/readyz` at 200; refused here, it reads as refused credentials: `/readyz` says why, the log
/// says what to grant, and rigs are served from the local registry meanwhile.
fn check_key_access(con: &mut CommandCon) -> anyhow::Result<()> {
    let probe: Vec<String> = KEY_PREFIXES
        .iter()
        .map(|p| format!("{p}fleetlink probe"))
        .collect();
    let read = redis::cmd("EXISTS").arg(&probe).query::<i64>(con);
    let write = read.and_then(|_| redis::cmd("DEL").arg(&probe).query::<i64>(con));
    match write {
        Ok(_) => Ok(()),
        Err(e) if e.code() == Some("NOPERM") => anyhow::bail!(
            "NOPERM: Redis's ACL for this user does not let it read and write all of the keys \
             {} ({e}); grant them, e.g. `ACL SETUSER <user> ~rig:* ~broker:* ~sess:* \
             ~sessof:* ~offline:* ~sentinel:* &fleetlink:* +@all`",
            KEY_PREFIXES.map(|p| format!("{p}*")).join(" ")
        ),
        Err(e) => Err(e.into()),
    }
}

/// Whether Redis refused MULTI or EXEC to this user (its ACL), in whichever reply says so.
fn refuses_transactions(e: &redis::RedisError) -> bool {
    let text = format!("{} {e}", e.detail().unwrap_or(""));
    let nopermission = e.code() == Some("NOPERM") || text.contains("NOPERM");
    nopermission && (text.contains("'multi'") || text.contains("'exec'"))
}

/// Checks that Redis's ACL lets this user run transactions: offline holds are taken, and
/// replies and events published, in them. Refused, a hello found every take refused and was
/// turned away (4503) while `/readyz` read 200 (review bb141); here it reads as refused
/// credentials, as a missing key prefix does.
fn check_transactions(con: &mut CommandCon) -> anyhow::Result<()> {
    let probe = format!("{}fleetlink probe", KEY_PREFIXES[0]);
    let mut pipe = redis::pipe();
    pipe.cmd("MULTI").cmd("EXISTS").arg(&probe).cmd("EXEC");
    // Every reply read as it came: a refused MULTI leaves the rest to run as plain commands,
    // and a refused EXEC answers EXECABORT naming NOPERM in its text.
    let replies = redis::ConnectionLike::req_packed_commands(
        con,
        &pipe.get_packed_pipeline(),
        0,
        pipe.len(),
    )?;
    let refusal = replies.iter().find_map(|r| match r {
        redis::Value::ServerError(e) if refuses_transactions(&e.clone().into()) => {
            Some(format!("{} {}", e.code(), e.details().unwrap_or("")))
        }
        _ => None,
    });
    // Refused for a passing reason (a full Redis refuses every command inside MULTI), the
    // connection is sound, and the broker connects as to any full Redis.
    match refusal {
        Some(why) => anyhow::bail!(
            "NOPERM: Redis's ACL for this user does not let it run MULTI and EXEC ({why}), \
             which the broker needs; grant them, e.g. `ACL SETUSER <user> +multi +exec`"
        ),
        None => Ok(()),
    }
}

impl Fleet {
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
        let started = Instant::now();
        match self.open_missing() {
            Ok(()) => {
                log::info!("redis: connected, scripts loaded, subscribed");
                self.failures = 0;
                self.down_why_changed |= self.down_why.take().is_some();
                true
            }
            Err(e) => {
                let why = e.to_string();
                if refuses_credentials(&why) && self.sub.take().is_some() {
                    // Kept, the subscription took commands this broker ran on its rigs with
                    // no way to answer them (no command connection) for as long as the ACL
                    // stays as it is: control timed out and sent them again (review bb143).
                    // Unsubscribed, control's PUBLISH says no one received them.
                    log::warn!(
                        "redis: unsubscribed while Redis refuses this broker's user: commands \
                         published to it reach no one (PUBLISH answers 0) until it is accepted"
                    );
                }
                self.back_off(now, &e, cap_after(started.elapsed()));
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
            self.just_subscribed = true;
        }
        Ok(())
    }

    /// Drops the command connection if Redis closed it while it was idle, and makes its
    /// reconnect due at once rather than at the backoff: Redis itself may well be fine (a
    /// `CLIENT KILL`, its `timeout`), and the next call, a hello's say, would otherwise fail
    /// on the dead connection and be decided without Redis. True when it dropped it.
    pub(crate) fn drop_if_closed(&mut self, now: Instant) -> bool {
        if !self.con.as_ref().is_some_and(CommandCon::peer_gone) {
            return false;
        }
        log::warn!(
            "redis: closed the command connection while it was idle (a CLIENT KILL, Redis's \
             timeout setting, or a restart); reconnecting it"
        );
        self.con = None;
        self.next_attempt = self.next_attempt.min(now);
        true
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
            .arg(crate::registry::sessions::PERSIST)
            .query::<String>(&mut con)?;
        redis::cmd("SCRIPT")
            .arg("LOAD")
            .arg(crate::registry::sessions::RESUME)
            .query::<String>(&mut con)?;
        self.once.connected(&mut con)?;
        check_key_access(&mut con)?;
        check_transactions(&mut con)?;
        self.warn_if_evicting(&mut con);
        Ok(con)
    }

    /// Says, at warn, when Redis may evict keys: with `maxmemory` set and a policy other than
    /// `noeviction`, a full Redis drops sessions, leases and offline holds on its own, and the
    /// unacked commands only they held go unreported (docs/operations.md, "Redis"). Nothing
    /// when `CONFIG` is not allowed (a managed Redis, an ACL): the docs say what to set.
    fn warn_if_evicting(&mut self, con: &mut CommandCon) {
        let Ok(got) = redis::cmd("CONFIG")
            .arg("GET")
            // One pattern: Redis before 7 takes no more.
            .arg("maxmemory*")
            .query::<HashMap<String, String>>(con)
        else {
            return;
        };
        let (Some(limit), Some(policy)) = (got.get("maxmemory"), got.get("maxmemory-policy"))
        else {
            return;
        };
        let setting = format!("maxmemory {limit} with maxmemory-policy {policy}");
        if limit == "0" || policy == "noeviction" || self.evicting_warned.as_ref() == Some(&setting)
        {
            return;
        }
        log::warn!(
            "!!! redis: {setting}: once full, Redis evicts keys on its own, and a session, lease \
             or offline hold it evicts loses the unacked commands only it held, without a \
             report; set maxmemory-policy noeviction (docs/operations.md, \"Redis\")"
        );
        self.evicting_warned = Some(setting);
    }

    /// A call's answer, or None once its failure is handled as [`Self::call_failed`] says.
    pub(super) fn answered<T, E: CallError>(&mut self, r: Result<T, E>) -> Option<T> {
        r.map_err(|e| self.call_failed(&e)).ok()
    }

    /// A call on the command connection failed. A refusal on a sound connection is counted
    /// and logged (at most once a second), and both connections stay; anything else drops
    /// the command connection alone, and the subscription goes on delivering commands (kept
    /// or not as Redis allows, their replies queued until it is back).
    pub(super) fn call_failed(&mut self, e: &dyn CallError) {
        let now = Instant::now();
        // MULTI or EXEC refused by the ACL (revoked while connected): hellos taking offline
        // holds were turned away (4503) with `/readyz` at 200 for as long as the connection
        // lasted (review bb143). Dropped, the reconnect's check reports refused credentials.
        if e.redis().is_some_and(refuses_transactions) {
            self.con = None;
            return self.back_off(now, e, MAX_BACKOFF);
        }
        if let Some(redis) = e.redis().filter(|r| leaves_connection_sound(r)) {
            // Only a full Redis refuses the writes that keep leases and sessions; a refusal of
            // one command (an ACL without HDEL, say) would otherwise have every heartbeat
            // re-assert every session.
            self.refusing |= redis.code() == Some("OOM");
            return self.note_refusal(e);
        }
        self.con = None;
        self.back_off(now, e, MAX_BACKOFF);
    }

    /// Counts a call Redis refused on a sound connection, and logs it at most once a second.
    pub(super) fn note_refusal(&mut self, e: &dyn std::fmt::Display) {
        self.refusals += 1;
        if let Some(n) = self.refusal_log.note(Instant::now()) {
            log::warn!(
                "redis: {n} calls refused since the last such line (the last: {e}); the \
                 connections stay, and what was refused goes on without Redis: commands \
                 are delivered unkept, hellos decided here"
            );
        }
    }

    /// Schedules the next reconnect attempt after a failure, at most `cap` (before jitter)
    /// after the last. The reason kept for `/readyz` says whether Redis could not be reached,
    /// refused the credentials, or answered but refused the call.
    fn back_off(&mut self, now: Instant, why: &dyn std::fmt::Display, cap: Duration) {
        let mut why = plain_timeout(why.to_string());
        let credentials = refuses_credentials(&why);
        let answered = answered_refusal(&why).map(str::to_string);
        let state = if credentials {
            "credentials refused"
        } else if answered.is_some() {
            "answers but refuses"
        } else {
            "unreachable"
        };
        if let Some(said) = answered {
            why = said;
        }
        if credentials {
            // Not an outage that ends by itself: the log must say what to fix. Every attempt
            // up to the fourth, then at doubling counts, so a fix is seen to take.
            if self.failures < 4 || self.failures.is_power_of_two() {
                log::error!(
                    "redis: credentials refused ({why}): check the user and password in \
                     --redis and Redis's ACL; retrying, and serving from the local registry \
                     meanwhile"
                );
            }
        } else if why.contains("DB index is out of range") {
            // Configuration too: the database --redis names is past Redis's `databases`.
            if self.failures < 4 || self.failures.is_power_of_two() {
                log::error!(
                    "redis: {why}: the database in --redis is not one this Redis has (its \
                     `databases` setting, 16 by default); retrying, and serving from the local \
                     registry meanwhile"
                );
            }
        } else if self.failures == 0 {
            log::warn!("redis: {why}; serving from the local registry until it returns");
        } else if self.failures >= 4 && self.failures.is_power_of_two() {
            // Credentials were handled above: what is left either never answered or refused.
            let still = if state == "unreachable" {
                "unreachable"
            } else {
                "refusing"
            };
            log::warn!(
                "redis: still {still} after {} attempts (the last: {why})",
                self.failures
            );
        }
        let why = format!("{state}: {why}");
        if self.down_why.as_deref() != Some(why.as_str()) {
            self.down_why = Some(why);
            self.down_why_changed = true;
        }
        self.failures = self.failures.saturating_add(1);
        self.next_attempt = now + backoff(self.failures, cap, fastrand::f64());
    }

    /// Tries to reach Redis until `wait` is over, every [`EXIT_RETRY`] rather than at the
    /// backoff's pace; true once both connections are up.
    pub(crate) fn wait_up(&mut self, wait: &ExitWait) -> bool {
        loop {
            let now = Instant::now();
            // After "now", only a Redis already there: no attempt that could take a probe's
            // wait. Nor one that could end past the wait.
            if !attempt_fits(wait, now) {
                return false;
            }
            self.next_attempt = self.next_attempt.min(now);
            if self.ensure(now) {
                return true;
            }
            std::thread::sleep(wait.pause(now, EXIT_RETRY));
        }
    }

    /// Messages that arrived on the subscription.
    pub(crate) fn read(&mut self) -> Vec<Push> {
        let Some(sub) = self.sub.as_mut() else {
            return Vec::new();
        };
        match sub.read() {
            Ok(pushes) => {
                if !pushes.is_empty() && self.con.is_none() {
                    self.reconnect_sooner(Instant::now());
                }
                pushes
            }
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
                    // faster than this broker reads), or someone ran CLIENT KILL. What Redis had
                    // not yet sent (it drops the output buffer with the client), and what is
                    // published until the broker is subscribed again, is lost, unanswered.
                    Some(true) => {
                        self.subscription_cuts += 1;
                        log::warn!(
                            "redis: ended this broker's subscription while still answering: a CLIENT KILL, or its client-output-buffer-limit for pubsub (messages published faster than this broker reads them; Redis's own log names that one); what Redis had not yet sent it, and what is published to it until it resubscribes, is lost, unanswered"
                        );
                    }
                    None => {}
                }
                self.back_off(Instant::now(), &e, MAX_BACKOFF);
                Vec::new()
            }
        }
    }

    /// Redis pushed on the subscription while the command connection is down: Redis answers,
    /// so the reconnect should not wait out a backoff grown while it hung (up to 7.5 s after a
    /// pause of a few seconds). Until then, commands that arrive are delivered unkept and
    /// their replies wait; should the broker die meanwhile, control never hears of them
    /// (review bb138). At most once per [`SOONER_EVERY`], in case the command connection keeps
    /// failing for a reason of its own (Redis at `maxclients`, say).
    fn reconnect_sooner(&mut self, now: Instant) {
        if self.sooner_at.is_some_and(|at| now < at + SOONER_EVERY) {
            return;
        }
        self.sooner_at = Some(now);
        self.next_attempt = self.next_attempt.min(now);
    }

    /// The subscription socket, for poll(2).
    pub(crate) fn fd(&self) -> Option<RawFd> {
        self.sub.as_ref().map(AsRawFd::as_raw_fd)
    }

    /// The command connection's socket, for poll(2) on its peer's close alone.
    pub(crate) fn con_fd(&self) -> Option<RawFd> {
        self.con.as_ref().map(CommandCon::fd)
    }
}

/// Least time between two reconnects brought forward by the subscription's pushes.
const SOONER_EVERY: Duration = Duration::from_millis(500);

/// Whether a reconnect attempt begun at `now` ends within `wait` however Redis answers: a hung
/// one holds it for the connect and then the probe, each up to [`PROBE_TIMEOUT`].
pub(super) fn attempt_fits(wait: &ExitWait, now: Instant) -> bool {
    !wait.over(now + PROBE_TIMEOUT.saturating_mul(2))
}

/// The cap for the wait after an attempt that failed in `took`: short when it was refused at
/// once, long when it held the bridge.
fn cap_after(took: Duration) -> Duration {
    took.saturating_mul(CAP_PER_ATTEMPT_TIME)
        .clamp(MAX_BACKOFF_REFUSED, MAX_BACKOFF)
}

/// The wait after `failures` failed attempts in a row: doubling from 200 ms up to `cap`, then
/// scaled by 0.5–1.5 (`jitter` in 0–1), so that brokers that lost Redis together do not
/// all come back in the same instant.
fn backoff(failures: u32, cap: Duration, jitter: f64) -> Duration {
    Duration::from_millis(100)
        .saturating_mul(1 << failures.min(10))
        .min(cap)
        .mul_f64(0.5 + jitter)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::registry::fleet::tests::fleet;

    #[test]
    fn another_broker_is_back_within_the_longest_reconnect() {
        // The backoff's cap at its longest jitter (1.5 times), then a connect and a probe.
        assert_eq!(LONGEST_RECONNECT, Duration::from_secs(8));
    }

    #[test]
    fn the_reason_redis_is_down_is_handed_over_once_and_cleared_on_reconnect() {
        let mut f = fleet();
        assert_eq!(f.take_down_why(), None);
        let now = Instant::now();
        f.back_off(now, &"Connection refused (os error 111)", MAX_BACKOFF);
        assert_eq!(
            f.take_down_why(),
            Some(Some(
                "unreachable: Connection refused (os error 111)".into()
            ))
        );
        f.back_off(now, &"Connection refused (os error 111)", MAX_BACKOFF);
        assert_eq!(f.take_down_why(), None, "unchanged: nothing to hand over");
        f.back_off(
            now,
            &"WRONGPASS: invalid username-password pair",
            MAX_BACKOFF,
        );
        let why = f.take_down_why().flatten().unwrap_or_default();
        assert_eq!(
            why,
            "credentials refused: WRONGPASS: invalid username-password pair"
        );
        // Redis answered, so not "unreachable" (review bb146: a read-only replica).
        f.back_off(
            now,
            &"An error was signalled by the server - ReadOnly: You can't write against a read only replica.",
            MAX_BACKOFF,
        );
        let why = f.take_down_why().flatten().unwrap_or_default();
        assert_eq!(
            why,
            "answers but refuses: ReadOnly: You can't write against a read only replica."
        );
    }

    #[test]
    fn a_refused_attempt_is_tried_again_within_1_5_s_and_one_that_held_the_bridge_backs_off_to_7_5_s(
    ) {
        let refused = cap_after(Duration::from_millis(1));
        let held = cap_after(Duration::from_millis(250));
        assert_eq!((refused, held), (MAX_BACKOFF_REFUSED, MAX_BACKOFF));
        // A slow refusal (a Redis far away) is paced by what it took.
        assert_eq!(
            cap_after(Duration::from_millis(100)),
            Duration::from_secs(2)
        );
        // The first waits are the same either way: 200 ms, 400 ms, 800 ms before jitter.
        for failures in 1..=3 {
            assert_eq!(
                backoff(failures, refused, 0.5),
                backoff(failures, held, 0.5)
            );
        }
        assert_eq!(backoff(1, held, 0.5), Duration::from_millis(200));
        // After a long outage: at most 1.5 s while Redis refuses, 7.5 s while it hangs.
        for failures in [10, 11, 1_000, u32::MAX] {
            assert_eq!(
                backoff(failures, refused, 1.0),
                Duration::from_millis(1_500)
            );
            assert_eq!(backoff(failures, refused, 0.0), Duration::from_millis(500));
            assert_eq!(backoff(failures, held, 1.0), Duration::from_millis(7_500));
            assert_eq!(backoff(failures, held, 0.0), Duration::from_millis(2_500));
        }
    }

    #[test]
    fn while_redis_refuses_connections_attempts_come_at_the_short_pace() {
        // Its Redis is 127.0.0.1:1, where nothing listens: each attempt is refused at once.
        let mut f = fleet();
        f.failures = 20;
        let now = Instant::now();
        f.next_attempt = now;
        assert!(!f.ensure(now));
        let took = now.elapsed();
        let wait = f.next_attempt - now;
        // 1.5 s at most; more only if a busy machine stretched the attempt itself (the old
        // pace waited 2.5–7.5 s however quick the refusal).
        assert!(
            wait <= Duration::from_millis(1_500).max(took * 30),
            "a refused attempt after a long outage waits {wait:?} (it took {took:?})"
        );
    }
}
