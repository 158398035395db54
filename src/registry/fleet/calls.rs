//! The registry and session script calls the bridge waits on: hellos, resumes, lease
//! refreshes, ownership and session reads, commands kept in sessions or held for offline rigs,
//! the heartbeat. Apart from the queued writes because each goes out at once, in one round
//! trip, and the bridge acts on its answer (None: Redis is unavailable, and the broker decides
//! without it), where a queued write needs no answer and waits for its pace.

use std::collections::HashMap;
use std::time::Duration;

use super::Fleet;
use crate::ids::Seq;
use crate::ids::{BootId, RigId};
use crate::registry::lapse_scripts::{Lapse, Sweep};
use crate::registry::offline::{Held, Pushed};
use crate::registry::scripts::{Claim, Heartbeat, HelloOutcome, RefreshStatus};
use crate::registry::sessions::{self, Kept, Persist, Rekeep, RekeepAnswer, Resumed};

impl Fleet {
    /// Runs `hello.lua` for many rigs in one round trip. None when Redis is unavailable.
    pub(crate) fn hello_many(
        &mut self,
        entries: &[(&RigId, &BootId)],
        ttl: Duration,
    ) -> Option<Vec<Result<HelloOutcome, String>>> {
        let con = self.con.as_mut()?;
        let r = self.scripts.hello_many(con, entries, &self.broker_id, ttl);
        let outcomes: Vec<Result<HelloOutcome, String>> = self
            .answered(r)?
            .into_iter()
            .map(|o| o.map_err(|e| e.to_string()))
            .collect();
        // Refused (a full Redis, an ACL): those hellos are decided here; counted and logged
        // like any refused call.
        if let Some(e) = outcomes.iter().find_map(|o| o.as_ref().err().cloned()) {
            self.note_refusal(&e);
        }
        Some(outcomes)
    }

    /// What Redis holds of many rigs' sessions, and the commands held for them while they
    /// were offline (taken), in one round trip each. None when Redis is unavailable; an
    /// entry's own error is a `None` in its place (with the session store off, every entry is
    /// an empty `Resumed`).
    #[allow(clippy::type_complexity)]
    pub(crate) fn resume_many(
        &mut self,
        entries: &[(&RigId, &BootId)],
        ttl: Duration,
        take: usize,
    ) -> Option<(Vec<Option<Resumed>>, Vec<Vec<Held>>)> {
        let con = self.con.as_mut()?;
        let resumed = if ttl.is_zero() {
            Ok(vec![Some(Resumed::default()); entries.len()])
        } else {
            self.sessions
                .resume_many(con, entries, ttl, &self.broker_id)
                .map(|r| r.into_iter().map(Result::ok).collect())
        };
        let unreadable = resumed
            .as_ref()
            .map_or(0, |r| r.iter().filter(|x| x.is_none()).count());
        let rigs: Vec<&RigId> = entries.iter().map(|(r, _)| *r).collect();
        let outcome = resumed.and_then(|r| Ok((r, self.offline.take_many(con, &rigs, take)?)));
        if unreadable > 0 {
            // An entry that failed alone turns its hello away (4503): say so, as for any
            // refused call, or a rig locked out that way leaves no trace.
            let n = entries.len();
            self.note_refusal(&format!("resume: {unreadable} of {n} sessions unreadable"));
        }
        self.answered(outcome)
    }

    /// Runs the sessions of boots this broker took a rig for without Redis (decided while it
    /// was away, their leases taken back from an older boot since) through `resume.lua`, as
    /// their hellos would have: the older boot's session, still recorded as the rig's latest,
    /// has its unacked commands reported `rig_rebooted` and is deleted. What the script finds
    /// of these sessions is not used: the cores hold them, and put them back (`rekeep`) after.
    /// Returns how many commands were reported; None when Redis is unavailable.
    pub(crate) fn report_reboots(
        &mut self,
        entries: &[(&RigId, &BootId)],
        ttl: Duration,
    ) -> Option<u64> {
        let con = self.con.as_mut()?;
        let r = self
            .sessions
            .resume_many(con, entries, ttl, &self.broker_id);
        Some(self.answered(r)?.iter().flatten().map(|r| r.rebooted).sum())
    }

