//! `wss://`: a rustls client (TLS 1.3 and 1.2, ring) that trusts `--ca` (or the system bundle)
//! and presents `--tls-cert`/`--tls-key` for mTLS; and [`Stream`], the socket tungstenite
//! reads and writes, plain or TLS.
//!
//! The TLS is ours rather than tungstenite's feature, so the agent needs no root-store crate and
//! controls the read timeouts the session loop polls with.

use std::fs::File;
use std::io::{self, BufReader, Read, Write};
use std::net::TcpStream;
use std::path::Path;
use std::sync::Arc;

use anyhow::{bail, Context};
use rustls::pki_types::{CertificateDer, PrivateKeyDer, ServerName};
use rustls::{ClientConfig, ClientConnection, RootCertStore, StreamOwned};

/// Where distributions keep the system CA bundle; the first that exists is used without `--ca`.
const SYSTEM_BUNDLES: &[&str] = &[
    "/etc/ssl/certs/ca-certificates.crt",
    "/etc/pki/tls/certs/ca-bundle.crt",
    "/etc/ssl/cert.pem",
];

/// Builds the client configuration once at start (bad files are a startup error).
pub(crate) fn client_config(
    ca: Option<&Path>,
    identity: Option<(&Path, &Path)>,
) -> anyhow::Result<Arc<ClientConfig>> {
    let bundle = match ca {
        Some(path) => path.to_path_buf(),
        None => std::env::var_os("SSL_CERT_FILE")
            .map(Into::into)
            .or_else(|| {
                SYSTEM_BUNDLES
                    .iter()
                    .map(Path::new)
                    .find(|p| p.exists())
                    .map(Path::to_path_buf)
            })
            .context("wss:// without --ca, and no system CA bundle found")?,
    };
    let mut roots = RootCertStore::empty();
    let (added, _ignored) = roots.add_parsable_certificates(read_certs(&bundle)?);
    if added == 0 {
        bail!("no usable CA certificate in {}", bundle.display());
    }
    let provider = Arc::new(rustls::crypto::ring::default_provider());
    let builder = ClientConfig::builder_with_provider(provider)
        .with_protocol_versions(&[&rustls::version::TLS13, &rustls::version::TLS12])
        .context("TLS versions")?
        .with_root_certificates(roots);
    let config = match identity {
        Some((cert, key)) => {
            let chain = read_certs(cert)?;
            if chain.is_empty() {
                bail!("no certificate in --tls-cert {}", cert.display());
            }
            builder
                .with_client_auth_cert(chain, read_key(key)?)
                .context("--tls-cert/--tls-key")?
        }
        None => builder.with_no_client_auth(),
    };
    Ok(Arc::new(config))
}

fn read_certs(path: &Path) -> anyhow::Result<Vec<CertificateDer<'static>>> {
    let file = File::open(path).with_context(|| format!("opening {}", path.display()))?;
    rustls_pemfile::certs(&mut BufReader::new(file))
        .collect::<Result<_, _>>()
        .with_context(|| format!("reading PEM certificates from {}", path.display()))
}

fn read_key(path: &Path) -> anyhow::Result<PrivateKeyDer<'static>> {
    if std::fs::read(path).is_ok_and(|pem| fleetlink::tls::encrypted_key_pem(&pem)) {
        anyhow::bail!(
            "{}: an encrypted private key; give it decrypted (`openssl pkey -in KEY -out PLAIN`)",
            path.display()
        );
    }
    let file = File::open(path).with_context(|| format!("opening {}", path.display()))?;
    rustls_pemfile::private_key(&mut BufReader::new(file))
        .with_context(|| format!("reading PEM key from {}", path.display()))?
        .with_context(|| format!("no private key in {}", path.display()))
}

/// The connection's byte stream.
pub(crate) enum Stream {
    Plain(TcpStream),
    Tls(Box<StreamOwned<ClientConnection, TcpStream>>),
}

impl Stream {
    /// Wraps `tcp` in a TLS client for `host` (handshake happens on first IO).
    pub(crate) fn tls(
        config: &Arc<ClientConfig>,
        host: &str,
        tcp: TcpStream,
    ) -> io::Result<Stream> {
        let name = ServerName::try_from(host.to_string()).map_err(|e| {
            io::Error::new(
                io::ErrorKind::InvalidInput,
                format!("TLS server name {host:?}: {e}"),
            )
        })?;
        let conn = ClientConnection::new(config.clone(), name).map_err(io::Error::other)?;
        Ok(Stream::Tls(Box::new(StreamOwned::new(conn, tcp))))
    }

    /// The TCP socket underneath (for timeouts).
    pub(crate) fn tcp(&self) -> &TcpStream {
        match self {
            Stream::Plain(s) => s,
            Stream::Tls(s) => &s.sock,
        }
    }
}

// EINTR is retried here, at the edge: a socket with SO_RCVTIMEO fails reads with EINTR even
// under SA_RESTART (signal(7)), also after a stop/continue, and neither tungstenite's
// handshake nor its frame IO would retry it.
impl Read for Stream {
    fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        retry_eintr(|| match self {
            Stream::Plain(s) => s.read(buf),
            Stream::Tls(s) => s.read(buf),
        })
    }
}

impl Write for Stream {
    fn write(&mut self, buf: &[u8]) -> io::Result<usize> {
        retry_eintr(|| match self {
            Stream::Plain(s) => s.write(buf),
            Stream::Tls(s) => s.write(buf),
        })
    }

    fn flush(&mut self) -> io::Result<()> {
        retry_eintr(|| match self {
            Stream::Plain(s) => s.flush(),
            Stream::Tls(s) => s.flush(),
        })
    }
}

fn retry_eintr<T>(mut op: impl FnMut() -> io::Result<T>) -> io::Result<T> {
    loop {
        match op() {
            Err(e) if e.kind() == io::ErrorKind::Interrupted => continue,
            other => return other,
        }
    }
}
