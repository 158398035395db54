//! Control's commands for a rig and the outbox that holds them: admitting one (scope, bounds,
//! seq), the refusals control hears, the offline hold's commands waiting for room, and
//! [`pump`], which writes them to the rig within its unacked window; and how a reply reaches
//! control. Separate as the outbound half of a session, the one that decides what a rig is sent.

use std::time::Instant;

use crate::doorbell::Full;
use crate::ids::{ConnId, RigId, Seq};
use crate::metrics::{GroupCount, C};
use crate::protocol;
use crate::registry::msg::{
    AdminAnswer, AdminReply, CommandReq, PersistReq, ReplyTo, SeqCommand, ToBridge,
};
use crate::registry::offline::MAX_PER_RIG;
use crate::reply::{self, Unresponsive};
use crate::worker::core::{stamp, Conn, ConnState, Core, Phase, Session};
use crate::worker::queues::{self, RIG_OUTBOX_BYTES, RIG_UNACKED_BYTES};
use crate::worker::transport::Security;
use crate::ws::OpCode;

use super::hold_fetch;

use super::rig_messages::forget_kept;

/// Control's command for this connection's rig.
pub(crate) fn on_command(core: &Core, conn: &Conn, st: &mut ConnState, req: CommandReq) {
    // One from the offline hold goes behind those of it already waiting, here or in Redis:
    // hold order.
    let behind = waiting(st) > 0 || st.session.as_ref().is_some_and(|s| s.hold.behind());
    let req = match behind && from_hold(&req) {
        true => Err(req),
        false => enqueue(core, conn, st, req),
    };
    if let Err(req) = req {
        wait_for_room(core, conn, st, req);
    }
    pump(core, conn, st);
}

/// Whether a command comes from the rig's offline hold: control was answered when it was held,
/// and its outcome is an event.
fn from_hold(req: &CommandReq) -> bool {
    matches!(req.reply, ReplyTo::Event)
}

/// Commands from the offline hold waiting for room in this connection's outbox.
fn waiting(st: &ConnState) -> usize {
    st.session
        .as_ref()
        .and_then(|s| s.queues.as_ref())
        .map_or(0, |q| q.waiting_len())
}

/// A command from the offline hold that the outbox cannot take yet waits for room (a rig
/// comes back to up to [`MAX_PER_RIG`] held commands, more than an outbox holds). Refused as
/// any command past the outbox only past that many, or past the core's command bytes.
fn wait_for_room(core: &Core, conn: &Conn, st: &mut ConnState, req: CommandReq) {
    let Some(session) = st.session.as_mut() else {
        return not_taken(core, conn.id, req, "the rig's connection is closing");
    };
    if session.queues.as_ref().map_or(0, |q| q.waiting_len()) >= MAX_PER_RIG {
        return outbox_full(core, session, req, Filled::Count);
    }
    if core_full(core, queues::weight(&req)) {
        return memory_full(core, req);
    }
    session.queues().wait(req, false);
}

