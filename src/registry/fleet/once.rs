//! Publishes that reach Redis once across a lost connection.
//!
//! A batch of publishes whose answer never came may or may not have run: a Redis that hung
//! keeps the batch in its socket buffer and runs it when it wakes, and the broker sent the
//! batch again on its next connection. Control then read the same reply twice (review bb140
//! saw it in about one Redis pause of six). Now each batch is a transaction (`MULTI`, a `SET`
//! of this process's mark, the `PUBLISH`es, `EXEC`), so it runs whole or not at all and says
//! so in the mark; and before sending it again, the next connection ends the old one inside
//! Redis (`CLIENT KILL ID`), so that nothing still waiting on it can run afterwards, then reads
//! the mark. Only a batch that did not run goes again.
//!
//! Why not a Lua script that checks a fence itself: in the small batches of a fan-out a script
//! call cost Redis about 1 µs more per publish, a sixth more of Redis's CPU per command, where
//! a transaction costs about 2% (docs/benchmarks.md, "Since pass 1207a").
//!
//! Apart because this is a small protocol of its own (numbered batches, the connection they
//! went on, the question after a reconnect) that the queue of publishes (`writes.rs`) only
//! consults.

use std::time::{Duration, Instant};

use redis::{ConnectionLike, Value};

/// How long a mark lasts after its batch: the question comes right after the reconnect.
const MARK_TTL: Duration = Duration::from_secs(24 * 3600);
/// How long batches go without the mark after Redis refused it for want of memory: each
/// marked batch would otherwise be refused whole and sent twice while Redis stays full.
const UNMARKED_AFTER_FULL: Duration = Duration::from_secs(1);

/// A command connection as Redis knows it: the client id Redis gave it, in the run of Redis
/// (its `run_id`) that gave it. Ids start again at a restart, so an id is only killed in the
/// run it came from.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(super) struct ClientId {
    id: i64,
    run: String,
}

/// What a batch's transaction answered.
#[derive(Debug)]
pub(super) enum Sent {
    /// It ran; this many of its publishes failed as they ran, and are dropped.
    Ran { refused: u64 },
    /// Redis refused to queue some of it (`EXECABORT`), so none of it ran: the publishes it
    /// refused (an ACL that does not let this user publish to a `reply_to`), by their place in
    /// the batch, and whether it refused the mark (Redis full: a `SET` is refused at
    /// `maxmemory`, a `PUBLISH` is not).
    Aborted { refused: Vec<usize>, mark: bool },
    /// Redis refused the transaction itself, or answered what no transaction answers: none of
    /// it ran.
    Refused(redis::RedisError),
}

/// The batch numbering, the connection the batches go on, and what is in doubt.
pub(super) struct Once {
    key: String,
    /// This process, told apart from another with the same broker id (a restart within the
    /// mark's TTL numbers its batches from 1 again).
    instance: String,
    /// The last batch number given.
    last: u64,
    /// The command connection now, when Redis said who it is.
    client: Option<ClientId>,
    /// Batches go without the mark until then (Redis refused the mark for want of memory).
    unmarked_until: Option<Instant>,
    /// The batch whose answer was lost with its connection: the next connection asks about
    /// it before anything else goes out.
    pub(super) doubt: Option<Doubt>,
}

/// A batch sent on a connection that failed before its answer.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(super) struct Doubt {
    pub(super) batch: u64,
    /// The publishes at the head of the queue that it carried.
    pub(super) publishes: usize,
    /// The connection it went on, to end inside Redis before asking.
    client: Option<ClientId>,
}

/// A batch added to a pipeline.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) struct Batch {
    pub(super) number: u64,
    /// Replies its transaction takes in the pipeline.
    pub(super) replies: usize,
    pub(super) marked: bool,
}

impl Once {
    pub(super) fn new(broker_id: &str) -> Self {
        Self {
            key: mark_key(broker_id),
            instance: format!("{}-{:016x}", std::process::id(), fastrand::u64(..)),
            last: 0,
            client: None,
            unmarked_until: None,
            doubt: None,
        }
    }

