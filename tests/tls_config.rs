//! TLS config, client-certificate verification, revocation and reload, over in-memory
//! handshakes: a rustls client and server pumping records through byte buffers, no sockets.

use std::fs;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::{Duration, Instant};

use fleetlink::dev_certs::{generate_broker, generate_rig, write_crl, Ca, Issued};
use fleetlink::tls::{
    build_server_config, cert_identities, identity_matches, new_connection, peer_identities,
    ConfigCache, TlsError, TlsPaths, TlsReloader,
};
use rustls::pki_types::{CertificateDer, PrivateKeyDer, ServerName};
use rustls::{
    CertificateError, ClientConfig, ClientConnection, ConnectionCommon, ServerConfig,
    ServerConnection,
};
use time::OffsetDateTime;

#[test]
fn builds_from_good_files() {
    let pki = Pki::new("good");
    let config = build_server_config(&pki.paths(false, vec![])).expect("server only");
    assert_eq!(config.alpn_protocols, [b"http/1.1".to_vec()]);
    assert_eq!(config.send_tls13_tickets, 0);
    assert!(!config.session_storage.can_cache());
    build_server_config(&pki.paths(true, vec![])).expect("mTLS, empty CRL list");
    let crl = pki.crl("empty", &[]);
    build_server_config(&pki.paths(true, vec![crl])).expect("mTLS with a CRL");
}

#[test]
fn refuses_bad_files_and_names_them() {
    let pki = Pki::new("bad");
    let other_key = pki.issue_rig("rig-x").1;

    let mut paths = pki.paths(false, vec![]);
    paths.key = other_key.clone();
    let err = build_server_config(&paths).expect_err("key of another cert");
    assert!(matches!(err, TlsError::CertKey { .. }), "{err:?}");
    assert!(err.to_string().contains("rig-x.key"), "{err}");

    let mut paths = pki.paths(true, vec![]);
    paths.client_ca = Some(pki.dir.join("nope.pem"));
    let err = build_server_config(&paths).expect_err("missing file");
    assert!(matches!(err, TlsError::Read { .. }), "{err:?}");
    assert!(err.to_string().contains("nope.pem"), "{err}");

    let two_keys = pki.dir.join("two.key");
    let key = fs::read_to_string(&pki.broker_key).expect("key");
    fs::write(&two_keys, format!("{key}{key}")).expect("write");
    let mut paths = pki.paths(false, vec![]);
    paths.key = two_keys;
    let err = build_server_config(&paths).expect_err("two keys");
    assert!(
        matches!(err, TlsError::ManyKeys { count: 2, .. }),
        "{err:?}"
    );

    // An encrypted key is named as such, not as PEM the reader cannot parse.
    let encrypted = pki.dir.join("encrypted.key");
    fs::write(
        &encrypted,
        "-----BEGIN EC PRIVATE KEY-----\nProc-Type: 4,ENCRYPTED\nDEK-Info: AES-256-CBC,0011\n\nMHcCAQEE\n-----END EC PRIVATE KEY-----\n",
    )
    .expect("write");
    let mut paths = pki.paths(false, vec![]);
    paths.key = encrypted;
    let err = build_server_config(&paths).expect_err("encrypted key");
    assert!(matches!(err, TlsError::EncryptedKey { .. }), "{err:?}");
    assert!(err.to_string().contains("encrypted.key"), "{err}");

    let mut paths = pki.paths(false, vec![]);
    paths.cert = paths.key.clone();
    let err = build_server_config(&paths).expect_err("key as cert");
    assert!(matches!(err, TlsError::Missing { .. }), "{err:?}");

    let not_crl = pki.dir.join("not-a.crl");
    fs::write(&not_crl, "hello\n").expect("write");
    let err = build_server_config(&pki.paths(true, vec![not_crl])).expect_err("no CRL block");
    assert!(err.to_string().contains("not-a.crl"), "{err}");

    let bad_crl = pki.dir.join("bad.crl");
    fs::write(
        &bad_crl,
        "-----BEGIN X509 CRL-----\nMAA=\n-----END X509 CRL-----\n",
    )
    .unwrap();
    let err = build_server_config(&pki.paths(true, vec![bad_crl])).expect_err("bad CRL");
    assert!(matches!(err, TlsError::Crl { .. }), "{err:?}");
    assert!(err.to_string().contains("bad.crl"), "{err}");

    let crl = pki.crl("orphan", &[]);
    let err = build_server_config(&pki.paths(false, vec![crl])).expect_err("CRL without CA");
    assert!(
        matches!(err, TlsError::CrlWithoutClientCa { .. }),
        "{err:?}"
    );
}

