//! TLS on the rig listener: rustls server configuration, client-certificate verification with
//! CRLs, hot reload, and the rig identity a client certificate grants (CONTRACT.md §1–2).
//!
//! Who calls what:
//! - `main` builds a [`TlsReloader`] from `--tls-cert`, `--tls-key`, `--client-ca`, `--crl` and
//!   starts its watcher ([`TlsReloader::spawn_watcher`]: file changes and SIGHUP).
//! - Each core keeps a [`ConfigCache`] and, per accepted socket, calls [`new_connection`] with
//!   the config it returns; `worker/conn.rs` drives the `rustls::ServerConnection` itself
//!   (`read_tls` / `process_new_packets` / `reader` / `writer` / `write_tls`) on the core thread.
//! - After the handshake it calls [`peer_identities`] once, keeps the strings, and closes with
//!   4403 when [`identity_matches`] says the hello's `rig_id` is not one of them.
//!
//! Invariants:
//! - Nothing here that a handshake runs reads a file or takes a lock: files are read only by
//!   [`build_server_config`], at startup and on the watcher thread. The handshake's CPU cost
//!   (one ECDHE, one signature, the client chain and CRL lookups) is all that runs on a core.
//! - A config is immutable once built. A reload builds a new one; connections keep the config
//!   they started their handshake with, so a reload never touches a live connection. A cert
//!   revoked by a reloaded CRL is refused at its next full handshake, and every handshake is
//!   full: there is no session resumption (it would skip the revocation check, and at the
//!   accept rate's 50 handshakes/s per broker it would save nothing measurable).
//! - With `--client-ca` every client must present a certificate that chains to the bundle;
//!   with `--crl`, every certificate of the chain except the trust anchor must be covered by
//!   a CRL of its issuer (rustls' default, as nginx's `ssl_crl`): a cert from an issuer that has
//!   no CRL among the files is refused (unknown revocation status). CRL `nextUpdate` is not
//!   enforced: a stale CRL still revokes.

mod chain_bound;
mod identity;
mod reload;

use std::fs;
use std::io;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use rustls::crypto::CryptoProvider;
use rustls::pki_types::{CertificateDer, CertificateRevocationListDer, PrivateKeyDer};
use rustls::server::{NoServerSessionStorage, VerifierBuilderError, WebPkiClientVerifier};
use rustls::{RootCertStore, ServerConfig, ServerConnection};
use rustls_pemfile::Item;

pub use identity::{cert_identities, identity_matches, peer_identities};
pub use reload::{ConfigCache, TlsReloader};

/// Bound of the bytes a connection buffers on its way out: encrypted records not yet taken by
/// `write_tls`, and plaintext written before the handshake finished. 16 KiB is one full TLS
/// record. Past it, `writer().write` accepts fewer bytes than offered (possibly 0): the
/// connection loop must then flush with `write_tls` and offer the rest later, never
/// `write_all` into it. Received plaintext has rustls' own fixed 16 KiB bound, and the
/// incoming record buffer shrinks back to 4 KiB once it holds no partial record.
pub const SEND_BUFFER_LIMIT: usize = 16 * 1024;

/// The TLS files of the rig listener, as given by the flags.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TlsPaths {
    /// `--tls-cert`: the server certificate chain, PEM, end-entity first.
    pub cert: PathBuf,
    /// `--tls-key`: the server's private key, PEM (PKCS#8, PKCS#1 or SEC1), exactly one.
    pub key: PathBuf,
    /// `--client-ca`: the CA bundle client certificates must chain to; makes them required.
    pub client_ca: Option<PathBuf>,
    /// `--crl`: PEM CRL files checked by the client verifier; needs `client_ca`.
    pub crl: Vec<PathBuf>,
}

impl TlsPaths {
    /// Every file a config is built from: what the reload watcher watches.
    pub fn files(&self) -> impl Iterator<Item = &Path> {
        [self.cert.as_path(), self.key.as_path()]
            .into_iter()
            .chain(self.client_ca.as_deref())
            .chain(self.crl.iter().map(PathBuf::as_path))
    }
}

