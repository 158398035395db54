//! A welcomed connection's end, handed to the registry only once Redis has answered for every
//! command it still held.
//!
//! The registry passes a closed connection's unacked commands to the rig's next connection
//! here. A command still waiting for its persist must not go along as written-ready: if Redis
//! then fences it (another broker took the rig meanwhile), control is told it failed while the
//! next connection may already have written it. So the session waits here, with its socket
//! already gone, until each of those persists is answered (always, within the bridge's next
//! Redis pass; see `Bridge::persist_held`): a kept command goes along, a fenced one is dropped
//! as control was told.

use std::collections::HashMap;

use crate::ids::{ConnId, Seq};
use crate::registry::msg::{ClosedSession, ToBridge};
use crate::worker::core::Core;
use crate::worker::session;

/// Closed sessions of this core whose held commands wait for Redis's answers, by connection.
/// At most one per connection that closed with a persist in flight, each for one bridge pass.
pub(crate) type Waiting = HashMap<ConnId, ClosedSession>;

/// Tells the bridge `conn` closed, or waits for the answers to its held commands first.
pub(crate) fn closed(core: &Core, conn: ConnId, session: ClosedSession) {
    if session.carried.iter().any(|c| c.held) {
        core.closing.borrow_mut().insert(conn, session);
    } else {
        hand_over(core, conn, session);
    }
}

/// Redis's answer to a held command of a connection that has closed. False when no closed
/// session of this core waits for it.
pub(crate) fn persisted(core: &Core, conn: ConnId, seq: Seq, kept: bool, unkept: bool) -> bool {
    let mut closing = core.closing.borrow_mut();
    let Some(waiting) = closing.get_mut(&conn) else {
        return false;
    };
    if let Some(pos) = waiting.carried.iter().position(|c| c.seq == seq && c.held) {
        if kept {
            if let Some(cmd) = waiting.carried.get_mut(pos) {
                cmd.held = false;
                cmd.unkept = unkept;
            }
        } else {
            waiting.carried.remove(pos);
        }
    }
    if waiting.carried.iter().any(|c| c.held) {
        return true;
    }
    if let Some(done) = closing.remove(&conn) {
        drop(closing);
        hand_over(core, conn, done);
        core.check_drained();
    }
    true
}

/// [`session::raise_seq`] for a closed connection whose session waits here; false when none
/// of this core waits under `conn`.
pub(crate) fn raise_seq(core: &Core, conn: ConnId, next: Seq) -> bool {
    let mut closing = core.closing.borrow_mut();
    let Some(waiting) = closing.get_mut(&conn) else {
        return false;
    };
    waiting.next_seq = waiting.next_seq.max(next);
    true
}

/// Redis lost the session of a connection that has closed while its held commands wait: the
/// session goes back as this closed one holds it (the held commands are being kept on their
/// own). False when no closed session of this core waits under `conn`.
pub(crate) fn rekeep(core: &Core, conn: ConnId) -> bool {
    let closing = core.closing.borrow();
    let Some(waiting) = closing.get(&conn) else {
        return false;
    };
    let carried = waiting.carried.iter();
    session::send_rekeep(core, &waiting.rig, waiting.boot, waiting.next_seq, carried);
    true
}

fn hand_over(core: &Core, conn: ConnId, mut session: ClosedSession) {
    // Kept parked for the park window, or queued on the rig's next connection: no spare room
    // goes along.
    session.carried.shrink_to_fit();
    core.to_bridge_owed(ToBridge::Closed {
        conn,
        session: Box::new(session),
    });
}

#[cfg(test)]
mod tests {
    use std::rc::Rc;

    use super::*;
    use crate::doorbell::{self, Inbox};
    use crate::ids::{BootId, RigId};
    use crate::metrics::GroupSlot;
    use crate::registry::msg::{SeqCommand, ToCore};
    use crate::worker::core::tests::test_core;
    use crate::worker::core::{Conn, Session};
    use crate::worker::queues::Queues;
    use crate::worker::{inbox, session};

    fn cmd(seq: u64, held: bool) -> SeqCommand {
        SeqCommand::for_test(seq, 2, held)
    }

    /// A welcomed connection of rig-1 holding `outbox`, still in the core's table (a closing
    /// socket lingers there after its session has left it).
    fn live_conn(core: &Rc<Core>, outbox: Vec<SeqCommand>) -> Rc<Conn> {
        let id = core.next_conn_id();
        let conn = Rc::new(Conn::new(core, id, -1));
        core.conns.borrow_mut().insert(id, conn.clone());
        conn.st.borrow_mut().session = Some(Box::new(Session {
            rig: RigId::parse("rig-1").expect("rig"),
            boot: BootId::generate(1),
            v: 1,
            labels: Box::new([]),
            next_seq: Seq(4),
            last_ack: Seq(0),
            last_ack_ms: 0,
            connected_ms: 0,
            resume_from: Seq(0),
            welcomed: true,
            group: GroupSlot::NONE,
            hold: Default::default(),
            queues: Some(Box::new({
                let mut q = Queues::default();
                q.push_unacked(cmd(1, false));
                outbox.into_iter().for_each(|c| q.push_outbox(c));
                q
            })),
        }));
        conn
    }

