//! Hellos, answered in batches: one pipelined lease claim for every hello read from the
//! inbox, one more round trip for the accepted rigs' sessions and held commands.

use std::collections::HashSet;
use std::time::Instant;

use serde_json::Value;

use super::Bridge;
use crate::ids::{BootId, ConnId, RigId, Seq};
use crate::registry::embedded::Action;
use crate::registry::fleet;
use crate::registry::msg::{SeqCommand, ToCore, Verdict};
use crate::registry::scripts::HelloOutcome;
use crate::registry::sessions::Resumed;
use crate::registry::sessions::Unkept;
use crate::worker::queues::RIG_SESSION_BYTES;

/// A hello waiting for its batch's round trip.
pub(super) struct PendingHello {
    conn: ConnId,
    rig: RigId,
    boot: BootId,
    labels: Vec<(String, String)>,
}

/// A hello the registry has answered, waiting for its session and held commands if accepted.
pub(super) struct Decided {
    conn: ConnId,
    rig: RigId,
    boot: BootId,
    actions: Vec<Action>,
    accepted: bool,
    /// Waits for a same-boot hand-over from this rig's connection before it.
    handover: bool,
    /// Redis took this hello's lease (`hello.lua` answered): its session is read there. A
    /// hello Redis could not take (away, or refusing the call: OOM, an ACL) is decided here
    /// alone, as during an outage.
    leased: bool,
}

impl Bridge {
    /// Queues a hello for the next [`Self::flush_hellos`].
    pub(super) fn queue_hello(
        &mut self,
        conn: ConnId,
        rig: RigId,
        boot: BootId,
        labels: Vec<(String, String)>,
    ) {
        self.hellos.push(PendingHello {
            conn,
            rig,
            boot,
            labels,
        });
    }

