//! Command-line interface and the small value parsers it needs (durations, source ranges,
//! labels, ws/wss URLs). Parsers are plain functions so they are unit-testable without clap.

use std::collections::BTreeMap;
use std::net::Ipv4Addr;
use std::path::PathBuf;
use std::time::Duration;

use anyhow::{bail, Context, Result};
use clap::{Args, Parser, Subcommand};

/// Sockets one child process may hold: the platform caps open files at 20,000 per process and a
/// child also needs a few descriptors for itself.
pub const MAX_SOCKETS_PER_PROC: usize = 18_000;

/// Most child processes one run starts: 512 of 18,000 sockets is 9.2M rigs, past what one
/// host's port ranges and memory hold. A typo of a few digits more would otherwise start
/// processes for minutes until --max-time.
pub const MAX_PROCS: usize = 512;

/// Most rigs one run opens: [`MAX_PROCS`] full processes.
pub const MAX_RIGS: u64 = (MAX_PROCS * MAX_SOCKETS_PER_PROC) as u64;

#[derive(Debug, Parser)]
#[command(
    name = "fleetlink-loadgen",
    version,
    about = "Load generator for the fleetlink broker",
    after_help = "Exit codes: 0 done; 1 a setup error; 2 not all done (rigs: a rig never \
                  welcomed or a worker process lost; admin-fanout: a command refused or failed; \
                  redis-publish: a PUBLISH failed or reached no subscriber); 64 a flag that does \
                  not parse (bench/README.md has each subcommand's output)."
)]
pub struct Cli {
    #[command(subcommand)]
    pub cmd: Command,
}

#[derive(Debug, Subcommand)]
pub enum Command {
    /// Open N rigs (hello/welcome, ack every command) and hold them.
    Rigs(RigsArgs),
    /// POST one command to each rig through the admin API, stamped with `sent_at_us`.
    AdminFanout(FanoutArgs),
    /// PUBLISH commands on a broker's Redis channel (fleet mode), stamped with `sent_at_us`.
    RedisPublish(RedisPublishArgs),
}

