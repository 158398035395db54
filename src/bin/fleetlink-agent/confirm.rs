//! Results and acks sent and not yet known to be read by the broker. A broker reads a connection in
//! order and answers a ping with a pong carrying its payload, so once the pong to a ping comes
//! back, every result sent before that ping was read. Whatever is unconfirmed when a
//! connection ends, however it ended (broken, closed, after a goaway), goes again on the next:
//! control may see a result twice, never not at all; acks go again after a resumed welcome.
//! Before this, only the last 32 of each went again, and only results of a connection that
//! broke without a close: a broker reading slowly (its per-rig rate limit) had more than that
//! unread, and they were lost with their acks.

use std::collections::VecDeque;

/// Most results kept unconfirmed, and their bytes: a broker that never answers pings must not
/// grow this without bound. Past either, the oldest is given up (and said).
const MAX_RESULTS: usize = 1024;
const MAX_BYTES: usize = 16 << 20;

/// One result as sent: the confirmation round it went out in, its seq, its text.
type Sent = (u64, u64, String);

#[derive(Debug, Default)]
pub(crate) struct Unconfirmed {
    sent: VecDeque<Sent>,
    bytes: usize,
    /// Acks sent, (round, seq), each seq once.
    acks: VecDeque<(u64, u64)>,
    /// The round results sent now belong to; the next ping asks about it.
    round: u64,
    /// The round of the ping on its way, if any: one at a time.
    asked: Option<u64>,
}

impl Unconfirmed {
    /// Notes a result sent; returns the seqs of results given up to stay within bounds.
    pub(crate) fn sent(&mut self, seq: u64, text: String) -> Vec<u64> {
        self.bytes += text.len();
        self.sent.push_back((self.round, seq, text));
        let mut given_up = Vec::new();
        while self.sent.len() > MAX_RESULTS || self.bytes > MAX_BYTES {
            let Some((_, seq, text)) = self.sent.pop_front() else {
                break;
            };
            self.bytes -= text.len();
            given_up.push(seq);
        }
        given_up
    }

    /// Notes an ack sent (a duplicate's ack is the same ack again). Past [`MAX_RESULTS`] the
    /// oldest is given up: an ack costs its command a `rig_rebooted` report at worst.
    pub(crate) fn acked(&mut self, seq: u64) {
        if self.acks.iter().any(|(_, s)| *s == seq) {
            return;
        }
        if self.acks.len() == MAX_RESULTS {
            self.acks.pop_front();
        }
        self.acks.push_back((self.round, seq));
    }

    /// The payload of a ping to send now: results or acks went out since the last one asked
    /// about, and no ping is on its way.
    pub(crate) fn ask(&mut self) -> Option<[u8; 8]> {
        let this_round = |r: Option<u64>| r == Some(self.round);
        let fresh = this_round(self.sent.back().map(|(r, _, _)| *r))
            || this_round(self.acks.back().map(|(r, _)| *r));
        if self.asked.is_some() || !fresh {
            return None;
        }
        let r = self.round;
        self.round += 1;
        self.asked = Some(r);
        Some(r.to_be_bytes())
    }

    /// A pong came: the results of its round and before were read. A pong of anything else
    /// (unsolicited, or another payload) confirms nothing.
    pub(crate) fn pong(&mut self, payload: &[u8]) {
        let Ok(bytes) = <[u8; 8]>::try_from(payload) else {
            return;
        };
        let r = u64::from_be_bytes(bytes);
        if self.asked != Some(r) {
            return;
        }
        self.asked = None;
        while self.sent.front().is_some_and(|(round, _, _)| *round <= r) {
            if let Some((_, _, text)) = self.sent.pop_front() {
                self.bytes -= text.len();
            }
        }
        while self.acks.front().is_some_and(|(round, _)| *round <= r) {
            self.acks.pop_front();
        }
    }

    /// The connection ended: the results not confirmed, oldest first, as (seq, text), and the
    /// seqs of the acks not confirmed; the next connection starts asking afresh.
    pub(crate) fn take(&mut self) -> (Vec<(u64, String)>, Vec<u64>) {
        self.asked = None;
        self.bytes = 0;
        let results = self
            .sent
            .drain(..)
            .map(|(_, seq, text)| (seq, text))
            .collect();
        let acks = self.acks.drain(..).map(|(_, seq)| seq).collect();
        (results, acks)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_pong_confirms_what_went_before_its_ping_and_nothing_after() {
        let mut u = Unconfirmed::default();
        assert_eq!(u.ask(), None, "nothing sent, nothing to ask");
        u.sent(1, "r1".into());
        u.sent(2, "r2".into());
        let first = u.ask().expect("a ping");
        assert_eq!(u.ask(), None, "one ping at a time");
        u.sent(3, "r3".into());
        u.pong(b"other");
        u.pong(&first);
        assert_eq!(
            u.ask().map(u64::from_be_bytes),
            Some(1),
            "3 is asked about next"
        );
        let (left, _) = u.take();
        assert_eq!(left, vec![(3, "r3".to_string())]);
        assert_eq!(u.take(), (vec![], vec![]));
    }

    #[test]
    fn acks_are_confirmed_as_results_are() {
        let mut u = Unconfirmed::default();
        u.acked(1);
        u.acked(1);
        let ping = u.ask().expect("an ack went out");
        u.acked(2);
        u.pong(&ping);
        assert_eq!(u.take(), (vec![], vec![2]));
    }

    #[test]
    fn a_connection_that_ends_unconfirmed_gives_everything_back() {
        let mut u = Unconfirmed::default();
        for seq in 1..=100 {
            assert!(u.sent(seq, format!("r{seq}")).is_empty());
        }
        assert!(u.ask().is_some());
        let (left, _) = u.take();
        assert_eq!(left.len(), 100);
        assert_eq!(left.first().map(|l| l.0), Some(1));
        // The ping of the ended connection confirms nothing on the next.
        u.sent(101, "r101".into());
        u.pong(&0u64.to_be_bytes());
        assert_eq!(u.take().0.len(), 1);
    }

    #[test]
    fn unconfirmed_results_are_bounded_and_the_oldest_given_up_said() {
        let mut u = Unconfirmed::default();
        let mut given_up = Vec::new();
        for seq in 1..=(MAX_RESULTS as u64 + 2) {
            given_up.extend(u.sent(seq, "r".into()));
        }
        assert_eq!(given_up, vec![1, 2]);
        let big = "x".repeat(MAX_BYTES / 2 + 1);
        let mut u = Unconfirmed::default();
        assert!(u.sent(1, big.clone()).is_empty());
        assert_eq!(u.sent(2, big), vec![1]);
    }
}
