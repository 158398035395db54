//! The command line of fleetctl (CONTRACT.md §1) and its value parsers.
//!
//! Every check that can be made without the network happens here, so a bad invocation exits 64
//! before anything is sent. The plane (Redis or admin HTTP) is resolved here too: flags beat
//! env vars, and naming both planes at the same level is a usage error.

use std::collections::BTreeMap;
use std::ffi::OsString;
use std::time::Duration;

use clap::error::ErrorKind;
use clap::{CommandFactory, Parser, Subcommand};
use fleetlink::ids::{RigId, COMMAND_NAME_MAX};
use serde_json::{Map, Value};

/// Env var naming the Redis URL of the fleet (same as `--redis`).
const ENV_REDIS: &str = "FLEETCTL_REDIS";
/// Env var naming one broker's admin URL (same as `--admin`).
const ENV_ADMIN: &str = "FLEETCTL_ADMIN";
/// Admin URL used when neither plane is named anywhere (the broker's default `--admin`).
const DEFAULT_ADMIN: &str = "http://127.0.0.1:9090";

/// Control-plane CLI of fleetlink: send commands, kick, inspect rigs and brokers, tail events.
///
/// Exit codes: 0 ok, 2 an error reply (or the plane is unreachable), 3 timeout, 64 usage.
#[derive(Parser, Debug)]
#[command(name = "fleetctl", version)]
pub(crate) struct Cli {
    /// Fleet mode: the Redis backplane, e.g. redis://10.0.0.5:6379/ [env: FLEETCTL_REDIS]
    #[arg(long, global = true, value_name = "URL", conflicts_with = "admin")]
    redis: Option<String>,
    /// Standalone mode: one broker's admin API [env: FLEETCTL_ADMIN]
    /// [default: http://127.0.0.1:9090]
    #[arg(long, global = true, value_name = "URL")]
    admin: Option<String>,
    /// Print reply objects as JSON, one per line.
    #[arg(long, global = true)]
    pub(crate) json: bool,
    #[command(subcommand)]
    pub(crate) command: Command,
}

/// The subcommands.
#[derive(Subcommand, Debug)]
pub(crate) enum Command {
    /// Send a command to one rig (RIG NAME), or to every rig matching --selector (NAME).
    #[command(
        override_usage = "fleetctl send RIG NAME [--args JSON] [--timeout 5s]\n       \
                          fleetctl send --selector k=v[,k=v] NAME [--args JSON] [--timeout 5s]"
    )]
    Send(SendArgs),
    /// Force a rig to reconnect: its socket closes with 1012.
    Kick {
        /// The rig id.
        #[arg(value_parser = parse_rig)]
        rig: RigId,
        /// How long to wait for the broker's reply, Redis's answers on the way included.
        #[arg(long, value_name = "DURATION", default_value = "5s", value_parser = parse_timeout)]
        timeout: Duration,
    },
    /// Show where a rig is connected (registry entry and its broker's liveness).
    ///
    /// With --redis, a broker is live when its `broker:<id>` key exists and something
    /// subscribes to its `fleetlink:broker:<id>` channel: a killed broker's key lingers for up
    /// to its TTL, but its subscription ends with it.
    ///
    /// Gives up when the plane does not answer (exit 3): after 5s with --redis, 10s with --admin.
    Status {
        /// The rig id.
        #[arg(value_parser = parse_rig)]
        rig: RigId,
    },
    /// List connected rigs, one page at a time. With --json: every rig from --cursor to the
    /// end, one rig object per line (pages are followed, and no cursor line is printed).
    ///
    /// Gives up when the plane does not answer (exit 3): after 5s with --redis, 10s with --admin.
    List {
        /// Rigs per page (Redis: SCAN COUNT, and a page may hold a few more; admin: a larger
        /// one is taken as 9,999, the most a page of /v1/rigs holds beside the row that tells
        /// whether another page follows).
        #[arg(long, default_value_t = 500, value_parser = clap::value_parser!(u64).range(1..=100_000))]
        page_size: u64,
        /// Where to resume: the `next: --cursor` of the previous page (0 = start). With --redis a
        /// SCAN cursor (a number); with --admin `after:RIG`, the last rig of that page, so that
        /// rigs leaving between pages make none of the others skipped.
        #[arg(long, default_value = "0")]
        cursor: String,
    },
    /// List broker keys (Redis), or the health of the admin broker.
    ///
    /// With --redis, LISTENING says whether the broker still subscribes to its channel: a
    /// killed broker's key stays until its TTL ends, marked `no`. `list` marks rigs of such a
    /// broker `(dead)`.
    ///
    /// Gives up when the plane does not answer (exit 3): after 5s with --redis, 10s with --admin.
    Brokers,
    /// Tail `fleetlink:events` (with --admin, a standalone broker's kept events) until
    /// Ctrl-C, --count or --for.
    ///
    /// Gives up when Redis does not answer the subscription within --for, or 5s without it
    /// (exit 3). With --redis, after each 2s without an event it asks Redis whether it is
    /// still there, and gives up (exit 3) when no answer comes within 5s.
    Events {
        /// Stop after this many events (exit 3 if --for ends first).
        #[arg(long, value_parser = parse_count, allow_negative_numbers = true)]
        count: Option<u64>,
        /// Stop after this long.
        #[arg(long = "for", value_name = "DURATION", value_parser = parse_timeout)]
        for_: Option<Duration>,
    },
}

