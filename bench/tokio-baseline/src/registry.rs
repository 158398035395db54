//! Standalone in-process registry: rig_id -> the connection that owns it, its outbox and its
//! session's seq counter. One `Mutex<HashMap>`: that is what the baseline is meant to be.
//! Rules follow the contract's Redis registry: a hello with an older boot_id than the owner's is
//! refused (4409); newer or equal takes over and the old connection is closed with 4410.

use std::collections::{BTreeMap, HashMap, VecDeque};
use std::sync::atomic::{AtomicU16, AtomicU64, Ordering::Relaxed};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use serde_json::{json, Value};
use tokio::sync::{mpsc, oneshot, Notify};

pub const CLOSE_SUPERSEDED: u16 = 4410;
pub const CLOSE_KICKED: u16 = 1012;

pub fn unix_ms() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_millis() as u64)
        .unwrap_or(0)
}

/// A command ready to write: its seq and its serialised `command` message.
#[derive(Debug)]
pub struct Outgoing {
    pub seq: u64,
    /// Control's command id, for the `ack` event.
    pub id: String,
    pub text: String,
    /// With `--session-ttl`: resolves once Redis has the command (true) or refused it because
    /// another broker owns the rig (false: not written). The outbox keeps seq order, so a
    /// command waits for its own keep and for every earlier one.
    pub kept: Option<oneshot::Receiver<bool>>,
}

/// A command queued behind its keep (`--session-ttl`): what the keeper needs to store it.
#[derive(Debug)]
pub struct KeepTicket {
    pub seq: u64,
    pub boot_id: String,
    /// The command's JSON exactly as it will be written.
    pub text: String,
    /// Tells the connection whether to write it.
    pub done: oneshot::Sender<bool>,
}

/// State of one connection shared by its task and the registry.
#[derive(Debug)]
pub struct RigConn {
    pub conn_id: u64,
    pub rig_id: String,
    pub boot_id: String,
    pub labels: BTreeMap<String, String>,
    pub connected_at_ms: u64,
    pub last_ack_seq: AtomicU64,
    pub last_ack_at_ms: AtomicU64,
    /// Highest seq written to the socket, so the registry can tell queued from written.
    pub written_seq: AtomicU64,
    /// Set before `close` is notified: the code the task must close with.
    pub close_code: AtomicU16,
    pub close: Notify,
}

impl RigConn {
    pub fn new(
        conn_id: u64,
        rig_id: String,
        boot_id: String,
        labels: BTreeMap<String, String>,
    ) -> Self {
        Self {
            conn_id,
            rig_id,
            boot_id,
            labels,
            connected_at_ms: unix_ms(),
            last_ack_seq: AtomicU64::new(0),
            last_ack_at_ms: AtomicU64::new(0),
            written_seq: AtomicU64::new(0),
            close_code: AtomicU16::new(0),
            close: Notify::new(),
        }
    }

    /// Asks the connection's task to close with `code` (a permit is stored if it is busy).
    pub fn request_close(&self, code: u16) {
        self.close_code.store(code, Relaxed);
        self.close.notify_one();
    }
}

struct Entry {
    conn: Arc<RigConn>,
    outbox: mpsc::Sender<Outgoing>,
    /// The next seq of this session (rig_id + boot_id).
    next_seq: u64,
    /// Enqueued commands not yet known to be written: (seq, enqueue time), for the
    /// `rig_unresponsive` detail.
    queued: VecDeque<(u64, Instant)>,
}

impl Entry {
    fn prune(&mut self) {
        let written = self.conn.written_seq.load(Relaxed);
        while self.queued.front().is_some_and(|&(s, _)| s <= written) {
            self.queued.pop_front();
        }
    }
}

