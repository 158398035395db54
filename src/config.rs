//! Command line, `FLEETLINK_*` environment and optional TOML file, merged into one validated
//! [`Config`].
//!
//! Precedence: a flag on the command line beats its environment variable, which beats the
//! `--config` file, which beats the default. Every flag is documented with its default and unit
//! in `--help`; the defaults are CONTRACT.md §1's.

use std::ffi::OsString;
use std::net::SocketAddr;
use std::num::NonZeroUsize;
use std::path::PathBuf;
use std::time::Duration;

use clap::builder::BoolishValueParser;
use clap::parser::ValueSource;
use clap::{ArgAction, Args, CommandFactory, FromArgMatches, Parser, Subcommand};

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

Logging: RUST_LOG sets the level and filters (default info,rustls=error), e.g. RUST_LOG=debug or
RUST_LOG=info,fleetlink::worker=debug. Logs go to stderr.

Signals: SIGTERM/SIGINT (or POST /v1/drain) drain over --drain, then exit 0; a second
SIGTERM/SIGINT during a drain ends it at once. SIGHUP reloads the TLS files when TLS is on.

Exit codes: 0 drained and stopped (or --help/--version); 1 invalid configuration (a value
out of its range, from a flag, the environment or the file alike; flags that do not go
together) or a failure at start (a file that does not load, a port that does not bind); 2 a
flag or environment value that does not parse as its kind; 64 the --config file cannot be
read or parsed, or holds an unknown key or a value that does not parse as its kind. doctor: 0 the host can hold N connections, 1 it cannot
or the broker would not start with this configuration (and 2 or 64 as above: doctor reads
the broker's flags, environment and --config too).";

/// Tools bundled into the broker binary.
#[derive(Subcommand, Debug)]
pub enum Tool {
    /// Check this host's kernel and limits for N connections, and the broker's flags and
    /// files (config, TLS, tokens) as a start would; exit 1 if it cannot hold them or those
    /// would not start it. Ports are not tried: doctor runs beside a live broker. The broker's
    /// flags go before `doctor`: `fleetlink-fe --cores 8 doctor --connections N`.
    Doctor {
        /// Connections the host should hold (at least 1; above 100,000,000 checked as that).
        #[arg(long, default_value_t = 1_000_000, value_parser = clap::value_parser!(u64).range(1..))]
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
    #[arg(long, env = "FLEETLINK_CORES", value_parser = parse_cores)]
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
    #[arg(long, env = "FLEETLINK_PING_INTERVAL", default_value = "20s", value_parser = parse_broker_duration)]
    pub ping_interval: Duration,
    /// Time a rig has to answer a PING with a PONG; a PONG later than the next PING counts as
    /// missed, so a timeout past --ping-interval acts as --ping-interval.
    #[arg(long, env = "FLEETLINK_PONG_TIMEOUT", default_value = "10s", value_parser = parse_broker_duration)]
    pub pong_timeout: Duration,
    /// Missed PONGs in a row before the broker closes the socket with 4002 (1 to 255).
    #[arg(long, env = "FLEETLINK_MAX_MISSED_PONGS", default_value_t = 3)]
    pub max_missed_pongs: u32,
    /// Time from TCP accept to a complete request head, and from upgrade to a valid hello.
    #[arg(long, env = "FLEETLINK_HELLO_TIMEOUT", default_value = "10s", value_parser = parse_broker_duration)]
    pub hello_timeout: Duration,
    /// New connections per second for the whole broker (split evenly across cores); more
    /// than 0.
    #[arg(long, env = "FLEETLINK_ACCEPT_RATE", default_value_t = 50.0)]
    pub accept_rate: f64,
    /// Accept bucket size for the whole broker (split evenly across cores, each core's at
    /// least 1, so never below --cores); at least 1.
    #[arg(long, env = "FLEETLINK_ACCEPT_BURST", default_value_t = 100)]
    pub accept_burst: u32,
    /// Connection cap for the whole broker, all cores together; beyond it, 503 (0 refuses
    /// every rig). Default: none.
    #[arg(long, env = "FLEETLINK_MAX_CONNECTIONS")]
    pub max_connections: Option<u64>,
    /// Per-rig bound on commands queued but not yet written, at least 1; beyond it, rig_unresponsive. A rig
    /// may have 8x this written and unacked; past that the next waits here for an ack, so a
    /// resume can give back every one.
    #[arg(long, env = "FLEETLINK_OUTBOX", default_value_t = 128)]
    pub outbox: u32,
    /// Largest inbound message in bytes (125 B to 16 MiB); larger closes with 1009.
    #[arg(long, env = "FLEETLINK_MAX_MESSAGE", default_value_t = 65536)]
    pub max_message: usize,
    /// Registry lease lifetime.
    #[arg(long, env = "FLEETLINK_REGISTRY_TTL", default_value = "60s", value_parser = parse_broker_duration)]
    pub registry_ttl: Duration,
    /// Registry lease refresh interval.
    #[arg(long, env = "FLEETLINK_REGISTRY_REFRESH", default_value = "10s", value_parser = parse_broker_duration)]
    pub registry_refresh: Duration,
    /// Fleet mode: how long Redis keeps a session's unacked commands after its rig was last
    /// seen (while it stays connected its broker keeps the session alive; if that broker dies,
    /// at least two thirds of this are left for the resume elsewhere). 0 keeps
    /// nothing in Redis: commands are written at once (one Redis round trip less per command),
    /// but a rig that resumes on another broker starts a fresh session and whatever the old
    /// broker had not seen acked is gone with it.
    #[arg(long, env = "FLEETLINK_SESSION_TTL", default_value = "10m", value_parser = parse_broker_duration)]
    pub session_ttl: Duration,
    /// Graceful shutdown window: goaway delays spread over it, 1001 at its end.
    #[arg(long, env = "FLEETLINK_DRAIN", default_value = "10s", value_parser = parse_broker_duration)]
    pub drain: Duration,
    /// Inbound messages per second per rig (a PING or PONG counts an eighth), more than 0;
    /// over it the broker stops reading that socket.
    #[arg(long, env = "FLEETLINK_RIG_RATE", default_value_t = 100.0)]
    pub rig_rate: f64,
    /// Inbound message burst per rig, at least 1.
    #[arg(long, env = "FLEETLINK_RIG_BURST", default_value_t = 200)]
    pub rig_burst: u32,
    /// Hello label whose value metrics aggregate rigs by.
    #[arg(long, env = "FLEETLINK_GROUP_LABEL", default_value = "group")]
    pub group_label: String,
    /// Listen backlog of each core's listener, at least 1; the kernel silently caps it at
    /// net.core.somaxconn (raise that to match).
    #[arg(long, env = "FLEETLINK_BACKLOG", default_value_t = 4096,
          value_parser = clap::value_parser!(i32).range(0..))]
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

/// Validated configuration shared (read-only) by every thread.
#[derive(Debug, Clone)]
pub struct Config {
    /// Rig endpoint.
    pub listen: SocketAddr,
    /// Admin endpoint.
    pub admin: SocketAddr,
    /// Broker id.
    pub broker_id: String,
    /// `--broker-id` was given; else `broker_id` is [`default_broker_id`]'s.
    pub broker_id_given: bool,
    /// Event-loop threads.
    pub cores: usize,
    /// Redis URL; None = standalone.
    pub redis: Option<String>,
    /// TLS files, when enabled.
    pub tls: Option<TlsFiles>,
    /// Token verification keys (empty: no tokens).
    pub jwt_keys: Vec<PathBuf>,
    /// Required token audience.
    pub jwt_audience: Option<String>,
    /// PING period.
    pub ping_interval: Duration,
    /// PONG deadline.
    pub pong_timeout: Duration,
    /// Misses before 4002.
    pub max_missed_pongs: u8,
    /// Head and hello deadline.
    pub hello_timeout: Duration,
    /// Broker-wide accepts per second.
    pub accept_rate: f64,
    /// Broker-wide accept burst.
    pub accept_burst: u32,
    /// Broker-wide connection cap.
    pub max_connections: Option<u64>,
    /// Per-rig unwritten command bound.
    pub outbox: usize,
    /// Inbound message cap (bytes).
    pub max_message: usize,
    /// Registry lease TTL.
    pub registry_ttl: Duration,
    /// Registry refresh period.
    pub registry_refresh: Duration,
    /// Session retention in Redis.
    pub session_ttl: Duration,
    /// Drain window.
    pub drain: Duration,
    /// Per-rig inbound messages per second.
    pub rig_rate: f64,
    /// Per-rig inbound burst.
    pub rig_burst: u32,
    /// Metrics grouping label.
    pub group_label: String,
    /// Listen backlog per core.
    pub backlog: i32,
    /// Unknown types close with 4400.
    pub strict: bool,
    /// Serve /echo for conformance suites.
    pub echo_endpoint: bool,
    /// Skip io_uring.
    pub force_epoll: bool,
    /// Bind --listen even while another process listens there.
    pub share_port: bool,
}

/// TLS material paths.
#[derive(Debug, Clone)]
pub struct TlsFiles {
    /// Certificate chain.
    pub cert: PathBuf,
    /// Private key.
    pub key: PathBuf,
    /// Client CA bundle (mTLS) if any.
    pub client_ca: Option<PathBuf>,
    /// CRL files.
    pub crl: Vec<PathBuf>,
}

/// Largest `--max-message`: a rig's event is held whole on its way to Redis, and the bridge's
/// byte bound for events (64 MiB) must take several.
const MAX_MESSAGE_CAP: usize = 16 << 20;

/// Most `--cores`: far past any host's CPUs, and well inside the file descriptors and threads
/// a process may have (a few descriptors per core).
pub const MAX_CORES: usize = 1024;

/// Written-but-unacked commands kept per rig, as a multiple of `--outbox`: enough for a rig
/// that acks in batches, bounded for one that never acks.
const UNACKED_PER_OUTBOX: usize = 8;

impl Config {
    /// Most written-but-unacked commands a rig's session remembers for a resume.
    pub fn unacked_limit(&self) -> usize {
        self.outbox * UNACKED_PER_OUTBOX
    }

    /// Most commands one session holds, queued and unacked together: what a resume can carry.
    pub fn session_limit(&self) -> usize {
        self.outbox + self.unacked_limit()
    }
}

impl Cli {
    /// Parses argv + env, then fills flags still at their defaults from `--config`.
    pub fn load(argv: Vec<OsString>) -> anyhow::Result<Cli> {
        let matches = Cli::command().try_get_matches_from(&argv)?;
        let cli = Cli::from_arg_matches(&matches)?;
        let Some(path) = cli.broker.config.clone() else {
            return Ok(cli);
        };
        let text = std::fs::read_to_string(&path)
            .map_err(|e| anyhow::anyhow!("reading config {}: {e}", path.display()))?;
        let table: toml::Table = text
            .parse()
            .map_err(|e| anyhow::anyhow!("parsing config {}: {e}", path.display()))?;
        // File values go right after the program name, ahead of the command line: after a
        // subcommand they would be taken for its arguments. Their place never decides a value:
        // keys also given on the command line or in the environment are skipped below.
        let cmd = Cli::command();
        let mut from_file: Vec<OsString> = Vec::new();
        for (key, value) in table {
            let id = key.replace('-', "_");
            let Some(arg) = cmd.get_arguments().find(|a| {
                a.get_id() == id.as_str()
                    && !matches!(
                        a.get_action(),
                        ArgAction::Help
                            | ArgAction::HelpShort
                            | ArgAction::HelpLong
                            | ArgAction::Version
                    )
            }) else {
                anyhow::bail!("config {}: unknown key {key:?}", path.display());
            };
            let explicit = matches!(
                matches.value_source(&id),
                Some(ValueSource::CommandLine | ValueSource::EnvVariable)
            );
            // A file naming another file would be followed nowhere: better said than ignored.
            anyhow::ensure!(
                id != "config",
                "config {}: a config file cannot name another (key {key:?})",
                path.display()
            );
            if explicit {
                continue;
            }
            let flag = format!("--{}", arg.get_long().unwrap_or(id.as_str()));
            if !arg.get_action().takes_values() {
                // A switch (`--strict`) takes no value: present when true, absent when false.
                match value {
                    toml::Value::Boolean(true) => from_file.push(flag.into()),
                    toml::Value::Boolean(false) => {}
                    other => anyhow::bail!(
                        "config {}: {key} must be true or false, not {other}",
                        path.display()
                    ),
                }
                continue;
            }
            // A list only where the flag takes several, and true/false only for switches
            // (above): `broker-id = ["a"]` or `admin = true` is a mistake to name, not to guess.
            let several = matches!(arg.get_action(), ArgAction::Append);
            match &value {
                toml::Value::Array(_) if !several => anyhow::bail!(
                    "config {}: {key} takes one value, not a list",
                    path.display()
                ),
                toml::Value::Boolean(_) => anyhow::bail!(
                    "config {}: {key} takes a value, not true or false",
                    path.display()
                ),
                _ => {}
            }
            // `--key=value`, so a value that starts with '-' is not taken for a flag.
            for v in toml_values(&value) {
                from_file.push(format!("{flag}={v}").into());
            }
        }
        let mut merged = argv.into_iter();
        let argv: Vec<OsString> = merged
            .next()
            .into_iter()
            .chain(from_file)
            .chain(merged)
            .collect();
        // The command line and environment parsed alone above, so what fails now is a value
        // from the file: say so, once, as a config-file error rather than clap's usage text.
        Cli::try_parse_from(argv).map_err(|e| {
            let text = e.to_string();
            let first = text.lines().next().unwrap_or_default();
            anyhow::anyhow!(
                "config {}: {}",
                path.display(),
                first.trim_start_matches("error: ")
            )
        })
    }
}

fn toml_values(v: &toml::Value) -> Vec<String> {
    match v {
        toml::Value::String(s) => vec![s.clone()],
        toml::Value::Array(a) => a.iter().flat_map(toml_values).collect(),
        other => vec![other.to_string()],
    }
}

impl BrokerArgs {
    /// Checks cross-field rules and fills computed defaults.
    pub fn validate(self) -> anyhow::Result<Config> {
        // Each of these does nothing without the flag it refines; taking it silently would let
        // an operator believe rigs are checked when they are not.
        anyhow::ensure!(
            self.crl.is_empty() || self.client_ca.is_some(),
            "--crl needs --client-ca (a CRL revokes client certificates, which only mTLS asks for)"
        );
        anyhow::ensure!(
            self.client_ca.is_none() || (self.tls_cert.is_some() && self.tls_key.is_some()),
            "--client-ca and --crl need TLS: give --tls-cert and --tls-key too"
        );
        anyhow::ensure!(
            self.jwt_audience.is_none() || !self.jwt_key.is_empty(),
            "--jwt-audience needs --jwt-key (without a key no token is asked for)"
        );
        if let Some(url) = &self.redis {
            check_redis_url(url)?;
        }
        let tls = match (self.tls_cert, self.tls_key) {
            (Some(cert), Some(key)) => Some(TlsFiles {
                cert,
                key,
                client_ca: self.client_ca,
                crl: self.crl,
            }),
            (None, None) if self.client_ca.is_none() => None,
            _ => anyhow::bail!("--tls-cert and --tls-key go together (and --client-ca needs them)"),
        };
        let default_port = if tls.is_some() { 8443 } else { 8080 };
        let listen = self
            .listen
            .unwrap_or_else(|| SocketAddr::from(([0, 0, 0, 0], default_port)));
        let cpus = std::thread::available_parallelism().map_or(1, NonZeroUsize::get);
        let cores = self.cores.unwrap_or(cpus);
        anyhow::ensure!(
            cores >= 1,
            "--cores must be at least 1 (leave it out for every CPU)"
        );
        anyhow::ensure!(
            cores <= MAX_CORES,
            "--cores {cores} is more than {MAX_CORES}: each core is a pinned thread with its own \
             listener, ring and inbox, and no host has that many CPUs"
        );
        if cores > cpus {
            // Allowed (a test may want more loops than CPUs), but never what a host wants: the
            // loops then share CPUs, and the pinning puts several on each.
            log::warn!(
                "--cores {cores} is more than the {cpus} CPUs this process may use: \
                 event loops will share CPUs"
            );
        }
        let broker_id_given = self.broker_id.is_some();
        let broker_id = self
            .broker_id
            .unwrap_or_else(|| default_broker_id(listen.port()));
        // It goes into channel names, the registry's `boot|broker` values and the ready line's
        // key=value words.
        anyhow::ensure!(
            (1..=128).contains(&broker_id.len())
                && broker_id
                    .bytes()
                    .all(|b| b.is_ascii_alphanumeric() || b"._:-".contains(&b)),
            "--broker-id {broker_id:?}: 1-128 characters of A-Z a-z 0-9 . _ : - (the default \
             is the host name and the --listen port)"
        );
        // Infinity parses as an f64; as a rate it would mean no bucket at all, silently.
        anyhow::ensure!(
            self.accept_rate.is_finite() && self.accept_rate > 0.0,
            "--accept-rate must be a number > 0"
        );
        anyhow::ensure!(self.accept_burst > 0, "--accept-burst must be > 0");
        anyhow::ensure!(
            self.rig_rate.is_finite() && self.rig_rate > 0.0 && self.rig_burst > 0,
            "--rig-rate and --rig-burst must be numbers > 0"
        );
        anyhow::ensure!(self.outbox > 0, "--outbox must be > 0");
        anyhow::ensure!(
            (125..=MAX_MESSAGE_CAP).contains(&self.max_message),
            "--max-message must be 125 bytes to 16 MiB (a larger result belongs in a file transfer)"
        );
        let max_missed_pongs = u8::try_from(self.max_missed_pongs)
            .ok()
            .filter(|&n| n > 0)
            .ok_or_else(|| anyhow::anyhow!("--max-missed-pongs must be 1 to 255"))?;
        anyhow::ensure!(self.backlog >= 1, "--backlog must be at least 1");
        // A label a hello cannot carry would group every rig under "".
        let max = crate::protocol::MAX_LABEL_LEN;
        anyhow::ensure!(
            (1..=max).contains(&self.group_label.len()),
            "--group-label must be 1 to {max} bytes, as a hello label's key"
        );
        for (name, d) in [
            ("--ping-interval", self.ping_interval),
            ("--pong-timeout", self.pong_timeout),
            ("--hello-timeout", self.hello_timeout),
            ("--registry-refresh", self.registry_refresh),
        ] {
            anyhow::ensure!(
                d >= Duration::from_millis(10),
                "{name} must be at least 10ms"
            );
        }
        anyhow::ensure!(
            self.registry_ttl > self.registry_refresh,
            "--registry-ttl must exceed --registry-refresh"
        );
        Ok(Config {
            listen,
            admin: self.admin,
            broker_id,
            broker_id_given,
            cores,
            redis: self.redis,
            tls,
            jwt_keys: self.jwt_key,
            jwt_audience: self.jwt_audience,
            ping_interval: self.ping_interval,
            pong_timeout: self.pong_timeout,
            max_missed_pongs,
            hello_timeout: self.hello_timeout,
            accept_rate: self.accept_rate,
            accept_burst: self.accept_burst,
            max_connections: self.max_connections,
            outbox: self.outbox as usize,
            max_message: self.max_message,
            registry_ttl: self.registry_ttl,
            registry_refresh: self.registry_refresh,
            session_ttl: self.session_ttl,
            drain: self.drain,
            rig_rate: self.rig_rate,
            rig_burst: self.rig_burst,
            group_label: self.group_label,
            backlog: self.backlog,
            strict: self.strict,
            echo_endpoint: self.echo_endpoint,
            force_epoll: self.force_epoll,
            share_port: self.share_port,
        })
    }
}

/// Refuses a `--redis` value the Redis client would not take, in words: the client's own error
/// reads "Redis URL did not parse- InvalidClientConfig".
fn check_redis_url(url: &str) -> anyhow::Result<()> {
    use redis::IntoConnectionInfo;
    if url.into_connection_info().is_ok() {
        return Ok(());
    }
    let scheme = url.split_once("://").map(|(s, _)| s);
    let why = match scheme {
        Some("rediss") => "this build has no TLS to Redis (rediss://)".to_string(),
        Some("redis" | "unix" | "redis+unix") => "it does not parse".to_string(),
        Some(other) => format!("{other}:// is not a Redis scheme"),
        None => "no scheme".to_string(),
    };
    anyhow::bail!(
        "--redis {url:?}: not a usable Redis URL ({why}); expected redis://[USER:PASSWORD@]HOST[:PORT][/DB] or unix:///PATH"
    )
}

/// The broker id when `--broker-id` is not given: the host name and the rig port (the port
/// as bound, when `--listen` asked for port 0).
pub fn default_broker_id(port: u16) -> String {
    format!("{}-{port}", hostname())
}

fn hostname() -> String {
    let mut buf = [0u8; 256];
    // SAFETY: buf is valid for its length; gethostname NUL-terminates within it on success.
    let rc = unsafe { libc::gethostname(buf.as_mut_ptr().cast(), buf.len()) };
    let len = buf.iter().position(|&b| b == 0).unwrap_or(0);
    if rc != 0 || len == 0 {
        return "fleetlink".into();
    }
    String::from_utf8_lossy(&buf[..len]).into_owned()
}

/// An error and its causes on one line, each said once: many errors (ours, io's, redis')
/// already end with their cause's text, which `{:#}` would then print a second time.
pub fn error_line(e: &anyhow::Error) -> String {
    let mut line = String::new();
    for cause in e.chain() {
        let text = cause.to_string();
        if line.is_empty() {
            line = text;
        } else if !line.ends_with(&text) {
            line.push_str(": ");
            line.push_str(&text);
        }
    }
    line
}

/// The longest duration any flag takes: a deadline that far ahead always fits the clock.
pub const MAX_DURATION: Duration = Duration::from_secs(365 * 24 * 3600);

/// [`parse_duration`] for the broker's flags, whose values may also come from its `--config`
/// file, where a duration is a string.
fn parse_cores(s: &str) -> Result<usize, String> {
    // Its range (1 to 1024) is checked with the other values', wherever the value came from.
    s.trim()
        .parse()
        .map_err(|_| format!("{s:?} is not a number of cores (1 to {MAX_CORES})"))
}

fn parse_broker_duration(s: &str) -> Result<Duration, String> {
    parse_duration(s).map_err(|e| {
        // A bare number is what a TOML file's `ping-interval = 20` hands over.
        if s.trim().bytes().all(|b| b.is_ascii_digit() || b == b'.') {
            format!("{e} (in a --config file, a string: \"20s\")")
        } else {
            e
        }
    })
}

/// `dev-certs --rigs`: at most 100,000.
fn parse_rig_count(s: &str) -> Result<usize, String> {
    match s.parse::<usize>() {
        Ok(n) if n <= 100_000 => Ok(n),
        _ => Err(format!(
            "{s:?}: a number of rig certificates from 0 to 100000"
        )),
    }
}

/// An address to bind: `ADDRESS:PORT`, `HOST:PORT` (the first address it resolves to) or
/// `:PORT` (every IPv4 address, as the defaults are written).
pub fn parse_addr(s: &str) -> Result<SocketAddr, String> {
    use std::net::ToSocketAddrs;
    if let Some(port) = s.strip_prefix(':') {
        let port: u16 = port.parse().map_err(|_| format!("{s:?}: not a port"))?;
        return Ok(SocketAddr::from(([0, 0, 0, 0], port)));
    }
    if let Ok(addr) = s.parse() {
        return Ok(addr);
    }
    s.to_socket_addrs()
        .map_err(|e| format!("{s:?}: {e} (expected ADDRESS:PORT, HOST:PORT or :PORT)"))?
        .next()
        .ok_or_else(|| format!("{s:?}: the name resolves to no address"))
}

/// Parses `250ms`, `20s`, `5m`, `1h`, at most [`MAX_DURATION`]. A number without a unit is
/// refused (`--drain 120000` meant as ms would be 33 hours), except `0`, which is the same in
/// every unit.
pub fn parse_duration(s: &str) -> Result<Duration, String> {
    let s = s.trim();
    if s.chars().all(|c| c.is_ascii_digit() || c == '.') && !s.is_empty() {
        if s.parse::<f64>() == Ok(0.0) {
            return Ok(Duration::ZERO);
        }
        return Err(format!(
            "{s:?} has no unit: write it as 250ms, 20s, 5m or 1h"
        ));
    }
    let split = s
        .find(|c: char| !c.is_ascii_digit() && c != '.')
        .unwrap_or(s.len());
    let (num, unit) = s.split_at(split);
    let n: f64 = num
        .parse()
        .map_err(|_| format!("bad duration {s:?} (use e.g. 250ms, 20s, 5m)"))?;
    let secs = match unit {
        "ms" => n / 1000.0,
        "s" => n,
        "m" => n * 60.0,
        "h" => n * 3600.0,
        _ => return Err(format!("bad duration unit in {s:?} (ms, s, m, h)")),
    };
    // Only digits and dots got here, so `secs` is never negative, but it can be beyond what a
    // Duration holds, or infinite (hundreds of digits): an error, not `from_secs_f64`'s panic.
    Duration::try_from_secs_f64(secs)
        .ok()
        .filter(|d| *d <= MAX_DURATION)
        .ok_or_else(|| format!("duration {s:?} is too long: at most 365 days"))
}

/// The defaults on one core, for unit tests that build a core or a bridge.
#[cfg(test)]
pub(crate) fn test_config() -> &'static Config {
    let argv = ["fleetlink-fe", "--cores", "1"]
        .map(OsString::from)
        .to_vec();
    let cfg = Cli::load(argv)
        .and_then(|c| c.broker.validate())
        .expect("default config");
    Box::leak(Box::new(cfg))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn load(args: &[&str]) -> anyhow::Result<Config> {
        let argv = std::iter::once("fleetlink-fe")
            .chain(args.iter().copied())
            .map(OsString::from);
        Cli::load(argv.collect())?.broker.validate()
    }

    /// The contract writes the TLS default as `:8443`; an operator writes host names.
    #[test]
    fn addresses_take_a_bare_port_and_host_names() {
        let c = load(&["--listen", ":8443", "--admin", "localhost:9191"]).unwrap();
        assert_eq!(c.listen, "0.0.0.0:8443".parse().unwrap());
        assert!(
            c.admin.ip().is_loopback() && c.admin.port() == 9191,
            "{}",
            c.admin
        );
        assert_eq!(
            load(&["--listen", "[::1]:80"]).unwrap().listen,
            "[::1]:80".parse().unwrap()
        );
        for bad in [":", ":99999", "8080", "no-such-host.invalid:80"] {
            assert!(load(&["--listen", bad]).is_err(), "{bad}");
        }
    }

    /// A broker id goes into channel names, registry values and the ready line's words.
    #[test]
    fn broker_ids_are_checked() {
        for ok in ["fe-a", "fe_03", "rack4.host-1:8443", &"x".repeat(128)] {
            assert_eq!(load(&["--broker-id", ok]).unwrap().broker_id, ok);
        }
        for bad in ["", "has space", "bad/id", "a|b", &"x".repeat(129)] {
            let err = load(&["--broker-id", bad]).unwrap_err().to_string();
            assert!(err.contains("--broker-id"), "{bad}: {err}");
        }
    }

    #[test]
    fn durations() {
        assert_eq!(parse_duration("250ms"), Ok(Duration::from_millis(250)));
        assert_eq!(parse_duration("20s"), Ok(Duration::from_secs(20)));
        assert_eq!(parse_duration("5m"), Ok(Duration::from_secs(300)));
        assert_eq!(parse_duration("1.5s"), Ok(Duration::from_millis(1500)));
        assert!(parse_duration("5x").is_err());
        assert!(parse_duration("").is_err());
    }

    #[test]
    fn a_duration_without_a_unit_is_refused_except_zero() {
        for bare in ["3", "120000", "0.5", "5."] {
            let e = parse_duration(bare).unwrap_err();
            assert!(
                e.contains("no unit") && e.contains("250ms, 20s, 5m"),
                "{bare}: {e}"
            );
        }
        assert_eq!(parse_duration("0"), Ok(Duration::ZERO));
        assert_eq!(parse_duration("0.0"), Ok(Duration::ZERO));
        // Flags, environment and config file alike.
        let e = load(&["--ping-interval", "5"]).unwrap_err().to_string();
        assert!(e.contains("no unit"), "{e}");
        let file = config_file("bare-duration.toml", "drain = 120000\n");
        let e = load(&["--config", file.to_str().unwrap()]).unwrap_err();
        assert!(
            e.downcast_ref::<clap::Error>().is_none(),
            "a config-file error"
        );
        let e = e.to_string();
        assert!(
            e.starts_with("config ") && e.contains("--drain") && e.contains("no unit"),
            "{e}"
        );
        assert!(!e.contains("Usage"), "one line: {e}");
        let file = config_file("unit-duration.toml", "drain = \"2m\"\n");
        let c = load(&["--config", file.to_str().unwrap()]).unwrap();
        assert_eq!(c.drain, Duration::from_secs(120));
    }

    #[test]
    fn a_connection_cap_is_for_the_broker_whatever_its_cores() {
        for ok in ["0", "1", "2", "4", "1000"] {
            let cfg = load(&["--cores", "4", "--max-connections", ok]).unwrap();
            assert_eq!(cfg.max_connections, ok.parse().ok());
        }
    }

    #[test]
    fn huge_durations_are_errors_not_panics() {
        for huge in [
            "99999999999999999999s",
            "99999999999999999999999ms",
            "9999999999999999999m",
            "99999999999999999999h",
            format!("{}s", "1".repeat(400)).as_str(),
        ] {
            let e = parse_duration(huge).unwrap_err();
            assert!(e.contains("too long"), "{huge}: {e}");
        }
        // Up to a year parses; a second more does not.
        assert_eq!(parse_duration("8760h"), Ok(MAX_DURATION));
        assert!(parse_duration("31536001s").is_err());
        let e = load(&["--drain", "99999999999999999999s"]).unwrap_err();
        let e = e.downcast::<clap::Error>().expect("a clap error");
        assert_eq!(e.kind(), clap::error::ErrorKind::ValueValidation);
        assert!(e.to_string().contains("too long"), "{e}");
    }

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

    #[test]
    fn config_file_fills_defaults_but_flags_win() {
        let dir = std::env::temp_dir().join(format!("fl-cfg-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join("c.toml");
        std::fs::write(
            &path,
            "ping-interval = \"5s\"\noutbox = 7\nbroker_id = \"fe-x\"\n",
        )
        .unwrap();
        let c = load(&["--config", path.to_str().unwrap(), "--outbox", "9"]).unwrap();
        assert_eq!(c.ping_interval, Duration::from_secs(5));
        assert_eq!(c.outbox, 9);
        assert_eq!(c.broker_id, "fe-x");
        std::fs::write(&path, "no-such-key = 1\n").unwrap();
        assert!(load(&["--config", path.to_str().unwrap()]).is_err());
    }

    /// A config file of its own for one test (tests run in parallel in one process).
    fn config_file(name: &str, text: &str) -> PathBuf {
        let dir = std::env::temp_dir().join(format!("fl-cfg-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join(name);
        std::fs::write(&path, text).unwrap();
        path
    }

    /// A list where one value goes, or true/false where a value goes, is refused; a list is
    /// taken where the flag takes several.
    #[test]
    fn config_file_values_have_the_flags_shape() {
        for (name, text, words) in [
            (
                "list.toml",
                "broker-id = [\"a\"]\n",
                "one value, not a list",
            ),
            ("bool.toml", "admin = true\n", "not true or false"),
        ] {
            let path = config_file(name, text);
            let err = load(&["--config", path.to_str().unwrap()]).unwrap_err();
            assert!(err.to_string().contains(words), "{text}: {err}");
        }
        let path = config_file(
            "crls.toml",
            "tls-cert = \"c\"\ntls-key = \"k\"\nclient-ca = \"ca\"\ncrl = [\"a\", \"b\"]\n",
        );
        assert_eq!(
            load(&["--config", path.to_str().unwrap()])
                .unwrap()
                .tls
                .unwrap()
                .crl
                .len(),
            2
        );
    }

    /// A file's `config` key, like an unknown one, is refused rather than ignored.
    #[test]
    fn a_config_file_naming_another_is_refused() {
        let path = config_file("nested.toml", "config = \"other.toml\"\n");
        let err = load(&["--config", path.to_str().unwrap()]).unwrap_err();
        assert!(err.to_string().contains("cannot name another"), "{err}");
        let path = config_file("unknown.toml", "no-such-key = 1\n");
        let err = load(&["--config", path.to_str().unwrap()]).unwrap_err();
        assert!(err.to_string().contains("unknown key"), "{err}");
    }

    #[test]
    fn config_file_sets_switches() {
        let on = config_file(
            "switches-on.toml",
            "strict = true\necho-endpoint = true\nforce_epoll = true\n",
        );
        let on = on.to_str().unwrap();
        let c = load(&["--config", on]).unwrap();
        assert!(c.strict && c.echo_endpoint && c.force_epoll);
        // A switch on the command line and the same switch in the file: still on.
        let c = load(&["--config", on, "--strict"]).unwrap();
        assert!(c.strict && c.echo_endpoint);

        let off = config_file(
            "switches-off.toml",
            "strict = false\necho_endpoint = false\nforce-epoll = false\noutbox = 5\n",
        );
        let off = off.to_str().unwrap();
        let c = load(&["--config", off]).unwrap();
        assert!(!c.strict && !c.echo_endpoint && !c.force_epoll);
        assert_eq!(c.outbox, 5);
        // The command line beats the file: `--strict` wins over `strict = false`.
        let c = load(&["--config", off, "--strict"]).unwrap();
        assert!(c.strict && !c.echo_endpoint);

        let bad = config_file("switches-bad.toml", "strict = \"yes\"\n");
        let e = load(&["--config", bad.to_str().unwrap()]).unwrap_err();
        assert!(e.to_string().contains("true or false"), "{e}");
    }

    #[test]
    fn config_file_values_go_before_a_subcommand_and_may_start_with_a_dash() {
        let path = config_file(
            "dash.toml",
            "strict = true\ngroup-label = \"-g\"\ncrl = [\"a.pem\", \"b.pem\"]\n\
             client-ca = \"ca\"\ntls-cert = \"c\"\ntls-key = \"k\"\n",
        );
        let path = path.to_str().unwrap();
        let c = load(&["--config", path]).unwrap();
        assert_eq!(c.group_label, "-g");
        let cli = Cli::load(
            [
                "fleetlink-fe",
                "--config",
                path,
                "doctor",
                "--connections",
                "5",
            ]
            .map(OsString::from)
            .to_vec(),
        )
        .unwrap();
        assert!(cli.broker.strict);
        assert!(matches!(
            cli.tool,
            Some(Tool::Doctor {
                connections: 5,
                tls: false
            })
        ));
        let c = load(&["--config", path]).unwrap();
        let crl = c.tls.unwrap().crl;
        assert_eq!(crl, [PathBuf::from("a.pem"), PathBuf::from("b.pem")]);
    }

    #[test]
    fn refining_flags_need_what_they_refine() {
        let err = |args: &[&str]| load(args).unwrap_err().to_string();
        let tls = ["--tls-cert", "c.pem", "--tls-key", "k.pem"];
        // --crl without --client-ca, with TLS or without (it used to be ignored there).
        assert!(err(&["--crl", "r.pem"]).contains("--crl needs --client-ca"));
        assert!(err(&[&tls[..], &["--crl", "r.pem"]].concat()).contains("--crl needs --client-ca"));
        // --client-ca (alone or with --crl) without TLS.
        for args in [
            &["--client-ca", "ca.pem"][..],
            &["--client-ca", "ca.pem", "--crl", "r.pem"],
            &["--client-ca", "ca.pem", "--tls-cert", "c.pem"],
        ] {
            assert!(err(args).contains("need TLS"), "{args:?}");
        }
        let c = load(&[&tls[..], &["--client-ca", "ca.pem", "--crl", "r.pem"]].concat()).unwrap();
        assert_eq!(c.tls.map(|t| t.crl.len()), Some(1));
        assert!(err(&["--jwt-audience", "fleet"]).contains("--jwt-audience needs --jwt-key"));
        let c = load(&["--jwt-audience", "fleet", "--jwt-key", "k.pem"]).unwrap();
        assert_eq!(c.jwt_audience.as_deref(), Some("fleet"));
    }

    #[test]
    fn cores_backlog_and_redis_url_are_checked_up_front() {
        let err = |args: &[&str]| load(args).unwrap_err().to_string();
        assert!(err(&["--cores", "99999"]).contains("more than 1024"));
        assert_eq!(load(&["--cores", "1024"]).map(|c| c.cores).ok(), Some(1024));
        assert!(load(&["--backlog", "0"]).is_err());
        assert!(load(&["--backlog", "-1"]).is_err());
        assert!(load(&["--group-label", ""]).is_err());
        assert!(load(&["--group-label", &"g".repeat(129)]).is_err());
        assert!(load(&["--group-label", &"g".repeat(128)]).is_ok());
        assert_eq!(load(&["--backlog", "1"]).map(|c| c.backlog).ok(), Some(1));
        let e = err(&["--redis", "http://x"]);
        assert!(e.contains("http:// is not a Redis scheme"), "{e}");
        assert!(!e.contains("InvalidClientConfig"), "{e}");
        assert!(err(&["--redis", "localhost:6379"]).contains("not a usable Redis URL"));
        assert!(load(&["--redis", "redis://127.0.0.1:6379/0"]).is_ok());
    }

    /// `Cli::load` of a `--config` file holding `key = value` alone (the file named `name`).
    fn load_one_key(name: &str, key: &str, value: &str) -> anyhow::Result<Cli> {
        let path = config_file(name, &format!("{key} = {value}\n"));
        let loaded = Cli::load(vec![
            "fleetlink-fe".into(),
            "--config".into(),
            path.clone().into(),
        ]);
        let _ = std::fs::remove_file(path);
        loaded
    }

    /// Exit codes (docs/operations.md): a value that does not parse as its kind fails the load
    /// (2 from a flag or variable, 64 from the file); a well-formed value out of its range
    /// loads and is refused by `validate` (1), the same wherever it came from.
    #[test]
    fn a_value_out_of_range_is_refused_at_validation_wherever_it_came_from() {
        let out_of_range = [
            ("cores", "0", "0", "--cores must be at least 1"),
            ("cores", "2000", "2000", "more than 1024"),
            ("backlog", "0", "0", "--backlog must be at least 1"),
            ("outbox", "0", "0", "--outbox must be > 0"),
            (
                "max-missed-pongs",
                "0",
                "0",
                "--max-missed-pongs must be 1 to 255",
            ),
            (
                "max-missed-pongs",
                "256",
                "256",
                "--max-missed-pongs must be 1 to 255",
            ),
            ("max-message", "10", "10", "--max-message must be"),
            (
                "accept-rate",
                "inf",
                "inf",
                "--accept-rate must be a number > 0",
            ),
            (
                "accept-rate",
                "0",
                "0.0",
                "--accept-rate must be a number > 0",
            ),
            (
                "rig-rate",
                "NaN",
                "nan",
                "--rig-rate and --rig-burst must be numbers > 0",
            ),
            ("accept-burst", "0", "0", "--accept-burst must be > 0"),
        ];
        for (key, flag_value, toml_value, want) in out_of_range {
            let flag = format!("--{key}={flag_value}");
            let cli = Cli::load(vec!["fleetlink-fe".into(), flag.clone().into()])
                .unwrap_or_else(|e| panic!("{flag} should parse: {e}"));
            let e = cli.broker.validate().unwrap_err().to_string();
            assert!(e.contains(want), "{flag}: {e}");
            let cli = load_one_key(&format!("range-{key}-{flag_value}"), key, toml_value)
                .unwrap_or_else(|e| panic!("{key} = {toml_value}: {e}"));
            let e = cli.broker.validate().unwrap_err().to_string();
            assert!(e.contains(want), "{key} = {toml_value}: {e}");
        }
        let malformed = [
            ("cores", "two", "\"two\""),
            ("outbox", "-1", "-1"),
            ("backlog", "-1", "-1"),
            ("max-missed-pongs", "x", "\"x\""),
            ("ping-interval", "20", "20"),
        ];
        for (key, flag_value, toml_value) in malformed {
            let flag = format!("--{key}={flag_value}");
            assert!(
                Cli::load(vec!["fleetlink-fe".into(), flag.clone().into()]).is_err(),
                "{flag}"
            );
            let e = load_one_key(&format!("malformed-{key}"), key, toml_value)
                .map(|_| ())
                .unwrap_err()
                .to_string();
            assert!(e.starts_with("config "), "{key} = {toml_value}: {e}");
        }
        // The file hint is for a bare number, which is what a TOML number hands over.
        let e = Cli::load(vec!["fleetlink-fe".into(), "--ping-interval=20x".into()])
            .map(|_| ())
            .unwrap_err()
            .to_string();
        assert!(!e.contains("--config"), "{e}");
    }

    /// docs/operations.md's option table names every broker flag with its variable, and no
    /// flag the broker does not have.
    #[test]
    fn the_operations_guide_lists_every_flag_with_its_variable() {
        let doc = include_str!("../docs/operations.md");
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
    fn an_error_chain_says_each_cause_once() {
        let io = std::io::Error::from_raw_os_error(2);
        let text = format!("reading /nonexistent: {io}");
        let e = anyhow::Error::new(io).context(text.clone());
        assert_eq!(error_line(&e), text);
        let e = anyhow::anyhow!("inner").context("outer");
        assert_eq!(error_line(&e), "outer: inner");
    }

    #[test]
    fn help_lists_exit_codes_and_rust_log() {
        let help = Cli::command().render_long_help().to_string();
        for want in ["Exit codes", "64", "RUST_LOG", "SIGHUP", "250ms"] {
            assert!(help.contains(want), "{want}: {help}");
        }
    }

    #[test]
    fn tls_flags_go_together() {
        assert!(load(&["--tls-cert", "a.pem"]).is_err());
        let c = load(&["--tls-cert", "a.pem", "--tls-key", "k.pem"]).unwrap();
        assert_eq!(c.listen.port(), 8443);
    }
}
