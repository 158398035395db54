//! Which source wins (command line, environment, `--config` file) is its own concern: clap knows
//! nothing of the file, so its values are spliced into the argv here, but for keys already set.

use std::ffi::OsString;

use clap::parser::ValueSource;
use clap::{ArgAction, CommandFactory, FromArgMatches, Parser};

use super::flags::Cli;

/// Environment variables of the `FLEETLINK_` prefix that name no broker option (a typo, say
/// `FLEETLINK_PING_INTERVL`), which clap ignores: said at start, or a setting the operator
/// believes in force silently is not. `FLEETLINK_AGENT_*` belongs to `fleetlink-agent`, and
/// `FLEETLINK_FAILPOINT` to the tests.
pub fn unknown_env(vars: impl Iterator<Item = String>) -> Vec<String> {
    let cmd = Cli::command();
    let known: Vec<String> = cmd
        .get_arguments()
        .filter_map(|a| a.get_env())
        .map(|e| e.to_string_lossy().into_owned())
        .collect();
    let mut unknown: Vec<String> = vars
        .filter(|v| v.starts_with("FLEETLINK_") && !v.starts_with("FLEETLINK_AGENT_"))
        .filter(|v| v != "FLEETLINK_FAILPOINT" && !known.contains(v))
        .collect();
    unknown.sort();
    unknown
}

/// Adds a tip to clap's "unexpected argument" when the argument is a broker flag given after
/// `doctor` or `dev-certs` (`fleetlink-fe doctor --cores 2`), which take only their own: the
/// broker's flags go before the tool's name.
fn placed_after_a_tool(mut e: clap::Error, argv: &[OsString]) -> clap::Error {
    use clap::error::{ContextKind, ContextValue, ErrorKind};
    if e.kind() != ErrorKind::UnknownArgument {
        return e;
    }
    let Some(ContextValue::String(arg)) = e.get(ContextKind::InvalidArg) else {
        return e;
    };
    let name = arg.split('=').next().unwrap_or_default();
    let Some(long) = name.strip_prefix("--") else {
        return e;
    };
    let cmd = Cli::command();
    let broker_flag = cmd.get_arguments().any(|a| a.get_long() == Some(long));
    let tool = argv.iter().skip(1).find_map(|a| {
        let a = a.to_str()?;
        cmd.get_subcommands().find(|t| t.get_name() == a)
    });
    if let (true, Some(tool)) = (broker_flag, tool) {
        let tip = format!(
            "{name} is a broker flag: give it before the tool's name \
             (`fleetlink-fe {name} ... {} ...`)",
            tool.get_name()
        );
        e.insert(
            ContextKind::Suggested,
            ContextValue::StyledStrs(vec![tip.into()]),
        );
    }
    e
}

impl Cli {
    /// Parses argv + env, then fills flags still at their defaults from `--config`.
    pub fn load(argv: Vec<OsString>) -> anyhow::Result<Cli> {
        let matches = Cli::command()
            .try_get_matches_from(&argv)
            .map_err(|e| placed_after_a_tool(e, &argv))?;
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn unknown_fleetlink_variables_are_named_and_known_ones_are_not() {
        let vars = [
            "FLEETLINK_PING_INTERVAL",
            "FLEETLINK_PING_INTERVL",
            "FLEETLINK_AGENT_URL",
            "FLEETLINK_FAILPOINT",
            "HOME",
            "FLEETLINK_REDIS",
            "FLEETLINK_JWT_KEY",
        ];
        let unknown = unknown_env(vars.iter().map(|v| v.to_string()));
        assert_eq!(unknown, ["FLEETLINK_PING_INTERVL"]);
    }

    /// A broker flag after a tool's name gets a tip to move it; a flag no one knows does not.
    #[test]
    fn a_broker_flag_after_a_tool_gets_a_tip_to_move_it() {
        let render = |args: &[&str]| {
            let argv = std::iter::once("fleetlink-fe").chain(args.iter().copied());
            let e = Cli::load(argv.map(OsString::from).collect()).unwrap_err();
            e.downcast::<clap::Error>().unwrap().to_string()
        };
        let tip = "tip: --cores is a broker flag: give it before the tool's name \
                   (`fleetlink-fe --cores ... doctor ...`)";
        assert!(render(&["doctor", "--cores", "2"]).contains(tip));
        assert!(render(&["doctor", "--cores=2"]).contains(tip));
        assert!(render(&["dev-certs", "--cores", "2"])
            .contains("(`fleetlink-fe --cores ... dev-certs ...`)"));
        assert!(!render(&["doctor", "--corse", "2"]).contains("broker flag"));
    }
    use crate::config::testing::{config_file, load};
    use crate::config::Tool;
    use std::path::PathBuf;
    use std::time::Duration;

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

    /// A number that is not one says so, its range beside it (review bb129: clap's own parser
    /// answered "invalid digit found in string", and to `-1` "unexpected argument '-1' found").
    #[test]
    fn a_number_flag_that_is_not_a_number_says_so() {
        for (args, says) in [
            (
                &["--outbox", "-1"][..],
                r#""-1" is not a whole number from 0 to 4294967295"#,
            ),
            (
                &["--max-message", "16MiB"],
                r#""16MiB" is not a whole number from 0 to"#,
            ),
            (
                &["--max-connections", "99999999999999999999"],
                "is more than 18446744073709551615",
            ),
            (
                &["--accept-burst", "4294967296"],
                "4294967296 is more than 4294967295",
            ),
            (
                &["--backlog", "4294967296"],
                "4294967296 is more than 2147483647",
            ),
            (
                &["--rig-rate", "fast"],
                r#""fast" is not a number per second"#,
            ),
            (
                &["--accept-rate", "1e"],
                r#""1e" is not a number per second"#,
            ),
            (&["--cores", "-1"], r#""-1" is not a number of cores"#),
        ] {
            let e = load(args).expect_err(&format!("{args:?} taken"));
            assert!(format!("{e:#}").contains(says), "{args:?}: {e:#}");
        }
        // Past the parse, negative rates and a zero backlog are the range checks' to refuse.
        for args in [&["--rig-rate", "-1"][..], &["--backlog", "0"]] {
            let e = load(args).expect_err(&format!("{args:?} taken"));
            assert!(
                !format!("{e:#}").contains("unexpected argument"),
                "{args:?}: {e:#}"
            );
        }
        assert_eq!(load(&["--outbox", " 7 "]).unwrap().outbox, 7);
        assert!(load(&["--outbox", "+7"]).is_err());
        // A duration takes a leading `-` as its value too, for its own message.
        let e = load(&["--drain", "-1s"]).unwrap_err();
        assert!(format!("{e:#}").contains("bad duration"), "{e:#}");
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
}
