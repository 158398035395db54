//! `fleetlink-fe dev-certs --out DIR --rigs N`: a throwaway PKI for development and tests.
//!
//! [`generate`] writes, all ECDSA P-256 and valid from one hour ago (clock skew between hosts)
//! for 365 days:
//!
//! | file | what |
//! |---|---|
//! | `ca.pem`, `ca.key` | the CA: `--client-ca` for the broker, `--ca` for rigs |
//! | `broker.pem`, `broker.key` | server cert (serverAuth), SANs `localhost`, `127.0.0.1` + broker names |
//! | `rig-0001.pem`, `rig-0001.key`, … | client certs (clientAuth), CN **and** DNS SAN = the rig id |
//!
//! A rig's identity is its cert's CN or DNS SAN; the broker closes with 4403 when it is not the
//! hello's `rig_id` (CONTRACT.md §2), so rig certs carry the id in both. Key files are created
//! with mode 0600; certificates 0644. Existing files of the same names are replaced.
//!
//! For the TLS tests: [`generate_rig`] takes any validity (an expired cert), a second [`Ca`]
//! gives a cert from an issuer the broker does not trust, and [`write_crl`] revokes serials.
//!
//! Not for production: the CA key lies unencrypted next to the certificates.

use std::fmt;
use std::fs;
use std::io::Write;
use std::os::unix::fs::OpenOptionsExt;
use std::path::{Path, PathBuf};

use anyhow::{bail, Context};
use rcgen::{
    BasicConstraints, Certificate, CertificateParams, CertificateRevocationListParams,
    DistinguishedName, DnType, ExtendedKeyUsagePurpose, IsCa, KeyIdMethod, KeyPair,
    KeyUsagePurpose, RevocationReason, RevokedCertParams, SerialNumber, PKCS_ECDSA_P256_SHA256,
};
use time::{Duration, OffsetDateTime};

/// Backdating of `not_before`, so a host whose clock is behind still accepts a fresh cert.
const SKEW: Duration = Duration::hours(1);
/// Lifetime of the generated CA, broker and rig certificates.
const LIFETIME: Duration = Duration::days(365);
/// `next_update` of a CRL, counted from its `this_update`.
const CRL_LIFETIME: Duration = Duration::days(30);

/// A certificate authority: its certificate and signing key, kept in memory to issue more
/// certificates and CRLs.
pub struct Ca {
    cert: Certificate,
    key: KeyPair,
}

impl Ca {
    /// A new self-signed CA named `common_name`, allowed to sign end-entity certs and CRLs only
    /// (path length 0).
    pub fn new(
        common_name: &str,
        not_before: OffsetDateTime,
        not_after: OffsetDateTime,
    ) -> anyhow::Result<Ca> {
        let key = KeyPair::generate_for(&PKCS_ECDSA_P256_SHA256)?;
        let mut params = CertificateParams::default();
        params.distinguished_name = name(common_name);
        params.is_ca = IsCa::Ca(BasicConstraints::Constrained(0));
        params.key_usages = vec![
            KeyUsagePurpose::KeyCertSign,
            KeyUsagePurpose::CrlSign,
            KeyUsagePurpose::DigitalSignature,
        ];
        params.serial_number = Some(random_serial()?);
        params.not_before = not_before;
        params.not_after = not_after;
        let cert = params.self_signed(&key).context("self-signing the CA")?;
        Ok(Ca { cert, key })
    }

    /// The CA certificate, PEM.
    pub fn cert_pem(&self) -> String {
        self.cert.pem()
    }

    /// The CA private key, PKCS#8 PEM.
    pub fn key_pem(&self) -> String {
        self.key.serialize_pem()
    }
}

/// A certificate issued by a [`Ca`], with its private key, not yet on disk.
#[derive(Debug, Clone)]
pub struct Issued {
    /// The certificate, PEM.
    pub cert_pem: String,
    /// Its private key, PKCS#8 PEM.
    pub key_pem: String,
    /// Its serial number: what [`write_crl`] revokes.
    pub serial: SerialNumber,
}

