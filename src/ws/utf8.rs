//! Incremental UTF-8 validation of text messages across fragments (RFC 6455 §5.6, §8.1).
//!
//! §8.1 says an endpoint that receives invalid UTF-8 in a text message MUST _Fail the
//! WebSocket Connection_; we fail on the first fragment that contains an invalid sequence instead
//! of waiting for the final one. A code point may be split across fragments, so up to three
//! bytes of an incomplete sequence are carried from one fragment to the next. Built on
//! `std::str::from_utf8`: `Utf8Error::error_len()` is `None` exactly when the input ends in the
//! middle of a sequence that could still complete. The final fragment needs no validator: the
//! decoder checks the whole message with `String::from_utf8`, which also refuses a code point
//! left incomplete at the end.

use super::apply_mask;

/// The text payload seen so far is not valid UTF-8.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct InvalidUtf8;

/// Validation state between fragments: the incomplete sequence at the end of the last one.
#[derive(Debug, Default, Clone, Copy)]
pub(crate) struct Utf8Validator {
    /// Bytes of a code point whose remaining bytes are in a later fragment.
    carry: [u8; 4],
    /// How many bytes of `carry` are in use (0..=3).
    carry_len: u8,
}

impl Utf8Validator {
    /// Validates `chunk` as the continuation of every chunk fed before.
    pub(crate) fn feed(&mut self, chunk: &[u8]) -> Result<(), InvalidUtf8> {
        let rest = self.complete_carry(chunk)?;
        match std::str::from_utf8(rest) {
            Ok(_) => Ok(()),
            Err(e) if e.error_len().is_some() => Err(InvalidUtf8),
            Err(e) => self.set_carry(rest.get(e.valid_up_to()..).unwrap_or_default()),
        }
    }

    /// Validates payload bytes that are still masked: `masked` starts `offset` bytes into a
    /// frame payload masked with `key` (§5.3). Unmasks a copy on the stack, a piece at a time,
    /// so the caller's buffer is left as it is.
    pub(crate) fn feed_masked(
        &mut self,
        masked: &[u8],
        key: [u8; 4],
        offset: usize,
    ) -> Result<(), InvalidUtf8> {
        let mut key = key;
        key.rotate_left(offset % 4);
        let mut copy = [0; 256];
        for piece in masked.chunks(copy.len()) {
            let copy = copy.get_mut(..piece.len()).unwrap_or_default();
            copy.copy_from_slice(piece);
            // Every piece but the last is a multiple of 4 long, so `key` stays in phase.
            apply_mask(copy, key);
            self.feed(copy)?;
        }
        Ok(())
    }

    /// Bytes at the end of the input fed so far that start a code point not yet complete.
    pub(crate) fn pending(&self) -> usize {
        usize::from(self.carry_len)
    }

