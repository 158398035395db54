//! Commands for rigs that are not connected: held in Redis (fleet mode) or here, delivered at
//! the rig's welcome, reported `expired` at their deadline.

use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

use serde_json::json;

use super::shared::unix_ms;
use super::Bridge;
use crate::ids::{ConnId, RigId};
use crate::registry::embedded::Action;
use crate::registry::fleet;
use crate::registry::msg::{CommandReq, ReplyTo, ToCore};
use crate::registry::offline::{Held, Pushed};
use crate::reply;

/// How soon a deadline that passed while Redis was away is looked at again.
const EXPIRY_RETRY: Duration = Duration::from_secs(1);

/// A command for an offline rig, its deadline running, waiting for its batch's round trip.
pub(super) struct PendingHold {
    rig: RigId,
    entry: Held,
    /// [`Held::size`], counted against the broker's bound.
    size: usize,
    ttl: Duration,
    reply_to: ReplyTo,
}

impl Bridge {
    /// Holds a command for a rig that is not connected (Redis in fleet mode, else here).
    pub(super) fn hold(&mut self, req: CommandReq, ttl: Duration) {
        self.hold_until(req, unix_ms() + ttl.as_millis() as u64, ttl);
    }

    /// [`Self::hold`] with its deadline given: a command held again keeps the one it was held
    /// with to the millisecond, so that its entry is byte for byte the one Redis may hold
    /// already (`offline_push.lua` finds a push whose answer was lost by that). Recomputed
    /// from what was left, it could come out a millisecond later, and the command was then
    /// held twice (a CI run of `a_hold_whose_answer_was_lost_reaches_the_rig_once`).
    fn hold_until(&mut self, req: CommandReq, deadline_ms: u64, ttl: Duration) {
        let entry = Held {
            id: req.id,
            name: req.name,
            args: req.args,
            deadline_ms,
            reply_to: match &req.reply {
                ReplyTo::Channel(c) => Some(c.clone()),
                _ => None,
            },
        };
        let size = entry.size();
        if self.fleet.is_none() && self.shared.draining.load(Ordering::Relaxed) {
            // Standalone keeps holds in this process, which is on its way out: `queued` now
            // would be a promise broken at exit, unreported.
            self.shared.count("offline", "draining");
            let why = "this standalone broker is draining: it would exit with the command held";
            let body = reply::error(&entry.id, Some(req.rig.as_str()), "rig_not_connected", why);
            return self.reply(req.reply, body);
        }
        if self
            .deadlines
            .would_overflow(self.holds.len() + 1, self.holds_bytes + size)
        {
            self.shared.count("offline", "full");
            let why = "too many commands held on this broker";
            let body = reply::error(&entry.id, Some(req.rig.as_str()), "offline_queue_full", why);
            return self.reply(req.reply, body);
        }
        self.holds_bytes += size;
        self.holds.push(PendingHold {
            rig: req.rig,
            entry,
            size,
            ttl,
            reply_to: req.reply,
        });
    }

    /// Holds the commands queued by [`Self::hold`]: in fleet mode in one round trip to Redis
    /// (`offline_push.lua`, pipelined), so a fan-out to rigs that are all away costs one round
    /// trip per batch, not one per rig; standalone, or with Redis away, here.
    pub(super) fn flush_holds(&mut self) {
        if self.holds.is_empty() {
            return;
        }
        let holds = std::mem::take(&mut self.holds);
        self.holds_bytes = 0;
        if self.fleet.is_some() {
            // The verdicts and commands already decided must not wait on this round trip.
            self.ring_owed();
        }
        // A loss of Redis's keys the heartbeat (every 10 s) has not seen yet is looked for
        // first: these commands are held after it, and must not be reported with those
        // held before.
        self.keys_lost_unseen(Instant::now());
        let stored = self.fleet.as_mut().and_then(|f| {
            let batch: Vec<(&RigId, &Held, Duration)> =
                holds.iter().map(|h| (&h.rig, &h.entry, h.ttl)).collect();
            f.offline_push_many(&batch)
        });
        if stored.is_some() {
            self.shared.count("offline_batch", "sent");
        }
        let mut stored = stored.map(Vec::into_iter);
        for h in holds {
            match stored.as_mut().map(|s| s.next().flatten()) {
                Some(Some(Pushed::Held)) => self.held_reply(h, true, false),
                Some(Some(Pushed::Full)) => self.held_reply(h, false, false),
                Some(Some(Pushed::ConnectedAt(holder))) => self.connected_elsewhere(h, &holder),
                // Standalone, Redis away, or this entry's call failed: held here (delivered
                // only by this broker).
                _ => {
                    let room = self.held.has_room(&h.rig);
                    self.held_reply(h, room, true);
                }
            }
        }
    }

