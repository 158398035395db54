//! Standalone's lifecycle events, kept for control to read through the admin API.
//!
//! In fleet mode every event goes to `fleetlink:events`. A broker without Redis has no channel
//! to publish on, and its admin API is the control plane: without this, a command's `result`,
//! and the `rig_rebooted`, `expired` and `offline_delivered` reports, would reach nobody. So
//! the bridge keeps the latest events here, numbered from 1, and `GET /v1/events?after=N`
//! pages through them. Bounded by count and bytes: the oldest go first, and a reader that fell
//! behind is told how many it missed.

use std::collections::VecDeque;

/// Events kept at most.
pub const MAX_EVENTS: usize = 10_000;
/// Bytes of events kept at most (a rig's `result` may be `--max-message` long).
pub const MAX_BYTES: usize = 16 << 20;
/// Events one page holds at most.
pub const PAGE_MAX: usize = 1_000;

/// The latest events, oldest first.
#[derive(Debug, Default)]
pub struct EventLog {
    events: VecDeque<Box<[u8]>>,
    bytes: usize,
    /// The number of the newest event (0: none yet).
    last: u64,
}

/// One page of the log, borrowed from it.
#[derive(Debug, PartialEq, Eq)]
pub struct Page<'a> {
    /// The events after the one asked for, oldest first (each a JSON object's bytes).
    pub events: Vec<&'a [u8]>,
    /// The number of the last event in `events`, or the one asked for when there are none:
    /// what the next request's `after` is.
    pub next: u64,
    /// Events after the one asked for that were dropped before they were read.
    pub missed: u64,
}

impl EventLog {
    /// Keeps `event` as the newest, dropping the oldest past the bounds.
    pub fn push(&mut self, event: Box<[u8]>) {
        self.last += 1;
        self.bytes += event.len();
        self.events.push_back(event);
        while self.events.len() > MAX_EVENTS || (self.bytes > MAX_BYTES && self.events.len() > 1) {
            let Some(old) = self.events.pop_front() else {
                break;
            };
            self.bytes -= old.len();
        }
    }

