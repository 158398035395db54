//! A minimal keep-alive HTTP/1.1 client: enough to POST JSON to the admin API quickly and
//! read `Content-Length` (or close-delimited) replies. No chunked encoding, no TLS.

use std::net::SocketAddr;

use anyhow::{bail, Context, Result};
use tokio::io::{AsyncBufReadExt, AsyncReadExt, AsyncWriteExt, BufReader};
use tokio::net::TcpStream;

/// Largest reply body accepted (admin replies are small JSON objects).
const MAX_BODY: usize = 1 << 20;

/// The server closed the connection before reading the request (see [`HttpConn::request`]).
#[derive(Debug)]
struct StaleConnection;

impl std::fmt::Display for StaleConnection {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("connection closed before the request was read")
    }
}

impl std::error::Error for StaleConnection {}

/// No connection to the server could be opened: the request was never written.
#[derive(Debug)]
struct Unreachable(std::io::Error);

impl std::fmt::Display for Unreachable {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "connect: {}", self.0)
    }
}

impl std::error::Error for Unreachable {}

/// Whether a failed [`HttpConn::request`] was never written: no connection could be opened.
/// (A connection that ends before the reply may have had its request read, so it counts as
/// sent.)
pub fn never_sent(e: &anyhow::Error) -> bool {
    e.is::<Unreachable>()
}

pub struct HttpConn {
    addr: SocketAddr,
    host: String,
    stream: Option<BufReader<TcpStream>>,
}

/// Status and body of one reply.
#[derive(Debug)]
pub struct Reply {
    pub status: u16,
    pub body: Vec<u8>,
}

impl HttpConn {
    pub fn new(addr: SocketAddr, host: String) -> Self {
        Self {
            addr,
            host,
            stream: None,
        }
    }

    /// Sends one request on the kept-alive connection (opening one if needed). A failed request
    /// is not retried, since a POST may already have been applied, with one exception: a reused
    /// connection that the server had already closed as idle (the write fails, or EOF comes
    /// before any byte of a reply). The server never read that request, so it is sent once more
    /// on a new connection.
    pub async fn request(&mut self, method: &str, path: &str, body: &[u8]) -> Result<Reply> {
        let reused = self.stream.is_some();
        let mut result = self.request_inner(method, path, body).await;
        if reused && result.as_ref().is_err_and(|e| e.is::<StaleConnection>()) {
            self.stream = None;
            result = self.request_inner(method, path, body).await;
        }
        if result.is_err() {
            self.stream = None;
        }
        result
    }