#[derive(Debug, Clone, Args)]
pub struct RigsArgs {
    /// Rig endpoint, e.g. ws://127.0.0.1:8080/agent, or wss://127.0.0.1:8443/agent with --ca.
    #[arg(long)]
    pub url: String,
    /// wss: PEM CA bundle the broker's certificate must chain to.
    #[arg(long)]
    pub ca: Option<PathBuf>,
    /// wss: client certificate (PEM) presented by every rig (needs --tls-key). Against a broker
    /// with --client-ca its identity must be the rig id: use --rigs 1 and --id-width/--start-index
    /// to match it (dev-certs' rig-0001 is `--prefix rig --id-width 4 --start-index 1`).
    #[arg(long, requires = "tls_key")]
    pub tls_cert: Option<PathBuf>,
    /// wss: the client certificate's private key (PEM).
    #[arg(long, requires = "tls_cert")]
    pub tls_key: Option<PathBuf>,
    /// wss: SNI and the name the broker's certificate is verified against (the URL's host is
    /// only where to connect).
    #[arg(long, default_value = "localhost")]
    pub server_name: String,
    /// Number of rigs to open (1 to 9,216,000: 512 processes of 18,000).
    #[arg(long, value_parser = clap::builder::RangedU64ValueParser::<usize>::new().range(1..=MAX_RIGS))]
    pub rigs: usize,
    /// Child processes to split the rigs over, 1 to 512 (default: enough for 18,000 sockets
    /// each).
    #[arg(long, value_parser = parse_procs)]
    pub procs: Option<usize>,
    /// Source addresses, round-robin per rig: `127.0.0.1-127.0.0.16`, `a,b,c` or one address.
    /// Default: 127.0.0.1-127.0.0.16 for a loopback target, otherwise the kernel's choice.
    #[arg(long)]
    pub sources: Option<String>,
    /// Rig ids are `<prefix>-<index>`, the index zero-padded to --id-width digits.
    #[arg(long, default_value = "rig")]
    pub prefix: String,
    /// First rig index (lets several runs add disjoint rigs to one broker).
    #[arg(long, default_value_t = 0)]
    pub start_index: usize,
    /// Digits of the zero-padded index in rig ids.
    #[arg(long, default_value_t = 6)]
    pub id_width: usize,
    /// Labels sent in every hello: `k=v,k2=v2`.
    #[arg(long, default_value = "")]
    pub labels: String,
    /// Handshakes (connect to welcome) in flight per process, at least 1.
    #[arg(long, default_value_t = 256, value_parser = parse_positive)]
    pub concurrency: usize,
    /// Paces the ramp: rigs started per second over the whole run, each process starting its
    /// share evenly from its own start (still at most `--concurrency` handshakes in flight).
    /// 0 = as fast as `--concurrency` allows.
    #[arg(long, default_value_t = 0.0, value_parser = parse_rate)]
    pub ramp_rate: f64,
    /// How long to keep the rigs connected once the ramp is over.
    #[arg(long, default_value = "60s", value_parser = parse_duration)]
    pub hold: Duration,
    /// Hard bound on the whole run, ramp included.
    #[arg(long, default_value = "300s", value_parser = parse_duration)]
    pub max_time: Duration,
    /// Per attempt: TCP connect + upgrade + hello/welcome must finish within this.
    #[arg(long, default_value = "30s", value_parser = parse_duration)]
    pub handshake_timeout: Duration,
    /// Write the JSON report here (`-` = stdout, after the ALL_WELCOMED line).
    #[arg(long)]
    pub report: Option<String>,
    /// End the hold early once this many commands have been received (over all rigs), so a
    /// latency run stops as soon as its last command has arrived.
    #[arg(long)]
    pub until_commands: Option<u64>,
    /// Reconnect whenever a welcomed connection ends, as the agent does: after a `goaway` at
    /// the instant it asked for (closing with 1000 then), after a close or a drop after a
    /// jittered backoff (`--reconnect-backoff`); always with the same boot_id and `last_seq`, so
    /// the broker resumes the session. Any failed reconnect attempt is retried (counted by
    /// reason). Without it a rig is done when its connection ends.
    #[arg(long)]
    pub reconnect: bool,
    /// --reconnect: the wait after a lost connection is uniform(0.5, 1.5) × this × 2^failures
    /// (consecutive failed attempts), the base capped at 30 s (so at most 45 s a wait).
    #[arg(long, default_value = "1s", value_parser = parse_duration)]
    pub reconnect_backoff: Duration,
    /// Write `rig=R seq=N id=ID name=NAME` per command run, like the agent's --exec-log: a
    /// command runs on the first receipt of its seq in the rig's session; replays (seq already
    /// seen) are acked again and counted as duplicates, not run. One file per worker process:
    /// `PATH.<first rig index of the worker>`.
    #[arg(long)]
    pub exec_log: Option<PathBuf>,
    /// Never ack a command: rigs that receive but leave every command unacked, so the
    /// broker keeps them (for resume and Redis-restart scenarios, `bench/redis-restart.sh`).
    #[arg(long)]
    pub no_ack: bool,
    /// Bucket width of `reconnect_timeline` (re-welcomes by unix time, e.g. across a drain).
    #[arg(long, default_value = "100ms", value_parser = parse_duration)]
    pub timeline_bucket: Duration,
    /// Internal: run as a child over rigs [START, START+COUNT) and talk JSON lines on stdio.
    #[arg(long, hide = true, value_parser = parse_slice)]
    pub child_slice: Option<(usize, usize)>,
}

#[derive(Debug, Clone, Args)]
pub struct FanoutArgs {
    /// Admin base URL, e.g. http://127.0.0.1:9090
    #[arg(long, default_value = "http://127.0.0.1:9090")]
    pub admin: String,
    /// Rig ids are `<prefix>-<index>`, as `rigs` opens them.
    #[arg(long, default_value = "rig")]
    pub prefix: String,
    /// Rigs to send to, one command each per round (at least 1).
    #[arg(long, value_parser = parse_positive)]
    pub rigs: usize,
    /// First rig index.
    #[arg(long, default_value_t = 0)]
    pub start_index: usize,
    /// Digits of the zero-padded index in rig ids, as `rigs --id-width`.
    #[arg(long, default_value_t = 6)]
    pub id_width: usize,
    /// Command name to send.
    #[arg(long, default_value = "bench")]
    pub name: String,
    /// Keep-alive HTTP connections used in parallel, at least 1.
    #[arg(long, default_value_t = 8, value_parser = parse_positive)]
    pub concurrency: usize,
    /// Rounds: the whole fan-out is repeated this many times (`--rigs 1 --count 500` = 500
    /// single commands to one rig, one at a time).
    #[arg(long, default_value_t = 1)]
    pub count: usize,
    /// Pause after each round.
    #[arg(long, default_value = "0s", value_parser = parse_duration)]
    pub interval: Duration,
    /// Bound on the whole fan-out.
    #[arg(long, default_value = "120s", value_parser = parse_duration)]
    pub max_time: Duration,
    /// Also write the JSON summary here (it is always printed on stdout).
    #[arg(long)]
    pub report: Option<String>,
}

