//! `fleetlink-fe`: parse the configuration, start the bridge, the cores and the admin thread,
//! then wait for SIGTERM/SIGINT or `POST /v1/drain` and drain (CONTRACT.md §7).

use std::process::ExitCode;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;

use anyhow::Context;
use fleetlink::config::{error_line, Cli, Config, Tool};
use fleetlink::jwt::JwtVerifier;
use fleetlink::registry::bridge::{self, BridgeShared};
use fleetlink::registry::msg::{ToBridge, ToCore};
use fleetlink::tls::{TlsPaths, TlsReloader};
use fleetlink::{admin, doorbell, metrics, thread_loss, worker};

#[cfg(not(feature = "heap-stats"))]
#[global_allocator]
static GLOBAL: mimalloc::MiMalloc = mimalloc::MiMalloc;

#[cfg(feature = "heap-stats")]
#[global_allocator]
static GLOBAL: fleetlink::heap_stats::Counting<mimalloc::MiMalloc> =
    fleetlink::heap_stats::Counting(mimalloc::MiMalloc);

/// Messages a core or the bridge may have waiting before senders get "full".
const QUEUE: usize = 65_536;

/// The log filter without `RUST_LOG`. rustls' own lines stay below error: a peer can make it
/// warn at will (one line per TLS 1.2 renegotiation attempt), and the cores log each TLS
/// failure themselves, at most once a second.
const DEFAULT_LOG: &str = "info,rustls=error";

/// What goes after a `RUST_LOG` the operator set: rustls kept at error unless it names rustls
/// itself, so that `RUST_LOG=info,fleetlink::worker=debug` does not also let any peer write a
/// warning line per connection.
fn quiet_rustls(rust_log: Option<&str>) -> Option<&'static str> {
    let set = rust_log.map(str::trim).filter(|f| !f.is_empty())?;
    (!set.contains("rustls") && set != "off").then_some("rustls=error")
}

fn main() -> ExitCode {
    let mut logger =
        env_logger::Builder::from_env(env_logger::Env::default().default_filter_or(DEFAULT_LOG));
    if let Some(quiet) = quiet_rustls(std::env::var("RUST_LOG").ok().as_deref()) {
        logger.parse_filters(quiet);
    }
    logger.init();
    let cli = match Cli::load(std::env::args_os().collect()) {
        Ok(cli) => cli,
        Err(e) => match e.downcast::<clap::Error>() {
            Ok(clap_err) => clap_err.exit(),
            Err(e) => {
                eprintln!("fleetlink-fe: {}", error_line(&e));
                return ExitCode::from(64);
            }
        },
    };
    let names = std::env::vars_os().map(|(k, _)| k.to_string_lossy().into_owned());
    for var in fleetlink::config::unknown_env(names) {
        log::warn!("{var} is set but names no fleetlink-fe option; ignored (see --help)");
    }
    let result = match cli.tool {
        Some(Tool::Doctor { connections, tls }) => {
            // A deploy gate: a configuration the broker would refuse at start fails here too.
            if let Err(e) = cli
                .broker
                .clone()
                .validate()
                .and_then(|cfg| check_files(&cfg))
            {
                eprintln!("fleetlink-fe: {}", error_line(&e));
                return ExitCode::FAILURE;
            }
            let transport = if tls || cli.broker.tls_cert.is_some() {
                fleetlink::doctor::Transport::Tls
            } else {
                fleetlink::doctor::Transport::Plain
            };
            return fleetlink::doctor::main_with(
                connections,
                cli.broker.cores.and_then(std::num::NonZeroUsize::new),
                transport,
                cli.broker.listen,
                u64::try_from(cli.broker.backlog).unwrap_or(fleetlink::doctor::LISTEN_BACKLOG),
                cli.broker.max_connections,
            );
        }
        Some(Tool::DevCerts {
            out,
            rigs,
            broker_names,
        }) => fleetlink::dev_certs::main(&out, rigs, &broker_names),
        None => cli.broker.validate().and_then(run),
    };
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("fleetlink-fe: {}", error_line(&e));
            ExitCode::FAILURE
        }
    }
}

