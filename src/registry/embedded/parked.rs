//! The memory of parked sessions, a job apart from who owns which rig: what a rig that went
//! keeps here (its seq, unacked commands and ids awaiting results) until it comes back with the
//! same boot or the park window ends, which of those copies Redis may never have kept, and the
//! byte bound past which the oldest lose their commands. `mod.rs` decides when a session is
//! parked or resumed; this file keeps it.

use std::time::Instant;

use super::Embedded;
use crate::ids::{BootId, RigId, Seq};
use crate::registry::msg::{ClosedSession, Recall, SeqCommand};
use crate::registry::sessions::Unkept;

#[derive(Debug)]
pub(super) struct Parked {
    pub(super) boot: BootId,
    pub(super) next_seq: Seq,
    pub(super) carried: Vec<SeqCommand>,
    /// None when the session remembers nothing past its commands (most do: no allocation).
    pub(super) recall: Option<Box<Recall>>,
    /// Fleet mode: the seqs delivered while Redis was away and not put back since, for
    /// `rekeep.lua` to tell the commands only this copy knows of.
    unkept: Unkept,
    at: Instant,
}

impl Parked {
    fn bytes(&self) -> usize {
        self.carried.iter().map(|c| c.json.len()).sum::<usize>()
            + self.recall.as_ref().map_or(0, |r| r.bytes())
    }
}

/// Bytes of commands parked sessions may keep for their rigs' return. A rig's session may hold
/// 24 MiB (`crate::worker::queues`), so a few hundred slow rigs dropping at once could
/// otherwise park gigabytes for the park window.
pub const MAX_PARKED_BYTES: usize = 1 << 30;

impl Embedded {
    /// Logs the parked sessions a line a second held back, once one is due.
    pub(crate) fn flush_parked_drop_log(&mut self, now: Instant) {
        if let Some(n) = self.parked_drop_log.due(now) {
            log::warn!(
                "{n} more parked sessions lost commands kept for their rigs' return since the \
                 last such line (parked/dropped counts the commands)"
            );
        }
    }

    /// Commands parked sessions dropped for [`MAX_PARKED_BYTES`] since the last call.
    pub fn take_parked_dropped(&mut self) -> u64 {
        std::mem::take(&mut self.parked_dropped)
    }

    /// Whether any session is parked here.
    pub fn has_parked(&self) -> bool {
        !self.parked.is_empty()
    }

    /// Every session parked here for a disconnected rig, with its boot (to be put back into
    /// Redis after Redis lost them or missed commands delivered while it was away).
    pub fn parked_sessions(&self) -> Vec<(RigId, BootId)> {
        self.parked
            .iter()
            .map(|(r, p)| (r.clone(), p.boot))
            .collect()
    }

    /// Records that `rig`'s session of `boot`, if it is the one parked, holds the commands
    /// `unkept` that Redis may never have kept (none, once it has put them back).
    pub fn mark_parked_unkept(&mut self, rig: &RigId, boot: BootId, unkept: Unkept) {
        if let Some(p) = self.parked.get_mut(rig).filter(|p| p.boot == boot) {
            p.unkept = unkept;
        }
    }

    /// Drops commands `seqs` from `rig`'s session of `boot`, if it is the one parked: Redis
    /// published them `lost` as the session went back.
    pub fn forget_parked(&mut self, rig: &RigId, boot: BootId, seqs: &[Seq]) {
        let Some(p) = self.parked.get_mut(rig).filter(|p| p.boot == boot) else {
            return;
        };
        let before = p.bytes();
        p.carried.retain(|c| !seqs.contains(&c.seq));
        self.parked_bytes = self.parked_bytes.saturating_sub(before - p.bytes());
    }

    /// Redis lost keys (it restarted empty, or was flushed): every parked session's commands
    /// are now ones Redis may not hold, as if delivered while it was away.
    pub fn mark_all_parked_unkept(&mut self) {
        for p in self.parked.values_mut() {
            let top = p.carried.iter().map(|c| c.seq).max().unwrap_or(Seq(0));
            p.unkept = p.unkept.union(Unkept::up_to(top));
        }
    }

