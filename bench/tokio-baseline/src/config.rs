//! Flags of the baseline broker: the contract's names and defaults where the baseline has the
//! feature, plus the buffer knobs the density benches compare.

use std::net::SocketAddr;
use std::path::PathBuf;
use std::time::Duration;

use clap::Parser;

#[derive(Debug, Clone, Parser)]
#[command(
    name = "fleetlink-tokio-baseline",
    version,
    about = "tokio + tokio-tungstenite baseline broker",
    long_about = "tokio + tokio-tungstenite baseline broker, for benchmarks against fleetlink-fe.\n\nIt reads the same FLEETLINK_* environment variables as fleetlink-fe, with some defaults of its own (--session-ttl 0s): do not share an environment file between the two."
)]
pub struct Config {
    /// Rig endpoint.
    #[arg(long, env = "FLEETLINK_LISTEN", default_value = "0.0.0.0:8080")]
    pub listen: SocketAddr,
    /// Admin HTTP endpoint.
    #[arg(long, env = "FLEETLINK_ADMIN", default_value = "127.0.0.1:9090")]
    pub admin: SocketAddr,
    /// Id reported in welcome messages (default: `tokio-baseline-<port>`).
    #[arg(long, env = "FLEETLINK_BROKER_ID")]
    pub broker_id: Option<String>,
    /// tokio worker threads (default: all online cores).
    #[arg(long, env = "FLEETLINK_WORKERS")]
    pub workers: Option<usize>,
    /// Listen backlog: accept storms overflow a small queue and clients wait for SYN retransmits.
    #[arg(long, env = "FLEETLINK_BACKLOG", default_value_t = 4096)]
    pub backlog: u32,
    /// tungstenite read buffer per connection, bytes (default: tungstenite's, 128 KiB).
    #[arg(long, env = "FLEETLINK_READ_BUFFER")]
    pub read_buffer: Option<usize>,
    /// tungstenite write buffer target, bytes (default: tungstenite's, 128 KiB).
    #[arg(long, env = "FLEETLINK_WRITE_BUFFER")]
    pub write_buffer: Option<usize>,
    /// Per-rig bound of commands not yet written.
    #[arg(long, env = "FLEETLINK_OUTBOX", default_value_t = 128)]
    pub outbox: usize,
    /// A PING to every rig this often (liveness, as the broker's).
    #[arg(long, env = "FLEETLINK_PING_INTERVAL", default_value = "20s", value_parser = parse_duration)]
    pub ping_interval: Duration,
    /// A PONG must come within this after the PING, or it is a miss.
    #[arg(long, env = "FLEETLINK_PONG_TIMEOUT", default_value = "10s", value_parser = parse_duration)]
    pub pong_timeout: Duration,
    /// This many misses in a row close the rig with 4002.
    #[arg(long, env = "FLEETLINK_MAX_MISSED_PONGS", default_value_t = 3)]
    pub max_missed_pongs: u32,
    /// Upgrade to valid hello must finish within this.
    #[arg(long, env = "FLEETLINK_HELLO_TIMEOUT", default_value = "10s", value_parser = parse_duration)]
    pub hello_timeout: Duration,
    /// Larger inbound messages close the connection with 1009.
    #[arg(long, env = "FLEETLINK_MAX_MESSAGE", default_value_t = 65536)]
    pub max_message: usize,
    /// Server certificate chain (PEM); with --tls-key the rig endpoint serves wss.
    #[arg(long, env = "FLEETLINK_TLS_CERT", requires = "tls_key")]
    pub tls_cert: Option<PathBuf>,
    /// Server private key (PEM).
    #[arg(long, env = "FLEETLINK_TLS_KEY", requires = "tls_cert")]
    pub tls_key: Option<PathBuf>,
    /// CA bundle (PEM): client certificates chaining to it are required.
    #[arg(long, env = "FLEETLINK_CLIENT_CA", requires = "tls_cert")]
    pub client_ca: Option<PathBuf>,
    /// Redis URL (`redis://...`): registry leases and the pub/sub control plane. None =
    /// standalone, the admin API is the control plane.
    #[arg(long, env = "FLEETLINK_REDIS")]
    pub redis: Option<String>,
    /// TTL of a rig's registry entry (Redis mode).
    #[arg(long, env = "FLEETLINK_REGISTRY_TTL", default_value = "60s", value_parser = parse_duration)]
    pub registry_ttl: Duration,
    /// How often the broker extends the leases of the rigs it holds (Redis mode).
    #[arg(long, env = "FLEETLINK_REGISTRY_REFRESH", default_value = "10s", value_parser = parse_duration)]
    pub registry_refresh: Duration,
    /// Redis mode: keep every command control PUBLISHes in Redis (lua/persist.lua, fenced by
    /// the rig's lease, as fleetlink-fe's session store does) before writing it, forget it at
    /// the ack, and let an untouched session expire after this long. Admin POSTs are written
    /// unkept. 0 = off, the default: the
    /// baseline's subset has no session store. A bench knob for what the store costs on the
    /// write path: nothing is ever resumed from it.
    #[arg(long, env = "FLEETLINK_SESSION_TTL", default_value = "0s", value_parser = parse_duration)]
    pub session_ttl: Duration,
}