/// Which local session a takeover elsewhere supersedes.
#[derive(Debug, Clone, Copy)]
pub enum BootCheck<'a> {
    /// Exactly this boot (a refresh answered `superseded` for it).
    Exact(&'a str),
    /// Any boot not newer than this one (an `evict` naming the new owner's boot).
    AtMost(&'a str),
}

#[derive(Debug, PartialEq, Eq)]
pub enum RegisterError {
    /// A live session with a newer boot_id owns this rig_id.
    OlderBootId,
}

#[derive(Debug, PartialEq)]
pub enum EnqueueError {
    NotConnected,
    /// Outbox full; the `rig_unresponsive` reply fields.
    Full {
        depth: usize,
        cap: usize,
        oldest_age: Duration,
        last_ack_seq: u64,
        last_ack_at_ms: u64,
    },
}

pub struct Registry {
    rigs: Mutex<HashMap<String, Entry>>,
    outbox_cap: usize,
}

impl Registry {
    pub fn new(outbox_cap: usize) -> Self {
        Self {
            rigs: Mutex::new(HashMap::new()),
            outbox_cap: outbox_cap.max(1),
        }
    }

    fn lock(&self) -> MutexGuard<'_, HashMap<String, Entry>> {
        // A panic while holding the lock cannot leave the map half-updated in a way that matters
        // more than losing the whole broker would.
        self.rigs.lock().unwrap_or_else(|e| e.into_inner())
    }

    pub fn len(&self) -> usize {
        self.lock().len()
    }

    /// Takes ownership of `conn.rig_id` for `conn`, returning its outbox receiver.
    pub fn register(&self, conn: Arc<RigConn>) -> Result<mpsc::Receiver<Outgoing>, RegisterError> {
        let mut rigs = self.lock();
        let mut next_seq = 1;
        if let Some(old) = rigs.get(&conn.rig_id) {
            // UUIDv7 canonical text compares by time.
            if old.conn.boot_id > conn.boot_id {
                return Err(RegisterError::OlderBootId);
            }
            if old.conn.boot_id == conn.boot_id {
                next_seq = old.next_seq; // same session: seq is never reused
            }
            old.conn.request_close(CLOSE_SUPERSEDED);
        }
        let (tx, rx) = mpsc::channel(self.outbox_cap);
        rigs.insert(
            conn.rig_id.clone(),
            Entry {
                conn,
                outbox: tx,
                next_seq,
                queued: VecDeque::new(),
            },
        );
        Ok(rx)
    }

    /// Removes the entry if it still belongs to this connection; true when it did (the
    /// connection was still the rig's owner, so its registry lease is its to release).
    pub fn unregister(&self, conn: &RigConn) -> bool {
        let mut rigs = self.lock();
        if rigs
            .get(&conn.rig_id)
            .is_some_and(|e| e.conn.conn_id == conn.conn_id)
        {
            rigs.remove(&conn.rig_id);
            return true;
        }
        false
    }

    /// Another owner took `rig_id` (Redis mode): forgets the entry and closes its connection
    /// with 4410, when the local boot passes `check`. True when a connection was superseded.
    pub fn supersede(&self, rig_id: &str, check: BootCheck<'_>) -> bool {
        let mut rigs = self.lock();
        let hit = rigs.get(rig_id).is_some_and(|e| match check {
            BootCheck::Exact(b) => e.conn.boot_id == b,
            BootCheck::AtMost(b) => e.conn.boot_id.as_str() <= b,
        });
        if !hit {
            return false;
        }
        match rigs.remove(rig_id) {
            Some(e) => {
                e.conn.request_close(CLOSE_SUPERSEDED);
                true
            }
            None => false,
        }
    }

    /// `(rig_id, boot_id)` of every rig held here: the leases to refresh.
    pub fn leases(&self) -> Vec<(String, String)> {
        self.lock()
            .values()
            .map(|e| (e.conn.rig_id.clone(), e.conn.boot_id.clone()))
            .collect()
    }

    /// Rigs whose hello labels include every `selector` pair (a broadcast's targets).
    pub fn matching(&self, selector: &[(String, String)]) -> Vec<String> {
        self.lock()
            .values()
            .filter(|e| {
                selector
                    .iter()
                    .all(|(k, v)| e.conn.labels.get(k).is_some_and(|x| x == v))
            })
            .map(|e| e.conn.rig_id.clone())
            .collect()
    }

    /// Assigns the next seq and queues the command; seq advances only when it was queued.
    pub fn enqueue(
        &self,
        rig_id: &str,
        id: &str,
        name: &str,
        args: &Value,
    ) -> Result<u64, EnqueueError> {
        self.enqueue_gated(rig_id, id, name, args, false)
            .map(|(seq, _)| seq)
    }

    /// As [`Registry::enqueue`], but the connection writes the command only once the
    /// returned ticket's `done` says Redis kept it (`--session-ttl`).
    pub fn enqueue_kept(
        &self,
        rig_id: &str,
        id: &str,
        name: &str,
        args: &Value,
    ) -> Result<KeepTicket, EnqueueError> {
        match self.enqueue_gated(rig_id, id, name, args, true)? {
            (_, Some(ticket)) => Ok(ticket),
            (_, None) => Err(EnqueueError::NotConnected), // not reached: keep was asked for
        }
    }

    fn enqueue_gated(
        &self,
        rig_id: &str,
        id: &str,
        name: &str,
        args: &Value,
        keep: bool,
    ) -> Result<(u64, Option<KeepTicket>), EnqueueError> {
        let mut rigs = self.lock();
        let e = rigs.get_mut(rig_id).ok_or(EnqueueError::NotConnected)?;
        e.prune();
        let seq = e.next_seq;
        let text = json!({"type": "command", "seq": seq, "id": id, "name": name, "args": args})
            .to_string();
        let (gate, ticket) = if keep {
            let (done, kept) = oneshot::channel();
            let ticket = KeepTicket {
                seq,
                boot_id: e.conn.boot_id.clone(),
                text: text.clone(),
                done,
            };
            (Some(kept), Some(ticket))
        } else {
            (None, None)
        };
        match e.outbox.try_send(Outgoing {
            seq,
            id: id.to_string(),
            text,
            kept: gate,
        }) {
            Ok(()) => {
                e.next_seq += 1;
                e.queued.push_back((seq, Instant::now()));
                Ok((seq, ticket))
            }
            Err(mpsc::error::TrySendError::Full(_)) => Err(EnqueueError::Full {
                depth: e.queued.len(),
                cap: self.outbox_cap,
                oldest_age: e
                    .queued
                    .front()
                    .map_or(Duration::ZERO, |&(_, t)| t.elapsed()),
                last_ack_seq: e.conn.last_ack_seq.load(Relaxed),
                last_ack_at_ms: e.conn.last_ack_at_ms.load(Relaxed),
            }),
            // The task is gone but has not unregistered yet: as good as not connected.
            Err(mpsc::error::TrySendError::Closed(_)) => Err(EnqueueError::NotConnected),
        }
    }

    /// Closes the rig's connection with 1012 (force reconnect). False if not connected.
    pub fn kick(&self, rig_id: &str) -> bool {
        match self.lock().get(rig_id) {
            Some(e) => {
                e.conn.request_close(CLOSE_KICKED);
                true
            }
            None => false,
        }
    }

    /// The `GET /v1/rigs` listing.
    pub fn list(&self) -> Vec<Value> {
        let mut rigs = self.lock();
        let mut out: Vec<Value> = rigs
            .values_mut()
            .map(|e| {
                e.prune();
                json!({
                    "rig_id": e.conn.rig_id,
                    "boot_id": e.conn.boot_id,
                    "labels": e.conn.labels,
                    "connected_at_ms": e.conn.connected_at_ms,
                    "last_ack_seq": e.conn.last_ack_seq.load(Relaxed),
                    "outbox_depth": e.queued.len(),
                })
            })
            .collect();
        out.sort_by(|a, b| a["rig_id"].as_str().cmp(&b["rig_id"].as_str()));
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const OLD: &str = "017f22e2-79b0-7cc3-98c4-dc0c0c07398f";
    const NEW: &str = "018f22e2-79b0-7cc3-98c4-dc0c0c07398f";

    fn conn(id: u64, boot: &str) -> Arc<RigConn> {
        Arc::new(RigConn::new(id, "r1".into(), boot.into(), BTreeMap::new()))
    }

    #[test]
    fn boot_id_rules() {
        let reg = Registry::new(4);
        let a = conn(1, NEW);
        let _rx_a = reg.register(a.clone()).unwrap();
        assert_eq!(
            reg.register(conn(2, OLD)).err(),
            Some(RegisterError::OlderBootId)
        );
        assert_eq!(
            a.close_code.load(Relaxed),
            0,
            "refused hello must not disturb the owner"
        );
        assert_eq!(reg.enqueue("r1", "c1", "x", &json!({})), Ok(1));
        let b = conn(3, NEW);
        let _rx_b = reg.register(b.clone()).unwrap();
        assert_eq!(a.close_code.load(Relaxed), CLOSE_SUPERSEDED);
        assert_eq!(
            reg.enqueue("r1", "c2", "x", &json!({})),
            Ok(2),
            "same session keeps seq"
        );
        reg.unregister(&a); // stale connection's cleanup must not remove the new owner
        assert_eq!(reg.len(), 1);
        reg.unregister(&b);
        assert_eq!(reg.len(), 0);
        assert_eq!(
            reg.enqueue("r1", "c3", "x", &json!({})),
            Err(EnqueueError::NotConnected)
        );
    }

    #[test]
    fn full_outbox_reports_unresponsive() {
        let reg = Registry::new(2);
        let c = conn(1, OLD);
        let mut rx = reg.register(c.clone()).unwrap();
        assert_eq!(reg.enqueue("r1", "a", "x", &json!({})), Ok(1));
        assert_eq!(reg.enqueue("r1", "b", "x", &json!({})), Ok(2));
        match reg.enqueue("r1", "c", "x", &json!({})) {
            Err(EnqueueError::Full {
                depth: 2, cap: 2, ..
            }) => {}
            other => panic!("{other:?}"),
        }
        let first = rx.try_recv().unwrap();
        assert_eq!(first.seq, 1);
        assert!(first.text.contains(r#""type":"command""#));
        c.written_seq.store(1, Relaxed);
        assert_eq!(
            reg.enqueue("r1", "d", "x", &json!({})),
            Ok(3),
            "seq not consumed by the refusal"
        );
        assert_eq!(reg.list()[0]["outbox_depth"], 2);
        assert!(reg.kick("r1"));
        assert_eq!(c.close_code.load(Relaxed), CLOSE_KICKED);
    }

    #[test]
    fn a_kept_command_waits_for_its_gate() {
        let reg = Registry::new(2);
        let c = conn(1, OLD);
        let mut rx = reg.register(c).unwrap();
        assert_eq!(reg.enqueue("r1", "a", "x", &json!({})), Ok(1));
        let ticket = reg.enqueue_kept("r1", "b", "y", &json!({"n": 1})).unwrap();
        assert_eq!((ticket.seq, ticket.boot_id.as_str()), (2, OLD));
        assert!(rx.try_recv().unwrap().kept.is_none(), "seq 1 was not kept");
        let mut out = rx.try_recv().unwrap();
        assert_eq!(out.text, ticket.text, "Redis keeps exactly what is written");
        let gate = out.kept.as_mut().unwrap();
        assert!(
            gate.try_recv().is_err(),
            "not open before the keeper answers"
        );
        ticket.done.send(false).unwrap();
        assert_eq!(gate.try_recv(), Ok(false));
        assert_eq!(
            reg.enqueue_kept("r2", "c", "x", &json!({})).err(),
            Some(EnqueueError::NotConnected)
        );
    }

    #[test]
    fn supersede_checks_the_boot() {
        let reg = Registry::new(2);
        let mut labels = BTreeMap::new();
        labels.insert("group".to_string(), "a".to_string());
        let c = Arc::new(RigConn::new(1, "r1".into(), NEW.into(), labels));
        let _rx = reg.register(c.clone()).unwrap();
        let sel = |k: &str, v: &str| vec![(k.to_string(), v.to_string())];
        assert_eq!(reg.matching(&sel("group", "a")), vec!["r1".to_string()]);
        assert!(reg.matching(&sel("group", "b")).is_empty());
        assert_eq!(reg.leases(), vec![("r1".to_string(), NEW.to_string())]);
        assert!(
            !reg.supersede("r1", BootCheck::AtMost(OLD)),
            "an older evict"
        );
        assert!(
            !reg.supersede("r1", BootCheck::Exact(OLD)),
            "a stale refresh answer"
        );
        assert_eq!(c.close_code.load(Relaxed), 0);
        assert!(reg.supersede("r1", BootCheck::AtMost(NEW)));
        assert_eq!(c.close_code.load(Relaxed), CLOSE_SUPERSEDED);
        assert_eq!(reg.len(), 0);
        assert!(!reg.unregister(&c), "nothing left to release");
    }
}
