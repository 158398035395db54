//! The agent's life (CONTRACT.md §2, §5, §7): connect, hello, welcome; then ack each command on
//! receipt and hand it to the worker, and send the results the worker finishes; when the
//! connection ends, pick the wait (backoff, the broker's Retry-After, or the goaway delay) and
//! connect again with the same boot_id and `last_seq`.
//!
//! Everything runs on the main thread except commands (the worker). The socket is read with a
//! short timeout, so one loop both answers pings (tungstenite queues the pong on read) and
//! sends results as they finish.

use std::collections::VecDeque;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::mpsc::{Receiver, SyncSender, TrySendError};
use std::sync::Arc;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use fastrand::Rng;
use fleetlink::ids::BootId;
use rustls::ClientConfig;
use tungstenite::protocol::frame::coding::CloseCode;
use tungstenite::protocol::CloseFrame;
use tungstenite::{Message, WebSocket};

use crate::backoff::MAX_RETRY_AFTER_S;
use crate::cli::Config;
use crate::confirm::Unconfirmed;
use crate::dial::{self, DialError};
use crate::handler::Running;
use crate::proto::{self, Command, ServerMsg};
use crate::reconnect::{End, Exit, Policy};
use crate::seq::{SeqTracker, SeqVerdict};
use crate::tls::Stream;
use crate::worker::{Done, Job, MAX_QUEUED_BYTES};

/// Socket read timeout: the latency of sending a finished result and of noticing a stop.
const POLL: Duration = Duration::from_millis(50);
/// Longest wait for `welcome` after hello.
const WELCOME_TIMEOUT: Duration = Duration::from_secs(30);
/// Longest wait for the broker's close frame after ours.
const CLOSE_TIMEOUT: Duration = Duration::from_secs(2);
/// Added to three ping intervals: a broker silent for that long is presumed gone.
const SILENCE_SLACK: Duration = Duration::from_secs(10);
/// Longest a stopping agent waits for the results of what it accepted (each either the
/// killed command's or "not run") to go out before it closes.
const WIND_DOWN: Duration = Duration::from_secs(5);

/// How a stopping agent ends what it accepted: commands not started are reported not run
/// (`abandon`, read by the worker), and the one running is killed.
pub(crate) struct Stopping {
    pub(crate) abandon: Arc<AtomicBool>,
    pub(crate) running: Running,
}

/// The process-wide state: survives connections.
pub(crate) struct Agent {
    cfg: Config,
    tls: Option<Arc<ClientConfig>>,
    /// Fresh per process, never per connection: a reconnect resumes the broker session.
    boot: BootId,
    seqs: SeqTracker,
    jobs: SyncSender<Job>,
    /// Bytes of the commands `jobs` holds or runs (see [`MAX_QUEUED_BYTES`]).
    queued: Arc<AtomicUsize>,
    done: Receiver<Done>,
    /// A result taken from `done` whose send failed; sent first on the next connection.
    unsent: VecDeque<Done>,
    policy: Policy,
    stop: Arc<AtomicBool>,
    /// `--run-for` deadline.
    deadline: Option<Instant>,
    /// Commands handed to the worker whose result has not come back from it yet.
    pending: usize,
    stopping: Stopping,
    /// Acks of the connection that ended which the broker had not shown it read, acked again
    /// after a resumed welcome: an ack lost with a connection leaves the broker holding that
    /// command unacked for good (not sent again, since the hello's `last_seq` covers it), to
    /// be reported `rig_rebooted` when this process ends.
    recent_acks: Vec<u64>,
    /// Results and acks sent on this connection that the broker has not yet shown it read
    /// (see [`Unconfirmed`]): they go again on the next connection.
    unconfirmed: Unconfirmed,
    /// Results of a connection that ended unconfirmed, (seq, text), sent again after the next
    /// welcome.
    resend: VecDeque<(u64, String)>,
}

