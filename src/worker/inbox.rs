//! A core's inbox: messages from the bridge, the admin threads and the other cores, drained
//! whenever the doorbell rings. The loop sleeps on one readiness op while nothing arrives.

use std::future::{poll_fn, Future};
use std::pin::pin;
use std::rc::Rc;
use std::task::Poll;

use crate::doorbell::Full;
use crate::doorbell::Inbox;
use crate::metrics::{RigInfo, C};
use crate::registry::msg::{RigPage, ToBridge, ToCore};
use crate::reply;
use crate::worker::core::{Core, Phase};
use crate::worker::{admin_conn, closing, drain, session};

/// Messages handled between rings of the bridge's doorbell inside one burst.
const RING_EVERY: u32 = 256;

/// Handles messages until the core has finished draining.
pub(crate) async fn run(core: Rc<Core>, inbox: Inbox<ToCore>) -> std::io::Result<()> {
    let bell = monoio::net::UnixStream::from_std(inbox.listen.try_clone()?)?;
    loop {
        let mut handled = 0u32;
        while let Some(msg) = inbox.try_recv() {
            handle(&core, msg);
            handled += 1;
            if handled.is_multiple_of(RING_EVERY) {
                // A long burst keeps this loop from yielding: the bridge hears of it meanwhile.
                core.bridge.ring();
            }
        }
        if core.finished.get() {
            let snap = core.metrics.snapshot(core.id.0 as usize, core.driver);
            core.retired.keep(snap);
            return Ok(());
        }
        if !inbox.arm() {
            continue;
        }
        let mut ring = pin!(bell.readable(false));
        poll_fn(|cx| {
            if core.done.poll(cx) {
                return Poll::Ready(());
            }
            ring.as_mut().poll(cx).map(|_| ())
        })
        .await;
        inbox.clear();
    }
}

