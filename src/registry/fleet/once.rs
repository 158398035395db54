//! Publishes that reach Redis once across a lost connection (`lua/publish.lua`).
//!
//! A batch of publishes whose answer never came may or may not have run: a Redis that hung
//! keeps the batch in its socket buffer and runs it when it wakes, and the broker sends the
//! batch again on its next connection. Control then read the same reply twice (review bb140
//! saw it in about one Redis pause of six). Each batch now leaves a mark in Redis and is
//! fenced by the connection it came on, so the broker can ask, once it is back, whether the
//! batch ran, and be sure it cannot run later: only a batch that did not run goes again.
//! Apart because this is a small protocol of its own (numbered batches, a connection
//! count, the question after a reconnect) that the queue of publishes (`writes.rs`) only
//! consults.

use std::time::Duration;

use redis::{ConnectionLike, Script, Value};

/// How long a mark lasts after its batch: the question comes right after the reconnect, and a
/// batch waiting in a hung Redis's buffer sets its mark when it runs.
const MARK_TTL: Duration = Duration::from_secs(24 * 3600);

/// What a batch's answer says.
#[derive(Debug)]
pub(super) enum Sent {
    /// It ran; this many of its publishes were refused (an ACL) and dropped.
    Ran { refused: u64 },
    /// A later connection of this process asked about it: it did not run, and will not.
    Fenced,
    /// Redis lost the script (`SCRIPT FLUSH`): it did not run; load it and send again.
    NoScript,
    /// Redis answered with an error: the batch did not run.
    Refused(redis::RedisError),
}

/// The batch numbering and the connection count behind the marks.
pub(super) struct Once {
    script: Script,
    key: String,
    /// This process, told apart from another with the same broker id (a restart within the
    /// mark's TTL numbers its batches from 1 again).
    instance: String,
    /// The command connection's count: one more at each connect.
    gen: u64,
    /// The last batch number given.
    last: u64,
    /// The batch whose answer was lost with its connection, and how much of the queue it
    /// held: the next connection asks about it before anything else goes out.
    pub(super) doubt: Option<Doubt>,
}

/// A batch sent on a connection that failed before its answer.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) struct Doubt {
    pub(super) batch: u64,
    /// The publishes at the head of the queue that it carried.
    pub(super) publishes: usize,
}

impl Once {
    pub(super) fn new(broker_id: &str) -> Self {
        Self {
            script: Script::new(include_str!("../../../lua/publish.lua")),
            key: format!("sentinel:{broker_id}|published"),
            instance: format!("{}-{:016x}", std::process::id(), fastrand::u64(..)),
            gen: 0,
            last: 0,
            doubt: None,
        }
    }

    /// A new command connection: later batches are fenced from the earlier connection's.
    pub(super) fn connected(&mut self, con: &mut impl ConnectionLike) -> redis::RedisResult<()> {
        self.gen += 1;
        self.script.prepare_invoke().load(con).map(drop)
    }