    async fn request_inner(&mut self, method: &str, path: &str, body: &[u8]) -> Result<Reply> {
        if self.stream.is_none() {
            let s = TcpStream::connect(self.addr).await.map_err(Unreachable)?;
            s.set_nodelay(true)?;
            self.stream = Some(BufReader::new(s));
        }
        let stream = self.stream.as_mut().context("no stream")?;
        let head = format!(
            "{method} {path} HTTP/1.1\r\nHost: {}\r\nContent-Type: application/json\r\nContent-Length: {}\r\n\r\n",
            self.host,
            body.len()
        );
        let mut req = Vec::with_capacity(head.len() + body.len());
        req.extend_from_slice(head.as_bytes());
        req.extend_from_slice(body);
        if stream.get_mut().write_all(&req).await.is_err() {
            return Err(StaleConnection.into());
        }

        let mut line = String::new();
        match stream.read_line(&mut line).await {
            Ok(0) => return Err(StaleConnection.into()),
            Ok(_) => {}
            Err(e) if e.kind() == std::io::ErrorKind::ConnectionReset && line.is_empty() => {
                return Err(StaleConnection.into())
            }
            Err(e) => return Err(e).context("read status"),
        }
        let status: u16 = line
            .split_whitespace()
            .nth(1)
            .and_then(|s| s.parse().ok())
            .with_context(|| format!("bad status line {line:?}"))?;
        let (mut length, mut close) = (None, false);
        loop {
            line.clear();
            if stream.read_line(&mut line).await.context("read header")? == 0 {
                bail!("connection closed in headers");
            }
            let l = line.trim_end();
            if l.is_empty() {
                break;
            }
            if let Some((k, v)) = l.split_once(':') {
                let (k, v) = (k.trim().to_ascii_lowercase(), v.trim());
                match k.as_str() {
                    "content-length" => {
                        length = Some(v.parse::<usize>().context("content-length")?)
                    }
                    "connection" => close = v.eq_ignore_ascii_case("close"),
                    "transfer-encoding" if !v.eq_ignore_ascii_case("identity") => {
                        bail!("transfer-encoding {v} not supported")
                    }
                    _ => {}
                }
            }
        }
        let mut body = Vec::new();
        match length {
            Some(n) if n > MAX_BODY => bail!("reply body too large ({n})"),
            Some(n) => {
                body.resize(n, 0);
                stream.read_exact(&mut body).await.context("read body")?;
            }
            None => {
                stream
                    .take(MAX_BODY as u64)
                    .read_to_end(&mut body)
                    .await
                    .context("read body")?;
                close = true;
            }
        }
        if close {
            self.stream = None;
        }
        Ok(Reply { status, body })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use tokio::net::TcpListener;

    #[tokio::test]
    async fn keep_alive_round_trips() {
        let l = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = l.local_addr().unwrap();
        tokio::spawn(async move {
            let (s, _) = l.accept().await.unwrap();
            let mut s = BufReader::new(s);
            for i in 0..2 {
                answer(&mut s, i).await;
            }
        });
        let mut c = HttpConn::new(addr, "x".into());
        let r = c.request("POST", "/a", b"{}").await.unwrap();
        assert_eq!((r.status, r.body.as_slice()), (200, &b"{\"n\":0}"[..]));
        let r = c.request("POST", "/b", b"{}").await.unwrap();
        assert_eq!(r.body, b"{\"n\":1}");
    }

    /// Reads one request head and body and answers it with `n`.
    async fn answer(s: &mut BufReader<TcpStream>, n: usize) {
        let mut len = 0;
        loop {
            let mut line = String::new();
            s.read_line(&mut line).await.unwrap();
            if line == "\r\n" {
                break;
            }
            if let Some(v) = line.to_ascii_lowercase().strip_prefix("content-length:") {
                len = v.trim().parse().unwrap();
            }
        }
        let mut body = vec![0; len];
        s.read_exact(&mut body).await.unwrap();
        let reply = format!("{{\"n\":{n}}}");
        let msg = format!(
            "HTTP/1.1 200 OK\r\nContent-Length: {}\r\n\r\n{reply}",
            reply.len()
        );
        s.get_mut().write_all(msg.as_bytes()).await.unwrap();
    }

    #[tokio::test]
    async fn a_connection_the_server_closed_as_idle_is_replaced_once() {
        let l = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = l.local_addr().unwrap();
        let (closed_tx, closed_rx) = tokio::sync::oneshot::channel();
        let server = tokio::spawn(async move {
            // First connection: one answer, then closed as an idle keep-alive would be.
            let (s, _) = l.accept().await.unwrap();
            let mut s = BufReader::new(s);
            answer(&mut s, 0).await;
            drop(s);
            closed_tx.send(()).unwrap();
            // The retry arrives on a second connection.
            let (s, _) = l.accept().await.unwrap();
            answer(&mut BufReader::new(s), 1).await;
            // A fresh connection that fails is not retried: accept and close at once.
            let (s, _) = l.accept().await.unwrap();
            drop(s);
            let third = tokio::time::timeout(std::time::Duration::from_millis(300), l.accept());
            assert!(
                third.await.is_err(),
                "a fresh connection's failure was retried"
            );
        });
        let mut c = HttpConn::new(addr, "x".into());
        assert_eq!(
            c.request("POST", "/a", b"{}").await.unwrap().body,
            b"{\"n\":0}"
        );
        closed_rx.await.unwrap();
        let r = c.request("POST", "/b", b"{}").await.unwrap();
        assert_eq!(r.body, b"{\"n\":1}");
        // The connection is kept alive after that answer; the server drops it, so this
        // request retries once (the stale case) and then fails on the fresh connection.
        assert!(c.request("POST", "/c", b"{}").await.is_err());
        server.await.unwrap();
    }
}