impl Config {
    pub fn broker_id(&self) -> String {
        self.broker_id
            .clone()
            .unwrap_or_else(|| format!("tokio-baseline-{}", self.listen.port()))
    }
}

/// `250ms`, `20s`, `5m`, `1h`; a bare number is seconds.
pub fn parse_duration(s: &str) -> Result<Duration, String> {
    let s = s.trim();
    let split = s
        .find(|c: char| !c.is_ascii_digit() && c != '.')
        .unwrap_or(s.len());
    let (num, unit) = s.split_at(split);
    let n: f64 = num.parse().map_err(|_| format!("bad duration {s:?}"))?;
    let secs = match unit {
        "" | "s" => n,
        "ms" => n / 1000.0,
        "m" => n * 60.0,
        "h" => n * 3600.0,
        _ => return Err(format!("bad duration unit in {s:?} (use ms, s, m, h)")),
    };
    if !secs.is_finite() || secs < 0.0 {
        return Err(format!("bad duration {s:?}"));
    }
    Ok(Duration::from_secs_f64(secs))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn defaults_follow_the_contract() {
        let c = Config::try_parse_from(["x"]).unwrap();
        assert_eq!(c.outbox, 128);
        assert_eq!(c.ping_interval, Duration::from_secs(20));
        assert_eq!(c.pong_timeout, Duration::from_secs(10));
        assert_eq!(c.max_missed_pongs, 3);
        assert_eq!(c.read_buffer, None);
        assert_eq!(c.broker_id(), "tokio-baseline-8080");
        assert_eq!(c.registry_ttl, Duration::from_secs(60));
        assert_eq!(c.registry_refresh, Duration::from_secs(10));
        assert_eq!(c.redis, None);
        assert_eq!(c.session_ttl, Duration::ZERO);
        let c = Config::try_parse_from(["x", "--read-buffer", "4096", "--ping-interval", "250ms"])
            .unwrap();
        assert_eq!(c.read_buffer, Some(4096));
        assert_eq!(c.ping_interval, Duration::from_millis(250));
        assert_eq!(c.tls_cert, None);
    }

    #[test]
    fn tls_flags_go_together() {
        assert!(Config::try_parse_from(["x", "--tls-cert", "a.pem"]).is_err());
        assert!(Config::try_parse_from(["x", "--tls-key", "a.key"]).is_err());
        assert!(Config::try_parse_from(["x", "--client-ca", "ca.pem"]).is_err());
        let c = Config::try_parse_from([
            "x",
            "--tls-cert",
            "a.pem",
            "--tls-key",
            "a.key",
            "--client-ca",
            "ca.pem",
        ])
        .unwrap();
        assert_eq!(c.client_ca, Some(PathBuf::from("ca.pem")));
    }
}