fn run(mut cfg: Config) -> anyhow::Result<()> {
    // Caught from the start, answered once the broker runs: a SIGTERM during start-up (a
    // Redis slow to answer the broker-id check holds it there for a second) drains and exits
    // 0 as at any other time, rather than killing the process as the default action did.
    let signals = {
        use signal_hook::consts::{SIGHUP, SIGINT, SIGTERM};
        signal_hook::iterator::Signals::new([SIGTERM, SIGINT, SIGHUP])?
    };
    let listeners = worker::bind_listeners(cfg.listen, cfg.cores, cfg.backlog, cfg.share_port)
        .with_context(|| format!("binding {}", cfg.listen))?;
    let listen = listeners
        .first()
        .map(|l| l.local_addr())
        .transpose()?
        .context("no listener")?;
    if !cfg.broker_id_given && cfg.listen.port() == 0 {
        // Named for the port it got: two brokers on port 0 would otherwise share `host-0`.
        cfg.broker_id = fleetlink::config::default_broker_id(listen.port());
    }
    // What the registry's `broker:` key and the logs name: the port bound, not 0.
    cfg.listen = listen;
    // Read-only for the life of the process; every thread borrows it.
    let cfg: &'static Config = Box::leak(Box::new(cfg));
    if !cfg.listen.ip().is_loopback() && cfg.tls.is_none() {
        log::warn!("!!! plain ws on non-loopback {}: rig traffic and identities travel unencrypted; use --tls-cert/--tls-key", cfg.listen);
    }
    let driver = worker::driver_name(cfg);
    if driver != "io_uring" && cfg.force_epoll {
        log::info!("running on the epoll driver, as --force-epoll asks");
    } else if driver != "io_uring" {
        log::warn!("!!! io_uring unavailable or disabled: running on the epoll driver (metric fleetlink_driver{{driver=\"epoll\"}})");
    }
    log_connection_room(cfg);
    // Standalone keeps a parked session at least as long as a lease would last (review bb147:
    // `--session-ttl 1s` under a 5 s `--registry-ttl` reported `expired` after 5.9 s, unsaid).
    if cfg.redis.is_none() && !cfg.session_ttl.is_zero() && cfg.session_ttl < cfg.registry_ttl {
        log::info!(
            "--session-ttl {:?} is below --registry-ttl {:?}: standalone, a rig's parked session is kept {:?} before its commands are reported expired",
            cfg.session_ttl,
            cfg.registry_ttl,
            cfg.park_for()
        );
    }
    let admin_listener =
        admin::bind(cfg.admin).with_context(|| format!("binding admin {}", cfg.admin))?;
    if let Some(url) = &cfg.redis {
        // Two brokers with one id would share one control channel: each command would reach
        // both, and the one without the rig would answer `rig_not_connected` for a command
        // the other ran.
        use fleetlink::registry::fleet::{broker_id_in_use, IdCheck};
        let check = broker_id_in_use(url, &cfg.broker_id);
        if let IdCheck::Failed(e) = &check {
            log::warn!(
                "cannot tell whether another broker runs with --broker-id {}: Redis refused \
                 PUBSUB NUMSUB ({e}); the canaries will tell once both run",
                cfg.broker_id
            );
        }
        if check == IdCheck::Taken {
            anyhow::bail!(
                "another broker with --broker-id {} is running: something is subscribed to {}; \
                 give each broker its own --broker-id (the default is the host name and the \
                 --listen port)",
                cfg.broker_id,
                fleetlink::registry::fleet::broker_channel(&cfg.broker_id)
            );
        }
    }
    let admin_addr = admin_listener.local_addr()?;

    let guard = security(cfg)?;
    let lost = thread_loss::watch();
    let (bridge_tx, bridge_rx) = doorbell::channel::<ToBridge>(QUEUE)?;
    let mut core_txs = Vec::with_capacity(cfg.cores);
    let mut core_rxs = Vec::with_capacity(cfg.cores);
    for _ in 0..cfg.cores {
        let (tx, rx) = doorbell::channel::<ToCore>(QUEUE)?;
        core_txs.push(tx);
        core_rxs.push(rx);
    }
    let shared = Arc::new(BridgeShared::new(cfg.redis.is_some()));
    let bridge = bridge::spawn(cfg, bridge_rx, core_txs.clone(), shared.clone())?;
    let pool = admin::pool_queue();
    let conn_cap = cfg
        .max_connections
        .map(|max| Arc::new(worker::ConnCap::new(max)));
    let retired = Arc::new(metrics::Retired::default());
    let mut cores = Vec::with_capacity(cfg.cores);
    for (i, (listener, inbox)) in listeners.into_iter().zip(core_rxs).enumerate() {
        let links = worker::Links {
            bridge: bridge_tx.clone(),
            peers: core_txs.clone(),
            pool: pool.0.clone(),
            bridge_shared: shared.clone(),
            conn_cap: conn_cap.clone(),
            retired: retired.clone(),
        };
        cores.push(worker::spawn(
            i,
            cfg,
            driver,
            listener,
            inbox,
            guard.clone(),
            links,
        )?);
    }
    let draining = Arc::new(AtomicBool::new(false));
    let (drain_tx, drain_rx) = crossbeam_channel::bounded::<()>(4);
    metrics::set_identity(metrics::Identity {
        broker_id: cfg.broker_id.clone(),
        fleet: cfg.redis.is_some(),
    });
    let admin = Arc::new(admin::Admin::new(
        bridge_tx.clone(),
        core_txs.clone(),
        shared.clone(),
        draining.clone(),
        drain_tx.clone(),
        retired,
        guard.tls.clone(),
    ));
    admin::spawn(admin_listener, admin, pool)?;
    let (signal_tx, signal_rx) = crossbeam_channel::bounded::<&'static str>(4);
    spawn_signal_thread(signals, signal_tx, cfg.tls.is_some())?;

    // Machine-readable: tests and scripts wait for this line to learn the bound ports.
    println!(
        "fleetlink-fe ready listen={listen} admin={admin_addr} broker_id={} cores={} driver={driver}",
        cfg.broker_id, cfg.cores
    );
    log::info!(
        "broker {} listening on {listen} (admin {admin_addr}), {} cores, {driver}",
        cfg.broker_id,
        cfg.cores
    );

    let cause = crossbeam_channel::select! {
        recv(signal_rx) -> name => name.map_or(DrainCause::AdminApi, DrainCause::Signal),
        recv(drain_rx) -> _ => DrainCause::AdminApi,
        recv(lost) -> first => DrainCause::Lost(first.map_or_else(|e| e.to_string(), |l| l.to_string())),
    };
    draining.store(true, Ordering::SeqCst);
    shared.draining.store(true, Ordering::SeqCst);
    if let DrainCause::Lost(what) = &cause {
        log::error!("!!! {what}: draining the rest of the broker and exiting 1, for the supervisor to start a whole one");
    }
    // In seconds: `{:?}` of a zero window reads "0ns".
    log::info!("draining over {}s ({cause})", cfg.drain.as_secs_f64());
    drain_cores(&core_txs, cfg.drain);
    // Only a second signal cuts the drain short: an operator pressing Ctrl-C again means
    // "now", while a retried POST /v1/drain is just a retry. After a drain started by the API,
    // the first signal is the usual `systemctl stop` that follows it, not a "now": cut at
    // once, every rig would reconnect in the same instant instead of over the window.
    let signals_before_cut = match cause {
        DrainCause::Signal(_) | DrainCause::Lost(_) => 1,
        DrainCause::AdminApi => 2,
    };
    let cut_txs = core_txs.clone();
    let cut = Arc::new(AtomicBool::new(false));
    let cut_seen = cut.clone();
    std::thread::Builder::new()
        .name("fleetlink-drain-cut".into())
        .spawn(move || {
            for _ in 1..signals_before_cut {
                match signal_rx.recv() {
                    Ok(name) => log::info!("{name}: already draining; another one ends it now"),
                    Err(_) => return,
                }
            }
            if let Ok(name) = signal_rx.recv() {
                log::warn!("{name} during the drain: closing every rig now (1001)");
                cut_seen.store(true, Ordering::SeqCst);
                drain_cores(&cut_txs, Duration::ZERO);
            }
        })?;
    for core in cores {
        let _ = core.join();
    }
    // The flag, not its value now: a second signal during the bridge's wait for Redis ends
    // that wait too.
    let _ = bridge_tx.push_owed(ToBridge::Shutdown { now: cut });
    bridge_tx.ring();
    let _ = bridge.join();
    match (cause, lost.try_recv().ok()) {
        (DrainCause::Lost(what), _) => anyhow::bail!("drained after {what}"),
        (_, Some(what)) => anyhow::bail!("drained, but {what} during the drain"),
        _ => {}
    }
    log::info!("drained; exiting");
    Ok(())
}

