//! The registry's answers about a session: the verdict on its hello (welcome, 4409 or 4503),
//! Redis keeping a held command, raising the session's seq, or asking for it to be kept again;
//! and what the registry is told when the connection ends. Separate because these arrive
//! through the core's inbox, not from the socket, and change the session's state as a whole.

use crate::ids::{BootId, ConnId, RigId, Seq};
use crate::metrics::C;
use crate::registry::msg::{ClosedSession, Recall, RekeepReq, SeqCommand, ToBridge, Verdict};
use crate::worker::core::{Conn, ConnState, Core, Phase, Upgraded};
use crate::worker::{closing, crossed};
use crate::ws::OpCode;
use crate::{events, protocol::encode_welcome};

use super::commands::{keep_unacked, not_taken, pump};
use super::rig_messages::retry_after;

/// The registry's answer to this connection's hello.
pub(crate) fn on_verdict(core: &Core, conn: &Conn, st: &mut ConnState, verdict: Verdict) {
    if st.phase != Phase::AwaitVerdict {
        // Closing before its welcome: the session goes back. (A welcomed session has had its
        // verdict; nothing else is owed one.)
        match st.session.as_ref() {
            Some(s) if !s.welcomed => return_verdict(
                core,
                conn.id,
                Some(Box::new((s.rig.clone(), s.boot))),
                verdict,
            ),
            Some(_) => {}
            // Closed, lingering for the peer's FIN: its end went to the bridge already
            // (`Abandoned`), which waits for this session back, as from a connection gone.
            None => return_verdict(core, conn.id, None, verdict),
        }
        return;
    }
    if st.session.is_none() && matches!(verdict, Verdict::Accept { .. }) {
        return return_verdict(core, conn.id, None, verdict);
    }
    let (next_seq, resumed, carried, recall) = match verdict {
        Verdict::Accept {
            next_seq,
            resumed,
            carried,
            recall,
        } => (next_seq, resumed, carried, recall),
        Verdict::Older => return conn.close(st, 4409, "a newer boot of this rig is connected"),
        Verdict::Busy => return conn.close(st, 4503, retry_after()),
    };
    let Some(session) = st.session.as_mut() else {
        return;
    };
    session.last_ack = acked_before(next_seq, &carried);
    // The time of the ack the session remembers, if the last ack is that one (an ack on a
    // connection this session's memory never saw, at another broker, has no time here).
    if let Some(recall) = recall {
        if recall.last_ack == session.last_ack {
            session.last_ack_ms = recall.last_ack_ms;
        }
        if !recall.results.is_empty() {
            let q = session.queues();
            for (seq, id) in recall.results {
                q.await_result(seq, id);
            }
        }
    }
    // Seqs are never reused: if Redis lost the session (restarted empty, or the key expired),
    // the rig's own last_seq is the floor, or its next command would be one it drops.
    session.next_seq = next_seq.max(Seq(session.resume_from.0.saturating_add(1)));
    session.welcomed = true;
    let welcome = encode_welcome(
        session.v,
        &core.cfg.broker_id,
        &session.rig,
        core.cfg.ping_interval.as_millis() as u64,
        resumed,
    );
    let already = session.resume_from;
    for cmd in carried {
        if cmd.seq > already {
            core.metrics.inc(C::CmdResumeSent);
            session.queues().push_outbox(cmd);
        } else {
            // The rig has it but has not acked it: its ack, which may still come, forgets it.
            keep_unacked(core, session, cmd);
        }
    }
    // A rig without the label counts under the empty value, so the series add up to every rig.
    let g = session.group(&core.cfg.group_label).unwrap_or("");
    session.group = core.metrics.join_group(g);
    let ev = events::connected(&core.cfg.broker_id, &session.rig, &session.boot, resumed);
    core.event_bytes(ev);
    st.phase = Phase::Live;
    st.live.last_ping = core.now_tick();
    let first_ping = st.live.last_ping + core.ticks(core.cfg.ping_interval);
    core.schedule(st, first_ping, conn.id);
    conn.send_frame(st, OpCode::Text, &welcome);
    pump(core, conn, st);
    // Input that arrived behind the hello is parsed now.
    conn.notify();
}

