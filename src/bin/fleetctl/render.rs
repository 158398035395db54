//! Output: a sentence or table for people, or with `--json` the objects themselves, one per line.
//!
//! Each printer also returns the exit code its object stands for, so `main` never inspects
//! replies twice. Everything goes to stdout; only fleetctl's own failures go to stderr.

use std::time::Duration;

use serde_json::{json, Value};

use crate::{Broadcast, Exit, Page};

/// Fields an event line shows after its time, type and rig, in this order; others follow.
const EVENT_FIELDS: &[&str] = &[
    "seq",
    "id",
    "code",
    "reason",
    "ok",
    "name",
    "boot_id",
    "resumed",
    "broker_id",
];

/// The output mode.
pub(crate) struct Render {
    /// `--json`: objects, one per line.
    pub(crate) json: bool,
}

impl Render {
    /// A single-rig reply (`send RIG`, `kick`); `done` describes a success without a seq.
    pub(crate) fn reply(&self, r: &Value, done: &str) -> Exit {
        if self.json {
            println!("{r}");
        } else if r["ok"].as_bool() == Some(true) {
            let what = match r["seq"].as_u64() {
                Some(seq) => format!("enqueued as seq {seq}"),
                None => done.to_owned(),
            };
            println!("{}: {what} (id {})", cell(&r["rig_id"]), cell(&r["id"]));
        } else {
            print_error(r);
        }
        Exit::of_reply(r)
    }

    /// A selector broadcast: a row per broker, the failed rigs, and totals.
    pub(crate) fn broadcast(&self, b: &Broadcast) -> Exit {
        let missing = b.missing();
        if self.json {
            for r in &b.replies {
                println!("{r}");
            }
            for broker in &missing {
                let detail = format!("no reply within {}", secs(b.timeout));
                println!(
                    "{}",
                    json!({"id": b.id, "ok": false, "error": "timeout", "broker_id": broker, "detail": detail})
                );
            }
            return b.exit();
        }
        let mut rows: Vec<Vec<String>> = b
            .replies
            .iter()
            .map(|r| {
                let failed = r["failed"].as_array().map_or(0, Vec::len);
                let note = if r["ok"].as_bool() == Some(true) {
                    String::new()
                } else {
                    error_text(r)
                };
                vec![
                    cell(&r["broker_id"]),
                    cell(&r["matched"]),
                    cell(&r["enqueued"]),
                    failed.to_string(),
                    note,
                ]
            })
            .collect();
        for broker in &missing {
            let note = format!("no reply within {}", secs(b.timeout));
            rows.push(vec![
                broker.to_string(),
                "-".into(),
                "-".into(),
                "-".into(),
                note,
            ]);
        }
        table(&["BROKER", "MATCHED", "ENQUEUED", "FAILED", ""], &rows);
        let sum = |k: &str| b.replies.iter().filter_map(|r| r[k].as_u64()).sum::<u64>();
        let mut failed = 0;
        for r in &b.replies {
            for f in r["failed"].as_array().into_iter().flatten() {
                failed += 1;
                println!(
                    "failed: {} on {}: {}",
                    cell(&f["rig_id"]),
                    cell(&r["broker_id"]),
                    error_text(f)
                );
            }
        }
        // A broker found not listening was answered for by fleetctl, not by itself.
        let not_listening = b
            .replies
            .iter()
            .filter(|r| r["error"] == "broker_not_listening")
            .count();
        let replied = b
            .expected
            .len()
            .saturating_sub(missing.len() + not_listening);
        let unheard = match not_listening {
            0 => String::new(),
            n => format!(", {n} not listening"),
        };
        println!(
            "total: {replied}/{} brokers replied{unheard}, {} matched, {} enqueued, {failed} failed (id {})",
            b.expected.len(),
            sum("matched"),
            sum("enqueued"),
            b.id
        );
        b.exit()
    }

