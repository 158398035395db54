//! The command line as clap declares it, kept apart from merging and checking so that what an
//! operator sees in `--help` (flags, variables, defaults, units) reads in one place, against
//! docs/operations.md's table.

use std::net::SocketAddr;
use std::path::PathBuf;
use std::time::Duration;

use clap::builder::BoolishValueParser;
use clap::{Args, Parser, Subcommand};

use super::parse::{
    parse_addr, parse_broker_duration, parse_cores, parse_i32, parse_rate, parse_rig_count,
    parse_u32, parse_u64, parse_usize,
};

/// `fleetlink-fe`: the thread-per-core websocket broker for rig fleets.
#[derive(Parser, Debug)]
#[command(name = "fleetlink-fe", version, about, long_about = None, after_help = AFTER_HELP)]
pub struct Cli {
    /// Broker flags (used when no subcommand is given).
    #[command(flatten)]
    pub broker: BrokerArgs,
    /// Optional tool to run instead of the broker.
    #[command(subcommand)]
    pub tool: Option<Tool>,
}

/// What `--help` ends with: what a flag cannot say (docs/operations.md says it at length).
const AFTER_HELP: &str = "\
Durations take a unit: 250ms, 20s, 5m, 1h (a bare number is refused, except 0).

Logging: RUST_LOG sets the level and filters (default info,rustls=error; rustls stays at error
unless RUST_LOG names it), e.g. RUST_LOG=debug or RUST_LOG=info,fleetlink::worker=debug. Logs
go to stderr.

Signals: SIGTERM/SIGINT (or POST /v1/drain) drain over --drain, then exit 0; a second
SIGTERM/SIGINT during a drain ends it at once. SIGHUP reloads the TLS files when TLS is on.