    /// Answers the hellos read from the inbox, all at once: in fleet mode one round trip
    /// claims every rig's lease (`hello.lua`, pipelined) and, for those accepted, one more
    /// reads their sessions and takes what was held for them offline. A storm of 10,000
    /// hellos costs a few round trips per inbox batch instead of three per rig.
    pub(super) fn flush_hellos(&mut self) {
        if self.hellos.is_empty() {
            return;
        }
        // A hello must find in Redis what was held for its rig before it.
        self.flush_holds();
        let hellos = std::mem::take(&mut self.hellos);
        self.rekeep_parked_of(hellos.iter().map(|h| &h.rig));
        let ttl = self.cfg.registry_ttl;
        if self.fleet.is_some() {
            // The verdicts already decided must not wait on these hellos' round trips.
            self.ring_owed();
        }
        // A hello this broker already knows to be older than the rig's live session is
        // refused here, writing nothing (CONTRACT.md §3), even if the lease itself is gone.
        let older: Vec<bool> = hellos
            .iter()
            .map(|h| self.registry.holds_newer(&h.rig, h.boot))
            .collect();
        let outcomes = self.fleet.as_mut().map(|f| {
            let entries: Vec<(&RigId, &BootId)> = hellos
                .iter()
                .zip(&older)
                .filter(|(_, older)| !**older)
                .map(|(h, _)| (&h.rig, &h.boot))
                .collect();
            f.settle_before_hellos(&entries);
            if entries.is_empty() {
                return Some(Vec::new());
            }
            f.hello_many(&entries, ttl)
        });
        if matches!(&outcomes, Some(Some(o)) if !o.is_empty()) {
            self.shared.count("hello_batch", "sent");
        }
        let mut outcomes = outcomes.map(|o| o.map(Vec::into_iter));
        let mut decided = Vec::with_capacity(hellos.len());
        for (h, older) in hellos.into_iter().zip(older) {
            let mut leased = false;
            // What the copy parked here for this very boot was given while Redis refused
            // writes: the hello may resume it, and its connection then holds those commands.
            let parked_unkept = self.registry.parked_unkept_of(&h.rig, h.boot);
            let actions = if older {
                self.shared.count("hello", "older");
                self.registry.hello(h.conn, h.rig.clone(), h.boot, h.labels)
            } else {
                let outcome = match outcomes.as_mut() {
                    None => None,
                    Some(None) => Some(None),
                    Some(Some(each)) => Some(each.next()),
                };
                leased = matches!(outcome, Some(Some(Ok(HelloOutcome::Owned { .. }))));
                self.decide_hello(h.conn, h.rig.clone(), h.boot, h.labels, outcome)
            };
            let accepted = accepts(&actions, h.conn);
            if accepted && !parked_unkept.is_none() {
                // Else the session lost the knowledge as its copy was resumed, and the next
                // copy parked, or put back, took those commands for ones Redis kept (review
                // bb122: a second hello while Redis was full, and the command was dropped as
                // settled, unreported).
                let high = self.unkept_high.entry((h.rig.clone(), h.boot)).or_default();
                *high = high.union(parked_unkept);
            }
            let handover = !accepted && self.registry.awaits_handover(&h.rig, h.conn);
            decided.push(Decided {
                conn: h.conn,
                rig: h.rig,
                boot: h.boot,
                actions,
                accepted,
                handover,
                leased,
            });
        }
        // A hand-over's session is read too, and merged when the hand-over completes: the
        // connection before it may hold a session another broker has added to since (the rig
        // moved there and back while that connection stayed half-open here).
        let accepted: Vec<(&RigId, &BootId)> = decided
            .iter()
            .filter(|d| d.leased && (d.accepted || d.handover))
            .map(|d| (&d.rig, &d.boot))
            .collect();
        let session_ttl = self.cfg.session_ttl;
        let take = self.hold_take();
        let found = match self.fleet.as_mut() {
            Some(f) if !accepted.is_empty() => f.resume_many(&accepted, session_ttl, take),
            _ => None,
        };
        // Redis took the leases but then failed to say what their sessions hold: accepted
        // with local state only, a resumed rig could be given seqs Redis already keeps
        // commands under, and overwrite them. They are turned away (4503) to come back.
        let unread = found.is_none() && !accepted.is_empty();
        let (mut sessions, mut held) = match found {
            Some((s, h)) => (s.into_iter(), h.into_iter()),
            None => (Vec::new().into_iter(), Vec::new().into_iter()),
        };
        for d in decided {
            let mut actions = d.actions;
            if d.handover && d.leased {
                self.shared.count("hello", "ok");
                let entry = sessions.next();
                let taken = held.next().unwrap_or_default();
                match entry {
                    Some(Some(found)) => {
                        self.handover_resumes.insert(d.conn, (found, taken));
                    }
                    // Unread: the hand-over goes on with what this broker holds, as when Redis
                    // is away.
                    _ => self.hold_again(&d.rig, taken),
                }
                self.carry_out(actions);
                continue;
            }
            let read = d.accepted && d.leased;
            let entry = if read { sessions.next() } else { None };
            // `unread` for this one rig: Redis answered the batch but failed its own entry
            // (BUSY, READONLY, a reply of the wrong shape).
            let entry_failed = matches!(entry, Some(None));
            if read && (unread || entry_failed) {
                self.turn_away(d.conn, &d.rig, d.boot, &mut actions);
                self.carry_out(actions);
                // Taken from Redis for this hello: held again for the rig's return.
                let taken = held.next().unwrap_or_default();
                self.hold_again(&d.rig, taken);
                continue;
            }
            if d.leased {
                self.shared.count("hello", "ok");
            }
            if d.accepted {
                if let Some(Some(found)) = entry {
                    actions = self.resume(d.conn, &d.rig, &d.boot, found, actions, false);
                }
                let from_redis = if read {
                    held.next().unwrap_or_default()
                } else {
                    Vec::new()
                };
                self.deliver_held(d.conn, &d.rig, from_redis, &mut actions);
            }
            self.carry_out(actions);
        }
    }

    /// Merges what Redis held into the acceptance a completed hand-over produced (`actions`,
    /// from the old connection's `Closed`), for the connection that waited, as `resume` does
    /// for an accepted hello: the higher next seq, every unacked command of both, and the
    /// commands held for the rig while offline.
    pub(super) fn merge_handover(
        &mut self,
        rig: &RigId,
        boot: BootId,
        mut actions: Vec<Action>,
    ) -> Vec<Action> {
        let waited: Vec<ConnId> = actions
            .iter()
            .filter_map(|a| match a {
                Action::Core(
                    c,
                    ToCore::Verdict {
                        verdict: Verdict::Accept { .. },
                        ..
                    },
                ) => Some(*c),
                _ => None,
            })
            .collect();
        for conn in waited {
            if let Some((found, held)) = self.handover_resumes.remove(&conn) {
                actions = self.resume(conn, rig, &boot, found, actions, true);
                self.deliver_held(conn, rig, held, &mut actions);
            }
        }
        actions
    }

