//! fleetlink: a thread-per-core websocket command broker for fleets of rigs.
//!
//! # Threads
//! ```text
//!            admin HTTP thread ──┐            ┌── core 0: monoio (io_uring) loop, listener, conns
//! SIGTERM ─▶ main ── drain ──────┼─▶ bridge ◀─┼── core 1: …
//!                                │  (registry,└── core N-1
//!                                │   Redis)
//! ```
//! Cores share nothing. They talk to the bridge (and the admin thread to them) only through
//! bounded queues with a doorbell ([`doorbell`]), carrying the types in [`registry::msg`].
//!
//! # Module map
//! - [`config`]: flags, env, TOML → [`config::Config`].
//! - [`http_upgrade`], [`ws`]: the sans-IO HTTP upgrade and RFC 6455 frame layer.
//! - [`protocol`]: the JSON messages of the rig protocol; [`ids`]: validated identifiers;
//!   [`args`]: a command's args, kept as the text control sent.
//! - [`worker`]: one event loop per core: accept, connections (plain or TLS), sweep, drain.
//! - [`registry`]: the bridge thread, the embedded registry, fleet mode's Redis I/O (Lua
//!   registry and session scripts, pub/sub control, offline commands).
//! - [`tls`], [`jwt`]: TLS configuration with reload and client identities; bearer tokens.
//! - [`admin`]: health, readiness, metrics, rigs, standalone control plane.
//! - [`metrics`], [`reply`], [`events`]: what the broker reports, in the contract's shapes;
//!   [`heap_stats`]: optional allocation accounting; [`heap_trim`]: memory given back after a
//!   burst; [`thread_loss`]: a thread lost drains the rest and exits non-zero.
//! - [`doctor`], [`dev_certs`]: operator tools bundled in the binary.
//!
//! The binaries: `fleetlink-fe` (`src/main.rs`), `fleetctl` (`src/bin/fleetctl/`) and
//! `fleetlink-agent` (`src/bin/fleetlink-agent/`).
#![warn(missing_docs, unreachable_pub)]

pub mod admin;
pub mod args;
pub mod config;
pub mod dev_certs;
pub mod doctor;
pub mod doorbell;
pub mod event_log;
pub mod events;
pub mod heap_stats;
pub mod heap_trim;
pub mod http_upgrade;
pub mod ids;
pub mod json_text;
pub mod jwt;
pub mod log_text;
pub mod metrics;
pub mod protocol;
pub mod registry;
pub mod reply;
pub mod string_pairs;
pub mod thread_loss;
pub mod tls;
pub mod worker;
pub mod ws;
