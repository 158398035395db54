//! A command's `args`: the JSON text control sent, kept as text and shared.
//!
//! A broadcast hands the same args to every matched rig, and a held command waits with its
//! args for hours; as a parsed `serde_json::Value` each copy would cost up to 16 times its text
//! (32 bytes per array element of 2), and the byte bounds, which count text, would be off by
//! as much. As shared text, a copy costs a pointer, a bound counts what is held, and a rig's
//! frame is written from it without serializing again.

use std::borrow::Cow;
use std::fmt;
use std::sync::Arc;

use serde::de::{self, MapAccess, SeqAccess, Visitor};
use serde::{Deserialize, Deserializer, Serialize, Serializer};
use serde_json::value::RawValue;
use serde_json::Value;

/// The object key by which serde_json's `raw_value` feature marks a value as JSON text: a
/// `Value` parsed with that feature on reads an object whose first key it is as the JSON its
/// string holds. Args holding it would be checked as one thing, and read as another by a rig
/// parsing the same way, or by this broker once it has re-serialized the args with their keys
/// sorted (a held command forwarded to the rig's broker, which then refused it).
const RAW_VALUE_KEY: &str = "$serde_json::private::RawValue";

/// A command's args: a JSON object's text (or `null` in a stub that needs none).
#[derive(Clone)]
pub struct Args(Arc<RawValue>);

impl Args {
    /// `{}`, for a command sent without args.
    pub fn empty() -> Args {
        Args::from_value(&Value::Object(serde_json::Map::new()))
    }

    /// `null`: the args of a record that keeps none.
    pub fn null() -> Args {
        Args::from_value(&Value::Null)
    }

    /// The args as text, from a parsed value.
    pub fn from_value(v: &Value) -> Args {
        match serde_json::value::to_raw_value(v) {
            Ok(raw) => Args(Arc::from(raw)),
            // Only a map with non-string keys fails, which a `Value` cannot hold.
            Err(_) => Args(Arc::from(RawValue::NULL.to_owned())),
        }
    }

    /// The args of a control message or request, which must be an object that parses.
    pub fn object(raw: Box<RawValue>) -> Option<Args> {
        Args::checked(raw).ok()
    }

    /// As [`Args::object`], with why they were refused, for control's reply.
    pub fn checked(raw: Box<RawValue>) -> Result<Args, String> {
        // The parser hands over the value's own text, which starts at its first byte. It only
        // skims that text, though: lone surrogates, numbers out of range and nesting past
        // serde_json's limit pass, and a rig parsing them would fail on the frame. So they
        // are parsed once here, the tree dropped at once (as short-lived as the old parse).
        if !raw.get().starts_with('{') {
            return Err("args must be an object".into());
        }
        // A rig gets them one level down, inside its command: as deep as the parser takes
        // here, the frame is one level past what a rig's parser takes.
        let deepest = crate::protocol::MAX_DEPTH - 1;
        if crate::protocol::nests_deeper_than(raw.get().as_bytes(), deepest) {
            return Err(format!("args nest deeper than {deepest} levels"));
        }
        match serde_json::from_str::<Checked>(raw.get()) {
            Ok(Checked) => Ok(Args(Arc::from(raw))),
            Err(e) => Err(format!("args are not JSON a rig can parse: {e}")),
        }
    }

    /// The JSON text.
    pub fn get(&self) -> &str {
        self.0.get()
    }

    /// Bytes of the text.
    pub fn len(&self) -> usize {
        self.0.get().len()
    }

    /// Never: a JSON value's text has at least one byte.
    pub fn is_empty(&self) -> bool {
        self.0.get().is_empty()
    }

    /// For writing into a message as it is.
    pub fn raw(&self) -> &RawValue {
        &self.0
    }
}

/// Any JSON value, parsed as a rig would parse it (strings decoded, numbers in range, nesting
/// within serde_json's limit) and dropped as it goes, refusing [`RAW_VALUE_KEY`] as a key.
struct Checked;

impl<'de> Deserialize<'de> for Checked {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Checked, D::Error> {
        d.deserialize_any(Checked)
    }
}

impl<'de> Visitor<'de> for Checked {
    type Value = Checked;

    fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("any JSON value")
    }

    fn visit_bool<E>(self, _: bool) -> Result<Checked, E> {
        Ok(Checked)
    }

    fn visit_i64<E>(self, _: i64) -> Result<Checked, E> {
        Ok(Checked)
    }

    fn visit_u64<E>(self, _: u64) -> Result<Checked, E> {
        Ok(Checked)
    }

    fn visit_f64<E>(self, _: f64) -> Result<Checked, E> {
        Ok(Checked)
    }

    fn visit_str<E>(self, _: &str) -> Result<Checked, E> {
        Ok(Checked)
    }

    fn visit_unit<E>(self) -> Result<Checked, E> {
        Ok(Checked)
    }

    fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<Checked, A::Error> {
        while seq.next_element::<Checked>()?.is_some() {}
        Ok(Checked)
    }

    fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<Checked, A::Error> {
        while let Some(key) = map.next_key::<Cow<'de, str>>()? {
            if key == RAW_VALUE_KEY {
                return Err(de::Error::custom(format!(
                    "{RAW_VALUE_KEY:?} is not a key args may use"
                )));
            }
            map.next_value::<Checked>()?;
        }
        Ok(Checked)
    }
}

