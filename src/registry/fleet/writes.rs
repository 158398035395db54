//! The writes that need no answer and go out paced: publishes (events and replies), lease
//! releases, notes on sessions whose rigs left, and removals of acked commands, each queued
//! under a bound and sent in batches by `flush`, and all of it at the end of a drain. Apart
//! because what these hold while Redis is away, what they drop past their bounds, and the
//! order they reach Redis in (a removal riding ahead of its `ack` event, a release dropped
//! when its lease is claimed again) are rules of their own, unlike the calls answered at once.

use std::collections::HashSet;
use std::time::{Duration, Instant};

use redis::{ConnectionLike, Value};

use super::errors::{leaves_connection_sound, CallError};
use super::once::{Answer, Fate, Then};
use super::{Fleet, EVENTS, EXIT_RETRY};
use crate::ids::Seq;
use crate::ids::{BootId, ConnId, RigId};
use crate::registry::exit_wait::ExitWait;
use crate::registry::msg::Recall;
use crate::registry::sessions;
use crate::registry::sessions::CheckedForget;

/// Publishes held while Redis is slow or down; beyond it they are dropped and counted.
const MAX_OUTGOING: usize = 100_000;
/// The bytes those publishes may hold (channel names and payloads). Rig events (up to
/// `--max-message` each) stop at [`EVENT_SHARE_BYTES`]; the 8 MiB above it stay for control's
/// replies and the brokers' own messages, small, owed, and each on a channel of its own.
const MAX_OUTGOING_BYTES: usize = 32 << 20;
/// Why 24 MiB: the backlog goes out in about a second once Redis is back, much faster than a
/// subscriber of `fleetlink:events` reads it, so nearly all of it sits in that subscriber's
/// Redis output buffer, and Redis's default `client-output-buffer-limit pubsub 32mb 8mb 60`
/// disconnects the subscriber once it passes 32 MiB: control would lose its stream exactly
/// when it matters. Each message costs the subscriber its payload plus about 50 bytes
/// (`*3 $7 message $16 fleetlink:events $N` and the CRLFs), of which the 16 of the channel
/// name are counted here, so at most [`MAX_OUTGOING`] × 36 B ≈ 3.6 MB uncounted: the whole
/// backlog stays under about 29 MB, 4.7 MB short of the limit. Events held beyond what a
/// subscriber can be sent would only cost it the ones it could have had. (The soft limit,
/// 8 MiB for 60 s, leaves a subscriber a minute to catch up.) The bound is per broker: when
/// several brokers flush at once, their backlogs add up in the subscriber's buffer.
const EVENT_SHARE_BYTES: usize = 24 << 20;
/// The publishes rig events may hold, by count: small events (a rig's `ack`s, 200 bytes each)
/// reach the count bound long before the bytes, and without a share of their own a few chatty
/// rigs during a Redis stall would leave no room for control's replies, which are owed.
const EVENT_SHARE_COUNT: usize = MAX_OUTGOING / 4 * 3;
/// Bytes of publishes sent in one pipeline: a Redis back from an outage gets the queue in
/// pieces, not as one write of everything held.
const FLUSH_BYTES: usize = 8 << 20;
/// Publishes in one batch: a batch is one transaction (`once.rs`), which Redis runs without
/// serving anyone else, so 4,096 (a few ms of Redis) keeps other brokers' calls from waiting
/// long behind an outage's backlog; a pipeline of plain PUBLISHes let Redis serve others
/// between its reads.
const FLUSH_COUNT: usize = 4096;
/// Pipelines of publishes sent per pass of the bridge.
const FLUSH_PIPELINES: usize = 4;

