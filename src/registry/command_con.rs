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
//! The socket's timeout bounds one read, not a call: a path to Redis that trickles, each reply
//! inside the timeout, held the bridge for as long as the pipeline lasted. So a call also ends
//! once it has taken the timeout in all (a long pipeline, 1 ms a reply), wherever it is.

use std::time::{Duration, Instant};

use redis::{ConnectionLike, RedisResult, Value};

/// A [`redis::Connection`] whose calls fail at their first failed read, or past their timeout.
pub(crate) struct CommandCon {
    con: redis::Connection,
    /// The socket's read timeout, and the most one call may take from its send to its last
    /// reply (more for a long pipeline: [`call_budget`]).
    timeout: Duration,
}

impl CommandCon {
    /// Wraps `con`, whose calls may take `timeout` each.
    pub(crate) fn new(con: redis::Connection, timeout: Duration) -> RedisResult<Self> {
        con.set_read_timeout(Some(timeout))?;
        Ok(CommandCon { con, timeout })
    }

    /// Sets how long each call may take from now on.
    pub(crate) fn set_timeout(&mut self, timeout: Duration) -> RedisResult<()> {
        self.con.set_read_timeout(Some(timeout))?;
        self.timeout = timeout;
        Ok(())
    }

    /// Sends `cmd`, then reads `offset + count` replies as [`read_replies`] does, all by the
    /// call's deadline.
    fn call(&mut self, cmd: &[u8], offset: usize, count: usize) -> RedisResult<Vec<Value>> {
        let timeout = self.timeout;
        let deadline = Instant::now() + call_budget(timeout, offset + count);
        self.con.send_packed_command(cmd)?;
        let con = &mut self.con;
        let mut shortened = false;
        let replies = read_replies(offset, count, || {
            let left = deadline.saturating_duration_since(Instant::now());
            if left.is_zero() {
                return Err(std::io::Error::new(
                    std::io::ErrorKind::TimedOut,
                    format!("call timed out: its {count} replies took too long"),
                )
                .into());
            }
            // A read that starts late in the call may wait only what the call has left (a
            // syscall, so only once a call is slow).
            if left < timeout / 2 {
                con.set_read_timeout(Some(left))?;
                shortened = true;
            }
            con.recv_response()
        });
        if shortened {
            self.con.set_read_timeout(Some(timeout))?;
        }
        replies
    }
}

impl ConnectionLike for CommandCon {
    fn req_packed_command(&mut self, cmd: &[u8]) -> RedisResult<Value> {
        // One reply: the first that is not a RESP3 push, which this RESP2 connection never
        // gets.
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
        self.con.get_db()
    }

    fn check_connection(&mut self) -> bool {
        self.con.check_connection()
    }

    fn is_open(&self) -> bool {
        self.con.is_open()
    }
}

/// How long a call expecting `replies` may take: the timeout, or 1 ms a reply for a pipeline
/// long enough to need more (Redis runs a simple command in microseconds, so a healthy one
/// never comes near it; thousands of publishes on a slow host could come near 2 s in all).
fn call_budget(timeout: Duration, replies: usize) -> Duration {
    timeout.max(Duration::from_millis(replies as u64))
}

/// Reads `offset + count` replies with `next`, keeping the last `count`, as redis-rs does (an
/// error reply among the first `offset`, a transaction's, fails the call once all are read),
/// except that a failed read ends it at once.
fn read_replies(
    offset: usize,
    count: usize,
    mut next: impl FnMut() -> RedisResult<Value>,
) -> RedisResult<Vec<Value>> {
    let mut out = Vec::with_capacity(count);
    let mut first_err = None;
    for idx in 0..offset + count {
        match next()? {
            Value::ServerError(e) if idx < offset => {
                first_err.get_or_insert(e.into());
            }
            _ if idx < offset => {}
            reply => out.push(reply),
        }
    }
    first_err.map_or(Ok(out), Err)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A server whose replies each come well inside the socket's read timeout, but whose
    /// pipeline takes six times the call's timeout in all: the call ends at its timeout.
    #[test]
    fn a_call_whose_replies_trickle_in_ends_at_its_timeout() {
        use std::io::{Read, Write};
        const PINGS: usize = 30;
        let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let addr = listener.local_addr().unwrap();
        let server = std::thread::spawn(move || {
            let (mut s, _) = listener.accept().unwrap();
            let (mut got, mut buf) = (0, [0u8; 1024]);
            // The whole pipeline first: each PING is `*1\r\n$4\r\nPING\r\n`, 14 bytes.
            while got < PINGS * 14 {
                match s.read(&mut buf) {
                    Ok(0) | Err(_) => return,
                    Ok(n) => got += n,
                }
            }
            // The trickle itself, which the test injects, not a wait for anything.
            for _ in 0..PINGS {
                if s.write_all(b"+PONG\r\n").is_err() {
                    return;
                }
                std::thread::sleep(Duration::from_millis(100));
            }
        });
        let con = redis::Client::open(format!("redis://{addr}/"))
            .and_then(|c| c.get_connection())
            .unwrap();
        let mut con = CommandCon::new(con, Duration::from_millis(500)).unwrap();
        let mut pipe = redis::pipe();
        for _ in 0..PINGS {
            pipe.cmd("PING");
        }
        let started = Instant::now();
        let r: RedisResult<Vec<String>> = pipe.query(&mut con);
        let took = started.elapsed();
        // Ended by the deadline itself, or by a read it shortened to what was left.
        let e = r.expect_err("the whole pipeline took 3 s");
        assert!(e.is_timeout(), "{e}");
        // Before, the call took the whole 3 s and succeeded: each read was within 500 ms.
        assert!(took >= Duration::from_millis(500), "{took:?}");
        assert!(took < Duration::from_millis(1500), "{took:?}");
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
        let out = read_replies(1, 2, || Ok(replies.next().unwrap_or(Value::Nil)));
        assert_eq!(out.ok(), Some(vec![Value::Int(1), Value::Int(2)]));

        let refused = || redis::parse_redis_value(b"-ERR refused\r\n").unwrap_or(Value::Nil);
        let mut replies = vec![refused(), Value::Int(1)].into_iter();
        let out = read_replies(1, 1, || Ok(replies.next().unwrap_or(Value::Nil)));
        assert!(out.is_err(), "a transaction's error reply fails the call");
        let mut replies = vec![Value::Okay, refused()].into_iter();
        let out = read_replies(1, 1, || Ok(replies.next().unwrap_or(Value::Nil)));
        assert!(matches!(out.as_deref(), Ok([Value::ServerError(_)])));
    }
}
