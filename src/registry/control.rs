//! Control-plane messages arriving over Redis pub/sub (CONTRACT.md §4), parsed and validated
//! into owned requests. A bad message never reaches a core: it is answered with `bad_request`
//! when it names a `reply_to`, and counted either way.

use serde::Deserialize;
use serde_json::value::RawValue;

use crate::args::Args;
use crate::ids::{BootId, RigId, COMMAND_NAME_MAX, CONTROL_NAME_MAX};
use crate::protocol::MAX_LABELS;
use crate::registry::msg::{CommandReq, ReplyTo};
use crate::string_pairs::{string_pairs, Refused};

/// A validated control message.
#[derive(Debug)]
pub enum Control {
    /// Enqueue a command for one rig; the reply goes to its `reply_to` channel.
    Command(CommandReq),
    /// Close a rig's connection with 1012.
    Kick {
        /// Request id.
        id: String,
        /// The rig.
        rig: RigId,
        /// Reply channel.
        reply_to: String,
    },
    /// Another broker took `rig` over with `boot`: close ours if it is not newer.
    Evict {
        /// The rig.
        rig: RigId,
        /// The new owner's boot.
        boot: BootId,
    },
    /// A command for every rig matching `selector`.
    Broadcast {
        /// Request id.
        id: String,
        /// Label pairs every matching rig has.
        selector: Vec<(String, String)>,
        /// Command name.
        name: String,
        /// Command args.
        args: Args,
        /// Reply channel.
        reply_to: String,
    },
    /// Another broker added to the session of `rig`'s `boot` in Redis (its parked copy, put
    /// back after an empty restart while the rig went on here): put ours back, and take
    /// what was added.
    Merged {
        /// The rig.
        rig: RigId,
        /// The session's boot.
        boot: BootId,
    },
    /// A readiness canary (ours, or a twin's: another process subscribed with our id).
    Canary {
        /// Who sent it.
        broker_id: String,
        /// Which process sent it: the same id from another process is a twin.
        instance: Option<String>,
    },
}

/// Why a control message was refused, with where to say so.
#[derive(Debug)]
pub struct Bad {
    /// What was wrong.
    pub why: String,
    /// The rig it named, if any.
    pub rig: Option<String>,
    /// (id, reply_to) when the message had a reply channel; the id is empty when control sent
    /// none, and the answer then says `"id": null` rather than make one up.
    pub reply_to: Option<(String, String)>,
}

#[derive(Deserialize)]
struct Raw {
    #[serde(rename = "type")]
    ty: String,
    #[serde(default)]
    id: Option<String>,
    #[serde(default)]
    rig_id: Option<String>,
    #[serde(default)]
    boot_id: Option<String>,
    #[serde(default)]
    name: Option<String>,
    #[serde(default)]
    args: Option<Box<RawValue>>,
    #[serde(default)]
    reply_to: Option<String>,
    #[serde(default)]
    selector: Option<Box<RawValue>>,
    #[serde(default)]
    broker_id: Option<String>,
    #[serde(default)]
    instance: Option<String>,
    /// `null` is absent, as for `ttl_ms`.
    #[serde(default)]
    queue_if_offline: Option<bool>,
    #[serde(default)]
    ttl_ms: Option<u64>,
    /// Broker to broker: a command held for the rig while it was offline, taken from the
    /// hold by a broker whose connection lost the rig to this one; its outcome is reported as
    /// an `offline_delivered` event, since control was answered when it was held.
    #[serde(default)]
    offline_delivery: bool,
}

/// Largest control message taken, as for an admin request.
pub const MAX_CONTROL: usize = crate::admin::MAX_REQUEST;

/// Where to answer a message that cannot be taken (too large, a field of the wrong type, a
/// duplicated key, bad UTF-8 or nesting past the parser's bound further on): only these three
/// are read, every other field is skipped unbuilt, and each is kept as soon as it is read, so
/// that what breaks the message after it does not take the answer's address with it.
#[derive(Default)]
struct Envelope {
    id: Scalar,
    rig_id: Scalar,
    reply_to: Scalar,
}

