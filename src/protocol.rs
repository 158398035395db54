//! The JSON messages of CONTRACT.md §2: parsing what rigs send, encoding what the broker sends.
//!
//! Pure functions over byte slices; the connection loop calls `parse_client_msg` on every
//! complete text message and writes whatever the `encode_*` functions return.

use serde::{Deserialize, Serialize};
use serde_json::value::RawValue;
use serde_json::Value;

use crate::ids::{BootId, RigId, Seq};

/// Most labels a hello may carry; more is a bad hello (bounded per-connection state).
pub const MAX_LABELS: usize = 32;
/// Longest label key or value, and longest `version`, in bytes.
pub const MAX_LABEL_LEN: usize = 128;

/// A message from a rig.
#[derive(Debug, Clone, PartialEq)]
pub enum ClientMsg {
    /// The first message of every connection.
    Hello(Hello),
    /// The rig accepted command `seq`.
    Ack {
        /// Protocol version the rig spoke.
        v: u32,
        /// The acked command.
        seq: Seq,
    },
    /// The rig finished command `seq`.
    Result {
        /// Protocol version the rig spoke.
        v: u32,
        /// The finished command.
        seq: Seq,
        /// Whether it succeeded.
        ok: bool,
        /// Whatever the rig reported.
        output: Option<Value>,
    },
    /// Anything else the rig reports.
    Event {
        /// Protocol version the rig spoke.
        v: u32,
        /// Event name.
        name: String,
        /// Event payload.
        data: Option<Value>,
    },
    /// A well-formed message of a type this broker does not know (counted, then ignored).
    Unknown {
        /// The unknown `type` value.
        ty: String,
    },
}

/// A validated hello.
#[derive(Debug, Clone, PartialEq)]
pub struct Hello {
    /// Protocol version the rig spoke (default 1).
    pub v: u32,
    /// Who the rig says it is.
    pub rig_id: RigId,
    /// This boot of the rig process.
    pub boot_id: BootId,
    /// The agent's version string.
    pub version: String,
    /// Labels for broadcast selectors and metrics grouping, sorted by key.
    pub labels: Vec<(String, String)>,
    /// The last seq the rig saw in this session, when resuming.
    pub last_seq: Option<Seq>,
}

/// Why a rig message was refused.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum ProtocolError {
    /// The text is not a JSON object with a string `type`.
    #[error("not a JSON message object: {0}")]
    Malformed(String),
    /// A known type with a missing or invalid field.
    #[error("invalid {ty}: {why}")]
    Invalid {
        /// Message type.
        ty: &'static str,
        /// What was wrong.
        why: &'static str,
    },
}

#[derive(Deserialize)]
struct RawMsg {
    #[serde(rename = "type")]
    ty: String,
    #[serde(default)]
    v: Option<u32>,
    #[serde(default)]
    rig_id: Option<String>,
    #[serde(default)]
    boot_id: Option<String>,
    #[serde(default)]
    version: Option<String>,
    #[serde(default)]
    labels: Option<serde_json::Map<String, Value>>,
    #[serde(default)]
    last_seq: Option<u64>,
    #[serde(default)]
    seq: Option<u64>,
    #[serde(default)]
    ok: Option<bool>,
    #[serde(default)]
    output: Option<Value>,
    #[serde(default)]
    name: Option<String>,
    #[serde(default)]
    data: Option<Value>,
}