impl Issued {
    /// Writes `<stem>.pem` (0644) and `<stem>.key` (0600) into `dir`; returns both paths.
    pub fn write(&self, dir: &Path, stem: &str) -> anyhow::Result<(PathBuf, PathBuf)> {
        let cert = dir.join(format!("{stem}.pem"));
        let key = dir.join(format!("{stem}.key"));
        write_file(&cert, self.cert_pem.as_bytes(), 0o644)?;
        write_file(&key, self.key_pem.as_bytes(), 0o600)?;
        Ok((cert, key))
    }
}

/// One rig's files, as written by [`generate`].
#[derive(Debug, Clone)]
pub struct RigCert {
    /// The rig id in the cert's CN and DNS SAN: `rig-0001`, `rig-0002`, …
    pub rig_id: String,
    /// `<out>/<rig_id>.pem`.
    pub cert: PathBuf,
    /// `<out>/<rig_id>.key`, mode 0600.
    pub key: PathBuf,
    /// The cert's serial, for [`write_crl`].
    pub serial: SerialNumber,
}

/// What [`generate`] wrote, plus the CA, so a test can issue more certs or a CRL from it.
pub struct Summary {
    /// The CA that signed everything below.
    pub ca: Ca,
    /// `<out>/ca.pem`: `--client-ca` for the broker, `--ca` for rigs.
    pub ca_cert: PathBuf,
    /// `<out>/ca.key`, mode 0600.
    pub ca_key: PathBuf,
    /// `<out>/broker.pem`: `--tls-cert`.
    pub broker_cert: PathBuf,
    /// `<out>/broker.key`, mode 0600: `--tls-key`.
    pub broker_key: PathBuf,
    /// The broker cert's subject alternative names.
    pub broker_names: Vec<String>,
    /// One entry per rig, in order.
    pub rigs: Vec<RigCert>,
    /// Start of validity of every cert written.
    pub not_before: OffsetDateTime,
    /// End of validity of every cert written.
    pub not_after: OffsetDateTime,
}

impl fmt::Display for Summary {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        writeln!(
            f,
            "CA:     {} (key {})",
            self.ca_cert.display(),
            self.ca_key.display()
        )?;
        writeln!(
            f,
            "broker: {} (key {}), names {}",
            self.broker_cert.display(),
            self.broker_key.display(),
            self.broker_names.join(", ")
        )?;
        match (self.rigs.first(), self.rigs.last()) {
            (Some(first), Some(last)) => writeln!(
                f,
                "rigs:   {} certs, {} .. {}",
                self.rigs.len(),
                first.cert.display(),
                last.cert.display()
            )?,
            _ => writeln!(f, "rigs:   none")?,
        }
        write!(
            f,
            "valid:  {} .. {}",
            utc(self.not_before),
            utc(self.not_after)
        )
    }
}

/// `2026-11-29 18:58:36 UTC`: the precision X.509 keeps.
fn utc(t: OffsetDateTime) -> String {
    let t = t.to_offset(time::UtcOffset::UTC);
    let (h, m, s) = t.to_hms();
    format!(
        "{}-{:02}-{:02} {h:02}:{m:02}:{s:02} UTC",
        t.year(),
        u8::from(t.month()),
        t.day()
    )
}

/// Entry point of `fleetlink-fe dev-certs --out DIR --rigs N [--broker-name NAME]…`: runs
/// [`generate`] and prints what it wrote.
pub fn main(out: &Path, rigs: usize, broker_names: &[String]) -> anyhow::Result<()> {
    let summary = generate(out, rigs, broker_names)?;
    println!("{summary}");
    Ok(())
}

