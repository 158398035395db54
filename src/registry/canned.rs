//! A Redis connection for unit tests: it answers each pipeline with the next of a script of
//! replies and records how many replies each asked for.

use redis::{ConnectionLike, Script, Value};

pub(crate) struct Canned {
    pub(crate) replies: Vec<Vec<Value>>,
    pub(crate) sent: Vec<usize>,
}

impl ConnectionLike for Canned {
    fn req_packed_command(&mut self, _: &[u8]) -> redis::RedisResult<Value> {
        // SCRIPT LOAD: its hash.
        let sha = Script::new("return 1").get_hash().to_string();
        Ok(Value::BulkString(sha.into_bytes()))
    }
    fn req_packed_commands(
        &mut self,
        cmd: &[u8],
        _: usize,
        count: usize,
    ) -> redis::RedisResult<Vec<Value>> {
        // A pipeline of script calls asks for one reply per call.
        let calls = cmd.windows(7).filter(|w| w == b"EVALSHA").count();
        assert!(
            calls == 0 || calls == count,
            "{calls} calls, {count} replies"
        );
        self.sent.push(count);
        Ok(self.replies.remove(0))
    }
    fn get_db(&self) -> i64 {
        0
    }
    fn check_connection(&mut self) -> bool {
        true
    }
    fn is_open(&self) -> bool {
        true
    }
}