/// Asks every core to drain over `window`; a core already draining closes its rigs at once
/// when `window` is zero.
fn drain_cores(cores: &[doorbell::Mailbox<ToCore>], window: Duration) {
    // Past the inboxes' bounds: a drain or shutdown that a full inbox refused would leave
    // the process waiting for that thread forever.
    for core in cores {
        let _ = core.push_owed(ToCore::Drain { window });
        core.ring();
    }
}

/// Loads TLS material (and starts its file/SIGHUP watcher) and the token verifier.
fn security(cfg: &Config) -> anyhow::Result<worker::Guard> {
    let tls = match tls_paths(cfg) {
        Some(paths) => {
            let reloader = TlsReloader::new(paths)?;
            reloader.spawn_watcher(Duration::from_secs(1))?;
            Some(reloader)
        }
        None => None,
    };
    let jwt = if cfg.jwt_keys.is_empty() {
        None
    } else {
        let mut verifier = JwtVerifier::from_pem_files(&cfg.jwt_keys)?;
        if let Some(aud) = &cfg.jwt_audience {
            verifier = verifier.with_audience(aud.clone());
        }
        Some(Arc::new(verifier))
    };
    Ok(worker::Guard { tls, jwt })
}

fn tls_paths(cfg: &Config) -> Option<TlsPaths> {
    cfg.tls.as_ref().map(|files| TlsPaths {
        cert: files.cert.clone(),
        key: files.key.clone(),
        client_ca: files.client_ca.clone(),
        crl: files.crl.clone(),
    })
}

