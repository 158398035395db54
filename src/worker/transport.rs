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

/// Reads records from the socket, processes them, and copies out plaintext into `buf`;
/// `wire` is set to the bytes that came off the socket.
pub(crate) fn read_tls(
    fd: RawFd,
    tls: &mut ServerConnection,
    buf: &mut [u8],
    wire: &mut usize,
) -> io::Result<TlsRead> {
    match tls.read_tls(&mut Fd(fd)) {
        Ok(0) => return Ok(TlsRead::Closed),
        Ok(n) => *wire = n,
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
