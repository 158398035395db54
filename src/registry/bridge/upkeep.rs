//! The bridge's timers: expiring held commands and stale registry entries, closing late
//! broadcasts, and in fleet mode the canary, the heartbeat, lease refreshes and session
//! touches.

use std::collections::{HashMap, HashSet};
use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

use serde_json::json;

use super::shared::{mono_ms, unix_ms, CANARY_STALE};
use super::{Bridge, ALL_UNKEPT};
use crate::heap_trim;
use crate::ids::{BootId, RigId};
use crate::registry::fleet;
use crate::registry::msg::ToCore;
use crate::registry::scripts::{Claim, RefreshStatus};

/// Most rigs named in `offline:for:<broker_id>` taken up per refresh: more wait for the next one.
const HELD_FOR_ME_PER_TICK: usize = 1_000;

/// How often the broker publishes a canary on its own channel.
const CANARY_EVERY: Duration = Duration::from_secs(1);
/// The `broker:<id>` key: refreshed every 10 s with a 30 s TTL (CONTRACT.md §3,
/// [`fleet::HEARTBEAT_TTL`]).
const HEARTBEAT_EVERY: Duration = Duration::from_secs(10);

impl Bridge {
    /// Once a second: the counts that once-a-second log lines held back since their last
    /// line, for bursts that stopped (the next occurrence would have carried them).
    fn flush_logs(&mut self, now: Instant) {
        self.unanswered.flush(now);
        self.registry.flush_parked_drop_log(now);
        if let Some(n) = self.twin_log.due(now) {
            log::error!(
                "another broker runs with --broker-id {}: {n} more of its canaries since the \
                 last line",
                self.cfg.broker_id
            );
        }
    }

    pub(super) fn timers(&mut self, now: Instant) {
        self.expire_held(now);
        // Before the check for Redis below: with Redis away each due one is asked again a
        // second later, where left due it would wake the bridge at once, again and again.
        self.check_lapses(now);
        if now >= self.next_expire {
            let lapsed = self.registry.expire(now);
            self.report_lapsed(lapsed);
            self.next_expire = now + Duration::from_secs(1);
            self.flush_logs(now);
            // On the expiry timer, so that it never wakes the bridge by itself.
            if now >= self.next_trim {
                self.next_trim = now + heap_trim::EVERY;
                self.registry.shrink_idle();
                heap_trim::collect();
            }
        }
        let late: Vec<u64> = self
            .broadcasts
            .iter()
            .filter(|(_, b)| b.deadline <= now)
            .map(|(k, _)| *k)
            .collect();
        for agg in late {
            self.finish_broadcast(agg, true);
        }
        if self.fleet.as_ref().is_none_or(|f| !f.is_up()) {
            return;
        }
        if now >= self.next_canary {
            self.next_canary = now + CANARY_EVERY;
            self.report_handed_deadlines();
            // Readiness fails on a late canary while every call still succeeds (a path to
            // Redis that trickles, a subscription read falling behind): said once, or the
            // 503 has no trace in the log.
            let last = self.shared.canary_at_ms.load(Ordering::Relaxed);
            let age = mono_ms().saturating_sub(last);
            if last != 0 && age > CANARY_STALE.as_millis() as u64 && !self.canary_late {
                self.canary_late = true;
                log::warn!(
                    "redis: no canary back for {age} ms, though Redis answers calls: the subscription or the path to Redis is slow; /readyz fails until one comes back"
                );
            }
            let canary = json!({
                "type": "canary",
                "broker_id": self.cfg.broker_id,
                "instance": self.instance,
                "at": unix_ms(),
            });
            self.publish(fleet::broker_channel(&self.cfg.broker_id), &canary);
        }
        let draining = self.shared.draining.load(Ordering::Relaxed);
        if draining != self.heartbeat_draining {
            self.next_heartbeat = now;
        }
        // A parked session lasts --registry-ttl, which may be shorter than the heartbeat's
        // 10 s: a flush is checked for as soon as a release hints at one.
        if self
            .fleet
            .as_mut()
            .is_some_and(|f| std::mem::take(&mut f.release_missed))
        {
            self.next_heartbeat = now;
        }
        if now >= self.next_heartbeat {
            self.next_heartbeat = now + HEARTBEAT_EVERY;
            self.heartbeat_draining = draining;
            let blob = json!({
                "broker_id": self.cfg.broker_id, "address": self.cfg.listen.to_string(),
                "cores": self.cfg.cores, "started_at": self.started_at, "connections": self.registry.len(),
                "draining": draining,
            });
            let mut lost = false;
            if let Some(f) = self.fleet.as_mut() {
                f.heartbeat(&blob.to_string(), fleet::HEARTBEAT_TTL);
                lost = std::mem::take(&mut f.keys_lost);
            }
            let counted = std::mem::take(&mut self.keys_loss_counted);
            if lost && !counted {
                // The commands held in Redis went with the keys: one not found at its
                // deadline is reported, not taken for delivered.
                self.deadlines.keys_lost();
            }
            // Redis lost its keys while it stayed up. A broker with rigs connected learns it
            // from a restored lease at its next refresh too; one with none, only here.
            if lost && !self.cfg.session_ttl.is_zero() {
                // What Redis kept of the sessions here may be gone with the keys: each
                // copy's commands count as never kept, so that a copy meeting another
                // broker's session adds them rather than take them for acked.
                self.registry.mark_all_parked_unkept();
                // `sess:lapses` may be gone with them: sessions are named again.
                self.lapse_count = self.lapse_count.wrapping_add(1).max(1);
                for key in self.registry.live_sessions() {
                    // Whatever Redis kept of it before is gone too.
                    self.unkept_high.insert(key, ALL_UNKEPT);
                }
                self.queue_parked_rekeeps();
            }
        }
        if now >= self.next_refresh {
            self.next_refresh = now + self.cfg.registry_refresh;
            self.refresh();
        }
        if let Some(f) = self.fleet.as_mut() {
            let registry = &self.registry;
            f.sweep_stale_step(now, |rig| {
                registry.boot_of(rig).is_some() || registry.parked(rig).is_some()
            });
        }
        if now >= self.next_touch {
            self.next_touch = now + touch_every(self.cfg.session_ttl);
            self.touch_sessions();
        }
    }

