//! Command line, `FLEETLINK_*` environment and optional TOML file, merged into one validated
//! [`Config`].
//!
//! Precedence: a flag on the command line beats its environment variable, which beats the
//! `--config` file, which beats the default. Every flag is documented with its default and unit
//! in `--help`; the defaults are CONTRACT.md §1's.
//!
//! One job a file: `flags.rs` declares the command line, `sources.rs` merges it with the
//! environment and the file, `validate.rs` turns it into the `Config` of `settings.rs`,
//! `parse.rs` parses values; `error_line.rs` says an error on one line.

mod error_line;
mod flags;
mod parse;
mod settings;
mod sources;
#[cfg(test)]
mod testing;
mod validate;

pub use error_line::error_line;
pub use flags::{BrokerArgs, Cli, Tool};
pub use parse::{parse_addr, parse_duration, MAX_DURATION};
pub use settings::{Config, TlsFiles, MAX_CORES};
pub use sources::unknown_env;
#[cfg(test)]
pub(crate) use testing::test_config;
pub use validate::default_broker_id;
