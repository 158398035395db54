//! What every thread reads, kept apart from how it is built: workers, the bridge and the admin
//! thread depend on these types alone, not on clap, the environment or TOML.

use std::net::SocketAddr;
use std::path::PathBuf;
use std::time::Duration;

/// Validated configuration shared (read-only) by every thread.
#[derive(Debug, Clone)]
pub struct Config {
    /// Rig endpoint.
    pub listen: SocketAddr,
    /// Admin endpoint.
    pub admin: SocketAddr,
    /// Broker id.
    pub broker_id: String,
    /// `--broker-id` was given; else `broker_id` is [`default_broker_id`]'s.
    ///
    /// [`default_broker_id`]: super::default_broker_id
    pub broker_id_given: bool,
    /// Event-loop threads.
    pub cores: usize,
    /// Redis URL; None = standalone.
    pub redis: Option<String>,
    /// TLS files, when enabled.
    pub tls: Option<TlsFiles>,
    /// Token verification keys (empty: no tokens).
    pub jwt_keys: Vec<PathBuf>,
    /// Required token audience.
    pub jwt_audience: Option<String>,
    /// PING period.
    pub ping_interval: Duration,
    /// PONG deadline.
    pub pong_timeout: Duration,
    /// Misses before 4002.
    pub max_missed_pongs: u8,
    /// Head and hello deadline.
    pub hello_timeout: Duration,
    /// Broker-wide accepts per second.
    pub accept_rate: f64,
    /// Broker-wide accept burst.
    pub accept_burst: u32,
    /// Broker-wide connection cap.
    pub max_connections: Option<u64>,
    /// Per-rig unwritten command bound.
    pub outbox: usize,
    /// Inbound message cap (bytes).
    pub max_message: usize,
    /// Bytes of admin answers one core may hold for clients still reading them.
    pub admin_answer_bytes: usize,
    /// Registry lease TTL.
    pub registry_ttl: Duration,
    /// Registry refresh period.
    pub registry_refresh: Duration,
    /// Session retention in Redis.
    pub session_ttl: Duration,
    /// Drain window.
    pub drain: Duration,
    /// Per-rig inbound messages per second.
    pub rig_rate: f64,
    /// Per-rig inbound burst.
    pub rig_burst: u32,
    /// Metrics grouping label.
    pub group_label: String,
    /// Listen backlog per core.
    pub backlog: i32,
    /// Unknown types close with 4400.
    pub strict: bool,
    /// Serve /echo for conformance suites.
    pub echo_endpoint: bool,
    /// Skip io_uring.
    pub force_epoll: bool,
    /// Bind --listen even while another process listens there.
    pub share_port: bool,
}

/// TLS material paths.
#[derive(Debug, Clone)]
pub struct TlsFiles {
    /// Certificate chain.
    pub cert: PathBuf,
    /// Private key.
    pub key: PathBuf,
    /// Client CA bundle (mTLS) if any.
    pub client_ca: Option<PathBuf>,
    /// CRL files.
    pub crl: Vec<PathBuf>,
}

/// Largest `--max-message`: a rig's event is held whole on its way to Redis, and the bridge's
/// byte bound for events (64 MiB) must take several.
pub(super) const MAX_MESSAGE_CAP: usize = 16 << 20;

/// Most `--cores`: far past any host's CPUs, and well inside the file descriptors and threads
/// a process may have (a few descriptors per core).
pub const MAX_CORES: usize = 1024;

/// Written-but-unacked commands kept per rig, as a multiple of `--outbox`: enough for a rig
/// that acks in batches, bounded for one that never acks.
const UNACKED_PER_OUTBOX: usize = 8;

impl Config {
    /// Most written-but-unacked commands a rig's session remembers for a resume.
    pub fn unacked_limit(&self) -> usize {
        self.outbox * UNACKED_PER_OUTBOX
    }

    /// How long the broker remembers a disconnected rig's session. Fleet mode: the lease's
    /// lifetime (Redis keeps the session itself, for `--session-ttl`). Standalone: this memory
    /// is the only copy, so it is kept for `--session-ttl` too (never less than the lease's).
    pub fn park_for(&self) -> std::time::Duration {
        match self.redis {
            Some(_) => self.registry_ttl,
            None => self.registry_ttl.max(self.session_ttl),
        }
    }

    /// Most commands one session holds, queued and unacked together: what a resume can carry.
    pub fn session_limit(&self) -> usize {
        self.outbox + self.unacked_limit()
    }

    /// Places of a rig's outbox (and of its session's bound) that commands from its offline
    /// hold leave to control's new commands: a quarter of `--outbox`, at least one, none with
    /// an outbox of one (where the hold would otherwise never get in).
    pub fn hold_reserve(&self) -> usize {
        match self.outbox {
            0 | 1 => 0,
            n => (n / 4).max(1),
        }
    }
}
