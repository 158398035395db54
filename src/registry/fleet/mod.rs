//! Fleet mode's Redis I/O, owned by the bridge thread: the command connection (Lua registry
//! scripts, batched publishes, heartbeats) and the subscription. Every call is bounded by a
//! socket timeout; any failure drops both connections and schedules a reconnect with capped,
//! jittered backoff, while the broker keeps serving its rigs from the embedded registry.
//!
//! The files: `errors` (how a failed call or connection attempt is read), `connection`
//! (connecting, health, the subscription and the reconnect backoff), `calls` (the script
//! calls answered at once), `writes` (the queued writes that go out paced), `once` (how a
//! batch of publishes whose answer was lost is sent again only if it did not run) and `sweep` (the
//! leases a predecessor under this broker id left, removed after an unclean exit).

use std::time::{Duration, Instant};

use redis::{ConnectionInfo, IntoConnectionInfo};

use crate::ids::Seq;
use crate::ids::{BootId, ConnId, RigId};
use crate::registry::command_con::CommandCon;
use crate::registry::lapse_scripts::LapseScripts;
use crate::registry::offline::OfflineScripts;
use crate::registry::pubsub::Subscriber;
use crate::registry::scripts::Scripts;
use crate::registry::sessions::{CheckedForget, SessionScripts};
use crate::registry::throttle::Throttle;

mod calls;
mod connection;
mod errors;
mod once;
mod sweep;
mod writes;

pub(crate) use connection::LONGEST_RECONNECT;
pub use connection::{broker_channel, broker_id_in_use, IdCheck};
pub(crate) use errors::refused_for_memory;

/// Socket timeout for every Redis call: a hung Redis stalls the bridge at most this long.
const IO_TIMEOUT: Duration = Duration::from_secs(2);
/// How long a reconnect attempt waits for Redis to take its probe write before giving up.
const PROBE_TIMEOUT: Duration = Duration::from_millis(250);
/// The `broker:<id>` key's TTL (CONTRACT.md §3); the heartbeat sets it, and so does the
/// reconnect probe.
pub(crate) const HEARTBEAT_TTL: Duration = Duration::from_secs(30);

/// Between the attempts to reach Redis at the end of a drain (see `Fleet::flush_before_exit`).
const EXIT_RETRY: Duration = Duration::from_millis(100);

/// Channel every broker subscribes to for broadcasts (CONTRACT.md §4).
pub const BROADCAST: &str = "fleetlink:broadcast";
/// Channel of lifecycle events (CONTRACT.md §4).
pub const EVENTS: &str = "fleetlink:events";