    /// `--session-ttl` counts from when the rig was last seen, and a connected rig is seen
    /// all along; commands do not extend it (`persist.lua`). Without this, a connected rig's
    /// session (its `next` and unacked commands) would expire, and a resume after this broker
    /// died would find nothing.
    ///
    /// A session found missing lost its commands in Redis with the rig still here (a key
    /// deleted or evicted on its own; or never kept, decided here while Redis was away): the
    /// core holding the rig puts its copy back, as after an empty restart.
    fn touch_sessions(&mut self) {
        if self.cfg.session_ttl.is_zero() {
            return;
        }
        let sessions = self.registry.live_sessions();
        let Some(f) = self.fleet.as_mut() else {
            return;
        };
        let touched = f.touch_sessions(&sessions);
        self.shared.count_n(
            "session",
            "pointer_restored",
            touched.pointers_restored as u64,
        );
        for (rig, boot) in touched.missing {
            if self.registry.boot_of(&rig) != Some(boot) {
                continue;
            }
            if let Some(conn) = self.registry.rekeep_from(&rig) {
                self.ask_back_lost_alone(rig, boot);
                self.send_to_core(conn, ToCore::Rekeep { conn });
            }
        }
    }

    /// One batched lease refresh for every rig this broker holds (CONTRACT.md §3).
    fn refresh(&mut self) {
        // Taken here: a failed refresh means Redis is away again, and its return sets it anew.
        let everyone = std::mem::take(&mut self.rekeep_all);
        // Sessions parked here for rigs that disconnected go back too: one that left while
        // Redis was away carries commands Redis never kept, and one that left before an empty
        // restart lived only in Redis and here. Queued even if this refresh fails: the queue
        // waits for Redis, and the next reconnect queues them again in place.
        if everyone && !self.cfg.session_ttl.is_zero() {
            self.rekeep_asked.clear();
            self.queue_parked_rekeeps();
        }
        self.send_ended_alone();
        let entries = self.registry.live_sessions();
        if entries.is_empty() {
            // No rig of it is connected here, but the set is emptied all the same.
            self.take_held_for_me();
            return;
        }
        let ttl = self.cfg.registry_ttl;
        let now = Instant::now();
        if everyone {
            // Waited from this reconnect: an outage within the wait held the newer boot's
            // broker back too (review bb153).
            self.pending_claims
                .values_mut()
                .for_each(|since| *since = now);
        }
        let claims = self.claims(now, false);
        let Some(statuses) = self
            .fleet
            .as_mut()
            .and_then(|f| f.refresh(&entries, ttl, &claims))
        else {
            return;
        };
        // A restored lease without a reconnect: Redis lost keys while it stayed up (FLUSHALL,
        // eviction). The parked sessions and the liveness key went with them, as after an
        // empty restart: put them back now, as a reconnect would. (Not a lease a claim took.)
        let restored = |(e, s): (&(RigId, BootId), &RefreshStatus)| {
            matches!(s, RefreshStatus::Restored | RefreshStatus::Outlived { .. })
                && !claims.contains_key(e)
        };
        if !everyone && entries.iter().zip(&statuses).any(restored) {
            if !self.cfg.session_ttl.is_zero() {
                self.queue_parked_rekeeps();
            }
            self.next_heartbeat = Instant::now();
        }
        // Before their sessions go back: `rekeep.lua` leaves the rig's latest-boot record as
        // it finds it, and that record still names the older boot. Also when the older boot
        // was this broker's own: what it reported of it from here, its parked copy, was
        // removed from Redis or left a tombstone, and the report moves the rig's record to the
        // newer boot, whose own session a later hello must find to report.
        let mut ended: Vec<(&RigId, &BootId)> = entries
            .iter()
            .zip(&statuses)
            .filter(|(_, s)| {
                matches!(
                    s,
                    RefreshStatus::Taken { .. } | RefreshStatus::Outlived { .. }
                )
            })
            .map(|((rig, boot), _)| (rig, boot))
            .collect();
        ended.extend(self.ended_unseen(&entries, &statuses, &claims, everyone, now));
        self.settle_claims(&entries, &statuses, &claims, now);
        self.report_ended_sessions(&ended);
        for ((rig, boot), status) in entries.iter().zip(statuses) {
            // A restored lease means Redis may have lost the session too (it restarted empty);
            // after any reconnect, commands delivered while Redis was away were never kept; a
            // taken one was decided here while Redis was away, so Redis has no session for it.
            // Either way the core holding the rig sends its session back to be kept again.
            let rekeep = match status {
                RefreshStatus::Restored
                | RefreshStatus::Outlived { .. }
                | RefreshStatus::Taken { .. } => true,
                RefreshStatus::Ok => everyone,
                RefreshStatus::Superseded | RefreshStatus::Vacant => false,
            };
            // While its lease was missing, another broker may have held a command for the rig
            // as an offline one (control found no lease, `queue_if_offline`): nothing else
            // would make its connection here look, so it is taken now, as at a hello.
            if matches!(
                status,
                RefreshStatus::Restored
                    | RefreshStatus::Outlived { .. }
                    | RefreshStatus::Taken { .. }
            ) {
                self.held_unread.insert(rig.clone());
            }
            if rekeep && !self.cfg.session_ttl.is_zero() {
                if let Some(conn) = self.registry.rekeep_from(rig) {
                    if everyone {
                        self.rekeep_asked.insert((rig.clone(), *boot));
                    }
                    self.send_to_core(conn, ToCore::Rekeep { conn });
                }
            }
            match status {
                RefreshStatus::Ok => self.shared.count("refresh", "ok"),
                RefreshStatus::Vacant => self.shared.count("refresh", "vacant"),
                RefreshStatus::Restored => self.shared.count("refresh", "restored"),
                RefreshStatus::Outlived { .. } => self.shared.count("refresh", "outlived"),
                RefreshStatus::Taken { from } => {
                    self.shared.count("refresh", "taken");
                    self.evict(rig, *boot, &from);
                }
                RefreshStatus::Superseded => {
                    self.shared.count("refresh", "superseded");
                    // Its session may hold commands delivered while Redis was away: it goes
                    // back as its connection closes (`rekeep.lua` merges it into the rig's
                    // session on the broker that holds the rig now, if that is the same boot's).
                    // So may a hello decided alone whose claim waited.
                    let claimed = claims.contains_key(&(rig.clone(), *boot));
                    if (everyone || claimed) && !self.cfg.session_ttl.is_zero() {
                        self.merge_on_close.insert((rig.clone(), *boot));
                    }
                    let actions = self.registry.supersede(rig, None);
                    self.carry_out(actions);
                }
            }
        }
        self.take_held_for_me();
        if !self.held_unread.is_empty() {
            self.deliver_held_unread();
        }
    }
}