#[test]
fn mtls_rig_cert_grants_its_id() {
    let pki = Pki::new("mtls");
    let config = build_server_config(&pki.paths(true, vec![])).expect("config");
    let (mut client, mut server) = pki.pair(&config, Some("rig-0001"), Versions::Both);
    handshake(&mut client, &mut server).expect("handshake");
    assert_eq!(
        server.protocol_version(),
        Some(rustls::ProtocolVersion::TLSv1_3)
    );
    assert_eq!(server.alpn_protocol(), Some(&b"http/1.1"[..]));
    let ids = peer_identities(&server);
    assert_eq!(ids, ["rig-0001"]);
    assert!(identity_matches(&ids, "rig-0001"));
    assert!(!identity_matches(&ids, "rig-0002"));
    exchange(&mut client, &mut server);
}

#[test]
fn tls12_only_client_works() {
    let pki = Pki::new("tls12");
    let config = build_server_config(&pki.paths(true, vec![])).expect("config");
    let (mut client, mut server) = pki.pair(&config, Some("rig-0001"), Versions::Tls12);
    handshake(&mut client, &mut server).expect("handshake");
    assert_eq!(
        server.protocol_version(),
        Some(rustls::ProtocolVersion::TLSv1_2)
    );
    assert_eq!(peer_identities(&server), ["rig-0001"]);
    exchange(&mut client, &mut server);
}

#[test]
fn without_client_ca_no_cert_is_asked() {
    let pki = Pki::new("plain");
    let config = build_server_config(&pki.paths(false, vec![])).expect("config");
    let (mut client, mut server) = pki.pair(&config, None, Versions::Both);
    handshake(&mut client, &mut server).expect("handshake");
    assert!(peer_identities(&server).is_empty());
}

#[test]
fn client_without_cert_is_refused() {
    let pki = Pki::new("nocert");
    let config = build_server_config(&pki.paths(true, vec![])).expect("config");
    let (mut client, mut server) = pki.pair(&config, None, Versions::Both);
    let err = handshake(&mut client, &mut server).expect_err("refused");
    assert_eq!(err, rustls::Error::NoCertificatesPresented);
}

#[test]
fn cert_of_another_ca_is_refused() {
    let pki = Pki::new("foreign");
    let other = Ca::new("some other CA", pki.not_before, pki.not_after).expect("ca");
    let foreign = generate_rig(&other, "rig-0001", pki.not_before, pki.not_after).expect("rig");
    let config = build_server_config(&pki.paths(true, vec![])).expect("config");
    let mut server = new_connection(config).expect("server");
    let mut client = pki.client_with(&foreign, Versions::Both);
    let err = handshake(&mut client, &mut server).expect_err("refused");
    assert_eq!(err, cert_error(CertificateError::UnknownIssuer));
}

#[test]
fn expired_cert_is_refused() {
    let pki = Pki::new("expired");
    let now = OffsetDateTime::now_utc();
    let old = generate_rig(
        &pki.ca,
        "rig-old",
        now - time::Duration::days(30),
        now - time::Duration::days(1),
    )
    .expect("rig");
    let config = build_server_config(&pki.paths(true, vec![])).expect("config");
    let mut server = new_connection(config).expect("server");
    let mut client = pki.client_with(&old, Versions::Both);
    let err = handshake(&mut client, &mut server).expect_err("refused");
    let expired = matches!(
        &err,
        rustls::Error::InvalidCertificate(
            CertificateError::Expired | CertificateError::ExpiredContext { .. }
        )
    );
    assert!(expired, "{err:?}");
}

