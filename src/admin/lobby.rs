//! Admin connections the cores cannot take wait here, in the admin acceptor's poll set, while
//! their requests arrive and while their answers leave. A pool thread gets a connection only
//! with a whole request to answer, writes what the socket takes at once, and gives it back
//! here with the rest.
//!
//! A pool thread that waited on a client, to read or to write, could be held by it: past the
//! cores' share, a few dozen silent, trickling or idle keep-alive connections tied up every
//! pool thread, and so did eight that pipelined big requests and never read the answers.
//! Waiting here costs a descriptor, a slot in one `poll(2)` call, and the bytes of the request
//! so far or of the answer not yet taken.

use std::io::{ErrorKind, Read, Write};
use std::net::{TcpListener, TcpStream};
use std::os::fd::{AsRawFd, RawFd};
use std::time::Instant;

use crate::admin::{parse_request, Parsed, Refusal, Request, RequestClock, CONTINUE};

/// Connections that may wait at once for a request or an answer; past it a new one is refused
/// (503).
pub(crate) const MAX_WAITING: usize = 1024;
/// Refused connections that may linger besides them, reading and dropping what their clients
/// still send (see [`Held::linger`]); past it a refusal closes once its 503 is written.
pub(crate) const MAX_LINGERING: usize = 256;
/// Bytes of unfinished requests held in all. One request may be 1 MiB; a thousand of them
/// trickling in would otherwise hold a gigabyte. A read past it is answered 503.
pub(crate) const MAX_HELD_BYTES: usize = 32 << 20;
/// Bytes of answers waiting for their clients to read them, in all. Past it a connection
/// whose answer would wait is closed instead: its client was not reading.
pub(crate) const MAX_UNSENT_BYTES: usize = 64 << 20;
/// Bytes read from one connection per wake-up, so that one fast sender does not hold up the
/// rest of the poll set.
const READ_PER_WAKE: usize = 64 << 10;

/// An admin connection between requests, as it passes between the lobby and the pool.
#[derive(Debug)]
pub(crate) struct Held {
    pub(crate) stream: TcpStream,
    /// Bytes read past the last whole request (pipelined, or the start of the next).
    pub(crate) buf: Vec<u8>,
    /// Requests answered on it so far.
    pub(crate) served: usize,
    /// The end of an answer the socket did not take yet; the next request is read only once
    /// it has gone, so a connection holds one answer at a time.
    pub(crate) unsent: Vec<u8>,
    /// Close once `unsent` has gone.
    pub(crate) close_after: bool,
    /// Its request was refused: once the answer has gone, read and drop what the client still
    /// sends before closing (see [`crate::admin::LINGER`]).
    pub(crate) linger: bool,
}

impl Held {
    pub(crate) fn new(stream: TcpStream) -> Self {
        Held {
            stream,
            buf: Vec::new(),
            served: 0,
            unsent: Vec::new(),
            close_after: false,
            linger: false,
        }
    }

    /// Writes `bytes` as far as the non-blocking socket takes them; what it does not take is
    /// kept in `unsent` for the lobby. False when the connection broke.
    pub(crate) fn send(&mut self, bytes: &[u8], close_after: bool) -> bool {
        self.close_after = close_after;
        match write_some(&mut self.stream, bytes) {
            Some(n) => {
                self.unsent = bytes.get(n..).unwrap_or_default().to_vec();
                true
            }
            None => false,
        }
    }
}

/// Writes what a non-blocking socket takes now: the count, or None when it broke.
fn write_some(stream: &mut TcpStream, bytes: &[u8]) -> Option<usize> {
    let mut done = 0;
    while let Some(rest) = bytes.get(done..).filter(|r| !r.is_empty()) {
        match stream.write(rest) {
            Ok(0) => return None,
            Ok(n) => done += n,
            Err(e) if e.kind() == ErrorKind::WouldBlock => break,
            Err(e) if e.kind() == ErrorKind::Interrupted => {}
            Err(_) => return None,
        }
    }
    Some(done)
}

struct Waiting {
    conn: Held,
    clock: RequestClock,
    deadline: Instant,
    /// `100 Continue` was sent for the request in `buf`.
    continued: bool,
    /// Admitted with bytes in `buf`: they may already hold a whole request, which no poll
    /// would announce.
    unparsed: bool,
    /// Refused and answered: the bytes read and dropped since (see [`Held::linger`]).
    lingering: Option<usize>,
    /// A wait has polled it since it came: only then may it be closed for room.
    polled: bool,
}

/// What one wait found.
#[derive(Default)]
pub(crate) struct Woken {
    /// The listener has connections to accept.
    pub(crate) accept: bool,
    /// The pool rang: connections it answered are waiting to come back.
    pub(crate) rung: bool,
    /// Connections with a whole request to answer, or one refused before routing.
    pub(crate) ready: Vec<(Held, Result<Request, Refusal>)>,
}

impl Woken {
    /// Whether nothing arrived: no connection to accept, none back from the pool, none with a
    /// request.
    pub(crate) fn is_quiet(&self) -> bool {
        !self.accept && !self.rung && self.ready.is_empty()
    }
}

/// Connections waiting for a whole request.
#[derive(Default)]
pub(crate) struct Lobby {
    waiting: Vec<Waiting>,
    held_bytes: usize,
    unsent_bytes: usize,
    /// When the next [`Lobby::wait`] returns at the latest, whatever arrives.
    wake_by: Option<Instant>,
}

