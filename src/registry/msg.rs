//! The only types that cross threads: cores ⇄ bridge ⇄ admin. Owned, `Send`, sent over bounded
//! queues (`crate::doorbell`). A full queue hands the message back, and the sender answers for it.

use std::time::{Duration, Instant};

use crossbeam_channel::Sender;
use serde_json::Value;

use crate::args::Args;
use crate::ids::{BootId, ConnId, CoreId, RigId, Seq};
use crate::registry::sessions::Unkept;

/// A command that has its seq: queued on a connection, or carried to the next connection of the
/// same session.
#[derive(Debug, Clone)]
pub struct SeqCommand {
    /// Its seq in the session.
    pub seq: Seq,
    /// Control's command id.
    pub id: Box<str>,
    /// The encoded `command` JSON (payload of one text frame).
    pub json: Box<[u8]>,
    /// When it was enqueued (for "oldest queued cmd age").
    pub queued_at: Instant,
    /// When it was last written to a socket (for ack latency); None while queued.
    pub written_at: Option<Instant>,
    /// Fleet mode: not written until Redis keeps it (so no command control was told about can
    /// be lost with its broker).
    pub held: bool,
    /// Fleet mode: released while Redis could not keep it (an outage). Another broker deciding
    /// alone meanwhile may give the rig this seq for a command of its own.
    pub unkept: bool,
    /// Fleet mode: read from Redis's copy of the session (a resume, or commands another broker
    /// gave the rig meanwhile), not kept here. The broker that kept it may hold it in a copy
    /// as one whose keep it could not confirm (the answer was lost with its connection), and
    /// put that copy back later: its removal here marks the seq acked with its id, or that
    /// put-back, finding the seq empty, reports it `lost` though the rig ran it (review bb140).
    pub read_back: bool,
    /// The connection that wrote it, once written.
    pub written_on: Option<ConnId>,
}

#[cfg(test)]
impl SeqCommand {
    /// A command `c<seq>` of `len` bytes, just queued.
    pub(crate) fn for_test(seq: u64, len: usize, held: bool) -> SeqCommand {
        SeqCommand {
            seq: Seq(seq),
            id: format!("c{seq}").into(),
            json: vec![b' '; len].into(),
            queued_at: Instant::now(),
            written_at: None,
            held,
            unkept: false,
            read_back: false,
            written_on: None,
        }
    }
}

/// What a session remembers besides its unacked commands, carried with them to the rig's next
/// connection. Without it, a `result` sent after a reconnect lost its command's `id`, and
/// `last_ack_at` read null although `last_ack_seq` was known.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Recall {
    /// Acked commands whose `result` has not come yet: (seq, control's id), oldest first.
    pub results: Vec<(Seq, Box<str>)>,
    /// The rig's latest ack (0: none).
    pub last_ack: Seq,
    /// When that ack came, Unix ms (0: unknown).
    pub last_ack_ms: u64,
}

impl Recall {
    /// Bytes it holds, for the bounds of what is kept for disconnected rigs.
    pub fn bytes(&self) -> usize {
        self.results.iter().map(|(_, id)| id.len() + 24).sum()
    }

    /// Whether it remembers nothing.
    pub fn is_empty(&self) -> bool {
        self.results.is_empty() && self.last_ack_ms == 0
    }
}

/// A welcomed connection's session once the connection has closed, as the connection's end
/// hands it from its core to the registry (waiting in `crate::worker::closing` for Redis when
/// it must, then through the bridge). One value, so that no step on the way can drop or swap
/// one of its parts, or has to spell all five out again.
#[derive(Debug)]
pub struct ClosedSession {
    /// Its rig.
    pub rig: RigId,
    /// Its boot.
    pub boot: BootId,
    /// The next seq the session would have used.
    pub next_seq: Seq,
    /// Commands of the session not yet acked, kept for the session's next connection.
    pub carried: Vec<SeqCommand>,
    /// What the session remembers besides them; None when nothing (no allocation for the many
    /// sessions that have acked nothing). Boxed as parked sessions and verdicts hold it (a
    /// verdict's queue slot is preallocated).
    pub recall: Option<Box<Recall>>,
}