    /// `conn` went before its hand-over completed: what Redis held for it is not merged
    /// anywhere, and the commands taken for the rig are held again.
    pub(super) fn drop_handover_resume(&mut self, conn: ConnId, rig: &RigId) {
        if let Some((_, held)) = self.handover_resumes.remove(&conn) {
            self.hold_again(rig, held);
        }
    }

    /// Replaces `conn`'s acceptance with 4503: the session it carried goes back to the
    /// registry (parked for the rig's next hello), and the lease just claimed is released. A
    /// connection of the same boot that said hello right after, and waits for this one's
    /// session, is turned away too: it would get the session with local state only.
    fn turn_away(&mut self, conn: ConnId, rig: &RigId, boot: BootId, actions: &mut Vec<Action>) {
        self.shared.count("hello", "unavailable");
        let (answers, waiting) = self.registry.stop_waiting_for(conn, rig);
        actions.extend(answers);
        actions.extend(waiting.map(crate::registry::embedded::turned_away));
        let mut back = Vec::new();
        for action in actions.iter_mut() {
            let Action::Core(c, ToCore::Verdict { verdict, .. }) = action else {
                continue;
            };
            if *c != conn {
                continue;
            }
            if let Verdict::Accept {
                next_seq,
                carried,
                recall,
                ..
            } = std::mem::replace(verdict, Verdict::Busy)
            {
                back.push((next_seq, carried, recall));
            }
        }
        for (next_seq, carried, recall) in back {
            let more = self.take_back(conn, Some((rig.clone(), boot)), next_seq, carried, recall);
            actions.extend(more);
        }
    }

    /// One hello's verdict, given what `hello.lua` said (None: standalone; Some(None): Redis
    /// unavailable, so the local registry decides alone until the next refresh).
    fn decide_hello(
        &mut self,
        conn: ConnId,
        rig: RigId,
        boot: BootId,
        labels: Vec<(String, String)>,
        outcome: Option<Option<Result<HelloOutcome, String>>>,
    ) -> Vec<Action> {
        // Redis did not answer: what it holds for the rig was not taken either.
        let unread = matches!(outcome, Some(None) | Some(Some(Err(_))));
        let alone = match outcome {
            None => {
                self.shared.count("hello", "ok");
                self.report_parked_reboot(&rig, boot);
                false
            }
            Some(None) | Some(Some(Err(_))) => {
                self.shared.count("hello", "unavailable");
                // Away: Redis may have had that session reported already, by a boot in between
                // on another broker; it decides what is left to report once it is back. So
                // too when it is full: it takes writes again in time. Refusing the call for
                // good (an ACL), it would never say, so the report goes from here. Reported
                // from here while Redis was full, it repeated another broker's (review bb122).
                match &outcome {
                    Some(None) => self.defer_parked_reboot(&rig, boot),
                    Some(Some(Err(e))) if fleet::refused_for_memory(e) => {
                        self.defer_parked_reboot(&rig, boot)
                    }
                    _ => self.report_parked_reboot(&rig, boot),
                }
                // What only Redis knows (the older boot's session there, or a boot in between
                // on another broker) is reported once it is back (`Bridge::decided_alone`), if
                // the hello is taken.
                !self.cfg.session_ttl.is_zero()
            }
            Some(Some(Ok(HelloOutcome::Older { .. }))) => {
                self.shared.count("hello", "older");
                return vec![Action::Core(
                    conn,
                    ToCore::Verdict {
                        conn,
                        verdict: Verdict::Older,
                    },
                )];
            }
            Some(Some(Ok(HelloOutcome::Owned { previous }))) => {
                // Counted `ok` once its session is read, or `unavailable` if it is turned away.
                if let Some(prev) = previous {
                    self.evict(&rig, boot, &prev);
                }
                false
            }
        };
        let rig_of_alone = alone.then(|| rig.clone());
        let unread = unread.then(|| rig.clone());
        let actions = self.registry.hello(conn, rig, boot, labels);
        if accepts(&actions, conn) {
            if let Some(rig) = rig_of_alone {
                self.decided_alone.insert((rig, boot));
            }
            if let Some(rig) = unread {
                self.held_unread.insert(rig);
            }
        }
        actions
    }

