//! fleetlink: a thread-per-core websocket command broker (architecture tour filled in below).
#![warn(missing_docs, unreachable_pub)]

pub mod doctor;
pub mod http_upgrade;
pub mod ids;
pub mod protocol;
pub mod registry;
pub mod ws;