/// A count of at least 1.
fn parse_positive(s: &str) -> Result<usize, String> {
    match s.trim().parse::<usize>() {
        Ok(n) if n >= 1 => Ok(n),
        _ => Err(format!("{s:?}: a whole number, at least 1")),
    }
}

/// A ramp rate: rigs a second, 0 (unpaced) or more, finite.
fn parse_rate(s: &str) -> Result<f64, String> {
    match s.trim().parse::<f64>() {
        Ok(r) if r.is_finite() && r >= 0.0 => Ok(r),
        _ => Err(format!("{s:?}: rigs a second, 0 or more")),
    }
}

/// A count of child processes: at least 1, at most [`MAX_PROCS`].
fn parse_procs(s: &str) -> Result<usize, String> {
    match s.trim().parse::<usize>() {
        Ok(n) if (1..=MAX_PROCS).contains(&n) => Ok(n),
        _ => Err(format!(
            "{s:?}: a whole number, at least 1 and at most {MAX_PROCS}"
        )),
    }
}

/// What `redis-publish` sends.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum PublishMode {
    /// One command per rig, all in one Redis pipeline per round.
    Fanout,
    /// `--count` commands to the first rig, one PUBLISH at a time, `--interval` apart.
    Single,
}

#[derive(Debug, Clone, Args)]
pub struct RedisPublishArgs {
    /// Redis URL, e.g. redis://127.0.0.1:16379/
    #[arg(long)]
    pub redis: String,
    /// The broker whose channel `fleetlink:broker:<id>` gets the commands.
    #[arg(long)]
    pub broker_id: String,
    /// Rig ids are `<prefix>-<index>`, as `rigs` opens them.
    #[arg(long, default_value = "rig")]
    pub prefix: String,
    /// Rigs addressed in fan-out mode (single mode uses the first one); at least 1.
    #[arg(long, default_value_t = 1, value_parser = parse_positive)]
    pub rigs: usize,
    /// First rig index.
    #[arg(long, default_value_t = 0)]
    pub start_index: usize,
    /// Digits of the zero-padded index in rig ids, as `rigs --id-width`.
    #[arg(long, default_value_t = 6)]
    pub id_width: usize,
    #[arg(long, value_enum, default_value_t = PublishMode::Fanout)]
    pub mode: PublishMode,
    /// Fan-out: rounds (default 1). Single: commands (default 500).
    #[arg(long)]
    pub count: Option<usize>,
    /// Pause between single commands, or after each fan-out round.
    #[arg(long, default_value = "10ms", value_parser = parse_duration)]
    pub interval: Duration,
    /// Command name to send.
    #[arg(long, default_value = "bench")]
    pub name: String,
    /// Reply channel named in every command; nobody needs to listen (latency is measured by the
    /// rigs).
    #[arg(long, default_value = "fleetlink:bench:replies")]
    pub reply_to: String,
    /// Bound on the whole run (checked between PUBLISHes/rounds and used as the socket timeout).
    #[arg(long, default_value = "120s", value_parser = parse_duration)]
    pub max_time: Duration,
    /// Also write the JSON summary here (it is always printed on stdout).
    #[arg(long)]
    pub report: Option<String>,
}

impl RedisPublishArgs {
    /// `--count`, or the mode's default.
    pub fn effective_count(&self) -> usize {
        self.count.unwrap_or(match self.mode {
            PublishMode::Fanout => 1,
            PublishMode::Single => 500,
        })
    }
}