/// Why a TLS configuration could not be built. Each names the file at fault. At startup the
/// broker exits with it; on reload the old config stays in force and the error is logged.
#[derive(Debug, thiserror::Error)]
pub enum TlsError {
    /// A file could not be read.
    #[error("reading {}: {source}", path.display())]
    Read {
        /// The file.
        path: PathBuf,
        /// What the OS said.
        source: io::Error,
    },
    /// A file is not well-formed PEM (bad base64, an unterminated block).
    #[error("{}: not valid PEM: {source}", path.display())]
    Pem {
        /// The file.
        path: PathBuf,
        /// What the PEM reader said.
        source: io::Error,
    },
    /// A file holds none of the PEM blocks it must hold.
    #[error("{}: no {what} found", path.display())]
    Missing {
        /// The file.
        path: PathBuf,
        /// What was looked for, e.g. "CERTIFICATE block".
        what: &'static str,
    },
    /// The key file holds an encrypted private key, which would need a passphrase at every
    /// start and reload.
    #[error("{}: an encrypted private key; give it decrypted (`openssl pkey -in KEY -out PLAIN`), readable by the broker alone", path.display())]
    EncryptedKey {
        /// The key file.
        path: PathBuf,
    },
    /// The key file holds more than one private key: which one is meant is a guess we refuse.
    #[error("{}: {count} private keys; expected exactly one", path.display())]
    ManyKeys {
        /// The key file.
        path: PathBuf,
        /// How many keys it holds.
        count: usize,
    },
    /// rustls refused the certificate chain with this key: the key does not match the
    /// end-entity certificate, or its type is unsupported.
    #[error("{} with key {}: {}", cert.display(), key.display(), cert_key_words(cause))]
    CertKey {
        /// The certificate file.
        cert: PathBuf,
        /// The key file.
        key: PathBuf,
        /// What rustls said. Not a `source`: the message already says it, in words, and an
        /// error chain printed whole would say it again as rustls' `KeyMismatch`.
        cause: rustls::Error,
    },
    /// A certificate of the client CA bundle is not usable as a trust anchor.
    #[error("{}: certificate #{index} is not a usable CA: {source}", path.display())]
    ClientCa {
        /// The bundle.
        path: PathBuf,
        /// Its position in the bundle, from 1.
        index: usize,
        /// What rustls said.
        source: rustls::Error,
    },
    /// A CRL file does not parse as a CRL the verifier can use.
    #[error("{}: unusable CRL: {source}", path.display())]
    Crl {
        /// The CRL file.
        path: PathBuf,
        /// What the verifier builder said.
        source: VerifierBuilderError,
    },
    /// No CRL is issued by a client CA: rustls would take them, find no CRL for the CA that
    /// issued the rigs' (or their intermediates') certificates, and refuse every one of them
    /// (unknown revocation status). Refused here instead, so a reload keeps the configuration
    /// in force. (A CRL of an intermediate CA names an issuer outside the bundle, so only
    /// "none at all" is certain to be a mistake.)
    #[error("{}: no CRL is issued by a --client-ca certificate (issuers: {issuers})", path.display())]
    CrlIssuer {
        /// The first CRL file.
        path: PathBuf,
        /// The CRLs' issuers, as text.
        issuers: String,
    },
    /// A CRL names a client CA as its issuer but that CA did not sign it: taken, it would fail
    /// every handshake of the CA's rigs (rustls checks the signature only then). Refused here,
    /// so a reload keeps the configuration in force.
    #[error("{}: the CRL of {issuer} is not signed by that --client-ca certificate", path.display())]
    CrlSignature {
        /// The CRL file.
        path: PathBuf,
        /// The issuer it names, as text.
        issuer: String,
    },
    /// `--crl` without `--client-ca`: with no client certificates there is nothing to revoke,
    /// and silently checking nothing would mislead the operator.
    #[error("{}: --crl needs --client-ca", path.display())]
    CrlWithoutClientCa {
        /// The first CRL file.
        path: PathBuf,
    },
    /// The client verifier could not be built from the CA bundle.
    #[error("{}: client verifier: {source}", path.display())]
    Verifier {
        /// The CA bundle.
        path: PathBuf,
        /// What the verifier builder said.
        source: VerifierBuilderError,
    },
    /// rustls refused the protocol versions (not expected with the ring provider).
    #[error("TLS configuration: {0}")]
    Config(rustls::Error),
    /// The broker's own certificate is outside its validity period: every rig would refuse
    /// it, while the rigs already connected stay, so an outage would show only as failed
    /// reconnects. Refused, so a reload keeps the certificate in force.
    #[error("{}: {which} is {why}", path.display())]
    NotValidNow {
        /// The certificate file.
        path: PathBuf,
        /// "the certificate", or which one of the chain after it.
        which: String,
        /// "expired since …" or "not valid before …".
        why: String,
    },
}