    /// This broker decides another boot's hello without Redis (standalone, or Redis refused the
    /// call, or no room to wait for it: see [`Self::defer_parked_reboot`]), and the session it
    /// keeps parked for the rig's older boot ends with it: that session's unacked commands are
    /// reported `rig_rebooted` from here (CONTRACT.md §5), as `resume.lua` would have done, and
    /// their copies in Redis are forgotten, so that a later hello does not report them again.
    /// Before, they went unreported: dropped with the parked session.
    fn report_parked_reboot(&mut self, rig: &RigId, boot: BootId) {
        let Some((old, _, carried)) = self.registry.parked(rig) else {
            return;
        };
        // Any other boot's hello ends it, an older one's too (a stale process, or a rig whose
        // clock went back, welcomed once the newer one left): as `resume.lua` ends the rig's
        // latest session whichever boot is newer. Dropped, its commands went unreported.
        if old == boot {
            return;
        }
        let lost: Vec<(Seq, Box<str>)> = carried.iter().map(|c| (c.seq, c.id.clone())).collect();
        self.report_reboot(rig, old, boot, lost);
    }

    /// Redis is away, and a new boot's hello, decided here alone, ends the session parked here
    /// for the rig's older boot. Reported from here, it may repeat what Redis has reported
    /// already: a boot in between may have said hello to another broker, whose `resume.lua`
    /// reported that session and left its tombstone. So the report waits for Redis
    /// (`rekeep.lua`, mode `ended`), which publishes what no report has covered: all of it,
    /// or only what was delivered unkept while Redis was away. Reported from here at once
    /// when there is no room to wait.
    fn defer_parked_reboot(&mut self, rig: &RigId, boot: BootId) {
        if self.cfg.session_ttl.is_zero() {
            return self.report_parked_reboot(rig, boot);
        }
        let unkept = self.registry.parked_unkept(rig);
        let Some((old, next, carried)) = self.registry.parked(rig) else {
            return;
        };
        // Any other boot's hello ends it, an older one's too (a stale process, or a rig whose
        // clock went back, welcomed once the newer one left): as `resume.lua` ends the rig's
        // latest session whichever boot is newer. Dropped, its commands went unreported.
        if old == boot {
            return;
        }
        let req = crate::registry::msg::RekeepReq::of(rig, old, next, carried, unkept);
        if !self.ended_alone.push(req, boot) {
            self.report_parked_reboot(rig, boot);
        }
    }

    /// A live session of `r.old`, its next seq `next`, that the newer boot `r.new` took over
    /// (see `ToBridge::Closed`); Redis may never have kept its commands `unkept`.
    pub(super) fn report_taken_over(
        &mut self,
        r: crate::registry::embedded::Rebooted,
        next: Seq,
        unkept: Unkept,
    ) {
        if self.fleet.is_some() && !self.cfg.session_ttl.is_zero() {
            let req = crate::registry::msg::RekeepReq::of(&r.rig, r.old, next, &r.carried, unkept);
            if self.ended_alone.push(req, r.new) {
                return;
            }
        }
        let lost = r.carried.into_iter().map(|c| (c.seq, c.id)).collect();
        self.report_reboot(&r.rig, r.old, r.new, lost);
    }