/// Removals of acked commands that find no publish to ride with (see [`Fleet::flush`]) wait up
/// to this long, or for [`FORGET_BATCH`] of them. Until then a resume elsewhere still finds
/// them, and drops them by the rig's `last_seq`: a rig acks only what it has.
const FORGET_PACE: Duration = Duration::from_secs(1);
const FORGET_BATCH: usize = 16_384;
/// Sessions whose queued forgets ride with the next publishes rather than wait for their
/// pace, one HDEL each. Acks from a few rigs at a time fit, however many each sends at once (a
/// rig acking a burst of commands); a fan-out's acks come from dozens of rigs per paced write,
/// and their removals' work inside the burst costs its last deliveries more than it is worth
/// (an A/B in docs/benchmarks-history.md).
const FORGET_RIDE_MAX: usize = 8;
/// At most this many acked commands ride, whatever their sessions.
const FORGET_RIDE_FIELDS: usize = 1024;

impl Fleet {
    /// Queues the removal of an acked command from its session (sent when
    /// [`Self::forget_due`]). False when the queue is full: the command then stays in the
    /// session until the session expires, where a resume drops it by the rig's `last_seq`.
    pub(crate) fn forget(&mut self, rig: RigId, boot: BootId, seq: Seq) -> bool {
        if self.forgets_full() {
            return false;
        }
        self.forgets.push((rig, boot, seq));
        self.forgets_since.get_or_insert_with(Instant::now);
        true
    }

    /// Queues the removal of an acked command delivered while Redis was away, which Redis
    /// may hold another command under the seq of (sent at the next [`Self::flush`]). False
    /// when the queue is full, as [`Self::forget`].
    pub(crate) fn forget_checked(&mut self, f: CheckedForget) -> bool {
        if self.forgets_full() {
            return false;
        }
        self.checked_forgets.push(f);
        true
    }

    /// Whether the removals of acked commands, plain and checked together, fill their bound.
    fn forgets_full(&self) -> bool {
        self.forgets.len() + self.checked_forgets.len() >= MAX_OUTGOING
    }

    /// Sends the queued checked forgets now. False when Redis failed and the connection went
    /// with it. Refused on a sound connection (a full Redis refuses their marks), they are
    /// tried again a [`FORGET_PACE`] later, and the rest of the flush goes on meanwhile: held
    /// back behind them, replies and events waited for as long as Redis stayed full (review
    /// bb119 saw a reply 1.3 s late).
    fn send_checked_forgets(&mut self) -> bool {
        if self.checked_forgets.is_empty() {
            return true;
        }
        let now = Instant::now();
        if self.checked_forgets_after.is_some_and(|after| now < after) {
            return true;
        }
        let Some(con) = self.con.as_mut() else {
            return false;
        };
        let at = crate::reply::rfc3339(std::time::SystemTime::now());
        match self.sessions.forget_checked(
            con,
            &self.checked_forgets,
            &self.broker_id,
            &at,
            self.session_ttl,
        ) {
            Ok(lost) => {
                self.forget_lost += lost;
                self.checked_forgets.clear();
                self.checked_forgets_after = None;
                true
            }
            Err(e) => {
                self.call_failed(&e);
                self.checked_forgets_after = Some(now + FORGET_PACE);
                self.con.is_some()
            }
        }
    }

    /// Sends the queued forgets now, in one round trip. False when Redis failed.
    fn send_forgets(&mut self) -> bool {
        if self.forgets.is_empty() {
            return true;
        }
        let Some(con) = self.con.as_mut() else {
            return false;
        };
        let mut pipe = redis::pipe();
        hdel_by_session(&mut pipe, &self.forgets);
        if let Err(e) = pipe.query::<()>(con) {
            self.call_failed(&e);
            return false;
        }
        self.forgets.clear();
        self.forgets_since = None;
        true
    }

    /// Sends these lease releases in one round trip; false when the call failed (the
    /// connection is then dropped).
    fn send_releases(&mut self, releases: Vec<(RigId, BootId)>) -> bool {
        let Some(con) = self.con.as_mut() else {
            self.releases.extend(releases);
            return false;
        };
        let released = self.scripts.release(con, &releases, &self.broker_id);
        if let Ok(deleted) = released {
            // A lease gone: another broker's now, or Redis lost it (see `release_missed`).
            self.release_missed |= deleted < releases.len();
        }
        if let Err(e) = released {
            // Sent again on the next connection (the script deletes only this broker's
            // exact tuple, so twice is harmless): dropped, the lease would outlive its rig
            // by a TTL, and commands held for the rig meanwhile would be refused as for a
            // rig connected here. Not when Redis refused them on a sound connection (an
            // ACL without EVALSHA, say): sent again, they were refused again at every pass
            // of the bridge, 800 calls a second; those leases lapse by their TTL.
            if !e.redis().is_some_and(leaves_connection_sound) {
                self.releases.extend(releases);
            }
            self.call_failed(&e);
            return false;
        }
        // A released session's TTL counts from its disconnect, not from its last touch.
        self.touch_sessions(&releases);
        true
    }