impl Lobby {
    /// Lets `conn` wait for its next request, or linger once refused; gives it back when its
    /// kind is at its bound ([`MAX_WAITING`], [`MAX_LINGERING`]).
    pub(crate) fn admit(&mut self, conn: Held, now: Instant) -> Result<(), Held> {
        if !self.has_room(conn.linger, now) {
            return Err(conn);
        }
        self.enter(conn, now)
    }

    /// Lets a connection the pool answered wait here again, whatever the count: it had its
    /// place before the pool took it, and the lobby may have filled since with connections
    /// still sending their requests, which no longer made room for it; closing it cut its
    /// answer short. At most the pool's queue and threads hold connections away from here, so
    /// this stays bounded by that many past the bounds.
    pub(crate) fn take_back(&mut self, conn: Held, now: Instant) -> Result<(), Held> {
        self.enter(conn, now)
    }

    /// Puts `conn` in the poll set, to wait for its next request, to send the rest of its
    /// answer or to linger; gives it back when its answer's bytes would pass
    /// [`MAX_UNSENT_BYTES`].
    fn enter(&mut self, conn: Held, now: Instant) -> Result<(), Held> {
        if conn.stream.set_nonblocking(true).is_err()
            || self.unsent_bytes + conn.unsent.len() > MAX_UNSENT_BYTES
        {
            return Err(conn);
        }
        let mut clock = RequestClock::new(conn.served > 0);
        let deadline = match conn.unsent.is_empty() {
            true => now + clock.wait(!conn.buf.is_empty(), now),
            // An answer has as long to leave as a request to come, from its last progress.
            false => now + crate::admin::IO_TIMEOUT,
        };
        let mut w = Waiting {
            unparsed: !conn.buf.is_empty() && conn.unsent.is_empty(),
            conn,
            clock,
            deadline,
            continued: false,
            lingering: None,
            polled: false,
        };
        if w.conn.unsent.is_empty() && w.conn.linger {
            // A refusal the pool answered whole: nothing is left but to linger.
            if let Step::Gone = Self::start_lingering(&mut w, now) {
                return Ok(());
            }
        }
        // Counted as it waits: a lingering connection's bytes are gone already.
        self.held_bytes += w.conn.buf.len();
        self.unsent_bytes += w.conn.unsent.len();
        self.waiting.push(w);
        Ok(())
    }

    /// Answers 503 on a connection nothing can serve now (the lobby or the pool is full), then
    /// lets it linger as any refused one: its client may still be sending a request, and a
    /// close with its bytes unread would reset the connection, and the answer with it, under
    /// the client's next write. With [`MAX_LINGERING`] lingering already it closes after
    /// what the socket took at once.
    pub(crate) fn refuse(&mut self, mut conn: Held, now: Instant) {
        if conn.stream.set_nonblocking(true).is_err() {
            return;
        }
        conn.buf = Vec::new();
        conn.linger = true;
        if conn.send(&crate::admin::busy_answer(), true) {
            let _ = self.admit(conn, now);
        }
    }

    /// Whether a connection may wait here: a refused one (`lingering`) within its own bound,
    /// so that refusals never take the place of a connection being served nor close one for
    /// room; any other within [`MAX_WAITING`], making room by closing the one idle longest or,
    /// with none idle, by refusing the request that has been arriving longest.
    /// Connections refused while they waited linger in place, in their own bound first, so
    /// that the lobby never holds more than both bounds together.
    fn has_room(&mut self, lingering: bool, now: Instant) -> bool {
        // Neither bound is reached below the smaller one, and counting walks the set.
        if self.waiting.len() < MAX_LINGERING.min(MAX_WAITING) {
            return true;
        }
        let refused = self.waiting.iter().filter(|w| w.conn.linger).count();
        match lingering {
            true => refused < MAX_LINGERING,
            false => {
                self.waiting.len() - refused.min(MAX_LINGERING) < MAX_WAITING
                    || self.evict_idle()
                    || self.refuse_slowest(now)
            }
        }
    }

    /// Shuts the sending side of a refused connection whose answer has gone, and reads what
    /// its client still sends from now on, for up to [`crate::admin::LINGER`].
    fn start_lingering(w: &mut Waiting, now: Instant) -> Step {
        if w.conn.stream.shutdown(std::net::Shutdown::Write).is_err() {
            return Step::Gone;
        }
        w.conn.buf = Vec::new();
        w.lingering = Some(0);
        w.unparsed = false;
        w.deadline = now + crate::admin::LINGER;
        Step::Wait
    }

    /// Reads and drops what a lingering connection's client sent, up to [`READ_PER_WAKE`] at
    /// a time as for a request: a few hundred refused clients streaming at once would
    /// otherwise hold `/healthz` behind their megabytes. Gone once it closed or sent
    /// [`crate::admin::LINGER_BYTES`].
    fn drain(w: &mut Waiting) -> Step {
        let mut chunk = [0u8; 16 << 10];
        let Some(drained) = w.lingering.as_mut() else {
            return Step::Wait;
        };
        let mut now = 0;
        loop {
            if now >= READ_PER_WAKE {
                return Step::Wait;
            }
            match w.conn.stream.read(&mut chunk) {
                Ok(0) => return Step::Gone,
                Ok(n) => {
                    *drained += n;
                    now += n;
                    if *drained >= crate::admin::LINGER_BYTES {
                        return Step::Gone;
                    }
                }
                Err(e) if e.kind() == ErrorKind::WouldBlock => return Step::Wait,
                Err(e) if e.kind() == ErrorKind::Interrupted => {}
                Err(_) => return Step::Gone,
            }
        }
    }