/// The broker's own certificate out of its validity period: every rig would refuse it, so
/// it is refused at start-up, and a reload with it keeps the certificate in force.
#[test]
fn an_expired_or_future_broker_certificate_is_refused() {
    let pki = Pki::new("broker-expired");
    let now = OffsetDateTime::now_utc();
    for (tag, from, until, words) in [
        (
            "past",
            now - time::Duration::days(30),
            now - time::Duration::days(1),
            "expired since",
        ),
        (
            "future",
            now + time::Duration::days(1),
            now + time::Duration::days(30),
            "not valid before",
        ),
    ] {
        let broker = generate_broker(&pki.ca, &["localhost".into()], from, until).expect("broker");
        let (cert, key) = broker.write(&pki.dir, tag).expect("write");
        let mut paths = pki.paths(false, vec![]);
        paths.cert = cert.clone();
        paths.key = key;
        let err = build_server_config(&paths).expect_err("refused");
        assert!(matches!(err, TlsError::NotValidNow { .. }), "{err:?}");
        let text = err.to_string();
        assert!(
            text.contains(words) && text.contains(&*cert.to_string_lossy()),
            "{text}"
        );
    }
    // A valid one still builds.
    build_server_config(&pki.paths(false, vec![])).expect("valid certificate");
}

/// The certificates sent after the broker's own count as much as it: a rig refuses the whole
/// chain for an expired intermediate. Such a chain was taken at start-up and by a reload, and
/// the expiry metric showed the leaf's end, years away, so no alert would fire before every
/// reconnect failed (TLS audit of stop 46).
#[test]
fn an_expired_intermediate_is_refused_and_the_chains_end_is_its_earliest() {
    let pki = Pki::new("broker-chain");
    let now = OffsetDateTime::now_utc();
    let chain = |stem: &str, from: OffsetDateTime, until: OffsetDateTime| {
        let int = Ca::new(&format!("int {stem}"), from, until).expect("intermediate");
        let leaf = fs::read_to_string(&pki.broker_cert).expect("leaf");
        let path = pki.dir.join(format!("chain-{stem}.pem"));
        fs::write(&path, leaf + &int.cert_pem()).expect("write chain");
        let mut paths = pki.paths(false, vec![]);
        paths.cert = path;
        paths
    };
    let expired = chain(
        "expired",
        now - time::Duration::days(30),
        now - time::Duration::days(1),
    );
    let err = fleetlink::tls::build(&expired).expect_err("refused");
    let text = err.to_string();
    assert!(
        matches!(err, TlsError::NotValidNow { .. })
            && text.contains("the chain's certificate 2")
            && text.contains("int expired")
            && text.contains("expired since"),
        "{text}"
    );
    let soon = now + time::Duration::days(3);
    let (_, validity) =
        fleetlink::tls::build(&chain("soon", now - time::Duration::days(1), soon)).expect("valid");
    assert_eq!(validity.cert_not_after, Some(soon.unix_timestamp()));
}

#[test]
fn revoked_cert_is_refused_others_pass() {
    let pki = Pki::new("revoked");
    let crl = pki.crl("revoked", &[&pki.rig2]);
    let config = build_server_config(&pki.paths(true, vec![crl])).expect("config");

    let mut server = new_connection(config.clone()).expect("server");
    let mut client = pki.client_with(&pki.rig2, Versions::Both);
    let err = handshake(&mut client, &mut server).expect_err("revoked");
    assert_eq!(err, cert_error(CertificateError::Revoked));

    let (mut client, mut server) = pki.pair(&config, Some("rig-0001"), Versions::Both);
    handshake(&mut client, &mut server).expect("not revoked");
}

/// An older CRL of the same CA left beside the newer one, as two files in either order or
/// appended in one, does not un-revoke what the newer one revokes: the newest per issuer is
/// used. Before, the first listed won.
#[test]
fn an_older_crl_beside_a_newer_one_of_the_same_ca_does_not_unrevoke() {
    let pki = Pki::new("two-crls");
    let old = pki.crl("old", &[]);
    let new = pki.crl("new", &[&pki.rig2]);
    let bundle = pki.dir.join("bundle.crl");
    let appended = format!(
        "{}{}",
        fs::read_to_string(&old).expect("old"),
        fs::read_to_string(&new).expect("new")
    );
    fs::write(&bundle, appended).expect("write");
    for crls in [
        vec![old.clone(), new.clone()],
        vec![new.clone(), old.clone()],
        vec![bundle],
    ] {
        let config = build_server_config(&pki.paths(true, crls.clone())).expect("config");
        let mut server = new_connection(config.clone()).expect("server");
        let mut client = pki.client_with(&pki.rig2, Versions::Both);
        let err = handshake(&mut client, &mut server).expect_err("revoked");
        assert_eq!(err, cert_error(CertificateError::Revoked), "{crls:?}");
        let (mut client, mut server) = pki.pair(&config, Some("rig-0001"), Versions::Both);
        handshake(&mut client, &mut server).expect("not revoked");
    }
}