    /// The parked sessions holding commands Redis may never have kept.
    pub fn parked_unkept_sessions(&self) -> Vec<(RigId, BootId)> {
        self.parked
            .iter()
            .filter(|(_, p)| !p.unkept.is_none())
            .map(|(r, p)| (r.clone(), p.boot))
            .collect()
    }

    /// The seqs of `rig`'s parked session Redis may never have kept.
    pub fn parked_unkept(&self, rig: &RigId) -> Unkept {
        self.parked.get(rig).map_or(Unkept::NONE, |p| p.unkept)
    }

    /// [`Self::parked_unkept`], for `rig`'s session of `boot` alone (none when another boot's
    /// is parked).
    pub fn parked_unkept_of(&self, rig: &RigId, boot: BootId) -> Unkept {
        self.parked
            .get(rig)
            .filter(|p| p.boot == boot)
            .map_or(Unkept::NONE, |p| p.unkept)
    }

    /// Adds `seq` to the commands of `rig`'s session of `boot`, if it is the one parked, that
    /// Redis may never have kept.
    pub fn note_parked_unkept(&mut self, rig: &RigId, boot: BootId, seq: Seq) {
        if let Some(p) = self.parked.get_mut(rig).filter(|p| p.boot == boot) {
            p.unkept = p.unkept.with(seq);
        }
    }

    /// How many commands the parked sessions carry, how many sessions carry any, and the
    /// first `ids` of their ids (rig: id), for the log at exit.
    pub fn parked_commands(&self, ids: usize) -> (usize, usize, Vec<String>) {
        let carrying = self.parked.iter().filter(|(_, p)| !p.carried.is_empty());
        let (mut n, mut sessions, mut first) = (0, 0, Vec::new());
        for (rig, p) in carrying {
            n += p.carried.len();
            sessions += 1;
            for c in p.carried.iter().take(ids.saturating_sub(first.len())) {
                let id = crate::log_text::clip(&c.id, crate::log_text::LOG_CHARS);
                first.push(format!("{rig}: {id}"));
            }
        }
        (n, sessions, first)
    }

    /// `rig`'s parked session: its boot, next seq and the unacked commands it carries.
    pub fn parked(&self, rig: &RigId) -> Option<(BootId, Seq, &[SeqCommand])> {
        self.parked
            .get(rig)
            .map(|p| (p.boot, p.next_seq, &p.carried[..]))
    }

    /// Drops the commands of `rig`'s parked session of `boot`, keeping its seq: Redis reported
    /// them `expired` as the session lapsed there (fleet mode), and a copy here would give
    /// them to the rig back with the same boot after all, under seqs Redis no longer knows.
    pub fn drop_parked_commands(&mut self, rig: &RigId, boot: BootId) {
        let Some(p) = self.parked.get_mut(rig).filter(|p| p.boot == boot) else {
            return;
        };
        let before = p.bytes();
        p.carried = Vec::new();
        let after = p.bytes();
        self.parked_bytes = self.parked_bytes.saturating_sub(before - after);
    }

    /// Forgets parked sessions older than the park window; returns those that still carried
    /// commands (rig, boot, commands), which no resume will give back now.
    pub fn expire(&mut self, now: Instant) -> Vec<(RigId, BootId, Vec<SeqCommand>)> {
        self.ended.expire(now, self.park_for);
        let mut lapsed = Vec::new();
        while let Some((at, _)) = self.parked_order.front() {
            if now.duration_since(*at) < self.park_for {
                break;
            }
            if let Some((at, rig)) = self.parked_order.pop_front() {
                if self.parked.get(&rig).is_some_and(|p| p.at == at) {
                    if let Some(p) = self.unpark(&rig).filter(|p| !p.carried.is_empty()) {
                        lapsed.push((rig, p.boot, p.carried));
                    }
                }
            }
        }
        lapsed
    }

    pub(super) fn unpark(&mut self, rig: &RigId) -> Option<Parked> {
        let p = self.parked.remove(rig)?;
        self.parked_bytes = self.parked_bytes.saturating_sub(p.bytes());
        Some(p)
    }

