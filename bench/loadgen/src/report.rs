//! What a worker counts while it runs (`Counters`), what it ships to the parent when done
//! (`WorkerReport`, mergeable) and the JSON the user gets (`FinalReport`).

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicU64, Ordering::Relaxed};
use std::sync::Mutex;

use serde::{Deserialize, Serialize};

use crate::hist::{Histogram, Summary};

/// Live counters of one worker process, shared by all its rig tasks.
#[derive(Debug, Default)]
pub struct Counters {
    /// Rigs this worker owns.
    pub total: u64,
    /// Websockets currently open (upgraded, not yet closed).
    pub open: AtomicU64,
    /// Rigs that got a welcome at least once.
    pub welcomed: AtomicU64,
    /// Rigs that gave up before any welcome.
    pub failed: AtomicU64,
    pub retries_503: AtomicU64,
    pub retries_4503: AtomicU64,
    /// Welcomed rigs whose connection later ended for a reason other than our own stop.
    pub dropped: AtomicU64,
    pub commands: AtomicU64,
    pub acks: AtomicU64,
    pub goaways: AtomicU64,
    /// Welcomes after the first one (`--reconnect`).
    pub reconnects: AtomicU64,
    /// Of those, welcomes with `resumed: true`.
    pub resumed: AtomicU64,
    /// Reconnects answered `resumed: false` although the rig had seen commands: the broker lost
    /// the session (its unacked commands are gone; fleetlink-fe numbers on above `last_seq`).
    pub sessions_restarted: AtomicU64,
    /// Commands run: the first receipt of a seq in the rig's session.
    pub executed: AtomicU64,
    /// Commands whose seq had already been seen (replays after a resume): acked, not run.
    pub duplicates: AtomicU64,
    /// Commands whose seq skipped over seqs never received, and how many were skipped.
    pub seq_gaps: AtomicU64,
    pub seqs_missing: AtomicU64,
    pub detail: Mutex<Detail>,
}

/// The parts that are not plain counters.
#[derive(Debug, Default)]
pub struct Detail {
    pub failed_by_reason: BTreeMap<String, u64>,
    pub close_codes: BTreeMap<String, u64>,
    pub latency_us: Histogram,
    pub handshake_us: Histogram,
    pub first_command_unix_us: Option<u64>,
    pub last_command_unix_us: Option<u64>,
    /// Failed reconnect attempts by reason (`--reconnect`; they are retried).
    pub reconnect_failures_by_reason: BTreeMap<String, u64>,
    /// `reconnect_after_ms` of every goaway received.
    pub goaway_delay_ms: Histogram,
    /// From the end of a connection to the welcome of the next one (`--reconnect`).
    pub reconnect_gap_us: Histogram,
    /// Re-welcomes by unix time in ms, floored to the timeline bucket.
    pub reconnect_timeline: BTreeMap<u64, u64>,
}

impl Counters {
    pub fn new(total: usize) -> Self {
        Self {
            total: total as u64,
            ..Self::default()
        }
    }

    /// Welcomed + failed = total: every rig has reached its ramp outcome.
    pub fn ramp_settled(&self) -> bool {
        self.welcomed.load(Relaxed) + self.failed.load(Relaxed) >= self.total
    }

    pub fn fail(&self, reason: &str) {
        self.failed.fetch_add(1, Relaxed);
        *self
            .lock()
            .failed_by_reason
            .entry(reason.to_string())
            .or_insert(0) += 1;
    }

    pub fn close_code(&self, code: &str) {
        *self.lock().close_codes.entry(code.to_string()).or_insert(0) += 1;
    }

    /// Notes a received command: its receive time and, if stamped, its one-way latency.
    pub fn command(&self, now_us: u64, sent_at_us: Option<u64>) {
        self.commands.fetch_add(1, Relaxed);
        let mut d = self.lock();
        d.first_command_unix_us.get_or_insert(now_us);
        d.last_command_unix_us = Some(now_us);
        if let Some(sent) = sent_at_us {
            d.latency_us.record(now_us.saturating_sub(sent));
        }
    }