/// One live websocket and what the session loop tracks about it.
struct Conn {
    ws: WebSocket<Stream>,
    addr: SocketAddr,
    welcomed: Option<Instant>,
    goaway: Option<Instant>,
}

impl Conn {
    fn lost(&self, why: String, close: Option<(u16, String)>) -> End {
        if let Some(at) = self.goaway {
            log::info!("connection ended after goaway: {why}");
            return End::Goaway(at);
        }
        End::Lost {
            why,
            welcomed_for: self.welcomed.map(|w| w.elapsed()),
            close,
        }
    }
}

/// What one read produced.
enum Read {
    /// Nothing within the poll interval.
    Idle,
    /// A ping, or a binary message: the broker is alive.
    Control,
    /// A pong, with its payload: the broker is alive, and read what went before our ping.
    Pong(Vec<u8>),
    Text(String),
    Closed(u16, String),
    Failed(String),
}

impl Agent {
    pub(crate) fn new(
        cfg: Config,
        tls: Option<Arc<ClientConfig>>,
        (jobs, queued): (SyncSender<Job>, Arc<AtomicUsize>),
        done: Receiver<Done>,
        stop: Arc<AtomicBool>,
        stopping: Stopping,
    ) -> Agent {
        let unix_ms = SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .map(|d| d.as_millis() as u64)
            .unwrap_or(0);
        let deadline = cfg.run_for.map(|d| Instant::now() + d);
        let policy = Policy::new(cfg.max_attempts, Rng::new());
        Agent {
            cfg,
            tls,
            boot: BootId::generate(unix_ms),
            seqs: SeqTracker::default(),
            jobs,
            queued,
            done,
            unsent: VecDeque::new(),
            policy,
            stop,
            deadline,
            pending: 0,
            stopping,
            recent_acks: Vec::new(),
            unconfirmed: Unconfirmed::default(),
            resend: VecDeque::new(),
        }
    }

    /// Connects until told to stop, or a reason to give up; then ends what it accepted.
    pub(crate) fn run(mut self) -> Exit {
        let exit = self.connect_until_done();
        self.abandon_pending();
        exit
    }

    fn connect_until_done(&mut self) -> Exit {
        log::info!(
            "rig {} boot_id {} (version {})",
            self.cfg.rig_id,
            self.boot,
            env!("CARGO_PKG_VERSION")
        );
        let mut attempt = 0u64;
        loop {
            if self.stopping() {
                return Exit::Stopped;
            }
            attempt += 1;
            log::info!(
                "connecting to {} (attempt {attempt}, last_seq {:?})",
                self.cfg.endpoint.url,
                self.seqs.last_seq()
            );
            let dialed = dial::dial_unless(
                &self.cfg.endpoint,
                self.tls.as_ref(),
                self.cfg.token_file.as_deref(),
                || self.stopping(),
                POLL,
            );
            let Some(dialed) = dialed else {
                return Exit::Stopped;
            };
            let end = match dialed {
                Ok((ws, addr)) => {
                    let end = self.connection(Conn {
                        ws,
                        addr,
                        welcomed: None,
                        goaway: None,
                    });
                    self.after_connection();
                    end
                }
                Err(DialError::Unavailable { retry_after }) => End::Unavailable(retry_after),
                Err(DialError::Refused(why)) => End::Refused(why),
                Err(DialError::Failed(why)) => End::Lost {
                    why,
                    welcomed_for: None,
                    close: None,
                },
            };
            let delay = match self.policy.plan(end, Instant::now()) {
                Ok(delay) => delay,
                Err(exit) => return exit,
            };
            if !self.sleep(delay) {
                return Exit::Stopped;
            }
        }
    }

    /// What a connection's end leaves of the results it sent: those the broker had not shown
    /// it read go again, however it ended (a broker that sends a close may not read what was
    /// on its way; one that broke may have lost anything in its buffers).
    fn after_connection(&mut self) {
        let (results, acks) = self.unconfirmed.take();
        self.resend.extend(results);
        self.recent_acks = acks;
    }