    /// Before these rigs' sessions are read: their acked commands leave Redis first (a new
    /// boot would otherwise report an acked command `rig_rebooted`), and a release queued for
    /// the very lease a hello is about to claim again is dropped (sent after the claim, its
    /// compare-and-delete would find the same tuple and delete the new claim). One queued
    /// for another boot of a rig saying hello goes first: left for the paced flush, the
    /// claim would find the lease of a connection already closed, and an older boot (a rig
    /// whose clock stepped back, restarting at once) would be turned away 4409.
    pub(crate) fn settle_before_hellos(&mut self, hellos: &[(&RigId, &BootId)]) {
        let claimed: HashSet<(&RigId, &BootId)> = hellos.iter().copied().collect();
        let rigs: HashSet<&RigId> = hellos.iter().map(|(rig, _)| *rig).collect();
        self.releases
            .retain(|(rig, boot)| !claimed.contains(&(rig, boot)));
        if self.con.is_some() && self.releases.iter().any(|(rig, _)| rigs.contains(rig)) {
            let (first, rest) = std::mem::take(&mut self.releases)
                .into_iter()
                .partition(|(rig, _)| rigs.contains(rig));
            self.releases = rest;
            self.send_releases(first);
        }
        if self.checked_forgets.iter().any(|f| rigs.contains(&f.rig)) {
            self.send_checked_forgets();
        }
        if self.forgets.iter().any(|(rig, _, _)| rigs.contains(rig)) {
            self.send_forgets();
        }
    }

    /// When the queued forgets are to go out: None when there are none.
    pub(crate) fn forget_due(&self) -> Option<Instant> {
        let since = self.forgets_since?;
        if self.forgets.len() >= FORGET_BATCH {
            return Some(since);
        }
        Some(since + FORGET_PACE)
    }

    /// Removes the `broker:<id>` liveness key on a clean exit, so that control stops counting
    /// this broker among those that answer a broadcast at once, not 30 s later. Where every
    /// lease release went out (none still queued, none dropped for a full queue) and no sweep
    /// of a predecessor's leases is under way, the sentinel says the exit was clean, so that
    /// the next process under this id sweeps nothing (`sweep.rs`).
    pub(crate) fn retire(&mut self) {
        let clean = self.releases.is_empty() && !self.release_dropped && !self.sweeping();
        let Some(con) = self.con.as_mut() else { return };
        let key = crate::registry::scripts::broker_key(&self.broker_id);
        if let Err(e) = redis::cmd("DEL").arg(key).query::<()>(con) {
            log::warn!("redis: broker key not removed at exit ({e}); it lapses by its TTL");
        }
        if clean {
            // XX: a sentinel Redis lost meanwhile stays lost, as broker.lua reads it.
            let sentinel = crate::registry::scripts::sentinel_key(&self.broker_id);
            let done = redis::cmd("SET")
                .arg(sentinel)
                .arg("clean")
                .arg("XX")
                .query::<Option<String>>(con);
            if let Err(e) = done {
                log::warn!(
                    "redis: clean exit not recorded ({e}); the next process under this id \
                     sweeps for leases left over"
                );
            }
        }
    }

