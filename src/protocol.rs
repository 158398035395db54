//! The JSON messages of CONTRACT.md §2: parsing what rigs send, encoding what the broker sends.
//!
//! Pure functions over byte slices; the connection loop calls `parse_client_msg` on every
//! complete text message and writes whatever the `encode_*` functions return.

use std::borrow::Cow;

use serde::{Deserialize, Serialize};
use serde_json::value::RawValue;

use crate::string_pairs::{string_pairs, Refused};

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
        /// Whatever the rig reported, as it sent it.
        output: Option<RawJson>,
    },
    /// Anything else the rig reports.
    Event {
        /// Protocol version the rig spoke.
        v: u32,
        /// Event name.
        name: String,
        /// Event payload, as the rig sent it.
        data: Option<RawJson>,
    },
    /// A well-formed message of a type this broker does not know (counted, then ignored).
    Unknown {
        /// The unknown `type` value.
        ty: String,
    },
}

/// JSON a rig sent, kept as its text: control gets it exactly as sent, as a rig gets a
/// command's args. Parsed into a `Value` and written again, a number past 64 bits lost its
/// digits, `1e400` or a lone surrogate escape (`"\udcff"`, which Python writes for bytes that
/// are no UTF-8) failed the whole message, and a key given twice kept only its last value.
#[derive(Debug, Clone)]
pub struct RawJson(Box<RawValue>);

impl RawJson {
    /// The JSON text.
    pub fn get(&self) -> &str {
        self.0.get()
    }
}

impl PartialEq for RawJson {
    fn eq(&self, other: &Self) -> bool {
        self.get() == other.get()
    }
}

/// A field kept as its text; `null` reads as absent.
fn raw_own(raw: Option<&RawValue>) -> Option<RawJson> {
    raw.map(|r| RawJson(r.to_owned()))
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

/// A rig message as read: its `type`, its `v`, and every field some message type has, each
/// kept as raw JSON text. Only the fields of the message's own type are then parsed, so a
/// field of another type, whatever it holds, is ignored like an unknown key (and unknown keys
/// are skipped unbuilt). A key given twice is an error, as is a message that is not an object
/// with a string `type`.
#[derive(Deserialize)]
struct RawMsg<'a> {
    #[serde(rename = "type", borrow)]
    ty: Cow<'a, str>,
    #[serde(default, borrow)]
    v: Option<&'a RawValue>,
    #[serde(default, borrow)]
    rig_id: Option<&'a RawValue>,
    #[serde(default, borrow)]
    boot_id: Option<&'a RawValue>,
    #[serde(default, borrow)]
    version: Option<&'a RawValue>,
    #[serde(default, borrow)]
    labels: Option<&'a RawValue>,
    #[serde(default, borrow)]
    last_seq: Option<&'a RawValue>,
    #[serde(default, borrow)]
    seq: Option<&'a RawValue>,
    #[serde(default, borrow)]
    ok: Option<&'a RawValue>,
    #[serde(default, borrow)]
    output: Option<&'a RawValue>,
    #[serde(default, borrow)]
    name: Option<&'a RawValue>,
    #[serde(default, borrow)]
    data: Option<&'a RawValue>,
}

fn own<'a, T: Deserialize<'a>>(raw: Option<&'a RawValue>) -> Result<Option<T>, ProtocolError> {
    raw.map_or(Ok(None), |r| {
        serde_json::from_str(r.get()).map_err(|e| ProtocolError::Malformed(e.to_string()))
    })
}

/// Deepest nesting of arrays and objects a rig's message may have, counting the message's own
/// object: serde_json's own bound, which its parser enforces on what it builds but not on what
/// it skims (unknown keys, and the `output` and `data` kept as text).
pub(crate) const MAX_DEPTH: usize = 127;