    /// A core whose connection of rig-1, holding `outbox`, has just closed; and the bridge's
    /// end of the core's queue.
    fn closed_with(outbox: Vec<SeqCommand>) -> (Rc<Core>, Rc<Conn>, Inbox<ToBridge>) {
        let (tx, rx) = doorbell::channel::<ToBridge>(16).expect("channel");
        let core = test_core(tx);
        let conn = live_conn(&core, outbox);
        session::on_closed(&core, &conn, &mut conn.st.borrow_mut());
        (core, conn, rx)
    }

    /// The bridge's answer to the persist of `seq`.
    fn answer(core: &Rc<Core>, conn: &Conn, seq: u64, kept: bool) {
        let msg = ToCore::Persisted {
            conn: conn.id,
            seq: Seq(seq),
            kept,
            unkept: false,
        };
        inbox::handle(core, msg);
    }

    fn closed_carried(rx: &Inbox<ToBridge>) -> Option<Vec<(u64, bool)>> {
        std::iter::from_fn(|| rx.try_recv()).find_map(|m| match m {
            ToBridge::Closed { session, .. } => {
                Some(session.carried.iter().map(|c| (c.seq.0, c.held)).collect())
            }
            _ => None,
        })
    }

    #[test]
    fn a_closed_session_waits_for_its_held_commands_and_carries_only_the_kept() {
        let (core, conn, rx) = closed_with(vec![cmd(2, true), cmd(3, true)]);
        assert_eq!(closed_carried(&rx), None, "not before Redis answers");

        answer(&core, &conn, 2, true);
        assert_eq!(closed_carried(&rx), None, "seq 3 is still held");

        answer(&core, &conn, 3, false);
        assert_eq!(
            closed_carried(&rx),
            Some(vec![(1, false), (2, false)]),
            "the kept command goes along released, the fenced one not at all"
        );
        assert!(core.closing.borrow().is_empty());
    }

    #[test]
    fn a_closed_session_without_held_commands_is_handed_over_at_once() {
        let (core, conn, rx) = closed_with(vec![cmd(2, false)]);
        assert_eq!(closed_carried(&rx), Some(vec![(1, false), (2, false)]));
        assert!(core.closing.borrow().is_empty());
        assert!(
            !persisted(&core, conn.id, Seq(2), true, false),
            "nothing waits"
        );
    }

    /// Redis lost the session while the closed connection waits: what it holds goes back,
    /// since its socket is gone and its session left it, numbered up to its held command.
    #[test]
    fn a_waiting_closed_session_answers_a_rekeep() {
        let (core, conn, rx) = closed_with(vec![cmd(2, false), cmd(3, true)]);
        inbox::handle(&core, ToCore::Rekeep { conn: conn.id });
        let rekept = std::iter::from_fn(|| rx.try_recv()).find_map(|m| match m {
            ToBridge::Rekeep(r) => {
                Some((r.next, r.cmds.iter().map(|c| c.0 .0).collect::<Vec<_>>()))
            }
            _ => None,
        });
        // All but the held one, and `next` no higher than it: its own persist, still on its
        // way, must not find the session numbered past it (`persist.lua`'s `stale`).
        assert_eq!(rekept, Some((Seq(3), vec![1, 2])), "all but the held one");
    }

    /// A draining core finishes only once its closed sessions have gone to the registry.
    #[test]
    fn a_drain_waits_for_closed_sessions_still_waiting_on_redis() {
        let (core, conn, rx) = closed_with(vec![cmd(2, true)]);
        core.conns.borrow_mut().remove(&conn.id);
        core.draining.set(true);
        core.drain_may_end.set(true);
        core.check_drained();
        assert!(!core.finished.get(), "its Closed is still owed");
        answer(&core, &conn, 2, true);
        assert!(core.finished.get());
        assert_eq!(closed_carried(&rx), Some(vec![(1, false), (2, false)]));
    }

    /// A broadcast's command that reaches a connection another connection of the rig has just
    /// taken over (published as the rig moved between brokers) is refused saying so: the rig
    /// may have it where it went, which "closing" alone did not tell control.
    #[test]
    fn a_command_for_a_superseded_connection_says_the_rig_may_have_it_elsewhere() {
        let (tx, rx) = doorbell::channel::<ToBridge>(16).expect("channel");
        let core = test_core(tx);
        let conn = live_conn(&core, Vec::new());
        conn.st.borrow_mut().phase = crate::worker::core::Phase::Live;
        inbox::handle(&core, ToCore::Supersede { conn: conn.id });
        let req = crate::registry::msg::CommandReq {
            id: "c1".into(),
            rig: RigId::parse("rig-1").expect("rig"),
            name: "noop".into(),
            args: crate::args::Args::empty(),
            reply: crate::registry::msg::ReplyTo::Aggregate(7),
            offline_ttl: None,
        };
        let msg = ToCore::Command {
            conn: conn.id,
            req: Box::new(req),
            direct: false,
        };
        inbox::handle(&core, msg);
        let body = std::iter::from_fn(|| rx.try_recv())
            .find_map(|m| match m {
                ToBridge::Part { agg: 7, body } => Some(body),
                _ => None,
            })
            .expect("answered");
        assert_eq!(body["error"], "rig_not_connected", "{body}");
        let detail = body["detail"].as_str().unwrap_or_default();
        assert!(
            detail.contains("4410") && detail.contains("may have"),
            "{body}"
        );
    }
}
