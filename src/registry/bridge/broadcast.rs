//! Broadcasts: one command to every rig matching a selector, answered with one aggregate
//! reply once each rig's core has answered, or at the deadline.

use std::time::{Duration, Instant};

use serde_json::{json, Value};

use super::Bridge;
use crate::args::Args;
use crate::registry::msg::{CommandReq, ReplyTo};

/// A broadcast reply goes out after this even if some rigs' cores never answered.
const BROADCAST_WAIT: Duration = Duration::from_secs(5);
/// Broadcasts waiting for their rigs' answers at once. Each waits at most [`BROADCAST_WAIT`],
/// so only a controller outrunning stuck cores reaches this; past it a broadcast is answered
/// at once, every matched rig failed `overloaded`, and nothing of it is held.
pub(super) const MAX_BROADCASTS: usize = 4096;
/// A broadcast waiting for its rigs' answers.
pub(super) struct Broadcast {
    id: String,
    reply_to: String,
    matched: usize,
    enqueued: usize,
    failed: Vec<Value>,
    outstanding: usize,
    pub(super) deadline: Instant,
}

impl Bridge {
    pub(super) fn broadcast(
        &mut self,
        id: String,
        selector: &[(String, String)],
        name: String,
        args: Args,
        reply_to: String,
        now: Instant,
    ) {
        let rigs = self.registry.matching(selector);
        if self.broadcasts.len() >= MAX_BROADCASTS {
            self.shared.count("broadcast", "overloaded");
            let refused = Broadcast {
                id,
                reply_to,
                matched: rigs.len(),
                enqueued: 0,
                failed: rigs
                    .iter()
                    .map(|rig| json!({"rig_id": rig.as_str(), "error": "overloaded"}))
                    .collect(),
                outstanding: 0,
                deadline: now,
            };
            return self.answer(refused);
        }
        let agg = self.next_agg;
        self.next_agg += 1;
        self.broadcasts.insert(
            agg,
            Broadcast {
                id: id.clone(),
                reply_to,
                matched: rigs.len(),
                enqueued: 0,
                failed: Vec::new(),
                outstanding: rigs.len(),
                deadline: now + BROADCAST_WAIT,
            },
        );
        for rig in rigs {
            let req = CommandReq {
                id: id.clone(),
                rig,
                name: name.clone(),
                args: args.clone(),
                reply: ReplyTo::Aggregate(agg),
                offline_ttl: None,
            };
            let actions = self.route_command(Box::new(req));
            self.carry_out(actions);
        }
        self.finish_broadcast(agg, false);
    }

    pub(super) fn broadcast_part(&mut self, agg: u64, body: &Value) {
        let Some(b) = self.broadcasts.get_mut(&agg) else {
            return;
        };
        b.outstanding = b.outstanding.saturating_sub(1);
        if body["ok"] == true {
            b.enqueued += 1;
        } else {
            let mut failed = json!({"rig_id": body["rig_id"], "error": body["error"]});
            if let Some(detail) = body.get("detail") {
                failed["detail"] = detail.clone();
            }
            b.failed.push(failed);
        }
        self.finish_broadcast(agg, false);
    }

    /// Publishes the broadcast's one reply once every rig answered (or at its deadline).
    pub(super) fn finish_broadcast(&mut self, agg: u64, timed_out: bool) {
        let done = self
            .broadcasts
            .get(&agg)
            .is_some_and(|b| b.outstanding == 0 || timed_out);
        if !done {
            return;
        }
        if let Some(b) = self.broadcasts.remove(&agg) {
            self.answer(b);
        }
    }

    /// Publishes a broadcast's one reply (CONTRACT.md §4).
    fn answer(&mut self, b: Broadcast) {
        let body = json!({
            "id": b.id, "ok": true, "broker_id": self.cfg.broker_id, "matched": b.matched,
            "enqueued": b.enqueued, "failed": b.failed, "unanswered": b.outstanding,
        });
        self.publish(b.reply_to, &body);
    }
}

#[cfg(test)]
mod tests {
    use std::sync::atomic::Ordering;

    use super::*;
    use crate::doorbell::Inbox;
    use crate::ids::{BootId, ConnId, CoreId, RigId};
    use crate::registry::bridge::testing::bridge;
    use crate::registry::bridge::EXIT_FLUSH_WAIT;
    use crate::registry::bridge::REGISTRY_OPS;
    use crate::registry::exit_wait::ExitWait;
    use crate::registry::msg::ToCore;

