//! What a rig sends once upgraded: control frames, its hello, and then acks, results and
//! events. Separate from the upgrade (HTTP, before any rig) and from control's commands (what
//! goes to the rig): this is the inbound half of a live session.

use std::borrow::Cow;
use std::time::Instant;

use crate::events;
use crate::http_upgrade;
use crate::ids::{BootId, ConnId, RigId, Seq};
use crate::metrics::{GroupCount, GroupSlot, C};
use crate::protocol::{self, ClientMsg, Hello, ProtocolError};
use crate::registry::msg::ToBridge;
use crate::worker::core::{unix_ms, Conn, ConnState, Core, Phase, Session};
use crate::worker::{crossed, sweep};
use crate::ws::{Message, OpCode};

use super::commands::{pump, scope_allows};
use super::upgrade::identity_ok;

/// What a PING or PONG from a rig takes from its `--rig-rate` bucket: free, a rig could keep
/// its core busy decoding PINGs and writing PONGs at line rate while taking no token; at a
/// whole token, a rig's own keepalive would eat into its messages under a low rate.
const CONTROL_FRAME_COST: f32 = 0.125;

/// What a rig's message takes from its bucket once handled.
enum Cost {
    /// A token.
    Message,
    /// Nothing: the first ack of a command written to the rig, and its result once acked.
    /// These answer the broker's own commands, so control's rate bounds them, not the rig's
    /// choice. Charged, they held a healthy rig's reading back behind a burst of commands:
    /// at a whole token each the rate capped commands at half of `--rig-rate` a second, and
    /// at an eighth (until review bb148) a burst of 2,000 to a rig acking each at once left
    /// its acks unread past the bucket's burst, until the unacked commands filled the session
    /// and the next were refused `rig_unresponsive`, "force_reconnect", "oldest queued cmd
    /// age 0s". An ack repeated or of a seq never written, a result for an unacked command or
    /// one repeated, and every event cost a token.
    Answer,
}

pub(super) fn on_message(core: &Core, conn: &Conn, st: &mut ConnState, msg: Message) {
    match msg {
        Message::Ping(payload) => {
            st.bucket.spend(CONTROL_FRAME_COST);
            if st.phase != Phase::Closing {
                // Queued, not written: the connection's loop writes what this read produced
                // in one go, so a flood of PINGs costs one write per read, not one each.
                crate::ws::encode_frame(st.out(), OpCode::Pong, &payload);
            }
        }
        Message::Pong(payload) => {
            st.bucket.spend(CONTROL_FRAME_COST);
            // Only answers to the last PING count: unsolicited PONGs (RFC 6455 allows them)
            // and answers to an earlier PING would hide a gap between PINGs sent and
            // answered, which is what the series is watched for.
            let answer = st.live.awaiting_pong && sweep::answers_last_ping(&st.live, &payload);
            if answer {
                core.metrics.inc(C::PongsReceived);
            }
            // Only the answer to our PING, in time, counts (CONTRACT.md §2): a late one is a
            // miss, which the sweep counts and which must not wipe out the misses before it.
            // A rig that started a fragmented message and never ends it would hold its buffer
            // for good while its pongs kept it alive: liveness includes finishing messages.
            if answer && !sweep::past_pong_deadline(core, &st.live) && st.decoder.is_idle() {
                st.live.awaiting_pong = false;
                st.live.missed = 0;
            }
        }
        Message::Close(frame) => {
            if st.phase == Phase::Closing {
                st.phase = Phase::Done;
                crossed::forget(core, conn.id);
                return;
            }
            // Echo the peer's code (RFC 6455 §5.5.1), then close the TCP connection first.
            let code = frame.as_ref().map(|f| f.code);
            match code {
                Some(code) => crate::ws::encode_close(st.out(), code, ""),
                None => crate::ws::encode_frame(st.out(), OpCode::Close, &[]),
            }
            st.close_code = Some(code.unwrap_or(1005));
            // The rig's own words for `disconnected` (at most 123 bytes, RFC 6455 §5.5).
            st.close_reason = frame.map_or(Cow::Borrowed(""), |f| Cow::Owned(f.reason));
            st.phase = Phase::Done;
            // The registry hears of it before the rig sees the echo: a rig that says hello
            // again the moment its close handshake ends (an older boot, say) must not find
            // this connection still live there (4409 for a session that has ended).
            // In fleet mode the echo also waits for the session's note (the ids of acked
            // commands awaiting results) to reach Redis: a rig resuming on another broker
            // once it has the echo, as after a drain's `goaway`, was read there before the
            // note, and its results came with `id` null (review bb152).
            let noting = core.persist
                && st.linger_until.is_none()
                && st
                    .session
                    .as_ref()
                    .is_some_and(|s| s.welcomed && s.awaits_results());
            crate::worker::conn::released(core, conn, st);
            if noting {
                crate::worker::conn::hold_echo(core, st);
            } else {
                let _ = crate::worker::core::flush(conn.fd, st);
            }
        }
        Message::Text(text) if st.phase == Phase::Echo => {
            conn.send_frame(st, OpCode::Text, text.as_bytes())
        }
        Message::Binary(data) if st.phase == Phase::Echo => {
            conn.send_frame(st, OpCode::Binary, &data)
        }
        // CONTRACT.md §2: a first message that is not a valid hello is 4400, binary or not;
        // counted by what it is, as a binary message after the hello is.
        Message::Binary(_) if st.phase == Phase::AwaitHello => {
            core.metrics.inc(C::MsgBinary);
            conn.close(st, 4400, "the first message must be a hello");
        }
        Message::Binary(_) => {
            core.metrics.inc(C::MsgBinary);
            if st.phase != Phase::Closing {
                conn.close(st, 1003, "messages are JSON text frames");
            } else {
                // Live, it would have been closed for this: nothing after it is published.
                crossed::forget(core, conn.id);
            }
        }
        Message::Text(text) => on_text(core, conn, st, text.as_bytes()),
    }
}