    /// Closes the waiting connection that has been idle longest (nothing of a request read,
    /// nothing of an answer left to send), to make room for a new one; false when none is
    /// idle. Without it, 1,024 connections that never send a byte held the lobby, and with the
    /// cores' share full too, `/healthz` answered 503 to every probe for as long as they were
    /// renewed. Only one a wait has polled: a connection taken in this very round has had no
    /// chance to send, and closing it for the next one in the same burst served neither, and
    /// answered it with a reset instead of the 503 the newer one then gets.
    fn evict_idle(&mut self) -> bool {
        let Some(i) = self.nearest_deadline(false) else {
            return false;
        };
        // An idle connection holds no bytes the lobby counts.
        drop(self.waiting.swap_remove(i));
        crate::admin::note_evicted();
        true
    }

    /// With no connection idle, answers 503 (`busy`) to the request that has been arriving
    /// longest and lets it linger as any refused one, to make room for a new connection. A
    /// client sending 1,024 requests a byte at a time, each renewed before its 5 s ran out,
    /// otherwise kept every new connection refused, `/healthz` included, and a liveness probe
    /// failing under such a client gets the broker restarted and its rigs dropped. The oldest
    /// is the one its deadline would cut first anyway, and a probe, sent whole at once, is
    /// never it. Only one a wait has polled, as for [`Lobby::evict_idle`]; false when none is.
    fn refuse_slowest(&mut self, now: Instant) -> bool {
        let Some(i) = self.nearest_deadline(true) else {
            return false;
        };
        let w = self.waiting.swap_remove(i);
        self.held_bytes -= w.conn.buf.len();
        crate::admin::note_slow_refused();
        // Lingers in the refused connections' own room, or closes once its 503 is written.
        self.refuse(w.conn, now);
        true
    }

    /// Of the connections that may give way for a new one (polled, not refused, no answer
    /// left to send), idle or holding part of a request as `holding` says, the one whose
    /// deadline comes first: idle the longest, or its request arriving the longest.
    fn nearest_deadline(&self, holding: bool) -> Option<usize> {
        self.waiting
            .iter()
            .enumerate()
            .filter(|(_, w)| {
                w.polled
                    && !w.conn.linger
                    && w.conn.unsent.is_empty()
                    && w.conn.buf.is_empty() != holding
            })
            .min_by_key(|(_, w)| w.deadline)
            .map(|(i, _)| i)
    }

    /// Connections waiting now.
    #[cfg(test)]
    fn len(&self) -> usize {
        self.waiting.len()
    }

    /// Whether no connection waits here.
    pub(crate) fn is_empty(&self) -> bool {
        self.waiting.is_empty()
    }

    /// Makes the next waits return by `at` at the latest (`None`: only when something arrives
    /// or a connection runs out of time).
    pub(crate) fn wake_by(&mut self, at: Option<Instant>) {
        self.wake_by = at;
    }

    /// Waits until the listener, `bell` or a waiting connection is readable, and reads what
    /// arrived. Connections out of time (a request has 5 s from its first byte, an idle
    /// keep-alive connection 2 s) are closed.
    pub(crate) fn wait(&mut self, listener: &TcpListener, bell: RawFd) -> Woken {
        let mut woken = Woken::default();
        let now = Instant::now();
        self.expire(now);
        let mut timeout = self
            .waiting
            .iter()
            .map(|w| w.deadline)
            .min()
            .map_or(-1, |d| {
                // Rounded up: a wake-up a little early would only find nothing expired.
                let left = d.saturating_duration_since(now);
                left.as_millis().saturating_add(1).min(i32::MAX as u128) as i32
            });
        if let Some(at) = self.wake_by {
            let left = at
                .saturating_duration_since(now)
                .as_millis()
                .saturating_add(1);
            let left = left.min(i32::MAX as u128) as i32;
            timeout = if timeout < 0 { left } else { timeout.min(left) };
        }
        if self.waiting.iter().any(|w| w.unparsed) {
            timeout = 0;
        }
        let listen = |fd| (fd, libc::POLLIN);
        let mut fds: Vec<libc::pollfd> = [listen(listener.as_raw_fd()), listen(bell)]
            .into_iter()
            .chain(self.waiting.iter().map(|w| {
                let writing = !w.conn.unsent.is_empty();
                let events = if writing { libc::POLLOUT } else { libc::POLLIN };
                (w.conn.stream.as_raw_fd(), events)
            }))
            .map(|(fd, events)| libc::pollfd {
                fd,
                events,
                revents: 0,
            })
            .collect();
        // SAFETY: `fds` is a valid array of initialized pollfd for its length.
        let n = unsafe { libc::poll(fds.as_mut_ptr(), fds.len() as libc::nfds_t, timeout) };
        let readable = |i: usize| n > 0 && fds.get(i).is_some_and(|p| p.revents != 0);
        woken.accept = readable(0);
        woken.rung = readable(1);
        let now = Instant::now();
        let mut still = Vec::with_capacity(self.waiting.len());
        for (i, mut w) in std::mem::take(&mut self.waiting).into_iter().enumerate() {
            w.polled = true;
            // The lobby counts a connection's bytes only while it holds them.
            self.held_bytes -= w.conn.buf.len();
            self.unsent_bytes -= w.conn.unsent.len();
            let step = if !w.conn.unsent.is_empty() {
                if readable(i + 2) {
                    Self::write(&mut w, now)
                } else {
                    Step::Wait
                }
            } else if readable(i + 2) && w.lingering.is_some() {
                Self::drain(&mut w)
            } else if readable(i + 2) {
                self.read(&mut w, now)
            } else if std::mem::take(&mut w.unparsed) {
                Step::Parse
            } else {
                Step::Wait
            };
            match step {
                Step::Wait => {}
                Step::Parse => match parse_request(&w.conn.buf) {
                    Parsed::Complete(req, len) => {
                        w.conn.buf.drain(..len);
                        woken.ready.push((w.conn, Ok(req)));
                        continue;
                    }
                    Parsed::Bad(refusal) => {
                        woken.ready.push((w.conn, Err(refusal)));
                        continue;
                    }
                    Parsed::Partial { send_continue } => {
                        if send_continue && !std::mem::replace(&mut w.continued, true) {
                            // 25 bytes to a socket whose client waits for them: they fit.
                            let _ = w.conn.stream.write(CONTINUE);
                        }
                    }
                },
                Step::CutShort => {
                    // Closed unanswered, as on the cores.
                    crate::admin::note_unfinished();
                    continue;
                }
                Step::Over => {
                    // Answered here; its bytes are dropped before the answer goes, and what
                    // its client still sends is read and dropped too.
                    w.conn.buf = Vec::new();
                    w.conn.linger = true;
                    if !w.conn.send(&crate::admin::busy_answer(), true) {
                        continue;
                    }
                    if w.conn.unsent.is_empty() {
                        if let Step::Gone = Self::start_lingering(&mut w, now) {
                            continue;
                        }
                    } else {
                        w.deadline = now + crate::admin::IO_TIMEOUT;
                    }
                }
                Step::Gone => continue,
            }
            self.held_bytes += w.conn.buf.len();
            self.unsent_bytes += w.conn.unsent.len();
            still.push(w);
        }
        self.waiting = still;
        self.expire(now);
        woken
    }