/// Redis connections and what is waiting to be sent on them.
pub(crate) struct Fleet {
    info: ConnectionInfo,
    broker_id: String,
    scripts: Scripts,
    sessions: SessionScripts,
    lapses: LapseScripts,
    offline: OfflineScripts,
    forgets: Vec<(RigId, BootId, Seq)>,
    /// Removals of acked commands delivered while Redis was away, which may meet another
    /// command under their seq (`forget.lua`); sent with the next flush, not paced.
    checked_forgets: Vec<CheckedForget>,
    /// Checked forgets Redis refused wait until then (`writes.rs`, `send_checked_forgets`).
    checked_forgets_after: Option<Instant>,
    /// When the oldest queued forget was queued.
    forgets_since: Option<Instant>,
    con: Option<CommandCon>,
    sub: Option<Subscriber>,
    outgoing: Vec<(String, Box<[u8]>)>,
    /// Numbers the batches of `outgoing` sent, so that one whose answer was lost is sent again
    /// only if it did not run.
    once: once::Once,
    /// Bytes in `outgoing`, channel names and payloads.
    outgoing_bytes: usize,
    /// Rig events in `outgoing`.
    outgoing_events: usize,
    releases: Vec<(RigId, BootId)>,
    /// What this broker remembers of sessions whose rigs disconnected, to write into them
    /// (`sessions::remember`).
    recalls: Vec<(RigId, BootId, String)>,
    /// Closed connections holding the echo of their rig's close until their session's note in
    /// `recalls` is written (see `ToCore::Noted`).
    noting: Vec<ConnId>,
    /// Those whose note went (or failed), for the bridge to tell their cores.
    noted: Vec<ConnId>,
    /// `--session-ttl`: touched and released sessions get it afresh (0 = no session kept).
    session_ttl: Duration,
    failures: u32,
    next_attempt: Instant,
    /// When pushes on the subscription last brought a reconnect of the command connection
    /// forward (see `connection.rs`).
    sooner_at: Option<Instant>,
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
    /// The eviction setting last warned of (see `connection::warn_if_evicting`), so a Redis
    /// that flaps is named once.
    evicting_warned: Option<String>,
    /// Set after every successful (re)subscribe: what was held for this broker's rigs while
    /// it did not listen is taken at once (the bridge's refresh), not at the next one.
    pub(crate) just_subscribed: bool,
    /// Set when the heartbeat found this broker's sentinel key gone: Redis lost keys (an
    /// empty restart, FLUSHALL, eviction), and the sessions parked here go back.
    pub(crate) keys_lost: bool,
    /// Set when a lease release found a lease gone that it should have deleted: another
    /// broker took the rig (its lease then names that broker), or Redis lost keys, which only
    /// the heartbeat tells apart. A broker with no rig connected has no refresh to notice a
    /// flush, so the bridge runs the heartbeat at once rather than within 10 s.
    pub(crate) release_missed: bool,
    /// Calls Redis refused on a sound connection (see [`leaves_connection_sound`]).
    ///
    /// [`leaves_connection_sound`]: errors::leaves_connection_sound
    pub(crate) refusals: u64,
    /// Subscriptions Redis ended while it still answered on the other connection, since the
    /// bridge last took them.
    pub(crate) subscription_cuts: u64,
    /// Commands `forget.lua` published `lost` (another command under an acked one's seq).
    pub(crate) forget_lost: u64,
    /// Publishes of batches whose answer a lost connection took: found to have run, so not
    /// sent again; and found not to have run, so sent again (`once.rs`).
    pub(crate) unanswered_ran: u64,
    pub(crate) unanswered_resent: u64,
    /// Whether a heartbeat of this process went through (its first asks after the last
    /// process under this id: `broker.lua`'s "start").
    heartbeat_went: bool,
    /// The sweep of the leases a predecessor under this id left, while under way.
    stale_sweep: Option<sweep::StaleSweep>,
    /// `stale_leases.lua`.
    stale_leases: redis::Script,
    /// Leases the sweep removed, since the bridge last took them.
    pub(crate) stale_removed: u64,
    /// The rigs of those leases, with their boots, for the `disconnected` events their dead
    /// broker never published (taken by the bridge).
    pub(crate) stale_gone: Vec<(RigId, BootId)>,
    /// A lease release was dropped for a full queue: its lease lapses by its TTL, so the
    /// exit is not a clean one (see `retire`).
    release_dropped: bool,
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
            lapses: LapseScripts::default(),
            offline: OfflineScripts::default(),
            forgets: Vec::new(),
            checked_forgets: Vec::new(),
            checked_forgets_after: None,
            forgets_since: None,
            con: None,
            sub: None,
            outgoing: Vec::new(),
            once: once::Once::new(broker_id),
            outgoing_bytes: 0,
            outgoing_events: 0,
            releases: Vec::new(),
            recalls: Vec::new(),
            noting: Vec::new(),
            noted: Vec::new(),
            session_ttl,
            failures: 0,
            next_attempt: Instant::now(),
            sooner_at: None,
            down_why: None,
            down_why_changed: false,
            dropped: 0,
            drop_log: Throttle::default(),
            refused_log: Throttle::default(),
            published: 0,
            just_connected: false,
            evicting_warned: None,
            just_subscribed: false,
            keys_lost: false,
            release_missed: false,
            refusals: 0,
            subscription_cuts: 0,
            forget_lost: 0,
            unanswered_ran: 0,
            unanswered_resent: 0,
            heartbeat_went: false,
            stale_sweep: None,
            stale_leases: redis::Script::new(include_str!("../../../lua/stale_leases.lua")),
            stale_removed: 0,
            stale_gone: Vec::new(),
            release_dropped: false,
            refusal_log: Throttle::default(),
            refusing: false,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    pub(super) fn fleet() -> Fleet {
        Fleet::new("redis://127.0.0.1:1/", "fx", Duration::from_secs(600)).expect("url")
    }
}
