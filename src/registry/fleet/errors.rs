//! How a failed Redis call or connection attempt is read: Redis refusing who we are, not
//! answering in time, refusing one command on a connection still in step, or a connection
//! gone. Apart because these are verdicts on an error (or, asked with a PING, on a
//! connection) that keep no state of their own: the reconnect path and the paced writes both
//! consult them, and the rules on error texts and codes can be tested without a Redis.

use super::{IO_TIMEOUT, PROBE_TIMEOUT};
use crate::registry::command_con::CommandCon;

/// redis-rs's preamble to every error reply of a kind it knows (READONLY, LOADING, BUSY, ...).
const SERVER_SAID: &str = "An error was signalled by the server - ";

/// What Redis said when it answered a call with a refusal that passes (a read-only replica,
/// a Redis still loading, a busy script), without redis-rs's preamble; `None` when the error
/// is not Redis's answer (a refused connection, a reset, a timeout). An operator told such a
/// Redis is "unreachable" would look for a network fault (review bb146).
pub(super) fn answered_refusal(why: &str) -> Option<&str> {
    why.split_once(SERVER_SAID).map(|(_, said)| said)
}

/// Whether a failed connection attempt's error is Redis refusing who we are (a wrong
/// password, a user without the rights the broker needs) rather than Redis being away.
pub(super) fn refuses_credentials(why: &str) -> bool {
    [
        "WRONGPASS",
        "NOAUTH",
        "NOPERM",
        "AuthenticationFailed",
        "invalid username-password",
        // A password in --redis for a Redis that asks for none.
        "without any password configured",
    ]
    .iter()
    .any(|code| why.contains(code))
}

/// A socket timeout reads as the OS's EAGAIN text ("Resource temporarily unavailable (os
/// error 11)"), which says nothing to an operator about a Redis that accepts connections but
/// does not answer (hung, or paused for writes during a failover): say that instead.
pub(super) fn plain_timeout(why: String) -> String {
    let timed_out = ["(os error 11)", "(os error 110)", "timed out", "WouldBlock"]
        .iter()
        .any(|t| why.contains(t));
    if !timed_out {
        return why;
    }
    // The call's own timeout, or the reconnect probe's shorter one.
    format!("no answer in time (a hung Redis, or one paused for writes): {why}")
}

/// Whether `con` still answers, asked with a PING under [`PROBE_TIMEOUT`] (PING is not a write,
/// so a Redis paused for writes answers it).
pub(super) fn answers_ping(con: &mut CommandCon) -> bool {
    let probe =
        con.set_timeout(PROBE_TIMEOUT).is_ok() && redis::cmd("PING").query::<String>(con).is_ok();
    probe && con.set_timeout(IO_TIMEOUT).is_ok()
}

/// Whether Redis answered a command with a refusal that sending it again would repeat, as
/// opposed to a broken connection or a passing state (loading, a failover, a busy script).
pub(super) fn refused(e: &redis::RedisError) -> bool {
    e.code().is_some_and(|code| {
        !matches!(
            code,
            "LOADING" | "READONLY" | "MASTERDOWN" | "TRYAGAIN" | "CLUSTERDOWN" | "BUSY"
        )
    })
}

/// Whether a refusal's text (a script's reply turned into a string) is Redis refusing for want
/// of memory (`OOM` under `maxmemory` with `noeviction`): a state that passes, unlike an ACL's
/// `NOPERM`, so what it refused can wait for Redis to take writes again.
pub(crate) fn refused_for_memory(why: &str) -> bool {
    why.contains("OOM")
}

/// Whether a failed call leaves its connection sound: Redis refused it (OOM under `maxmemory`
/// with `noeviction`, an ACL's NOPERM, a script's own error) and redis-rs read every reply of
/// the call, so the connection is still in step. Dropping it would take the subscription,
/// which works through all of these, down with it, and reconnecting would change nothing.
/// NOSCRIPT is the exception: a reconnect loads the scripts again.
pub(super) fn leaves_connection_sound(e: &redis::RedisError) -> bool {
    refused(e) && e.code() != Some("NOSCRIPT")
}

/// An error of a call on the command connection, and the Redis error inside it, if any.
pub(super) trait CallError: std::fmt::Display {
    fn redis(&self) -> Option<&redis::RedisError>;
}

impl CallError for redis::RedisError {
    fn redis(&self) -> Option<&redis::RedisError> {
        Some(self)
    }
}

impl CallError for crate::registry::scripts::RegistryError {
    fn redis(&self) -> Option<&redis::RedisError> {
        match self {
            Self::Redis(e) => Some(e),
            // The scripts on the server and this binary disagree: reconnecting loads ours.
            Self::UnexpectedReply(_) => None,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A hello's refusal reaches the bridge as text: only a full Redis's waits for it.
    #[test]
    fn a_refusal_for_want_of_memory_is_told_from_one_for_good() {
        let full = "unexpected reply from a registry script: hello.lua failed: OOM: command not allowed when used memory > 'maxmemory'.";
        assert!(refused_for_memory(full));
        let acl = "NOPERM this user has no permissions to run the 'evalsha' command";
        assert!(!refused_for_memory(acl));
    }

    #[test]
    fn credential_refusals_are_told_from_outages() {
        for why in [
            "NOAUTH: Authentication required.",
            "WRONGPASS: invalid username-password pair or user is disabled.",
            "Password authentication failed- AuthenticationFailed",
            "NOPERM: this user has no permissions to run the 'pexpire' command",
        ] {
            assert!(refuses_credentials(why), "{why}");
        }
        for why in [
            "Connection refused (os error 111)",
            "LOADING: Redis is loading the dataset in memory",
            "timed out",
        ] {
            assert!(!refuses_credentials(why), "{why}");
        }
    }

    #[test]
    fn a_timeout_says_redis_did_not_answer() {
        let why = plain_timeout("Resource temporarily unavailable (os error 11)".into());
        assert!(why.starts_with("no answer in time"), "{why}");
        let refused = "Connection refused (os error 111)".to_string();
        assert_eq!(plain_timeout(refused.clone()), refused);
    }
}
