//! Results and events a rig sent before it read the broker's own close.
//!
//! The broker's close (a drain's 1001, a kick's 1012, a takeover's 4410, a missed pong's 4002)
//! can cross a rig's `result` on the wire: the rig sent it before the close frame reached it,
//! and the broker reads it after the session has gone to the registry. RFC 6455 forbids only
//! *sending* data after a close; what the peer sent before it read ours is still its message.
//! Dropped, a command's outcome was lost for any rig that does not send its results again on
//! its next connection (review bb155: 61 of 150 results sent 4 ms after a drain's window). So
//! a connection the broker closes keeps what publishing them takes (the rig, its boot, and the
//! ids of the commands it may answer) here on its core, only while it waits for the rig's echo
//! (the close linger at most).
//!
//! Kept on the core, not in the connection: every idle connection would pay for the slot.
//! What is read after the close is held to the rig's `--rig-rate` as before it
//! (`session::consume`): a rig flooding its closing window would otherwise have it all
//! published (review bb156).
//! An ack is not taken: its command went to the registry unacked and is given to the rig's
//! next connection, where the rig acks it again.

use std::collections::HashMap;

use crate::events;
use crate::ids::{BootId, ConnId, RigId, Seq};
use crate::metrics::C;
use crate::protocol::{self, ClientMsg};
use crate::worker::core::{ConnState, Core};
use crate::worker::session;

/// What a closing connection's late messages are published under.
#[derive(Debug)]
pub(crate) struct Left {
    rig: RigId,
    boot: BootId,
    owed: Owed,
}

/// A command the rig may answer after the close, and control's id for it.
#[derive(Debug)]
pub(crate) struct Owing {
    pub(crate) seq: Seq,
    pub(crate) id: Box<str>,
    /// Acked (before the close, or by an ack that crossed it): its result is an answer.
    /// Otherwise written on this connection and not yet acked.
    pub(crate) acked: bool,
}

/// What the rig owed when its connection closed: what a result must be to answer a command
/// (`on_text`), as live.
#[derive(Debug)]
pub(crate) struct Owed {
    /// Commands acked and awaiting results whose ids are kept, and those written on this
    /// connection and not yet acked.
    pub(crate) ids: Vec<Owing>,
    /// Acked commands whose results are owed, ids kept or not.
    pub(crate) results: u32,
    /// The session's next seq.
    pub(crate) next: Seq,
}

/// The connections of a core that closed on the broker's word and still read, by id.
pub(crate) type Closing = HashMap<ConnId, Left>;

/// Closes for which the rig did nothing wrong: what it sent before it read one is its own.
/// A close for a protocol fault (4400, 1003, 1009, …) ends what is read with it.
pub(crate) fn may_cross(code: Option<u16>) -> bool {
    matches!(code, Some(1001 | 1012 | 4410 | 4002))
}

/// Keeps what `conn`'s late results and events need until it is [`forget`]ten.
pub(crate) fn keep(core: &Core, conn: ConnId, rig: &RigId, boot: BootId, owed: Owed) {
    let left = Left {
        rig: rig.clone(),
        boot,
        owed,
    };
    core.crossed.borrow_mut().insert(conn, left);
}

/// Nothing more the rig sends on `conn` is published: its echo came, it sent what a live
/// connection would have been closed for, or the connection is gone.
pub(crate) fn forget(core: &Core, conn: ConnId) {
    core.crossed.borrow_mut().remove(&conn);
}

/// A text message read on `conn` after the broker's close: a `result` or an `event` is
/// published as it would have been before the close. Anything else is dropped, as is all of it
/// on a connection that kept nothing (a close for a fault, or a session never welcomed).
/// True when it answered one of the broker's commands (the first ack of a written command, or
/// the result of an acked one): free of the rig's rate, as live. At a token each, a rig
/// acking and reporting a burst as it was kicked had the last ones, those with ids, cut off at
/// the linger (reviews bb157, bb158).
pub(crate) fn on_text(core: &Core, conn: ConnId, st: &ConnState, text: &[u8]) -> bool {
    let broker = core.cfg.broker_id.as_str();
    let mut answer = false;
    let bytes = {
        let mut closing = core.crossed.borrow_mut();
        let Some(left) = closing.get_mut(&conn) else {
            return false;
        };
        match protocol::parse_client_msg(text) {
            Ok(ClientMsg::Result {
                seq, ok, output, ..
            }) => {
                core.metrics.inc(C::MsgResult);
                // Once, as on a live connection: a result repeated has no id to claim.
                let owed = &mut left.owed;
                let owing = owed
                    .ids
                    .iter()
                    .position(|o| o.seq == seq)
                    .map(|i| owed.ids.swap_remove(i));
                // As `rig_messages`: an acked command's result is an answer while one is owed,
                // its id kept or not; a written, unacked one's is not.
                answer = match &owing {
                    Some(o) => o.acked,
                    None => seq.0 > 0 && seq < owed.next && owed.results > 0,
                };
                if answer {
                    owed.results = owed.results.saturating_sub(1);
                }
                let id = owing.map(|o| o.id);
                let (rig, boot) = (&left.rig, &left.boot);
                events::result(broker, rig, boot, seq, id.as_deref(), ok, output.as_ref())
            }
            Ok(ClientMsg::Event { name, data, .. }) => {
                if !session::scope_allows(&st.sec, |s| s.allows_emit(&name)) {
                    core.metrics.inc(C::Forbidden);
                    return false;
                }
                core.metrics.inc(C::MsgEvent);
                events::event(broker, &left.rig, &left.boot, &name, data.as_ref())
            }
            Ok(ClientMsg::Ack { seq, .. }) => {
                core.metrics.inc(C::MsgAck);
                // Not taken (the module's note), but its result is then an answer, as live.
                let owed = &mut left.owed;
                let first = owed.ids.iter_mut().find(|o| o.seq == seq && !o.acked);
                return match first {
                    Some(o) => {
                        o.acked = true;
                        owed.results = owed.results.saturating_add(1);
                        true
                    }
                    None => false,
                };
            }
            // As on a live connection: counted, and under `--strict` the end of what is read
            // (live, it is closed 4400 for it: review bb156 saw what followed published).
            other => {
                core.metrics.inc(match other {
                    Err(_) => C::MsgInvalid,
                    Ok(_) => C::MsgUnknown,
                });
                if core.cfg.strict {
                    closing.remove(&conn);
                }
                return false;
            }
        }
    };
    core.event_bytes(bytes);
    answer
}

