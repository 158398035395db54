//! Rig-level figures by the `--group-label` value (CONTRACT.md §6: aggregated by that value,
//! never one series per rig): welcomed rigs, their commands by result, their closes by code
//! and their ack latency. A session holds its group's slot from welcome to close, so the hot
//! path counts through an index, never by hashing the label again.

use std::collections::{BTreeMap, HashMap, VecDeque};
use std::fmt::Write as _;

use super::counting::{ACK_BUCKETS_MS, CLOSE_CODES};
use super::render::{ack_histogram, escape, family};

/// Distinct `--group-label` values one core counts apart; more share [`OTHER_GROUP`].
pub const MAX_GROUPS: usize = 1000;
/// The series rigs beyond [`MAX_GROUPS`] values are counted in.
pub const OTHER_GROUP: &str = "(other)";

/// Command outcomes counted per group, in the order of their `result` label values.
#[derive(Clone, Copy, Debug)]
pub enum GroupCount {
    /// Taken and numbered for the rig.
    Enqueued,
    /// Written to the rig's socket.
    Written,
    /// Acked by the rig.
    Acked,
    /// Refused `rig_unresponsive`: the rig's outbox or session was full.
    OutboxFull,
}

/// `result` label values of `fleetlink_group_commands_total`, in [`GroupCount`] order.
const GROUP_RESULTS: [&str; 4] = ["enqueued", "written", "acked", "outbox_full"];

/// A session's place in its core's table of groups; [`GroupSlot::NONE`] before its welcome.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct GroupSlot(u16);

impl GroupSlot {
    /// Not (yet) counted in any group.
    pub const NONE: GroupSlot = GroupSlot(u16::MAX);
}

/// One value's figures on one core.
#[derive(Debug, Clone, Default)]
pub struct GroupFigures {
    /// Welcomed rigs now.
    pub rigs: u64,
    /// Commands by [`GroupCount`].
    pub commands: [u64; GROUP_RESULTS.len()],
    /// Closes in [`CLOSE_CODES`] order, then other.
    pub closes: [u64; CLOSE_CODES.len() + 1],
    /// Ack latency buckets, then +Inf.
    pub ack_buckets: [u64; ACK_BUCKETS_MS.len() + 1],
    /// Sum of ack latencies in µs.
    pub ack_sum_us: u64,
}

impl GroupFigures {
    fn add(&mut self, other: &GroupFigures) {
        self.rigs += other.rigs;
        let pairs = [
            (&mut self.commands[..], &other.commands[..]),
            (&mut self.closes[..], &other.closes[..]),
            (&mut self.ack_buckets[..], &other.ack_buckets[..]),
        ];
        for (mine, theirs) in pairs {
            for (m, t) in mine.iter_mut().zip(theirs) {
                *m += t;
            }
        }
        self.ack_sum_us = self.ack_sum_us.saturating_add(other.ack_sum_us);
    }
}

#[derive(Debug)]
struct Slot {
    name: Box<str>,
    figures: GroupFigures,
    /// On the idle list (its last rig left): never listed twice, so a value whose rigs come
    /// and go does not grow the list.
    idle: bool,
}

/// One core's groups. A value keeps its slot, and its counters, after its last rig leaves, so
/// they never go back; only when [`MAX_GROUPS`] values are listed does a new value take over
/// the slot of one without rigs (its counters start again, which Prometheus reads as a reset).
#[derive(Debug, Default)]
pub(super) struct GroupTable {
    index: HashMap<Box<str>, u16>,
    slots: Vec<Slot>,
    /// Slots whose last rig left, the longest ago first.
    idle: VecDeque<u16>,
}

impl GroupTable {
    /// A welcomed rig joined value `g`.
    pub(super) fn join(&mut self, g: &str) -> GroupSlot {
        let slot = match self.index.get(g) {
            Some(&i) => i,
            None => self.take_slot(g),
        };
        if let Some(s) = self.slots.get_mut(usize::from(slot)) {
            s.figures.rigs += 1;
        }
        GroupSlot(slot)
    }

