//! Short-lived JWTs on the upgrade request (`Authorization: Bearer …`), verified locally.
//!
//! Small and strict (RFC 7515 compact JWS, RFC 7519 claims, RFC 8037 EdDSA):
//! - Only `EdDSA` (Ed25519) and `ES256` (P-256, signature as the fixed 64-byte `r || s`,
//!   RFC 7518 §3.4). `none`, `HS*`, `RS*` and anything else: [`JwtError::UnsupportedAlg`]. The
//!   `alg` must match the key's type: an ES256 header never gets near an Ed25519 key.
//! - Keys are configured PEM public keys, never taken from the token (`jwk`, `jku`, `x5u` are
//!   ignored). With a `kid`, the key of that id (the key file's stem) must exist; without, every
//!   key of the `alg`'s type is tried.
//! - The signature is checked before the claims are even parsed. Then `exp` is required,
//!   `nbf` honoured, both with [`JwtVerifier::leeway`]; `aud`, when present, must name the
//!   configured audience (RFC 7519 §4.1.3). A `crit` header is refused: we implement no
//!   extension. Tokens longer than [`MAX_TOKEN_LEN`] are refused unread.
//! - Nothing here panics on input; every error maps to HTTP 401 ([`JwtError::status`]).
//!
//! Called by `worker/conn.rs` at the upgrade; the [`Claims`] it returns ride with the
//! connection, and [`Scope`] gates each command before it is written to the rig (error
//! `forbidden`) and each message class the rig emits.
//!
//! Files: this one holds the verifier (header, key choice, signature, then the claims'
//! times and audience); `keys.rs` loads the configured PEM keys; `claims.rs` is what a
//! verified token grants ([`Claims`], [`Scope`]); `error.rs` is [`JwtError`]; `bearer.rs`
//! takes the token out of the `Authorization` header; `testing.rs` signs tokens for the tests.

mod bearer;
mod claims;
mod error;
mod keys;
#[cfg(test)]
mod testing;

use std::path::PathBuf;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use base64::engine::general_purpose::URL_SAFE_NO_PAD;
use base64::Engine;
use ring::signature::{UnparsedPublicKey, VerificationAlgorithm};
use serde::Deserialize;

use claims::{numeric_date, OneOrMany};
use keys::{key_error, load_key, Key};

pub use bearer::bearer;
pub use claims::{Claims, Scope, MAX_SCOPE_ENTRIES};
pub use error::JwtError;

/// Longest token read, in bytes: a short-lived rig token is a few hundred.
pub const MAX_TOKEN_LEN: usize = 8 * 1024;
/// Default clock-skew allowance on `exp` and `nbf`.
pub const DEFAULT_LEEWAY: Duration = Duration::from_secs(30);

/// The algorithms accepted, each tied to one key type.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Alg {
    EdDsa,
    Es256,
}

impl Alg {
    fn name(self) -> &'static str {
        match self {
            Alg::EdDsa => "EdDSA",
            Alg::Es256 => "ES256",
        }
    }

    fn ring(self) -> &'static dyn VerificationAlgorithm {
        match self {
            Alg::EdDsa => &ring::signature::ED25519,
            Alg::Es256 => &ring::signature::ECDSA_P256_SHA256_FIXED,
        }
    }
}

/// Verifies rig tokens against a fixed set of public keys.
#[derive(Debug)]
pub struct JwtVerifier {
    keys: Vec<Key>,
    leeway: Duration,
    audience: Option<String>,
}

impl JwtVerifier {
    /// Loads one PEM `PUBLIC KEY` (SubjectPublicKeyInfo, Ed25519 or P-256) per file; its `kid`
    /// is the file stem (`keys/ops-2026.pem` → `ops-2026`). A file with no public key, more
    /// than one, a private key, or a key of another type is an error naming the file. Leeway
    /// [`DEFAULT_LEEWAY`], no audience.
    pub fn from_pem_files(paths: &[PathBuf]) -> Result<JwtVerifier, JwtError> {
        let mut keys: Vec<Key> = Vec::with_capacity(paths.len());
        for path in paths {
            let key = load_key(path)?;
            if keys.iter().any(|k| k.kid.is_some() && k.kid == key.kid) {
                return Err(key_error(path, "another key file has the same stem (kid)"));
            }
            keys.push(key);
        }
        if keys.is_empty() {
            return Err(JwtError::Key {
                path: PathBuf::new(),
                detail: "no JWT key files given".into(),
            });
        }
        Ok(JwtVerifier {
            keys,
            leeway: DEFAULT_LEEWAY,
            audience: None,
        })
    }

