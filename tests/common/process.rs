//! Child processes waited for with a deadline, so that a test of a binary that hangs fails
//! instead of hanging the suite; and a port that surely refuses connections, for tests of what
//! a binary does when it cannot connect.

use std::io::{ErrorKind, Read};
use std::process::{Child, Command, ExitStatus, Output, Stdio};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

/// How often a wait looks at the child.
const POLL: Duration = Duration::from_millis(5);

/// Runs `cmd` like [`Command::output`] (stdin /dev/null, stdout and stderr captured), but kills
/// it and panics, naming the command line, if it has not exited within `limit`.
pub fn output_within(cmd: &mut Command, limit: Duration) -> Output {
    spawn_piped(cmd).output_within(limit)
}

/// Starts `cmd` with stdin /dev/null and stdout and stderr piped, read from now on (a full
/// pipe never blocks the child); [`Running::output_within`] collects the result.
pub fn spawn_piped(cmd: &mut Command) -> Running {
    let line = format!("{cmd:?}");
    let child = cmd
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap_or_else(|e| panic!("cannot spawn {line}: {e}"));
    Running::adopt(child, line)
}

/// What one pipe of the child has said so far, filled by its reader thread.
struct Pipe {
    bytes: Arc<Mutex<Vec<u8>>>,
    reader: Option<JoinHandle<()>>,
}

impl Pipe {
    fn read(from: Option<impl Read + Send + 'static>) -> Pipe {
        let bytes = Arc::new(Mutex::new(Vec::new()));
        let reader = from.map(|mut from| {
            let sink = bytes.clone();
            std::thread::spawn(move || {
                let mut buf = [0u8; 8192];
                loop {
                    match from.read(&mut buf) {
                        Ok(0) => break,
                        Ok(n) => sink.lock().unwrap().extend_from_slice(&buf[..n]),
                        Err(e) if e.kind() == ErrorKind::Interrupted => continue,
                        Err(_) => break,
                    }
                }
            })
        });
        Pipe { bytes, reader }
    }

    /// Its reader has seen the end of the pipe (or there is no pipe).
    fn closed(&self) -> bool {
        self.reader.as_ref().is_none_or(JoinHandle::is_finished)
    }

    fn take(&mut self) -> Vec<u8> {
        if let Some(reader) = self.reader.take() {
            reader.join().expect("pipe reader");
        }
        std::mem::take(&mut *self.bytes.lock().unwrap())
    }

    fn so_far(&self) -> String {
        String::from_utf8_lossy(&self.bytes.lock().unwrap()).into_owned()
    }
}

/// A child whose piped output is being read; killed (and reaped) on drop unless it has been
/// waited for, so a test that panics first leaves no process behind.
pub struct Running {
    child: Child,
    line: String,
    stdout: Pipe,
    stderr: Pipe,
    reaped: bool,
}

impl Running {
    /// Takes over an already spawned `child` (`line` names it in messages): whichever of its
    /// stdout and stderr are piped are read from now on.
    pub fn adopt(mut child: Child, line: impl Into<String>) -> Running {
        let stdout = Pipe::read(child.stdout.take());
        let stderr = Pipe::read(child.stderr.take());
        Running {
            child,
            line: line.into(),
            stdout,
            stderr,
            reaped: false,
        }
    }

    /// The process id.
    pub fn id(&self) -> u32 {
        self.child.id()
    }

    /// Waits for the child to exit and its pipes to close, up to `limit`; on the deadline
    /// kills it and panics with the command line and what it printed so far.
    pub fn output_within(mut self, limit: Duration) -> Output {
        let deadline = Instant::now() + limit;
        let status = loop {
            if let Some(status) = self.child.try_wait().expect("try_wait") {
                self.reaped = true;
                break status;
            }
            if Instant::now() >= deadline {
                self.kill_and_panic(limit, "did not exit");
            }
            std::thread::sleep(POLL);
        };
        // A grandchild holding a pipe open would keep its reader waiting: bounded too.
        while !(self.stdout.closed() && self.stderr.closed()) {
            if Instant::now() >= deadline {
                self.kill_and_panic(limit, &format!("exited ({status}) but left its pipes open"));
            }
            std::thread::sleep(POLL);
        }
        Output {
            status,
            stdout: self.stdout.take(),
            stderr: self.stderr.take(),
        }
    }

    fn kill_and_panic(&mut self, limit: Duration, what: &str) -> ! {
        let status = self.kill();
        panic!(
            "{} {what} within {limit:?}; killed ({status:?})\nstdout so far:\n{}\nstderr so far:\n{}",
            self.line,
            self.stdout.so_far(),
            self.stderr.so_far()
        );
    }

    /// SIGKILL and reap: a killed process always exits.
    fn kill(&mut self) -> Option<ExitStatus> {
        if self.reaped {
            return None;
        }
        let _ = self.child.kill();
        self.reaped = true;
        self.child.wait().ok()
    }
}

impl Drop for Running {
    fn drop(&mut self) {
        self.kill();
    }
}

/// A loopback port that refuses connections and that no one else can take while this lives:
/// a TCP socket bound to it that never listens. Without SO_REUSEADDR and SO_REUSEPORT on it,
/// no other socket (a broker's listener included, whatever its own options) can bind the port,
/// and a connection to it is refused (RST), there being no listener. A listener bound and
/// dropped frees its port for the next test's port-0 bind instead.
pub struct RefusingPort {
    _socket: socket2::Socket,
    /// `127.0.0.1:<port>`.
    pub addr: std::net::SocketAddr,
}

impl RefusingPort {
    pub fn new() -> RefusingPort {
        use socket2::{Domain, Protocol, SockAddr, Socket, Type};
        let socket = Socket::new(Domain::IPV4, Type::STREAM, Some(Protocol::TCP)).unwrap();
        let any: std::net::SocketAddr = "127.0.0.1:0".parse().unwrap();
        socket.bind(&SockAddr::from(any)).unwrap();
        let addr = socket.local_addr().unwrap().as_socket().unwrap();
        RefusingPort {
            _socket: socket,
            addr,
        }
    }

    pub fn port(&self) -> u16 {
        self.addr.port()
    }
}
