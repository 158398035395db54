//! The bridge's command connection to Redis, which gives up on a call at the first reply
//! that does not come, and once the call has taken its whole timeout.
//!
//! redis-rs reads every reply of a pipeline even after a read failed (so that a transaction's
//! error replies leave the connection in step), and each read waits out the socket's timeout.
//! A Redis that hung under a pipeline of thousands of publishes (rigs flooding events) so held
//! the bridge 2 s per publish, for as long as it hung: hellos and admin commands stalled, and
//! the outage was never noticed. Here the first read that fails ends the call; the caller then
//! drops the connection (`Fleet::call_failed`), so the replies left unread never matter.
//!
//! A socket's timeout bounds one read, not a call: a path to Redis that trickles, each piece
//! inside the timeout, held the bridge for as long as the pipeline (or one reply, a byte at a
//! time) lasted, and so did a Redis reading a long request slowly. So a call also ends once it
//! has taken the timeout in all (a long pipeline, 1 ms a reply), wherever it is: this
//! connection does its own writes and reads to keep that bound.

use std::io::{self, Read, Write};
use std::os::fd::{AsRawFd, RawFd};
use std::time::{Duration, Instant};

use redis::{ConnectionInfo, ConnectionLike, RedisResult, Value};

use crate::registry::pubsub::Stream;
use crate::registry::resp;

/// Largest reply kept while it arrives; a longer one is a protocol failure.
const MAX_REPLY: usize = 512 << 20;

/// The bridge's command connection: its own socket, read a reply at a time, every read bounded
/// by what its call has left. redis-rs read a reply in as many reads as it came in, each with
/// the whole timeout, so one reply trickling a byte at a time held the bridge about 22 s in
/// an audit; its parser still turns each whole reply into a [`Value`].
pub(crate) struct CommandCon {
    stream: Stream,
    /// Bytes read and not yet taken as replies: `buf[start..]`. A pipeline's replies are taken
    /// by moving `start`, not by shifting the rest down after each one (thousands of replies
    /// in one read made that quadratic).
    buf: Vec<u8>,
    start: usize,
    /// How far the reply at `start` was walked while it was incomplete.
    scan: resp::Scan,
    /// The most one call may take from its send to its last reply (more for a long pipeline:
    /// [`call_budget`]); also the socket's timeouts between calls.
    timeout: Duration,
    /// The socket's read and write timeouts now: shortened late in a slow call.
    read_timeout: Duration,
    write_timeout: Duration,
    db: i64,
    /// False once a read or write failed: the caller drops the connection.
    open: bool,
}

impl CommandCon {
    /// Connects to the address `info` names, giving up after `timeout`; sends no AUTH or
    /// SELECT (the caller does, to see Redis's answers).
    pub(crate) fn connect(info: &ConnectionInfo, timeout: Duration) -> io::Result<Self> {
        Ok(CommandCon {
            stream: Stream::connect(&info.addr, timeout)?,
            buf: Vec::new(),
            start: 0,
            scan: resp::Scan::default(),
            timeout,
            read_timeout: timeout,
            write_timeout: timeout,
            db: info.redis.db,
            open: true,
        })
    }

    /// Whether Redis closed this connection (or sent what no call asked for) while it was
    /// idle: between calls nothing is owed on it, so anything readable means it is done. A
    /// `CLIENT KILL`, Redis's `timeout`, or a restart closes it without a word, and the next
    /// call would only then find out, failing whatever it carried.
    pub(crate) fn peer_gone(&self) -> bool {
        if !self.open || self.start < self.buf.len() {
            return true;
        }
        let mut fd = libc::pollfd {
            fd: self.stream.as_raw_fd(),
            events: libc::POLLIN | libc::POLLRDHUP,
            revents: 0,
        };
        // SAFETY: one valid, initialized pollfd; a zero timeout never blocks.
        let ready = unsafe { libc::poll(&mut fd, 1, 0) };
        ready != 0
    }

    /// The socket, for poll(2): its peer closing it wakes the bridge.
    pub(crate) fn fd(&self) -> RawFd {
        self.stream.as_raw_fd()
    }

    /// Sets how long each call may take from now on.
    pub(crate) fn set_timeout(&mut self, timeout: Duration) -> RedisResult<()> {
        self.stream.set_timeouts(Some(timeout))?;
        self.timeout = timeout;
        self.read_timeout = timeout;
        self.write_timeout = timeout;
        Ok(())
    }

