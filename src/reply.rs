//! The reply objects of CONTRACT.md §4, shared by the admin API and the Redis control plane so
//! both speak exactly the same JSON.

use std::time::{Duration, SystemTime, UNIX_EPOCH};

use serde_json::{json, Value};

use crate::ids::{RigId, Seq};

/// `{"id","ok":true,"rig_id","seq"}`: the command is enqueued with `seq`.
pub fn enqueued(id: &str, rig: &RigId, seq: Seq) -> Value {
    json!({"id": id, "ok": true, "rig_id": rig.as_str(), "seq": seq.0})
}

/// `{"id","ok":true,"rig_id"}`: a kick was carried out.
pub fn done(id: &str, rig: &RigId) -> Value {
    json!({"id": id, "ok": true, "rig_id": rig.as_str()})
}

/// An error reply other than `rig_unresponsive` (`rig_not_connected`, `bad_request`, …).
pub fn error(id: &str, rig: Option<&str>, error: &str, detail: &str) -> Value {
    json!({"id": id, "ok": false, "error": error, "rig_id": rig, "detail": detail})
}

/// What the broker knows about a rig whose outbox is full.
#[derive(Debug, Clone, Copy)]
pub struct Unresponsive {
    /// Commands queued and not yet written.
    pub queued: usize,
    /// The outbox bound.
    pub capacity: usize,
    /// Bytes queued and their bound, when bytes filled the outbox rather than the count.
    pub bytes: Option<(usize, usize)>,
    /// The session's commands (written and unacked, queued, waiting for Redis) and their
    /// bound, what a resume carries, when that filled rather than the outbox: a rig that
    /// reads everything and acks nothing can fill it with its outbox empty.
    pub session: Option<(usize, usize)>,
    /// Age of the oldest queued command (with `session`, the oldest the session holds).
    pub oldest_age: Duration,
    /// Last seq the rig acked, 0 if none.
    pub last_ack_seq: Seq,
    /// When that ack arrived.
    pub last_ack_at: Option<SystemTime>,
}

/// `rig_unresponsive` with the contract's `detail`, `last_ack_seq`, `last_ack_at`,
/// `suggested_action`.
pub fn unresponsive(id: &str, rig: &RigId, u: Unresponsive) -> Value {
    json!({
        "id": id,
        "ok": false,
        "error": "rig_unresponsive",
        "rig_id": rig.as_str(),
        "detail": match (u.session, u.bytes) {
            (Some((held, limit)), _) => format!(
                "session full ({held}/{limit} commands unacked or queued, what a resume \
                 carries; {} of them queued), oldest unacked cmd age {}s",
                u.queued, u.oldest_age.as_secs()
            ),
            (None, None) => format!(
                "outbox full ({}/{}), oldest queued cmd age {}s",
                u.queued, u.capacity, u.oldest_age.as_secs()
            ),
            (None, Some((bytes, cap))) => format!(
                "outbox full ({bytes}/{cap} bytes in {} commands), oldest queued cmd age {}s",
                u.queued, u.oldest_age.as_secs()
            ),
        },
        "last_ack_seq": u.last_ack_seq.0,
        "last_ack_at": u.last_ack_at.map(rfc3339),
        "suggested_action": "force_reconnect",
    })
}

/// RFC 3339 UTC text with milliseconds, e.g. `2026-11-29T20:31:07.123Z`.
pub fn rfc3339(t: SystemTime) -> String {
    let nanos = t.duration_since(UNIX_EPOCH).map_or(0, |d| d.as_nanos()) as i128;
    let format = time::macros::format_description!(
        "[year]-[month]-[day]T[hour]:[minute]:[second].[subsecond digits:3]Z"
    );
    time::OffsetDateTime::from_unix_timestamp_nanos(nanos)
        .ok()
        .and_then(|dt| dt.format(&format).ok())
        .unwrap_or_default()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn unresponsive_has_contract_fields() {
        let rig = RigId::parse("rig-1").unwrap();
        let v = unresponsive(
            "c1",
            &rig,
            Unresponsive {
                queued: 128,
                capacity: 128,
                bytes: None,
                session: None,
                oldest_age: Duration::from_secs(47),
                last_ack_seq: Seq(9),
                last_ack_at: Some(UNIX_EPOCH + Duration::from_millis(1_500)),
            },
        );
        assert_eq!(
            v["detail"],
            "outbox full (128/128), oldest queued cmd age 47s"
        );
        let session_full = Unresponsive {
            queued: 0,
            capacity: 2,
            bytes: None,
            session: Some((18, 18)),
            oldest_age: Duration::from_secs(5),
            last_ack_seq: Seq(0),
            last_ack_at: None,
        };
        assert_eq!(
            unresponsive("c2", &rig, session_full)["detail"],
            "session full (18/18 commands unacked or queued, what a resume carries; 0 of them \
             queued), oldest unacked cmd age 5s"
        );
        assert_eq!(v["last_ack_seq"], 9);
        assert_eq!(v["last_ack_at"], "1970-01-01T00:00:01.500Z");
        assert_eq!(v["suggested_action"], "force_reconnect");
    }
}