/// `250ms`, `20s`, `5m`, `1h`. A bare number is refused, as by the broker and the agent: a
/// `--max-time 120000` meant as milliseconds would otherwise run for 33 hours.
pub fn parse_duration(s: &str) -> Result<Duration, String> {
    let s = s.trim();
    let split = s
        .find(|c: char| !c.is_ascii_digit() && c != '.')
        .unwrap_or(s.len());
    let (num, unit) = s.split_at(split);
    let n: f64 = num.parse().map_err(|_| format!("bad duration {s:?}"))?;
    let secs = match unit {
        "" => return Err(format!("{s:?} has no unit (use ms, s, m, h: e.g. {s}s)")),
        "s" => n,
        "ms" => n / 1000.0,
        "us" => n / 1_000_000.0,
        "m" => n * 60.0,
        "h" => n * 3600.0,
        _ => return Err(format!("bad duration unit in {s:?} (use ms, s, m, h)")),
    };
    if !secs.is_finite() || secs < 0.0 {
        return Err(format!("bad duration {s:?}"));
    }
    Ok(Duration::from_secs_f64(secs))
}

/// `START:COUNT` for the hidden child flag.
fn parse_slice(s: &str) -> Result<(usize, usize), String> {
    let (a, b) = s.split_once(':').ok_or("slice is START:COUNT")?;
    Ok((
        a.parse().map_err(|_| "bad slice start")?,
        b.parse().map_err(|_| "bad slice count")?,
    ))
}

/// Expands `127.0.0.1-127.0.0.16` (inclusive, may cross octets), `a,b,c` lists, or one address.
pub fn parse_sources(s: &str) -> Result<Vec<Ipv4Addr>> {
    let mut out = Vec::new();
    for part in s.split(',').map(str::trim).filter(|p| !p.is_empty()) {
        if let Some((a, b)) = part.split_once('-') {
            let a: Ipv4Addr = a
                .trim()
                .parse()
                .with_context(|| format!("bad address {a:?}"))?;
            let b: Ipv4Addr = b
                .trim()
                .parse()
                .with_context(|| format!("bad address {b:?}"))?;
            let (lo, hi) = (u32::from(a), u32::from(b));
            if hi < lo {
                bail!("source range {part:?} is reversed");
            }
            if hi - lo >= 65_536 {
                bail!("source range {part:?} is too large");
            }
            out.extend((lo..=hi).map(Ipv4Addr::from));
        } else {
            out.push(
                part.parse()
                    .with_context(|| format!("bad address {part:?}"))?,
            );
        }
    }
    if out.is_empty() {
        bail!("no source addresses in {s:?}");
    }
    Ok(out)
}

/// `k=v,k2=v2` into a map; empty string gives no labels.
pub fn parse_labels(s: &str) -> Result<BTreeMap<String, String>> {
    let mut out = BTreeMap::new();
    for part in s.split(',').map(str::trim).filter(|p| !p.is_empty()) {
        let (k, v) = part
            .split_once('=')
            .with_context(|| format!("label {part:?} is not k=v"))?;
        out.insert(k.trim().to_string(), v.trim().to_string());
    }
    Ok(out)
}

/// The parts of a `ws://host:port/path` (or `http://…`) URL the tools need.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PlainUrl {
    pub host: String,
    pub port: u16,
    pub path: String,
}

/// Parses a `SCHEME://host[:port][/path]` URL for exactly `scheme`: a `wss://` URL given where
/// `ws` is expected is refused rather than silently sent in clear (see [`parse_ws_url`]).
pub fn parse_plain_url(url: &str, scheme: &str, default_port: u16) -> Result<PlainUrl> {
    let rest = url
        .strip_prefix(scheme)
        .and_then(|r| r.strip_prefix("://"))
        .with_context(|| format!("{url:?} is not a {scheme}:// URL"))?;
    let (authority, path) = match rest.find('/') {
        Some(i) => (&rest[..i], &rest[i..]),
        None => (rest, "/"),
    };
    let (host, port) = match authority.rsplit_once(':') {
        Some((h, p)) if !h.ends_with(']') || h.starts_with('[') => (
            h,
            p.parse().with_context(|| format!("bad port in {url:?}"))?,
        ),
        _ => (authority, default_port),
    };
    if host.is_empty() {
        bail!("no host in {url:?}");
    }
    Ok(PlainUrl {
        host: host
            .trim_start_matches('[')
            .trim_end_matches(']')
            .to_string(),
        port,
        path: path.to_string(),
    })
}

