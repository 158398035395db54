//! Graceful drain on one core (CONTRACT.md §7): stop accepting, send every rig a `goaway` with
//! its own delay drawn uniformly from the window, close what is left with 1001 at the end.

use std::rc::Rc;
use std::time::Duration;

use crate::protocol;
use crate::worker::core::{Core, Phase};
use crate::ws::OpCode;

/// The 4503's reason for a connection a draining broker will not take as a rig's: the rig
/// is to try again at once, and finds another broker (this one's listener is closed).
pub(crate) const DRAINING: &str = "retry_after=1";

/// Extra time after the window for close handshakes before the core gives up on stragglers.
const GRACE: Duration = Duration::from_secs(3);
/// How long a drain lasts at least (or its whole window, if shorter), even with no rig left:
/// the answer to `POST /v1/drain` and handshakes already under way get out before the exit.
const FLOOR: Duration = Duration::from_secs(1);

/// Starts the drain; once started, only a zero `window` (a second signal: "now") changes it,
/// closing every connection at once.
pub(crate) fn start(core: &Rc<Core>, window: Duration) {
    if core.draining.replace(true) {
        if window.is_zero() {
            core.drain_may_end.set(true);
            close_all(core);
            monoio::spawn(give_up_after_grace(core.clone()));
        }
        return;
    }
    core.accept_stop.notify();
    let window_ms = window.as_millis() as u64;
    let conns: Vec<_> = core.conns.borrow().values().cloned().collect();
    for conn in conns {
        let mut st = conn.st.borrow_mut();
        match st.phase {
            Phase::Live => {
                let v = st.session.as_ref().map_or(1, |s| s.v);
                let delay = if window_ms == 0 {
                    0
                } else {
                    fastrand::u64(0..window_ms)
                };
                let goaway = protocol::encode_goaway(v, "drain", delay);
                conn.send_frame(&mut st, OpCode::Text, &goaway);
            }
            // Upgraded, not yet a rig's: a draining broker takes no new rig, which
            // CONTRACT.md §2 answers 4503 (1001 is for the end of a drain). Soon: another
            // broker takes it.
            Phase::AwaitHello | Phase::AwaitVerdict => {
                conn.close(&mut st, 4503, DRAINING);
            }
            Phase::Handshake | Phase::Echo => {
                conn.close(&mut st, 1001, "broker draining");
            }
            Phase::Closing | Phase::Done => {}
        }
    }
    // A core with no rigs left has nothing to wait for: it ends after the floor, or when its
    // last rig leaves after that.
    let floor = window.min(FLOOR);
    let early = core.clone();
    monoio::spawn(async move {
        monoio::time::sleep(floor).await;
        early.drain_may_end.set(true);
        early.check_drained();
    });
    let core = core.clone();
    monoio::spawn(async move {
        monoio::time::sleep(window).await;
        core.drain_may_end.set(true);
        close_all(&core);
        give_up_after_grace(core).await;
    });
}

/// The end of the window: 1001 to whoever is left.
fn close_all(core: &Rc<Core>) {
    let conns: Vec<_> = core.conns.borrow().values().cloned().collect();
    for conn in conns {
        conn.close(&mut conn.st.borrow_mut(), 1001, "broker shutting down");
    }
    core.check_drained();
}

async fn give_up_after_grace(core: Rc<Core>) {
    monoio::time::sleep(GRACE).await;
    // Stragglers that never finished their close handshake are dropped with the runtime.
    if !core.finished.get() {
        core.finished.set(true);
        core.done.notify();
    }
}
