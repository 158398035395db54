//! The sweep of leases a previous process under this broker id left behind.
//!
//! A broker killed outright leaves its rigs' leases (`rig:<rig_id>` = `<boot>|<broker_id>`) to
//! lapse by `--registry-ttl`. Started again under the same id before then, it listens on its
//! channel once more, so to everyone else those leases read as rigs connected to a live broker
//! that holds none of them. Redis keeps no index of a broker's leases (one more write per
//! hello and per release, for every broker, for this one case), so the process that finds its
//! predecessor did not exit cleanly (`broker.lua`'s "unclean") walks `rig:*` once with `SCAN`,
//! a step at a time, and removes the leases naming its id that it did not write itself
//! (`stale_leases.lua`). A clean exit releases every lease first and says so in the sentinel,
//! so a drained broker's successor sweeps nothing.

use std::time::{Duration, Instant};

use super::errors::refused;
use super::Fleet;
use crate::ids::{BootId, RigId};

/// Keys `SCAN` looks at per step. At 1,000 a step each script call held Redis about 5 ms,
/// where a third of the keys were stale leases, and other clients' p99 went from 0.6 to 8 ms
/// (review bb109); half that holds it half as long.
const STEP_KEYS: usize = 500;
/// Between two steps: 100,000 keys a second at most (bb109 measured 61,000 a second with the
/// larger steps, on a shared machine), so a Redis of three million keys (a million rigs with
/// their sessions) is walked in 30–50 s, about the default `--registry-ttl` of 60 s.
const STEP_EVERY: Duration = Duration::from_millis(5);

/// A sweep under way.
#[derive(Debug)]
pub(crate) struct StaleSweep {
    /// `SCAN`'s cursor for the next step (0 at the start; 0 again after the last step).
    cursor: u64,
    /// Leases removed so far.
    removed: u64,
    started: Instant,
    next_step: Instant,
}

impl Fleet {
    /// The predecessor under this id did not exit cleanly: sweep the leases it left.
    pub(super) fn start_stale_sweep(&mut self) {
        if self.stale_sweep.is_some() {
            return;
        }
        log::info!(
            "redis: the last process under --broker-id {} did not exit cleanly; removing the \
             leases it left for rigs not connected here (they would read as connected here \
             until --registry-ttl)",
            self.broker_id
        );
        let now = Instant::now();
        self.stale_sweep = Some(StaleSweep {
            cursor: 0,
            removed: 0,
            started: now,
            next_step: now,
        });
    }

    /// When the sweep's next step is due: None when no sweep is under way.
    pub(crate) fn stale_sweep_due(&self) -> Option<Instant> {
        self.stale_sweep.as_ref().map(|s| s.next_step)
    }

    /// Whether a sweep is under way (the leases it has not reached yet may be stale).
    pub(crate) fn sweeping(&self) -> bool {
        self.stale_sweep.is_some()
    }

    /// One step of the sweep: the next `SCAN` page of `rig:*`, less the rigs this process
    /// holds (`holds`: connected or parked here), through `stale_leases.lua`. A failed call
    /// leaves the cursor where it was; a `SCAN` cursor outlives the connection it came from.
    pub(crate) fn sweep_stale_step(&mut self, now: Instant, holds: impl Fn(&RigId) -> bool) {
        let Some(sweep) = self.stale_sweep.as_mut() else {
            return;
        };
        if now < sweep.next_step {
            return;
        }
        sweep.next_step = now + STEP_EVERY;
        let cursor = sweep.cursor;
        // Its own subscriber must be there to be counted below.
        if !self.is_subscribed() {
            return;
        }
        let Some(con) = self.con.as_mut() else { return };
        // A second process under this id, started while Redis was out of its reach (so the
        // check at start could not refuse it), wrote `running` too: its leases are live ones
        // (review bb109: 30 connected rigs without a lease until the next refresh).
        let listeners = redis::cmd("PUBSUB")
            .arg("NUMSUB")
            .arg(super::broker_channel(&self.broker_id))
            .query::<(String, i64)>(con);
        match listeners {
            Ok((_, n)) if n > 1 => {
                log::warn!(
                    "redis: another process listens on --broker-id {}'s channel: not sweeping \
                     the leases a previous process left (they may be its)",
                    self.broker_id
                );
                self.stale_sweep = None;
                return;
            }
            Ok(_) => {}
            // An ACL without PUBSUB: the check at start was skipped as well.
            Err(e) if refused(&e) => {}
            Err(e) => return self.call_failed(&e),
        }
        let page = redis::cmd("SCAN")
            .arg(cursor)
            .arg("MATCH")
            .arg("rig:*")
            .arg("COUNT")
            .arg(STEP_KEYS)
            .query::<(u64, Vec<String>)>(con);
        let (next, keys) = match page {
            Ok(page) => page,
            Err(e) => return self.call_failed(&e),
        };
        let theirs: Vec<&String> = keys
            .iter()
            .filter(|key| {
                key.strip_prefix("rig:")
                    .and_then(RigId::parse)
                    .is_none_or(|rig| !holds(&rig))
            })
            .collect();
        let mut removed = 0;
        if !theirs.is_empty() {
            let mut call = self.stale_leases.prepare_invoke();
            for key in &theirs {
                call.key(key.as_str());
            }
            call.arg(&self.broker_id);
            match call.invoke::<Vec<String>>(con) {
                Ok(gone) => {
                    removed = (gone.len() / 2) as u64;
                    // Bounded by the page: taken by the bridge at its next pass.
                    self.stale_gone
                        .extend(gone.chunks(2).filter_map(|pair| match pair {
                            [key, lease] => {
                                let rig = RigId::parse(key.strip_prefix("rig:")?)?;
                                let boot = BootId::parse(lease.split_once('|')?.0)?;
                                Some((rig, boot))
                            }
                            _ => None,
                        }));
                }
                Err(e) => return self.call_failed(&e),
            }
        }
        self.stale_removed += removed;
        let Some(sweep) = self.stale_sweep.as_mut() else {
            return;
        };
        sweep.cursor = next;
        sweep.removed += removed;
        if next == 0 {
            log::info!(
                "redis: removed {} leases the last process under --broker-id {} left, in {} ms",
                sweep.removed,
                self.broker_id,
                sweep.started.elapsed().as_millis()
            );
            self.stale_sweep = None;
        }
    }
}