/// A CRL that names our CA as its issuer but is signed by another key would refuse every rig
/// of the CA at the handshake: refused at load instead, and a reload to it keeps the
/// configuration in force.
#[test]
fn a_crl_not_signed_by_the_client_ca_it_names_is_refused() {
    let pki = Pki::new("forged-crl");
    let impostor = Ca::new("fleetlink test CA", pki.not_before, pki.not_after).expect("ca");
    let forged = pki.dir.join("forged.crl");
    write_crl(&impostor, &[], &forged).expect("crl");
    let err = build_server_config(&pki.paths(true, vec![forged.clone()])).expect_err("forged");
    assert!(err.to_string().contains("is not signed by"), "{err}");
    let ours = pki.crl("ours", &[]);
    let reloader = TlsReloader::new(pki.paths(true, vec![ours.clone()])).expect("reloader");
    fs::copy(&forged, &ours).expect("replace");
    assert!(reloader.reload().is_err());
    assert_eq!(reloader.generation(), 0, "the configuration in force stays");
    let (mut client, mut server) = pki.pair(&reloader.current(), Some("rig-0001"), Versions::Both);
    handshake(&mut client, &mut server).expect("still admitted");
}

#[test]
fn cert_of_an_issuer_without_crl_is_refused_once_crls_are_given() {
    let pki = Pki::new("unknown-status");
    let other = Ca::new("second CA", pki.not_before, pki.not_after).expect("ca");
    let bundle = pki.dir.join("bundle.pem");
    let ours = fs::read_to_string(&pki.ca_cert).expect("ca");
    fs::write(&bundle, format!("{ours}{}", other.cert_pem())).expect("write");
    let second = generate_rig(&other, "rig-0009", pki.not_before, pki.not_after).expect("rig");
    let mut paths = pki.paths(true, vec![pki.crl("ours", &[])]);
    paths.client_ca = Some(bundle);
    let config = build_server_config(&paths).expect("config");
    let mut server = new_connection(config).expect("server");
    let mut client = pki.client_with(&second, Versions::Both);
    let err = handshake(&mut client, &mut server).expect_err("no CRL for its issuer");
    assert_eq!(err, cert_error(CertificateError::UnknownRevocationStatus));
}

#[test]
fn reload_revokes_for_new_handshakes_only() {
    let pki = Pki::new("reload");
    let crl = pki.crl("live", &[]);
    let reloader = TlsReloader::new(pki.paths(true, vec![crl.clone()])).expect("reloader");
    let mut cache = ConfigCache::new(reloader.clone());
    assert_eq!(reloader.generation(), 0);
    let before = reloader.current();
    assert!(Arc::ptr_eq(cache.config(), &before));

    // A connection established before the reload.
    let (mut live_client, mut live_server) = pki.pair(&before, Some("rig-0001"), Versions::Both);
    handshake(&mut live_client, &mut live_server).expect("before");

    write_crl(&pki.ca, std::slice::from_ref(&pki.rig1.serial), &crl).expect("crl");
    reloader.reload().expect("reload");
    assert_eq!(reloader.generation(), 1);
    let after = cache.config().clone();
    assert!(!Arc::ptr_eq(&after, &before));
    assert!(Arc::ptr_eq(&after, &reloader.current()));

    let (mut client, mut server) = pki.pair(&after, Some("rig-0001"), Versions::Both);
    let err = handshake(&mut client, &mut server).expect_err("revoked now");
    assert_eq!(err, cert_error(CertificateError::Revoked));

    // The config taken before still admits it, and the live connection still carries data.
    let (mut client, mut server) = pki.pair(&before, Some("rig-0001"), Versions::Both);
    handshake(&mut client, &mut server).expect("old config");
    exchange(&mut live_client, &mut live_server);
    assert_eq!(peer_identities(&live_server), ["rig-0001"]);
}