    /// Replaces the clock-skew allowance on `exp` and `nbf`.
    pub fn with_leeway(mut self, leeway: Duration) -> JwtVerifier {
        self.leeway = leeway;
        self
    }

    /// Sets the audience a token's `aud` must name when it has one.
    pub fn with_audience(mut self, audience: impl Into<String>) -> JwtVerifier {
        self.audience = Some(audience.into());
        self
    }

    /// The clock-skew allowance in force.
    pub fn leeway(&self) -> Duration {
        self.leeway
    }

    /// Verifies `token` at time `now`: header, key choice, signature, then `exp`, `nbf`, `aud`.
    pub fn verify(&self, token: &str, now: SystemTime) -> Result<Claims, JwtError> {
        if token.len() > MAX_TOKEN_LEN {
            return Err(JwtError::Malformed("token too long"));
        }
        let mut parts = token.split('.');
        let (Some(header_b64), Some(payload_b64), Some(sig_b64), None) =
            (parts.next(), parts.next(), parts.next(), parts.next())
        else {
            return Err(JwtError::Malformed("not three dot-separated parts"));
        };
        let header: Header = json_object(&b64(header_b64)?).ok_or(JwtError::Malformed(
            "header is not the expected JSON object",
        ))?;
        if header.crit.is_some() {
            return Err(JwtError::Malformed(
                "crit header: no extension is supported",
            ));
        }
        let alg = match header.alg.as_str() {
            "EdDSA" => Alg::EdDsa,
            "ES256" => Alg::Es256,
            other => return Err(JwtError::UnsupportedAlg(other.chars().take(32).collect())),
        };
        let signature = b64(sig_b64)?;
        // The signing input is the ASCII of the first two parts as sent (RFC 7515 §5.2).
        let signed = token
            .as_bytes()
            .get(..header_b64.len() + 1 + payload_b64.len())
            .ok_or(JwtError::Malformed("not three dot-separated parts"))?;
        self.check_signature(alg, header.kid, signed, &signature)?;

        let payload: Payload = json_object(&b64(payload_b64)?).ok_or(JwtError::Malformed(
            "claims are not the expected JSON object",
        ))?;
        self.check_claims(payload, now)
    }

    fn check_signature(
        &self,
        alg: Alg,
        kid: Option<String>,
        signed: &[u8],
        signature: &[u8],
    ) -> Result<(), JwtError> {
        let verifies =
            |key: &Key| UnparsedPublicKey::new(alg.ring(), &key.public).verify(signed, signature);
        match kid {
            Some(kid) => {
                let Some(key) = self.keys.iter().find(|k| k.kid.as_deref() == Some(&kid)) else {
                    return Err(JwtError::UnknownKey(Some(kid)));
                };
                if key.alg != alg {
                    return Err(JwtError::AlgMismatch {
                        alg: alg.name(),
                        kid,
                    });
                }
                verifies(key).map_err(|_| JwtError::BadSignature)
            }
            None => {
                let mut candidates = self.keys.iter().filter(|k| k.alg == alg).peekable();
                if candidates.peek().is_none() {
                    return Err(JwtError::UnknownKey(None));
                }
                match candidates.any(|k| verifies(k).is_ok()) {
                    true => Ok(()),
                    false => Err(JwtError::BadSignature),
                }
            }
        }
    }