    /// Answers control for one held (or refused) command and arms its deadline; `here` holds
    /// it in this broker's own queue too.
    fn held_reply(&mut self, hold: PendingHold, stored: bool, here: bool) {
        let PendingHold {
            rig,
            entry,
            size,
            ttl,
            reply_to,
        } = hold;
        // Held again after a connection could not take it: control was answered when it was
        // first held, and hears its outcome from the events.
        let again = matches!(reply_to, ReplyTo::Event);
        let body = if stored {
            self.shared
                .count("offline", if again { "held_again" } else { "held" });
            let body = json!({"id": entry.id, "ok": true, "rig_id": rig.as_str(), "queued": true});
            let at = Instant::now() + ttl;
            if here {
                let key = self.deadlines.add(at, rig.clone(), entry.stub(), size);
                self.held.push(&rig, key, entry);
            } else {
                // Kept whole: its removal from Redis at the deadline names it exactly.
                self.deadlines.add(at, rig.clone(), entry, size);
            }
            if again {
                return;
            }
            body
        } else {
            self.shared.count("offline", "full");
            reply::error(
                &entry.id,
                Some(rig.as_str()),
                "offline_queue_full",
                "too many commands held for this rig",
            )
        };
        self.reply(reply_to, body);
    }

    /// A command to hold for a rig that is connected to another broker after all (control
    /// looked before its hello there): `rig_not_connected`, as for any command sent to a broker
    /// that does not hold the rig, naming the one that does.
    fn connected_elsewhere(&mut self, hold: PendingHold, holder: &str) {
        if matches!(hold.reply_to, ReplyTo::Event) {
            // A held command whose rig moved to that broker as it was being delivered here:
            // that broker delivers it, or holds it again, and reports it as delivered from
            // the hold (`offline_delivery`), since control was answered when it was held.
            return self.forward_held(holder, &hold.rig, &hold.entry, unix_ms());
        }
        self.shared.count("offline", "connected_elsewhere");
        let why = format!("the rig is connected to broker {holder}; send it there");
        let body = reply::error(
            &hold.entry.id,
            Some(hold.rig.as_str()),
            "rig_not_connected",
            &why,
        );
        self.reply(hold.reply_to, body);
    }

    /// Hands a held command whose rig is connected to broker `holder` to that broker (on its
    /// channel, with `offline_delivery`), which delivers it and reports it delivered from the
    /// hold, or holds it again, for what is left of its time at `now_ms`.
    fn forward_held(&mut self, holder: &str, rig: &RigId, entry: &Held, now_ms: u64) {
        self.shared.count("offline", "forwarded");
        let left = entry.deadline_ms.saturating_sub(now_ms).max(1);
        let payload = crate::registry::control::forwarded_hold(
            &entry.id,
            rig,
            &entry.name,
            &entry.args,
            left,
        );
        self.publish_bytes(fleet::broker_channel(holder), payload);
    }

    /// At a rig's welcome: the commands held for it (`held`, taken from Redis, then any held
    /// here while Redis was away), in order, behind the verdict; expired ones are reported
    /// instead.
    pub(super) fn deliver_held(
        &mut self,
        conn: ConnId,
        rig: &RigId,
        held: Vec<Held>,
        actions: &mut Vec<Action>,
    ) {
        // A take that got all it asked for may have left more in Redis (a new connection takes
        // what its outbox does at once): the connection asks, and an empty answer ends it. One
        // that got less emptied the list, and a storm's hellos make no second call each.
        let more = held.len() >= self.hold_take();
        self.deliver_held_more(conn, rig, held, more, actions);
    }