    /// Sends `cmd`, then reads `offset + count` replies as [`read_replies`] does, all by the
    /// call's deadline.
    fn call(&mut self, cmd: &[u8], offset: usize, count: usize) -> RedisResult<Vec<Value>> {
        let deadline = Instant::now() + call_budget(self.timeout, offset + count);
        let replies = match self.send(cmd, deadline) {
            Ok(()) => read_replies(offset, count, || self.reply(deadline, count)),
            Err(e) => Err(e.into()),
        };
        // Every reply read, one of a transaction's refused (a full Redis refuses commands
        // queued in MULTI): the connection is in step and stays. Dropped, it was reconnected
        // at once, the refused call tried again and refused again, a thousand times a second.
        let (replies, refused) = match replies {
            Ok(Replies { kept, refused }) => (Ok(kept), refused),
            Err(e) => (Err(e), None),
        };
        let restored = if self.read_timeout != self.timeout || self.write_timeout != self.timeout {
            self.read_timeout = self.timeout;
            self.write_timeout = self.timeout;
            self.stream.set_timeouts(Some(self.timeout))
        } else {
            Ok(())
        };
        let replies = restored.map_err(Into::into).and(replies);
        if replies.is_err() {
            // Replies may be left unread: the connection is out of step.
            self.open = false;
        }
        match refused {
            Some(e) => Err(e),
            None => replies,
        }
    }

    /// Writes all of `cmd` by `deadline`. A Redis that reads a long pipeline slowly takes each
    /// write inside the socket's timeout, so the timeout alone bounded a write, not the call.
    fn send(&mut self, mut cmd: &[u8], deadline: Instant) -> io::Result<()> {
        while !cmd.is_empty() {
            let stream = &self.stream;
            wait_within(
                deadline,
                &mut self.write_timeout,
                |t| stream.set_write_timeout(t),
                || "redis took its request too slowly".into(),
            )?;
            match self.stream.write(cmd) {
                Ok(0) => return Err(io::ErrorKind::WriteZero.into()),
                Ok(n) => cmd = cmd.get(n..).unwrap_or_default(),
                Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
                Err(e) => return Err(e),
            }
        }
        Ok(())
    }

    /// The next whole reply, read by `deadline`.
    fn reply(&mut self, deadline: Instant, count: usize) -> RedisResult<Value> {
        loop {
            let unread = self.buf.get(self.start..).unwrap_or_default();
            if let Some(len) = resp::value_len(unread, &mut self.scan)? {
                let value = redis::parse_redis_value(unread.get(..len).unwrap_or_default());
                self.start += len;
                if self.start == self.buf.len() {
                    self.buf.clear();
                    self.start = 0;
                }
                return value;
            }
            // Room for the rest of a reply at the front, once per read rather than per reply.
            self.buf.drain(..self.start);
            self.start = 0;
            let stream = &self.stream;
            wait_within(
                deadline,
                &mut self.read_timeout,
                |t| stream.set_read_timeout(t),
                || format!("its {count} replies took too long"),
            )?;
            // Made here, not once per call: a pipeline's replies mostly come whole in one
            // read, and zeroing 16 KiB for each of a fan-out's thousands of replies took
            // about a twentieth of the bridge's time.
            let mut chunk = [0u8; 16 << 10];
            match self.stream.read(&mut chunk) {
                Ok(0) => {
                    return Err(io::Error::new(
                        io::ErrorKind::UnexpectedEof,
                        "redis closed the connection",
                    )
                    .into())
                }
                Ok(n) => self
                    .buf
                    .extend_from_slice(chunk.get(..n).unwrap_or_default()),
                Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
                Err(e) => return Err(e.into()),
            }
            if self.buf.len() > MAX_REPLY {
                return Err(
                    io::Error::new(io::ErrorKind::InvalidData, "oversized redis reply").into(),
                );
            }
        }
    }
}

impl ConnectionLike for CommandCon {
    fn req_packed_command(&mut self, cmd: &[u8]) -> RedisResult<Value> {
        let mut reply = self.call(cmd, 0, 1)?;
        Ok(reply.pop().unwrap_or(Value::Nil))
    }

