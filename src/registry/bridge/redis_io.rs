//! The bridge's turn at Redis in each pass: read the subscription and act on what came, then
//! send the queued writes (persists, rekeeps, publishes, releases) when their pace allows.

use std::collections::HashSet;
use std::sync::atomic::Ordering;
use std::time::Instant;

use super::shared::mono_ms;
use super::Bridge;
use crate::ids::{BootId, ConnId, RigId, Seq};
use crate::log_text::{clip, LOG_CHARS};
use crate::registry::control::{self, Control};
use crate::registry::fleet::{self, Fleet};
use crate::registry::msg::{PersistReq, ReplyTo, SeqCommand, ToCore};
use crate::registry::pace::Queued;
use crate::registry::scripts::RefreshStatus;
use crate::registry::sessions::{Kept, Persist};
use crate::registry::throttle::Throttle;
use crate::reply;

impl Bridge {
    /// Tells `/metrics` and `/readyz` how the connections to Redis stand at the end of a pass,
    /// timers included: a call that failed anywhere in it dropped its connection, and while
    /// Redis is away the bridge may then sleep until the reconnect's backoff is over, so a
    /// state told any earlier would read as up all that time.
    pub(super) fn report_redis(&mut self) {
        let Some(f) = self.fleet.as_mut() else { return };
        let refused = f.refusals - self.refusals_counted;
        self.refusals_counted = f.refusals;
        let (up, subscribed) = (f.is_up(), f.is_subscribed());
        self.shared.count_n("redis", "refused", refused);
        let stale = std::mem::take(&mut f.stale_removed);
        self.shared.count_n("lease", "stale_removed", stale);
        let gone = std::mem::take(&mut f.stale_gone);
        let lost = std::mem::take(&mut f.forget_lost);
        self.shared.count_n("forget", "lost", lost);
        let ran = std::mem::take(&mut f.unanswered_ran);
        self.shared.count_n("publish", "unanswered_ran", ran);
        let resent = std::mem::take(&mut f.unanswered_resent);
        self.shared.count_n("publish", "unanswered_resent", resent);
        let cuts = std::mem::take(&mut f.subscription_cuts);
        self.shared.count_n("subscription", "cut", cuts);
        if let Some(why) = f.take_down_why() {
            if let Ok(mut slot) = self.shared.redis_down_why.lock() {
                *slot = why;
            }
        }
        self.shared.redis_up.store(u64::from(up), Ordering::Relaxed);
        self.shared.subscribed.store(subscribed, Ordering::Relaxed);
        // The rigs of a predecessor killed outright: it published no `disconnected` for them,
        // and no rig of them is here (the sweep leaves those out). Review bb152.
        for (rig, boot) in gone {
            let ev = crate::events::disconnected(
                &self.cfg.broker_id,
                &rig,
                &boot,
                1006,
                "the broker's previous process exited without closing (killed, or crashed)",
            );
            self.publish(fleet::EVENTS.to_string(), &ev);
        }
        self.count_publish_drops();
        self.note_listening();
    }

    /// Each time this broker stops or starts listening (either connection, the subscription
    /// alone included), sessions are named in `sess:lapses` again with their next command:
    /// while it did not listen, a sweep may have taken out a connected rig's session that held
    /// nothing unacked (`lua/lapse_end.lua`). Noted at the end of a pass too: a call that
    /// failed in the timers must not wait for the reconnect to be seen.
    fn note_listening(&mut self) {
        let listening = self.fleet.as_ref().is_some_and(Fleet::is_up);
        if listening != self.lapse_listening {
            self.lapse_listening = listening;
            self.lapse_count = self.lapse_count.wrapping_add(1).max(1);
        }
    }