/// Warn when the broker's certificate has less than this left.
const EXPIRY_WARNING: Duration = Duration::from_secs(14 * 24 * 3600);

/// Refuses a certificate of the served chain (`at` 0: the broker's own) outside its validity
/// period, and warns when it ends soon; returns its end (Unix seconds) when it can be read.
/// The chain's intermediates count as much as the leaf: a rig refuses the whole chain for an
/// expired one.
fn check_validity(
    path: &Path,
    at: usize,
    der: &CertificateDer<'_>,
) -> Result<Option<i64>, TlsError> {
    let Ok((_, cert)) = x509_parser::parse_x509_certificate(der) else {
        // rustls judges what it can parse; a certificate it takes is not ours to refuse.
        return Ok(None);
    };
    let now = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_secs() as i64);
    let validity = cert.validity();
    let (from, until) = (
        validity.not_before.timestamp(),
        validity.not_after.timestamp(),
    );
    let why = if now > until {
        Some(format!("expired since {}", validity.not_after))
    } else if now < from {
        Some(format!("not valid before {}", validity.not_before))
    } else {
        None
    };
    let which = match at {
        0 => "the certificate".to_string(),
        n => format!("the chain's certificate {} ({})", n + 1, cert.subject()),
    };
    if let Some(why) = why {
        return Err(TlsError::NotValidNow {
            path: path.to_owned(),
            which,
            why,
        });
    }
    if until - now < EXPIRY_WARNING.as_secs() as i64 {
        log::warn!(
            "{}: {which} expires on {} (in {} h): renew it; the broker reloads it when the \
             file changes",
            path.display(),
            validity.not_after,
            (until - now) / 3600
        );
    }
    Ok(Some(until))
}

/// rustls' words for a refused certificate/key pair are its enum's names; an operator needs to
/// hear which file is wrong.
fn cert_key_words(e: &rustls::Error) -> String {
    use rustls::InconsistentKeys;
    match e {
        rustls::Error::InconsistentKeys(InconsistentKeys::KeyMismatch) => {
            "the private key does not belong to the certificate (the chain's first certificate)"
                .into()
        }
        rustls::Error::InconsistentKeys(InconsistentKeys::Unknown) => {
            "cannot check that the private key belongs to the certificate (unsupported key)".into()
        }
        other => other.to_string(),
    }
}

/// Builds the rig listener's config from `paths`: TLS 1.3 and 1.2 (for old agents), the ring
/// provider's default suites and groups, ALPN `http/1.1`, no session resumption (no tickets,
/// no session cache: see the module doc), no early data, 16 KiB records. With `client_ca`, a
/// [`WebPkiClientVerifier`] that requires a client certificate chaining to the bundle and
/// checks it against the CRLs. Reads every file once; does no other IO.
pub fn build_server_config(paths: &TlsPaths) -> Result<Arc<ServerConfig>, TlsError> {
    build(paths).map(|(config, _)| config)
}

/// When the TLS material in force stops being usable, for the metrics operators alert on.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Validity {
    /// The end of the served chain (Unix seconds): the earliest `notAfter` of its
    /// certificates, the broker's own and the intermediates sent with it, when read.
    pub cert_not_after: Option<i64>,
    /// The earliest `nextUpdate` among the CRLs (Unix seconds): past it a CRL still revokes,
    /// but is stale. None without CRLs, or when none says.
    pub crl_next_update: Option<i64>,
}

