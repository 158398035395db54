//! `fleetlink-fe doctor`: host readiness checks. Owned by the tuning work.

/// Entry point of `fleetlink-fe doctor` (placeholder until the tuning work lands).
pub fn main(_connections: u64) -> std::process::ExitCode {
    eprintln!("doctor is not available in this build yet");
    std::process::ExitCode::from(1)
}
