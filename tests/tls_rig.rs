//! wss and mTLS (CONTRACT.md §1–2): the rig's identity is its certificate, revocation takes
//! effect on the next handshake without a restart, and bearer tokens gate upgrades and
//! commands. Certificates come from `fleetlink-fe dev-certs`' generator; the rig side is
//! tungstenite over rustls, a client we did not write.

mod common;

use std::io::{ErrorKind, Read, Write};
use std::net::TcpStream;
use std::path::Path;
use std::sync::Arc;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use common::broker::{boot_id, eventually, read_close, read_json, Broker};
use common::jwt::{now_s, Signer};
use fleetlink::dev_certs::{self, Summary};
use rustls::pki_types::ServerName;
use serde_json::json;
use tungstenite::{Message, WebSocket};

type TlsWs = WebSocket<rustls::StreamOwned<rustls::ClientConnection, TcpStream>>;

use common::scratch::Scratch as Dir;

fn certs(path: &Path) -> Vec<rustls::pki_types::CertificateDer<'static>> {
    rustls_pemfile::certs(&mut std::io::BufReader::new(
        std::fs::File::open(path).unwrap(),
    ))
    .map(Result::unwrap)
    .collect()
}

fn client_config(ca: &Path, cert: Option<(&Path, &Path)>) -> Arc<rustls::ClientConfig> {
    let mut roots = rustls::RootCertStore::empty();
    for c in certs(ca) {
        roots.add(c).unwrap();
    }
    let provider = Arc::new(rustls::crypto::ring::default_provider());
    let builder = rustls::ClientConfig::builder_with_provider(provider)
        .with_safe_default_protocol_versions()
        .unwrap()
        .with_root_certificates(roots);
    let config = match cert {
        Some((cert, key)) => {
            let key = rustls_pemfile::private_key(&mut std::io::BufReader::new(
                std::fs::File::open(key).unwrap(),
            ))
            .unwrap()
            .unwrap();
            builder.with_client_auth_cert(certs(cert), key).unwrap()
        }
        None => builder.with_no_client_auth(),
    };
    Arc::new(config)
}