/// Writes a development PKI into `out` (created if missing): a CA, a broker server cert for
/// `localhost`, `127.0.0.1` and `broker_names`, and `rigs` client certs `rig-0001` … Validity:
/// now − 1 h .. now + 365 d.
pub fn generate(out: &Path, rigs: usize, broker_names: &[String]) -> anyhow::Result<Summary> {
    if let Some(bad) = broker_names
        .iter()
        .find(|n| n.parse::<std::net::IpAddr>().is_err() && !dns_name(n))
    {
        anyhow::bail!(
            "--broker-name {bad:?} is neither an IP address nor a DNS name (dot-separated labels \
             of letters, digits and '-', each 1 to 63 long, not starting or ending with '-', the last \
             not all digits)"
        );
    }
    fs::create_dir_all(out).with_context(|| format!("creating {}", out.display()))?;
    let now = OffsetDateTime::now_utc();
    let (not_before, not_after) = (now - SKEW, now + LIFETIME);

    let ca = Ca::new("fleetlink dev CA", not_before, not_after)?;
    let ca_cert = out.join("ca.pem");
    let ca_key = out.join("ca.key");
    write_file(&ca_cert, ca.cert_pem().as_bytes(), 0o644)?;
    write_file(&ca_key, ca.key_pem().as_bytes(), 0o600)?;

    let mut names = vec!["localhost".to_owned(), "127.0.0.1".to_owned()];
    for n in broker_names {
        if !names.contains(n) {
            names.push(n.clone());
        }
    }
    let (broker_cert, broker_key) =
        generate_broker(&ca, &names, not_before, not_after)?.write(out, "broker")?;

    let mut rig_certs = Vec::with_capacity(rigs);
    for i in 1..=rigs {
        // rig-0001 … rig-9999, then rig-10000: the width a load generator can compute too.
        let rig_id = format!("rig-{i:04}");
        let issued = generate_rig(&ca, &rig_id, not_before, not_after)?;
        let (cert, key) = issued.write(out, &rig_id)?;
        rig_certs.push(RigCert {
            rig_id,
            cert,
            key,
            serial: issued.serial,
        });
    }

    remove_stale_rigs(out, rigs)?;

    Ok(Summary {
        ca,
        ca_cert,
        ca_key,
        broker_cert,
        broker_key,
        broker_names: names,
        rigs: rig_certs,
        not_before,
        not_after,
    })
}

/// Whether `name` can be a DNS SAN (RFC 1123 host name; a `*.` wildcard first label too). A
/// top-level label of digits alone would read as a dotted-decimal address, which a host name
/// never is (RFC 1123 §2.1): `1.2.3` and `256.1.1.1` are mistyped addresses (review bb132).
fn dns_name(name: &str) -> bool {
    let name = name.strip_prefix("*.").unwrap_or(name);
    let numeric_top = name
        .rsplit('.')
        .next()
        .is_some_and(|top| !top.is_empty() && top.bytes().all(|b| b.is_ascii_digit()));
    !numeric_top
        && !name.is_empty()
        && name.len() <= 253
        && name.split('.').all(|label| {
            (1..=63).contains(&label.len())
                && label
                    .bytes()
                    .all(|b| b.is_ascii_alphanumeric() || b == b'-')
                && !label.starts_with('-')
                && !label.ends_with('-')
        })
}

/// Removes the rig certificates and keys past `rigs` that an earlier run left in `out`: the CA
/// that signed them was just replaced, so they no longer verify (review bb129: a second run with
/// fewer rigs left `rig-0002.pem` behind, failing at the broker with no hint why).
fn remove_stale_rigs(out: &Path, rigs: usize) -> anyhow::Result<()> {
    let entries = fs::read_dir(out).with_context(|| format!("reading {}", out.display()))?;
    for entry in entries.flatten() {
        let file = entry.file_name();
        let Some(file) = file.to_str() else { continue };
        let Some(stem) = file
            .strip_suffix(".pem")
            .or_else(|| file.strip_suffix(".key"))
        else {
            continue;
        };
        let number = stem
            .strip_prefix("rig-")
            .filter(|n| n.len() >= 4 && n.bytes().all(|b| b.is_ascii_digit()));
        if number
            .and_then(|n| n.parse::<usize>().ok())
            .is_some_and(|n| n > rigs)
        {
            fs::remove_file(entry.path())
                .with_context(|| format!("removing {}", entry.path().display()))?;
        }
    }
    Ok(())
}

/// A server certificate (serverAuth) for `names`: each is an IP SAN if it parses as an IP
/// address, else a DNS SAN. The first name is also the CN.
pub fn generate_broker(
    ca: &Ca,
    names: &[String],
    not_before: OffsetDateTime,
    not_after: OffsetDateTime,
) -> anyhow::Result<Issued> {
    let Some(first) = names.first() else {
        bail!("a broker certificate needs at least one name");
    };
    let mut params = CertificateParams::new(names.to_vec())
        .with_context(|| format!("broker names {names:?}"))?;
    params.distinguished_name = name(first);
    params.extended_key_usages = vec![ExtendedKeyUsagePurpose::ServerAuth];
    issue(ca, params, not_before, not_after)
}

