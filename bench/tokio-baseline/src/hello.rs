//! Validation of the first message. Anything that is not a well-formed hello is refused with 4400
//! before the registry is touched, so a malformed client can never displace a real rig.

use std::collections::BTreeMap;

use serde_json::Value;

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Hello {
    pub rig_id: String,
    pub boot_id: String,
    pub version: String,
    pub labels: BTreeMap<String, String>,
    pub last_seq: Option<u64>,
    /// Protocol version the rig spoke (`v`, default 1); replies use the same.
    pub v: u64,
}

fn valid_rig_id(s: &str) -> bool {
    (1..=64).contains(&s.len())
        && s.bytes()
            .all(|c| c.is_ascii_alphanumeric() || matches!(c, b'.' | b'_' | b'-'))
}

/// Canonical lowercase UUIDv7 text: 36 chars, version 7, RFC variant.
pub fn valid_boot_id(s: &str) -> bool {
    let b = s.as_bytes();
    b.len() == 36
        && b.iter().enumerate().all(|(i, &c)| match i {
            8 | 13 | 18 | 23 => c == b'-',
            _ => c.is_ascii_digit() || (b'a'..=b'f').contains(&c),
        })
        && b[14] == b'7'
        && matches!(b[19], b'8' | b'9' | b'a' | b'b')
}

/// Parses and validates a hello; the error is a short reason used as the close reason.
pub fn parse_hello(text: &str) -> Result<Hello, &'static str> {
    let v: Value = serde_json::from_str(text).map_err(|_| "not json")?;
    let obj = v.as_object().ok_or("not an object")?;
    if obj.get("type").and_then(Value::as_str) != Some("hello") {
        return Err("first message must be hello");
    }
    let rig_id = obj
        .get("rig_id")
        .and_then(Value::as_str)
        .ok_or("rig_id missing")?;
    if !valid_rig_id(rig_id) {
        return Err("bad rig_id");
    }
    let boot_id = obj
        .get("boot_id")
        .and_then(Value::as_str)
        .ok_or("boot_id missing")?;
    if !valid_boot_id(boot_id) {
        return Err("boot_id is not a canonical uuidv7");
    }
    let version = obj
        .get("version")
        .and_then(Value::as_str)
        .ok_or("version missing")?;
    let mut labels = BTreeMap::new();
    match obj.get("labels") {
        None | Some(Value::Null) => {}
        Some(Value::Object(m)) => {
            for (k, v) in m {
                labels.insert(
                    k.clone(),
                    v.as_str()
                        .ok_or("label values must be strings")?
                        .to_string(),
                );
            }
        }
        Some(_) => return Err("labels must be an object"),
    }
    let last_seq = match obj.get("last_seq") {
        None | Some(Value::Null) => None,
        Some(v) => Some(v.as_u64().ok_or("bad last_seq")?),
    };
    let v = match obj.get("v") {
        None => 1,
        Some(v) => v.as_u64().ok_or("bad v")?,
    };
    Ok(Hello {
        rig_id: rig_id.to_string(),
        boot_id: boot_id.to_string(),
        version: version.to_string(),
        labels,
        last_seq,
        v,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    const BOOT: &str = "017f22e2-79b0-7cc3-98c4-dc0c0c07398f";

    #[test]
    fn accepts_a_good_hello() {
        let h = parse_hello(&format!(
            r#"{{"type":"hello","rig_id":"rig-000001","boot_id":"{BOOT}","version":"1.0","labels":{{"group":"a"}},"last_seq":3,"extra":1}}"#
        ))
        .unwrap();
        assert_eq!(h.rig_id, "rig-000001");
        assert_eq!(h.labels["group"], "a");
        assert_eq!(h.last_seq, Some(3));
        assert_eq!(h.v, 1);
    }

    #[test]
    fn refuses_bad_hellos() {
        let bad = [
            "nope".to_string(),
            r#"{"type":"ack","seq":1}"#.to_string(),
            format!(r#"{{"type":"hello","rig_id":"bad id","boot_id":"{BOOT}","version":"x"}}"#),
            format!(r#"{{"type":"hello","rig_id":"{}","boot_id":"{BOOT}","version":"x"}}"#, "a".repeat(65)),
            r#"{"type":"hello","rig_id":"r","boot_id":"017F22E2-79B0-7CC3-98C4-DC0C0C07398F","version":"x"}"#.to_string(),
            r#"{"type":"hello","rig_id":"r","boot_id":"017f22e2-79b0-4cc3-98c4-dc0c0c07398f","version":"x"}"#.to_string(),
            format!(r#"{{"type":"hello","rig_id":"r","boot_id":"{BOOT}"}}"#),
            format!(r#"{{"type":"hello","rig_id":"r","boot_id":"{BOOT}","version":"x","labels":{{"a":1}}}}"#),
            format!(r#"{{"type":"hello","rig_id":"r","boot_id":"{BOOT}","version":"x","last_seq":-1}}"#),
        ];
        for b in bad {
            assert!(parse_hello(&b).is_err(), "{b}");
        }
    }
}
