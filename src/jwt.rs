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

use std::fs;
use std::path::{Path, PathBuf};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use base64::engine::general_purpose::URL_SAFE_NO_PAD;
use base64::Engine;
use ring::signature::{UnparsedPublicKey, VerificationAlgorithm};
use rustls_pemfile::Item;
use serde::Deserialize;

/// Longest token read, in bytes: a short-lived rig token is a few hundred.
pub const MAX_TOKEN_LEN: usize = 8 * 1024;
/// Most scope entries kept; more is a malformed token.
pub const MAX_SCOPE_ENTRIES: usize = 256;
/// Default clock-skew allowance on `exp` and `nbf`.
pub const DEFAULT_LEEWAY: Duration = Duration::from_secs(30);

/// DER prefix of an Ed25519 SubjectPublicKeyInfo (RFC 8410 §4): the 32-byte key follows.
const ED25519_SPKI_PREFIX: [u8; 12] = [
    0x30, 0x2a, 0x30, 0x05, 0x06, 0x03, 0x2b, 0x65, 0x70, 0x03, 0x21, 0x00,
];
/// DER prefix of a P-256 SubjectPublicKeyInfo (RFC 5480): id-ecPublicKey, prime256v1, then the
/// 65-byte uncompressed point `04 || x || y`.
const P256_SPKI_PREFIX: [u8; 26] = [
    0x30, 0x59, 0x30, 0x13, 0x06, 0x07, 0x2a, 0x86, 0x48, 0xce, 0x3d, 0x02, 0x01, 0x06, 0x08, 0x2a,
    0x86, 0x48, 0xce, 0x3d, 0x03, 0x01, 0x07, 0x03, 0x42, 0x00,
];

/// Why a token was refused, or a key file not loaded.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum JwtError {
    /// Not three base64url parts, bad JSON, a missing or ill-typed claim, too long.
    #[error("malformed token: {0}")]
    Malformed(&'static str),
    /// The signature does not verify with the selected key(s).
    #[error("bad signature")]
    BadSignature,
    /// `exp` (plus leeway) is past.
    #[error("token expired at {exp} (now {now})")]
    Expired {
        /// The token's `exp`, Unix seconds.
        exp: u64,
        /// The verifier's clock, Unix seconds.
        now: u64,
    },
    /// `nbf` (minus leeway) is still ahead.
    #[error("token not valid before {nbf} (now {now})")]
    NotYetValid {
        /// The token's `nbf`, Unix seconds.
        nbf: u64,
        /// The verifier's clock, Unix seconds.
        now: u64,
    },
    /// The header's `alg` is not `EdDSA` or `ES256`.
    #[error("unsupported alg {0:?}")]
    UnsupportedAlg(String),
    /// The `kid` names a key of another type than `alg`.
    #[error("alg {alg} does not match the type of key {kid:?}")]
    AlgMismatch {
        /// The header's `alg`.
        alg: &'static str,
        /// The header's `kid`.
        kid: String,
    },
    /// No configured key has this `kid` (or, without a kid, none of the `alg`'s type).
    #[error("unknown key {0:?}")]
    UnknownKey(Option<String>),
    /// `aud` is present and does not name this broker's audience.
    #[error("audience not accepted")]
    WrongAudience,
    /// A public key file could not be used.
    #[error("{}: {detail}", path.display())]
    Key {
        /// The key file.
        path: PathBuf,
        /// What is wrong with it.
        detail: String,
    },
}

impl JwtError {
    /// The HTTP status the upgrade answers with: 401 for every token error, 500 for a key
    /// file error (a startup error; never produced by [`JwtVerifier::verify`]).
    pub fn status(&self) -> u16 {
        match self {
            JwtError::Key { .. } => 500,
            _ => 401,
        }
    }
}

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

