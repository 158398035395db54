//! What sits between a connection's bytes and its socket: nothing (plain ws), or a rustls
//! session (wss). Both are driven with non-blocking `recv`/`send` on the raw fd after an
//! io_uring readiness op, so a TLS handshake never blocks a core.
//!
//! Per-connection security state ([`Security`]) is boxed and exists only on TLS or
//! token-carrying connections: a plain connection pays one null pointer for it.

use std::io::{self, Read, Write};
use std::os::fd::RawFd;

use rustls::ServerConnection;

use crate::jwt::Scope;
use crate::worker::core::recv;

/// TLS session and what the peer proved about itself.
pub(crate) struct Security {
    /// The rustls session (None on plain connections that carried a token).
    pub(crate) tls: Option<ServerConnection>,
    /// Identities of the verified client certificate (CN and DNS SANs), set when the
    /// handshake completes; empty without mTLS.
    pub(crate) peer_ids: Option<Vec<String>>,
    /// What the upgrade's bearer token allows (None: no token configured).
    pub(crate) scope: Option<Scope>,
    /// The token's `rig_id` claim, when it has one.
    pub(crate) token_rig: Option<String>,
    /// Refused at accept (over `--max-connections` or the accept bucket): served only as far
    /// as the handshake, so the client can read its 503 through TLS.
    pub(crate) refusing: bool,
    /// The socket failed: what rustls still holds to send never will be, and must not keep
    /// the connection waiting to write it (a reset socket is always "writable").
    pub(crate) output_dead: bool,
    /// Where the peer's record stream stands, for counting the records each read ends.
    pub(crate) records: RecordCount,
}

/// Follows the TLS record framing of the bytes a peer sends (a 5-byte header whose last two
/// bytes are the body's length, then the body), across reads, to count the records each read
/// completes: what rustls decrypts one by one. rustls keeps its own count to itself.
#[derive(Debug, Default, Clone, Copy)]
pub(crate) struct RecordCount {
    /// Header bytes seen of the record in flight (5: its body is coming).
    have: u8,
    /// Body bytes of the record in flight still to come (built from the header's last two
    /// bytes as they pass).
    left: u16,
}

impl RecordCount {
    /// A record's header: type, version (2 bytes), body length (2 bytes).
    const HEADER: u8 = 5;

    /// Walks `bytes`, the next the peer sent, and says how many records ended in them.
    pub(crate) fn ended_in(&mut self, mut bytes: &[u8]) -> usize {
        let mut ended = 0;
        while let Some((&byte, rest)) = bytes.split_first() {
            if self.have < Self::HEADER {
                match self.have {
                    3 => self.left = u16::from(byte) << 8,
                    4 => self.left |= u16::from(byte),
                    _ => {}
                }
                self.have += 1;
                bytes = rest;
            } else {
                let take = usize::from(self.left).min(bytes.len());
                self.left -= take as u16;
                bytes = bytes.get(take..).unwrap_or_default();
            }
            if self.have == Self::HEADER && self.left == 0 {
                ended += 1;
                self.have = 0;
            }
        }
        ended
    }
}

/// The socket as rustls reads it, counting the records each read completes.
struct Counted<'a> {
    fd: Fd,
    records: &'a mut RecordCount,
    ended: usize,
}

impl Read for Counted<'_> {
    fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        let n = self.fd.read(buf)?;
        self.ended += self.records.ended_in(buf.get(..n).unwrap_or_default());
        Ok(n)
    }
}

/// The raw socket as `Read`/`Write` for rustls (non-blocking; WouldBlock passes through).
pub(crate) struct Fd(pub(crate) RawFd);

impl Read for Fd {
    fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        recv(self.0, buf)
    }
}

impl Write for Fd {
    fn write(&mut self, buf: &[u8]) -> io::Result<usize> {
        // SAFETY: `buf` is a valid slice; the fd is owned by the live connection task.
        let n = unsafe {
            libc::send(
                self.0,
                buf.as_ptr().cast(),
                buf.len(),
                libc::MSG_DONTWAIT | libc::MSG_NOSIGNAL,
            )
        };
        if n < 0 {
            return Err(io::Error::last_os_error());
        }
        Ok(n as usize)
    }

    fn flush(&mut self) -> io::Result<()> {
        Ok(())
    }
}

