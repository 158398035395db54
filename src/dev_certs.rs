//! `fleetlink-fe dev-certs` (placeholder until the TLS work lands).

/// Entry point of `fleetlink-fe dev-certs`.
pub fn main(_out: &std::path::Path, _rigs: usize, _names: &[String]) -> anyhow::Result<()> {
    anyhow::bail!("dev-certs is not available in this build yet")
}