    /// Runs one connection from hello to its end.
    fn connection(&mut self, mut conn: Conn) -> End {
        if let Err(e) = conn.ws.get_ref().tcp().set_read_timeout(Some(POLL)) {
            return conn.lost(format!("socket options: {e}"), None);
        }
        let hello = proto::hello(
            self.cfg.rig_id.as_str(),
            self.boot.as_str(),
            &self.cfg.labels,
            self.seqs.last_seq(),
        );
        if let Err(e) = conn.ws.send(Message::text(hello)) {
            return conn.lost(format!("sending hello: {e}"), None);
        }
        let ping_interval_ms = match self.await_welcome(&mut conn) {
            Ok(ms) => ms,
            Err(end) => return end,
        };
        let silence_limit =
            Duration::from_millis(ping_interval_ms.saturating_mul(3)) + SILENCE_SLACK;
        let mut last_rx = Instant::now();
        loop {
            if self.stopping() {
                self.wind_down(&mut conn.ws);
                close(&mut conn.ws, 1001, "agent stopping");
                return End::Exit(Exit::Stopped);
            }
            if let Some(at) = conn.goaway.filter(|&at| Instant::now() >= at) {
                close(&mut conn.ws, 1000, "goaway");
                return End::Goaway(at);
            }
            if last_rx.elapsed() > silence_limit {
                return conn.lost(
                    format!("broker silent for {}s", silence_limit.as_secs()),
                    None,
                );
            }
            if let Err(why) = self.send_results(&mut conn.ws) {
                return conn.lost(why, None);
            }
            if let Some(round) = self.unconfirmed.ask() {
                if let Err(e) = conn.ws.send(Message::Ping(round.to_vec().into())) {
                    return conn.lost(format!("sending a ping: {e}"), None);
                }
            }
            match read(&mut conn.ws) {
                Read::Idle => {}
                Read::Control => last_rx = Instant::now(),
                Read::Pong(payload) => {
                    last_rx = Instant::now();
                    self.unconfirmed.pong(&payload);
                }
                Read::Text(text) => {
                    last_rx = Instant::now();
                    if let Some(end) = self.on_text(&mut conn, &text) {
                        return end;
                    }
                }
                Read::Closed(code, reason) => {
                    return conn.lost(
                        format!("closed by broker: {code} {reason:?}"),
                        Some((code, reason)),
                    )
                }
                Read::Failed(why) => return conn.lost(why, None),
            }
        }
    }

    /// Waits for `welcome`; returns its ping interval.
    fn await_welcome(&mut self, conn: &mut Conn) -> Result<u64, End> {
        let deadline = Instant::now() + WELCOME_TIMEOUT;
        loop {
            if self.stopping() {
                close(&mut conn.ws, 1001, "agent stopping");
                return Err(End::Exit(Exit::Stopped));
            }
            match read(&mut conn.ws) {
                Read::Text(text) => match proto::parse_server_msg(&text) {
                    Ok(ServerMsg::Welcome {
                        broker_id,
                        ping_interval_ms,
                        resumed,
                    }) => {
                        self.on_welcome(conn, &broker_id, resumed);
                        return Ok(ping_interval_ms);
                    }
                    Ok(other) => log::warn!("before welcome, ignored: {other:?}"),
                    Err(e) => log::warn!(
                        "before welcome, ignored a bad message ({e}): {}",
                        clip(&text)
                    ),
                },
                Read::Idle | Read::Control | Read::Pong(_) => {
                    if Instant::now() > deadline {
                        return Err(conn.lost(
                            format!("no welcome within {}s", WELCOME_TIMEOUT.as_secs()),
                            None,
                        ));
                    }
                }
                Read::Closed(code, reason) => {
                    let why = format!("closed before welcome: {code} {reason:?}");
                    return Err(conn.lost(why, Some((code, reason))));
                }
                Read::Failed(why) => return Err(conn.lost(why, None)),
            }
        }
    }