    fn check_claims(&self, payload: Payload, now: SystemTime) -> Result<Claims, JwtError> {
        let now = now
            .duration_since(UNIX_EPOCH)
            .map(|d| d.as_secs())
            .unwrap_or(0);
        let leeway = self.leeway.as_secs();
        let exp = numeric_date(payload.exp.as_ref(), "exp")?
            .ok_or(JwtError::Malformed("exp is required"))?;
        if now >= exp.saturating_add(leeway) {
            return Err(JwtError::Expired { exp, now });
        }
        if let Some(nbf) = numeric_date(payload.nbf.as_ref(), "nbf")? {
            if now.saturating_add(leeway) < nbf {
                return Err(JwtError::NotYetValid { nbf, now });
            }
        }
        // With an audience configured a token must name it; a token for nobody in particular
        // is no token for this broker. Without one, a token that names any audience is
        // someone else's.
        let accepted = match (&payload.aud, &self.audience) {
            (Some(aud), Some(ours)) => aud.iter().any(|a| a == ours),
            (None, Some(_)) | (Some(_), None) => false,
            (None, None) => true,
        };
        if !accepted {
            return Err(JwtError::WrongAudience);
        }
        let scope = match payload.scope {
            Some(entries) => Scope::parse(entries.iter().flat_map(|e| e.split(' ')))?,
            None => Scope::default(),
        };
        Ok(Claims {
            sub: payload.sub,
            exp,
            scope,
            rig_id: payload.rig_id,
        })
    }
}

#[derive(Deserialize)]
struct Header {
    alg: String,
    #[serde(default)]
    kid: Option<String>,
    #[serde(default)]
    crit: Option<serde_json::Value>,
}

#[derive(Deserialize)]
struct Payload {
    #[serde(default)]
    exp: Option<serde_json::Number>,
    #[serde(default)]
    nbf: Option<serde_json::Number>,
    #[serde(default)]
    sub: Option<String>,
    #[serde(default)]
    aud: Option<OneOrMany>,
    #[serde(default)]
    scope: Option<OneOrMany>,
    #[serde(default)]
    rig_id: Option<String>,
}

/// `bytes` as `T` if they are one JSON object (serde would also take an array for a struct)
/// with no field twice (serde's derive refuses duplicates).
fn json_object<T: serde::de::DeserializeOwned>(bytes: &[u8]) -> Option<T> {
    crate::json_text::opens_an_object(bytes)
        .then(|| serde_json::from_slice(bytes).ok())
        .flatten()
}

fn b64(part: &str) -> Result<Vec<u8>, JwtError> {
    URL_SAFE_NO_PAD
        .decode(part)
        .map_err(|_| JwtError::Malformed("a part is not unpadded base64url"))
}

#[cfg(test)]
mod tests {
    use super::testing::{claims, now, setup, token, Keys, Signer, NOW};
    use super::*;

