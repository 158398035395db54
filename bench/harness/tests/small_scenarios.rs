//! Every `fleetlink-bench` scenario, small and fast: each against fleetlink-fe and the
//! baseline(s) in one invocation, as on demand, to prove that the harness runs them end to end
//! and writes complete result files. These do not measure anything; `bench/run` does.
//!
//! They run the workspace's binaries from the directory `fleetlink-bench` was built into
//! (`cargo test --workspace` builds fleetlink-fe, the baseline and the loadgen there too).
//! The accept storm's fleet-mode brokers need `redis-server` (`tests/run-all.sh` installs it).

use std::path::{Path, PathBuf};
use std::process::{Command, ExitStatus};
use std::time::{Duration, Instant};

use serde_json::Value;

/// How long one small scenario may run (they take well under a minute each on 2 CPUs).
const SCENARIO_LIMIT: Duration = Duration::from_secs(300);
/// How long drawing the plots may take.
const PLOTS_LIMIT: Duration = Duration::from_secs(60);

/// Where fleetlink-bench and its sibling binaries are.
fn bin_dir() -> PathBuf {
    let dir = Path::new(env!("CARGO_BIN_EXE_fleetlink-bench"))
        .parent()
        .expect("a directory")
        .to_path_buf();
    for bin in [
        "fleetlink-fe",
        "fleetlink-tokio-baseline",
        "fleetlink-loadgen",
    ] {
        assert!(
            dir.join(bin).is_file(),
            "{bin} is not in {}: run `cargo test --workspace`, which builds it",
            dir.display()
        );
    }
    dir
}

/// Runs `cmd` to its end, or kills it and panics after `limit` (the harness's own children get
/// PR_SET_PDEATHSIG, so they go with it).
fn status_within(cmd: &mut Command, limit: Duration) -> ExitStatus {
    let mut child = cmd
        .spawn()
        .unwrap_or_else(|e| panic!("{cmd:?} does not start: {e}"));
    let deadline = Instant::now() + limit;
    loop {
        if let Some(status) = child.try_wait().expect("wait for fleetlink-bench") {
            return status;
        }
        if Instant::now() >= deadline {
            let _ = child.kill();
            let _ = child.wait();
            panic!("{cmd:?} still running after {limit:?}: killed");
        }
        std::thread::sleep(Duration::from_millis(50));
    }
}

/// Runs one scenario into a fresh results directory and returns its JSON. Every broker binds
/// port 0 and the harness reads the ports it got from the broker's start-up line: nothing to
/// pick, nothing another test or a loadgen socket can take between two brokers.
fn scenario(name: &str, args: &[&str]) -> Value {
    let out = tempfile::tempdir().expect("tempdir");
    let dir = bin_dir();
    let status = status_within(
        Command::new(dir.join("fleetlink-bench"))
            .arg(name)
            .args(["--rounds", "1", "--bin-dir"])
            .arg(&dir)
            .arg("--out")
            .arg(out.path())
            .args(["--listen-port", "0", "--admin-port", "0"])
            .args(args),
        SCENARIO_LIMIT,
    );
    assert!(
        status.success(),
        "fleetlink-bench {name} {args:?}: {status}"
    );
    let md = std::fs::read_to_string(out.path().join(format!("{name}.md"))).expect("markdown");
    assert!(md.contains("| broker |"), "{md}");
    let json = std::fs::read_to_string(out.path().join(format!("{name}.json"))).expect("json");
    serde_json::from_str(&json).expect("valid JSON")
}

/// Every broker in the summary ran once and completed.
fn all_complete(doc: &Value, brokers: &[&str]) {
    for b in brokers {
        let s = &doc["summary"][b];
        assert_eq!(
            (s["runs"].as_u64(), s["complete"].as_u64()),
            (Some(1), Some(1)),
            "{b}: {s}"
        );
    }
}

#[test]
fn accept_storm_standalone_and_in_fleet_mode() {
    let brokers = [
        "fleetlink-fe-bucket-off",
        "tokio-baseline-rb4096",
        "fleetlink-fe-redis",
        "tokio-baseline-redis-rb4096",
    ];
    let doc = scenario(
        "accept-storm",
        &[
            "--rigs",
            "300",
            "--procs",
            "1",
            "--concurrency",
            "64",
            "--brokers",
            &brokers.join(","),
        ],
    );
    all_complete(&doc, &brokers);
    for run in doc["runs"].as_array().expect("runs") {
        assert_eq!(run["welcomed"], 300, "{run}");
        let fleet = run["broker"].as_str().is_some_and(|b| b.contains("redis"));
        // In fleet mode every lease is in Redis, and Redis's CPU is counted.
        assert_eq!(
            run["leases_in_redis"].as_u64(),
            fleet.then_some(300),
            "{run}"
        );
        assert_eq!(run["redis_cpu_s"].is_number(), fleet, "{run}");
        // The baseline runs hello.lua once per rig; fleetlink-fe a call per batch of hellos
        // (and one more for their sessions).
        let calls = run["redis_script_calls"].as_u64();
        match run["broker"].as_str() {
            Some("tokio-baseline-redis-rb4096") => {
                assert!(calls.is_some_and(|c| c >= 300), "{run}")
            }
            Some("fleetlink-fe-redis") => assert!(calls.is_some_and(|c| c < 300), "{run}"),
            _ => assert_eq!(calls, None, "{run}"),
        }
    }
}