    /// Sends what the socket takes of a connection's answer. Once all of it has gone the
    /// connection closes if its answer said so, or waits for its next request (already in
    /// `buf`, perhaps, pipelined).
    fn write(w: &mut Waiting, now: Instant) -> Step {
        let Some(n) = write_some(&mut w.conn.stream, &w.conn.unsent) else {
            return Step::Gone;
        };
        w.conn.unsent.drain(..n);
        if !w.conn.unsent.is_empty() {
            if n > 0 {
                w.deadline = now + crate::admin::IO_TIMEOUT;
            }
            return Step::Wait;
        }
        if w.conn.close_after {
            return match w.conn.linger {
                true => Self::start_lingering(w, now),
                false => Step::Gone,
            };
        }
        w.clock = RequestClock::new(true);
        w.deadline = now + w.clock.wait(!w.conn.buf.is_empty(), now);
        w.continued = false;
        Step::Parse
    }

    /// Reads what one connection has, up to [`READ_PER_WAKE`].
    fn read(&self, w: &mut Waiting, now: Instant) -> Step {
        let mut chunk = [0u8; 16 << 10];
        let mut got = 0;
        while got < READ_PER_WAKE {
            match w.conn.stream.read(&mut chunk) {
                Ok(0) if w.conn.buf.is_empty() => return Step::Gone,
                Ok(0) => return Step::CutShort,
                Ok(n) => {
                    if self.held_bytes + w.conn.buf.len() + n > MAX_HELD_BYTES {
                        return Step::Over;
                    }
                    w.conn
                        .buf
                        .extend_from_slice(chunk.get(..n).unwrap_or_default());
                    got += n;
                }
                Err(e) if e.kind() == ErrorKind::WouldBlock => break,
                Err(e) if e.kind() == ErrorKind::Interrupted => {}
                Err(_) => return Step::Gone,
            }
        }
        if got == 0 {
            return Step::Wait;
        }
        w.clock.got_bytes(now);
        w.deadline = now + w.clock.wait(true, now);
        Step::Parse
    }

    /// Closes the connections out of time: a request that has not come whole gets no answer,
    /// as on the cores.
    fn expire(&mut self, now: Instant) {
        let (held, unsent) = (&mut self.held_bytes, &mut self.unsent_bytes);
        self.waiting.retain(|w| {
            let keep = w.deadline > now;
            if !keep && w.conn.unsent.is_empty() && !w.conn.buf.is_empty() {
                crate::admin::note_unfinished();
            }
            if !keep {
                *held -= w.conn.buf.len();
                *unsent -= w.conn.unsent.len();
            }
            keep
        });
    }
}

/// What reading a connection left to do.
enum Step {
    /// Nothing new.
    Wait,
    /// New bytes: see whether a request is whole.
    Parse,
    /// The client closed inside a request.
    CutShort,
    /// Its bytes would pass the lobby's bound.
    Over,
    /// Closed between requests, or broken.
    Gone,
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::unix::net::UnixStream;
    use std::time::Duration;

    /// Held by the tests that make room in a full lobby, so that each reads the counters of
    /// connections closed or refused for room as only its own changed them.
    static MAKING_ROOM: std::sync::Mutex<()> = std::sync::Mutex::new(());