    /// `status RIG`: Redis (registry entry + broker) or admin (the rig's row) shape.
    pub(crate) fn status(&self, s: &Value) -> Exit {
        let exit = if s["ok"].as_bool() == Some(true) {
            Exit::Ok
        } else {
            Exit::Error
        };
        if self.json {
            println!("{s}");
            return exit;
        }
        if exit != Exit::Ok && s.get("broker_live").is_none() {
            print_error(s);
            return exit;
        }
        let Some(fields) = s.as_object() else {
            return exit;
        };
        if let Some(live) = s["broker_live"].as_bool() {
            let broker = cell(&s["broker_id"]);
            let broker_line = if live {
                let b = &s["broker"];
                format!(
                    "{broker} (live: address {}, {} cores, {} connections, started {}, key ttl {})",
                    cell(&b["address"]),
                    cell(&b["cores"]),
                    cell(&b["connections"]),
                    cell(&b["started_at"]),
                    ttl(&s["broker_ttl_ms"])
                )
            } else if s["broker_key"].as_bool() == Some(true) {
                format!(
                    "{broker} (dead: nothing listens on fleetlink:broker:{broker}, though its key \
                     has {} left; this entry is stale until its lease ends)",
                    ttl(&s["broker_ttl_ms"])
                )
            } else {
                format!("{broker} (dead: no broker:{broker} key; this entry is stale until its lease ends)")
            };
            table(
                &["", ""],
                &[
                    vec!["rig".into(), cell(&s["rig_id"])],
                    vec!["boot_id".into(), cell(&s["boot_id"])],
                    vec!["broker".into(), broker_line],
                    vec!["lease".into(), format!("{} left", ttl(&s["ttl_ms"]))],
                ],
            );
            if exit != Exit::Ok {
                print_error(s);
            }
        } else {
            let rows: Vec<Vec<String>> = fields
                .iter()
                .filter(|(k, _)| *k != "ok")
                .map(|(k, v)| vec![k.clone(), cell(v)])
                .collect();
            table(&["", ""], &rows);
        }
        exit
    }

    /// One page of `list` as a table, then where the next one starts (`--json` follows the
    /// pages in `main` instead).
    pub(crate) fn page(&self, p: &Page) -> Exit {
        if p.admin {
            let rows: Vec<Vec<String>> = p
                .rows
                .iter()
                .map(|r| {
                    let keys = [
                        "rig_id",
                        "boot_id",
                        "connected_at",
                        "last_ack_seq",
                        "outbox_depth",
                        "labels",
                    ];
                    keys.iter().map(|k| cell(&r[*k])).collect()
                })
                .collect();
            table(
                &[
                    "RIG",
                    "BOOT_ID",
                    "CONNECTED_AT",
                    "LAST_ACK",
                    "OUTBOX",
                    "LABELS",
                ],
                &rows,
            );
        } else {
            let rows: Vec<Vec<String>> = p
                .rows
                .iter()
                .map(|r| {
                    let broker = match r["broker_live"].as_bool() {
                        Some(false) => format!("{} (dead)", cell(&r["broker_id"])),
                        _ => cell(&r["broker_id"]),
                    };
                    vec![cell(&r["rig_id"]), cell(&r["boot_id"]), broker]
                })
                .collect();
            table(&["RIG", "BOOT_ID", "BROKER"], &rows);
        }
        match &p.next_cursor {
            None => println!("({} rigs, end of list)", p.rows.len()),
            Some(c) => println!("({} rigs) next: --cursor {c}", p.rows.len()),
        }
        Exit::Ok
    }

    /// `brokers`: live broker keys (Redis) or one broker's health (admin).
    pub(crate) fn brokers(&self, rows: &[Value]) -> Exit {
        if self.json {
            for row in rows {
                println!("{row}");
            }
            return Exit::Ok;
        }
        if rows.iter().any(|r| r.get("admin").is_some()) {
            let rows: Vec<Vec<String>> = rows
                .iter()
                .map(|r| {
                    vec![
                        cell(&r["admin"]),
                        cell(&r["healthz"]),
                        cell(&r["readyz"]),
                        cell(&r["detail"]),
                    ]
                })
                .collect();
            table(&["ADMIN", "HEALTHZ", "READYZ", "DETAIL"], &rows);
            return Exit::Ok;
        }
        let table_rows: Vec<Vec<String>> = rows
            .iter()
            .map(|r| {
                let mut row: Vec<String> =
                    ["broker_id", "address", "cores", "connections", "started_at"]
                        .iter()
                        .map(|k| cell(&r[*k]))
                        .collect();
                row.push(ttl(&r["ttl_ms"]));
                // A draining broker still listens, but its rigs are leaving it.
                let mut listening = yes_no(&r["listening"]);
                if r["draining"].as_bool() == Some(true) {
                    listening.push_str(" (draining)");
                }
                row.push(listening);
                row
            })
            .collect();
        table(
            &[
                "BROKER",
                "ADDRESS",
                "CORES",
                "CONNECTIONS",
                "STARTED_AT",
                "TTL",
                "LISTENING",
            ],
            &table_rows,
        );
        let dead = rows
            .iter()
            .filter(|r| r["listening"].as_bool() == Some(false))
            .count();
        match dead {
            0 => println!("({} live brokers)", rows.len()),
            n => println!(
                "({} live brokers; {n} dead: key not yet expired, nothing listening on its channel)",
                rows.len() - n
            ),
        }
        Exit::Ok
    }