    /// Notes a failed reconnect attempt (it will be retried).
    pub fn reconnect_fail(&self, reason: &str) {
        *self
            .lock()
            .reconnect_failures_by_reason
            .entry(reason.to_string())
            .or_insert(0) += 1;
    }

    /// Notes a re-welcome: when (unix ms, floored to `bucket_ms`) and how long after the end of
    /// the previous connection.
    pub fn rewelcome(&self, resumed: bool, now_unix_ms: u64, bucket_ms: u64, gap_us: u64) {
        self.reconnects.fetch_add(1, Relaxed);
        if resumed {
            self.resumed.fetch_add(1, Relaxed);
        }
        let bucket = now_unix_ms - now_unix_ms % bucket_ms.max(1);
        let mut d = self.lock();
        *d.reconnect_timeline.entry(bucket).or_insert(0) += 1;
        d.reconnect_gap_us.record(gap_us);
    }

    pub fn lock(&self) -> std::sync::MutexGuard<'_, Detail> {
        // A poisoned lock only means a rig task panicked mid-update; the counts are still usable.
        self.detail.lock().unwrap_or_else(|e| e.into_inner())
    }

    pub fn progress(&self) -> Progress {
        Progress {
            total: self.total,
            open: self.open.load(Relaxed),
            welcomed: self.welcomed.load(Relaxed),
            failed: self.failed.load(Relaxed),
            retries_503: self.retries_503.load(Relaxed) + self.retries_4503.load(Relaxed),
            commands: self.commands.load(Relaxed),
        }
    }

    pub fn report(&self) -> WorkerReport {
        let d = self.lock();
        WorkerReport {
            rigs: self.total,
            welcomed: self.welcomed.load(Relaxed),
            failed: self.failed.load(Relaxed),
            failed_by_reason: d.failed_by_reason.clone(),
            retries_503: self.retries_503.load(Relaxed),
            retries_4503: self.retries_4503.load(Relaxed),
            dropped_after_welcome: self.dropped.load(Relaxed),
            commands_received: self.commands.load(Relaxed),
            acks_sent: self.acks.load(Relaxed),
            goaways: self.goaways.load(Relaxed),
            close_codes: d.close_codes.clone(),
            latency_us: d.latency_us.clone(),
            handshake_us: d.handshake_us.clone(),
            first_command_unix_us: d.first_command_unix_us,
            last_command_unix_us: d.last_command_unix_us,
            reconnects: self.reconnects.load(Relaxed),
            resumed: self.resumed.load(Relaxed),
            sessions_restarted: self.sessions_restarted.load(Relaxed),
            executed: self.executed.load(Relaxed),
            duplicates: self.duplicates.load(Relaxed),
            seq_gaps: self.seq_gaps.load(Relaxed),
            seqs_missing: self.seqs_missing.load(Relaxed),
            reconnect_failures_by_reason: d.reconnect_failures_by_reason.clone(),
            goaway_delay_ms: d.goaway_delay_ms.clone(),
            reconnect_gap_us: d.reconnect_gap_us.clone(),
            reconnect_timeline: d.reconnect_timeline.iter().map(|(&k, &v)| (k, v)).collect(),
        }
    }
}

/// A snapshot for progress lines.
#[derive(Debug, Clone, Copy, Default, Serialize, Deserialize, PartialEq, Eq)]
pub struct Progress {
    pub total: u64,
    pub open: u64,
    pub welcomed: u64,
    pub failed: u64,
    pub retries_503: u64,
    /// Commands received so far (lets the parent end a hold at `--until-commands`).
    #[serde(default)]
    pub commands: u64,
}

impl Progress {
    pub fn settled(&self) -> bool {
        self.welcomed + self.failed >= self.total
    }