/// A rig endpoint: `ws://…` (plain, default port 80) or `wss://…` (TLS, default port 443).
/// Returns the parts and whether it is TLS.
pub fn parse_ws_url(url: &str) -> Result<(PlainUrl, bool)> {
    if url.starts_with("wss://") {
        Ok((parse_plain_url(url, "wss", 443)?, true))
    } else {
        Ok((parse_plain_url(url, "ws", 80)?, false))
    }
}

impl RigsArgs {
    /// Checks the TLS flags against the URL's scheme: wss needs --ca; the TLS flags need wss.
    pub fn check_tls_flags(&self, tls: bool) -> Result<()> {
        if tls && self.ca.is_none() {
            bail!("{} is wss: --ca is required", self.url);
        }
        if !tls && (self.ca.is_some() || self.tls_cert.is_some()) {
            bail!("--ca/--tls-cert/--tls-key need a wss:// URL");
        }
        Ok(())
    }

    /// The id of rig `index`: `<prefix>-<index>` zero-padded to `--id-width`.
    pub fn rig_id(prefix: &str, width: usize, index: usize) -> String {
        format!("{prefix}-{index:0width$}")
    }

    /// Child processes to use: the flag, or the fewest that keep each under the socket cap.
    pub fn effective_procs(&self) -> Result<usize> {
        let min = self.rigs.div_ceil(MAX_SOCKETS_PER_PROC).max(1);
        let procs = self.procs.unwrap_or(min).max(1);
        if procs < min {
            bail!(
                "{} rigs over {procs} process(es) exceeds {MAX_SOCKETS_PER_PROC} sockets per process; use --procs {min} or more",
                self.rigs
            );
        }
        Ok(procs.min(self.rigs.max(1)))
    }

    /// The source list to bind to: the flag, or 16 loopback addresses for a loopback target.
    pub fn effective_sources(&self, target_is_loopback_v4: bool) -> Result<Vec<Ipv4Addr>> {
        match &self.sources {
            Some(s) => {
                let sources = parse_sources(s)?;
                // Not local, a source fails every rig at bind with EADDRNOTAVAIL, which a run
                // would report as ports running out.
                for ip in &sources {
                    if let Err(e) = std::net::UdpSocket::bind((*ip, 0)) {
                        anyhow::bail!("--sources: {ip} is not an address of this host ({e})");
                    }
                }
                Ok(sources)
            }
            None if target_is_loopback_v4 => parse_sources("127.0.0.1-127.0.0.16"),
            None => Ok(Vec::new()),
        }
    }
}

