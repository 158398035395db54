//! Logs of refusals a peer can cause as fast as it connects: failed TLS handshakes, hellos
//! naming a rig their connection did not prove (4403), and accepts that failed (EMFILE past
//! the open-file limit, in a storm). A core writes at most one line a second
//! of each, with how many since the last line and the last one's reason and peer, which is what
//! an operator needs to find the client. A burst that stops is logged by the sweep within the
//! next second, not only when the next refusal comes (which may be hours later, and another).

use std::net::SocketAddr;
use std::os::fd::{BorrowedFd, RawFd};
use std::time::Instant;

use crate::registry::throttle::Throttle;

/// The held-back count and the last refusal noted, for one kind of refusal.
#[derive(Debug)]
pub(crate) struct RefusalLog {
    /// What the count counts, e.g. "connections failed TLS".
    what: &'static str,
    gate: Throttle,
    last: String,
}

impl RefusalLog {
    /// Failed TLS handshakes.
    pub(crate) fn tls() -> Self {
        Self::new("connections failed TLS")
    }

    /// Hellos closed 4403.
    pub(crate) fn identity() -> Self {
        Self::new("hellos named a rig their connection did not prove (4403)")
    }

    /// Accepts that failed.
    pub(crate) fn accepts() -> Self {
        Self::new("accepts failed")
    }

    fn new(what: &'static str) -> Self {
        Self {
            what,
            gate: Throttle::default(),
            last: String::new(),
        }
    }

    /// Notes a refusal of the peer on `fd` (None: no connection, as for a failed accept); the
    /// line to log when one is due now. The peer is asked for here, on the refusal's path: an
    /// address kept per connection would cost every idle connection its bytes.
    pub(crate) fn note(
        &mut self,
        now: Instant,
        fd: Option<RawFd>,
        why: &dyn std::fmt::Display,
    ) -> Option<String> {
        self.last = match fd.and_then(peer_addr) {
            Some(peer) => format!("{why}, from {peer}"),
            None => why.to_string(),
        };
        self.gate.note(now).map(|n| self.line(n))
    }

    /// The line for refusals held back, once a second has passed since the last line.
    pub(crate) fn due(&mut self, now: Instant) -> Option<String> {
        self.gate.due(now).map(|n| self.line(n))
    }

    fn line(&self, n: u64) -> String {
        format!(
            "{n} {} since the last such line (the last: {})",
            self.what, self.last
        )
    }
}

/// The address of the peer on `fd`; None once it is gone (a reset connection has none).
fn peer_addr(fd: RawFd) -> Option<SocketAddr> {
    // SAFETY: `fd` is the open socket of the connection being refused, borrowed for this call
    // only; it is closed later, by its owner.
    let fd = unsafe { BorrowedFd::borrow_raw(fd) };
    socket2::SockRef::from(&fd).peer_addr().ok()?.as_socket()
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::fd::AsRawFd;
    use std::time::Duration;

    #[test]
    fn a_burst_that_stops_is_logged_with_its_own_last_reason_and_peer() {
        let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let client = std::net::TcpStream::connect(listener.local_addr().unwrap()).unwrap();
        let (accepted, _) = listener.accept().unwrap();
        let from = format!("from {}", client.local_addr().unwrap());
        let fd = accepted.as_raw_fd();
        let mut log = RefusalLog::tls();
        let t0 = Instant::now();
        let ms = |n| t0 + Duration::from_millis(n);
        let first = log.note(t0, Some(fd), &"unknown ca");
        assert!(
            first
                .as_deref()
                .is_some_and(|l| l.starts_with("1 connections failed TLS")
                    && l.ends_with(&format!("(the last: unknown ca, {from})"))),
            "{first:?}"
        );
        for i in 1..=5 {
            assert_eq!(log.note(ms(i * 30), Some(fd), &"unknown ca"), None);
        }
        assert_eq!(log.due(ms(900)), None, "not before a second");
        let held = log.due(ms(1000));
        assert!(
            held.as_deref()
                .is_some_and(|l| l.starts_with("5 connections")
                    && l.ends_with(&format!("(the last: unknown ca, {from})"))),
            "{held:?}"
        );
        assert_eq!(log.due(ms(3000)), None, "nothing since");
    }

    #[test]
    fn a_peer_that_cannot_be_named_leaves_the_reason_alone() {
        // A socket with no peer: getpeername fails, as for a connection already reset.
        let unconnected = std::net::UdpSocket::bind("127.0.0.1:0").unwrap();
        let mut log = RefusalLog::identity();
        let line = log.note(Instant::now(), Some(unconnected.as_raw_fd()), &"rig_id r1");
        assert_eq!(
            line.as_deref(),
            Some(
                "1 hellos named a rig their connection did not prove (4403) since the last \
                 such line (the last: rig_id r1)"
            )
        );
    }
}
