//! A bound on the client chains the verifier builds paths through. webpki tries, at each step,
//! every certificate the client sent whose subject names the issuer being looked for, up to
//! 100 signature checks: a client holding no key of ours sent 120 certificates named like the
//! client CA, and each of its handshakes cost the broker 10–13 ms of CPU, 25 times a real one's
//! (review bb131). A chain whose intermediates all have their own subjects has one candidate
//! per step, so its checks grow with its length, which is bounded too.

use std::collections::HashSet;
use std::sync::Arc;

use rustls::client::danger::HandshakeSignatureValid;
use rustls::pki_types::{CertificateDer, UnixTime};
use rustls::server::danger::{ClientCertVerified, ClientCertVerifier};
use rustls::{CertificateError, DigitallySignedStruct, DistinguishedName, OtherError};
use rustls::{Error, SignatureScheme};

/// The most intermediates a rig's chain may bring: webpki's own bound on sub-CAs in a path.
pub(super) const MAX_INTERMEDIATES: usize = 6;

/// Why a chain is refused before its paths are built.
#[derive(thiserror::Error)]
pub(super) enum Unbounded {
    #[error("the client sent {0} intermediate certificates, more than {MAX_INTERMEDIATES}")]
    TooMany(usize),
    #[error("two of the client's intermediate certificates have the same subject")]
    SameSubject,
}

/// As its text: rustls shows a `CertificateError::Other` by its Debug form, and the refusal log
/// line should say why in words.
impl std::fmt::Debug for Unbounded {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        std::fmt::Display::fmt(self, f)
    }
}

/// Whether `intermediates` may go to path building: at most [`MAX_INTERMEDIATES`], each with a
/// subject of its own (one the parser cannot read is left to webpki, which refuses it).
pub(super) fn bounded(intermediates: &[CertificateDer<'_>]) -> Result<(), Unbounded> {
    if intermediates.len() > MAX_INTERMEDIATES {
        return Err(Unbounded::TooMany(intermediates.len()));
    }
    let mut subjects = HashSet::with_capacity(intermediates.len());
    for der in intermediates {
        if let Ok((_, cert)) = x509_parser::parse_x509_certificate(der) {
            if !subjects.insert(cert.subject().as_raw().to_vec()) {
                return Err(Unbounded::SameSubject);
            }
        }
    }
    Ok(())
}

/// The verifier, asked only about chains [`bounded`] lets through.
#[derive(Debug)]
pub(super) struct BoundedChains(pub(super) Arc<dyn ClientCertVerifier>);

impl ClientCertVerifier for BoundedChains {
    fn offer_client_auth(&self) -> bool {
        self.0.offer_client_auth()
    }

    fn client_auth_mandatory(&self) -> bool {
        self.0.client_auth_mandatory()
    }

    fn root_hint_subjects(&self) -> &[DistinguishedName] {
        self.0.root_hint_subjects()
    }

    fn verify_client_cert(
        &self,
        end_entity: &CertificateDer<'_>,
        intermediates: &[CertificateDer<'_>],
        now: UnixTime,
    ) -> Result<ClientCertVerified, Error> {
        bounded(intermediates).map_err(|why| {
            Error::InvalidCertificate(CertificateError::Other(OtherError(Arc::new(why))))
        })?;
        self.0.verify_client_cert(end_entity, intermediates, now)
    }

    fn verify_tls12_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> Result<HandshakeSignatureValid, Error> {
        self.0.verify_tls12_signature(message, cert, dss)
    }

    fn verify_tls13_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> Result<HandshakeSignatureValid, Error> {
        self.0.verify_tls13_signature(message, cert, dss)
    }

    fn supported_verify_schemes(&self) -> Vec<SignatureScheme> {
        self.0.supported_verify_schemes()
    }

    fn requires_raw_public_keys(&self) -> bool {
        self.0.requires_raw_public_keys()
    }
}
