//! One connection attempt: resolve the host name again (a moved broker, DNS load balancing),
//! connect to the first address that answers, TLS if `wss://`, then the websocket upgrade.
//! A `503` answer is reported with its `Retry-After` so the caller can honour it; a `4xx`
//! that no retry can change (a wrong path, a plain GET, a head too large, credentials the
//! broker refuses) as a refusal, so the agent stops instead of knocking forever.

use std::net::{SocketAddr, TcpStream, ToSocketAddrs};
use std::sync::mpsc::{self, RecvTimeoutError};
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
    /// A `4xx` other than 408 and 429: the same request would get the same answer.
    Refused(String),
    /// Anything else: resolution, connect, TLS, a 5xx, a timeout.
    Failed(String),
}

/// Whether an upgrade answered with `status` would be answered the same way next time.
/// 408 (the request was too slow) and 429 (too many requests) are about this moment, not
/// this request; everything else in 4xx is about the request itself.
pub(crate) fn refusal_is_final(status: u16) -> bool {
    (400..500).contains(&status) && status != 408 && status != 429
}

/// What `dial` gives back.
pub(crate) type Dialed = Result<(WebSocket<Stream>, SocketAddr), DialError>;

/// `dial` on a thread of its own, checking `stopping` every `poll`: a stop must not wait out
/// a stalled connect or handshake (10 s each). `None`: told to stop first; the abandoned
/// attempt ends with the process, which is stopping.
pub(crate) fn dial_unless(
    endpoint: &Endpoint,
    tls: Option<&Arc<ClientConfig>>,
    stopping: impl Fn() -> bool,
    poll: Duration,
) -> Option<Dialed> {
    let (tx, rx) = mpsc::sync_channel(1);
    let (endpoint_, tls_) = (endpoint.clone(), tls.cloned());
    let spawned = std::thread::Builder::new()
        .name("dial".into())
        .spawn(move || {
            let _ = tx.send(dial(&endpoint_, tls_.as_ref()));
        });
    if spawned.is_err() {
        // No thread to spare: dial here, as stoppable as its timeouts.
        return Some(dial(endpoint, tls));
    }
    loop {
        match rx.recv_timeout(poll) {
            Ok(dialed) => return Some(dialed),
            Err(RecvTimeoutError::Timeout) if stopping() => return None,
            Err(RecvTimeoutError::Timeout) => {}
            Err(RecvTimeoutError::Disconnected) => {
                return Some(Err(DialError::Failed("the dial thread died".into())))
            }
        }
    }
}

/// Connects to `endpoint`, returning the websocket and the address it reached.
pub(crate) fn dial(endpoint: &Endpoint, tls: Option<&Arc<ClientConfig>>) -> Dialed {
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
        Err(HandshakeError::Failure(tungstenite::Error::Http(resp)))
            if refusal_is_final(resp.status().as_u16()) =>
        {
            // The broker's own words where it gave some: a TLS port reached with ws:// says so.
            let said = resp
                .body()
                .as_deref()
                .map(|b| {
                    String::from_utf8_lossy(b)
                        .trim()
                        .chars()
                        .take(200)
                        .collect::<String>()
                })
                .filter(|b| !b.is_empty())
                .map(|b| format!(": {b:?}"))
                .unwrap_or_default();
            let guess = match resp.status().as_u16() {
                404 => " (is --url's path /agent?)",
                _ => "",
            };
            Err(DialError::Refused(format!(
                "{addr}: upgrade refused with HTTP {}{said}{guess}",
                resp.status()
            )))
        }
        Err(HandshakeError::Failure(tungstenite::Error::Http(resp))) => Err(DialError::Failed(
            format!("{addr}: upgrade refused with HTTP {}", resp.status()),
        )),
        Err(HandshakeError::Failure(e)) => Err(DialError::Failed(format!("{addr}: {e}"))),
    }
}

#[cfg(test)]
mod tests {
    use super::refusal_is_final;

    #[test]
    fn only_request_errors_are_final() {
        for status in [400, 401, 403, 404, 426, 431] {
            assert!(refusal_is_final(status), "{status}");
        }
        for status in [101, 302, 408, 429, 500, 502, 503] {
            assert!(!refusal_is_final(status), "{status}");
        }
    }
}
