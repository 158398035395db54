//! A rig reading slowly through a backlog of commands is alive, though its PONG is late.
//!
//! Our PING goes out behind whatever is already queued for the rig: up to one command in our
//! buffer and the kernel's send buffer (megabytes). A rig on a slow link, reading a 1 MiB
//! command at 40 KB/s, sees the PING long after `--pong-timeout`, and would be closed 4002 while
//! it reads. So while bytes are ahead of our PINGs, liveness is judged by the bytes the rig's
//! TCP acknowledges instead: a PONG missing at its deadline is not a miss if that count has
//! grown since the last look. A rig that stopped reading stops acknowledging once its receive
//! buffer is full, and from then its misses count as any silent rig's do: it gets the same
//! `--max-missed-pongs` intervals without progress before 4002.
//!
//! The count lives in the rig's command queues, which exist only while commands are in flight:
//! an idle rig pays nothing, and a PING with no command ahead of it costs no system call.

use std::os::fd::RawFd;

use crate::worker::core::ConnState;

/// Called as a PING is queued: starts watching the rig's acknowledged bytes if anything is
/// ahead of the PING, and stops when nothing is.
pub(crate) fn mark(fd: RawFd, st: &mut ConnState) {
    let unsent = st.unsent();
    let Some(q) = st.session.as_mut().and_then(|s| s.queues.as_mut()) else {
        return;
    };
    if unsent == 0 && unacked_in_kernel(fd) == 0 {
        q.taken_seen = None;
    } else if q.taken_seen.is_none() {
        q.taken_seen = bytes_acked(fd);
    }
}

/// At a missed PONG's deadline: whether the rig has taken bytes since the last look, while
/// bytes were ahead of the PING.
pub(crate) fn still_reading(fd: RawFd, st: &mut ConnState) -> bool {
    let Some(q) = st.session.as_mut().and_then(|s| s.queues.as_mut()) else {
        return false;
    };
    // Nothing was ahead of the PING: a missing PONG is a miss, and needs no system call.
    let Some(seen) = q.taken_seen else {
        return false;
    };
    match bytes_acked(fd) {
        Some(now) if now > seen => {
            q.taken_seen = Some(now);
            true
        }
        _ => false,
    }
}

/// Bytes in the send queue not yet acknowledged by the rig's TCP (`SIOCOUTQ`).
fn unacked_in_kernel(fd: RawFd) -> libc::c_int {
    let mut n: libc::c_int = 0;
    // SAFETY: SIOCOUTQ (= TIOCOUTQ) writes one c_int through the pointer, on a socket fd owned
    // by the live connection.
    let rc = unsafe { libc::ioctl(fd, libc::TIOCOUTQ, std::ptr::from_mut(&mut n)) };
    if rc == 0 {
        n
    } else {
        0
    }
}

/// Bytes the rig's TCP has acknowledged over the connection's life (`tcpi_bytes_acked`).
fn bytes_acked(fd: RawFd) -> Option<u64> {
    // SAFETY: tcp_info is plain old data; all-zero is a valid value.
    let mut info: libc::tcp_info = unsafe { std::mem::zeroed() };
    let mut len = std::mem::size_of::<libc::tcp_info>() as libc::socklen_t;
    // SAFETY: getsockopt writes at most `len` bytes into `info` and updates `len`, on a socket fd
    // owned by the live connection.
    let rc = unsafe {
        libc::getsockopt(
            fd,
            libc::IPPROTO_TCP,
            libc::TCP_INFO,
            std::ptr::from_mut(&mut info).cast(),
            &mut len,
        )
    };
    // A kernel too old to fill the field (before 4.2) reads as no progress.
    let filled = std::mem::offset_of!(libc::tcp_info, tcpi_bytes_acked) + 8;
    (rc == 0 && len as usize >= filled).then_some(info.tcpi_bytes_acked)
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::{Read, Write};
    use std::net::{TcpListener, TcpStream};
    use std::os::fd::AsRawFd;
    use std::time::{Duration, Instant};

    /// A connected pair: (our side, the peer), the peer's receive buffer small so that a few
    /// hundred KB stay queued on our side.
    fn pair() -> (TcpStream, TcpStream) {
        let l = TcpListener::bind("127.0.0.1:0").expect("bind");
        let ours = TcpStream::connect(l.local_addr().expect("addr")).expect("connect");
        let (peer, _) = l.accept().expect("accept");
        ours.set_nonblocking(true).expect("nonblocking");
        (ours, peer)
    }

    fn poll_until(what: &str, mut f: impl FnMut() -> bool) {
        let deadline = Instant::now() + Duration::from_secs(5);
        while !f() {
            assert!(Instant::now() < deadline, "timed out waiting for {what}");
            std::thread::yield_now();
        }
    }

    /// Fills our send path until the kernel refuses more.
    fn fill(ours: &mut TcpStream) -> usize {
        let chunk = vec![7u8; 64 << 10];
        let mut total = 0;
        loop {
            match ours.write(&chunk) {
                Ok(n) => total += n,
                Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => return total,
                Err(e) => panic!("write: {e}"),
            }
        }
    }

    #[test]
    fn acked_bytes_grow_while_the_peer_reads_and_stop_when_it_does_not() {
        let (mut ours, mut peer) = pair();
        let fd = ours.as_raw_fd();
        let queued = fill(&mut ours);
        assert!(queued > 0);
        poll_until("the peer's window to close", || {
            let a = bytes_acked(fd);
            std::thread::sleep(Duration::from_millis(20));
            a == bytes_acked(fd) && unacked_in_kernel(fd) > 0
        });
        let stalled = bytes_acked(fd).expect("tcp_info");
        assert!(
            unacked_in_kernel(fd) > 0,
            "bytes wait behind the closed window"
        );
        // The peer reads a little: its TCP acknowledges more.
        let mut buf = vec![0u8; 256 << 10];
        let mut read = 0;
        while read < buf.len() {
            read += peer.read(&mut buf[read..]).expect("read");
        }
        poll_until("the acks to count", || {
            bytes_acked(fd).is_some_and(|n| n > stalled)
        });
    }

    #[test]
    fn an_idle_socket_has_nothing_ahead() {
        let (ours, _peer) = pair();
        assert_eq!(unacked_in_kernel(ours.as_raw_fd()), 0);
        assert!(bytes_acked(ours.as_raw_fd()).is_some());
    }
}