    /// Finishes the carried code point with the first bytes of `chunk`; returns the rest of the
    /// chunk, which starts on a code point boundary (or is empty, with the carry extended).
    fn complete_carry<'a>(&mut self, chunk: &'a [u8]) -> Result<&'a [u8], InvalidUtf8> {
        let carried = usize::from(self.carry_len);
        if carried == 0 {
            return Ok(chunk);
        }
        let mut joined = self.carry;
        let taken = chunk.len().min(4 - carried);
        for (dst, src) in joined.iter_mut().skip(carried).zip(chunk) {
            *dst = *src;
        }
        let joined = joined.get(..carried + taken).unwrap_or_default();
        let used = match std::str::from_utf8(joined) {
            // All of `taken` is valid: the carried code point and whatever followed it.
            Ok(_) => taken,
            // The carried code point completed (it ends after the carried bytes, so the
            // subtraction cannot fail); the rest of `chunk` is checked by the caller.
            Err(e) if e.valid_up_to() > 0 => {
                e.valid_up_to().checked_sub(carried).ok_or(InvalidUtf8)?
            }
            Err(e) if e.error_len().is_some() => return Err(InvalidUtf8),
            // Still incomplete: `chunk` was shorter than the rest of the code point.
            Err(_) => return self.set_carry(joined).map(|()| &[][..]),
        };
        self.carry_len = 0;
        Ok(chunk.get(used..).unwrap_or_default())
    }

    fn set_carry(&mut self, tail: &[u8]) -> Result<(), InvalidUtf8> {
        // `from_utf8` only reports an incomplete tail of at most 3 bytes; longer would be a bug
        // in this module, reported as invalid text rather than a panic.
        if tail.len() > 3 {
            return Err(InvalidUtf8);
        }
        self.carry = [0; 4];
        for (dst, src) in self.carry.iter_mut().zip(tail) {
            *dst = *src;
        }
        self.carry_len = tail.len() as u8;
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// What the decoder's final `String::from_utf8` adds: the message may not end inside a
    /// code point.
    fn finish(v: &Utf8Validator) -> Result<(), InvalidUtf8> {
        match v.carry_len {
            0 => Ok(()),
            _ => Err(InvalidUtf8),
        }
    }

    fn validate_split(chunks: &[&[u8]]) -> Result<(), InvalidUtf8> {
        let mut v = Utf8Validator::default();
        for chunk in chunks {
            v.feed(chunk)?;
        }
        finish(&v)
    }

    #[test]
    fn code_points_split_at_every_position_are_accepted() {
        let text = "aé€😀z κόσμε 𝄞".as_bytes();
        for i in 0..=text.len() {
            for j in i..=text.len() {
                let r = validate_split(&[&text[..i], &text[i..j], &text[j..]]);
                assert_eq!(r, Ok(()), "split at {i}, {j}");
            }
        }
    }

    #[test]
    fn one_byte_at_a_time_is_accepted() {
        let text = "😀€é😀".as_bytes();
        let chunks: Vec<&[u8]> = text.chunks(1).collect();
        assert_eq!(validate_split(&chunks), Ok(()));
    }

    #[test]
    fn invalid_sequence_fails_in_the_fragment_that_holds_it() {
        let mut v = Utf8Validator::default();
        assert_eq!(v.feed(b"hello "), Ok(()));
        assert_eq!(v.feed(b"w\xffrld"), Err(InvalidUtf8));
    }

    #[test]
    fn invalid_continuation_of_a_carried_prefix_fails_at_once() {
        let mut v = Utf8Validator::default();
        assert_eq!(v.feed(b"ok \xe2\x82"), Ok(()));
        assert_eq!(v.feed(b"A"), Err(InvalidUtf8));
    }

    #[test]
    fn prefix_that_can_never_complete_fails_at_once() {
        // 0xF4 0x90 would encode a code point above U+10FFFF: invalid without a third byte.
        let mut v = Utf8Validator::default();
        assert_eq!(v.feed(b"\xf4"), Ok(()));
        assert_eq!(v.feed(b"\x90"), Err(InvalidUtf8));
        // A surrogate (U+D800) is invalid from its second byte.
        assert_eq!(Utf8Validator::default().feed(b"\xed\xa0"), Err(InvalidUtf8));
    }

    #[test]
    fn incomplete_sequence_at_the_end_fails_finish() {
        let mut v = Utf8Validator::default();
        assert_eq!(v.feed(b"abc\xf0\x9f\x98"), Ok(()));
        assert_eq!(finish(&v), Err(InvalidUtf8));
    }

    #[test]
    fn empty_chunks_keep_the_carry() {
        let mut v = Utf8Validator::default();
        v.feed(b"\xf0").unwrap();
        v.feed(b"").unwrap();
        v.feed(b"\x9f").unwrap();
        v.feed(b"").unwrap();
        v.feed(b"\x98\x80!").unwrap();
        assert_eq!(finish(&v), Ok(()));
    }

    #[test]
    fn masked_input_is_validated_at_any_offset() {
        let key = [0x11, 0x22, 0x33, 0x44];
        let text = "κόσμε €😀 ".repeat(50);
        let mut masked = text.as_bytes().to_vec();
        apply_mask(&mut masked, key);
        for split in [0, 1, 2, 3, 255, 256, 257, 511] {
            let mut v = Utf8Validator::default();
            v.feed_masked(&masked[..split], key, 0).unwrap();
            v.feed_masked(&masked[split..], key, split).unwrap();
            assert_eq!(finish(&v), Ok(()), "split at {split}");
        }
        let mut bad = masked.clone();
        bad[300] ^= 0x80; // flips a byte's top bit: no longer UTF-8 around there
        let mut v = Utf8Validator::default();
        assert_eq!(v.feed_masked(&bad, key, 0), Err(InvalidUtf8));
    }

    #[test]
    fn agrees_with_std_on_every_split_of_assorted_inputs() {
        let inputs: [&[u8]; 8] = [
            b"\xce\xba\xe1\xbd\xb9\xcf\x83\xce\xbc\xce\xb5",
            b"\xce\xba\xe1\xbd\xb9\xcf\x83\xce\xbc\xce\xb5\xed\xa0\x80edited",
            b"\xf8\x88\x80\x80\x80",
            b"\xc0\xaf",
            b"\xef\xbf\xbf",
            b"\xf4\x8f\xbf\xbf",
            b"\xf4\x90\x80\x80",
            b"\xe0\x80\xaf",
        ];
        for input in inputs {
            let expect = std::str::from_utf8(input).is_ok();
            for i in 0..=input.len() {
                let got = validate_split(&[&input[..i], &input[i..]]).is_ok();
                assert_eq!(got, expect, "{input:x?} split at {i}");
            }
        }
    }
}