/// Reads a message's top-level fields into an [`Envelope`] as they come (the first of a
/// duplicated key wins).
struct Fill<'a>(&'a mut Envelope);

/// A top-level key of a control message, as far as its [`Envelope`] cares.
enum Key {
    Id,
    RigId,
    ReplyTo,
    Other,
}

impl<'de> Deserialize<'de> for Key {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Key, D::Error> {
        struct V;
        impl serde::de::Visitor<'_> for V {
            type Value = Key;
            fn expecting(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
                f.write_str("a key")
            }
            fn visit_str<E>(self, s: &str) -> Result<Key, E> {
                Ok(match s {
                    "id" => Key::Id,
                    "rig_id" => Key::RigId,
                    "reply_to" => Key::ReplyTo,
                    _ => Key::Other,
                })
            }
        }
        d.deserialize_str(V)
    }
}

impl<'de> serde::de::Visitor<'de> for Fill<'_> {
    type Value = ();
    fn expecting(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("a JSON object")
    }
    fn visit_map<A: serde::de::MapAccess<'de>>(self, mut map: A) -> Result<(), A::Error> {
        while let Some(key) = map.next_key::<Key>()? {
            let slot = match key {
                Key::Id => &mut self.0.id,
                Key::RigId => &mut self.0.rig_id,
                Key::ReplyTo => &mut self.0.reply_to,
                Key::Other => {
                    map.next_value::<serde::de::IgnoredAny>()?;
                    continue;
                }
            };
            let value = map.next_value::<Scalar>()?;
            if slot.0.is_none() {
                *slot = value;
            }
        }
        Ok(())
    }
}

/// A string, or a number as its JSON text; anything else (an array, an object) is skipped
/// without being built, since the message may be the subscription's 64 MiB.
#[derive(Default)]
struct Scalar(Option<String>);

impl<'de> Deserialize<'de> for Scalar {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Scalar, D::Error> {
        use serde::de::{IgnoredAny, MapAccess, SeqAccess, Visitor};
        struct V;
        impl<'de> Visitor<'de> for V {
            type Value = Scalar;
            fn expecting(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
                f.write_str("any JSON value")
            }
            fn visit_str<E>(self, s: &str) -> Result<Scalar, E> {
                Ok(Scalar(Some(s.to_string())))
            }
            fn visit_u64<E>(self, n: u64) -> Result<Scalar, E> {
                Ok(Scalar(Some(n.to_string())))
            }
            fn visit_i64<E>(self, n: i64) -> Result<Scalar, E> {
                Ok(Scalar(Some(n.to_string())))
            }
            fn visit_f64<E>(self, n: f64) -> Result<Scalar, E> {
                Ok(Scalar(Some(n.to_string())))
            }
            fn visit_bool<E>(self, _: bool) -> Result<Scalar, E> {
                Ok(Scalar(None))
            }
            fn visit_unit<E>(self) -> Result<Scalar, E> {
                Ok(Scalar(None))
            }
            fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<Scalar, A::Error> {
                while seq.next_element::<IgnoredAny>()?.is_some() {}
                Ok(Scalar(None))
            }
            fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<Scalar, A::Error> {
                while map.next_entry::<IgnoredAny, IgnoredAny>()?.is_some() {}
                Ok(Scalar(None))
            }
        }
        d.deserialize_any(V)
    }
}

impl Envelope {
    fn read(payload: &[u8]) -> Self {
        let mut envelope = Envelope::default();
        let mut de = serde_json::Deserializer::from_slice(payload);
        // An error leaves what was read before it: that is the point.
        let _ = serde::Deserializer::deserialize_map(&mut de, Fill(&mut envelope));
        envelope
    }

    /// The refusal of this message: answered when it names a reply channel. An id that is a
    /// number is echoed as its JSON text, so control can still match it.
    fn bad(self, why: String) -> Bad {
        let id = self.id.0.unwrap_or_default();
        let reply_to = self
            .reply_to
            .0
            .filter(|r| !r.is_empty() && r.len() <= CONTROL_NAME_MAX)
            .map(|r| (id, r));
        Bad {
            why,
            rig: self.rig_id.0,
            reply_to,
        }
    }
}

