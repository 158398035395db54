//! The rig side of the JSON messages of CONTRACT.md §2: parsing what the broker sends, encoding
//! what the rig sends. Pure functions; nothing the broker sends can make them panic.

use std::collections::BTreeMap;

use serde_json::{json, Map, Value};

/// `ping_interval_ms` assumed when a welcome lacks it (the broker's default, 20 s).
const DEFAULT_PING_INTERVAL_MS: u64 = 20_000;

/// A message from the broker.
#[derive(Debug, Clone, PartialEq)]
pub(crate) enum ServerMsg {
    /// The answer to hello.
    Welcome {
        broker_id: String,
        ping_interval_ms: u64,
        /// The broker continued this boot's session (seqs go on from there).
        resumed: bool,
    },
    /// A command to ack and run.
    Command(Command),
    /// The broker is draining: reconnect after this delay (None: it gave no number).
    Goaway {
        reason: String,
        reconnect_after_ms: Option<u64>,
    },
    /// A type this agent does not know (ignored, per the contract).
    Unknown(String),
}

/// One command of the session.
#[derive(Debug, Clone, PartialEq)]
pub(crate) struct Command {
    pub(crate) seq: u64,
    /// Control's command id.
    pub(crate) id: String,
    pub(crate) name: String,
    /// An object; `{}` when the broker sent none.
    pub(crate) args: Value,
}

/// Parses one text message. Unknown fields are ignored; a known type with a missing or
/// mistyped required field is an error (the caller logs it and goes on).
pub(crate) fn parse_server_msg(text: &str) -> Result<ServerMsg, String> {
    let v: Value = serde_json::from_str(text).map_err(|e| format!("not JSON: {e}"))?;
    let obj = v.as_object().ok_or("not a JSON object")?;
    let ty = obj
        .get("type")
        .and_then(Value::as_str)
        .ok_or("no string \"type\"")?;
    let str_field = |k: &str| obj.get(k).and_then(Value::as_str).map(str::to_string);
    let u64_field = |k: &str| obj.get(k).and_then(Value::as_u64);
    match ty {
        "welcome" => Ok(ServerMsg::Welcome {
            broker_id: str_field("broker_id").unwrap_or_default(),
            ping_interval_ms: u64_field("ping_interval_ms").unwrap_or(DEFAULT_PING_INTERVAL_MS),
            resumed: obj.get("resumed").and_then(Value::as_bool).unwrap_or(false),
        }),
        "command" => {
            let seq = u64_field("seq").ok_or("command without a numeric seq")?;
            let name = str_field("name").ok_or("command without a string name")?;
            let id = match obj.get("id") {
                Some(Value::String(s)) => s.clone(),
                Some(Value::Null) | None => String::new(),
                Some(other) => other.to_string(),
            };
            let args = obj.get("args").cloned().unwrap_or_else(|| json!({}));
            Ok(ServerMsg::Command(Command {
                seq,
                id,
                name,
                args,
            }))
        }
        "goaway" => Ok(ServerMsg::Goaway {
            reason: str_field("reason").unwrap_or_default(),
            reconnect_after_ms: u64_field("reconnect_after_ms"),
        }),
        other => Ok(ServerMsg::Unknown(other.to_string())),
    }
}

/// `hello`; `last_seq` only when the session has seen a command.
pub(crate) fn hello(
    rig_id: &str,
    boot_id: &str,
    labels: &BTreeMap<String, String>,
    last_seq: Option<u64>,
) -> String {
    let mut msg = json!({
        "type": "hello",
        "rig_id": rig_id,
        "boot_id": boot_id,
        "version": env!("CARGO_PKG_VERSION"),
        "labels": labels,
    });
    if let (Some(seq), Some(obj)) = (last_seq, msg.as_object_mut()) {
        obj.insert("last_seq".into(), seq.into());
    }
    msg.to_string()
}

/// `ack`.
pub(crate) fn ack(seq: u64) -> String {
    json!({"type": "ack", "seq": seq}).to_string()
}

/// `result`, cut down to at most `max` bytes: the longest string in `output` is halved until
/// it fits (and `"truncated": true` set); if nothing is left to cut, the output is replaced by
/// an error object. A too-big message would only get the connection closed with 1009, and the
/// result resent into the same wall after every reconnect.
pub(crate) fn result(seq: u64, ok: bool, output: Value, max: usize) -> String {
    let encode = |output: &Value| {
        json!({"type": "result", "seq": seq, "ok": ok, "output": output}).to_string()
    };
    let mut output = output;
    let mut text = encode(&output);
    let mut cut = false;
    while text.len() > max {
        let Some(longest) = longest_string(&mut output).filter(|s| !s.is_empty()) else {
            let note = json!({"error": "output too large", "bytes": text.len()});
            return encode(&note);
        };
        let mut keep = longest.len() / 2;
        while !longest.is_char_boundary(keep) {
            keep -= 1;
        }
        longest.truncate(keep);
        cut = true;
        text = encode(&output);
    }
    if cut {
        if let Some(obj) = output.as_object_mut() {
            obj.insert("truncated".into(), true.into());
            text = encode(&output);
            if text.len() > max {
                return result(seq, ok, output, max);
            }
        }
    }
    text
}

