//! `fleetlink-fe doctor` as a deploy gate: what the broker would refuse at start, doctor
//! refuses too (exit 1, the same message), and a host check asks for at least one connection.

mod common;

use std::process::Command;
use std::time::Duration;

use common::process::output_within;

fn doctor(args: &[&str]) -> (Option<i32>, String) {
    // Bounded: doctor taken for the broker itself would serve until killed.
    let out = output_within(
        Command::new(env!("CARGO_BIN_EXE_fleetlink-fe"))
            .args(args)
            .env_remove("RUST_LOG"),
        Duration::from_secs(30),
    );
    (
        out.status.code(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

#[test]
fn doctor_refuses_what_the_broker_would_refuse_at_start() {
    let (code, err) = doctor(&["--cores", "2000", "doctor", "--connections", "10"]);
    assert_eq!(code, Some(1), "{err}");
    assert!(err.contains("--cores 2000"), "{err}");
    let missing = [
        "--tls-cert",
        "/nonexistent/c.pem",
        "--tls-key",
        "/nonexistent/k.pem",
    ];
    let (code, err) = doctor(&[&missing[..], &["doctor", "--connections", "10"]].concat());
    assert_eq!(code, Some(1), "{err}");
    assert!(err.contains("/nonexistent/c.pem"), "{err}");
    let (code, err) = doctor(&["--tls-cert", "c.pem", "doctor", "--connections", "10"]);
    assert_eq!(code, Some(1), "{err}");
    assert!(err.contains("--tls-key"), "{err}");
    let (code, err) = doctor(&["--redis", "http://x", "doctor", "--connections", "10"]);
    assert_eq!(code, Some(1), "{err}");
    // A host check for no connections at all is a usage error.
    let (code, err) = doctor(&["doctor", "--connections", "0"]);
    assert_eq!(code, Some(2), "{err}");
    // So is one that is not a count, said as such, a negative one too.
    for bad in ["-1", "1e6", "1_000"] {
        let (code, err) = doctor(&["doctor", "--connections", bad]);
        assert_eq!(code, Some(2), "{err}");
        assert!(
            err.contains("a whole number of connections, 1 or more"),
            "{err}"
        );
    }
    // Ten connections fit this host (its own limit is 20,000 open files).
    let (code, err) = doctor(&["doctor", "--connections", "10"]);
    assert_eq!(code, Some(0), "{err}");
}

/// The broker's own cap is part of what stops N connections: a host that could hold them, with
/// `--max-connections` below N (as a flag or from the environment, as a unit sets it), fails
/// the check and says the fix.
#[test]
fn doctor_blocks_a_max_connections_below_the_count_asked_for() {
    let stdout = |args: &[&str], env: &[(&str, &str)]| {
        let out = output_within(
            Command::new(env!("CARGO_BIN_EXE_fleetlink-fe"))
                .args(args)
                .envs(env.iter().copied())
                .env_remove("RUST_LOG"),
            Duration::from_secs(30),
        );
        (
            out.status.code(),
            String::from_utf8_lossy(&out.stdout).into_owned(),
        )
    };
    let check = ["doctor", "--connections", "10"];
    let (code, out) = stdout(&[&["--max-connections", "5"], &check[..]].concat(), &[]);
    assert_eq!(code, Some(1), "{out}");
    assert!(out.contains("[BLOCKS] --max-connections = 5"), "{out}");
    assert!(out.contains("fix:    --max-connections 10"), "{out}");
    let (code, out) = stdout(&check, &[("FLEETLINK_MAX_CONNECTIONS", "5")]);
    assert_eq!(code, Some(1), "{out}");
    let (code, out) = stdout(&check, &[("FLEETLINK_MAX_CONNECTIONS", "10")]);
    assert_eq!(code, Some(0), "{out}");
    assert!(out.contains("[    ok] --max-connections = 10"), "{out}");
}