    /// Up to `limit` events after event `after` (0: from the oldest kept).
    pub fn page(&self, after: u64, limit: usize) -> Page<'_> {
        // Numbers of the kept events: first..=last.
        let first = self.last + 1 - self.events.len() as u64;
        // An `after` past the newest (a reader from before a restart) starts over from now.
        let after = if after > self.last { self.last } else { after };
        let missed = first.saturating_sub(after + 1);
        let skip = (after + 1).saturating_sub(first) as usize;
        let events: Vec<&[u8]> = self
            .events
            .iter()
            .skip(skip)
            .take(limit.min(PAGE_MAX))
            .map(|e| &e[..])
            .collect();
        let next = after.max(first.saturating_sub(1)) + events.len() as u64;
        Page {
            events,
            next,
            missed,
        }
    }

    /// The length of [`Self::page_json`]'s answer, worked out without building it: an admin
    /// connection reserves it against `--admin-answer-bytes` before the page is built.
    pub fn page_json_len(&self, after: u64, limit: usize) -> usize {
        let page = self.page(after, limit);
        let digits = |n: u64| n.checked_ilog10().map_or(1, |d| d as usize + 1);
        let commas = page.events.len().saturating_sub(1);
        r#"{"next":,"missed":,"events":[]}"#.len()
            + digits(page.next)
            + digits(page.missed)
            + commas
            + page.events.iter().map(|e| e.len()).sum::<usize>()
    }

    /// The page as the admin API's JSON: `{"next","missed","events":[…]}`.
    pub fn page_json(&self, after: u64, limit: usize) -> Vec<u8> {
        let page = self.page(after, limit);
        let mut out = format!(
            r#"{{"next":{},"missed":{},"events":["#,
            page.next, page.missed
        )
        .into_bytes();
        for (i, ev) in page.events.iter().enumerate() {
            if i > 0 {
                out.push(b',');
            }
            out.extend_from_slice(ev);
        }
        out.extend_from_slice(b"]}");
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ev(n: u64) -> Box<[u8]> {
        format!(r#"{{"n":{n}}}"#).into_bytes().into_boxed_slice()
    }

    #[test]
    fn a_pages_length_is_known_before_it_is_built() {
        let mut log = EventLog::default();
        for after in [0, 5, 12] {
            assert_eq!(log.page_json_len(after, 10), log.page_json(after, 10).len());
        }
        for n in 0..12_345 {
            log.push(ev(n));
        }
        for (after, limit) in [
            (0, 1000),
            (2_344, 1),
            (12_000, 1000),
            (99_999, 5),
            (12_345, 3),
        ] {
            assert_eq!(
                log.page_json_len(after, limit),
                log.page_json(after, limit).len(),
                "after {after}, limit {limit}"
            );
        }
    }

    fn numbers(p: &Page) -> Vec<String> {
        p.events
            .iter()
            .map(|e| String::from_utf8_lossy(e).into_owned())
            .collect()
    }

    #[test]
    fn pages_follow_on_from_the_last_one_read() {
        let mut log = EventLog::default();
        assert_eq!(
            log.page(0, 10),
            Page {
                events: vec![],
                next: 0,
                missed: 0
            }
        );
        for n in 1..=5 {
            log.push(ev(n));
        }
        let p = log.page(0, 2);
        assert_eq!(
            (numbers(&p), p.next, p.missed),
            (vec![r#"{"n":1}"#.into(), r#"{"n":2}"#.into()], 2, 0)
        );
        let p = log.page(p.next, 10);
        assert_eq!((p.events.len(), p.next, p.missed), (3, 5, 0));
        let p = log.page(p.next, 10);
        assert_eq!((p.events.len(), p.next, p.missed), (0, 5, 0), "nothing new");
        log.push(ev(6));
        assert_eq!(numbers(&log.page(5, 10)), vec![r#"{"n":6}"#.to_string()]);
        // A reader from before a restart, ahead of this log: from now on.
        assert_eq!(
            log.page(99, 10),
            Page {
                events: vec![],
                next: 6,
                missed: 0
            }
        );
    }

    #[test]
    fn the_oldest_go_first_and_a_late_reader_is_told_how_many_it_missed() {
        let mut log = EventLog::default();
        for n in 1..=(MAX_EVENTS as u64 + 3) {
            log.push(ev(n));
        }
        let p = log.page(0, 1);
        assert_eq!(p.missed, 3, "events 1-3 are gone");
        assert_eq!(numbers(&p), vec![r#"{"n":4}"#.to_string()]);
        assert_eq!(p.next, 4);
        let p = log.page(2, 1);
        assert_eq!((p.missed, p.next), (1, 4));
        assert_eq!(log.page(3, 1).missed, 0);
        assert_eq!(
            log.page(0, PAGE_MAX + 5).events.len(),
            PAGE_MAX,
            "a page is bounded"
        );
        // Bytes bound it too, but the newest is always kept.
        let mut log = EventLog::default();
        log.push(vec![b'x'; MAX_BYTES / 2].into_boxed_slice());
        log.push(vec![b'y'; MAX_BYTES / 2 + 1].into_boxed_slice());
        let p = log.page(0, 10);
        assert_eq!((p.events.len(), p.missed, p.next), (1, 1, 2));
        log.push(vec![b'z'; MAX_BYTES + 1].into_boxed_slice());
        assert_eq!(
            log.page(0, 10).events.len(),
            1,
            "one larger than the bound stays alone"
        );
    }

    #[test]
    fn a_page_is_json() {
        let mut log = EventLog::default();
        log.push(ev(1));
        log.push(ev(2));
        let v: serde_json::Value = serde_json::from_slice(&log.page_json(0, 10)).unwrap();
        assert_eq!(
            v,
            serde_json::json!({"next": 2, "missed": 0, "events": [{"n": 1}, {"n": 2}]})
        );
        let v: serde_json::Value = serde_json::from_slice(&log.page_json(2, 10)).unwrap();
        assert_eq!(v, serde_json::json!({"next": 2, "missed": 0, "events": []}));
    }
}