    /// Reports the unacked commands of `rig`'s session of boot `old`, which boot `boot` ended:
    /// counted, published as `rig_rebooted` events (standalone: kept for `GET /v1/events`, and
    /// logged with their ids).
    pub(super) fn report_reboot(
        &mut self,
        rig: &RigId,
        old: BootId,
        boot: BootId,
        lost: Vec<(Seq, Box<str>)>,
    ) {
        self.shared.count_n("resume", "rebooted", lost.len() as u64);
        if self.fleet.is_none() && !lost.is_empty() {
            let what = format!(
                "rig {rig} rebooted (boot {boot}, was {old}): {} unacked commands of its old session are dropped, not replayed to the new boot (rig_rebooted; those written to the old boot may have run)",
                lost.len()
            );
            log_ids(&what, lost.iter().map(|(_, id)| &**id));
        }
        for (seq, id) in lost {
            let ev = crate::events::rig_rebooted(&self.cfg.broker_id, rig, &old, &boot, seq, &id);
            self.publish(fleet::EVENTS.to_string(), &ev);
            if let Some(f) = self.fleet.as_mut() {
                // Full: the copy stays, and a later hello may report it a second time.
                let _ = f.forget(rig.clone(), old, seq);
            }
        }
    }

    /// Sessions kept for their rigs' return whose window ran out with commands never acked.
    /// Standalone holds the only copy: each command is counted (`parked/expired`), published
    /// as an `expired` event and its id logged, as a reboot's are, rather than vanish after
    /// control was told `ok`. Fleet mode keeps the session in Redis, where a resume still
    /// finds it: the copy here goes quietly.
    pub(super) fn report_lapsed(&mut self, lapsed: Vec<(RigId, BootId, Vec<SeqCommand>)>) {
        if self.fleet.is_some() {
            return;
        }
        for (rig, boot, cmds) in lapsed {
            self.shared.count_n("parked", "expired", cmds.len() as u64);
            let what = format!(
                "rig {rig} (boot {boot}) stayed away past --session-ttl: {} unacked commands of its session are dropped (expired; it may have run those written to it)",
                cmds.len()
            );
            log_ids(&what, cmds.iter().map(|c| &*c.id));
            for c in cmds {
                let ev =
                    crate::events::session_expired(&self.cfg.broker_id, &rig, &boot, c.seq, &c.id);
                self.publish(fleet::EVENTS.to_string(), &ev);
            }
        }
    }