    /// Reads the subscription, then sends queued persists, publishes and releases unless
    /// [`Self::write_due`] says to wait; reconnects when down.
    pub(super) fn redis_io(&mut self, now: Instant) {
        let Some(f) = self.fleet.as_mut() else { return };
        f.log_pending_drops(now);
        let up = f.ensure(now);
        // The subscription is read even when the command connection is down: what Redis
        // pushed on it is control's, and it was told someone received it.
        let pushes = f.read();
        let resubscribed = up && std::mem::take(&mut f.just_subscribed);
        let reconnected = up && std::mem::take(&mut f.just_connected);
        self.note_listening();
        if resubscribed {
            // What control held for rigs connected here while this broker did not listen
            // (`offline:for:<id>`) is taken by the refresh: now, not up to a refresh later.
            self.next_refresh = now;
            self.next_canary = now;
        }
        if reconnected {
            // Re-assert every lease we hold: Redis may have restarted empty. And put every
            // session back: commands delivered while Redis was away were not kept.
            self.rekeep_all = true;
            self.forget_delivered_here();
            self.hold_in_redis_again();
            self.next_refresh = now;
            self.next_heartbeat = now;
            self.next_canary = now;
            // Readiness waits for a canary through the new subscription; the last one came
            // before the outage, and its age would read as a slow subscription.
            self.shared.canary_at_ms.store(0, Ordering::Relaxed);
            // Redis may have lost `sess:lapses` (restarted empty): each session is named
            // again with its next command.
            self.lapse_count = self.lapse_count.wrapping_add(1).max(1);
        }
        self.batched(|b| {
            for push in pushes {
                b.shared.pubsub_in.fetch_add(1, Ordering::Relaxed);
                b.control(&push.channel, &push.payload, now);
            }
            // Settling an evict asks Redis who holds the lease: it waits for the connection.
            if up {
                b.settle_evicts();
            }
            b.flush_holds();
            if up && !b.held_unread.is_empty() {
                b.deliver_held_unread();
            }
        });
        if !up {
            self.persist_held();
            return;
        }
        // Leases first: a Redis that restarted empty or let a lease expire would fence the
        // queued persists of rigs still connected here, and a fenced seq is a gap for the rig.
        // This pass's timers put the leases back (`refresh`); the persists go in the next.
        if reconnected {
            return;
        }
        if self.write_due(now).is_none_or(|due| due > now) {
            return;
        }
        self.pace.wrote(now);
        self.batched(Self::persist_held);
        self.rekeep_sessions();
        let Some(f) = self.fleet.as_mut() else { return };
        let published = f.published;
        f.flush(Some(now));
        let noted = f.take_noted();
        self.shared
            .pubsub_out
            .fetch_add(f.published - published, Ordering::Relaxed);
        for conn in noted {
            self.send_to_core(conn, ToCore::Noted { conn });
        }
    }

    /// When the queued Redis writes should go out: None when nothing is queued.
    pub(super) fn write_due(&self, now: Instant) -> Option<Instant> {
        // While Redis is away the reconnect backoff paces the bridge, not this.
        if !self.fleet.as_ref().is_some_and(Fleet::is_up) {
            return None;
        }
        let queued = Queued {
            persists: self.persists.len() + self.fleet.as_ref().map_or(0, Fleet::recalls_queued),
            others: self.rekeeps.len() + self.fleet.as_ref().map_or(0, Fleet::queued),
        };
        let writes = self.pace.due(queued, now);
        let forgets = self.fleet.as_ref().and_then(Fleet::forget_due);
        writes.into_iter().chain(forgets).min()
    }

    /// The evicts of rigs this broker holds. The rig may have come back after the evict was
    /// sent (A to B and back to A within pub/sub's latency), or the evict was never a broker's
    /// (anyone who may publish on the channel can send one): if the lease still names this
    /// broker and the boot held here, the evict is stale, and closing the rig's live connection
    /// would only bounce it once more. One round trip for all of a read's, since a whole fleet
    /// moving between two live brokers sends one per rig.
    pub(super) fn settle_evicts(&mut self) {
        if self.evicts_to_settle.is_empty() {
            return;
        }
        let evicts = std::mem::take(&mut self.evicts_to_settle);
        let ours = self.fleet.as_mut().and_then(|f| f.owns_many(&evicts));
        for (i, (rig, boot)) in evicts.into_iter().enumerate() {
            if ours
                .as_ref()
                .and_then(|o| o.get(i))
                .copied()
                .unwrap_or(false)
            {
                self.shared.count("evict", "stale");
            } else {
                // Seqs given here while Redis was away go back as the connection closes.
                if self.unkept_high.contains_key(&(rig.clone(), boot)) {
                    self.merge_on_close.insert((rig.clone(), boot));
                }
                let actions = self.registry.supersede(&rig, Some(boot));
                self.carry_out(actions);
            }
        }
    }

