//! `--reconnect` and `--exec-log` against a tiny in-test broker: the first connection of each
//! rig gets command 1 and a goaway; the rig must come back at the asked instant with the same
//! boot_id and `last_seq: 1`, get seq 1 replayed (a duplicate: acked, not run) and then seq 2.

use std::collections::BTreeMap;
use std::process::Command;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use futures_util::{SinkExt, StreamExt};
use serde_json::Value;
use tokio::net::TcpListener;
use tokio_tungstenite::tungstenite::Message;

/// What the goaway asks for: come back no earlier than this after it.
const RECONNECT_AFTER: Duration = Duration::from_millis(200);

/// What the server saw of one rig.
struct Rig {
    boot_id: String,
    /// Each hello, with when it arrived.
    hellos: Vec<(Value, Instant)>,
    acks: Vec<u64>,
    /// Taken just before the goaway is written (so never later than the rig can read it).
    goaway_at: Option<Instant>,
}

/// rig_id → what the server saw of it.
type Seen = Arc<Mutex<BTreeMap<String, Rig>>>;

async fn serve(listener: TcpListener, seen: Seen) {
    while let Ok((tcp, _)) = listener.accept().await {
        let seen = seen.clone();
        tokio::spawn(async move {
            let Ok(mut ws) = tokio_tungstenite::accept_async(tcp).await else {
                return;
            };
            let Some(Ok(Message::Text(hello))) = ws.next().await else {
                return;
            };
            let at = Instant::now();
            let hello: Value = serde_json::from_str(&hello).unwrap();
            let rig = hello["rig_id"].as_str().unwrap().to_string();
            let first = {
                let mut s = seen.lock().unwrap();
                let e = s.entry(rig.clone()).or_insert_with(|| Rig {
                    boot_id: hello["boot_id"].as_str().unwrap().to_string(),
                    hellos: vec![],
                    acks: vec![],
                    goaway_at: None,
                });
                e.hellos.push((hello.clone(), at));
                e.hellos.len() == 1
            };
            let welcome = format!(
                r#"{{"type":"welcome","broker_id":"mini","rig_id":"{rig}","ping_interval_ms":20000,"resumed":{}}}"#,
                !first
            );
            let cmd = |seq: u64| {
                Message::text(format!(
                    r#"{{"type":"command","seq":{seq},"id":"{rig}-c{seq}","name":"n","args":{{}}}}"#
                ))
            };
            let mut out = vec![Message::text(welcome), cmd(1)];
            if first {
                out.push(Message::text(format!(
                    r#"{{"type":"goaway","reason":"drain","reconnect_after_ms":{}}}"#,
                    RECONNECT_AFTER.as_millis()
                )));
                seen.lock().unwrap().get_mut(&rig).unwrap().goaway_at = Some(Instant::now());
            } else {
                out.push(cmd(2));
            }
            for m in out {
                if ws.send(m).await.is_err() {
                    return;
                }
            }
            while let Some(Ok(msg)) = ws.next().await {
                if let Message::Text(t) = msg {
                    let v: Value = serde_json::from_str(&t).unwrap();
                    if v["type"] == "ack" {
                        let mut s = seen.lock().unwrap();
                        s.get_mut(&rig)
                            .unwrap()
                            .acks
                            .push(v["seq"].as_u64().unwrap());
                    }
                }
            }
        });
    }
}

#[test]
fn goaway_reconnects_resume_and_replays_run_once() {
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .unwrap();
    let listener = rt.block_on(TcpListener::bind("127.0.0.1:0")).unwrap();
    let port = listener.local_addr().unwrap().port();
    let seen: Seen = Arc::default();
    rt.spawn(serve(listener, seen.clone()));

    let dir = tempfile::tempdir().unwrap();
    let report = dir.path().join("report.json");
    let exec = dir.path().join("exec");
    let out = Command::new(env!("CARGO_BIN_EXE_fleetlink-loadgen"))
        .args(["rigs", "--url", &format!("ws://127.0.0.1:{port}/agent")])
        .args([
            "--rigs",
            "4",
            "--procs",
            "2",
            "--prefix",
            "t",
            "--id-width",
            "2",
        ])
        .args([
            "--sources",
            "127.0.0.1",
            "--hold",
            "1500ms",
            "--max-time",
            "30s",
        ])
        .args(["--reconnect", "--reconnect-backoff", "100ms"])
        .arg("--exec-log")
        .arg(&exec)
        .arg("--report")
        .arg(&report)
        .output()
        .expect("run loadgen");
    eprintln!("stderr:\n{}", String::from_utf8_lossy(&out.stderr));
    assert_eq!(out.status.code(), Some(0));

    let r: Value = serde_json::from_str(&std::fs::read_to_string(&report).unwrap()).unwrap();
    assert_eq!(r["welcomed"], 4, "{r:#}");
    assert_eq!(r["goaways"], 4);
    assert_eq!(r["reconnects"], 4);
    assert_eq!(r["resumed"], 4);
    assert_eq!(r["commands_received"], 12);
    assert_eq!(r["executed"], 8);
    assert_eq!(r["duplicates"], 4);
    assert_eq!(r["seq_gaps"], 0);
    assert_eq!(r["sessions_restarted"], 0);
    assert_eq!(
        r["goaway_delay_ms"]["max"],
        RECONNECT_AFTER.as_millis() as u64
    );
    assert_eq!(r["reconnect_gap_us"]["count"], 4);
    let timeline: u64 = r["reconnect_timeline"]
        .as_array()
        .unwrap()
        .iter()
        .map(|p| p[1].as_u64().unwrap())
        .sum();
    assert_eq!(timeline, 4);

    // One exec log per worker (first rig index 0 and 2), each command of each rig once.
    let mut lines: Vec<String> = ["exec.0", "exec.2"]
        .iter()
        .flat_map(|f| {
            std::fs::read_to_string(dir.path().join(f))
                .unwrap()
                .lines()
                .map(str::to_string)
                .collect::<Vec<_>>()
        })
        .collect();
    lines.sort();
    let want: Vec<String> = (0..4)
        .flat_map(|i| (1..=2).map(move |s| format!("rig=t-{i:02} seq={s} id=t-{i:02}-c{s} name=n")))
        .collect();
    assert_eq!(lines, want);

    // The broker's side: every rig, same boot, last_seq 1, no earlier than the goaway asked,
    // all acked.
    let seen = seen.lock().unwrap();
    let rigs: Vec<&String> = seen.keys().collect();
    assert_eq!(rigs, ["t-00", "t-01", "t-02", "t-03"]);
    for (rig, s) in seen.iter() {
        assert_eq!(s.hellos.len(), 2, "{rig}");
        let ((first, _), (second, back_at)) = (&s.hellos[0], &s.hellos[1]);
        assert!(first.get("last_seq").is_none(), "{rig}: {first}");
        assert_eq!(second["boot_id"], s.boot_id.as_str(), "{rig}");
        assert_eq!(second["last_seq"], 1, "{rig}");
        assert_eq!(s.acks, vec![1, 1, 2], "{rig}");
        let goaway_at = s
            .goaway_at
            .unwrap_or_else(|| panic!("{rig}: no goaway sent"));
        let after = back_at.saturating_duration_since(goaway_at);
        assert!(
            *back_at >= goaway_at + RECONNECT_AFTER,
            "{rig} came back {after:?} after the goaway, which asked for {RECONNECT_AFTER:?}"
        );
    }
}