Exit codes: 0 drained and stopped (or --help/--version); 1 invalid configuration (a value
out of its range, from a flag, the environment or the file alike; flags that do not go
together) or a failure at start (a file that does not load, a port that does not bind); 2 a
flag or environment value that does not parse as its kind; 64 the --config file cannot be
read or parsed, or holds an unknown key or a value that does not parse as its kind. doctor: 0 the host can hold N connections, 1 it cannot
or the broker would not start with this configuration (and 2 or 64 as above: doctor reads
the broker's flags, environment and --config too).";

/// `doctor --connections`: a count, said plainly when it is not one (clap's own messages read
/// "unexpected argument '-1'" and "invalid digit found in string").
fn parse_connections(s: &str) -> Result<u64, String> {
    match s.parse::<u64>() {
        Ok(n) if n >= 1 => Ok(n),
        Err(e) if *e.kind() == std::num::IntErrorKind::PosOverflow => Err(format!(
            "{s} is more than {}; the largest count checked is {}",
            u64::MAX,
            crate::doctor::MAX_CONNECTIONS
        )),
        _ => Err(format!(
            "a whole number of connections, 1 or more, in plain digits (not {s:?})"
        )),
    }
}

/// Tools bundled into the broker binary.
#[derive(Subcommand, Debug)]
pub enum Tool {
    /// Check this host's kernel and limits for N connections, and the broker's flags and
    /// files (config, TLS, tokens) as a start would; exit 1 if it cannot hold them or those
    /// would not start it. Ports are not tried: doctor runs beside a live broker. The broker's
    /// flags go before `doctor`: `fleetlink-fe --cores 8 doctor --connections N`.
    Doctor {
        /// Connections the host should hold (at least 1; above 100,000,000 checked as that).
        #[arg(long, default_value_t = 1_000_000, value_parser = parse_connections, allow_negative_numbers = true)]
        connections: u64,
        /// Rigs connect over wss: size memory with the TLS figure (~9,000 B of broker memory
        /// per idle connection instead of ~1,130 B). Implied by --tls-cert/FLEETLINK_TLS_CERT.
        #[arg(long)]
        tls: bool,
    },
    /// Write a development CA, a broker certificate and N rig client certificates.
    DevCerts {
        /// Output directory (created if missing).
        #[arg(long)]
        out: PathBuf,
        /// Number of rig certificates (rig-0001 …), at most 100,000 (each is a key pair and two
        /// files).
        #[arg(long, default_value_t = 3, value_parser = parse_rig_count)]
        rigs: usize,
        /// Extra DNS names for the broker certificate (localhost and 127.0.0.1 are always in).
        #[arg(long = "broker-name")]
        broker_names: Vec<String>,
    },
}

/// Every broker option (CONTRACT.md §1). Durations take a unit: `250ms`, `20s`, `5m`, `1h`.
#[derive(Args, Debug, Clone)]
pub struct BrokerArgs {
    /// TOML file with the same keys as these flags (e.g. `ping-interval = "20s"`,
    /// `strict = true`).
    #[arg(long, env = "FLEETLINK_CONFIG")]
    pub config: Option<PathBuf>,
    /// Rig websocket endpoint: ADDRESS:PORT, HOST:PORT or :PORT (every address). Default
    /// 0.0.0.0:8080, or 0.0.0.0:8443 with TLS.
    #[arg(long, env = "FLEETLINK_LISTEN", value_parser = parse_addr)]
    pub listen: Option<SocketAddr>,
    /// Admin HTTP endpoint (health, metrics, rigs, commands, drain), written as --listen is.
    /// Plain HTTP: keep it private.
    #[arg(long, env = "FLEETLINK_ADMIN", default_value = "127.0.0.1:9090", value_parser = parse_addr)]
    pub admin: SocketAddr,
    /// Broker id for registry entries and channel names: 1-128 of A-Z a-z 0-9 . _ : -.
    /// Default: hostname-port.
    #[arg(long, env = "FLEETLINK_BROKER_ID")]
    pub broker_id: Option<String>,
    /// Event-loop threads, one per core, each pinned. Default: every CPU this process may run
    /// on (its affinity mask: all online CPUs unless taskset or CPUAffinity= narrows it), at least 1. In fleet mode
    /// (--redis) the bridge thread is busy too: leaving it a CPU (cores = CPUs - 1) cut a
    /// fan-out's context switches 11x (median; 4.8-12.7x by round) on a 2-CPU host (docs/tuning.md).
    /// 1 to 1024.
    #[arg(long, env = "FLEETLINK_CORES", value_parser = parse_cores, allow_negative_numbers = true)]
    pub cores: Option<usize>,
    /// Redis URL (redis://host:port/db, or unix:///path). Without it the broker runs standalone.
    #[arg(long, env = "FLEETLINK_REDIS")]
    pub redis: Option<String>,
    /// Server certificate chain (PEM); with --tls-key enables TLS.
    #[arg(long, env = "FLEETLINK_TLS_CERT")]
    pub tls_cert: Option<PathBuf>,
    /// Server private key (PEM).
    #[arg(long, env = "FLEETLINK_TLS_KEY")]
    pub tls_key: Option<PathBuf>,
    /// CA bundle (PEM) for client certificates; makes them required (mTLS). Needs --tls-cert.
    #[arg(long, env = "FLEETLINK_CLIENT_CA")]
    pub client_ca: Option<PathBuf>,
    /// PEM CRL file(s) for --client-ca's certificates, reloaded when they change. Repeat the
    /// flag for several, or separate them with commas (FLEETLINK_CRL=a.pem,b.pem; in TOML,
    /// crl = ["a.pem", "b.pem"]).
    #[arg(long, env = "FLEETLINK_CRL", value_delimiter = ',')]
    pub crl: Vec<PathBuf>,
    /// Public key (PEM, Ed25519 or P-256) that signs rig bearer tokens, one per file; repeat
    /// the flag (or separate with commas) for several. With it, every upgrade needs
    /// `Authorization: Bearer <JWT>`; bad or expired tokens get 401.
    #[arg(long, env = "FLEETLINK_JWT_KEY", value_delimiter = ',')]
    pub jwt_key: Vec<PathBuf>,
    /// Required `aud` claim of rig tokens (needs --jwt-key): when set, a token must name it;
    /// when unset, a token that names any audience is refused.
    #[arg(long, env = "FLEETLINK_JWT_AUDIENCE")]
    pub jwt_audience: Option<String>,
    /// Interval between PINGs sent to each rig.
    #[arg(long, env = "FLEETLINK_PING_INTERVAL", default_value = "20s", value_parser = parse_broker_duration, allow_hyphen_values = true)]
    pub ping_interval: Duration,
    /// Time a rig has to answer a PING with a PONG; a PONG later than the next PING counts as
    /// missed, so a timeout past --ping-interval acts as --ping-interval.
    #[arg(long, env = "FLEETLINK_PONG_TIMEOUT", default_value = "10s", value_parser = parse_broker_duration, allow_hyphen_values = true)]
    pub pong_timeout: Duration,
    /// Missed PONGs in a row before the broker closes the socket with 4002 (1 to 255).
    // Wide and signed so that 0, -1 or 300 reach validate's own "1 to 255" rather than
    // clap's message about the type.
    #[arg(
        long,
        env = "FLEETLINK_MAX_MISSED_PONGS",
        default_value_t = 3,
        allow_negative_numbers = true
    )]
    pub max_missed_pongs: i64,
    /// Time from TCP accept to a complete request head, and from upgrade to a valid hello.
    #[arg(long, env = "FLEETLINK_HELLO_TIMEOUT", default_value = "10s", value_parser = parse_broker_duration, allow_hyphen_values = true)]
    pub hello_timeout: Duration,
    /// New connections per second for the whole broker (split evenly across cores); more
    /// than 0.
    #[arg(long, env = "FLEETLINK_ACCEPT_RATE", default_value_t = 50.0, value_parser = parse_rate, allow_negative_numbers = true)]
    pub accept_rate: f64,
    /// Accept bucket size for the whole broker (split evenly across cores, each core's at
    /// least 1, so never below --cores); at least 1.
    #[arg(long, env = "FLEETLINK_ACCEPT_BURST", default_value_t = 100, value_parser = parse_u32, allow_negative_numbers = true)]
    pub accept_burst: u32,
    /// Connection cap for the whole broker, all cores together; beyond it, 503 (0 refuses
    /// every rig). Default: none.
    #[arg(long, env = "FLEETLINK_MAX_CONNECTIONS", value_parser = parse_u64, allow_negative_numbers = true)]
    pub max_connections: Option<u64>,
    /// Per-rig bound on commands queued but not yet written, at least 1; beyond it, rig_unresponsive. A rig
    /// may have 8x this written and unacked; past that the next waits here for an ack, so a
    /// resume can give back every one. In fleet mode, commands still being kept in Redis when
    /// the rig falls behind join the queue past this bound, never past 9x it in the session as
    /// a whole (queued, being kept and unacked).
    #[arg(long, env = "FLEETLINK_OUTBOX", default_value_t = 128, value_parser = parse_u32, allow_negative_numbers = true)]
    pub outbox: u32,
    /// Bytes of admin answers (rig lists, event pages, metrics) each core may hold while their clients
    /// read them, past the first 64 KiB of each, at least 1 MiB; one past it is answered 503
    /// (a single answer always goes, however big).
    #[arg(long, env = "FLEETLINK_ADMIN_ANSWER_BYTES", default_value_t = 64 << 20, value_parser = parse_usize, allow_negative_numbers = true)]
    pub admin_answer_bytes: usize,
    /// Largest inbound message in bytes (125 B to 16 MiB); larger closes with 1009.
    #[arg(long, env = "FLEETLINK_MAX_MESSAGE", default_value_t = 65536, value_parser = parse_usize, allow_negative_numbers = true)]
    pub max_message: usize,
    /// Registry lease lifetime.
    #[arg(long, env = "FLEETLINK_REGISTRY_TTL", default_value = "60s", value_parser = parse_broker_duration, allow_hyphen_values = true)]
    pub registry_ttl: Duration,
    /// Registry lease refresh interval.
    #[arg(long, env = "FLEETLINK_REGISTRY_REFRESH", default_value = "10s", value_parser = parse_broker_duration, allow_hyphen_values = true)]
    pub registry_refresh: Duration,
    /// How long a session's unacked commands are kept for a rig that left. Standalone: in
    /// memory, at least --registry-ttl; past it they are reported expired. Fleet mode: how
    /// long Redis keeps them after its rig was last seen (while it stays connected its broker keeps the session alive; if that broker dies,
    /// at least two thirds of this are left for the resume elsewhere). 0 keeps
    /// nothing in Redis: commands are written at once (one Redis round trip less per command),
    /// but a rig that resumes on another broker starts a fresh session and whatever the old
    /// broker had not seen acked is gone with it. Otherwise at least 1s.
    #[arg(long, env = "FLEETLINK_SESSION_TTL", default_value = "10m", value_parser = parse_broker_duration, allow_hyphen_values = true)]
    pub session_ttl: Duration,
    /// Graceful shutdown window: goaway delays spread over it, 1001 at its end.
    #[arg(long, env = "FLEETLINK_DRAIN", default_value = "10s", value_parser = parse_broker_duration, allow_hyphen_values = true)]
    pub drain: Duration,
    /// Inbound messages per second per rig (a PING or PONG counts an eighth; the first ack of a
    /// written command and the result of an acked one nothing), more than 0; over it the broker
    /// stops reading that socket.
    #[arg(long, env = "FLEETLINK_RIG_RATE", default_value_t = 100.0, value_parser = parse_rate, allow_negative_numbers = true)]
    pub rig_rate: f64,
    /// Inbound message burst per rig, at least 1.
    #[arg(long, env = "FLEETLINK_RIG_BURST", default_value_t = 200, value_parser = parse_u32, allow_negative_numbers = true)]
    pub rig_burst: u32,
    /// Hello label whose value metrics aggregate rigs by.
    #[arg(long, env = "FLEETLINK_GROUP_LABEL", default_value = "group")]
    pub group_label: String,
    /// Listen backlog of each core's listener, at least 1; the kernel silently caps it at
    /// net.core.somaxconn (raise that to match).
    #[arg(long, env = "FLEETLINK_BACKLOG", default_value_t = 4096, value_parser = parse_i32,
          allow_negative_numbers = true)]
    pub backlog: i32,
    /// Close rigs that send unknown message types with 4400 instead of ignoring them.
    #[arg(long, env = "FLEETLINK_STRICT", value_parser = BoolishValueParser::new())]
    pub strict: bool,
    /// Test only: also serve /echo, a plain websocket echo with limits lifted (conformance).
    #[arg(long, env = "FLEETLINK_ECHO_ENDPOINT", value_parser = BoolishValueParser::new())]
    pub echo_endpoint: bool,
    /// Use the epoll driver even where io_uring works (diagnostics, comparisons).
    #[arg(long, env = "FLEETLINK_FORCE_EPOLL", value_parser = BoolishValueParser::new())]
    pub force_epoll: bool,
    /// Bind --listen beside a process already listening there (SO_REUSEPORT): a new broker
    /// started next to one about to drain, so its rigs reconnect to the same address. Without
    /// it a port in use is refused (exit 1), since two brokers on one port split its rigs.
    #[arg(long, env = "FLEETLINK_SHARE_PORT", value_parser = BoolishValueParser::new())]
    pub share_port: bool,
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::testing::load;
    use clap::CommandFactory;

    #[test]
    fn defaults_match_contract() {
        let c = load(&[]).unwrap();
        assert_eq!(c.listen.port(), 8080);
        assert_eq!(c.admin.port(), 9090);
        assert_eq!(c.ping_interval, Duration::from_secs(20));
        assert_eq!(c.pong_timeout, Duration::from_secs(10));
        assert_eq!(c.max_missed_pongs, 3);
        assert_eq!(c.outbox, 128);
        assert_eq!(c.max_message, 65536);
        assert!(load(&["--max-message", "16777216"]).is_ok());
        assert!(load(&["--max-message", "16777217"]).is_err());
        assert!(load(&["--max-message", "124"]).is_err());
        assert_eq!(c.registry_ttl, Duration::from_secs(60));
        assert!(c.broker_id.ends_with("-8080"));
    }

    /// docs/operations.md's option table names every broker flag with its variable, and no
    /// flag the broker does not have.
    #[test]
    fn the_operations_guide_lists_every_flag_with_its_variable() {
        let doc = include_str!("../../docs/operations.md");
        let rows: Vec<&str> = doc
            .lines()
            .skip_while(|l| !l.starts_with("| flag (TOML key without `--`)"))
            .take_while(|l| l.starts_with('|'))
            .collect();
        assert!(rows.len() > 2, "no option table in docs/operations.md");
        let cmd = Cli::command();
        let flags: Vec<&clap::Arg> = cmd
            .get_arguments()
            .filter(|a| a.get_long().is_some_and(|l| l != "help" && l != "version"))
            .collect();
        for arg in &flags {
            let long = arg.get_long().unwrap_or_default();
            let env = arg
                .get_env()
                .and_then(|e| e.to_str())
                .unwrap_or_else(|| panic!("--{long} has no environment variable"));
            let flag = format!("`--{long}`");
            let row = rows
                .iter()
                .find(|r| r.split('|').nth(1).is_some_and(|c| c.contains(&flag)))
                .unwrap_or_else(|| panic!("{flag} is not in docs/operations.md's table"));
            assert!(
                row.contains(&format!("`{env}`")),
                "{flag}: {env} not in {row}"
            );
            if let Some(default) = arg.get_default_values().first().and_then(|d| d.to_str()) {
                assert!(
                    row.contains(&format!("`{default}`")),
                    "{flag}: default {default} not in {row}"
                );
            }
        }
        for row in rows.iter().skip(2) {
            let first = row.split('|').nth(1).unwrap_or_default();
            for named in first.split('`').filter(|w| w.starts_with("--")) {
                let known = flags.iter().any(|a| a.get_long() == Some(&named[2..]));
                assert!(known, "{named} is in the table but not a flag");
            }
        }
    }

    #[test]
    fn help_lists_exit_codes_and_rust_log() {
        let help = Cli::command().render_long_help().to_string();
        for want in ["Exit codes", "64", "RUST_LOG", "SIGHUP", "250ms"] {
            assert!(help.contains(want), "{want}: {help}");
        }
    }
}