/// [`build_server_config`], and when what it read stops being usable.
pub fn build(paths: &TlsPaths) -> Result<(Arc<ServerConfig>, Validity), TlsError> {
    let provider = Arc::new(rustls::crypto::ring::default_provider());
    let chain = read_certs(&paths.cert)?;
    let mut validity = Validity::default();
    for (at, cert) in chain.iter().enumerate() {
        if let Some(until) = check_validity(&paths.cert, at, cert)? {
            let first = validity.cert_not_after.map_or(until, |end| end.min(until));
            validity.cert_not_after = Some(first);
        }
    }
    let key = read_key(&paths.key)?;
    let builder = ServerConfig::builder_with_provider(provider.clone())
        .with_protocol_versions(&[&rustls::version::TLS13, &rustls::version::TLS12])
        .map_err(TlsError::Config)?;
    let builder = match &paths.client_ca {
        Some(ca) => {
            let (verifier, next_update) = client_verifier(ca, &paths.crl, provider)?;
            validity.crl_next_update = next_update;
            builder.with_client_cert_verifier(verifier)
        }
        None => match paths.crl.first() {
            Some(path) => return Err(TlsError::CrlWithoutClientCa { path: path.clone() }),
            None => builder.with_no_client_auth(),
        },
    };
    let mut config = builder
        .with_single_cert(chain, key)
        .map_err(|cause| TlsError::CertKey {
            cert: paths.cert.clone(),
            key: paths.key.clone(),
            cause,
        })?;
    config.alpn_protocols = vec![b"http/1.1".to_vec()];
    config.session_storage = Arc::new(NoServerSessionStorage {});
    config.send_tls13_tickets = 0;
    config.max_early_data_size = 0;
    // 16 KiB records: smaller ones would not lower per-connection memory (bounded by
    // SEND_BUFFER_LIMIT either way), only add a header and tag per record.
    config.max_fragment_size = None;
    Ok((Arc::new(config), validity))
}

/// A server connection for one accepted socket, with [`SEND_BUFFER_LIMIT`] applied.
pub fn new_connection(config: Arc<ServerConfig>) -> Result<ServerConnection, rustls::Error> {
    let mut conn = ServerConnection::new(config)?;
    conn.set_buffer_limit(Some(SEND_BUFFER_LIMIT));
    Ok(conn)
}

/// The client verifier: certs required, chained to `ca`, checked against every CRL in `crls`.
/// Each CRL file is first tried alone so an unusable one is named in the error. Also returns
/// the CRLs' earliest `nextUpdate`.
fn client_verifier(
    ca: &Path,
    crl_files: &[PathBuf],
    provider: Arc<CryptoProvider>,
) -> Result<
    (
        Arc<dyn rustls::server::danger::ClientCertVerifier>,
        Option<i64>,
    ),
    TlsError,
