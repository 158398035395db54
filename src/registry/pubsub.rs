//! A minimal, non-blocking Redis pub/sub reader for the bridge thread.
//!
//! The `redis` crate's sync `PubSub` blocks in its read, which would leave the bridge unable to
//! serve its inbox. This reader owns a plain TCP socket in non-blocking mode, so the bridge can
//! `poll(2)` it together with its inbox doorbell and never busy-waits.

use std::io::{self, Read, Write};
use std::net::{TcpStream, ToSocketAddrs};
use std::os::fd::{AsRawFd, RawFd};
use std::os::unix::net::UnixStream;
use std::time::Duration;

use redis::{ConnectionAddr, ConnectionInfo};

use crate::registry::resp::{self, Value};

/// Largest unparsed input kept; a longer message than this from Redis is a protocol failure.
const MAX_BUFFER: usize = 64 << 20;

/// Bytes taken from the socket per [`Subscriber::read`]: a burst of thousands of commands is
/// handed to the cores a few hundred at a time, so the first rigs get theirs while the rest are
/// still being parsed. The socket stays readable, so the caller comes back for more.
const READ_PER_CALL: usize = 64 * 1024;

/// One pushed message on a subscribed channel.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Push {
    /// The channel.
    pub channel: String,
    /// The payload.
    pub payload: Vec<u8>,
}

/// The socket to Redis: TCP, or a Unix socket for a Redis on the same host (`unix://`).
pub(crate) enum Stream {
    Tcp(TcpStream),
    Unix(UnixStream),
}

impl Stream {
    /// Connects to what `addr` names, giving up after `timeout`.
    pub(crate) fn connect(addr: &ConnectionAddr, timeout: Duration) -> io::Result<Stream> {
        let stream = match addr {
            ConnectionAddr::Tcp(host, port) => {
                let addr = (host.as_str(), *port)
                    .to_socket_addrs()?
                    .next()
                    .ok_or_else(|| {
                        io::Error::new(io::ErrorKind::NotFound, "redis host did not resolve")
                    })?;
                let stream = TcpStream::connect_timeout(&addr, timeout)?;
                stream.set_nodelay(true)?;
                Stream::Tcp(stream)
            }
            // A connect to a Unix socket does not wait on the network: it succeeds, or fails
            // at once when nothing listens there.
            ConnectionAddr::Unix(path) => Stream::Unix(UnixStream::connect(path)?),
            _ => {
                return Err(io::Error::new(
                    io::ErrorKind::Unsupported,
                    "only redis:// over TCP and unix:// are supported",
                ))
            }
        };
        stream.set_timeouts(Some(timeout))?;
        Ok(stream)
    }

    /// The read timeout alone: what the next read may wait.
    pub(crate) fn set_read_timeout(&self, timeout: Option<Duration>) -> io::Result<()> {
        match self {
            Stream::Tcp(s) => s.set_read_timeout(timeout),
            Stream::Unix(s) => s.set_read_timeout(timeout),
        }
    }

    /// The write timeout alone: what the next write may wait.
    pub(crate) fn set_write_timeout(&self, timeout: Option<Duration>) -> io::Result<()> {
        match self {
            Stream::Tcp(s) => s.set_write_timeout(timeout),
            Stream::Unix(s) => s.set_write_timeout(timeout),
        }
    }

    pub(crate) fn set_timeouts(&self, timeout: Option<Duration>) -> io::Result<()> {
        match self {
            Stream::Tcp(s) => s
                .set_read_timeout(timeout)
                .and_then(|()| s.set_write_timeout(timeout)),
            Stream::Unix(s) => s
                .set_read_timeout(timeout)
                .and_then(|()| s.set_write_timeout(timeout)),
        }
    }

    fn set_nonblocking(&self) -> io::Result<()> {
        match self {
            Stream::Tcp(s) => s.set_nonblocking(true),
            Stream::Unix(s) => s.set_nonblocking(true),
        }
    }
}

