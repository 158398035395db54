//! What TLS costs the broker per connection, measured in memory (no sockets):
//! `size_of::<ServerConnection>()`, the heap an idle established connection holds, and full
//! handshakes per second on one core (ECDSA P-256 server cert, X25519, TLS 1.3 unless said).
//!
//! `cargo run --release --example tls_cost` (debug builds run rustls unoptimised: the
//! handshake rate is then several times lower and says little about production).

use std::alloc::{GlobalAlloc, Layout, System};
use std::fs;
use std::hint::black_box;
use std::io::{Read, Write};
use std::sync::atomic::{AtomicIsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use fleetlink::dev_certs::{generate_broker, generate_rig, Ca, Issued};
use fleetlink::tls::{build_server_config, new_connection, peer_identities, TlsPaths};
use rustls::pki_types::ServerName;
use rustls::{ClientConfig, ClientConnection, ConnectionCommon, ServerConfig, ServerConnection};
use time::OffsetDateTime;

/// Counts live heap bytes of the whole process.
struct Counting;

static LIVE: AtomicIsize = AtomicIsize::new(0);

// SAFETY: forwards every call to `System` unchanged; only counts sizes.
unsafe impl GlobalAlloc for Counting {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        LIVE.fetch_add(layout.size() as isize, Ordering::Relaxed);
        System.alloc(layout)
    }

    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        LIVE.fetch_sub(layout.size() as isize, Ordering::Relaxed);
        System.dealloc(ptr, layout)
    }

    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        LIVE.fetch_add(
            new_size as isize - layout.size() as isize,
            Ordering::Relaxed,
        );
        System.realloc(ptr, layout, new_size)
    }
}

#[global_allocator]
static GLOBAL: Counting = Counting;

fn live() -> isize {
    LIVE.load(Ordering::Relaxed)
}

fn main() {
    let dir = std::env::temp_dir().join(format!("fleetlink-tls-cost-{}", std::process::id()));
    fs::create_dir_all(&dir).expect("dir");
    let now = OffsetDateTime::now_utc();
    let (nb, na) = (
        now - time::Duration::hours(1),
        now + time::Duration::days(30),
    );
    let ca = Ca::new("cost CA", nb, na).expect("ca");
    let ca_path = dir.join("ca.pem");
    fs::write(&ca_path, ca.cert_pem()).expect("ca");
    let (cert, key) = generate_broker(&ca, &["localhost".into()], nb, na)
        .expect("broker")
        .write(&dir, "broker")
        .expect("write");
    let rig = generate_rig(&ca, "rig-0001", nb, na).expect("rig");
    let crl = dir.join("ca.crl");
    let revoked: Vec<_> = (0..100)
        .map(|i| {
            generate_rig(&ca, &format!("gone-{i}"), nb, na)
                .expect("rig")
                .serial
        })
        .collect();
    fleetlink::dev_certs::write_crl(&ca, &revoked, &crl).expect("crl");

    let plain = build_server_config(&TlsPaths {
        cert: cert.clone(),
        key: key.clone(),
        client_ca: None,
        crl: vec![],
    })
    .expect("plain");
    let mtls = build_server_config(&TlsPaths {
        cert,
        key,
        client_ca: Some(ca_path),
        crl: vec![crl],
    })
    .expect("mtls");

    println!(
        "size_of::<ServerConnection>() = {} bytes (ClientConnection {})",
        std::mem::size_of::<ServerConnection>(),
        std::mem::size_of::<ClientConnection>()
    );
    let all = [&rustls::version::TLS13, &rustls::version::TLS12];
    let tls12 = [&rustls::version::TLS12];
    let cases = [
        ("TLS 1.3, server auth only", &plain, None, &all[..]),
        ("TLS 1.3, mTLS + 100-entry CRL", &mtls, Some(&rig), &all[..]),
        (
            "TLS 1.2, mTLS + 100-entry CRL",
            &mtls,
            Some(&rig),
            &tls12[..],
        ),
    ];
    for (name, server_config, client_cert, versions) in cases {
        let client_config = client_config(&ca, client_cert, versions);
        println!("\n{name}:");
        held(server_config, &client_config);
        rate(server_config, &client_config);
    }
    let _ = fs::remove_dir_all(&dir);
}

/// Heap held per idle established server connection, averaged over 1,000: right after the
/// handshake, and after one 1 KiB message each way (read out).
fn held(server_config: &Arc<ServerConfig>, client_config: &Arc<ClientConfig>) {
    let _warm = pair_up(server_config, client_config);
    for chatted in [false, true] {
        println!(
            "  heap held by an idle ServerConnection {}: {:.0} bytes (+ {} inline)",
            if chatted {
                "after 1 KiB each way"
            } else {
                "right after the handshake"
            },
            held_per_conn(server_config, client_config, chatted),
            size_of::<ServerConnection>()
        );
    }
    let (_c, s) = pair_up(server_config, client_config);
    let before = live();
    let ids = peer_identities(&s);
    println!("  peer_identities() = {ids:?}: {} bytes", live() - before);
}