    /// A bridge holding rig-7 (label pool=a) on core 0.
    fn bridge_with_rig() -> (Bridge, Inbox<ToCore>) {
        let (mut b, core) = bridge();
        let rig = RigId::parse("rig-7").expect("rig");
        b.registry.hello(
            ConnId::new(CoreId(0), 1),
            rig,
            BootId::generate(1),
            pool_a(),
        );
        (b, core)
    }

    fn pool_a() -> Vec<(String, String)> {
        vec![("pool".to_string(), "a".to_string())]
    }

    /// Broadcasts `id` to pool=a, answers to `back`.
    fn send(b: &mut Bridge, id: &str) {
        let now = Instant::now();
        b.broadcast(
            id.into(),
            &pool_a(),
            "noop".into(),
            Args::empty(),
            "back".into(),
            now,
        );
    }

    /// The last publish queued for Redis, which must be on `back`.
    fn answer(b: &Bridge) -> Value {
        let sent = b.fleet.as_ref().expect("fleet").queued_publishes();
        let (channel, body) = sent.last().expect("answered");
        assert_eq!(channel, "back");
        serde_json::from_slice(body).expect("json")
    }

    #[test]
    fn past_the_bound_a_broadcast_is_answered_at_once_and_not_held() {
        let (mut b, _core) = bridge_with_rig();
        let now = Instant::now();
        for agg in 0..MAX_BROADCASTS as u64 {
            let held = Broadcast {
                id: format!("old-{agg}"),
                reply_to: "r".into(),
                matched: 1,
                enqueued: 0,
                failed: Vec::new(),
                outstanding: 1,
                deadline: now + BROADCAST_WAIT,
            };
            b.broadcasts.insert(agg, held);
        }
        b.next_agg = MAX_BROADCASTS as u64;
        send(&mut b, "new");
        assert_eq!(b.broadcasts.len(), MAX_BROADCASTS, "nothing more held");
        let body = answer(&b);
        assert_eq!(body["id"], "new");
        assert_eq!(body["matched"], 1);
        assert_eq!(body["enqueued"], 0);
        assert_eq!(body["failed"][0]["rig_id"], "rig-7");
        assert_eq!(body["failed"][0]["error"], "overloaded");
        let overloaded = REGISTRY_OPS
            .iter()
            .position(|&op| op == ("broadcast", "overloaded"))
            .expect("counted op");
        assert_eq!(b.shared.ops[overloaded].load(Ordering::Relaxed), 1);
    }

    #[test]
    fn a_broadcast_still_waiting_at_shutdown_is_answered() {
        let (mut b, _core) = bridge_with_rig();
        send(&mut b, "w");
        b.shutdown(ExitWait::new(
            Instant::now(),
            EXIT_FLUSH_WAIT,
            Default::default(),
        ));
        assert!(b.broadcasts.is_empty());
        let body = answer(&b);
        assert_eq!(
            (body["id"].clone(), body["unanswered"].clone()),
            (json!("w"), json!(1))
        );
    }

    #[test]
    fn under_the_bound_a_broadcast_waits_for_its_rigs() {
        let (mut b, core) = bridge_with_rig();
        send(&mut b, "new");
        assert_eq!(b.broadcasts.len(), 1, "held until its rig's core answers");
        assert!(
            std::iter::from_fn(|| core.try_recv()).any(|m| matches!(m, ToCore::Command { .. })),
            "the command went to the rig's core"
        );
        assert!(
            b.fleet
                .as_ref()
                .expect("fleet")
                .queued_publishes()
                .is_empty(),
            "no answer before the rig's core answers"
        );
    }

    /// A rig's failure keeps its detail in the reply, as standalone's does: "the connection
    /// is closing" and "another connection took the rig over, which may have it" call for
    /// different things from control.
    #[test]
    fn a_failed_rig_keeps_its_detail() {
        let (mut b, core) = bridge_with_rig();
        send(&mut b, "d");
        let agg = std::iter::from_fn(|| core.try_recv())
            .find_map(|m| match m {
                ToCore::Command { req, .. } => match req.reply {
                    ReplyTo::Aggregate(agg) => Some(agg),
                    _ => None,
                },
                _ => None,
            })
            .expect("the command went to the rig's core");
        let why = "the rig's connection is closing";
        let part = crate::reply::error("d", Some("rig-7"), "rig_not_connected", why);
        b.broadcast_part(agg, &part);
        let body = answer(&b);
        assert_eq!(
            body["failed"],
            json!([{"rig_id": "rig-7", "error": "rig_not_connected", "detail": why}])
        );
    }
}
