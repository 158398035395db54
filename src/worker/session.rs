//! What a connection does with what it receives: the upgrade, rig messages, the registry's
//! verdicts and control's commands. No awaits and no socket calls other than through
//! [`Conn`]'s ordered writer, so every rule here runs to completion on the core thread.

use std::borrow::Cow;
use std::time::{Instant, SystemTime};

use crate::doorbell::Full;
use crate::http_upgrade::{self, Reject};
use crate::ids::{BootId, ConnId, RigId, Seq};
use crate::metrics::C;
use crate::protocol::{self, ClientMsg, Hello};
use crate::registry::msg::{
    AdminAnswer, AdminReply, CommandReq, PersistReq, Recall, RekeepReq, ReplyTo, SeqCommand,
    ToBridge, Verdict,
};
use crate::registry::offline::MAX_PER_RIG;
use crate::reply::{self, Unresponsive};
use crate::worker::core::{stamp, unix_ms, Conn, ConnState, Core, Phase, Session};
use crate::worker::queues::{self, RIG_OUTBOX_BYTES, RIG_UNACKED_BYTES};
use crate::worker::transport::Security;
use crate::worker::{closing, sweep};
use crate::ws::{Decoder, Limits, Message, OpCode};
use crate::{events, protocol::encode_welcome};

/// Longest request head accepted (CONTRACT.md §2: larger is 431).
pub(crate) const MAX_HEAD: usize = 8 * 1024;

/// Limits of the test-only /echo endpoint (CONTRACT.md §1 `--echo-endpoint`).
/// Autobahn 9.3.1 sends a 4 MiB message as 1 + 65,536 frames of 64 bytes, so the contract's
/// "65,536 fragments" is read as continuation fragments after the first frame.
const ECHO_LIMITS: Limits = Limits {
    max_message: 16 << 20,
    max_fragments: 65_536 + 1,
};

/// Parses as much of `input` as the connection may consume now; returns the bytes used.
pub(crate) fn consume(core: &Core, conn: &Conn, st: &mut ConnState, input: &[u8]) -> usize {
    let mut pos = 0;
    st.rbuf_ready = false;
    while pos < input.len() {
        if !st.can_consume(core.now_ms()) {
            st.rbuf_ready = true;
            break;
        }
        let rest = input.get(pos..).unwrap_or_default();
        if st.phase == Phase::Handshake {
            if st.refusing() {
                // Refused at accept; TLS is up now, so the client can read why.
                conn.send_raw(
                    st,
                    &http_upgrade::service_unavailable(http_upgrade::retry_after_s()),
                );
                st.phase = Phase::Done;
                pos = input.len();
                break;
            }
            match http_upgrade::parse_request(rest, MAX_HEAD, |p| known_path(core, p)) {
                Ok(None) => break,
                Ok(Some((len, req))) => {
                    pos += len;
                    if !authorize(core, st, req.authorization.as_deref()) {
                        core.metrics.inc(C::Reject401);
                        conn.send_raw(st, &http_upgrade::unauthorized());
                        st.phase = Phase::Done;
                        break;
                    }
                    upgrade(core, conn, st, &req.path, &req.key);
                }
                Err(reject) => {
                    refuse(core, conn, st, &reject);
                    break;
                }
            }
            continue;
        }
        if st.phase == Phase::Live {
            let now = core.now_ms();
            if let Err(wait_ms) = st.bucket.ready(core.cfg.rig_rate, core.cfg.rig_burst, now) {
                // Over its rate: stop reading this rig until a token is back. TCP pushes back
                // on this rig alone; nothing is dropped (CONTRACT.md §2 fairness).
                core.metrics.inc(C::RigRatePaused);
                st.paused_until = Some(now.wrapping_add(wait_ms));
                st.live.throttled = true;
                st.rbuf_ready = true;
                break;
            }
        }
        match st.decoder.decode(rest) {
            Ok(None) => break,
            Ok(Some((used, msg))) => {
                pos += used;
                if let Some(msg) = msg {
                    on_message(core, conn, st, msg);
                }
            }
            Err(e) => {
                // Fail the connection (RFC 6455 §7.1.7): our close frame, then drop TCP; no
                // waiting for a close handshake with a peer that broke the protocol.
                if st.phase != Phase::Closing {
                    conn.close(st, e.close_code(), e.to_string());
                }
                st.phase = Phase::Done;
                break;
            }
        }
    }
    pos
}

