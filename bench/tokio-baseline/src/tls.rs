//! wss for the baseline: a rustls server config (ring provider, TLS 1.3 and 1.2, like
//! fleetlink-fe) used through tokio-rustls, accepted before the websocket upgrade.
//!
//! Resumption is off as in fleetlink-fe (no session cache, no TLS 1.3 tickets), so both brokers
//! do the same work per handshake and every handshake is a full one. With `--client-ca` a client
//! certificate chaining to the bundle is required; the baseline does not map it to a rig id
//! (no 4403 identity check: that is fleetlink-fe's contract, not this comparison's).

use std::path::Path;
use std::sync::Arc;

use anyhow::{Context, Result};
// The load generator's PEM loader: the same file handling and error messages on both ends
// of the wss benches, and no second copy to drift.
use fleetlink_loadgen::pem::{read_certs, read_key, read_roots};
use rustls::server::{NoServerSessionStorage, WebPkiClientVerifier};
use rustls::ServerConfig;

/// The server config for `--tls-cert`/`--tls-key` and, if given, `--client-ca`.
pub fn server_config(cert: &Path, key: &Path, client_ca: Option<&Path>) -> Result<ServerConfig> {
    let provider = Arc::new(rustls::crypto::ring::default_provider());
    let builder = ServerConfig::builder_with_provider(provider.clone())
        .with_protocol_versions(&[&rustls::version::TLS13, &rustls::version::TLS12])
        .context("TLS protocol versions")?;
    let builder = match client_ca {
        Some(ca) => {
            let roots = Arc::new(read_roots(ca)?);
            let verifier = WebPkiClientVerifier::builder_with_provider(roots, provider)
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