    /// How many of a rig's held commands a new connection takes at once: what its outbox
    /// takes of them (all but the places left to control's new commands).
    pub(super) fn hold_take(&self) -> usize {
        self.cfg.outbox - self.cfg.hold_reserve()
    }

    /// [`Self::deliver_held`], `more` saying Redis holds others behind these. In fleet mode
    /// the delivery ends with [`ToCore::HoldDelivered`], at which the connection puts back
    /// what it could not number.
    fn deliver_held_more(
        &mut self,
        conn: ConnId,
        rig: &RigId,
        mut held: Vec<Held>,
        more: bool,
        actions: &mut Vec<Action>,
    ) {
        for (key, h) in self.held.take(rig) {
            // Delivered: nothing left to expire, and the copy need not wait for the deadline.
            self.deadlines.forget(key);
            if self.fleet.is_some() {
                self.delivered_here.push((rig.clone(), h.clone()));
            }
            held.push(h);
        }
        let mut delivered = false;
        for req in self.unexpired(rig, held, unix_ms()) {
            self.shared.count("offline", "delivered");
            delivered = true;
            actions.push(Action::Core(
                conn,
                ToCore::Command {
                    conn,
                    req: Box::new(req),
                    direct: false,
                },
            ));
        }
        if self.fleet.is_some() && (delivered || more) {
            actions.push(Action::Core(conn, ToCore::HoldDelivered { conn, more }));
        }
    }

    /// Commands from `rig`'s hold that its connection could not number yet (fleet mode): back
    /// at the head of the hold in Redis, in order, this broker keeping their deadlines to
    /// report them `expired`, as it does for any command it holds. With Redis away they are
    /// held as any command for an offline rig is then (here, and in Redis once it is back).
    pub(super) fn put_back_held(&mut self, rig: RigId, reqs: Vec<CommandReq>) {
        let now = unix_ms();
        let ttls: Vec<Duration> = reqs
            .iter()
            .map(|r| r.offline_ttl.unwrap_or(Duration::from_millis(1)))
            .collect();
        let entries: Vec<Held> = reqs
            .iter()
            .zip(&ttls)
            .map(|(r, ttl)| Held {
                id: r.id.clone(),
                name: r.name.clone(),
                args: r.args.clone(),
                deadline_ms: now + ttl.as_millis() as u64,
                reply_to: None,
            })
            .collect();
        let longest = ttls.iter().copied().max().unwrap_or_default();
        let stored = self
            .fleet
            .as_mut()
            .and_then(|f| f.offline_put_back(&rig, &entries, longest));
        let Some(stored) = stored else {
            for (req, ttl) in reqs.into_iter().zip(ttls) {
                self.hold(req, ttl);
            }
            return;
        };
        if let Pushed::ConnectedAt(holder) = stored {
            // The rig moved to that broker, whose connection took the hold at its hello:
            // handed on, in order, as any held command a connection lost to another is.
            for entry in &entries {
                self.forward_held(&holder, &rig, entry, now);
            }
            return;
        }
        self.shared
            .count_n("offline", "returned", entries.len() as u64);
        let at = Instant::now();
        for (entry, ttl) in entries.into_iter().zip(ttls) {
            let size = entry.size();
            self.deadlines.add(at + ttl, rig.clone(), entry, size);
        }
    }

    /// Takes up to `max` more of `rig`'s held commands (`max_bytes` of them) from Redis for
    /// `conn`, which has room for them now. With Redis away, asked again once it is back.
    pub(super) fn take_held(
        &mut self,
        conn: ConnId,
        rig: RigId,
        max: u32,
        max_bytes: u32,
    ) -> Vec<Action> {
        let mut actions = Vec::new();
        let (max, bytes) = (max as usize, max_bytes as usize);
        match self
            .fleet
            .as_mut()
            .and_then(|f| f.offline_take_some(&rig, max, bytes))
        {
            Some((held, more)) => self.deliver_held_more(conn, &rig, held, more, &mut actions),
            None => {
                self.held_unread.insert(rig);
                actions.push(Action::Core(
                    conn,
                    ToCore::HoldDelivered { conn, more: false },
                ));
            }
        }
        actions
    }