fn known_path(core: &Core, path: &str) -> bool {
    path == "/agent" || (core.cfg.echo_endpoint && path == "/echo")
}

fn refuse(core: &Core, conn: &Conn, st: &mut ConnState, reject: &Reject) {
    core.metrics.inc(match reject {
        Reject::BadRequest => C::Reject400,
        Reject::NotFound => C::Reject404,
        Reject::MethodNotAllowed => C::Reject405,
        Reject::UpgradeRequired => C::Reject426,
        Reject::HeaderTooLarge => C::Reject431,
    });
    conn.send_raw(st, &reject.response());
    st.phase = Phase::Done;
}

/// Checks the upgrade's bearer token when tokens are configured; keeps its scope and rig claim.
fn authorize(core: &Core, st: &mut ConnState, authorization: Option<&str>) -> bool {
    let Some(verifier) = core.jwt.as_ref() else {
        return true;
    };
    let Some(token) = authorization.and_then(crate::jwt::bearer) else {
        return false;
    };
    match verifier.verify(token, SystemTime::now()) {
        Ok(claims) => {
            if let Some(sec) = st.sec.as_mut() {
                sec.scope = Some(claims.scope);
                sec.token_rig = claims.rig_id;
            }
            true
        }
        Err(e) => {
            log::debug!("refused token: {e}");
            false
        }
    }
}

/// The rig's proven identities: mTLS certificate names and the token's rig claim must all
/// allow `rig` (CONTRACT.md §2, 4403).
fn identity_ok(st: &ConnState, rig: &str) -> bool {
    let Some(sec) = st.sec.as_ref() else {
        return true;
    };
    // A client certificate that names nothing (no CN or DNS SAN this broker reads) grants
    // no rig at all.
    let cert_ok = sec
        .peer_ids
        .as_ref()
        .is_none_or(|ids| crate::tls::identity_matches(ids, rig));
    cert_ok && sec.token_rig.as_deref().is_none_or(|r| r == rig)
}

fn upgrade(core: &Core, conn: &Conn, st: &mut ConnState, path: &str, key: &str) {
    core.metrics.inc(C::Upgraded);
    st.upgraded = true;
    conn.send_raw(st, &http_upgrade::switching_protocols(key));
    if path == "/echo" {
        st.decoder = Decoder::new(ECHO_LIMITS);
        st.phase = Phase::Echo;
    } else {
        // The hello deadline runs from the upgrade (CONTRACT.md §1 `--hello-timeout`).
        st.phase = Phase::AwaitHello;
        st.deadline = core.deadline_in(core.cfg.hello_timeout);
        let deadline = st.deadline;
        core.schedule(st, deadline, conn.id);
    }
}

/// What a PING or PONG from a rig takes from its `--rig-rate` bucket: free, a rig could keep
/// its core busy decoding PINGs and writing PONGs at line rate while taking no token; at a
/// whole token, a rig's own keepalive would eat into its messages under a low rate.
const CONTROL_FRAME_COST: f32 = 0.125;

