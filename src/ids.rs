//! Newtypes for the identifiers that cross module boundaries, validated once at the edge.
//!
//! A `RigId` or `BootId` that exists has passed the contract's rules (CONTRACT.md §2), so the
//! rest of the broker never re-checks them.

use std::fmt;

/// Longest command `id` or `reply_to` channel control may send, in bytes. Each is copied into
/// every reply and event about the command, and a broadcast's id into each matched rig's
/// request: unbounded, one message of 1 MiB could cost a fleet's worth of copies.
pub const CONTROL_NAME_MAX: usize = 256;

/// Longest command `name`, in bytes: the pub/sub route, the admin API and fleetctl hold it.
pub const COMMAND_NAME_MAX: usize = 128;

/// A rig's name: 1–64 bytes of `[A-Za-z0-9._-]`.
#[derive(Clone, PartialEq, Eq, Hash, PartialOrd, Ord, Debug)]
pub struct RigId(Box<str>);

impl RigId {
    /// Longest accepted rig id, in bytes.
    pub const MAX_LEN: usize = 64;

    /// Validates `s` against the contract's charset and length.
    pub fn parse(s: &str) -> Option<Self> {
        let ok = !s.is_empty()
            && s.len() <= Self::MAX_LEN
            && s.bytes()
                .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'.' | b'_' | b'-'));
        ok.then(|| Self(s.into()))
    }

    /// The id as text.
    pub fn as_str(&self) -> &str {
        &self.0
    }
}

impl fmt::Display for RigId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

/// One boot of a rig process: a UUIDv7 in canonical lowercase text.
///
/// UUIDv7 puts a millisecond timestamp in its leading bits, so comparing the canonical text
/// orders boots by time; that is what "newer boot_id wins" relies on (CONTRACT.md §3).
#[derive(Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct BootId([u8; 36]);

impl BootId {
    /// Accepts only canonical lowercase UUIDv7 text (version nibble 7, RFC 9562 variant).
    pub fn parse(s: &str) -> Option<Self> {
        let b = s.as_bytes();
        if b.len() != 36 {
            return None;
        }
        for (i, &c) in b.iter().enumerate() {
            let ok = match i {
                8 | 13 | 18 | 23 => c == b'-',
                _ => c.is_ascii_digit() || (b'a'..=b'f').contains(&c),
            };
            if !ok {
                return None;
            }
        }
        if b[14] != b'7' || !matches!(b[19], b'8' | b'9' | b'a' | b'b') {
            return None;
        }
        let mut out = [0u8; 36];
        out.copy_from_slice(b);
        Some(Self(out))
    }

    /// Makes a fresh UUIDv7 for `unix_ms` (used by agents, tests and the load generator).
    pub fn generate(unix_ms: u64) -> Self {
        let mut bytes = [0u8; 16];
        bytes[..6].copy_from_slice(&unix_ms.to_be_bytes()[2..]);
        for b in &mut bytes[6..] {
            *b = fastrand::u8(..);
        }
        bytes[6] = 0x70 | (bytes[6] & 0x0f);
        bytes[8] = 0x80 | (bytes[8] & 0x3f);
        let hex = |n: u8| b"0123456789abcdef"[n as usize];
        let mut out = [0u8; 36];
        let mut j = 0;
        for (i, byte) in bytes.iter().enumerate() {
            if matches!(i, 4 | 6 | 8 | 10) {
                out[j] = b'-';
                j += 1;
            }
            out[j] = hex(byte >> 4);
            out[j + 1] = hex(byte & 0x0f);
            j += 2;
        }
        Self(out)
    }

    /// The canonical text.
    pub fn as_str(&self) -> &str {
        // Only ASCII ever enters the array (checked in `parse`, written in `generate`).
        std::str::from_utf8(&self.0).unwrap_or("")
    }
}

impl fmt::Debug for BootId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

impl fmt::Display for BootId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// Per-session command sequence number: 1 for the first command, never reused.
#[derive(Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Debug, Default)]
pub struct Seq(pub u64);

impl Seq {
    /// The highest seq a session may use. The Lua scripts keep a seq, and the session's next
    /// one, as a decimal of at most 15 digits, which a Lua number (a double) holds exactly; a
    /// hello's `last_seq` above this, or a command past it, is refused rather than wrapped.
    pub const LAST: Seq = Seq(999_999_999_999_998);
}

/// Index of a worker core (0-based, dense).
#[derive(Clone, Copy, PartialEq, Eq, Hash, Debug)]
pub struct CoreId(pub u16);

/// A connection's id, unique within the process: the core in the top bits, a counter below.
#[derive(Clone, Copy, PartialEq, Eq, Hash, Debug)]
pub struct ConnId(pub u64);

impl ConnId {
    /// Builds the id of the `n`th connection accepted by `core`.
    pub fn new(core: CoreId, n: u64) -> Self {
        Self(((core.0 as u64) << 48) | (n & 0xffff_ffff_ffff))
    }

    /// The core that owns this connection.
    pub fn core(self) -> CoreId {
        CoreId((self.0 >> 48) as u16)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rig_id_rules() {
        assert!(RigId::parse("rig-0414").is_some());
        assert!(RigId::parse("a.b_c-D9").is_some());
        assert!(RigId::parse(&"x".repeat(64)).is_some());
        assert!(RigId::parse(&"x".repeat(65)).is_none());
        assert!(RigId::parse("").is_none());
        assert!(RigId::parse("rig 1").is_none());
        assert!(RigId::parse("rig/1").is_none());
        assert!(RigId::parse("rïg").is_none());
    }

    #[test]
    fn boot_id_rules() {
        let ok = "01890a5d-ac96-774b-bcce-b302099a8057";
        assert!(BootId::parse(ok).is_some());
        assert!(BootId::parse(&ok.to_uppercase()).is_none());
        // Version 4, not 7.
        assert!(BootId::parse("01890a5d-ac96-474b-bcce-b302099a8057").is_none());
        // The variant is RFC 9562's: its top bits 10, a nibble of 8, 9, a or b.
        for variant in ['0', '7', 'c', 'f'] {
            let id = format!("01890a5d-ac96-774b-{variant}cce-b302099a8057");
            assert!(BootId::parse(&id).is_none(), "{id}");
        }
        for variant in ['8', '9', 'a', 'b'] {
            let id = format!("01890a5d-ac96-774b-{variant}cce-b302099a8057");
            assert!(BootId::parse(&id).is_some(), "{id}");
        }
        assert!(BootId::parse("01890a5dac96774bbcceb302099a8057").is_none());
        assert!(BootId::parse("").is_none());
    }

    #[test]
    fn generated_boot_ids_parse_and_order_by_time() {
        let a = BootId::generate(1_700_000_000_000);
        let b = BootId::generate(1_700_000_000_001);
        assert_eq!(BootId::parse(a.as_str()), Some(a));
        assert!(a < b);
    }

    #[test]
    fn conn_id_carries_core() {
        let id = ConnId::new(CoreId(3), 77);
        assert_eq!(id.core(), CoreId(3));
    }
}