    /// The end of a drain: sends everything queued, waiting as `wait` allows for a Redis that is
    /// away (or paused) to answer again, then says what could not be sent. Before, a broker
    /// that drained during an outage exited at once, and the `ack` events it held (acks it
    /// took while Redis could not keep them) were lost without a word.
    pub(crate) fn flush_before_exit(&mut self, wait: &ExitWait) {
        loop {
            let now = Instant::now();
            if super::connection::attempt_fits(wait, now) {
                // At its own pace, not the backoff's: after a long outage that is seconds.
                self.next_attempt = self.next_attempt.min(now);
                self.ensure(now);
            }
            if self.con.is_some() {
                self.flush(None);
            }
            let now = Instant::now();
            let (publishes, forgets, writes) = (
                self.outgoing.len(),
                self.forgets.len() + self.checked_forgets.len(),
                self.releases.len() + self.recalls.len(),
            );
            if publishes + forgets + writes == 0 {
                return;
            }
            if wait.over(now) {
                // A batch whose answer was lost may have gone out: say how many of those
                // "unpublished" it holds.
                let doubt = self.once.doubt.as_ref().map_or(String::new(), |d| {
                    format!(
                        " (the first {} of them may have gone out: their answer was lost)",
                        d.publishes
                    )
                });
                log::warn!(
                    "redis: exiting with {publishes} events and replies unpublished{doubt}, {forgets} removals of acked commands and {writes} lease releases and session notes unwritten: Redis did not answer by the end of the drain's wait for it (the leases lapse by their TTL; an acked command whose removal is lost may be reported rig_rebooted at its rig's next boot)"
                );
                return;
            }
            std::thread::sleep(wait.pause(now, EXIT_RETRY));
        }
    }

    /// Writes waiting for the next [`Self::flush`], forgets and recalls aside (see
    /// [`Self::forget_due`] and [`Self::recalls_queued`]).
    pub(crate) fn queued(&self) -> usize {
        self.outgoing.len() + self.releases.len()
    }

    /// Sessions' notes (`r`) waiting for the next [`Self::flush`]. They go as soon as the
    /// persists' bucket lets them, not at the pace of replies: the rig may be saying hello to
    /// another broker already, which reads the note as it resumes the session.
    pub(crate) fn recalls_queued(&self) -> usize {
        self.recalls.len()
    }

    /// Queues what this broker remembers of a session whose rig disconnected (acked commands'
    /// ids awaiting results, the last ack's time), for a resume on another broker; sent with
    /// the next flush. False when not queued: no session is kept, or the queue is full.
    /// `conn`, when its core holds the echo of the rig's close for it, hears once the note
    /// went ([`Self::take_noted`]).
    pub(crate) fn remember(
        &mut self,
        rig: RigId,
        boot: BootId,
        recall: &Recall,
        conn: Option<ConnId>,
    ) -> bool {
        if self.session_ttl.is_zero() || self.recalls.len() >= MAX_OUTGOING {
            return false;
        }
        let text = sessions::encode_recall(recall);
        self.recalls.push((rig, boot, text));
        self.noting.extend(conn);
        true
    }

    /// The connections whose session's note went to Redis (or failed to) since the last call.
    pub(crate) fn take_noted(&mut self) -> Vec<ConnId> {
        std::mem::take(&mut self.noted)
    }

    /// Queues a compare-and-delete of a released lease, and a fresh `--session-ttl` for its
    /// session (sent with the next flush). False when the queue is full: the lease then lapses
    /// by its own TTL, and the rig's next hello anywhere takes it over before that.
    pub(crate) fn release(&mut self, rig: RigId, boot: BootId) -> bool {
        if self.releases.len() >= MAX_OUTGOING {
            self.release_dropped = true;
            return false;
        }
        self.releases.push((rig, boot));
        true
    }

    /// Takes back the queued releases of these leases, and returns the ones it found, for the
    /// caller to queue again later: a session parked for a rig must be put back before its
    /// lease goes. If Redis kept the lease through the outage, `rekeep.lua` merges under it;
    /// released first, the script would find only the session Redis kept from before the
    /// outage, leave it as someone's newer truth, and the commands delivered since were lost.
    pub(crate) fn hold_releases(
        &mut self,
        which: &HashSet<(RigId, BootId)>,
    ) -> HashSet<(RigId, BootId)> {
        let mut held = HashSet::new();
        if which.is_empty() {
            return held;
        }
        self.releases.retain(|r| {
            if which.contains(r) {
                held.insert(r.clone());
                return false;
            }
            true
        });
        held
    }