/// Moves plaintext `out[*pos..]` into the TLS session and its records to the socket.
/// Ok(true) when everything (plaintext and records) is out.
pub(crate) fn flush_tls(
    fd: RawFd,
    tls: &mut ServerConnection,
    out: &[u8],
    pos: &mut usize,
) -> io::Result<bool> {
    loop {
        while *pos < out.len() {
            let rest = out.get(*pos..).unwrap_or_default();
            // rustls takes less than offered once its send buffer limit is reached.
            let n = tls.writer().write(rest)?;
            if n == 0 {
                break;
            }
            *pos += n;
        }
        if !tls.wants_write() {
            return Ok(*pos >= out.len());
        }
        match tls.write_tls(&mut Fd(fd)) {
            Ok(_) => {}
            Err(e) if e.kind() == io::ErrorKind::WouldBlock => return Ok(false),
            Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
            Err(e) => return Err(e),
        }
    }
}

/// Ends our side of the TLS session with close_notify before the TCP half-close (RFC 8446
/// §6.1): without it a client cannot tell our close from a truncation, and TLS libraries
/// report the end as an error. Best effort, never waiting: a socket that cannot take the
/// record now gets the FIN alone. Nothing is sent mid-handshake or after a fatal alert.
pub(crate) fn send_close_notify(fd: RawFd, tls: &mut ServerConnection) {
    if tls.is_handshaking() {
        return;
    }
    tls.send_close_notify();
    while tls.wants_write() {
        match tls.write_tls(&mut Fd(fd)) {
            Ok(0) => return,
            Ok(_) => {}
            Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
            Err(_) => return,
        }
    }
}

/// What a readable TLS socket yielded.
pub(crate) enum TlsRead {
    /// `n` plaintext bytes are in the buffer (0: only handshake or control records).
    Data(usize),
    /// The last `n` plaintext bytes the peer will send: its close_notify came with them. No
    /// further readiness will say so (the TCP connection may stay open), so the caller ends
    /// the connection once it has used them.
    Last(usize),
    /// The peer closed (EOF or close_notify).
    Closed,
    /// A TLS error: the connection must end.
    Failed {
        /// What rustls refused.
        why: rustls::Error,
        /// rustls queued no alert and has taken no ClientHello: the caller sends
        /// [`PLAIN_DECODE_ERROR`] itself (see [`send_plain_alert`]).
        plain_alert: bool,
        /// The first record was no TLS record at all, before any ClientHello: almost always
        /// plain HTTP (`ws://` or `http://` to the TLS port). The caller answers
        /// [`PLAIN_HTTP_REFUSAL`] instead of the alert rustls queued, which such a client
        /// would show as garbage or an opaque protocol error.
        plain_http: bool,
    },
}

/// The answer to plain HTTP on the TLS port.
const PLAIN_HTTP_REFUSAL: &[u8] = b"HTTP/1.1 400 Bad Request\r\nContent-Type: text/plain\r\n\
Content-Length: 67\r\nConnection: close\r\n\r\n\
this port speaks TLS: connect with wss:// (or https://), not ws://\n";

/// Sends [`PLAIN_HTTP_REFUSAL`] in place of the alert rustls queued, which is dropped: after
/// the answer it would read as the start of a body. Best effort, as [`send_plain_alert`].
pub(crate) fn send_plain_http_refusal(fd: RawFd, tls: &mut ServerConnection) {
    while tls.wants_write() {
        if tls.write_tls(&mut io::sink()).is_err() {
            break;
        }
    }
    let _ = Fd(fd).write(PLAIN_HTTP_REFUSAL);
}

/// A fatal `decode_error` alert as a plaintext record, what rustls sends for a handshake
/// message it will not take when it gets to check one.
const PLAIN_DECODE_ERROR: [u8; 7] = [21, 3, 3, 0, 2, 2, 50];

/// Sends [`PLAIN_DECODE_ERROR`] where rustls refused input without queuing an alert: a
/// handshake message over the 64 KiB it takes (TLS allows 16 MiB), which it refuses while
/// joining the message's records, before its handshake code (which would send the alert)
/// sees it. Only right before a ClientHello was taken: until then nothing is encrypted and
/// the client reads a plaintext alert; later it expects encrypted records, and the FIN alone
/// must do. Best effort, like any last words: 7 bytes to a socket that has sent nothing yet.
pub(crate) fn send_plain_alert(fd: RawFd) {
    let _ = Fd(fd).write(&PLAIN_DECODE_ERROR);
}

