//! Commands for rigs that are not connected: held in Redis (fleet mode) or here, delivered at
//! the rig's welcome, reported `expired` at their deadline.

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
        let entry = Held {
            id: req.id,
            name: req.name,
            args: req.args,
            deadline_ms: unix_ms() + ttl.as_millis() as u64,
            reply_to: match &req.reply {
                ReplyTo::Channel(c) => Some(c.clone()),
                _ => None,
            },
        };
        let size = entry.size();
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
        let body = if stored {
            self.shared.count("offline", "held");
            let body = json!({"id": entry.id, "ok": true, "rig_id": rig.as_str(), "queued": true});
            let at = Instant::now() + ttl;
            if here {
                let key = self.deadlines.add(at, rig.clone(), entry.stub(), size);
                self.held.push(&rig, key, entry);
            } else {
                // Kept whole: its removal from Redis at the deadline names it exactly.
                self.deadlines.add(at, rig.clone(), entry, size);
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

    /// At a rig's welcome: the commands held for it (`held`, taken from Redis, then any held
    /// here while Redis was away), in order, behind the verdict; expired ones are reported
    /// instead.
    pub(super) fn deliver_held(
        &mut self,
        conn: ConnId,
        rig: &RigId,
        mut held: Vec<Held>,
        actions: &mut Vec<Action>,
    ) {
        for (key, h) in self.held.take(rig) {
            // Delivered: nothing left to expire, and the copy need not wait for the deadline.
            self.deadlines.forget(key);
            held.push(h);
        }
        let now = unix_ms();
        for h in held {
            if h.expired(now) {
                self.report_expired(rig, &h.id);
                continue;
            }
            self.shared.count("offline", "delivered");
            let req = CommandReq {
                id: h.id,
                rig: rig.clone(),
                name: h.name,
                args: h.args,
                reply: ReplyTo::Event,
                offline_ttl: None,
            };
            actions.push(Action::Core(
                conn,
                ToCore::Command {
                    conn,
                    req: Box::new(req),
                    direct: false,
                },
            ));
        }
    }

    fn report_expired(&mut self, rig: &RigId, id: &str) {
        self.shared.count("offline", "expired");
        let ev = crate::events::expired(&self.cfg.broker_id, rig, id);
        self.publish(fleet::EVENTS.to_string(), &ev);
    }

    /// Commands this broker held whose deadline passed: reported `expired` if still held.
    pub(super) fn expire_held(&mut self, now: Instant) {
        let due = self.deadlines.due(now);
        if due.is_empty() {
            return;
        }
        // A fan-out held for many rigs expires at once: one round trip removes it all.
        let in_redis = self.fleet.as_mut().and_then(|f| {
            let entries: Vec<(&RigId, &Held)> = due.iter().map(|(r, e)| (r, e)).collect();
            f.offline_remove_many(&entries)
        });
        let mut in_redis = in_redis.map(Vec::into_iter);
        for (rig, entry) in due {
            let from_redis = in_redis.as_mut().and_then(Iterator::next).unwrap_or(false);
            if from_redis || self.held.remove(&rig, &entry.id) {
                self.report_expired(&rig, &entry.id);
            }
        }
    }
}
