//! One connection attempt: resolve the host name again (a moved broker, DNS load balancing),
//! connect to the first address that answers, TLS if `wss://`, then the websocket upgrade.
//! A `503` answer is reported with its `Retry-After` so the caller can honour it; a `4xx`
//! that no retry can change (a wrong path, a plain GET, a head too large, credentials the
//! broker refuses) as a refusal, so the agent stops instead of knocking forever. A bearer
//! token is read from its file at every attempt, and its 401 is retried: the file may be
//! renewed.

use std::net::{SocketAddr, TcpStream, ToSocketAddrs};
use std::path::Path;
use std::sync::mpsc::{self, RecvTimeoutError};
use std::sync::Arc;
use std::time::Duration;

use rustls::ClientConfig;
use tungstenite::client::IntoClientRequest;
use tungstenite::handshake::HandshakeError;
use tungstenite::http::header::{HeaderValue, AUTHORIZATION};
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
    token_file: Option<&Path>,
    stopping: impl Fn() -> bool,
    poll: Duration,
) -> Option<Dialed> {
    let (tx, rx) = mpsc::sync_channel(1);
    let (endpoint_, tls_) = (endpoint.clone(), tls.cloned());
    let token_ = token_file.map(Path::to_path_buf);
    let spawned = std::thread::Builder::new()
        .name("dial".into())
        .spawn(move || {
            let _ = tx.send(dial(&endpoint_, tls_.as_ref(), token_.as_deref()));
        });
    if spawned.is_err() {
        // No thread to spare: dial here, as stoppable as its timeouts.
        return Some(dial(endpoint, tls, token_file));
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

/// The `Authorization` value for the token in `path`: read now, so that a renewed token is
/// the one sent. An empty file is an error, as the broker would refuse it anyway.
pub(crate) fn bearer(path: &Path) -> Result<HeaderValue, String> {
    let text = std::fs::read_to_string(path)
        .map_err(|e| format!("--token-file {}: {e}", path.display()))?;
    let token = text.trim();
    if token.is_empty() {
        return Err(format!("--token-file {}: empty", path.display()));
    }
    HeaderValue::from_str(&format!("Bearer {token}")).map_err(|_| {
        format!(
            "--token-file {}: not a token (control characters or non-ASCII bytes)",
            path.display()
        )
    })
}

/// Connects to `endpoint`, returning the websocket and the address it reached.
pub(crate) fn dial(
    endpoint: &Endpoint,
    tls: Option<&Arc<ClientConfig>>,
    token_file: Option<&Path>,
) -> Dialed {
    let mut request = endpoint
        .url
        .as_str()
        .into_client_request()
        .map_err(|e| DialError::Failed(format!("--url: {e}")))?;
    if let Some(path) = token_file {
        let value = bearer(path).map_err(DialError::Failed)?;
        request.headers_mut().insert(AUTHORIZATION, value);
    }
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
    match tungstenite::client::client_with_config(request, stream, Some(config)) {
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
        // The token may have expired; its file is read again at the next attempt.
        Err(HandshakeError::Failure(tungstenite::Error::Http(resp)))
            if resp.status().as_u16() == 401 && token_file.is_some() =>
        {
            Err(DialError::Failed(format!(
                "{addr}: upgrade refused with HTTP 401: the broker does not take the token in \
                 --token-file (expired, or signed with a key it does not have)"
            )))
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