/// Arguments of `send`; [`SendArgs::target`] sorts out the two forms.
#[derive(clap::Args, Debug)]
pub(crate) struct SendArgs {
    /// RIG, then NAME; with --selector only NAME.
    #[arg(value_name = "RIG|NAME")]
    first: String,
    /// NAME (when a RIG is given).
    #[arg(value_name = "NAME")]
    second: Option<String>,
    /// Broadcast to rigs whose hello labels match all pairs, e.g. group=lab,site=b. Space
    /// around each key and value is dropped ("group=lab, site=b" works), so a label value
    /// that starts or ends with a space is matched only by publishing the broadcast yourself.
    #[arg(long, value_name = "k=v[,k=v]", value_parser = parse_selector)]
    selector: Option<Selector>,
    /// Command arguments: a JSON object.
    #[arg(long, value_name = "JSON", default_value = "{}", value_parser = parse_args)]
    pub(crate) args: Map<String, Value>,
    /// How long to wait for replies, Redis's answers on the way included.
    #[arg(long, value_name = "DURATION", default_value = "5s", value_parser = parse_timeout)]
    pub(crate) timeout: Duration,
}

/// Label pairs of a broadcast, sorted so the JSON is stable.
pub(crate) type Selector = BTreeMap<String, String>;

/// Who a `send` goes to.
#[derive(Debug)]
pub(crate) enum Target {
    /// One rig through its registry entry (or the admin API).
    Rig(RigId),
    /// Every rig whose labels match.
    Selector(Selector),
}

/// Where fleetctl talks to.
#[derive(Debug, Clone)]
pub(crate) enum Plane {
    /// `redis://…`: the fleet's registry and pub/sub.
    Redis(String),
    /// `http://host:port`: one broker's admin API.
    Admin(AdminUrl),
}

/// A parsed `http://host:port[/prefix]` admin URL.
#[derive(Debug, Clone)]
pub(crate) struct AdminUrl {
    /// `host:port`, for connecting and the Host header.
    pub(crate) authority: String,
    /// Path prefix without a trailing slash (usually empty).
    pub(crate) prefix: String,
}

impl Cli {
    /// Parses `argv` and resolves the plane; every error is a clap error (exit 64).
    pub(crate) fn load(argv: Vec<OsString>) -> Result<(Cli, Plane), clap::Error> {
        let cli = Cli::try_parse_from(argv)?;
        let plane = cli.plane()?;
        Ok((cli, plane))
    }

    fn plane(&self) -> Result<Plane, clap::Error> {
        let env = |name: &str| std::env::var(name).ok().filter(|v| !v.is_empty());
        let (redis, admin) = match (&self.redis, &self.admin) {
            (None, None) => (env(ENV_REDIS), env(ENV_ADMIN)),
            (redis, admin) => (redis.clone(), admin.clone()),
        };
        match (redis, admin) {
            (Some(_), Some(_)) => Err(usage(
                ErrorKind::ArgumentConflict,
                format!(
                    "{ENV_REDIS} and {ENV_ADMIN} are both set; pass --redis or --admin to pick one"
                ),
            )),
            (Some(url), None) => parse_redis_url(&url).map(Plane::Redis),
            (None, admin) => {
                parse_admin_url(admin.as_deref().unwrap_or(DEFAULT_ADMIN)).map(Plane::Admin)
            }
        }
    }
}

