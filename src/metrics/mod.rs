//! Per-core counters, shipped to the admin thread as snapshots, rendered as Prometheus text.
//!
//! A core bumps plain `Cell`s (no atomics, no sharing); the admin thread asks each core for a
//! [`CoreSnapshot`] through its inbox and sums them. Rig-level figures are aggregated by the
//! `--group-label` value, never one series per rig.

mod counting;
mod groups;
mod help;
mod render;
mod snapshot;

pub use counting::{CoreMetrics, ACK_BUCKETS_MS, C, CLOSE_CODES};
pub use groups::{GroupCount, GroupFigures, GroupSlot, MAX_GROUPS, OTHER_GROUP};
pub(crate) use render::family;
pub use render::{broker_id, render, render_as, render_tls, set_identity, Identity};
pub use snapshot::{BridgeStats, CoreSnapshot, Retired, RigInfo};