    fn on_welcome(&mut self, conn: &mut Conn, broker_id: &str, resumed: bool) {
        if !resumed {
            if let Some(last) = self.seqs.last_seq() {
                // Results of the lost session still go out: the broker numbers new commands
                // above the hello's last_seq, so their seqs cannot be mistaken for new ones,
                // and control joins each to its ack by rig_id, boot_id and seq.
                log::warn!(
                    "!!! broker {broker_id} has no session for boot {} (restarted, or the session expired): \
                     its seqs go on above {last}; results of commands already acked still go out",
                    self.boot
                );
            }
        }
        self.seqs.welcomed(resumed);
        if !resumed {
            self.recent_acks.clear();
        }
        for seq in std::mem::take(&mut self.recent_acks) {
            // An ack the broker already has changes nothing there; a failed send shows at the
            // next read, as any broken connection does.
            let _ = conn.ws.send(Message::text(proto::ack(seq)));
            self.unconfirmed.acked(seq);
        }
        let again = self.resend.len();
        while let Some((seq, text)) = self.resend.pop_front() {
            if conn.ws.send(Message::text(text.clone())).is_err() {
                // Broken already: kept for the next connection, not dropped.
                self.resend.push_front((seq, text));
                break;
            }
            self.remember_sent(seq, text);
        }
        if again > 0 {
            log::info!(
                "sent again {again} results the broker had not confirmed reading when the last connection ended: control may see them twice (the same rig_id, boot_id and seq)"
            );
        }
        conn.welcomed = Some(Instant::now());
        log::info!(
            "connected to {}: broker_id={broker_id} resumed={resumed} boot_id={} last_seq={:?}",
            conn.addr,
            self.boot,
            self.seqs.last_seq()
        );
    }

    fn on_text(&mut self, conn: &mut Conn, text: &str) -> Option<End> {
        match proto::parse_server_msg(text) {
            Ok(ServerMsg::Command(cmd)) => self.on_command(conn, cmd, text.len()),
            Ok(ServerMsg::Goaway {
                reason,
                reconnect_after_ms: None,
            }) => {
                // Taken as 0, every rig of a draining broker came back at once (review bb133):
                // the close that follows is handled as any close, with the backoff's jitter.
                log::warn!(
                    "goaway (reason {reason:?}) without a reconnect_after_ms number, ignored: \
                     reconnecting as after any close"
                );
                None
            }
            Ok(ServerMsg::Goaway {
                reason,
                reconnect_after_ms: Some(reconnect_after_ms),
            }) => {
                let delay = Duration::from_millis(reconnect_after_ms.min(MAX_RETRY_AFTER_S * 1000));
                log::info!(
                    "goaway (reason {reason:?}): reconnect in {}ms",
                    delay.as_millis()
                );
                conn.goaway.get_or_insert(Instant::now() + delay);
                None
            }
            Ok(ServerMsg::Welcome { .. }) => {
                log::warn!("a second welcome, ignored");
                None
            }
            Ok(ServerMsg::Unknown(ty)) => {
                log::debug!("ignoring message type {ty:?}");
                None
            }
            Err(e) => {
                log::warn!("ignoring a bad message ({e}): {}", clip(text));
                None
            }
        }
    }