    pub fn add(&mut self, o: &Progress) {
        self.total += o.total;
        self.open += o.open;
        self.welcomed += o.welcomed;
        self.failed += o.failed;
        self.retries_503 += o.retries_503;
        self.commands += o.commands;
    }
}

/// Everything one worker measured; mergeable without loss (histograms travel whole).
#[derive(Debug, Clone, Default, Serialize, Deserialize, PartialEq)]
pub struct WorkerReport {
    pub rigs: u64,
    pub welcomed: u64,
    pub failed: u64,
    pub failed_by_reason: BTreeMap<String, u64>,
    pub retries_503: u64,
    pub retries_4503: u64,
    pub dropped_after_welcome: u64,
    pub commands_received: u64,
    pub acks_sent: u64,
    pub goaways: u64,
    pub close_codes: BTreeMap<String, u64>,
    pub latency_us: Histogram,
    pub handshake_us: Histogram,
    pub first_command_unix_us: Option<u64>,
    pub last_command_unix_us: Option<u64>,
    #[serde(default)]
    pub reconnects: u64,
    #[serde(default)]
    pub resumed: u64,
    #[serde(default)]
    pub sessions_restarted: u64,
    #[serde(default)]
    pub executed: u64,
    #[serde(default)]
    pub duplicates: u64,
    #[serde(default)]
    pub seq_gaps: u64,
    #[serde(default)]
    pub seqs_missing: u64,
    #[serde(default)]
    pub reconnect_failures_by_reason: BTreeMap<String, u64>,
    #[serde(default)]
    pub goaway_delay_ms: Histogram,
    #[serde(default)]
    pub reconnect_gap_us: Histogram,
    /// (unix ms bucket, re-welcomes), sorted. Pairs, not a map: integer map keys do not survive
    /// serde's buffering of the internally tagged worker messages.
    #[serde(default)]
    pub reconnect_timeline: Vec<(u64, u64)>,
}

/// Adds sorted `(key, count)` pairs into `into`, keeping it sorted.
pub fn add_timeline(into: &mut Vec<(u64, u64)>, from: &[(u64, u64)]) {
    let mut m: BTreeMap<u64, u64> = into.iter().copied().collect();
    add_counts(&mut m, from.iter().map(|(k, v)| (k, v)));
    *into = m.into_iter().collect();
}

/// Adds every `(key, count)` of `from` into `into`.
fn add_counts<'a, K: Ord + Clone + 'a>(
    into: &mut BTreeMap<K, u64>,
    from: impl IntoIterator<Item = (&'a K, &'a u64)>,
) {
    for (k, v) in from {
        *into.entry(k.clone()).or_insert(0) += v;
    }
}

impl WorkerReport {
    pub fn merge(&mut self, o: &WorkerReport) {
        self.rigs += o.rigs;
        self.welcomed += o.welcomed;
        self.failed += o.failed;
        add_counts(&mut self.failed_by_reason, &o.failed_by_reason);
        self.retries_503 += o.retries_503;
        self.retries_4503 += o.retries_4503;
        self.dropped_after_welcome += o.dropped_after_welcome;
        self.commands_received += o.commands_received;
        self.acks_sent += o.acks_sent;
        self.goaways += o.goaways;
        add_counts(&mut self.close_codes, &o.close_codes);
        self.latency_us.merge(&o.latency_us);
        self.handshake_us.merge(&o.handshake_us);
        self.first_command_unix_us = match (self.first_command_unix_us, o.first_command_unix_us) {
            (Some(a), Some(b)) => Some(a.min(b)),
            (a, b) => a.or(b),
        };
        self.last_command_unix_us = self.last_command_unix_us.max(o.last_command_unix_us);
        self.reconnects += o.reconnects;
        self.resumed += o.resumed;
        self.sessions_restarted += o.sessions_restarted;
        self.executed += o.executed;
        self.duplicates += o.duplicates;
        self.seq_gaps += o.seq_gaps;
        self.seqs_missing += o.seqs_missing;
        add_counts(
            &mut self.reconnect_failures_by_reason,
            &o.reconnect_failures_by_reason,
        );
        self.goaway_delay_ms.merge(&o.goaway_delay_ms);
        self.reconnect_gap_us.merge(&o.reconnect_gap_us);
        add_timeline(&mut self.reconnect_timeline, &o.reconnect_timeline);
    }
}

