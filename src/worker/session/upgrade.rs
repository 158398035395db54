//! The upgrade: a connection's first bytes read as an HTTP request, its path and bearer token
//! checked, and answered with 101 or a refusal; and [`consume`], the entry point for every read,
//! which then hands each decoded frame on to the rig's messages. Separate because this is HTTP
//! and authentication, done before there is any rig or session to speak of.

use std::time::SystemTime;

use crate::http_upgrade::{self, Reject};
use crate::metrics::C;
use crate::worker::core::{Conn, ConnState, Core, Phase, Upgraded};
use crate::ws::{Decoder, Limits};

use super::rig_messages::on_message;

/// Longest request head accepted (CONTRACT.md §2: larger is 431).
pub(crate) const MAX_HEAD: usize = 8 * 1024;

/// Limits of the test-only /echo endpoint (CONTRACT.md §1 `--echo-endpoint`).
/// Autobahn 9.3.1 sends a 4 MiB message as 1 + 65,536 frames of 64 bytes, so the contract's
/// "65,536 fragments" is read as continuation fragments after the first frame.
const ECHO_LIMITS: Limits = Limits {
    max_message: 16 << 20,
    max_fragments: 65_536 + 1,
};

/// How long a rig's reading waits while the events waiting for the bridge are near their bound.
const EVENTS_PAUSE_MS: u32 = 10;

/// Parses as much of `input` as the connection may consume now; returns the bytes used.
pub(crate) fn consume(core: &Core, conn: &Conn, st: &mut ConnState, input: &[u8]) -> usize {
    let mut pos = 0;
    st.rbuf_ready = false;
    while pos < input.len() {
        if !st.can_consume(core.now_ms()) {
            st.rbuf_ready = true;
            break;
        }
        let rest = input.get(pos..).unwrap_or_default();
        if st.phase == Phase::Handshake {
            if st.refusing() {
                // Refused at accept; TLS is up now, so the client can read why.
                conn.send_raw(
                    st,
                    &http_upgrade::service_unavailable(http_upgrade::retry_after_s()),
                );
                st.phase = Phase::Done;
                pos = input.len();
                break;
            }
            match http_upgrade::parse_request(rest, MAX_HEAD, |p| known_path(core, p)) {
                Ok(None) => break,
                Ok(Some((len, req))) => {
                    pos += len;
                    if !authorize(core, st, req.authorization.as_deref()) {
                        core.metrics.inc(C::Reject401);
                        conn.send_raw(st, &http_upgrade::unauthorized());
                        st.phase = Phase::Done;
                        break;
                    }
                    upgrade(core, conn, st, &req.path, &req.key);
                }
                Err(reject) => {
                    refuse(core, conn, st, &reject);
                    break;
                }
            }
            continue;
        }
        // Before its hello too: a connection flooding PINGs before it said which rig it is
        // kept a core busy answering them until its hello timeout (review bb130). And after
        // our close: what crosses it is published (`crossed`), and a rig that flooded its
        // closing window (a kick, or a 4410 it caused itself) was read at line rate, 45,000
        // events in the 2 s linger at `--rig-rate 100` (review bb156).
        let metered = match st.phase {
            Phase::AwaitHello | Phase::Live => true,
            Phase::Closing => st.upgraded == Upgraded::Rig,
            _ => false,
        };
        if metered {
            let now = core.now_ms();
            if let Err(wait_ms) = st.bucket.ready(core.cfg.rig_rate, core.cfg.rig_burst, now) {
                // Over its rate: stop reading this rig until a token is back. TCP pushes back
                // on this rig alone; nothing is dropped (CONTRACT.md §2 fairness).
                core.metrics.inc(C::RigRatePaused);
                st.paused_until = Some(now.wrapping_add(wait_ms));
                if st.phase == Phase::Live {
                    st.live.throttled = true;
                }
                st.rbuf_ready = true;
                break;
            }
            if st.phase != Phase::AwaitHello && core.events_backlogged() {
                // The bridge is behind on the events rigs send (many chatty rigs at once):
                // this rig waits a moment, as over its rate, rather than have what it sends
                // dropped at the bound (CONTRACT.md §2: a chatty rig loses nothing).
                core.metrics.inc(C::EventsPaused);
                st.paused_until = Some(now.wrapping_add(EVENTS_PAUSE_MS));
                if st.phase == Phase::Live {
                    st.live.throttled = true;
                }
                st.rbuf_ready = true;
                break;
            }
        }
        match st.decoder.decode(rest) {
            Ok(None) => break,
            Ok(Some((used, msg))) => {
                pos += used;
                if let Some(msg) = msg {
                    on_message(core, conn, st, msg);
                }
            }
            Err(e) => {
                // Fail the connection (RFC 6455 §7.1.7): our close frame, then drop TCP; no
                // waiting for a close handshake with a peer that broke the protocol.
                if st.phase != Phase::Closing {
                    conn.close(st, e.close_code(), e.to_string());
                }
                st.phase = Phase::Done;
                break;
            }
        }
    }
    pos
}