    pub(super) fn park(&mut self, session: ClosedSession, now: Instant) {
        let ClosedSession {
            rig,
            boot,
            next_seq,
            carried,
            recall,
        } = session;
        let p = Parked {
            boot,
            next_seq,
            carried,
            recall,
            unkept: Unkept::NONE,
            at: now,
        };
        self.parked_bytes += p.bytes();
        if let Some(old) = self.parked.insert(rig.clone(), p) {
            self.parked_bytes = self.parked_bytes.saturating_sub(old.bytes());
        }
        self.parked_order.push_back((now, rig));
        self.drop_oldest_parked_commands();
    }

    /// Past [`MAX_PARKED_BYTES`], the oldest parked sessions lose their commands (counted), and
    /// keep their seq, so that a resume never numbers a command with a seq the rig has seen.
    fn drop_oldest_parked_commands(&mut self) {
        let mut order = self.parked_order.iter();
        while self.parked_bytes > self.max_parked_bytes {
            let Some((at, rig)) = order.next() else {
                break;
            };
            let Some(p) = self.parked.get_mut(rig).filter(|p| p.at == *at) else {
                continue;
            };
            self.parked_bytes = self.parked_bytes.saturating_sub(p.bytes());
            let dropped = std::mem::take(&mut p.carried);
            // The ids awaiting results go with them: a result reported without its id still
            // names the rig, boot and seq that its ack event joined to the id.
            p.recall = p.recall.take().filter(|r| r.last_ack_ms != 0).map(|mut r| {
                r.results = Vec::new();
                r
            });
            self.parked_dropped += dropped.len() as u64;
            if dropped.is_empty() {
                continue;
            }
            if let Some(n) = self.parked_drop_log.note(Instant::now()) {
                log::warn!(
                    "rig {rig}: {} commands kept for its return dropped: parked sessions hold {} bytes ({n} sessions lost theirs since the last such line; parked/dropped counts the commands)",
                    dropped.len(),
                    self.max_parked_bytes
                );
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use super::super::test_support::*;
    use super::*;
    use crate::registry::msg::Verdict;

    /// A parked session's ids awaiting results count against the parked bytes and go with its
    /// commands past the bound; the last ack's time stays, as the seq does.
    #[test]
    fn a_parked_sessions_recall_comes_back_and_counts_against_the_bound() {
        let mut r = Embedded::new(Duration::from_secs(60), 4);
        let now = Instant::now();
        let recall = Recall {
            results: vec![(Seq(2), "c2".into())],
            last_ack: Seq(2),
            last_ack_ms: 1_700_000_000_000,
        };
        let up = boot(1);
        let recall_of = |r: &mut Embedded, c: u64| match verdict_of(
            &r.hello(conn(c), rig(), up, vec![]),
            conn(c),
        ) {
            Some(Verdict::Accept { recall, .. }) => recall.as_deref().cloned().unwrap_or_default(),
            other => panic!("{other:?}"),
        };
        let park = |r: &mut Embedded, c: u64| {
            let recall = Some(Box::new(recall.clone()));
            r.closed(conn(c), session(rig(), up, Seq(3), vec![], recall), now)
        };
        r.hello(conn(1), rig(), up, vec![]);
        park(&mut r, 1);
        assert_eq!(r.parked_bytes, recall.bytes());
        assert_eq!(recall_of(&mut r, 2), recall);
        assert_eq!(r.parked_bytes, 0);

        r.max_parked_bytes = recall.bytes() - 1;
        park(&mut r, 2);
        assert_eq!(r.parked_bytes, 0);
        let kept = Recall {
            results: vec![],
            ..recall
        };
        assert_eq!(recall_of(&mut r, 3), kept, "the time stays");
    }

    #[test]
    fn parked_commands_past_the_byte_bound_go_oldest_first_and_seqs_stay() {
        let mut r = Embedded::new(Duration::from_secs(60), 4);
        r.max_parked_bytes = 250;
        let now = Instant::now();
        let cmds = |n: u64| -> Vec<SeqCommand> {
            (1..=n)
                .map(|seq| SeqCommand::for_test(seq, 50, false))
                .collect()
        };
        let (a, b, up) = (
            RigId::parse("a").unwrap(),
            RigId::parse("b").unwrap(),
            boot(1),
        );
        r.hello(conn(1), a.clone(), up, vec![]);
        r.hello(conn(2), b.clone(), up, vec![]);
        r.closed(conn(1), session(a.clone(), up, Seq(4), cmds(3), None), now);
        assert_eq!((r.parked_bytes, r.take_parked_dropped()), (150, 0));
        // 150 + 200 > 250: the older session, a's, gives up its commands.
        r.closed(conn(2), session(b.clone(), up, Seq(5), cmds(4), None), now);
        assert_eq!((r.parked_bytes, r.take_parked_dropped()), (200, 3));
        let back = r.hello(conn(3), a, up, vec![]);
        match verdict_of(&back, conn(3)) {
            Some(Verdict::Accept {
                next_seq, carried, ..
            }) => assert_eq!((*next_seq, carried.len()), (Seq(4), 0)),
            other => panic!("{other:?}"),
        }
        let back = r.hello(conn(4), b, up, vec![]);
        match verdict_of(&back, conn(4)) {
            Some(Verdict::Accept { carried, .. }) => assert_eq!(carried.len(), 4),
            other => panic!("{other:?}"),
        }
        assert_eq!(r.parked_bytes, 0);
    }

    /// Redis lost keys: every parked copy's commands count as never kept, up to its last.
    #[test]
    fn a_parked_copy_counts_as_unkept_once_redis_lost_keys() {
        let mut r = Embedded::new(Duration::from_secs(60), 4);
        let now = Instant::now();
        let b = boot(1);
        r.hello(conn(1), rig(), b, vec![]);
        let carried = vec![
            SeqCommand::for_test(2, 4, false),
            SeqCommand::for_test(3, 4, false),
        ];
        r.closed(conn(1), session(rig(), b, Seq(4), carried, None), now);
        assert_eq!(r.parked_unkept(&rig()), Unkept::NONE);
        assert!(r.parked_unkept_sessions().is_empty());
        r.mark_all_parked_unkept();
        assert_eq!(r.parked_unkept(&rig()), Unkept::up_to(Seq(3)));
        assert_eq!(r.parked_unkept_sessions(), [(rig(), b)]);
    }

    /// Commands Redis published `lost` leave the parked copy, and their bytes with them.
    #[test]
    fn a_parked_copy_forgets_what_redis_published_lost() {
        let mut r = Embedded::new(Duration::from_secs(60), 4);
        let b = boot(1);
        r.hello(conn(1), rig(), b, vec![]);
        let carried = vec![
            SeqCommand::for_test(2, 4, false),
            SeqCommand::for_test(3, 4, false),
        ];
        r.closed(
            conn(1),
            session(rig(), b, Seq(4), carried, None),
            Instant::now(),
        );
        let bytes = r.parked_bytes;
        r.forget_parked(&rig(), boot(2), &[Seq(2)]);
        assert_eq!(r.parked_bytes, bytes, "another boot's copy is not this one");
        r.forget_parked(&rig(), b, &[Seq(2)]);
        let (_, _, carried) = r.parked(&rig()).expect("parked");
        assert_eq!(carried.iter().map(|c| c.seq).collect::<Vec<_>>(), [Seq(3)]);
        assert_eq!(r.parked_bytes, bytes / 2);
    }

    #[test]
    fn parked_session_resumes_then_expires() {
        let mut r = Embedded::new(Duration::from_secs(60), 4);
        let now = Instant::now();
        let b = boot(100);
        r.hello(conn(1), rig(), b, vec![]);
        let (_, released) = r.closed(conn(1), session(rig(), b, Seq(4), vec![], None), now);
        assert!(released);
        assert!(r.is_empty());
        let a = r.hello(conn(2), rig(), b, vec![]);
        assert!(matches!(
            verdict_of(&a, conn(2)),
            Some(Verdict::Accept {
                next_seq: Seq(4),
                resumed: true,
                ..
            })
        ));
        r.closed(conn(2), session(rig(), b, Seq(6), vec![], None), now);
        r.expire(now + Duration::from_secs(61));
        let a = r.hello(conn(3), rig(), b, vec![]);
        assert!(matches!(
            verdict_of(&a, conn(3)),
            Some(Verdict::Accept {
                next_seq: Seq(1),
                resumed: false,
                ..
            })
        ));
    }
}