/// A command to keep in Redis before it is written and control hears `ok` (fleet mode).
#[derive(Debug)]
pub struct PersistReq {
    /// The connection that holds the command.
    pub conn: ConnId,
    /// The rig.
    pub rig: RigId,
    /// Its session's boot.
    pub boot: BootId,
    /// The command's seq.
    pub seq: Seq,
    /// Control's command id.
    pub id: Box<str>,
    /// The command as it will be sent.
    pub json: Box<[u8]>,
    /// Where control waits for the reply.
    pub reply: ReplyTo,
    /// A command delivered from the offline hold: what is left of its hold, should Redis
    /// fence it (the rig moved on) and it need holding again.
    pub hold_left: Option<std::time::Duration>,
}

/// A connected rig's session as its core holds it, to be kept in Redis again.
#[derive(Debug)]
pub struct RekeepReq {
    /// The rig.
    pub rig: RigId,
    /// Its session's boot.
    pub boot: BootId,
    /// The session's next seq.
    pub next: Seq,
    /// Its commands not yet acked (written or queued, none held), by seq.
    pub cmds: Vec<(Seq, Box<[u8]>)>,
    /// The seqs among them Redis may never have kept (delivered while it was away), none
    /// when Redis kept them all (see `rekeep.lua`'s `unkept_from` and `unkept_to`).
    pub unkept: Unkept,
    /// Commands were left out for their own keep, in flight when the copy was made: should
    /// Redis lose the session again before the copy is written, one kept meanwhile is in
    /// neither, and the copy must be made again (`rekeep.lua`'s "anew").
    pub left_held: bool,
}

impl RekeepReq {
    /// A copy of the session `carried` holds: its commands but those still held for their
    /// persist (the connection waits for those before it hands its session over; filtered in
    /// case).
    pub fn of(
        rig: &RigId,
        boot: BootId,
        next: Seq,
        carried: &[SeqCommand],
        unkept: Unkept,
    ) -> RekeepReq {
        RekeepReq {
            rig: rig.clone(),
            boot,
            next,
            unkept,
            left_held: carried.iter().any(|c| c.held),
            cmds: carried
                .iter()
                .filter(|c| !c.held)
                .map(|c| (c.seq, c.json.clone()))
                .collect(),
        }
    }
}

/// What an admin request thread gets back.
#[derive(Debug)]
pub struct AdminAnswer {
    /// The reply, as control would get it on `reply_to`.
    pub body: Value,
    /// For a command a connection took, that connection: where the thread sends the rig's
    /// next command itself, without the bridge.
    pub route: Option<ConnId>,
}

/// What a core serving an admin connection gets back for a request it passed on.
#[derive(Debug)]
pub enum AdminReply {
    /// The answer to a command (from a core or the bridge).
    Command(AdminAnswer),
    /// A whole HTTP answer, worked out by an admin pool thread.
    Http(crate::admin::Answer),
}

/// Where a reply to a control request goes.
#[derive(Debug, Clone)]
pub enum ReplyTo {
    /// The admin HTTP thread waiting on a one-shot channel.
    Admin(Sender<AdminAnswer>),
    /// An admin connection served on a core, waiting in that core's slot `slot`.
    Core {
        /// The core serving the admin connection.
        core: CoreId,
        /// Its waiting request.
        slot: u64,
    },
    /// A Redis channel (`reply_to`), published by the bridge.
    Channel(String),
    /// One rig's part of a broadcast; the bridge sums the parts into one reply.
    Aggregate(u64),
    /// A held command delivered at the rig's hello: its outcome is an `offline_delivered`
    /// event (control already had its one reply, `queued`).
    Event,
}

