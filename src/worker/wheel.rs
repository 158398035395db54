//! The per-core timer wheel: one entry (a connection id) per connection, in the slot of its
//! next deadline (hello deadline, next PING, PONG deadline). Connections have no timers of
//! their own; the sweep task visits only the slot that is due.

use crate::ids::ConnId;

/// Ticks since the core started.
pub(crate) type Tick = u64;

/// The most slots a wheel has: 384 KiB of empty slots. A longer horizon (a ping interval of
/// hours, say) costs an early visit per lap instead of memory: at the 250 ms tick of long
/// settings a lap is 68 minutes, at the 5 ms tick of the shortest 82 s.
pub(crate) const MAX_SLOTS: usize = 1 << 14;

/// A hashed wheel of `slots` ticks. Deadlines further than `slots - 1` ticks ahead are clamped
/// (the entry is revisited early and rescheduled), so any horizon works.
#[derive(Debug)]
pub(crate) struct Wheel {
    slots: Vec<Vec<ConnId>>,
    now: Tick,
}

impl Wheel {
    /// A wheel covering `slots` ticks (at least 2, at most [`MAX_SLOTS`]).
    pub(crate) fn new(slots: usize) -> Self {
        Self {
            slots: (0..slots.clamp(2, MAX_SLOTS)).map(|_| Vec::new()).collect(),
            now: 0,
        }
    }

    /// The tick the wheel has advanced to.
    pub(crate) fn now(&self) -> Tick {
        self.now
    }

    /// Schedules `id` for tick `at` (at least the next tick); returns the tick it will be
    /// visited at, which is earlier than `at` when `at` is past the horizon.
    pub(crate) fn insert(&mut self, at: Tick, id: ConnId) -> Tick {
        let horizon = self.now + self.slots.len() as Tick - 1;
        let at = at.clamp(self.now + 1, horizon);
        let n = self.slots.len();
        if let Some(slot) = self.slots.get_mut((at % n as Tick) as usize) {
            slot.push(id);
        }
        at
    }

    /// Advances one tick and takes what is due then. The caller hands back the (emptied) Vec
    /// with [`Wheel::recycle`] so slots keep their capacity.
    pub(crate) fn advance(&mut self) -> Vec<ConnId> {
        self.now += 1;
        let n = self.slots.len() as Tick;
        self.slots
            .get_mut((self.now % n) as usize)
            .map(std::mem::take)
            .unwrap_or_default()
    }

    /// Entries waiting, due or not.
    #[cfg(test)]
    pub(crate) fn len(&self) -> usize {
        self.slots.iter().map(Vec::len).sum()
    }

    /// Returns a drained Vec to the slot it came from, unless the slot got new entries.
    pub(crate) fn recycle(&mut self, mut v: Vec<ConnId>) {
        v.clear();
        let n = self.slots.len() as Tick;
        if let Some(slot) = self.slots.get_mut((self.now % n) as usize) {
            if slot.is_empty() && slot.capacity() < v.capacity() {
                *slot = v;
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::ids::CoreId;

    #[test]
    fn entries_come_due_on_their_tick() {
        let mut w = Wheel::new(8);
        let a = ConnId::new(CoreId(0), 1);
        let b = ConnId::new(CoreId(0), 2);
        w.insert(3, a);
        w.insert(100, b); // clamped to the horizon (tick 7)
        let mut due = Vec::new();
        for _ in 0..8 {
            let v = w.advance();
            due.push((w.now(), v.clone()));
            w.recycle(v);
        }
        assert_eq!(due[2], (3, vec![a]));
        assert_eq!(due[6], (7, vec![b]));
        assert!(due.iter().filter(|(_, v)| !v.is_empty()).count() == 2);
    }

    /// A horizon of a year in 5 ms ticks would be 6.3 billion slots (150 GB): the wheel stops
    /// at its most, and a deadline past it comes due at the end of the lap instead.
    #[test]
    fn a_long_horizon_costs_early_visits_not_memory() {
        let year_in_ticks = 365 * 24 * 3600 * 1000 / 5;
        let mut w = Wheel::new(year_in_ticks);
        assert_eq!(w.slots.len(), MAX_SLOTS);
        let a = ConnId::new(CoreId(0), 1);
        let at = w.insert(year_in_ticks as Tick, a);
        assert_eq!(at, MAX_SLOTS as Tick - 1);
    }
}