/// Puts control's command in the outbox, numbered, or answers why not. A command from the
/// offline hold that the outbox has no room for comes back (`Err`) to wait for it.
fn enqueue(
    core: &Core,
    conn: &Conn,
    st: &mut ConnState,
    req: CommandReq,
) -> Result<(), CommandReq> {
    if !holds(st, &req.rig) {
        let why = leaving(st, matches!(req.reply, ReplyTo::Aggregate(_)));
        not_taken(core, conn.id, req, why);
        return Ok(());
    };
    if !scope_allows(&st.sec, |s| s.allows_command(&req.name)) {
        let why = "the rig's token does not allow this command";
        refuse_command(core, req, C::Forbidden, "forbidden", why);
        return Ok(());
    }
    let Some(session) = st.session.as_mut() else {
        return Ok(());
    };
    if let Some(seq) = broadcast_had(session, &req) {
        core.metrics.inc(C::CmdBroadcastAgain);
        let body = reply::enqueued(&req.id, &session.rig, seq);
        deliver_routed(core, req.reply, body, Some(conn.id));
        return Ok(());
    }
    let held = from_hold(&req);
    if session.held_len() >= core.cfg.unacked_limit() {
        if held {
            return Err(req);
        }
        // Redis is slower than control right now: a broker-side condition, not the rig's.
        let why = "too many commands waiting for the session store";
        refuse_command(core, req, C::CmdStoreBacklog, "overloaded", why);
        return Ok(());
    }
    // Those still waiting for Redis count too for the hold's: it delivers a thousand at once.
    // And the hold leaves a quarter of the outbox and of the session to control's new
    // commands, which may go ahead of it: filled by a hold the rig works through, a healthy
    // rig was answered rig_unresponsive.
    let (queued, room) = match held {
        true => (
            session.queues.as_ref().map_or(0, |q| q.outbox().len()),
            core.cfg.outbox - core.cfg.hold_reserve(),
        ),
        false => (session.outbox_len(), core.cfg.outbox),
    };
    if queued >= room {
        if held {
            return Err(req);
        }
        outbox_full(core, session, req, Filled::Count);
        return Ok(());
    }
    // Those waiting for Redis join the queue once kept, past --outbox: the session as a whole
    // (queued, waiting and written unacked) must stay within what a resume carries, or a burst
    // to a rig that does not ack would have its next resume drop the oldest of commands control
    // was told were taken.
    let session_room = match held {
        true => core.cfg.session_limit() - core.cfg.hold_reserve(),
        false => core.cfg.session_limit(),
    };
    if session.commands_len() >= session_room && !drop_oldest_had(core, session) {
        if held {
            return Err(req);
        }
        outbox_full(core, session, req, Filled::Session);
        return Ok(());
    }
    let seq = session.next_seq;
    if seq > Seq::LAST {
        // Only a hello claiming a last_seq near the limit gets here: wrapping would reuse seqs.
        let why =
            "this boot of the rig has used every seq; it takes commands again under a new boot_id";
        refuse_command(core, req, C::CmdSeqExhausted, "seq_exhausted", why);
        return Ok(());
    }
    let json = protocol::encode_command(session.v, seq, &req.id, &req.name, req.args.raw())
        .into_boxed_slice();
    let queued = session.queues.as_ref().map_or(0, |q| q.outbox_bytes());
    if queued > 0 && queued + json.len() > RIG_OUTBOX_BYTES {
        if held {
            return Err(req);
        }
        outbox_full(core, session, req, Filled::Bytes(queued));
        return Ok(());
    }
    if core_full(core, json.len()) {
        memory_full(core, req);
        return Ok(());
    }
    if core.persist {
        // Kept in Redis first; the bridge answers control and releases it for writing.
        let persist = PersistReq {
            conn: conn.id,
            rig: session.rig.clone(),
            boot: session.boot,
            seq,
            id: req.id.as_str().into(),
            json: json.clone(),
            hold_left: req.offline_ttl.filter(|_| held),
            reply: req.reply,
        };
        if let Err(Full(ToBridge::Persist(p))) =
            core.push_to_bridge(ToBridge::Persist(Box::new(persist)))
        {
            bridge_full(core, &req.id, &req.rig, p.reply);
            return Ok(());
        }
    } else {
        let body = reply::enqueued(&req.id, &session.rig, seq);
        deliver_routed(core, req.reply, body, Some(conn.id));
    }
    session.next_seq = Seq(seq.0.saturating_add(1));
    session.queues().push_outbox(SeqCommand {
        seq,
        id: req.id.as_str().into(),
        json,
        queued_at: Instant::now(),
        written_at: None,
        held: core.persist,
        unkept: false,
        read_back: false,
        written_on: None,
    });
    core.metrics.inc(C::CmdEnqueued);
    core.metrics
        .group_count(session.group, GroupCount::Enqueued);
    Ok(())
}

/// The seq under which the rig's session already holds this broadcast, queued or written
/// and not acked. Every broker reads a broadcast at its own moment, so a rig that moves
/// between two of them as it arrives can be given it by both: the session the rig brought
/// here (a resume carries the commands the broker it left gave and the rig has not acked)
/// then holds it already, and numbered again it would reach the rig under a second seq,
/// which the rig runs as another command. Only the very same command counts (its id, name
/// and args, as it was sent): a direct command that shares the broadcast's id is another
/// command, and taking it for the broadcast would lose the broadcast.
fn broadcast_had(session: &Session, req: &CommandReq) -> Option<Seq> {
    if !matches!(req.reply, ReplyTo::Aggregate(_)) {
        return None;
    }
    let q = session.queues.as_ref()?;
    q.outbox()
        .iter()
        .chain(q.unacked().iter())
        .filter(|c| *c.id == *req.id)
        .find(|c| {
            let json =
                protocol::encode_command(session.v, c.seq, &req.id, &req.name, req.args.raw());
            *c.json == *json
        })
        .map(|c| c.seq)
}