    fn control(&mut self, channel: &str, payload: &[u8], now: Instant) {
        let broadcast = channel == fleet::BROADCAST;
        match control::parse(payload, broadcast) {
            Ok(Control::Canary {
                broker_id,
                instance,
            }) => {
                if broker_id != self.cfg.broker_id {
                    // Another broker's canary, on our channel: misrouted or made by hand. It
                    // says nothing of our subscription, and only a counter shows it came.
                    self.shared.count("canary", "foreign");
                    return;
                }
                if instance.as_deref().is_some_and(|i| i != self.instance) {
                    // Another process with our id is subscribed to our channel: it takes our
                    // commands too (see `BridgeShared::not_ready`).
                    self.shared.count("canary", "twin");
                    self.shared.twin_at_ms.store(mono_ms(), Ordering::Relaxed);
                    if let Some(n) = self.twin_log.note(now) {
                        log::error!(
                            "another broker runs with --broker-id {broker_id} (instance \
                             {}, {n} of its canaries since the last line): both take every \
                             command sent to this id, and each answers rig_not_connected for \
                             the other's rigs; /readyz fails until one is gone. Give each \
                             broker its own --broker-id",
                            clip(instance.as_deref().unwrap_or_default(), LOG_CHARS)
                        );
                    }
                    return;
                }
                self.shared.canary_at_ms.store(mono_ms(), Ordering::Relaxed);
                if std::mem::take(&mut self.canary_late) {
                    log::info!("redis: the canary is back; /readyz no longer fails on it");
                }
            }
            Ok(Control::Command(req)) => {
                let actions = self.route_command(Box::new(req));
                self.carry_out(actions);
            }
            Ok(Control::Kick { id, rig, reply_to }) => {
                let actions = self.registry.kick(id, rig, ReplyTo::Channel(reply_to));
                self.carry_out(actions);
            }
            Ok(Control::Evict { rig, boot }) => {
                self.shared.count("evict", "received");
                // An evict naming the boot held here, or a newer one (sent by the broker that
                // welcomed it), closes the connection here once the lease says another holds
                // the rig (settled after the read); one naming an older boot changes nothing.
                // Seqs given here while Redis was away go back as it closes, as at a refresh
                // that finds it superseded (see `settle_evicts`).
                if let Some(held) = self.registry.boot_of(&rig).filter(|held| *held <= boot) {
                    self.evicts_to_settle.push((rig, held));
                }
            }
            Ok(Control::Merged { rig, boot }) => {
                // The connection's copy goes back (`rekeep.lua`, live): Redis numbers past it
                // now, and its answer gives the rig what the other broker added.
                match self.registry.conn_of(&rig) {
                    Some(conn) if self.registry.boot_of(&rig) == Some(boot) => {
                        self.shared.count("session", "merged");
                        self.send_to_core(conn, ToCore::Rekeep { conn });
                    }
                    // The rig left or moved since (or the notice was made by hand): its
                    // session goes back from wherever it is now.
                    _ => self.shared.count("session", "merged_stale"),
                }
            }
            Ok(Control::Broadcast {
                id,
                selector,
                name,
                args,
                reply_to,
            }) => {
                self.broadcast(id, &selector, name, args, reply_to, now);
            }
            Err(bad) => {
                self.shared.count("control", "bad_request");
                if bad.reply_to.is_none() {
                    self.unanswered.note(now, &bad);
                }
                if let Some((id, reply_to)) = bad.reply_to {
                    let mut body = reply::error(&id, bad.rig.as_deref(), "bad_request", &bad.why);
                    if id.is_empty() {
                        // Control sent none; one made up here would match nothing of control's.
                        body["id"] = serde_json::Value::Null;
                    }
                    if broadcast {
                        // Every broker answers a broadcast, this one too: control counts the
                        // answers by broker.
                        body["broker_id"] = self.cfg.broker_id.clone().into();
                    }
                    self.publish(reply_to, &body);
                }
            }
        }
    }

