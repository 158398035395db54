//! Per-rig fairness (CONTRACT.md §2: over its rate a rig is paused, never dropped) and the
//! epoll fallback driver serving the same protocol.

mod common;

use std::time::{Duration, Instant};

use common::broker::{read_json, Broker, RawRig};
use serde_json::{json, Value};
use tungstenite::Message;

#[test]
fn a_chatty_rig_is_slowed_not_dropped() {
    let b = Broker::start(&["--rig-rate", "50", "--rig-burst", "5"]);
    let (mut ws, _, _) = b.rig("rig-chatty");
    let started = Instant::now();
    for i in 0..40 {
        let ev = json!({"type":"event","name":"tick","data":{"i":i}});
        ws.send(Message::Text(ev.to_string().into())).unwrap();
    }
    b.wait_metric("fleetlink_messages_in_total{type=\"event\"} 40");
    // 35 messages beyond the burst at 50/s take at least ~0.7 s.
    assert!(
        started.elapsed() >= Duration::from_millis(600),
        "{:?}",
        started.elapsed()
    );
    assert!(metric(&b, "fleetlink_rig_rate_paused_total ") > 0);
    // Still connected and served.
    let (status, reply) = b.command("rig-chatty", "noop", json!({}));
    assert_eq!(status, 200, "{reply}");
    assert_eq!(read_json(&mut ws)["type"], "command");
}

/// Acks and results answer the broker's own commands: a rig that acks and reports each command
/// at once is not held back by its rate (at a token each, a rig answering 50 commands a second
/// at the default rate filled its outbox and was reported `rig_unresponsive`), while an ack
/// repeated still costs a whole token.
#[test]
fn a_rig_answering_its_commands_is_not_held_back_by_its_rate() {
    const COMMANDS: u64 = 120;
    let b = Broker::start(&["--rig-rate", "5", "--rig-burst", "40"]);
    let (mut ws, _, _) = b.rig("rig-busy");
    // The first half reported at once; the second acked at once, its results sent after the
    // last command, as a rig running its commands for a while does (more owed than the 16
    // most recent ids the broker keeps for results).
    let send = |ws: &mut common::broker::Ws, msg: Value| {
        ws.send(Message::Text(msg.to_string().into())).unwrap();
    };
    for i in 1..=COMMANDS {
        let (status, reply) = b.command("rig-busy", "noop", json!({}));
        assert_eq!(status, 200, "{reply}");
        let cmd = read_json(&mut ws);
        assert_eq!(cmd["seq"], i, "{cmd}");
        send(&mut ws, json!({"type":"ack","seq":i}));
        if i <= COMMANDS / 2 {
            send(&mut ws, json!({"type":"result","seq":i,"ok":true}));
        }
    }
    for i in COMMANDS / 2 + 1..=COMMANDS {
        send(&mut ws, json!({"type":"result","seq":i,"ok":true}));
    }
    // Two messages a command, 240 in all against a burst of 40 and 5 more a second: nothing
    // each (at a token each for the 44 results past the ids kept, 68; at an eighth, 30).
    b.wait_metric(&format!(
        "fleetlink_messages_in_total{{type=\"result\"}} {COMMANDS}"
    ));
    assert_eq!(metric(&b, "fleetlink_rig_rate_paused_total "), 0);
    // Past the burst of 40: paused.
    for _ in 0..60 {
        let again = json!({"type":"ack","seq":1});
        ws.send(Message::Text(again.to_string().into())).unwrap();
    }
    b.wait_metric(&format!(
        "fleetlink_messages_in_total{{type=\"ack\"}} {}",
        COMMANDS + 60
    ));
    assert!(metric(&b, "fleetlink_rig_rate_paused_total ") > 0);
}