    /// A new command connection: asks Redis who it is, so that a batch left in doubt on it
    /// can be ended inside Redis later. A user whose ACL refuses `CLIENT ID` or `INFO` leaves
    /// that unknown, and the mark alone then decides (a batch still on its way as the mark
    /// is read could then run after it). Errors only when the connection failed.
    pub(super) fn connected(&mut self, con: &mut impl ConnectionLike) -> redis::RedisResult<()> {
        self.client = None;
        let id = refusal_as_none(redis::cmd("CLIENT").arg("ID").query::<i64>(con))?;
        let info = refusal_as_none(redis::cmd("INFO").arg("server").query::<String>(con))?;
        let run = info.as_deref().and_then(run_id);
        if let (Some(id), Some(run)) = (id, run) {
            self.client = Some(ClientId {
                id,
                run: run.to_string(),
            });
        }
        Ok(())
    }

    /// Numbers the next batch and adds its transaction to `pipe`, after whatever `pipe` holds.
    pub(super) fn add_batch<'a>(
        &mut self,
        pipe: &mut redis::Pipeline,
        publishes: impl Iterator<Item = (&'a str, &'a [u8])>,
        now: Instant,
    ) -> Batch {
        self.last += 1;
        let marked = self.unmarked_until.is_none_or(|until| now >= until);
        pipe.cmd("MULTI");
        if marked {
            pipe.cmd("SET")
                .arg(&self.key)
                .arg(format!("{}|{}", self.instance, self.last))
                .arg("PX")
                .arg(MARK_TTL.as_millis() as u64);
        }
        let mut replies = 2 + usize::from(marked);
        for (channel, payload) in publishes {
            pipe.cmd("PUBLISH").arg(channel).arg(payload);
            replies += 1;
        }
        pipe.cmd("EXEC");
        Batch {
            number: self.last,
            replies,
            marked,
        }
    }

    /// The batch was sent and its answer lost: asked about on the next connection.
    pub(super) fn in_doubt(&mut self, batch: Batch, publishes: usize) {
        self.doubt = Some(Doubt {
            batch: batch.number,
            publishes,
            client: self.client.clone(),
        });
    }

    /// Redis refused the mark for want of memory: batches go unmarked for a moment.
    pub(super) fn mark_refused(&mut self, now: Instant) {
        self.unmarked_until = Some(now + UNMARKED_AFTER_FULL);
    }

    /// Reads a batch's answer: the replies of its transaction, `MULTI`'s first and `EXEC`'s
    /// last.
    pub(super) fn sent(batch: Batch, replies: &[Value]) -> Sent {
        let odd = |what: &str| {
            Sent::Refused(redis::RedisError::from((
                redis::ErrorKind::TypeError,
                "a batch of publishes got an unexpected answer",
                what.to_string(),
            )))
        };
        let (Some(multi), Some(exec)) = (replies.first(), replies.last()) else {
            return odd("no replies");
        };
        if replies.len() != batch.replies {
            return odd(&format!("{} replies for {}", replies.len(), batch.replies));
        }
        if let Value::ServerError(e) = multi {
            return Sent::Refused(e.clone().into());
        }
        let queued = &replies[1..replies.len() - 1];
        let first_publish = usize::from(batch.marked);
        match exec {
            Value::Array(results) => {
                let failed = results
                    .iter()
                    .skip(first_publish)
                    .filter(|r| matches!(r, Value::ServerError(_)))
                    .count();
                Sent::Ran {
                    refused: failed as u64,
                }
            }
            Value::ServerError(e) if e.code() == "EXECABORT" => {
                let refused_at = |r: &Value| matches!(r, Value::ServerError(_));
                let mark = batch.marked && queued.first().is_some_and(refused_at);
                let refused: Vec<usize> = queued
                    .iter()
                    .skip(first_publish)
                    .enumerate()
                    .filter(|(_, r)| refused_at(r))
                    .map(|(i, _)| i)
                    .collect();
                if !mark && refused.is_empty() {
                    // Aborted for nothing it names: sent again, it would abort again.
                    return Sent::Refused(e.clone().into());
                }
                Sent::Aborted { refused, mark }
            }
            Value::ServerError(e) => Sent::Refused(e.clone().into()),
            other => odd(&format!("{other:?}")),
        }
    }

    /// Asks whether the batch in doubt ran. First ends the connection it went on inside Redis
    /// (when that connection is of this run of Redis), so nothing of it can run after the
    /// answer; then reads the mark, which a batch that ran set to its number or later.
    pub(super) fn ran(
        &self,
        con: &mut impl ConnectionLike,
        doubt: &Doubt,
    ) -> redis::RedisResult<bool> {
        let mut pipe = redis::pipe();
        let kill = match (&doubt.client, &self.client) {
            (Some(old), Some(now)) if old.run == now.run && old.id != now.id => {
                pipe.cmd("CLIENT")
                    .arg("KILL")
                    .arg("ID")
                    .arg(old.id)
                    .arg("SKIPME")
                    .arg("yes");
                true
            }
            _ => false,
        };
        pipe.cmd("GET").arg(&self.key);
        let replies = con.req_packed_commands(&pipe.get_packed_pipeline(), 0, pipe.len())?;
        if kill {
            if let Some(Value::ServerError(e)) = replies.first() {
                log::warn!(
                    "redis: could not end the connection a batch of publishes was lost on \
                     ({}: {}); a batch Redis still holds could run after this broker sends it \
                     again (grant the broker's user CLIENT)",
                    e.code(),
                    e.details().unwrap_or("")
                );
            }
        }
        Ok(match replies.last() {
            Some(Value::BulkString(mark)) => self.marks_at_least(mark, doubt.batch),
            _ => false,
        })
    }

    /// Whether `mark` is this process's, at batch `batch` or later.
    fn marks_at_least(&self, mark: &[u8], batch: u64) -> bool {
        let Ok(mark) = std::str::from_utf8(mark) else {
            return false;
        };
        let Some((instance, n)) = mark.rsplit_once('|') else {
            return false;
        };
        instance == self.instance && n.parse::<u64>().is_ok_and(|n| n >= batch)
    }
}

