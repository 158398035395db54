//! fleetlink-loadgen: many simulated rigs against a broker's `/agent` endpoint, and an admin-API
//! fan-out for latency scenarios. See `bench/README.md` for how the benches use it.

pub mod cli;
pub mod fanout;
pub mod hist;
pub mod http;
pub mod orchestrator;
pub mod pem;
pub mod progress;
pub mod redis_pub;
pub mod report;
pub mod rig;
pub mod tls;
pub mod uuid7;
pub mod worker;
