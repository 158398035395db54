//! A throwaway `redis-server` per test: free port, no persistence, own temp dir, killed on drop.
//!
//! The port comes from binding 127.0.0.1:0 and is then handed to redis-server, so another
//! process can grab it in between; the server is only accepted once `INFO server` reports our
//! child's pid, and a server that exits at startup is retried on a fresh port.

use std::io::Read;
use std::net::TcpListener;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicU32, Ordering};
use std::thread;
use std::time::{Duration, Instant};

/// How long a redis-server may take to answer PING after spawning.
const START_DEADLINE: Duration = Duration::from_secs(10);
/// Pause between readiness probes inside the deadline loop.
const POLL: Duration = Duration::from_millis(10);
/// The server's Unix socket, in its own directory.
const SOCKET: &str = "redis.sock";
/// Fresh ports tried before giving up (each failure means the port was taken meanwhile).
const PORT_ATTEMPTS: usize = 5;

/// A redis-server child process listening on 127.0.0.1.
pub struct RedisServer {
    /// The running child; `None` after [`RedisServer::kill9`].
    child: Option<Child>,
    /// Kept across [`RedisServer::restart`] so clients can reconnect to the same URL.
    port: u16,
    /// Working dir and log file; removed on drop.
    dir: PathBuf,
}

impl RedisServer {
    /// Starts a server on a free port and waits until it answers as itself.
    pub fn start() -> RedisServer {
        let bin = find_redis_server();
        let dir = temp_dir();
        let mut last_err = String::new();
        for _ in 0..PORT_ATTEMPTS {
            let port = free_port();
            match spawn_ready(&bin, port, &dir) {
                Ok(child) => {
                    return RedisServer {
                        child: Some(child),
                        port,
                        dir,
                    }
                }
                Err(e) => last_err = e,
            }
        }
        panic!("redis-server did not start after {PORT_ATTEMPTS} ports: {last_err}");
    }

    /// `redis://127.0.0.1:<port>/`.
    pub fn url(&self) -> String {
        format!("redis://127.0.0.1:{}/", self.port)
    }

    /// `unix://<dir>/redis.sock`: the same server through its Unix socket.
    #[allow(dead_code)] // not every test binary reaches Redis through its Unix socket
    pub fn unix_url(&self) -> String {
        format!("unix://{}", self.dir.join(SOCKET).display())
    }

    /// The TCP port, stable across [`RedisServer::restart`].
    pub fn port(&self) -> u16 {
        self.port
    }

    /// A client for this server (connections are opened lazily by the caller).
    pub fn client(&self) -> ::redis::Client {
        ::redis::Client::open(self.url()).expect("valid redis URL")
    }

    /// A new blocking connection with a read timeout, so a broken test fails instead of hanging.
    pub fn connection(&self) -> ::redis::Connection {
        let con = self
            .client()
            .get_connection()
            .expect("connect to test redis");
        con.set_read_timeout(Some(START_DEADLINE))
            .expect("set read timeout");
        con
    }

    /// SIGKILLs the server (no shutdown, no save), as a crash or OOM kill would.
    pub fn kill9(&mut self) {
        if let Some(mut child) = self.child.take() {
            // Child::kill sends SIGKILL on Unix; wait reaps it so the port is free again.
            let _ = child.kill();
            let _ = child.wait();
        }
    }

    /// Freezes (`true`, SIGSTOP) or thaws (`false`, SIGCONT) the server: unreachable to its
    /// clients, as on a network partition, but with every key kept.
    #[allow(dead_code)] // not every test binary freezes Redis
    pub fn freeze(&self, frozen: bool) {
        if let Some(child) = &self.child {
            let sig = if frozen { libc::SIGSTOP } else { libc::SIGCONT };
            // SAFETY: kill(2) on our own child's pid.
            unsafe { libc::kill(child.id() as i32, sig) };
        }
    }

    /// Kills the server if running and starts a new, empty one on the same port.
    pub fn restart(&mut self) {
        self.kill9();
        let bin = find_redis_server();
        let deadline = Instant::now() + START_DEADLINE;
        loop {
            match spawn_ready(&bin, self.port, &self.dir) {
                Ok(child) => {
                    self.child = Some(child);
                    return;
                }
                Err(e) if Instant::now() >= deadline => {
                    panic!("redis-server did not restart on port {}: {e}", self.port)
                }
                Err(_) => thread::sleep(POLL),
            }
        }
    }
}