#[test]
fn idle_cost_small() {
    let brokers = [
        "fleetlink-fe",
        "tokio-baseline-default",
        "tokio-baseline-rb4096",
    ];
    let doc = scenario(
        "idle-cost",
        &[
            "--rigs", "200", "--window", "2s", "--settle", "0s", "--spread", "0s",
        ],
    );
    all_complete(&doc, &brokers);
    // Over 2 s with pings every 20 s a broker may well read 0: the figure is there, not big.
    for b in brokers {
        let s = &doc["summary"][b];
        assert!(
            s["cpu_s_per_min_median"].as_f64().is_some_and(|c| c >= 0.0),
            "{b}: {s}"
        );
        assert!(
            s["rss_mib_median"].as_f64().is_some_and(|m| m > 1.0),
            "{b}: {s}"
        );
    }
}

#[test]
fn throughput_small() {
    let brokers = ["fleetlink-fe-cores1", "tokio-baseline-rb4096"];
    let doc = scenario(
        "throughput",
        &[
            "--rigs",
            "50",
            "--duration",
            "2s",
            "--conns",
            "2",
            "--brokers",
            &brokers.join(","),
        ],
    );
    all_complete(&doc, &brokers);
    for b in brokers {
        let acked = doc["summary"][b]["acked_per_s_median"].as_f64();
        assert!(acked.is_some_and(|a| a > 0.0), "{b}: {acked:?}");
    }
}

#[test]
fn plots_draw_the_committed_results() {
    let out = tempfile::tempdir().expect("tempdir");
    let results = Path::new(env!("CARGO_MANIFEST_DIR")).join("../results");
    for entry in std::fs::read_dir(&results).expect("bench/results") {
        let path = entry.expect("entry").path();
        let name = path
            .file_name()
            .and_then(|n| n.to_str())
            .unwrap_or_default();
        let wanted = name.ends_with(".json")
            && (name.starts_with("density-fleetlink") || name.starts_with("latency-fleetlink"));
        if wanted {
            std::fs::copy(&path, out.path().join(name)).expect("copy");
        }
    }
    let status = status_within(
        Command::new(bin_dir().join("fleetlink-bench"))
            .args(["plots", "--out"])
            .arg(out.path()),
        PLOTS_LIMIT,
    );
    assert!(status.success());
    for svg in ["density.svg", "latency-single.svg", "latency-fanout.svg"] {
        let text = std::fs::read_to_string(out.path().join(svg)).expect(svg);
        assert!(text.contains("fleetlink-fe"), "{svg} names its broker");
    }
    // A run that wrote no files draws nothing and says so.
    let status = status_within(
        Command::new(bin_dir().join("fleetlink-bench"))
            .args(["plots", "--name", "no-such-run", "--out"])
            .arg(out.path()),
        PLOTS_LIMIT,
    );
    assert!(!status.success());
    assert!(!out.path().join("latency-single-no-such-run.svg").exists());
}

/// The scenarios written as scripts are reached through `fleetlink-bench` as through
/// `bench/run`: each subcommand hands its arguments to its own script (here `--help`, which
/// every script answers with its usage and nothing run).
#[test]
fn the_script_scenarios_are_reached_through_the_harness_too() {
    for (scenario, script) in [
        ("density", "compare-density.sh"),
        ("latency", "latency.sh"),
        ("tls", "tls.sh"),
        ("redis-restart", "redis-restart.sh"),
    ] {
        let out = Command::new(env!("CARGO_BIN_EXE_fleetlink-bench"))
            .args([scenario, "--help"])
            .output()
            .expect("fleetlink-bench runs");
        let text = String::from_utf8_lossy(&out.stdout);
        assert!(
            out.status.success() && text.contains(script),
            "{scenario}: {:?}\n{text}{}",
            out.status,
            String::from_utf8_lossy(&out.stderr)
        );
    }
}
