//! Broadcasts: one command to every rig matching a selector, answered with one aggregate
//! reply once each rig's core has answered, or at the deadline.

use std::time::{Duration, Instant};

use serde_json::{json, Value};

use super::Bridge;
use crate::registry::msg::{CommandReq, ReplyTo};

/// A broadcast reply goes out after this even if some rigs' cores never answered.
const BROADCAST_WAIT: Duration = Duration::from_secs(5);
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
        args: Value,
        reply_to: String,
        now: Instant,
    ) {
        let rigs = self.registry.matching(selector);
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
            let actions = self.registry.command(Box::new(req));
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
            b.failed
                .push(json!({"rig_id": body["rig_id"], "error": body["error"]}));
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
        let Some(b) = self.broadcasts.remove(&agg) else {
            return;
        };
        let body = json!({
            "id": b.id, "ok": true, "broker_id": self.cfg.broker_id, "matched": b.matched,
            "enqueued": b.enqueued, "failed": b.failed, "unanswered": b.outstanding,
        });
        self.publish(b.reply_to, &body);
    }
}
