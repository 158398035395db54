//! Bearer tokens for tests: an Ed25519 key whose public half the broker reads (`--jwt-key`),
//! and tokens signed with it.

use std::path::{Path, PathBuf};
use std::time::{SystemTime, UNIX_EPOCH};

use base64::engine::general_purpose::{STANDARD, URL_SAFE_NO_PAD};
use base64::Engine;
use ring::rand::SystemRandom;
use ring::signature::{Ed25519KeyPair, KeyPair};

/// Ed25519 token signer, and its public key as the PEM file the broker loads.
pub struct Signer(Ed25519KeyPair);

impl Signer {
    pub fn new(dir: &Path) -> (Signer, PathBuf) {
        let pkcs8 = Ed25519KeyPair::generate_pkcs8(&SystemRandom::new()).unwrap();
        let key = Ed25519KeyPair::from_pkcs8(pkcs8.as_ref()).unwrap();
        // SubjectPublicKeyInfo for Ed25519: a fixed 12-byte prefix, then the 32-byte key.
        let spki = [
            &[
                0x30, 0x2a, 0x30, 0x05, 0x06, 0x03, 0x2b, 0x65, 0x70, 0x03, 0x21, 0x00,
            ][..],
            key.public_key().as_ref(),
        ]
        .concat();
        let path = dir.join("jwt.pub.pem");
        std::fs::write(
            &path,
            format!(
                "-----BEGIN PUBLIC KEY-----\n{}\n-----END PUBLIC KEY-----\n",
                STANDARD.encode(spki)
            ),
        )
        .unwrap();
        (Signer(key), path)
    }

    pub fn token(&self, claims: serde_json::Value) -> String {
        let input = format!(
            "{}.{}",
            URL_SAFE_NO_PAD.encode(r#"{"alg":"EdDSA","typ":"JWT"}"#),
            URL_SAFE_NO_PAD.encode(claims.to_string())
        );
        format!(
            "{input}.{}",
            URL_SAFE_NO_PAD.encode(self.0.sign(input.as_bytes()))
        )
    }
}

pub fn now_s() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .unwrap()
        .as_secs()
}
