//! Checks apart from parsing: a value that parses may still be out of range or need another
//! flag, and is refused alike (exit 1) whether a flag, a variable or the file gave it.

use std::net::SocketAddr;
use std::num::NonZeroUsize;
use std::time::Duration;

use super::flags::BrokerArgs;
use super::settings::{Config, TlsFiles, MAX_CORES, MAX_MESSAGE_CAP};

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
        anyhow::ensure!(
            self.admin_answer_bytes >= 1 << 20,
            "--admin-answer-bytes must be at least 1 MiB (1048576)"
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
        // The broker touches a live session a few times per TTL but not more often than every
        // 100 ms; a shorter TTL would let connected rigs' sessions lapse between touches.
        anyhow::ensure!(
            self.session_ttl.is_zero() || self.session_ttl >= Duration::from_secs(1),
            "--session-ttl must be 0 (keep no session) or at least 1s"
        );
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
            admin_answer_bytes: self.admin_answer_bytes,
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
        Some("redis" | "redis+unix") => {
            "it does not parse: a path after the host must be a database number (/3), \
             and a password with @ : / ? # or % in it must be percent-encoded"
                .to_string()
        }
        Some("unix") => "it does not parse: unix:///PATH[?db=N&user=U&pass=P]".to_string(),
        Some(other) => format!("{other}:// is not a Redis scheme"),
        None => "no scheme".to_string(),
    };
    let shown = crate::log_text::redact_url(url);
    anyhow::bail!(
        "--redis {shown:?}: not a usable Redis URL ({why}); expected redis://[USER:PASSWORD@]HOST[:PORT][/DB] or unix:///PATH[?db=N&user=U&pass=P]"
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

#[cfg(test)]
mod tests {
    use crate::config::testing::{config_file, load};
    use crate::config::Cli;

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
    fn a_connection_cap_is_for_the_broker_whatever_its_cores() {
        for ok in ["0", "1", "2", "4", "1000"] {
            let cfg = load(&["--cores", "4", "--max-connections", ok]).unwrap();
            assert_eq!(cfg.max_connections, ok.parse().ok());
        }
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
            (
                "max-missed-pongs",
                "-1",
                "-1",
                "--max-missed-pongs must be 1 to 255",
            ),
            (
                "session-ttl",
                "500ms",
                "\"500ms\"",
                "--session-ttl must be 0 (keep no session) or at least 1s",
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
            (
                "admin-answer-bytes",
                "1000",
                "1000",
                "--admin-answer-bytes must be at least 1 MiB",
            ),
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
        // A negative count written with a space is a value, not a flag.
        let cli = Cli::load(vec![
            "fleetlink-fe".into(),
            "--max-missed-pongs".into(),
            "-1".into(),
        ])
        .unwrap_or_else(|e| panic!("--max-missed-pongs -1 should parse: {e}"));
        let e = cli.broker.validate().unwrap_err().to_string();
        assert!(e.contains("--max-missed-pongs must be 1 to 255"), "{e}");
        // The file hint is for a bare number, which is what a TOML number hands over.
        let e = Cli::load(vec!["fleetlink-fe".into(), "--ping-interval=20x".into()])
            .map(|_| ())
            .unwrap_err()
            .to_string();
        assert!(!e.contains("--config"), "{e}");
    }

    /// Standalone keeps a left rig's session for --session-ttl (the only copy), never less
    /// than the lease's lifetime; fleet mode for the lease's, Redis keeping the session.
    #[test]
    fn a_session_is_parked_for_the_session_ttl_standalone_only() {
        let park = |args: &[&str]| load(args).unwrap().park_for();
        let s = std::time::Duration::from_secs;
        assert_eq!(park(&[]), s(600));
        assert_eq!(park(&["--session-ttl", "0"]), s(60));
        assert_eq!(
            park(&["--session-ttl", "5s", "--registry-ttl", "30s"]),
            s(30)
        );
        assert_eq!(park(&["--redis", "redis://127.0.0.1:1"]), s(60));
    }

    #[test]
    fn tls_flags_go_together() {
        assert!(load(&["--tls-cert", "a.pem"]).is_err());
        let c = load(&["--tls-cert", "a.pem", "--tls-key", "k.pem"]).unwrap();
        assert_eq!(c.listen.port(), 8443);
    }
}