/// The report file: run facts, merged counts and latency summaries (microseconds).
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct FinalReport {
    pub url: String,
    pub rigs: u64,
    pub start_index: u64,
    pub procs: u64,
    pub sources: u64,
    /// Whether every rig was welcomed (the ALL_WELCOMED line was printed).
    pub all_welcomed: bool,
    /// Start to the last welcome (or to the last ramp outcome if some failed).
    pub ramp_ms: Option<u64>,
    pub elapsed_ms: u64,
    /// `hold_elapsed`, `until_commands`, `max_time`, `signal`, `workers_gone`.
    pub exit_reason: String,
    /// Child processes that ended without a report (crash, kill).
    pub children_lost: u64,
    pub welcomed: u64,
    pub failed: u64,
    pub failed_by_reason: BTreeMap<String, u64>,
    pub retries_503: u64,
    pub retries_4503: u64,
    pub dropped_after_welcome: u64,
    pub commands_received: u64,
    pub acks_sent: u64,
    pub goaways: u64,
    pub close_codes: BTreeMap<String, u64>,
    /// Publisher stamp (`args.sent_at_us`) to receipt, per command.
    pub latency_us: Summary,
    /// TCP connect start to welcome, per successful attempt.
    pub handshake_us: Summary,
    pub first_command_unix_us: Option<u64>,
    pub last_command_unix_us: Option<u64>,
    /// `--reconnect`: welcomes after the first, of which `resumed: true`.
    pub reconnects: u64,
    pub resumed: u64,
    /// Reconnects answered `resumed: false` after commands had been seen (session lost).
    pub sessions_restarted: u64,
    /// Failed reconnect attempts (retried), by reason.
    pub reconnect_failures_by_reason: BTreeMap<String, u64>,
    /// Commands run (first receipt of each seq), replays dropped, seq gaps and seqs skipped.
    pub executed: u64,
    pub duplicates: u64,
    pub seq_gaps: u64,
    pub seqs_missing: u64,
    /// `reconnect_after_ms` of the goaways received.
    pub goaway_delay_ms: Summary,
    /// End of a connection to the welcome of the next (µs).
    pub reconnect_gap_us: Summary,
    /// Re-welcomes per `timeline_bucket_ms`, as `[unix_ms, count]` pairs.
    pub timeline_bucket_ms: u64,
    pub reconnect_timeline: Vec<(u64, u64)>,
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn timelines_add_per_bucket() {
        let mut t = vec![(0, 1), (20, 2)];
        add_timeline(&mut t, &[(10, 1), (20, 3)]);
        assert_eq!(t, [(0, 1), (10, 1), (20, 5)]);
    }

    #[test]
    fn merge_adds_and_keeps_extremes() {
        let a = Counters::new(2);
        a.welcomed.fetch_add(2, Relaxed);
        a.command(100, Some(90));
        a.close_code("4410");
        let b = Counters::new(3);
        b.welcomed.fetch_add(2, Relaxed);
        b.fail("connect_refused");
        b.command(50, Some(45));
        b.command(200, None);
        b.close_code("4410");
        assert!(a.ramp_settled() && b.ramp_settled());
        let mut r = a.report();
        r.merge(&b.report());
        assert_eq!(
            (r.rigs, r.welcomed, r.failed, r.commands_received),
            (5, 4, 1, 3)
        );
        assert_eq!(r.close_codes["4410"], 2);
        assert_eq!(r.failed_by_reason["connect_refused"], 1);
        assert_eq!(r.latency_us.count(), 2);
        assert_eq!(
            (r.first_command_unix_us, r.last_command_unix_us),
            (Some(50), Some(200))
        );
    }
}