    /// Queues a PUBLISH (sent with the next flush, in order). Past the bounds it is dropped
    /// and counted in `dropped`.
    pub(crate) fn publish(&mut self, channel: String, payload: Vec<u8>) {
        let event = channel == EVENTS;
        let (cap, full) = if event {
            (EVENT_SHARE_BYTES, self.outgoing_events >= EVENT_SHARE_COUNT)
        } else {
            (MAX_OUTGOING_BYTES, false)
        };
        let size = channel.len() + payload.len();
        if full || self.outgoing.len() >= MAX_OUTGOING || self.outgoing_bytes + size > cap {
            self.dropped += 1;
            if let Some(n) = self.drop_log.note(Instant::now()) {
                self.log_drops(n);
            }
            return;
        }
        self.outgoing_bytes += size;
        self.outgoing_events += usize::from(event);
        self.outgoing.push((channel, payload.into_boxed_slice()));
    }

    /// Logs the drops held back by the once-a-second bound, once it allows: a burst that
    /// stopped is logged too, not only when the next drop comes.
    pub(crate) fn log_pending_drops(&mut self, now: Instant) {
        if let Some(n) = self.drop_log.due(now) {
            self.log_drops(n);
        }
        if let Some(n) = self.refused_log.due(now) {
            log::warn!("redis: {n} more batches of publishes were refused in whole or in part");
        }
        if let Some(n) = self.refusal_log.due(now) {
            log::warn!("redis: {n} more calls refused since the last such line");
        }
    }

    fn log_drops(&self, n: u64) {
        log::warn!(
            "redis: {n} publishes (events or replies) dropped since the last such line: {} \
             messages, {} bytes are waiting to be sent (bounds {MAX_OUTGOING}, \
             {MAX_OUTGOING_BYTES}; events {EVENT_SHARE_BYTES})",
            self.outgoing.len(),
            self.outgoing_bytes
        );
    }

    /// Forgets queued and not yet sent.
    #[cfg(test)]
    pub(crate) fn queued_forgets(&self) -> usize {
        self.forgets.len()
    }

    /// Checked forgets queued and not yet sent.
    #[cfg(test)]
    pub(crate) fn queued_checked_forgets(&self) -> &[CheckedForget] {
        &self.checked_forgets
    }

    /// Publishes queued and not yet sent, oldest first.
    #[cfg(test)]
    pub(crate) fn queued_publishes(&self) -> &[(String, Box<[u8]>)] {
        &self.outgoing
    }