impl Drop for RedisServer {
    fn drop(&mut self) {
        self.kill9();
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

/// Spawns redis-server on `port` and polls it until it answers as this child, exits, or the
/// deadline passes. On failure the child is killed and the log tail returned.
fn spawn_ready(bin: &Path, port: u16, dir: &Path) -> Result<Child, String> {
    let log = dir.join(format!("redis-{port}.log"));
    let mut child = Command::new(bin)
        .args(["--port", &port.to_string(), "--bind", "127.0.0.1"])
        .arg("--unixsocket")
        .arg(dir.join(SOCKET))
        .args(["--unixsocketperm", "700"])
        .args(["--save", "", "--appendonly", "no"])
        .arg("--dir")
        .arg(dir)
        .arg("--logfile")
        .arg(&log)
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .map_err(|e| format!("spawn {}: {e}", bin.display()))?;
    let deadline = Instant::now() + START_DEADLINE;
    let url = format!("redis://127.0.0.1:{port}/");
    loop {
        if let Ok(Some(status)) = child.try_wait() {
            return Err(format!("exited with {status}: {}", log_tail(&log)));
        }
        if answers_as(&url, child.id()) {
            return Ok(child);
        }
        if Instant::now() >= deadline {
            let _ = child.kill();
            let _ = child.wait();
            return Err(format!(
                "no PING answer in {START_DEADLINE:?}: {}",
                log_tail(&log)
            ));
        }
        thread::sleep(POLL);
    }
}

/// True once the server at `url` answers PING and reports `pid` as its process id (so a
/// stranger that took the port is never mistaken for ours).
fn answers_as(url: &str, pid: u32) -> bool {
    let Ok(client) = ::redis::Client::open(url) else {
        return false;
    };
    let Ok(mut con) = client.get_connection_with_timeout(Duration::from_secs(1)) else {
        return false;
    };
    let _ = con.set_read_timeout(Some(Duration::from_secs(1)));
    let pong: Result<String, _> = ::redis::cmd("PING").query(&mut con);
    let info: Result<String, _> = ::redis::cmd("INFO").arg("server").query(&mut con);
    let ours = format!("process_id:{pid}");
    pong.is_ok_and(|p| p == "PONG") && info.is_ok_and(|i| i.lines().any(|l| l.trim() == ours))
}

/// The redis-server binary from PATH, or a panic that says how to get one.
fn find_redis_server() -> PathBuf {
    let path = std::env::var_os("PATH").unwrap_or_default();
    std::env::split_paths(&path)
        .map(|d| d.join("redis-server"))
        .find(|p| p.is_file())
        .unwrap_or_else(|| {
            panic!(
                "redis-server not found on PATH: the Redis/Lua tests need a real server. \
                 Install it (Debian/Ubuntu: `apt-get install redis-server`, macOS: \
                 `brew install redis`) and re-run."
            )
        })
}

/// A port the kernel just considered free on 127.0.0.1.
fn free_port() -> u16 {
    let listener = TcpListener::bind("127.0.0.1:0").expect("bind 127.0.0.1:0");
    listener.local_addr().expect("local addr").port()
}

/// A fresh directory under the system temp dir, unique per process and call.
fn temp_dir() -> PathBuf {
    static NEXT: AtomicU32 = AtomicU32::new(0);
    let name = format!(
        "fleetlink-redis-{}-{}-{:08x}",
        std::process::id(),
        NEXT.fetch_add(1, Ordering::Relaxed),
        fastrand::u32(..)
    );
    let dir = std::env::temp_dir().join(name);
    std::fs::create_dir_all(&dir).expect("create redis temp dir");
    dir
}

/// The last lines of a redis log, for panic messages.
fn log_tail(log: &Path) -> String {
    let mut text = String::new();
    if let Ok(mut f) = std::fs::File::open(log) {
        let _ = f.read_to_string(&mut text);
    }
    let lines: Vec<&str> = text.lines().collect();
    lines[lines.len().saturating_sub(5)..].join(" / ")
}