impl Read for Stream {
    fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        match self {
            Stream::Tcp(s) => s.read(buf),
            Stream::Unix(s) => s.read(buf),
        }
    }
}

impl Write for Stream {
    fn write(&mut self, buf: &[u8]) -> io::Result<usize> {
        match self {
            Stream::Tcp(s) => s.write(buf),
            Stream::Unix(s) => s.write(buf),
        }
    }

    fn flush(&mut self) -> io::Result<()> {
        Ok(())
    }
}

impl AsRawFd for Stream {
    fn as_raw_fd(&self) -> RawFd {
        match self {
            Stream::Tcp(s) => s.as_raw_fd(),
            Stream::Unix(s) => s.as_raw_fd(),
        }
    }
}

/// A subscription connection.
pub struct Subscriber {
    stream: Stream,
    buf: Vec<u8>,
    /// How far the first push in `buf` was walked while it was incomplete.
    scan: resp::Scan,
    /// Channels confirmed by Redis so far.
    pub confirmed: usize,
    /// How the connection ended, once it has: said by the call after the one that returns
    /// the messages read before the end. Redis may push a command and close the subscription
    /// in one breath (a `CLIENT KILL`): that command was published to a subscriber, control
    /// was told someone has it, and dropped with the end it went unanswered (review bb144).
    ended: Option<(io::ErrorKind, String)>,
}

impl Subscriber {
    /// Connects (with AUTH when the URL has credentials) and subscribes to `channels`.
    pub fn connect(
        info: &ConnectionInfo,
        channels: &[String],
        timeout: Duration,
    ) -> io::Result<Self> {
        let mut stream = Stream::connect(&info.addr, timeout)?;
        if let Some(password) = &info.redis.password {
            let mut args = vec!["AUTH"];
            if let Some(user) = &info.redis.username {
                args.push(user);
            }
            args.push(password);
            stream.write_all(&resp::command(&args))?;
            let mut reply = [0u8; 256];
            let n = stream.read(&mut reply)?;
            let reply = reply.get(..n).unwrap_or_default();
            if !reply.starts_with(b"+OK") {
                // Redis's own words say which: a wrong password, or no such user.
                let said = String::from_utf8_lossy(reply);
                let said = said.trim_start_matches('-').lines().next().unwrap_or("");
                return Err(io::Error::new(
                    io::ErrorKind::PermissionDenied,
                    format!(
                        "redis AUTH failed: {}",
                        said.chars().take(200).collect::<String>()
                    ),
                ));
            }
        }
        let mut args = vec!["SUBSCRIBE"];
        args.extend(channels.iter().map(String::as_str));
        stream.write_all(&resp::command(&args))?;
        stream.set_nonblocking()?;
        Ok(Self {
            stream,
            buf: Vec::new(),
            scan: resp::Scan::default(),
            confirmed: 0,
            ended: None,
        })
    }