    /// Refreshes the leases of `entries`, those in `claims` by the hello's rule (boots whose
    /// hellos were decided alone: [`crate::registry::scripts::Scripts::refresh_claiming`]).
    /// None when Redis is unavailable.
    pub(crate) fn refresh(
        &mut self,
        entries: &[(RigId, BootId)],
        ttl: Duration,
        claims: &HashMap<(RigId, BootId), Claim>,
    ) -> Option<Vec<RefreshStatus>> {
        let con = self.con.as_mut()?;
        let r = self
            .scripts
            .refresh_claiming(con, entries, &self.broker_id, ttl, claims);
        self.answered(r)
    }

    /// Each rig's latest boot on record (`sessof:<rig>`; None where there is none or it is
    /// not a boot id), in one round trip. None when Redis is unavailable.
    pub(crate) fn latest_boots(&mut self, rigs: &[&RigId]) -> Option<Vec<Option<BootId>>> {
        let con = self.con.as_mut()?;
        let mut mget = redis::cmd("MGET");
        for rig in rigs {
            mget.arg(sessions::pointer_key(rig));
        }
        let r = mget.query::<Vec<Option<String>>>(con);
        Some(
            self.answered(r)?
                .into_iter()
                .map(|b| b.and_then(|b| BootId::parse(&b)))
                .collect(),
        )
    }

    /// For each entry, whether `rig:<rig>` names that very boot on this broker, in one round
    /// trip. None when Redis is unavailable.
    pub(crate) fn owns_many(&mut self, entries: &[(RigId, BootId)]) -> Option<Vec<bool>> {
        let con = self.con.as_mut()?;
        let mut mget = redis::cmd("MGET");
        for (rig, _) in entries {
            mget.arg(crate::registry::scripts::rig_key(rig));
        }
        let r = mget.query::<Vec<Option<String>>>(con);
        let owners = self.answered(r)?;
        Some(
            entries
                .iter()
                .zip(owners)
                .map(|((_, boot), owner)| {
                    owner == Some(crate::registry::scripts::tuple(boot, &self.broker_id))
                })
                .collect(),
        )
    }

    /// Extends these sessions' TTLs to `--session-ttl` (see [`sessions::touch`]). Returns
    /// what Redis no longer had; nothing when the call failed.
    pub(crate) fn touch_sessions(&mut self, sessions: &[(RigId, BootId)]) -> sessions::Touched {
        if self.session_ttl.is_zero() {
            return sessions::Touched::default();
        }
        let Some(con) = self.con.as_mut() else {
            return sessions::Touched::default();
        };
        match sessions::touch(con, sessions, self.session_ttl) {
            Ok(touched) => touched,
            Err(e) => {
                self.call_failed(&e);
                sessions::Touched::default()
            }
        }
    }

    /// Sessions of rigs that left with commands unacked, near the end of their TTL (see
    /// [`LapseScripts::ask_many`](crate::registry::lapse_scripts::LapseScripts::ask_many)).
    /// None when Redis is unavailable.
    pub(crate) fn session_lapses(
        &mut self,
        watched: &[(RigId, BootId)],
    ) -> Option<Vec<Option<Lapse>>> {
        let con = self.con.as_mut()?;
        let r = self
            .lapses
            .ask_many(con, watched, &self.broker_id, self.session_ttl);
        self.answered(r)
    }