/// Parses one text message from a rig. Unknown fields are ignored; unknown types are
/// `ClientMsg::Unknown`, not errors.
pub fn parse_client_msg(bytes: &[u8]) -> Result<ClientMsg, ProtocolError> {
    let raw: RawMsg =
        serde_json::from_slice(bytes).map_err(|e| ProtocolError::Malformed(e.to_string()))?;
    let v = raw.v.unwrap_or(1);
    match raw.ty.as_str() {
        "hello" => parse_hello(v, raw).map(ClientMsg::Hello),
        "ack" => {
            let seq = raw.seq.ok_or(ProtocolError::Invalid {
                ty: "ack",
                why: "missing seq",
            })?;
            Ok(ClientMsg::Ack { v, seq: Seq(seq) })
        }
        "result" => {
            let invalid = |why| ProtocolError::Invalid { ty: "result", why };
            let seq = raw.seq.ok_or(invalid("missing seq"))?;
            let ok = raw.ok.ok_or(invalid("missing ok"))?;
            Ok(ClientMsg::Result {
                v,
                seq: Seq(seq),
                ok,
                output: raw.output,
            })
        }
        "event" => {
            let name = raw.name.ok_or(ProtocolError::Invalid {
                ty: "event",
                why: "missing name",
            })?;
            Ok(ClientMsg::Event {
                v,
                name,
                data: raw.data,
            })
        }
        _ => Ok(ClientMsg::Unknown { ty: raw.ty }),
    }
}

fn parse_hello(v: u32, raw: RawMsg) -> Result<Hello, ProtocolError> {
    let invalid = |why| ProtocolError::Invalid { ty: "hello", why };
    let rig_id = raw
        .rig_id
        .as_deref()
        .and_then(RigId::parse)
        .ok_or(invalid("rig_id"))?;
    let boot_id = raw
        .boot_id
        .as_deref()
        .and_then(BootId::parse)
        .ok_or(invalid("boot_id"))?;
    let version = raw.version.ok_or(invalid("missing version"))?;
    if version.len() > MAX_LABEL_LEN {
        return Err(invalid("version too long"));
    }
    let mut labels = Vec::new();
    if let Some(map) = raw.labels {
        if map.len() > MAX_LABELS {
            return Err(invalid("too many labels"));
        }
        for (k, val) in map {
            let Value::String(s) = val else {
                return Err(invalid("label values must be strings"));
            };
            if k.len() > MAX_LABEL_LEN || s.len() > MAX_LABEL_LEN {
                return Err(invalid("label too long"));
            }
            labels.push((k, s));
        }
        labels.sort();
    }
    if raw.last_seq.is_some_and(|s| s > Seq::LAST.0) {
        return Err(invalid("last_seq beyond the highest seq a session can use"));
    }
    Ok(Hello {
        v,
        rig_id,
        boot_id,
        version,
        labels,
        last_seq: raw.last_seq.map(Seq),
    })
}

/// `welcome` (CONTRACT.md §2).
pub fn encode_welcome(
    v: u32,
    broker_id: &str,
    rig_id: &RigId,
    ping_interval_ms: u64,
    resumed: bool,
) -> Vec<u8> {
    #[derive(Serialize)]
    struct Welcome<'a> {
        #[serde(rename = "type")]
        ty: &'static str,
        v: u32,
        broker_id: &'a str,
        rig_id: &'a str,
        ping_interval_ms: u64,
        resumed: bool,
    }
    to_vec(&Welcome {
        ty: "welcome",
        v,
        broker_id,
        rig_id: rig_id.as_str(),
        ping_interval_ms,
        resumed,
    })
}

/// `command` (CONTRACT.md §2). `args` is already-encoded JSON (an object), written as it is.
pub fn encode_command(v: u32, seq: Seq, id: &str, name: &str, args: &RawValue) -> Vec<u8> {
    #[derive(Serialize)]
    struct Command<'a> {
        #[serde(rename = "type")]
        ty: &'static str,
        v: u32,
        seq: u64,
        id: &'a str,
        name: &'a str,
        args: &'a RawValue,
    }
    to_vec(&Command {
        ty: "command",
        v,
        seq: seq.0,
        id,
        name,
        args,
    })
}