/// One configured public key.
#[derive(Debug)]
struct Key {
    kid: Option<String>,
    alg: Alg,
    /// The raw public key: 32 bytes (Ed25519) or the 65-byte uncompressed point (P-256).
    public: Vec<u8>,
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
    fn parse<'a>(entries: impl Iterator<Item = &'a str>) -> Result<Scope, JwtError> {
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

/// The token from an `Authorization` header value: `Bearer` (any case) then one or more
/// spaces then a b64token (RFC 6750 §2.1), trailing whitespace ignored. `None` for another
/// scheme, an empty token or characters a token cannot have.
pub fn bearer(header: &str) -> Option<&str> {
    let scheme = header.get(..6)?;
    if !scheme.eq_ignore_ascii_case("bearer") {
        return None;
    }
    let rest = &header[6..];
    let token = rest.trim_start_matches(' ');
    if token.len() == rest.len() {
        return None;
    }
    let token = token.trim_end_matches([' ', '\t']);
    let body = token.trim_end_matches('=');
    let ok = !body.is_empty()
        && body.bytes().all(|b| {
            b.is_ascii_alphanumeric() || matches!(b, b'-' | b'.' | b'_' | b'~' | b'+' | b'/')
        });
    ok.then_some(token)
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

/// A claim that is a string or an array of strings.
#[derive(Deserialize)]
#[serde(untagged)]
enum OneOrMany {
    One(String),
    Many(Vec<String>),
}

impl OneOrMany {
    fn iter(&self) -> impl Iterator<Item = &str> {
        let slice = match self {
            OneOrMany::One(one) => std::slice::from_ref(one),
            OneOrMany::Many(many) => many.as_slice(),
        };
        slice.iter().map(String::as_str)
    }
}

/// A NumericDate (RFC 7519 §2): non-negative seconds, fractions truncated.
fn numeric_date(
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

/// `bytes` as `T` if they are one JSON object (serde would also take an array for a struct)
/// with no field twice (serde's derive refuses duplicates).
fn json_object<T: serde::de::DeserializeOwned>(bytes: &[u8]) -> Option<T> {
    let first = bytes.iter().find(|b| !b.is_ascii_whitespace())?;
    (*first == b'{').then(|| serde_json::from_slice(bytes).ok())?
}

fn b64(part: &str) -> Result<Vec<u8>, JwtError> {
    URL_SAFE_NO_PAD
        .decode(part)
        .map_err(|_| JwtError::Malformed("a part is not unpadded base64url"))
}

fn load_key(path: &Path) -> Result<Key, JwtError> {
    let bytes = fs::read(path).map_err(|e| key_error(path, &format!("reading: {e}")))?;
    let mut spkis = Vec::new();
    for item in rustls_pemfile::read_all(&mut bytes.as_slice()) {
        match item.map_err(|e| key_error(path, &format!("not valid PEM: {e}")))? {
            Item::SubjectPublicKeyInfo(spki) => spkis.push(spki),
            Item::Pkcs1Key(_) | Item::Pkcs8Key(_) | Item::Sec1Key(_) => {
                return Err(key_error(
                    path,
                    "holds a PRIVATE key: give the PUBLIC KEY only (and keep the private one off the broker)",
                ))
            }
            _ => {}
        }
    }
    let der = match spkis.as_slice() {
        [one] => one.as_ref(),
        [] => return Err(key_error(path, "no PUBLIC KEY block")),
        _ => {
            return Err(key_error(
                path,
                "more than one PUBLIC KEY block; use one file per key",
            ))
        }
    };
    let (alg, public) = if let Some(key) = der.strip_prefix(&ED25519_SPKI_PREFIX[..]) {
        (Alg::EdDsa, key)
    } else if let Some(key) = der.strip_prefix(&P256_SPKI_PREFIX[..]) {
        (Alg::Es256, key)
    } else {
        return Err(key_error(
            path,
            "not an Ed25519 or uncompressed P-256 public key",
        ));
    };
    let expected = match alg {
        Alg::EdDsa => 32,
        Alg::Es256 => 65,
    };
    if public.len() != expected || (alg == Alg::Es256 && public[0] != 0x04) {
        return Err(key_error(path, "truncated or malformed public key"));
    }
    Ok(Key {
        kid: path.file_stem().and_then(|s| s.to_str()).map(str::to_owned),
        alg,
        public: public.to_vec(),
    })
}

fn key_error(path: &Path, detail: &str) -> JwtError {
    JwtError::Key {
        path: path.to_owned(),
        detail: detail.to_owned(),
    }
}

#[cfg(test)]
mod tests {
    use ring::rand::SystemRandom;
    use ring::signature::{EcdsaKeyPair, Ed25519KeyPair, KeyPair, ECDSA_P256_SHA256_FIXED_SIGNING};

    use super::*;

    /// A signing key and the PEM of its public half.
    enum Signer {
        Ed(Ed25519KeyPair),
        Es(EcdsaKeyPair),
    }

    impl Signer {
        fn ed() -> Signer {
            let pkcs8 = Ed25519KeyPair::generate_pkcs8(&SystemRandom::new()).expect("gen");
            Signer::Ed(Ed25519KeyPair::from_pkcs8(pkcs8.as_ref()).expect("key"))
        }

        fn es() -> Signer {
            let rng = SystemRandom::new();
            let alg = &ECDSA_P256_SHA256_FIXED_SIGNING;
            let pkcs8 = EcdsaKeyPair::generate_pkcs8(alg, &rng).expect("gen");
            Signer::Es(EcdsaKeyPair::from_pkcs8(alg, pkcs8.as_ref(), &rng).expect("key"))
        }

        fn public_pem(&self) -> String {
            let spki = match self {
                Signer::Ed(k) => [&ED25519_SPKI_PREFIX[..], k.public_key().as_ref()].concat(),
                Signer::Es(k) => [&P256_SPKI_PREFIX[..], k.public_key().as_ref()].concat(),
            };
            pem("PUBLIC KEY", &spki)
        }

        fn sign(&self, msg: &[u8]) -> Vec<u8> {
            match self {
                Signer::Ed(k) => k.sign(msg).as_ref().to_vec(),
                Signer::Es(k) => k
                    .sign(&SystemRandom::new(), msg)
                    .expect("sign")
                    .as_ref()
                    .to_vec(),
            }
        }
    }

    fn pem(label: &str, der: &[u8]) -> String {
        use base64::engine::general_purpose::STANDARD;
        let b64 = STANDARD.encode(der);
        let lines: Vec<&str> = b64
            .as_bytes()
            .chunks(64)
            .map(|c| std::str::from_utf8(c).expect("ascii"))
            .collect();
        format!(
            "-----BEGIN {label}-----\n{}\n-----END {label}-----\n",
            lines.join("\n")
        )
    }

    fn token(header: &str, claims: &str, signer: &Signer) -> String {
        let input = format!(
            "{}.{}",
            URL_SAFE_NO_PAD.encode(header),
            URL_SAFE_NO_PAD.encode(claims)
        );
        let sig = URL_SAFE_NO_PAD.encode(signer.sign(input.as_bytes()));
        format!("{input}.{sig}")
    }

    /// A temp dir with key files, removed on drop.
    struct Keys {
        dir: PathBuf,
        files: Vec<PathBuf>,
    }

    impl Keys {
        fn new(tag: &str) -> Keys {
            let dir =
                std::env::temp_dir().join(format!("fleetlink-jwt-{tag}-{}", std::process::id()));
            let _ = fs::remove_dir_all(&dir);
            fs::create_dir_all(&dir).expect("dir");
            Keys {
                dir,
                files: Vec::new(),
            }
        }

        fn add(&mut self, stem: &str, text: &str) -> &mut Keys {
            let path = self.dir.join(format!("{stem}.pem"));
            fs::write(&path, text).expect("write");
            self.files.push(path);
            self
        }

        fn verifier(&self) -> JwtVerifier {
            JwtVerifier::from_pem_files(&self.files).expect("verifier")
        }
    }

    impl Drop for Keys {
        fn drop(&mut self) {
            let _ = fs::remove_dir_all(&self.dir);
        }
    }

    const NOW: u64 = 1_800_000_000;

    fn now() -> SystemTime {
        UNIX_EPOCH + Duration::from_secs(NOW)
    }

    fn claims(extra: &str) -> String {
        format!(
            r#"{{"sub":"rig-0001","exp":{},"rig_id":"rig-0001"{extra}}}"#,
            NOW + 300
        )
    }

    /// An Ed25519 key `ed` and a P-256 key `es`, with their verifier.
    fn setup(tag: &str) -> (Keys, Signer, Signer, JwtVerifier) {
        let (ed, es) = (Signer::ed(), Signer::es());
        let mut keys = Keys::new(tag);
        keys.add("ed", &ed.public_pem()).add("es", &es.public_pem());
        let verifier = keys.verifier();
        (keys, ed, es, verifier)
    }

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

    #[test]
    fn bearer_header() {
        assert_eq!(bearer("Bearer abc.def.ghi"), Some("abc.def.ghi"));
        assert_eq!(bearer("bearer   x-y_z~+/=="), Some("x-y_z~+/=="));
        assert_eq!(bearer("BEARER tok \t"), Some("tok"));
        for bad in [
            "",
            "Bearer",
            "Bearer ",
            "Bearerabc",
            "Basic abc",
            "Bearer a b",
            "Bearer é",
            "Beé",
            "Bearer ==",
            "Bearer\tabc",
        ] {
            assert_eq!(bearer(bad), None, "{bad:?}");
        }
    }

    #[test]
    fn key_files() {
        let ed = Signer::ed();
        let mut keys = Keys::new("files");
        keys.add("a", &ed.public_pem());
        let pkcs8 = Ed25519KeyPair::generate_pkcs8(&SystemRandom::new()).expect("gen");
        let private = pem("PRIVATE KEY", pkcs8.as_ref());
        let cases = [
            ("private", private.clone()),
            (
                "two",
                format!("{}{}", ed.public_pem(), Signer::es().public_pem()),
            ),
            ("empty", String::new()),
            (
                "rsa-ish",
                pem("PUBLIC KEY", &[0x30, 0x03, 0x02, 0x01, 0x00]),
            ),
            ("short", pem("PUBLIC KEY", &ED25519_SPKI_PREFIX)),
        ];
        for (stem, text) in cases {
            let path = keys.dir.join(format!("{stem}.pem"));
            fs::write(&path, text).expect("write");
            let err = JwtVerifier::from_pem_files(&[path]).expect_err(stem);
            assert!(err.to_string().contains(&format!("{stem}.pem")), "{err}");
            assert_eq!(err.status(), 500);
        }
        let sub = keys.dir.join("sub");
        fs::create_dir_all(&sub).expect("dir");
        fs::write(sub.join("a.pem"), ed.public_pem()).expect("write");
        let dup = JwtVerifier::from_pem_files(&[keys.files[0].clone(), sub.join("a.pem")]);
        assert!(dup.is_err(), "same kid twice");
        assert!(JwtVerifier::from_pem_files(&[]).is_err());
        assert!(JwtVerifier::from_pem_files(&[keys.dir.join("missing.pem")]).is_err());
    }
}
