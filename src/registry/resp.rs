//! RESP2, the wire format of the two Redis sockets the bridge reads by hand: the subscription
//! (`pubsub.rs`), which turns pushes into [`Value`]s itself, and the command connection
//! (`command_con.rs`), which only needs to know where a reply ends before redis-rs parses it.
//! Both read a value's header line and its count through the same two functions here, so
//! the two cannot drift apart on where a value starts and ends.

use std::io;

/// A reply this reader does not understand: the connection is dropped, never guessed at.
fn malformed() -> io::Error {
    io::Error::new(io::ErrorKind::InvalidData, "malformed redis reply")
}

/// A value's header line: its type byte, the text after it, and where the next byte starts.
struct Line<'a> {
    kind: u8,
    text: &'a [u8],
    after: usize,
}

/// The longest header line taken: Redis's are a type byte and a count, or a short status or
/// error text. A line still open past it is refused rather than searched again on each read.
const MAX_LINE: usize = 64 << 10;

/// The header line at the start of `buf`, or None until its CRLF has come.
fn line(buf: &[u8]) -> io::Result<Option<Line<'_>>> {
    let Some(end) = buf.windows(2).position(|w| w == b"\r\n") else {
        if buf.len() > MAX_LINE {
            return Err(malformed());
        }
        return Ok(None);
    };
    let kind = buf.first().copied().ok_or_else(malformed)?;
    let text = buf.get(1..end).ok_or_else(malformed)?;
    Ok(Some(Line {
        kind,
        text,
        after: end + 2,
    }))
}

/// A header's count or integer.
fn number(text: &[u8]) -> io::Result<i64> {
    std::str::from_utf8(text)
        .ok()
        .and_then(|t| t.parse().ok())
        .ok_or_else(malformed)
}

/// How far [`value_len`] got through an incomplete value: where the next element starts and
/// how many are still owed. Kept between reads, so that a reply of many small elements
/// arriving over many reads is walked once, not again from its start after each read
/// (review bb111: 22 million elements re-parsed a thousand times stalled the bridge). Valid
/// while the buffer it was made on keeps the value at the same offset and only grows.
#[derive(Debug, Default)]
pub(crate) struct Scan {
    pos: usize,
    owed: u64,
}

/// The length of the first whole value in `buf`, or None while it is incomplete, resuming
/// from `scan` (which is reset once the value is whole, or on an error). Counts the values
/// still owed rather than recursing, so a deep reply cannot overflow the stack.
pub(crate) fn value_len(buf: &[u8], scan: &mut Scan) -> io::Result<Option<usize>> {
    if scan.owed == 0 {
        *scan = Scan { pos: 0, owed: 1 };
    }
    let walked = walk(buf, scan);
    if !matches!(walked, Ok(None)) {
        *scan = Scan::default();
    }
    walked
}

fn walk(buf: &[u8], scan: &mut Scan) -> io::Result<Option<usize>> {
    while scan.owed > 0 {
        let pos = scan.pos;
        let Some(head) = line(buf.get(pos..).unwrap_or_default())? else {
            return Ok(None);
        };
        let after = pos + head.after;
        let mut owed = scan.owed - 1;
        let next = match head.kind {
            b'+' | b'-' | b':' => after,
            b'$' => match usize::try_from(number(head.text)?) {
                Ok(n) if buf.len() < after.saturating_add(n).saturating_add(2) => return Ok(None),
                Ok(n) => after + n + 2,
                Err(_) => after, // a nil bulk string ($-1)
            },
            b'*' => {
                if let Ok(n) = u64::try_from(number(head.text)?) {
                    owed = owed.saturating_add(n);
                }
                after
            }
            _ => return Err(malformed()),
        };
        *scan = Scan { pos: next, owed };
    }
    Ok(Some(scan.pos))
}

/// One value as the subscription reads it.
#[derive(Debug, PartialEq)]
pub(crate) enum Value {
    Bulk(Vec<u8>),
    Int(i64),
    Error(Vec<u8>),
    Simple,
    Nil,
    Array(Vec<Value>),
}

