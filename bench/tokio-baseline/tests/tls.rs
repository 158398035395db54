//! wss on the baseline, driven by the load generator's TLS client: server-auth TLS (the density
//! and handshake benches' setup), the verification name, and mTLS with `--client-ca`.

use std::path::{Path, PathBuf};

use clap::Parser;
use fleetlink_loadgen::cli::{Cli, Command as LgCommand};
use rcgen::{BasicConstraints, CertificateParams, DnType, ExtendedKeyUsagePurpose, IsCa, KeyPair};
use serde_json::Value;

mod common;
use common::{http_get, Broker};

fn start_broker(extra: &[&str]) -> Broker {
    let mut args = vec![
        "--workers",
        "2",
        "--read-buffer",
        "4096",
        "--write-buffer",
        "0",
    ];
    args.extend_from_slice(extra);
    common::start("baseline", &args)
}

/// CA, a server cert for `localhost` and a client cert, as PEM files in `dir`.
struct Pki {
    ca: PathBuf,
    server: (PathBuf, PathBuf),
    client: (PathBuf, PathBuf),
}

fn pki(dir: &Path) -> Pki {
    let ca_key = KeyPair::generate().unwrap();
    let mut p = CertificateParams::new(Vec::<String>::new()).unwrap();
    p.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
    p.distinguished_name
        .push(DnType::CommonName, "baseline test CA");
    let ca = p.self_signed(&ca_key).unwrap();
    let issue = |name: &str, eku: ExtendedKeyUsagePurpose, file: &str| {
        let key = KeyPair::generate().unwrap();
        let mut p = CertificateParams::new(vec![name.to_string()]).unwrap();
        p.distinguished_name.push(DnType::CommonName, name);
        p.extended_key_usages = vec![eku];
        let cert = p.signed_by(&key, &ca, &ca_key).unwrap();
        let (c, k) = (
            dir.join(format!("{file}.pem")),
            dir.join(format!("{file}.key")),
        );
        std::fs::write(&c, cert.pem()).unwrap();
        std::fs::write(&k, key.serialize_pem()).unwrap();
        (c, k)
    };
    let server = issue("localhost", ExtendedKeyUsagePurpose::ServerAuth, "server");
    let client = issue("rig-000000", ExtendedKeyUsagePurpose::ClientAuth, "client");
    let ca_path = dir.join("ca.pem");
    std::fs::write(&ca_path, ca.pem()).unwrap();
    Pki {
        ca: ca_path,
        server,
        client,
    }
}

/// Runs `fleetlink-loadgen rigs` in-process; returns its exit code and JSON report. Each run
/// gets its own `report` path (one that does not exist yet), so a run that writes no report
/// fails here instead of reading the previous run's.
async fn rigs(args: &[&str], report: &Path) -> (i32, Value) {
    assert!(
        !report.exists(),
        "{} is reused: give every run its own report",
        report.display()
    );
    let mut full = vec![
        "fleetlink-loadgen",
        "rigs",
        "--procs",
        "1",
        "--hold",
        "500ms",
    ];
    full.extend_from_slice(args);
    full.extend_from_slice(&["--max-time", "30s", "--report", report.to_str().unwrap()]);
    let LgCommand::Rigs(a) = Cli::parse_from(full).cmd else {
        unreachable!()
    };
    let code = fleetlink_loadgen::orchestrator::run_parent(a)
        .await
        .unwrap();
    let text = std::fs::read_to_string(report)
        .unwrap_or_else(|e| panic!("run {args:?} wrote no report {}: {e}", report.display()));
    let r = serde_json::from_str(&text).unwrap();
    (code, r)
}

fn s(p: &Path) -> &str {
    p.to_str().unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn twenty_rigs_over_wss_verified_as_localhost() {
    let dir = tempfile::tempdir().unwrap();
    let pki = pki(dir.path());
    let b = start_broker(&[
        "--tls-cert",
        s(&pki.server.0),
        "--tls-key",
        s(&pki.server.1),
    ]);
    assert!(b.banner.contains("tls=server-auth"), "{}", b.banner);
    let port = b.rigs.rsplit(':').next().unwrap();
    let url = format!("wss://127.0.0.1:{port}/agent");

    let (code, r) = rigs(
        &["--url", &url, "--rigs", "20", "--ca", s(&pki.ca)],
        &dir.path().join("verified.json"),
    )
    .await;
    assert_eq!(code, 0, "{r:#}");
    assert_eq!(r["welcomed"], 20, "{r:#}");
    assert_eq!(r["handshake_us"]["count"], 20, "{r:#}");
    assert_eq!(r["dropped_after_welcome"], 0, "{r:#}");
    let metrics = http_get(&b.admin, "/metrics").await;
    assert!(
        metrics.contains("fleetlink_accepts_total{result=\"ok\"} 20\n"),
        "{metrics}"
    );

    // The certificate names localhost, not this name: the rig refuses the broker.
    let (code, r) = rigs(
        &[
            "--url",
            &url,
            "--rigs",
            "1",
            "--ca",
            s(&pki.ca),
            "--server-name",
            "elsewhere.example",
        ],
        &dir.path().join("wrong-name.json"),
    )
    .await;
    assert_eq!(code, 2, "{r:#}");
    assert_eq!(
        r["failed_by_reason"]["tls_bad_server_cert_notvalidfornamecontext"], 1,
        "{r:#}"
    );
    // Plain ws against the TLS port gets no upgrade.
    let (code, r) = rigs(
        &[
            "--url",
            &format!("ws://127.0.0.1:{port}/agent"),
            "--rigs",
            "1",
            "--handshake-timeout",
            "5s",
        ],
        &dir.path().join("plain-ws.json"),
    )
    .await;
    assert_eq!(code, 2, "{r:#}");
    assert_eq!(r["welcomed"], 0, "{r:#}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn client_ca_requires_a_client_certificate() {
    let dir = tempfile::tempdir().unwrap();
    let pki = pki(dir.path());
    let b = start_broker(&[
        "--tls-cert",
        s(&pki.server.0),
        "--tls-key",
        s(&pki.server.1),
        "--client-ca",
        s(&pki.ca),
    ]);
    assert!(b.banner.contains("tls=mtls"), "{}", b.banner);
    let port = b.rigs.rsplit(':').next().unwrap();
    let url = format!("wss://127.0.0.1:{port}/agent");

    let (code, r) = rigs(
        &["--url", &url, "--rigs", "1", "--ca", s(&pki.ca)],
        &dir.path().join("no-client-cert.json"),
    )
    .await;
    assert_eq!(code, 2, "{r:#}");
    assert_eq!(
        r["failed_by_reason"]["tls_alert_certificaterequired"], 1,
        "{r:#}"
    );

    let (code, r) = rigs(
        &[
            "--url",
            &url,
            "--rigs",
            "1",
            "--ca",
            s(&pki.ca),
            "--tls-cert",
            s(&pki.client.0),
            "--tls-key",
            s(&pki.client.1),
        ],
        &dir.path().join("client-cert.json"),
    )
    .await;
    assert_eq!(code, 0, "{r:#}");
    assert_eq!(r["welcomed"], 1, "{r:#}");
    let metrics = http_get(&b.admin, "/metrics").await;
    assert!(
        metrics.contains("fleetlink_accepts_total{result=\"tls_error\"} 1\n"),
        "{metrics}"
    );
    assert!(
        metrics.contains("fleetlink_accepts_total{result=\"ok\"} 1\n"),
        "{metrics}"
    );
}
