//! The scenarios written as shell scripts (density, latency, TLS, Redis restart), reached from
//! `fleetlink-bench` as from `bench/run`, so that either entry point runs every scenario. The
//! arguments go to the script unchanged; each script's `--help` says how it spells them.

use std::os::unix::process::CommandExt;
use std::path::PathBuf;
use std::process::Command;

use anyhow::{bail, Result};

/// Arguments handed to a script as they are (`--help` included).
#[derive(clap::Args)]
#[command(disable_help_flag = true)]
pub(crate) struct Passed {
    #[arg(trailing_var_arg = true, allow_hyphen_values = true)]
    args: Vec<String>,
}

/// The repository the harness was built from (its scripts are not installed anywhere else);
/// `FLEETLINK_REPO` points elsewhere.
fn repo() -> PathBuf {
    std::env::var_os("FLEETLINK_REPO")
        .map(PathBuf::from)
        .unwrap_or_else(|| PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../.."))
}

/// Replaces this process with `bench/<script>` and `passed`'s arguments; returns only on error.
pub(crate) fn exec(script: &str, passed: &Passed) -> Result<()> {
    let path = repo().join("bench").join(script);
    if !path.is_file() {
        bail!(
            "{} not found: the script scenarios run the scripts of the checkout this binary \
             was built from (or of FLEETLINK_REPO when set); set FLEETLINK_REPO to a fleetlink \
             checkout, or use `cargo run -p fleetlink-bench` in one",
            path.display()
        );
    }
    let err = Command::new(&path).args(&passed.args).exec();
    bail!("{}: {err}", path.display())
}