> {
    let mut roots = RootCertStore::empty();
    let ca_certs = read_certs(ca)?;
    for (index, subject) in not_cas(&ca_certs) {
        // Taken (rustls trusts any certificate as an anchor), but most likely the wrong file:
        // a rig's own certificate, say, instead of the CA that issued it.
        log::warn!(
            "{}: certificate #{index} ({subject}) is not a CA certificate (no basicConstraints \
             CA:TRUE); no rig certificate is likely to chain to it",
            ca.display()
        );
    }
    let cas: Vec<_> = ca_certs
        .iter()
        .filter_map(|der| x509_parser::parse_x509_certificate(der).ok())
        .map(|(_, cert)| cert)
        .collect();
    // (raw DER, text) of each client CA's subject.
    let subjects: Vec<(Vec<u8>, String)> = cas
        .iter()
        .map(|cert| (cert.subject().as_raw().to_vec(), cert.subject().to_string()))
        .collect();
    for (i, cert) in ca_certs.iter().enumerate() {
        roots
            .add(cert.clone())
            .map_err(|source| TlsError::ClientCa {
                path: ca.to_owned(),
                index: i + 1,
                source,
            })?;
    }
    let roots = Arc::new(roots);
    let mut crls = Vec::new();
    for path in crl_files {
        let these = read_crls(path)?;
        WebPkiClientVerifier::builder_with_provider(roots.clone(), provider.clone())
            .with_crls(these.iter().cloned())
            .build()
            .map_err(|source| TlsError::Crl {
                path: path.clone(),
                source,
            })?;
        for crl in these {
            let facts = crl_facts(path, &crl, &cas)?;
            crls.push((path.clone(), crl, facts));
        }
    }
    let (crls, facts): (Vec<_>, Vec<_>) = newest_per_issuer(crls).into_iter().unzip();
    let facts: Vec<CrlFacts> = facts.into_iter().flatten().collect();
    let next_update = facts.iter().filter_map(|f| f.next_update).min();
    // (raw DER, text) of each CRL's issuer.
    let issuers: Vec<(Vec<u8>, String)> = facts
        .into_iter()
        .map(|f| (f.issuer, f.issuer_text))
        .collect();
    if let Some(first) = crl_files.first() {
        let uncovered = without_crl(&subjects, &issuers);
        if uncovered.len() == subjects.len() && !issuers.is_empty() {
            let names: Vec<&str> = issuers.iter().map(|(_, text)| text.as_str()).collect();
            return Err(TlsError::CrlIssuer {
                path: first.clone(),
                issuers: names.join("; "),
            });
        }
        if !uncovered.is_empty() {
            // Taken, since a CA on its way in or out of the bundle may have no CRL yet; but
            // every rig certificate chained through it will be refused, and a rig is told
            // only `unknown_ca`.
            log::warn!(
                "{}: no CRL among --crl is issued by {} of --client-ca; every rig \
                 certificate chained through it will be refused (unknown revocation status) \
                 until its CRL is added",
                first.display(),
                uncovered.join("; ")
            );
        }
    }
    let verifier = WebPkiClientVerifier::builder_with_provider(roots, provider)
        .with_crls(crls)
        .build()
        .map_err(|source| TlsError::Verifier {
            path: ca.to_owned(),
            source,
        })?;
    Ok((Arc::new(chain_bound::BoundedChains(verifier)), next_update))
}

/// What the loader uses of one CRL, read from one parse.
struct CrlFacts {
    /// Its issuer, raw DER and as text.
    issuer: Vec<u8>,
    issuer_text: String,
    /// CRL number (big-endian, padded so that longer means larger), then thisUpdate: the
    /// greater is the newer CRL of an issuer.
    rank: (Option<Vec<u8>>, i64),
    next_update: Option<i64>,
}

