//! PEM files as rustls types, with errors that name the file. Public because the tokio
//! baseline loads its server certificate and client CA bundle the same way.

use std::fs::File;
use std::io::BufReader;
use std::path::Path;

use anyhow::{bail, Context, Result};
use rustls::pki_types::{CertificateDer, PrivateKeyDer};
use rustls::RootCertStore;

/// Every certificate in `path`; an error when there is none.
pub fn read_certs(path: &Path) -> Result<Vec<CertificateDer<'static>>> {
    let f = File::open(path).with_context(|| format!("reading {}", path.display()))?;
    let certs = rustls_pemfile::certs(&mut BufReader::new(f))
        .collect::<Result<Vec<_>, _>>()
        .with_context(|| format!("{}: not valid PEM", path.display()))?;
    if certs.is_empty() {
        bail!("{}: no CERTIFICATE block found", path.display());
    }
    Ok(certs)
}

/// The first private key in `path`.
pub fn read_key(path: &Path) -> Result<PrivateKeyDer<'static>> {
    let f = File::open(path).with_context(|| format!("reading {}", path.display()))?;
    rustls_pemfile::private_key(&mut BufReader::new(f))
        .with_context(|| format!("{}: not valid PEM", path.display()))?
        .with_context(|| format!("{}: no private key found", path.display()))
}

/// A trust store of every certificate in the bundle `ca`; one that is not a usable CA is an
/// error rather than skipped, so a wrong file fails at start-up instead of at every handshake.
pub fn read_roots(ca: &Path) -> Result<RootCertStore> {
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
    Ok(roots)
}