#[cfg(test)]
mod tests {
    use std::rc::Rc;

    use super::*;
    use crate::doorbell::{self, Inbox};
    use crate::registry::msg::ToBridge;
    use crate::worker::core::tests::test_core;
    use crate::worker::core::Conn;

    fn published(rx: &Inbox<ToBridge>) -> Vec<serde_json::Value> {
        std::iter::from_fn(|| rx.try_recv())
            .filter_map(|m| match m {
                ToBridge::Event(bytes) => serde_json::from_slice(&bytes).ok(),
                _ => None,
            })
            .collect()
    }

    fn closing_conn() -> (Rc<Core>, Conn, Inbox<ToBridge>) {
        let (tx, rx) = doorbell::channel::<ToBridge>(16).expect("channel");
        let core = test_core(tx);
        let conn = Conn::new(&core, core.next_conn_id(), -1);
        let rig = RigId::parse("rig-1").expect("rig");
        let owing = |seq, id: &str, acked| Owing {
            seq: Seq(seq),
            id: id.into(),
            acked,
        };
        let owed = Owed {
            ids: vec![owing(1, "c1", true), owing(2, "c2", false)],
            results: 1,
            next: Seq(3),
        };
        keep(&core, conn.id, &rig, BootId::generate(1), owed);
        (core, conn, rx)
    }

    fn late(core: &Core, conn: &Conn, text: &str) -> bool {
        on_text(core, conn.id, &conn.st.borrow(), text.as_bytes())
    }

    /// Which messages are answers (free of the rig's rate), as live: the result of an acked
    /// command while one is owed, and the first ack of a written one, whose result then is too.
    /// A written command's result before its ack is not, and takes nothing owed from the acked
    /// (review bb158: such results used up the count, and the acked ones' were charged).
    #[test]
    fn answers_are_free_of_the_rate_as_live() {
        let (core, conn, _rx) = closing_conn();
        let result = |seq: u64| format!(r#"{{"type":"result","seq":{seq},"ok":true}}"#);
        assert!(!late(&core, &conn, &result(2)), "written, unacked");
        assert!(late(&core, &conn, &result(1)), "acked");
        assert!(!late(&core, &conn, &result(1)), "nothing more owed");

        let (core, conn, _rx) = closing_conn();
        assert!(
            late(&core, &conn, r#"{"type":"ack","seq":2}"#),
            "its first ack"
        );
        assert!(!late(&core, &conn, r#"{"type":"ack","seq":2}"#), "again");
        assert!(late(&core, &conn, &result(2)));
        assert!(late(&core, &conn, &result(1)), "still owed");
        assert!(!late(&core, &conn, &result(1)));
    }

    #[test]
    fn a_late_result_takes_its_commands_id_once() {
        let (core, conn, rx) = closing_conn();
        late(&core, &conn, r#"{"type":"result","seq":2,"ok":true}"#);
        late(&core, &conn, r#"{"type":"result","seq":2,"ok":true}"#);
        late(&core, &conn, r#"{"type":"result","seq":7,"ok":false}"#);
        let ids: Vec<_> = published(&rx).iter().map(|e| e["id"].clone()).collect();
        assert_eq!(
            ids,
            [
                serde_json::json!("c2"),
                serde_json::Value::Null,
                serde_json::Value::Null
            ]
        );
    }

    #[test]
    fn acks_and_anything_after_the_echo_are_dropped() {
        let (core, conn, rx) = closing_conn();
        late(&core, &conn, r#"{"type":"ack","seq":1}"#);
        late(&core, &conn, r#"{"type":"result""#);
        assert!(published(&rx).is_empty(), "an ack, and what does not parse");
        forget(&core, conn.id);
        late(&core, &conn, r#"{"type":"result","seq":1,"ok":true}"#);
        assert!(
            published(&rx).is_empty(),
            "nothing is kept once the echo came"
        );
        assert!(core.crossed.borrow().is_empty());
    }

    #[test]
    fn only_closes_that_were_not_the_rigs_fault_are_crossed() {
        for code in [1001, 1012, 4410, 4002] {
            assert!(may_cross(Some(code)), "{code}");
        }
        for code in [
            None,
            Some(1000),
            Some(1003),
            Some(1009),
            Some(4400),
            Some(4408),
        ] {
            assert!(!may_cross(code), "{code:?}");
        }
    }
}
