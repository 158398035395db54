//! Fixtures for unit tests here and elsewhere (a core or a bridge needs a `Config`), so that no
//! part's tests lean on another part's test module.

use std::ffi::OsString;
use std::path::PathBuf;

use super::{Cli, Config};

/// The defaults on one core, for unit tests that build a core or a bridge.
#[cfg(test)]
pub(crate) fn test_config() -> &'static Config {
    let argv = ["fleetlink-fe", "--cores", "1"]
        .map(OsString::from)
        .to_vec();
    let cfg = Cli::load(argv)
        .and_then(|c| c.broker.validate())
        .expect("default config");
    Box::leak(Box::new(cfg))
}

pub(super) fn load(args: &[&str]) -> anyhow::Result<Config> {
    let argv = std::iter::once("fleetlink-fe")
        .chain(args.iter().copied())
        .map(OsString::from);
    Cli::load(argv.collect())?.broker.validate()
}

/// A config file of its own for one test (tests run in parallel in one process).
pub(super) fn config_file(name: &str, text: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("fl-cfg-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let path = dir.join(name);
    std::fs::write(&path, text).unwrap();
    path
}