/// The 4400's close reason for a first message that is not a valid hello: which field of a
/// hello was wrong, when it was one. Nothing of the rig's own text goes into it.
fn not_a_hello(parsed: Result<ClientMsg, ProtocolError>) -> Cow<'static, str> {
    match parsed {
        Err(ProtocolError::Invalid { ty: "hello", why }) => format!("invalid hello: {why}").into(),
        // A hello may fail to parse for these two rules alone: saying it is no hello would
        // send the rig's developer looking at the wrong thing.
        Err(ProtocolError::Malformed(why)) if why.starts_with("duplicate field") => {
            "first message must be a hello with each key at most once".into()
        }
        Err(ProtocolError::Malformed(why)) if why.starts_with("nested deeper") => format!(
            "first message must be a hello nested at most {} levels deep",
            protocol::MAX_DEPTH
        )
        .into(),
        Err(ProtocolError::Malformed(_)) => {
            "first message must be a hello: a JSON object with \"type\":\"hello\"".into()
        }
        _ => "first message must be a hello".into(),
    }
}

fn on_text(core: &Core, conn: &Conn, st: &mut ConnState, text: &[u8]) {
    match st.phase {
        Phase::AwaitHello => match protocol::parse_client_msg(text) {
            Ok(ClientMsg::Hello(hello)) => on_hello(core, conn, st, hello),
            other => {
                core.metrics.inc(C::MsgInvalid);
                conn.close(st, 4400, not_a_hello(other));
            }
        },
        Phase::Live => match on_rig_message(core, conn, st, text) {
            // `consume` checked a token is there before decoding this message.
            Cost::Message => {
                let _ = st
                    .bucket
                    .take(core.cfg.rig_rate, core.cfg.rig_burst, core.now_ms());
            }
            Cost::Answer => {}
        },
        // Sent before the rig read our close: a result or event is still the rig's.
        Phase::Closing => {
            let answer = crossed::on_text(core, conn.id, st, text);
            if !answer {
                let _ = st
                    .bucket
                    .take(core.cfg.rig_rate, core.cfg.rig_burst, core.now_ms());
            }
        }
        _ => {}
    }
}

/// What a 4403 refused: the rig the hello named and what its connection proved. The proofs
/// are the client's own text (certificate names, a token's claim), quoted as Rust strings so
/// that no control character reaches the log raw.
fn identity_refused(st: &ConnState, rig: &RigId) -> String {
    let sec = st.sec.as_ref();
    // Debug formatting of each name, not of the Options around them: the log read
    // `Some(["rig-0002"])` and `None` (review bb129).
    let certificate = sec
        .and_then(|s| s.peer_ids.as_ref())
        .map_or("none".to_string(), |ids| format!("{ids:?}"));
    let token = sec
        .and_then(|s| s.token_rig.as_ref())
        .map_or("none".to_string(), |t| format!("{t:?}"));
    format!("hello as {rig}; certificate names {certificate}, token's rig {token}")
}