    fn req_packed_commands(
        &mut self,
        cmd: &[u8],
        offset: usize,
        count: usize,
    ) -> RedisResult<Vec<Value>> {
        self.call(cmd, offset, count)
    }

    fn get_db(&self) -> i64 {
        self.db
    }

    fn check_connection(&mut self) -> bool {
        redis::cmd("PING").query::<String>(self).is_ok()
    }

    fn is_open(&self) -> bool {
        self.open
    }
}

/// Readies the socket for one more read or write of a call ending at `deadline`: a wait late
/// in the call may take only what the call has left, so `timeout` (the socket's, set with
/// `set`) is shortened to it once under half (a syscall, so only once a call is slow).
/// TimedOut, saying `late`, once nothing is left.
fn wait_within(
    deadline: Instant,
    timeout: &mut Duration,
    set: impl FnOnce(Option<Duration>) -> io::Result<()>,
    late: impl FnOnce() -> String,
) -> io::Result<()> {
    let left = deadline.saturating_duration_since(Instant::now());
    if left.is_zero() {
        let why = format!("call timed out: {}", late());
        return Err(io::Error::new(io::ErrorKind::TimedOut, why));
    }
    if left < *timeout / 2 {
        set(Some(left))?;
        *timeout = left;
    }
    Ok(())
}

/// How long a call expecting `replies` may take: the timeout, or 1 ms a reply for a pipeline
/// long enough to need more (Redis runs a simple command in microseconds, so a healthy one
/// never comes near it; thousands of publishes on a slow host could come near 2 s in all).
fn call_budget(timeout: Duration, replies: usize) -> Duration {
    timeout.max(Duration::from_millis(replies as u64))
}

/// What a call read: the last `count` replies, and the first error reply among those before
/// them (a transaction's), with which redis-rs fails the call once all are read.
struct Replies {
    kept: Vec<Value>,
    refused: Option<redis::RedisError>,
}