/// Reads one CRL of `path`; None for one the parser cannot read (rustls took it, and checks
/// it at the handshake). A CRL that names a client CA as its issuer must be signed by it:
/// rustls checks the signature only at the handshake, where a bad one refuses every rig of
/// that CA. (A CRL of an intermediate CA names an issuer outside the bundle, whose key comes
/// only with a rig's chain.)
fn crl_facts(
    path: &Path,
    der: &CertificateRevocationListDer<'_>,
    cas: &[x509_parser::certificate::X509Certificate<'_>],
) -> Result<Option<CrlFacts>, TlsError> {
    let Ok((_, crl)) = x509_parser::parse_x509_crl(der) else {
        return Ok(None);
    };
    let issuer = crl.issuer();
    let named: Vec<_> = cas
        .iter()
        .filter(|ca| ca.subject().as_raw() == issuer.as_raw())
        .collect();
    if !named.is_empty()
        && !named
            .iter()
            .any(|ca| crl.verify_signature(ca.public_key()).is_ok())
    {
        return Err(TlsError::CrlSignature {
            path: path.to_owned(),
            issuer: issuer.to_string(),
        });
    }
    let number = crl.crl_number().map(|n| {
        let mut b = n.to_bytes_be();
        b.splice(
            0..0,
            std::iter::repeat_n(0, 32usize.saturating_sub(b.len())),
        );
        b
    });
    Ok(Some(CrlFacts {
        issuer: issuer.as_raw().to_vec(),
        issuer_text: issuer.to_string(),
        rank: (number, crl.last_update().timestamp()),
        next_update: crl.next_update().map(|t| t.timestamp()),
    }))
}

/// One CRL per issuer, the newest (see [`CrlFacts::rank`]): the verifier would use whichever
/// came first, so an old CRL left beside its successor (two files, or one appended to the
/// other) un-revoked what the newer one revokes. The older ones are logged. A CRL the parser
/// could not read is kept as it is.
fn newest_per_issuer(
    crls: Vec<(
        PathBuf,
        CertificateRevocationListDer<'static>,
        Option<CrlFacts>,
    )>,
) -> Vec<(CertificateRevocationListDer<'static>, Option<CrlFacts>)> {
    let newest = |i: usize, mine: &CrlFacts| {
        // Ties keep the first.
        !crls.iter().enumerate().any(|(j, (_, _, other))| {
            other.as_ref().is_some_and(|o| {
                o.issuer == mine.issuer && (o.rank > mine.rank || (o.rank == mine.rank && j < i))
            })
        })
    };
    let keep: Vec<bool> = crls
        .iter()
        .enumerate()
        .map(|(i, (_, _, facts))| facts.as_ref().is_none_or(|f| newest(i, f)))
        .collect();
    let mut kept = Vec::with_capacity(crls.len());
    for ((path, der, facts), keep) in crls.into_iter().zip(keep) {
        match facts {
            Some(f) if keep => kept.push((der, Some(f))),
            Some(f) => log::warn!(
                "{}: a CRL of {} (thisUpdate {}) is older than another of the same issuer in \
                 --crl; only the newest is used",
                path.display(),
                f.issuer_text,
                f.rank.1
            ),
            None => kept.push((der, None)),
        }
    }
    kept
}

/// The certificates of a CA bundle (position from 1, subject) that are not CA certificates.
fn not_cas(certs: &[CertificateDer<'_>]) -> Vec<(usize, String)> {
    certs
        .iter()
        .enumerate()
        .filter_map(|(i, der)| {
            let (_, cert) = x509_parser::parse_x509_certificate(der).ok()?;
            (!cert.is_ca()).then(|| (i + 1, cert.subject().to_string()))
        })
        .collect()
}

/// The client CAs (raw subject, text) that issued none of the CRLs (raw issuer, text).
fn without_crl<'a>(cas: &'a [(Vec<u8>, String)], crls: &[(Vec<u8>, String)]) -> Vec<&'a str> {
    cas.iter()
        .filter(|(subject, _)| !crls.iter().any(|(issuer, _)| issuer == subject))
        .map(|(_, text)| text.as_str())
        .collect()
}

fn read_certs(path: &Path) -> Result<Vec<CertificateDer<'static>>, TlsError> {
    let certs: Vec<_> = read_pem(path)?
        .into_iter()
        .filter_map(|item| match item {
            Item::X509Certificate(cert) => Some(cert),
            _ => None,
        })
        .collect();
    if certs.is_empty() {
        return Err(TlsError::Missing {
            path: path.to_owned(),
            what: "CERTIFICATE block",
        });
    }
    Ok(certs)
}

/// Whether PEM text holds an encrypted private key (PKCS#8 `ENCRYPTED PRIVATE KEY`, or a
/// traditional key with `Proc-Type: 4,ENCRYPTED`), which the PEM reader would report only as
/// unreadable.
pub fn encrypted_key_pem(pem: &[u8]) -> bool {
    let has = |needle: &[u8]| pem.windows(needle.len()).any(|w| w == needle);
    has(b"-----BEGIN ENCRYPTED PRIVATE KEY-----") || has(b"Proc-Type: 4,ENCRYPTED")
}

fn read_key(path: &Path) -> Result<PrivateKeyDer<'static>, TlsError> {
    if fs::read(path).is_ok_and(|pem| encrypted_key_pem(&pem)) {
        return Err(TlsError::EncryptedKey {
            path: path.to_owned(),
        });
    }
    let mut keys: Vec<PrivateKeyDer<'static>> = read_pem(path)?
        .into_iter()
        .filter_map(|item| match item {
            Item::Pkcs8Key(k) => Some(k.into()),
            Item::Pkcs1Key(k) => Some(k.into()),
            Item::Sec1Key(k) => Some(k.into()),
            _ => None,
        })
        .collect();
    match keys.len() {
        0 => Err(TlsError::Missing {
            path: path.to_owned(),
            what: "PRIVATE KEY block (PKCS#8, RSA or EC)",
        }),
        1 => Ok(keys.remove(0)),
        count => Err(TlsError::ManyKeys {
            path: path.to_owned(),
            count,
        }),
    }
}