/// The last seq a resumed session's rig acked on its earlier connections, as far as the
/// session tells: the highest below `next_seq` not given back unacked (`carried`, in seq
/// order). Without it a rig that acked commands before it reconnected moved `last_ack_seq`
/// back to 0, and its repeated acks of them counted again as acks.
fn acked_before(next_seq: Seq, carried: &[SeqCommand]) -> Seq {
    let mut last = next_seq.0.saturating_sub(1);
    for cmd in carried.iter().rev() {
        if cmd.seq.0 < last {
            break;
        }
        if cmd.seq.0 == last {
            last = last.saturating_sub(1);
        }
    }
    Seq(last)
}

/// A verdict its connection cannot take (closing, or gone): an accepted session goes back to
/// the registry, which parks it, or a resume that raced a drop would lose its commands.
pub(crate) fn return_verdict(
    core: &Core,
    conn: ConnId,
    rig: Option<Box<(RigId, BootId)>>,
    verdict: Verdict,
) {
    if let Verdict::Accept {
        next_seq,
        carried,
        recall,
        ..
    } = verdict
    {
        core.to_bridge_owed(ToBridge::Returned {
            conn,
            rig,
            next_seq,
            carried,
            recall,
        });
    }
}

/// Redis kept (or refused) a held command of this connection.
pub(crate) fn on_persisted(
    core: &Core,
    conn: &Conn,
    st: &mut ConnState,
    seq: Seq,
    kept: bool,
    unkept: bool,
) {
    let Some(q) = st.session.as_mut().and_then(|s| s.queues.as_mut()) else {
        return;
    };
    // The held one: a command another broker gave under the same seq may be queued beside it
    // (`raise_seq`).
    let Some(pos) = q.outbox().iter().position(|c| c.seq == seq && c.held) else {
        return;
    };
    if kept {
        q.release(pos, unkept);
    } else {
        // Another broker owns the rig now; this connection is being superseded.
        q.remove_outbox(pos);
    }
    pump(core, conn, st);
}

/// Redis's copy of the session numbers past this one (another broker gave the rig commands
/// while each decided alone): the next command takes `next` or later (never lowered), and the
/// rig is given what that broker gave it, `missed`, in order before this core's own. Without
/// them a rig that left the other broker before reading them would see a gap in its seqs.
/// Those at or below a seq the rig has shown it holds (acked, written here, or named by its
/// hello) are left out; a rig drops a seq it already has anyway.
pub(crate) fn raise_seq(
    core: &Core,
    conn: &Conn,
    st: &mut ConnState,
    next: Seq,
    missed: Box<[SeqCommand]>,
) {
    let Some(s) = st.session.as_mut() else {
        return;
    };
    s.next_seq = s.next_seq.max(next);
    if missed.is_empty() {
        return;
    }
    let seen = s.last_ack.max(s.resume_from);
    let q = s.queues();
    let floor = q.unacked().back().map_or(seen, |c| seen.max(c.seq));
    for cmd in missed.into_vec().into_iter().filter(|c| c.seq > floor) {
        q.insert_outbox(cmd);
    }
    pump(core, conn, st);
}

/// Drops commands `seqs` from the session: putting it back found them gone from Redis for
/// good, published `lost` (another command the rig acked took each one's seq) or acked on
/// another broker meanwhile. No ack or event: each has had its one outcome, which a resume
/// giving it again, or a report at the session's end, would contradict.
pub(crate) fn forget_dropped(st: &mut ConnState, seqs: &[Seq]) {
    let Some(s) = st.session.as_mut() else {
        return;
    };
    let Some(q) = s.queues.as_mut() else {
        return;
    };
    for &seq in seqs {
        if q.take_unacked(seq).is_none() {
            if let Some(pos) = q.outbox().iter().position(|c| c.seq == seq && !c.held) {
                q.remove_outbox(pos);
            }
        }
    }
    s.shrink_queues();
}

/// Redis lost this connection's session (it restarted empty): hands the bridge what the
/// session holds, so a resume after this broker dies still finds its unacked commands. Held
/// commands are left out: their own persist is on its way.
pub(crate) fn on_rekeep(core: &Core, st: &ConnState) {
    let Some(s) = st.session.as_ref().filter(|s| s.welcomed) else {
        return;
    };
    let cmds = s
        .queues
        .iter()
        .flat_map(|q| q.unacked().iter().chain(q.outbox().iter()));
    send_rekeep(core, &s.rig, s.boot, s.next_seq, cmds);
}