    /// One event as it arrives: `time type rig key=value…`, or the raw object.
    pub(crate) fn event(&self, e: &Value) {
        if self.json {
            println!("{e}");
            return;
        }
        let mut line = format!(
            "{} {} {}",
            cell(&e["at"]),
            cell(&e["type"]),
            cell(&e["rig_id"])
        );
        let skip = ["at", "type", "rig_id"];
        let rest =
            e.as_object().into_iter().flatten().filter(|(k, _)| {
                !skip.contains(&k.as_str()) && !EVENT_FIELDS.contains(&k.as_str())
            });
        let known = EVENT_FIELDS.iter().map(|k| (*k, &e[*k]));
        for (k, v) in known.chain(rest.map(|(k, v)| (k.as_str(), v))) {
            match v {
                Value::Null => {}
                // Quoted when a bare value would run into the next field.
                Value::String(s) if s.is_empty() || s.contains(char::is_whitespace) => {
                    line.push_str(&format!(" {k}={v}"))
                }
                _ => line.push_str(&format!(" {k}={}", cell(v))),
            }
        }
        println!("{line}");
    }
}

/// `5s`, `250ms`: a duration as the flags spell it.
pub(crate) fn secs(d: Duration) -> String {
    if d.subsec_millis() == 0 {
        format!("{}s", d.as_secs())
    } else {
        format!("{}ms", d.as_millis())
    }
}

/// `rig: error: detail`, plus the recovery hints of `rig_unresponsive`.
fn print_error(r: &Value) {
    println!("{}: {}", cell(&r["rig_id"]), error_text(r));
    if r.get("last_ack_seq").is_some() || r.get("suggested_action").is_some() {
        println!(
            "  last ack: seq {} at {}; suggested action: {}",
            cell(&r["last_ack_seq"]),
            cell(&r["last_ack_at"]),
            cell(&r["suggested_action"])
        );
    }
}

/// `error: detail` (or just the error when there is no detail).
fn error_text(r: &Value) -> String {
    match r["detail"].as_str() {
        Some(d) if !d.is_empty() => format!("{}: {d}", cell(&r["error"])),
        _ => cell(&r["error"]),
    }
}

/// A JSON value as table text: strings bare, null as `-`.
fn cell(v: &Value) -> String {
    match v {
        Value::Null => "-".into(),
        Value::String(s) => s.clone(),
        other => other.to_string(),
    }
}

/// A PTTL in milliseconds as `54.3s`; negative (no TTL / gone) as Redis means it.
fn ttl(v: &Value) -> String {
    match v.as_i64() {
        Some(-1) => "no ttl".into(),
        Some(ms) if ms < 0 => "expired".into(),
        Some(ms) => format!("{:.1}s", ms as f64 / 1000.0),
        None => "-".into(),
    }
}

/// `yes`/`no` for a bool, `-` for anything else.
fn yes_no(v: &Value) -> String {
    match v.as_bool() {
        Some(true) => "yes".into(),
        Some(false) => "no".into(),
        None => "-".into(),
    }
}

/// Left-aligned columns two spaces apart; the last column is not padded.
fn table(headers: &[&str], rows: &[Vec<String>]) {
    let mut widths: Vec<usize> = headers.iter().map(|h| h.chars().count()).collect();
    for row in rows {
        for (w, c) in widths.iter_mut().zip(row) {
            *w = (*w).max(c.chars().count());
        }
    }
    let line = |cells: Vec<&str>| {
        let mut out = String::new();
        for (i, (c, w)) in cells.iter().zip(&widths).enumerate() {
            if i + 1 == cells.len() {
                out.push_str(c);
            } else {
                out.push_str(&format!("{c:<w$}  "));
            }
        }
        println!("{}", out.trim_end());
    };
    if headers.iter().any(|h| !h.is_empty()) {
        line(headers.to_vec());
    }
    for row in rows {
        line(row.iter().map(String::as_str).collect());
    }
}