    /// Fleet mode: what Redis holds of this session, merged into the local verdict (the
    /// previous boot's unacked commands were reported `rig_rebooted` by the script).
    fn resume(
        &mut self,
        conn: ConnId,
        rig: &RigId,
        boot: &BootId,
        found: Resumed,
        mut actions: Vec<Action>,
        handed_over: bool,
    ) -> Vec<Action> {
        // `resume.lua` itself published the previous boot's rig_rebooted reports.
        self.shared.count_n("resume", "rebooted", found.rebooted);
        let Some(next) = found.next else {
            // Redis has no session of this boot (it lapsed there, or was lost) while the
            // verdict numbers on from a copy parked here: Redis must learn that copy's `next`,
            // or the rig's next broker would number from 1 again, under seqs the rig has.
            let numbered = actions.iter().any(|a| {
                matches!(a, Action::Core(c, ToCore::Verdict {
                    verdict: Verdict::Accept { next_seq, .. }, ..
                }) if *c == conn && next_seq.0 > 1)
            });
            if numbered && !self.cfg.session_ttl.is_zero() {
                self.rekeep_asked.insert((rig.clone(), *boot));
                actions.push(Action::Core(conn, ToCore::Rekeep { conn }));
            }
            return actions;
        };
        let mut stale = Vec::new();
        let mut holds_commands = false;
        // The seqs of this session given while Redis refused writes, and not put back since
        // (the parked copy's, carried over at the hello).
        let unkept = self
            .unkept_high
            .get(&(rig.clone(), *boot))
            .copied()
            .unwrap_or(Unkept::NONE);
        let mut lost = Vec::new();
        for action in &mut actions {
            if let Action::Core(
                c,
                ToCore::Verdict {
                    verdict:
                        Verdict::Accept {
                            next_seq,
                            resumed,
                            carried,
                            recall,
                        },
                    ..
                },
            ) = action
            {
                if *c != conn {
                    continue;
                }
                *next_seq = (*next_seq).max(next);
                *resumed = true;
                // A hand-over's copy is the old connection's, live until it handed the
                // session over, so newer than what the hello read: a command Redis held that
                // the old connection acked (its removal from Redis still on its way when the
                // hello read the session) is not taken back. Given back, the rig acked it
                // again and the ack was published twice (review bb101). Only the very
                // command acked there (seq and id, among those awaiting their results): one
                // the copy lacks for another reason (another broker numbered that seq while
                // this one was cut off, and this one's own was fenced) still goes to the rig
                // (review bb104).
                let acked_there: HashSet<(Seq, Box<str>)> = match (handed_over, recall.as_deref()) {
                    (true, Some(r)) => r.results.iter().cloned().collect(),
                    _ => HashSet::new(),
                };
                // What this broker holds of the session is the newer, when it holds any.
                if recall.is_none() {
                    *recall = found.recall.clone().map(Box::new);
                }
                // Except a command Redis kept once (its seq is below Redis's `next`) and no
                // longer holds: it was acked, on another connection since this copy was
                // taken (a session parked here while the rig resumed and acked elsewhere).
                // A local one at or above `next` was delivered while Redis was away, never
                // kept, and stays.
                // One given while Redis refused writes never reached it, so its absence says
                // nothing of an ack: another broker numbered past its seq meanwhile, most
                // likely giving the rig another command under it. Published `lost`, where it
                // was dropped with no report (review bb120).
                let in_redis: HashSet<Seq> = found.commands.iter().map(|(seq, _)| *seq).collect();
                carried.retain(|c| {
                    let stays = c.seq >= next || in_redis.contains(&c.seq);
                    if !stays && unkept.holds(c.seq) {
                        lost.push((c.seq, c.id.clone()));
                    }
                    stays
                });
                let local: HashSet<Seq> = carried.iter().map(|c| c.seq).collect();
                for (seq, json) in &found.commands {
                    if !acked_there.is_empty() && acked_there.contains(&(*seq, command_id(json))) {
                        continue;
                    }
                    if !local.contains(seq) {
                        carried.push(SeqCommand {
                            seq: *seq,
                            id: command_id(json),
                            json: json.clone().into_boxed_slice(),
                            queued_at: Instant::now(),
                            written_at: None,
                            held: false,
                            unkept: false,
                            read_back: true,
                            written_on: None,
                        });
                    }
                }
                carried.sort_by_key(|c| c.seq);
                // A session never holds more than this, in count or bytes; older entries in
                // Redis are ones whose removal was lost (acked, or already dropped from resume
                // memory and counted).
                let mut excess = carried.len().saturating_sub(self.cfg.session_limit());
                let mut bytes: usize = carried.iter().skip(excess).map(|c| c.json.len()).sum();
                for c in carried.iter().skip(excess) {
                    if bytes <= RIG_SESSION_BYTES {
                        break;
                    }
                    bytes -= c.json.len();
                    excess += 1;
                }
                stale.extend(carried.drain(..excess).map(|c| c.seq));
                holds_commands = !carried.is_empty();
            }
        }
        for (seq, id) in lost {
            self.shared.count("resume", "lost");
            let ev = crate::events::lost_to_a_shared_seq(
                &self.cfg.broker_id,
                rig,
                boot,
                seq,
                &id,
                crate::events::SharedSeq::GivenSince,
            );
            self.publish_bytes(fleet::EVENTS.to_string(), ev);
        }
        if holds_commands {
            // Resumed here with commands unacked: named for their lapse report, should this
            // broker die with the rig on it, as after a first command kept here. The broker it
            // came from may not have named it (it took the rig over within the second).
            self.registry.set_lapse_named(rig, *boot, self.lapse_count);
            self.name_held_lapse(rig.clone(), *boot);
        }
        for seq in stale {
            self.shared.count("resume", "stale_dropped");
            if let Some(f) = self.fleet.as_mut() {
                if !f.forget(rig.clone(), *boot, seq) {
                    self.shared.count("forget", "dropped");
                }
            }
        }
        actions
    }
}

/// Whether `actions` welcome `conn`.
fn accepts(actions: &[Action], conn: ConnId) -> bool {
    actions.iter().any(|a| {
        matches!(a, Action::Core(c, ToCore::Verdict { verdict: Verdict::Accept { .. }, .. }) if *c == conn)
    })
}

