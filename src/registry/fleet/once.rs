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
/// How long batches go plain after Redis refused a transaction because it takes no writes:
/// each transaction would otherwise be refused whole and sent twice meanwhile.
const PLAIN_AFTER_FULL: Duration = Duration::from_secs(1);

/// A command connection as Redis knows it: the client id Redis gave it, in the run of Redis
/// (its `run_id`) that gave it. Ids start again at a restart, so an id is only killed in the
/// run it came from.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(super) struct ClientId {
    id: i64,
    run: String,
}

/// What became of one publish of a batch.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Fate {
    /// It went out.
    Ran,
    /// Redis refused it for good (an ACL that does not let this user publish to its channel),
    /// or it failed as it ran: dropped and counted, since sent again it would fail again.
    Refused,
    /// It did not run, for a reason that passes (Redis full, busy, loading): it stays queued.
    Again,
}

/// What to do after a batch's answer.
#[derive(Debug)]
pub(super) enum Then {
    /// Go on with the next batch.
    Next,
    /// Stop for this pass: Redis is in a passing state (the error says which); the batch's
    /// publishes that did not run go in a later pass.
    Wait(redis::RedisError),
    /// The answer is not one a batch gets: the batch may have run. Settle it as a lost answer.
    Doubt(String),
}

/// A batch's answer: each publish's fate, in batch order, and what to do next.
#[derive(Debug)]
pub(super) struct Answer {
    pub(super) fates: Vec<Fate>,
    pub(super) then: Then,
}

/// How batches are sent.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Mode {
    /// A transaction with the mark: sent once.
    Marked,
    /// Plain `PUBLISH`es in a pipeline: Redis takes no writes (inside `MULTI` it then refuses
    /// every command, `PUBLISH` too, where a plain `PUBLISH` still goes out), or the broker's
    /// user may not write the mark's key. A batch whose answer is lost goes again.
    Plain,
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
    /// Batches go plain until then: Redis refused a transaction because it takes no writes.
    plain_until: Option<Instant>,
    /// Batches go plain on this connection: the broker's user may not write the mark's key.
    plain_here: bool,
    /// Said once per process: the guarantee is weaker with this ACL.
    acl_told: bool,
    /// The batch whose answer was lost with its connection: the next connection asks about
    /// it before anything else is published.
    pub(super) doubt: Option<Doubt>,
}

/// A batch sent on a connection that failed before its answer.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(super) struct Doubt {
    batch: u64,
    /// The publishes at the head of the queue that it carried.
    pub(super) publishes: usize,
    /// The connection it went on, to end inside Redis before asking.
    client: Option<ClientId>,
    /// Whether it set the mark (a plain batch can only be sent again).
    marked: bool,
}

/// A batch added to a pipeline.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) struct Batch {
    number: u64,
    mode: Mode,
    publishes: usize,
}

impl Batch {
    /// Replies the batch takes in the pipeline.
    pub(super) fn replies(&self) -> usize {
        match self.mode {
            // MULTI, SET, the publishes, EXEC.
            Mode::Marked => self.publishes + 3,
            Mode::Plain => self.publishes,
        }
    }
}

impl Once {
    pub(super) fn new(broker_id: &str) -> Self {
        Self {
            key: mark_key(broker_id),
            instance: format!("{}-{:016x}", std::process::id(), fastrand::u64(..)),
            last: 0,
            client: None,
            plain_until: None,
            plain_here: false,
            acl_told: false,
            doubt: None,
        }
    }

    /// A new command connection: asks Redis who it is, so that a batch left in doubt on it
    /// can be ended inside Redis later. A user whose ACL refuses `CLIENT ID` or `INFO` leaves
    /// that unknown, and the mark alone then decides (a batch still on its way as the mark
    /// is read could then run after it); said once. Errors only when the connection failed.
    pub(super) fn connected(&mut self, con: &mut impl ConnectionLike) -> redis::RedisResult<()> {
        self.client = None;
        self.plain_here = false;
        let id = refusal_as_none(redis::cmd("CLIENT").arg("ID").query::<i64>(con))?;
        let info = refusal_as_none(redis::cmd("INFO").arg("server").query::<String>(con))?;
        let run = info.as_deref().and_then(run_id);
        match (id, run) {
            (Some(id), Some(run)) => {
                self.client = Some(ClientId {
                    id,
                    run: run.to_string(),
                });
            }
            (id, _) => {
                let mut refused = Vec::new();
                if id.is_none() {
                    refused.push("CLIENT ID");
                }
                if info.is_none() {
                    refused.push("INFO server");
                }
                self.tell_acl(&refused);
            }
        }
        Ok(())
    }