impl Bridge {
    /// Rigs other brokers held commands for as offline ones because this broker, whose lease
    /// held them, was not listening on its channel (reconnecting to Redis; `offline_push.lua`
    /// names them in `offline:for:<broker_id>`). A rig still connected here has its connection
    /// take them, as it takes the rest of a big hold; nothing else would make it look before
    /// its next hello. A rig gone since finds them at that hello.
    fn take_held_for_me(&mut self) {
        let Some(rigs) = self
            .fleet
            .as_mut()
            .and_then(|f| f.held_for_me(HELD_FOR_ME_PER_TICK))
        else {
            return;
        };
        for rig in rigs.iter().filter_map(|r| RigId::parse(r)) {
            if let Some(conn) = self.registry.conn_of(&rig) {
                self.shared.count("offline", "found");
                self.send_to_core(conn, ToCore::HoldFound { conn });
            }
        }
    }

    /// What this refresh asks of the leases of hellos decided alone (`refresh.lua`'s
    /// claims): those pending since a refresh interval and the longest reconnect or more are
    /// taken (by then the newer boot's broker, if up, has refreshed), the others asked.
    /// `hurry` (a command for the rig is waiting): every one is taken, since fenced, that
    /// command would leave a gap in the rig's seqs.
    pub(super) fn claims(&self, now: Instant, hurry: bool) -> HashMap<(RigId, BootId), Claim> {
        let wait = self.cfg.registry_refresh + fleet::LONGEST_RECONNECT;
        let due = |since: &Instant| hurry || now >= *since + wait;
        let first = if hurry { Claim::Take } else { Claim::Ask };
        let alone = self.decided_alone.iter().map(|e| (e.clone(), first));
        let pending = self.pending_claims.iter().map(|(e, since)| {
            let claim = if due(since) { Claim::Take } else { Claim::Ask };
            (e.clone(), claim)
        });
        alone.chain(pending).collect()
    }