/// Reads `offset + count` replies with `next`, keeping the last `count`, as redis-rs does,
/// except that a failed read ends it at once (an `Err`: the connection is out of step).
fn read_replies(
    offset: usize,
    count: usize,
    mut next: impl FnMut() -> RedisResult<Value>,
) -> RedisResult<Replies> {
    let mut kept = Vec::with_capacity(count);
    let mut refused = None;
    for idx in 0..offset + count {
        match next()? {
            Value::ServerError(e) if idx < offset => {
                refused.get_or_insert(e.into());
            }
            _ if idx < offset => {}
            reply => kept.push(reply),
        }
    }
    Ok(Replies { kept, refused })
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A fake Redis at the returned address: takes `request_len` bytes, then writes `reply`
    /// in pieces of `piece` bytes, `gap` apart (the trickle the test injects, not a wait for
    /// anything).
    fn trickling_server(
        request_len: usize,
        reply: Vec<u8>,
        piece: usize,
        gap: Duration,
    ) -> (redis::ConnectionInfo, std::thread::JoinHandle<()>) {
        use redis::IntoConnectionInfo;
        let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let addr = listener.local_addr().unwrap();
        let server = std::thread::spawn(move || {
            let (mut s, _) = listener.accept().unwrap();
            let (mut got, mut buf) = (0, [0u8; 1024]);
            while got < request_len {
                match s.read(&mut buf) {
                    Ok(0) | Err(_) => return,
                    Ok(n) => got += n,
                }
            }
            for part in reply.chunks(piece) {
                if s.write_all(part).is_err() {
                    return;
                }
                std::thread::sleep(gap);
            }
        });
        let info = format!("redis://{addr}/").into_connection_info().unwrap();
        (info, server)
    }

    /// An idle connection Redis closed reads as gone, with no call made on it; one still
    /// open does not.
    #[test]
    fn an_idle_connection_its_peer_closed_is_seen_gone_without_a_call() {
        use redis::IntoConnectionInfo;
        let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let addr = listener.local_addr().unwrap();
        let info = format!("redis://{addr}/").into_connection_info().unwrap();
        let con = CommandCon::connect(&info, Duration::from_millis(500)).unwrap();
        let (peer, _) = listener.accept().unwrap();
        assert!(!con.peer_gone(), "open and idle");
        drop(peer);
        let deadline = Instant::now() + Duration::from_secs(5);
        while !con.peer_gone() {
            assert!(Instant::now() < deadline, "the close never seen");
            std::thread::yield_now();
        }
    }

    /// A call with a 500 ms budget ended by its deadline (or a read or write it shortened to
    /// what was left), about when its budget ran out, leaving the connection to be dropped.
    fn ended_at_its_timeout<T: std::fmt::Debug>(
        r: RedisResult<T>,
        took: Duration,
        con: &CommandCon,
    ) {
        let e = r.expect_err("the call should not have finished within its budget");
        assert!(e.is_timeout(), "{e}");
        assert!(!con.is_open(), "out of step: to be dropped");
        assert!(took >= Duration::from_millis(500), "{took:?}");
        assert!(took < Duration::from_millis(1500), "{took:?}");
    }

    /// A full Redis refuses the commands a transaction queues: every reply read, the call
    /// fails with Redis's refusal and the connection stays, in step for the next call. It was
    /// dropped, and the bridge reconnected about a thousand times a second (review bb115).
    #[test]
    fn a_transaction_refused_whole_leaves_the_connection_in_step() {
        let mut pipe = redis::pipe();
        pipe.atomic().cmd("LRANGE").arg("k").arg(0).arg(1);
        let request = pipe.get_packed_pipeline().len();
        let refusal = b"+OK\r\n-OOM command not allowed when used memory > 'maxmemory'.\r\n\
                        -EXECABORT Transaction discarded because of previous errors.\r\n";
        // A fake Redis: refuses the transaction, then answers a PING (14 bytes).
        let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let addr = listener.local_addr().unwrap();
        let server = std::thread::spawn(move || {
            let (mut s, _) = listener.accept().unwrap();
            for (len, reply) in [(request, &refusal[..]), (14, b"+PONG\r\n")] {
                let mut got = vec![0u8; len];
                s.read_exact(&mut got).unwrap();
                s.write_all(reply).unwrap();
            }
        });
        use redis::IntoConnectionInfo;
        let info = format!("redis://{addr}/").into_connection_info().unwrap();
        let mut con = CommandCon::connect(&info, Duration::from_secs(2)).unwrap();
        let refused = pipe.query::<Vec<Value>>(&mut con).unwrap_err();
        assert_eq!(refused.code(), Some("OOM"), "{refused}");
        assert!(con.is_open() && !con.peer_gone(), "in step: kept");
        let pong: String = redis::cmd("PING").query(&mut con).unwrap();
        assert_eq!(pong, "PONG");
        drop(con);
        server.join().unwrap();
    }

    /// Replies that each come well inside the socket's read timeout, a pipeline that takes six
    /// times the call's timeout in all: the call ends at its timeout.
    #[test]
    fn a_call_whose_replies_trickle_in_ends_at_its_timeout() {
        const PINGS: usize = 30;
        // Each PING is `*1\r\n$4\r\nPING\r\n`, 14 bytes; each reply 7.
        let replies = b"+PONG\r\n".repeat(PINGS);
        let (info, server) = trickling_server(PINGS * 14, replies, 7, Duration::from_millis(100));
        let mut con = CommandCon::connect(&info, Duration::from_millis(500)).unwrap();
        let mut pipe = redis::pipe();
        for _ in 0..PINGS {
            pipe.cmd("PING");
        }
        let started = Instant::now();
        let r: RedisResult<Vec<String>> = pipe.query(&mut con);
        // Before, the call took the whole 3 s and succeeded: each read was within 500 ms.
        ended_at_its_timeout(r, started.elapsed(), &con);
        drop(con);
        server.join().unwrap();
    }

    /// One reply a byte at a time, each byte well inside the read timeout: the call still
    /// ends at its timeout. The redis crate read a reply in as many reads as it came in, each
    /// with the whole timeout: a Redis-fault audit held the bridge 22 s so.
    #[test]
    fn one_reply_trickling_a_byte_at_a_time_ends_at_the_calls_timeout() {
        let reply = b"$40\r\n"
            .iter()
            .chain([b'x'; 40].iter())
            .chain(b"\r\n")
            .copied();
        let (info, server) = trickling_server(14, reply.collect(), 1, Duration::from_millis(60));
        let mut con = CommandCon::connect(&info, Duration::from_millis(500)).unwrap();
        let started = Instant::now();
        let r: RedisResult<String> = redis::cmd("PING").query(&mut con);
        // The reply takes 2.8 s.
        ended_at_its_timeout(r, started.elapsed(), &con);
        drop(con);
        server.join().unwrap();
    }

    /// A Redis that takes a long request 16 KiB at a time, each piece well inside the write
    /// timeout: the call ends at its timeout. Before, each write waited for room only as long
    /// as the socket's timeout, so the call lasted as long as Redis took to read it all.
    #[test]
    fn a_request_that_redis_reads_slowly_ends_at_the_calls_timeout() {
        use redis::IntoConnectionInfo;
        use std::sync::atomic::{AtomicBool, Ordering};
        use std::sync::Arc;
        // A small receive buffer, so that each read opens the window and each of the
        // client's writes gets somewhere inside its timeout.
        let socket =
            socket2::Socket::new(socket2::Domain::IPV4, socket2::Type::STREAM, None).unwrap();
        socket.set_recv_buffer_size(32 << 10).unwrap();
        let any: std::net::SocketAddr = "127.0.0.1:0".parse().unwrap();
        socket.bind(&any.into()).unwrap();
        socket.listen(1).unwrap();
        let listener = std::net::TcpListener::from(socket);
        let addr = listener.local_addr().unwrap();
        let done = Arc::new(AtomicBool::new(false));
        let server = std::thread::spawn({
            let done = done.clone();
            move || {
                let (mut s, _) = listener.accept().unwrap();
                let mut buf = vec![0u8; 16 << 10];
                while !done.load(Ordering::Relaxed) {
                    if matches!(s.read(&mut buf), Ok(0) | Err(_)) {
                        return;
                    }
                    std::thread::sleep(Duration::from_millis(10));
                }
            }
        });
        let info = format!("redis://{addr}/").into_connection_info().unwrap();
        let mut con = CommandCon::connect(&info, Duration::from_millis(500)).unwrap();
        // 16 MiB at about 1.6 MiB/s is several seconds past what the kernel buffers.
        let started = Instant::now();
        let r: RedisResult<()> = redis::cmd("SET")
            .arg("k")
            .arg(vec![b'x'; 16 << 20])
            .query(&mut con);
        let took = started.elapsed();
        done.store(true, Ordering::Relaxed);
        ended_at_its_timeout(r, took, &con);
        drop(con);
        server.join().unwrap();
    }

    #[test]
    fn a_long_pipeline_has_a_millisecond_a_reply() {
        let two = Duration::from_secs(2);
        assert_eq!(call_budget(two, 1), two);
        assert_eq!(call_budget(two, 2_000), two);
        assert_eq!(call_budget(two, 16_384), Duration::from_millis(16_384));
    }

    #[test]
    fn a_failed_read_ends_the_pipeline_at_once() {
        let mut reads = 0;
        let timed_out = read_replies(0, 5_000, || {
            reads += 1;
            match reads {
                1 => Ok(Value::Okay),
                _ => Err(std::io::Error::from(std::io::ErrorKind::WouldBlock).into()),
            }
        });
        assert!(timed_out.is_err());
        assert_eq!(reads, 2, "not one timeout per reply left");
    }

    #[test]
    fn replies_after_the_offset_are_kept_error_replies_among_them_too() {
        let mut replies = vec![Value::Okay, Value::Int(1), Value::Int(2)].into_iter();
        let out = read_replies(1, 2, || Ok(replies.next().unwrap_or(Value::Nil))).unwrap();
        assert_eq!(out.kept, [Value::Int(1), Value::Int(2)]);
        assert!(out.refused.is_none());

        let refused = || redis::parse_redis_value(b"-ERR refused\r\n").unwrap_or(Value::Nil);
        let mut replies = vec![refused(), Value::Int(1)].into_iter();
        let out = read_replies(1, 1, || Ok(replies.next().unwrap_or(Value::Nil))).unwrap();
        assert!(
            out.refused.is_some(),
            "a transaction's error reply fails the call"
        );
        let mut replies = vec![Value::Okay, refused()].into_iter();
        let out = read_replies(1, 1, || Ok(replies.next().unwrap_or(Value::Nil))).unwrap();
        assert!(matches!(out.kept.as_slice(), [Value::ServerError(_)]));
    }
}