/// A burst of commands to a rig that acks each as it reads it: its acks are read as they come,
/// so its unacked commands stay few and every command is taken. At an eighth of a token an
/// ack, the acks past the bucket's burst waited unread (here some 1,700, for 40 s), and with
/// commands coming faster than one at a time the session filled with commands the rig had
/// acked and the rest were refused `rig_unresponsive` with "force_reconnect" (review bb148:
/// 508 of 2,000 published at once, at the default rate).
#[test]
fn a_burst_to_a_rig_acking_each_command_is_all_taken() {
    const COMMANDS: u64 = 2_000;
    let b = Broker::start(&["--rig-rate", "5", "--rig-burst", "40"]);
    let (mut ws, _, _) = b.rig("rig-burst");
    let mut admin = common::broker::KeepAlive::open(b.admin);
    for i in 1..=COMMANDS {
        let (status, reply) = admin.post("/v1/rigs/rig-burst/commands", r#"{"name":"n"}"#);
        assert_eq!(status, 200, "command {i}: {reply}");
        let cmd = read_json(&mut ws);
        assert_eq!(cmd["seq"], i, "{cmd}");
        ws.send(Message::Text(
            json!({"type":"ack","seq":i}).to_string().into(),
        ))
        .unwrap();
    }
    b.wait_metric(&format!(
        "fleetlink_messages_in_total{{type=\"ack\"}} {COMMANDS}"
    ));
    assert_eq!(metric(&b, "fleetlink_rig_rate_paused_total "), 0);
}

/// Many chatty rigs at once, each within its own rate but together sending more events than
/// the bridge's 64 MiB of waiting events hold: none is dropped; the rigs wait instead.
#[test]
fn many_rigs_bursting_large_events_together_lose_none() {
    const RIGS: usize = 12;
    const EACH: usize = 200;
    let b = Broker::start(&[]);
    let rigs: Vec<RawRig> = (0..RIGS)
        .map(|i| RawRig::hello(&b, &format!("rig-loud-{i}")))
        .collect();
    let pad = "x".repeat(60_000);
    let senders: Vec<_> = rigs
        .into_iter()
        .enumerate()
        .map(|(r, mut rig)| {
            let pad = pad.clone();
            std::thread::spawn(move || {
                for i in 0..EACH {
                    let ev = json!({"type":"event","name":"dump","data":{"r":r,"i":i,"pad":pad}});
                    rig.send_text(&ev.to_string());
                }
                rig
            })
        })
        .collect();
    let _rigs: Vec<RawRig> = senders.into_iter().map(|t| t.join().unwrap()).collect();
    let all = RIGS * EACH;
    let deadline = Instant::now() + Duration::from_secs(60);
    while metric(&b, "fleetlink_messages_in_total{type=\"event\"} ") < all as u64 {
        assert!(
            Instant::now() < deadline,
            "not every event was read in time"
        );
        std::thread::sleep(Duration::from_millis(50));
    }
    let dropped = metric(&b, "fleetlink_bridge_queue_full_total{from=\"core\"} ");
    assert_eq!(dropped, 0, "{dropped} of {all} events dropped");
    // Paused, if the bridge fell behind at all: counted where an operator can see it.
    metric(&b, "fleetlink_rig_events_paused_total ");
}

/// PINGs are not messages, but each costs the broker a decode and a PONG: a rig flooding them
/// is paused like a chatty one, at an eighth of a token each, and stays connected.
#[test]
fn a_rig_flooding_pings_is_slowed_too() {
    let b = Broker::start(&["--rig-rate", "10", "--rig-burst", "5"]);
    let mut rig = RawRig::hello(&b, "rig-pinger");
    let pongs = pongs_to_a_flood(&mut rig);
    assert!((40..400).contains(&pongs), "{pongs} PONGs in 0.5 s");
    assert!(metric(&b, "fleetlink_rig_rate_paused_total ") > 0);
    // Held back, not dropped: still served.
    let (status, reply) = b.command("rig-pinger", "noop", json!({}));
    assert_eq!(status, 200, "{reply}");
}

/// The same before the hello: a connection that has not said which rig it is held a core busy
/// answering its PINGs until its hello timeout, 20 million PONGs in 1.5 s (review bb130).
#[test]
fn a_connection_flooding_pings_before_its_hello_is_slowed_too() {
    let b = Broker::start(&["--rig-rate", "10", "--rig-burst", "5"]);
    let mut conn = RawRig::upgraded(&b);
    let pongs = pongs_to_a_flood(&mut conn);
    assert!((40..400).contains(&pongs), "{pongs} PONGs in 0.5 s");
    assert!(metric(&b, "fleetlink_rig_rate_paused_total ") > 0);
}

/// Writes 2,000 PINGs at once and counts the PONGs that come back within 0.5 s: at
/// `--rig-rate 10 --rig-burst 5`, the burst's 40 and 80 a second after it.
fn pongs_to_a_flood(rig: &mut RawRig) -> usize {
    rig.write_raw(&client_ping(b"p").repeat(2000));
    let started = Instant::now();
    let mut pongs = 0;
    while started.elapsed() < Duration::from_millis(500) {
        match rig.read_frame_within(Duration::from_millis(50)) {
            Some((0xA, _)) => pongs += 1,
            Some((op, _)) => panic!("opcode {op:#x} before the flood was read"),
            None => {}
        }
    }
    pongs
}

/// While the broker holds a chatty rig back, that rig's PONGs wait in TCP behind messages the
/// broker has not read yet. Those are the broker's delay, not the rig's: it is not closed 4002,
/// and every message is read.
#[test]
fn a_rig_held_back_by_its_rate_is_not_closed_for_pongs_behind_its_messages() {
    let b = Broker::start(&[
        "--rig-rate",
        "10",
        "--rig-burst",
        "5",
        "--ping-interval",
        "300ms",
        "--pong-timeout",
        "100ms",
        "--max-missed-pongs",
        "2",
    ]);
    let mut rig = RawRig::hello(&b, "rig-chatty");
    let mut burst = Vec::new();
    for i in 0..30 {
        let ev = json!({"type":"event","name":"tick","data":{"i":i}}).to_string();
        fleetlink::ws::encode_client_frame(
            &mut burst,
            true,
            fleetlink::ws::OpCode::Text,
            [1, 2, 3, 4],
            ev.as_bytes(),
        );
    }
    rig.write_raw(&burst);
    // 25 messages past the burst at 10/s: about 2.5 s, some eight PING intervals, each PONG
    // queued behind what is left of the burst.
    let all_read = "fleetlink_messages_in_total{type=\"event\"} 30";
    let deadline = Instant::now() + Duration::from_secs(15);
    let mut pings = 0;
    while metric(&b, "fleetlink_messages_in_total{type=\"event\"} ") < 30 {
        assert!(Instant::now() < deadline, "never read the whole burst");
        match rig.read_frame_within(Duration::from_millis(50)) {
            Some((0x9, ping)) => {
                pings += 1;
                rig.send_frame(fleetlink::ws::OpCode::Pong, &ping);
            }
            Some((op, payload)) => panic!(
                "opcode {op} while held back: {:?}",
                String::from_utf8_lossy(&payload)
            ),
            None => {}
        }
    }
    b.wait_metric(all_read);
    assert!(pings >= 4, "only {pings} PINGs while held back");
    assert_eq!(metric(&b, "fleetlink_closes_total{code=\"4002\"} "), 0);
    // Still up, and served once the burst is read.
    let (status, reply) = b.command("rig-chatty", "noop", json!({}));
    assert_eq!(status, 200, "{reply}");
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        assert!(
            Instant::now() < deadline,
            "no command once the burst was read"
        );
        match rig.read_frame_within(Duration::from_secs(5)) {
            Some((0x9, ping)) => rig.send_frame(fleetlink::ws::OpCode::Pong, &ping),
            Some((0x1, payload)) => {
                assert!(String::from_utf8_lossy(&payload).contains("\"command\""));
                break;
            }
            other => panic!("{other:?}"),
        }
    }
}