/// Whether `bytes`, read as JSON, nest arrays and objects deeper than `limit`. Brackets inside
/// strings do not count; text that is not JSON may read either way, and fails the parse that
/// follows anyway.
pub(crate) fn nests_deeper_than(bytes: &[u8], limit: usize) -> bool {
    // Each level takes at least a byte: a message no longer than `limit` (an ack, most
    // hellos) cannot pass it, and skips the scan.
    if bytes.len() <= limit {
        return false;
    }
    let (mut depth, mut in_string, mut escaped) = (0usize, false, false);
    for &b in bytes {
        if in_string {
            match b {
                _ if escaped => escaped = false,
                b'\\' => escaped = true,
                b'"' => in_string = false,
                _ => {}
            }
            continue;
        }
        match b {
            b'"' => in_string = true,
            b'[' | b'{' => {
                depth += 1;
                if depth > limit {
                    return true;
                }
            }
            b']' | b'}' => depth = depth.saturating_sub(1),
            _ => {}
        }
    }
    false
}

/// Parses one text message from a rig. Unknown fields, and fields of other message types, are
/// ignored; unknown types are `ClientMsg::Unknown`, not errors.
pub fn parse_client_msg(bytes: &[u8]) -> Result<ClientMsg, ProtocolError> {
    // Kept as text, a result's output or an event's data 10,000 levels deep went on to control,
    // whose JSON parsers (Python's, fleetctl's) then failed on every event after it.
    if nests_deeper_than(bytes, MAX_DEPTH) {
        return Err(ProtocolError::Malformed(format!(
            "nested deeper than {MAX_DEPTH} levels"
        )));
    }
    if !crate::json_text::opens_an_object(bytes) {
        return Err(ProtocolError::Malformed("the text opens no object".into()));
    }
    let raw: RawMsg<'_> =
        serde_json::from_slice(bytes).map_err(|e| ProtocolError::Malformed(e.to_string()))?;
    // A hello's close reason names the field; another message's bad `v` is malformed.
    let v = match own::<u32>(raw.v) {
        Ok(v) => v.unwrap_or(1),
        Err(_) if raw.ty == "hello" => {
            return Err(ProtocolError::Invalid {
                ty: "hello",
                why: "v must be an integer from 0 to 2^32-1",
            })
        }
        Err(e) => return Err(e),
    };
    match &*raw.ty {
        "hello" => parse_hello(v, &raw).map(ClientMsg::Hello),
        "ack" => {
            let seq = own(raw.seq)?.ok_or(ProtocolError::Invalid {
                ty: "ack",
                why: "missing seq",
            })?;
            Ok(ClientMsg::Ack { v, seq: Seq(seq) })
        }
        "result" => {
            let invalid = |why| ProtocolError::Invalid { ty: "result", why };
            let seq = own(raw.seq)?.ok_or(invalid("missing seq"))?;
            let ok = own(raw.ok)?.ok_or(invalid("missing ok"))?;
            Ok(ClientMsg::Result {
                v,
                seq: Seq(seq),
                ok,
                output: raw_own(raw.output),
            })
        }
        "event" => {
            let name = own(raw.name)?.ok_or(ProtocolError::Invalid {
                ty: "event",
                why: "missing name",
            })?;
            Ok(ClientMsg::Event {
                v,
                name,
                data: raw_own(raw.data),
            })
        }
        _ => Ok(ClientMsg::Unknown {
            ty: raw.ty.into_owned(),
        }),
    }
}

