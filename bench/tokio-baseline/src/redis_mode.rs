//! ============================ REDIS MODE: NOT IMPLEMENTED YET ============================
//!
//! Place for the baseline's Redis mode, so the bench can compare the brokers on the contract's
//! distributed path (section 3-4 of CONTRACT.md), not only standalone. When implemented it must:
//! - load the project's Lua scripts from `lua/` once and run them by EVALSHA (hello/takeover,
//!   refresh, disconnect), exactly as `fleetlink-fe` does, so registry costs compare fairly;
//! - keep `rig:<rig_id>` = `<boot_id>|<broker_id>` refreshed every `--registry-refresh`, close
//!   with 4410 when a refresh answers `superseded`, and publish `evict` on takeover;
//! - subscribe to `fleetlink:broker:<broker_id>` and `fleetlink:broadcast`, enqueue through the
//!   same `Registry::enqueue` as the admin API, and publish replies to `reply_to` exactly once;
//! - publish lifecycle events on `fleetlink:events` and keep `broker:<broker_id>` alive.
//!
//! Until then `--redis` is refused at start-up rather than silently ignored.

use anyhow::{bail, Result};

/// Refuses to start in Redis mode (see the module docs).
pub fn start(url: &str) -> Result<()> {
    bail!("--redis {url}: Redis mode is not implemented in the tokio baseline yet (bench/tokio-baseline/src/redis_mode.rs)")
}