#[test]
fn epoll_driver_serves_the_same_protocol() {
    let b = Broker::start(&["--force-epoll", "--ping-interval", "100ms"]);
    b.wait_metric("fleetlink_driver{core=\"0\",driver=\"epoll\"} 1");
    let (mut ws, _, welcome) = b.rig("rig-epoll");
    assert_eq!(welcome["rig_id"], "rig-epoll");
    let (status, reply) = b.command("rig-epoll", "uptime", json!({}));
    assert_eq!(status, 200, "{reply}");
    let cmd = read_json(&mut ws);
    assert_eq!(cmd["seq"], 1);
    // The sweep pings on this driver too; tungstenite answers while it reads.
    if let tungstenite::stream::MaybeTlsStream::Plain(s) = ws.get_mut() {
        s.set_read_timeout(Some(Duration::from_millis(20))).unwrap();
    }
    common::broker::eventually(Duration::from_secs(5), "pongs on epoll", || {
        let _ = ws.read();
        metric(&b, "fleetlink_pongs_received_total ") >= 2
    });
}

fn metric(b: &Broker, series: &str) -> u64 {
    b.metric(series)
}

/// On epoll, a socket that keeps receiving is ready at every poll: a rig that streams without
/// pause after our close frame must not hold its connection past the close's 2 s linger.
#[test]
fn a_rig_streaming_after_our_close_is_cut_at_the_linger_on_epoll() {
    let b = Broker::start(&["--force-epoll"]);
    b.wait_metric("fleetlink_driver{core=\"0\",driver=\"epoll\"} 1");
    let rig = RawRig::hello(&b, "rig-stream");
    let mut writer = rig.stream_clone();
    let stop = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
    let stopped = stop.clone();
    let pump = std::thread::spawn(move || {
        let chunk = client_ping(b"x").repeat(64);
        let started = Instant::now();
        while !stopped.load(std::sync::atomic::Ordering::Relaxed)
            && started.elapsed() < Duration::from_secs(8)
        {
            if std::io::Write::write_all(&mut writer, &chunk).is_err() {
                break;
            }
        }
    });
    let (status, body) = b.http("POST", "/v1/rigs/rig-stream/kick", "");
    assert_eq!(status, 200, "{body}");
    let kicked = Instant::now();
    let mut reader = rig.stream_clone();
    reader
        .set_read_timeout(Some(Duration::from_secs(10)))
        .unwrap();
    let mut buf = [0u8; 4096];
    loop {
        match std::io::Read::read(&mut reader, &mut buf) {
            Ok(0) => break,
            Ok(_) => {}
            Err(e) if e.kind() == std::io::ErrorKind::ConnectionReset => break,
            Err(e) => panic!("still open {:?} after the kick: {e}", kicked.elapsed()),
        }
    }
    stop.store(true, std::sync::atomic::Ordering::Relaxed);
    let _ = pump.join();
    assert!(
        kicked.elapsed() < Duration::from_secs(5),
        "closed {:?} after the kick",
        kicked.elapsed()
    );
}

