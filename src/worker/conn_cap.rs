//! `--max-connections` for the whole broker (CONTRACT.md §1: "per broker").
//!
//! One count the cores share. SO_REUSEPORT spreads connections unevenly, so a share per core
//! refused rigs while the broker as a whole had room. An accept takes a place with one atomic
//! update and the connection's end gives it back: no lock, no map, and nothing at all when the
//! flag is unset.

use std::sync::atomic::{AtomicU64, Ordering};

/// The broker's connection cap and how many connections hold a place under it.
#[derive(Debug)]
pub struct ConnCap {
    max: u64,
    open: AtomicU64,
}

impl ConnCap {
    /// A cap of `max` connections, none open.
    pub fn new(max: u64) -> Self {
        ConnCap {
            max,
            open: AtomicU64::new(0),
        }
    }

    /// Takes a place for a new connection; false when the broker holds `max` already.
    pub fn try_take(&self) -> bool {
        self.open
            .fetch_update(Ordering::AcqRel, Ordering::Acquire, |n| {
                (n < self.max).then_some(n + 1)
            })
            .is_ok()
    }

    /// Gives back the place of a connection that ended.
    pub fn give_back(&self) {
        let _ = self
            .open
            .fetch_update(Ordering::AcqRel, Ordering::Acquire, |n| n.checked_sub(1));
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::Arc;

    #[test]
    fn the_cap_holds_across_threads_and_a_place_given_back_is_taken_again() {
        let cap = Arc::new(ConnCap::new(1000));
        let takers: Vec<_> = (0..4)
            .map(|_| {
                let cap = cap.clone();
                std::thread::spawn(move || (0..400).filter(|_| cap.try_take()).count())
            })
            .collect();
        let taken: usize = takers.into_iter().map(|t| t.join().expect("taker")).sum();
        assert_eq!(taken, 1000, "exactly the cap, whichever thread took them");
        assert!(!cap.try_take());
        cap.give_back();
        assert!(cap.try_take());
        assert!(!cap.try_take());
    }

    #[test]
    fn a_cap_of_zero_refuses_every_connection() {
        let cap = ConnCap::new(0);
        assert!(!cap.try_take());
        cap.give_back();
        assert!(!cap.try_take());
    }
}