/// A rig client certificate (clientAuth) whose CN and DNS SAN are `rig_id`, with any validity:
/// pass a `not_after` in the past for an expired cert, or another [`Ca`] for an untrusted one.
/// `rig_id` must be a valid rig id: 1–64 of `[A-Za-z0-9._-]` (CONTRACT.md §2).
pub fn generate_rig(
    ca: &Ca,
    rig_id: &str,
    not_before: OffsetDateTime,
    not_after: OffsetDateTime,
) -> anyhow::Result<Issued> {
    let valid = (1..=64).contains(&rig_id.len())
        && rig_id
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'.' | b'_' | b'-'));
    if !valid {
        bail!("invalid rig id {rig_id:?}: 1-64 of [A-Za-z0-9._-]");
    }
    let mut params = CertificateParams::new(vec![rig_id.to_owned()])
        .with_context(|| format!("rig id {rig_id:?}"))?;
    params.distinguished_name = name(rig_id);
    params.extended_key_usages = vec![ExtendedKeyUsagePurpose::ClientAuth];
    issue(ca, params, not_before, not_after)
}

/// A client certificate signed by `ca` with whatever names `params` gives it: for testing what
/// the broker makes of unusual certificates (say, one with only a URI SAN).
pub fn issue_client(
    ca: &Ca,
    mut params: CertificateParams,
    not_before: OffsetDateTime,
    not_after: OffsetDateTime,
) -> anyhow::Result<Issued> {
    params.extended_key_usages = vec![ExtendedKeyUsagePurpose::ClientAuth];
    issue(ca, params, not_before, not_after)
}

/// Writes a PEM CRL signed by `ca` revoking `revoked_serials` to `path`, atomically (a temp file
/// renamed over it), because the broker reloads `--crl` when the file changes. `this_update` is
/// now, `next_update` now + 30 d, the CRL number the current Unix time in nanoseconds, so a
/// rewritten CRL always has a larger number.
pub fn write_crl(ca: &Ca, revoked_serials: &[SerialNumber], path: &Path) -> anyhow::Result<()> {
    let now = OffsetDateTime::now_utc();
    let number = u64::try_from(now.unix_timestamp_nanos()).context("clock before 1970")?;
    let params = CertificateRevocationListParams {
        this_update: now,
        next_update: now + CRL_LIFETIME,
        crl_number: SerialNumber::from(number),
        issuing_distribution_point: None,
        revoked_certs: revoked_serials
            .iter()
            .map(|serial| RevokedCertParams {
                serial_number: serial.clone(),
                revocation_time: now,
                reason_code: Some(RevocationReason::KeyCompromise),
                invalidity_date: None,
            })
            .collect(),
        key_identifier_method: KeyIdMethod::Sha256,
    };
    let pem = params.signed_by(&ca.cert, &ca.key)?.pem()?;
    let mut tmp = path.as_os_str().to_owned();
    tmp.push(".tmp");
    let tmp = PathBuf::from(tmp);
    write_file(&tmp, pem.as_bytes(), 0o644)?;
    fs::rename(&tmp, path)
        .with_context(|| format!("renaming {} to {}", tmp.display(), path.display()))
}

/// Signs an end-entity cert: fresh P-256 key, random serial, digitalSignature, and the
/// authority key identifier so verifiers find the issuer by key.
fn issue(
    ca: &Ca,
    mut params: CertificateParams,
    not_before: OffsetDateTime,
    not_after: OffsetDateTime,
) -> anyhow::Result<Issued> {
    let key = KeyPair::generate_for(&PKCS_ECDSA_P256_SHA256)?;
    let serial = random_serial()?;
    params.serial_number = Some(serial.clone());
    params.key_usages = vec![KeyUsagePurpose::DigitalSignature];
    params.use_authority_key_identifier_extension = true;
    params.not_before = not_before;
    params.not_after = not_after;
    let cert = params.signed_by(&key, &ca.cert, &ca.key)?;
    Ok(Issued {
        cert_pem: cert.pem(),
        key_pem: key.serialize_pem(),
        serial,
    })
}

