//! Cross-thread wake-up for a thread that sleeps in its event loop: a bounded crossbeam queue
//! plus a socketpair "doorbell" that costs nothing while idle.
//!
//! The queue is crossbeam's linked one, bounded by a length check on every push, not its array
//! one: an array of 65,536 slots is written in full when it is created, about 4 MiB per core
//! and 6 MiB for the bridge held from start-up whether a message ever arrives or not. The
//! linked queue takes memory in blocks of 31 messages as a burst needs them and gives them back
//! as it drains. The check races with other senders, so a queue can exceed its bound by at most
//! one message per sender pushing at that instant.
//!
//! The receiving side waits for the read end to become readable (an io_uring PollAdd on a
//! core), so a core with nothing to do makes no syscalls for its inbox. Senders ring only when
//! the receiver has said it is about to sleep (`armed`), so a burst of messages costs one
//! write, not one per message.
//!
//! A sender that produces messages in batches uses [`Mailbox::push`] and rings once with
//! [`Mailbox::ring`] when the batch is done. Ringing on the first message instead wakes the
//! receiver for that one message; it drains it, sleeps again, and the next message wakes it
//! again: a context switch per message on both sides during a fan-out.

use std::io::{self, Read, Write};
use std::os::unix::net::UnixStream;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;

use crossbeam_channel::{Receiver, Sender};

/// The sending half: clone it into every thread that talks to the owner.
pub struct Mailbox<T> {
    tx: Sender<T>,
    bell: Arc<Bell>,
}

impl<T> Clone for Mailbox<T> {
    fn clone(&self) -> Self {
        Self {
            tx: self.tx.clone(),
            bell: self.bell.clone(),
        }
    }
}

struct Bell {
    armed: AtomicBool,
    ring: UnixStream,
    /// Messages the queue holds before a push answers [`Full`].
    capacity: usize,
}

/// The receiving half, owned by one thread.
pub struct Inbox<T> {
    rx: Receiver<T>,
    bell: Arc<Bell>,
    /// Read end of the doorbell; the owner waits on its readability.
    pub listen: UnixStream,
}

/// The queue was full: the message comes back so the caller can answer for it.
#[derive(Debug)]
pub struct Full<T>(pub T);

/// Creates a mailbox/inbox pair holding at most `capacity` messages (give or take one per sender
/// pushing at the same instant).
pub fn channel<T>(capacity: usize) -> io::Result<(Mailbox<T>, Inbox<T>)> {
    let (ring, listen) = UnixStream::pair()?;
    ring.set_nonblocking(true)?;
    listen.set_nonblocking(true)?;
    let (tx, rx) = crossbeam_channel::unbounded();
    let bell = Arc::new(Bell {
        armed: AtomicBool::new(false),
        ring,
        capacity,
    });
    Ok((
        Mailbox {
            tx,
            bell: bell.clone(),
        },
        Inbox { rx, bell, listen },
    ))
}

impl<T> Mailbox<T> {
    /// Queues `msg` without blocking and rings the doorbell if the owner sleeps.
    pub fn send(&self, msg: T) -> Result<(), Full<T>> {
        self.push(msg)?;
        self.ring();
        Ok(())
    }

    /// Queues `msg` without blocking and without ringing: the caller owes a [`Self::ring`]
    /// once its batch is queued, or the owner may sleep through the message.
    pub fn push(&self, msg: T) -> Result<(), Full<T>> {
        if self.tx.len() >= self.bell.capacity {
            return Err(Full(msg));
        }
        self.push_owed(msg)
    }

    /// Queues `msg` past the bound, without ringing. Only for a message that settles something
    /// the owner already counted against its own bounds: the answer to a request it made, or
    /// the end of a connection it registered. There is at most one per such request or
    /// connection, so those bounds bound the overrun; dropping it instead would leave the
    /// owner waiting for it forever. Fails only when the owner is gone.
    pub fn push_owed(&self, msg: T) -> Result<(), Full<T>> {
        // Disconnected: the owner is gone (shutdown); the caller answers as for a full queue.
        self.tx.send(msg).map_err(|e| Full(e.into_inner()))
    }