/// One masked PING frame as a rig sends it.
fn client_ping(payload: &[u8]) -> Vec<u8> {
    let mut frame = Vec::new();
    fleetlink::ws::encode_client_frame(
        &mut frame,
        true,
        fleetlink::ws::OpCode::Ping,
        [1, 2, 3, 4],
        payload,
    );
    frame
}

/// What a rig sends after the broker's close is still held to its rate: it is read, and what
/// crosses the close published, only as its bucket allows. A kicked rig that flooded its
/// closing window (the 2 s linger) instead of echoing the close had 45,000 events read and
/// published at `--rig-rate 100` (review bb156).
#[test]
fn a_kicked_rig_flooding_its_closing_window_is_held_to_its_rate() {
    let b = Broker::start(&["--rig-rate", "10", "--rig-burst", "10"]);
    let mut rig = RawRig::hello(&b, "rig-flood");
    let (status, body) = b.http("POST", "/v1/rigs/rig-flood/kick", "");
    assert_eq!(status, 200, "{body}");
    // Small enough to sit in the socket buffers whatever the broker reads.
    let flood = json!({"type":"event","name":"flood"}).to_string();
    for _ in 0..500 {
        rig.send_text(&flood);
    }
    assert_eq!(rig.read_close(), 1012);
    // No echo: the broker ends the connection when its linger is over.
    let mut reader = rig.stream_clone();
    let mut buf = [0u8; 4096];
    while !matches!(std::io::Read::read(&mut reader, &mut buf), Ok(0) | Err(_)) {}
    let read = metric(&b, "fleetlink_messages_in_total{type=\"event\"}");
    // The burst, then 10 a second for the linger's 2 s, and some slack for the clock.
    assert!((10..=40).contains(&read), "{read} of 500 read");
    common::broker::eventually(Duration::from_secs(5), "the read ones published", || {
        b.events_named("flood").len() as u64 == read
    });
    assert!(metric(&b, "fleetlink_rig_rate_paused_total ") > 0);
}