/// What filled a rig's outbox, which says what control's `detail` counts.
enum Filled {
    /// `--outbox` commands ready to write: the count leaves out those waiting for Redis.
    Count,
    /// The whole session, what a resume carries: every queued command counts.
    Session,
    /// The whole session, with `--outbox` commands queued, those waiting for Redis among them:
    /// answered as the outbox.
    Queued,
    /// This many bytes queued, every queued command's.
    Bytes(usize),
}

/// Answers a command refused for a full outbox with `rig_unresponsive`, and counts it.
fn outbox_full(core: &Core, session: &mut Session, req: CommandReq, filled: Filled) {
    core.metrics.inc(C::CmdOutboxFull);
    core.metrics
        .group_count(session.group, GroupCount::OutboxFull);
    let all_queued = session.queues.as_ref().map_or(0, |q| q.outbox().len());
    // A rig that reads nothing fills both on one command: the outbox is what the contract
    // names, even where some of it still waits for Redis (review bb128: "session full" in 7
    // of 10 bursts to such a rig in fleet mode, never standalone).
    let filled = match filled {
        Filled::Session if all_queued >= core.cfg.outbox => Filled::Queued,
        f => f,
    };
    let q = session.queues();
    let age = |c: Option<&SeqCommand>| c.map(|c| c.queued_at.elapsed());
    let oldest = match filled {
        // Written and unacked ones too: the outbox may be empty.
        Filled::Session => age(q.unacked().front()).max(age(q.outbox().front())),
        _ => age(q.outbox().front()),
    }
    .unwrap_or_default();
    let (queued, bytes, held) = match filled {
        Filled::Count => (session.outbox_len(), None, None),
        Filled::Session => (
            all_queued,
            None,
            Some((session.commands_len(), core.cfg.session_limit())),
        ),
        Filled::Queued => (all_queued, None, None),
        Filled::Bytes(b) => (all_queued, Some((b, RIG_OUTBOX_BYTES)), None),
    };
    let body = reply::unresponsive(
        &req.id,
        &session.rig,
        Unresponsive {
            queued,
            capacity: core.cfg.outbox,
            bytes,
            session: held,
            oldest_age: oldest,
            last_ack_seq: session.last_ack,
            last_ack_at: stamp(session.last_ack_ms),
        },
    );
    deliver(core, req.reply, body);
}

/// Whether `bytes` more would take this core past its share of the broker's command bytes.
fn core_full(core: &Core, bytes: usize) -> bool {
    queues::core_bytes() + bytes > queues::core_command_bytes(core.cfg.cores)
}

/// Answers a command the core's command bytes have no room for, and counts it.
fn memory_full(core: &Core, req: CommandReq) {
    let why = "this core holds as many command bytes as it may";
    refuse_command(core, req, C::CmdMemoryFull, "overloaded", why);
}

/// Answers a command refused before it took a seq with `error`, and counts it.
fn refuse_command(core: &Core, req: CommandReq, counter: C, error: &str, why: &str) {
    core.metrics.inc(counter);
    let body = reply::error(&req.id, Some(req.rig.as_str()), error, why);
    deliver(core, req.reply, body);
}

/// A command connection `conn` cannot take, since it no longer holds the rig: one delivered
/// from the offline hold goes back to the bridge, to reach the rig's connection now or be held
/// again (control was told it is held, and must hear one outcome); any other is answered
/// `rig_not_connected`.
pub(crate) fn not_taken(core: &Core, conn: ConnId, req: CommandReq, detail: &str) {
    if !matches!(req.reply, ReplyTo::Event) {
        return not_connected(core, req, detail);
    }
    let back = ToBridge::Undelivered {
        conn,
        req: Box::new(req),
    };
    if let Err(Full(ToBridge::Undelivered { req, .. })) = core.push_to_bridge(back) {
        not_connected(core, *req, detail);
    }
}