fn on_message(core: &Core, conn: &Conn, st: &mut ConnState, msg: Message) {
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
            crate::worker::conn::released(core, conn, st);
            let _ = crate::worker::core::flush(conn.fd, st);
        }
        Message::Text(text) if st.phase == Phase::Echo => {
            conn.send_frame(st, OpCode::Text, text.as_bytes())
        }
        Message::Binary(data) if st.phase == Phase::Echo => {
            conn.send_frame(st, OpCode::Binary, &data)
        }
        // CONTRACT.md §2: a first message that is not a valid hello is 4400, binary or not.
        Message::Binary(_) if st.phase == Phase::AwaitHello => {
            core.metrics.inc(C::MsgInvalid);
            conn.close(st, 4400, "the first message must be a hello");
        }
        Message::Binary(_) => {
            core.metrics.inc(C::MsgBinary);
            if st.phase != Phase::Closing {
                conn.close(st, 1003, "messages are JSON text frames");
            }
        }
        Message::Text(text) => on_text(core, conn, st, text.as_bytes()),
    }
}

fn on_text(core: &Core, conn: &Conn, st: &mut ConnState, text: &[u8]) {
    match st.phase {
        Phase::AwaitHello => match protocol::parse_client_msg(text) {
            Ok(ClientMsg::Hello(hello)) => on_hello(core, conn, st, hello),
            _ => {
                core.metrics.inc(C::MsgInvalid);
                conn.close(st, 4400, "first message must be a valid hello");
            }
        },
        Phase::Live => {
            // `consume` checked a token is there before decoding this message.
            let _ = st
                .bucket
                .take(core.cfg.rig_rate, core.cfg.rig_burst, core.now_ms());
            on_rig_message(core, conn, st, text);
        }
        // Closing: the RFC says data after our close frame is ignored.
        _ => {}
    }
}