/// The `id` inside an encoded command (for replayed commands' bookkeeping).
pub(super) fn command_id(json: &[u8]) -> Box<str> {
    serde_json::from_slice::<Value>(json)
        .ok()
        .and_then(|v| v["id"].as_str().map(Into::into))
        .unwrap_or_default()
}

/// Logs `what` with every id of `ids`, 20 to a line (each clipped to `LOG_CHARS`: control's ids
/// are whatever it sent, and one log line must stay a line): standalone has no events channel,
/// and `GET /v1/events` keeps only the latest events, so the log is where control finds them.
/// A session holds at most `Config::session_limit` commands, which bounds the lines.
fn log_ids<'a>(what: &str, ids: impl Iterator<Item = &'a str>) {
    let ids: Vec<String> = ids
        .map(|id| crate::log_text::clip(id, crate::log_text::LOG_CHARS).into_owned())
        .collect();
    let lines = ids.len().div_ceil(20);
    for (i, chunk) in ids.chunks(20).enumerate() {
        log::warn!("{what}; ids ({}/{lines}): {}", i + 1, chunk.join(", "));
    }
}

#[cfg(test)]
mod tests {
    use std::sync::atomic::Ordering;

    use super::*;
    use crate::ids::CoreId;
    use crate::registry::bridge::testing::{bridge, closed};
    use crate::registry::bridge::REGISTRY_OPS;

    /// Redis may hold more of a session than any connection did (removals of acked commands
    /// that were lost): a resume carries no more than one session can hold, the newest.
    /// Resumes a session Redis found with `commands` (seq, bytes); the seqs carried, and how
    /// many were counted stale.
    fn resume_found(commands: Vec<(Seq, Vec<u8>)>) -> (Vec<Seq>, u64) {
        let (mut b, _core) = bridge();
        let conn = ConnId::new(CoreId(0), 1);
        let rig = RigId::parse("rig-1").expect("rig");
        let boot = BootId::generate(1);
        let next = commands.last().map_or(Seq(1), |(s, _)| Seq(s.0 + 1));
        let found = Resumed {
            next: Some(next),
            commands,
            rebooted: 0,
            previous_boot: None,
            recall: None,
        };
        let verdict = Verdict::Accept {
            next_seq: Seq(1),
            resumed: false,
            carried: vec![],
            recall: Default::default(),
        };
        let actions = vec![Action::Core(conn, ToCore::Verdict { conn, verdict })];
        let out = b.resume(conn, &rig, &boot, found, actions, false);
        let Some(Action::Core(
            _,
            ToCore::Verdict {
                verdict:
                    Verdict::Accept {
                        next_seq, carried, ..
                    },
                ..
            },
        )) = out.first()
        else {
            panic!("no accept");
        };
        assert_eq!(*next_seq, next);
        let stale = REGISTRY_OPS
            .iter()
            .position(|&op| op == ("resume", "stale_dropped"))
            .expect("counted op");
        let seqs = carried.iter().map(|c| c.seq).collect();
        (seqs, b.shared.ops[stale].load(Ordering::Relaxed))
    }

