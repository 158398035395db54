//! fleetlink-tokio-baseline: the broker "as a competent team would write it" on tokio
//! multi-thread + tokio-tungstenite, to measure the thread-per-core broker against. Speaks the
//! contract subset the benches use: `/agent` hello/welcome/command/ack, registry takeover rules,
//! pings, the standalone admin API, and with `--redis` the Redis registry and pub/sub control
//! plane (without session persistence, resume or the offline queue).

mod admin;
mod config;
mod conn;
mod hello;
mod keep;
mod metrics;
mod redis_mode;
mod registry;
mod tls;

use std::process::ExitCode;
use std::sync::atomic::AtomicU64;
use std::sync::Arc;

use anyhow::{Context, Result};
use clap::Parser;
use tokio::signal::unix::{signal, SignalKind};
use tokio_tungstenite::tungstenite::protocol::WebSocketConfig;

use config::Config;
use metrics::Metrics;
use registry::Registry;

/// Same allocator as fleetlink-fe, so memory comparisons are about design, not malloc.
#[global_allocator]
static GLOBAL: mimalloc::MiMalloc = mimalloc::MiMalloc;

/// Process-wide state shared by the rig and admin tasks.
pub struct App {
    pub cfg: Config,
    pub broker_id: String,
    pub registry: Registry,
    pub metrics: Metrics,
    pub ws_config: WebSocketConfig,
    /// wss: TLS is accepted before the upgrade. None = plain ws.
    pub tls: Option<tokio_rustls::TlsAcceptor>,
    /// Redis mode: registry leases and the pub/sub control plane. None = standalone.
    pub fleet: Option<redis_mode::Fleet>,
    pub next_conn_id: AtomicU64,
    pub next_command_id: AtomicU64,
}

impl App {
    fn new(
        cfg: Config,
        tls: Option<tokio_rustls::TlsAcceptor>,
        fleet: Option<redis_mode::Fleet>,
    ) -> Self {
        let mut ws = WebSocketConfig::default()
            .max_message_size(Some(cfg.max_message))
            .max_frame_size(Some(cfg.max_message));
        if let Some(n) = cfg.read_buffer {
            ws = ws.read_buffer_size(n);
        }
        if let Some(n) = cfg.write_buffer {
            ws = ws.write_buffer_size(n);
        }
        Self {
            broker_id: cfg.broker_id(),
            registry: Registry::new(cfg.outbox),
            metrics: Metrics::default(),
            ws_config: ws,
            tls,
            fleet,
            next_conn_id: AtomicU64::new(1),
            next_command_id: AtomicU64::new(1),
            cfg,
        }
    }
}

fn main() -> ExitCode {
    let cfg = Config::parse();
    let mut rt = tokio::runtime::Builder::new_multi_thread();
    if let Some(n) = cfg.workers {
        rt.worker_threads(n.max(1));
    }
    let result = rt
        .enable_all()
        .build()
        .context("tokio runtime")
        .and_then(|rt| rt.block_on(run(cfg)));
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("fleetlink-tokio-baseline: {e:#}");
            ExitCode::FAILURE
        }
    }
}

async fn run(cfg: Config) -> Result<()> {
    let tls = match (&cfg.tls_cert, &cfg.tls_key) {
        (Some(cert), Some(key)) => Some(tokio_rustls::TlsAcceptor::from(Arc::new(
            tls::server_config(cert, key, cfg.client_ca.as_deref())?,
        ))),
        _ => None,
    };
    let rigs =
        conn::bind(cfg.listen, cfg.backlog).with_context(|| format!("binding {}", cfg.listen))?;
    let admin = tokio::net::TcpListener::bind(cfg.admin)
        .await
        .with_context(|| format!("binding admin {}", cfg.admin))?;
    let fleet = match &cfg.redis {
        Some(url) => Some(
            redis_mode::Fleet::connect(url, &cfg.broker_id(), cfg.registry_ttl, cfg.session_ttl)
                .await?,
        ),
        None => None,
    };
    let app = Arc::new(App::new(cfg, tls, fleet));
    let tls_mode = match (&app.tls, &app.cfg.client_ca) {
        (None, _) => "off",
        (Some(_), None) => "server-auth",
        (Some(_), Some(_)) => "mtls",
    };
    eprintln!(
        "fleetlink-tokio-baseline: broker_id={} rigs on {} admin on {} read_buffer={} write_buffer={} tls={tls_mode} redis={}",
        app.broker_id,
        rigs.local_addr()?,
        admin.local_addr()?,
        app.ws_config.read_buffer_size,
        app.ws_config.write_buffer_size,
        if app.fleet.is_some() { "on" } else { "off" }
    );
    redis_mode::spawn(&app);
    tokio::spawn(admin::serve(admin, app.clone()));
    tokio::spawn(conn::accept_loop(rigs, app.clone()));

    // No drain in the baseline: a signal ends the process (sockets are reset by the kernel).
    let mut term = signal(SignalKind::terminate()).context("SIGTERM handler")?;
    tokio::select! {
        _ = term.recv() => {}
        r = tokio::signal::ctrl_c() => r.context("SIGINT handler")?,
    }
    eprintln!(
        "fleetlink-tokio-baseline: exiting with {} rigs connected",
        app.registry.len()
    );
    Ok(())
}