/// A held command as a broker forwards it to the broker its rig is connected to, which
/// delivers it or holds it again for the `ttl_ms` left (`offline_delivery`: control was
/// answered when it was first held). The args go as the text control sent: through a
/// `serde_json::Value` their numbers would be printed again, and a float could come back a
/// unit in the last place off (found by fuzzing).
pub fn forwarded_hold(id: &str, rig: &RigId, name: &str, args: &Args, ttl_ms: u64) -> Vec<u8> {
    #[derive(serde::Serialize)]
    struct Forwarded<'a> {
        r#type: &'static str,
        id: &'a str,
        rig_id: &'a str,
        name: &'a str,
        args: &'a Args,
        offline_delivery: bool,
        queue_if_offline: bool,
        ttl_ms: u64,
    }
    let msg = Forwarded {
        r#type: "command",
        id,
        rig_id: rig.as_str(),
        name,
        args,
        offline_delivery: true,
        queue_if_offline: true,
        ttl_ms,
    };
    serde_json::to_vec(&msg).unwrap_or_default()
}

/// Parses one pub/sub payload; `broadcast` says it came on `fleetlink:broadcast`.
pub fn parse(payload: &[u8], broadcast: bool) -> Result<Control, Bad> {
    if payload.len() > MAX_CONTROL {
        // The admin API's bound: a command goes to the rig as one frame. Checked before the
        // message is parsed, which for one of the subscription's 64 MiB could take gigabytes.
        return Err(Envelope::read(payload).bad("control message larger than 1 MiB".to_string()));
    }
    if !crate::json_text::opens_an_object(payload) {
        return Err(
            Envelope::read(payload).bad("not a valid control message: not a JSON object".into())
        );
    }
    let raw: Raw = serde_json::from_slice(payload)
        .map_err(|e| Envelope::read(payload).bad(format!("not a valid control message: {e}")))?;
    // Not made up when missing: control matches replies and events by the id it chose, so a
    // command without one would run with nobody able to tell its outcome.
    let id = raw.id.clone().unwrap_or_default();
    let reply_to = raw.reply_to.clone().filter(|r| !r.is_empty());
    if reply_to
        .as_ref()
        .is_some_and(|r| r.len() > CONTROL_NAME_MAX)
    {
        // Not answered: the channel named is itself what is refused.
        return Err(Bad {
            why: format!("reply_to longer than {CONTROL_NAME_MAX} bytes"),
            rig: raw.rig_id,
            reply_to: None,
        });
    }
    let bad = |why: &str| Bad {
        why: why.to_string(),
        rig: raw.rig_id.clone(),
        reply_to: reply_to.clone().map(|r| (id.clone(), r)),
    };
    if id.len() > CONTROL_NAME_MAX {
        return Err(bad(&format!("id longer than {CONTROL_NAME_MAX} bytes")));
    }
    match (raw.ty.as_str(), broadcast) {
        // Published on a broker's own channel only: one on the broadcast channel is forged, and
        // made every broker named in it fail /readyz as if it had a twin (review bb130).
        ("canary", false) => Ok(Control::Canary {
            broker_id: raw.broker_id.unwrap_or_default(),
            instance: raw.instance,
        }),
        ("canary", true) => Err(bad(
            "a canary belongs on a broker's own channel, not on fleetlink:broadcast",
        )),
        // Broker to broker: a rig and the boot the message is about.
        (ty @ ("evict" | "session_merged"), false) => {
            let rig = raw
                .rig_id
                .as_deref()
                .and_then(RigId::parse)
                .ok_or_else(|| bad(&format!("{ty} needs a valid rig_id")))?;
            let boot = raw
                .boot_id
                .as_deref()
                .and_then(BootId::parse)
                .ok_or_else(|| bad(&format!("{ty} needs a valid boot_id")))?;
            Ok(match ty {
                "evict" => Control::Evict { rig, boot },
                _ => Control::Merged { rig, boot },
            })
        }
        ("kick", false) => {
            if id.is_empty() {
                return Err(bad("kick needs an id"));
            }
            let rig = raw
                .rig_id
                .as_deref()
                .and_then(RigId::parse)
                .ok_or_else(|| bad("kick needs a valid rig_id"))?;
            let reply_to = reply_to.clone().ok_or_else(|| bad("kick needs reply_to"))?;
            Ok(Control::Kick { id, rig, reply_to })
        }
        ("command", _) => {
            if id.is_empty() {
                return Err(bad("command needs an id"));
            }
            let offline = raw.offline_delivery && !broadcast;
            let reply_to = match reply_to.clone() {
                Some(r) => r,
                None if offline => String::new(),
                None => return Err(bad("command needs reply_to")),
            };
            let name = raw
                .name
                .clone()
                .filter(|n| !n.is_empty() && n.len() <= COMMAND_NAME_MAX)
                .ok_or_else(|| {
                    bad(&format!(
                        "command needs a name of 1-{COMMAND_NAME_MAX} bytes"
                    ))
                })?;
            let args = match raw.args.clone() {
                None => Args::empty(),
                Some(a) => Args::checked(a).map_err(|why| bad(&why))?,
            };
            if broadcast {
                let selector = raw
                    .selector
                    .as_ref()
                    .ok_or_else(|| bad("a broadcast command needs a selector"))?;
                // A rig has at most MAX_LABELS labels, so a longer selector matches none.
                let pairs = string_pairs(selector.get(), MAX_LABELS).map_err(|why| {
                    bad(match why {
                        Refused::NotAnObject => "selector must be an object",
                        Refused::NotAString => "selector values must be strings",
                        Refused::NotUnicode => {
                            "selector keys and values must be valid Unicode (no lone surrogate escapes)"
                        }
                        Refused::TooMany => "a selector names at most 32 labels (a rig has no more)",
                        Refused::Twice => "a selector key given twice",
                    })
                })?;
                return Ok(Control::Broadcast {
                    id,
                    selector: pairs,
                    name,
                    args,
                    reply_to,
                });
            }
            let rig = raw
                .rig_id
                .as_deref()
                .and_then(RigId::parse)
                .ok_or_else(|| bad("command needs a valid rig_id"))?;
            // A held command another broker took from the hold for this rig (its `reply_to`
            // was answered then): delivered or held again here, its outcome an event.
            let (reply, offline_ttl) = match offline {
                true => (ReplyTo::Event, Some(offline_ttl(raw.ttl_ms))),
                false => (
                    ReplyTo::Channel(reply_to),
                    raw.queue_if_offline
                        .unwrap_or(false)
                        .then(|| offline_ttl(raw.ttl_ms)),
                ),
            };
            Ok(Control::Command(CommandReq {
                id,
                rig,
                name,
                args,
                reply,
                offline_ttl,
            }))
        }
        _ => Err(bad("unknown control message type")),
    }
}

