//! Who owns which rig, and the control plane around it.
//!
//! - [`msg`]: the only types that cross threads.
//! - [`embedded`]: the standalone registry (pure state).
//! - [`bridge`]: the thread that owns the registry and talks to cores.
//! - `fleet`, [`pubsub`], [`control`]: fleet mode's Redis I/O and control messages;
//!   `command_con`: its command connection, which gives up on a pipeline Redis stopped answering.
//! - [`scripts`]: the Redis Lua scripts of fleet mode; [`lapse_scripts`], those watching
//!   sessions that may lapse with commands unacked.
//! - `pace`: when the bridge's queued Redis writes go out.
//! - `throttle`: one log line a second for things that can happen thousands of times a second.

pub mod bridge;
#[cfg(test)]
mod canned;
pub(crate) mod command_con;
pub mod control;
pub mod embedded;
pub mod exit_wait;
pub mod fleet;
pub mod lapse_scripts;
pub mod msg;
pub mod offline;
pub(crate) mod pace;
pub mod pubsub;
pub(crate) mod resp;
pub mod scripts;
pub mod sessions;
pub(crate) mod throttle;
