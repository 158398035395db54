//! One connection attempt: resolve the host name again (a moved broker, DNS load balancing),
//! connect to the first address that answers, TLS if `wss://`, then the websocket upgrade.
//! A `503` answer is reported with its `Retry-After` so the caller can honour it.

use std::net::{SocketAddr, TcpStream, ToSocketAddrs};
use std::sync::Arc;
use std::time::Duration;

use rustls::ClientConfig;
use tungstenite::handshake::HandshakeError;
use tungstenite::protocol::WebSocketConfig;
use tungstenite::WebSocket;

use crate::backoff::parse_retry_after;
use crate::cli::Endpoint;
use crate::tls::Stream;

/// Per-address TCP connect timeout.
const CONNECT_TIMEOUT: Duration = Duration::from_secs(10);
/// Read and write timeout during the TLS and websocket handshakes.
const HANDSHAKE_TIMEOUT: Duration = Duration::from_secs(10);
/// Largest message accepted from the broker (its commands are far smaller).
const MAX_INBOUND_MESSAGE: usize = 16 << 20;

/// Why an attempt got no websocket.
#[derive(Debug)]
pub(crate) enum DialError {
    /// `503 Service Unavailable`; the header's seconds when it had a usable `Retry-After`.
    Unavailable { retry_after: Option<u64> },
    /// Anything else: resolution, connect, TLS, another status.
    Failed(String),
}

/// Connects to `endpoint`, returning the websocket and the address it reached.
pub(crate) fn dial(
    endpoint: &Endpoint,
    tls: Option<&Arc<ClientConfig>>,
) -> Result<(WebSocket<Stream>, SocketAddr), DialError> {
    let addrs = (endpoint.host.as_str(), endpoint.port)
        .to_socket_addrs()
        .map_err(|e| DialError::Failed(format!("resolving {}: {e}", endpoint.host)))?;
    let mut last_err = format!("{} resolved to no address", endpoint.host);
    let mut connected = None;
    for addr in addrs {
        match TcpStream::connect_timeout(&addr, CONNECT_TIMEOUT) {
            Ok(tcp) => {
                connected = Some((tcp, addr));
                break;
            }
            Err(e) => last_err = format!("connecting to {addr}: {e}"),
        }
    }
    let (tcp, addr) = connected.ok_or(DialError::Failed(last_err))?;
    let setup = |tcp: &TcpStream| -> std::io::Result<()> {
        tcp.set_nodelay(true)?;
        tcp.set_read_timeout(Some(HANDSHAKE_TIMEOUT))?;
        tcp.set_write_timeout(Some(HANDSHAKE_TIMEOUT))
    };
    setup(&tcp).map_err(|e| DialError::Failed(format!("socket options: {e}")))?;
    let stream = match tls {
        Some(config) => Stream::tls(config, &endpoint.host, tcp)
            .map_err(|e| DialError::Failed(e.to_string()))?,
        None => Stream::Plain(tcp),
    };
    let config = WebSocketConfig::default().max_message_size(Some(MAX_INBOUND_MESSAGE));
    match tungstenite::client::client_with_config(endpoint.url.as_str(), stream, Some(config)) {
        Ok((ws, _response)) => Ok((ws, addr)),
        Err(HandshakeError::Interrupted(_)) => {
            Err(DialError::Failed(format!("{addr}: handshake timed out")))
        }
        Err(HandshakeError::Failure(tungstenite::Error::Http(resp)))
            if resp.status().as_u16() == 503 =>
        {
            let retry_after = resp
                .headers()
                .get("retry-after")
                .and_then(|v| v.to_str().ok())
                .and_then(parse_retry_after);
            Err(DialError::Unavailable { retry_after })
        }
        Err(HandshakeError::Failure(tungstenite::Error::Http(resp))) => Err(DialError::Failed(
            format!("{addr}: upgrade refused with HTTP {}", resp.status()),
        )),
        Err(HandshakeError::Failure(e)) => Err(DialError::Failed(format!("{addr}: {e}"))),
    }
}