/// Answers a command whose connection no longer holds its rig, and counts it.
pub(crate) fn not_connected(core: &Core, req: CommandReq, detail: &str) {
    refuse_command(core, req, C::CmdNotConnected, "rig_not_connected", detail);
}

/// Answers a command the bridge's full inbox could not take, and counts it.
pub(crate) fn bridge_full(core: &Core, id: &str, rig: &RigId, to: ReplyTo) {
    core.metrics.inc(C::BridgeQueueFull);
    let body = reply::error(id, Some(rig.as_str()), "overloaded", "bridge queue full");
    deliver(core, to, body);
}

/// Whether this connection holds `rig` and takes commands for it now.
pub(crate) fn holds(st: &ConnState, rig: &RigId) -> bool {
    st.phase == Phase::Live && st.session.as_ref().is_some_and(|s| &s.rig == rig)
}

/// Whether the commands written and not yet acked fill what a resume may carry (a count, and
/// [`RIG_UNACKED_BYTES`]), so that one more of `len` bytes must wait for an ack. Past it the
/// rig's outbox fills, and control hears `rig_unresponsive` rather than a resume losing what
/// the socket buffers took. Those the rig said at its hello it had (at or below `had`, its
/// `last_seq`) are not on this connection's wire and do not count: an ack lost with an earlier
/// connection is never sent again by a rig that acks on receipt, and would hold its place for
/// the session's whole life. They count against the session's whole bound instead (`enqueue`).
fn window_full(core: &Core, q: &queues::Queues, had: Seq, len: usize) -> bool {
    let (had_n, had_bytes) = q
        .unacked()
        .iter()
        .take_while(|c| c.seq <= had)
        .fold((0, 0), |(n, b), c| (n + 1, b + c.json.len()));
    let n = q.unacked().len() - had_n;
    n >= core.cfg.unacked_limit()
        || (n > 0 && q.unacked_bytes() - had_bytes + len > RIG_UNACKED_BYTES)
}

/// Remembers a command the rig has (written, or received before it reconnected) until its ack,
/// within the bounds (a count, and [`RIG_UNACKED_BYTES`]): past them the oldest is dropped from
/// resume memory, counted, and removed from the session store too, or Redis would keep it for
/// the session's whole life.
pub(super) fn keep_unacked(core: &Core, s: &mut Session, cmd: SeqCommand) {
    let (rig, boot, had) = (&s.rig, s.boot, s.resume_from);
    let q = s.queues.get_or_insert_with(Default::default);
    while window_full(core, q, had, cmd.json.len()) {
        let Some(old) = q.pop_unacked() else {
            break;
        };
        core.metrics.inc(C::CmdResumeDropped);
        forget_kept(core, rig, boot, old.seq, &old.id, false, false);
    }
    q.push_unacked(cmd);
}

/// Makes room in a full session by dropping from resume memory the oldest unacked command the
/// rig said at its hello it had (at or below its `last_seq`), counted, and having the session
/// store forget it; false when there is none to drop. Only once the rig has acked a later
/// command on this connection: a rig that acks is one whose ack for that older command was
/// lost with its old connection, while one that acks nothing may yet, and its commands stay
/// (control hears `rig_unresponsive` for the new one instead).
fn drop_oldest_had(core: &Core, s: &mut Session) -> bool {
    let had = s.resume_from;
    if s.last_ack <= had {
        return false;
    }
    let Some(q) = s.queues.as_mut() else {
        return false;
    };
    if q.unacked().front().is_none_or(|c| c.seq > had) {
        return false;
    }
    let Some(old) = q.pop_unacked() else {
        return false;
    };
    core.metrics.inc(C::CmdResumeDropped);
    forget_kept(core, &s.rig, s.boot, old.seq, &old.id, false, false);
    true
}

/// Moves queued commands to the socket while it keeps up, and commands waiting from the
/// offline hold into the outbox as it makes room. Called after enqueue, after an ack and after
/// the task flushed a backlog.
pub(crate) fn pump(core: &Core, conn: &Conn, st: &mut ConnState) {
    // Nothing after our close frame (RFC 6455 §5.5.1): a command released by Redis, or a
    // backlog flushed, after a kick, a supersede or a drain's close stays queued, and is
    // carried to the rig's next connection with the rest.
    if st.phase != Phase::Live {
        return;
    }
    loop {
        write_out(core, conn, st);
        if !admit_waiting(core, conn, st) {
            break;
        }
    }
    if let Some(session) = st.session.as_mut() {
        hold_fetch::take_more(core, conn, session);
    }
}

