//! The command line of `fleetlink-agent` (CONTRACT.md §1) and its validation into [`Config`].
//!
//! Everything a broker would refuse later (a bad rig id, too many labels) is refused here, at
//! start, with exit code 64, instead of as a reconnect loop of 4400 closes.

use std::collections::{BTreeMap, BTreeSet};
use std::path::PathBuf;
use std::time::Duration;

use anyhow::{bail, ensure, Context};
use clap::Parser;
use fleetlink::config::parse_duration;
use fleetlink::ids::RigId;
use fleetlink::protocol::{MAX_LABELS, MAX_LABEL_LEN};

/// What `--help` ends with: the exit codes, which scripts and supervisors act on.
const AFTER_HELP: &str = "\
Durations take a unit: 250ms, 20s, 5m, 1h. Logging: RUST_LOG (default info).

Stopping (SIGTERM/SIGINT/SIGHUP, --run-for, a seq gap): every command already acked ends in a result
before the close: the running one is killed, the ones not started are reported ok:false
(\"not run: the agent stopped first\") and never run; up to 5 s for those to go out. The
broker will not send an acked command again, so a result that cannot go out (stopped while
disconnected) is logged as an error with its seq. After sending acks or results the agent
pings the broker, whose pong says it read them; those a connection ends with unconfirmed go
again on the next (up to 1,024; results after any welcome, acks after a resumed one):
control may see a result twice.

Reconnecting (the same boot id, so the broker resumes the session):
  goaway                 at the reconnect_after_ms it gave, exactly (at most 600 s); one
                         without a number is ignored, and the close after it is as below
  HTTP 503 Retry-After N, close 4503 retry_after=N
                         N s, give or take 10 % (N = 0: as anything else)
  kicked (close 1012)    0.5-1.5 s: control asked for the reconnect
  anything else          uniform(0.5, 1.5) x min(2^n, 30) s, n the failures in a row
                         (at most 45 s); a connection up 10 s after its welcome starts n over
  HTTP 401 with --token-file
                         as anything else: the token may have expired, and the file is read
                         again at each attempt, so a renewed token gets in
  4400, 4403, 4409, or a final 4xx to the upgrade: no retry (exit 5)
  no welcome within 30 s of the hello, or a message from the broker over 16 MiB (the
  connection is dropped): as anything else

Exit codes:
  0   stopped: SIGTERM/SIGINT/SIGHUP, or --run-for elapsed
  1   startup error (TLS files, --exec-log, --token-file) or the command worker died
  3   gave up after --max-attempts attempts in a row that never got a welcome
  4   a seq gap: commands were lost, so going on would hide it
  5   refused by the broker for good: 4400 (bad hello), 4403 (TLS identity is not
      --rig-id), 4409 (a newer boot of this rig is connected), or the upgrade answered
      with a 4xx other than 408/429 (404: --url's path is not /agent; 401 only without
      --token-file); reconnecting would not help
  64  usage: a flag that does not parse or does not validate";

/// The reference rig agent: hello, ack, run allowed commands, reconnect with jitter.
#[derive(Parser, Debug)]
#[command(name = "fleetlink-agent", version, after_help = AFTER_HELP)]
pub(crate) struct Cli {
    /// Broker rig endpoint: `ws://HOST:PORT/agent` or `wss://HOST:PORT/agent`.
    #[arg(long, env = "FLEETLINK_AGENT_URL")]
    url: String,
    /// This rig's id: 1–64 of `[A-Za-z0-9._-]`.
    #[arg(long, env = "FLEETLINK_AGENT_RIG_ID")]
    rig_id: String,
    /// Hello labels, `k=v,k=v` (at most 32, each key and value at most 128 bytes).
    #[arg(long, env = "FLEETLINK_AGENT_LABELS", default_value = "")]
    labels: String,
    /// A command name the default handler may run (repeat the flag, or separate names with
    /// commas; spaces around a name are dropped, as for --labels). Others are refused.
    #[arg(
        long = "allow",
        value_name = "CMD",
        env = "FLEETLINK_AGENT_ALLOW",
        value_delimiter = ','
    )]
    allow: Vec<String>,
    /// Client certificate chain (PEM) for mTLS; needs --tls-key and a wss:// URL.
    #[arg(long, env = "FLEETLINK_AGENT_TLS_CERT")]
    tls_cert: Option<PathBuf>,
    /// Private key (PEM) of --tls-cert.
    #[arg(long, env = "FLEETLINK_AGENT_TLS_KEY")]
    tls_key: Option<PathBuf>,
    /// CA bundle (PEM) to trust for the broker's certificate. Default: the system bundle.
    #[arg(long, env = "FLEETLINK_AGENT_CA")]
    ca: Option<PathBuf>,
    /// File holding a bearer token (a JWT) for a broker started with --jwt-key, sent as
    /// `Authorization: Bearer` with each upgrade. Read again at every connection attempt, so
    /// a renewed token is used without a restart.
    #[arg(long, env = "FLEETLINK_AGENT_TOKEN_FILE")]
    token_file: Option<PathBuf>,
    /// Append `seq=N id=ID name=NAME ok=BOOL` per executed command, fsync'd (exactly-once checks).
    #[arg(long, env = "FLEETLINK_AGENT_EXEC_LOG")]
    exec_log: Option<PathBuf>,
    /// Bytes of stdout and of stderr kept per command; the rest is counted and dropped.
    #[arg(long, env = "FLEETLINK_AGENT_OUTPUT_CAP", default_value_t = 64 * 1024)]
    output_cap: usize,
    /// Timeout of a command whose args carry no `timeout_ms`; the process group is killed.
    #[arg(long, env = "FLEETLINK_AGENT_COMMAND_TIMEOUT", default_value = "60s", value_parser = parse_duration)]
    command_timeout: Duration,
    /// Largest message the agent sends, in bytes (at least 1024): the broker's --max-message.
    /// Bigger results are cut down to fit.
    #[arg(long, env = "FLEETLINK_AGENT_MAX_MESSAGE", default_value_t = 65_536)]
    max_message: usize,
    /// Accepted commands waiting for the worker (and at most 64 MiB of them, whatever the
    /// count). When full, the agent closes 1013 without acking the next, reconnects, and the
    /// broker replays the rest later.
    #[arg(long, env = "FLEETLINK_AGENT_MAX_PENDING", default_value_t = 1024)]
    max_pending: usize,
    /// Give up (exit 3) after this many connection attempts in a row that never got a welcome.
    /// A welcomed connection is a successful attempt, however soon it ends (a kick, a 4410).
    #[arg(long, env = "FLEETLINK_AGENT_MAX_ATTEMPTS")]
    max_attempts: Option<u32>,
    /// Stop (exit 0) after this long, e.g. `30s`.
    #[arg(long, env = "FLEETLINK_AGENT_RUN_FOR", value_parser = parse_duration)]
    run_for: Option<Duration>,
}