    fn on_command(&mut self, conn: &mut Conn, cmd: Command, size: usize) -> Option<End> {
        let seq = cmd.seq;
        match self.seqs.judge(seq) {
            SeqVerdict::Duplicate => {
                log::info!(
                    "duplicate seq={seq} (last seen {:?}): acked again, not run",
                    self.seqs.last_seq()
                );
            }
            SeqVerdict::Gap { missing } => {
                log::error!(
                    "!!! SEQ GAP: got seq={seq} but seqs {}..={} never arrived: the broker lost commands; \
                     stopping (exit {})",
                    missing.start(),
                    missing.end(),
                    Exit::SeqGap.code()
                );
                self.wind_down(&mut conn.ws);
                close(&mut conn.ws, 1000, "seq gap");
                return Some(End::Exit(Exit::SeqGap));
            }
            SeqVerdict::Run => {
                log::info!("command seq={seq} id={} name={}", cmd.id, cmd.name);
                let queued = self.queued.load(Ordering::SeqCst);
                if queued > 0 && queued.saturating_add(size) > MAX_QUEUED_BYTES {
                    let why = format!(
                        "{queued} bytes of commands pending (at most {MAX_QUEUED_BYTES}), seq={seq} not accepted"
                    );
                    return Some(self.busy(conn, why));
                }
                self.queued.fetch_add(size, Ordering::SeqCst);
                match self.jobs.try_send(Job::new(cmd, size)) {
                    Ok(()) => {
                        self.seqs.record(seq);
                        self.pending += 1;
                    }
                    Err(TrySendError::Full(_)) => {
                        self.queued.fetch_sub(size, Ordering::SeqCst);
                        let why = format!(
                            "{} commands pending, seq={seq} not accepted",
                            self.cfg.max_pending
                        );
                        return Some(self.busy(conn, why));
                    }
                    Err(TrySendError::Disconnected(_)) => {
                        log::error!("the worker thread is gone");
                        return Some(End::Exit(Exit::Fatal));
                    }
                }
            }
        }
        self.unconfirmed.acked(seq);
        match conn.ws.send(Message::text(proto::ack(seq))) {
            Ok(()) => None,
            Err(e) => Some(conn.lost(format!("sending ack: {e}"), None)),
        }
    }

    /// Full: the command is neither recorded nor acked, and the connection ends, so that the
    /// next hello's last_seq has the broker replay it and everything after, once there is room.
    fn busy(&mut self, conn: &mut Conn, why: String) -> End {
        close(&mut conn.ws, 1013, "agent busy");
        // A close of its own: what it sent before went through, and goes no second time.
        conn.lost(why, Some((1013, "agent busy".into())))
    }

    /// Sends every finished result; on a failed send the result is kept for the next connection.
    fn send_results(&mut self, ws: &mut WebSocket<Stream>) -> Result<(), String> {
        loop {
            let done = match self.unsent.pop_front() {
                Some(done) => done,
                None => match self.done.try_recv() {
                    Ok(done) => {
                        self.pending = self.pending.saturating_sub(1);
                        done
                    }
                    Err(_) => return Ok(()),
                },
            };
            let text = proto::result(done.seq, done.ok, done.output.clone(), self.cfg.max_message);
            if let Err(e) = ws.send(Message::text(text.clone())) {
                let why = format!("sending result seq={}: {e}", done.seq);
                self.unsent.push_front(done);
                return Err(why);
            }
            self.remember_sent(done.seq, text);
        }
    }

    fn remember_sent(&mut self, seq: u64, text: String) {
        for seq in self.unconfirmed.sent(seq, text) {
            log::error!(
                "result seq={seq}: the broker has not confirmed reading it, and the agent keeps                  no more unconfirmed results: if the connection breaks now, control may never see it"
            );
        }
    }

    /// Stopping while connected: what the worker has not started is reported not run, the
    /// running command is killed, and their results go out before the close, for up to
    /// [`WIND_DOWN`]. Commands that arrive meanwhile are not acked: the broker keeps them.
    fn wind_down(&mut self, ws: &mut WebSocket<Stream>) {
        self.stopping.abandon.store(true, Ordering::SeqCst);
        self.stopping.running.kill();
        let deadline = Instant::now() + WIND_DOWN;
        while self.pending > 0 && Instant::now() < deadline {
            if self.send_results(ws).is_err() {
                return;
            }
            if self.pending == 0 {
                return;
            }
            // Keeps answering pings while the worker catches up.
            if let Read::Closed(..) | Read::Failed(_) = read(ws) {
                return;
            }
        }
    }

