//! Sessions waiting to be put back into Redis, one entry per session. A Redis that flaps
//! makes every core send every connected session again at each reconnect; keeping only the
//! latest copy bounds the queue by the sessions this broker holds.

use std::collections::{HashMap, VecDeque};

use crate::ids::{BootId, RigId};
use crate::registry::msg::RekeepReq;

/// Sessions to put back, oldest first; a newer copy of a queued session replaces it in place.
#[derive(Default)]
pub(super) struct Rekeeps {
    order: VecDeque<(RigId, BootId)>,
    latest: HashMap<(RigId, BootId), RekeepReq>,
}

impl Rekeeps {
    pub(super) fn push(&mut self, r: RekeepReq) {
        let key = (r.rig.clone(), r.boot);
        if self.latest.insert(key.clone(), r).is_none() {
            self.order.push_back(key);
        }
    }

    /// Puts a queued session first: its lease is about to be released, after which Redis
    /// would refuse it. (Its old place in the order is skipped when reached.)
    pub(super) fn hurry(&mut self, rig: &RigId, boot: BootId) {
        let key = (rig.clone(), boot);
        if self.latest.contains_key(&key) {
            self.order.push_front(key);
        }
    }

    pub(super) fn len(&self) -> usize {
        self.latest.len()
    }

    pub(super) fn is_empty(&self) -> bool {
        self.latest.is_empty()
    }

    /// Takes up to `n`, oldest first.
    pub(super) fn take(&mut self, n: usize) -> Vec<RekeepReq> {
        let mut out = Vec::with_capacity(n.min(self.len()));
        while out.len() < n {
            let Some(key) = self.order.pop_front() else {
                break;
            };
            out.extend(self.latest.remove(&key));
        }
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::ids::Seq;

    fn req(rig: &str, next: u64) -> RekeepReq {
        RekeepReq {
            rig: RigId::parse(rig).expect("rig"),
            boot: BootId::parse("0190f5c2-0000-7000-8000-000000000001").expect("boot"),
            next: Seq(next),
            cmds: Vec::new(),
        }
    }

    #[test]
    fn a_session_sent_again_is_queued_once_with_its_latest_state() {
        let mut q = Rekeeps::default();
        q.push(req("rig-a", 1));
        q.push(req("rig-b", 1));
        q.push(req("rig-a", 5));
        assert_eq!(q.len(), 2);
        let first = q.take(1);
        assert_eq!(first.len(), 1);
        assert_eq!((first[0].rig.as_str(), first[0].next), ("rig-a", Seq(5)));
        let rest = q.take(10);
        assert_eq!(rest.len(), 1);
        assert_eq!(rest[0].rig.as_str(), "rig-b");
        assert!(q.is_empty());
    }

    #[test]
    fn a_hurried_session_goes_first_and_only_once() {
        let mut q = Rekeeps::default();
        for rig in ["rig-a", "rig-b", "rig-c"] {
            q.push(req(rig, 1));
        }
        let c = req("rig-c", 1);
        q.hurry(&c.rig, c.boot);
        q.hurry(&RigId::parse("rig-z").expect("rig"), c.boot);
        let rigs: Vec<String> = q.take(10).iter().map(|r| r.rig.to_string()).collect();
        assert_eq!(rigs, ["rig-c", "rig-a", "rig-b"]);
        assert!(q.is_empty());
        assert!(q.take(10).is_empty());
    }
}