/// A wss connection with the given client certificate; Err when TLS or the upgrade fails.
fn wss(
    b: &Broker,
    ca: &Path,
    cert: Option<(&Path, &Path)>,
    headers: &[(&'static str, String)],
) -> Result<TlsWs, String> {
    let tcp = TcpStream::connect(b.listen).unwrap();
    tcp.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
    let conn = rustls::ClientConnection::new(
        client_config(ca, cert),
        ServerName::try_from("localhost").unwrap(),
    )
    .unwrap();
    let stream = rustls::StreamOwned::new(conn, tcp);
    let mut req = tungstenite::client::IntoClientRequest::into_client_request(format!(
        "wss://localhost:{}/agent",
        b.listen.port()
    ))
    .unwrap();
    for (k, v) in headers {
        req.headers_mut().insert(*k, v.parse().unwrap());
    }
    tungstenite::client(req, stream)
        .map(|(ws, _)| ws)
        .map_err(|e| e.to_string())
}

fn hello(ws: &mut TlsWs, rig: &str) -> serde_json::Value {
    let msg = json!({"type":"hello","rig_id":rig,"boot_id":boot_id(),"version":"tls-test"});
    ws.send(Message::Text(msg.to_string().into())).unwrap();
    loop {
        match ws.read().unwrap() {
            Message::Text(t) => return serde_json::from_str(t.as_str()).unwrap(),
            Message::Close(c) => return json!({"close": c.map(|c| u16::from(c.code))}),
            _ => {}
        }
    }
}

fn tls_broker(pki: &Summary, dir: &Path, extra: &[&str]) -> Broker {
    let crl = dir.join("crl.pem");
    dev_certs::write_crl(&pki.ca, &[], &crl).unwrap();
    let mut args = vec![
        "--tls-cert".to_string(),
        pki.broker_cert.display().to_string(),
        "--tls-key".into(),
        pki.broker_key.display().to_string(),
        "--client-ca".into(),
        pki.ca_cert.display().to_string(),
        "--crl".into(),
        crl.display().to_string(),
    ];
    args.extend(extra.iter().map(|s| s.to_string()));
    let refs: Vec<&str> = args.iter().map(String::as_str).collect();
    Broker::start_logged(&refs)
}

/// Asserts `attempt` failed with the TLS alert `alert` from the broker (rustls'
/// `received fatal alert: <alert>`), not with a refused connection or a timeout.
fn refused_with(attempt: Result<TlsWs, String>, alert: &str) {
    match attempt {
        Ok(_) => panic!("the handshake succeeded; expected alert {alert}"),
        Err(e) => assert!(
            e.contains(&format!("received fatal alert: {alert}")),
            "expected alert {alert}, got: {e}"
        ),
    }
}

/// Reads `s` to its end into `buf`: the peer must close it (EOF, or a reset when our unread
/// bytes were in its buffer) within the socket's read timeout, not leave it open.
fn closed_by_peer(s: &mut TcpStream, buf: &mut Vec<u8>) {
    let started = Instant::now();
    match s.read_to_end(buf) {
        Ok(_) => {}
        Err(e) if e.kind() == ErrorKind::ConnectionReset => {}
        Err(e) => panic!(
            "the broker did not close the connection ({e} after {:?})",
            started.elapsed()
        ),
    }
}

#[test]
fn mtls_identity_is_the_certificate() {
    let dir = Dir::new("id");
    let pki = dev_certs::generate(&dir.0, 2, &[]).unwrap();
    let b = tls_broker(&pki, &dir.0, &[]);
    let (r1, r2) = (&pki.rigs[0], &pki.rigs[1]);
    let mut ws = wss(&b, &pki.ca_cert, Some((&r1.cert, &r1.key)), &[]).unwrap();
    let welcome = hello(&mut ws, &r1.rig_id);
    assert_eq!(welcome["type"], "welcome", "{welcome}");
    // Commands flow over TLS like over plain ws.
    let (status, reply) = b.command(&r1.rig_id, "uptime", json!({}));
    assert_eq!(status, 200, "{reply}");
    let cmd = loop {
        if let Message::Text(t) = ws.read().unwrap() {
            break serde_json::from_str::<serde_json::Value>(t.as_str()).unwrap();
        }
    };
    assert_eq!(cmd["name"], "uptime");
    // rig-0002's certificate saying hello as rig-0001: 4403, and a line in the log naming
    // both and where the client connected from, for whoever must find it.
    let mut liar = wss(&b, &pki.ca_cert, Some((&r2.cert, &r2.key)), &[]).unwrap();
    assert_eq!(hello(&mut liar, &r1.rig_id)["close"], 4403);
    b.wait_metric("fleetlink_identity_mismatch_total 1");
    b.wait_log(&[
        "1 hellos named a rig their connection did not prove (4403)",
        &format!(
            "hello as {}; certificate names [\"{}\"], token's rig none",
            r1.rig_id, r2.rig_id
        ),
        "from 127.0.0.1:",
    ]);
}

/// A rig's last message and its TLS close_notify in one read: the broker must see the close
/// (no further readiness will come while TCP stays open), not keep the rig listed and
/// pinged until its PONGs run out.
#[test]
fn a_close_notify_that_comes_with_data_ends_the_connection() {
    let dir = Dir::new("notify");
    let pki = dev_certs::generate(&dir.0, 1, &[]).unwrap();
    let b = tls_broker(&pki, &dir.0, &[]);
    let r = &pki.rigs[0];
    let mut ws = wss(&b, &pki.ca_cert, Some((&r.cert, &r.key)), &[]).unwrap();
    assert_eq!(hello(&mut ws, &r.rig_id)["type"], "welcome");
    assert_eq!(
        b.metric("fleetlink_connections{core=\"0\"}")
            + b.metric("fleetlink_connections{core=\"1\"}"),
        1
    );
    // One masked text frame (a zero mask leaves the payload as it is), then close_notify,
    // all in one TCP write; the TCP connection stays open.
    let payload = br#"{"type":"ack","seq":99}"#;
    let mut frame = vec![0x81, 0x80 | payload.len() as u8, 0, 0, 0, 0];
    frame.extend_from_slice(payload);
    let s = ws.get_mut();
    s.conn.writer().write_all(&frame).unwrap();
    s.conn.send_close_notify();
    let mut out = Vec::new();
    while s.conn.wants_write() {
        s.conn.write_tls(&mut out).unwrap();
    }
    s.sock.write_all(&out).unwrap();
    let sent = Instant::now();
    // The broker closes its side: the socket reads to its end (its close_notify, then EOF).
    s.sock
        .set_read_timeout(Some(Duration::from_secs(10)))
        .unwrap();
    let mut records = Vec::new();
    match s.sock.read_to_end(&mut records) {
        Ok(_) => {}
        Err(e) => panic!(
            "the broker kept the connection open: {e} after {:?}",
            sent.elapsed()
        ),
    }
    let mut records = &records[..];
    while !records.is_empty() {
        s.conn.read_tls(&mut records).unwrap();
    }
    assert!(
        s.conn.process_new_packets().unwrap().peer_has_closed(),
        "the broker answered the rig's close_notify with none of its own"
    );
    assert!(
        sent.elapsed() < Duration::from_secs(5),
        "{:?}",
        sent.elapsed()
    );
    eventually(Duration::from_secs(5), "the rig unlisted", || {
        b.http("GET", "/v1/rigs", "").1.trim() == "[]"
    });
}

/// The broker ends its side of a TLS session with close_notify, so that a rig can tell the
/// end of the session from a truncation (rustls reports a bare FIN as an unexpected EOF).
#[test]
fn a_kicked_tls_rig_reads_the_close_frame_then_close_notify() {
    let dir = Dir::new("bye");
    let pki = dev_certs::generate(&dir.0, 1, &[]).unwrap();
    let b = tls_broker(&pki, &dir.0, &[]);
    let r = &pki.rigs[0];
    let mut ws = wss(&b, &pki.ca_cert, Some((&r.cert, &r.key)), &[]).unwrap();
    assert_eq!(hello(&mut ws, &r.rig_id)["type"], "welcome");
    let (status, body) = b.http("POST", &format!("/v1/rigs/{}/kick", r.rig_id), "");
    assert_eq!(status, 200, "{body}");
    let code = loop {
        match ws.read().unwrap() {
            Message::Close(c) => break c.map(|c| u16::from(c.code)),
            _ => continue,
        }
    };
    assert_eq!(code, Some(1012));
    // tungstenite answers the close frame; then the session must end cleanly.
    assert!(ws.read().is_err());
    let mut rest = Vec::new();
    match ws.get_mut().read_to_end(&mut rest) {
        Ok(_) => {}
        Err(e) => panic!("the TLS session ended without close_notify: {e}"),
    }
}

/// Writes each of `records` as a TLS record of its own (a large one as several), all in one
/// TCP write.
fn send_records(ws: &mut TlsWs, records: &[&[u8]]) {
    let s = ws.get_mut();
    let mut out = Vec::new();
    for r in records {
        // rustls takes a bounded amount of plaintext at a time: a large one goes in parts.
        let mut rest = *r;
        while !rest.is_empty() {
            let n = s.conn.writer().write(rest).unwrap();
            rest = &rest[n..];
            while s.conn.wants_write() {
                s.conn.write_tls(&mut out).unwrap();
            }
        }
    }
    s.sock.write_all(&out).unwrap();
}

/// A masked client text frame (a zero mask leaves the payload as it is).
fn text_frame(payload: &[u8]) -> Vec<u8> {
    let mut frame = vec![0x81];
    match u8::try_from(payload.len()) {
        Ok(n) if n < 126 => frame.push(0x80 | n),
        _ => {
            frame.push(0xFE);
            frame.extend_from_slice(&u16::try_from(payload.len()).unwrap().to_be_bytes());
        }
    }
    frame.extend_from_slice(&[0, 0, 0, 0]);
    frame.extend_from_slice(payload);
    frame
}

/// One-byte TLS records sent together come many to a read (rustls takes 4 KiB at once), so
/// the reads are not small, yet each record is decrypted on its own: the read charge for
/// tiny reads missed them (review bb108). Each such record now costs the rig's bucket what a
/// tiny read does, and its reading pauses; a rig whose records carry whole messages is not
/// charged however many come in one read, nor when a large message follows a small one (15
/// here, within the burst so that no message waits for its rate either).
#[test]
fn one_byte_tls_records_sent_together_are_charged_each_and_the_message_arrives() {
    let dir = Dir::new("records");
    let pki = dev_certs::generate(&dir.0, 2, &[]).unwrap();
    let b = tls_broker(&pki, &dir.0, &["--cores", "1", "--rig-burst", "20"]);
    let (r, whole) = (&pki.rigs[0], &pki.rigs[1]);
    let mut ws = wss(&b, &pki.ca_cert, Some((&whole.cert, &whole.key)), &[]).unwrap();
    assert_eq!(hello(&mut ws, &whole.rig_id)["type"], "welcome");
    // Small messages, and small ones each followed by a large one: a read then holds a
    // small record and the start of a large one, whose plaintext is not out yet (review
    // bb114: that read was taken for 180 one-byte records).
    let event = |i: usize, data: String| {
        text_frame(
            json!({"type": "event", "name": "whole", "data": [i, data]})
                .to_string()
                .as_bytes(),
        )
    };
    let smalls: Vec<Vec<u8>> = (0..5).map(|i| event(i, String::new())).collect();
    let refs: Vec<&[u8]> = smalls.iter().map(Vec::as_slice).collect();
    send_records(&mut ws, &refs);
    eventually(Duration::from_secs(10), "the small events logged", || {
        b.events_named("whole").len() == 5
    });
    // Each pair alone on the wire, so that a read holds the small record and the start of
    // the large one; a PING after it answers once the broker has read the pair, with no time
    // for the bucket to refill in between.
    let ping = [0x89, 0x80, 0, 0, 0, 0];
    for _ in 0..5 {
        let (small, large) = (event(5, String::new()), event(6, "l".repeat(30_000)));
        send_records(&mut ws, &[&small, &large, &ping]);
        while !matches!(ws.read().unwrap(), Message::Pong(_)) {}
    }
    eventually(Duration::from_secs(10), "the pairs logged", || {
        b.events_named("whole").len() == 15
    });
    assert_eq!(b.metric("fleetlink_tiny_reads_paused_total"), 0);

    let mut ws = wss(&b, &pki.ca_cert, Some((&r.cert, &r.key)), &[]).unwrap();
    assert_eq!(hello(&mut ws, &r.rig_id)["type"], "welcome");
    let data = "d".repeat(2000);
    let ev = text_frame(
        json!({"type": "event", "name": "drip", "data": data})
            .to_string()
            .as_bytes(),
    );
    let bytes: Vec<&[u8]> = ev.chunks(1).collect();
    let sent = Instant::now();
    send_records(&mut ws, &bytes);
    eventually(Duration::from_secs(10), "the dripped event logged", || {
        !b.events_named("drip").is_empty()
    });
    assert_eq!(b.events_named("drip")[0]["data"], json!(data));
    eprintln!("PAUSED {}", b.metric("fleetlink_tiny_reads_paused_total"));
    // About 2,050 records at a sixteenth of a token each, less the burst of 20, at 100 a second:
    // at least 1.08 s of pauses.
    assert!(
        sent.elapsed() >= Duration::from_millis(1000),
        "one-byte records were not charged: read in {:?}",
        sent.elapsed()
    );
    assert!(b.metric("fleetlink_tiny_reads_paused_total") >= 5);
}

/// A certificate from the right CA that names no rig (no CN, only a URI SAN) proves no
/// identity: every rig_id is refused, not every rig_id allowed.
#[test]
fn a_certificate_that_names_nothing_grants_no_rig() {
    let dir = Dir::new("noname");
    let pki = dev_certs::generate(&dir.0, 1, &[]).unwrap();
    let b = tls_broker(&pki, &dir.0, &[]);
    let now = time::OffsetDateTime::now_utc();
    let mut params = rcgen::CertificateParams::default();
    params.distinguished_name = rcgen::DistinguishedName::new();
    params.subject_alt_names = vec![rcgen::SanType::URI(
        "spiffe://fleet/rig-0001".try_into().unwrap(),
    )];
    let nameless = dev_certs::issue_client(
        &pki.ca,
        params,
        now - time::Duration::hours(1),
        now + time::Duration::days(1),
    )
    .unwrap();
    let (nc, nk) = nameless.write(&dir.0, "nameless").unwrap();
    let mut ws = wss(&b, &pki.ca_cert, Some((&nc, &nk)), &[]).unwrap();
    assert_eq!(hello(&mut ws, &pki.rigs[0].rig_id)["close"], 4403);
    b.wait_metric("fleetlink_identity_mismatch_total 1");
}

/// The status and `Retry-After` of an upgrade the broker refused over TLS; panics if it was
/// taken or failed some other way.
fn refused_status(b: &Broker, ca: &Path, cert: (&Path, &Path)) -> (u16, Option<String>) {
    let tcp = TcpStream::connect(b.listen).unwrap();
    tcp.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
    let conn = rustls::ClientConnection::new(
        client_config(ca, Some(cert)),
        ServerName::try_from("localhost").unwrap(),
    )
    .unwrap();
    let stream = rustls::StreamOwned::new(conn, tcp);
    let url = format!("wss://localhost:{}/agent", b.listen.port());
    match tungstenite::client(url, stream) {
        Ok(_) => panic!("the upgrade was taken"),
        Err(tungstenite::HandshakeError::Failure(tungstenite::Error::Http(resp))) => (
            resp.status().as_u16(),
            resp.headers()
                .get("retry-after")
                .map(|v| v.to_str().unwrap().to_string()),
        ),
        Err(e) => panic!("expected an HTTP answer, got: {e}"),
    }
}

/// Over `--max-connections` a TLS client reads the contract's 503 and `Retry-After` through
/// TLS (CONTRACT.md §2), as a plain client does; sent in plain text it would reach the client
/// as a TLS record error.
#[test]
fn a_tls_connection_over_capacity_reads_its_503_through_tls() {
    let dir = Dir::new("full");
    let pki = dev_certs::generate(&dir.0, 2, &[]).unwrap();
    let args = [
        "--max-connections",
        "1",
        "--cores",
        "1",
        "--hello-timeout",
        "1s",
    ];
    let b = tls_broker(&pki, &dir.0, &args);
    let (r1, r2) = (&pki.rigs[0], &pki.rigs[1]);
    let mut ws = wss(&b, &pki.ca_cert, Some((&r1.cert, &r1.key)), &[]).unwrap();
    assert_eq!(hello(&mut ws, &r1.rig_id)["type"], "welcome");
    for _ in 0..2 {
        let (status, retry) = refused_status(&b, &pki.ca_cert, (&r2.cert, &r2.key));
        assert_eq!(status, 503);
        let retry: u32 = retry.expect("Retry-After").parse().unwrap();
        assert!((5..=15).contains(&retry), "Retry-After {retry}");
    }
    // A client that never starts its TLS handshake is closed at the head timeout.
    let mut silent = TcpStream::connect(b.listen).unwrap();
    silent
        .set_read_timeout(Some(Duration::from_secs(10)))
        .unwrap();
    closed_by_peer(&mut silent, &mut Vec::new());
    b.wait_metric("fleetlink_accepts_total{result=\"over_capacity\"} 3");
    // A refusal is one result: no abandoned or timed-out request, no connection counted, the
    // cap's one place still the rig's.
    assert_eq!(
        b.metric("fleetlink_upgrades_total{result=\"head_timeout\"}"),
        0
    );
    assert_eq!(
        b.metric("fleetlink_upgrades_total{result=\"abandoned\"}"),
        0
    );
    assert_eq!(b.metric("fleetlink_connections{core=\"0\"}"), 1);
    let (status, reply) = b.command(&r1.rig_id, "uptime", json!({}));
    assert_eq!(status, 200, "{reply}");
    drop(ws);
    b.wait_metric("fleetlink_connections{core=\"0\"} 0");
    let mut ws = wss(&b, &pki.ca_cert, Some((&r2.cert, &r2.key)), &[]).unwrap();
    assert_eq!(hello(&mut ws, &r2.rig_id)["type"], "welcome");
}

/// A refusal over TLS costs the broker a handshake, so refusals have a budget of their own
/// (the accept bucket's rate and burst): past it a connection is closed unanswered and
/// counted as shed.
#[test]
fn tls_refusals_past_their_budget_are_closed_unanswered() {
    let dir = Dir::new("shed");
    let pki = dev_certs::generate(&dir.0, 1, &[]).unwrap();
    let args = [
        "--max-connections",
        "0",
        "--cores",
        "1",
        "--accept-burst",
        "2",
        "--accept-rate",
        "0.001",
    ];
    let b = tls_broker(&pki, &dir.0, &args);
    let r1 = &pki.rigs[0];
    for _ in 0..2 {
        assert_eq!(refused_status(&b, &pki.ca_cert, (&r1.cert, &r1.key)).0, 503);
    }
    for _ in 0..2 {
        let mut over = TcpStream::connect(b.listen).unwrap();
        over.set_read_timeout(Some(Duration::from_secs(10)))
            .unwrap();
        let mut got = Vec::new();
        closed_by_peer(&mut over, &mut got);
        assert!(got.is_empty(), "{:?}", String::from_utf8_lossy(&got));
    }
    b.wait_metric("fleetlink_accepts_total{result=\"shed\"} 2");
    assert_eq!(
        b.metric("fleetlink_accepts_total{result=\"over_capacity\"}"),
        2
    );
}

/// A ClientHello longer than the 64 KiB rustls takes (TLS allows 16 MiB) is refused with a
/// `decode_error` alert and counted as a failed handshake, like any other bad handshake.
/// rustls refuses such a message while joining its records and queues no alert: the broker
/// closed the connection with none.
#[test]
fn an_oversized_client_hello_gets_a_decode_error_alert() {
    let dir = Dir::new("bighello");
    let pki = dev_certs::generate(&dir.0, 1, &[]).unwrap();
    let b = tls_broker(&pki, &dir.0, &[]);
    let failures = "fleetlink_tls_handshake_failures_total";
    assert_eq!(b.metric(failures), 0);
    let mut tcp = TcpStream::connect(b.listen).unwrap();
    tcp.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
    // A ClientHello declaring 16 MiB - 1, in full records of 16 KiB: rustls stops taking
    // them at 64 KiB.
    let mut first = vec![1u8, 0xff, 0xff, 0xff];
    first.resize(16 << 10, 0);
    for i in 0..5 {
        let body = if i == 0 {
            first.clone()
        } else {
            vec![0u8; 16 << 10]
        };
        let mut record = vec![22u8, 3, 1, 0x40, 0x00];
        record.extend_from_slice(&body);
        if tcp.write_all(&record).is_err() {
            break;
        }
    }
    let mut got = Vec::new();
    closed_by_peer(&mut tcp, &mut got);
    // A fatal decode_error alert record, whatever its legacy version bytes.
    assert!(
        got.len() == 7 && got[0] == 21 && got[3..] == [0, 2, 2, 50],
        "expected a decode_error alert, got {got:?}"
    );
    b.wait_metric(&format!("{failures} 1"));
}

/// Plain HTTP on the TLS port (a rig configured with `ws://` for a `wss://` broker) is answered
/// in HTTP, saying so, rather than with an alert such a client shows as a protocol error; it is
/// counted as a failed handshake. A record that is TLS but wrong still gets its alert.
#[test]
fn plain_http_on_the_tls_port_is_told_to_use_tls() {
    let dir = Dir::new("plainhttp");
    let pki = dev_certs::generate(&dir.0, 1, &[]).unwrap();
    let b = tls_broker(&pki, &dir.0, &[]);
    let mut tcp = TcpStream::connect(b.listen).unwrap();
    tcp.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
    tcp.write_all(b"GET /agent HTTP/1.1\r\nHost: x\r\nUpgrade: websocket\r\nConnection: Upgrade\r\nSec-WebSocket-Key: dGhlIHNhbXBsZSBub25jZQ==\r\nSec-WebSocket-Version: 13\r\n\r\n")
        .unwrap();
    let mut got = Vec::new();
    closed_by_peer(&mut tcp, &mut got);
    let text = String::from_utf8_lossy(&got);
    assert!(text.starts_with("HTTP/1.1 400 Bad Request\r\n"), "{text}");
    let (head, body) = text.split_once("\r\n\r\n").unwrap();
    assert!(body.contains("wss://"), "{body}");
    assert!(
        head.contains(&format!("Content-Length: {}", body.len())),
        "{text}"
    );
    b.wait_metric("fleetlink_tls_handshake_failures_total 1");
    // A TLS record of a type TLS does not have is still answered in TLS: an alert.
    let mut tcp = TcpStream::connect(b.listen).unwrap();
    tcp.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
    tcp.write_all(&[22, 9, 9, 0, 4, 1, 0, 0, 0]).unwrap();
    let mut got = Vec::new();
    closed_by_peer(&mut tcp, &mut got);
    assert_eq!(got.first(), Some(&21), "an alert record: {got:?}");
}

/// A chain of certificates named like the client CA, from a client holding no key of ours: each
/// was a candidate issuer, and the broker spent up to 100 signature checks (10–13 ms of CPU)
/// on each such handshake before refusing it (review bb131). Now refused before any path is
/// built, as is a chain of more intermediates than a path may have, and the log says which.
#[test]
fn a_chain_of_look_alike_issuers_is_refused_before_its_paths_are_tried() {
    let dir = Dir::new("lookalike");
    let pki = dev_certs::generate(&dir.0, 1, &[]).unwrap();
    let b = tls_broker(&pki, &dir.0, &[]);
    let now = time::OffsetDateTime::now_utc();
    let (from, until) = (
        now - time::Duration::hours(1),
        now + time::Duration::days(1),
    );
    let look_alike = || dev_certs::Ca::new("fleetlink dev CA", from, until).unwrap();
    let signer = look_alike();
    let leaf = dev_certs::generate_rig(&signer, "rig-0001", from, until).unwrap();
    let (leaf_cert, leaf_key) = leaf.write(&dir.0, "lookalike").unwrap();
    let with_intermediates = |n: usize| {
        let mut chain = leaf.cert_pem.clone();
        chain.push_str(&signer.cert_pem());
        for _ in 1..n {
            chain.push_str(&look_alike().cert_pem());
        }
        std::fs::write(&leaf_cert, chain).unwrap();
        wss(&b, &pki.ca_cert, Some((&leaf_cert, &leaf_key)), &[])
    };
    refused_with(with_intermediates(3), "CertificateUnknown");
    b.wait_log(&["intermediate certificates have the same subject"]);
    refused_with(with_intermediates(7), "CertificateUnknown");
    b.wait_log(&["the client sent 7 intermediate certificates, more than 6"]);
    b.wait_metric("fleetlink_tls_handshake_failures_total 2");
    // A rig's own certificate is still taken.
    let rig = &pki.rigs[0];
    let mut ws = wss(&b, &pki.ca_cert, Some((&rig.cert, &rig.key)), &[]).unwrap();
    assert_eq!(hello(&mut ws, &rig.rig_id)["type"], "welcome");
}

#[test]
fn wrong_ca_expired_and_certless_clients_are_refused() {
    let dir = Dir::new("refuse");
    let pki = dev_certs::generate(&dir.0, 1, &[]).unwrap();
    let b = tls_broker(&pki, &dir.0, &[]);
    let now = time::OffsetDateTime::now_utc();
    let other = dev_certs::Ca::new(
        "other CA",
        now - time::Duration::hours(1),
        now + time::Duration::days(1),
    )
    .unwrap();
    let foreign = dev_certs::generate_rig(
        &other,
        "rig-0001",
        now - time::Duration::hours(1),
        now + time::Duration::days(1),
    )
    .unwrap();
    let (fc, fk) = foreign.write(&dir.0, "foreign").unwrap();
    // Each refusal is the broker's handshake failure (one more on its counter) and the alert
    // naming the reason, not a refused connection or a timeout.
    let failures = "fleetlink_tls_handshake_failures_total";
    assert_eq!(b.metric(failures), 0);
    refused_with(wss(&b, &pki.ca_cert, Some((&fc, &fk)), &[]), "UnknownCA");
    b.wait_metric(&format!("{failures} 1"));
    // The log says why, and where the client connected from.
    b.wait_log(&[
        "1 connections failed TLS",
        "UnknownIssuer",
        "from 127.0.0.1:",
    ]);
    let expired = dev_certs::generate_rig(
        &pki.ca,
        "rig-0001",
        now - time::Duration::days(3),
        now - time::Duration::days(1),
    )
    .unwrap();
    let (ec, ek) = expired.write(&dir.0, "expired").unwrap();
    refused_with(
        wss(&b, &pki.ca_cert, Some((&ec, &ek)), &[]),
        "CertificateExpired",
    );
    b.wait_metric(&format!("{failures} 2"));
    refused_with(wss(&b, &pki.ca_cert, None, &[]), "CertificateRequired");
    b.wait_metric(&format!("{failures} 3"));
    // A plain-text client on the TLS port is told to use TLS, and the broker lives on.
    let mut plain = TcpStream::connect(b.listen).unwrap();
    plain
        .set_read_timeout(Some(Duration::from_secs(10)))
        .unwrap();
    plain
        .write_all(b"GET /agent HTTP/1.1\r\nHost: x\r\n\r\n")
        .unwrap();
    let mut buf = Vec::new();
    closed_by_peer(&mut plain, &mut buf);
    assert!(
        String::from_utf8_lossy(&buf).starts_with("HTTP/1.1 400 "),
        "{buf:?}"
    );
    // Plain text is not a TLS record: the fourth handshake failure.
    b.wait_metric(&format!("{failures} 4"));
    let r = &pki.rigs[0];
    let mut ok = wss(&b, &pki.ca_cert, Some((&r.cert, &r.key)), &[]).unwrap();
    assert_eq!(hello(&mut ok, &r.rig_id)["type"], "welcome");
    assert_eq!(b.metric(failures), 4, "a good handshake counted as failed");
    // A session that breaks after its handshake (a record that does not decrypt) is not a
    // failed handshake: it ends as a close without a close frame, counted there alone.
    let dropped = "fleetlink_closes_total{code=\"1006\"}";
    let before = b.metric(dropped);
    let mut record = vec![0x17, 0x03, 0x03, 0x00, 0x20];
    record.extend([0x5a; 0x20]);
    ok.get_mut().sock.write_all(&record).unwrap();
    b.wait_metric(&format!("{dropped} {}", before + 1));
    assert_eq!(
        b.metric(failures),
        4,
        "a broken session counted as a failed handshake"
    );
}

#[test]
fn a_revoked_cert_is_refused_after_the_crl_changes_and_others_stay_up() {
    let dir = Dir::new("crl");
    let pki = dev_certs::generate(&dir.0, 2, &[]).unwrap();
    let b = tls_broker(&pki, &dir.0, &[]);
    let (keep, revoke) = (&pki.rigs[0], &pki.rigs[1]);
    let mut kept = wss(&b, &pki.ca_cert, Some((&keep.cert, &keep.key)), &[]).unwrap();
    assert_eq!(hello(&mut kept, &keep.rig_id)["type"], "welcome");
    let mut doomed = wss(&b, &pki.ca_cert, Some((&revoke.cert, &revoke.key)), &[]).unwrap();
    assert_eq!(hello(&mut doomed, &revoke.rig_id)["type"], "welcome");
    dev_certs::write_crl(
        &pki.ca,
        std::slice::from_ref(&revoke.serial),
        &dir.0.join("crl.pem"),
    )
    .unwrap();
    // The watcher reloads within about a second; poll with a deadline. Until then the
    // handshake succeeds; after, the broker refuses it as revoked, and nothing else fails.
    let failures = "fleetlink_tls_handshake_failures_total";
    assert_eq!(b.metric(failures), 0);
    let mut refusal = None;
    eventually(Duration::from_secs(10), "revoked cert refused", || {
        refusal = wss(&b, &pki.ca_cert, Some((&revoke.cert, &revoke.key)), &[]).err();
        refusal.is_some()
    });
    refused_with(Err(refusal.unwrap()), "CertificateRevoked");
    b.wait_metric(&format!("{failures} 1"));
    let reloads = |result: &str| {
        b.metric(&format!(
            "fleetlink_tls_reloads_total{{result=\"{result}\"}}"
        ))
    };
    assert!(
        reloads("ok") >= 1 && reloads("failed") == 0,
        "the reload counted"
    );
    // No connection was dropped by the reload, not even the one whose cert is now revoked.
    for (ws, rig) in [(&mut kept, &keep.rig_id), (&mut doomed, &revoke.rig_id)] {
        let (status, reply) = b.command(rig, "still-there", json!({}));
        assert_eq!(status, 200, "{reply}");
        let got = loop {
            if let Message::Text(t) = ws.read().unwrap() {
                break serde_json::from_str::<serde_json::Value>(t.as_str()).unwrap();
            }
        };
        assert_eq!(got["name"], "still-there");
    }
}

fn upgrade_with(b: &Broker, auth: Option<&str>) -> String {
    let mut s = TcpStream::connect(b.listen).unwrap();
    s.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
    let auth = auth
        .map(|t| format!("Authorization: Bearer {t}\r\n"))
        .unwrap_or_default();
    write!(s, "GET /agent HTTP/1.1\r\nHost: x\r\nUpgrade: websocket\r\nConnection: Upgrade\r\nSec-WebSocket-Key: dGhlIHNhbXBsZSBub25jZQ==\r\nSec-WebSocket-Version: 13\r\n{auth}\r\n").unwrap();
    let mut head = Vec::new();
    let mut byte = [0u8; 1];
    while !head.ends_with(b"\r\n\r\n") && s.read(&mut byte).unwrap_or(0) == 1 {
        head.push(byte[0]);
    }
    String::from_utf8_lossy(&head).into_owned()
}

#[test]
fn bearer_tokens_gate_upgrades_and_commands() {
    let dir = Dir::new("jwt");
    let (signer, key) = Signer::new(&dir.0);
    let (other, _) = Signer::new(&Dir::new("jwt-other").0);
    let b = Broker::start(&["--jwt-key", key.to_str().unwrap()]);
    let good = |rig: &str, scope: &str| {
        signer.token(json!({"exp": now_s() + 60, "rig_id": rig, "scope": scope}))
    };
    assert!(upgrade_with(&b, None).starts_with("HTTP/1.1 401"));
    assert!(upgrade_with(&b, Some("not.a.token")).starts_with("HTTP/1.1 401"));
    assert!(
        upgrade_with(
            &b,
            Some(&signer.token(json!({"exp": now_s() - 3600, "scope": "cmd:*"})))
        )
        .starts_with("HTTP/1.1 401"),
        "expired"
    );
    assert!(
        upgrade_with(
            &b,
            Some(&other.token(json!({"exp": now_s() + 60, "scope": "cmd:*"})))
        )
        .starts_with("HTTP/1.1 401"),
        "bad signature"
    );
    assert!(upgrade_with(&b, Some(&good("rig-j", "cmd:reboot"))).starts_with("HTTP/1.1 101"));
    b.wait_metric("fleetlink_upgrades_total{result=\"401\"} 4");

    let connect = |token: String| {
        let mut req =
            tungstenite::client::IntoClientRequest::into_client_request(b.url("/agent")).unwrap();
        req.headers_mut()
            .insert("Authorization", format!("Bearer {token}").parse().unwrap());
        let stream = TcpStream::connect(b.listen).unwrap();
        stream
            .set_read_timeout(Some(Duration::from_secs(10)))
            .unwrap();
        tungstenite::client(req, tungstenite::stream::MaybeTlsStream::Plain(stream))
            .unwrap()
            .0
    };
    let mut ws = connect(good("rig-j", "cmd:reboot"));
    common::broker::hello(&mut ws, "rig-j", &boot_id(), json!({}));
    let (status, reply) = b.command("rig-j", "reboot", json!({}));
    assert_eq!((status, &reply["ok"]), (200, &json!(true)), "{reply}");
    assert_eq!(read_json(&mut ws)["name"], "reboot");
    let (status, reply) = b.command("rig-j", "dmesg", json!({}));
    assert_eq!(status, 403, "{reply}");
    assert_eq!(reply["error"], "forbidden");
    // A token issued to another rig cannot say hello as this one.
    let mut liar = connect(good("rig-other", "cmd:*"));
    liar.send(Message::Text(
        json!({"type":"hello","rig_id":"rig-j2","boot_id":boot_id(),"version":"t"})
            .to_string()
            .into(),
    ))
    .unwrap();
    assert_eq!(read_close(&mut liar), 4403);
}

/// The end of a certificate file's first certificate (Unix seconds).
fn not_after(path: &Path) -> i64 {
    let der = certs(path).remove(0);
    let (_, cert) = x509_parser::parse_x509_certificate(&der).unwrap();
    cert.validity().not_after.timestamp()
}

/// `/metrics` says when the served certificate expires and when the CRLs go stale, and follows
/// a reload: an expired certificate or a stale CRL would otherwise show only as rigs failing
/// their next handshake.
#[test]
fn metrics_say_when_the_certificate_and_the_crls_expire() {
    let dir = Dir::new("expiry");
    let pki = dev_certs::generate(&dir.0, 1, &[]).unwrap();
    let b = tls_broker(&pki, &dir.0, &[]);
    let cert_series = "fleetlink_tls_cert_expiry_timestamp_seconds";
    assert_eq!(b.metric(cert_series) as i64, not_after(&pki.broker_cert));
    // dev-certs' CRLs are good for 30 days from when they are written.
    let crl_next = b.metric("fleetlink_tls_crl_next_update_timestamp_seconds") as i64;
    let now = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .unwrap()
        .as_secs() as i64;
    let in_30_days = now + 30 * 24 * 3600;
    assert!(
        (in_30_days - 120..=in_30_days).contains(&crl_next),
        "{crl_next} against {in_30_days}"
    );

    // A certificate renewed in place is served, and its end reported, after the reload.
    let now_t = time::OffsetDateTime::now_utc();
    let renewed = dev_certs::generate_broker(
        &pki.ca,
        &["localhost".into()],
        now_t - time::Duration::hours(1),
        now_t + time::Duration::days(20),
    )
    .unwrap();
    let (cert, key) = renewed.write(&dir.0, "renewed").unwrap();
    let until = not_after(&cert);
    assert_ne!(until, not_after(&pki.broker_cert));
    std::fs::rename(&key, &pki.broker_key).unwrap();
    std::fs::rename(&cert, &pki.broker_cert).unwrap();
    eventually(
        Duration::from_secs(10),
        "the renewed certificate's end",
        || b.metric(cert_series) as i64 == until,
    );
}

/// A wss client floods PINGs without reading, so the broker's PONGs back up into rustls, then
/// resets the connection. rustls keeps the records it could not write, and the broker used to
/// wait for ever to write them to a socket that is always "writable" with an error: the
/// connection never ended, its place under `--max-connections` and its gauge were never given
/// back, and its task spun.
#[test]
fn a_reset_with_tls_records_unsent_ends_the_connection() {
    let dir = Dir::new("reset");
    let pki = dev_certs::generate(&dir.0, 1, &[]).unwrap();
    let b = tls_broker(&pki, &dir.0, &[]);
    let r = &pki.rigs[0];
    let sock = socket2::Socket::new(socket2::Domain::IPV4, socket2::Type::STREAM, None).unwrap();
    sock.set_recv_buffer_size(4096).unwrap();
    sock.connect(&b.listen.into()).unwrap();
    let tcp: TcpStream = sock.into();
    tcp.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
    let conn = rustls::ClientConnection::new(
        client_config(&pki.ca_cert, Some((&r.cert, &r.key))),
        ServerName::try_from("localhost").unwrap(),
    )
    .unwrap();
    let req = format!("wss://localhost:{}/agent", b.listen.port());
    let (mut ws, _) = tungstenite::client(req, rustls::StreamOwned::new(conn, tcp)).unwrap();
    let gauge = || {
        b.metric("fleetlink_connections{core=\"0\"}")
            + b.metric("fleetlink_connections{core=\"1\"}")
    };
    assert_eq!(gauge(), 1);
    // Masked PINGs of 125 bytes (a zero mask leaves the payload as it is); their PONGs fill
    // the small receive buffer, the broker's socket, rustls and the broker's queue.
    let mut ping = vec![0x89, 0x80 | 125, 0, 0, 0, 0];
    ping.extend_from_slice(&[b'p'; 125]);
    let s = ws.get_mut();
    s.sock
        .set_write_timeout(Some(Duration::from_millis(500)))
        .unwrap();
    let started = Instant::now();
    let mut sent = 0usize;
    while started.elapsed() < Duration::from_secs(10) {
        s.conn.writer().write_all(&ping).unwrap();
        sent += 1;
        let mut stalled = false;
        while s.conn.wants_write() {
            match s.conn.write_tls(&mut s.sock) {
                Ok(_) => {}
                Err(e) if matches!(e.kind(), ErrorKind::WouldBlock | ErrorKind::TimedOut) => {
                    stalled = true;
                    break;
                }
                Err(e) => panic!("after {sent} PINGs: {e}"),
            }
        }
        if stalled {
            break;
        }
    }
    assert!(
        sent > 1000,
        "the broker took only {sent} PINGs before it stopped reading"
    );
    // Reset: SO_LINGER 0, then close.
    socket2::SockRef::from(&s.sock)
        .set_linger(Some(Duration::ZERO))
        .unwrap();
    drop(ws);
    eventually(Duration::from_secs(10), "the connection ended", || {
        gauge() == 0
    });
}

/// A client that gives up in the middle of its TLS 1.3 handshake with a close_notify (after the
/// server's flight, before its own Finished) has abandoned its connection, as one that closes
/// TCP there has: counted as an abandoned upgrade, not a failed handshake, and not logged as
/// one. rustls raises such an alert as an error, which the broker used to count as a failure.
#[test]
fn a_close_notify_in_the_middle_of_a_handshake_is_an_abandoned_connection() {
    let dir = Dir::new("abandon");
    let pki = dev_certs::generate(&dir.0, 1, &[]).unwrap();
    let b = tls_broker(&pki, &dir.0, &[]);
    let r = &pki.rigs[0];
    let mut tcp = TcpStream::connect(b.listen).unwrap();
    tcp.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
    let mut conn = rustls::ClientConnection::new(
        client_config(&pki.ca_cert, Some((&r.cert, &r.key))),
        ServerName::try_from("localhost").unwrap(),
    )
    .unwrap();
    while conn.wants_write() {
        conn.write_tls(&mut tcp).unwrap();
    }
    // The server's first record is its ServerHello: with it alone the client has its
    // handshake keys and has not sent its Finished yet.
    let mut head = [0u8; 5];
    tcp.read_exact(&mut head).unwrap();
    assert_eq!(head[0], 0x16, "a handshake record first");
    let mut hello = vec![0u8; usize::from(u16::from_be_bytes([head[3], head[4]]))];
    tcp.read_exact(&mut hello).unwrap();
    let record = [&head[..], &hello[..]].concat();
    conn.read_tls(&mut &record[..]).unwrap();
    conn.process_new_packets().unwrap();
    assert!(conn.is_handshaking());
    conn.send_close_notify();
    while conn.wants_write() {
        conn.write_tls(&mut tcp).unwrap();
    }
    tcp.shutdown(std::net::Shutdown::Write).unwrap();
    b.wait_metric("fleetlink_upgrades_total{result=\"abandoned\"} 1");
    assert_eq!(b.metric("fleetlink_tls_handshake_failures_total"), 0);
}
