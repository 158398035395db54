//! The bridge thread: the one place that owns the registry (embedded, or Redis in fleet mode)
//! and the control plane. Cores and the admin thread reach it only through its bounded inbox;
//! it reaches cores only through theirs.
//!
//! Standalone, it blocks on its inbox (no wake-ups while idle) and expires parked sessions once a
//! second.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use serde_json::Value;

use crate::config::Config;
use crate::doorbell::{Full, Inbox, Mailbox};
use crate::ids::ConnId;
use crate::metrics::BridgeStats;
use crate::registry::embedded::{Action, Embedded};
use crate::registry::msg::{ReplyTo, ToBridge, ToCore, Verdict};
use crate::reply;

/// Bridge figures the admin thread reads (written only by the bridge thread).
#[derive(Default, Debug)]
pub struct BridgeShared {
    /// 1 while Redis answers.
    pub redis_up: AtomicU64,
    /// Messages the bridge could not hand to a full core inbox.
    pub core_queue_full: AtomicU64,
    /// Replies whose admin waiter had already gone.
    pub replies_orphaned: AtomicU64,
    /// Hellos handled.
    pub hellos: AtomicU64,
    /// Hellos refused as older (4409).
    pub hellos_older: AtomicU64,
    /// Releases (welcomed connections closed).
    pub releases: AtomicU64,
    /// Lifecycle events (dropped standalone: there is no events channel).
    pub events: AtomicU64,
}

impl BridgeShared {
    /// Copies the figures for `/metrics`.
    pub fn stats(&self, queue_depth: usize) -> BridgeStats {
        let get = |a: &AtomicU64| a.load(Ordering::Relaxed);
        BridgeStats {
            redis_up: get(&self.redis_up),
            registry_ops: vec![
                ("hello".into(), "ok".into(), get(&self.hellos) - get(&self.hellos_older)),
                ("hello".into(), "older".into(), get(&self.hellos_older)),
                ("release".into(), "ok".into(), get(&self.releases)),
            ],
            queue_depth: queue_depth as u64,
            core_queue_full: get(&self.core_queue_full),
            pubsub: vec![("events".into(), get(&self.events))],
        }
    }
}

/// Starts the bridge thread.
pub fn spawn(
    cfg: &'static Config,
    inbox: Inbox<ToBridge>,
    cores: Vec<Mailbox<ToCore>>,
    shared: Arc<BridgeShared>,
) -> std::io::Result<JoinHandle<()>> {
    std::thread::Builder::new().name("fleetlink-bridge".into()).spawn(move || {
        let mut bridge = Bridge {
            registry: Embedded::new(cfg.registry_ttl, cfg.outbox),
            cores,
            shared,
        };
        bridge.run(&inbox);
    })
}

struct Bridge {
    registry: Embedded,
    cores: Vec<Mailbox<ToCore>>,
    shared: Arc<BridgeShared>,
}

impl Bridge {
    fn run(&mut self, inbox: &Inbox<ToBridge>) {
        let mut last_expire = Instant::now();
        loop {
            let msg = inbox.recv_timeout(Duration::from_secs(1));
            let now = Instant::now();
            if now.duration_since(last_expire) >= Duration::from_secs(1) {
                self.registry.expire(now);
                last_expire = now;
            }
            match msg {
                Some(ToBridge::Shutdown) => return,
                Some(msg) => self.handle(msg, now),
                None => {}
            }
        }
    }

    fn handle(&mut self, msg: ToBridge, now: Instant) {
        let actions = match msg {
            ToBridge::Hello { conn, rig, boot, labels } => {
                self.shared.hellos.fetch_add(1, Ordering::Relaxed);
                let actions = self.registry.hello(conn, rig, boot, labels);
                let older = actions.iter().any(|a| {
                    matches!(a, Action::Core(_, ToCore::Verdict { verdict: Verdict::Older, .. }))
                });
                if older {
                    self.shared.hellos_older.fetch_add(1, Ordering::Relaxed);
                }
                actions
            }
            ToBridge::Closed { conn, rig, boot, next_seq, carried } => {
                self.shared.releases.fetch_add(1, Ordering::Relaxed);
                self.registry.closed(conn, rig, boot, next_seq, carried, now)
            }
            ToBridge::Abandoned { conn, rig } => self.registry.abandoned(conn, &rig),
            ToBridge::Event(_) => {
                self.shared.events.fetch_add(1, Ordering::Relaxed);
                Vec::new()
            }
            // Standalone has no Redis reply channels; nothing sends these here.
            ToBridge::Reply { .. } => Vec::new(),
            ToBridge::Command(req) => self.registry.command(req),
            ToBridge::Kick { id, rig, reply } => self.registry.kick(id, rig, reply),
            ToBridge::Shutdown => Vec::new(),
        };
        for action in actions {
            self.carry_out(action);
        }
    }

    fn carry_out(&mut self, action: Action) {
        match action {
            Action::Core(conn, msg) => self.send_to_core(conn, msg),
            Action::Reply(to, body) => self.reply(to, body),
            Action::Event(_) => {
                self.shared.events.fetch_add(1, Ordering::Relaxed);
            }
        }
    }

    fn send_to_core(&mut self, conn: ConnId, msg: ToCore) {
        let Some(core) = self.cores.get(conn.core().0 as usize) else { return };
        let Err(Full(msg)) = core.send(msg) else { return };
        self.shared.core_queue_full.fetch_add(1, Ordering::Relaxed);
        // The core cannot take it: answer for what we hold. A lost verdict is covered by the
        // core's own hello deadline; a lost supersede by the next hello or ping timeout.
        match msg {
            ToCore::Command { req, .. } => {
                let body = reply::error(&req.id, Some(req.rig.as_str()), "overloaded", "broker core queue full");
                self.reply(req.reply, body);
            }
            ToCore::Kick { id, rig, reply: to, .. } => {
                let body = reply::error(&id, Some(rig.as_str()), "overloaded", "broker core queue full");
                self.reply(to, body);
            }
            _ => {}
        }
    }

    fn reply(&mut self, to: ReplyTo, body: Value) {
        match to {
            ReplyTo::Admin(tx) => {
                if tx.try_send(body).is_err() {
                    self.shared.replies_orphaned.fetch_add(1, Ordering::Relaxed);
                }
            }
            // Fleet mode publishes these; standalone never creates channel replies.
            ReplyTo::Channel(_) => {}
        }
    }
}
