//! A rig that comes back to more held commands than its outbox takes (fleet mode). Its hello
//! takes from Redis only what the outbox takes, and the connection takes more, as many as fit,
//! each time a write or an ack makes room; what it cannot number after all goes back to the
//! head of the hold rather than wait in this broker's memory. So a broker killed while the rig
//! works through the hold loses at most one take on its way to being kept, and the rig's next
//! hello, on any broker, finds the rest. Standalone keeps them waiting here: its hold is in
//! this process anyway.

use crate::doorbell::Full;
use crate::registry::msg::ToBridge;
use crate::worker::core::{Conn, ConnState, Core, Phase, Session};
use crate::worker::queues::RIG_OUTBOX_BYTES;

use super::commands::pump;

/// Where a connection stands with the rest of its rig's hold.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub(crate) enum HoldFetch {
    /// Nothing of the hold is known to be left in Redis.
    #[default]
    Idle,
    /// Commands are left in Redis: taken as the outbox has room.
    Left,
    /// A take is on its way: its commands, then its end.
    Asked,
    /// Commands went back to Redis because the outbox was full: the next take waits for a
    /// write or an ack to make room, or one command bigger than the room left would be taken
    /// and put back for ever.
    Stalled,
}

impl HoldFetch {
    /// Whether a command from the hold arriving now belongs behind some still in Redis.
    pub(crate) fn behind(self) -> bool {
        matches!(self, HoldFetch::Left | HoldFetch::Stalled)
    }
}

/// The end of a delivery from the hold (at the welcome, or of a take). What the outbox takes
/// now is numbered; the rest go back to Redis in one call, in the order they came, ahead of
/// anything held since, and are taken again as the outbox makes room. `more`: Redis has others
/// behind them.
pub(crate) fn on_delivery_end(core: &Core, conn: &Conn, st: &mut ConnState, more: bool) {
    // A closing connection holds its waiting commands again as it closes (`on_closed`).
    if !core.bridge_shared.fleet || st.phase != Phase::Live {
        return;
    }
    // Into the outbox, numbered, whatever it takes now: exactly what stays in memory.
    pump(core, conn, st);
    let Some(session) = st.session.as_mut() else {
        return;
    };
    let back = session
        .queues
        .as_mut()
        .map(|q| q.take_waiting())
        .unwrap_or_default();
    session.hold = if more {
        HoldFetch::Left
    } else {
        HoldFetch::Idle
    };
    if !back.is_empty() {
        let msg = ToBridge::HeldBack {
            rig: session.rig.clone(),
            reqs: back.into_boxed_slice(),
        };
        match core.push_to_bridge(msg) {
            Ok(()) => session.hold = HoldFetch::Stalled,
            // The bridge's inbox is full: they wait here after all, as standalone's do.
            Err(Full(ToBridge::HeldBack { reqs, .. })) => {
                for req in reqs.into_vec() {
                    session.queues().wait(req, false);
                }
            }
            Err(Full(_)) => {}
        }
        session.shrink_queues();
    }
    if session.hold != HoldFetch::Idle {
        core.hold_left.borrow_mut().insert(conn.id);
    }
    pump(core, conn, st);
}

/// A refresh found commands held in Redis for this connection's rig (fleet mode): taken as
/// the rest of a hold is, as the outbox has room. A connection taking from the hold already
/// takes them in its turn.
pub(crate) fn on_hold_found(core: &Core, conn: &Conn, st: &mut ConnState) {
    if st.phase != Phase::Live {
        return;
    }
    let Some(session) = st.session.as_mut() else {
        return;
    };
    if session.hold != HoldFetch::Idle {
        return;
    }
    session.hold = HoldFetch::Left;
    core.hold_left.borrow_mut().insert(conn.id);
    pump(core, conn, st);
}

/// Once a second, for each connection whose rig has held commands left in Redis: a take that
/// waits for room goes now if there is room. The writes and acks that make room ask on their
/// own; this catches what no event will, at the cost of one look a second at these few
/// connections.
pub(crate) fn sweep(core: &Core) {
    let ids: Vec<_> = core.hold_left.borrow_mut().drain().collect();
    for id in ids {
        let Some(conn) = core.conns.borrow().get(&id).cloned() else {
            continue;
        };
        let mut st = conn.st.borrow_mut();
        if st.phase != Phase::Live {
            continue;
        }
        let Some(session) = st.session.as_mut() else {
            continue;
        };
        on_room(session);
        if session.hold == HoldFetch::Left {
            pump(core, &conn, &mut st);
        }
        if st
            .session
            .as_ref()
            .is_some_and(|s| s.hold != HoldFetch::Idle)
        {
            core.hold_left.borrow_mut().insert(id);
        }
    }
}

/// A command left the outbox for the socket, or the rig acked one: a take that waited for
/// room may go.
pub(crate) fn on_room(session: &mut Session) {
    if session.hold == HoldFetch::Stalled {
        session.hold = HoldFetch::Left;
    }
}

/// Asks the bridge for as many of the commands left in Redis as the outbox takes now, once
/// nothing waits here.
pub(crate) fn take_more(core: &Core, conn: &Conn, session: &mut Session) {
    if session.hold != HoldFetch::Left {
        return;
    }
    let (count, bytes) = room(core, session);
    let waiting = session.queues.as_ref().is_some_and(|q| q.waiting_len() > 0);
    if count == 0 || bytes == 0 || waiting {
        return;
    }
    let msg = ToBridge::TakeHeld {
        conn: conn.id,
        rig: session.rig.clone(),
        max: u32::try_from(count).unwrap_or(u32::MAX),
        max_bytes: u32::try_from(bytes).unwrap_or(u32::MAX),
    };
    if core.push_to_bridge(msg).is_ok() {
        session.hold = HoldFetch::Asked;
    }
}

/// How many more commands from the hold, and bytes of them, the outbox takes now: what
/// `enqueue` lets in (its count, the session's bound, less any command the rig had at its
/// resume that a new one may push out, the commands waiting for Redis, and its bytes).
fn room(core: &Core, session: &Session) -> (usize, usize) {
    let Some(q) = session.queues.as_ref() else {
        return (core.cfg.outbox - core.cfg.hold_reserve(), RIG_OUTBOX_BYTES);
    };
    let had = match session.last_ack > session.resume_from {
        true => q
            .unacked()
            .iter()
            .take_while(|c| c.seq <= session.resume_from)
            .count(),
        false => 0,
    };
    let reserve = core.cfg.hold_reserve();
    let count = (core.cfg.outbox - reserve)
        .saturating_sub(q.outbox().len())
        .min((core.cfg.session_limit() - reserve + had).saturating_sub(session.commands_len()))
        .min(core.cfg.unacked_limit().saturating_sub(session.held_len()));
    (count, RIG_OUTBOX_BYTES.saturating_sub(q.outbox_bytes()))
}
