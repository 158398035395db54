//! Loading the configured public keys from PEM files: which key types are accepted, how a
//! file is refused, and the `kid` a file's name gives its key. Apart because it reads files
//! and runs only at startup, while the verifier runs per upgrade and never touches a file.

use std::fs;
use std::path::Path;

use rustls_pemfile::Item;

use super::{Alg, JwtError};

/// DER prefix of an Ed25519 SubjectPublicKeyInfo (RFC 8410 §4): the 32-byte key follows.
pub(super) const ED25519_SPKI_PREFIX: [u8; 12] = [
    0x30, 0x2a, 0x30, 0x05, 0x06, 0x03, 0x2b, 0x65, 0x70, 0x03, 0x21, 0x00,
];
/// DER prefix of a P-256 SubjectPublicKeyInfo (RFC 5480): id-ecPublicKey, prime256v1, then the
/// 65-byte uncompressed point `04 || x || y`.
pub(super) const P256_SPKI_PREFIX: [u8; 26] = [
    0x30, 0x59, 0x30, 0x13, 0x06, 0x07, 0x2a, 0x86, 0x48, 0xce, 0x3d, 0x02, 0x01, 0x06, 0x08, 0x2a,
    0x86, 0x48, 0xce, 0x3d, 0x03, 0x01, 0x07, 0x03, 0x42, 0x00,
];

/// One configured public key.
#[derive(Debug)]
pub(super) struct Key {
    pub(super) kid: Option<String>,
    pub(super) alg: Alg,
    /// The raw public key: 32 bytes (Ed25519) or the 65-byte uncompressed point (P-256).
    pub(super) public: Vec<u8>,
}

pub(super) fn load_key(path: &Path) -> Result<Key, JwtError> {
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

pub(super) fn key_error(path: &Path, detail: &str) -> JwtError {
    JwtError::Key {
        path: path.to_owned(),
        detail: detail.to_owned(),
    }
}

#[cfg(test)]
mod tests {
    use ring::rand::SystemRandom;
    use ring::signature::Ed25519KeyPair;

    use super::super::testing::{pem, Keys, Signer};
    use super::super::JwtVerifier;
    use super::*;

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