    /// Redis is back: the copies in Redis of commands this broker held and delivered itself
    /// while it was away are removed (a push whose answer was lost may have run), before
    /// anything takes from Redis again. Kept for the next reconnect if Redis does not answer.
    pub(super) fn forget_delivered_here(&mut self) {
        if self.delivered_here.is_empty() {
            return;
        }
        let done = self.fleet.as_mut().and_then(|f| {
            let entries: Vec<(&RigId, &Held)> =
                self.delivered_here.iter().map(|(r, h)| (r, h)).collect();
            f.offline_remove_many(&entries)
        });
        if let Some(removed) = done {
            let n = removed.iter().filter(|r| **r).count() as u64;
            self.shared.count_n("offline", "duplicate_removed", n);
            self.delivered_here.clear();
        }
    }

    /// Redis is back: the commands held here while it was away go to it, where the rig's
    /// hello on any broker finds them. Held here, only this broker could deliver them, and a
    /// rig that came back to another one never got them (they expired there unseen, or were
    /// lost with this broker).
    pub(super) fn hold_in_redis_again(&mut self) {
        for (rig, held) in self.held.take_all() {
            let held = held
                .into_iter()
                .map(|(key, entry)| {
                    self.deadlines.forget(key);
                    entry
                })
                .collect();
            self.hold_again(&rig, held);
        }
    }

    /// Redis is back: the commands it held for rigs welcomed here while it was away, which
    /// their hellos could not take, are delivered now, as at a welcome (a connection that
    /// cannot take one holds it again, as at any welcome). Before, they waited in
    /// Redis for the rig's next hello and were reported `expired` with the rig connected.
    pub(super) fn deliver_held_unread(&mut self) {
        // A rig gone since has nothing to take: its next hello takes the list.
        let conns: Vec<(RigId, ConnId)> = std::mem::take(&mut self.held_unread)
            .into_iter()
            .filter_map(|rig| self.registry.conn_of(&rig).map(|conn| (rig, conn)))
            .collect();
        if conns.is_empty() {
            return;
        }
        let refs: Vec<&RigId> = conns.iter().map(|(rig, _)| rig).collect();
        let take = self.hold_take();
        let Some(taken) = self
            .fleet
            .as_mut()
            .and_then(|f| f.offline_take_many(&refs, take))
        else {
            // Away again: asked at the next reconnect.
            self.held_unread
                .extend(conns.into_iter().map(|(rig, _)| rig));
            return;
        };
        for ((rig, conn), held) in conns.iter().zip(taken) {
            if !held.is_empty() {
                let mut actions = Vec::new();
                self.deliver_held(*conn, rig, held, &mut actions);
                self.carry_out(actions);
            }
        }
    }

    /// Commands taken from Redis for a hello that was then turned away: held again (or
    /// reported `expired`), so that each still has its one outcome to come.
    pub(super) fn hold_again(&mut self, rig: &RigId, taken: Vec<Held>) {
        let now = unix_ms();
        for req in self.unexpired(rig, taken, now) {
            // Unexpired, its deadline is `now` and what is left, exactly.
            let left = req.offline_ttl.unwrap_or(Duration::from_millis(1));
            self.hold_until(req, now + left.as_millis() as u64, left);
        }
    }

    /// `held` as commands for `rig`, each with what is left of its hold (held again, should
    /// the connection not take it: see `undelivered`); those past their deadline are reported
    /// `expired` instead. Control heard `queued` when each was first held: its outcome comes
    /// as events.
    fn unexpired(&mut self, rig: &RigId, held: Vec<Held>, now: u64) -> Vec<CommandReq> {
        let mut out = Vec::with_capacity(held.len());
        for h in held {
            if h.expired(now) {
                self.report_expired(rig, &h.id);
                continue;
            }
            let left = Duration::from_millis(h.deadline_ms.saturating_sub(now).max(1));
            out.push(CommandReq {
                id: h.id,
                rig: rig.clone(),
                name: h.name,
                args: h.args,
                reply: ReplyTo::Event,
                offline_ttl: Some(left),
            });
        }
        out
    }