/// A validated configuration.
#[derive(Debug)]
pub(crate) struct Config {
    pub(crate) endpoint: Endpoint,
    pub(crate) rig_id: RigId,
    pub(crate) labels: BTreeMap<String, String>,
    pub(crate) allow: BTreeSet<String>,
    /// `(cert, key)` for mTLS.
    pub(crate) identity: Option<(PathBuf, PathBuf)>,
    pub(crate) ca: Option<PathBuf>,
    /// The bearer token's file, read at each attempt.
    pub(crate) token_file: Option<PathBuf>,
    pub(crate) exec_log: Option<PathBuf>,
    pub(crate) output_cap: usize,
    pub(crate) command_timeout: Duration,
    pub(crate) max_message: usize,
    pub(crate) max_pending: usize,
    pub(crate) max_attempts: Option<u32>,
    pub(crate) run_for: Option<Duration>,
}

/// Where the broker is: kept as a host name so every attempt resolves it again.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Endpoint {
    /// `wss://`.
    pub(crate) tls: bool,
    /// Host name or IP literal, without IPv6 brackets (also the TLS server name).
    pub(crate) host: String,
    pub(crate) port: u16,
    /// The URL as given, for the upgrade request.
    pub(crate) url: String,
}

impl Cli {
    /// Checks the flags against each other and the contract's limits.
    pub(crate) fn validate(self) -> anyhow::Result<Config> {
        let endpoint = parse_url(&self.url).map_err(anyhow::Error::msg)?;
        let rig_id = RigId::parse(&self.rig_id)
            .with_context(|| format!("--rig-id {:?}: 1-64 of [A-Za-z0-9._-]", self.rig_id))?;
        let labels = parse_labels(&self.labels).map_err(anyhow::Error::msg)?;
        let identity = match (self.tls_cert, self.tls_key) {
            (Some(cert), Some(key)) => Some((cert, key)),
            (None, None) => None,
            _ => bail!("--tls-cert and --tls-key go together"),
        };
        ensure!(
            endpoint.tls || (identity.is_none() && self.ca.is_none()),
            "--tls-cert/--tls-key/--ca need a wss:// URL"
        );
        ensure!(self.max_pending > 0, "--max-pending must be > 0");
        ensure!(
            !self.command_timeout.is_zero(),
            "--command-timeout must be > 0 (0 would kill every command as it starts)"
        );
        ensure!(self.max_attempts != Some(0), "--max-attempts must be > 0");
        ensure!(
            self.max_message >= 1024,
            "--max-message must be at least 1024"
        );
        // `--allow "echo, true"` means `true`, not " true" (which no command is named).
        let allow: Vec<String> = self.allow.iter().map(|a| a.trim().to_string()).collect();
        if let Some(bad) = allow.iter().find(|a| a.is_empty()) {
            bail!("--allow {bad:?}: empty command name");
        }
        Ok(Config {
            endpoint,
            rig_id,
            labels,
            allow: allow.into_iter().collect(),
            identity,
            ca: self.ca,
            token_file: self.token_file,
            exec_log: self.exec_log,
            output_cap: self.output_cap,
            command_timeout: self.command_timeout,
            max_message: self.max_message,
            max_pending: self.max_pending,
            max_attempts: self.max_attempts,
            run_for: self.run_for,
        })
    }
}