fn name(common_name: &str) -> DistinguishedName {
    let mut dn = DistinguishedName::new();
    dn.push(DnType::OrganizationName, "fleetlink dev");
    dn.push(DnType::CommonName, common_name);
    dn
}

/// 16 random bytes from getrandom(2), positive and with no leading zero byte (RFC 5280 §4.1.2.2:
/// positive, at most 20 octets).
fn random_serial() -> anyhow::Result<SerialNumber> {
    let mut bytes = [0u8; 16];
    let mut filled = 0;
    while filled < bytes.len() {
        let rest = &mut bytes[filled..];
        // SAFETY: `rest` is valid for writes of `rest.len()` bytes.
        let n = unsafe { libc::getrandom(rest.as_mut_ptr().cast(), rest.len(), 0) };
        match usize::try_from(n) {
            Ok(n) => filled += n,
            Err(_) if std::io::Error::last_os_error().kind() == std::io::ErrorKind::Interrupted => {
            }
            Err(_) => return Err(std::io::Error::last_os_error()).context("getrandom"),
        }
    }
    bytes[0] = (bytes[0] & 0x7f) | 0x40;
    Ok(SerialNumber::from_slice(&bytes))
}

/// Replaces `path` with `data`, created with `mode`: the old file is removed first, so a key
/// never sits in a file whose earlier mode was wider.
fn write_file(path: &Path, data: &[u8], mode: u32) -> anyhow::Result<()> {
    match fs::remove_file(path) {
        Ok(()) => {}
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
        Err(e) => return Err(e).with_context(|| format!("removing {}", path.display())),
    }
    let mut file = fs::OpenOptions::new()
        .write(true)
        .create_new(true)
        .mode(mode)
        .open(path)
        .with_context(|| format!("creating {}", path.display()))?;
    file.write_all(data)
        .and_then(|()| file.sync_all())
        .with_context(|| format!("writing {}", path.display()))
}

#[cfg(test)]
mod tests {
    use std::os::unix::fs::PermissionsExt;

    use super::*;

    /// OID 1.3.6.1.5.5.7.3.1 (serverAuth) / .2 (clientAuth), DER-encoded.
    const SERVER_AUTH: &[u8] = &[0x06, 0x08, 0x2b, 0x06, 0x01, 0x05, 0x05, 0x07, 0x03, 0x01];
    const CLIENT_AUTH: &[u8] = &[0x06, 0x08, 0x2b, 0x06, 0x01, 0x05, 0x05, 0x07, 0x03, 0x02];

    /// A fresh, empty directory under the system temp dir, removed on drop.
    struct TempDir(PathBuf);

    impl TempDir {
        fn new(tag: &str) -> TempDir {
            let dir = std::env::temp_dir().join(format!("fleetlink-{tag}-{}", std::process::id()));
            let _ = fs::remove_dir_all(&dir);
            fs::create_dir_all(&dir).expect("temp dir");
            TempDir(dir)
        }
    }

    impl Drop for TempDir {
        fn drop(&mut self) {
            let _ = fs::remove_dir_all(&self.0);
        }
    }

    /// The DER bodies of the PEM blocks labelled `label` in `text`.
    fn pem_blocks(text: &str, label: &str) -> Vec<Vec<u8>> {
        let begin = format!("-----BEGIN {label}-----");
        let end = format!("-----END {label}-----");
        let mut out = Vec::new();
        let mut rest = text;
        while let Some(start) = rest.find(&begin) {
            let body = &rest[start + begin.len()..];
            let stop = body.find(&end).expect("unterminated PEM block");
            out.push(base64(&body[..stop]));
            rest = &body[stop + end.len()..];
        }
        out
    }

    fn base64(text: &str) -> Vec<u8> {
        let value = |c: u8| match c {
            b'A'..=b'Z' => c - b'A',
            b'a'..=b'z' => c - b'a' + 26,
            b'0'..=b'9' => c - b'0' + 52,
            b'+' => 62,
            b'/' => 63,
            _ => panic!("not base64: {c}"),
        };
        let digits: Vec<u8> = text
            .bytes()
            .filter(|c| !c.is_ascii_whitespace() && *c != b'=')
            .map(value)
            .collect();
        let mut out = Vec::new();
        for chunk in digits.chunks(4) {
            let n = chunk
                .iter()
                .enumerate()
                .fold(0u32, |n, (i, d)| n | u32::from(*d) << (18 - 6 * i));
            out.extend(&n.to_be_bytes()[1..chunk.len()]);
        }
        out
    }