/// A CRL that only another CA issued would leave every rig certificate without a CRL of its
/// issuer, refused by every handshake: refused at load instead, and a reload to it keeps the
/// configuration in force.
#[test]
fn a_crl_of_a_ca_that_is_not_a_client_ca_is_refused() {
    let pki = Pki::new("foreign-crl");
    let other = Ca::new("someone else's CA", pki.not_before, pki.not_after).expect("ca");
    let foreign = pki.dir.join("foreign.crl");
    write_crl(&other, &[], &foreign).expect("crl");
    let err = build_server_config(&pki.paths(true, vec![foreign.clone()])).expect_err("foreign");
    assert!(
        err.to_string()
            .contains("no CRL is issued by a --client-ca"),
        "{err}"
    );
    // Beside a CRL of ours it is fine (it may be an intermediate CA's).
    let ours = pki.crl("ours", &[]);
    build_server_config(&pki.paths(true, vec![ours.clone(), foreign.clone()])).expect("both");
    let reloader = TlsReloader::new(pki.paths(true, vec![ours.clone()])).expect("reloader");
    fs::copy(&foreign, &ours).expect("replace");
    assert!(reloader.reload().is_err());
    assert_eq!(reloader.generation(), 0, "the configuration in force stays");
    let (mut client, mut server) = pki.pair(&reloader.current(), Some("rig-0001"), Versions::Both);
    handshake(&mut client, &mut server).expect("still admitted");
}

#[test]
fn failed_reload_keeps_the_config() {
    let pki = Pki::new("failed-reload");
    let paths = pki.paths(true, vec![]);
    let reloader = TlsReloader::new(paths.clone()).expect("reloader");
    let before = reloader.current();
    fs::write(&paths.key, "not a key\n").expect("write");
    let err = reloader.reload().expect_err("bad key");
    assert!(err.to_string().contains("broker.key"), "{err}");
    assert_eq!(reloader.generation(), 0);
    assert_eq!(reloader.failed_reloads(), 1, "counted for /metrics");
    assert!(Arc::ptr_eq(&reloader.current(), &before));
    let (mut client, mut server) = pki.pair(&reloader.current(), Some("rig-0001"), Versions::Both);
    handshake(&mut client, &mut server).expect("old config in force");
}

#[test]
fn reload_picks_up_a_new_server_cert() {
    let pki = Pki::new("new-cert");
    let paths = pki.paths(false, vec![]);
    let reloader = TlsReloader::new(paths.clone()).expect("reloader");
    let fresh = generate_broker(
        &pki.ca,
        &["localhost".into()],
        pki.not_before,
        pki.not_after,
    )
    .expect("broker");
    fresh.write(&pki.dir, "broker").expect("write");
    reloader.reload().expect("reload");
    let (mut client, mut server) = pki.pair(&reloader.current(), None, Versions::Both);
    handshake(&mut client, &mut server).expect("handshake");
    let served = client.peer_certificates().expect("server cert")[0].clone();
    assert_eq!(served, pem_certs(&fresh.cert_pem)[0]);
}

#[test]
fn watcher_reloads_when_the_crl_file_changes() {
    let pki = Pki::new("watch");
    let crl = pki.crl("watched", &[]);
    let reloader = TlsReloader::new(pki.paths(true, vec![crl.clone()])).expect("reloader");
    reloader
        .spawn_watcher(Duration::from_millis(20))
        .expect("watcher");
    let admitted = || {
        let (mut client, mut server) =
            pki.pair(&reloader.current(), Some("rig-0001"), Versions::Both);
        handshake(&mut client, &mut server)
    };
    admitted().expect("not revoked yet");
    write_crl(&pki.ca, std::slice::from_ref(&pki.rig1.serial), &crl).expect("crl");
    // Not the generation: another test's SIGHUP (raise(3) reaches every watcher in this
    // process) may reload before the write. Wait for what the watcher is for.
    wait_for(|| admitted() == Err(cert_error(CertificateError::Revoked)));
}