    /// Of the hellos decided here while Redis was away whose lease this refresh finds in
    /// place, those whose rig's latest boot on record is another's: its session, or that of
    /// a boot in between on another broker, is reported as the hello would have (what this
    /// broker reported of it from here was removed or left a tombstone, so nothing is
    /// reported twice). Asked at the first refresh after the reconnect (`everyone`), where
    /// the hello's own call reached Redis late and took the lease; and for a pending claim
    /// taken now. An older boot's is reported at once; a newer boot's only once the claim is
    /// due (see `pending_claims`), since that boot may be connected still.
    fn ended_unseen<'a>(
        &mut self,
        entries: &'a [(RigId, BootId)],
        statuses: &[RefreshStatus],
        claims: &HashMap<(RigId, BootId), Claim>,
        everyone: bool,
        now: Instant,
    ) -> Vec<(&'a RigId, &'a BootId)> {
        let alone = match everyone {
            true => std::mem::take(&mut self.decided_alone),
            false => HashSet::new(),
        };
        let unseen: Vec<(&(RigId, BootId), bool)> = entries
            .iter()
            .zip(statuses)
            .filter(|(_, s)| matches!(s, RefreshStatus::Ok))
            .filter_map(|(e, _)| match claims.get(e) {
                Some(Claim::Take) => Some((e, true)),
                Some(Claim::Ask) if alone.contains(e) => Some((e, false)),
                _ => None,
            })
            .collect();
        if unseen.is_empty() {
            return Vec::new();
        }
        let rigs: Vec<&RigId> = unseen.iter().map(|((rig, _), _)| rig).collect();
        let Some(latest) = self.fleet.as_mut().and_then(|f| f.latest_boots(&rigs)) else {
            return Vec::new();
        };
        let mut ended = Vec::new();
        for (((rig, boot), due), latest) in unseen.into_iter().zip(latest) {
            if due {
                self.pending_claims.remove(&(rig.clone(), *boot));
            }
            match latest {
                Some(b) if b < *boot || (b > *boot && due) => ended.push((rig, boot)),
                Some(b) if b > *boot => {
                    self.pending_claims
                        .entry((rig.clone(), *boot))
                        .or_insert(now);
                }
                _ => {}
            }
        }
        ended
    }

    /// After a refresh, the claims of hellos decided alone: one found vacant waits (from
    /// now, if it was not waiting already); one superseded, or taken from another (reported
    /// with the `ended` leases), is settled. One taken that was already in place is settled
    /// by [`Self::ended_unseen`], once it has read the rig's record.
    fn settle_claims(
        &mut self,
        entries: &[(RigId, BootId)],
        statuses: &[RefreshStatus],
        claims: &HashMap<(RigId, BootId), Claim>,
        now: Instant,
    ) {
        for (e, status) in entries.iter().zip(statuses) {
            match (claims.get(e), status) {
                (None, _) => {}
                (Some(_), RefreshStatus::Vacant) => {
                    self.pending_claims.entry(e.clone()).or_insert(now);
                    // Should the rig leave meanwhile, its session goes back to Redis as it
                    // closed (`Closed`), what it was given while Redis was away with it, rather
                    // than wait parked for a reconnect: a resume elsewhere would otherwise not
                    // find those commands, and give their seqs to others (review bb153).
                    self.rekeep_asked.insert(e.clone());
                }
                (Some(_), RefreshStatus::Superseded)
                | (
                    Some(Claim::Take),
                    RefreshStatus::Restored
                    | RefreshStatus::Outlived { .. }
                    | RefreshStatus::Taken { .. },
                ) => {
                    self.pending_claims.remove(e);
                }
                (Some(_), _) => {}
            }
        }
    }

    /// Reports the older sessions these rigs' boots ended while Redis could not say so at
    /// their hellos (a refresh found the lease `Taken` from an older boot, or `Outlived`
    /// one), through `resume.lua` as the hellos would have (CONTRACT.md §5). Their removals
    /// of acked commands go first, so that nothing acked is reported.
    pub(super) fn report_ended_sessions(&mut self, ended: &[(&RigId, &BootId)]) {
        if ended.is_empty() || self.cfg.session_ttl.is_zero() {
            return;
        }
        let ttl = self.cfg.session_ttl;
        let Some(f) = self.fleet.as_mut() else { return };
        f.settle_before_hellos(ended);
        if let Some(n) = f.report_reboots(ended, ttl) {
            self.shared.count_n("resume", "rebooted", n);
        }
    }
}

/// How often connected rigs' sessions get their TTL extended: a few times per TTL, so one
/// late or failed round never lets a session lapse (and at least hourly). With no sessions
/// kept (`--session-ttl 0`) the timer only idles, hourly, rather than waking the bridge.
pub(super) fn touch_every(session_ttl: Duration) -> Duration {
    const HOURLY: Duration = Duration::from_secs(3600);
    if session_ttl.is_zero() {
        return HOURLY;
    }
    (session_ttl / 3).clamp(Duration::from_millis(100), HOURLY)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sessions_are_touched_a_few_times_per_ttl_and_never_busily() {
        let s = Duration::from_secs;
        assert_eq!(touch_every(s(600)), s(200), "the default 10 min TTL");
        assert_eq!(touch_every(s(2)), s(2) / 3);
        assert_eq!(
            touch_every(Duration::from_millis(30)),
            Duration::from_millis(100)
        );
        assert_eq!(touch_every(s(365 * 86_400)), s(3600));
        assert_eq!(
            touch_every(Duration::ZERO),
            s(3600),
            "--session-ttl 0 keeps no session"
        );
    }
}
