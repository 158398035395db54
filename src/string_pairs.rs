//! A JSON object whose values must all be strings, read as it was written: a hello's `labels`
//! and a broadcast's `selector`. Both come from outside, and both were read through
//! serde_json's `Value`, which with the `raw_value` feature reads an object keyed
//! `$serde_json::private::RawValue` as the JSON its string holds (so `{"g":{"$serde_json::
//! private::RawValue":"\"x\""}}` passed for `g = "x"`), keeps only the last of a key given
//! twice, and built every entry of an object of a million before its size was checked.

use serde::de::{DeserializeSeed, Deserializer, IgnoredAny, MapAccess, Visitor};
use serde_json::value::RawValue;

/// Why an object was refused.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Refused {
    /// Not a JSON object (or not JSON at all).
    NotAnObject,
    /// A value that is not a string.
    NotAString,
    /// A key or value that is a JSON string but no Unicode text: a lone surrogate escape.
    NotUnicode,
    /// More entries than allowed.
    TooMany,
    /// A key given twice: which of the two values was meant is a guess.
    Twice,
}

/// The entries of the object `text`, sorted by key; at most `most` of them. Entries past
/// `most` are skimmed, not built, so the refusal costs no more memory than the text.
pub fn string_pairs(text: &str, most: usize) -> Result<Vec<(String, String)>, Refused> {
    let mut de = serde_json::Deserializer::from_str(text);
    let read = Capped(most).deserialize(&mut de).and_then(|entries| {
        de.end()?;
        Ok(entries)
    });
    let (raw, over) = match read {
        Ok(read) => read,
        // The text was skimmed as JSON before it got here: what fails only once its strings
        // are built is a key no Rust string holds.
        Err(e) if e.is_syntax() => return Err(Refused::NotUnicode),
        Err(_) => return Err(Refused::NotAnObject),
    };
    if over {
        return Err(Refused::TooMany);
    }
    let mut pairs = Vec::with_capacity(raw.len());
    for (k, v) in raw {
        let text = v.get();
        if !text.starts_with('"') {
            return Err(Refused::NotAString);
        }
        let Ok(v) = serde_json::from_str::<String>(text) else {
            return Err(Refused::NotUnicode);
        };
        pairs.push((k, v));
    }
    pairs.sort();
    if pairs.windows(2).any(|w| w[0].0 == w[1].0) {
        return Err(Refused::Twice);
    }
    Ok(pairs)
}

/// Reads up to `.0` entries, each value kept as its text; says whether there were more.
struct Capped(usize);

type Entries = (Vec<(String, Box<RawValue>)>, bool);

impl<'de> DeserializeSeed<'de> for Capped {
    type Value = Entries;
    fn deserialize<D: Deserializer<'de>>(self, d: D) -> Result<Entries, D::Error> {
        d.deserialize_map(self)
    }
}

impl<'de> Visitor<'de> for Capped {
    type Value = Entries;
    fn expecting(&self, f: &mut std::fmt::Formatter) -> std::fmt::Result {
        f.write_str("an object")
    }
    fn visit_map<A: MapAccess<'de>>(self, mut m: A) -> Result<Entries, A::Error> {
        let mut out = Vec::new();
        let mut over = false;
        loop {
            if out.len() < self.0 {
                match m.next_entry::<String, Box<RawValue>>()? {
                    Some(entry) => out.push(entry),
                    None => break,
                }
            } else {
                match m.next_entry::<IgnoredAny, IgnoredAny>()? {
                    Some(_) => over = true,
                    None => break,
                }
            }
        }
        Ok((out, over))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn strings_are_kept_sorted_and_anything_else_is_refused_by_name() {
        assert_eq!(
            string_pairs(r#"{"b":"2","a":"1","":""}"#, 32),
            Ok(vec![
                ("".into(), "".into()),
                ("a".into(), "1".into()),
                ("b".into(), "2".into())
            ])
        );
        assert_eq!(string_pairs("{}", 32), Ok(vec![]));
        assert_eq!(
            string_pairs(r#"{"é":"\u00e9\ud83d\ude00"}"#, 32),
            Ok(vec![("é".into(), "é😀".into())])
        );
        for (text, why) in [
            ("[]", Refused::NotAnObject),
            (r#""x""#, Refused::NotAnObject),
            ("1", Refused::NotAnObject),
            (r#"{"a":1}"#, Refused::NotAString),
            (r#"{"a":null}"#, Refused::NotAString),
            (r#"{"a":{"x":"y"}}"#, Refused::NotAString),
            (r#"{"a":["x"]}"#, Refused::NotAString),
            (r#"{"a":"\udcff"}"#, Refused::NotUnicode),
            (r#"{"\ud83d":"x"}"#, Refused::NotUnicode),
            (r#"{"a":"1","a":"2"}"#, Refused::Twice),
            (r#"{"a":"1","\u0061":"1"}"#, Refused::Twice),
        ] {
            assert_eq!(string_pairs(text, 32), Err(why), "{text}");
        }
    }

    /// The marker by which serde_json's `raw_value` feature reads an object as the JSON its
    /// string holds: as a value it is an object, as a key only a string.
    #[test]
    fn serde_jsons_raw_value_marker_is_an_object_as_a_value_and_a_string_as_a_key() {
        assert_eq!(
            string_pairs(r#"{"g":{"$serde_json::private::RawValue":"\"x\""}}"#, 32),
            Err(Refused::NotAString)
        );
        assert_eq!(
            string_pairs(r#"{"$serde_json::private::RawValue":"\"x\""}"#, 32),
            Ok(vec![(
                "$serde_json::private::RawValue".into(),
                "\"x\"".into()
            )])
        );
    }

    #[test]
    fn entries_past_the_bound_are_skimmed_and_refused() {
        let object = |n: usize| {
            let entries: Vec<String> = (0..n).map(|i| format!(r#""k{i}":"v""#)).collect();
            format!("{{{}}}", entries.join(","))
        };
        assert_eq!(string_pairs(&object(32), 32).map(|p| p.len()), Ok(32));
        assert_eq!(string_pairs(&object(33), 32), Err(Refused::TooMany));
        assert_eq!(string_pairs(&object(100_000), 32), Err(Refused::TooMany));
    }
}
