//! The one error type of token verification and key loading, and the HTTP status each maps
//! to. Apart so that the verifier, the key loader and the claims parser can all return it
//! without any of them owning it.

use std::path::PathBuf;

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
    /// file error (a startup error; never produced by [`JwtVerifier::verify`](super::JwtVerifier::verify)).
    pub fn status(&self) -> u16 {
        match self {
            JwtError::Key { .. } => 500,
            _ => 401,
        }
    }
}