/// Says at start how many rigs the open-file limit leaves room for, by `doctor`'s count: past
/// it rigs are refused, counted but not logged one by one.
fn log_connection_room(cfg: &Config) {
    let Some(room) = fleetlink::doctor::rig_room(cfg.cores as u64) else {
        return;
    };
    match cfg.max_connections {
        Some(cap) if room < cap => log::warn!(
            "!!! the open-file limit (RLIMIT_NOFILE) leaves room for about {room} rigs, below \
             --max-connections {cap}: rigs past it are refused (counted in \
             fleetlink_accepts_total{{result=\"over_capacity\"}}); raise it (ulimit -n, \
             LimitNOFILE=), see `fleetlink-fe doctor --connections {cap}`"
        ),
        // No cap to compare with, but no room at all is never meant (review bb129: said at INFO).
        None if room == 0 => log::warn!(
            "!!! the open-file limit (RLIMIT_NOFILE) leaves room for about 0 rigs beside what the \
             admin API and Redis need: rigs past the few the rest holds are refused (503, counted \
             in fleetlink_accepts_total{{result=\"over_capacity\"}}); raise it (ulimit -n, \
             LimitNOFILE=), see `fleetlink-fe doctor --connections N`"
        ),
        _ => log::info!(
            "the open-file limit (RLIMIT_NOFILE) leaves room for about {room} rigs \
             (`fleetlink-fe doctor --connections N` checks this host for N)"
        ),
    }
    if let Some(ceiling) = fleetlink::worker::rig_fd_ceiling() {
        log::info!(
            "rigs are refused (503) once the broker holds {ceiling} file descriptors: the rest \
             of the open-file limit is kept for Redis and the admin API"
        );
    }
}

/// Loads the TLS and token files as a start would, and drops them: `doctor`'s check.
fn check_files(cfg: &Config) -> anyhow::Result<()> {
    if let Some(paths) = tls_paths(cfg) {
        fleetlink::tls::build(&paths)?;
    }
    if !cfg.jwt_keys.is_empty() {
        JwtVerifier::from_pem_files(&cfg.jwt_keys)?;
    }
    Ok(())
}

/// What started the drain, for the log.
#[derive(Clone, Debug)]
enum DrainCause {
    Signal(&'static str),
    AdminApi,
    /// A thread stopped unasked ([`thread_loss`]).
    Lost(String),
}

impl std::fmt::Display for DrainCause {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            DrainCause::Signal(name) => f.write_str(name),
            DrainCause::AdminApi => f.write_str("POST /v1/drain"),
            DrainCause::Lost(what) => f.write_str(what),
        }
    }
}

/// Handles SIGTERM/SIGINT (drain; the second one during a drain ends it at once) and SIGHUP,
/// which must never keep its default action: that kills the broker without a drain, leaving
/// its leases in Redis until they time out.
fn spawn_signal_thread(
    mut signals: signal_hook::iterator::Signals,
    drain: crossbeam_channel::Sender<&'static str>,
    tls: bool,
) -> anyhow::Result<()> {
    use signal_hook::consts::{SIGINT, SIGTERM};
    std::thread::Builder::new()
        .name("fleetlink-signals".into())
        .spawn(move || {
            for signal in signals.forever() {
                let name = match signal {
                    SIGTERM => "SIGTERM",
                    SIGINT => "SIGINT",
                    // With TLS, the reloader's own SIGHUP thread reloads and logs it.
                    _ if tls => continue,
                    _ => {
                        log::info!("SIGHUP: nothing to reload (no TLS files configured)");
                        continue;
                    }
                };
                let _ = drain.try_send(name);
            }
        })?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::quiet_rustls;

    #[test]
    fn rustls_stays_at_error_unless_rust_log_names_it() {
        for set in ["info", "debug", "info,fleetlink::worker=debug", " warn "] {
            assert_eq!(quiet_rustls(Some(set)), Some("rustls=error"), "{set}");
        }
        for set in ["info,rustls=debug", "rustls=warn", "off", "", " "] {
            assert_eq!(quiet_rustls(Some(set)), None, "{set:?}");
        }
        assert_eq!(quiet_rustls(None), None, "unset: the default has it");
    }
}