    /// A held command that connection `conn` could not take: to the rig's connection now if
    /// it has another one here, else held again (in Redis, or forwarded to the broker the rig
    /// is connected to now), so that its one outcome is still to come.
    pub(super) fn undelivered(&mut self, conn: ConnId, req: Box<CommandReq>) -> Vec<Action> {
        self.shared.count("offline", "undelivered");
        let ttl = req.offline_ttl.unwrap_or(Duration::from_millis(1));
        self.registry
            .command(req)
            .into_iter()
            .map(|action| match action {
                // The registry has not yet heard that this connection let the rig go: held
                // again, not sent back to it.
                Action::Core(c, ToCore::Command { req, .. }) if c == conn => {
                    Action::Offline(req, ttl)
                }
                other => other,
            })
            .collect()
    }

    /// At exit: what this broker's end does to the commands it holds for offline rigs, said
    /// once, since control was told each was `queued`. In fleet mode they stay in Redis, and
    /// the deadlines, this broker's to report, are handed to Redis for the brokers still
    /// running (`offline_due.lua`); before, a rig that stayed away never heard of them
    /// (review bb107). Standalone they were in this process.
    pub(super) fn hand_off_holds(&mut self) {
        if let Some(f) = self.fleet.as_mut() {
            // A deadline of a command held here, not in Redis, has no entry there to report.
            let entries: Vec<(&RigId, &Held)> = self
                .deadlines
                .iter()
                .filter(|(_, e)| !e.name.is_empty())
                .collect();
            let n = entries.len();
            if n == 0 {
                return;
            }
            if f.offline_hand_off(&entries) {
                log::info!(
                    "handed the deadlines of {n} commands this broker held for offline rigs to \
                     Redis: a broker still running reports each expired when it comes due, \
                     unless its rig took it first"
                );
            } else {
                log::warn!(
                    "exiting while keeping the deadlines of {n} commands this broker held for \
                     offline rigs (delivered ones too: a deadline is kept until due, since \
                     another broker may deliver the command), Redis not taking them: those \
                     still held stay in Redis and reach their rigs at the next hello on any \
                     broker, but one whose deadline passes is reported expired only at its \
                     rig's hello, and not at all if the rig stays away past a minute after it"
                );
            }
            return;
        }
        let (n, first) = self.held.summary(10);
        if n > 0 {
            log::warn!(
                "exiting with {n} commands held for offline rigs, lost with this process \
                 (standalone keeps them in memory) and never reported; the first: {}",
                first.join(", ")
            );
        }
        let (n, sessions, first) = self.registry.parked_commands(10);
        if n > 0 {
            log::warn!(
                "exiting with {n} commands of {sessions} rigs' sessions never acked (queued, or \
                 written and maybe run), lost with this process (standalone keeps sessions in \
                 memory: their rigs' next hello starts afresh) and never reported; the first: {}",
                first.join(", ")
            );
        }
    }

    /// At exit: the commands held in Redis before it lost its keys are reported `lost` now,
    /// as their deadlines would have. Handed to Redis instead, the broker that took their
    /// deadlines found them gone and took them for delivered (review bb126).
    pub(super) fn report_holds_lost_with_the_keys(&mut self) {
        if self.fleet.is_none() {
            return;
        }
        self.keys_lost_unseen(Instant::now());
        for (rig, entry) in self.deadlines.take_held_across_a_loss(in_redis_whole) {
            if !self.delivered_holds.take(&rig, &entry.id) {
                self.report_hold_lost(&rig, &entry.id);
            }
        }
    }

    fn report_hold_lost(&mut self, rig: &RigId, id: &str) {
        self.shared.count("offline", "lost");
        let ev = crate::events::hold_lost(&self.cfg.broker_id, rig, id);
        self.publish(fleet::EVENTS.to_string(), &ev);
    }

