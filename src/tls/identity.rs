//! The rig identity a verified client certificate grants (CONTRACT.md §2, close code 4403).
//!
//! A rig's identity is its end-entity certificate's subject CN or any of its DNS SANs, compared
//! byte for byte with the hello's `rig_id`: registry keys are case-sensitive, so `RIG-1` is not
//! `rig-1`, and a wildcard SAN such as `*.fleet` grants nothing. Called once per connection,
//! after the handshake: the caller keeps the strings, not the certificate.

use rustls::ServerConnection;
use x509_parser::extensions::GeneralName;

/// The identities the peer's verified client certificate grants: its subject CN(s), then every
/// DNS SAN, without duplicates. Empty when there is no client certificate, and also for one
/// that names nothing this reads (only a URI or IP SAN, a CN not in UTF-8): the caller tells
/// the two apart with `peer_certificates()`, and refuses every rig_id (4403) in the second.
pub fn peer_identities(conn: &ServerConnection) -> Vec<String> {
    conn.peer_certificates()
        .and_then(|chain| chain.first())
        .map(|end_entity| cert_identities(end_entity))
        .unwrap_or_default()
}

/// The identities of one DER certificate, as [`peer_identities`]. A certificate that does not
/// parse grants nothing (rustls has verified it already, so that does not happen in practice).
pub fn cert_identities(der: &[u8]) -> Vec<String> {
    let Ok((_, cert)) = x509_parser::parse_x509_certificate(der) else {
        return Vec::new();
    };
    let mut ids: Vec<String> = Vec::new();
    let mut push = |id: &str| {
        if !id.is_empty() && !ids.iter().any(|have| have == id) {
            ids.push(id.to_owned());
        }
    };
    for cn in cert.subject().iter_common_name() {
        if let Ok(cn) = cn.as_str() {
            push(cn);
        }
    }
    if let Ok(Some(san)) = cert.subject_alternative_name() {
        for name in &san.value.general_names {
            if let GeneralName::DNSName(dns) = name {
                push(dns);
            }
        }
    }
    ids
}

/// True when `rig_id` is exactly one of `ids`.
pub fn identity_matches(ids: &[String], rig_id: &str) -> bool {
    !rig_id.is_empty() && ids.iter().any(|id| id == rig_id)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn match_is_exact() {
        let ids = vec!["rig-0001".to_owned(), "rig-0001.fleet".to_owned()];
        assert!(identity_matches(&ids, "rig-0001"));
        assert!(identity_matches(&ids, "rig-0001.fleet"));
        assert!(!identity_matches(&ids, "RIG-0001"));
        assert!(!identity_matches(&ids, "rig-000"));
        assert!(!identity_matches(&ids, ""));
        assert!(!identity_matches(&[], "rig-0001"));
        assert!(!identity_matches(&["*.fleet".to_owned()], "a.fleet"));
    }

    #[test]
    fn garbage_der_grants_nothing() {
        assert!(cert_identities(b"").is_empty());
        assert!(cert_identities(&[0x30, 0x82, 0xff, 0xff, 0x00]).is_empty());
    }
}