    /// Sends queued releases and publishes, and the forgets (all of them when `now` is None),
    /// each batch in one round trip, publishes in batches of [`FLUSH_BYTES`] or
    /// [`FLUSH_COUNT`], each one transaction (`once.rs`): a batch whose answer is lost goes
    /// again only if it did not run.
    ///
    /// The queued forgets of up to [`FORGET_RIDE_MAX`] sessions lead the first pipeline of
    /// publishes: an ack's removal reaches Redis in the round trip that publishes its `ack`
    /// event, ahead of it (the core queues the removal first). Held back for their own pace, a
    /// broker killed within that second left the acked command in its session: the rig's next
    /// boot reported it `rig_rebooted`, and a resume with a lower `last_seq` replayed it, after
    /// control had seen it acked. Forgets of more sessions than that (a fan-out's acks), or
    /// with no publishes to ride with, go at their own pace: there that window remains.
    pub(crate) fn flush(&mut self, now: Option<Instant>) {
        let ride = !self.outgoing.is_empty()
            && self.forgets.len() <= FORGET_RIDE_FIELDS
            && sessions_up_to(&self.forgets, FORGET_RIDE_MAX + 1) <= FORGET_RIDE_MAX;
        let forgets_due = !ride
            && match now {
                Some(now) => self.forget_due().is_some_and(|due| due <= now),
                None => true,
            };
        if self.con.is_none() {
            return;
        }
        // What a session remembers goes before its lease: a rig that reconnects the moment
        // its close handshake ends (after a drain's goaway) is read by the next broker about a
        // round trip after the release, and written after, the note came too late for it
        // (review bb152: results with `id` null).
        if !self.recalls.is_empty() {
            let Some(con) = self.con.as_mut() else { return };
            // Not sent again: a resume without it still has every command, only results
            // without their ids and a null `last_ack_at`.
            let recalls = std::mem::take(&mut self.recalls);
            let written = sessions::remember(con, &recalls, self.session_ttl);
            self.noted.append(&mut self.noting);
            if let Err(e) = written {
                self.call_failed(&e);
                return;
            }
        }
        if !self.releases.is_empty() {
            let releases = std::mem::take(&mut self.releases);
            if !self.send_releases(releases) {
                return;
            }
        }
        if !self.send_checked_forgets() {
            return;
        }
        if forgets_due && !self.send_forgets() {
            return;
        }
        // A queue held through an outage goes out over a few passes, not in one long stall of
        // the bridge; all of it at the end of a drain.
        let mut pipelines = if now.is_some() {
            FLUSH_PIPELINES
        } else {
            usize::MAX
        };
        if !self.settle_doubt() {
            return;
        }
        while !self.outgoing.is_empty() && pipelines > 0 {
            pipelines -= 1;
            let Some(con) = self.con.as_mut() else { return };
            let mut pipe = redis::pipe();
            let forgets = if ride { self.forgets.len() } else { 0 };
            hdel_by_session(&mut pipe, &self.forgets[..forgets]);
            let hdels = pipe.len();
            let (mut n, mut bytes) = (0, 0);
            for (channel, payload) in &self.outgoing {
                let size = channel.len() + payload.len();
                if n > 0 && (bytes + size > FLUSH_BYTES || n == FLUSH_COUNT) {
                    break;
                }
                n += 1;
                bytes += size;
            }
            let now = Instant::now();
            let batch = self.once.add_batch(
                &mut pipe,
                self.outgoing[..n]
                    .iter()
                    .map(|(channel, payload)| (channel.as_str(), &payload[..])),
                now,
            );
            let count = hdels + batch.replies();
            let replies = con.req_packed_commands(&pipe.get_packed_pipeline(), 0, count);
            let replies = match replies {
                Ok(replies) => replies,
                Err(e) => {
                    // No answer: the batch may have run, or may yet, in a Redis that hangs
                    // with it in its buffer. The next connection asks before sending it again.
                    self.once.in_doubt(batch);
                    return self.call_failed(&e);
                }
            };
            let (removals, answer) = replies.split_at(hdels.min(replies.len()));
            // A removal Redis refused (an ACL without HDEL, a key of another type) leaves its
            // command in the session until it expires; the publishes are told apart below.
            if let Some(Value::ServerError(e)) =
                removals.iter().find(|r| matches!(r, Value::ServerError(_)))
            {
                self.note_refusal(&redis::RedisError::from(e.clone()));
            }
            self.forgets.drain(..forgets);
            if self.forgets.is_empty() {
                self.forgets_since = None;
            }
            let Answer { fates, then } = self.once.answer(batch, answer, now);
            let (ran, refused) = self.take_publishes(n, &fates);
            self.published += ran;
            if refused > 0 {
                self.dropped += refused;
                self.log_refused_publishes(refused, n, "were refused or failed as they ran");
            }
            match then {
                Then::Next => {}
                // Redis is full, busy or loading: what did not run goes in a later pass.
                Then::Wait(e) => return self.call_failed(&e),
                Then::Doubt(why) => {
                    self.once.in_doubt(batch);
                    let e = redis::RedisError::from((
                        redis::ErrorKind::IoError,
                        "a batch of publishes got an answer no batch gets",
                        why,
                    ));
                    return self.call_failed(&e);
                }
            }
        }
    }