    /// The seqs a connection carries once the session Redis read at its hello (commands c1,
    /// other and c3 under seqs 1 to 3, next 4) is merged into a copy holding only c3, numbered
    /// up to 4, whose rig acked c1 and c2 (awaiting their results): handed over by the same
    /// boot's old connection here, or parked here.
    fn merged_into_a_copy_holding_3(handed_over: bool) -> Vec<Seq> {
        let (mut b, _core) = bridge();
        let conn = ConnId::new(CoreId(0), 2);
        let rig = RigId::parse("rig-1").expect("rig");
        let boot = BootId::generate(1);
        let found = Resumed {
            next: Some(Seq(4)),
            commands: [(1, "c1"), (2, "other"), (3, "c3")]
                .map(|(s, id)| (Seq(s), format!(r#"{{"id":"{id}"}}"#).into_bytes()))
                .into(),
            rebooted: 0,
            previous_boot: None,
            recall: None,
        };
        let recall = crate::registry::msg::Recall {
            results: vec![(Seq(1), "c1".into()), (Seq(2), "c2".into())],
            last_ack: Seq(2),
            last_ack_ms: 1,
        };
        let verdict = Verdict::Accept {
            next_seq: Seq(4),
            resumed: true,
            carried: vec![SeqCommand::for_test(3, 4, false)],
            recall: Some(Box::new(recall)),
        };
        let actions = vec![Action::Core(conn, ToCore::Verdict { conn, verdict })];
        let out = b.resume(conn, &rig, &boot, found, actions, handed_over);
        let Some(Action::Core(_, ToCore::Verdict { verdict, .. })) = out.first() else {
            panic!("no verdict");
        };
        let Verdict::Accept { carried, .. } = verdict else {
            panic!("no accept");
        };
        carried.iter().map(|c| c.seq).collect()
    }

    /// The old connection acked c1 just before it handed the session over, its removal from
    /// Redis still on its way when the new connection's hello read the session: it is not
    /// given back (the rig acked it again, and the ack was published twice). Under seq 2
    /// Redis holds another command than the c2 acked there (another broker numbered seq 2
    /// while this one was cut off, and this one's c2 was fenced): that one goes to the rig
    /// (review bb104 found it dropped by a rule that skipped every seq below the copy's next).
    /// A parked copy may be older than Redis (the rig went on elsewhere), so Redis's commands
    /// go back into it.
    #[test]
    fn a_handed_over_session_does_not_take_back_what_its_old_connection_acked() {
        assert_eq!(merged_into_a_copy_holding_3(true), [Seq(2), Seq(3)]);
        assert_eq!(
            merged_into_a_copy_holding_3(false),
            [Seq(1), Seq(2), Seq(3)]
        );
    }

    #[test]
    fn a_resume_carries_at_most_one_sessions_worth_the_newest() {
        let limit = crate::config::test_config().session_limit() as u64;
        let commands = (1..=limit + 10).map(|s| (Seq(s), b"{}".to_vec())).collect();
        let (carried, stale) = resume_found(commands);
        assert_eq!(carried.len() as u64, limit);
        assert_eq!(carried.first(), Some(&Seq(11)), "the oldest went");
        assert_eq!(stale, 10);
    }

    #[test]
    fn a_resume_carries_at_most_one_sessions_worth_of_bytes_the_newest() {
        let mib = vec![b' '; 1 << 20];
        let commands = (1..=30).map(|s| (Seq(s), mib.clone())).collect();
        let (carried, stale) = resume_found(commands);
        let most = (RIG_SESSION_BYTES >> 20) as u64;
        assert_eq!(carried.len() as u64, most);
        assert_eq!(carried.first(), Some(&Seq(31 - most)), "the oldest went");
        assert_eq!(stale, 30 - most);
    }

    /// Redis away, a new boot's hello decided here ends the session parked for the older boot:
    /// its unacked commands wait for Redis, which says which of them no report has covered
    /// (another broker may have reported them already). Nothing is published from here.
    #[test]
    fn a_new_boot_decided_without_redis_leaves_the_parked_sessions_report_to_redis() {
        let (mut b, _core) = bridge();
        let rig = RigId::parse("rig-1").expect("rig");
        let (old, new) = (BootId::generate(1), BootId::generate(2));
        assert!(old < new);
        let first = ConnId::new(CoreId(0), 1);
        b.registry.hello(first, rig.clone(), old, vec![]);
        let carried = vec![
            SeqCommand::for_test(1, 4, false),
            SeqCommand::for_test(2, 4, false),
        ];
        b.handle(closed(first, rig.clone(), old, Seq(3), carried));
        b.queue_hello(ConnId::new(CoreId(0), 2), rig.clone(), new, vec![]);
        b.flush_hellos();
        let f = b.fleet.as_ref().expect("fleet");
        let reports = f
            .queued_publishes()
            .iter()
            .filter(|(channel, _)| channel == fleet::EVENTS)
            .count();
        assert_eq!((reports, f.queued_forgets()), (0, 0));
        let waiting = b.ended_alone.take_all();
        let [(req, by)] = &waiting[..] else {
            panic!("one session waits: {waiting:?}");
        };
        let seqs: Vec<u64> = req.cmds.iter().map(|(s, _)| s.0).collect();
        assert_eq!(
            (req.boot, req.next, seqs, *by),
            (old, Seq(3), vec![1, 2], new)
        );
    }
}
