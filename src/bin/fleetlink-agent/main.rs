//! `fleetlink-agent`: the reference rig (CONTRACT.md §1, §2, §5, §7). It says hello with a
//! boot_id fresh per process, acks every command on receipt, runs the allowed ones one at a
//! time, reports results, and reconnects with jitter, resuming its session.
//!
//! Module map:
//! - `cli`: flags → validated `Config`.
//! - `session`: the connection loop (the only socket IO after dial).
//! - `reconnect`: how long to wait after an attempt ends, or whether to stop; pure.
//! - `dial`: resolve, connect, TLS, upgrade; 503 + Retry-After.
//! - `tls`: rustls client config and the plain/TLS stream.
//! - `proto`: the JSON messages, pure.
//! - `seq`: run / duplicate / gap, pure.
//! - `backoff`: reconnect delays, pure.
//! - `worker`, `handler`: the command thread, the `Handler` trait and the allowlist handler.
//!
//! Exit codes: 0 stopped (signal, `--run-for`), 1 startup error or dead worker, 3 gave up
//! (`--max-attempts`), 4 seq gap (commands were lost), 5 refused by the broker (4400, 4403,
//! 4409), 64 usage.

mod backoff;
mod cli;
mod confirm;
mod dial;
mod handler;
mod proto;
mod reconnect;
mod seq;
mod session;
mod tls;
mod worker;

use std::process::ExitCode;
use std::sync::atomic::AtomicBool;
use std::sync::Arc;

use clap::error::ErrorKind;
use clap::Parser;

use crate::cli::{Cli, Config};
use crate::handler::{Allowlist, Running};
use crate::reconnect::Exit;
use crate::session::Agent;
use crate::worker::ExecLog;

/// Exit code of a bad command line (sysexits `EX_USAGE`), as `fleetctl` uses.
const EXIT_USAGE: u8 = 64;

fn main() -> ExitCode {
    env_logger::Builder::from_env(env_logger::Env::default().default_filter_or("info")).init();
    let cli = match Cli::try_parse() {
        Ok(cli) => cli,
        Err(e) if matches!(e.kind(), ErrorKind::DisplayHelp | ErrorKind::DisplayVersion) => {
            e.exit()
        }
        Err(e) => {
            let _ = e.print();
            return ExitCode::from(EXIT_USAGE);
        }
    };
    let cfg = match cli.validate() {
        Ok(cfg) => cfg,
        Err(e) => {
            eprintln!("fleetlink-agent: {e:#}");
            return ExitCode::from(EXIT_USAGE);
        }
    };
    match run(cfg) {
        Ok(exit) => ExitCode::from(exit.code()),
        Err(e) => {
            eprintln!("fleetlink-agent: {e:#}");
            ExitCode::from(Exit::Fatal.code())
        }
    }
}

fn run(cfg: Config) -> anyhow::Result<Exit> {
    let tls = match cfg.endpoint.tls {
        true => {
            let identity = cfg
                .identity
                .as_ref()
                .map(|(c, k)| (c.as_path(), k.as_path()));
            Some(tls::client_config(cfg.ca.as_deref(), identity)?)
        }
        false => None,
    };
    // Read at every attempt; a file that is not there at start is a mistake, not a renewal
    // still to come.
    if let Some(path) = cfg.token_file.as_deref() {
        dial::bearer(path).map_err(anyhow::Error::msg)?;
    }
    let exec_log = cfg.exec_log.as_deref().map(ExecLog::open).transpose()?;
    if cfg.allow.is_empty() {
        log::warn!("no --allow given: every command will be refused");
    }
    let running = Running::default();
    let handler = Allowlist::new(
        cfg.allow.clone(),
        cfg.output_cap,
        cfg.command_timeout,
        running.clone(),
    );
    let abandon = Arc::new(AtomicBool::new(false));
    let queued = Arc::new(std::sync::atomic::AtomicUsize::new(0));
    let (jobs, done) = worker::spawn(
        Box::new(handler),
        exec_log,
        cfg.max_pending,
        abandon.clone(),
        queued.clone(),
    )?;
    let stop = Arc::new(AtomicBool::new(false));
    // SIGHUP too (a closed terminal, a supervisor's reload): stopping winds down, killing the
    // running command's process group; dying of it left that group running past its timeout.
    for signal in [
        signal_hook::consts::SIGTERM,
        signal_hook::consts::SIGINT,
        signal_hook::consts::SIGHUP,
    ] {
        signal_hook::flag::register(signal, stop.clone())?;
    }
    let stopping = session::Stopping {
        abandon,
        running: running.clone(),
    };
    let exit = Agent::new(cfg, tls, (jobs, queued), done, stop, stopping).run();
    // Nothing started after the agent's own wind-down; a command still running would
    // outlive us.
    running.kill();
    log::info!("exiting with code {} ({exit:?})", exit.code());
    Ok(exit)
}