/// The hold time of a `queue_if_offline` command: its `ttl_ms` (default one hour), at most a day.
pub fn offline_ttl(ttl_ms: Option<u64>) -> std::time::Duration {
    let ttl = std::time::Duration::from_millis(ttl_ms.unwrap_or(3_600_000).max(1));
    ttl.min(crate::registry::offline::MAX_TTL)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Each message is one JSON object: serde takes a struct from an array of its fields too,
    /// and `["command","c1","r1",…]` ran as a command (review bb130).
    #[test]
    fn a_message_that_is_not_an_object_is_refused_however_its_fields_line_up() {
        let array = br#"["command","arr-1","r1",null,"from-array",{"k":1},"replies"]"#;
        let Err(bad) = parse(array, false) else {
            panic!("an array taken as a command");
        };
        assert!(bad.why.contains("not a JSON object"), "{}", bad.why);
        assert!(bad.reply_to.is_none());
        let object = br#"{"type":"command","id":"c1","rig_id":"r1","name":"n","args":{},"reply_to":"replies"}"#;
        assert!(matches!(parse(object, false), Ok(Control::Command(_))));
    }

    /// Brokers publish their canaries on their own channels; one on the broadcast channel is
    /// not taken for a twin's.
    #[test]
    fn a_canary_counts_on_a_brokers_own_channel_only() {
        let canary = br#"{"type":"canary","broker_id":"fe-a","instance":"forged"}"#;
        assert!(matches!(parse(canary, false), Ok(Control::Canary { .. })));
        assert!(parse(canary, true).is_err());
    }

    /// Broker to broker, on a broker's own channel only; a rig and boot it cannot parse are
    /// refused, as for an evict.
    #[test]
    fn a_session_merged_notice_names_a_rig_and_boot() {
        let ok = br#"{"type":"session_merged","rig_id":"r1","boot_id":"01890a5d-ac96-774b-bcce-b302099a8057"}"#;
        assert!(matches!(
            parse(ok, false),
            Ok(Control::Merged { ref rig, .. }) if rig.as_str() == "r1"
        ));
        assert!(parse(ok, true).is_err(), "not on the broadcast channel");
        assert!(parse(br#"{"type":"session_merged","rig_id":"r1"}"#, false).is_err());
        let bad_boot = br#"{"type":"session_merged","rig_id":"r1","boot_id":"nope"}"#;
        assert!(parse(bad_boot, false).is_err());
    }

    #[test]
    fn commands_kicks_evicts_broadcasts() {
        let c = parse(br#"{"type":"command","id":"c1","rig_id":"r1","name":"reboot","args":{},"reply_to":"x"}"#, false).unwrap();
        assert!(matches!(c, Control::Command(CommandReq { ref id, .. }) if id == "c1"));
        let k = parse(
            br#"{"type":"kick","id":"k","rig_id":"r1","reply_to":"x"}"#,
            false,
        )
        .unwrap();
        assert!(matches!(k, Control::Kick { .. }));
        let e = parse(
            br#"{"type":"evict","rig_id":"r1","boot_id":"01890a5d-ac96-774b-bcce-b302099a8057"}"#,
            false,
        )
        .unwrap();
        assert!(matches!(e, Control::Evict { .. }));
        let b = parse(
            br#"{"type":"command","id":"b","selector":{"lab":"a"},"name":"x","reply_to":"r"}"#,
            true,
        )
        .unwrap();
        assert!(matches!(b, Control::Broadcast { ref selector, .. } if selector.len() == 1));
    }

    /// A selector's values are strings as written: not serde_json's raw-value marker object
    /// (which a `Value` read as the string it holds), and not a key given twice (of which a
    /// map kept the last).
    #[test]
    fn a_selector_is_an_object_of_strings_each_key_once() {
        let broadcast = |selector: &str| {
            let msg = format!(
                r#"{{"type":"command","id":"b","selector":{selector},"name":"x","reply_to":"r"}}"#
            );
            parse(msg.as_bytes(), true).map_err(|bad| bad.why)
        };
        let Ok(Control::Broadcast { selector, .. }) = broadcast(r#"{"g":"x","a":"1"}"#) else {
            panic!("a plain selector");
        };
        assert_eq!(
            selector,
            [("a".into(), "1".into()), ("g".into(), "x".into())]
        );
        for (selector, why) in [
            (
                r#"{"g":{"$serde_json::private::RawValue":"\"x\""}}"#,
                "selector values must be strings",
            ),
            (r#"{"g":{"x":"y"}}"#, "selector values must be strings"),
            (r#"{"a":"1","a":"2"}"#, "a selector key given twice"),
            (r#""a=1""#, "selector must be an object"),
            (
                r#"{"a":"\udcff"}"#,
                "selector keys and values must be valid Unicode",
            ),
        ] {
            let got = broadcast(selector).err().unwrap_or_default();
            assert!(got.contains(why), "{selector}: {got}");
        }
        let wide: Vec<String> = (0..33).map(|i| format!(r#""k{i}":"v""#)).collect();
        let got = broadcast(&format!("{{{}}}", wide.join(","))).err();
        assert!(got.is_some_and(|why| why.contains("at most 32 labels")));
    }

    #[test]
    fn bad_messages_say_where_to_answer() {
        let bad = parse(
            br#"{"type":"command","id":"c1","rig_id":"bad id","name":"x","reply_to":"chan"}"#,
            false,
        )
        .unwrap_err();
        assert_eq!(bad.reply_to, Some(("c1".into(), "chan".into())));
        let bad = parse(
            br#"{"type":"command","id":"c","rig_id":"r","name":"x","args":[1],"reply_to":"chan"}"#,
            false,
        )
        .unwrap_err();
        assert!(bad.why.contains("args"));
        assert!(parse(b"garbage", false).unwrap_err().reply_to.is_none());
        // A field of the wrong type still gets its answer, with the id as control sent it.
        let bad = parse(
            br#"{"type":"command","id":7,"rig_id":"r1","name":"x","reply_to":"chan"}"#,
            false,
        )
        .unwrap_err();
        assert_eq!(bad.reply_to, Some(("7".into(), "chan".into())));
        assert_eq!(bad.rig.as_deref(), Some("r1"));
        for wrong in [
            r#""selector":["a"]"#,
            r#""ttl_ms":-1"#,
            r#""queue_if_offline":"yes""#,
        ] {
            let msg = format!(
                r#"{{"type":"command","id":"c9","rig_id":"r1","name":"x","reply_to":"chan",{wrong}}}"#
            );
            let bad = parse(msg.as_bytes(), true).unwrap_err();
            assert_eq!(bad.reply_to, Some(("c9".into(), "chan".into())), "{wrong}");
        }
        // null is absent, for either field.
        let nulls = br#"{"type":"command","id":"c9","rig_id":"r1","name":"x","reply_to":"chan","queue_if_offline":null,"ttl_ms":null}"#;
        assert!(parse(nulls, false).is_ok());
        // What breaks the message after its reply channel does not lose the answer: bad
        // UTF-8, a duplicated key, nesting past the parser's bound.
        let deep = format!(r#"{{"a":{}1{}}}"#, "[".repeat(5000), "]".repeat(5000));
        let broken: [Vec<u8>; 3] = [
            b"{\"type\":\"command\",\"id\":\"c3\",\"reply_to\":\"chan\",\"name\":\"x\xff\"}".to_vec(),
            br#"{"type":"command","id":"c3","reply_to":"chan","rig_id":"r1","rig_id":"r2","name":"x"}"#.to_vec(),
            format!(r#"{{"type":"command","id":"c3","reply_to":"chan","rig_id":"r1","name":"x","args":{deep}}}"#).into_bytes(),
        ];
        for msg in broken {
            let bad = parse(&msg, false).unwrap_err();
            let shown = String::from_utf8_lossy(&msg[..msg.len().min(90)]).into_owned();
            assert_eq!(bad.reply_to, Some(("c3".into(), "chan".into())), "{shown}");
        }
        // No usable reply channel: counted only.
        let bad = parse(br#"{"type":"command","id":"c","reply_to":[5]}"#, false).unwrap_err();
        assert!(bad.reply_to.is_none());
        // An oversized message whose id is a huge array: skipped, not built or echoed.
        let big = format!(
            r#"{{"type":"command","id":[{}0],"reply_to":"chan"}}"#,
            "0,".repeat(MAX_CONTROL)
        );
        let bad = parse(big.as_bytes(), false).unwrap_err();
        let (id, to) = bad.reply_to.expect("answered");
        assert!(id.len() < 64 && to == "chan", "{id}");
        assert!(parse(br#"{"type":"evict","rig_id":"r"}"#, true).is_err());
        let big = format!(
            r#"{{"type":"command","id":"c2","rig_id":"r","name":"x","args":{{"b":"{}"}},"reply_to":"chan"}}"#,
            "x".repeat(MAX_CONTROL)
        );
        let bad = parse(big.as_bytes(), false).unwrap_err();
        assert!(bad.why.contains("1 MiB"), "{}", bad.why);
        assert_eq!(bad.reply_to, Some(("c2".into(), "chan".into())));
    }

    /// Control matches replies and events by the id it chose: a command or kick without one
    /// is refused, not run under an id the broker made up, and its answer says `"id": null`.
    #[test]
    fn commands_and_kicks_without_an_id_are_refused() {
        for msg in [
            br#"{"type":"command","rig_id":"r1","name":"x","reply_to":"chan"}"#.as_slice(),
            br#"{"type":"command","id":"","rig_id":"r1","name":"x","reply_to":"chan"}"#,
            br#"{"type":"kick","rig_id":"r1","reply_to":"chan"}"#,
        ] {
            let bad = parse(msg, false).unwrap_err();
            assert!(bad.why.contains("needs an id"), "{}", bad.why);
            assert_eq!(bad.reply_to, Some((String::new(), "chan".into())));
        }
        let b = br#"{"type":"command","selector":{"lab":"a"},"name":"x","reply_to":"chan"}"#;
        assert!(parse(b, true).unwrap_err().why.contains("needs an id"));
        // Refused for another reason before it was parsed: still no id made up.
        let bad = parse(br#"{"type":"command","rig_id":7,"reply_to":"chan"}"#, false).unwrap_err();
        assert_eq!(bad.reply_to, Some((String::new(), "chan".into())));
    }

    /// A forwarded hold parses back to the same command, its args the very text control
    /// sent (a float printed again could come back a unit in the last place off).
    #[test]
    fn a_forwarded_hold_parses_back_with_its_args_as_sent() {
        let msg = r#"{"type":"command","id":"h","rig_id":"r1","name":"x","reply_to":"c","queue_if_offline":true,"args":{"rpm":6666666000000000000000000000000000000000000000000000000001588782656, "b" : [1.5e-7]}}"#;
        let Ok(Control::Command(req)) = parse(msg.as_bytes(), false) else {
            panic!("a command");
        };
        let out = forwarded_hold(&req.id, &req.rig, &req.name, &req.args, 5_000);
        let Ok(Control::Command(again)) = parse(&out, false) else {
            panic!("{}", String::from_utf8_lossy(&out));
        };
        assert_eq!(again.args.get(), req.args.get());
        assert_eq!(
            (&again.id, &again.rig, &again.name),
            (&req.id, &req.rig, &req.name)
        );
        assert!(matches!(again.reply, ReplyTo::Event));
        assert_eq!(again.offline_ttl, Some(offline_ttl(Some(5_000))));
    }

    /// A broadcast copies its id into every matched rig's request and each reply: one message
    /// with a 1 MiB id to 10,000 rigs would be gigabytes.
    #[test]
    fn ids_and_reply_channels_past_256_bytes_are_refused() {
        let msg = |id: &str, to: &str| {
            format!(
                r#"{{"type":"command","id":"{id}","selector":{{}},"name":"x","reply_to":"{to}"}}"#
            )
        };
        let at = "i".repeat(CONTROL_NAME_MAX);
        assert!(parse(msg(&at, &"c".repeat(CONTROL_NAME_MAX)).as_bytes(), true).is_ok());
        let long = format!("{at}i");
        let bad = parse(msg(&long, "chan").as_bytes(), true).unwrap_err();
        assert!(bad.why.contains("id longer than 256"), "{}", bad.why);
        assert_eq!(bad.reply_to, Some((long, "chan".into())), "answered once");
        let bad = parse(
            msg("c1", &"c".repeat(CONTROL_NAME_MAX + 1)).as_bytes(),
            false,
        )
        .unwrap_err();
        assert!(bad.why.contains("reply_to longer than 256"), "{}", bad.why);
        assert_eq!(bad.reply_to, None, "no answer to a channel it refuses");
        // The same for a message refused before it is parsed, for its size.
        let huge = format!(
            r#"{{"type":"command","id":"c2","reply_to":"{}","args":{{"b":"{}"}}}}"#,
            "c".repeat(CONTROL_NAME_MAX + 1),
            "x".repeat(MAX_CONTROL)
        );
        assert_eq!(parse(huge.as_bytes(), false).unwrap_err().reply_to, None);
    }
}