fn held_per_conn(
    server_config: &Arc<ServerConfig>,
    client_config: &Arc<ClientConfig>,
    chatted: bool,
) -> f64 {
    const N: usize = 1000;
    let mut servers = Vec::with_capacity(N);
    let mut clients = Vec::with_capacity(N);
    let before = live();
    for _ in 0..N {
        let (mut c, mut s) = pair_up(server_config, client_config);
        if chatted {
            chat(&mut c, &mut s);
        }
        clients.push(c);
        servers.push(s);
    }
    clients.clear();
    let per = (live() - before) as f64 / N as f64;
    black_box(&servers);
    per
}

/// Full handshakes per second, client and server on this one thread, and the server's share.
fn rate(server_config: &Arc<ServerConfig>, client_config: &Arc<ClientConfig>) {
    let budget = Duration::from_secs(2);
    let start = Instant::now();
    let mut server_time = Duration::ZERO;
    let mut n = 0u32;
    while start.elapsed() < budget {
        let mut client = ClientConnection::new(client_config.clone(), name()).expect("client");
        let mut server = new_connection(server_config.clone()).expect("server");
        server_time += pump(&mut client, &mut server);
        black_box(&server);
        n += 1;
    }
    let total = start.elapsed();
    println!(
        "  {n} handshakes in {:.2} s: {:.0}/s both ends on one core; server side alone {:.0} µs each = {:.0}/s",
        total.as_secs_f64(),
        f64::from(n) / total.as_secs_f64(),
        server_time.as_secs_f64() * 1e6 / f64::from(n),
        f64::from(n) / server_time.as_secs_f64()
    );
}

fn pair_up(
    server_config: &Arc<ServerConfig>,
    client_config: &Arc<ClientConfig>,
) -> (ClientConnection, ServerConnection) {
    let mut client = ClientConnection::new(client_config.clone(), name()).expect("client");
    let mut server = new_connection(server_config.clone()).expect("server");
    pump(&mut client, &mut server);
    assert!(!server.is_handshaking() && !client.is_handshaking());
    (client, server)
}

/// One 1 KiB message each way, read out completely.
fn chat(client: &mut ClientConnection, server: &mut ServerConnection) {
    let msg = [b'x'; 1024];
    let mut got = [0u8; 1024];
    client.writer().write_all(&msg).expect("write");
    pump(client, server);
    server.reader().read_exact(&mut got).expect("read");
    server.writer().write_all(&msg).expect("write");
    pump(client, server);
    client.reader().read_exact(&mut got).expect("read");
}

/// Pumps until quiet; returns the time spent in server calls.
fn pump(client: &mut ClientConnection, server: &mut ServerConnection) -> Duration {
    let mut server_time = Duration::ZERO;
    loop {
        let to_server = drain(client);
        let t = Instant::now();
        let to_client = drain(server);
        server_time += t.elapsed();
        if to_server.is_empty() && to_client.is_empty() {
            return server_time;
        }
        let t = Instant::now();
        feed(server, &to_server);
        server_time += t.elapsed();
        feed(client, &to_client);
    }
}

fn drain<D>(conn: &mut ConnectionCommon<D>) -> Vec<u8> {
    let mut buf = Vec::new();
    while conn.wants_write() {
        conn.write_tls(&mut buf).expect("write_tls");
    }
    buf
}

fn feed<D>(conn: &mut ConnectionCommon<D>, mut bytes: &[u8]) {
    while !bytes.is_empty() {
        conn.read_tls(&mut bytes).expect("read_tls");
        conn.process_new_packets().expect("handshake");
    }
}

fn client_config(
    ca: &Ca,
    cert: Option<&Issued>,
    versions: &[&'static rustls::SupportedProtocolVersion],
) -> Arc<ClientConfig> {
    let mut roots = rustls::RootCertStore::empty();
    for c in rustls_pemfile::certs(&mut ca.cert_pem().as_bytes()) {
        roots.add(c.expect("pem")).expect("root");
    }
    let builder =
        ClientConfig::builder_with_provider(Arc::new(rustls::crypto::ring::default_provider()))
            .with_protocol_versions(versions)
            .expect("versions")
            .with_root_certificates(roots);
    let mut config = match cert {
        Some(rig) => builder
            .with_client_auth_cert(
                rustls_pemfile::certs(&mut rig.cert_pem.as_bytes())
                    .collect::<Result<_, _>>()
                    .expect("certs"),
                rustls_pemfile::private_key(&mut rig.key_pem.as_bytes())
                    .expect("pem")
                    .expect("key"),
            )
            .expect("client cert"),
        None => builder.with_no_client_auth(),
    };
    // Client-side resumption would not happen anyway (the server issues no tickets).
    config.resumption = rustls::client::Resumption::disabled();
    Arc::new(config)
}

fn name() -> ServerName<'static> {
    ServerName::try_from("localhost").expect("name")
}