/// The mark's key: under `sentinel:`, which the broker's ACL grant names already; `|` is not
/// allowed in a broker id, so no broker's own sentinel can be this key.
fn mark_key(broker_id: &str) -> String {
    format!("sentinel:{broker_id}|published")
}

/// `run_id` from `INFO server`.
fn run_id(info: &str) -> Option<&str> {
    info.lines()
        .find_map(|l| l.strip_prefix("run_id:"))
        .map(str::trim)
        .filter(|r| !r.is_empty())
}

/// A call's answer, None when Redis refused it (an ACL): only a failed connection is an error.
fn refusal_as_none<T>(r: redis::RedisResult<T>) -> redis::RedisResult<Option<T>> {
    match r {
        Ok(v) => Ok(Some(v)),
        Err(e) if e.code().is_some() => Ok(None),
        Err(e) => Err(e),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn reply(text: &[u8]) -> Value {
        redis::parse_redis_value(text).expect("a reply")
    }

    fn batch(publishes: usize, marked: bool) -> Batch {
        Batch {
            number: 1,
            replies: 2 + usize::from(marked) + publishes,
            marked,
        }
    }

    /// EXEC's array is a batch that ran (a publish failing as it ran is counted); EXECABORT
    /// names the publishes and the mark Redis would not queue, and nothing ran; anything else
    /// is a batch that did not run.
    #[test]
    fn a_batchs_answer_says_whether_it_ran_and_what_was_refused() {
        let ok = reply(b"+OK\r\n");
        let queued = reply(b"+QUEUED\r\n");
        let noperm = reply(b"-NOPERM this user has no permissions to access the channel\r\n");
        let oom = reply(b"-OOM command not allowed when used memory > 'maxmemory'.\r\n");
        let abort = reply(b"-EXECABORT Transaction discarded because of previous errors.\r\n");
        let ran = reply(b"*3\r\n+OK\r\n:1\r\n:0\r\n");
        let replies = [
            ok.clone(),
            queued.clone(),
            queued.clone(),
            queued.clone(),
            ran,
        ];
        assert!(matches!(
            Once::sent(batch(2, true), &replies),
            Sent::Ran { refused: 0 }
        ));
        let replies = [
            ok.clone(),
            queued.clone(),
            queued.clone(),
            noperm.clone(),
            abort.clone(),
        ];
        match Once::sent(batch(2, true), &replies) {
            Sent::Aborted { refused, mark } => assert_eq!((refused, mark), (vec![1], false)),
            other => panic!("{other:?}"),
        }
        let replies = [ok.clone(), oom, queued.clone(), abort.clone()];
        match Once::sent(batch(1, true), &replies) {
            Sent::Aborted { refused, mark } => assert_eq!((refused, mark), (vec![], true)),
            other => panic!("{other:?}"),
        }
        // Unmarked: the first queued reply is a publish's.
        let replies = [ok.clone(), noperm, queued.clone(), abort.clone()];
        match Once::sent(batch(2, false), &replies) {
            Sent::Aborted { refused, mark } => assert_eq!((refused, mark), (vec![0], false)),
            other => panic!("{other:?}"),
        }
        // Aborted for nothing it names, short of replies, MULTI refused: did not run.
        let replies = [ok.clone(), queued.clone(), queued.clone(), abort];
        assert!(matches!(
            Once::sent(batch(1, true), &replies),
            Sent::Refused(_)
        ));
        assert!(matches!(
            Once::sent(batch(2, true), &[ok, queued]),
            Sent::Refused(_)
        ));
        let busy = reply(b"-BUSY Redis is busy running a script.\r\n");
        let replies = [busy.clone(), busy.clone(), busy];
        assert!(matches!(
            Once::sent(batch(0, true), &replies),
            Sent::Refused(_)
        ));
    }

    /// Each batch takes the next number and sets the mark to it, unless Redis refused the mark
    /// a moment ago; only this process's mark at the batch or later says the batch ran.
    #[test]
    fn batches_are_numbered_and_marked() {
        let mut once = Once::new("b1");
        let now = Instant::now();
        let mut pipe = redis::pipe();
        let one = once.add_batch(&mut pipe, [("ch", &b"a"[..])].into_iter(), now);
        assert_eq!((one.number, one.replies, one.marked), (1, 4, true));
        let packed = String::from_utf8_lossy(&pipe.get_packed_pipeline()).into_owned();
        assert!(packed.contains("sentinel:b1|published"), "{packed}");
        assert!(packed.contains(&format!("{}|1", once.instance)), "{packed}");
        assert!(
            packed.contains("PUBLISH\r\n$2\r\nch\r\n$1\r\na\r\n"),
            "{packed}"
        );
        once.mark_refused(now);
        let two = once.add_batch(&mut redis::pipe(), std::iter::empty(), now);
        assert_eq!((two.number, two.replies, two.marked), (2, 2, false));
        let later = now + UNMARKED_AFTER_FULL;
        assert!(
            once.add_batch(&mut redis::pipe(), std::iter::empty(), later)
                .marked
        );

        let mine = |n: u64| format!("{}|{n}", once.instance).into_bytes();
        assert!(once.marks_at_least(&mine(3), 3));
        assert!(once.marks_at_least(&mine(4), 3));
        assert!(!once.marks_at_least(&mine(2), 3));
        assert!(!once.marks_at_least(b"other-instance|9", 3));
        assert!(!once.marks_at_least(b"garbage", 1));
    }

    #[test]
    fn the_run_id_is_read_from_info() {
        let info = "# Server\r\nredis_version:7.0.15\r\nrun_id:abc123\r\ntcp_port:6379\r\n";
        assert_eq!(run_id(info), Some("abc123"));
        assert_eq!(run_id("# Server\r\nrun_id:\r\n"), None);
        assert_eq!(mark_key("fe-1"), "sentinel:fe-1|published");
    }
}
