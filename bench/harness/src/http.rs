//! A blocking one-shot HTTP/1.1 GET (`Connection: close`) for the brokers' admin endpoints:
//! `/readyz` while a broker starts, `/v1/rigs` to count registered rigs. Both brokers answer
//! with `Content-Length`; a reply without one is read to EOF.

use std::io::{Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::time::{Duration, Instant};

use anyhow::{bail, Context, Result};

/// Status and body of one reply.
pub(crate) struct Reply {
    /// HTTP status code.
    pub(crate) status: u16,
    /// The body bytes (after the head, up to Content-Length).
    pub(crate) body: Vec<u8>,
}

/// GETs `path` from `addr`; connect, write and read each bounded by `timeout`.
pub(crate) fn get(addr: SocketAddr, path: &str, timeout: Duration) -> Result<Reply> {
    get_timed(addr, path, timeout).map(|(reply, _)| reply)
}

/// [`get`], and when the reply's last byte was read.
fn get_timed(addr: SocketAddr, path: &str, timeout: Duration) -> Result<(Reply, Instant)> {
    let mut s =
        TcpStream::connect_timeout(&addr, timeout).with_context(|| format!("connect {addr}"))?;
    s.set_read_timeout(Some(timeout))?;
    s.set_write_timeout(Some(timeout))?;
    write!(
        s,
        "GET {path} HTTP/1.1\r\nHost: {addr}\r\nConnection: close\r\n\r\n"
    )?;
    let mut raw = Vec::new();
    s.read_to_end(&mut raw).context("reading reply")?;
    let received = Instant::now();
    Ok((parse(&raw)?, received))
}

/// Counts the JSON array `GET /v1/rigs` returns (fleetlink-fe and the baseline alike), and
/// when its last byte arrived: the broker's part ends there, and parsing takes the harness
/// longer for the broker that lists more fields per rig.
pub(crate) fn rig_count(admin: SocketAddr) -> Result<(usize, Instant)> {
    let (reply, received) = get_timed(admin, "/v1/rigs", Duration::from_secs(10))?;
    if reply.status != 200 {
        bail!("GET /v1/rigs: HTTP {}", reply.status);
    }
    let v: serde_json::Value =
        serde_json::from_slice(&reply.body).context("GET /v1/rigs: not JSON")?;
    let n = v
        .as_array()
        .map(Vec::len)
        .context("GET /v1/rigs: not an array")?;
    Ok((n, received))
}

fn parse(raw: &[u8]) -> Result<Reply> {
    let head_end = raw
        .windows(4)
        .position(|w| w == b"\r\n\r\n")
        .context("reply without a complete head")?;
    let head = std::str::from_utf8(&raw[..head_end]).context("head is not UTF-8")?;
    let status = head
        .split_whitespace()
        .nth(1)
        .and_then(|s| s.parse().ok())
        .context("bad status line")?;
    let length = head.lines().find_map(|l| {
        let (k, v) = l.split_once(':')?;
        k.trim()
            .eq_ignore_ascii_case("content-length")
            .then(|| v.trim().parse::<usize>().ok())?
    });
    let body = &raw[head_end + 4..];
    let body = match length {
        Some(n) if n <= body.len() => &body[..n],
        Some(n) => bail!("reply body cut short: {} of {n} bytes", body.len()),
        None => body,
    };
    Ok(Reply {
        status,
        body: body.to_vec(),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_length_delimited_and_eof_bodies() {
        let r = parse(b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\n[]xx").unwrap();
        assert_eq!((r.status, r.body.as_slice()), (200, &b"[]"[..]));
        let r = parse(b"HTTP/1.1 503 Busy\r\n\r\nbusy\n").unwrap();
        assert_eq!((r.status, r.body.as_slice()), (503, &b"busy\n"[..]));
        assert!(parse(b"HTTP/1.1 200 OK\r\nContent-Length: 9\r\n\r\n[]").is_err());
        assert!(parse(b"HTTP/1.1 200").is_err());
    }
}
