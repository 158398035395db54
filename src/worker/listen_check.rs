//! Whether another process listens on the rig port. SO_REUSEPORT lets any process of the same
//! user bind beside the broker's listeners, and a second broker started by mistake would take a
//! share of the rigs. The check runs after this broker's own listeners are up, reading the
//! kernel's socket tables, so of two brokers started at the same instant at least the later
//! checker sees the other; a probe bind made before binding left a gap between the two.

use std::io::{self, BufRead};
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr};
use std::os::fd::AsRawFd;
use std::time::{Duration, Instant};

/// How long a foreign listener may take to go. A process just killed can leave its listener
/// for some milliseconds after it is reaped (io_uring releases its files asynchronously).
const GRACE: Duration = Duration::from_millis(300);

/// Fails when a listening socket other than `ours` holds `addr`'s port on an overlapping
/// address, and is still there after [`GRACE`].
pub(crate) fn alone_on(addr: SocketAddr, ours: &[std::net::TcpListener]) -> io::Result<()> {
    let mine: Vec<u64> = ours.iter().filter_map(|l| inode(l.as_raw_fd())).collect();
    let deadline = Instant::now() + GRACE;
    loop {
        let all = match listeners() {
            Ok(all) => all,
            // A guard, not a reason to stay down: a /proc the broker may not read (hidepid, a
            // sandbox) leaves the port unchecked, and says so.
            Err(e) => {
                log::warn!("cannot check whether another process listens on {addr}: {e}");
                return Ok(());
            }
        };
        let foreign = all
            .into_iter()
            .find(|(at, ino)| !mine.contains(ino) && overlaps(*at, addr));
        let Some((at, _)) = foreign else {
            return Ok(());
        };
        if Instant::now() >= deadline {
            return Err(io::Error::new(
                io::ErrorKind::AddrInUse,
                format!(
                    "another process is listening on {at} (a second broker? --share-port binds \
                     beside it on purpose)"
                ),
            ));
        }
        std::thread::sleep(Duration::from_millis(10));
    }
}

/// The socket inode of `fd`, as the socket tables name it.
fn inode(fd: std::os::fd::RawFd) -> Option<u64> {
    // SAFETY: an all-zero `stat` is valid; fstat fills it for the open fd.
    let mut st: libc::stat = unsafe { std::mem::zeroed() };
    // SAFETY: fd is an open socket owned by the caller; st is a valid out pointer.
    (unsafe { libc::fstat(fd, &mut st) } == 0).then_some(st.st_ino)
}

/// Every listening TCP socket of this network namespace: its address and inode. The tables
/// list every socket, listening or not, and are read a line at a time: after a drain of a
/// million rigs they hold a million TIME-WAIT rows (150 MB of text), which read whole would
/// have stayed in the new broker's RSS.
fn listeners() -> io::Result<Vec<(SocketAddr, u64)>> {
    let mut out = Vec::new();
    let mut line = String::new();
    for table in ["/proc/net/tcp", "/proc/net/tcp6"] {
        let file = match std::fs::File::open(table) {
            Ok(file) => file,
            // No IPv6 in this kernel: nothing listens there.
            Err(e) if e.kind() == io::ErrorKind::NotFound => continue,
            Err(e) => return Err(e),
        };
        let mut rows = io::BufReader::new(file);
        // The first line is the column names.
        rows.read_line(&mut line)?;
        loop {
            line.clear();
            if rows.read_line(&mut line)? == 0 {
                break;
            }
            out.extend(parse_line(&line));
        }
    }
    Ok(out)
}

/// One row of `/proc/net/tcp{,6}` when its socket listens (state 0A).
fn parse_line(line: &str) -> Option<(SocketAddr, u64)> {
    // sl, local address, remote address, st, tx:rx, tr:when, retrnsmt, uid, timeout, inode
    let mut fields = line.split_whitespace();
    let local = fields.nth(1)?;
    if fields.nth(1)? != "0A" {
        return None;
    }
    let inode = fields.nth(5)?.parse().ok()?;
    let (ip, port) = local.split_once(':')?;
    let port = u16::from_str_radix(port, 16).ok()?;
    // The kernel prints each 32-bit word of the address as a native-endian number.
    let words = (0..ip.len() / 8)
        .map(|i| u32::from_str_radix(ip.get(i * 8..i * 8 + 8)?, 16).ok())
        .collect::<Option<Vec<u32>>>()?;
    let ip = match words.as_slice() {
        [a] => IpAddr::V4(Ipv4Addr::from(a.to_ne_bytes())),
        [a, b, c, d] => {
            let mut bytes = [0u8; 16];
            for (chunk, w) in bytes.chunks_mut(4).zip([a, b, c, d]) {
                chunk.copy_from_slice(&w.to_ne_bytes());
            }
            IpAddr::V6(Ipv6Addr::from(bytes))
        }
        _ => return None,
    };
    Some((SocketAddr::new(ip, port), inode))
}

/// Whether a listener on `a` takes connections meant for `b`: the same port, and the same
/// address or a wildcard on either side (an IPv6 wildcard takes IPv4 too, unless V6ONLY).
fn overlaps(a: SocketAddr, b: SocketAddr) -> bool {
    let canonical = |ip: IpAddr| match ip {
        IpAddr::V6(v6) => v6.to_ipv4_mapped().map_or(ip, IpAddr::V4),
        v4 => v4,
    };
    a.port() == b.port()
        && (a.ip().is_unspecified()
            || b.ip().is_unspecified()
            || canonical(a.ip()) == canonical(b.ip()))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rows_of_the_socket_tables_parse() {
        // 127.0.0.1:8080 listening, as a little-endian kernel prints it.
        let v4 = "   0: 0100007F:1F90 00000000:0000 0A 00000000:00000000 00:00000000 00000000     0        0 4242 1 0000000000000000 100 0 0 10 0";
        let addr = SocketAddr::from(([127, 0, 0, 1], 8080));
        if cfg!(target_endian = "little") {
            assert_eq!(parse_line(v4), Some((addr, 4242)));
        }
        // An established row is not a listener.
        assert_eq!(parse_line(&v4.replace(" 0A ", " 01 ")), None);
        let v6 = "   1: 00000000000000000000000000000000:1F90 00000000000000000000000000000000:0000 0A 00000000:00000000 00:00000000 00000000     0        0 77 1";
        assert_eq!(parse_line(v6), Some(("[::]:8080".parse().unwrap(), 77)));
        assert_eq!(parse_line("garbage"), None);
    }

    #[test]
    fn wildcards_overlap_every_address_of_their_port() {
        let at = |s: &str| s.parse::<SocketAddr>().unwrap();
        assert!(overlaps(at("0.0.0.0:80"), at("127.0.0.1:80")));
        assert!(overlaps(at("[::]:80"), at("10.0.0.1:80")));
        assert!(overlaps(at("[::ffff:10.0.0.1]:80"), at("10.0.0.1:80")));
        assert!(!overlaps(at("10.0.0.2:80"), at("10.0.0.1:80")));
        assert!(!overlaps(at("0.0.0.0:81"), at("0.0.0.0:80")));
    }
}