    /// Names in Redis sessions of rigs that just left with commands unacked (see
    /// [`LapseScripts::watch`](crate::registry::lapse_scripts::LapseScripts::watch)): how
    /// many could not be named (full) and how many failed. None when Redis is unavailable
    /// (nothing was named).
    /// `held`: sessions of rigs connected here when they were queued (see
    /// [`LapseScripts::name`](crate::registry::lapse_scripts::LapseScripts::name)).
    pub(crate) fn watch_lapses(
        &mut self,
        sessions: &[(RigId, BootId)],
        held: bool,
    ) -> Option<(u64, u64)> {
        let con = self.con.as_mut()?;
        let r = self
            .lapses
            .name(con, sessions, &self.broker_id, self.session_ttl, held);
        self.answered(r)
    }

    /// Asks about the sessions that are due in Redis, whoever named them (see
    /// [`LapseScripts::sweep`](crate::registry::lapse_scripts::LapseScripts::sweep)). None
    /// when Redis is unavailable.
    pub(crate) fn sweep_lapses(&mut self, most: usize) -> Option<Sweep> {
        let con = self.con.as_mut()?;
        let r = self.lapses.sweep(con, &self.broker_id, most);
        self.answered(r)
    }

    /// Puts sessions back (see [`SessionScripts::rekeep`]). None when Redis is unavailable.
    ///
    /// [`SessionScripts::rekeep`]: sessions::SessionScripts::rekeep
    pub(crate) fn rekeep(
        &mut self,
        sessions: &[Rekeep<'_>],
        ttl: Duration,
    ) -> Option<Vec<RekeepAnswer>> {
        let con = self.con.as_mut()?;
        let at = crate::reply::rfc3339(std::time::SystemTime::now());
        let r = self
            .sessions
            .rekeep_answers(con, sessions, &self.broker_id, ttl, &at);
        self.answered(r)
    }

    /// The commands `rig`'s session holds under `seqs` (see [`sessions::read_commands`]).
    /// None when Redis is unavailable.
    pub(crate) fn session_commands(
        &mut self,
        rig: &RigId,
        boot: &BootId,
        seqs: std::ops::Range<u64>,
    ) -> Option<Vec<(Seq, Vec<u8>)>> {
        let con = self.con.as_mut()?;
        let r = sessions::read_commands(con, rig, boot, seqs);
        self.answered(r)
    }

    /// Keeps commands in their sessions (fenced by our leases). None when Redis is unavailable.
    pub(crate) fn persist(&mut self, cmds: &[Persist<'_>], ttl: Duration) -> Option<Vec<Kept>> {
        let con = self.con.as_mut()?;
        let r = self.sessions.persist(con, cmds, &self.broker_id, ttl);
        self.answered(r)
    }

    /// Takes the commands held for `rigs`, in one round trip. None when Redis is unavailable.
    pub(crate) fn offline_take_many(
        &mut self,
        rigs: &[&RigId],
        take: usize,
    ) -> Option<Vec<Vec<Held>>> {
        let con = self.con.as_mut()?;
        let taken = self.offline.take_many(con, rigs, take);
        self.answered(taken)
    }

    /// Puts commands back at the head of `rig`'s hold, or says which live broker holds the rig
    /// now. None when Redis is unavailable.
    pub(crate) fn offline_put_back(
        &mut self,
        rig: &RigId,
        entries: &[Held],
        ttl: Duration,
    ) -> Option<Pushed> {
        let con = self.con.as_mut()?;
        let r = self
            .offline
            .put_back(con, rig, entries, ttl, &self.broker_id);
        self.answered(r)
    }

    /// Takes up to `max` of `rig`'s held commands and `max_bytes` of them (but always the
    /// first), and whether more are left. None when Redis is unavailable.
    pub(crate) fn offline_take_some(
        &mut self,
        rig: &RigId,
        max: usize,
        max_bytes: usize,
    ) -> Option<(Vec<Held>, bool)> {
        let con = self.con.as_mut()?;
        let r = self.offline.take_some(con, rig, max, max_bytes);
        self.answered(r)
    }

    /// Holds commands for offline rigs, in one round trip: per entry, what came of it (`None`
    /// for an entry whose own call failed). None when Redis is unavailable.
    pub(crate) fn offline_push_many(
        &mut self,
        entries: &[(&RigId, &Held, Duration)],
    ) -> Option<Vec<Option<Pushed>>> {
        let con = self.con.as_mut()?;
        let r = self.offline.push_many(con, entries, &self.broker_id);
        Some(self.answered(r)?.into_iter().map(Result::ok).collect())
    }

    /// Removes held commands whose deadline passed, in one round trip (see
    /// [`crate::registry::offline::OfflineScripts::expire_many`]). None when Redis is unavailable.
    pub(crate) fn offline_expire_many(
        &mut self,
        entries: &[(&RigId, &Held)],
    ) -> Option<Vec<Option<bool>>> {
        let con = self.con.as_mut()?;
        let expired = self.offline.expire_many(con, entries);
        self.answered(expired)
    }

    /// Hands the deadlines of commands this exiting broker holds to Redis (see
    /// `OfflineScripts::hand_off`); false when Redis did not take them.
    pub(crate) fn offline_hand_off(&mut self, entries: &[(&RigId, &Held)]) -> bool {
        let Some(con) = self.con.as_mut() else {
            return false;
        };
        let done = self.offline.hand_off(con, entries);
        self.answered(done).is_some()
    }

    /// Reports the deadlines exited brokers handed to Redis that are due; how many were
    /// published `expired`. None when Redis is unavailable.
    pub(crate) fn offline_report_due(&mut self) -> Option<u64> {
        let con = self.con.as_mut()?;
        let reported =
            self.offline
                .report_due(con, &self.broker_id, crate::registry::offline::DUE_CALLS);
        self.answered(reported)
    }

    /// Removes held commands that are still there, in one round trip. None when Redis is
    /// unavailable.
    pub(crate) fn offline_remove_many(&mut self, entries: &[(&RigId, &Held)]) -> Option<Vec<bool>> {
        let con = self.con.as_mut()?;
        let removed = self.offline.remove_many(con, entries);
        self.answered(removed)
    }

    /// Up to `max` rigs other brokers held commands for while this one was not listening on
    /// its channel (`offline:for:<broker_id>`, emptied as read). None when Redis is unavailable.
    pub(crate) fn held_for_me(&mut self, max: usize) -> Option<Vec<String>> {
        let con = self.con.as_mut()?;
        let r = redis::cmd("SPOP")
            .arg(format!("offline:for:{}", self.broker_id))
            .arg(max)
            .query::<Vec<String>>(con);
        self.answered(r)
    }

    /// Whether this broker's sentinel key is still in Redis: gone, Redis lost its keys since
    /// the last heartbeat wrote it (see `Fleet::keys_lost`). None when Redis is unavailable.
    pub(crate) fn sentinel_present(&mut self) -> Option<bool> {
        let con = self.con.as_mut()?;
        let r = redis::cmd("EXISTS")
            .arg(crate::registry::scripts::sentinel_key(&self.broker_id))
            .query::<bool>(con);
        self.answered(r)
    }

    /// Writes the `broker:<id>` liveness key. The process's first one that goes through also
    /// asks whether its predecessor under this id exited cleanly, and starts the sweep of the
    /// leases it left when not (`sweep.rs`).
    pub(crate) fn heartbeat(&mut self, json: &str, ttl: Duration) {
        let Some(con) = self.con.as_mut() else { return };
        let start = !self.heartbeat_went;
        match self
            .scripts
            .broker_heartbeat(con, &self.broker_id, json, ttl, start)
        {
            Ok(seen) => {
                self.heartbeat_went = true;
                if seen == Heartbeat::Unclean {
                    self.start_stale_sweep();
                }
                if std::mem::take(&mut self.refusing) {
                    log::info!("redis: writes go through again; leases and sessions are put back");
                    self.just_connected = true;
                } else {
                    self.keys_lost |= seen == Heartbeat::New;
                }
            }
            Err(e) => self.call_failed(&e),
        }
    }
}