fn on_hello(core: &Core, conn: &Conn, st: &mut ConnState, hello: Hello) {
    core.metrics.inc(C::MsgHello);
    crate::thread_loss::Failpoint::CoreHello.check(hello.rig_id.as_str());
    if core.draining.get() {
        conn.close(st, 4503, crate::worker::drain::DRAINING);
        return;
    }
    if !identity_ok(st, hello.rig_id.as_str()) {
        core.metrics.inc(C::IdentityMismatch);
        // A client with a valid certificate or token claiming another rig: worth a line for
        // whoever must find it, within the log's pace, since any client can repeat it.
        let why = identity_refused(st, &hello.rig_id);
        if let Some(line) =
            core.identity_refusals
                .borrow_mut()
                .note(Instant::now(), Some(conn.fd), &why)
        {
            log::warn!("{line}");
        }
        conn.close(
            st,
            4403,
            "rig_id is not the identity this connection proved",
        );
        return;
    }
    let Hello {
        v,
        rig_id,
        boot_id,
        labels,
        last_seq,
        ..
    } = hello;
    let msg = ToBridge::Hello {
        conn: conn.id,
        rig: rig_id.clone(),
        boot: boot_id,
        labels: labels.clone(),
    };
    st.session = Some(Box::new(Session {
        rig: rig_id,
        boot: boot_id,
        v,
        labels: labels.into_boxed_slice(),
        next_seq: Seq(1),
        last_ack: Seq(0),
        last_ack_ms: 0,
        connected_ms: unix_ms(),
        resume_from: last_seq.unwrap_or(Seq(0)),
        welcomed: false,
        group: GroupSlot::NONE,
        hold: Default::default(),
        queues: None,
    }));
    if core.to_bridge(msg) {
        st.phase = Phase::AwaitVerdict;
    } else {
        st.session = None;
        conn.close(st, 4503, retry_after());
    }
}

/// The reason of a 4503 close (CONTRACT.md §2).
pub(crate) fn retry_after() -> String {
    format!("retry_after={}", http_upgrade::retry_after_s())
}

fn on_rig_message(core: &Core, conn: &Conn, st: &mut ConnState, text: &[u8]) -> Cost {
    let msg = protocol::parse_client_msg(text);
    if let Ok(ClientMsg::Event { name, .. }) = &msg {
        if !scope_allows(&st.sec, |s| s.allows_emit(name)) {
            core.metrics.inc(C::Forbidden);
            return Cost::Message;
        }
    }
    let Some(session) = st.session.as_mut() else {
        return Cost::Message;
    };
    let broker = core.cfg.broker_id.as_str();
    match msg {
        Ok(ClientMsg::Ack { seq, .. }) => {
            core.metrics.inc(C::MsgAck);
            if !ackable(session, seq) {
                // Not a command this rig could have: no event for control to puzzle over,
                // and none to crowd control's replies out of the publish queue.
                return Cost::Message;
            }
            let (counted, id, doubtful) = on_ack(core, session, seq, conn.id);
            if let (true, Some(q)) = (counted, session.queues.as_mut()) {
                q.results_owed = q.results_owed.saturating_add(1);
            }
            if let Some(lost) = doubtful {
                core.event_bytes(events::lost_to_a_shared_seq(
                    broker,
                    &session.rig,
                    &session.boot,
                    seq,
                    &lost,
                    events::SharedSeq::AckedLater,
                ));
            }
            super::hold_fetch::on_room(session);
            // An ack sent again (a rig that acks twice) is the first one's: one event.
            if counted {
                core.event_bytes(events::ack(
                    broker,
                    &session.rig,
                    &session.boot,
                    seq,
                    id.as_deref(),
                ));
            }
            // The ack may have opened the window for commands waiting behind it.
            pump(core, conn, st);
            return if counted { Cost::Answer } else { Cost::Message };
        }
        Ok(ClientMsg::Result {
            seq, ok, output, ..
        }) => {
            core.metrics.inc(C::MsgResult);
            let unacked = session
                .queues
                .as_ref()
                .is_some_and(|q| q.id_of(seq).is_some());
            let id = session.queues.as_mut().and_then(|q| q.result_id(seq));
            // A result for an acked command the rig still owes one for: its id may be past
            // the last few kept for results, and it is still an answer.
            let acked = seq.0 > 0 && seq < session.next_seq && !unacked;
            let awaited = match session.queues.as_mut() {
                Some(q) if acked && (id.is_some() || q.results_owed > 0) => {
                    q.results_owed = q.results_owed.saturating_sub(1);
                    true
                }
                _ => false,
            };
            session.shrink_queues();
            core.event_bytes(events::result(
                broker,
                &session.rig,
                &session.boot,
                seq,
                id.as_deref(),
                ok,
                output.as_ref(),
            ));
            if awaited {
                return Cost::Answer;
            }
        }
        Ok(ClientMsg::Event { name, data, .. }) => {
            core.metrics.inc(C::MsgEvent);
            core.event_bytes(events::event(
                broker,
                &session.rig,
                &session.boot,
                &name,
                data.as_ref(),
            ));
        }
        Ok(ClientMsg::Unknown { .. }) => {
            core.metrics.inc(C::MsgUnknown);
            if core.cfg.strict {
                conn.close(st, 4400, "unknown message type");
            }
        }
        // Counted and ignored as an unknown type is: a session has one hello.
        Ok(ClientMsg::Hello(_)) => {
            core.metrics.inc(C::MsgUnknown);
            if core.cfg.strict {
                conn.close(st, 4400, "a second hello");
            }
        }
        Err(_) => {
            core.metrics.inc(C::MsgInvalid);
            if core.cfg.strict {
                conn.close(st, 4400, "invalid message");
            }
        }
    }
    Cost::Message
}