    /// Takes out of the queue the first `n` publishes' that ran or were refused for good (by
    /// `fates`, in order; one without a fate stays), and returns how many of each.
    fn take_publishes(&mut self, n: usize, fates: &[Fate]) -> (u64, u64) {
        let (mut ran, mut refused, mut bytes, mut events) = (0, 0, 0, 0);
        let mut i = 0;
        self.outgoing.retain(|(channel, payload)| {
            let fate = if i < n {
                fates.get(i).copied().unwrap_or(Fate::Again)
            } else {
                Fate::Again
            };
            i += 1;
            match fate {
                Fate::Again => return true,
                Fate::Ran => ran += 1,
                Fate::Refused => refused += 1,
            }
            bytes += channel.len() + payload.len();
            events += usize::from(channel == EVENTS);
            false
        });
        self.outgoing_bytes -= bytes;
        self.outgoing_events -= events;
        (ran, refused)
    }

    /// Logs publishes Redis refused, at most a line a second: a refusal that lasts (an ACL)
    /// meets every batch.
    fn log_refused_publishes(&mut self, refused: u64, n: usize, how: &str) {
        if let Some(more) = self.refused_log.note(Instant::now()) {
            log::warn!(
                "redis: {refused} of a batch of {n} publishes {how} (an ACL that does not let \
                 this user publish to a reply_to channel?); they are dropped and counted \
                 ({more} such batches, this one included, since the last line)"
            );
        }
    }

    /// Settles the batch of publishes whose answer a lost connection took, before anything
    /// else is published: if it ran, its publishes leave the queue; if not, the question has
    /// fenced it from running later, and they go again with the next batch. False when the
    /// question failed too (the batch stays in doubt for the next connection).
    fn settle_doubt(&mut self) -> bool {
        let Some(doubt) = self.once.doubt.clone() else {
            return true;
        };
        let Some(con) = self.con.as_mut() else {
            return false;
        };
        match self.once.ran(con, &doubt) {
            Ok(true) => {
                let (ran, _) =
                    self.take_publishes(doubt.publishes, &vec![Fate::Ran; doubt.publishes]);
                self.published += ran;
                self.unanswered_ran += ran;
            }
            Ok(false) => self.unanswered_resent += doubt.publishes as u64,
            Err(e) => {
                self.call_failed(&e);
                return false;
            }
        }
        self.once.doubt = None;
        true
    }
}

/// How many distinct sessions `forgets` name, counting no further than `limit`.
fn sessions_up_to(forgets: &[(RigId, BootId, Seq)], limit: usize) -> usize {
    let mut seen: Vec<(&RigId, &BootId)> = Vec::new();
    for (rig, boot, _) in forgets {
        if !seen.contains(&(rig, boot)) {
            seen.push((rig, boot));
            if seen.len() >= limit {
                break;
            }
        }
    }
    seen.len()
}