    fn contains(haystack: &[u8], needle: &[u8]) -> bool {
        haystack.windows(needle.len()).any(|w| w == needle)
    }

    fn one_cert(path: &Path) -> Vec<u8> {
        let text = fs::read_to_string(path).expect("read cert");
        let mut blocks = pem_blocks(&text, "CERTIFICATE");
        assert_eq!(blocks.len(), 1, "{}", path.display());
        blocks.remove(0)
    }

    fn mode(path: &Path) -> u32 {
        fs::metadata(path).expect("metadata").permissions().mode() & 0o777
    }

    #[test]
    fn base64_decodes_rfc4648_vectors() {
        assert_eq!(base64("Zm9vYmFy"), b"foobar");
        assert_eq!(base64("Zm9vYg=="), b"foob");
        assert_eq!(base64("Zm9vYmE="), b"fooba");
    }

    /// A second run replaces the CA: the rig files past its count, signed by the old one, go.
    /// Files of other names stay.
    #[test]
    fn a_second_run_leaves_no_rig_certificate_of_the_replaced_ca() {
        let dir = TempDir::new("dev-certs-again");
        generate(&dir.0, 3, &[]).expect("first");
        fs::write(dir.0.join("rig-notes.pem"), "mine").expect("write");
        generate(&dir.0, 1, &[]).expect("second");
        let mut left: Vec<String> = fs::read_dir(&dir.0)
            .expect("dir")
            .map(|e| e.expect("entry").file_name().to_string_lossy().into_owned())
            .collect();
        left.sort();
        assert_eq!(
            left,
            [
                "broker.key",
                "broker.pem",
                "ca.key",
                "ca.pem",
                "rig-0001.key",
                "rig-0001.pem",
                "rig-notes.pem"
            ]
        );
    }

    #[test]
    fn a_broker_name_that_is_no_dns_name_or_address_is_refused() {
        let dir = TempDir::new("dev-certs-names");
        for bad in [
            "bad..name",
            "-x.example",
            "a b",
            "",
            &"l".repeat(64),
            "1.2.3",
            "256.1.1.1",
        ] {
            let Err(e) = generate(&dir.0, 0, &[bad.to_string()]) else {
                panic!("{bad:?} taken");
            };
            assert!(
                e.to_string()
                    .contains("neither an IP address nor a DNS name"),
                "{e}"
            );
        }
        let fine = [
            "broker-1.example",
            "*.rigs.example",
            "10.0.0.1",
            "::1",
            "xn--bcher-kva",
        ];
        generate(&dir.0, 0, &fine.map(String::from)).expect("valid names");
    }

    #[test]
    fn generates_ca_broker_and_rigs() {
        let dir = TempDir::new("dev-certs");
        let s =
            generate(&dir.0, 3, &["broker.example".into(), "localhost".into()]).expect("generate");

        assert_eq!(s.broker_names, ["localhost", "127.0.0.1", "broker.example"]);
        let ca = one_cert(&s.ca_cert);
        assert!(contains(&ca, b"fleetlink dev CA"));
        let key = fs::read_to_string(&s.ca_key).expect("ca key");
        assert_eq!(pem_blocks(&key, "PRIVATE KEY").len(), 1);

        let broker = one_cert(&s.broker_cert);
        assert!(contains(&broker, b"broker.example") && contains(&broker, b"localhost"));
        assert!(
            contains(&broker, &[0x87, 0x04, 127, 0, 0, 1]),
            "IP SAN 127.0.0.1"
        );
        assert!(contains(&broker, SERVER_AUTH) && !contains(&broker, CLIENT_AUTH));

        let ids: Vec<_> = s.rigs.iter().map(|r| r.rig_id.as_str()).collect();
        assert_eq!(ids, ["rig-0001", "rig-0002", "rig-0003"]);
        for rig in &s.rigs {
            let der = one_cert(&rig.cert);
            // CN (UTF8String) and DNS SAN ([2] IA5String) both carry the rig id.
            let id = rig.rig_id.as_bytes();
            assert!(
                contains(&der, &[&[0x0c, id.len() as u8][..], id].concat()),
                "CN {}",
                rig.rig_id
            );
            assert!(
                contains(&der, &[&[0x82, id.len() as u8][..], id].concat()),
                "SAN {}",
                rig.rig_id
            );
            assert!(contains(&der, CLIENT_AUTH) && !contains(&der, SERVER_AUTH));
            assert!(contains(&der, &rig.serial.to_bytes()));
            assert!(contains(&der, b"fleetlink dev CA"), "issuer");
            assert_eq!(mode(&rig.key), 0o600);
            assert_eq!(mode(&rig.cert), 0o644);
        }
        assert_eq!(mode(&s.ca_key), 0o600);
        assert_eq!(mode(&s.broker_key), 0o600);
        assert!(s.not_after - s.not_before > Duration::days(365));
        let shown = s.to_string();
        assert!(
            shown.contains("3 certs") && shown.ends_with(" UTC"),
            "{shown}"
        );
    }