    /// Numbers the next batch and adds its call to `pipe`, after whatever `pipe` holds.
    pub(super) fn add_batch<'a>(
        &mut self,
        pipe: &mut redis::Pipeline,
        publishes: impl Iterator<Item = (&'a str, &'a [u8])>,
    ) -> u64 {
        self.last += 1;
        let mut call = self.call("publish", self.last);
        for (channel, payload) in publishes {
            call.arg(channel).arg(payload);
        }
        pipe.add_command(call);
        self.last
    }

    /// Reads a batch's answer, the last reply of its pipeline.
    pub(super) fn sent(reply: Option<Value>) -> Sent {
        match reply {
            Some(Value::Int(n)) if n >= 0 => Sent::Ran { refused: n as u64 },
            Some(Value::Int(_)) => Sent::Fenced,
            Some(Value::ServerError(e)) if e.code() == "NOSCRIPT" => Sent::NoScript,
            Some(Value::ServerError(e)) => Sent::Refused(e.into()),
            other => Sent::Refused(redis::RedisError::from((
                redis::ErrorKind::TypeError,
                "publish.lua answered neither a count nor an error",
                format!("{other:?}"),
            ))),
        }
    }

    /// Loads the script again after Redis answered NOSCRIPT.
    pub(super) fn reload(&self, con: &mut impl ConnectionLike) -> redis::RedisResult<()> {
        self.script.prepare_invoke().load(con).map(drop)
    }

    /// Asks whether the batch in doubt ran, fencing it (and every batch of an older
    /// connection) if it did not. True when it ran. Asked on the current connection, before
    /// any batch of its own.
    pub(super) fn ran(
        &self,
        con: &mut impl ConnectionLike,
        batch: u64,
    ) -> redis::RedisResult<bool> {
        let call = self.call("check", batch);
        let reply: Value = match call.query(con) {
            Err(e) if e.kind() == redis::ErrorKind::NoScriptError => {
                self.reload(con)?;
                self.call("check", batch).query(con)?
            }
            other => other?,
        };
        match reply {
            Value::Int(1) => Ok(true),
            Value::Int(0) => Ok(false),
            other => Err(redis::RedisError::from((
                redis::ErrorKind::TypeError,
                "publish.lua's check answered neither 0 nor 1",
                format!("{other:?}"),
            ))),
        }
    }

    fn call(&self, mode: &str, batch: u64) -> redis::Cmd {
        let mut call = redis::cmd("EVALSHA");
        call.arg(self.script.get_hash())
            .arg(1)
            .arg(&self.key)
            .arg(mode)
            .arg(&self.instance)
            .arg(self.gen)
            .arg(batch)
            .arg(MARK_TTL.as_millis() as u64);
        call
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn error(text: &[u8]) -> Value {
        redis::parse_redis_value(text).expect("an error reply")
    }

    /// A count is a batch that ran, -1 one a later connection fenced; an error is a batch that
    /// did not run, NOSCRIPT apart since loading the script fixes it; anything else is no
    /// answer the script gives.
    #[test]
    fn a_batchs_answer_says_whether_it_ran() {
        assert!(matches!(
            Once::sent(Some(Value::Int(2))),
            Sent::Ran { refused: 2 }
        ));
        assert!(matches!(Once::sent(Some(Value::Int(-1))), Sent::Fenced));
        assert!(matches!(
            Once::sent(Some(error(b"-NOSCRIPT No matching script.\r\n"))),
            Sent::NoScript
        ));
        match Once::sent(Some(error(b"-BUSY Redis is busy running a script.\r\n"))) {
            Sent::Refused(e) => assert_eq!(e.code(), Some("BUSY")),
            other => panic!("{other:?}"),
        }
        assert!(matches!(Once::sent(Some(Value::Nil)), Sent::Refused(_)));
        assert!(matches!(Once::sent(None), Sent::Refused(_)));
    }

    /// Each batch takes the next number, and a reconnect counts one more connection: the mark
    /// a batch leaves names both, and the check after a reconnect fences the older ones.
    #[test]
    fn batches_are_numbered_and_name_their_connection() {
        let mut once = Once::new("b1");
        let mut pipe = redis::pipe();
        let one = once.add_batch(&mut pipe, [("ch", &b"a"[..])].into_iter());
        let two = once.add_batch(&mut pipe, std::iter::empty());
        assert_eq!((one, two), (1, 2));
        let packed = String::from_utf8_lossy(&pipe.get_packed_pipeline()).into_owned();
        assert!(packed.contains("sentinel:b1|published"), "{packed}");
        assert!(packed.contains(&once.instance), "{packed}");
        assert!(packed.contains("$7\r\npublish\r\n$"), "{packed}");
        assert!(packed.contains("$2\r\nch\r\n$1\r\na\r\n"), "{packed}");
        assert_eq!(once.gen, 0, "no connection yet");
    }
}
