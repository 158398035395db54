//! Test fixtures the tests of every file here share: signing keys, key files in a temp dir,
//! signed tokens and a fixed clock. Apart because the verifier's, the claims' and the key
//! loader's tests all need to mint real signed tokens, and that belongs in one place.

use std::fs;
use std::path::PathBuf;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use base64::engine::general_purpose::URL_SAFE_NO_PAD;
use base64::Engine;
use ring::rand::SystemRandom;
use ring::signature::{EcdsaKeyPair, Ed25519KeyPair, KeyPair, ECDSA_P256_SHA256_FIXED_SIGNING};

use super::keys::{ED25519_SPKI_PREFIX, P256_SPKI_PREFIX};
use super::JwtVerifier;

/// A signing key and the PEM of its public half.
pub(super) enum Signer {
    Ed(Ed25519KeyPair),
    Es(EcdsaKeyPair),
}

impl Signer {
    pub(super) fn ed() -> Signer {
        let pkcs8 = Ed25519KeyPair::generate_pkcs8(&SystemRandom::new()).expect("gen");
        Signer::Ed(Ed25519KeyPair::from_pkcs8(pkcs8.as_ref()).expect("key"))
    }

    pub(super) fn es() -> Signer {
        let rng = SystemRandom::new();
        let alg = &ECDSA_P256_SHA256_FIXED_SIGNING;
        let pkcs8 = EcdsaKeyPair::generate_pkcs8(alg, &rng).expect("gen");
        Signer::Es(EcdsaKeyPair::from_pkcs8(alg, pkcs8.as_ref(), &rng).expect("key"))
    }

    pub(super) fn public_pem(&self) -> String {
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

pub(super) fn pem(label: &str, der: &[u8]) -> String {
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

pub(super) fn token(header: &str, claims: &str, signer: &Signer) -> String {
    let input = format!(
        "{}.{}",
        URL_SAFE_NO_PAD.encode(header),
        URL_SAFE_NO_PAD.encode(claims)
    );
    let sig = URL_SAFE_NO_PAD.encode(signer.sign(input.as_bytes()));
    format!("{input}.{sig}")
}

/// A temp dir with key files, removed on drop.
pub(super) struct Keys {
    pub(super) dir: PathBuf,
    pub(super) files: Vec<PathBuf>,
}

impl Keys {
    pub(super) fn new(tag: &str) -> Keys {
        let dir = std::env::temp_dir().join(format!("fleetlink-jwt-{tag}-{}", std::process::id()));
        let _ = fs::remove_dir_all(&dir);
        fs::create_dir_all(&dir).expect("dir");
        Keys {
            dir,
            files: Vec::new(),
        }
    }

    pub(super) fn add(&mut self, stem: &str, text: &str) -> &mut Keys {
        let path = self.dir.join(format!("{stem}.pem"));
        fs::write(&path, text).expect("write");
        self.files.push(path);
        self
    }

    pub(super) fn verifier(&self) -> JwtVerifier {
        JwtVerifier::from_pem_files(&self.files).expect("verifier")
    }
}

impl Drop for Keys {
    fn drop(&mut self) {
        let _ = fs::remove_dir_all(&self.dir);
    }
}

pub(super) const NOW: u64 = 1_800_000_000;

pub(super) fn now() -> SystemTime {
    UNIX_EPOCH + Duration::from_secs(NOW)
}

pub(super) fn claims(extra: &str) -> String {
    format!(
        r#"{{"sub":"rig-0001","exp":{},"rig_id":"rig-0001"{extra}}}"#,
        NOW + 300
    )
}

/// An Ed25519 key `ed` and a P-256 key `es`, with their verifier.
pub(super) fn setup(tag: &str) -> (Keys, Signer, Signer, JwtVerifier) {
    let (ed, es) = (Signer::ed(), Signer::es());
    let mut keys = Keys::new(tag);
    keys.add("ed", &ed.public_pem()).add("es", &es.public_pem());
    let verifier = keys.verifier();
    (keys, ed, es, verifier)
}
