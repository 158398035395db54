//! The rig identity a verified client certificate grants (CONTRACT.md §2, close code 4403).
//!
//! A rig's identity is its end-entity certificate's subject CN (when the subject has exactly
//! one) or any of its DNS SANs, compared
//! byte for byte with the hello's `rig_id`: registry keys are case-sensitive, so `RIG-1` is not
//! `rig-1`, and a wildcard SAN such as `*.fleet` grants nothing. Called once per connection,
//! after the handshake: the caller keeps the strings, not the certificate.

use rustls::ServerConnection;
use x509_parser::extensions::GeneralName;

/// The identities the peer's verified client certificate grants: its subject CN, then every
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
    // A subject with two CNs is ambiguous (OpenSSL and Go would each read only one of them,
    // not the same one): neither is granted, and the SANs decide.
    let mut cns = cert.subject().iter_common_name();
    if let (Some(cn), None) = (cns.next(), cns.next()) {
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

    /// Certificate DER with `cns` as its subject's CNs (the second as a custom attribute of the
    /// CN's OID: rcgen keeps one value per attribute type) and `sans` as its DNS SANs.
    fn cert_with(cns: &[&str], sans: &[&str]) -> Vec<u8> {
        let mut params =
            rcgen::CertificateParams::new(sans.iter().map(|s| s.to_string()).collect::<Vec<_>>())
                .unwrap();
        params.distinguished_name = rcgen::DistinguishedName::new();
        for (i, cn) in cns.iter().enumerate() {
            let ty = match i {
                0 => rcgen::DnType::CommonName,
                _ => rcgen::DnType::CustomDnType(vec![2, 5, 4, 3]),
            };
            params.distinguished_name.push(ty, *cn);
        }
        let key = rcgen::KeyPair::generate().unwrap();
        params.self_signed(&key).unwrap().der().to_vec()
    }

    #[test]
    fn a_subject_with_two_cns_grants_neither_and_its_sans_still_count() {
        assert_eq!(cert_identities(&cert_with(&["rig-1"], &[])), ["rig-1"]);
        assert_eq!(
            cert_identities(&cert_with(&["rig-1"], &["rig-1.fleet"])),
            ["rig-1", "rig-1.fleet"]
        );
        let two = cert_with(&["rig-1", "rig-2"], &["rig-3"]);
        let (_, parsed) = x509_parser::parse_x509_certificate(&two).unwrap();
        assert_eq!(parsed.subject().iter_common_name().count(), 2);
        assert_eq!(cert_identities(&two), ["rig-3"]);
        assert!(cert_identities(&cert_with(&["rig-1", "rig-2"], &[])).is_empty());
    }

    #[test]
    fn garbage_der_grants_nothing() {
        assert!(cert_identities(b"").is_empty());
        assert!(cert_identities(&[0x30, 0x82, 0xff, 0xff, 0x00]).is_empty());
    }
}