    /// Says once per process that the broker's ACL weakens the once-only publishing.
    fn tell_acl(&mut self, what: &[&str]) {
        if !std::mem::replace(&mut self.acl_told, true) {
            log::warn!(
                "redis: this broker's user may not use {}: a batch of replies and events whose \
                 answer a broken connection takes may be published twice (grant CLIENT ID, \
                 CLIENT KILL and INFO, or +@all; docs/operations.md)",
                what.join(" or ")
            );
        }
    }

    /// Numbers the next batch of `publishes` and adds it to `pipe`, after whatever `pipe`
    /// holds.
    pub(super) fn add_batch<'a>(
        &mut self,
        pipe: &mut redis::Pipeline,
        publishes: impl Iterator<Item = (&'a str, &'a [u8])>,
        now: Instant,
    ) -> Batch {
        self.last += 1;
        let plain = self.plain_here || self.plain_until.is_some_and(|until| now < until);
        let mode = if plain { Mode::Plain } else { Mode::Marked };
        if mode == Mode::Marked {
            pipe.cmd("MULTI");
            pipe.cmd("SET")
                .arg(&self.key)
                .arg(format!("{}|{}", self.instance, self.last))
                .arg("PX")
                .arg(MARK_TTL.as_millis() as u64);
        }
        let mut count = 0;
        for (channel, payload) in publishes {
            pipe.cmd("PUBLISH").arg(channel).arg(payload);
            count += 1;
        }
        if mode == Mode::Marked {
            pipe.cmd("EXEC");
        }
        Batch {
            number: self.last,
            mode,
            publishes: count,
        }
    }

    /// The batch was sent and its answer lost: asked about on the next connection.
    pub(super) fn in_doubt(&mut self, batch: Batch) {
        self.doubt = Some(Doubt {
            batch: batch.number,
            publishes: batch.publishes,
            client: self.client.clone(),
            marked: batch.mode == Mode::Marked,
        });
    }

    /// Reads a batch's answer (its replies, in pipeline order), and learns from it how the
    /// next batches go.
    pub(super) fn answer(&mut self, batch: Batch, replies: &[Value], now: Instant) -> Answer {
        if replies.len() != batch.replies() {
            return Answer {
                fates: vec![Fate::Again; batch.publishes],
                then: Then::Doubt(format!(
                    "{} replies to a batch of publishes that takes {}",
                    replies.len(),
                    batch.replies()
                )),
            };
        }
        match batch.mode {
            Mode::Plain => plain_answer(replies),
            Mode::Marked => self.marked_answer(replies, now),
        }
    }

    /// A transaction's answer: `MULTI`'s, the `SET`'s and each publish's as queued, `EXEC`'s.
    fn marked_answer(&mut self, replies: &[Value], now: Instant) -> Answer {
        // At least MULTI, SET and EXEC: `answer` checked the count.
        let (Some((multi, rest)), Some(exec)) = (replies.split_first(), replies.last()) else {
            return plain_answer(&[]);
        };
        let Some((mark, publishes)) = rest
            .get(..rest.len().saturating_sub(1))
            .and_then(<[Value]>::split_first)
        else {
            return plain_answer(&[]);
        };
        if let Value::ServerError(e) = multi {
            // Without MULTI what followed ran as plain commands: the publishes' own replies
            // say which went out. Then the refusal is waited on: one the ACL makes (MULTI
            // revoked while connected) drops the connection, whose reconnect reports it.
            let mut answer = plain_answer(publishes);
            if matches!(answer.then, Then::Next) {
                answer.then = Then::Wait(e.clone().into());
            }
            return answer;
        }
        match exec {
            Value::Array(results) => Answer {
                fates: results
                    .iter()
                    .skip(1)
                    .map(|r| match r {
                        Value::ServerError(_) => Fate::Refused,
                        _ => Fate::Ran,
                    })
                    .chain(std::iter::repeat(Fate::Ran))
                    .take(publishes.len())
                    .collect(),
                then: Then::Next,
            },
            Value::ServerError(e) => {
                // Nothing ran. Publishes an ACL refused go; the rest stay, and the reason the
                // transaction was discarded says how they go next.
                let code = |v: &Value| match v {
                    Value::ServerError(e) => Some(e.code().to_string()),
                    _ => None,
                };
                let fates = publishes
                    .iter()
                    .map(|p| match code(p).as_deref() {
                        Some("NOPERM") => Fate::Refused,
                        _ => Fate::Again,
                    })
                    .collect();
                let why = e.details().unwrap_or("");
                let mark_code = code(mark);
                let full = publishes.iter().any(|v| code(v).as_deref() == Some("OOM"))
                    || why.contains("OOM")
                    || mark_code.as_deref().is_some_and(takes_no_writes);
                let then = if full {
                    // Redis takes no writes (full at `maxmemory`, a read-only replica, a failed
                    // save): inside MULTI it then refuses every command, where a plain PUBLISH
                    // still goes out.
                    self.plain_until = Some(now + PLAIN_AFTER_FULL);
                    Then::Next
                } else if e.code() == "NOPERM" || why.contains("NOPERM") {
                    // EXEC refused by the ACL (revoked while connected): the connection drops
                    // and its reconnect reports it.
                    Then::Wait(e.clone().into())
                } else if mark_code.as_deref() == Some("NOPERM") {
                    // The user may not write the mark's key (an ACL narrower than the
                    // `sentinel:*` the broker checks at connect): plain on this connection.
                    self.plain_here = true;
                    self.tell_acl(&["the mark's key, sentinel:<id>|published"]);
                    Then::Next
                } else if let Some(passing) =
                    [mark].into_iter().chain(publishes).find_map(|v| match v {
                        Value::ServerError(e) if e.code() != "NOPERM" => Some(e.clone()),
                        _ => None,
                    })
                {
                    Then::Wait(passing.into())
                } else if publishes.iter().any(|p| code(p).is_some()) {
                    // Only ACL refusals of publishes: the rest go at once.
                    Then::Next
                } else {
                    Then::Wait(e.clone().into())
                };
                Answer { fates, then }
            }
            other => Answer {
                fates: vec![Fate::Again; publishes.len()],
                then: Then::Doubt(format!("EXEC answered {other:?}")),
            },
        }
    }

    /// Asks whether the batch in doubt ran. First ends the connection it went on inside Redis
    /// (when that connection is of this run of Redis), so nothing of it can run after the
    /// answer; then reads the mark, which a batch that ran set to its number or later. A plain
    /// batch left no mark: it counts as not run. An error reply leaves the doubt for later.
    pub(super) fn ran(
        &mut self,
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
                if e.code() == "NOPERM" {
                    self.tell_acl(&["CLIENT KILL"]);
                } else {
                    log::warn!(
                        "redis: could not end the connection a batch of publishes was lost on \
                         ({}: {}); a batch Redis still holds could run after this broker sends \
                         it again",
                        e.code(),
                        e.details().unwrap_or("")
                    );
                }
            }
        }
        match replies.last() {
            Some(Value::ServerError(e)) => Err(e.clone().into()),
            Some(Value::BulkString(mark)) => {
                Ok(doubt.marked && self.marks_at_least(mark, doubt.batch))
            }
            _ => Ok(false),
        }
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