/// Moves commands waiting from the offline hold into the outbox while it has room; whether
/// any went in.
fn admit_waiting(core: &Core, conn: &Conn, st: &mut ConnState) -> bool {
    let mut admitted = false;
    while let Some(req) = st
        .session
        .as_mut()
        .and_then(|s| s.queues.as_mut())
        .and_then(|q| q.next_waiting())
    {
        if let Err(req) = enqueue(core, conn, st, req) {
            if let Some(q) = st.session.as_mut().and_then(|s| s.queues.as_mut()) {
                q.wait(req, true);
            }
            break;
        }
        admitted = true;
    }
    admitted
}

/// Writes queued commands while the socket keeps up and the unacked window allows.
fn write_out(core: &Core, conn: &Conn, st: &mut ConnState) {
    while st.unsent() == 0 {
        let Some(session) = st.session.as_mut() else {
            return;
        };
        let Some(q) = session.queues.as_mut() else {
            return;
        };
        // A held command (fleet mode, not yet kept by Redis) blocks the ones behind it: order.
        let Some(front) = q.outbox().front().filter(|c| !c.held) else {
            return;
        };
        // The rig has as many commands unacked as a resume may carry: the next waits for its
        // acks, so that a resume can still give back every command written.
        if window_full(core, q, session.resume_from, front.json.len()) {
            return;
        }
        let Some(mut cmd) = q.pop_outbox() else {
            return;
        };
        cmd.written_at = Some(Instant::now());
        cmd.written_on = Some(conn.id);
        let json = cmd.json.clone();
        keep_unacked(core, session, cmd);
        hold_fetch::on_room(session);
        core.metrics.inc(C::CmdWritten);
        core.metrics.group_count(session.group, GroupCount::Written);
        conn.send_frame(st, OpCode::Text, &json);
    }
}

/// Why a connection that no longer holds its rig takes no command. Taken over by another
/// connection of the rig, the rig may well have a broadcast's command there: published as the
/// rig moved, it reaches the broker the rig moved to too, which may have matched it. A command
/// for this broker alone never reaches the other.
fn leaving(st: &ConnState, broadcast: bool) -> &'static str {
    match (st.close_code, broadcast) {
        (Some(4410), true) => {
            "the rig's connection is closing: another connection of the rig took it over (4410), where the rig may have this broadcast all the same"
        }
        (Some(4410), false) => {
            "the rig's connection is closing: another connection of the rig took it over (4410); send the command again to reach it there"
        }
        _ => "the rig's connection is closing",
    }
}

/// Whether the connection's token scope (if any) allows something.
pub(crate) fn scope_allows(
    sec: &Option<Box<Security>>,
    check: impl Fn(&crate::jwt::Scope) -> bool,
) -> bool {
    sec.as_ref()
        .and_then(|s| s.scope.as_ref())
        .is_none_or(check)
}

/// Sends a reply to wherever control waits for it.
pub(crate) fn deliver(core: &Core, to: ReplyTo, body: serde_json::Value) {
    deliver_routed(core, to, body, None);
}

/// Sends a reply; `route` is the connection that took the command, for an admin thread to
/// send the rig's next one to directly.
fn deliver_routed(core: &Core, to: ReplyTo, body: serde_json::Value, route: Option<ConnId>) {
    match to {
        // A gone waiter (timed out) is not an error here.
        ReplyTo::Admin(tx) => drop(tx.try_send(AdminAnswer { body, route })),
        ReplyTo::Core { core: at, slot } => {
            core.admin_reply(at, slot, AdminReply::Command(AdminAnswer { body, route }))
        }
        // Control's answer to a request that reached this core through its bounded inbox, so
        // that bound bounds these; dropped, control would never hear (CONTRACT.md §4: exactly
        // once), and a broadcast would be short one broker's part.
        ReplyTo::Channel(channel) => core.to_bridge_owed(ToBridge::Reply { channel, body }),
        ReplyTo::Aggregate(agg) => core.to_bridge_owed(ToBridge::Part { agg, body }),
        ReplyTo::Event => {
            core.held_event(crate::events::offline_delivered(&core.cfg.broker_id, body));
        }
    }
}
