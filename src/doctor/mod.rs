//! `fleetlink-fe doctor --connections N`: can this host hold N rig connections?
//!
//! Pure core, thin IO shell. [`HostSettings::read`] is the only code that touches the host
//! (procfs, `getrlimit`, `sysconf`); it never panics, and a setting it cannot read is `None`.
//! [`check`] is a pure function of the settings, the target connection count and the core count,
//! so every rule is unit-tested with synthetic hosts. [`run`] prints the report and returns the
//! exit code. Called by `main.rs` for the `doctor` subcommand.
//!
//! One job a file: `model` (what a connection, a core and a ring cost: the figures the rules
//! use, and [`Transport`]), `host` (reading the host: [`HostSettings`], the only IO), `checks`
//! (the pure rules, one file per area under `checks/`), `report` (each [`Finding`], the printed
//! report, the exit code and the entry point [`main_with`]) and, for tests only, `testing`
//! (the synthetic tuned host the tests share).
//!
//! A finding is *blocking* only when the broker cannot hold N connections (it would fail
//! accept with EMFILE/ENFILE, or run out of memory, or the firewall would drop rigs). Anything
//! that degrades behaviour under load (storms, broadcasts, drain) or moves cores from io_uring
//! to the epoll driver is a warning. Each rule's model is written next to it and, at length,
//! in `docs/tuning.md`.
//!
//! Limits (`RLIMIT_*`) are those of the process running `doctor`. A systemd unit sets its own
//! (`LimitNOFILE=`, `LimitMEMLOCK=`), so run `doctor` the way the broker runs, e.g.
//! `systemd-run --pty -p LimitNOFILE=1100000 fleetlink-fe doctor --connections N`. The broker
//! never raises its own limits: the soft `RLIMIT_NOFILE` it starts with is the one `accept`
//! is held to.

mod checks;
mod host;
mod model;
mod report;
#[cfg(test)]
mod testing;

pub use checks::{check, check_max_connections, check_with_backlog};
pub use host::{rig_room, HostSettings};
pub use model::{Transport, LISTEN_BACKLOG, MAX_CONNECTIONS};
pub use report::{main_with, run, Finding};