    /// Keeps the held commands in Redis (one batched, lease-fenced script call), then releases
    /// each to its core and answers control: `ok` only for what Redis kept. With Redis down,
    /// commands are released unkept (delivery goes on; only a cross-broker resume loses them).
    pub(super) fn persist_held(&mut self) {
        if self.persists.is_empty() {
            return;
        }
        let held = std::mem::take(&mut self.persists);
        let mut kept = self.keep(held.iter());
        let mut rekeep = match kept.as_mut() {
            Some(kept) => self.keep_again_under_restored_leases(&held, kept),
            None => Vec::new(),
        };
        if let Some(kept) = kept.as_ref() {
            self.keep_again_sessions_lost_alone(&held, kept, &mut rekeep);
        }
        // Before the answers: a closed connection's session hands over at its last answer,
        // and its core puts back what it then holds.
        for conn in rekeep {
            self.send_to_core(conn, ToCore::Rekeep { conn });
        }
        let after = std::mem::take(&mut self.after_keeps);
        self.answer_persists(held, kept, true, after);
    }

    /// Releases each command to its core (or drops it) and answers control: `ok` only for
    /// what Redis kept. `kept` None means Redis was unavailable: then, with `unkept_written`,
    /// the command is released unkept (delivery goes on, only a cross-broker resume loses
    /// it); without it (shutdown: no core is left to write it) control hears it was not.
    /// `after` are reports that came in among `held`, each after the number of them it names:
    /// published in that place among the answers.
    pub(super) fn answer_persists(
        &mut self,
        held: Vec<PersistReq>,
        kept: Option<Vec<Kept>>,
        unkept_written: bool,
        after: Vec<(usize, Box<[u8]>)>,
    ) {
        // One read of what the rig missed per connection and batch: its later stale commands
        // find the same.
        let mut caught_up: Vec<ConnId> = Vec::new();
        let mut after = after.into_iter().peekable();
        for (i, p) in held.into_iter().enumerate() {
            while let Some((_, ev)) = after.next_if(|(before, _)| *before <= i) {
                self.publish_bytes(fleet::EVENTS.to_string(), ev.into_vec());
            }
            let status = match &kept {
                Some(k) => k.get(i).copied().unwrap_or(Kept::Fenced),
                None => Kept::Unavailable,
            };
            let result = match status {
                Kept::Yes => "ok",
                Kept::Anew => "created",
                Kept::Unavailable => "unavailable",
                Kept::Fenced | Kept::LeaseMissing => "fenced",
                Kept::Stale(_) => "stale",
            };
            self.shared.count("persist", result);
            let ok = match status {
                Kept::Yes | Kept::Anew => true,
                Kept::Unavailable => unkept_written,
                Kept::Fenced | Kept::LeaseMissing | Kept::Stale(_) => false,
            };
            if let (Kept::Unavailable, true) = (status, ok) {
                self.note_unkept(&p);
            }
            if let Kept::Stale(next) = status {
                // Before the answer: the core gives the rig what the other broker gave it, and
                // numbers what comes next past it.
                let missed = if caught_up.contains(&p.conn) {
                    Box::default()
                } else {
                    caught_up.push(p.conn);
                    self.missed(&p.rig, p.boot, p.seq, next)
                };
                let conn = p.conn;
                self.send_to_core(conn, ToCore::RaiseSeq { conn, next, missed });
            }
            let (body, route) = if ok {
                (reply::enqueued(&p.id, &p.rig, p.seq), Some(p.conn))
            } else {
                let why = match status {
                    Kept::Unavailable => {
                        "the broker shut down before the command was kept or written"
                    }
                    Kept::Stale(_) => {
                        "another broker gave the rig this seq while this broker could not reach Redis (an outage or a restart); send the command again"
                    }
                    // A broadcast reaches that broker too, which may have matched the rig.
                    _ if matches!(p.reply, ReplyTo::Aggregate(_)) => {
                        "another broker took this rig over as the broadcast arrived, and may have enqueued it there"
                    }
                    _ => "another broker owns this rig now",
                };
                let body = reply::error(&p.id, Some(p.rig.as_str()), "rig_not_connected", why);
                (body, None)
            };
            self.send_to_core(
                p.conn,
                ToCore::Persisted {
                    conn: p.conn,
                    seq: p.seq,
                    kept: ok,
                    unkept: ok && status == Kept::Unavailable,
                },
            );
            if let (false, Some(left)) = (ok, p.hold_left) {
                // From the offline hold, fenced because the rig moved to another connection
                // as it was being delivered: it goes there, or is held again.
                if let Some(req) = unheld(&p, left) {
                    let actions = self.undelivered(p.conn, Box::new(req));
                    self.carry_out(actions);
                    continue;
                }
            }
            self.reply_routed(p.reply, body, route);
        }
        for (_, ev) in after {
            self.publish_bytes(fleet::EVENTS.to_string(), ev.into_vec());
        }
    }

