//! A TCP relay in front of a test's redis-server that, once armed, cuts the connection whose
//! client sends a given byte string, without passing that call on: a Redis that fails between
//! two calls of one operation, which killing or freezing the server cannot aim at. It can also
//! freeze what goes through it: a Redis that one broker cannot reach while others can.

use std::io::{Read, Write};
use std::net::{Shutdown, SocketAddr, TcpListener, TcpStream};
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::thread;

/// Relays 127.0.0.1:<port> to the upstream port; stops accepting on drop.
pub struct Relay {
    addr: SocketAddr,
    armed: Arc<Mutex<Option<Vec<u8>>>>,
    cuts: Arc<AtomicUsize>,
    stop: Arc<AtomicBool>,
    frozen: Arc<AtomicBool>,
    frozen_back: Arc<AtomicBool>,
    down: Arc<AtomicBool>,
    /// Connections closed at once while down.
    turned_away: Arc<AtomicUsize>,
    /// Both ends of every connection relayed so far, to cut when the relay goes down.
    open: Arc<Mutex<Vec<TcpStream>>>,
}

impl Relay {
    /// Starts relaying to `127.0.0.1:<upstream>`.
    pub fn start(upstream: u16) -> Relay {
        let listener = TcpListener::bind("127.0.0.1:0").expect("bind relay");
        let addr = listener.local_addr().expect("relay address");
        let relay = Relay {
            addr,
            armed: Arc::new(Mutex::new(None)),
            cuts: Arc::new(AtomicUsize::new(0)),
            stop: Arc::new(AtomicBool::new(false)),
            frozen: Arc::new(AtomicBool::new(false)),
            frozen_back: Arc::new(AtomicBool::new(false)),
            down: Arc::new(AtomicBool::new(false)),
            turned_away: Arc::new(AtomicUsize::new(0)),
            open: Arc::new(Mutex::new(Vec::new())),
        };
        let (armed, cuts, stop) = (relay.armed.clone(), relay.cuts.clone(), relay.stop.clone());
        let (frozen, frozen_back) = (relay.frozen.clone(), relay.frozen_back.clone());
        let (down, open) = (relay.down.clone(), relay.open.clone());
        let turned_away = relay.turned_away.clone();
        thread::spawn(move || {
            for client in listener.incoming() {
                if stop.load(Ordering::Relaxed) {
                    return;
                }
                // Down: accepted and closed at once, as a Redis that is not there fails fast.
                let Ok(client) = client else { continue };
                if down.load(Ordering::SeqCst) {
                    turned_away.fetch_add(1, Ordering::SeqCst);
                    continue;
                }
                let Ok(server) = TcpStream::connect(("127.0.0.1", upstream)) else {
                    continue;
                };
                if let (Ok(c), Ok(s)) = (client.try_clone(), server.try_clone()) {
                    open.lock().unwrap().extend([c, s]);
                }
                let (armed, cuts) = (armed.clone(), cuts.clone());
                let (frozen, frozen_back) = (frozen.clone(), frozen_back.clone());
                thread::spawn(move || pump(client, server, &armed, &cuts, &frozen, frozen_back));
            }
        });
        relay
    }

    /// `redis://` URL of the relay.
    pub fn url(&self) -> String {
        format!("redis://{}/", self.addr)
    }

    /// The next connection to send `pattern` is cut there, once.
    pub fn cut_on(&self, pattern: &[u8]) {
        *self.armed.lock().unwrap() = Some(pattern.to_vec());
    }

    /// Holds every call sent through the relay from now until unfrozen, as a Redis that
    /// stopped answering this client alone (connections stay open, nothing is lost).
    pub fn freeze(&self, frozen: bool) {
        self.frozen.store(frozen, Ordering::SeqCst);
    }

    /// Holds what Redis sends through the relay too (replies and pub/sub messages), as a
    /// network partition would: nothing is lost, all of it arrives once unfrozen.
    pub fn freeze_both(&self, frozen: bool) {
        self.frozen_back.store(frozen, Ordering::SeqCst);
        self.freeze(frozen);
    }

    /// A Redis this broker alone finds gone, failing fast: every relayed connection is cut,
    /// and new ones are closed as they come, until the relay is up again.
    #[allow(dead_code)] // not every test binary takes its Redis down
    pub fn down(&self, down: bool) {
        self.down.store(down, Ordering::SeqCst);
        if down {
            for s in self.open.lock().unwrap().drain(..) {
                let _ = s.shutdown(Shutdown::Both);
            }
        }
    }

    /// How many connections were closed at once while the relay was down.
    #[allow(dead_code)]
    pub fn turned_away(&self) -> usize {
        self.turned_away.load(Ordering::SeqCst)
    }

    /// How many connections were cut so far.
    pub fn cuts(&self) -> usize {
        self.cuts.load(Ordering::SeqCst)
    }
}

impl Drop for Relay {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
        // Wakes the accept loop so it sees `stop`.
        let _ = TcpStream::connect(self.addr);
    }
}

/// Copies client→server, watching for the armed pattern (also across reads), while another
/// thread copies server→client.
fn pump(
    mut client: TcpStream,
    mut server: TcpStream,
    armed: &Mutex<Option<Vec<u8>>>,
    cuts: &AtomicUsize,
    frozen: &AtomicBool,
    frozen_back: Arc<AtomicBool>,
) {
    let (Ok(mut back_from), Ok(mut back_to)) = (server.try_clone(), client.try_clone()) else {
        return;
    };
    thread::spawn(move || {
        let mut buf = [0u8; 16 * 1024];
        while let Ok(n @ 1..) = back_from.read(&mut buf) {
            hold_while(&frozen_back);
            if back_to.write_all(&buf[..n]).is_err() {
                break;
            }
        }
        let _ = back_to.shutdown(Shutdown::Both);
    });
    let mut tail: Vec<u8> = Vec::new();
    let mut buf = [0u8; 16 * 1024];
    loop {
        let n = match client.read(&mut buf) {
            Ok(0) | Err(_) => break,
            Ok(n) => n,
        };
        let mut window = std::mem::take(&mut tail);
        window.extend_from_slice(&buf[..n]);
        let mut guard = armed.lock().unwrap();
        if let Some(pattern) = guard.as_ref() {
            if window
                .windows(pattern.len())
                .any(|w| w == pattern.as_slice())
            {
                *guard = None;
                cuts.fetch_add(1, Ordering::SeqCst);
                break;
            }
            let keep = pattern.len().saturating_sub(1).min(window.len());
            tail = window[window.len() - keep..].to_vec();
        }
        drop(guard);
        hold_while(frozen);
        if server.write_all(&buf[..n]).is_err() {
            break;
        }
    }
    let _ = client.shutdown(Shutdown::Both);
    let _ = server.shutdown(Shutdown::Both);
}

/// Not the test's synchronisation: the relay's stand-in for a server or a network that hangs.
fn hold_while(frozen: &AtomicBool) {
    while frozen.load(Ordering::SeqCst) {
        thread::sleep(std::time::Duration::from_millis(1));
    }
}