    /// A slot for a value not listed: a new one, an idle one taken over, or the overflow's.
    fn take_slot(&mut self, g: &str) -> u16 {
        let listed = self.slots.len() - usize::from(self.index.contains_key(OTHER_GROUP));
        if listed < MAX_GROUPS || g == OTHER_GROUP {
            return self.push(g);
        }
        while let Some(i) = self.idle.pop_front() {
            let Some(s) = self.slots.get_mut(usize::from(i)) else {
                continue;
            };
            s.idle = false;
            if s.figures.rigs == 0 {
                let old = std::mem::replace(&mut s.name, g.into());
                s.figures = GroupFigures::default();
                self.index.remove(&old);
                self.index.insert(g.into(), i);
                return i;
            }
        }
        match self.index.get(OTHER_GROUP) {
            Some(&i) => i,
            None => self.push(OTHER_GROUP),
        }
    }

    fn push(&mut self, g: &str) -> u16 {
        // MAX_GROUPS + 1 slots at most, far below u16::MAX (GroupSlot::NONE).
        let i = self.slots.len() as u16;
        self.slots.push(Slot {
            name: g.into(),
            figures: GroupFigures::default(),
            idle: false,
        });
        self.index.insert(g.into(), i);
        i
    }

    /// A welcomed rig counted in `slot` left.
    pub(super) fn leave(&mut self, slot: GroupSlot) {
        let Some(s) = self.slots.get_mut(usize::from(slot.0)) else {
            return;
        };
        s.figures.rigs = s.figures.rigs.saturating_sub(1);
        if s.figures.rigs == 0 && !s.idle && &*s.name != OTHER_GROUP {
            s.idle = true;
            self.idle.push_back(slot.0);
        }
    }

    /// The figures of `slot`, if it is one.
    pub(super) fn figures(&mut self, slot: GroupSlot) -> Option<&mut GroupFigures> {
        self.slots
            .get_mut(usize::from(slot.0))
            .map(|s| &mut s.figures)
    }

    /// Every listed value and its figures.
    pub(super) fn snapshot(&self) -> Vec<(String, GroupFigures)> {
        self.slots
            .iter()
            .map(|s| (s.name.to_string(), s.figures.clone()))
            .collect()
    }
}

/// Counts `c` in `f`'s commands.
pub(super) fn count(f: &mut GroupFigures, c: GroupCount) {
    f.commands[c as usize] += 1;
}

