//! The per-core sweep: advances the timer wheel one tick at a time and enforces the deadlines
//! of the connections that are due (head/hello deadline, PING, PONG, CONTRACT.md §2 liveness).

use std::rc::Rc;
use std::time::Duration;

use crate::heap_trim;
use crate::ids::ConnId;
use crate::metrics::C;
use crate::worker::core::{Core, Liveness, Phase};
use crate::worker::wheel::Tick;
use crate::worker::{conn, quiet_pong, session, slow_reader};
use crate::ws::OpCode;

/// Runs until the core finishes.
pub(crate) async fn run(core: Rc<Core>) {
    let start = monoio::time::Instant::from_std(core.started);
    let trim = core.ticks(heap_trim::EVERY);
    let second = core.ticks(std::time::Duration::from_secs(1)).max(1);
    while !core.finished.get() {
        let next = core.wheel.borrow().now() + 1;
        monoio::time::sleep_until(start + since_start(core.tick_ms, next)).await;
        let due = core.wheel.borrow_mut().advance();
        for id in &due {
            visit(&core, *id);
        }
        core.wheel.borrow_mut().recycle(due);
        if next.is_multiple_of(trim) {
            let mut conns = core.conns.borrow_mut();
            if conns.capacity() > 256 && conns.len() < conns.capacity() / 4 {
                let keep = conns.len() * 2;
                conns.shrink_to(keep);
            }
            drop(conns);
            heap_trim::collect();
        }
        if next.is_multiple_of(second) {
            session::sweep_holds(&core);
            let now = std::time::Instant::now();
            for log in [
                &core.tls_refusals,
                &core.identity_refusals,
                &core.accept_failures,
            ] {
                if let Some(line) = log.borrow_mut().due(now) {
                    log::warn!("{line}");
                }
            }
        }
    }
}

/// When tick `tick` is due, from the core's start. In u64 milliseconds: a u32 count of ticks
/// wrapped after 248 days of 5 ms ticks, and the sweep then found every tick already due and
/// spun, firing deadlines early and starving the core.
fn since_start(tick_ms: u64, tick: Tick) -> Duration {
    Duration::from_millis(tick_ms.saturating_mul(tick))
}

pub(super) fn visit(core: &Core, id: ConnId) {
    let Some(conn) = core.conns.borrow().get(&id).cloned() else {
        return;
    };
    let now = core.wheel.borrow().now();
    let mut st = conn.st.borrow_mut();
    if st.live.wheel_at != now as u32 {
        return;
    }
    let pong = pong_ticks(core);
    if st.phase == Phase::Live && st.live.pong_hidden && now >= st.live.last_ping + pong {
        // The PONG is most likely waiting below the low-water mark: read it before judging.
        drop(st);
        if conn.st.borrow().can_consume(core.now_ms()) {
            conn::read_while_parked(core, &conn);
        }
        st = conn.st.borrow_mut();
    }
    let next = match st.phase {
        Phase::Handshake | Phase::AwaitHello | Phase::AwaitVerdict if now < st.deadline => {
            Some(st.deadline)
        }
        Phase::Handshake => {
            // A refusal was counted at accept: one result per connection.
            if !st.refusing() {
                core.metrics.inc(C::HeadTimeout);
            }
            conn.close(&mut st, 1000, "");
            None
        }
        Phase::AwaitHello => {
            conn.close(&mut st, 4408, "no hello within the hello timeout");
            None
        }
        Phase::AwaitVerdict => {
            conn.close(&mut st, 4503, session::retry_after());
            None
        }
        Phase::Live => {
            let ping = core.ticks(core.cfg.ping_interval);
            if st.live.awaiting_pong && now >= st.live.last_ping + pong {
                st.live.awaiting_pong = false;
                if slow_reader::still_reading(conn.fd, &mut st) {
                    // The PONG is behind a backlog the rig is still reading: late, not missing,
                    // and the rig has shown itself alive, which ends a run of misses.
                    st.live.missed = 0;
                } else if !st.live.throttled {
                    st.live.missed += 1;
                    if st.live.missed >= core.cfg.max_missed_pongs {
                        conn.close(&mut st, 4002, "ping timeout");
                        return;
                    }
                }
            }
            let paused = st.paused_until.is_some();
            let live = &mut st.live;
            if now >= live.last_ping + ping {
                live.last_ping = now;
                live.awaiting_pong = true;
                // A rig still held back by its rate bucket is throttled for this PING too.
                live.throttled = paused;
                core.metrics.inc(C::PingsSent);
                // Before the PING: a quick PONG must find the mark already up.
                if !st.live.pong_hidden && !st.has_tls() {
                    st.live.pong_hidden = quiet_pong::hide(conn.fd);
                }
                slow_reader::mark(conn.fd, &mut st);
                let payload = ping_payload(st.live.last_ping);
                conn.send_frame(&mut st, OpCode::Ping, &payload);
            } else {
                // Past the PONG deadline (the only other visit while a PONG is hidden), after
                // the read above: the mark goes back before anything else can hide behind it.
                quiet_pong::lower(conn.fd, &mut st.live);
            }
            // A miss that would close the connection, or a PONG that waits to be read, is
            // checked at its PONG deadline; any other miss is counted at the next PING's visit.
            let live = &st.live;
            let fatal = live.missed.saturating_add(1) >= core.cfg.max_missed_pongs;
            Some(if live.awaiting_pong && (fatal || live.pong_hidden) {
                live.last_ping + pong
            } else {
                live.last_ping + ping
            })
        }
        Phase::Echo | Phase::Closing | Phase::Done => None,
    };
    if let Some(at) = next {
        core.schedule(&mut st, at, id);
    }
}

/// Whether the PONG deadline of the last PING has passed by more than the tick the sweep
/// reads hidden PONGs at: a PONG read now is late. Judged on the wheel's clock, the sweep's
/// own, so a hidden PONG read at its deadline visit is in time.
pub(crate) fn past_pong_deadline(core: &Core, live: &Liveness) -> bool {
    core.wheel.borrow().now() > live.last_ping + pong_ticks(core)
}

/// What a PING sent at tick `sent` carries, which its PONG echoes (RFC 6455 §5.5.3): the tick's
/// low 32 bits, different for every PING a connection is sent. Without it, a PONG later than
/// the next PING passed for that PING's answer, so a rig answering every PING more than an
/// interval late was never closed, while one answering less late was.
pub(crate) fn ping_payload(sent: Tick) -> [u8; PING_PAYLOAD_LEN] {
    (sent as u32).to_be_bytes()
}

/// The size of [`ping_payload`].
pub(crate) const PING_PAYLOAD_LEN: usize = 4;

/// Whether a PONG carrying `payload` answers the connection's last PING.
pub(crate) fn answers_last_ping(live: &Liveness, payload: &[u8]) -> bool {
    payload == ping_payload(live.last_ping)
}

/// A PONG later than the next PING counts as missed too.
fn pong_ticks(core: &Core) -> crate::worker::wheel::Tick {
    core.ticks(core.cfg.pong_timeout)
        .min(core.ticks(core.cfg.ping_interval))
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Past 2^32 ticks (248 days of 5 ms ticks) a tick is still due after the one before it.
    #[test]
    fn ticks_past_two_to_the_32_are_due_in_order() {
        let wrap: Tick = 1 << 32;
        let before = since_start(5, wrap - 1);
        let after = since_start(5, wrap + 1);
        assert_eq!(after - before, Duration::from_millis(10));
        assert_eq!(after, Duration::from_millis(5 * (wrap + 1)));
    }
}