/// A request to enqueue one command for one rig.
#[derive(Debug)]
pub struct CommandReq {
    /// Control's command id.
    pub id: String,
    /// Target rig.
    pub rig: RigId,
    /// Command name.
    pub name: String,
    /// Command arguments (a JSON object's text, shared by a broadcast's copies).
    pub args: Args,
    /// Where the single reply goes.
    pub reply: ReplyTo,
    /// `queue_if_offline` with its `ttl_ms`: hold it if the rig is not connected.
    pub offline_ttl: Option<Duration>,
}

/// The registry's answer to a hello.
#[derive(Debug)]
pub enum Verdict {
    /// Welcome the rig.
    Accept {
        /// Next seq to assign in this session.
        next_seq: Seq,
        /// True when an existing session continues (CONTRACT.md §5).
        resumed: bool,
        /// Commands of the session not yet acked, to send after welcome.
        carried: Vec<SeqCommand>,
        /// What the session remembers besides them; None when nothing (no allocation for the
        /// many sessions that have acked nothing). Boxed: queue slots are preallocated.
        recall: Option<Box<Recall>>,
    },
    /// A live session with a newer boot_id owns the rig: close 4409.
    Older,
    /// The registry could not take the hello now: close 4503.
    Busy,
}

/// A page of `GET /v1/rigs` (sorted by rig id): the rigs after `after`, at most `limit`. Each
/// core sends its own first `limit`, so the admin thread merges at most cores × `limit`.
#[derive(Debug, Clone)]
pub struct RigPage {
    /// Only rigs whose id sorts after this one (None: from the first).
    pub after: Option<Box<str>>,
    /// At most this many.
    pub limit: usize,
}

impl RigPage {
    /// The whole list.
    pub const ALL: RigPage = RigPage {
        after: None,
        limit: usize::MAX,
    };
}

/// Bridge/admin → core.
#[derive(Debug)]
pub enum ToCore {
    /// The answer to a connection's hello.
    Verdict {
        /// The connection that said hello.
        conn: ConnId,
        /// What to do.
        verdict: Verdict,
    },
    /// Another connection took this rig over: close 4410.
    Supersede {
        /// The superseded connection.
        conn: ConnId,
    },
    /// Enqueue a command on a connection.
    Command {
        /// The connection believed to hold the rig.
        conn: ConnId,
        /// The request (boxed: queue slots are preallocated, so every variant stays small).
        req: Box<CommandReq>,
        /// Sent by an admin request thread from its own route memory, not by the bridge: if
        /// `conn` no longer holds the rig, the core passes the request on to the bridge, which
        /// knows where the rig is now.
        direct: bool,
    },
    /// Close a rig's connection with 1012 (force reconnect).
    Kick {
        /// The connection.
        conn: ConnId,
        /// Control's request id.
        id: String,
        /// The rig.
        rig: RigId,
        /// Where the reply goes.
        reply: ReplyTo,
    },
    /// The end of a delivery from the rig's offline hold to `conn` (fleet mode): what the
    /// connection could not number goes back to Redis. `more`: Redis holds others behind them.
    HoldDelivered {
        /// The connection the commands went to.
        conn: ConnId,
        /// Whether the hold has more in Redis.
        more: bool,
    },
    /// A refresh found commands held in Redis for `conn`'s rig as an offline one (fleet
    /// mode): the connection takes them as it takes the rest of a hold, unless it is taking
    /// from the hold already.
    HoldFound {
        /// The connection holding the rig.
        conn: ConnId,
    },
    /// Redis kept (or, fenced, refused) a held command.
    Persisted {
        /// The connection.
        conn: ConnId,
        /// The command.
        seq: Seq,
        /// False when another broker owns the rig now: drop the command.
        kept: bool,
        /// Released without Redis keeping it (Redis away): see [`SeqCommand::unkept`].
        unkept: bool,
    },
    /// What a closed connection's session remembers (its `r`: acked commands' ids awaiting
    /// results) is in Redis, or will not be written: the connection may echo the rig's close,
    /// which it held so that a resume on another broker the moment the rig has the echo
    /// finds the note there.
    Noted {
        /// The closed connection.
        conn: ConnId,
    },
    /// Redis lost this rig's session (the bridge had to restore its lease): send back what the
    /// session holds so it is kept again.
    Rekeep {
        /// The connection holding the rig.
        conn: ConnId,
    },
    /// Redis's copy of this rig's session numbers further than the core does: another broker
    /// gave the rig commands while each decided alone (a Redis outage). The next command
    /// takes `next` or above, so that no seq the rig holds is given to another command.
    RaiseSeq {
        /// The connection holding the rig.
        conn: ConnId,
        /// The lowest seq the next command may take.
        next: Seq,
        /// What Redis holds below `next` that this core never numbered, in seq order: given
        /// by another broker meanwhile, perhaps never received (the rig left that broker
        /// before reading them). Written here, ahead of the core's own, so the rig sees no
        /// gap; a rig drops a seq it already has.
        missed: Box<[SeqCommand]>,
    },
    /// Drop these commands from the rig's session: putting it back into Redis found them gone
    /// for good, published `lost` (their seqs went to other commands while this broker could
    /// not reach Redis, and the rig acked those) or acked on another broker meanwhile. Kept,
    /// a resume would give them again, or a report name them a second time.
    Forget {
        /// The connection holding the rig.
        conn: ConnId,
        /// Their seqs.
        seqs: Box<[Seq]>,
    },
    /// Send a snapshot of this core's metrics (and rigs when `rigs`).
    Snapshot {
        /// Include the rigs of this page of the list.
        rigs: Option<RigPage>,
        /// Where the snapshot goes.
        reply: Sender<crate::metrics::CoreSnapshot>,
    },
    /// Start a graceful drain over `window`.
    Drain {
        /// The drain window.
        window: Duration,
    },
    /// Serve this admin HTTP connection on the core.
    AdminConn(crate::admin::OnCore),
    /// The answer for an admin request this core waits for in `slot`.
    AdminReply {
        /// The waiting request.
        slot: u64,
        /// Its answer.
        reply: Box<AdminReply>,
    },
}