fn longest_string(v: &mut Value) -> Option<&mut String> {
    match v {
        Value::String(s) => Some(s),
        Value::Array(items) => items
            .iter_mut()
            .filter_map(longest_string)
            .max_by_key(|s| s.len()),
        Value::Object(map) => map
            .values_mut()
            .filter_map(longest_string)
            .max_by_key(|s| s.len()),
        _ => None,
    }
}

/// An error object as a command's output: `{"error": why}`.
pub(crate) fn error_output(why: &str) -> Value {
    let mut m = Map::new();
    m.insert("error".into(), why.into());
    Value::Object(m)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_contract_messages() {
        let w = parse_server_msg(
            r#"{"type":"welcome","v":1,"broker_id":"fe-1","rig_id":"r","ping_interval_ms":500,"resumed":true}"#,
        );
        assert_eq!(
            w,
            Ok(ServerMsg::Welcome {
                broker_id: "fe-1".into(),
                ping_interval_ms: 500,
                resumed: true
            })
        );
        let c = parse_server_msg(
            r#"{"type":"command","seq":3,"id":"c-1","name":"uptime","args":{"argv":["-p"]}}"#,
        );
        let Ok(ServerMsg::Command(c)) = c else {
            panic!("{c:?}")
        };
        assert_eq!(
            (c.seq, c.id.as_str(), c.name.as_str()),
            (3, "c-1", "uptime")
        );
        assert_eq!(c.args["argv"][0], "-p");
        let g =
            parse_server_msg(r#"{"type":"goaway","reason":"draining","reconnect_after_ms":250}"#);
        assert_eq!(
            g,
            Ok(ServerMsg::Goaway {
                reason: "draining".into(),
                reconnect_after_ms: Some(250)
            })
        );
        // No number, no delay made up: 0 sent every rig back at once (review bb133).
        let g = parse_server_msg(r#"{"type":"goaway","reason":"x","reconnect_after_ms":"soon"}"#);
        assert!(matches!(
            g,
            Ok(ServerMsg::Goaway {
                reconnect_after_ms: None,
                ..
            })
        ));
        assert_eq!(
            parse_server_msg(r#"{"type":"news"}"#),
            Ok(ServerMsg::Unknown("news".into()))
        );
    }

    #[test]
    fn hostile_input_is_an_error_not_a_panic() {
        for bad in [
            "",
            "null",
            "[]",
            "{}",
            r#"{"type":1}"#,
            r#"{"type":"command","seq":-1,"name":"x"}"#,
            r#"{"type":"command","seq":1.5,"name":"x"}"#,
            r#"{"type":"command","seq":1}"#,
            r#"{"type":"command","seq":"1","name":"x"}"#,
        ] {
            assert!(parse_server_msg(bad).is_err(), "{bad}");
        }
        let c = parse_server_msg(r#"{"type":"command","seq":1,"name":"x","id":7}"#);
        assert!(
            matches!(c, Ok(ServerMsg::Command(Command { ref id, ref args, .. })) if id == "7" && args == &json!({}))
        );
    }

    #[test]
    fn hello_carries_last_seq_only_when_known() {
        let labels = BTreeMap::from([("group".to_string(), "a".to_string())]);
        let boot = "01890a5d-ac96-774b-bcce-b302099a8057";
        let h: Value = serde_json::from_str(&hello("rig-1", boot, &labels, None)).unwrap();
        assert_eq!(h["type"], "hello");
        assert_eq!(h["labels"]["group"], "a");
        assert!(h.get("last_seq").is_none());
        let h: Value = serde_json::from_str(&hello("rig-1", boot, &labels, Some(9))).unwrap();
        assert_eq!(h["last_seq"], 9);
        // The broker's own parser accepts it.
        assert!(fleetlink::protocol::parse_client_msg(
            hello("rig-1", boot, &labels, Some(9)).as_bytes()
        )
        .is_ok());
    }

    #[test]
    fn results_fit_the_message_limit() {
        let small = result(1, true, json!({"stdout": "hi"}), 1024);
        assert_eq!(
            serde_json::from_str::<Value>(&small).unwrap()["output"]["stdout"],
            "hi"
        );
        let big =
            json!({"stdout": "é".repeat(50_000), "stderr": "x".repeat(10_000), "exit_code": 0});
        let text = result(2, true, big, 4096);
        assert!(text.len() <= 4096, "{}", text.len());
        let v: Value = serde_json::from_str(&text).unwrap();
        assert_eq!(v["output"]["truncated"], true);
        assert_eq!(v["output"]["exit_code"], 0);
        assert!(v["output"]["stdout"].as_str().unwrap().len() > 1000);
        // Nothing to cut: replaced by an error object.
        let numbers = Value::Array((0..2000).map(Value::from).collect());
        let v: Value = serde_json::from_str(&result(3, false, numbers, 1024)).unwrap();
        assert_eq!(v["output"]["error"], "output too large");
    }
}