    /// What `rig`'s session in Redis holds from `from` up to `next`: commands another broker
    /// numbered while this one could not reach Redis, which the rig's connection here never
    /// had. At most a session's worth, the newest (a resume drops older ones too).
    pub(super) fn missed(
        &mut self,
        rig: &RigId,
        boot: BootId,
        from: Seq,
        next: Seq,
    ) -> Box<[SeqCommand]> {
        let limit = self.cfg.session_limit() as u64;
        let from = from.0.max(next.0.saturating_sub(limit));
        let Some(found) = self
            .fleet
            .as_mut()
            .and_then(|f| f.session_commands(rig, &boot, from..next.0))
        else {
            // The rig has a gap then, as before this read existed: counted.
            self.shared.count("missed", "unavailable");
            return Box::default();
        };
        self.shared.count_n("missed", "given", found.len() as u64);
        found
            .into_iter()
            .map(|(seq, json)| SeqCommand {
                seq,
                id: super::hellos::command_id(&json),
                json: json.into_boxed_slice(),
                queued_at: Instant::now(),
                written_at: None,
                held: false,
                unkept: false,
                read_back: true,
                written_on: None,
            })
            .collect()
    }

    /// `p` was delivered unkept: remembered for its session while that session is here, live
    /// (see `Bridge::unkept_high`) or parked. Not only on `p`'s own connection: a hello of
    /// the same boot may have taken the session over before this answer came (the bridge
    /// held up by Redis), and the copy parked after then took the command for one Redis had
    /// kept, and dropped it unreported once Redis was back (review bb123).
    fn note_unkept(&mut self, p: &PersistReq) {
        if self.fleet.is_none() || self.cfg.session_ttl.is_zero() {
            return;
        }
        if self.registry.boot_of(&p.rig) == Some(p.boot) {
            let unkept = self.unkept_high.entry((p.rig.clone(), p.boot)).or_default();
            *unkept = unkept.with(p.seq);
        } else {
            self.registry.note_parked_unkept(&p.rig, p.boot, p.seq);
        }
    }

