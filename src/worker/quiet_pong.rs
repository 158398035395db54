//! Lets a rig's PONG wait in its socket until the sweep comes for it.
//!
//! An idle fleet's whole upkeep is one PING out and one PONG back per rig per interval. Sending
//! is cheap; it is the PONG that costs: its arrival completes the connection's readiness op,
//! wakes the core, and the task then reads 6 bytes and re-arms the op. Yet nothing needs that
//! PONG before its deadline. So while a PING is out on a plain connection, the socket's receive
//! low-water mark (`SO_RCVLOWAT`) is one byte above the PONG's size: a lone PONG stays in the
//! kernel, and the sweep reads it at the PONG deadline it visits anyway, then sets the mark back
//! to 1. Anything bigger than a bare PONG (every rig message, or a PONG with other bytes behind
//! it) is over the mark and wakes the connection as before; EOF always does. The first read of
//! real input puts the mark back at once, so the tail of a message, which can be as short as
//! a PONG, never waits behind it: the mark stays up only while the rig is silent.
//!
//! Our PINGs carry a 4-byte payload ([`sweep::ping_payload`]), so a conforming PONG is a
//! masked frame of exactly [`PONG_LEN`] bytes. The only other frames that small have a payload
//! of 4 bytes or less (a PING, a close, a tiny text, binary or continuation frame); sent alone
//! by a silent rig while a PING of ours is out, they wait for the PONG deadline at most. TLS connections are left alone: a record's size does not tell a PONG from a message.

use std::os::fd::RawFd;

use crate::worker::core::Liveness;
use crate::worker::sweep;

/// A client's PONG to our PING: 2 header bytes, the 4-byte mask and the PING's payload.
pub(crate) const PONG_LEN: usize = 6 + sweep::PING_PAYLOAD_LEN;

/// Raises the low-water mark above a bare PONG. False if the kernel refused (then the PONG
/// wakes the connection as usual and nothing else changes).
pub(crate) fn hide(fd: RawFd) -> bool {
    set_rcvlowat(fd, PONG_LEN as libc::c_int + 1)
}

/// Restores the default mark. The caller reads the socket first: with a PONG still waiting,
/// lowering the mark would complete the readiness op at once.
pub(crate) fn reveal(fd: RawFd) {
    set_rcvlowat(fd, 1);
}

/// Puts the mark back if it is up, keeping `live.pong_hidden` and the socket in step.
pub(crate) fn lower(fd: RawFd, live: &mut Liveness) {
    if live.pong_hidden {
        reveal(fd);
        live.pong_hidden = false;
    }
}

fn set_rcvlowat(fd: RawFd, bytes: libc::c_int) -> bool {
    // SAFETY: plain setsockopt on a socket fd owned by the live connection, with a pointer to
    // a c_int and its size.
    unsafe {
        libc::setsockopt(
            fd,
            libc::SOL_SOCKET,
            libc::SO_RCVLOWAT,
            std::ptr::from_ref(&bytes).cast(),
            std::mem::size_of::<libc::c_int>() as libc::socklen_t,
        ) == 0
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::Write;
    use std::net::{TcpListener, TcpStream};
    use std::os::fd::AsRawFd;
    use std::time::{Duration, Instant};

    fn readable(fd: RawFd, wait_ms: i32) -> bool {
        let mut p = libc::pollfd {
            fd,
            events: libc::POLLIN,
            revents: 0,
        };
        // SAFETY: one valid pollfd.
        unsafe { libc::poll(&mut p, 1, wait_ms) == 1 && p.revents & libc::POLLIN != 0 }
    }

    fn pair() -> (TcpStream, TcpStream) {
        let l = TcpListener::bind("127.0.0.1:0").unwrap();
        let c = TcpStream::connect(l.local_addr().unwrap()).unwrap();
        let (s, _) = l.accept().unwrap();
        (c, s)
    }

    /// Waits until the server side has `n` bytes queued (SIOCINQ), so a "not readable" check
    /// is made with the bytes really there.
    fn queued(fd: RawFd, n: i32) {
        let end = Instant::now() + Duration::from_secs(5);
        loop {
            let mut q: libc::c_int = 0;
            // SAFETY: FIONREAD writes one c_int.
            unsafe { libc::ioctl(fd, libc::FIONREAD, &mut q) };
            if q >= n {
                return;
            }
            assert!(Instant::now() < end, "only {q} of {n} bytes arrived");
            std::thread::yield_now();
        }
    }

    #[test]
    fn a_bare_pong_stays_hidden_and_anything_more_shows() {
        let (mut c, s) = pair();
        let fd = s.as_raw_fd();
        assert!(hide(fd));
        let pong = [0x8a, 0x84, 1, 2, 3, 4, 9, 9, 9, 9];
        assert_eq!(pong.len(), PONG_LEN);
        c.write_all(&pong).unwrap();
        queued(fd, PONG_LEN as i32);
        assert!(
            !readable(fd, 0),
            "a lone PONG must not make the socket readable"
        );
        // A non-blocking read still gets it: the sweep's read.
        let mut buf = [0u8; 64];
        let n = crate::worker::core::recv(fd, &mut buf).unwrap();
        assert_eq!(&buf[..n], &pong);
        // A message behind a PONG is over the mark.
        c.write_all(&pong).unwrap();
        c.write_all(&[0x81, 0x82, 0, 0, 0, 0, b'{', b'}']).unwrap();
        assert!(readable(fd, 5_000));
        crate::worker::core::recv(fd, &mut buf).unwrap();
        // After reveal a lone PONG is readable again.
        reveal(fd);
        c.write_all(&pong).unwrap();
        assert!(readable(fd, 5_000));
        crate::worker::core::recv(fd, &mut buf).unwrap();
        // EOF shows through a raised mark.
        assert!(hide(fd));
        c.shutdown(std::net::Shutdown::Write).unwrap();
        assert!(readable(fd, 5_000));
    }
}
