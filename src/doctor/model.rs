//! The figures every rule is built on: what one connection, one core and one ring cost the
//! host (file descriptors, kernel and broker memory, TCP pages), how many connections and how
//! long a backlog `doctor` checks for, and how the rigs connect ([`Transport`]).
//!
//! Apart from the rules because these numbers are measurements (FACTS.md, the density and TLS
//! benches), each with its source beside it: when a measurement changes, this file changes and
//! no rule does, and the rules and the report all read the one value.

/// File descriptors beyond one per rig and per core: the Redis connections, the admin
/// listener, log files, TLS/CRL files being reloaded, stdio, the start-up probe.
pub(super) const FD_BASE: u64 = 64;
/// Per core: a listener, the io_uring fd, monoio's eventfd and poller, the inbox doorbell
/// (an idle broker measured about 5 a core, 17 fds on 1 core and 1,512 on 300).
pub(super) const FD_PER_CORE: u64 = 6;
/// Admin connections the broker lets in at once: those served on the cores and those
/// waiting in the lobby. A host full to its limit of rigs must still answer `/metrics`.
pub(super) const FD_ADMIN: u64 =
    (crate::admin::MAX_ON_CORES + crate::admin::lobby::MAX_WAITING) as u64;

/// The descriptors at the top of the open-file limit that the broker keeps from rigs
/// (`worker::fd_room`): a rig's socket landing among them is refused (503), so once rigs hold
/// all they may, these are what Redis reconnects, admin connections and file reloads have.
pub(super) const FD_KEPT: u64 = crate::worker::RIG_FD_RESERVE;

/// File descriptors the broker holds itself on `cores` cores, before any connection.
pub(super) fn fd_own(cores: u64) -> u64 {
    FD_BASE + FD_PER_CORE * cores
}

/// The descriptors kept from rigs under a soft open-file limit of `soft`: [`FD_KEPT`], or a
/// quarter of a limit under 512 (`None`, unknown or unlimited: [`FD_KEPT`]).
pub(super) fn fd_kept(soft: Option<u64>) -> u64 {
    soft.map_or(FD_KEPT, crate::worker::rig_fd_reserve_for)
}

/// File descriptors beyond one per rig below which the broker refuses rigs before N: its own
/// and the ones it keeps from rigs under the soft limit `soft`.
pub(super) fn fd_floor(cores: u64, soft: Option<u64>) -> u64 {
    fd_own(cores) + fd_kept(soft)
}

/// File descriptors beyond one per rig, on `cores` cores, for N rigs and every admin
/// connection the broker lets in at once beside them.
pub(super) fn fd_slack(cores: u64) -> u64 {
    fd_own(cores) + FD_ADMIN.max(FD_KEPT)
}

/// Most connections `doctor` checks for. Far past what one host's memory holds (~5 KB each with
/// the kernel's share), and it keeps every sum below in range: a larger N is checked as this
/// many, and the report says so.
pub const MAX_CONNECTIONS: u64 = 100_000_000;

/// Listen backlog each per-core `SO_REUSEPORT` listener asks for by default (`--backlog`).
/// The kernel uses `min(backlog, net.core.somaxconn)`, silently.
pub const LISTEN_BACKLOG: u64 = 4096;

/// Kernel memory of one established idle socket, bytes (the shared platform measurements,
/// FACTS.md, matching /proc/slabinfo on the dev machine): `TCP` 2,368 + `sock_inode_cache` 832 + `filp` 192 + `dentry` 192 + the
/// pending poll (`io_kiocb` 256 under io_uring, `eventpoll_epi` 128 under epoll).
pub(super) const KERNEL_BYTES_PER_CONN: u64 = 3_900;

/// Broker memory per idle plain-ws connection, bytes: the RSS slope `bench/run density`
/// measures (1,128–1,144 B, docs/benchmarks.md and its history). A floor, not a promise:
/// labels and queued commands add more.
const BROKER_BYTES_PER_CONN: u64 = 1_130;

/// Broker memory per idle wss connection, bytes: the RSS slope `bench/tls.sh` measured
/// (9,018 B, `density.wss` in bench/results/tls-fleetlink-fe.json: TLS 1.3, no client
/// certificates). The rustls session state is most of it. Also a floor: with `--client-ca`
/// each session keeps the rig's certificate chain as well, which was not measured.
const BROKER_BYTES_PER_TLS_CONN: u64 = 9_018;

/// TCP memory (`tcp_mem`, pages) a connection holds while busy. An idle socket has empty queues
/// and holds ~0 pages. During a command to every rig at once each socket holds one skb in its
/// send queue until the rig ACKs and one in its receive queue (the rig's ack/result) until the
/// broker reads it. The kernel charges socket memory in whole pages, so 2 pages per connection.
pub(super) const PAGES_PER_BUSY_CONN: u64 = 2;

/// io_uring submission queue entries per core: `URING_ENTRIES` in `worker/mod.rs`. The
/// startup probe builds one ring of the same size.
pub(super) const RING_ENTRIES: u64 = 4096;

/// How the rigs connect, which decides the broker's memory per idle connection.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub enum Transport {
    /// Plain `ws://`: the broker runs without `--tls-cert`.
    #[default]
    Plain,
    /// `wss://`: the broker runs with `--tls-cert`/`--tls-key`, as tuning/fleetlink-fe.service
    /// does.
    Tls,
}

impl Transport {
    /// Broker memory per idle connection, bytes.
    pub(super) fn broker_bytes(self) -> u64 {
        match self {
            Transport::Plain => BROKER_BYTES_PER_CONN,
            Transport::Tls => BROKER_BYTES_PER_TLS_CONN,
        }
    }

    pub(super) fn name(self) -> &'static str {
        match self {
            Transport::Plain => "plain ws",
            Transport::Tls => "TLS",
        }
    }

    /// The broker's `--listen` port when none is given (CONTRACT.md §1).
    pub fn default_port(self) -> u16 {
        match self {
            Transport::Plain => 8080,
            Transport::Tls => 8443,
        }
    }
}

/// `LimitNOFILE` to recommend: N + 10 % headroom, at least N + slack, rounded up to 1,000
/// (1,100,000 for a million rigs, the value in tuning/fleetlink-fe.service).
pub(super) fn recommended_nofile(n: u64, cores: u64) -> u64 {
    let want = n
        .saturating_add(n / 10)
        .max(n.saturating_add(fd_slack(cores)));
    want.div_ceil(1000).saturating_mul(1000)
}