/// Whether an error code is Redis refusing every write for now (full at `maxmemory`, a
/// read-only replica, a failed save, too few replicas), as opposed to being busy or loading.
fn takes_no_writes(code: &str) -> bool {
    matches!(code, "OOM" | "READONLY" | "MISCONF" | "NOREPLICAS")
}

/// Plain publishes' replies: a count is a publish that went out, an ACL's refusal one that
/// never will, any other error one that may later (the first such error says to wait).
fn plain_answer(replies: &[Value]) -> Answer {
    let mut wait = None;
    let fates = replies
        .iter()
        .map(|r| match r {
            Value::ServerError(e) if e.code() == "NOPERM" => Fate::Refused,
            Value::ServerError(e) => {
                wait.get_or_insert_with(|| e.clone());
                Fate::Again
            }
            _ => Fate::Ran,
        })
        .collect();
    let then = match wait {
        Some(e) => Then::Wait(e.into()),
        None => Then::Next,
    };
    Answer { fates, then }
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

    fn reply(text: &str) -> Value {
        redis::parse_redis_value(text.as_bytes()).expect("a reply")
    }

    fn replies(texts: &[&str]) -> Vec<Value> {
        texts.iter().map(|t| reply(t)).collect()
    }

    const OK: &str = "+OK\r\n";
    const QUEUED: &str = "+QUEUED\r\n";
    const NOPERM: &str = "-NOPERM this user has no permissions to access one of the channels\r\n";
    const OOM: &str = "-OOM command not allowed when used memory > 'maxmemory'.\r\n";
    const ABORT: &str = "-EXECABORT Transaction discarded because of previous errors.\r\n";

    /// A marked batch of `publishes`, numbered as `once` numbers it.
    fn marked(once: &mut Once, publishes: usize) -> Batch {
        let batch = once.add_batch(
            &mut redis::pipe(),
            std::iter::repeat_n(("ch", &b"p"[..]), publishes),
            Instant::now(),
        );
        assert_eq!(batch.mode, Mode::Marked);
        batch
    }

    fn fates_and_then(once: &mut Once, batch: Batch, texts: &[&str]) -> (Vec<Fate>, String) {
        let Answer { fates, then } = once.answer(batch, &replies(texts), Instant::now());
        (fates, format!("{then:?}"))
    }

    /// The answers Redis 7 gives a transaction (each seen in review bb142's experiments): EXEC's
    /// array is a batch that ran, one of its publishes failing as it ran; an ACL's refusal at
    /// queueing drops that publish alone and the rest go at once; a busy Redis keeps them all.
    #[test]
    fn a_transactions_answer_says_what_ran_what_goes_and_what_stays() {
        use Fate::*;
        let mut once = Once::new("b1");
        let b = marked(&mut once, 2);
        let ran = "*3\r\n+OK\r\n:1\r\n:0\r\n";
        let (fates, then) = fates_and_then(&mut once, b, &[OK, QUEUED, QUEUED, QUEUED, ran]);
        assert_eq!((fates, then.as_str()), (vec![Ran, Ran], "Next"));
        let b = marked(&mut once, 2);
        let failed = "*3\r\n+OK\r\n-NOPERM no permissions\r\n:0\r\n";
        let (fates, _) = fates_and_then(&mut once, b, &[OK, QUEUED, QUEUED, QUEUED, failed]);
        assert_eq!(fates, [Refused, Ran]);
        let b = marked(&mut once, 3);
        let (fates, then) =
            fates_and_then(&mut once, b, &[OK, QUEUED, QUEUED, NOPERM, QUEUED, ABORT]);
        assert_eq!(
            (fates, then.as_str()),
            (vec![Again, Refused, Again], "Next")
        );
        let b = marked(&mut once, 2);
        let busy = "-BUSY Redis is busy running a script.\r\n";
        let (fates, then) = fates_and_then(&mut once, b, &[OK, QUEUED, busy, QUEUED, ABORT]);
        assert_eq!(fates, [Again, Again]);
        assert!(then.starts_with("Wait"), "{then}");
        assert_eq!(marked(&mut once, 1).mode, Mode::Marked, "still marked");
        // Fewer replies than the batch takes: it may have run.
        let b = marked(&mut once, 1);
        let (fates, then) = fates_and_then(&mut once, b, &[OK, QUEUED]);
        assert_eq!(fates, [Again]);
        assert!(then.starts_with("Doubt"), "{then}");
    }

    /// A full Redis refuses every command queued in MULTI, PUBLISH too, where it takes a plain
    /// PUBLISH: the batch stays and the next ones go plain for a moment. So does a Redis that
    /// refuses the mark for another passing reason (a read-only replica), and one that discards
    /// the transaction at EXEC for memory.
    #[test]
    fn a_full_redis_sends_batches_plain_for_a_moment() {
        use Fate::*;
        let mut once = Once::new("b1");
        let b = marked(&mut once, 2);
        let now = Instant::now();
        let Answer { fates, then } = once.answer(b, &replies(&[OK, OOM, OOM, OOM, ABORT]), now);
        assert_eq!(fates, [Again, Again]);
        assert!(matches!(then, Then::Next), "{then:?}");
        let plain = once.add_batch(&mut redis::pipe(), std::iter::empty(), now);
        assert_eq!(plain.mode, Mode::Plain);
        let later = once.add_batch(
            &mut redis::pipe(),
            std::iter::empty(),
            now + PLAIN_AFTER_FULL,
        );
        assert_eq!(
            later.mode,
            Mode::Marked,
            "marked again once the moment is over"
        );

        let mut once = Once::new("b1");
        let b = marked(&mut once, 1);
        let readonly = "-READONLY You can't write against a read only replica.\r\n";
        once.answer(b, &replies(&[OK, readonly, QUEUED, ABORT]), now);
        assert_eq!(marked_or_plain(&mut once, now), Mode::Plain);

        let mut once = Once::new("b1");
        let b = marked(&mut once, 1);
        let at_exec = "-EXECABORT Transaction discarded because of: OOM command not allowed\r\n";
        let (fates, _) = fates_and_then(&mut once, b, &[OK, QUEUED, QUEUED, at_exec]);
        assert_eq!(fates, [Again]);
        assert_eq!(marked_or_plain(&mut once, now), Mode::Plain);
    }

    fn marked_or_plain(once: &mut Once, now: Instant) -> Mode {
        once.add_batch(&mut redis::pipe(), std::iter::empty(), now)
            .mode
    }

    /// A user that may not use MULTI: what followed ran as plain commands, and the publishes'
    /// own replies say which went out; one that may not use EXEC: nothing ran. Either way the
    /// refusal is waited on (the connection drops, and its reconnect reports the ACL). A user
    /// that may not write the mark's key sends plain batches on this connection.
    #[test]
    fn transactions_the_acl_refuses_are_waited_on_and_an_unwritable_mark_goes_plain() {
        use Fate::*;
        let now = Instant::now();
        let mut once = Once::new("b1");
        let b = marked(&mut once, 2);
        let no_multi = "-NOPERM this user has no permissions to run the 'multi' command\r\n";
        let no_exec = "-ERR EXEC without MULTI\r\n";
        let (fates, then) =
            fates_and_then(&mut once, b, &[no_multi, OK, ":1\r\n", NOPERM, no_exec]);
        assert_eq!(fates, [Ran, Refused]);
        assert!(
            then.starts_with("Wait") && then.contains("'multi'"),
            "{then}"
        );

        let b = marked(&mut once, 1);
        let exec_refused = "-EXECABORT Transaction discarded because of: NOPERM this user has no permissions to run the 'exec' command\r\n";
        let (fates, then) = fates_and_then(&mut once, b, &[OK, QUEUED, QUEUED, exec_refused]);
        assert_eq!(fates, [Again]);
        assert!(
            then.starts_with("Wait") && then.contains("'exec'"),
            "{then}"
        );
        assert_eq!(marked_or_plain(&mut once, now), Mode::Marked);

        let b = marked(&mut once, 1);
        let no_key =
            "-NOPERM this user has no permissions to access one of the keys used as arguments\r\n";
        let (fates, then) = fates_and_then(&mut once, b, &[OK, no_key, QUEUED, ABORT]);
        assert_eq!((fates, then.as_str()), (vec![Again], "Next"));
        assert_eq!(marked_or_plain(&mut once, now), Mode::Plain);
        // A new connection tries the mark again (the ACL may have been mended).
        once.plain_here = false;
        assert_eq!(marked_or_plain(&mut once, now), Mode::Marked);
    }

    /// A busy or loading Redis refusing the mark is waited on, not taken for one that takes no
    /// writes.
    #[test]
    fn a_busy_redis_is_waited_on() {
        let now = Instant::now();
        let mut once = Once::new("b1");
        let b = marked(&mut once, 1);
        let busy = "-BUSY Redis is busy running a script.\r\n";
        let (fates, then) = fates_and_then(&mut once, b, &[OK, busy, busy, ABORT]);
        assert_eq!(fates, [Fate::Again]);
        assert!(then.starts_with("Wait"), "{then}");
        assert_eq!(marked_or_plain(&mut once, now), Mode::Marked);
    }

    /// Plain publishes: a count went out, an ACL's refusal never will, anything else may later.
    #[test]
    fn a_plain_batchs_answer_is_read_publish_by_publish() {
        use Fate::*;
        let loading = "-LOADING Redis is loading the dataset in memory\r\n";
        let Answer { fates, then } = plain_answer(&replies(&[":1\r\n", NOPERM, loading]));
        assert_eq!(fates, [Ran, Refused, Again]);
        assert!(matches!(then, Then::Wait(_)), "{then:?}");
        let Answer { then, .. } = plain_answer(&replies(&[":0\r\n", NOPERM]));
        assert!(matches!(then, Then::Next), "{then:?}");
    }

    /// Each batch takes the next number and sets the mark to it; only this process's mark at
    /// the batch or later says the batch ran.
    #[test]
    fn batches_are_numbered_and_marked() {
        let mut once = Once::new("b1");
        let mut pipe = redis::pipe();
        let one = once.add_batch(&mut pipe, [("ch", &b"a"[..])].into_iter(), Instant::now());
        assert_eq!((one.number, one.replies()), (1, 4));
        let packed = String::from_utf8_lossy(&pipe.get_packed_pipeline()).into_owned();
        assert!(packed.starts_with("*1\r\n$5\r\nMULTI\r\n"), "{packed}");
        assert!(packed.contains("sentinel:b1|published"), "{packed}");
        assert!(packed.contains(&format!("{}|1", once.instance)), "{packed}");
        assert!(
            packed.contains("PUBLISH\r\n$2\r\nch\r\n$1\r\na\r\n"),
            "{packed}"
        );
        assert!(packed.ends_with("*1\r\n$4\r\nEXEC\r\n"), "{packed}");
        assert_eq!(marked(&mut once, 0).number, 2);

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