/// Core/admin → bridge.
#[derive(Debug)]
pub enum ToBridge {
    /// A valid hello arrived on a connection.
    Hello {
        /// The connection.
        conn: ConnId,
        /// Claimed rig id.
        rig: RigId,
        /// Its boot.
        boot: BootId,
        /// Hello labels.
        labels: Vec<(String, String)>,
    },
    /// A connection that had been welcomed closed.
    Closed {
        /// The connection.
        conn: ConnId,
        /// Its session. Boxed, as queue slots are preallocated: inline, it would make every
        /// slot 104 bytes (the enum's tag finds no room in the struct's padding), even with its
        /// commands as a boxed slice.
        session: Box<ClosedSession>,
    },
    /// A hello never got a verdict because its connection went away first.
    Abandoned {
        /// The connection.
        conn: ConnId,
        /// The rig it claimed.
        rig: RigId,
    },
    /// An accepted hello's session that its connection could not take (the connection was
    /// closing or gone when the verdict came): the registry parks it for the rig's return.
    Returned {
        /// The connection the verdict was for.
        conn: ConnId,
        /// Its rig and the hello's boot, when the core still knew the connection; None when
        /// the connection had already gone (its `Abandoned` came first, and the registry
        /// remembers the rig). Boxed: rare, and it would widen every queue slot.
        rig: Option<Box<(RigId, BootId)>>,
        /// The session's next seq.
        next_seq: Seq,
        /// The session's unacked commands.
        carried: Vec<SeqCommand>,
        /// What the session remembers besides them; None when nothing (no allocation for the
        /// many sessions that have acked nothing). Boxed: queue slots are preallocated.
        recall: Option<Box<Recall>>,
    },
    /// A lifecycle event for `fleetlink:events` (CONTRACT.md §4), serialized by the core: its
    /// bytes are what [`crate::registry::bridge::BridgeShared::event_bytes`] counts.
    Event(Box<[u8]>),
    /// An `offline_delivered` refusal of a held command (fleet mode), serialized and counted
    /// like [`ToBridge::Event`]: published after the commands the core sent to be kept before
    /// it, whose `offline_delivered` reports wait for Redis, so that control reads a hold's
    /// reports in hold order.
    HeldEvent(Box<[u8]>),
    /// A reply for a Redis `reply_to` channel.
    Reply {
        /// The channel.
        channel: String,
        /// The reply object.
        body: Value,
    },
    /// Keep a command in the rig's session before it is written (fleet mode).
    Persist(Box<PersistReq>),
    /// Put a connected rig's session back into Redis (the answer to [`ToCore::Rekeep`]).
    Rekeep(Box<RekeepReq>),
    /// The rig acked (or the broker stopped remembering) a command: forget it in Redis.
    Forget {
        /// The rig.
        rig: RigId,
        /// Its session's boot.
        boot: BootId,
        /// The command.
        seq: Seq,
        /// Its id: delivered while Redis was away, the seq may name another broker's command
        /// in Redis, which this removal must not take silently (`lua/forget.lua`).
        id: Box<str>,
        /// The ack may be for another broker's command under this seq (reported `lost`
        /// here): only this very command is removed, and the seq is not marked acked with it.
        doubtful: bool,
        /// It was read back from Redis (`SeqCommand::read_back`): its removal marks the seq
        /// acked with its id.
        read_back: bool,
    },
    /// One rig's answer to a broadcast command.
    Part {
        /// The broadcast it belongs to.
        agg: u64,
        /// The per-rig reply.
        body: Value,
    },
    /// Route a command to whichever connection holds the rig.
    Command(Box<CommandReq>),
    /// A command held for the rig while it was offline, which connection `conn` could not
    /// take (it closed, or another connection took the rig over, between the hello that took
    /// the command from the hold and the command reaching it): routed again, to the rig's
    /// connection now, or held again, never dropped.
    Undelivered {
        /// The connection that could not take it.
        conn: ConnId,
        /// The command, its `offline_ttl` what is left of its hold.
        req: Box<CommandReq>,
    },
    /// Commands from the rig's offline hold that its connection could not number yet, in hold
    /// order: back to the head of the hold in Redis (fleet mode).
    HeldBack {
        /// The rig.
        rig: RigId,
        /// The commands, each `offline_ttl` what is left of its hold.
        reqs: Box<[CommandReq]>,
    },
    /// Take up to `max` more of the rig's held commands from Redis for connection `conn`,
    /// delivered as at a welcome, then [`ToCore::HoldDelivered`].
    TakeHeld {
        /// The connection with room for them.
        conn: ConnId,
        /// The rig.
        rig: RigId,
        /// How many fit.
        max: u32,
        /// How many bytes of them fit (the first is taken whatever its size).
        max_bytes: u32,
    },
    /// Close a rig's connection with 1012.
    Kick {
        /// Control's request id.
        id: String,
        /// The rig.
        rig: RigId,
        /// Where the reply goes.
        reply: ReplyTo,
    },
    /// The broker is stopping: release what it holds and exit.
    Shutdown {
        /// Set by a second signal, which means "now": until then, a Redis that is away gets a
        /// few seconds to come back for what the broker still holds for it.
        now: std::sync::Arc<std::sync::atomic::AtomicBool>,
    },
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn queue_slots_stay_small() {
        // Bounded crossbeam channels preallocate every slot, so message size × capacity is
        // resident from the start (65,536 slots per queue): big payloads go in a Box.
        assert!(
            std::mem::size_of::<ToCore>() <= 72,
            "{}",
            std::mem::size_of::<ToCore>()
        );
        assert!(
            std::mem::size_of::<ToBridge>() <= 96,
            "{}",
            std::mem::size_of::<ToBridge>()
        );
    }
}
