//! A TCP relay in front of a test's redis-server that, once armed, cuts the connection whose
//! client sends a given byte string, without passing that call on: a Redis that fails between
//! two calls of one operation, which killing or freezing the server cannot aim at. It can also
//! freeze what goes through it: a Redis that one broker cannot reach while others can. And it
//! can hold one call until the test lets it go, to change Redis just before that call runs.

use std::io::{Read, Write};
use std::net::{Shutdown, SocketAddr, TcpListener, TcpStream};
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::thread;

/// Relays 127.0.0.1:<port> to the upstream port; stops accepting on drop.
pub struct Relay {
    addr: SocketAddr,
    armed: Arc<Mutex<Option<Vec<u8>>>>,
    /// Like `armed`, but the call is passed on before the cut: Redis runs it, and its answer
    /// is lost.
    armed_after: Arc<Mutex<Option<Vec<u8>>>>,
    /// Set: the relay goes down at that cut, as a Redis gone right after running the call.
    down_after: Arc<AtomicBool>,
    cuts: Arc<AtomicUsize>,
    stop: Arc<AtomicBool>,
    frozen: Arc<AtomicBool>,
    frozen_back: Arc<AtomicBool>,
    down: Arc<AtomicBool>,
    /// Connections closed at once while down.
    turned_away: Arc<AtomicUsize>,
    /// The call to hold back (see [`Relay::hold_on`]), how many were held so far, and
    /// whether one is held now.
    hold: Arc<Mutex<Option<Vec<u8>>>>,
    holds: Arc<AtomicUsize>,
    holding: Arc<AtomicBool>,
    /// The relay's own address on its connection to Redis that carried the last held call:
    /// Redis's `CLIENT LIST` names that connection by it.
    held_from: Arc<Mutex<Option<SocketAddr>>>,
    /// Holds both directions of the subscriber connections (see
    /// [`Relay::freeze_subscriptions`]).
    subs_frozen: Arc<AtomicBool>,
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
            armed_after: Arc::new(Mutex::new(None)),
            down_after: Arc::new(AtomicBool::new(false)),
            cuts: Arc::new(AtomicUsize::new(0)),
            stop: Arc::new(AtomicBool::new(false)),
            frozen: Arc::new(AtomicBool::new(false)),
            frozen_back: Arc::new(AtomicBool::new(false)),
            down: Arc::new(AtomicBool::new(false)),
            turned_away: Arc::new(AtomicUsize::new(0)),
            open: Arc::new(Mutex::new(Vec::new())),
            hold: Arc::new(Mutex::new(None)),
            holds: Arc::new(AtomicUsize::new(0)),
            holding: Arc::new(AtomicBool::new(false)),
            held_from: Arc::new(Mutex::new(None)),
            subs_frozen: Arc::new(AtomicBool::new(false)),
        };
        let (armed, cuts, stop) = (relay.armed.clone(), relay.cuts.clone(), relay.stop.clone());
        let armed_after = relay.armed_after.clone();
        let down_after = relay.down_after.clone();
        let (frozen, frozen_back) = (relay.frozen.clone(), relay.frozen_back.clone());
        let (down, open) = (relay.down.clone(), relay.open.clone());
        let turned_away = relay.turned_away.clone();
        let held = Held {
            pattern: relay.hold.clone(),
            count: relay.holds.clone(),
            holding: relay.holding.clone(),
            from: relay.held_from.clone(),
        };
        let subs_frozen = relay.subs_frozen.clone();
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
                let (armed, cuts) = ([armed.clone(), armed_after.clone()], cuts.clone());
                let (frozen, frozen_back) = (frozen.clone(), frozen_back.clone());
                let then_down = [down_after.clone(), down.clone()];
                let held = held.clone();
                let subs_frozen = subs_frozen.clone();
                thread::spawn(move || {
                    let watch = Watch {
                        armed: &armed,
                        cuts: &cuts,
                        held: &held,
                        subs_frozen: &subs_frozen,
                    };
                    pump(client, server, &watch, &frozen, frozen_back, &then_down)
                });
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

    /// The next connection to send `pattern` passes that call on, then is cut before Redis's
    /// answer comes back: a call that ran, whose caller cannot know it did.
    #[allow(dead_code)] // not every test binary loses an answer
    pub fn cut_after(&self, pattern: &[u8], then_down: bool) {
        self.down_after.store(then_down, Ordering::SeqCst);
        *self.armed_after.lock().unwrap() = Some(pattern.to_vec());
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

    /// The next call to send `pattern` is held, once, before Redis sees it, until
    /// [`Relay::release`]: the caller waits for its answer meanwhile, and the test changes
    /// Redis in between ([`Relay::holds`] says when the call is there).
    #[allow(dead_code)] // not every test binary holds a call
    pub fn hold_on(&self, pattern: &[u8]) {
        *self.hold.lock().unwrap() = Some(pattern.to_vec());
    }

    /// How many calls were held so far (released or not).
    #[allow(dead_code)]
    pub fn holds(&self) -> usize {
        self.holds.load(Ordering::SeqCst)
    }

    /// Holds what goes through the subscriber connections (those that sent a SUBSCRIBE), both
    /// ways, from now until unfrozen: a broker that hears nothing on its channels (another
    /// broker's evict, say) while its calls go through. Nothing is lost.
    #[allow(dead_code)] // not every test binary partitions a subscription
    pub fn freeze_subscriptions(&self, frozen: bool) {
        self.subs_frozen.store(frozen, Ordering::SeqCst);
    }

    /// The relay's address on the Redis connection of the last held call.
    #[allow(dead_code)]
    pub fn held_from(&self) -> Option<SocketAddr> {
        *self.held_from.lock().unwrap()
    }

    /// Lets the held call go on to Redis.
    #[allow(dead_code)]
    pub fn release(&self) {
        self.holding.store(false, Ordering::SeqCst);
    }
}