    fn making_room() -> std::sync::MutexGuard<'static, ()> {
        MAKING_ROOM.lock().unwrap_or_else(|e| e.into_inner())
    }

    struct Setup {
        listener: TcpListener,
        bell: UnixStream,
        _ringer: UnixStream,
    }

    fn setup() -> Setup {
        let listener = TcpListener::bind("127.0.0.1:0").expect("bind");
        let (bell, ringer) = UnixStream::pair().expect("pair");
        Setup {
            listener,
            bell,
            _ringer: ringer,
        }
    }

    fn connect(s: &Setup) -> (TcpStream, TcpStream) {
        let client = TcpStream::connect(s.listener.local_addr().expect("addr")).expect("connect");
        let (server, _) = s.listener.accept().expect("accept");
        (client, server)
    }

    /// A lobby holding one new connection, and that connection's client.
    fn one_admitted() -> (Setup, Lobby, TcpStream) {
        let s = setup();
        let mut lobby = Lobby::default();
        let (client, server) = connect(&s);
        lobby
            .admit(Held::new(server), Instant::now())
            .expect("room");
        (s, lobby, client)
    }

    /// One wait that returns at once: every connection waiting is polled.
    fn one_round(lobby: &mut Lobby, s: &Setup) -> Woken {
        lobby.wake_by(Some(Instant::now()));
        let woken = lobby.wait(&s.listener, s.bell.as_raw_fd());
        lobby.wake_by(None);
        woken
    }

    /// Waits until the lobby hands something over, or `limit` passes.
    fn wait_for_ready(lobby: &mut Lobby, s: &Setup, limit: Duration) -> Woken {
        let end = Instant::now() + limit;
        loop {
            let woken = lobby.wait(&s.listener, s.bell.as_raw_fd());
            if !woken.ready.is_empty() || Instant::now() >= end {
                return woken;
            }
        }
    }

    #[test]
    fn a_request_trickling_in_is_handed_over_only_once_whole() {
        let (s, mut lobby, mut client) = one_admitted();
        for part in [&b"GET /hea"[..], b"lthz HTTP/1.1\r\n", b"Host: x\r\n"] {
            client.write_all(part).expect("write");
            let woken = lobby.wait(&s.listener, s.bell.as_raw_fd());
            assert!(woken.ready.is_empty(), "handed over half a request");
        }
        client.write_all(b"\r\nGET /x").expect("write");
        let mut woken = wait_for_ready(&mut lobby, &s, Duration::from_secs(5));
        let (conn, req) = woken.ready.pop().expect("a whole request");
        let req = req.expect("well formed");
        assert_eq!(
            (req.method.as_str(), req.path.as_str()),
            ("GET", "/healthz")
        );
        assert_eq!(
            conn.buf, b"GET /x",
            "the next request's start stays with it"
        );
        assert_eq!(lobby.len(), 0);
        assert_eq!(lobby.held_bytes, 0);
    }

    #[test]
    fn a_connection_given_back_with_a_whole_request_in_hand_is_handed_over_at_once() {
        let s = setup();
        let mut lobby = Lobby::default();
        let (_client, server) = connect(&s);
        let conn = Held {
            buf: b"GET /healthz HTTP/1.1\r\n\r\n".to_vec(),
            served: 1,
            ..Held::new(server)
        };
        lobby.admit(conn, Instant::now()).expect("room");
        let woken = lobby.wait(&s.listener, s.bell.as_raw_fd());
        assert_eq!(woken.ready.len(), 1, "no poll would have announced it");
    }

    #[test]
    fn an_answer_the_socket_did_not_take_is_sent_as_the_client_reads_then_the_next_request_is_read()
    {
        let s = setup();
        let mut lobby = Lobby::default();
        let (mut client, server) = connect(&s);
        let answer: Vec<u8> = (0..8 << 20).map(|i| (i % 251) as u8).collect();
        let mut conn = Held::new(server);
        conn.stream.set_nonblocking(true).expect("nonblocking");
        assert!(conn.send(&answer, false));
        assert!(!conn.unsent.is_empty(), "8 MiB fit the socket at once");
        conn.buf = b"GET /healthz HTTP/1.1\r\n\r\n".to_vec();
        lobby.admit(conn, Instant::now()).expect("room");
        client.set_nonblocking(true).expect("nonblocking");
        let mut got = Vec::new();
        let mut chunk = vec![0u8; 1 << 16];
        let mut ready = Vec::new();
        // The client takes what has arrived, then the lobby sends more into the room made.
        while got.len() < answer.len() {
            while got.len() < answer.len() {
                match client.read(&mut chunk) {
                    Ok(0) => panic!("closed after {} bytes", got.len()),
                    Ok(n) => got.extend_from_slice(&chunk[..n]),
                    Err(e) if e.kind() == ErrorKind::WouldBlock => break,
                    Err(e) => panic!("{e}"),
                }
            }
            // Handed over once all of it has left: the rest is in the kernel for the client.
            if ready.is_empty() {
                assert_eq!(lobby.len(), 1, "dropped after {} bytes", got.len());
                ready.extend(lobby.wait(&s.listener, s.bell.as_raw_fd()).ready);
            }
        }
        assert!(got == answer, "the answer arrived whole and in order");
        if ready.is_empty() {
            ready = wait_for_ready(&mut lobby, &s, Duration::from_secs(5)).ready;
        }
        let (_, req) = ready
            .pop()
            .expect("the pipelined request, once the answer left");
        assert_eq!(req.expect("well formed").path, "/healthz");
        assert_eq!((lobby.unsent_bytes, lobby.held_bytes), (0, 0));
    }

    #[test]
    fn answers_waiting_for_their_clients_are_bounded() {
        let s = setup();
        let mut lobby = Lobby::default();
        let (_client, server) = connect(&s);
        let mut conn = Held::new(server);
        conn.unsent = vec![0; MAX_UNSENT_BYTES + 1];
        assert!(lobby.admit(conn, Instant::now()).is_err());
    }

    /// A full lobby makes room for a new connection by closing the one idle longest, never
    /// one in the middle of a request.
    #[test]
    fn a_full_lobby_closes_its_longest_idle_connection_for_a_new_one() {
        let _room = making_room();
        let s = setup();
        let mut lobby = Lobby::default();
        let t0 = Instant::now();
        let mut clients = Vec::new();
        for i in 0..MAX_WAITING {
            let (client, server) = connect(&s);
            let mut conn = Held::new(server);
            // All but the second have a request half read: only the second is idle.
            if i != 1 {
                conn.buf = b"GET /he".to_vec();
            }
            lobby.admit(conn, t0).expect("room");
            clients.push(client);
        }
        // Only connections a wait has polled may give way.
        one_round(&mut lobby, &s);
        let evicted = crate::admin::evicted();
        let (_new, server) = connect(&s);
        lobby.admit(Held::new(server), t0).expect("room made");
        assert_eq!(lobby.len(), MAX_WAITING);
        assert_eq!(crate::admin::evicted(), evicted + 1);
        // The idle one was closed: its client reads the end.
        let mut b = [0u8; 1];
        clients[1]
            .set_read_timeout(Some(Duration::from_secs(5)))
            .expect("timeout");
        assert_eq!(clients[1].read(&mut b).expect("eof"), 0);
        // The new one is the only idle one now: once polled, it gives way to the next.
        one_round(&mut lobby, &s);
        let (_next, server) = connect(&s);
        let mut busy = Held::new(server);
        busy.buf = b"GET /he".to_vec();
        lobby.admit(busy, t0).expect("room made");
        assert_eq!(crate::admin::evicted(), evicted + 2);
        assert_eq!(lobby.len(), MAX_WAITING);
        drop(clients);
    }

    /// A full lobby with none idle makes room for a new connection by refusing the request
    /// that has been arriving longest: its client reads a 503, and the new one waits.
    #[test]
    fn a_full_lobby_with_none_idle_refuses_the_request_arriving_longest_for_a_new_one() {
        let _room = making_room();
        let s = setup();
        let mut lobby = Lobby::default();
        let t0 = Instant::now();
        let (mut oldest, server) = connect(&s);
        let mut conn = Held::new(server);
        conn.buf = b"GET /he".to_vec();
        lobby.admit(conn, t0).expect("room");
        let (_rest, server) = connect(&s);
        for _ in 1..MAX_WAITING {
            let mut conn = Held::new(server.try_clone().expect("dup"));
            conn.buf = b"GET /he".to_vec();
            lobby
                .admit(conn, t0 + Duration::from_millis(100))
                .expect("room");
        }
        // Only connections a wait has polled may give way.
        one_round(&mut lobby, &s);
        let refused = crate::admin::slow_refused();
        let (_new, server) = connect(&s);
        lobby
            .admit(Held::new(server), Instant::now())
            .expect("room made");
        assert_eq!(crate::admin::slow_refused(), refused + 1);
        // The refused one lingers in its own room; the rest and the new one wait.
        assert_eq!(lobby.len(), MAX_WAITING + 1);
        assert_eq!(lobby.waiting.iter().filter(|w| w.conn.linger).count(), 1);
        assert_eq!(lobby.held_bytes, (MAX_WAITING - 1) * 7);
        oldest
            .set_read_timeout(Some(Duration::from_secs(5)))
            .expect("timeout");
        let mut answer = String::new();
        oldest
            .read_to_string(&mut answer)
            .expect("the answer, then the close");
        assert!(
            answer.starts_with("HTTP/1.1 503 ") && answer.ends_with("busy\n"),
            "{answer}"
        );
    }

    #[test]
    fn silent_and_idle_connections_are_closed_at_their_limits() {
        let s = setup();
        let mut lobby = Lobby::default();
        let (_c1, fresh) = connect(&s);
        let (_c2, idle) = connect(&s);
        let t0 = Instant::now();
        lobby.admit(Held::new(fresh), t0).expect("room");
        let mut kept_alive = Held::new(idle);
        kept_alive.served = 1;
        lobby.admit(kept_alive, t0).expect("room");
        // An idle keep-alive connection has 2 s, a new one 5 s for its request.
        while lobby.len() == 2 {
            lobby.wait(&s.listener, s.bell.as_raw_fd());
        }
        let idle_for = t0.elapsed();
        while lobby.len() == 1 {
            lobby.wait(&s.listener, s.bell.as_raw_fd());
        }
        let fresh_for = t0.elapsed();
        assert!(
            idle_for >= Duration::from_secs(2) && idle_for < Duration::from_secs(4),
            "{idle_for:?}"
        );
        assert!(
            fresh_for >= Duration::from_secs(5) && fresh_for < Duration::from_secs(7),
            "{fresh_for:?}"
        );
    }

    #[test]
    fn a_client_closing_inside_a_request_or_between_two_is_let_go_unanswered() {
        let s = setup();
        let mut lobby = Lobby::default();
        let (mut half, server) = connect(&s);
        lobby
            .admit(Held::new(server), Instant::now())
            .expect("room");
        let (quiet, server) = connect(&s);
        lobby
            .admit(Held::new(server), Instant::now())
            .expect("room");
        let unfinished = crate::admin::http::unfinished();
        half.write_all(b"GET /heal").expect("write");
        half.shutdown(std::net::Shutdown::Write).expect("shutdown");
        drop(quiet);
        let deadline = Instant::now() + Duration::from_secs(5);
        while !lobby.is_empty() {
            assert!(Instant::now() < deadline, "still held");
            let woken = lobby.wait(&s.listener, s.bell.as_raw_fd());
            assert!(woken.ready.is_empty(), "neither is answered");
        }
        assert_eq!(lobby.held_bytes, 0);
        assert!(crate::admin::http::unfinished() > unfinished);
        let mut rest = Vec::new();
        half.read_to_end(&mut rest).expect("read");
        assert!(rest.is_empty(), "no answer: {rest:?}");
    }

    #[test]
    fn the_lobby_is_bounded_in_connections_and_bytes() {
        let _room = making_room();
        let s = setup();
        let mut lobby = Lobby::default();
        let (_client, server) = connect(&s);
        let now = Instant::now();
        for _ in 0..MAX_WAITING - 1 {
            let dup = server.try_clone().expect("dup");
            lobby.admit(Held::new(dup), now).expect("room");
        }
        lobby.admit(Held::new(server), now).expect("room");
        one_round(&mut lobby, &s);
        // Full: a new one is let in only in place of an idle one (here, a duplicate of the
        // first), so the count stays at the bound.
        let (_other, extra) = connect(&s);
        lobby
            .admit(Held::new(extra), now)
            .expect("an idle one gives way");
        assert_eq!(lobby.len(), MAX_WAITING);
    }

    /// A lobby holding [`MAX_WAITING`] connections each halfway through a request, none idle;
    /// all are duplicates of one socket, so as not to spend a client each.
    fn full_of_requests(s: &Setup) -> (Lobby, TcpStream) {
        let mut lobby = Lobby::default();
        let (client, server) = connect(s);
        for _ in 0..MAX_WAITING {
            let mut conn = Held::new(server.try_clone().expect("dup"));
            conn.buf = b"GET /he".to_vec();
            lobby.admit(conn, Instant::now()).expect("room");
        }
        (lobby, client)
    }

    /// A connection refused because the lobby is full is answered 503 and then read to its
    /// end: a client still sending its body finishes, reads the answer, and sees the close,
    /// where a close with its bytes unread would have reset both.
    #[test]
    fn a_connection_refused_by_a_full_lobby_lingers_until_its_client_is_done() {
        let s = setup();
        let (mut lobby, _first) = full_of_requests(&s);
        let (mut client, server) = connect(&s);
        let refused = lobby.admit(Held::new(server), Instant::now());
        lobby.refuse(refused.expect_err("full"), Instant::now());
        assert_eq!(lobby.len(), MAX_WAITING + 1);
        // The largest body an admin request may carry; the lobby reads up to twice that.
        let body = 1 << 20;
        let writer = std::thread::spawn(move || {
            let head = format!("POST /v1/drain HTTP/1.1\r\nContent-Length: {body}\r\n\r\n");
            client.write_all(head.as_bytes())?;
            client.write_all(&vec![b'x'; body])?;
            client.shutdown(std::net::Shutdown::Write)?;
            let mut answer = String::new();
            client.read_to_string(&mut answer)?;
            Ok::<_, std::io::Error>(answer)
        });
        let end = Instant::now() + Duration::from_secs(10);
        while lobby.len() > MAX_WAITING {
            assert!(Instant::now() < end, "the refused connection never closed");
            lobby.wait(&s.listener, s.bell.as_raw_fd());
        }
        let answer = writer
            .join()
            .expect("writer")
            .expect("the client's writes and read");
        assert!(answer.starts_with("HTTP/1.1 503 "), "{answer}");
    }

    /// A connection the pool answered comes back to its place even when the lobby has filled
    /// up meanwhile, where a new connection would be refused, and its client reads the whole
    /// answer.
    #[test]
    fn a_connection_back_from_the_pool_finds_its_place_in_a_full_lobby() {
        let s = setup();
        let (mut lobby, _first) = full_of_requests(&s);
        let (mut client, server) = connect(&s);
        let answer = b"HTTP/1.1 200 OK\r\nContent-Length: 5\r\nConnection: close\r\n\r\nhello";
        let mut conn = Held::new(server);
        conn.served = 1;
        conn.unsent = answer.to_vec();
        conn.close_after = true;
        let conn = lobby
            .admit(conn, Instant::now())
            .expect_err("full to new ones");
        lobby.take_back(conn, Instant::now()).expect("its place");
        client.set_nonblocking(true).expect("nonblocking");
        let end = Instant::now() + Duration::from_secs(5);
        let mut got = Vec::new();
        loop {
            lobby.wait(&s.listener, s.bell.as_raw_fd());
            match client.read_to_end(&mut got) {
                Ok(_) => break,
                Err(e) if e.kind() == ErrorKind::WouldBlock => {}
                Err(e) => panic!("after {} bytes: {e}", got.len()),
            }
            assert!(Instant::now() < end, "the answer never ended: {got:?}");
        }
        assert_eq!(got, answer);
    }

    /// A lingering connection is read a share at a time, like a request, however much its
    /// client has sent: the rest waits for the next wake-up.
    #[test]
    fn a_lingering_connection_is_read_a_share_at_a_time() {
        let s = setup();
        let mut lobby = Lobby::default();
        let (mut client, server) = connect(&s);
        // Room for all the client sends, so that it is all there before the lobby reads.
        socket2::SockRef::from(&server)
            .set_recv_buffer_size(4 << 20)
            .expect("receive buffer");
        lobby.refuse(Held::new(server), Instant::now());
        let sent = 8 * READ_PER_WAKE;
        // The client stays open after it: a close would end the lingering.
        let writer =
            std::thread::spawn(move || client.write_all(&vec![b'x'; sent]).map(|()| client));
        let end = Instant::now() + Duration::from_secs(5);
        while !writer.is_finished() {
            assert!(
                Instant::now() < end,
                "the body did not fit the sockets' buffers"
            );
            std::thread::yield_now();
        }
        let _client = writer.join().expect("writer").expect("the body");
        let mut shares = Vec::new();
        while shares.iter().sum::<usize>() < sent {
            assert!(Instant::now() < end, "read {shares:?}");
            let before = lobby.waiting.first().and_then(|w| w.lingering).unwrap_or(0);
            lobby.wait(&s.listener, s.bell.as_raw_fd());
            let after = lobby
                .waiting
                .first()
                .and_then(|w| w.lingering)
                .expect("lingering");
            shares.push(after - before);
        }
        assert!(shares.iter().all(|&n| n <= READ_PER_WAKE), "{shares:?}");
    }

    /// A connection taken in this very round is not closed to make room for the next one: no
    /// wait has polled it, so it had no chance to send its request. The newer one is refused
    /// instead, and the first is served once its request is read.
    #[test]
    fn a_connection_not_yet_polled_is_not_closed_for_room() {
        let s = setup();
        let mut lobby = Lobby::default();
        let (_first, server) = connect(&s);
        for _ in 0..MAX_WAITING - 1 {
            let mut conn = Held::new(server.try_clone().expect("dup"));
            conn.buf = b"GET /he".to_vec();
            lobby.admit(conn, Instant::now()).expect("room");
        }
        let (mut fresh, server) = connect(&s);
        fresh
            .write_all(b"GET /healthz HTTP/1.1\r\n\r\n")
            .expect("request");
        lobby
            .admit(Held::new(server), Instant::now())
            .expect("room");
        let (_newer, server) = connect(&s);
        assert!(lobby.admit(Held::new(server), Instant::now()).is_err());
        let woken = wait_for_ready(&mut lobby, &s, Duration::from_secs(5));
        let served: Vec<_> = woken
            .ready
            .iter()
            .map(|(_, r)| r.as_ref().map(|r| r.path.clone()))
            .collect();
        assert_eq!(served, [Ok("/healthz".to_string())]);
    }

    /// Refused connections linger within their own bound: past it one is answered and closed
    /// at once, and none of them takes the room of a connection being served.
    #[test]
    fn refused_connections_lingering_are_bounded_apart_from_the_rest() {
        let s = setup();
        let (mut lobby, _first) = full_of_requests(&s);
        // A client each: a refusal shuts its socket's sending side, which a duplicate shares.
        let mut clients = Vec::new();
        for _ in 0..MAX_LINGERING {
            let (client, server) = connect(&s);
            lobby.refuse(Held::new(server), Instant::now());
            clients.push(client);
        }
        assert_eq!(lobby.len(), MAX_WAITING + MAX_LINGERING);
        let (mut last, server) = connect(&s);
        lobby.refuse(Held::new(server), Instant::now());
        assert_eq!(lobby.len(), MAX_WAITING + MAX_LINGERING);
        last.set_read_timeout(Some(Duration::from_secs(5)))
            .expect("timeout");
        let mut answer = String::new();
        last.read_to_string(&mut answer)
            .expect("the answer, then the close");
        assert!(answer.starts_with("HTTP/1.1 503 "), "{answer}");
        // The served ones' room is theirs alone: a new busy one is still refused, and an
        // idle one is let in only in place of another idle one.
        let (_next, server) = connect(&s);
        let mut busy = Held::new(server);
        busy.buf = b"GET /he".to_vec();
        assert!(lobby.admit(busy, Instant::now()).is_err());
    }

    /// Past the byte bound a reading connection is answered 503 and holds nothing; what its
    /// client still sends is read and dropped until it closes, so the answer is not lost to a
    /// reset.
    #[test]
    fn a_connection_past_the_byte_bound_is_answered_and_read_to_its_end() {
        let (s, mut lobby, mut client) = one_admitted();
        lobby.held_bytes = MAX_HELD_BYTES - 10;
        client
            .write_all(b"POST /v1/drain HTTP/1.1\r\nContent-Length: 100000\r\n\r\n")
            .expect("write");
        client.set_nonblocking(true).expect("nonblocking");
        let end = Instant::now() + Duration::from_secs(5);
        while !matches!(client.peek(&mut [0u8; 1]), Ok(1)) {
            assert!(Instant::now() < end, "no answer");
            lobby.wait(&s.listener, s.bell.as_raw_fd());
        }
        assert_eq!(
            lobby.held_bytes,
            MAX_HELD_BYTES - 10,
            "its bytes are not held"
        );
        client.set_nonblocking(false).expect("blocking");
        client
            .write_all(&[b'x'; 50_000])
            .expect("the rest of the body");
        while lobby.waiting.first().and_then(|w| w.lingering) != Some(50_000) {
            assert!(Instant::now() < end, "the rest was not read");
            lobby.wait(&s.listener, s.bell.as_raw_fd());
        }
        client
            .shutdown(std::net::Shutdown::Write)
            .expect("shutdown");
        while !lobby.is_empty() {
            assert!(Instant::now() < end, "not closed once the client was done");
            lobby.wait(&s.listener, s.bell.as_raw_fd());
        }
        let mut answer = String::new();
        client
            .read_to_string(&mut answer)
            .expect("the answer, then the close");
        assert!(answer.starts_with("HTTP/1.1 503 "), "{answer}");
    }
}
