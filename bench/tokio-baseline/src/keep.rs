//! `--session-ttl`: the baseline keeps every command control PUBLISHes in Redis before writing
//! it, the way fleetlink-fe's session store does, so the benches can tell what the guarantee
//! costs from what the broker's design costs. Commands POSTed to the admin API are written
//! unkept: the benches send theirs through Redis.
//!
//! A cost model of the write path, not the feature: commands are stored through the very
//! `lua/persist.lua` fe runs (fenced by the rig's lease, batched), forgotten with `HDEL` at the
//! ack, and nothing is ever resumed from them.
//!
//! Written as a tokio team would: the subscription reader numbers the command and queues it in
//! the rig's outbox behind a oneshot, then hands a ticket to one keeper task. The keeper sends
//! whatever has accumulated as one script call (calls do not overlap, so a session's commands
//! reach Redis in seq order and "next" only goes up), then opens each gate and answers control:
//! `ok` for what Redis kept; `rig_not_connected` for what it fenced, which is not written. With
//! Redis unreachable, commands are written unkept, as fe does.

use std::sync::atomic::Ordering::Relaxed;
use std::sync::Arc;

use serde_json::{json, Value};
use tokio::sync::mpsc;

use crate::registry::KeepTicket;
use crate::App;

/// Tickets and forgets waiting for the keeper; the subscription reader waits for room.
pub const KEEP_QUEUE: usize = 65_536;
/// Most commands per persist.lua call (a script blocks Redis while it runs; fe's batch).
const KEEP_BATCH: usize = 500;

/// One piece of keeper work.
#[derive(Debug)]
pub enum Job {
    /// Keep this command, then open its gate and send `reply` (single-rig commands).
    Keep {
        rig_id: String,
        ticket: KeepTicket,
        reply: Option<Reply>,
    },
    /// The rig acked `seq`: the session no longer needs it.
    Forget {
        rig_id: String,
        boot_id: String,
        seq: u64,
    },
}

/// Where and what to answer once the keep is settled.
#[derive(Debug)]
pub struct Reply {
    pub reply_to: String,
    pub id: String,
}

/// `sess:<rig_id>:<boot_id>`, fe's session key (`src/registry/sessions.rs`).
pub fn session_key(rig_id: &str, boot_id: &str) -> String {
    format!("sess:{rig_id}:{boot_id}")
}

/// The keeper task: one persist.lua call per batch of tickets, one `HDEL` pipeline per batch
/// of forgets.
pub async fn keeper(app: Arc<App>, mut rx: mpsc::Receiver<Job>) {
    let Some(fleet) = app.fleet.as_ref() else {
        return;
    };
    let m = &app.metrics.redis;
    let mut jobs = Vec::with_capacity(KEEP_BATCH);
    while rx.recv_many(&mut jobs, KEEP_BATCH).await > 0 {
        let mut keeps = Vec::new();
        let mut forgets = Vec::new();
        for j in jobs.drain(..) {
            match j {
                Job::Keep {
                    rig_id,
                    ticket,
                    reply,
                } => keeps.push((rig_id, ticket, reply)),
                Job::Forget {
                    rig_id,
                    boot_id,
                    seq,
                } => forgets.push((session_key(&rig_id, &boot_id), seq)),
            }
        }
        if !keeps.is_empty() {
            let batch: Vec<(&str, &str, u64, &str)> = keeps
                .iter()
                .map(|(r, t, _)| (r.as_str(), t.boot_id.as_str(), t.seq, t.text.as_str()))
                .collect();
            let kept = fleet.persist(&batch).await;
            for (i, (rig_id, ticket, reply)) in keeps.into_iter().enumerate() {
                // Redis unreachable: written unkept (only a resume elsewhere would miss it).
                let ok = match &kept {
                    // "created": kept, in the session this call made (the first command's).
                    Ok(k) => k.get(i).is_some_and(|s| s == "ok" || s == "created"),
                    Err(_) => true,
                };
                let counter = match (&kept, ok) {
                    (Err(_), _) => &m.persist_unavailable,
                    (Ok(_), true) => &m.persist_ok,
                    (Ok(_), false) => &m.persist_fenced,
                };
                counter.fetch_add(1, Relaxed);
                let seq = ticket.seq;
                let _ = ticket.done.send(ok); // the connection may be gone meanwhile
                if let Some(r) = reply {
                    fleet
                        .publish(r.reply_to, &answer(&r.id, &rig_id, seq, ok))
                        .await;
                }
            }
        }
        if !forgets.is_empty() {
            let n = forgets.len() as u64;
            let counter = match fleet.forget_acked(&forgets).await {
                Ok(()) => &m.forget_ok,
                Err(_) => &m.forget_failed,
            };
            counter.fetch_add(n, Relaxed);
        }
    }
}

/// Control's answer for a kept (or fenced) single-rig command, as fe gives it.
fn answer(id: &str, rig_id: &str, seq: u64, kept: bool) -> Value {
    if kept {
        json!({"id": id, "ok": true, "rig_id": rig_id, "seq": seq})
    } else {
        json!({"id": id, "ok": false, "error": "rig_not_connected", "rig_id": rig_id,
               "detail": "another broker owns this rig now"})
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn keys_and_answers_follow_fe() {
        assert_eq!(session_key("r1", "b1"), "sess:r1:b1");
        let ok = answer("c1", "r1", 7, true);
        assert_eq!(ok["ok"], true);
        assert_eq!(ok["seq"], 7);
        let no = answer("c1", "r1", 7, false);
        assert_eq!(no["ok"], false);
        assert_eq!(no["error"], "rig_not_connected");
        assert!(
            no.get("seq").is_none(),
            "a fenced command has no seq to report"
        );
    }
}