pub(crate) fn handle(core: &Rc<Core>, msg: ToCore) {
    let conn_of = |id| core.conns.borrow().get(&id).cloned();
    match msg {
        ToCore::Verdict { conn, verdict } => match conn_of(conn) {
            Some(c) => session::on_verdict(core, &c, &mut c.st.borrow_mut(), verdict),
            None => session::return_verdict(core, conn, None, verdict),
        },
        ToCore::Supersede { conn } => {
            if let Some(c) = conn_of(conn) {
                // Not "newer": after a Redis outage an older boot's lease can win
                // (CONTRACT.md §2 says only that another connection took ownership).
                c.close(
                    &mut c.st.borrow_mut(),
                    4410,
                    "superseded by another connection of this rig",
                );
            }
        }
        ToCore::Command { conn, req, direct } => {
            match conn_of(conn).filter(|c| !direct || session::holds(&c.st.borrow(), &req.rig)) {
                Some(c) => {
                    if direct {
                        core.metrics.inc(C::AdminDirect);
                    }
                    session::on_command(core, &c, &mut c.st.borrow_mut(), *req)
                }
                // An admin thread's route is stale (the rig reconnected, or is leaving): the
                // bridge knows where the rig is now, or holds the command through a hand-over.
                None if direct => {
                    core.metrics.inc(C::AdminRerouted);
                    if let Err(Full(ToBridge::Command(req))) =
                        core.push_to_bridge(ToBridge::Command(req))
                    {
                        session::bridge_full(core, &req.id, &req.rig, req.reply);
                    }
                }
                None => session::not_taken(core, conn, *req, "the rig's connection closed"),
            }
        }
        ToCore::Noted { conn } => {
            if let Some(c) = conn_of(conn) {
                crate::worker::conn::noted(&c);
            }
        }
        ToCore::Rekeep { conn } => {
            if !closing::rekeep(core, conn) {
                if let Some(c) = conn_of(conn) {
                    session::on_rekeep(core, &c.st.borrow());
                }
            }
        }
        ToCore::RaiseSeq { conn, next, missed } => {
            // A closed session's missed commands stay in Redis, for the rig's resume.
            if !closing::raise_seq(core, conn, next) {
                if let Some(c) = conn_of(conn) {
                    session::raise_seq(core, &c, &mut c.st.borrow_mut(), next, missed);
                }
            }
        }
        ToCore::Forget { conn, seqs } => {
            if let Some(c) = conn_of(conn) {
                session::forget_dropped(&mut c.st.borrow_mut(), &seqs);
            }
        }
        ToCore::HoldDelivered { conn, more } => {
            if let Some(c) = conn_of(conn) {
                session::on_delivery_end(core, &c, &mut c.st.borrow_mut(), more);
            }
        }
        ToCore::HoldFound { conn } => {
            if let Some(c) = conn_of(conn) {
                session::on_hold_found(core, &c, &mut c.st.borrow_mut());
            }
        }
        ToCore::Persisted {
            conn,
            seq,
            kept,
            unkept,
        } => {
            // A closing connection's session may have left it while its socket lingers.
            if !closing::persisted(core, conn, seq, kept, unkept) {
                if let Some(c) = conn_of(conn) {
                    session::on_persisted(core, &c, &mut c.st.borrow_mut(), seq, kept, unkept);
                }
            }
        }
        ToCore::Kick {
            conn,
            id,
            rig,
            reply: to,
        } => {
            let body = match conn_of(conn) {
                Some(c) => {
                    core.metrics.inc(C::Kicks);
                    c.close(&mut c.st.borrow_mut(), 1012, "kicked by control; reconnect");
                    reply::done(&id, &rig)
                }
                None => reply::error(
                    &id,
                    Some(rig.as_str()),
                    "rig_not_connected",
                    "the rig's connection closed",
                ),
            };
            session::deliver(core, to, body);
        }
        ToCore::Snapshot { rigs, reply } => {
            let mut snap = core.metrics.snapshot(core.id.0 as usize, core.driver);
            if let Some(page) = rigs {
                snap.rigs = rig_list(core, &page);
            }
            // The admin thread may have given up waiting; nothing to do then.
            let _ = reply.try_send(snap);
        }
        ToCore::Drain { window } => drain::start(core, window),
        ToCore::AdminConn(conn) => {
            monoio::spawn(admin_conn::serve(core.clone(), conn));
        }
        ToCore::AdminReply { slot, reply } => core.admin_waits.answer(slot, *reply),
    }
}

/// This core's live rigs on `page`, sorted by rig id.
fn rig_list(core: &Core, page: &RigPage) -> Vec<RigInfo> {
    let conns = core.conns.borrow();
    let after = page.after.as_deref();
    // Picked and sorted by id before anything is formatted: a page of 100 out of 19,000 rigs
    // builds 100 entries.
    let mut live: Vec<_> = conns
        .values()
        .filter_map(|conn| {
            let st = conn.st.borrow();
            let s = st.session.as_ref()?;
            let on_page =
                s.welcomed && st.phase == Phase::Live && after.is_none_or(|a| s.rig.as_str() > a);
            on_page.then(|| (s.rig.clone(), conn))
        })
        .collect();
    live.sort_unstable_by(|a, b| a.0.as_str().cmp(b.0.as_str()));
    live.truncate(page.limit);
    let mut out = Vec::with_capacity(live.len());
    for (_, conn) in live {
        let st = conn.st.borrow();
        let Some(s) = st.session.as_ref() else {
            continue;
        };
        out.push(RigInfo {
            rig_id: s.rig.to_string(),
            boot_id: s.boot.to_string(),
            labels: s.labels.iter().cloned().collect(),
            connected_at: crate::worker::core::stamp(s.connected_ms)
                .map(reply::rfc3339)
                .unwrap_or_default(),
            last_ack_seq: s.last_ack.0,
            last_ack_at: crate::worker::core::stamp(s.last_ack_ms).map(reply::rfc3339),
            outbox_depth: s.outbox_len(),
            next_seq: s.next_seq.0,
            core: core.id.0 as usize,
        });
    }
    out
}
