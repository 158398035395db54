//! One thread = one core = one monoio runtime (io_uring, or epoll with a loud warning).
//!
//! Each core owns its listener, accept bucket, connection table, timer wheel and metrics; the
//! only ways in are its inbox ([`crate::doorbell`]) and its sockets. Nothing here is shared
//! between cores.
//!
//! - `accept`: listener, token bucket, 503s.
//! - `conn_cap`: `--max-connections`, the one count the cores share.
//! - `fd_room`: the descriptors rigs may not take, kept for Redis and the admin API.
//! - `conn`: the per-connection IO loop.
//! - `session`: what a connection does with messages, verdicts and commands.
//! - `queues`: a rig's queued and unacked commands, bounded by bytes per rig and per core.
//! - `closing`: a closed session waits for Redis's answer to its held commands.
//! - `crossed`: results a rig sent before it read the broker's close are still published.
//! - `sweep` + `wheel`: deadlines and liveness without per-connection timers.
//! - `quiet_pong`: a rig's PONG waits in the kernel for the sweep instead of waking the core.
//! - `slow_reader`: a rig still reading through a backlog is not missing its PONGs.
//! - `inbox`: messages from the bridge and admin.
//! - `drain`: graceful shutdown.
//! - `admin_conn`: admin HTTP connections the admin acceptor hands to this core.

mod accept;
mod admin_conn;
mod bucket;
mod closing;
mod conn;
mod conn_cap;
pub(crate) mod core;
mod crossed;
mod drain;
mod fd_room;
mod inbox;
mod listen_check;
pub(crate) mod queues;
mod quiet_pong;
mod refusal_log;
mod session;
mod slow_reader;
mod sweep;
mod transport;
mod wheel;

pub use accept::bind_listeners;
pub use bucket::{RigBucket, TokenBucket};
pub use conn_cap::ConnCap;
pub use core::Links;
pub use fd_room::ceiling as rig_fd_ceiling;
pub use fd_room::{reserve_for as rig_fd_reserve_for, RESERVE as RIG_FD_RESERVE};

use std::rc::Rc;
use std::sync::Arc;
use std::thread::JoinHandle;

use monoio::{IoUringDriver, LegacyDriver, RuntimeBuilder};

use crate::config::Config;
use crate::doorbell::Inbox;
use crate::jwt::JwtVerifier;
use crate::registry::msg::ToCore;
use crate::tls::TlsReloader;
use crate::worker::core::Core;

/// io_uring submission queue size per core. Idle connections each hold one in-flight PollAdd,
/// which lives in the kernel, not in the SQ, so this only bounds one batch of submissions.
const URING_ENTRIES: u32 = 4096;

/// Ring setup: with COOP_TASKRUN the kernel does not interrupt a running core (an IPI) to post
/// a completion; it posts it at the core's next syscall or wait. A core makes syscalls all the
/// time (sends and receives are direct), so completions are not held back, and a burst of
/// readiness events costs fewer interrupts: 10-15% less broker CPU in an accept storm and a
/// Redis fan-out on this machine. Kernels before 5.19 reject the flag; the caller then builds
/// the ring without it. (DEFER_TASKRUN would go further, but it posts completions only when the
/// runtime waits with GETEVENTS, which monoio does not do while it has runnable tasks.)
fn coop_taskrun() -> io_uring::Builder {
    let mut b = io_uring::IoUring::builder();
    b.setup_coop_taskrun();
    b
}

/// Which event driver the cores will run. The probe is a ring of the cores' own size: the
/// kernel may allow a small one and refuse this one (before 5.12 ring memory counts against
/// RLIMIT_MEMLOCK, 64 KiB by default before 5.16).
pub fn driver_name(cfg: &Config) -> &'static str {
    if !cfg.force_epoll
        && monoio::utils::detect_uring()
        && io_uring::IoUring::<io_uring::squeue::Entry>::builder()
            .build(URING_ENTRIES)
            .is_ok()
    {
        "io_uring"
    } else {
        "epoll"
    }
}

/// Shared, read-mostly security material every core uses at accept/upgrade time.
#[derive(Clone, Default)]
pub struct Guard {
    /// TLS configs (reloaded on file change / SIGHUP).
    pub tls: Option<Arc<TlsReloader>>,
    /// Bearer-token verifier.
    pub jwt: Option<Arc<JwtVerifier>>,
}

/// Starts core `index` on its own pinned thread, on `driver` (from [`driver_name`], probed
/// once for all cores).
pub fn spawn(
    index: usize,
    cfg: &'static Config,
    driver: &'static str,
    listener: std::net::TcpListener,
    inbox: Inbox<ToCore>,
    guard: Guard,
    links: Links,
) -> std::io::Result<JoinHandle<()>> {
    std::thread::Builder::new()
        .name(format!("fleetlink-core-{index}"))
        .spawn(move || {
            if let Some(ids) = core_affinity::get_core_ids().filter(|ids| !ids.is_empty()) {
                core_affinity::set_for_current(ids[index % ids.len()]);
            }
            let build = |urb| {
                RuntimeBuilder::<IoUringDriver>::new()
                    .enable_timer()
                    .with_entries(URING_ENTRIES)
                    .uring_builder(urb)
                    .build()
            };
            let uring = match driver {
                "io_uring" => build(coop_taskrun())
                    .or_else(|e| {
                        log::warn!("core {index}: io_uring without COOP_TASKRUN ({e})");
                        build(io_uring::IoUring::builder())
                    })
                    .map_err(|e| {
                        // The probe's ring fitted, this core's did not (each core's ring
                        // counts against the same limit): a core on epoll beats a core that
                        // is gone.
                        log::error!(
                            "!!! core {index}: no io_uring ring of {URING_ENTRIES} entries ({e}); \
                             this core runs on epoll (fleetlink_driver says so). Raise the \
                             memlock limit (LimitMEMLOCK=infinity) to get io_uring back"
                        );
                    })
                    .ok(),
                _ => None,
            };
            let result = match uring {
                Some(mut rt) => Ok(rt.block_on(core_main(
                    index, cfg, "io_uring", listener, inbox, guard, links,
                ))),
                None => RuntimeBuilder::<LegacyDriver>::new()
                    .enable_timer()
                    .build()
                    .map(|mut rt| {
                        rt.block_on(core_main(
                            index, cfg, "epoll", listener, inbox, guard, links,
                        ))
                    }),
            };
            match result {
                Ok(Ok(())) => {}
                Ok(Err(e)) | Err(e) => {
                    log::error!("core {index} stopped: {e}");
                    crate::thread_loss::report_current(e.to_string());
                }
            }
        })
}

async fn core_main(
    index: usize,
    cfg: &'static Config,
    driver: &'static str,
    listener: std::net::TcpListener,
    inbox: Inbox<ToCore>,
    guard: Guard,
    links: Links,
) -> std::io::Result<()> {
    let core = Rc::new(Core::new(index, cfg, driver, guard, links));
    let listener = monoio::net::TcpListener::from_std(listener)?;
    monoio::spawn(accept::run(core.clone(), listener));
    monoio::spawn(sweep::run(core.clone()));
    monoio::spawn(core::ring_bridge(core.clone()));
    let finished = inbox::run(core.clone(), inbox).await;
    // The ringer task ends with the runtime: the last messages (a drain's closes) ring here.
    core.bridge.ring();
    finished
}