    /// Reads what arrived, up to 64 KiB per call, and returns the complete messages. An
    /// error means the connection is gone (EOF, reset, or a reply this reader does not
    /// understand); the messages that came before it are returned first, by the call before.
    pub fn read(&mut self) -> io::Result<Vec<Push>> {
        if let Some(end) = self.end() {
            return Err(end);
        }
        let mut chunk = [0u8; 16 * 1024];
        let mut taken = 0;
        while taken < READ_PER_CALL {
            match self.stream.read(&mut chunk) {
                Ok(0) => {
                    let why = "redis closed the subscription".to_string();
                    self.ended = Some((io::ErrorKind::UnexpectedEof, why));
                    break;
                }
                Ok(n) => {
                    taken += n;
                    self.buf
                        .extend_from_slice(chunk.get(..n).unwrap_or_default())
                }
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => break,
                Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
                Err(e) => {
                    self.ended = Some((e.kind(), e.to_string()));
                    break;
                }
            }
            if self.buf.len() > MAX_BUFFER {
                return Err(io::Error::new(
                    io::ErrorKind::InvalidData,
                    "oversized redis push",
                ));
            }
        }
        let mut out = Vec::new();
        let mut pos = 0;
        // Walked to its end before it is parsed: a push of many elements arriving over many
        // reads is parsed once, not again after each read (review bb111).
        while let Some(len) =
            resp::value_len(self.buf.get(pos..).unwrap_or_default(), &mut self.scan)?
        {
            let whole = self.buf.get(pos..pos + len).unwrap_or_default();
            let Some((used, value)) = resp::parse(whole)? else {
                break;
            };
            pos += used;
            match value {
                Value::Array(items) => match items.as_slice() {
                    [Value::Bulk(kind), Value::Bulk(channel), Value::Bulk(payload)]
                        if kind == b"message" =>
                    {
                        out.push(Push {
                            channel: String::from_utf8_lossy(channel).into_owned(),
                            payload: payload.clone(),
                        });
                    }
                    [Value::Bulk(kind), _, Value::Int(_)] if kind == b"subscribe" => {
                        self.confirmed += 1
                    }
                    _ => {}
                },
                Value::Error(e) => {
                    let why = format!(
                        "an error reply on the subscription: {}",
                        String::from_utf8_lossy(&e)
                    );
                    self.ended = Some((io::ErrorKind::Other, why));
                    break;
                }
                _ => {}
            }
        }
        self.buf.drain(..pos);
        if let Some(end) = self.end().filter(|_| out.is_empty()) {
            return Err(end);
        }
        // One large message grew it: do not keep that much for the subscription's life.
        if self.buf.capacity() > 4 * READ_PER_CALL && self.buf.len() <= READ_PER_CALL {
            self.buf.shrink_to(READ_PER_CALL);
        }
        Ok(out)
    }

    /// The end of the connection, once it came, as the error each later read returns.
    fn end(&self) -> Option<io::Error> {
        self.ended
            .as_ref()
            .map(|(kind, why)| io::Error::new(*kind, why.clone()))
    }
}

impl AsRawFd for Subscriber {
    fn as_raw_fd(&self) -> RawFd {
        self.stream.as_raw_fd()
    }
}

#[cfg(test)]
mod tests {
    use std::net::TcpListener;
    use std::thread;

    use redis::IntoConnectionInfo;

    use super::*;

    /// A message Redis pushes just before it ends the subscription (a `CLIENT KILL` right
    /// after a `PUBLISH`) is returned, and the end is said by the next call. Before, a read
    /// that met both returned the end alone, and the command in the message went unanswered
    /// though control was told someone received it (review bb144).
    #[test]
    fn a_message_pushed_just_before_the_end_comes_before_the_end() {
        let listener = TcpListener::bind("127.0.0.1:0").expect("bind");
        let addr = listener.local_addr().expect("addr");
        let redis = thread::spawn(move || {
            let (mut s, _) = listener.accept().expect("accept");
            let mut subscribe = [0u8; 256];
            let _ = s.read(&mut subscribe);
            s.write_all(b"*3\r\n$9\r\nsubscribe\r\n$2\r\nch\r\n:1\r\n")
                .expect("confirm");
            s.write_all(b"*3\r\n$7\r\nmessage\r\n$2\r\nch\r\n$3\r\ncmd\r\n")
                .expect("push");
        });
        let info = format!("redis://{addr}/")
            .into_connection_info()
            .expect("url");
        let mut sub =
            Subscriber::connect(&info, &["ch".to_string()], Duration::from_secs(5)).expect("sub");
        // Gone: the push and the end are both in the socket before the first read.
        redis.join().expect("redis");
        let got = sub.read().expect("the push first");
        assert_eq!(
            got,
            [Push {
                channel: "ch".into(),
                payload: b"cmd".to_vec(),
            }]
        );
        assert_eq!(sub.confirmed, 1);
        let end = sub.read().expect_err("then the end");
        assert_eq!(end.kind(), io::ErrorKind::UnexpectedEof, "{end}");
        assert!(sub.read().is_err(), "the end stays");
    }
}
