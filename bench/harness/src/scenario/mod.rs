//! The measuring scenarios. Each runs every broker configuration once per round (order rotating
//! per round), from a fresh broker process, and writes `<scenario>.json` + `<scenario>.md`.

pub(crate) mod accept_storm;
pub(crate) mod idle_cost;
pub(crate) mod throughput;