/// `goaway` (CONTRACT.md §2, §7).
pub fn encode_goaway(v: u32, reason: &str, reconnect_after_ms: u64) -> Vec<u8> {
    #[derive(Serialize)]
    struct Goaway<'a> {
        #[serde(rename = "type")]
        ty: &'static str,
        v: u32,
        reason: &'a str,
        reconnect_after_ms: u64,
    }
    to_vec(&Goaway {
        ty: "goaway",
        v,
        reason,
        reconnect_after_ms,
    })
}

fn to_vec<T: Serialize>(msg: &T) -> Vec<u8> {
    // Serializing these plain structs cannot fail: no maps with non-string keys, no I/O.
    serde_json::to_vec(msg).unwrap_or_default()
}

#[cfg(test)]
mod tests {
    use super::*;

    const BOOT: &str = "01890a5d-ac96-774b-bcce-b302099a8057";

    #[test]
    fn hello_round_trip() {
        let text = format!(
            r#"{{"type":"hello","rig_id":"rig-1","boot_id":"{BOOT}","version":"1.2","labels":{{"lab":"b","group":"a"}},"last_seq":7,"extra":1}}"#
        );
        let ClientMsg::Hello(h) = parse_client_msg(text.as_bytes()).unwrap() else {
            panic!()
        };
        assert_eq!(h.rig_id.as_str(), "rig-1");
        assert_eq!(h.v, 1);
        assert_eq!(h.last_seq, Some(Seq(7)));
        assert_eq!(h.labels[0], ("group".into(), "a".into()));
    }

    #[test]
    fn bad_hellos() {
        for bad in [
            r#"{"type":"hello","rig_id":"rig 1","boot_id":"01890a5d-ac96-774b-bcce-b302099a8057","version":"1"}"#,
            r#"{"type":"hello","rig_id":"r","boot_id":"not-a-uuid","version":"1"}"#,
            r#"{"type":"hello","rig_id":"r","boot_id":"01890a5d-ac96-774b-bcce-b302099a8057"}"#,
            r#"{"type":"hello","rig_id":"r","boot_id":"01890a5d-ac96-774b-bcce-b302099a8057","version":"1","labels":{"a":1}}"#,
            r#"{"rig_id":"r"}"#,
            r#"[1,2]"#,
            "not json",
            r#"{"type":"hello","rig_id":"r","boot_id":"01890a5d-ac96-774b-bcce-b302099a8057","version":"1","last_seq":999999999999999}"#,
            r#"{"type":"hello","rig_id":"r","boot_id":"01890a5d-ac96-774b-bcce-b302099a8057","version":"1","last_seq":18446744073709551615}"#,
        ] {
            assert!(parse_client_msg(bad.as_bytes()).is_err(), "{bad}");
        }
    }

    #[test]
    fn other_types() {
        assert_eq!(
            parse_client_msg(br#"{"type":"ack","seq":3,"v":2}"#).unwrap(),
            ClientMsg::Ack { v: 2, seq: Seq(3) }
        );
        assert!(parse_client_msg(br#"{"type":"ack"}"#).is_err());
        assert!(matches!(
            parse_client_msg(br#"{"type":"result","seq":1,"ok":false,"output":{"x":1}}"#).unwrap(),
            ClientMsg::Result { ok: false, .. }
        ));
        assert!(matches!(
            parse_client_msg(br#"{"type":"nope"}"#).unwrap(),
            ClientMsg::Unknown { .. }
        ));
    }

    #[test]
    fn encodes_contract_fields() {
        let rig = RigId::parse("rig-1").unwrap();
        let w: Value =
            serde_json::from_slice(&encode_welcome(1, "fe", &rig, 20000, false)).unwrap();
        assert_eq!(w["type"], "welcome");
        assert_eq!(w["ping_interval_ms"], 20000);
        let c: Value = serde_json::from_slice(&encode_command(
            1,
            Seq(5),
            "c1",
            "reboot",
            crate::args::Args::empty().raw(),
        ))
        .unwrap();
        assert_eq!(c["seq"], 5);
        assert_eq!(c["name"], "reboot");
    }
}
