//! Admin HTTP (CONTRACT.md §6): health, readiness, metrics, the rig list, and the standalone
//! control plane (commands, kicks, drain). Plain HTTP/1.1 with keep-alive.
//!
//! Connections are served on the cores, in turn (`crate::worker::admin_conn`): a command POST
//! is the one request a core answers itself, since it only enqueues on a connection, which a
//! core does anyway. Everything else may wait (a snapshot of every core, the bridge's answer
//! to a kick), so a small pool of threads of its own works it out and hands the answer back,
//! and no core ever blocks. The pool also serves whole connections when the cores cannot take
//! them: while the broker drains (a core that has drained stops) or when many are open. Such a
//! connection waits in the acceptor's lobby (`crate::admin::lobby`) while each request arrives,
//! and a pool thread gets it only to answer a whole one.
//!
//! The files: `acceptor` (the accepting thread, the pool, and who serves a connection),
//! `lobby` (where connections wait between requests), `http` (requests and answers as
//! bytes), `routes` (what each path answers) and `commands` (a rig's commands and kicks).

use std::sync::atomic::AtomicBool;
use std::sync::Arc;
use std::time::Duration;

use crossbeam_channel::Sender;

use crate::doorbell::Mailbox;
use crate::metrics::Retired;
use crate::registry::bridge::BridgeShared;
use crate::registry::msg::{ToBridge, ToCore};

mod acceptor;
mod commands;
mod http;
pub(crate) mod lobby;
mod routes;

pub(crate) use acceptor::busy_answer;
pub use acceptor::{bind, pool_queue, spawn, Lobbied, OnCore, Ticket, Work};
pub(crate) use commands::{command_answer, command_req, overloaded, route_of};
pub use commands::{command_rig, new_id};
pub use http::{
    evicted, parse_request, render_answered, slow_refused, Answer, Parsed, Refusal, Request,
};
pub(crate) use http::{
    note_evicted, note_slow_refused, note_unfinished, response, RequestClock, CONTINUE,
};
pub use routes::{allowed_methods, events_answer_len, immediate};

/// Admin connections the cores serve at once; past it the lobby and the pool serve them.
/// Generous, since the cores serve a connection without handing it between threads. On a core
/// a silent connection costs a pending read (a 4 KiB buffer) until its 5 s to send a request
/// run out.
pub const MAX_ON_CORES: usize = 1024;
/// How long an idle keep-alive connection may stay open.
pub(crate) const KEEP_ALIVE: Duration = Duration::from_secs(2);
/// Requests served on one connection before it is closed (so no client holds a pool thread or a
/// core's slot forever).
pub(crate) const MAX_PER_CONNECTION: usize = 10_000;
/// Largest request (head + body) accepted.
pub const MAX_REQUEST: usize = 1 << 20;
/// How long a request may take to arrive, and a core or the bridge to answer.
pub(crate) const IO_TIMEOUT: Duration = Duration::from_secs(5);
/// How long a refused connection reads and drops what its client still sends before it
/// closes. A refusal leaves part of the request unread; closing on unread bytes sends a reset,
/// which fails the write of a client still sending its body and can destroy the answer in its
/// buffers before it reads it.
pub(crate) const LINGER: Duration = Duration::from_secs(2);
/// Bytes read and dropped from one refused connection at most, in the lobby and on a core
/// (admin requests and refused upgrades alike): twice the largest request, so a client
/// finishing its body reads the answer, while one streaming without pause holds neither the
/// lobby's one thread, which polls every waiting connection, nor a core for all of [`LINGER`].
pub(crate) const LINGER_BYTES: usize = 2 << 20;

/// What the admin thread needs from the rest of the broker.
pub struct Admin {
    /// The bridge inbox (commands, kicks).
    pub bridge: Mailbox<ToBridge>,
    /// Every core's inbox (snapshots).
    pub cores: Vec<Mailbox<ToCore>>,
    /// Bridge figures.
    pub bridge_stats: Arc<BridgeShared>,
    /// Set once a drain started; readiness fails from then on.
    pub draining: Arc<AtomicBool>,
    /// Asks the main thread to drain.
    pub drain: Sender<()>,
    /// The last figures of cores that stopped at the end of a drain.
    pub retired: Arc<Retired>,
    /// The TLS material in force, for its expiry in `/metrics` (None: plain ws).
    pub tls: Option<Arc<crate::tls::TlsReloader>>,
}

impl Admin {
    /// Bundles the handles.
    pub fn new(
        bridge: Mailbox<ToBridge>,
        cores: Vec<Mailbox<ToCore>>,
        bridge_stats: Arc<BridgeShared>,
        draining: Arc<AtomicBool>,
        drain: Sender<()>,
        retired: Arc<Retired>,
        tls: Option<Arc<crate::tls::TlsReloader>>,
    ) -> Self {
        Self {
            bridge,
            cores,
            bridge_stats,
            draining,
            drain,
            retired,
            tls,
        }
    }
}