    fn report_expired(&mut self, rig: &RigId, id: &str) {
        self.shared.count("offline", "expired");
        let ev = crate::events::expired(&self.cfg.broker_id, rig, id);
        self.publish(fleet::EVENTS.to_string(), &ev);
    }

    /// Deadlines exited brokers handed to Redis that came due: reported there (once a second,
    /// with the canary).
    pub(super) fn report_handed_deadlines(&mut self) {
        if let Some(n) = self.fleet.as_mut().and_then(|f| f.offline_report_due()) {
            self.shared.count_n("offline", "expired_handed", n);
        }
    }

    /// Commands this broker held whose deadline passed: reported `expired` if still held.
    pub(super) fn expire_held(&mut self, now: Instant) {
        let due = self.deadlines.due(now);
        if due.is_empty() {
            return;
        }
        // A fan-out held for many rigs expires at once: one round trip removes it all.
        let in_redis = self.fleet.as_mut().and_then(|f| {
            let entries: Vec<(&RigId, &Held)> = due.iter().map(|(_, r, e, _)| (r, e)).collect();
            f.offline_expire_many(&entries)
        });
        let fleet = self.fleet.is_some();
        let answers: Vec<Option<bool>> = in_redis.unwrap_or_default();
        self.check_keys_lost(&due, &answers, now);
        for (i, (key, rig, entry, epoch)) in due.into_iter().enumerate() {
            // None: Redis did not answer for this one (standalone: there is no Redis).
            let expired = answers.get(i).copied().flatten();
            if expired == Some(true) || self.held.remove(&rig, key) {
                self.report_expired(&rig, &entry.id);
            } else if fleet && expired.is_none() {
                // Redis did not answer whether it still holds this one: asked again once it
                // is back, or the command would end with no outcome (its list lapses a
                // minute past the deadline, and no hello may come to find it). Should the
                // call have run after all, its mark says so then.
                let size = entry.size();
                self.deadlines
                    .add_from(now + EXPIRY_RETRY, rig, entry, size, epoch);
            } else if self.delivered_holds.take(&rig, &entry.id) {
                // Delivered here: its `offline_delivered` told its story.
            } else if in_redis_whole(&entry) && self.deadlines.held_across_a_loss(epoch) {
                // Not there, and Redis lost its keys since it held it: a hello elsewhere may
                // have taken it before, or the loss did. Taken for delivered, one the loss
                // took never had an outcome.
                self.report_hold_lost(&rig, &entry.id);
            }
        }
    }

    /// Before due commands Redis no longer holds are taken for delivered: Redis may have lost
    /// its keys since the last heartbeat (every 10 s) looked, a flush say, which only this
    /// broker's sentinel tells. Gone, the heartbeat runs now to recover from it, and every
    /// command held before counts as held across the loss.
    fn check_keys_lost(
        &mut self,
        due: &[(u64, RigId, Held, u32)],
        answers: &[Option<bool>],
        now: Instant,
    ) {
        let unseen = due
            .iter()
            .zip(answers)
            .any(|((_, _, entry, epoch), answer)| {
                *answer == Some(false)
                    && in_redis_whole(entry)
                    && !self.deadlines.held_across_a_loss(*epoch)
            });
        if !unseen {
            return;
        }
        self.keys_lost_unseen(now);
    }

    /// Whether Redis lost its keys since the last heartbeat looked, by this broker's sentinel
    /// (gone only with them): if so, the commands held in Redis before count as held across
    /// the loss, and the heartbeat runs now to recover the rest (leases, sessions).
    fn keys_lost_unseen(&mut self, now: Instant) {
        if self.keys_loss_counted || !self.fleet.as_ref().is_some_and(|f| f.is_up()) {
            return;
        }
        if self.fleet.as_mut().and_then(|f| f.sentinel_present()) == Some(false) {
            self.deadlines.keys_lost();
            self.keys_loss_counted = true;
            self.next_heartbeat = now;
        }
    }
}

/// Whether this deadline's command was held in Redis (kept whole), not here (a stub).
fn in_redis_whole(entry: &Held) -> bool {
    !entry.name.is_empty()
}