    /// Rings the doorbell if the owner sleeps (or is about to).
    pub fn ring(&self) {
        if self.bell.armed.swap(false, Ordering::SeqCst) {
            // A full socket buffer already holds a pending ring, so WouldBlock is success.
            let _ = (&self.bell.ring).write(&[1]);
        }
    }

    /// Messages waiting (for metrics).
    pub fn len(&self) -> usize {
        self.tx.len()
    }

    /// True when nothing is waiting.
    pub fn is_empty(&self) -> bool {
        self.tx.is_empty()
    }
}

impl<T> Inbox<T> {
    /// Takes one message if any.
    pub fn try_recv(&self) -> Option<T> {
        self.rx.try_recv().ok()
    }

    /// Declares the owner is going to sleep. Returns false if messages arrived meanwhile (then
    /// drain again instead of sleeping). Pairs with the swap in `send`: either the sender sees
    /// `armed` and rings, or this re-check sees its message.
    pub fn arm(&self) -> bool {
        self.bell.armed.store(true, Ordering::SeqCst);
        if self.rx.is_empty() {
            return true;
        }
        self.bell.armed.store(false, Ordering::SeqCst);
        false
    }

    /// Empties the doorbell after a wake-up.
    pub fn clear(&self) {
        let mut buf = [0u8; 64];
        while matches!((&self.listen).read(&mut buf), Ok(n) if n > 0) {}
    }

    /// Blocking receive with a timeout, for threads without an event loop.
    pub fn recv_timeout(&self, d: std::time::Duration) -> Option<T> {
        self.rx.recv_timeout(d).ok()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rings_only_when_armed() {
        let (tx, rx) = channel::<u32>(4).unwrap();
        tx.send(1).unwrap();
        let mut b = [0u8; 8];
        assert!(
            (&rx.listen).read(&mut b).is_err(),
            "no ring while not armed"
        );
        assert!(!rx.arm(), "arm sees the queued message");
        assert_eq!(rx.try_recv(), Some(1));
        assert!(rx.arm());
        tx.send(2).unwrap();
        tx.send(3).unwrap();
        assert_eq!(
            (&rx.listen).read(&mut b).unwrap(),
            1,
            "one ring for a burst"
        );
        rx.clear();
        assert_eq!(rx.try_recv(), Some(2));
    }

    #[test]
    fn push_waits_for_the_ring() {
        let (tx, rx) = channel::<u32>(4).unwrap();
        assert!(rx.arm());
        tx.push(1).unwrap();
        tx.push(2).unwrap();
        let mut b = [0u8; 8];
        assert!((&rx.listen).read(&mut b).is_err(), "push alone never rings");
        tx.ring();
        assert_eq!(
            (&rx.listen).read(&mut b).unwrap(),
            1,
            "one ring for the batch"
        );
        tx.ring();
        assert!(
            (&rx.listen).read(&mut b).is_err(),
            "a second ring before the owner re-arms writes nothing"
        );
        assert_eq!(rx.try_recv(), Some(1));
        assert_eq!(rx.try_recv(), Some(2));
    }

    #[test]
    fn full_returns_the_message() {
        let (tx, _rx) = channel::<u32>(1).unwrap();
        tx.send(1).unwrap();
        assert!(matches!(tx.send(2), Err(Full(2))));
    }

    #[test]
    fn an_owed_message_goes_past_the_bound_and_is_received_in_order() {
        let (tx, rx) = channel::<u32>(1).unwrap();
        tx.send(1).unwrap();
        assert!(matches!(tx.push(2), Err(Full(2))));
        tx.push_owed(3).unwrap();
        assert_eq!(
            (rx.try_recv(), rx.try_recv(), rx.try_recv()),
            (Some(1), Some(3), None)
        );
        drop(rx);
        assert!(matches!(tx.push_owed(4), Err(Full(4))), "the owner is gone");
    }
}
