//! Lifecycle events for `fleetlink:events` (CONTRACT.md §4): one JSON object per event, each
//! with `type`, `rig_id`, `broker_id`, `at`, and `seq`/`id`/`code` where they apply.

use std::time::SystemTime;

use serde_json::{json, Value};

use crate::ids::{BootId, RigId, Seq};
use crate::protocol::RawJson;
use crate::reply::rfc3339;

/// A rig was welcomed. Written straight to bytes, as [`ack`] is: a storm of hellos makes one
/// per rig.
pub fn connected(broker: &str, rig: &RigId, boot: &BootId, resumed: bool) -> Vec<u8> {
    let mut out = head("connected", broker, rig, boot, 0);
    out.extend_from_slice(format!(r#","resumed":{resumed}"#).as_bytes());
    finish(out)
}

/// A welcomed rig's connection closed with `code`.
pub fn disconnected(broker: &str, rig: &RigId, boot: &BootId, code: u16, reason: &str) -> Value {
    json!({"type": "disconnected", "rig_id": rig.as_str(), "boot_id": boot.as_str(),
           "broker_id": broker, "code": code, "reason": reason, "at": rfc3339(SystemTime::now())})
}

/// The rig acked command `seq` (`id` when the broker still knew it). A seq is unique only
/// within a session, so `boot_id` comes along: control joins a later `result` to this event by
/// (`rig_id`, `boot_id`, `seq`).
///
/// Written straight to bytes: one comes with every acked command, and building a `Value` for it
/// cost more than the rest of the event's way.
pub fn ack(broker: &str, rig: &RigId, boot: &BootId, seq: Seq, id: Option<&str>) -> Vec<u8> {
    let mut out = head("ack", broker, rig, boot, id.map_or(0, str::len));
    out.extend_from_slice(format!(r#","seq":{},"id":"#, seq.0).as_bytes());
    match id {
        Some(id) => json_str(&mut out, id),
        None => out.extend_from_slice(b"null"),
    }
    finish(out)
}

/// Why a command given while Redis was away is published `lost` by the broker that gave it:
/// the rig may hold another broker's command under its seq (each deciding alone), so this
/// one may never have reached it.
#[derive(Debug, Clone, Copy)]
pub enum SharedSeq {
    /// Acked on a later connection than the one that wrote it.
    AckedLater,
    /// Still unacked at a resume that found Redis's session gone past its seq, nothing under it.
    GivenSince,
}

/// Command `id` under `seq` is `lost` for `why`. Its `lost` has the shape of the ones Redis's
/// scripts publish (`forget.lua`, `rekeep.lua`).
pub fn lost_to_a_shared_seq(
    broker: &str,
    rig: &RigId,
    boot: &BootId,
    seq: Seq,
    id: &str,
    why: SharedSeq,
) -> Vec<u8> {
    let detail = match why {
        SharedSeq::AckedLater => "the rig acked its seq on a later connection, after it was written while its brokers could not reach Redis: another broker may have given the rig that seq for another command, so the rig may not have run it: send it again if no result for it came",
        SharedSeq::GivenSince => "it was written while its brokers could not reach Redis, and another broker has since given the rig its seq: the rig may hold that broker's command under it and not this one: send it again if no result for it came",
    };
    let mut out = head("lost", broker, rig, boot, id.len() + detail.len());
    out.extend_from_slice(format!(r#","seq":{},"id":"#, seq.0).as_bytes());
    json_str(&mut out, id);
    out.extend_from_slice(br#","detail":"#);
    json_str(&mut out, detail);
    finish(out)
}

/// The start of an event written as bytes: its type and whose it is, with room for `more`.
fn head(kind: &str, broker: &str, rig: &RigId, boot: &BootId, more: usize) -> Vec<u8> {
    let mut out = Vec::with_capacity(200 + more);
    out.extend_from_slice(br#"{"type":"#);
    json_str(&mut out, kind);
    out.extend_from_slice(br#","rig_id":"#);
    json_str(&mut out, rig.as_str());
    out.extend_from_slice(br#","boot_id":"#);
    json_str(&mut out, boot.as_str());
    out.extend_from_slice(br#","broker_id":"#);
    json_str(&mut out, broker);
    out
}

/// The end of an event written as bytes: when it happened.
fn finish(mut out: Vec<u8>) -> Vec<u8> {
    out.extend_from_slice(br#","at":"#);
    json_str(&mut out, &rfc3339(SystemTime::now()));
    out.push(b'}');
    out
}

/// `s` as a JSON string, quoted and escaped.
fn json_str(out: &mut Vec<u8>, s: &str) {
    // Writing a `&str` to a Vec cannot fail.
    let _ = serde_json::to_writer(&mut *out, s);
}

/// The rig reported the result of command `seq`; `id` when the command was not yet acked (an
/// acked command is forgotten at its ack, whose event carried the id). `output` goes on as
/// the rig sent it.
pub fn result(
    broker: &str,
    rig: &RigId,
    boot: &BootId,
    seq: Seq,
    id: Option<&str>,
    ok: bool,
    output: Option<&RawJson>,
) -> Vec<u8> {
    let output = output.map_or("null", RawJson::get);
    let mut out = head(
        "result",
        broker,
        rig,
        boot,
        output.len() + id.map_or(0, str::len),
    );
    out.extend_from_slice(format!(r#","seq":{},"id":"#, seq.0).as_bytes());
    match id {
        Some(id) => json_str(&mut out, id),
        None => out.extend_from_slice(b"null"),
    }
    out.extend_from_slice(format!(r#","ok":{ok},"output":"#).as_bytes());
    out.extend_from_slice(output.as_bytes());
    finish(out)
}

/// The rig reported an event of its own; `data` goes on as the rig sent it.
pub fn event(
    broker: &str,
    rig: &RigId,
    boot: &BootId,
    name: &str,
    data: Option<&RawJson>,
) -> Vec<u8> {
    let data = data.map_or("null", RawJson::get);
    let mut out = head("event", broker, rig, boot, name.len() + data.len());
    out.extend_from_slice(br#","name":"#);
    json_str(&mut out, name);
    out.extend_from_slice(br#","data":"#);
    out.extend_from_slice(data.as_bytes());
    finish(out)
}

/// Command `seq` of the rig's older session `old` was never acked and will not be replayed: a
/// new boot started (CONTRACT.md §5). `resume.lua` publishes these when Redis decides the
/// hello; the broker does, in the same shape, when it decided the hello alone.
pub fn rig_rebooted(
    broker: &str,
    rig: &RigId,
    old: &BootId,
    new: &BootId,
    seq: Seq,
    id: &str,
) -> Value {
    json!({"type": "rig_rebooted", "rig_id": rig.as_str(), "boot_id": old.as_str(),
           "new_boot_id": new.as_str(), "seq": seq.0, "id": id, "broker_id": broker,
           "at": rfc3339(SystemTime::now())})
}

/// A command held for an offline rig was delivered (`body` is its enqueue reply).
pub fn offline_delivered(broker: &str, mut body: Value) -> Value {
    body["type"] = json!("offline_delivered");
    body["broker_id"] = json!(broker);
    body["at"] = json!(rfc3339(SystemTime::now()));
    body
}

/// Standalone: an unacked command of a session kept for its rig's return, dropped when the rig
/// stayed away past `--session-ttl`. Written to the rig, it may have run.
pub fn session_expired(broker: &str, rig: &RigId, boot: &BootId, seq: Seq, id: &str) -> Value {
    json!({"type": "expired", "rig_id": rig.as_str(), "boot_id": boot.as_str(), "seq": seq.0,
           "id": id, "broker_id": broker, "at": rfc3339(SystemTime::now()),
           "detail": "its rig stayed away longer than its session is kept (--session-ttl) \
                      and never acked it; the rig may have run it"})
}

/// Command `id`, held in Redis for the offline `rig`, was not there at its deadline, and Redis
/// had lost its keys since it was held (an empty restart, a flush): a hello may have taken it
/// before the loss, or it went with the keys. Reported rather than taken for delivered, which
/// left a command the loss took with no outcome at all.
pub fn hold_lost(broker: &str, rig: &RigId, id: &str) -> Value {
    json!({"type": "lost", "rig_id": rig.as_str(), "id": id, "broker_id": broker,
           "at": rfc3339(SystemTime::now()),
           "detail": "Redis lost its keys (restarted empty, or flushed) while it held this command for the offline rig: unless an offline_delivered event for it came before, it was not delivered; send it again"})
}

/// A command held for an offline rig expired before the rig came back.
pub fn expired(broker: &str, rig: &RigId, id: &str) -> Value {
    json!({"type": "expired", "rig_id": rig.as_str(), "id": id, "broker_id": broker,
           "at": rfc3339(SystemTime::now())})
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_connected_event_written_as_bytes_is_the_json_it_says() {
        let rig = RigId::parse("rig-1").unwrap();
        let boot = BootId::generate(1_700_000_000_000);
        for resumed in [true, false] {
            let v: Value =
                serde_json::from_slice(&connected("fe-a", &rig, &boot, resumed)).unwrap();
            let at = v["at"].as_str().unwrap_or_default().to_string();
            assert_eq!(at.len(), 24, "{v}");
            assert_eq!(
                v,
                json!({"type": "connected", "rig_id": "rig-1", "boot_id": boot.as_str(),
                       "broker_id": "fe-a", "resumed": resumed, "at": at})
            );
        }
    }

    #[test]
    fn an_ack_written_as_bytes_is_the_json_it_says() {
        let rig = RigId::parse("rig-1").unwrap();
        let boot = BootId::generate(1_700_000_000_000);
        for id in [Some("c-1"), Some("q\"uo\\te\n\u{1}é"), None] {
            let bytes = ack("fe-a", &rig, &boot, Seq(7), id);
            let v: Value = serde_json::from_slice(&bytes).expect("JSON");
            let at = v["at"].as_str().unwrap_or_default().to_string();
            assert_eq!(at.len(), 24, "{v}");
            assert_eq!(
                v,
                json!({"type": "ack", "rig_id": "rig-1", "boot_id": boot.as_str(),
                       "broker_id": "fe-a", "seq": 7, "id": id, "at": at})
            );
        }
    }

    #[test]
    fn a_result_and_an_event_written_as_bytes_are_the_json_they_say() {
        let rig = RigId::parse("rig-1").unwrap();
        let boot = BootId::generate(1_700_000_000_000);
        let raw = |text: &str| match crate::protocol::parse_client_msg(
            format!(r#"{{"type":"result","seq":1,"ok":true,"output":{text}}}"#).as_bytes(),
        ) {
            Ok(crate::protocol::ClientMsg::Result { output, .. }) => output,
            other => panic!("{other:?}"),
        };
        for (output, id) in [(r#"{"exit":0}"#, Some("c-\"1")), ("null", None)] {
            let out = raw(output);
            let bytes = result("fe-a", &rig, &boot, Seq(7), id, false, out.as_ref());
            let v: Value = serde_json::from_slice(&bytes).expect("JSON");
            let at = v["at"].as_str().unwrap_or_default().to_string();
            let output: Value = serde_json::from_str(output).expect("JSON");
            assert_eq!(
                v,
                json!({"type": "result", "rig_id": "rig-1", "boot_id": boot.as_str(),
                       "broker_id": "fe-a", "seq": 7, "id": id, "ok": false,
                       "output": output, "at": at})
            );
            let bytes = event("fe-a", &rig, &boot, "t\"emp", out.as_ref());
            let v: Value = serde_json::from_slice(&bytes).expect("JSON");
            let at = v["at"].as_str().unwrap_or_default().to_string();
            assert_eq!(
                v,
                json!({"type": "event", "rig_id": "rig-1", "boot_id": boot.as_str(),
                       "broker_id": "fe-a", "name": "t\"emp", "data": output, "at": at})
            );
        }
        // A value a `Value` cannot hold goes on as its text.
        let big = "123456789012345678901234567890";
        let bytes = result("fe-a", &rig, &boot, Seq(7), None, true, raw(big).as_ref());
        let text = String::from_utf8(bytes).expect("utf-8");
        assert!(text.contains(&format!(r#""output":{big},"at":"#)), "{text}");
    }
}