    #[test]
    fn regenerating_replaces_files_and_keeps_key_modes() {
        let dir = TempDir::new("dev-certs-again");
        let key = dir.0.join("rig-0001.key");
        fs::write(&key, "old").expect("write");
        fs::set_permissions(&key, fs::Permissions::from_mode(0o644)).expect("chmod");
        let s = generate(&dir.0, 1, &[]).expect("generate");
        assert_eq!(mode(&s.rigs[0].key), 0o600);
        assert!(fs::read_to_string(&key)
            .expect("read")
            .contains("PRIVATE KEY"));
    }

    #[test]
    fn expired_and_foreign_rig_certs() {
        let now = OffsetDateTime::now_utc();
        let ca = Ca::new("fleetlink dev CA", now - SKEW, now + LIFETIME).expect("ca");
        let other = Ca::new("some other CA", now - SKEW, now + LIFETIME).expect("other ca");

        let expired = generate_rig(
            &ca,
            "rig-old",
            now - Duration::days(30),
            now - Duration::days(1),
        )
        .expect("expired");
        let foreign =
            generate_rig(&other, "rig-0001", now - SKEW, now + LIFETIME).expect("foreign");
        assert_ne!(expired.serial, foreign.serial);

        let dir = TempDir::new("dev-certs-tls");
        let (cert, key) = foreign.write(&dir.0, "foreign").expect("write");
        assert!(contains(&one_cert(&cert), b"some other CA"));
        assert_eq!(mode(&key), 0o600);
        assert_eq!(pem_blocks(&expired.cert_pem, "CERTIFICATE").len(), 1);

        assert!(generate_rig(&ca, "", now, now + LIFETIME).is_err());
        assert!(generate_rig(&ca, "bad id", now, now + LIFETIME).is_err());
        assert!(generate_rig(&ca, &"r".repeat(65), now, now + LIFETIME).is_err());
        assert!(generate_broker(&ca, &[], now, now + LIFETIME).is_err());
    }

    #[test]
    fn crl_lists_revoked_serials() {
        let dir = TempDir::new("dev-certs-crl");
        let s = generate(&dir.0, 2, &[]).expect("generate");
        let path = dir.0.join("revoked.crl");
        write_crl(&s.ca, &[s.rigs[1].serial.clone()], &path).expect("crl");
        let text = fs::read_to_string(&path).expect("read crl");
        let blocks = pem_blocks(&text, "X509 CRL");
        assert_eq!(blocks.len(), 1);
        assert!(contains(&blocks[0], &s.rigs[1].serial.to_bytes()));
        assert!(!contains(&blocks[0], &s.rigs[0].serial.to_bytes()));
        assert!(contains(&blocks[0], b"fleetlink dev CA"), "issuer");
        assert!(!dir.0.join("revoked.crl.tmp").exists());

        write_crl(&s.ca, &[], &path).expect("empty crl");
        let blocks = pem_blocks(&fs::read_to_string(&path).expect("read"), "X509 CRL");
        assert!(!contains(&blocks[0], &s.rigs[1].serial.to_bytes()));
    }
}