#[test]
fn watcher_reloads_on_sighup() {
    let pki = Pki::new("sighup");
    let reloader = TlsReloader::new(pki.paths(true, vec![])).expect("reloader");
    reloader
        .spawn_watcher(Duration::from_secs(3600))
        .expect("watcher");
    let start = reloader.generation();
    // SAFETY: raise(3) has no preconditions; our SIGHUP handler is registered just above, so
    // the default action (terminate) cannot happen.
    assert_eq!(unsafe { libc::raise(libc::SIGHUP) }, 0);
    wait_for(|| reloader.generation() > start);
}

#[test]
fn identities_are_cn_then_dns_sans() {
    let mut params =
        rcgen::CertificateParams::new(vec!["rig-b".into(), "rig-a".into(), "10.0.0.1".into()])
            .expect("params");
    params
        .distinguished_name
        .push(rcgen::DnType::CommonName, "rig-a");
    let key = rcgen::KeyPair::generate().expect("key");
    let cert = params.self_signed(&key).expect("cert");
    assert_eq!(cert_identities(cert.der()), ["rig-a", "rig-b"]);
}

// ---- harness ----

/// A CA, a broker cert, two rig certs and their files in a fresh temp dir (removed on drop).
struct Pki {
    dir: PathBuf,
    ca: Ca,
    ca_cert: PathBuf,
    broker_cert: PathBuf,
    broker_key: PathBuf,
    rig1: Issued,
    rig2: Issued,
    not_before: OffsetDateTime,
    not_after: OffsetDateTime,
}

#[derive(Clone, Copy)]
enum Versions {
    Both,
    Tls12,
}

impl Pki {
    fn new(tag: &str) -> Pki {
        let dir = std::env::temp_dir().join(format!("fleetlink-tls-{tag}-{}", std::process::id()));
        let _ = fs::remove_dir_all(&dir);
        fs::create_dir_all(&dir).expect("temp dir");
        let now = OffsetDateTime::now_utc();
        let (not_before, not_after) = (
            now - time::Duration::hours(1),
            now + time::Duration::days(30),
        );
        let ca = Ca::new("fleetlink test CA", not_before, not_after).expect("ca");
        let ca_cert = dir.join("ca.pem");
        fs::write(&ca_cert, ca.cert_pem()).expect("ca.pem");
        let broker =
            generate_broker(&ca, &["localhost".into()], not_before, not_after).expect("broker");
        let (broker_cert, broker_key) = broker.write(&dir, "broker").expect("write");
        let rig1 = generate_rig(&ca, "rig-0001", not_before, not_after).expect("rig1");
        let rig2 = generate_rig(&ca, "rig-0002", not_before, not_after).expect("rig2");
        Pki {
            dir,
            ca,
            ca_cert,
            broker_cert,
            broker_key,
            rig1,
            rig2,
            not_before,
            not_after,
        }
    }

    fn paths(&self, mtls: bool, crl: Vec<PathBuf>) -> TlsPaths {
        TlsPaths {
            cert: self.broker_cert.clone(),
            key: self.broker_key.clone(),
            client_ca: mtls.then(|| self.ca_cert.clone()),
            crl,
        }
    }

    fn crl(&self, stem: &str, revoked: &[&Issued]) -> PathBuf {
        let path = self.dir.join(format!("{stem}.crl"));
        let serials: Vec<_> = revoked.iter().map(|r| r.serial.clone()).collect();
        write_crl(&self.ca, &serials, &path).expect("crl");
        path
    }

    fn issue_rig(&self, rig_id: &str) -> (PathBuf, PathBuf) {
        generate_rig(&self.ca, rig_id, self.not_before, self.not_after)
            .expect("rig")
            .write(&self.dir, rig_id)
            .expect("write")
    }

    /// A client (with rig1's or rig2's cert, or none) and a server on `config`.
    fn pair(
        &self,
        config: &Arc<ServerConfig>,
        rig: Option<&str>,
        versions: Versions,
    ) -> (ClientConnection, ServerConnection) {
        let server = new_connection(config.clone()).expect("server");
        let client = match rig {
            Some("rig-0001") => self.client_with(&self.rig1, versions),
            Some("rig-0002") => self.client_with(&self.rig2, versions),
            Some(other) => panic!("no cert for {other}"),
            None => self.client(None, versions),
        };
        (client, server)
    }

