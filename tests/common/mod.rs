//! Shared helpers for integration tests: brokers and redis-servers on free ports.
#![allow(dead_code)]

pub mod broker;
pub mod control;
pub mod jwt;
pub mod process;
pub mod redis;
pub mod relay;
pub mod scratch;