/// The end of a session rustls refused: whether the caller owes the alert itself (never in
/// answer to the client's own alert).
fn failed(tls: &ServerConnection, why: rustls::Error) -> TlsRead {
    let before_hello = tls.protocol_version().is_none();
    let plain_alert =
        !matches!(why, rustls::Error::AlertReceived(_)) && !tls.wants_write() && before_hello;
    let plain_http = before_hello
        && matches!(
            why,
            rustls::Error::InvalidMessage(rustls::InvalidMessage::InvalidContentType)
        );
    TlsRead::Failed {
        why,
        plain_alert,
        plain_http,
    }
}

/// What one read took off the socket.
#[derive(Debug, Default, Clone, Copy)]
pub(crate) struct Wire {
    pub(crate) bytes: usize,
    /// TLS records the read completed (0 on plain connections).
    pub(crate) records: usize,
}

/// Reads records from the socket, processes them, and copies out plaintext into `buf`;
/// `wire` is set to what came off the socket, `records` following the peer's framing.
pub(crate) fn read_tls(
    fd: RawFd,
    tls: &mut ServerConnection,
    records: &mut RecordCount,
    buf: &mut [u8],
    wire: &mut Wire,
) -> io::Result<TlsRead> {
    let mut counted = Counted {
        fd: Fd(fd),
        records,
        ended: 0,
    };
    let read = tls.read_tls(&mut counted);
    wire.records = counted.ended;
    match read {
        Ok(0) => return Ok(TlsRead::Closed),
        Ok(n) => wire.bytes = n,
        Err(e) if e.kind() == io::ErrorKind::WouldBlock => {}
        // The socket's errors carry an errno; rustls's own refusals of input (a buffer it
        // will not grow further) do not, and are the peer's doing like any bad record.
        Err(e) if e.raw_os_error().is_none() => {
            let why = rustls::Error::General(e.to_string());
            return Ok(failed(tls, why));
        }
        Err(e) => return Err(e),
    }
    let io = match tls.process_new_packets() {
        Ok(io) => io,
        Err(why) => return Ok(failed(tls, why)),
    };
    match tls.reader().read(buf) {
        Ok(0) => Ok(TlsRead::Closed),
        Ok(n) if io.peer_has_closed() && n >= io.plaintext_bytes_to_read() => Ok(TlsRead::Last(n)),
        Ok(n) => Ok(TlsRead::Data(n)),
        Err(e) if e.kind() == io::ErrorKind::WouldBlock => Ok(TlsRead::Data(0)),
        Err(e) if e.kind() == io::ErrorKind::UnexpectedEof => Ok(TlsRead::Closed),
        Err(e) => Err(e),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn record(body: &[u8]) -> Vec<u8> {
        let mut r = vec![23, 3, 3];
        r.extend_from_slice(&u16::try_from(body.len()).unwrap().to_be_bytes());
        r.extend_from_slice(body);
        r
    }

    /// Records are counted where they end, however the reads cut them: a small record read
    /// with the start of a large one is one record, and the large one counts when its last
    /// byte comes.
    #[test]
    fn records_are_counted_where_they_end_across_reads() {
        let small = record(&[1; 40]);
        let large = record(&[2; 30_000]);
        let mut stream = small.clone();
        stream.extend_from_slice(&large);
        for cut in [1, 3, 5, 45, 46, 4096, stream.len() - 1] {
            let mut c = RecordCount::default();
            let (a, b) = stream.split_at(cut);
            let first = c.ended_in(a);
            assert_eq!(first, usize::from(cut >= small.len()), "cut at {cut}");
            assert_eq!(first + c.ended_in(b), 2, "cut at {cut}");
        }
        // Byte by byte, and records with empty bodies.
        let mut c = RecordCount::default();
        let tiny: Vec<u8> = (0..100)
            .flat_map(|_| record(&[7]))
            .chain(record(&[]))
            .collect();
        assert_eq!(tiny.iter().map(|b| c.ended_in(&[*b])).sum::<usize>(), 101);
        assert_eq!(RecordCount::default().ended_in(&tiny), 101);
    }
}