fn parse_hello(v: u32, raw: &RawMsg<'_>) -> Result<Hello, ProtocolError> {
    // Each why names the field and what it must be: it is the 4400's close reason, all a rig's
    // developer gets to see of why the broker turned the hello away.
    let invalid = |why| ProtocolError::Invalid { ty: "hello", why };
    const RIG_ID: &str = "rig_id must be 1 to 64 of A-Z a-z 0-9 . _ -";
    const BOOT_ID: &str = "boot_id must be a UUIDv7 in canonical lowercase text";
    let rig_id: Option<String> = own(raw.rig_id).map_err(|_| invalid(RIG_ID))?;
    let rig_id = rig_id
        .as_deref()
        .and_then(RigId::parse)
        .ok_or(invalid(RIG_ID))?;
    let boot_id: Option<String> = own(raw.boot_id).map_err(|_| invalid(BOOT_ID))?;
    let boot_id = boot_id
        .as_deref()
        .and_then(BootId::parse)
        .ok_or(invalid(BOOT_ID))?;
    let version: String = own(raw.version)
        .map_err(|_| invalid("version must be a string"))?
        .ok_or(invalid("missing version"))?;
    if version.len() > MAX_LABEL_LEN {
        return Err(invalid("version too long"));
    }
    let labels = match raw.labels.map(RawValue::get) {
        None | Some("null") => Vec::new(),
        Some(text) => string_pairs(text, MAX_LABELS).map_err(|why| {
            invalid(match why {
                Refused::NotAnObject => "labels must be an object",
                Refused::NotAString => "label values must be strings",
                Refused::NotUnicode => {
                    "label keys and values must be valid Unicode (no lone surrogate escapes)"
                }
                Refused::TooMany => "too many labels",
                // As for the message's own keys: which of the two values is meant is a guess.
                Refused::Twice => "a label key given twice",
            })
        })?,
    };
    if labels
        .iter()
        .any(|(k, v)| k.len() > MAX_LABEL_LEN || v.len() > MAX_LABEL_LEN)
    {
        return Err(invalid("label too long"));
    }
    // Any u64 is a valid last_seq (CONTRACT.md section 2). One past the last seq a session
    // can use says the rig has every seq there will be: held at that last one, it means the
    // same, and the session refuses its commands with `seq_exhausted` rather than the hello.
    let last_seq: Option<u64> = own::<u64>(raw.last_seq)
        .map_err(|_| invalid("last_seq must be an integer from 0 to 2^64-1"))?
        .map(|s| s.min(Seq::LAST.0));
    Ok(Hello {
        v,
        rig_id,
        boot_id,
        version,
        labels,
        last_seq: last_seq.map(Seq),
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
    use serde_json::Value;

    fn raw(text: &str) -> RawJson {
        RawJson(RawValue::from_string(text.to_owned()).expect("json"))
    }

    fn nested(depth: usize, inner: &str) -> String {
        format!("{}{inner}{}", "[".repeat(depth), "]".repeat(depth))
    }

    /// The depth check refuses exactly what serde_json's parser would refuse to build, for
    /// arrays and objects, and does not count brackets inside strings.
    #[test]
    fn the_nesting_bound_is_serde_jsons_own() {
        for depth in MAX_DEPTH - 3..MAX_DEPTH + 3 {
            let arrays = nested(depth, "1");
            let objects = format!("{}1{}", r#"{"a":"#.repeat(depth), "}".repeat(depth));
            for text in [arrays, objects] {
                let parses = serde_json::from_str::<Value>(&text).is_ok();
                let deep = nests_deeper_than(text.as_bytes(), MAX_DEPTH);
                assert_eq!(!deep, parses, "depth {depth}");
            }
        }
        let quoted = format!(r#"{{"s":"{}\"{}"}}"#, "[".repeat(500), "{".repeat(500));
        assert!(!nests_deeper_than(quoted.as_bytes(), MAX_DEPTH));
        assert!(serde_json::from_str::<Value>(&quoted).is_ok());
    }

    /// A rig's message nested past the bound is refused whatever field holds the depth, the
    /// ones kept as text and unknown keys included, in every message type; one level less
    /// is taken as before.
    #[test]
    fn a_rig_message_nested_too_deep_is_refused_wherever_the_depth_is() {
        let deep = nested(MAX_DEPTH, "1");
        let ok_depth = nested(MAX_DEPTH - 1, "1");
        for (template, field) in [
            (
                r#"{"type":"result","seq":1,"ok":true,"output":X}"#,
                "output",
            ),
            (r#"{"type":"event","name":"e","data":X}"#, "data"),
            (r#"{"type":"ack","seq":1,"extra":X}"#, "unknown key"),
            (
                r#"{"type":"hello","rig_id":"r","boot_id":"0190b6c0-0000-7000-8000-000000000000","version":"1","x":X}"#,
                "hello's unknown key",
            ),
            (r#"{"type":"later","x":X}"#, "unknown type"),
        ] {
            let refused = parse_client_msg(template.replace('X', &deep).as_bytes());
            assert!(
                matches!(&refused, Err(ProtocolError::Malformed(why)) if why.contains("nested deeper")),
                "{field}: {refused:?}"
            );
            let taken = parse_client_msg(template.replace('X', &ok_depth).as_bytes());
            assert!(taken.is_ok(), "{field}: {taken:?}");
        }
    }

    /// What a rig reports goes on as it sent it: numbers past 64 bits, `1e400`, lone
    /// surrogate escapes and repeated keys alike (they failed the message, or lost digits).
    #[test]
    fn a_results_output_and_an_events_data_are_kept_as_sent() {
        for output in [
            r#"123456789012345678901234567890"#,
            r#"0.1000000000000000055511151231257827"#,
            r#"1e400"#,
            r#""ok \udcff\udcfe bytes""#,
            r#"{"a":1,"a":2}"#,
        ] {
            let msg = format!(r#"{{"type":"result","seq":1,"ok":true,"output":{output}}}"#);
            assert_eq!(
                parse_client_msg(msg.as_bytes()),
                Ok(ClientMsg::Result {
                    v: 1,
                    seq: Seq(1),
                    ok: true,
                    output: Some(raw(output)),
                }),
                "{msg}"
            );
            let msg = format!(r#"{{"type":"event","name":"n","data":{output}}}"#);
            let Ok(ClientMsg::Event {
                data: Some(data), ..
            }) = parse_client_msg(msg.as_bytes())
            else {
                panic!("{msg}")
            };
            assert_eq!(data.get(), output);
        }
        // Still JSON: a broken value fails the message.
        assert!(parse_client_msg(br#"{"type":"result","seq":1,"ok":true,"output":[1,}"#).is_err());
    }

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
            r#"{"type":"hello","rig_id":"r","boot_id":"01890a5d-ac96-774b-bcce-b302099a8057","version":"1","labels":{"g":"x","g":"y"}}"#,
            r#"{"type":"hello","rig_id":"r","boot_id":"01890a5d-ac96-774b-bcce-b302099a8057","version":"1","labels":[]}"#,
            r#"{"rig_id":"r"}"#,
            r#"[1,2]"#,
            "not json",
            r#"{"type":"hello","rig_id":"r","boot_id":"01890a5d-ac96-774b-bcce-b302099a8057","version":"1","last_seq":18446744073709551616}"#,
            r#"{"type":"hello","rig_id":"r","boot_id":"01890a5d-ac96-774b-bcce-b302099a8057","version":"1","last_seq":-1}"#,
        ] {
            assert!(parse_client_msg(bad.as_bytes()).is_err(), "{bad}");
        }
    }

    /// serde_json's `raw_value` feature reads an object keyed by its private marker as the JSON
    /// its string holds, when building a `Value`: a label value must be a string as written.
    #[test]
    fn a_label_value_written_as_serde_jsons_raw_value_marker_is_not_a_string() {
        let hello = |labels: &str| {
            format!(
                r#"{{"type":"hello","rig_id":"r","boot_id":"01890a5d-ac96-774b-bcce-b302099a8057","version":"1","labels":{labels}}}"#
            )
        };
        let marker = r#"{"g":{"$serde_json::private::RawValue":"\"x\""}}"#;
        assert_eq!(
            parse_client_msg(hello(marker).as_bytes()),
            Err(ProtocolError::Invalid {
                ty: "hello",
                why: "label values must be strings"
            })
        );
        // As a key it is only a string, kept as written.
        let key = r#"{"$serde_json::private::RawValue":"\"x\""}"#;
        let Ok(ClientMsg::Hello(h)) = parse_client_msg(hello(key).as_bytes()) else {
            panic!("{key}");
        };
        assert_eq!(
            h.labels,
            [("$serde_json::private::RawValue".into(), "\"x\"".into())]
        );
    }

    /// What a hello may hold is bounded, since the broker keeps it for the whole connection:
    /// each bound is taken at its size and refused one past it.
    #[test]
    fn a_hellos_version_and_labels_are_bounded_at_128_bytes_and_32_labels() {
        let hello = |version: &str, labels: serde_json::Value| {
            let text = serde_json::json!({
                "type": "hello", "rig_id": "r", "boot_id": BOOT,
                "version": version, "labels": labels,
            });
            parse_client_msg(text.to_string().as_bytes())
        };
        let labels = |n: usize, key_len: usize, value_len: usize| {
            let map = (0..n)
                .map(|i| (format!("{i:0>key_len$}"), "v".repeat(value_len).into()))
                .collect::<serde_json::Map<_, _>>();
            serde_json::Value::Object(map)
        };
        let v = |n: usize| "1".repeat(n);
        assert!(hello(&v(MAX_LABEL_LEN), labels(32, 128, 128)).is_ok());
        for (version, labels, why) in [
            (v(129), labels(0, 1, 1), "version too long"),
            (v(1), labels(33, 3, 1), "too many labels"),
            (v(1), labels(1, 129, 1), "label too long"),
            (v(1), labels(1, 1, 129), "label too long"),
        ] {
            assert_eq!(
                hello(&version, labels).map(|_| ()),
                Err(ProtocolError::Invalid { ty: "hello", why }),
            );
        }
    }

    /// Any u64 is a valid last_seq; past the last seq a session can use, it is held there.
    #[test]
    fn a_last_seq_past_the_last_usable_seq_is_held_at_it() {
        for (sent, kept) in [
            (Seq::LAST.0, Seq::LAST),
            (Seq::LAST.0 + 1, Seq::LAST),
            (u64::MAX, Seq::LAST),
        ] {
            let msg = format!(
                r#"{{"type":"hello","rig_id":"r","boot_id":"01890a5d-ac96-774b-bcce-b302099a8057","version":"1","last_seq":{sent}}}"#
            );
            let Ok(ClientMsg::Hello(h)) = parse_client_msg(msg.as_bytes()) else {
                panic!("{msg}");
            };
            assert_eq!(h.last_seq, Some(kept), "{sent}");
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

    /// Each message type with the fields of every other type, with values of the wrong JSON
    /// type for them: still that message, the foreign fields ignored.
    #[test]
    fn foreign_fields_are_ignored() {
        let hello = format!(
            r#"{{"type":"hello","rig_id":"rig-1","boot_id":"{BOOT}","version":"1.2","seq":"x","ok":"y","output":1,"name":5,"data":[1],"v":2}}"#
        );
        let ClientMsg::Hello(h) = parse_client_msg(hello.as_bytes()).unwrap() else {
            panic!("{hello}")
        };
        assert_eq!((h.v, h.version.as_str()), (2, "1.2"));

        for ack in [
            r#"{"type":"ack","seq":3,"ok":"y"}"#,
            r#"{"type":"ack","seq":3,"ok":"y","output":{"x":1},"name":7,"data":"d"}"#,
            r#"{"type":"ack","seq":3,"rig_id":1,"boot_id":[],"version":2,"labels":"l","last_seq":-1}"#,
        ] {
            assert_eq!(
                parse_client_msg(ack.as_bytes()),
                Ok(ClientMsg::Ack { v: 1, seq: Seq(3) }),
                "{ack}"
            );
        }

        for result in [
            r#"{"type":"result","seq":4,"ok":true,"output":"done","name":1,"data":2}"#,
            r#"{"type":"result","seq":4,"ok":true,"output":"done","version":2,"labels":[],"last_seq":"z","rig_id":{}}"#,
        ] {
            assert_eq!(
                parse_client_msg(result.as_bytes()),
                Ok(ClientMsg::Result {
                    v: 1,
                    seq: Seq(4),
                    ok: true,
                    output: Some(raw(r#""done""#)),
                }),
                "{result}"
            );
        }

        for event in [
            r#"{"type":"event","name":"temp","data":{"c":21},"version":2}"#,
            r#"{"type":"event","name":"temp","data":{"c":21},"seq":"s","ok":"y","output":[],"boot_id":1,"labels":null,"last_seq":1.5}"#,
        ] {
            assert_eq!(
                parse_client_msg(event.as_bytes()),
                Ok(ClientMsg::Event {
                    v: 1,
                    name: "temp".into(),
                    data: Some(raw(r#"{"c":21}"#)),
                }),
                "{event}"
            );
        }

        // An unknown type has no fields of its own: anything goes but `type` and `v`.
        assert_eq!(
            parse_client_msg(br#"{"type":"pong","seq":"x","ok":1,"name":[],"v":3}"#),
            Ok(ClientMsg::Unknown { ty: "pong".into() })
        );
        // `type` with an escape is still read.
        assert_eq!(
            parse_client_msg(br#"{"type":"\u0061ck","seq":1}"#),
            Ok(ClientMsg::Ack { v: 1, seq: Seq(1) })
        );
    }

    /// `type` need not come first: fields before it are read once it is known.
    #[test]
    fn fields_before_the_type() {
        let hello = format!(
            r#"{{"labels":{{"g":"a"}},"seq":"x","rig_id":"rig-1","last_seq":2,"boot_id":"{BOOT}","version":"1","type":"hello","v":2}}"#
        );
        let ClientMsg::Hello(h) = parse_client_msg(hello.as_bytes()).unwrap() else {
            panic!("{hello}")
        };
        assert_eq!((h.v, h.last_seq), (2, Some(Seq(2))));
        assert_eq!(h.labels, [("g".into(), "a".into())]);
        for (text, want) in [
            (
                r#"{"seq":3,"ok":"y","type":"ack"}"#,
                Ok(ClientMsg::Ack { v: 1, seq: Seq(3) }),
            ),
            (
                r#"{"data":[1],"seq":"s","name":"n","version":2,"type":"event"}"#,
                Ok(ClientMsg::Event {
                    v: 1,
                    name: "n".into(),
                    data: Some(raw("[1]")),
                }),
            ),
            (
                r#"{"output":null,"seq":9,"type":"result","ok":false}"#,
                Ok(ClientMsg::Result {
                    v: 1,
                    seq: Seq(9),
                    ok: false,
                    output: None,
                }),
            ),
        ] {
            assert_eq!(parse_client_msg(text.as_bytes()), want, "{text}");
        }
        for bad in [
            // A key given twice is malformed whoever's field it is.
            r#"{"seq":3,"ok":"y","ok":{},"type":"ack"}"#,
            r#"{"seq":"x","type":"ack"}"#,
            r#"{"seq":1,"seq":2,"type":"ack"}"#,
            r#"{"seq":1,"type":"ack","seq":2}"#,
            r#"{"ok":"y","type":"result","seq":1}"#,
            r#"{"name":"n","type":"event","name":"m"}"#,
            r#"{"seq":1}"#,
        ] {
            assert!(parse_client_msg(bad.as_bytes()).is_err(), "{bad}");
        }
    }

    /// The fields of the message's own type, and the envelope, are still checked.
    #[test]
    fn own_fields_are_still_checked() {
        let hello = |extra: &str| {
            format!(
                r#"{{"type":"hello","rig_id":"rig-1","boot_id":"{BOOT}","version":"1"{extra}}}"#
            )
        };
        for bad in [
            hello(r#","version":2"#),
            hello(r#","labels":[]"#),
            hello(r#","last_seq":"7""#),
            hello(r#","v":"2""#),
            r#"{"type":"ack","seq":"3"}"#.into(),
            r#"{"type":"ack","seq":-3}"#.into(),
            r#"{"type":"ack","seq":3,"seq":4}"#.into(),
            r#"{"type":"result","seq":1,"ok":"y"}"#.into(),
            r#"{"type":"result","seq":1}"#.into(),
            r#"{"type":"result","ok":true}"#.into(),
            r#"{"type":"event","name":5}"#.into(),
            r#"{"type":"event","data":{}}"#.into(),
            r#"{"type":"event","name":"x","v":-1}"#.into(),
            r#"{"type":"nope","v":"2"}"#.into(),
            r#"{"type":5,"seq":1}"#.into(),
            r#"{"type":"ack","type":"ack","seq":1}"#.into(),
            r#"{"type":"ack","seq":1} x"#.into(),
            r#"{"type":"event","name":"x","data":{"a":}}"#.into(),
            r#"{"type":"nope","data":[1,}"#.into(),
            r#""ack""#.into(),
            "null".into(),
            // The fields in order, as an array: serde's derive takes those for a struct
            // (review bb130: welcomed, acked, published).
            r#"["ack",null,null,null,null,null,null,1]"#.into(),
            format!(r#"["hello",null,"r1","{BOOT}","x"]"#),
            r#"["event",null,null,null,null,null,null,null,null,null,null,"e",[1]]"#.into(),
        ] {
            assert!(parse_client_msg(bad.as_bytes()).is_err(), "{bad}");
        }
        assert_eq!(
            parse_client_msg(br#"{"type":"result","seq":1}"#),
            Err(ProtocolError::Invalid {
                ty: "result",
                why: "missing ok"
            })
        );
        assert!(matches!(
            parse_client_msg(br#"{"type":"ack","seq":"3"}"#),
            Err(ProtocolError::Malformed(_))
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