/// Whether `seq` names a command written to this rig's session. The outbox holds the
/// unwritten commands, lowest seq first: an ack of one of them cannot be the rig's
/// (CONTRACT.md §2: it accepted the command), and is ignored like an ack of a seq never
/// assigned.
fn ackable(s: &Session, seq: Seq) -> bool {
    let unwritten = s
        .queues
        .as_ref()
        .and_then(|q| q.outbox().front())
        .is_some_and(|first| seq >= first.seq);
    seq.0 > 0 && seq < s.next_seq && !unwritten
}

/// Records an ack of command `seq`, and only of it (CONTRACT.md §2: "the rig accepted command
/// `seq`"): a command below it the rig has not acked stays unacked, given back by a resume and
/// reported `rig_rebooted` by a new boot. Returns whether it acked something not acked before
/// (a command still unacked here, or a seq past the last ack), the command id for the ack
/// event (fleet mode) when the broker still held the command, and the id of a command the ack
/// may not be for (below).
fn on_ack(
    core: &Core,
    s: &mut Session,
    seq: Seq,
    on: ConnId,
) -> (bool, Option<Box<str>>, Option<Box<str>>) {
    let cmd = s.queues.as_mut().and_then(|q| q.take_unacked(seq));
    let latest = seq > s.last_ack && seq < s.next_seq;
    if cmd.is_some() || latest {
        core.metrics.inc(C::CmdAcked);
        core.metrics.group_count(s.group, GroupCount::Acked);
    }
    if latest {
        s.last_ack = seq;
        s.last_ack_ms = unix_ms();
    }
    let Some(cmd) = cmd else {
        return (latest, None, None);
    };
    // Released unkept (Redis away) and not written on this connection, yet acked on it: while
    // Redis was away the rig may have been given this seq by another broker deciding alone,
    // for a command of its own, and be acking that one (review bb115: a held command numbered
    // at a hello the rig closed at once was published acked, though the rig never read it).
    // Which command the rig holds under the seq cannot be told, so this one is reported
    // `lost`, to be sent again, rather than acked and never run; its result, should one come,
    // is not joined to it.
    let doubtful = cmd.unkept && cmd.written_on != Some(on);
    forget_kept(
        core,
        &s.rig,
        s.boot,
        cmd.seq,
        &cmd.id,
        doubtful,
        cmd.read_back,
    );
    if doubtful {
        core.metrics.inc(C::CmdLostToSharedSeq);
        s.shrink_queues();
        return (true, None, Some(cmd.id));
    }
    if let Some(at) = cmd.written_at {
        core.metrics.ack_latency(at.elapsed(), s.group);
    }
    // Events name the command: the ack's and, hours later maybe, the result's (CONTRACT.md
    // §4; standalone keeps them for `GET /v1/events`).
    let id = Some(cmd.id.clone());
    if let Some(q) = s.queues.as_mut() {
        q.await_result(cmd.seq, cmd.id);
    }
    s.shrink_queues();
    (true, id, None)
}

/// Fleet mode: has the session store forget command `seq`, no longer kept for a resume;
/// `doubtful` when the ack that ends it may be another command's (see `on_ack`), `read_back`
/// when the command came from Redis rather than from this broker (`SeqCommand::read_back`).
pub(super) fn forget_kept(
    core: &Core,
    rig: &RigId,
    boot: BootId,
    seq: Seq,
    id: &str,
    doubtful: bool,
    read_back: bool,
) {
    if core.persist {
        core.to_bridge(ToBridge::Forget {
            rig: rig.clone(),
            boot,
            seq,
            id: id.into(),
            doubtful,
            read_back,
        });
    }
}