/// How deep arrays may nest. A subscription's pushes are flat arrays; the cap keeps a
/// malformed stream of `*1\r\n*1\r\n…` from recursing until the bridge's stack overflows.
const MAX_DEPTH: usize = 4;
/// How many elements an array may have. A push has three or four; a malformed one of
/// millions of elements would otherwise be built in memory whole (about 50 bytes each).
const MAX_ITEMS: i64 = 64;

/// Parses one value. Ok(None) = incomplete.
pub(crate) fn parse(buf: &[u8]) -> io::Result<Option<(usize, Value)>> {
    parse_nested(buf, 0)
}

fn parse_nested(buf: &[u8], depth: usize) -> io::Result<Option<(usize, Value)>> {
    let Some(Line { kind, text, after }) = line(buf)? else {
        return Ok(None);
    };
    match kind {
        b'+' => Ok(Some((after, Value::Simple))),
        b'-' => Ok(Some((after, Value::Error(text.to_vec())))),
        b':' => Ok(Some((after, Value::Int(number(text)?)))),
        b'$' => {
            let n = number(text)?;
            if n < 0 {
                return Ok(Some((after, Value::Nil)));
            }
            let n = usize::try_from(n).map_err(|_| malformed())?;
            if buf.len() < after + n + 2 {
                return Ok(None);
            }
            let data = buf.get(after..after + n).ok_or_else(malformed)?.to_vec();
            Ok(Some((after + n + 2, Value::Bulk(data))))
        }
        b'*' => {
            let n = number(text)?;
            if n < 0 {
                return Ok(Some((after, Value::Nil)));
            }
            if depth >= MAX_DEPTH || n > MAX_ITEMS {
                return Err(malformed());
            }
            let mut items = Vec::new();
            let mut pos = after;
            for _ in 0..n {
                let Some((used, v)) = parse_nested(buf.get(pos..).unwrap_or_default(), depth + 1)?
                else {
                    return Ok(None);
                };
                pos += used;
                items.push(v);
            }
            Ok(Some((pos, Value::Array(items))))
        }
        _ => Err(malformed()),
    }
}