    /// One lease-fenced script call for `held`. None when Redis is unavailable.
    pub(super) fn keep<'a>(
        &mut self,
        held: impl Iterator<Item = &'a PersistReq>,
    ) -> Option<Vec<Kept>> {
        let ttl = self.cfg.session_ttl;
        let batch: Vec<Persist<'_>> = held
            .map(|p| Persist {
                rig: &p.rig,
                boot: &p.boot,
                seq: p.seq,
                json: &p.json,
            })
            .collect();
        let kept = self.fleet.as_mut()?.persist(&batch, ttl)?;
        // A connection's session is named in `sess:lapses` after its first command kept under
        // this connection to Redis, not with every command, and not in the keep's call.
        let count = self.lapse_count;
        for (p, k) in batch.iter().zip(&kept) {
            if matches!(k, Kept::Yes | Kept::Anew)
                && self.registry.lapse_named(p.rig, *p.boot) != count
            {
                self.registry.set_lapse_named(p.rig, *p.boot, count);
                self.name_held_lapse(p.rig.clone(), *p.boot);
            }
        }
        Some(kept)
    }

    /// A command kept in a session key it created: Redis had lost that session alone (a key
    /// deleted or evicted while the lease stayed), and with it every command it held that the
    /// rig has not acked. Only this broker's copy has them now, gone with it if it dies, so
    /// the connection's core sends its copy back, as after an empty restart. Adds those
    /// connections to `rekeep`.
    fn keep_again_sessions_lost_alone(
        &mut self,
        held: &[PersistReq],
        kept: &[Kept],
        rekeep: &mut Vec<ConnId>,
    ) {
        for (p, _) in held.iter().zip(kept).filter(|(_, k)| **k == Kept::Anew) {
            if rekeep.contains(&p.conn) || !self.registry.held_by(&p.rig, p.conn) {
                continue;
            }
            self.ask_back_lost_alone(p.rig.clone(), p.boot);
            rekeep.push(p.conn);
        }
    }

    /// A connected rig's session key was found gone on its own (at a keep or a touch): counted,
    /// and its core's copy is owed back (the caller asks for it). Should the connection close
    /// before its core answers, its session goes back from here (`Closed`).
    pub(super) fn ask_back_lost_alone(&mut self, rig: RigId, boot: BootId) {
        self.shared.count("session", "key_lost");
        self.rekeep_asked.insert((rig, boot));
    }

    /// Redis lost the lease of a rig still connected here (evicted, flushed, restarted
    /// empty): fenced, its command would leave a gap in the rig's seqs, which a rig treats as
    /// fatal. So the lease is put back at once, as the next refresh would, and the command
    /// kept again. Returns the connections whose whole session Redis may have lost too.
    fn keep_again_under_restored_leases(
        &mut self,
        held: &[PersistReq],
        kept: &mut [Kept],
    ) -> Vec<ConnId> {
        let missing: Vec<usize> = (0..held.len())
            .filter(|&i| kept.get(i) == Some(&Kept::LeaseMissing))
            .filter(|&i| {
                held.get(i)
                    .is_some_and(|p| self.registry.held_by(&p.rig, p.conn))
            })
            .collect();
        if missing.is_empty() {
            return Vec::new();
        }
        let leases: Vec<(RigId, BootId)> = missing
            .iter()
            .filter_map(|&i| held.get(i).map(|p| (p.rig.clone(), p.boot)))
            .collect::<HashSet<_>>()
            .into_iter()
            .collect();
        let ttl = self.cfg.registry_ttl;
        // A command for such a boot is taken as a sign it holds the rig: fenced, it would
        // leave a gap in the rig's seqs.
        let claims = self.claims(Instant::now(), true);
        let Some(statuses) = self
            .fleet
            .as_mut()
            .and_then(|f| f.refresh(&leases, ttl, &claims))
        else {
            self.release_unkept(&missing, kept);
            return Vec::new();
        };
        // Superseded meanwhile: another broker's now, and the next refresh says so.
        let mut restored: HashSet<&RigId> = HashSet::new();
        let mut ended = Vec::new();
        let me = self.cfg.broker_id.clone();
        for ((rig, boot), status) in leases.iter().zip(statuses) {
            // While the lease was missing, another broker may have held a command for the
            // rig as an offline one; the refresh that put a lease back takes it, and so must
            // this, or the refresh after finds the lease in place and the hold waits out its
            // deadline with the rig connected (review bb119).
            let put_back = !matches!(status, RefreshStatus::Ok | RefreshStatus::Superseded);
            match status {
                RefreshStatus::Superseded | RefreshStatus::Vacant => continue,
                RefreshStatus::Taken { from } => {
                    if from.broker_id != me {
                        ended.push((rig, boot));
                    }
                    self.evict(rig, *boot, &from)
                }
                RefreshStatus::Outlived { .. } => ended.push((rig, boot)),
                RefreshStatus::Ok | RefreshStatus::Restored => {}
            }
            if put_back {
                self.held_unread.insert(rig.clone());
            }
            restored.insert(rig);
        }
        self.report_ended_sessions(&ended);
        let retry: Vec<usize> = missing
            .into_iter()
            .filter(|&i| held.get(i).is_some_and(|p| restored.contains(&p.rig)))
            .collect();
        let Some(results) = self.keep(retry.iter().filter_map(|&i| held.get(i))) else {
            self.release_unkept(&retry, kept);
            return Vec::new();
        };
        for (&i, result) in retry.iter().zip(results) {
            if let Some(k) = kept.get_mut(i) {
                *k = result;
            }
        }
        for _ in &restored {
            self.shared.count("persist", "lease_restored");
        }
        let conns: HashSet<ConnId> = retry
            .iter()
            .filter_map(|&i| held.get(i).map(|p| p.conn))
            .collect();
        conns.into_iter().collect()
    }

    /// Redis went away while a lease was being put back: those commands go out unkept, as
    /// every command does while Redis is away (fenced, they would leave the rig a seq gap).
    fn release_unkept(&mut self, which: &[usize], kept: &mut [Kept]) {
        for &i in which {
            if let Some(k) = kept.get_mut(i) {
                *k = Kept::Unavailable;
            }
        }
    }
}