/// Splits `rigs` into `procs` contiguous slices `(start, count)`, sizes differing by at most one.
pub fn split_slices(start: usize, rigs: usize, procs: usize) -> Vec<(usize, usize)> {
    let procs = procs.max(1);
    let (base, extra) = (rigs / procs, rigs % procs);
    let mut at = start;
    (0..procs)
        .map(|i| {
            let n = base + usize::from(i < extra);
            let s = (at, n);
            at += n;
            s
        })
        .filter(|&(_, n)| n > 0)
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn durations() {
        assert_eq!(parse_duration("250ms").unwrap(), Duration::from_millis(250));
        assert_eq!(parse_duration("20s").unwrap(), Duration::from_secs(20));
        assert_eq!(parse_duration("5m").unwrap(), Duration::from_secs(300));
        assert!(parse_duration("7").is_err(), "a bare number has no unit");
        assert_eq!(parse_duration("1.5s").unwrap(), Duration::from_millis(1500));
        assert!(parse_duration("5 parsecs").is_err());
        assert!(parse_duration("").is_err());
    }

    #[test]
    fn sources() {
        let v = parse_sources("127.0.0.1-127.0.0.16").unwrap();
        assert_eq!(v.len(), 16);
        assert_eq!(v[0], Ipv4Addr::new(127, 0, 0, 1));
        assert_eq!(v[15], Ipv4Addr::new(127, 0, 0, 16));
        let v = parse_sources("127.0.0.254-127.0.1.1").unwrap();
        assert_eq!(v.len(), 4);
        assert_eq!(v[3], Ipv4Addr::new(127, 0, 1, 1));
        assert_eq!(parse_sources("127.0.0.3").unwrap().len(), 1);
        assert_eq!(parse_sources("127.0.0.3, 127.0.0.9").unwrap().len(), 2);
        assert!(parse_sources("127.0.0.9-127.0.0.1").is_err());
        assert!(parse_sources("nope").is_err());
        assert!(parse_sources("").is_err());
    }

    /// A count past what one host holds is refused up front: `--rigs 99999999999` started
    /// child processes for minutes, aiming at 5.5 million of them.
    #[test]
    fn counts_past_one_host_are_refused() {
        use clap::Parser;
        let parse = |rigs: &str, procs: &str| {
            Cli::try_parse_from([
                "loadgen",
                "rigs",
                "--url",
                "ws://127.0.0.1:1/agent",
                "--rigs",
                rigs,
                "--procs",
                procs,
            ])
            .map(|_| ())
            .map_err(|e| e.kind())
        };
        let refused = Err(clap::error::ErrorKind::ValueValidation);
        assert_eq!(parse("99999999999", "1"), refused);
        assert_eq!(parse("9216001", "512"), refused);
        assert_eq!(parse("1000", "513"), refused);
        assert_eq!(parse("9216000", "512"), Ok(()));
    }

    /// A source address this host does not have is refused up front, not run into a
    /// failure per rig; a count of 0 processes or handshakes is refused too.
    #[test]
    fn sources_must_be_local_and_counts_positive() {
        use clap::Parser;
        let rigs = |extra: &[&str]| {
            let mut argv = vec!["loadgen", "rigs", "--url", "ws://127.0.0.1:1/agent"];
            argv.extend(["--rigs", "2"]);
            argv.extend(extra);
            match Cli::try_parse_from(argv) {
                Ok(Cli {
                    cmd: Command::Rigs(a),
                }) => Ok(a),
                Ok(_) => panic!("not rigs"),
                Err(e) => Err(e.to_string()),
            }
        };
        let local = rigs(&["--sources", "127.0.0.1-127.0.0.3"]).unwrap();
        assert_eq!(local.effective_sources(true).unwrap().len(), 3);
        let far = rigs(&["--sources", "127.0.0.1,192.0.2.1"]).unwrap();
        let e = far.effective_sources(true).unwrap_err().to_string();
        assert!(
            e.contains("192.0.2.1 is not an address of this host"),
            "{e}"
        );
        for zero in [["--procs", "0"], ["--concurrency", "0"]] {
            let e = rigs(&zero).unwrap_err();
            assert!(e.contains("at least 1"), "{e}");
        }
    }

    #[test]
    fn labels() {
        let l = parse_labels("group=a, site=lab1").unwrap();
        assert_eq!(l["group"], "a");
        assert_eq!(l["site"], "lab1");
        assert!(parse_labels("").unwrap().is_empty());
        assert!(parse_labels("novalue").is_err());
    }

    #[test]
    fn urls() {
        let u = parse_plain_url("ws://127.0.0.1:8080/agent", "ws", 80).unwrap();
        assert_eq!(
            (u.host.as_str(), u.port, u.path.as_str()),
            ("127.0.0.1", 8080, "/agent")
        );
        let u = parse_plain_url("http://localhost", "http", 80).unwrap();
        assert_eq!(
            (u.host.as_str(), u.port, u.path.as_str()),
            ("localhost", 80, "/")
        );
        let u = parse_plain_url("ws://[::1]:9/x", "ws", 80).unwrap();
        assert_eq!((u.host.as_str(), u.port), ("::1", 9));
        assert!(parse_plain_url("wss://h/agent", "ws", 80).is_err());
        let (u, tls) = parse_ws_url("wss://127.0.0.1:8443/agent").unwrap();
        assert!(tls);
        assert_eq!((u.host.as_str(), u.port), ("127.0.0.1", 8443));
        let (u, tls) = parse_ws_url("wss://localhost/agent").unwrap();
        assert!(tls);
        assert_eq!(u.port, 443);
        assert!(!parse_ws_url("ws://h:1/agent").unwrap().1);
        assert!(parse_ws_url("https://h/agent").is_err());
    }

    #[test]
    fn tls_flags() {
        let parse = |args: &[&str]| {
            let mut full = vec!["fleetlink-loadgen", "rigs", "--rigs", "1"];
            full.extend_from_slice(args);
            Cli::try_parse_from(full).map(|c| match c.cmd {
                Command::Rigs(r) => r,
                _ => unreachable!(),
            })
        };
        let r = parse(&["--url", "wss://127.0.0.1:1/agent", "--ca", "ca.pem"]).unwrap();
        assert_eq!(r.server_name, "localhost");
        assert!(r.check_tls_flags(true).is_ok());
        let r = parse(&["--url", "wss://127.0.0.1:1/agent"]).unwrap();
        assert!(r.check_tls_flags(true).is_err());
        let r = parse(&["--url", "ws://127.0.0.1:1/agent", "--ca", "ca.pem"]).unwrap();
        assert!(r.check_tls_flags(false).is_err());
        assert!(parse(&["--url", "wss://h/a", "--ca", "c", "--tls-cert", "x.pem"]).is_err());
        let r = parse(&[
            "--url",
            "wss://h/a",
            "--ca",
            "c",
            "--tls-cert",
            "x.pem",
            "--tls-key",
            "x.key",
            "--server-name",
            "broker.fleet",
        ])
        .unwrap();
        assert_eq!(r.server_name, "broker.fleet");
        assert_eq!(RigsArgs::rig_id("rig", r.id_width, 7), "rig-000007");
        assert_eq!(RigsArgs::rig_id("rig", 4, 1), "rig-0001");
    }

    #[test]
    fn slices_and_procs() {
        assert_eq!(split_slices(0, 10, 3), vec![(0, 4), (4, 3), (7, 3)]);
        assert_eq!(split_slices(100, 2, 4), vec![(100, 1), (101, 1)]);
        let parse = |args: &[&str]| {
            let mut full = vec![
                "fleetlink-loadgen",
                "rigs",
                "--url",
                "ws://127.0.0.1:1/agent",
            ];
            full.extend_from_slice(args);
            match Cli::try_parse_from(full).unwrap().cmd {
                Command::Rigs(r) => r,
                _ => unreachable!(),
            }
        };
        let r = parse(&["--rigs", "40000"]);
        assert_eq!(r.effective_procs().unwrap(), 3);
        assert_eq!(r.hold, Duration::from_secs(60));
        assert_eq!(r.concurrency, 256);
        assert!(parse(&["--rigs", "40000", "--procs", "2"])
            .effective_procs()
            .is_err());
        let r = parse(&["--rigs", "5", "--hold", "250ms", "--child-slice", "3:2"]);
        assert_eq!(r.child_slice, Some((3, 2)));
        assert_eq!(r.hold, Duration::from_millis(250));
        assert_eq!(r.effective_sources(true).unwrap().len(), 16);
        assert!(r.effective_sources(false).unwrap().is_empty());
        assert_eq!(r.until_commands, None);
        let r = parse(&["--rigs", "5", "--until-commands", "500"]);
        assert_eq!(r.until_commands, Some(500));
    }

    #[test]
    fn redis_publish_args() {
        let parse = |args: &[&str]| {
            let mut full = vec![
                "fleetlink-loadgen",
                "redis-publish",
                "--redis",
                "redis://127.0.0.1:1/",
                "--broker-id",
                "fe-a",
            ];
            full.extend_from_slice(args);
            match Cli::try_parse_from(full).unwrap().cmd {
                Command::RedisPublish(r) => r,
                _ => unreachable!(),
            }
        };
        let r = parse(&["--rigs", "10000"]);
        assert_eq!(
            (r.mode, r.effective_count(), r.interval),
            (PublishMode::Fanout, 1, Duration::from_millis(10))
        );
        let r = parse(&["--mode", "single", "--interval", "20ms"]);
        assert_eq!(
            (r.mode, r.effective_count(), r.interval),
            (PublishMode::Single, 500, Duration::from_millis(20))
        );
        assert_eq!(
            parse(&["--mode", "single", "--count", "7"]).effective_count(),
            7
        );
        let f = match Cli::try_parse_from(["fleetlink-loadgen", "admin-fanout", "--rigs", "1"])
            .unwrap()
            .cmd
        {
            Command::AdminFanout(f) => f,
            _ => unreachable!(),
        };
        assert_eq!((f.count, f.interval), (1, Duration::ZERO));
    }
}