fn known_path(core: &Core, path: &str) -> bool {
    path == "/agent" || (core.cfg.echo_endpoint && path == "/echo")
}

fn refuse(core: &Core, conn: &Conn, st: &mut ConnState, reject: &Reject) {
    core.metrics.inc(match reject {
        Reject::BadRequest => C::Reject400,
        Reject::NotFound => C::Reject404,
        Reject::MethodNotAllowed => C::Reject405,
        Reject::UpgradeRequired => C::Reject426,
        Reject::HeaderTooLarge => C::Reject431,
    });
    conn.send_raw(st, &reject.response());
    st.phase = Phase::Done;
}

/// Checks the upgrade's bearer token when tokens are configured; keeps its scope and rig claim.
fn authorize(core: &Core, st: &mut ConnState, authorization: Option<&str>) -> bool {
    let Some(verifier) = core.jwt.as_ref() else {
        return true;
    };
    let Some(token) = authorization.and_then(crate::jwt::bearer) else {
        return false;
    };
    match verifier.verify(token, SystemTime::now()) {
        Ok(claims) => {
            if let Some(sec) = st.sec.as_mut() {
                sec.scope = Some(claims.scope);
                sec.token_rig = claims.rig_id;
            }
            true
        }
        Err(e) => {
            log::debug!("refused token: {e}");
            false
        }
    }
}

/// The rig's proven identities: mTLS certificate names and the token's rig claim must all
/// allow `rig` (CONTRACT.md §2, 4403).
pub(super) fn identity_ok(st: &ConnState, rig: &str) -> bool {
    let Some(sec) = st.sec.as_ref() else {
        return true;
    };
    // A client certificate that names nothing (no CN or DNS SAN this broker reads) grants
    // no rig at all.
    let cert_ok = sec
        .peer_ids
        .as_ref()
        .is_none_or(|ids| crate::tls::identity_matches(ids, rig));
    cert_ok && sec.token_rig.as_deref().is_none_or(|r| r == rig)
}

fn upgrade(core: &Core, conn: &Conn, st: &mut ConnState, path: &str, key: &str) {
    core.metrics.inc(C::Upgraded);
    conn.send_raw(st, &http_upgrade::switching_protocols(key));
    if path == "/echo" {
        st.decoder = Decoder::new(ECHO_LIMITS);
        st.phase = Phase::Echo;
        st.upgraded = Upgraded::Echo;
    } else {
        // The hello deadline runs from the upgrade (CONTRACT.md §1 `--hello-timeout`).
        st.phase = Phase::AwaitHello;
        st.upgraded = Upgraded::Rig;
        st.deadline = core.deadline_in(core.cfg.hello_timeout);
        let deadline = st.deadline;
        core.schedule(st, deadline, conn.id);
    }
}