/// Parses `ws[s]://HOST[:PORT][/PATH]`; the port defaults to 80 / 443.
pub(crate) fn parse_url(url: &str) -> Result<Endpoint, String> {
    let (tls, rest) = if let Some(rest) = url.strip_prefix("wss://") {
        (true, rest)
    } else if let Some(rest) = url.strip_prefix("ws://") {
        (false, rest)
    } else {
        return Err(format!("--url {url:?}: must start with ws:// or wss://"));
    };
    let authority = rest.split(['/', '?']).next().unwrap_or("");
    let bad = || format!("--url {url:?}: bad host or port");
    let (host, port) = if let Some(v6) = authority.strip_prefix('[') {
        let (host, after) = v6.split_once(']').ok_or_else(bad)?;
        (host, after.strip_prefix(':'))
    } else {
        match authority.rsplit_once(':') {
            Some((host, port)) => (host, Some(port)),
            None => (authority, None),
        }
    };
    if host.is_empty() || authority.contains('@') {
        return Err(bad());
    }
    let port = match port {
        Some(p) => p.parse::<u16>().ok().filter(|&p| p != 0).ok_or_else(bad)?,
        None if tls => 443,
        None => 80,
    };
    Ok(Endpoint {
        tls,
        host: host.to_string(),
        port,
        url: url.to_string(),
    })
}