    #[test]
    fn valid_eddsa_and_es256_tokens() {
        let (_keys, ed, es, v) = setup("valid");
        let scope = r#","scope":"cmd:reboot emit:event""#;
        for (header, signer) in [
            (r#"{"alg":"EdDSA","kid":"ed","typ":"JWT"}"#, &ed),
            (r#"{"alg":"EdDSA"}"#, &ed),
            (r#"{"alg":"ES256","kid":"es"}"#, &es),
            (r#"{"alg":"ES256"}"#, &es),
        ] {
            let c = v
                .verify(&token(header, &claims(scope), signer), now())
                .expect(header);
            assert_eq!(c.sub.as_deref(), Some("rig-0001"));
            assert_eq!(c.rig_id.as_deref(), Some("rig-0001"));
            assert_eq!(c.exp, NOW + 300);
            assert!(c.scope.allows_command("reboot") && !c.scope.allows_command("wipe"));
            assert!(c.scope.allows_emit("event") && !c.scope.allows_emit("result"));
        }
    }

    #[test]
    fn exp_and_nbf_with_leeway() {
        let (_keys, ed, _es, v) = setup("times");
        let h = r#"{"alg":"EdDSA"}"#;
        let at = |claims: String| v.verify(&token(h, &claims, &ed), now());
        let err = at(format!(r#"{{"exp":{}}}"#, NOW - 31)).expect_err("expired");
        assert_eq!(
            err,
            JwtError::Expired {
                exp: NOW - 31,
                now: NOW
            }
        );
        at(format!(r#"{{"exp":{}}}"#, NOW - 29)).expect("inside leeway");
        at(format!(r#"{{"exp":{}.5}}"#, NOW + 10)).expect("fractional exp");
        let err = at(format!(r#"{{"exp":{},"nbf":{}}}"#, NOW + 300, NOW + 31)).expect_err("nbf");
        assert_eq!(
            err,
            JwtError::NotYetValid {
                nbf: NOW + 31,
                now: NOW
            }
        );
        at(format!(r#"{{"exp":{},"nbf":{}}}"#, NOW + 300, NOW + 29)).expect("nbf in leeway");
        assert_eq!(at("{}".into()), Err(JwtError::Malformed("exp is required")));
        assert!(matches!(
            at(r#"{"exp":"soon"}"#.into()),
            Err(JwtError::Malformed(_))
        ));
        assert!(matches!(
            at(r#"{"exp":-1}"#.into()),
            Err(JwtError::Malformed(_))
        ));
        let strict = JwtVerifier {
            leeway: Duration::ZERO,
            ..v
        };
        let tok = token(h, &format!(r#"{{"exp":{NOW}}}"#), &ed);
        assert!(matches!(
            strict.verify(&tok, now()),
            Err(JwtError::Expired { .. })
        ));
    }

    #[test]
    fn bad_signatures() {
        let (_keys, ed, es, v) = setup("badsig");
        let good = token(r#"{"alg":"EdDSA"}"#, &claims(""), &ed);
        let (body, sig) = good.rsplit_once('.').expect("dot");
        let mut sig = sig.to_owned().into_bytes();
        sig[3] = if sig[3] == b'A' { b'B' } else { b'A' };
        let forged = format!("{body}.{}", String::from_utf8(sig).expect("ascii"));
        assert_eq!(v.verify(&forged, now()), Err(JwtError::BadSignature));

        let stranger = Signer::ed();
        let tok = token(r#"{"alg":"EdDSA","kid":"ed"}"#, &claims(""), &stranger);
        assert_eq!(v.verify(&tok, now()), Err(JwtError::BadSignature));
        let tok = token(r#"{"alg":"ES256"}"#, &claims(""), &Signer::es());
        assert_eq!(v.verify(&tok, now()), Err(JwtError::BadSignature));

        // Claims swapped under a valid signature.
        let other = token(r#"{"alg":"ES256"}"#, &claims(r#","scope":"*""#), &es);
        let good = token(r#"{"alg":"ES256"}"#, &claims(""), &es);
        let spliced = format!(
            "{}.{}.{}",
            good.split('.').next().expect("h"),
            other.split('.').nth(1).expect("p"),
            good.split('.').nth(2).expect("s")
        );
        assert_eq!(v.verify(&spliced, now()), Err(JwtError::BadSignature));
    }

    #[test]
    fn refused_algs_and_keys() {
        let (_keys, ed, _es, v) = setup("algs");
        let unsigned = format!(
            "{}.{}.",
            URL_SAFE_NO_PAD.encode(r#"{"alg":"none"}"#),
            URL_SAFE_NO_PAD.encode(claims(""))
        );
        assert_eq!(
            v.verify(&unsigned, now()),
            Err(JwtError::UnsupportedAlg("none".into()))
        );
        let hs = token(r#"{"alg":"HS256","kid":"ed"}"#, &claims(""), &ed);
        assert_eq!(
            v.verify(&hs, now()),
            Err(JwtError::UnsupportedAlg("HS256".into()))
        );
        let mismatch = token(r#"{"alg":"ES256","kid":"ed"}"#, &claims(""), &ed);
        assert_eq!(
            v.verify(&mismatch, now()),
            Err(JwtError::AlgMismatch {
                alg: "ES256",
                kid: "ed".into()
            })
        );
        let unknown = token(r#"{"alg":"EdDSA","kid":"old"}"#, &claims(""), &ed);
        assert_eq!(
            v.verify(&unknown, now()),
            Err(JwtError::UnknownKey(Some("old".into())))
        );
        let crit = token(r#"{"alg":"EdDSA","crit":["exp"]}"#, &claims(""), &ed);
        assert!(matches!(
            v.verify(&crit, now()),
            Err(JwtError::Malformed(_))
        ));

        let mut only_ed = Keys::new("only-ed");
        only_ed.add("ed", &ed.public_pem());
        let tok = token(r#"{"alg":"ES256"}"#, &claims(""), &Signer::es());
        assert_eq!(
            only_ed.verifier().verify(&tok, now()),
            Err(JwtError::UnknownKey(None))
        );
        assert!([JwtError::BadSignature, JwtError::Malformed("x")]
            .iter()
            .all(|e| e.status() == 401));
    }

    #[test]
    fn audience() {
        let (_keys, ed, _es, v) = setup("aud");
        let h = r#"{"alg":"EdDSA"}"#;
        let one = token(h, &claims(r#","aud":"fleetlink""#), &ed);
        let many = token(h, &claims(r#","aud":["other","fleetlink"]"#), &ed);
        let wrong = token(h, &claims(r#","aud":"other""#), &ed);
        let none = token(h, &claims(""), &ed);
        assert_eq!(
            v.verify(&one, now()),
            Err(JwtError::WrongAudience),
            "no audience configured"
        );
        v.verify(&none, now()).expect("no aud, no audience");
        let v = v.with_audience("fleetlink");
        v.verify(&one, now()).expect("aud string");
        v.verify(&many, now()).expect("aud array");
        assert_eq!(
            v.verify(&none, now()),
            Err(JwtError::WrongAudience),
            "an audience is configured: a token must name it"
        );
        assert_eq!(v.verify(&wrong, now()), Err(JwtError::WrongAudience));
    }

    #[test]
    fn malformed_tokens() {
        let (_keys, ed, _es, v) = setup("malformed");
        let good = token(r#"{"alg":"EdDSA"}"#, &claims(""), &ed);
        for bad in [
            String::new(),
            "a.b".into(),
            "a.b.c.d".into(),
            format!("{good}."),
            format!("{good}=="),
            good.replace('.', ".."),
            token(r#"{"alg":"EdDSA"}"#, r#"{"exp":1,"exp":2}"#, &ed),
            token(r#"["EdDSA"]"#, &claims(""), &ed),
            token(r#"{"alg":"EdDSA"}"#, r#"{"exp":9999999999,"scope":7}"#, &ed),
            "x".repeat(MAX_TOKEN_LEN + 1),
        ] {
            let err = v.verify(&bad, now()).expect_err(&bad);
            assert!(
                matches!(err, JwtError::Malformed(_) | JwtError::BadSignature),
                "{bad}: {err:?}"
            );
        }
    }

    #[test]
    fn garbage_never_panics_and_mutants_never_pass() {
        let (_keys, ed, _es, v) = setup("fuzz");
        let good = token(r#"{"alg":"EdDSA"}"#, &claims(r#","scope":"*""#), &ed);
        let alphabet = b"ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789-_.=+/ {}\"";
        let mut x: u64 = 0x9e37_79b9_7f4a_7c15;
        let mut next = move || {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            x
        };
        for _ in 0..3000 {
            let len = (next() % 200) as usize;
            let raw: Vec<u8> = (0..len).map(|_| next() as u8).collect();
            let raw = String::from_utf8_lossy(&raw);
            assert!(v.verify(&raw, now()).is_err(), "{raw:?}");
            let text: String = (0..len)
                .map(|_| alphabet[(next() % alphabet.len() as u64) as usize] as char)
                .collect();
            assert!(v.verify(&text, now()).is_err());
            let mut mutant = good.clone().into_bytes();
            let at = (next() as usize) % mutant.len();
            let with = alphabet[(next() % alphabet.len() as u64) as usize];
            if mutant[at] != with {
                mutant[at] = with;
                let mutant = String::from_utf8(mutant).expect("ascii");
                assert!(v.verify(&mutant, now()).is_err(), "{mutant}");
            }
        }
        v.verify(&good, now()).expect("the original still verifies");
    }
}