/// What one connection's client→server copy watches for: the calls to cut (`[cut before, cut
/// after]`), counted in `cuts`, and the one to hold.
#[derive(Clone, Copy)]
struct Watch<'a> {
    armed: &'a [Arc<Mutex<Option<Vec<u8>>>>; 2],
    cuts: &'a AtomicUsize,
    held: &'a Held,
    subs_frozen: &'a Arc<AtomicBool>,
}

/// The relay's hold of one call (see [`Relay::hold_on`]), shared by its connections.
#[derive(Clone)]
struct Held {
    pattern: Arc<Mutex<Option<Vec<u8>>>>,
    count: Arc<AtomicUsize>,
    holding: Arc<AtomicBool>,
    from: Arc<Mutex<Option<SocketAddr>>>,
}

impl Drop for Relay {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
        // Wakes the accept loop so it sees `stop`.
        let _ = TcpStream::connect(self.addr);
    }
}

/// Copies client→server, watching for the armed patterns (also across reads: `[cut before,
/// cut after]` passing the call on), while another thread copies server→client.
fn pump(
    mut client: TcpStream,
    mut server: TcpStream,
    watch: &Watch<'_>,
    frozen: &AtomicBool,
    frozen_back: Arc<AtomicBool>,
    [down_after, down]: &[Arc<AtomicBool>; 2],
) {
    let Watch {
        armed,
        cuts,
        held,
        subs_frozen,
    } = *watch;
    let (Ok(mut back_from), Ok(mut back_to)) = (server.try_clone(), client.try_clone()) else {
        return;
    };
    let back_frozen = frozen_back.clone();
    // Whether this connection subscribed, and so is held by `subs_frozen`.
    let is_sub = Arc::new(AtomicBool::new(false));
    let (back_sub, back_subs_frozen) = (is_sub.clone(), subs_frozen.clone());
    thread::spawn(move || {
        let mut buf = [0u8; 16 * 1024];
        while let Ok(n @ 1..) = back_from.read(&mut buf) {
            hold_while(&back_frozen);
            hold_subscriber(&back_sub, &back_subs_frozen);
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
        // The command itself, framed as RESP sends it: the word alone is in the scripts' text
        // that the command connection loads.
        if window
            .windows(13)
            .any(|w| w.eq_ignore_ascii_case(b"\r\nSUBSCRIBE\r\n"))
        {
            is_sub.store(true, Ordering::SeqCst);
        }
        let mut cut = None;
        for (after, slot) in armed.iter().enumerate() {
            let mut guard = slot.lock().unwrap();
            if let Some(pattern) = guard.as_ref() {
                if window
                    .windows(pattern.len())
                    .any(|w| w == pattern.as_slice())
                {
                    *guard = None;
                    cut = Some(after == 1);
                    break;
                }
                let keep = pattern.len().saturating_sub(1).min(window.len());
                if keep > tail.len() {
                    tail = window[window.len() - keep..].to_vec();
                }
            }
        }
        // Matched within this read (a call split between two reads passes unheld, and the
        // test waiting for its hold fails rather than passing wrongly). Only this connection
        // waits.
        let hold = {
            let mut pattern = held.pattern.lock().unwrap();
            let found = pattern
                .as_ref()
                .is_some_and(|p| window.windows(p.len()).any(|w| w == p.as_slice()));
            if found {
                *pattern = None;
                *held.from.lock().unwrap() = server.local_addr().ok();
                held.holding.store(true, Ordering::SeqCst);
                held.count.fetch_add(1, Ordering::SeqCst);
            }
            found
        };
        if hold {
            hold_while(&held.holding);
        }
        if let Some(pass) = cut {
            cuts.fetch_add(1, Ordering::SeqCst);
            if pass {
                // Redis's answer is held until both ends are shut: it never arrives.
                frozen_back.store(true, Ordering::SeqCst);
                if down_after.load(Ordering::SeqCst) {
                    down.store(true, Ordering::SeqCst);
                }
                let _ = server.write_all(&buf[..n]);
                let _ = client.shutdown(Shutdown::Both);
                let _ = server.shutdown(Shutdown::Write);
                frozen_back.store(false, Ordering::SeqCst);
            }
            break;
        }
        hold_while(frozen);
        hold_subscriber(&is_sub, subs_frozen);
        if server.write_all(&buf[..n]).is_err() {
            break;
        }
    }
    let _ = client.shutdown(Shutdown::Both);
    let _ = server.shutdown(Shutdown::Both);
}

/// Holds a subscriber connection's bytes while subscriptions are frozen.
fn hold_subscriber(is_sub: &AtomicBool, subs_frozen: &AtomicBool) {
    while is_sub.load(Ordering::SeqCst) && subs_frozen.load(Ordering::SeqCst) {
        thread::sleep(std::time::Duration::from_millis(1));
    }
}

/// Not the test's synchronisation: the relay's stand-in for a server or a network that hangs.
fn hold_while(frozen: &AtomicBool) {
    while frozen.load(Ordering::SeqCst) {
        thread::sleep(std::time::Duration::from_millis(1));
    }
}