/// A command as an array of bulk strings, the one form Redis takes from a client.
pub(crate) fn command(args: &[&str]) -> Vec<u8> {
    let mut out = format!("*{}\r\n", args.len()).into_bytes();
    for a in args {
        out.extend_from_slice(format!("${}\r\n", a.len()).as_bytes());
        out.extend_from_slice(a.as_bytes());
        out.extend_from_slice(b"\r\n");
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A value's length, walked at once.
    fn whole_len(buf: &[u8]) -> io::Result<Option<usize>> {
        value_len(buf, &mut Scan::default())
    }

    /// Fed a byte at a time with one scan kept, a reply is whole exactly at its last byte,
    /// and each byte is looked at a bounded number of times, not again from the start.
    #[test]
    fn a_scan_resumes_where_the_last_read_stopped() {
        let reply = b"*3\r\n$3\r\nabc\r\n*2\r\n:1\r\n$-1\r\n+OK\r\n";
        let mut scan = Scan::default();
        for cut in 0..reply.len() {
            assert_eq!(
                value_len(&reply[..cut], &mut scan).unwrap(),
                None,
                "cut at {cut}"
            );
        }
        assert_eq!(value_len(reply, &mut scan).unwrap(), Some(reply.len()));
        // Reset once whole: the next value is walked from its own start.
        assert_eq!(value_len(b"+OK\r\n", &mut scan).unwrap(), Some(5));
        // A million small elements over a thousand reads: the scan has moved past all but
        // the last when the last read comes.
        let mut big = b"*1000000\r\n".to_vec();
        big.extend_from_slice(&b":1\r\n".repeat(1_000_000));
        let mut scan = Scan::default();
        for chunk in 1..1000 {
            let cut = big.len() * chunk / 1000;
            assert_eq!(value_len(&big[..cut], &mut scan).unwrap(), None);
        }
        assert!(scan.pos > big.len() * 998 / 1000, "{scan:?}");
        assert_eq!(value_len(&big, &mut scan).unwrap(), Some(big.len()));
        // A header line that never ends is refused once past any Redis sends.
        let open = [b'+'; MAX_LINE + 1];
        assert!(whole_len(&open[..MAX_LINE]).unwrap().is_none());
        assert!(whole_len(&open).is_err());
        assert!(parse(&open).is_err());
    }

    #[test]
    fn parses_messages_and_partials() {
        let msg = b"*3\r\n$7\r\nmessage\r\n$2\r\nch\r\n$5\r\nhello\r\n";
        let (n, v) = parse(msg).unwrap().unwrap();
        assert_eq!(n, msg.len());
        assert!(matches!(v, Value::Array(ref items) if items.len() == 3));
        for cut in 0..msg.len() {
            assert!(parse(&msg[..cut]).unwrap().is_none(), "cut at {cut}");
        }
        assert!(parse(b"?x\r\n").is_err());
        // Nested past the cap: refused, not recursed into.
        let deep = b"*1\r\n".repeat(100_000);
        assert!(parse(&deep).is_err());
        let ok = b"*1\r\n*1\r\n*1\r\n*1\r\n:5\r\n";
        assert!(parse(ok).unwrap().is_some());
        // Wider than any push: refused before its elements are built.
        let mut wide = b"*65\r\n".to_vec();
        wide.extend_from_slice(&b":1\r\n".repeat(65));
        assert!(parse(&wide).is_err());
        assert!(parse(&wide[..10]).is_err(), "refused from its header alone");
        assert_eq!(
            command(&["SUBSCRIBE", "a"]),
            b"*2\r\n$9\r\nSUBSCRIBE\r\n$1\r\na\r\n".to_vec()
        );
    }

    #[test]
    fn a_reply_is_whole_only_with_its_last_byte_and_deep_or_huge_ones_do_not_panic() {
        let reply = b"*3\r\n$3\r\nabc\r\n*2\r\n:1\r\n$-1\r\n+OK\r\n";
        for cut in 0..reply.len() {
            assert_eq!(whole_len(&reply[..cut]).unwrap(), None, "cut at {cut}");
        }
        let mut more = reply.to_vec();
        more.extend_from_slice(b"+next\r\n");
        assert_eq!(whole_len(&more).unwrap(), Some(reply.len()));
        assert_eq!(
            redis::parse_redis_value(&more[..reply.len()]).ok(),
            Some(redis::Value::Array(vec![
                redis::Value::BulkString(b"abc".to_vec()),
                redis::Value::Array(vec![redis::Value::Int(1), redis::Value::Nil]),
                redis::Value::Okay,
            ]))
        );
        assert!(whole_len(b"?x\r\n").is_err());
        assert_eq!(whole_len(&b"*1\r\n".repeat(100_000)).unwrap(), None);
        let huge = b"*9223372036854775807\r\n*9223372036854775807\r\n$9223372036854775807\r\n";
        assert_eq!(whole_len(huge).unwrap(), None);
        assert_eq!(whole_len(b"*-1\r\n").unwrap(), Some(5));
    }

    #[test]
    fn both_readers_refuse_the_same_headers_and_take_the_same_whole_values() {
        for bad in [&b"\r\n"[..], b"?x\r\n", b"$x\r\nab\r\n", b"*1x\r\n:1\r\n"] {
            assert!(whole_len(bad).is_err(), "{bad:?}");
            assert!(parse(bad).is_err(), "{bad:?}");
        }
        for good in [
            &b"+OK\r\n"[..],
            b":-3\r\n",
            b"$-1\r\n",
            b"*2\r\n$1\r\na\r\n:1\r\n",
        ] {
            let (len, _) = parse(good).unwrap().unwrap();
            assert_eq!(whole_len(good).unwrap(), Some(len), "{good:?}");
            assert_eq!(len, good.len());
        }
    }
}