/// Renders the group families, each value's figures summed over the cores.
pub(super) fn render_groups<'a>(
    out: &mut String,
    cores: impl Iterator<Item = &'a [(String, GroupFigures)]>,
) {
    let mut groups: BTreeMap<&str, GroupFigures> = BTreeMap::new();
    for core in cores {
        for (g, f) in core {
            groups.entry(g).or_default().add(f);
        }
    }
    // A value without rigs drops out of the gauge (the rigs that named it are gone), and keeps
    // its counters.
    family(out, "fleetlink_rigs", "gauge");
    for (g, f) in groups.iter().filter(|(_, f)| f.rigs > 0) {
        let _ = writeln!(out, "fleetlink_rigs{{group=\"{}\"}} {}", escape(g), f.rigs);
    }
    let name = "fleetlink_group_commands_total";
    family(out, name, "counter");
    for (g, f) in &groups {
        let g = escape(g);
        for (result, n) in GROUP_RESULTS.iter().zip(f.commands) {
            let _ = writeln!(out, "{name}{{group=\"{g}\",result=\"{result}\"}} {n}");
        }
    }
    let name = "fleetlink_group_closes_total";
    family(out, name, "counter");
    for (g, f) in &groups {
        let g = escape(g);
        for (i, n) in f.closes.iter().enumerate().filter(|(_, n)| **n > 0) {
            let code = CLOSE_CODES
                .get(i)
                .map_or("other".to_string(), |c| c.to_string());
            let _ = writeln!(out, "{name}{{group=\"{g}\",code=\"{code}\"}} {n}");
        }
    }
    let name = "fleetlink_group_ack_latency_seconds";
    family(out, name, "histogram");
    for (g, f) in groups
        .iter()
        .filter(|(_, f)| f.ack_buckets.iter().any(|n| *n > 0))
    {
        let labels = format!("group=\"{}\"", escape(g));
        ack_histogram(out, name, &labels, &f.ack_buckets, f.ack_sum_us);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn values_beyond_the_cap_share_the_overflow_until_a_listed_value_has_no_rigs() {
        let mut t = GroupTable::default();
        let slots: Vec<_> = (0..MAX_GROUPS).map(|i| t.join(&format!("g{i}"))).collect();
        let late = t.join("late");
        assert_eq!(t.slots[usize::from(late.0)].name.as_ref(), OTHER_GROUP);
        assert_eq!(t.join("g0"), slots[0], "a listed value keeps its slot");
        assert_eq!(
            t.join(OTHER_GROUP),
            late,
            "a rig naming (other) counts there too"
        );
        // g1's last rig leaves: its counters stay while nothing needs the slot...
        if let Some(f) = t.figures(slots[1]) {
            count(f, GroupCount::Acked);
        }
        t.leave(slots[1]);
        t.join("g1");
        t.leave(slots[1]);
        assert_eq!(
            t.idle,
            [slots[1].0],
            "listed idle once, however often it empties"
        );
        let snap = t.snapshot();
        let g1 = snap
            .iter()
            .find(|(g, _)| g == "g1")
            .map(|(_, f)| f.commands);
        assert_eq!(g1, Some([0, 0, 1, 0]));
        // ...and a new value takes it over once the cap is reached, starting from zero.
        let newer = t.join("newer");
        assert_eq!(newer, slots[1]);
        assert!(!t.index.contains_key("g1"));
        assert_eq!(
            t.figures(newer).map(|f| (f.rigs, f.commands)),
            Some((1, [0; 4]))
        );
        assert_eq!(t.join("newest"), late, "no idle slot left: the overflow");
        assert_eq!(t.slots.len(), MAX_GROUPS + 1);
    }

    #[test]
    fn renders_each_value_summed_over_cores_and_drops_it_from_the_gauge_without_rigs() {
        let mut a = GroupTable::default();
        let mut b = GroupTable::default();
        let sa = a.join("lab \"a\"");
        let sb = b.join("lab \"a\"");
        let gone = b.join("gone");
        let mark = |f: Option<&mut GroupFigures>| {
            if let Some(f) = f {
                count(f, GroupCount::Written);
                f.ack_buckets[1] += 1;
                f.ack_sum_us += 2_000;
                f.closes[CLOSE_CODES.len()] += 1;
            }
        };
        mark(a.figures(sa));
        mark(b.figures(sb));
        mark(b.figures(gone));
        b.leave(gone);
        let (sa, sb) = (a.snapshot(), b.snapshot());
        let mut out = String::new();
        render_groups(&mut out, [&sa[..], &sb[..]].into_iter());
        assert!(out.contains("fleetlink_rigs{group=\"lab \\\"a\\\"\"} 2\n"));
        assert!(!out.contains("fleetlink_rigs{group=\"gone\"}"));
        assert!(out.contains(
            "fleetlink_group_commands_total{group=\"lab \\\"a\\\"\",result=\"written\"} 2\n"
        ));
        assert!(
            out.contains("fleetlink_group_commands_total{group=\"gone\",result=\"written\"} 1\n")
        );
        assert!(out.contains("fleetlink_group_closes_total{group=\"gone\",code=\"other\"} 1\n"));
        assert!(
            !out.contains("code=\"1000\""),
            "codes never seen are left out"
        );
        assert!(out.contains(
            "fleetlink_group_ack_latency_seconds_bucket{group=\"gone\",le=\"0.001\"} 0\n\
             fleetlink_group_ack_latency_seconds_bucket{group=\"gone\",le=\"0.005\"} 1\n"
        ));
        assert!(out
            .contains("fleetlink_group_ack_latency_seconds_sum{group=\"lab \\\"a\\\"\"} 0.004\n"));
        assert!(
            out.contains("fleetlink_group_ack_latency_seconds_count{group=\"lab \\\"a\\\"\"} 2\n")
        );
    }
}
