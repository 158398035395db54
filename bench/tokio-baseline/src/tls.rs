//! wss for the baseline: a rustls server config (ring provider, TLS 1.3 and 1.2, like
//! fleetlink-fe) used through tokio-rustls, accepted before the websocket upgrade.
//!
//! Resumption is off as in fleetlink-fe (no session cache, no TLS 1.3 tickets), so both brokers
//! do the same work per handshake and every handshake is a full one. With `--client-ca` a client
//! certificate chaining to the bundle is required; the baseline does not map it to a rig id
//! (no 4403 identity check: that is fleetlink-fe's contract, not this comparison's).

use std::fs::File;
use std::io::BufReader;
use std::path::Path;
use std::sync::Arc;

use anyhow::{bail, Context, Result};
use rustls::pki_types::{CertificateDer, PrivateKeyDer};
use rustls::server::{NoServerSessionStorage, WebPkiClientVerifier};
use rustls::{RootCertStore, ServerConfig};

fn read_certs(path: &Path) -> Result<Vec<CertificateDer<'static>>> {
    let f = File::open(path).with_context(|| format!("reading {}", path.display()))?;
    let certs = rustls_pemfile::certs(&mut BufReader::new(f))
        .collect::<Result<Vec<_>, _>>()
        .with_context(|| format!("{}: not valid PEM", path.display()))?;
    if certs.is_empty() {
        bail!("{}: no CERTIFICATE block found", path.display());
    }
    Ok(certs)
}

fn read_key(path: &Path) -> Result<PrivateKeyDer<'static>> {
    let f = File::open(path).with_context(|| format!("reading {}", path.display()))?;
    rustls_pemfile::private_key(&mut BufReader::new(f))
        .with_context(|| format!("{}: not valid PEM", path.display()))?
        .with_context(|| format!("{}: no private key found", path.display()))
}

/// The server config for `--tls-cert`/`--tls-key` and, if given, `--client-ca`.
pub fn server_config(cert: &Path, key: &Path, client_ca: Option<&Path>) -> Result<ServerConfig> {
    let provider = Arc::new(rustls::crypto::ring::default_provider());
    let builder = ServerConfig::builder_with_provider(provider.clone())
        .with_protocol_versions(&[&rustls::version::TLS13, &rustls::version::TLS12])
        .context("TLS protocol versions")?;
    let builder = match client_ca {
        Some(ca) => {
            let mut roots = RootCertStore::empty();
            for (i, c) in read_certs(ca)?.into_iter().enumerate() {
                roots.add(c).with_context(|| {
                    format!(
                        "{}: certificate #{} is not a usable CA",
                        ca.display(),
                        i + 1
                    )
                })?;
            }
            let verifier = WebPkiClientVerifier::builder_with_provider(Arc::new(roots), provider)
                .build()
                .with_context(|| format!("{}: client verifier", ca.display()))?;
            builder.with_client_cert_verifier(verifier)
        }
        None => builder.with_no_client_auth(),
    };
    let mut config = builder
        .with_single_cert(read_certs(cert)?, read_key(key)?)
        .with_context(|| format!("{} with key {}", cert.display(), key.display()))?;
    config.alpn_protocols = vec![b"http/1.1".to_vec()];
    config.session_storage = Arc::new(NoServerSessionStorage {});
    config.send_tls13_tickets = 0;
    Ok(config)
}