/// Sends a session's state to be kept in Redis again: its commands but those held (their own
/// persist is on its way), by seq, and its next seq, but no higher than the first held one:
/// `persist.lua` refuses a seq below the session's `next` as another broker's (`stale`).
pub(crate) fn send_rekeep<'a>(
    core: &Core,
    rig: &RigId,
    boot: BootId,
    next: Seq,
    cmds: impl Iterator<Item = &'a SeqCommand>,
) {
    let mut next = next;
    let mut kept: Vec<(Seq, Box<[u8]>)> = Vec::new();
    let mut left_held = false;
    for c in cmds {
        if c.held {
            next = next.min(c.seq);
            left_held = true;
        } else {
            kept.push((c.seq, c.json.clone()));
        }
    }
    kept.sort_by_key(|c| c.0);
    core.to_bridge_owed(ToBridge::Rekeep(Box::new(RekeepReq {
        rig: rig.clone(),
        boot,
        next,
        cmds: kept,
        // The bridge knows which of them Redis never kept; a live session needs it only
        // once it parks.
        unkept: crate::registry::sessions::Unkept::NONE,
        left_held,
    })));
}

/// Called once when the connection task ends: tell the registry, fix metrics.
pub(crate) fn on_closed(core: &Core, conn: &Conn, st: &mut ConnState) {
    // A request refused or left unfinished is counted by `upgrades_total`, not as a close.
    if st.upgraded != Upgraded::Not {
        core.metrics.close(st.close_code.unwrap_or(1006));
    }
    let Some(session) = st.session.take() else {
        return;
    };
    let s = *session;
    if !s.welcomed {
        core.to_bridge_owed(ToBridge::Abandoned {
            conn: conn.id,
            rig: s.rig,
        });
        return;
    }
    let code = st.close_code.unwrap_or(1006);
    core.metrics.group_close(s.group, code);
    core.metrics.leave_group(s.group);
    let ev = events::disconnected(&core.cfg.broker_id, &s.rig, &s.boot, code, &st.close_reason);
    core.event(ev);
    // Commands from the offline hold that never got a seq go back to be held (or to the rig's
    // next connection), as one arriving after the close would.
    let mut queues = s.queues;
    for req in queues
        .as_mut()
        .map(|q| q.take_waiting())
        .unwrap_or_default()
    {
        not_taken(core, conn.id, req, "the rig's connection closed");
    }
    let results_owed = queues.as_ref().map_or(0, |q| q.results_owed);
    // A command still held for Redis goes along only once Redis has answered for it.
    let (carried, results) = queues.map(|q| q.into_parts()).unwrap_or_default();
    if st.phase == Phase::Closing && crossed::may_cross(st.close_code) {
        let owing = |seq, id: &str, acked| crossed::Owing {
            seq,
            id: id.into(),
            acked,
        };
        let acked = results.iter().map(|(seq, id)| owing(*seq, id, true));
        let written = carried
            .iter()
            .filter(|c| c.written_on == Some(conn.id))
            .map(|c| owing(c.seq, &c.id, false));
        let owed = crossed::Owed {
            ids: acked.chain(written).collect(),
            results: results_owed,
            next: s.next_seq,
        };
        crossed::keep(core, conn.id, &s.rig, s.boot, owed);
    }
    let recall = Recall {
        results,
        last_ack: s.last_ack,
        last_ack_ms: s.last_ack_ms,
    };
    let recall = (!recall.is_empty()).then(|| Box::new(recall));
    let session = ClosedSession {
        rig: s.rig,
        boot: s.boot,
        next_seq: s.next_seq,
        carried,
        recall,
    };
    closing::closed(core, conn.id, session);
}

#[cfg(test)]
mod tests {
    use super::*;

    fn carried(seqs: &[u64]) -> Vec<SeqCommand> {
        seqs.iter()
            .map(|&s| SeqCommand::for_test(s, 8, false))
            .collect()
    }

    #[test]
    fn a_resumed_sessions_last_ack_is_the_highest_seq_not_given_back() {
        assert_eq!(acked_before(Seq(1), &carried(&[])), Seq(0), "a new session");
        assert_eq!(acked_before(Seq(4), &carried(&[])), Seq(3), "all acked");
        assert_eq!(acked_before(Seq(7), &carried(&[5, 6])), Seq(4));
        assert_eq!(acked_before(Seq(7), &carried(&[2])), Seq(6), "acked past 2");
        assert_eq!(acked_before(Seq(7), &carried(&[2, 5, 6])), Seq(4));
        assert_eq!(
            acked_before(Seq(4), &carried(&[1, 2, 3])),
            Seq(0),
            "none acked"
        );
        assert_eq!(
            acked_before(Seq(2), &carried(&[0, 1])),
            Seq(0),
            "no underflow"
        );
    }
}
