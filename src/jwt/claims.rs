//! What a verified token carries: [`Claims`] and the [`Scope`] that gates commands and
//! emitted classes, plus the claim value shapes (`NumericDate`, string-or-array) they are read
//! from. Apart because the rest of the broker holds and consults these long after the token
//! itself was checked, and never needs the verifier to do so.

use serde::Deserialize;

use super::JwtError;

/// Most scope entries kept; more is a malformed token.
pub const MAX_SCOPE_ENTRIES: usize = 256;

/// What a verified token grants.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Claims {
    /// `sub`, if any: who the token was issued to, for logs.
    pub sub: Option<String>,
    /// `exp`, Unix seconds: the connection may be closed or re-authenticated after it.
    pub exp: u64,
    /// `scope`: the commands the rig may receive and the classes it may emit.
    pub scope: Scope,
    /// `rig_id`, if any: the only rig id this token may say hello as (4403 otherwise).
    pub rig_id: Option<String>,
}

/// The `scope` claim: a space-separated string or an array of strings (whose entries may hold
/// spaces too). Entries: `cmd:NAME` or a bare `NAME` (the rig may receive command NAME),
/// `cmd:*` or `*` (any command), `emit:CLASS` (it may send messages of CLASS), `emit:*`.
/// No `scope` claim grants nothing. Command names and classes compare exactly.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Scope {
    all_commands: bool,
    commands: Vec<String>,
    all_emits: bool,
    emits: Vec<String>,
}

impl Scope {
    /// A scope that allows everything: what a connection without a token runs with.
    pub fn all() -> Scope {
        Scope {
            all_commands: true,
            all_emits: true,
            ..Scope::default()
        }
    }

    /// Parses scope entries (empty ones are skipped).
    pub(super) fn parse<'a>(entries: impl Iterator<Item = &'a str>) -> Result<Scope, JwtError> {
        let mut scope = Scope::default();
        for (i, entry) in entries.filter(|e| !e.is_empty()).enumerate() {
            if i >= MAX_SCOPE_ENTRIES {
                return Err(JwtError::Malformed("too many scope entries"));
            }
            let (all, list, name) = match entry.strip_prefix("emit:") {
                Some(class) => (&mut scope.all_emits, &mut scope.emits, class),
                None => {
                    let name = entry.strip_prefix("cmd:").unwrap_or(entry);
                    (&mut scope.all_commands, &mut scope.commands, name)
                }
            };
            match name {
                "" => {}
                "*" => *all = true,
                name if !list.iter().any(|have| have == name) => list.push(name.to_owned()),
                _ => {}
            }
        }
        Ok(scope)
    }

    /// May the rig receive command `name`? Otherwise it is refused with error `forbidden`.
    pub fn allows_command(&self, name: &str) -> bool {
        self.all_commands || self.commands.iter().any(|c| c == name)
    }

    /// May the rig emit messages of `class`?
    pub fn allows_emit(&self, class: &str) -> bool {
        self.all_emits || self.emits.iter().any(|c| c == class)
    }
}

/// A claim that is a string or an array of strings.
#[derive(Deserialize)]
#[serde(untagged)]
pub(super) enum OneOrMany {
    One(String),
    Many(Vec<String>),
}

impl OneOrMany {
    pub(super) fn iter(&self) -> impl Iterator<Item = &str> {
        let slice = match self {
            OneOrMany::One(one) => std::slice::from_ref(one),
            OneOrMany::Many(many) => many.as_slice(),
        };
        slice.iter().map(String::as_str)
    }
}

/// A NumericDate (RFC 7519 §2): non-negative seconds, fractions truncated.
pub(super) fn numeric_date(
    n: Option<&serde_json::Number>,
    name: &'static str,
) -> Result<Option<u64>, JwtError> {
    let Some(n) = n else { return Ok(None) };
    if let Some(secs) = n.as_u64() {
        return Ok(Some(secs));
    }
    match n.as_f64() {
        // `as` saturates at u64::MAX for huge values: far future, still a valid date.
        Some(f) if f.is_finite() && f >= 0.0 => Ok(Some(f as u64)),
        _ => Err(JwtError::Malformed(match name {
            "exp" => "exp is not a non-negative number",
            _ => "nbf is not a non-negative number",
        })),
    }
}

#[cfg(test)]
mod tests {
    use super::super::testing::{claims, now, setup, token};
    use super::*;

    #[test]
    fn scope_entries() {
        let parse = |s: &str| Scope::parse(s.split(' ')).expect("scope");
        let s = parse("cmd:reboot  status emit:event cmd: emit:");
        assert!(s.allows_command("reboot") && s.allows_command("status"));
        assert!(!s.allows_command("event") && !s.allows_command("") && !s.allows_command("Reboot"));
        assert!(s.allows_emit("event") && !s.allows_emit("reboot"));
        let s = parse("cmd:* emit:*");
        assert!(s.allows_command("anything") && s.allows_emit("anything"));
        let s = parse("*");
        assert!(s.allows_command("x") && !s.allows_emit("x"));
        assert!(!Scope::default().allows_command("x") && !Scope::default().allows_emit("x"));
        assert!(Scope::all().allows_command("x") && Scope::all().allows_emit("x"));
        let many = vec!["a"; MAX_SCOPE_ENTRIES + 1].join(" ");
        assert!(Scope::parse(many.split(' ')).is_err());

        let (_keys, ed, _es, v) = setup("scope");
        let h = r#"{"alg":"EdDSA"}"#;
        let arr = token(
            h,
            &claims(r#","scope":["cmd:reboot emit:log","emit:metrics"]"#),
            &ed,
        );
        let c = v.verify(&arr, now()).expect("array scope");
        assert!(c.scope.allows_command("reboot") && c.scope.allows_emit("log"));
        assert!(c.scope.allows_emit("metrics") && !c.scope.allows_command("metrics"));
        let none = v
            .verify(&token(h, &claims(""), &ed), now())
            .expect("no scope");
        assert_eq!(none.scope, Scope::default());
    }
}