impl Serialize for Args {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        self.0.serialize(s)
    }
}

impl<'de> Deserialize<'de> for Args {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Args, D::Error> {
        Box::<RawValue>::deserialize(d).map(|raw| Args(Arc::from(raw)))
    }
}

impl PartialEq for Args {
    fn eq(&self, other: &Args) -> bool {
        self.get() == other.get()
    }
}

impl fmt::Debug for Args {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.get())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The deepest args taken still parse inside the command a rig is sent, one level deeper;
    /// one level more is refused.
    #[test]
    fn the_deepest_args_taken_parse_inside_their_command() {
        let args = |depth: usize| {
            let text = format!("{}1{}", r#"{"a":"#.repeat(depth), "}".repeat(depth));
            Args::checked(RawValue::from_string(text).unwrap_or_else(|_| panic!("{depth}")))
        };
        let deepest = (1..200)
            .take_while(|&d| args(d).is_ok())
            .last()
            .unwrap_or(0);
        let taken = args(deepest).unwrap_or_else(|e| panic!("{e}"));
        let frame = crate::protocol::encode_command(1, crate::ids::Seq(1), "c", "n", &taken.0);
        assert!(
            serde_json::from_slice::<serde_json::Value>(&frame).is_ok(),
            "args {deepest} deep make a command no rig can parse"
        );
        assert_eq!(
            args(deepest + 1).err().as_deref(),
            Some(format!("args nest deeper than {deepest} levels").as_str())
        );
    }

    #[test]
    fn args_keep_their_text_and_only_objects_are_args() {
        let raw = |s: &str| RawValue::from_string(s.to_string()).unwrap_or_else(|_| panic!("{s}"));
        let a = Args::object(raw(r#"{"b": [1, 2],"a":"x"}"#)).map(|a| a.get().to_string());
        assert_eq!(a.as_deref(), Some(r#"{"b": [1, 2],"a":"x"}"#));
        assert!(Args::object(raw("[1]")).is_none());
        assert!(Args::object(raw("\"{\"")).is_none());
        // What the skimming parser lets through and a rig's parser would not.
        let deep = format!("{{\"a\":{}1{}}}", "[".repeat(200), "]".repeat(200));
        for bad in [r#"{"a":"\ud800"}"#, r#"{"a":1e400}"#, deep.as_str()] {
            assert!(Args::object(raw(bad)).is_none(), "{bad}");
        }
        let why = |s: &str| Args::checked(raw(s)).err().unwrap_or_default();
        assert_eq!(why(&deep), "args nest deeper than 126 levels");
        assert_eq!(why("[1]"), "args must be an object");
        assert!(why(r#"{"a":1e400}"#)
            .starts_with("args are not JSON a rig can parse: number out of range"));
        // serde_json's raw-value marker, at any depth and however escaped (fuzzing found args
        // passing as an object that a re-parse read as `[1]`).
        for marked in [
            r#"{"a":1,"$serde_json::private::RawValue":"x"}"#,
            r#"{"$serde_json::private::RawValue":"[1]"}"#,
            r#"{"a":[{"$serde_json::private::RawValue":"1"}]}"#,
            r#"{"\u0024serde_json::private::RawValue":"[1]"}"#,
        ] {
            assert!(
                why(marked).contains("is not a key args may use"),
                "{marked}: {}",
                why(marked)
            );
        }
        assert!(Args::object(raw(
            r#"{"$serde_json":1,"k":{"a":null,"b":[true,-1,2.5,"é"]}}"#
        ))
        .is_some());
        assert_eq!(Args::empty().get(), "{}");
        // Inside a message, written as they came; read back, the same text.
        #[derive(Serialize, Deserialize)]
        struct Msg {
            args: Args,
        }
        let parsed: Msg = serde_json::from_str(r#"{"args": {"z":1, "a" : 2}}"#).unwrap();
        assert_eq!(parsed.args.get(), r#"{"z":1, "a" : 2}"#);
        let text = serde_json::to_string(&parsed).unwrap();
        assert_eq!(text, r#"{"args":{"z":1, "a" : 2}}"#);
        let back: Msg = serde_json::from_str(&text).unwrap();
        assert_eq!(back.args, parsed.args);
        // A copy shares the text.
        let copy = parsed.args.clone();
        assert!(std::ptr::eq(copy.get(), parsed.args.get()));
    }
}