fn on_hello(core: &Core, conn: &Conn, st: &mut ConnState, hello: Hello) {
    core.metrics.inc(C::MsgHello);
    crate::thread_loss::Failpoint::CoreHello.check(hello.rig_id.as_str());
    if core.draining.get() {
        conn.close(st, 4503, "retry_after=5");
        return;
    }
    if !identity_ok(st, hello.rig_id.as_str()) {
        core.metrics.inc(C::IdentityMismatch);
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
        group_overflow: false,
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

fn on_rig_message(core: &Core, conn: &Conn, st: &mut ConnState, text: &[u8]) {
    let msg = protocol::parse_client_msg(text);
    if let Ok(ClientMsg::Event { name, .. }) = &msg {
        if !scope_allows(&st.sec, |s| s.allows_emit(name)) {
            core.metrics.inc(C::Forbidden);
            return;
        }
    }
    let Some(session) = st.session.as_mut() else {
        return;
    };
    let broker = core.cfg.broker_id.as_str();
    match msg {
        Ok(ClientMsg::Ack { seq, .. }) => {
            core.metrics.inc(C::MsgAck);
            if !ackable(session, seq) {
                // Not a command this rig could have: no event for control to puzzle over,
                // and none to crowd control's replies out of the publish queue.
                return;
            }
            let (counted, id) = on_ack(core, session, seq);
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
        }
        Ok(ClientMsg::Result {
            seq, ok, output, ..
        }) => {
            core.metrics.inc(C::MsgResult);
            let id = session.queues.as_mut().and_then(|q| q.result_id(seq));
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
/// (a command still unacked here, or a seq past the last ack), and the command id for the ack
/// event (fleet mode) when the broker still held the command.
fn on_ack(core: &Core, s: &mut Session, seq: Seq) -> (bool, Option<Box<str>>) {
    if seq > s.resume_from {
        forget_had_before(core, s);
    }
    let cmd = s.queues.as_mut().and_then(|q| q.take_unacked(seq));
    let latest = seq > s.last_ack && seq < s.next_seq;
    if cmd.is_some() || latest {
        core.metrics.inc(C::CmdAcked);
    }
    if latest {
        s.last_ack = seq;
        s.last_ack_ms = unix_ms();
    }
    let Some(cmd) = cmd else {
        return (latest, None);
    };
    forget_kept(core, &s.rig, s.boot, cmd.seq);
    if let Some(at) = cmd.written_at {
        core.metrics.ack_latency(at.elapsed());
    }
    // Events name the command: the ack's and, hours later maybe, the result's (CONTRACT.md
    // §4; standalone keeps them for `GET /v1/events`).
    let id = Some(cmd.id.clone());
    if let Some(q) = s.queues.as_mut() {
        q.await_result(cmd.seq, cmd.id);
    }
    s.shrink_queues();
    (true, id)
}

/// Forgets the unacked commands this connection's rig said it had at its hello (at or below
/// its `last_seq`), once it acks a later one. They were received on an earlier connection, and
/// their acks, if sent, were lost with it: a rig that acks on receipt never sends them again,
/// so kept for their own acks they would stay in the session for its whole life, each holding
/// a place in the rig's window.
fn forget_had_before(core: &Core, s: &mut Session) {
    let (rig, boot, had) = (&s.rig, s.boot, s.resume_from);
    let Some(q) = s.queues.as_mut() else {
        return;
    };
    while q.unacked().front().is_some_and(|c| c.seq <= had) {
        let Some(cmd) = q.pop_unacked() else {
            break;
        };
        forget_kept(core, rig, boot, cmd.seq);
    }
}

/// Fleet mode: has the session store forget command `seq`, no longer kept for a resume.
fn forget_kept(core: &Core, rig: &RigId, boot: BootId, seq: Seq) {
    if core.persist {
        core.to_bridge(ToBridge::Forget {
            rig: rig.clone(),
            boot,
            seq,
        });
    }
}

/// Whether the commands written and not yet acked fill what a resume may carry (a count, and
/// [`RIG_UNACKED_BYTES`]), so that one more of `len` bytes must wait for an ack. Past it the
/// rig's outbox fills, and control hears `rig_unresponsive` rather than a resume losing what
/// the socket buffers took.
fn window_full(core: &Core, q: &queues::Queues, len: usize) -> bool {
    q.unacked().len() >= core.cfg.unacked_limit()
        || (!q.unacked().is_empty() && q.unacked_bytes() + len > RIG_UNACKED_BYTES)
}

/// Remembers a command the rig has (written, or received before it reconnected) until its ack,
/// within the bounds (a count, and [`RIG_UNACKED_BYTES`]): past them the oldest is dropped from
/// resume memory, counted, and removed from the session store too, or Redis would keep it for
/// the session's whole life.
fn keep_unacked(core: &Core, s: &mut Session, cmd: SeqCommand) {
    let (rig, boot) = (&s.rig, s.boot);
    let q = s.queues.get_or_insert_with(Default::default);
    while window_full(core, q, cmd.json.len()) {
        let Some(old) = q.pop_unacked() else {
            break;
        };
        core.metrics.inc(C::CmdResumeDropped);
        forget_kept(core, rig, boot, old.seq);
    }
    q.push_unacked(cmd);
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
            return;
        }
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
        if window_full(core, q, front.json.len()) {
            return;
        }
        let Some(mut cmd) = q.pop_outbox() else {
            return;
        };
        cmd.written_at = Some(Instant::now());
        let json = cmd.json.clone();
        keep_unacked(core, session, cmd);
        core.metrics.inc(C::CmdWritten);
        conn.send_frame(st, OpCode::Text, &json);
    }
}

/// The registry's answer to this connection's hello.
pub(crate) fn on_verdict(core: &Core, conn: &Conn, st: &mut ConnState, verdict: Verdict) {
    if st.phase != Phase::AwaitVerdict {
        // Closing before its welcome: the session goes back. (A welcomed session has had its
        // verdict; nothing else is owed one.)
        match st.session.as_ref() {
            Some(s) if !s.welcomed => return_verdict(core, conn.id, Some(s.rig.clone()), verdict),
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
    session.group_overflow = core.metrics.join_group(g);
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
pub(crate) fn return_verdict(core: &Core, conn: ConnId, rig: Option<RigId>, verdict: Verdict) {
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

/// Control's command for this connection's rig.
pub(crate) fn on_command(core: &Core, conn: &Conn, st: &mut ConnState, req: CommandReq) {
    // One from the offline hold goes behind those of it already waiting: hold order.
    let req = match waiting(st) > 0 && from_hold(&req) {
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
        return outbox_full(core, session, req, None);
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
        not_taken(core, conn.id, req, "the rig's connection is closing");
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
    let held = from_hold(&req);
    if session.held_len() >= core.cfg.unacked_limit() {
        if held {
            return Err(req);
        }
        // Redis is slower than control right now: a broker-side condition, not the rig's.
        let why = "too many commands waiting for the session store";
        refuse_command(core, req, C::BridgeQueueFull, "overloaded", why);
        return Ok(());
    }
    // Those still waiting for Redis count too for the hold's: it delivers a thousand at once.
    let queued = match held {
        true => session.queues.as_ref().map_or(0, |q| q.outbox().len()),
        false => session.outbox_len(),
    };
    if queued >= core.cfg.outbox {
        if held {
            return Err(req);
        }
        outbox_full(core, session, req, None);
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
        outbox_full(core, session, req, Some(queued));
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
    });
    core.metrics.inc(C::CmdEnqueued);
    Ok(())
}

/// Answers a command refused for a full outbox (by count, or by `bytes` queued) with
/// `rig_unresponsive`, and counts it.
fn outbox_full(core: &Core, session: &mut Session, req: CommandReq, bytes: Option<usize>) {
    core.metrics.inc(C::CmdOutboxFull);
    let oldest = session
        .queues()
        .outbox()
        .front()
        .map(|c| c.queued_at.elapsed())
        .unwrap_or_default();
    let body = reply::unresponsive(
        &req.id,
        &session.rig,
        Unresponsive {
            // Bytes count every queued command, those still waiting for Redis too.
            queued: match bytes {
                Some(_) => session.queues.as_ref().map_or(0, |q| q.outbox().len()),
                None => session.outbox_len(),
            },
            capacity: core.cfg.outbox,
            bytes: bytes.map(|b| (b, RIG_OUTBOX_BYTES)),
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

/// Redis kept (or refused) a held command of this connection.
pub(crate) fn on_persisted(core: &Core, conn: &Conn, st: &mut ConnState, seq: Seq, kept: bool) {
    let Some(q) = st.session.as_mut().and_then(|s| s.queues.as_mut()) else {
        return;
    };
    // The held one: a command another broker gave under the same seq may be queued beside it
    // (`raise_seq`).
    let Some(pos) = q.outbox().iter().position(|c| c.seq == seq && c.held) else {
        return;
    };
    if kept {
        q.release(pos);
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
    for c in cmds {
        if c.held {
            next = next.min(c.seq);
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
        unkept_to: Seq(0),
    })));
}

/// Whether the connection's token scope (if any) allows something.
fn scope_allows(sec: &Option<Box<Security>>, check: impl Fn(&crate::jwt::Scope) -> bool) -> bool {
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
            core.event(crate::events::offline_delivered(&core.cfg.broker_id, body));
        }
    }
}

/// Called once when the connection task ends: tell the registry, fix metrics.
pub(crate) fn on_closed(core: &Core, conn: &Conn, st: &mut ConnState) {
    // A request refused or left unfinished is counted by `upgrades_total`, not as a close.
    if st.upgraded {
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
    core.metrics.leave_group(
        s.group(&core.cfg.group_label).unwrap_or(""),
        s.group_overflow,
    );
    let code = st.close_code.unwrap_or(1006);
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
    // A command still held for Redis goes along only once Redis has answered for it.
    let (carried, results) = queues.map(|q| q.into_parts()).unwrap_or_default();
    let recall = Recall {
        results,
        last_ack: s.last_ack,
        last_ack_ms: s.last_ack_ms,
    };
    let recall = (!recall.is_empty()).then(|| Box::new(recall));
    closing::closed(core, conn.id, s.rig, s.boot, s.next_seq, carried, recall);
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