fn read_crls(path: &Path) -> Result<Vec<CertificateRevocationListDer<'static>>, TlsError> {
    let crls: Vec<_> = read_pem(path)?
        .into_iter()
        .filter_map(|item| match item {
            Item::Crl(crl) => Some(crl),
            _ => None,
        })
        .collect();
    if crls.is_empty() {
        return Err(TlsError::Missing {
            path: path.to_owned(),
            what: "X509 CRL block",
        });
    }
    Ok(crls)
}

/// Every PEM block of `path`, read whole (the files are small; one read is one snapshot).
fn read_pem(path: &Path) -> Result<Vec<Item>, TlsError> {
    let bytes = fs::read(path).map_err(|source| TlsError::Read {
        path: path.to_owned(),
        source,
    })?;
    rustls_pemfile::read_all(&mut bytes.as_slice())
        .collect::<Result<Vec<_>, _>>()
        .map_err(|source| TlsError::Pem {
            path: path.to_owned(),
            source,
        })
}

#[cfg(test)]
mod tests {
    use super::{encrypted_key_pem, not_cas, without_crl};

    #[test]
    fn encrypted_keys_are_told_apart() {
        let pkcs8 =
            b"-----BEGIN ENCRYPTED PRIVATE KEY-----\nMIIB\n-----END ENCRYPTED PRIVATE KEY-----\n";
        let traditional = b"-----BEGIN EC PRIVATE KEY-----\nProc-Type: 4,ENCRYPTED\nDEK-Info: AES-256-CBC,00\n\nMHc\n-----END EC PRIVATE KEY-----\n";
        let plain = b"-----BEGIN PRIVATE KEY-----\nMIGH\n-----END PRIVATE KEY-----\n";
        assert!(encrypted_key_pem(pkcs8));
        assert!(encrypted_key_pem(traditional));
        assert!(!encrypted_key_pem(plain));
    }
    use rustls::pki_types::CertificateDer;

    fn named(pairs: &[(&[u8], &str)]) -> Vec<(Vec<u8>, String)> {
        pairs
            .iter()
            .map(|(raw, text)| (raw.to_vec(), text.to_string()))
            .collect()
    }

    #[test]
    fn a_leaf_in_a_ca_bundle_is_named() {
        use crate::dev_certs::{generate_rig, Ca};
        let now = time::OffsetDateTime::now_utc();
        let (from, until) = (
            now - time::Duration::hours(1),
            now + time::Duration::days(1),
        );
        let ca = Ca::new("bundle CA", from, until).expect("ca");
        let rig = generate_rig(&ca, "rig-0001", from, until).expect("rig");
        let pem = format!("{}{}", ca.cert_pem(), rig.cert_pem);
        let certs: Vec<CertificateDer<'static>> = rustls_pemfile::certs(&mut pem.as_bytes())
            .collect::<Result<_, _>>()
            .expect("pem");
        let named = not_cas(&certs);
        assert_eq!(named.len(), 1, "{named:?}");
        assert_eq!(named[0].0, 2);
        assert!(named[0].1.contains("rig-0001"), "{named:?}");
    }

    #[test]
    fn client_cas_without_a_crl_are_named() {
        let cas = named(&[(b"a", "CN=A"), (b"b", "CN=B"), (b"c", "CN=C")]);
        let crls = named(&[(b"b", "CN=B"), (b"x", "CN=X")]);
        assert_eq!(without_crl(&cas, &crls), ["CN=A", "CN=C"]);
        assert!(without_crl(&cas, &cas).is_empty());
        assert_eq!(without_crl(&cas, &[]).len(), 3);
    }
}