    /// At the end: whatever the worker still holds cannot be reported (no connection, or the
    /// wind-down ran out of time), and the log is the only place left to say so.
    fn abandon_pending(&mut self) {
        self.stopping.abandon.store(true, Ordering::SeqCst);
        self.stopping.running.kill();
        let deadline = Instant::now() + WIND_DOWN;
        let mut lost: Vec<u64> = self.unsent.drain(..).map(|d| d.seq).collect();
        while self.pending > 0 && Instant::now() < deadline {
            match self.done.recv_timeout(POLL) {
                Ok(done) => {
                    self.pending -= 1;
                    lost.push(done.seq);
                }
                Err(std::sync::mpsc::RecvTimeoutError::Timeout) => {}
                Err(std::sync::mpsc::RecvTimeoutError::Disconnected) => break,
            }
        }
        if !lost.is_empty() || self.pending > 0 {
            log::error!(
                "!!! stopped with the results of acked commands unsent (seqs {lost:?}{}): the \
                 broker will not send them again, and control hears nothing of them",
                if self.pending > 0 {
                    format!(", and {} more the worker still held", self.pending)
                } else {
                    String::new()
                }
            );
        }
    }

    fn stopping(&self) -> bool {
        self.stop.load(Ordering::SeqCst) || self.deadline.is_some_and(|d| Instant::now() >= d)
    }

    /// Sleeps `delay` unless told to stop first (then `false`).
    fn sleep(&self, delay: Duration) -> bool {
        let until = Instant::now() + delay;
        loop {
            if self.stopping() {
                return false;
            }
            let left = until.saturating_duration_since(Instant::now());
            if left.is_zero() {
                return true;
            }
            std::thread::sleep(left.min(POLL));
        }
    }
}

/// One read with the socket's poll timeout.
fn read(ws: &mut WebSocket<Stream>) -> Read {
    match ws.read() {
        Ok(Message::Text(text)) => Read::Text(text.as_str().to_string()),
        Ok(Message::Ping(_)) => {
            // Send the queued pong now rather than at the next read.
            let _ = ws.flush();
            Read::Control
        }
        Ok(Message::Binary(_)) => {
            log::warn!("binary message from the broker, ignored");
            Read::Control
        }
        Ok(Message::Pong(payload)) => Read::Pong(payload.to_vec()),
        Ok(Message::Frame(_)) => Read::Control,
        Ok(Message::Close(frame)) => {
            // tungstenite queued the close echo; write it.
            let _ = ws.flush();
            match frame {
                Some(f) => Read::Closed(u16::from(f.code), f.reason.as_str().to_string()),
                None => Read::Closed(1005, String::new()),
            }
        }
        Err(tungstenite::Error::Io(e)) if idle(&e) => Read::Idle,
        Err(tungstenite::Error::ConnectionClosed | tungstenite::Error::AlreadyClosed) => {
            Read::Failed("connection closed".into())
        }
        Err(e) => Read::Failed(e.to_string()),
    }
}

/// Starts the close handshake and waits (briefly) for the broker's echo.
fn close(ws: &mut WebSocket<Stream>, code: u16, reason: &str) {
    let frame = CloseFrame {
        code: CloseCode::from(code),
        reason: reason.into(),
    };
    if ws.close(Some(frame)).is_err() {
        return;
    }
    let deadline = Instant::now() + CLOSE_TIMEOUT;
    while Instant::now() < deadline {
        match ws.read() {
            Ok(_) => {}
            Err(tungstenite::Error::Io(e)) if idle(&e) => {}
            Err(_) => return,
        }
    }
}

/// A read error that only means "nothing yet": the poll timeout, or an interrupted call.
fn idle(e: &std::io::Error) -> bool {
    use std::io::ErrorKind::{Interrupted, TimedOut, WouldBlock};
    matches!(e.kind(), WouldBlock | TimedOut | Interrupted)
}

/// The start of a message, for logs.
fn clip(text: &str) -> &str {
    let mut end = text.len().min(200);
    while !text.is_char_boundary(end) {
        end -= 1;
    }
    &text[..end]
}