/// Parses `k=v,k=v` (empty = no labels) within the hello's limits (CONTRACT.md §2).
pub(crate) fn parse_labels(text: &str) -> Result<BTreeMap<String, String>, String> {
    let mut out = BTreeMap::new();
    for pair in text.split(',').map(str::trim).filter(|p| !p.is_empty()) {
        let (k, v) = pair
            .split_once('=')
            .ok_or_else(|| format!("--labels: {pair:?} is not k=v"))?;
        let (k, v) = (k.trim(), v.trim());
        if k.is_empty() || k.len() > MAX_LABEL_LEN || v.len() > MAX_LABEL_LEN {
            return Err(format!(
                "--labels: {pair:?}: keys 1-{MAX_LABEL_LEN} bytes, values up to {MAX_LABEL_LEN}"
            ));
        }
        if out.insert(k.to_string(), v.to_string()).is_some() {
            return Err(format!("--labels: {k:?} given twice"));
        }
    }
    if out.len() > MAX_LABELS {
        return Err(format!("--labels: at most {MAX_LABELS} labels"));
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn urls() {
        let e = parse_url("ws://127.0.0.1:8080/agent").unwrap();
        assert_eq!((e.tls, e.host.as_str(), e.port), (false, "127.0.0.1", 8080));
        let e = parse_url("wss://broker.lab/agent").unwrap();
        assert_eq!((e.tls, e.host.as_str(), e.port), (true, "broker.lab", 443));
        let e = parse_url("ws://[::1]:9/agent").unwrap();
        assert_eq!((e.host.as_str(), e.port), ("::1", 9));
        assert_eq!(parse_url("ws://h").unwrap().port, 80);
        for bad in [
            "http://h/agent",
            "ws://:80/agent",
            "ws://h:0/",
            "ws://h:99999/",
            "ws://u@h/",
            "ws://[::1/",
        ] {
            assert!(parse_url(bad).is_err(), "{bad}");
        }
    }

    #[test]
    fn labels() {
        let l = parse_labels("group=a, lab = b,").unwrap();
        assert_eq!(l.get("group").map(String::as_str), Some("a"));
        assert_eq!(l.get("lab").map(String::as_str), Some("b"));
        assert!(parse_labels("").unwrap().is_empty());
        assert!(parse_labels("k=").is_ok());
        assert!(parse_labels("novalue").is_err());
        assert!(parse_labels("=v").is_err());
        assert!(parse_labels("a=1,a=2").is_err());
        let many: Vec<String> = (0..=MAX_LABELS).map(|i| format!("k{i}=v")).collect();
        assert!(parse_labels(&many.join(",")).is_err());
    }

    /// `--allow "echo, true"` names `true`, as `--labels` drops such spaces.
    #[test]
    fn allowed_names_are_trimmed() {
        let cli = Cli::try_parse_from([
            "fleetlink-agent",
            "--url",
            "ws://127.0.0.1:1/agent",
            "--rig-id",
            "r",
            "--allow",
            "echo, true",
        ])
        .unwrap();
        let cfg = cli.validate().unwrap();
        assert_eq!(cfg.allow.iter().collect::<Vec<_>>(), ["echo", "true"]);
    }

    #[test]
    fn every_flag_has_its_environment_variable() {
        use clap::CommandFactory;
        let cmd = Cli::command();
        for arg in cmd.get_arguments() {
            let Some(long) = arg.get_long().filter(|l| !["help", "version"].contains(l)) else {
                continue;
            };
            let want = format!("FLEETLINK_AGENT_{}", long.replace('-', "_").to_uppercase());
            let env = arg.get_env().and_then(|e| e.to_str());
            assert_eq!(env, Some(want.as_str()), "--{long}");
        }
    }

    #[test]
    fn help_lists_every_exit_code() {
        use clap::CommandFactory;

        use crate::reconnect::Exit;
        let help = Cli::command().render_long_help().to_string();
        assert!(help.contains("\n  64  usage"), "{help}");
        for exit in [
            Exit::Stopped,
            Exit::Fatal,
            Exit::GaveUp,
            Exit::SeqGap,
            Exit::Refused,
        ] {
            let line = format!("\n  {:<3} ", exit.code());
            assert!(
                help.contains(&line),
                "exit {} not in --help:\n{help}",
                exit.code()
            );
        }
    }

    #[test]
    fn flags_go_together() {
        let parse = |args: &[&str]| {
            let mut argv = vec!["fleetlink-agent", "--rig-id", "rig-1"];
            argv.extend_from_slice(args);
            Cli::try_parse_from(argv)
                .map_err(anyhow::Error::from)
                .and_then(Cli::validate)
        };
        assert!(parse(&["--url", "ws://h/agent"]).is_ok());
        assert!(parse(&["--url", "ws://h/agent", "--ca", "ca.pem"]).is_err());
        assert!(parse(&["--url", "wss://h/agent", "--tls-cert", "c.pem"]).is_err());
        assert!(parse(&[
            "--url",
            "wss://h/agent",
            "--tls-cert",
            "c",
            "--tls-key",
            "k"
        ])
        .is_ok());
        assert!(parse(&["--url", "ws://h/agent", "--max-attempts", "0"]).is_err());
        assert!(parse(&["--url", "ws://h/agent", "--run-for", "250ms"]).is_ok());
        assert!(parse(&["--url", "ws://h/agent", "--command-timeout", "0s"]).is_err());
    }
}
