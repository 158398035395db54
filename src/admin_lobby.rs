//! Admin connections the cores cannot take wait here, in the admin acceptor's poll set, until
//! their first bytes arrive; only then does a pool thread get one.
//!
//! A pool thread blocks on the connection it serves. Handed over silent, a connection would
//! hold its thread for the whole time a request may take to arrive (5 s), and a few dozen
//! silent connections past the cores' share kept `/healthz` on the next one waiting 20 s.
//! Waiting here costs a descriptor and a slot in one `poll(2)` call.

use std::collections::VecDeque;
use std::net::{TcpListener, TcpStream};
use std::os::fd::AsRawFd;
use std::time::{Duration, Instant};

/// Connections that may wait at once; past it a new one is answered 503 at once.
pub(crate) const MAX_WAITING: usize = 1024;

/// Connections waiting for their first bytes, oldest first.
#[derive(Default)]
pub(crate) struct Lobby {
    waiting: VecDeque<(TcpStream, Instant)>,
}

/// What one wait found.
pub(crate) struct Woken {
    /// The listener has connections to accept.
    pub(crate) accept: bool,
    /// Connections with bytes (or their end) to read: a pool thread's now.
    pub(crate) ready: Vec<TcpStream>,
}

impl Lobby {
    /// Lets `stream` wait; gives it back when [`MAX_WAITING`] wait already.
    pub(crate) fn admit(&mut self, stream: TcpStream, now: Instant) -> Result<(), TcpStream> {
        if self.waiting.len() >= MAX_WAITING {
            return Err(stream);
        }
        self.waiting.push_back((stream, now));
        Ok(())
    }

    /// Waits until the listener or a waiting connection is readable; connections that stayed
    /// silent for `limit` are closed.
    pub(crate) fn wait(&mut self, listener: &TcpListener, limit: Duration) -> Woken {
        self.expire(limit);
        let now = Instant::now();
        let timeout = self.waiting.front().map_or(-1, |(_, since)| {
            let left = (*since + limit).saturating_duration_since(now);
            // Rounded up: a wake-up a little early would only find nothing expired.
            left.as_millis().saturating_add(1).min(i32::MAX as u128) as i32
        });
        let mut fds: Vec<libc::pollfd> = std::iter::once(listener.as_raw_fd())
            .chain(self.waiting.iter().map(|(s, _)| s.as_raw_fd()))
            .map(|fd| libc::pollfd {
                fd,
                events: libc::POLLIN,
                revents: 0,
            })
            .collect();
        // SAFETY: `fds` is a valid array of initialized pollfd for its length.
        let n = unsafe { libc::poll(fds.as_mut_ptr(), fds.len() as libc::nfds_t, timeout) };
        if n <= 0 {
            self.expire(limit);
            return Woken {
                accept: false,
                ready: Vec::new(),
            };
        }
        let accept = fds.first().is_some_and(|p| p.revents != 0);
        let mut ready = Vec::new();
        let mut still = VecDeque::with_capacity(self.waiting.len());
        for ((stream, since), p) in self.waiting.drain(..).zip(fds.iter().skip(1)) {
            if p.revents != 0 {
                ready.push(stream);
            } else {
                still.push_back((stream, since));
            }
        }
        self.waiting = still;
        self.expire(limit);
        Woken { accept, ready }
    }

    /// Closes the connections that stayed silent for `limit` (the oldest are first).
    fn expire(&mut self, limit: Duration) {
        let now = Instant::now();
        while self
            .waiting
            .front()
            .is_some_and(|(_, since)| now.saturating_duration_since(*since) >= limit)
        {
            self.waiting.pop_front();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::Write;

    #[test]
    fn a_connection_leaves_the_lobby_when_it_speaks_and_a_silent_one_at_its_limit() {
        let listener = TcpListener::bind("127.0.0.1:0").expect("bind");
        let addr = listener.local_addr().expect("addr");
        let mut lobby = Lobby::default();
        let mut talker = TcpStream::connect(addr).expect("connect");
        let _silent = TcpStream::connect(addr).expect("connect");
        let woken = lobby.wait(&listener, Duration::from_secs(5));
        assert!(woken.accept && woken.ready.is_empty());
        for _ in 0..2 {
            let (s, _) = listener.accept().expect("accept");
            assert!(lobby.admit(s, Instant::now()).is_ok());
        }
        talker
            .write_all(b"GET /healthz HTTP/1.1\r\n\r\n")
            .expect("write");
        let woken = lobby.wait(&listener, Duration::from_secs(5));
        assert_eq!((woken.accept, woken.ready.len()), (false, 1));
        // The silent one is dropped once its time is up, and nothing else wakes the wait.
        let woken = lobby.wait(&listener, Duration::from_millis(50));
        assert!(!woken.accept && woken.ready.is_empty());
        assert!(lobby.waiting.is_empty());
    }

    #[test]
    fn the_lobby_is_bounded() {
        let listener = TcpListener::bind("127.0.0.1:0").expect("bind");
        let addr = listener.local_addr().expect("addr");
        let mut lobby = Lobby::default();
        let _client = TcpStream::connect(addr).expect("connect");
        let (s, _) = listener.accept().expect("accept");
        let now = Instant::now();
        for _ in 0..MAX_WAITING {
            assert!(lobby.admit(s.try_clone().expect("dup"), now).is_ok());
        }
        assert!(lobby.admit(s, now).is_err());
    }
}
