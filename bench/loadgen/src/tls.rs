//! wss rigs: a rustls client (ring provider, TLS 1.3 and 1.2) driven by tokio-rustls over the
//! socket the rig bound and connected itself, then the websocket upgrade over the TLS stream.
//!
//! Session resumption is disabled: every rig does a full handshake, which is what a fleet of
//! separate devices does on its first connection and what the handshake benches count. The
//! server name (SNI and the name the broker's certificate is verified against) is
//! `--server-name`, independent of the address in the URL, so `wss://127.0.0.1:PORT` can verify
//! a certificate issued for `localhost`.

use std::fmt;
use std::io;
use std::path::Path;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context as TaskContext, Poll};

use anyhow::{Context, Result};
use rustls::client::Resumption;
use rustls::pki_types::ServerName;
use rustls::ClientConfig;
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::net::TcpStream;
use tokio_rustls::client::TlsStream;
use tokio_rustls::TlsConnector;

use crate::pem::{read_certs, read_key, read_roots};

/// What every wss rig of a worker shares: the connector and the name to verify.
#[derive(Clone)]
pub struct TlsClient {
    pub connector: TlsConnector,
    pub server_name: ServerName<'static>,
}

impl fmt::Debug for TlsClient {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("TlsClient")
            .field("server_name", &self.server_name)
            .finish_non_exhaustive()
    }
}

impl TlsClient {
    /// Trusts the certificates in `ca`; presents `cert`/`key` when given (one identity for all
    /// rigs). No resumption, ALPN `http/1.1`.
    pub fn new(ca: &Path, client: Option<(&Path, &Path)>, server_name: &str) -> Result<TlsClient> {
        let roots = read_roots(ca)?;
        let provider = Arc::new(rustls::crypto::ring::default_provider());
        let builder = ClientConfig::builder_with_provider(provider)
            .with_protocol_versions(&[&rustls::version::TLS13, &rustls::version::TLS12])
            .context("TLS protocol versions")?
            .with_root_certificates(roots);
        let mut config = match client {
            Some((cert, key)) => builder
                .with_client_auth_cert(read_certs(cert)?, read_key(key)?)
                .with_context(|| format!("{} with key {}", cert.display(), key.display()))?,
            None => builder.with_no_client_auth(),
        };
        config.resumption = Resumption::disabled();
        config.alpn_protocols = vec![b"http/1.1".to_vec()];
        let server_name = ServerName::try_from(server_name.to_owned())
            .with_context(|| format!("bad --server-name {server_name:?}"))?;
        Ok(TlsClient {
            connector: TlsConnector::from(Arc::new(config)),
            server_name,
        })
    }
}

/// A failure reason for the report from a TLS handshake error: rustls errors come wrapped in an
/// `io::Error` of kind `InvalidData`.
pub fn handshake_reason(e: &io::Error) -> Option<String> {
    let tls = e.get_ref()?.downcast_ref::<rustls::Error>()?;
    // The variant's name only: `NotValidForNameContext { .. }` -> `notvalidfornamecontext`.
    let name = |debug: String| -> String {
        debug
            .chars()
            .take_while(char::is_ascii_alphanumeric)
            .map(|c| c.to_ascii_lowercase())
            .collect()
    };
    Some(match tls {
        rustls::Error::InvalidCertificate(c) => {
            format!("tls_bad_server_cert_{}", name(format!("{c:?}")))
        }
        rustls::Error::AlertReceived(a) => format!("tls_alert_{}", name(format!("{a:?}"))),
        _ => "tls_error".to_string(),
    })
}

/// A rig's byte stream: plain TCP or TLS over TCP (boxed: a client connection is ~1 KiB).
pub enum RigStream {
    Plain(TcpStream),
    Tls(Box<TlsStream<TcpStream>>),
}

impl AsyncRead for RigStream {
    fn poll_read(
        self: Pin<&mut Self>,
        cx: &mut TaskContext<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        match self.get_mut() {
            RigStream::Plain(s) => Pin::new(s).poll_read(cx, buf),
            RigStream::Tls(s) => Pin::new(s.as_mut()).poll_read(cx, buf),
        }
    }
}

impl AsyncWrite for RigStream {
    fn poll_write(
        self: Pin<&mut Self>,
        cx: &mut TaskContext<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        match self.get_mut() {
            RigStream::Plain(s) => Pin::new(s).poll_write(cx, buf),
            RigStream::Tls(s) => Pin::new(s.as_mut()).poll_write(cx, buf),
        }
    }

    fn poll_flush(self: Pin<&mut Self>, cx: &mut TaskContext<'_>) -> Poll<io::Result<()>> {
        match self.get_mut() {
            RigStream::Plain(s) => Pin::new(s).poll_flush(cx),
            RigStream::Tls(s) => Pin::new(s.as_mut()).poll_flush(cx),
        }
    }

    fn poll_shutdown(self: Pin<&mut Self>, cx: &mut TaskContext<'_>) -> Poll<io::Result<()>> {
        match self.get_mut() {
            RigStream::Plain(s) => Pin::new(s).poll_shutdown(cx),
            RigStream::Tls(s) => Pin::new(s.as_mut()).poll_shutdown(cx),
        }
    }
}