impl SendArgs {
    /// The target and the command name, or a usage error for the wrong number of words.
    pub(crate) fn target(&self) -> Result<(Target, &str), clap::Error> {
        let (target, name) = self.words()?;
        // The brokers' bound, checked here so that a typo is a usage error like a bad rig id.
        if name.is_empty() || name.len() > COMMAND_NAME_MAX {
            return Err(usage(
                ErrorKind::ValueValidation,
                format!("invalid command name {name:?}: 1-{COMMAND_NAME_MAX} bytes"),
            ));
        }
        Ok((target, name))
    }

    fn words(&self) -> Result<(Target, &str), clap::Error> {
        match (&self.selector, &self.second) {
            (Some(sel), None) => Ok((Target::Selector(sel.clone()), &self.first)),
            (Some(_), Some(_)) => Err(usage(
                ErrorKind::ArgumentConflict,
                "with --selector give only NAME, not RIG NAME".into(),
            )),
            (None, Some(name)) => {
                let rig =
                    parse_rig(&self.first).map_err(|e| usage(ErrorKind::ValueValidation, e))?;
                Ok((Target::Rig(rig), name))
            }
            (None, None) => Err(usage(
                ErrorKind::MissingRequiredArgument,
                "send needs RIG NAME (or --selector k=v NAME)".into(),
            )),
        }
    }
}

/// A usage error rendered like clap's own.
pub(crate) fn usage(kind: ErrorKind, msg: String) -> clap::Error {
    Cli::command().error(kind, msg)
}

fn parse_rig(s: &str) -> Result<RigId, String> {
    RigId::parse(s).ok_or_else(|| format!("invalid rig id {s:?}: 1-64 of [A-Za-z0-9._-]"))
}

/// `events --count`: clap's range said "0 is not in 1..18446744073709551615" (review bb129).
fn parse_count(s: &str) -> Result<u64, String> {
    match s.parse::<u64>() {
        Ok(n) if n >= 1 && !s.starts_with('+') => Ok(n),
        _ => Err(format!(
            "{s:?} is not a count of events, a whole number from 1 up"
        )),
    }
}

/// A duration as the broker spells them (`250ms`, `5s`, `2m`), greater than zero (and, as
/// every duration flag, at most a year, so a deadline that far ahead fits the clock).
fn parse_timeout(s: &str) -> Result<Duration, String> {
    match fleetlink::config::parse_duration(s)? {
        d if d.is_zero() => Err(format!("duration {s:?} must be greater than zero")),
        d => Ok(d),
    }
}

fn parse_selector(s: &str) -> Result<Selector, String> {
    let mut out = Selector::new();
    for pair in s.split(',') {
        let Some((k, v)) = pair.split_once('=') else {
            return Err(format!("selector pair {pair:?} is not k=v"));
        };
        if k.trim().is_empty() {
            return Err(format!("selector pair {pair:?} has an empty label"));
        }
        if out
            .insert(k.trim().to_owned(), v.trim().to_owned())
            .is_some()
        {
            return Err(format!("label {k:?} appears twice in the selector"));
        }
    }
    Ok(out)
}

fn parse_args(s: &str) -> Result<Map<String, Value>, String> {
    match serde_json::from_str(s) {
        Ok(Value::Object(map)) => Ok(map),
        Ok(_) => Err("--args must be a JSON object, e.g. '{\"path\":\"/tmp\"}'".into()),
        Err(e) => Err(format!("--args is not valid JSON: {e}")),
    }
}

fn parse_redis_url(s: &str) -> Result<String, clap::Error> {
    let ok = ["redis://", "rediss://", "unix://", "redis+unix://"]
        .iter()
        .any(|p| s.starts_with(p));
    if ok && redis::Client::open(s).is_ok() {
        return Ok(s.to_owned());
    }
    Err(usage(
        ErrorKind::ValueValidation,
        format!(
            "invalid Redis URL {:?} (expected redis://host:port/)",
            redact(s)
        ),
    ))
}