/// 16 commands written to a rig at `--rig-rate 2 --rig-burst 4`, acked at once when
/// `acked_live`. The rig is kicked, and before it reads the close it sends each one's result,
/// acking it first when it had not. Every result must be published with its id.
fn kicked_while_reporting(acked_live: bool) {
    const COMMANDS: u64 = 16;
    let b = Broker::start(&["--rig-rate", "2", "--rig-burst", "4"]);
    let (mut ws, _, _) = b.rig("rig-report");
    let send = |ws: &mut common::broker::Ws, msg: Value| {
        ws.send(Message::Text(msg.to_string().into())).unwrap();
    };
    for i in 1..=COMMANDS {
        let (status, reply) = b.command("rig-report", "noop", json!({}));
        assert_eq!(status, 200, "{reply}");
        assert_eq!(read_json(&mut ws)["seq"], i);
        if acked_live {
            send(&mut ws, json!({"type":"ack","seq":i}));
        }
    }
    if acked_live {
        b.wait_metric(&format!(
            "fleetlink_commands_total{{result=\"acked\"}} {COMMANDS}"
        ));
    }
    let (status, body) = b.http("POST", "/v1/rigs/rig-report/kick", "");
    assert_eq!(status, 200, "{body}");
    for i in 1..=COMMANDS {
        if !acked_live {
            send(&mut ws, json!({"type":"ack","seq":i}));
        }
        send(&mut ws, json!({"type":"result","seq":i,"ok":true}));
    }
    assert_eq!(common::broker::read_close(&mut ws), 1012);
    let named = || b.events_where(|e| e["type"] == "result" && e["id"].is_string());
    common::broker::eventually(Duration::from_secs(5), "every result published", || {
        named().len() == COMMANDS as usize
    });
}

/// Results of acked commands are free of the rig's rate after the broker's close too, as they
/// are live: a rig kicked as it reports a burst of them has every one published, with its id.
/// At a token each, the rate cut off the last ones, those the broker kept ids for (review
/// bb157: 7 of 16 at `--rig-rate 2 --rig-burst 4`; 398 of 600 at the defaults).
#[test]
fn results_a_kicked_rig_reports_in_a_burst_are_all_published() {
    kicked_while_reporting(true);
}

/// The same for commands the rig acks only after the close: the ack is not taken, but it is
/// free as a first ack is live, and makes its result an answer (review bb158: 6 of 16
/// published, the acks charged a token each).
#[test]
fn results_a_kicked_rig_acks_and_reports_in_a_burst_are_all_published() {
    kicked_while_reporting(false);
}
