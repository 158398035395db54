//! The bridge's command connection to Redis, which gives up on a pipeline at the first reply
//! that does not come.
//!
//! redis-rs reads every reply of a pipeline even after a read failed (so that a transaction's
//! error replies leave the connection in step), and each read waits out the socket's timeout.
//! A Redis that hung under a pipeline of thousands of publishes (rigs flooding events) so held
//! the bridge 2 s per publish, for as long as it hung: hellos and admin commands stalled, and
//! the outage was never noticed. Here the first read that fails ends the call; the caller then
//! drops the connection (`Fleet::call_failed`), so the replies left unread never matter.

use redis::{ConnectionLike, RedisResult, Value};

/// A [`redis::Connection`] whose pipelines fail at their first failed read.
pub(crate) struct CommandCon(redis::Connection);

impl CommandCon {
    pub(crate) fn new(con: redis::Connection) -> Self {
        CommandCon(con)
    }

    /// The connection itself, to change its timeouts.
    pub(crate) fn inner(&mut self) -> &mut redis::Connection {
        &mut self.0
    }
}

impl ConnectionLike for CommandCon {
    fn req_packed_command(&mut self, cmd: &[u8]) -> RedisResult<Value> {
        self.0.req_packed_command(cmd)
    }

    fn req_packed_commands(
        &mut self,
        cmd: &[u8],
        offset: usize,
        count: usize,
    ) -> RedisResult<Vec<Value>> {
        self.0.send_packed_command(cmd)?;
        read_replies(offset, count, || self.0.recv_response())
    }

    fn get_db(&self) -> i64 {
        self.0.get_db()
    }

    fn check_connection(&mut self) -> bool {
        self.0.check_connection()
    }

    fn is_open(&self) -> bool {
        self.0.is_open()
    }
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