fn parse_admin_url(s: &str) -> Result<AdminUrl, clap::Error> {
    let bad = |why: &str| {
        usage(
            ErrorKind::ValueValidation,
            format!("invalid admin URL {s:?}: {why}"),
        )
    };
    let rest = match s.split_once("://") {
        Some(("http", rest)) => rest,
        Some((scheme, _)) => {
            return Err(bad(&format!(
                "scheme {scheme:?} (the admin API is plain http)"
            )))
        }
        None => s,
    };
    let (authority, prefix) = rest.split_once('/').map_or((rest, ""), |(a, p)| (a, p));
    if authority.is_empty() || authority.contains('@') {
        return Err(bad("expected http://host:port"));
    }
    // A port that is no port (`:99999`) is the user's typo, not part of a host name to look up
    // (review bb133: exit 2 "Name or service not known" for http://127.0.0.1:99999).
    let port = match authority.strip_prefix('[') {
        // An IPv6 literal: its own colons are no port's.
        Some(v6) => v6.split_once("]:").map(|(_, p)| p),
        None => authority.rsplit_once(':').map(|(_, p)| p),
    };
    if let Some(p) = port.filter(|p| !p.is_empty() && p.parse::<u16>().is_err()) {
        return Err(bad(&format!("port {p:?} is not a number from 0 to 65535")));
    }
    // Any port left is a number (checked just above).
    let has_port = port.is_some_and(|p| !p.is_empty());
    let authority = if has_port {
        authority.to_owned()
    } else {
        format!("{authority}:80")
    };
    let prefix = prefix.trim_end_matches('/');
    let prefix = if prefix.is_empty() {
        String::new()
    } else {
        format!("/{prefix}")
    };
    Ok(AdminUrl { authority, prefix })
}

/// `url` with any password replaced, for messages.
pub(crate) fn redact(url: &str) -> String {
    fleetlink::log_text::redact_url(url)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn selectors() {
        let sel = parse_selector("group=lab, site=b").unwrap();
        assert_eq!(sel.get("group").map(String::as_str), Some("lab"));
        assert_eq!(sel.get("site").map(String::as_str), Some("b"));
        assert!(parse_selector("group").is_err());
        assert!(parse_selector("=x").is_err());
        assert!(parse_selector("a=1,a=2").is_err());
    }

    #[test]
    fn admin_urls() {
        let u = parse_admin_url("http://127.0.0.1:9090/").unwrap();
        assert_eq!(
            (u.authority.as_str(), u.prefix.as_str()),
            ("127.0.0.1:9090", "")
        );
        let u = parse_admin_url("fe-1.lab/api/").unwrap();
        assert_eq!(
            (u.authority.as_str(), u.prefix.as_str()),
            ("fe-1.lab:80", "/api")
        );
        assert!(parse_admin_url("https://x:1").is_err());
        // A port that is no port is a usage error, not a host to look up (review bb133).
        for bad in ["http://127.0.0.1:99999", "http://h:x/", "[::1]:65536"] {
            assert!(parse_admin_url(bad).is_err(), "{bad}");
        }
        assert_eq!(parse_admin_url("[::1]").unwrap().authority, "[::1]:80");
        assert_eq!(
            parse_admin_url("http://[::1]:9090").unwrap().authority,
            "[::1]:9090"
        );
    }

    fn load(args: &[&str]) -> Result<(Cli, Plane), clap::Error> {
        let argv = ["fleetctl", "--admin", "http://127.0.0.1:9"].iter();
        Cli::load(argv.chain(args).map(OsString::from).collect())
    }

    #[test]
    fn timeouts_past_the_clock_are_usage_errors() {
        for args in [
            &[
                "send",
                "rig-1",
                "reboot",
                "--timeout",
                "10000000000000000000s",
            ][..],
            &[
                "send",
                "--selector",
                "g=a",
                "reboot",
                "--timeout",
                "99999999999999999999ms",
            ],
            &["kick", "rig-1", "--timeout", "9999999999999999999m"],
            &["events", "--for", "10000000000000000000s"],
        ] {
            let e = load(args).unwrap_err();
            assert_eq!(e.kind(), ErrorKind::ValueValidation, "{args:?}");
            assert!(e.to_string().contains("too long"), "{args:?}: {e}");
            // `main` prints these and exits 64 (`print_usage`).
            assert!(e.use_stderr());
        }
        assert!(load(&["send", "rig-1", "reboot", "--timeout", "8760h"]).is_ok());
    }

    #[test]
    fn a_timeout_without_a_unit_is_a_usage_error() {
        let e = load(&["send", "rig-1", "reboot", "--timeout", "5"]).unwrap_err();
        assert_eq!(e.kind(), ErrorKind::ValueValidation);
        assert!(e.to_string().contains("no unit"), "{e}");
    }

    #[test]
    fn redaction() {
        assert_eq!(redact("redis://user:pw@h:6379/"), "redis://***@h:6379/");
        assert_eq!(redact("redis://h:6379/"), "redis://h:6379/");
    }
}