/// One HDEL per session for `forgets`, naming all its acked commands, in the order the
/// sessions first appear: a rig's burst of acks costs Redis one command, not one each.
fn hdel_by_session(pipe: &mut redis::Pipeline, forgets: &[(RigId, BootId, Seq)]) {
    let mut fields: Vec<((&RigId, &BootId), Vec<String>)> = Vec::new();
    let mut at: std::collections::HashMap<(&RigId, &BootId), usize> =
        std::collections::HashMap::new();
    for (rig, boot, seq) in forgets {
        let i = *at.entry((rig, boot)).or_insert_with(|| {
            fields.push(((rig, boot), Vec::new()));
            fields.len() - 1
        });
        if let Some((_, f)) = fields.get_mut(i) {
            f.push(format!("c:{}", seq.0));
        }
    }
    for ((rig, boot), f) in fields {
        pipe.hdel(sessions::session_key(rig, boot), f).ignore();
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::registry::fleet::tests::fleet;

    fn rig() -> (RigId, BootId) {
        let rig = RigId::parse("rig-1").expect("rig");
        let boot = BootId::parse("0190f5c2-0000-7000-8000-000000000001").expect("boot");
        (rig, boot)
    }

    #[test]
    fn forgets_wait_for_the_pace_and_are_not_counted_as_writes() {
        let mut f = fleet();
        assert_eq!(f.forget_due(), None);
        let before = Instant::now();
        let (rig, boot) = rig();
        assert!(f.forget(rig.clone(), boot, Seq(1)));
        assert!(f.forget(rig, boot, Seq(2)));
        let due = f.forget_due().expect("due");
        assert!(due >= before + FORGET_PACE, "not before the pace");
        assert!(
            due <= Instant::now() + FORGET_PACE,
            "paced from the first forget"
        );
        assert_eq!(f.queued(), 0, "forgets do not make a write due");
    }

    /// A release queued for the very lease a hello batch is about to claim again is dropped:
    /// sent after the claim, its compare-and-delete would find the same tuple and delete it.
    /// Releases of other rigs, or of another boot of the same rig, stay.
    #[test]
    fn a_release_of_a_lease_being_claimed_again_is_dropped() {
        let mut f = fleet();
        let (rig, boot) = rig();
        let other = RigId::parse("rig-2").expect("rig");
        let older = BootId::parse("0190f5c2-0000-7000-8000-000000000000").expect("boot");
        assert!(f.release(rig.clone(), boot));
        assert!(f.release(rig.clone(), older));
        assert!(f.release(other.clone(), boot));
        f.settle_before_hellos(&[(&rig, &boot)]);
        assert_eq!(f.releases, vec![(rig, older), (other, boot)]);
    }

    #[test]
    fn a_full_batch_of_forgets_is_due_at_once() {
        let mut f = fleet();
        let (rig, boot) = rig();
        for seq in 1..=FORGET_BATCH as u64 {
            f.forget(rig.clone(), boot, Seq(seq));
        }
        let due = f.forget_due().expect("due");
        assert!(
            due <= Instant::now(),
            "a full batch goes out with the next flush"
        );
    }

    #[test]
    fn forgets_and_releases_past_the_bound_are_refused_not_queued() {
        let mut f = fleet();
        let (rig, boot) = rig();
        for seq in 0..MAX_OUTGOING as u64 {
            assert!(f.forget(rig.clone(), boot, Seq(seq)));
            assert!(f.release(rig.clone(), boot));
        }
        assert!(!f.forget(rig.clone(), boot, Seq(u64::MAX)), "full: refused");
        assert!(!f.release(rig, boot), "full: refused");
        assert_eq!(f.forgets.len(), MAX_OUTGOING);
        assert_eq!(f.releases.len(), MAX_OUTGOING);
    }

    #[test]
    fn publishes_are_bounded_by_bytes_and_events_leave_room_for_replies() {
        let mut f = fleet();
        let mib = vec![0u8; 1 << 20];
        while f.dropped == 0 {
            f.publish(EVENTS.to_string(), mib.clone());
        }
        let event = EVENTS.len() + mib.len();
        assert!(f.outgoing_bytes <= EVENT_SHARE_BYTES);
        assert!(f.outgoing_bytes + event > EVENT_SHARE_BYTES);
        f.publish("reply".into(), b"{}".to_vec());
        assert_eq!(f.dropped, 1, "a reply still has room");
        while f.dropped == 1 {
            f.publish("reply".into(), mib.clone());
        }
        assert!(f.outgoing_bytes <= MAX_OUTGOING_BYTES);
        assert!(f.outgoing_bytes + mib.len() > MAX_OUTGOING_BYTES);
    }

    #[test]
    fn small_events_leave_room_for_replies_by_count_too() {
        let mut f = fleet();
        let ack = br#"{"type":"ack","rig_id":"r","seq":1}"#.to_vec();
        while f.dropped == 0 {
            f.publish(EVENTS.to_string(), ack.clone());
        }
        assert_eq!(f.outgoing.len(), EVENT_SHARE_COUNT);
        assert!(f.outgoing_bytes < EVENT_SHARE_BYTES, "stopped by count");
        for _ in 0..MAX_OUTGOING - EVENT_SHARE_COUNT {
            f.publish("reply".into(), b"{}".to_vec());
        }
        assert_eq!(f.dropped, 1, "every reply up to the whole bound has room");
        assert_eq!(f.outgoing.len(), MAX_OUTGOING);
    }
}