    fn client_with(&self, rig: &Issued, versions: Versions) -> ClientConnection {
        self.client(Some(rig), versions)
    }

    fn client(&self, rig: Option<&Issued>, versions: Versions) -> ClientConnection {
        let mut roots = rustls::RootCertStore::empty();
        for cert in pem_certs(&self.ca.cert_pem()) {
            roots.add(cert).expect("root");
        }
        let versions: &[&'static rustls::SupportedProtocolVersion] = match versions {
            Versions::Both => &[&rustls::version::TLS13, &rustls::version::TLS12],
            Versions::Tls12 => &[&rustls::version::TLS12],
        };
        let builder =
            ClientConfig::builder_with_provider(Arc::new(rustls::crypto::ring::default_provider()))
                .with_protocol_versions(versions)
                .expect("versions")
                .with_root_certificates(roots);
        let mut config = match rig {
            Some(rig) => builder
                .with_client_auth_cert(pem_certs(&rig.cert_pem), pem_key(&rig.key_pem))
                .expect("client cert"),
            None => builder.with_no_client_auth(),
        };
        config.alpn_protocols = vec![b"http/1.1".to_vec()];
        let name = ServerName::try_from("localhost").expect("name");
        ClientConnection::new(Arc::new(config), name).expect("client")
    }
}

impl Drop for Pki {
    fn drop(&mut self) {
        let _ = fs::remove_dir_all(&self.dir);
    }
}

/// Pumps records both ways until neither side has anything to say. The server's error, if
/// any, else the client's.
fn handshake(
    client: &mut ClientConnection,
    server: &mut ServerConnection,
) -> Result<(), rustls::Error> {
    for _ in 0..32 {
        let to_server = drain(client);
        let to_client = drain(server);
        if to_server.is_empty() && to_client.is_empty() {
            return match (server.is_handshaking(), client.is_handshaking()) {
                (false, false) => Ok(()),
                _ => Err(rustls::Error::General("handshake stalled".into())),
            };
        }
        feed(server, &to_server)?;
        feed(client, &to_client)?;
    }
    Err(rustls::Error::General("handshake did not settle".into()))
}

fn drain<D>(conn: &mut ConnectionCommon<D>) -> Vec<u8> {
    let mut buf = Vec::new();
    while conn.wants_write() {
        conn.write_tls(&mut buf).expect("write_tls into a Vec");
    }
    buf
}

fn feed<D>(conn: &mut ConnectionCommon<D>, mut bytes: &[u8]) -> Result<(), rustls::Error> {
    while !bytes.is_empty() {
        conn.read_tls(&mut bytes).expect("read_tls from a slice");
        conn.process_new_packets()?;
    }
    Ok(())
}

/// One message each way over an established pair.
fn exchange(client: &mut ClientConnection, server: &mut ServerConnection) {
    use std::io::{Read, Write};
    client.writer().write_all(b"ping").expect("client write");
    handshake(client, server).expect("pump");
    let mut got = [0u8; 4];
    server.reader().read_exact(&mut got).expect("server read");
    assert_eq!(&got, b"ping");
    server.writer().write_all(b"pong").expect("server write");
    handshake(client, server).expect("pump");
    client.reader().read_exact(&mut got).expect("client read");
    assert_eq!(&got, b"pong");
}

fn cert_error(e: CertificateError) -> rustls::Error {
    rustls::Error::InvalidCertificate(e)
}

fn pem_certs(pem: &str) -> Vec<CertificateDer<'static>> {
    rustls_pemfile::certs(&mut pem.as_bytes())
        .collect::<Result<_, _>>()
        .expect("certs")
}

fn pem_key(pem: &str) -> PrivateKeyDer<'static> {
    rustls_pemfile::private_key(&mut pem.as_bytes())
        .expect("pem")
        .expect("a key")
}

/// Polls `done` every 10 ms for up to 10 s.
fn wait_for(done: impl Fn() -> bool) {
    let deadline = Instant::now() + Duration::from_secs(10);
    while !done() {
        assert!(Instant::now() < deadline, "timed out");
        std::thread::sleep(Duration::from_millis(10));
    }
}