/// The log of refused control messages that named no `reply_to`: nobody can be told, so an
/// operator trying `PUBLISH` by hand learns why nothing happened only from this line. At most
/// one a second, since whoever may publish on the channel can send them as fast as it likes.
#[derive(Default)]
pub(super) struct UnansweredLog(Throttle);

impl UnansweredLog {
    /// Logs the refusals a line a second held back, once one is due: a burst that stopped
    /// is counted too, not only when the next refusal comes.
    pub(super) fn flush(&mut self, now: Instant) {
        if let Some(n) = self.0.due(now) {
            log::warn!("control messages refused with no reply_to to answer: {n} more since the last such line");
        }
    }

    /// Logs `bad` unless a line went out less than a second ago; true when it did.
    pub(super) fn note(&mut self, now: Instant, bad: &control::Bad) -> bool {
        let Some(n) = self.0.note(now) else {
            return false;
        };
        // Quoted and cut: the rig id and the reason may carry whatever the publisher sent.
        let rig = clip(bad.rig.as_deref().unwrap_or("-"), LOG_CHARS);
        log::warn!(
            "control message refused, no reply_to to answer: {:?} (rig {rig:?}; {} more since the last such line)",
            clip(&bad.why, 4 * LOG_CHARS),
            n - 1
        );
        true
    }
}

/// The command of a fenced persist, as control sent it (its name and args read back from the
/// frame it was to be written as), to be routed again with `left` of its hold.
fn unheld(p: &PersistReq, left: std::time::Duration) -> Option<crate::registry::msg::CommandReq> {
    #[derive(serde::Deserialize)]
    struct Frame {
        name: String,
        args: Box<serde_json::value::RawValue>,
    }
    let frame: Frame = serde_json::from_slice(&p.json).ok()?;
    Some(crate::registry::msg::CommandReq {
        id: p.id.to_string(),
        rig: p.rig.clone(),
        name: frame.name,
        args: crate::args::Args::object(frame.args)?,
        reply: ReplyTo::Event,
        offline_ttl: Some(left),
    })
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use super::*;

    #[test]
    fn unanswered_refusals_are_logged_once_a_second_and_the_rest_counted_into_the_next_line() {
        let bad =
            || control::parse(br#"{"type":"kick","id":"k","rig_id":"r1"}"#, false).unwrap_err();
        assert_eq!(bad().why, "kick needs reply_to");
        let mut log = UnansweredLog::default();
        let t0 = Instant::now();
        assert!(log.note(t0, &bad()));
        assert!(!log.note(t0 + Duration::from_millis(500), &bad()));
        assert!(!log.note(t0 + Duration::from_millis(900), &bad()));
        assert!(log.note(t0 + Duration::from_millis(1000), &bad()));
    }
}
