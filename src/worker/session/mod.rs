//! What a connection does with what it receives: the upgrade, rig messages, the registry's
//! verdicts and control's commands. No awaits and no socket calls other than through
//! [`Conn`]'s ordered writer, so every rule here runs to completion on the core thread.
//!
//! One job a file: [`upgrade`] (the HTTP upgrade and its checks, and `consume`, the entry
//! point), [`rig_messages`] (what a rig sends), [`commands`] (control's commands and the
//! outbox), [`hold_fetch`] (a big offline hold taken from Redis as room frees) and [`verdicts`]
//! (the registry's answers, and the connection's end).
//!
//! [`Conn`]: crate::worker::core::Conn

mod commands;
mod hold_fetch;
mod rig_messages;
mod upgrade;
mod verdicts;

pub(crate) use commands::{bridge_full, deliver, holds, not_taken, on_command, pump, scope_allows};
pub(crate) use hold_fetch::{on_delivery_end, on_hold_found, sweep as sweep_holds, HoldFetch};
pub(crate) use rig_messages::retry_after;
pub(crate) use upgrade::consume;
pub(crate) use verdicts::{
    forget_dropped, on_closed, on_persisted, on_rekeep, on_verdict, raise_seq, return_verdict,
    send_rekeep,
};
