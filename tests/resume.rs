//! Resume, don't restart (CONTRACT.md §5): a session's unacked commands live in Redis until
//! acked, so a rig resumes on any broker, also after its old broker was killed, and a new boot
//! reports the old session's commands as `rig_rebooted` instead of replaying them.

mod common;

use std::collections::HashMap;
use std::time::Duration;

use common::broker::{ack, boot_id, eventually, read_close, read_command, read_json, Broker, Ws};
use common::control::{send_and_read, Control};
use common::redis::RedisServer;
use common::relay::Relay;
use fleetlink::ids::{BootId, RigId, Seq};
use fleetlink::registry::sessions::{
    Kept, Persist, Rekeep, RekeepMode, Rekept, SessionScripts, Unkept,
};
use redis::Commands;
use serde_json::{json, Value};
use tungstenite::Message;

fn fleet_broker(redis: &RedisServer, id: &str) -> Broker {
    fleet_broker_with(redis, id, &[])
}

fn fleet_broker_with(redis: &RedisServer, id: &str, extra: &[&str]) -> Broker {
    fleet_broker_at(&redis.url(), id, extra)
}

/// A fleet-mode broker on the Redis at `url` (a relay in front of one, say), once ready.
fn fleet_broker_at(url: &str, id: &str, extra: &[&str]) -> Broker {
    let mut args = vec!["--redis", url, "--broker-id", id];
    args.extend_from_slice(extra);
    let b = Broker::start(&args);
    b.wait_readyz(200, Duration::from_secs(10), "broker ready");
    b
}

fn hello(ws: &mut Ws, rig: &str, boot: &str, last_seq: Option<u64>) -> Value {
    send_hello(ws, rig, boot, last_seq);
    let welcome = read_json(ws);
    assert_eq!(welcome["type"], "welcome", "{welcome}");
    welcome
}

fn send_hello(ws: &mut Ws, rig: &str, boot: &str, last_seq: Option<u64>) {
    let mut msg = json!({"type":"hello","rig_id":rig,"boot_id":boot,"version":"t"});
    if let Some(k) = last_seq {
        msg["last_seq"] = json!(k);
    }
    ws.send(Message::Text(msg.to_string().into())).unwrap();
}

/// Brokers fe-a and fe-b on `redis`, both ready.
fn brokers_a_and_b(redis: &RedisServer) -> (Broker, Broker) {
    (fleet_broker(redis, "fe-a"), fleet_broker(redis, "fe-b"))
}

/// Connects to `b`'s rig endpoint and says hello; returns the socket and the welcome.
fn connect_hello(b: &Broker, rig: &str, boot: &str, last_seq: Option<u64>) -> (Ws, Value) {
    let mut ws = b.connect("/agent");
    let welcome = hello(&mut ws, rig, boot, last_seq);
    (ws, welcome)
}

/// Connects to `b` as `rig`'s `boot`, whose hello must resume its session there.
fn resume_on(b: &Broker, rig: &str, boot: &str, last_seq: Option<u64>) -> Ws {
    let (ws, welcome) = connect_hello(b, rig, boot, last_seq);
    assert_eq!(
        welcome["resumed"], true,
        "{rig} not resumed on {}: {welcome}",
        b.broker_id
    );
    ws
}

/// Delivers command `id` to `rig` through `b`'s admin API, which needs no Redis, and checks
/// the rig reads it as `seq`.
fn admin_command_reaches(b: &Broker, ws: &mut Ws, rig: &str, id: &str, seq: u64) {
    let (status, body) = b.command_with_id(rig, id);
    assert_eq!(status, 200, "{body}");
    assert_eq!(read_json(ws)["seq"], seq);
}

/// Waits (up to 5 s) until no broker holds `rig`'s lease.
fn wait_lease_released(con: &mut redis::Connection, rig: &str, what: &str) {
    eventually(Duration::from_secs(5), what, || {
        !con.exists::<_, bool>(format!("rig:{rig}")).unwrap()
    });
}

/// Holds `n` commands for the offline `rig` through `b`'s admin API (`queue_if_offline`, a
/// minute each), with ids `<prefix>0..`, each answered 200.
fn hold_via_admin(b: &Broker, rig: &str, prefix: &str, n: usize) {
    for i in 0..n {
        let body = json!({"id": format!("{prefix}{i}"), "name": "n", "args": {},
                          "queue_if_offline": true, "ttl_ms": 60_000});
        let (status, text) = b.http(
            "POST",
            &format!("/v1/rigs/{rig}/commands"),
            &body.to_string(),
        );
        assert_eq!(status, 200, "{text}");
    }
}

/// Waits (up to 10 s) until `broker` lists no rig: it saw the rig's connection end.
fn wait_no_rigs(broker: &Broker, what: &str) {
    eventually(Duration::from_secs(10), what, || {
        let body: Value = serde_json::from_str(&broker.http("GET", "/v1/rigs", "").1).unwrap();
        body.as_array().is_some_and(Vec::is_empty)
    });
}

/// Fills Redis: `maxmemory` of `bytes` (1: full at once; 0: no limit again) with
/// `noeviction`, so that it refuses every write that may grow memory.
fn set_maxmemory(con: &mut redis::Connection, bytes: &str) {
    let _: () = redis::cmd("CONFIG")
        .arg("SET")
        .arg("maxmemory-policy")
        .arg("noeviction")
        .arg("maxmemory")
        .arg(bytes)
        .query(con)
        .unwrap();
}

/// A command frame's seq and id.
fn seq_and_id(cmd: &Value) -> (u64, String) {
    (
        cmd["seq"].as_u64().unwrap(),
        cmd["id"].as_str().unwrap().to_owned(),
    )
}

/// SIGKILLs `b`, as a crash would (nothing released, nothing flushed), and waits for its exit.
fn kill_broker(b: &mut Broker) {
    b.signal(libc::SIGKILL);
    b.wait_exit(Duration::from_secs(5)).expect("killed");
}

/// Brokers fe-a and fe-b; `rig` (a new boot) welcomed on fe-a, sent `n` commands with ids
/// `<prefix>1..n`, each answered ok with seq 1..n and read by the rig in order.
fn rig_with_commands_on_a(
    redis: &RedisServer,
    rig: &str,
    prefix: &str,
    n: u64,
) -> (Broker, Broker, String, Ws, Control) {
    let (a, b) = brokers_a_and_b(redis);
    let boot = boot_id();
    let (mut on_a, welcome) = connect_hello(&a, rig, &boot, None);
    assert_eq!(welcome["resumed"], false);
    let mut ctl = Control::new(redis, &[]);
    for i in 1..=n {
        let r = ctl.command_id("fe-a", rig, &format!("{prefix}{i}"), "n", json!({}));
        assert_eq!(
            (r["ok"].clone(), r["seq"].clone()),
            (json!(true), json!(i)),
            "{r}"
        );
    }
    for i in 1..=n {
        assert_eq!(read_json(&mut on_a)["seq"], i);
    }
    (a, b, boot, on_a, ctl)
}

/// The rig, still connected to A, says hello on B with the same boot and `last_seq`: B welcomes
/// it (the welcome is returned) and A closes the old connection with 4410.
fn move_to_b(b: &Broker, on_a: &mut Ws, rig: &str, boot: &str, last_seq: u64) -> (Ws, Value) {
    let (on_b, welcome) = connect_hello(b, rig, boot, Some(last_seq));
    assert_eq!(read_close(on_a), 4410);
    (on_b, welcome)
}

#[test]
fn a_session_resumes_on_another_broker_with_unacked_commands_in_order() {
    let redis = RedisServer::start();
    let (_a, b, boot, mut on_a, mut ctl) = rig_with_commands_on_a(&redis, "rig-r", "c", 5);
    ack(&mut on_a, 1);
    ack(&mut on_a, 2);
    // Let A forget the acked ones in Redis before the rig moves.
    eventually(Duration::from_secs(5), "acks forgotten", || {
        let n: usize = redis
            .connection()
            .hlen(format!("sess:rig-r:{boot}"))
            .unwrap();
        n == 6 // "next", "t" (the TTL it lives by), "from" + c:3, c:4, c:5
    });
    // The rig saw up to 3 and moves to B (same boot): B replays 4 and 5, then continues at 6.
    let (mut on_b, welcome) = move_to_b(&b, &mut on_a, "rig-r", &boot, 3);
    assert_eq!(welcome["resumed"], true);
    let replayed: Vec<Value> = (0..2).map(|_| read_json(&mut on_b)).collect();
    assert_eq!(replayed[0]["seq"], 4);
    assert_eq!(replayed[0]["id"], "c4");
    assert_eq!(replayed[1]["seq"], 5);
    send_and_read(&mut ctl, "fe-b", "rig-r", "c6", &mut on_b, 6);
}

/// Acked commands leave Redis in paced batches (up to a second later), so a resume can find
/// them still there: the rig's last_seq keeps them from being replayed.
#[test]
fn acked_commands_still_in_redis_are_not_replayed_past_last_seq() {
    let redis = RedisServer::start();
    let (_a, b, boot, mut on_a, mut ctl) = rig_with_commands_on_a(&redis, "rig-f", "f", 3);
    ack(&mut on_a, 2);
    // Moves at once, whether or not A has removed 1 and 2 from Redis yet.
    let (mut on_b, welcome) = move_to_b(&b, &mut on_a, "rig-f", &boot, 2);
    assert_eq!(welcome["resumed"], true);
    read_command(&mut on_b, 3, "f3");
    let r = ctl.command_id("fe-b", "rig-f", "f4", "n", json!({}));
    assert_eq!(r["seq"], 4, "{r}");
    assert_eq!(
        read_json(&mut on_b)["seq"],
        4,
        "nothing replayed between 3 and 4"
    );
}

/// A broker keeps the session of a rig that left it parked, for the rig's return. If the rig
/// resumed elsewhere meanwhile and acked there, that copy is stale: the command acked on the
/// other broker must not come back from it when the rig returns (it did, in every run).
#[test]
fn a_command_acked_elsewhere_is_not_replayed_from_the_copy_parked_when_the_rig_left() {
    let redis = RedisServer::start();
    let (a, b, boot, mut on_a, mut ctl) = rig_with_commands_on_a(&redis, "rig-p", "p", 1);
    // The rig leaves A with seq 1 unacked (A parks the session), resumes on B, gets 1 again
    // and acks it there, and leaves B too.
    on_a.close(None).unwrap();
    let mut on_b = resume_on(&b, "rig-p", &boot, Some(0));
    assert_eq!(read_json(&mut on_b)["id"], "p1");
    ack(&mut on_b, 1);
    let key = format!("sess:rig-p:{boot}");
    let mut con = redis.connection();
    eventually(
        Duration::from_secs(10),
        "the ack forgotten in Redis",
        || !con.hexists::<_, _, bool>(&key, "c:1").unwrap_or(true),
    );
    on_b.close(None).unwrap();
    eventually(Duration::from_secs(10), "the lease released", || {
        !con.exists::<_, bool>("rig:rig-p").unwrap_or(true)
    });
    // Back on A, again with last_seq 0: the next command is the first thing it gets.
    let mut again = resume_on(&a, "rig-p", &boot, Some(0));
    let r = ctl.command_id("fe-a", "rig-p", "p2", "n", json!({}));
    assert_eq!(r["seq"], 2, "{r}");
    let first = read_json(&mut again);
    assert_eq!(
        (first["seq"].clone(), first["id"].clone()),
        (json!(2), json!("p2")),
        "acked on B, replayed by A: {first}"
    );
}

/// A rig that reconnects with commands it received but never acked (its `last_seq` covers
/// them) is not sent them again, but they stay unacked until it acks them, on the new
/// connection too: acking a later one says nothing of them (CONTRACT.md §2: an ack names the
/// command the rig accepted). Acked, they leave Redis.
#[test]
fn commands_a_rig_had_at_its_resume_stay_until_it_acks_them() {
    let redis = RedisServer::start();
    let (_a, b, boot, mut on_a, mut ctl) = rig_with_commands_on_a(&redis, "rig-u", "u", 3);
    let (mut on_b, welcome) = move_to_b(&b, &mut on_a, "rig-u", &boot, 3);
    assert_eq!(welcome["resumed"], true);
    let r = ctl.command_id("fe-b", "rig-u", "u4", "n", json!({}));
    assert_eq!(r["seq"], 4, "{r}");
    assert_eq!(read_json(&mut on_b)["seq"], 4, "1-3 are not sent again");
    ack(&mut on_b, 4);
    let key = format!("sess:rig-u:{boot}");
    let mut con = redis.connection();
    // The commands and `next`; not `t`, which the naming for a lapse report writes in a second
    // after a connection's first command (or as the rig leaves).
    let fields = |con: &mut redis::Connection| {
        let mut f: Vec<String> = con.hkeys(&key).unwrap_or_default();
        f.retain(|f| f != "t");
        f.sort();
        f
    };
    eventually(Duration::from_secs(10), "4 gone", || {
        !fields(&mut con).contains(&"c:4".to_string())
    });
    assert_eq!(fields(&mut con), ["c:1", "c:2", "c:3", "from", "next"]);
    for seq in 1..=3 {
        ack(&mut on_b, seq);
    }
    eventually(Duration::from_secs(10), "every acked command gone", || {
        fields(&mut con) == ["from", "next"]
    });
}

/// A command the rig had at its resume and never acked is the old session's unacked command
/// when the rig reboots: reported `rig_rebooted`, though the rig acked a later one. Before, a
/// later ack had the broker forget it, and control never heard of it again.
#[test]
fn a_command_had_at_a_resume_and_never_acked_is_reported_when_the_rig_reboots() {
    let redis = RedisServer::start();
    let (_a, b, boot, mut on_a, _) = rig_with_commands_on_a(&redis, "rig-h", "h", 1);
    let (mut on_b, _) = move_to_b(&b, &mut on_a, "rig-h", &boot, 1);
    let mut ctl = Control::new(&redis, &["fleetlink:events"]);
    let r = ctl.command_id("fe-b", "rig-h", "h2", "n", json!({}));
    assert_eq!(r["seq"], 2, "{r}");
    assert_eq!(read_json(&mut on_b)["seq"], 2);
    ack(&mut on_b, 2);
    assert_eq!(ctl.next_event("ack")["id"], "h2");
    drop(on_b);
    let new_boot = boot_id();
    let _again = connect_hello(&b, "rig-h", &new_boot, None);
    assert_eq!(rebooted_before_connected(&mut ctl, &new_boot), ["h1"]);
}

/// Redis lost the session (restarted empty, say, or the key expired): the rig's `last_seq`
/// still keeps seqs from being reused, so its next command is `last_seq` + 1 and not a seq the
/// rig already has (which it would drop).
#[test]
fn a_session_lost_in_redis_continues_after_the_rigs_last_seq() {
    let redis = RedisServer::start();
    let (_a, b, boot, mut on_a, mut ctl) = rig_with_commands_on_a(&redis, "rig-l", "l", 3);
    for seq in 1..=3 {
        ack(&mut on_a, seq);
    }
    let _: () = redis
        .connection()
        .del(format!("sess:rig-l:{boot}"))
        .unwrap();
    let (mut on_b, _) = move_to_b(&b, &mut on_a, "rig-l", &boot, 3);
    send_and_read(&mut ctl, "fe-b", "rig-l", "l4", &mut on_b, 4);
}

/// Broker fe-a with `--session-ttl ttl`; `rig` welcomed, sent one command (seq 1) and read it.
fn rig_with_one_command(redis: &RedisServer, rig: &str, ttl: &str) -> (Broker, Ws, String) {
    let a = fleet_broker_with(redis, "fe-a", &["--session-ttl", ttl]);
    let (mut ws, boot, _) = a.rig(rig);
    let mut ctl = Control::new(redis, &[]);
    assert_eq!(ctl.command("fe-a", rig, "n", json!({}))["seq"], 1);
    assert_eq!(read_json(&mut ws)["seq"], 1);
    (a, ws, boot)
}

/// `--session-ttl` counts from a session's last activity, and a connected rig is activity: a
/// rig that stays connected without new commands keeps its unacked commands (and `next`) in
/// Redis past the TTL, so a resume after its broker dies still finds them.
#[test]
fn a_connected_rigs_session_outlives_the_session_ttl() {
    let redis = RedisServer::start();
    let (_a, _ws, boot) = rig_with_one_command(&redis, "rig-t", "3s");
    let key = format!("sess:rig-t:{boot}");
    let mut con = redis.connection();
    // Left alone the TTL only falls, and the key is gone 3 s after the command: it must rise
    // again before that.
    let mut lowest = i64::MAX;
    eventually(
        Duration::from_secs(10),
        "the session's TTL extended",
        || {
            let pttl: i64 = redis::cmd("PTTL").arg(&key).query(&mut con).unwrap();
            assert!(pttl > 0, "the session expired while its rig is connected");
            let extended = pttl > lowest;
            lowest = lowest.min(pttl);
            extended
        },
    );
    let unacked: Option<String> = con.hget(&key, "c:1").unwrap();
    assert!(unacked.is_some(), "the unacked command is still kept");
    let pointer: i64 = redis::cmd("PTTL")
        .arg("sessof:rig-t")
        .query(&mut con)
        .unwrap();
    assert!(pointer > 0, "the latest-boot pointer is kept too");
}

/// A session's TTL counts from its rig's disconnect: the broker sets it afresh then, rather
/// than leaving whatever the last periodic touch or command left.
#[test]
fn a_sessions_ttl_starts_again_when_its_rig_disconnects() {
    let redis = RedisServer::start();
    let (_a, ws, boot) = rig_with_one_command(&redis, "rig-d", "60s");
    let key = format!("sess:rig-d:{boot}");
    let mut con = redis.connection();
    let mut pttl = || -> i64 { con.pttl(&key).unwrap() };
    // The next periodic touch is 20 s away: the TTL only runs down until the disconnect.
    eventually(Duration::from_secs(10), "the TTL below 59 s", || {
        pttl() < 59_000
    });
    drop(ws);
    eventually(Duration::from_secs(5), "the TTL set afresh", || {
        pttl() > 59_000
    });
}

/// Redis went away and came back empty while a rig with unacked commands stayed connected to
/// A, and a command was delivered (not kept) during the outage: A restores the lease and puts
/// the whole session back, so when A then dies the rig still resumes on B with its unacked
/// commands and its numbering.
#[test]
fn a_session_redis_lost_is_kept_again_and_survives_its_broker() {
    let mut redis = RedisServer::start();
    let (mut a, b, boot, mut on_a, _) = rig_with_commands_on_a(&redis, "rig-e", "e", 2);
    redis.kill9();
    admin_command_reaches(&a, &mut on_a, "rig-e", "e3", 3);
    redis.restart();
    let key = format!("sess:rig-e:{boot}");
    let mut con = redis.connection();
    eventually(Duration::from_secs(20), "the session kept again", || {
        let (c1, c3, next): (Option<String>, Option<String>, Option<String>) = redis::pipe()
            .hget(&key, "c:1")
            .hget(&key, "c:3")
            .hget(&key, "next")
            .query(&mut con)
            .unwrap_or((None, None, None));
        c1.is_some() && c3.is_some() && next.as_deref() == Some("4")
    });
    let pttl: i64 = con.pttl(&key).unwrap();
    assert!(pttl > 0, "kept with a TTL ({pttl})");
    let pointer: Option<String> = con.get("sessof:rig-e").unwrap();
    assert_eq!(pointer.as_deref(), Some(boot.as_str()));

    kill_broker(&mut a);
    // Control's new Redis connection: the old one went with the restart. B lost its own too;
    // a hello before it is back would be served from its local registry alone.
    let mut ctl = Control::new(&redis, &[]);
    b.wait_readyz(200, Duration::from_secs(20), "B back on Redis");
    let mut on_b = resume_on(&b, "rig-e", &boot, Some(1));
    let replayed: Vec<Value> = (0..2).map(|_| read_json(&mut on_b)).collect();
    assert_eq!(
        (replayed[0]["id"].clone(), replayed[1]["id"].clone()),
        (json!("e2"), json!("e3"))
    );
    send_and_read(&mut ctl, "fe-b", "rig-e", "e4", &mut on_b, 4);
}

/// Redis loses a connected rig's lease and session without restarting (evicted, flushed): the
/// next command is not fenced, which would leave the rig a gap in its seqs. The broker puts the
/// lease back, keeps the command, and puts the rest of the session back.
#[test]
fn a_lease_redis_lost_under_a_connected_rig_is_put_back_before_its_next_command() {
    let redis = RedisServer::start();
    let (_a, _b, boot, mut on_a, mut ctl) = rig_with_commands_on_a(&redis, "rig-l", "l", 1);
    let mut con = redis.connection();
    flushall(&mut con);
    let r = ctl.command_id("fe-a", "rig-l", "l2", "n", json!({}));
    assert_eq!(
        (r["ok"].clone(), r["seq"].clone()),
        (json!(true), json!(2)),
        "{r}"
    );
    read_command(&mut on_a, 2, "l2");
    let lease: Option<String> = con.get("rig:rig-l").unwrap();
    assert_eq!(lease.as_deref(), Some(format!("{boot}|fe-a").as_str()));
    let key = format!("sess:rig-l:{boot}");
    eventually(
        Duration::from_secs(10),
        "the whole session kept again",
        || holds_commands_up_to(&mut con, &key, 2),
    );
}

/// While a connected rig's lease is gone from Redis, another broker holds a command for it
/// as for an offline rig (control found no lease). The rig's next command puts the lease back,
/// and the held command follows it to the rig then, not at the rig's next hello. Before, only
/// a refresh that put a lease back took what was held: one put back under a command left the
/// hold to wait out its deadline with the rig connected (review bb119: a hello decided while
/// Redis was full left no lease, and a command held then waited its whole minute).
#[test]
fn a_command_held_while_the_lease_was_gone_follows_the_command_that_puts_it_back() {
    let redis = RedisServer::start();
    // No refresh of its own within the test: only the command puts the lease back.
    let a = fleet_broker_with(&redis, "fe-a", &["--registry-refresh", "50s"]);
    let b = fleet_broker(&redis, "fe-b");
    let (mut on_a, welcome) = connect_hello(&a, "rig-hl", &boot_id(), None);
    assert_eq!(welcome["resumed"], false, "{welcome}");
    let mut con = redis.connection();
    let _: () = con.del("rig:rig-hl").unwrap();
    hold_via_admin(&b, "rig-hl", "q", 1);
    assert_eq!(con.llen::<_, usize>("offline:rig-hl").unwrap(), 1);
    admin_command_reaches(&a, &mut on_a, "rig-hl", "p1", 1);
    assert!(
        con.exists::<_, bool>("rig:rig-hl").unwrap(),
        "the lease is back"
    );
    read_command(&mut on_a, 2, "q0");
}

/// Redis loses one session key on its own (deleted by hand here; evicted, under a `volatile-*`
/// policy) while the lease stays and the rig stays connected with command 1 unacked. The rig's
/// next command creates the key again, and the broker puts its copy back with it: killed
/// then, its rig resumes on the survivor with both commands, not only the newer one.
#[test]
fn a_session_key_lost_alone_is_put_back_at_the_rigs_next_command() {
    let redis = RedisServer::start();
    let (mut a, b, boot, mut on_a, mut ctl) = rig_with_commands_on_a(&redis, "rig-k", "k", 1);
    let key = format!("sess:rig-k:{boot}");
    let mut con = redis.connection();
    let _: () = con.del(&key).unwrap();
    send_and_read(&mut ctl, "fe-a", "rig-k", "k2", &mut on_a, 2);
    eventually(
        Duration::from_secs(10),
        "the whole session kept again",
        || holds_commands_up_to(&mut con, &key, 2),
    );
    assert_eq!(
        a.metric(r#"fleetlink_registry_ops_total{op="session",result="key_lost"}"#),
        1
    );
    kill_broker(&mut a);
    drop(on_a);
    let mut on_b = resume_on(&b, "rig-k", &boot, Some(0));
    read_command(&mut on_b, 1, "k1");
    read_command(&mut on_b, 2, "k2");
}

/// The same key lost with no command after it: the periodic touch that keeps a connected
/// rig's session alive finds it gone, and the broker puts its copy back then.
#[test]
fn a_session_key_lost_alone_is_put_back_at_the_next_touch() {
    let redis = RedisServer::start();
    let (a, ws, boot) = rig_with_one_command(&redis, "rig-j", "3s");
    let key = format!("sess:rig-j:{boot}");
    let mut con = redis.connection();
    let _: () = con.del(&key).unwrap();
    eventually(Duration::from_secs(10), "the session kept again", || {
        let (c1, next): (Option<String>, Option<String>) = redis::pipe()
            .hget(&key, "c:1")
            .hget(&key, "next")
            .query(&mut con)
            .unwrap_or((None, None));
        c1.is_some() && next.as_deref() == Some("2")
    });
    let pttl: i64 = con.pttl(&key).unwrap();
    assert!(pttl > 0, "the key put back has a TTL: {pttl}");
    assert_eq!(
        a.metric(r#"fleetlink_registry_ops_total{op="session",result="key_lost"}"#),
        1
    );
    drop(ws);
}

/// A rig acks on its old connection just as it opens a new one to the same broker, then sends
/// its acks again after the welcome, as the reference agent does. Each command's ack counts
/// once. Before, the new connection's session, read from Redis before the old connection's
/// ack had removed the command there, took the command back from Redis, and the repeated ack
/// counted (and was published) a second time (review bb101). Two cores: the two connections'
/// messages then reach the bridge in either order.
#[test]
fn an_ack_on_the_old_connection_during_a_reconnect_counts_once() {
    const ROUNDS: u64 = 30;
    let redis = RedisServer::start();
    let a = fleet_broker_with(&redis, "fe-a", &["--cores", "2"]);
    let boot = boot_id();
    let (mut ws, _) = connect_hello(&a, "rig-o", &boot, None);
    let mut ctl = Control::new(&redis, &[]);
    for seq in 1..=ROUNDS {
        send_and_read(&mut ctl, "fe-a", "rig-o", &format!("o{seq}"), &mut ws, seq);
        // The new connection is upgraded first, so that its hello goes out right behind the
        // old connection's ack.
        let mut next = a.connect("/agent");
        ack(&mut ws, seq);
        send_hello(&mut next, "rig-o", &boot, Some(seq));
        let welcome = read_json(&mut next);
        assert_eq!(welcome["resumed"], true, "{welcome}");
        ack(&mut next, seq);
        ws = next;
    }
    // The last connection's last ack: counted once all before it are.
    send_and_read(&mut ctl, "fe-a", "rig-o", "fence", &mut ws, ROUNDS + 1);
    ack(&mut ws, ROUNDS + 1);
    let acked = r#"fleetlink_commands_total{result="acked"}"#;
    eventually(Duration::from_secs(10), "the fence's ack counted", || {
        a.metric(acked) > ROUNDS
    });
    assert_eq!(a.metric(acked), ROUNDS + 1);
}

/// Broker A hears nothing on its channels for a moment (its subscription held), and the rig
/// says hello on B meanwhile, which takes the lease and gives it c3 as seq 2. A then numbers
/// c2 as seq 2 too, and its keep is fenced (B holds the lease). The rig comes back to A while
/// its old connection there is still live (A never heard B's evict), so the new connection
/// takes the session from the old one, which lacks seq 2 though Redis holds B's c3 under it.
/// The rig gets c3. Before, a hand-over skipped every seq below the old connection's next
/// that it lacked, and c3, answered ok, was lost without a report (review bb104).
#[test]
fn a_hand_over_gives_the_command_another_broker_kept_under_a_seq_fenced_here() {
    let redis = RedisServer::start();
    let relay = Relay::start(redis.port());
    let a = fleet_broker_at(&relay.url(), "fe-a", &["--cores", "1"]);
    let b = fleet_broker(&redis, "fe-b");
    let boot = boot_id();
    let (mut conn1, _) = connect_hello(&a, "rig-h", &boot, None);
    assert_eq!(a.command_with_id("rig-h", "c1").0, 200);
    read_command(&mut conn1, 1, "c1");
    ack(&mut conn1, 1);
    relay.freeze_subscriptions(true);
    let _conn_b = resume_on(&b, "rig-h", &boot, Some(1));
    let (status, reply) = b.command_with_id("rig-h", "c3");
    assert_eq!(status, 200, "{reply}");
    assert!(reply.contains(r#""seq":2"#), "{reply}");
    let (status, reply) = a.command_with_id("rig-h", "c2");
    assert_eq!(status, 404, "fenced: {reply}");
    let mut conn2 = resume_on(&a, "rig-h", &boot, Some(1));
    read_command(&mut conn2, 2, "c3");
    relay.freeze_subscriptions(false);
    drop(conn1);
}

/// Redis loses a connected rig's session key twice within one put-back (as sustained
/// `volatile-lru` eviction can). The first loss is found at command 2's keep, whose answer has
/// the core copy its session; command 3 was numbered meanwhile and its keep still in flight,
/// so the copy leaves it to that keep. Command 3's keep goes into the key command 2 created,
/// and that key is lost again before the copy is written. Before, the copy went back without
/// command 3 and nothing noticed: the rig's resume elsewhere never gave it. Now `rekeep.lua`
/// says it wrote into a key that was gone, and the core copies the session again.
#[test]
fn a_command_kept_between_two_losses_of_its_session_key_goes_back_with_the_session() {
    let redis = RedisServer::start();
    let relay = Relay::start(redis.port());
    // One core: the admin POSTs are numbered on the rig's own core, not through the bridge
    // the held call below keeps waiting.
    let a = fleet_broker_at(&relay.url(), "fe-a", &["--cores", "1"]);
    let (mut ws, boot, _) = a.rig("rig-w");
    assert_eq!(a.command("rig-w", "n", json!({})).1["seq"], 1);
    assert_eq!(read_json(&mut ws)["seq"], 1);
    let key = format!("sess:rig-w:{boot}");
    let mut con = redis.connection();
    let _: () = con.del(&key).unwrap();

    let sha = |script: &str| redis::Script::new(script).get_hash().to_string();
    let persist_sha = sha(include_str!("../lua/persist.lua"));
    let rekeep_sha = sha(fleetlink::registry::sessions::REKEEP);
    // Command 2's keep is held before Redis sees it; the bridge waits for its answer.
    relay.hold_on(persist_sha.as_bytes());
    let post = |n: u64| {
        let admin = a.admin;
        std::thread::spawn(move || {
            let body = json!({"id": format!("w{n}"), "name": "n", "args": {}}).to_string();
            common::broker::http(admin, "POST", "/v1/rigs/rig-w/commands", &body)
        })
    };
    let second = post(2);
    eventually(Duration::from_secs(5), "command 2's keep held", || {
        relay.holds() == 1
    });
    let third = post(3);
    let enqueued = r#"fleetlink_commands_total{result="enqueued"}"#;
    eventually(Duration::from_secs(5), "command 3 numbered", || {
        a.metric(enqueued) == 3
    });
    // Command 2 creates the key again (`created`): the core copies its session, command 3
    // left out for its own keep, which goes first, into that key.
    relay.hold_on(rekeep_sha.as_bytes());
    relay.release();
    eventually(Duration::from_secs(5), "the copy's put-back held", || {
        relay.holds() == 2
    });
    let held: Option<String> = con.hget(&key, "c:3").unwrap();
    assert!(held.is_some(), "command 3 was kept before the second loss");
    let _: () = con.del(&key).unwrap();
    relay.release();
    eventually(
        Duration::from_secs(10),
        "the whole session kept again",
        || holds_commands_up_to(&mut con, &key, 3),
    );
    assert_eq!(
        a.metric(r#"fleetlink_registry_ops_total{op="rekeep",result="anew"}"#),
        1
    );
    for (n, post) in [(2, second), (3, third)] {
        let (status, body) = post.join().unwrap();
        assert_eq!(status, 200, "command {n}: {body}");
    }
    read_command(&mut ws, 2, "w2");
    read_command(&mut ws, 3, "w3");
}

/// The rig's latest-boot pointer `sessof:` lost alone (deleted here) while the rig stays
/// connected with command 1 unacked: the touch writes it again, so that the rig's next boot
/// still finds the session and reports the command `rig_rebooted` (without the pointer it
/// came out `expired` a TTL later).
#[test]
fn a_latest_boot_pointer_lost_alone_is_written_again_at_the_next_touch() {
    let redis = RedisServer::start();
    let (a, ws, boot) = rig_with_one_command(&redis, "rig-p", "3s");
    let mut con = redis.connection();
    let _: () = con.del("sessof:rig-p").unwrap();
    eventually(Duration::from_secs(10), "the pointer written again", || {
        let latest: Option<String> = con.get("sessof:rig-p").unwrap_or(None);
        latest.as_deref() == Some(boot.as_str())
    });
    let pttl: i64 = con.pttl("sessof:rig-p").unwrap();
    assert!(pttl > 0, "the pointer has a TTL: {pttl}");
    assert_eq!(
        a.metric(r#"fleetlink_registry_ops_total{op="session",result="pointer_restored"}"#),
        1
    );
    drop(ws);
    let mut ctl = Control::new(&redis, &["fleetlink:events"]);
    let new_boot = boot_id();
    let (_again, welcome) = connect_hello(&a, "rig-p", &new_boot, None);
    assert_eq!(welcome["resumed"], false);
    let ev = ctl.next_event("rig_rebooted");
    assert_eq!((&ev["seq"], &ev["boot_id"]), (&json!(1), &json!(boot)));
}

/// Redis is flushed while a rig with command 1 unacked is connected to A, and the rig leaves
/// before A's next refresh could find its lease gone. With no rig left, no refresh of A's
/// would notice the flush, and the parked copy lasts only `--registry-ttl` (3 s here, under
/// the heartbeat's 10 s). The release that finds the lease gone runs the heartbeat at once,
/// which finds A's sentinel gone too, and the parked copy goes back to Redis.
#[test]
fn a_release_that_finds_its_lease_gone_puts_parked_sessions_back_before_the_heartbeat() {
    let redis = RedisServer::start();
    let flags = ["--registry-ttl", "3s", "--registry-refresh", "1s"];
    let a = fleet_broker_with(&redis, "fe-a", &flags);
    let boot = boot_id();
    let (mut ws, _) = connect_hello(&a, "rig-f", &boot, None);
    let mut ctl = Control::new(&redis, &[]);
    send_and_read(&mut ctl, "fe-a", "rig-f", "f1", &mut ws, 1);
    let mut con = redis.connection();
    flushall(&mut con);
    drop(ws);
    let key = format!("sess:rig-f:{boot}");
    eventually(Duration::from_secs(6), "the parked copy put back", || {
        let c1: Option<String> = con.hget(&key, "c:1").unwrap_or(None);
        c1.is_some()
    });
}

/// A command delivered while Redis was unreachable is not kept then; once Redis is back (with
/// everything else it had), the reconnect puts every connected session back, so it is kept.
#[test]
fn a_command_delivered_while_redis_was_away_is_kept_when_it_returns() {
    let redis = RedisServer::start();
    let (a, _b, boot, mut on_a, _) = rig_with_commands_on_a(&redis, "rig-w", "w", 1);
    redis.freeze(true);
    a.wait_readyz(503, Duration::from_secs(15), "readyz 503");
    admin_command_reaches(&a, &mut on_a, "rig-w", "w2", 2);
    redis.freeze(false);
    let key = format!("sess:rig-w:{boot}");
    let mut con = redis.connection();
    eventually(Duration::from_secs(20), "the outage's command kept", || {
        let (c2, next): (Option<String>, Option<String>) = redis::pipe()
            .hget(&key, "c:2")
            .hget(&key, "next")
            .query(&mut con)
            .unwrap_or((None, None));
        c2.is_some() && next.as_deref() == Some("3")
    });
    let c1: Option<String> = con.hget(&key, "c:1").unwrap();
    assert!(c1.is_some(), "what Redis had is still there");
}

/// While Redis is away each broker decides alone, and both may give a rig moving between them
/// the same seq: B numbers a command held for the rig 4 at a hello the rig closes at once; A,
/// where the rig comes back, gives its own command seq 4, which the rig reads and acks; back on
/// B, the rig sends its acks again. B cannot tell which command the rig acked: it reports its
/// own `lost` (with the ack, of no id), not acked. Before, it was published acked, though the
/// rig never read it, and nothing ever reported it (review bb115).
#[test]
fn an_ack_of_a_seq_two_brokers_gave_alone_does_not_ack_the_command_the_rig_never_read() {
    let redis = RedisServer::start();
    let mut events = Control::new(&redis, &["fleetlink:events"]);
    let (a, b, boot, mut on_a, _) = rig_with_commands_on_a(&redis, "rig-sh", "p", 3);
    for seq in 1..=3 {
        ack(&mut on_a, seq);
    }
    a.wait_metric("fleetlink_commands_total{result=\"acked\"} 3");
    drop(on_a);
    wait_no_rigs(&a, "A sees the rig leave");
    redis.freeze(true);
    for broker in [&a, &b] {
        broker.wait_readyz(503, Duration::from_secs(15), "readyz 503");
    }
    hold_via_admin(&b, "rig-sh", "q", 1);
    let (on_b, welcome) = connect_hello(&b, "rig-sh", &boot, Some(3));
    assert_eq!(
        welcome["resumed"], false,
        "B has no session of it: {welcome}"
    );
    drop(on_b);
    wait_no_rigs(&b, "B sees the rig leave");
    let mut on_a = resume_on(&a, "rig-sh", &boot, Some(3));
    admin_command_reaches(&a, &mut on_a, "rig-sh", "p4", 4);
    ack(&mut on_a, 4);
    a.wait_metric("fleetlink_commands_total{result=\"acked\"} 4");
    drop(on_a);
    let mut on_b = resume_on(&b, "rig-sh", &boot, Some(4));
    ack(&mut on_b, 4);
    b.wait_metric("fleetlink_commands_total{result=\"lost_shared_seq\"} 1");
    redis.freeze(false);
    const EV: &str = "fleetlink:events";
    let lost = events.next(|ch, v| ch == EV && v["type"] == "lost" && v["id"] == "q0");
    assert_eq!(
        (&lost["seq"], &lost["broker_id"], &lost["boot_id"]),
        (&json!(4), &json!("fe-b"), &json!(boot)),
        "{lost}"
    );
    let on_b_ack = events.next(|ch, v| ch == EV && v["type"] == "ack" && v["broker_id"] == "fe-b");
    assert_eq!(
        (&on_b_ack["seq"], &on_b_ack["id"]),
        (&json!(4), &Value::Null)
    );
    let on_a_ack = events.next(|ch, v| ch == EV && v["type"] == "ack" && v["seq"] == 4);
    assert_eq!(on_a_ack["id"], "p4", "{on_a_ack}");
    assert_eq!(
        events.backlog_count(|_, v| v["type"] == "ack" && v["id"] == "q0"),
        0,
        "q0 was never read"
    );
}

/// The rig, its commands 1 to 3 acked on A, leaves; Redis is then full, and B holds command
/// `q0` for the rig. Returns A, B, the boot and a Redis connection.
fn q0_held_on_b_while_redis_is_full(
    redis: &RedisServer,
    rig: &str,
) -> (Broker, Broker, String, redis::Connection) {
    let (a, b, boot, mut on_a, _) = rig_with_commands_on_a(redis, rig, "p", 3);
    for seq in 1..=3 {
        ack(&mut on_a, seq);
    }
    a.wait_metric("fleetlink_commands_total{result=\"acked\"} 3");
    drop(on_a);
    wait_no_rigs(&a, "A sees the rig leave");
    let mut con = redis.connection();
    set_maxmemory(&mut con, "1");
    hold_via_admin(&b, rig, "q", 1);
    (a, b, boot, con)
}

/// The setting of the two tests below: the rig, its commands 1 to 3 acked on A, leaves. While
/// Redis is full B numbers a command held for it (`q0`) 4 at a hello the rig closes at once;
/// the rig resumes on A, which gives its own `p4` seq 4, and the rig acks it there and leaves.
/// Redis then takes writes again. Returns A, B, the boot and a Redis connection.
fn seq_4_given_by_both_while_redis_was_full(
    redis: &RedisServer,
    rig: &str,
) -> (Broker, Broker, String, redis::Connection) {
    let (a, b, boot, mut con) = q0_held_on_b_while_redis_is_full(redis, rig);
    let (on_b, welcome) = connect_hello(&b, rig, &boot, Some(3));
    assert_eq!(welcome["resumed"], false, "{welcome}");
    drop(on_b);
    wait_no_rigs(&b, "B sees the rig leave");
    let mut on_a = resume_on(&a, rig, &boot, Some(3));
    admin_command_reaches(&a, &mut on_a, rig, "p4", 4);
    ack(&mut on_a, 4);
    a.wait_metric("fleetlink_commands_total{result=\"acked\"} 4");
    drop(on_a);
    wait_no_rigs(&a, "A sees the rig leave again");
    set_maxmemory(&mut con, "0");
    (a, b, boot, con)
}

/// While Redis is full (`maxmemory`, `noeviction`) B numbers a command held for the rig 4 at a
/// hello the rig closes at once, and A, where the rig stays, gives its own command seq 4, which
/// the rig acks. Once Redis takes writes again, whichever comes first, B's copy put back or
/// A's removal of the acked seq, the held command is published `lost`: the rig holds the other
/// command under its seq. Before, B's copy put it back under that seq after A's removal, where
/// no one reported it while the rig stayed (review bb117).
#[test]
fn a_command_whose_seq_another_broker_gave_while_redis_was_full_is_reported_lost() {
    let redis = RedisServer::start();
    let mut events = Control::new(&redis, &["fleetlink:events"]);
    let (a, _b, boot, _con) = seq_4_given_by_both_while_redis_was_full(&redis, "rig-vf");
    let lost = events.next_within(Duration::from_secs(30), |ch, v| {
        ch == "fleetlink:events" && v["type"] == "lost" && v["id"] == "q0"
    });
    let mut on_a = resume_on(&a, "rig-vf", &boot, Some(4));
    assert_eq!(
        (&lost["seq"], &lost["boot_id"]),
        (&json!(4), &json!(boot)),
        "{lost}"
    );
    // The rig keeps what it has: the next command is 5.
    admin_command_reaches(&a, &mut on_a, "rig-vf", "p5", 5);
}

/// As above, but the rig comes back to B once Redis takes writes again, before B has seen so:
/// B learns it only at its next heartbeat (every 10 s), which is when it queues its parked
/// copies to go back. B's hello found A's session in Redis numbered past seq 4 and took its own
/// copy's command under that seq for one acked elsewhere: dropped, never reported (harness run
/// bb120, 4 commands). Such a command is now published `lost` from the resume, and where
/// Redis's session had not gone past its seq yet, once B puts the session back.
#[test]
fn a_command_given_unkept_is_reported_lost_when_its_rig_returns_before_the_heartbeat() {
    let redis = RedisServer::start();
    let mut events = Control::new(&redis, &["fleetlink:events"]);
    let (_a, b, boot, mut con) = seq_4_given_by_both_while_redis_was_full(&redis, "rig-vg");
    // A's retried removal marks seq 4 as p4's, within a second or so; B's heartbeat is then
    // most likely still ahead.
    wait_acked_mark(&mut con, "rig-vg", &boot, 4, "p4");
    let (mut on_b, welcome) = connect_hello(&b, "rig-vg", &boot, Some(4));
    assert_eq!(welcome["resumed"], true, "{welcome}");
    // Published at that hello when A's session in Redis has gone past seq 4 (A put it back
    // first), else when B puts the rig's session back, at its heartbeat.
    let lost = events.next_within(Duration::from_secs(15), |ch, v| {
        ch == "fleetlink:events" && v["type"] == "lost" && v["id"] == "q0"
    });
    assert_eq!(
        (&lost["seq"], &lost["boot_id"]),
        (&json!(4), &json!(boot)),
        "{lost}"
    );
    admin_command_reaches(&b, &mut on_b, "rig-vg", "p5", 5);
}

/// While Redis is full B numbers a command held for the rig 4 at a hello the rig closes at
/// once, and the rig, after a moment on A, says hello to B again, still while Redis is full,
/// and closes at once again. The copy B parks then still counts seq 4 as given unkept: it had
/// lost that as the second hello resumed it, and once Redis took writes, A kept and the rig
/// acked A's own command 4, and B's copy went back taking its command for one Redis had kept
/// and the rig acked: dropped, never reported (review bb122). Now it is published `lost`.
#[test]
fn a_second_hello_while_redis_is_full_keeps_the_copys_unkept_command_reported() {
    let redis = RedisServer::start();
    let mut events = Control::new(&redis, &["fleetlink:events"]);
    let (a, b, boot, mut con) = q0_held_on_b_while_redis_is_full(&redis, "rig-vr");
    for what in ["B sees the rig leave", "B sees the rig leave again"] {
        let (on_b, _) = connect_hello(&b, "rig-vr", &boot, Some(3));
        drop(on_b);
        wait_no_rigs(&b, what);
        if what.ends_with("leave") {
            drop(resume_on(&a, "rig-vr", &boot, Some(3)));
            wait_no_rigs(&a, "A sees the rig leave again");
        }
    }
    let mut on_a = resume_on(&a, "rig-vr", &boot, Some(3));
    set_maxmemory(&mut con, "0");
    // Kept in Redis as 4 (the keep puts A's lease back if its refresh has not), read, acked.
    admin_command_reaches(&a, &mut on_a, "rig-vr", "p4", 4);
    ack(&mut on_a, 4);
    let lost = events.next_within(Duration::from_secs(20), |ch, v| {
        ch == "fleetlink:events" && v["type"] == "lost" && v["id"] == "q0"
    });
    assert_eq!(lost["seq"], 4, "{lost}");
}

/// A rig's old boot leaves a command unacked on B, kept in Redis; its new boot's hello on A
/// reports it `rig_rebooted` (`resume.lua`). The new boot then says hello to B while Redis is
/// full, and B still holds the old session parked: its report waits for Redis rather than
/// going out at once, and finds the report made. Before, B published it a second time (review
/// bb122: one `rig_rebooted` from both brokers).
#[test]
fn a_reboot_report_is_not_repeated_by_a_hello_while_redis_is_full() {
    let redis = RedisServer::start();
    let mut events = Control::new(&redis, &["fleetlink:events"]);
    let (a, b) = brokers_a_and_b(&redis);
    let (old, new) = (boot_id(), boot_id());
    let (mut on_b, _) = connect_hello(&b, "rig-rr", &old, None);
    admin_command_reaches(&b, &mut on_b, "rig-rr", "c1", 1);
    drop(on_b);
    wait_no_rigs(&b, "B sees the rig leave");
    const EV: &str = "fleetlink:events";
    let rebooted = |ch: &str, v: &Value| ch == EV && v["type"] == "rig_rebooted";
    drop(connect_hello(&a, "rig-rr", &new, None).0);
    let first = events.next_within(Duration::from_secs(10), rebooted);
    assert_eq!(
        (&first["id"], &first["broker_id"]),
        (&json!("c1"), &json!("fe-a"))
    );
    wait_no_rigs(&a, "A sees the new boot leave");
    let mut con = redis.connection();
    set_maxmemory(&mut con, "1");
    drop(connect_hello(&b, "rig-rr", &new, None).0);
    wait_no_rigs(&b, "B sees the new boot leave");
    set_maxmemory(&mut con, "0");
    // B's report goes through Redis once it takes writes again (B's heartbeat), and Redis
    // says the session's commands were reported.
    let went = "fleetlink_registry_ops_total{op=\"rekeep_parked\",result=\"reported\"}";
    eventually(Duration::from_secs(20), "B's report through Redis", || {
        b.metric(went) >= 1
    });
    events.take_in();
    assert_eq!(events.backlog_count(rebooted), 0, "reported once");
}

/// While Redis is full it refuses the removal of an acked command given unkept (its mark is a
/// write that may grow memory), and the broker tries it again later. Meanwhile replies and
/// events go out as ever: they waited behind the refused removal for as long as Redis stayed
/// full (review bb119 saw a reply 1.3 s late).
#[test]
fn replies_go_out_while_redis_refuses_the_removal_of_an_acked_command() {
    let redis = RedisServer::start();
    let (a, _b, boot, mut on_a, mut ctl) = rig_with_commands_on_a(&redis, "rig-fr", "p", 1);
    ack(&mut on_a, 1);
    a.wait_metric("fleetlink_commands_total{result=\"acked\"} 1");
    let mut con = redis.connection();
    set_maxmemory(&mut con, "1");
    admin_command_reaches(&a, &mut on_a, "rig-fr", "p2", 2);
    ack(&mut on_a, 2);
    a.wait_metric("fleetlink_commands_total{result=\"acked\"} 2");
    // Through Redis, still full: answered, and delivered.
    send_and_read(&mut ctl, "fe-a", "rig-fr", "p3", &mut on_a, 3);
    set_maxmemory(&mut con, "0");
    wait_acked_mark(&mut con, "rig-fr", &boot, 2, "p2");
}

/// Waits (up to 10 s) until the removal of `rig`'s acked `seq` has gone through: Redis marks
/// the seq acked with the command's `id` (`sess:<rig>:<boot>:acked`).
fn wait_acked_mark(con: &mut redis::Connection, rig: &str, boot: &str, seq: u64, id: &str) {
    let marks = format!("sess:{rig}:{boot}:acked");
    eventually(Duration::from_secs(10), "the removal goes through", || {
        con.hget::<_, _, Option<String>>(&marks, seq)
            .ok()
            .flatten()
            .as_deref()
            == Some(id)
    });
}

/// Rig R on A has command 1 kept in Redis; Redis is then unreachable (`freeze`) or killed
/// (`!freeze`), command 2 is delivered through A's admin API (not kept), and R disconnects,
/// seen by A. Returns the brokers and R's boot; Redis is still down.
fn rig_left_during_an_outage(
    redis: &mut RedisServer,
    rig: &str,
    freeze: bool,
) -> (Broker, Broker, String) {
    let (a, b, boot, mut on_a, _) = rig_with_commands_on_a(redis, rig, "p", 1);
    if freeze {
        redis.freeze(true);
        a.wait_readyz(503, Duration::from_secs(15), "readyz 503");
    } else {
        redis.kill9();
    }
    admin_command_reaches(&a, &mut on_a, rig, "p2", 2);
    drop(on_a);
    wait_no_rigs(&a, "A sees the rig leave");
    (a, b, boot)
}

/// Reads commands 1 and 2 of `rig_left_during_an_outage` in order, then control's next
/// command through `broker` gets seq 3.
fn replayed_then_continued(ws: &mut Ws, redis: &RedisServer, broker: &str, rig: &str) {
    for i in 1..=2u64 {
        read_command(ws, i, format!("p{i}"));
    }
    let mut ctl = Control::new(redis, &[]);
    send_and_read(&mut ctl, broker, rig, "p3", ws, 3);
}

/// A rig that disconnected while Redis was away, which then came back empty, resumes on
/// another broker with every command its old broker held for it: A puts the session it keeps
/// parked back into Redis once it reconnects, since no one else holds the rig.
#[test]
fn a_rig_that_left_during_an_outage_resumes_elsewhere_with_what_its_broker_held() {
    let mut redis = RedisServer::start();
    let (_a, b, boot) = rig_left_during_an_outage(&mut redis, "rig-p", false);
    redis.restart();
    let key = format!("sess:rig-p:{boot}");
    let mut con = redis.connection();
    eventually(
        Duration::from_secs(10),
        "A puts the parked session back",
        || holds_commands_up_to(&mut con, &key, 2),
    );
    let lease: Option<String> = con.get("rig:rig-p").unwrap();
    assert_eq!(lease, None, "A claims no lease for a rig it does not hold");
    resumes_whole_on(&b, &redis, "rig-p", &boot);
}

/// Redis unreachable but keeping everything (the lease too): the session goes back before the
/// lease's release queued during the outage, which would otherwise leave the session Redis
/// kept from before looking like someone's newer truth, without command 2.
#[test]
fn a_parked_session_goes_back_before_its_lease_is_released() {
    let mut redis = RedisServer::start();
    let (_a, b, boot) = rig_left_during_an_outage(&mut redis, "rig-q", true);
    redis.freeze(false);
    let key = format!("sess:rig-q:{boot}");
    let mut con = redis.connection();
    eventually(
        Duration::from_secs(15),
        "the session whole, the lease gone",
        || {
            let (c2, next, lease): (Option<String>, Option<String>, Option<String>) = redis::pipe()
                .hget(&key, "c:2")
                .hget(&key, "next")
                .get("rig:rig-q")
                .query(&mut con)
                .unwrap_or((None, None, Some(String::new())));
            c2.is_some() && next.as_deref() == Some("3") && lease.is_none()
        },
    );
    resumes_whole_on(&b, &redis, "rig-q", &boot);
}

/// Once `b` is back on Redis, `rig` resuming there finds its whole session: resumed, commands
/// 1 and 2 replayed, the next one numbered 3. Returns the rig's connection, still open.
fn resumes_whole_on(b: &Broker, redis: &RedisServer, rig: &str, boot: &str) -> Ws {
    let back = format!("{} back on Redis", b.broker_id);
    b.wait_readyz(200, Duration::from_secs(10), &back);
    let mut ws = resume_on(b, rig, boot, Some(0));
    replayed_then_continued(&mut ws, redis, &b.broker_id, rig);
    ws
}

/// The same rig coming back to A itself resumes from A's parked state, and the session in
/// Redis agrees with it (so a later resume elsewhere would too).
#[test]
fn a_rig_that_left_during_an_outage_resumes_on_its_own_broker() {
    let mut redis = RedisServer::start();
    let (a, _b, boot) = rig_left_during_an_outage(&mut redis, "rig-s", false);
    redis.restart();
    let _on_a = resumes_whole_on(&a, &redis, "rig-s", &boot);
    let mut con = redis.connection();
    let key = format!("sess:rig-s:{boot}");
    let (c1, c2): (Option<String>, Option<String>) = redis::pipe()
        .hget(&key, "c:1")
        .hget(&key, "c:2")
        .query(&mut con)
        .unwrap();
    assert!(c1.is_some() && c2.is_some(), "the unacked commands kept");
}

#[test]
fn a_killed_brokers_unacked_commands_reach_the_rig_on_the_survivor() {
    let redis = RedisServer::start();
    let (mut a, b) = brokers_a_and_b(&redis);
    let boot = boot_id();
    let (on_a, _) = connect_hello(&a, "rig-k", &boot, None);
    let mut ctl = Control::new(&redis, &[]);
    for i in 1..=3 {
        assert_eq!(
            ctl.command_id("fe-a", "rig-k", &format!("k{i}"), "n", json!({}))["ok"],
            true
        );
    }
    kill_broker(&mut a);
    drop(on_a);
    let mut on_b = resume_on(&b, "rig-k", &boot, None);
    for i in 1..=3u64 {
        read_command(&mut on_b, i, format!("k{i}"));
    }
    assert_eq!(
        ctl.command_id("fe-b", "rig-k", "k4", "n", json!({}))["seq"],
        4
    );
}

/// Redis takes B's lease claim, then fails the session read of the same hello: the rig is
/// turned away (4503) instead of welcomed with no knowledge of its session, the claim is
/// released once Redis is back, and the next hello resumes with the unacked commands and
/// the seqs after them.
#[test]
fn a_hello_whose_session_read_fails_is_turned_away_and_resumes_on_the_next() {
    let redis = RedisServer::start();
    let a = fleet_broker(&redis, "fe-a");
    let relay = Relay::start(redis.port());
    let b = fleet_broker_at(&relay.url(), "fe-b", &[]);
    let boot = boot_id();
    let (mut on_a, _) = connect_hello(&a, "rig-u", &boot, None);
    let mut ctl = Control::new(&redis, &[]);
    for i in 1..=3u64 {
        send_and_read(&mut ctl, "fe-a", "rig-u", &format!("u{i}"), &mut on_a, i);
    }
    // The rig leaves A (A releases its lease) and has seen 1..3 but acked none.
    drop(on_a);
    let mut con = redis.connection();
    wait_lease_released(&mut con, "rig-u", "fe-a's lease released");

    let resume_sha = redis::Script::new(fleetlink::registry::sessions::RESUME)
        .get_hash()
        .to_string();
    relay.cut_on(resume_sha.as_bytes());
    let mut on_b = b.connect("/agent");
    send_hello(&mut on_b, "rig-u", &boot, Some(1));
    assert_eq!(read_close(&mut on_b), 4503);
    assert_eq!(relay.cuts(), 1, "the session read was the call cut");
    let hellos = |result: &str| {
        b.metric(&format!(
            "fleetlink_registry_ops_total{{op=\"hello\",result=\"{result}\"}}"
        ))
    };
    // Counted once, as turned away, not also as ok.
    assert_eq!((hellos("unavailable"), hellos("ok")), (1, 0));
    // Back on Redis, B lets go of the lease that hello claimed.
    b.wait_readyz(200, Duration::from_secs(10), "fe-b back on Redis");
    wait_lease_released(&mut con, "rig-u", "fe-b's claim released");

    let mut on_b = resume_on(&b, "rig-u", &boot, Some(1));
    assert_eq!((hellos("unavailable"), hellos("ok")), (1, 1));
    for i in 2..=3u64 {
        read_command(&mut on_b, i, format!("u{i}"));
    }
    send_and_read(&mut ctl, "fe-b", "rig-u", "u4", &mut on_b, 4);
}

#[test]
fn a_new_boot_reports_the_old_sessions_commands_as_rig_rebooted() {
    let redis = RedisServer::start();
    let a = fleet_broker(&redis, "fe-a");
    let old_boot = boot_id();
    let (ws, _) = connect_hello(&a, "rig-b", &old_boot, None);
    let mut ctl = Control::new(&redis, &["fleetlink:events"]);
    assert_eq!(
        ctl.command_id("fe-a", "rig-b", "lost-1", "n", json!({}))["ok"],
        true
    );
    assert_eq!(
        ctl.command_id("fe-a", "rig-b", "lost-2", "n", json!({}))["ok"],
        true
    );
    drop(ws);
    let new_boot = boot_id();
    let (mut again, welcome) = connect_hello(&a, "rig-b", &new_boot, None);
    assert_eq!(welcome["resumed"], false);
    let mut ids = Vec::new();
    while ids.len() < 2 {
        let ev = ctl.next_event("rig_rebooted");
        assert_eq!(ev["boot_id"], old_boot.as_str());
        assert_eq!(ev["new_boot_id"], new_boot.as_str());
        assert_eq!(
            (&ev["rig_id"], &ev["broker_id"]),
            (&json!("rig-b"), &json!("fe-a"))
        );
        assert!(matches!(ev["seq"].as_u64(), Some(1 | 2)), "{ev}");
        ids.push(ev["id"].as_str().unwrap().to_string());
    }
    ids.sort();
    assert_eq!(ids, ["lost-1", "lost-2"]);
    // The new session starts at seq 1 and nothing of the old one is replayed.
    assert_eq!(
        ctl.command_id("fe-a", "rig-b", "fresh", "n", json!({}))["seq"],
        1
    );
    assert_eq!(read_json(&mut again)["id"], "fresh");
}

/// A rig that acks a command and comes back with a new boot at once (within the second acked
/// removals may wait to leave Redis): only what it had not acked is reported `rig_rebooted`.
#[test]
fn a_command_acked_just_before_a_reboot_is_not_reported_rig_rebooted() {
    let redis = RedisServer::start();
    let a = fleet_broker(&redis, "fe-a");
    let (ws, mut ctl) = rig_acked_the_first_of_two(&a, &redis, "rig-ack");
    drop(ws);
    let new_boot = boot_id();
    let _again = connect_hello(&a, "rig-ack", &new_boot, None);
    assert_eq!(rebooted_before_connected(&mut ctl, &new_boot), ["unacked"]);
}

/// The same when the broker that took the ack is killed at once: the ack's removal left in
/// the round trip that published its `ack` event, ahead of it, so control never sees a command
/// acked and then `rig_rebooted` (it did when removals waited a second for their own batch).
#[test]
fn a_command_acked_just_before_its_broker_dies_is_not_reported_rig_rebooted() {
    let redis = RedisServer::start();
    let (mut a, b) = brokers_a_and_b(&redis);
    let (ws, mut ctl) = rig_acked_the_first_of_two(&a, &redis, "rig-ackd");
    kill_broker(&mut a);
    drop(ws);
    let new_boot = boot_id();
    let _on_b = connect_hello(&b, "rig-ackd", &new_boot, None);
    assert_eq!(rebooted_before_connected(&mut ctl, &new_boot), ["unacked"]);
}

/// The same for a rig that acks a burst of commands at once: once control has seen their
/// `ack` events, a resume after the broker died does not replay them, even with a `last_seq`
/// below them. Before, the removals of more than 8 acks waited for their own once-a-second
/// pace, and a broker killed meanwhile left them in the session to be replayed.
#[test]
fn commands_acked_in_a_burst_just_before_their_broker_dies_are_not_replayed() {
    let redis = RedisServer::start();
    let (mut a, b) = brokers_a_and_b(&redis);
    let boot = boot_id();
    let (mut ws, _) = connect_hello(&a, "rig-burst", &boot, None);
    let mut ctl = Control::new(&redis, &["fleetlink:events"]);
    for i in 1..=20 {
        send_and_read(&mut ctl, "fe-a", "rig-burst", &format!("b{i}"), &mut ws, i);
    }
    // The odd ones, back to back.
    for seq in (1..=20).step_by(2) {
        ack(&mut ws, seq);
    }
    for _ in 0..10 {
        ctl.next_event("ack");
    }
    kill_broker(&mut a);
    drop(ws);
    let mut on_b = resume_on(&b, "rig-burst", &boot, Some(12));
    // In seq order: the first replay says whether an acked 13 came back.
    for seq in [14, 16, 18, 20] {
        assert_eq!(read_json(&mut on_b)["seq"], seq);
    }
    // And nothing after them: the next command is the next seq, and comes next.
    let r = ctl.command_id("fe-b", "rig-burst", "after", "n", json!({}));
    assert_eq!(r["seq"], 21, "{r}");
    assert_eq!(read_json(&mut on_b)["id"], "after");
}

/// `rig` (a new boot) on fe-a `a` reads commands `acked` (seq 1) and `unacked` and acks the
/// first; returns once control (on `fleetlink:events`) has seen the ack's event.
fn rig_acked_the_first_of_two(a: &Broker, redis: &RedisServer, rig: &str) -> (Ws, Control) {
    let (mut ws, _) = connect_hello(a, rig, &boot_id(), None);
    let mut ctl = Control::new(redis, &["fleetlink:events"]);
    for id in ["acked", "unacked"] {
        assert_eq!(ctl.command_id("fe-a", rig, id, "n", json!({}))["ok"], true);
        assert_eq!(read_json(&mut ws)["id"], id);
    }
    ack(&mut ws, 1);
    // The broker has taken the ack: its event follows the removal on the bridge's way out.
    let ack = ctl.next_event("ack");
    assert_eq!(ack["id"], "acked");
    (ws, ctl)
}

/// The ids reported `rig_rebooted` before `new_boot`'s `connected`: the session script
/// publishes the reports before the new boot is welcomed.
fn rebooted_before_connected(ctl: &mut Control, new_boot: &str) -> Vec<String> {
    let mut reported = Vec::new();
    loop {
        let ev = ctl.next(|ch, v| {
            ch == "fleetlink:events"
                && (v["type"] == "rig_rebooted"
                    || (v["type"] == "connected" && v["boot_id"] == new_boot))
        });
        if ev["type"] == "connected" {
            return reported;
        }
        reported.push(ev["id"].as_str().unwrap_or_default().to_string());
    }
}

#[test]
fn persisting_is_fenced_by_the_lease() {
    let redis = RedisServer::start();
    let mut con = redis.connection();
    let scripts = SessionScripts::new();
    let rig = RigId::parse("rig-f").unwrap();
    let boot = BootId::parse(&boot_id()).unwrap();
    let json = br#"{"type":"command","seq":1,"id":"x"}"#;
    let cmd = [Persist {
        rig: &rig,
        boot: &boot,
        seq: Seq(1),
        json,
    }];
    // No lease: not kept, said apart. Another broker's lease: fenced. Ours: kept.
    assert_eq!(
        scripts
            .persist(&mut con, &cmd, "fe-a", Duration::from_secs(60))
            .unwrap(),
        [Kept::LeaseMissing]
    );
    let exists: bool = con.exists(format!("sess:rig-f:{boot}")).unwrap();
    assert!(!exists, "nothing written without a lease");
    let _: () = con.set("rig:rig-f", format!("{boot}|fe-b")).unwrap();
    assert_eq!(
        scripts
            .persist(&mut con, &cmd, "fe-a", Duration::from_secs(60))
            .unwrap(),
        [Kept::Fenced]
    );
    let _: () = con.set("rig:rig-f", format!("{boot}|fe-a")).unwrap();
    // No session before it: the keep says it created one (the broker then puts its copy back).
    assert_eq!(
        scripts
            .persist(&mut con, &cmd, "fe-a", Duration::from_secs(60))
            .unwrap(),
        [Kept::Anew]
    );
    let found = scripts
        .resume(&mut con, &rig, &boot, Duration::from_secs(60), "fe-a")
        .unwrap();
    assert_eq!(found.next, Some(Seq(2)));
    assert_eq!(found.commands, vec![(Seq(1), json.to_vec())]);
    assert_eq!(found.rebooted, 0);
    // The key has a TTL (set by the command that created it, then by the resume).
    let key = format!("sess:rig-f:{boot}");
    let ttl: i64 = con.pttl(&key).unwrap();
    assert!(ttl > 0 && ttl <= 60_000);
    // Later commands leave the TTL alone (the broker's touch extends it), and still keep.
    let _: () = con.pexpire(&key, 5_000).unwrap();
    let second = [Persist {
        seq: Seq(2),
        ..cmd[0]
    }];
    assert_eq!(
        scripts
            .persist(&mut con, &second, "fe-a", Duration::from_secs(60))
            .unwrap(),
        [Kept::Yes]
    );
    let ttl: i64 = con.pttl(&key).unwrap();
    assert!(ttl > 0 && ttl <= 5_000, "{ttl}");
    let next: String = con.hget(&key, "next").unwrap();
    assert_eq!(next, "3");
}

#[test]
fn commands_for_an_offline_rig_are_held_then_delivered_or_expired() {
    let redis = RedisServer::start();
    let (a, b) = brokers_a_and_b(&redis);
    let mut ctl = Control::new(&redis, &["fleetlink:events"]);
    let reply_to = ctl.reply_to.clone();
    let publish = |ctl: &mut Control, id: &str, ttl_ms: u64| {
        let msg = json!({"type":"command","id":id,"rig_id":"rig-off","name":"fw","args":{},
                         "reply_to":reply_to,"queue_if_offline":true,"ttl_ms":ttl_ms});
        ctl.publish("fleetlink:broker:fe-a", msg);
        ctl.next(|ch, v| ch == reply_to && v["id"] == id)
    };
    let held = publish(&mut ctl, "keep", 60_000);
    assert_eq!(
        (held["ok"].clone(), held["queued"].clone()),
        (json!(true), json!(true)),
        "{held}"
    );
    assert_eq!(publish(&mut ctl, "short", 200)["queued"], true);
    // The short one expires on time, reported by the broker that held it.
    let ev = ctl.next_event("expired");
    assert_eq!(ev["id"], "short");
    // The rig comes back on the other broker and gets what is still held, as seq 1.
    let (mut ws, _) = connect_hello(&b, "rig-off", &boot_id(), None);
    read_command(&mut ws, 1, "keep");
    let ev = ctl.next_event("offline_delivered");
    assert_eq!(
        (ev["id"].clone(), ev["seq"].clone()),
        (json!("keep"), json!(1))
    );
    // Held commands come before any new one: had the expired one been delivered too, it
    // would be next, not this marker.
    let marker = ctl.command_id("fe-b", "rig-off", "marker", "n", json!({}));
    assert_eq!(marker["seq"], 2, "{marker}");
    let next = read_json(&mut ws);
    assert_eq!(
        (next["id"].as_str(), next["seq"].as_u64()),
        (Some("marker"), Some(2)),
        "{next}"
    );
    drop(a);
}

/// Redis restarts empty while it holds a command for an offline rig: the broker that held it
/// reports it `lost` at its deadline, where before it took the missing entry for one a hello
/// had taken, and nothing was ever reported (carried since stop 56; seen by review bb117). A
/// command held after the restart still expires, and one a hello took is not reported.
#[test]
fn a_hold_redis_lost_in_an_empty_restart_is_reported_lost_at_its_deadline() {
    hold_lost_with_redis_keys(&[], |redis| redis.restart());
}

/// The same with a flush, which the broker's connection lives through: the deadline comes
/// before the heartbeat that would notice (every 10 s), so the broker's sentinel is asked.
#[test]
fn a_hold_redis_lost_in_a_flush_is_reported_lost_at_its_deadline() {
    hold_lost_with_redis_keys(&[], |redis| flushall(&mut redis.connection()));
}

/// The same without sessions kept (`--session-ttl 0`), where the core reports a delivery
/// itself, not through the bridge's answer to a keep: the one delivered here before the loss
/// is still not reported `lost`.
#[test]
fn a_hold_redis_lost_in_a_flush_is_reported_lost_at_its_deadline_without_sessions() {
    hold_lost_with_redis_keys(&["--session-ttl", "0"], |redis| {
        flushall(&mut redis.connection())
    });
}

/// A command held for an offline rig before `lose` empties Redis, then two held after it, one
/// of which a hello takes: reported `lost`, `expired`, and nothing, in that order. One held
/// before the loss and delivered here before it is not reported either: its `offline_delivered`
/// told its story (review bb138 saw it reported `lost` after its `ack` and `result`).
fn hold_lost_with_redis_keys(broker_args: &[&str], lose: impl FnOnce(&mut RedisServer)) {
    let mut redis = RedisServer::start();
    let a = fleet_broker_with(&redis, "fe-a", broker_args);
    let hold = |id: &str, rig: &str| {
        let body = json!({"id": id, "name": "n", "args": {}, "queue_if_offline": true,
                          "ttl_ms": 3_000});
        let path = format!("/v1/rigs/{rig}/commands");
        let (status, text) = a.http("POST", &path, &body.to_string());
        assert_eq!(status, 200, "{text}");
    };
    hold("before", "rig-rl");
    hold("delivered", "rig-rd");
    let mut con = redis.connection();
    assert_eq!(con.llen::<_, usize>("offline:rig-rl").unwrap(), 1);
    let (mut early, _) = connect_hello(&a, "rig-rd", &boot_id(), None);
    read_command(&mut early, 1, "delivered");
    ack(&mut early, 1);
    drop(early);
    lose(&mut redis);
    a.wait_readyz(200, Duration::from_secs(15), "A back on Redis");
    let mut events = Control::new(&redis, &["fleetlink:events"]);
    // Held after the loss, "taken" first: its deadline comes before "after"'s.
    hold("taken", "rig-rt");
    hold("after", "rig-rl");
    let (mut ws, _) = connect_hello(&a, "rig-rt", &boot_id(), None);
    read_command(&mut ws, 1, "taken");
    const EV: &str = "fleetlink:events";
    let lost = events.next_within(Duration::from_secs(10), |ch, v| {
        ch == EV && v["type"] == "lost" && v["id"] == "before"
    });
    assert_eq!(lost["rig_id"], "rig-rl", "{lost}");
    events.next_within(Duration::from_secs(10), |ch, v| {
        ch == EV && v["type"] == "expired" && v["id"] == "after"
    });
    let reported = |v: &Value| v["type"] == "lost" || v["type"] == "expired";
    assert_eq!(
        events.backlog_count(|ch, v| ch == EV && reported(v)),
        0,
        "one report each, none for the commands hellos took"
    );
    a.wait_metric("fleetlink_registry_ops_total{op=\"offline\",result=\"lost\"} 1");
}

/// The broker holding commands Redis lost with a flush drains before their deadlines: it
/// reports them `lost` as it exits. Before, it handed their deadlines to Redis, and the broker
/// that took them found them gone and took them for delivered, so nothing was reported (review
/// bb126). A command held after the flush is handed over as ever, and expires on the other.
#[test]
fn holds_redis_lost_are_reported_by_their_broker_as_it_drains() {
    let redis = RedisServer::start();
    let (mut a, b) = brokers_a_and_b(&redis);
    let hold = |id: &str, ttl_ms: u64| {
        let body = json!({"id": id, "name": "n", "args": {}, "queue_if_offline": true,
                          "ttl_ms": ttl_ms});
        let (status, text) = a.http("POST", "/v1/rigs/rig-dl/commands", &body.to_string());
        assert_eq!(status, 200, "{text}");
    };
    hold("before", 60_000);
    flushall(&mut redis.connection());
    let mut events = Control::new(&redis, &["fleetlink:events"]);
    hold("after", 3_000);
    a.signal(libc::SIGTERM);
    a.wait_exit(Duration::from_secs(15)).expect("A drained");
    const EV: &str = "fleetlink:events";
    let lost = events.next_within(Duration::from_secs(5), |ch, v| {
        ch == EV && v["type"] == "lost" && v["id"] == "before"
    });
    assert_eq!(lost["broker_id"], "fe-a", "{lost}");
    events.next_within(Duration::from_secs(10), |ch, v| {
        ch == EV && v["type"] == "expired" && v["id"] == "after"
    });
    assert_eq!(
        events.backlog_count(|ch, v| ch == EV && v["type"] == "lost"),
        0,
        "one report each"
    );
    b.wait_metric("fleetlink_registry_ops_total{op=\"offline\",result=\"expired_handed\"} 1");
}

/// PUBLISHes each of `msgs` to fe-a in one pipeline, as a fan-out arrives all at once.
fn publish_to_fe_a_at_once(redis: &RedisServer, msgs: impl Iterator<Item = Value>) {
    let mut pipe = redis::pipe();
    for msg in msgs {
        pipe.cmd("PUBLISH")
            .arg("fleetlink:broker:fe-a")
            .arg(msg.to_string())
            .ignore();
    }
    let () = pipe.query(&mut redis.connection()).unwrap();
}

#[test]
fn a_fan_out_to_offline_rigs_is_held_in_batches_and_each_rig_gets_its_own() {
    let redis = RedisServer::start();
    let a = fleet_broker(&redis, "fe-a");
    let mut ctl = Control::new(&redis, &[]);
    let reply_to = ctl.reply_to.clone();
    // 300 commands for 300 rigs that are all away, in one pipeline of PUBLISHes.
    publish_to_fe_a_at_once(
        &redis,
        (0..300).map(|i| {
            json!({"type":"command","id":format!("h{i}"),"rig_id":format!("away-{i:03}"),
                   "name":"fw","args":{"i":i},"reply_to":reply_to,
                   "queue_if_offline":true,"ttl_ms":60_000})
        }),
    );
    let replies = ctl.replies(300, Duration::from_secs(10));
    assert!(
        replies
            .iter()
            .all(|r| r["ok"] == true && r["queued"] == true),
        "{replies:?}"
    );
    // Each rig that comes back gets exactly its own command, as seq 1.
    for i in [0, 150, 299] {
        let (mut ws, _) = connect_hello(&a, &format!("away-{i:03}"), &boot_id(), None);
        let cmd = read_json(&mut ws);
        assert_eq!(
            (
                cmd["id"].clone(),
                cmd["seq"].clone(),
                cmd["args"]["i"].clone()
            ),
            (json!(format!("h{i}")), json!(1), json!(i))
        );
    }
    let count = |series: &str| a.metric(series);
    assert_eq!(
        count("fleetlink_registry_ops_total{op=\"offline\",result=\"held\"}"),
        300
    );
    let batches = count("fleetlink_registry_ops_total{op=\"offline_batch\",result=\"sent\"}");
    assert!(
        (1..=75).contains(&batches),
        "{batches} round trips held 300 commands"
    );
}

/// Bursts to a rig that reads but never acks: commands waiting for Redis do not count against
/// `--outbox`, but join the queue once kept, so the broker must stop taking them at what a
/// resume carries. Every command control was told was taken comes back when the rig resumes on
/// another broker (before, all 30 were taken and the resume gave back only the newest 18).
#[test]
fn a_burst_to_a_rig_that_never_acks_comes_back_whole_on_resume() {
    let redis = RedisServer::start();
    let a = fleet_broker_with(&redis, "fe-a", &["--outbox", "2"]);
    let b = fleet_broker_with(&redis, "fe-b", &["--outbox", "2"]);
    let boot = boot_id();
    let (mut on_a, _) = connect_hello(&a, "rig-burst", &boot, None);
    let mut ctl = Control::new(&redis, &[]);
    let reply_to = ctl.reply_to.clone();
    let mut burst = |ids: std::ops::Range<u64>| {
        let n = ids.clone().count();
        publish_to_fe_a_at_once(
            &redis,
            ids.map(|i| {
                json!({"type":"command","id":format!("b{i}"),"rig_id":"rig-burst",
                       "name":"n","args":{"i":i},"reply_to":reply_to})
            }),
        );
        ctl.replies(n, Duration::from_secs(10))
    };
    // The first 16 (8 x --outbox) are kept and written, and fill the unacked window.
    let first = burst(0..16);
    assert!(first.iter().all(|r| r["ok"] == true), "{first:?}");
    for seq in 1..=16u64 {
        assert_eq!(read_json(&mut on_a)["seq"], seq);
    }
    // The next burst all waits for Redis at once, with none queued ahead of it: only --outbox
    // of it fits behind the window.
    let second = burst(16..30);
    let mut taken: Vec<u64> = first
        .iter()
        .chain(&second)
        .filter(|r| r["ok"] == true)
        .filter_map(|r| r["seq"].as_u64())
        .collect();
    taken.sort_unstable();
    assert_eq!(taken, (1..=18).collect::<Vec<_>>(), "{second:?}");
    assert!(
        second
            .iter()
            .filter(|r| r["ok"] != true)
            .all(|r| r["error"] == "rig_unresponsive"),
        "{second:?}"
    );
    drop(on_a);
    wait_lease_released(&mut redis.connection(), "rig-burst", "fe-a let the rig go");
    let mut on_b = resume_on(&b, "rig-burst", &boot, Some(0));
    for seq in 1..=18u64 {
        let cmd = read_json(&mut on_b);
        assert_eq!(cmd["seq"], seq, "{cmd}");
        ack(&mut on_b, seq);
    }
    assert_eq!(
        b.metric("fleetlink_registry_ops_total{op=\"resume\",result=\"stale_dropped\"}"),
        0
    );
}

#[test]
fn a_fan_out_held_for_offline_rigs_expires_together_each_reported_once() {
    // Each rig's list holds only this one short-lived command: the broker must still find it
    // at its deadline to report it (Redis keeps the list a margin longer).
    let redis = RedisServer::start();
    let _a = fleet_broker(&redis, "fe-a");
    let mut ctl = Control::new(&redis, &["fleetlink:events"]);
    let reply_to = ctl.reply_to.clone();
    publish_to_fe_a_at_once(
        &redis,
        (0..200).map(|i| {
            json!({"type":"command","id":format!("x{i}"),"rig_id":format!("gone-{i:03}"),
                   "name":"fw","args":{},"reply_to":reply_to,
                   "queue_if_offline":true,"ttl_ms":300})
        }),
    );
    assert_eq!(ctl.replies(200, Duration::from_secs(10)).len(), 200);
    let mut expired = std::collections::BTreeSet::new();
    while expired.len() < 200 {
        let ev = ctl.next_event("expired");
        assert!(
            expired.insert(ev["id"].as_str().unwrap().to_string()),
            "twice: {ev}"
        );
    }
    // Nothing is left in Redis to deliver later: only the expiries' marks, for a minute.
    let mut con = redis.connection();
    let left: Vec<String> = redis::cmd("KEYS").arg("offline:*").query(&mut con).unwrap();
    let (marks, held): (Vec<String>, Vec<String>) = left
        .into_iter()
        .partition(|k| k.starts_with("offline:expired:"));
    assert!(held.is_empty(), "{held:?}");
    for mark in marks {
        let ttl: i64 = redis::cmd("PTTL").arg(&mark).query(&mut con).unwrap();
        assert!((1..=60_000).contains(&ttl), "{mark}: {ttl}");
    }
}

#[test]
fn standalone_holds_commands_for_offline_rigs_too() {
    let b = Broker::start(&[]);
    let body = json!({"name":"fw","args":{},"queue_if_offline":true,"ttl_ms":60000}).to_string();
    let (status, text) = b.http("POST", "/v1/rigs/rig-later/commands", &body);
    assert_eq!(status, 200, "{text}");
    assert!(text.contains("\"queued\":true"), "{text}");
    let (status, _) = b.http(
        "POST",
        "/v1/rigs/rig-never/commands",
        &json!({"name":"fw"}).to_string(),
    );
    assert_eq!(
        status, 404,
        "without queue_if_offline an offline rig is rig_not_connected"
    );
    let held = "fleetlink_registry_ops_total{op=\"offline\",result=\"held\"}";
    let delivered = "fleetlink_registry_ops_total{op=\"offline\",result=\"delivered\"}";
    assert_eq!((b.metric(held), b.metric(delivered)), (1, 0));
    let (mut ws, _, _) = b.rig("rig-later");
    let cmd = read_json(&mut ws);
    assert_eq!(
        (cmd["name"].clone(), cmd["seq"].clone()),
        (json!("fw"), json!(1))
    );
    eventually(Duration::from_secs(5), "the delivery counted", || {
        b.metric(delivered) == 1
    });
}

/// Two commands held for one offline rig under one id, with different deadlines: the first
/// one's deadline reports it `expired`, and the second still reaches the rig. The deadline
/// removed every held command with its id, so the second vanished with no event (the
/// command-accounting review, 2 of 2 runs).
#[test]
fn standalone_holds_two_commands_with_one_id_each_to_its_own_end() {
    let b = Broker::start(&[]);
    for (id, ttl_ms) in [("dup", 300), ("dup", 60_000), ("other", 60_000)] {
        let body = json!({"id": id, "name": "fw", "args": {"ttl": ttl_ms},
                          "queue_if_offline": true, "ttl_ms": ttl_ms});
        let (status, text) = b.http("POST", "/v1/rigs/rig-dup/commands", &body.to_string());
        assert_eq!(status, 200, "{text}");
    }
    let expired = "fleetlink_registry_ops_total{op=\"offline\",result=\"expired\"}";
    eventually(Duration::from_secs(5), "the short one expired", || {
        b.metric(expired) == 1
    });
    let (mut ws, _, _) = b.rig("rig-dup");
    let got: Vec<(Value, Value)> = (0..2)
        .map(|_| {
            let cmd = read_json(&mut ws);
            (cmd["id"].clone(), cmd["args"]["ttl"].clone())
        })
        .collect();
    assert_eq!(
        got,
        [
            (json!("dup"), json!(60_000)),
            (json!("other"), json!(60_000))
        ]
    );
    let (status, body) = b.http("GET", "/v1/events?limit=1000", "");
    assert_eq!(status, 200);
    let events: Value = serde_json::from_str(&body).unwrap();
    let expired_ids: Vec<&Value> = events["events"]
        .as_array()
        .into_iter()
        .flatten()
        .filter(|e| e["type"] == "expired")
        .map(|e| &e["id"])
        .collect();
    assert_eq!(expired_ids, [&json!("dup")], "{body}");
}

/// A rig comes back to more held commands than its outbox takes (`--outbox 2`: 2 queued, 16
/// written ahead of acks). The rest wait at the broker and go in as it acks: every one
/// arrives, in hold order, none refused. Standalone, and in fleet mode where each is kept in
/// Redis before it is written.
#[test]
fn held_commands_past_the_outbox_wait_for_room_and_all_arrive_in_order() {
    const HELD: usize = 40;
    let hold_then_drain = |b: &Broker, rig: &str| {
        hold_via_admin(b, rig, "h", HELD);
        let (mut ws, _, _) = b.rig(rig);
        for i in 0..HELD {
            let cmd = read_json(&mut ws);
            assert_eq!(
                (&cmd["id"], &cmd["seq"]),
                (&json!(format!("h{i}")), &json!(i + 1)),
                "{cmd}"
            );
            let ack = json!({"type": "ack", "seq": cmd["seq"]});
            ws.send(Message::Text(ack.to_string().into())).unwrap();
        }
        b.wait_metric(&format!(
            "fleetlink_commands_total{{result=\"acked\"}} {HELD}"
        ));
        assert_eq!(
            b.metric("fleetlink_commands_total{result=\"outbox_full\"}"),
            0
        );
        ws
    };
    let b = Broker::start(&["--outbox", "2"]);
    hold_then_drain(&b, "rig-backlog");
    // Events reach the log through the bridge, a moment after the core sent them.
    let delivered = || -> Vec<Value> {
        let (_, events) = b.http("GET", "/v1/events?limit=1000", "");
        let events: Value = serde_json::from_str(&events).unwrap();
        let all = events["events"].as_array().cloned().unwrap_or_default();
        all.into_iter()
            .filter(|e| e["type"] == "offline_delivered")
            .collect()
    };
    eventually(Duration::from_secs(10), "every offline_delivered", || {
        delivered().len() >= HELD
    });
    let delivered = delivered();
    assert_eq!(delivered.len(), HELD, "{delivered:?}");
    assert!(delivered.iter().all(|e| e["seq"].is_u64()), "{delivered:?}");

    let redis = RedisServer::start();
    let a = fleet_broker_with(&redis, "fe-a", &["--outbox", "2"]);
    let mut ctl = Control::new(&redis, &["fleetlink:events"]);
    hold_then_drain(&a, "rig-backlog-fleet");
    for _ in 0..HELD {
        let ev = ctl.next_event("offline_delivered");
        assert!(ev["seq"].is_u64(), "{ev}");
    }
}

/// Fleet mode: a rig comes back to more held commands than its outbox takes, and the broker
/// it came back to is killed before the rig made room for them. Those it could not number
/// went back to the hold in Redis, not into its memory: the rig, resuming on another broker,
/// gets every held command exactly once, in hold order.
#[test]
fn held_commands_a_killed_broker_could_not_number_yet_reach_the_rig_elsewhere() {
    const HELD: usize = 60;
    let redis = RedisServer::start();
    let a = fleet_broker_with(&redis, "fe-a", &["--outbox", "2"]);
    let mut b = fleet_broker_with(&redis, "fe-b", &["--outbox", "2"]);
    hold_via_admin(&a, "rig-k", "k", HELD);
    let boot = boot_id();
    let (mut on_b, _) = connect_hello(&b, "rig-k", &boot, None);
    // `--outbox 2`: 16 written ahead of acks and 1 queued (the hold leaves the other place of
    // the outbox to control). The hello took only what the outbox takes, and each take as
    // much again while it drained into the write window: the rest stayed in Redis.
    let mut got: Vec<(u64, String)> = Vec::new();
    for _ in 0..16 {
        let cmd = read_json(&mut on_b);
        got.push(seq_and_id(&cmd));
    }
    // The one queued is kept in the session ("next", "t" and 17 commands); the other 43 are in the
    // hold, none in memory. (Killed with a take on its way, before Redis kept what it took,
    // the broker would lose that take: the documented exception.)
    let mut con = redis.connection();
    let session = format!("sess:rig-k:{boot}");
    eventually(
        Duration::from_secs(10),
        "17 kept and 43 in the hold",
        || {
            let held: i64 = redis::cmd("LLEN")
                .arg("offline:rig-k")
                .query(&mut con)
                .unwrap();
            let kept: i64 = redis::cmd("HLEN").arg(&session).query(&mut con).unwrap();
            held == 43 && kept == 20 // "next", "t", "from" + 17
        },
    );
    kill_broker(&mut b);
    let last = got.last().map(|(seq, _)| *seq);
    let mut on_a = resume_on(&a, "rig-k", &boot, last);
    while got.len() < HELD {
        let cmd = read_json(&mut on_a);
        ack(&mut on_a, cmd["seq"].as_u64().unwrap());
        got.push(seq_and_id(&cmd));
    }
    let ids: Vec<String> = got.iter().map(|(_, id)| id.clone()).collect();
    let want: Vec<String> = (0..HELD).map(|i| format!("k{i}")).collect();
    assert_eq!(ids, want, "each once, in hold order");
    let seqs: Vec<u64> = got.iter().map(|(seq, _)| *seq).collect();
    assert!(seqs.windows(2).all(|w| w[0] < w[1]), "{seqs:?}");
    assert_eq!(
        a.metric("fleetlink_commands_total{result=\"outbox_full\"}"),
        0
    );
}

/// A rig working through a hold bigger than its outbox still takes control's new commands:
/// the hold leaves a quarter of the outbox, and of the session, to them. Before, the hold
/// filled both and a healthy rig was answered `rig_unresponsive`.
#[test]
fn control_commands_go_ahead_of_a_big_hold() {
    let b = Broker::start(&["--outbox", "8"]);
    hold_via_admin(&b, "rig-busy", "b", 200);
    let (_ws, _, _) = b.rig("rig-busy");
    // 64 written ahead of acks (8 x --outbox), 6 queued: the hold's share of both.
    let depth = || -> u64 {
        let rigs: Value = serde_json::from_str(&b.http("GET", "/v1/rigs", "").1).unwrap();
        rigs[0]["outbox_depth"].as_u64().unwrap_or(0)
    };
    eventually(
        Duration::from_secs(10),
        "the hold's share written and queued",
        || b.metric("fleetlink_commands_total{result=\"written\"}") == 64 && depth() == 6,
    );
    for i in 0..2 {
        let (status, reply) = b.command("rig-busy", "now", json!({"i": i}));
        assert_eq!(status, 200, "{reply}");
    }
    let (status, reply) = b.command("rig-busy", "now", json!({}));
    assert_eq!(
        (status, &reply["error"]),
        (503, &json!("rig_unresponsive")),
        "{reply}"
    );
}

/// The rig leaves while held commands still wait for room at the broker: those go back to the
/// hold, and its next connection (the same boot, resuming) gets every held command exactly
/// once, in hold order: first the session's own (numbered before it left), then the rest.
#[test]
fn held_commands_still_waiting_when_the_rig_leaves_are_held_again() {
    const HELD: usize = 30;
    let b = Broker::start(&["--outbox", "1"]);
    hold_via_admin(&b, "rig-leaves", "w", HELD);
    let boot = boot_id();
    let (mut first, _) = connect_hello(&b, "rig-leaves", &boot, None);
    // `--outbox 1`: 8 written ahead of acks and 1 queued; the rest wait. Take 3, ack none.
    let mut got: Vec<(u64, String)> = Vec::new();
    for _ in 0..3 {
        let cmd = read_json(&mut first);
        got.push(seq_and_id(&cmd));
    }
    drop(first);
    wait_no_rigs(&b, "the broker sees the rig leave");
    let last = got.last().map(|(seq, _)| *seq);
    let mut again = resume_on(&b, "rig-leaves", &boot, last);
    while got.len() < HELD {
        let cmd = read_json(&mut again);
        let ack = json!({"type": "ack", "seq": cmd["seq"]});
        again.send(Message::Text(ack.to_string().into())).unwrap();
        got.push(seq_and_id(&cmd));
    }
    let ids: Vec<String> = got.iter().map(|(_, id)| id.clone()).collect();
    let want: Vec<String> = (0..HELD).map(|i| format!("w{i}")).collect();
    assert_eq!(ids, want, "each once, in hold order");
    let seqs: Vec<u64> = got.iter().map(|(seq, _)| *seq).collect();
    assert!(seqs.windows(2).all(|w| w[0] < w[1]), "{seqs:?}");
    b.wait_metric(&format!(
        "fleetlink_commands_total{{result=\"acked\"}} {}",
        HELD - 3
    ));
}

#[test]
fn the_same_boot_resumes_on_another_broker_even_without_commands() {
    let redis = RedisServer::start();
    let (a, b) = brokers_a_and_b(&redis);
    let boot = boot_id();
    let (_on_a, welcome) = connect_hello(&a, "rig-quiet", &boot, None);
    assert_eq!(welcome["resumed"], false);
    let _on_b = resume_on(&b, "rig-quiet", &boot, Some(0));
    let mut ctl = Control::new(&redis, &[]);
    assert_eq!(
        ctl.command_id("fe-b", "rig-quiet", "q1", "n", json!({}))["seq"],
        1
    );
}

/// `--session-ttl 0`: nothing is kept in Redis, commands still flow in order with one `ok`
/// each, and a resume on another broker starts a fresh session.
#[test]
fn session_ttl_zero_keeps_no_session_in_redis() {
    let redis = RedisServer::start();
    let a = fleet_broker_with(&redis, "fe-a", &["--session-ttl", "0"]);
    let (mut ws, boot, _) = a.rig("rig-z");
    let mut ctl = Control::new(&redis, &[]);
    for i in 1..=3u64 {
        let r = ctl.command("fe-a", "rig-z", "n", json!({"i": i}));
        assert_eq!(r["ok"], true, "{r}");
        assert_eq!(r["seq"], i);
        assert_eq!(read_json(&mut ws)["seq"], i);
    }
    let mut con = redis.connection();
    let keys: Vec<String> = con.keys("sess*").unwrap();
    assert!(keys.is_empty(), "no session keys expected, found {keys:?}");
    assert_eq!(
        con.get::<_, Option<String>>("rig:rig-z").unwrap(),
        Some(format!("{boot}|fe-a"))
    );
}

/// For the session scripts' own tests: rig-a leased to fe-a and rig-b to fe-b, same boot.
fn rigs_leased_to_fe_a_and_fe_b() -> (
    RedisServer,
    redis::Connection,
    SessionScripts,
    RigId,
    RigId,
    BootId,
) {
    let redis = RedisServer::start();
    let mut con = redis.connection();
    let (a, b) = (
        RigId::parse("rig-a").unwrap(),
        RigId::parse("rig-b").unwrap(),
    );
    let boot = BootId::parse(&boot_id()).unwrap();
    let _: () = con.set("rig:rig-a", format!("{boot}|fe-a")).unwrap();
    let _: () = con.set("rig:rig-b", format!("{boot}|fe-b")).unwrap();
    (redis, con, SessionScripts::new(), a, b, boot)
}

/// `persist.lua` refuses a seq below the session's `next`: another broker numbered past it
/// while this one could not reach Redis, and the rig may hold that seq with another command.
/// Nothing is written, and the answer names `next`, for the broker to number from.
#[test]
fn persist_refuses_a_seq_another_broker_numbered_past() {
    // `_redis` (not `_`): the server lives as long as the test.
    let (_redis, mut con, scripts, a, _b, boot) = rigs_leased_to_fe_a_and_fe_b();
    let sess = format!("sess:rig-a:{boot}");
    let _: () = con
        .hset_multiple(&sess, &[("next", "5"), ("c:4", "theirs")])
        .unwrap();
    let cmd = |seq, json| Persist {
        rig: &a,
        boot: &boot,
        seq: Seq(seq),
        json,
    };
    let kept = scripts
        .persist(
            &mut con,
            &[cmd(4, b"ours"), cmd(5, b"five")],
            "fe-a",
            Duration::from_secs(60),
        )
        .unwrap();
    assert_eq!(kept, [Kept::Stale(Seq(5)), Kept::Yes]);
    let fields: HashMap<String, String> = con.hgetall(&sess).unwrap();
    assert_eq!(fields.get("c:4").map(String::as_str), Some("theirs"));
    assert_eq!(fields.get("c:5").map(String::as_str), Some("five"));
    assert_eq!(fields.get("next").map(String::as_str), Some("6"));
}

/// `persist.lua` on a batch: each command is checked against its own rig's lease, a kept one
/// sets its session's `next` and TTL, and a malformed seq anywhere fails the call before any
/// write.
#[test]
fn a_persist_batch_is_fenced_per_rig_and_checked_before_any_write() {
    // `_redis` (not `_`): the server lives as long as the test.
    let (_redis, mut con, scripts, a, b, boot) = rigs_leased_to_fe_a_and_fe_b();
    let cmd = |rig, seq| Persist {
        rig,
        boot: &boot,
        seq: Seq(seq),
        json: b"{}",
    };
    let kept = scripts
        .persist(
            &mut con,
            &[cmd(&a, 7), cmd(&b, 1), cmd(&a, 8)],
            "fe-a",
            Duration::from_secs(60),
        )
        .unwrap();
    // The first of rig-a's creates its session; the second finds it.
    assert_eq!(kept, [Kept::Anew, Kept::Fenced, Kept::Yes]);
    // The keep names no session for its lapse report: the bridge does, later.
    let named: bool = con.exists("sess:lapses").unwrap();
    assert!(!named);
    let sess_a = format!("sess:rig-a:{boot}");
    let next: String = con.hget(&sess_a, "next").unwrap();
    assert_eq!(next, "9");
    let fields: Vec<String> = con.hkeys(&sess_a).unwrap();
    // next, c:7, c:8, and from: Redis numbered this session from 7 (it held none before).
    assert_eq!(fields.len(), 4, "{fields:?}");
    let from: String = con.hget(&sess_a, "from").unwrap();
    assert_eq!(from, "7");
    let ttl: i64 = con.pttl(&sess_a).unwrap();
    assert!(ttl > 50_000 && ttl <= 60_000, "{ttl}");
    let exists: bool = con.exists(format!("sess:rig-b:{boot}")).unwrap();
    assert!(!exists, "a fenced command wrote its session");

    // A malformed seq (the script's own check, bypassing the typed wrapper) writes nothing.
    let err = redis::cmd("EVAL")
        .arg(fleetlink::registry::sessions::PERSIST)
        .arg(4)
        .arg("rig:rig-a")
        .arg(&sess_a)
        .arg("rig:rig-a")
        .arg(&sess_a)
        .arg(60_000)
        .arg(format!("{boot}|fe-a"))
        .arg(9)
        .arg("{}")
        .arg(format!("{boot}|fe-a"))
        .arg("x1")
        .arg("{}")
        .query::<redis::Value>(&mut con);
    assert!(err.is_err(), "{err:?}");
    let fields: Vec<String> = con.hkeys(&sess_a).unwrap();
    assert_eq!(
        fields.len(),
        4, // "next", "from", c:7, c:8
        "the valid first command was written: {fields:?}"
    );
}

/// The highest seq a session may use is kept, and its `next` written, exactly: both fit the
/// script's 15 digits and a Lua number.
#[test]
fn the_last_usable_seq_is_kept_exactly() {
    // `_redis` (not `_`): the server lives as long as the test.
    let (_redis, mut con, scripts, a, _b, boot) = rigs_leased_to_fe_a_and_fe_b();
    let last = Persist {
        rig: &a,
        boot: &boot,
        seq: Seq::LAST,
        json: b"{}",
    };
    let kept = scripts
        .persist(&mut con, &[last], "fe-a", Duration::from_secs(60))
        .unwrap();
    assert_eq!(kept, [Kept::Anew]);
    let sess_a = format!("sess:rig-a:{boot}");
    let next: String = con.hget(&sess_a, "next").unwrap();
    assert_eq!(next, (Seq::LAST.0 + 1).to_string());
    let exists: bool = con.hexists(&sess_a, format!("c:{}", Seq::LAST.0)).unwrap();
    assert!(exists);
}

/// `rekeep.lua`: fenced by the lease like `persist.lua`; it raises `next` but never lowers it
/// (commands kept since Redis came back may be above the ones put back), and says when it
/// found it above the broker's (`ok|<next>`); a malformed seq fails the call before any write.
#[test]
fn rekeep_is_fenced_and_never_lowers_next() {
    // `_redis` (not `_`): the server lives as long as the test.
    let (_redis, mut con, scripts, a, b, boot) = rigs_leased_to_fe_a_and_fe_b();
    let sess_a = format!("sess:rig-a:{boot}");
    // A command kept after the restart already moved "next" to 9.
    let _: () = con
        .hset_multiple(&sess_a, &[("next", "9"), ("c:8", "{}")])
        .unwrap();
    let session = |rig, next| Rekeep {
        rig,
        boot: &boot,
        next: Seq(next),
        cmds: vec![(Seq(5), b"{\"seq\":5}".as_slice())],
        unkept: Unkept::up_to(Seq(0)),
        mode: RekeepMode::Live,
    };
    let kept = scripts
        .rekeep(
            &mut con,
            &[session(&a, 6), session(&b, 6)],
            "fe-a",
            Duration::from_secs(60),
            AT,
        )
        .unwrap();
    // Written, and the answer says Redis numbers further (9) than the broker (6) did.
    assert_eq!(kept, [Rekept::Behind(Seq(9)), Rekept::Fenced]);
    let next: String = con.hget(&sess_a, "next").unwrap();
    assert_eq!(next, "9", "not lowered");
    let c5: Option<String> = con.hget(&sess_a, "c:5").unwrap();
    assert_eq!(c5.as_deref(), Some("{\"seq\":5}"));
    let ttl: i64 = con.pttl(&sess_a).unwrap();
    assert!(ttl > 50_000 && ttl <= 60_000, "{ttl}");
    let pointer: Option<String> = con.get("sessof:rig-a").unwrap();
    assert_eq!(pointer.as_deref(), Some(boot.as_str()));
    let exists: bool = con.exists(format!("sess:rig-b:{boot}")).unwrap();
    assert!(!exists, "a fenced session was written");

    let kept = scripts
        .rekeep(
            &mut con,
            &[session(&a, 12)],
            "fe-a",
            Duration::from_secs(60),
            AT,
        )
        .unwrap();
    assert_eq!(kept, [Rekept::Kept]);
    let next: String = con.hget(&sess_a, "next").unwrap();
    assert_eq!(next, "12", "raised");

    let err = redis::cmd("EVAL")
        .arg(include_str!("../lua/rekeep.lua"))
        .arg(3)
        .arg("rig:rig-a")
        .arg(&sess_a)
        .arg("sessof:rig-a")
        .arg(60_000)
        .arg(format!("{boot}|fe-a"))
        .arg(13)
        .arg("live")
        .arg(AT)
        .arg(0)
        .arg(0)
        .arg("x1")
        .arg("{}")
        .query::<redis::Value>(&mut con)
        .unwrap_err();
    assert!(err.to_string().contains("seq must be"), "{err}");
    let c_x: Option<String> = con.hget(&sess_a, "c:x1").unwrap();
    assert!(c_x.is_none());
    let next: String = con.hget(&sess_a, "next").unwrap();
    assert_eq!(next, "12", "nothing written by a malformed call");
}

/// `rekeep.lua` for a session parked on a broker for a disconnected rig: its lease was
/// released or lost, so it is written only where no one else holds the rig: the lease absent
/// and the session not in Redis, or the lease still ours (merged, as for a connected rig).
/// A session Redis already holds under no lease is another broker's copy, newer or older: it
/// is merged, what it lacks added and `next` raised, never over what it holds (fenced, the
/// commands only this copy knows were lost). So is one of a rig leased to another broker
/// with the same boot, which went on with the session there. A mode other than live or
/// parked writes nothing.
#[test]
fn rekeep_of_a_parked_session_is_written_only_where_no_one_else_holds_the_rig() {
    // `_redis` (not `_`): the server lives as long as the test.
    let (_redis, mut con, scripts, a, b, boot) = rigs_leased_to_fe_a_and_fe_b();
    let (c, d) = (
        RigId::parse("rig-c").unwrap(),
        RigId::parse("rig-d").unwrap(),
    );
    // rig-c: no lease, no session (Redis restarted empty). rig-d: no lease, a session a
    // resume elsewhere wrote. rig-a: our lease, a session with c:8 kept since. rig-b: fe-b's.
    let sess = |rig: &RigId| format!("sess:{rig}:{boot}");
    let _: () = con.hset(sess(&d), "next", "1").unwrap();
    let _: () = con
        .hset_multiple(sess(&a), &[("next", "9"), ("c:8", "{}")])
        .unwrap();
    // rig-b: fe-b holds the same boot and numbered seq 1 itself (each decided alone).
    let _: () = con
        .hset_multiple(sess(&b), &[("next", "2"), ("c:1", "theirs")])
        .unwrap();
    let parked = |rig| Rekeep {
        rig,
        boot: &boot,
        next: Seq(3),
        cmds: vec![(Seq(1), b"c1".as_slice()), (Seq(2), b"c2".as_slice())],
        // Delivered while Redis was away: only this copy holds them.
        unkept: Unkept::up_to(Seq(2)),
        mode: RekeepMode::Parked,
    };
    let kept = scripts
        .rekeep(
            &mut con,
            &[parked(&c), parked(&d), parked(&a), parked(&b)],
            "fe-a",
            Duration::from_secs(60),
            AT,
        )
        .unwrap();
    use Rekept::{Behind, Kept, Merged};
    assert_eq!(kept, [Kept, Merged, Behind(Seq(9)), Merged]);

    let written: HashMap<String, String> = con.hgetall(sess(&c)).unwrap();
    // "from": Redis numbered none of it itself.
    let want = hash_of(&[("next", "3"), ("from", "3"), ("c:1", "c1"), ("c:2", "c2")]);
    assert_eq!(written, want);
    let ttl: i64 = con.pttl(sess(&c)).unwrap();
    assert!(ttl > 50_000 && ttl <= 60_000, "{ttl}");
    let pointer: Option<String> = con.get("sessof:rig-c").unwrap();
    assert_eq!(pointer.as_deref(), Some(boot.as_str()));
    let lease: Option<String> = con.get("rig:rig-c").unwrap();
    assert_eq!(lease, None, "a parked session claims no lease");

    let merged: HashMap<String, String> = con.hgetall(sess(&d)).unwrap();
    // "from": Redis numbered none of it itself.
    let want = hash_of(&[("next", "3"), ("from", "3"), ("c:1", "c1"), ("c:2", "c2")]);
    assert_eq!(merged, want, "what the other copy lacked added");

    let merged: HashMap<String, String> = con.hgetall(sess(&a)).unwrap();
    assert_eq!(
        merged.get("next").map(String::as_str),
        Some("9"),
        "not lowered"
    );
    assert_eq!(merged.get("c:1").map(String::as_str), Some("c1"));
    assert!(merged.contains_key("c:8"));

    // The same session went on at fe-b: ours added where it had none, `next` raised past them.
    let merged: HashMap<String, String> = con.hgetall(sess(&b)).unwrap();
    let want = hash_of(&[
        ("next", "3"),
        ("from", "3"),
        ("c:1", "theirs"),
        ("c:2", "c2"),
    ]);
    assert_eq!(merged, want);

    // A connected rig's session is not written without its lease, even where none exists.
    let live = Rekeep {
        mode: RekeepMode::Live,
        ..parked(&c)
    };
    let _: () = con.del(sess(&c)).unwrap();
    let kept = scripts
        .rekeep(&mut con, &[live], "fe-a", Duration::from_secs(60), AT)
        .unwrap();
    assert_eq!(kept, [Rekept::Fenced]);

    let err = redis::cmd("EVAL")
        .arg(include_str!("../lua/rekeep.lua"))
        .arg(3)
        .arg("rig:rig-c")
        .arg(sess(&c))
        .arg("sessof:rig-c")
        .arg(60_000)
        .arg(format!("{boot}|fe-a"))
        .arg(3)
        .arg("stale")
        .arg(AT)
        .arg(0)
        .arg(0)
        .query::<redis::Value>(&mut con)
        .unwrap_err();
    assert!(err.to_string().contains("mode must be"), "{err}");
    let exists: bool = con.exists(sess(&c)).unwrap();
    assert!(!exists, "nothing written by a malformed call");
}

/// The `at` of the `rig_rebooted` events `rekeep.lua` may publish.
const AT: &str = "2026-12-03T12:00:00Z";

/// For the session scripts' tests that read the events they publish: a fresh Redis, a
/// connection, the scripts, control subscribed to `fleetlink:events`, and `rig`.
fn scripts_and_events(
    rig: &str,
) -> (
    RedisServer,
    redis::Connection,
    SessionScripts,
    Control,
    RigId,
) {
    let redis = RedisServer::start();
    let con = redis.connection();
    let scripts = SessionScripts::new();
    let ctl = Control::new(&redis, &["fleetlink:events"]);
    (redis, con, scripts, ctl, RigId::parse(rig).unwrap())
}

/// A command as the session scripts keep it: seq `seq`, id `c<seq>`.
fn kept_command(seq: u64) -> String {
    format!("{{\"seq\":{seq},\"id\":\"c{seq}\"}}")
}

/// `N` fresh boots, oldest first.
fn boots<const N: usize>() -> [BootId; N] {
    let mut b = [(); N].map(|_| BootId::parse(&boot_id()).unwrap());
    b.sort();
    b
}

/// Empties Redis while it stays up (as an eviction or an empty restart leaves it).
fn flushall(con: &mut redis::Connection) {
    let _: () = redis::cmd("FLUSHALL").query(con).unwrap();
}

/// A Redis hash's fields as `hgetall` reads them.
fn hash_of(fields: &[(&str, &str)]) -> HashMap<String, String> {
    fields
        .iter()
        .map(|(k, v)| (k.to_string(), v.to_string()))
        .collect()
}

/// Every `rig_rebooted` event published before a marker published now, in order: the marker
/// follows everything the scripts that ran before it published.
fn rebooted_so_far(ctl: &mut Control) -> Vec<Value> {
    ctl.publish("fleetlink:events", json!({"type": "marker"}));
    let mut out = Vec::new();
    loop {
        let ev = ctl.next(|ch, v| {
            ch == "fleetlink:events" && (v["type"] == "rig_rebooted" || v["type"] == "marker")
        });
        if ev["type"] == "marker" {
            return out;
        }
        out.push(ev);
    }
}

/// A rig rebooted onto another broker while Redis was away, and its old broker still parks
/// the old session with a command Redis never kept (seq 4, delivered during the outage). The
/// old session ends there (CONTRACT.md §5): each unacked command is reported `rig_rebooted`
/// exactly once, whichever comes first when Redis is back, the newer boot's report
/// (`resume.lua`, which leaves a tombstone naming the boot that ended the session) or the old
/// broker putting its session back (`rekeep.lua`, parked). If Redis lost the session
/// altogether, the old broker reports all it holds.
#[test]
fn a_parked_session_a_newer_boot_ended_is_reported_once_whichever_runs_first() {
    let (_redis, mut con, scripts, mut ctl, rig) = scripts_and_events("rig-r");
    let ttl = Duration::from_secs(60);
    let (c1, c3, c4) = (kept_command(1), kept_command(3), kept_command(4));
    fn parked<'a>(rig: &'a RigId, boot: &'a BootId, cmds: [&'a str; 3]) -> Rekeep<'a> {
        Rekeep {
            rig,
            boot,
            next: Seq(5),
            cmds: [1, 3, 4]
                .into_iter()
                .map(Seq)
                .zip(cmds.map(str::as_bytes))
                .collect(),
            // Delivered while Redis was away: only this copy holds them.
            unkept: Unkept::up_to(Seq(4)),
            mode: RekeepMode::Parked,
        }
    }
    let cmds = [c1.as_str(), c3.as_str(), c4.as_str()];
    let reported = |ctl: &mut Control, n: usize, old: &BootId, new: &BootId| {
        let mut seqs = Vec::new();
        for ev in rebooted_so_far(ctl) {
            assert_eq!(
                (&ev["boot_id"], &ev["new_boot_id"], &ev["rig_id"]),
                (
                    &json!(old.to_string()),
                    &json!(new.to_string()),
                    &json!("rig-r")
                ),
                "{ev}"
            );
            assert_eq!(ev["id"], format!("c{}", ev["seq"]), "{ev}");
            seqs.push(ev["seq"].as_u64().unwrap());
        }
        assert_eq!(seqs.len(), n, "{seqs:?}");
        seqs
    };
    // Redis kept 1 and 3 (2 was acked), numbered the next 4; the newer boot holds the lease.
    let setup = |con: &mut redis::Connection, old: &BootId, new: &BootId| {
        let _: () = con
            .hset_multiple(
                format!("sess:rig-r:{old}"),
                &[("next", "4"), ("c:1", c1.as_str()), ("c:3", c3.as_str())],
            )
            .unwrap();
        let _: () = con.set("sessof:rig-r", old.to_string()).unwrap();
        let _: () = con.set("rig:rig-r", format!("{new}|fe-b")).unwrap();
    };

    // The newer boot's report first: 1 and 3 from Redis, then 4 from the old broker.
    let [old, new] = boots();
    setup(&mut con, &old, &new);
    let found = scripts.resume(&mut con, &rig, &new, ttl, "fe-b").unwrap();
    assert_eq!(found.rebooted, 2);
    let tomb: HashMap<String, String> = con.hgetall(format!("sess:rig-r:{old}")).unwrap();
    assert_eq!(tomb.get("gone"), Some(&new.to_string()), "{tomb:?}");
    assert_eq!(tomb.get("next").map(String::as_str), Some("4"), "{tomb:?}");
    assert_eq!(tomb.get("rep").map(String::as_str), Some("1,3"), "{tomb:?}");
    assert_eq!(tomb.len(), 3, "{tomb:?}");
    let kept = scripts
        .rekeep(&mut con, &[parked(&rig, &old, cmds)], "fe-a", ttl, AT)
        .unwrap();
    assert_eq!(kept, [Rekept::Reported(1)]);
    assert_eq!(reported(&mut ctl, 3, &old, &new), [1, 3, 4]);
    let kept = scripts
        .rekeep(&mut con, &[parked(&rig, &old, cmds)], "fe-a", ttl, AT)
        .unwrap();
    assert_eq!(kept, [Rekept::Reported(0)], "nothing twice");
    assert_eq!(reported(&mut ctl, 0, &old, &new), Vec::<u64>::new());

    // The old broker first: its session is merged for the newer boot's report to take.
    flushall(&mut con);
    let [old, new] = boots();
    setup(&mut con, &old, &new);
    let kept = scripts
        .rekeep(&mut con, &[parked(&rig, &old, cmds)], "fe-a", ttl, AT)
        .unwrap();
    assert_eq!(kept, [Rekept::Kept]);
    let found = scripts.resume(&mut con, &rig, &new, ttl, "fe-b").unwrap();
    assert_eq!(found.rebooted, 3);
    assert_eq!(reported(&mut ctl, 3, &old, &new), [1, 3, 4]);
    let kept = scripts
        .rekeep(&mut con, &[parked(&rig, &old, cmds)], "fe-a", ttl, AT)
        .unwrap();
    assert_eq!(kept, [Rekept::Reported(0)], "nothing twice");

    // Redis lost everything; the newer boot's lease (or only its session pointer) is back.
    for newer_on_record in ["rig:rig-r", "sessof:rig-r"] {
        flushall(&mut con);
        let [old, new] = boots();
        let value = match newer_on_record {
            "rig:rig-r" => format!("{new}|fe-b"),
            _ => new.to_string(),
        };
        let _: () = con.set(newer_on_record, value).unwrap();
        let kept = scripts
            .rekeep(&mut con, &[parked(&rig, &old, cmds)], "fe-a", ttl, AT)
            .unwrap();
        assert_eq!(kept, [Rekept::Reported(3)], "{newer_on_record}");
        assert_eq!(reported(&mut ctl, 3, &old, &new), [1, 3, 4]);
        let kept = scripts
            .rekeep(&mut con, &[parked(&rig, &old, cmds)], "fe-a", ttl, AT)
            .unwrap();
        assert_eq!(kept, [Rekept::Reported(0)], "nothing twice");
    }

    // An older boot on record ends nothing: the parked session is written as before.
    flushall(&mut con);
    let [older, old] = boots();
    let _: () = con.set("sessof:rig-r", older.to_string()).unwrap();
    let kept = scripts
        .rekeep(&mut con, &[parked(&rig, &old, cmds)], "fe-a", ttl, AT)
        .unwrap();
    assert_eq!(kept, [Rekept::Kept]);
}

/// `rekeep.lua` in mode `ended` as fe-a calls it: its copy of `old`'s session (commands 1, 3
/// and 4, `held`, all delivered while Redis was away; next 5), as the hello of `by` ended it.
fn report_ended(
    scripts: &SessionScripts,
    redis: &RedisServer,
    rig: &RigId,
    held: &[String],
    old: &BootId,
    by: &BootId,
) -> Result<Vec<Rekept>, fleetlink::registry::scripts::RegistryError> {
    let session = Rekeep {
        rig,
        boot: old,
        next: Seq(5),
        cmds: [1, 3, 4]
            .into_iter()
            .map(Seq)
            .zip(held.iter().map(|c| c.as_bytes()))
            .collect(),
        unkept: Unkept::up_to(Seq(4)),
        mode: RekeepMode::EndedBy(*by),
    };
    let ttl = Duration::from_secs(60);
    scripts.rekeep(&mut redis.connection(), &[session], "fe-a", ttl, AT)
}

/// A full Redis (`maxmemory`, `noeviction`) refuses a script's first write that may grow memory
/// but runs what comes before it: `rekeep.lua` published its `rig_rebooted` reports, then was
/// refused, and published them again at every retry (review bb115: one report 274 times). Now
/// a refused call publishes nothing, and the call once Redis takes writes again reports each
/// command once.
#[test]
fn a_report_redis_refuses_for_want_of_memory_is_not_published() {
    let (redis, mut con, scripts, mut ctl, rig) = scripts_and_events("rig-f");
    let held: Vec<String> = [1, 3, 4].map(kept_command).into();
    // x's session a tombstone y left (1 reported), the record on a newer boot w: this
    // broker's report of x as z ended it owes 3 and 4, and its first write comes after them.
    let [x, y, z, w] = boots();
    let ended = || report_ended(&scripts, &redis, &rig, &held, &x, &z);
    let y_text = y.to_string();
    let _: () = con
        .hset_multiple(
            format!("sess:rig-f:{x}"),
            &[("next", "2"), ("gone", y_text.as_str()), ("rep", "1")],
        )
        .unwrap();
    let _: () = con.set("sessof:rig-f", w.to_string()).unwrap();
    set_maxmemory(&mut con, "1");
    for _ in 0..3 {
        let refused = ended().expect_err("Redis is full");
        assert!(refused.to_string().contains("OOM"), "{refused}");
    }
    assert_eq!(rebooted_so_far(&mut ctl), Vec::<Value>::new());
    set_maxmemory(&mut con, "0");
    assert_eq!(ended().unwrap(), [Rekept::Reported(2)]);
    let seqs: Vec<u64> = rebooted_so_far(&mut ctl)
        .iter()
        .map(|ev| ev["seq"].as_u64().unwrap())
        .collect();
    assert_eq!(seqs, [3, 4], "each once");
}

/// A broker decided a new boot's hello alone while Redis was away, ending the old session it
/// held parked (commands 1, 3 and 4; 2 was acked there). Once Redis is back it owes that
/// session's report, and reports through `rekeep.lua` (mode `ended`): what a boot in between
/// reported already (its tombstone) is not reported again; otherwise everything it holds is,
/// with what Redis numbered past it (the same boot went on elsewhere), but not what it acked.
#[test]
fn a_session_a_hello_decided_alone_ended_is_reported_once_through_redis() {
    let (redis, mut con, scripts, mut ctl, rig) = scripts_and_events("rig-e");
    let ttl = Duration::from_secs(60);
    let held: Vec<String> = [1, 3, 4].map(kept_command).into();
    let ended =
        |old: &BootId, by: &BootId| report_ended(&scripts, &redis, &rig, &held, old, by).unwrap();
    // Each rig_rebooted event up to a marker published now: (seq, new_boot_id).
    let reported = |ctl: &mut Control, old: &BootId| {
        let mut out = Vec::new();
        for ev in rebooted_so_far(ctl) {
            assert_eq!(
                (&ev["boot_id"], &ev["rig_id"]),
                (&json!(old.to_string()), &json!("rig-e")),
                "{ev}"
            );
            assert_eq!(ev["id"], format!("c{}", ev["seq"]), "{ev}");
            out.push((ev["seq"].as_u64().unwrap(), ev["new_boot_id"].clone()));
        }
        out
    };

    // A boot in between (y) said hello elsewhere: resume.lua reported 1 and 3 and left the
    // tombstone. Only 4, delivered while Redis was away, is left, reported as y ended it.
    let [x, y, z] = boots();
    let _: () = con
        .hset_multiple(
            format!("sess:rig-e:{x}"),
            &[
                ("next", "4"),
                ("c:1", held[0].as_str()),
                ("c:3", held[1].as_str()),
            ],
        )
        .unwrap();
    let _: () = con.set("sessof:rig-e", x.to_string()).unwrap();
    let found = scripts.resume(&mut con, &rig, &y, ttl, "fe-b").unwrap();
    assert_eq!(found.rebooted, 2);
    assert_eq!(reported(&mut ctl, &x).len(), 2);
    assert_eq!(ended(&x, &z), [Rekept::Reported(1)]);
    assert_eq!(reported(&mut ctl, &x), [(4, json!(y.to_string()))]);
    assert_eq!(ended(&x, &z), [Rekept::Reported(0)], "nothing twice");
    assert_eq!(reported(&mut ctl, &x), []);

    // No report yet. Redis holds 1 and 3 as this broker does, 2 (acked here: its removal
    // never reached Redis) and 5, which another broker numbered for the same boot meanwhile;
    // not 4, delivered here while Redis was away. All but 2 are reported, as z ended them,
    // and a later hello of z finds nothing more to report.
    flushall(&mut con);
    let [x, _, z] = boots();
    let c2 = kept_command(2);
    let c5 = kept_command(5);
    let _: () = con
        .hset_multiple(
            format!("sess:rig-e:{x}"),
            &[
                ("next", "6"),
                ("c:1", held[0].as_str()),
                ("c:2", &c2),
                ("c:3", held[1].as_str()),
                ("c:5", &c5),
            ],
        )
        .unwrap();
    let _: () = con.set("sessof:rig-e", x.to_string()).unwrap();
    let _: () = con.set("rig:rig-e", format!("{x}|fe-a")).unwrap();
    assert_eq!(ended(&x, &z), [Rekept::Reported(4)]);
    let by_z = json!(z.to_string());
    assert_eq!(
        reported(&mut ctl, &x),
        [1, 3, 4, 5].map(|seq| (seq, by_z.clone()))
    );
    let tomb: HashMap<String, String> = con.hgetall(format!("sess:rig-e:{x}")).unwrap();
    assert_eq!(tomb.get("gone"), Some(&z.to_string()), "{tomb:?}");
    assert_eq!(tomb.get("next").map(String::as_str), Some("6"), "{tomb:?}");
    assert_eq!(
        tomb.get("rep").map(String::as_str),
        Some("1,3,4,5"),
        "{tomb:?}"
    );
    assert_eq!(tomb.len(), 3, "{tomb:?}");
    let latest: String = con.get("sessof:rig-e").unwrap();
    assert_eq!(
        latest,
        z.to_string(),
        "the ending boot is the latest on record"
    );
    let found = scripts.resume(&mut con, &rig, &z, ttl, "fe-a").unwrap();
    assert_eq!(found.rebooted, 0);
    assert_eq!(ended(&x, &z), [Rekept::Reported(0)], "nothing twice");
    assert_eq!(reported(&mut ctl, &x), []);

    // A boot in between (y) whose report found none of these: another broker numbered past
    // them while this one could not reach Redis, and Redis never held them. Below the
    // tombstone's `next`, but not among the seqs it lists as reported: reported now, as y
    // ended them. (Before, only those at or above its `next` were, and 1 and 3 never.)
    flushall(&mut con);
    let [x, y, z] = boots();
    let _: () = con.hset(format!("sess:rig-e:{x}"), "next", "4").unwrap();
    let _: () = con.set("sessof:rig-e", x.to_string()).unwrap();
    let found = scripts.resume(&mut con, &rig, &y, ttl, "fe-b").unwrap();
    assert_eq!(found.rebooted, 0);
    assert_eq!(ended(&x, &z), [Rekept::Reported(3)]);
    let by_y = json!(y.to_string());
    assert_eq!(
        reported(&mut ctl, &x),
        [1, 3, 4].map(|seq| (seq, by_y.clone()))
    );
    assert_eq!(ended(&x, &z), [Rekept::Reported(0)], "nothing twice");
    assert_eq!(reported(&mut ctl, &x), []);

    // Redis lost the session: everything held here is reported.
    flushall(&mut con);
    let [x, _, z] = boots();
    assert_eq!(ended(&x, &z), [Rekept::Reported(3)]);
    let by_z = json!(z.to_string());
    assert_eq!(
        reported(&mut ctl, &x),
        [1, 3, 4].map(|seq| (seq, by_z.clone()))
    );
}

/// A newer boot's hello decided alone (Redis away) runs no `resume.lua`, so nothing reported
/// the session the rig's record (`sessof`) named then. When a broker puts the newer boot's
/// session back and moves the record to it, it ends the older session there, as that hello
/// would have: its unacked commands reported `rig_rebooted` once, the session cut to a
/// tombstone. Otherwise the newer boot's next hello finds itself on record and reports
/// nothing, and the older boot's command is lost without a word (checker, 8 of 8 before).
/// So too for a connected rig's copy (live), and for a session a hello decided alone ended
/// (`ended`) when the record named a third boot, not the one that session belongs to.
#[test]
fn moving_the_record_to_a_newer_boot_reports_the_session_it_named() {
    let (_redis, mut con, scripts, mut ctl, rig) = scripts_and_events("rig-m");
    let ttl = Duration::from_secs(60);
    // Each rig_rebooted event up to a marker published now: (boot, new boot, seq, id).
    let reported = |ctl: &mut Control| {
        rebooted_so_far(ctl)
            .into_iter()
            .map(|ev| {
                assert_eq!(ev["rig_id"], "rig-m", "{ev}");
                (
                    ev["boot_id"].as_str().unwrap().to_string(),
                    ev["new_boot_id"].as_str().unwrap().to_string(),
                    ev["seq"].as_u64().unwrap(),
                    ev["id"].as_str().unwrap_or("").to_string(),
                )
            })
            .collect::<Vec<_>>()
    };
    // The older boot's session as Redis kept it: 1 and 2 unacked, the rig's latest on record.
    let older_session = |con: &mut redis::Connection, old: &BootId| {
        let _: () = con
            .hset_multiple(
                format!("sess:rig-m:{old}"),
                &[
                    ("next", "3"),
                    ("c:2", kept_command(2).as_str()),
                    ("c:1", &kept_command(1)),
                ],
            )
            .unwrap();
        let _: () = con.set("sessof:rig-m", old.to_string()).unwrap();
    };
    let copy = |boot, mode| Rekeep {
        rig: &rig,
        boot,
        next: Seq(1),
        cmds: Vec::new(),
        unkept: Unkept::up_to(Seq(0)),
        mode,
    };
    let tombstone = |con: &mut redis::Connection, old: &BootId, by: &BootId| {
        let tomb: HashMap<String, String> = con.hgetall(format!("sess:rig-m:{old}")).unwrap();
        let want = hash_of(&[("next", "3"), ("gone", &by.to_string()), ("rep", "1,2")]);
        assert_eq!(tomb, want);
        let latest: String = con.get("sessof:rig-m").unwrap();
        assert_eq!(latest, by.to_string(), "the newer boot is on record");
    };

    // Parked: the newer boot z said hello to fe-b alone and left; no lease, no session of z.
    let [x, _, z] = boots();
    older_session(&mut con, &x);
    let kept = scripts
        .rekeep(&mut con, &[copy(&z, RekeepMode::Parked)], "fe-b", ttl, AT)
        .unwrap();
    assert_eq!(kept, [Rekept::Kept]);
    let (xs, zs) = (x.to_string(), z.to_string());
    assert_eq!(
        reported(&mut ctl),
        [
            (xs.clone(), zs.clone(), 1, "c1".to_string()),
            (xs.clone(), zs.clone(), 2, "c2".to_string())
        ]
    );
    tombstone(&mut con, &x, &z);
    // Nothing twice: not by the copy put back again, nor by z's next hello.
    let kept = scripts
        .rekeep(&mut con, &[copy(&z, RekeepMode::Parked)], "fe-b", ttl, AT)
        .unwrap();
    assert_eq!(kept, [Rekept::Merged]);
    let found = scripts.resume(&mut con, &rig, &z, ttl, "fe-b").unwrap();
    assert_eq!(found.rebooted, 0);
    assert_eq!(reported(&mut ctl), []);

    // Live: z is connected to fe-b, whose lease is back.
    flushall(&mut con);
    let [x, _, z] = boots();
    older_session(&mut con, &x);
    let _: () = con.set("rig:rig-m", format!("{z}|fe-b")).unwrap();
    let kept = scripts
        .rekeep(&mut con, &[copy(&z, RekeepMode::Live)], "fe-b", ttl, AT)
        .unwrap();
    assert_eq!(kept, [Rekept::Kept]);
    assert_eq!(reported(&mut ctl).len(), 2);
    tombstone(&mut con, &x, &z);

    // Ended: fe-a parked w's session, then decided z's hello alone; the record names y, whose
    // session another broker kept. z ended both; each is reported once, as z ended it.
    flushall(&mut con);
    let [w, y, z] = boots();
    older_session(&mut con, &y);
    let ended = Rekeep {
        rig: &rig,
        boot: &w,
        next: Seq(2),
        cmds: vec![(Seq(1), b"{\"id\":\"w1\"}".as_slice())],
        unkept: Unkept::up_to(Seq(1)),
        mode: RekeepMode::EndedBy(z),
    };
    let kept = scripts.rekeep(&mut con, &[ended], "fe-a", ttl, AT).unwrap();
    assert_eq!(kept, [Rekept::Reported(1)]);
    let (ws, ys, zs) = (w.to_string(), y.to_string(), z.to_string());
    let mut events = reported(&mut ctl);
    events.sort();
    let mut want = vec![
        (ws, zs.clone(), 1, "w1".to_string()),
        (ys.clone(), zs.clone(), 1, "c1".to_string()),
        (ys, zs, 2, "c2".to_string()),
    ];
    want.sort();
    assert_eq!(events, want);
    tombstone(&mut con, &y, &z);

    // A record naming an older boot whose session is a tombstone already, or gone: nothing.
    flushall(&mut con);
    let [x, y, z] = boots();
    older_session(&mut con, &x);
    let found = scripts.resume(&mut con, &rig, &y, ttl, "fe-c").unwrap();
    assert_eq!(found.rebooted, 2);
    assert_eq!(reported(&mut ctl).len(), 2);
    let _: () = con.set("sessof:rig-m", x.to_string()).unwrap();
    let kept = scripts
        .rekeep(&mut con, &[copy(&z, RekeepMode::Parked)], "fe-b", ttl, AT)
        .unwrap();
    assert_eq!(kept, [Rekept::Kept]);
    assert_eq!(reported(&mut ctl), []);
}

/// The session under `key` holds commands 1 to `last` and numbers the next one `last` + 1.
fn holds_commands_up_to(con: &mut redis::Connection, key: &str, last: u64) -> bool {
    let mut pipe = redis::pipe();
    for seq in 1..=last {
        pipe.hget(key, format!("c:{seq}"));
    }
    pipe.hget(key, "next");
    let mut got: Vec<Option<String>> = pipe.query(con).unwrap_or_default();
    let next = got.pop().flatten();
    got.len() as u64 == last
        && got.iter().all(Option::is_some)
        && next == Some((last + 1).to_string())
}

/// A new boot that says hello to the broker holding its old session parked while Redis is
/// away is decided there alone: the old session's unacked commands (one kept before the
/// outage, one delivered during it) are still reported `rig_rebooted`, once Redis is back.
/// And the new boot is the rig's latest on record from then on: its own unacked command is
/// reported when a third boot says hello. Before, the record still named the first boot, so
/// the third boot's hello reported that one's (empty) session and never the second's.
#[test]
fn a_new_boot_during_an_outage_on_the_same_broker_reports_the_old_sessions_commands() {
    let mut redis = RedisServer::start();
    let mut ctl = Control::new(&redis, &["fleetlink:events"]);
    let (a, _b, old_boot) = rig_left_during_an_outage(&mut redis, "rig-n", true);
    let new_boot = boot_id();
    let (mut again, welcome) = connect_hello(&a, "rig-n", &new_boot, None);
    assert_eq!(welcome["resumed"], false);
    redis.freeze(false);
    let mut seqs = Vec::new();
    while seqs.len() < 2 {
        let ev = ctl.next_event("rig_rebooted");
        assert_eq!(
            (&ev["boot_id"], &ev["new_boot_id"], &ev["rig_id"]),
            (&json!(old_boot), &json!(new_boot), &json!("rig-n")),
            "{ev}"
        );
        seqs.push(ev["seq"].as_u64().unwrap());
    }
    seqs.sort();
    assert_eq!(seqs, [1, 2]);
    // The new boot keeps the rig: A's refresh finds its old boot's lease and takes it back for
    // the new one (it used to read that as another owner and close the new boot 4410).
    let lease = format!("{new_boot}|fe-a");
    eventually(Duration::from_secs(10), "the new boot's lease", || {
        redis
            .connection()
            .get::<_, Option<String>>("rig:rig-n")
            .unwrap()
            == Some(lease.clone())
    });
    let (status, body) = a.command("rig-n", "after", json!({}));
    assert_eq!(status, 200, "{body}");
    assert_eq!(read_json(&mut again)["name"], "after");
    assert_eq!(
        a.metric("fleetlink_registry_ops_total{op=\"resume\",result=\"rebooted\"}"),
        2,
        "reported once, by A alone"
    );
    let third_boot = boot_id();
    let _third = connect_hello(&a, "rig-n", &third_boot, None);
    let ev = ctl.next_event("rig_rebooted");
    assert_eq!(
        (&ev["boot_id"], &ev["new_boot_id"], &ev["seq"]),
        (&json!(new_boot), &json!(third_boot), &json!(1)),
        "{ev}"
    );
}

/// The rig was on A, moved to B (whose commands Redis keeps) and came back to A before A heard
/// B's evict, its first connection still open there (half-open after a network flap). A must
/// take the session from Redis, not hand the stale local one from the old connection to the
/// new: that would number new commands from A's own count and overwrite B's seqs. The lease
/// may still be B's, or gone (B released it when the rig left it): either way the hand-over
/// merges in what Redis holds.
#[test]
fn a_rig_back_from_another_broker_resumes_from_redis_not_from_the_stale_local_session() {
    back_from_b(true);
    back_from_b(false);
}

fn back_from_b(lease_still_bs: bool) {
    let redis = RedisServer::start();
    let (a, _b, boot, mut on_a, mut ctl) = rig_with_commands_on_a(&redis, "rig-h", "h", 2);
    ack(&mut on_a, 1);
    ack(&mut on_a, 2);
    // What B did while the rig was on it, without its evict reaching A: took the lease and
    // kept two commands of its own, seqs 3 and 4.
    let mut con = redis.connection();
    let key = format!("sess:rig-h:{boot}");
    let cmd = |seq: u64| {
        json!({"type":"command","seq":seq,"id":format!("b{seq}"),"name":"n","args":{}}).to_string()
    };
    let mut lease = redis::cmd("SET");
    lease
        .arg("rig:rig-h")
        .arg(format!("{boot}|fe-b"))
        .arg("PX")
        .arg(60_000);
    if !lease_still_bs {
        lease = redis::cmd("DEL");
        lease.arg("rig:rig-h");
    }
    let _: () = redis::pipe()
        .add_command(lease)
        .hset(&key, "c:3", cmd(3))
        .hset(&key, "c:4", cmd(4))
        .hset(&key, "next", "5")
        .query(&mut con)
        .unwrap();
    let mut back = resume_on(&a, "rig-h", &boot, Some(2));
    assert_eq!(read_close(&mut on_a), 4410);
    let replayed: Vec<Value> = (0..2).map(|_| read_json(&mut back)).collect();
    assert_eq!(
        (&replayed[0]["id"], &replayed[1]["id"]),
        (&json!("b3"), &json!("b4")),
        "{replayed:?}"
    );
    send_and_read(&mut ctl, "fe-a", "rig-h", "h5", &mut back, 5);
    let b3: Option<String> = con.hget(&key, "c:3").unwrap();
    assert_eq!(b3, Some(cmd(3)), "B's command kept as it was");
}

/// Broker fe-a, and `rig` (a new boot, returned) welcomed there, sent command `id` (seq 1),
/// which it read and did not ack, and gone: fe-a's lease released, its session parked.
fn rig_left_with_one_command(
    redis: &RedisServer,
    rig: &str,
    id: &str,
) -> (Broker, String, Control) {
    let a = fleet_broker(redis, "fe-a");
    let boot = boot_id();
    let (mut ws, _) = connect_hello(&a, rig, &boot, None);
    let mut ctl = Control::new(redis, &[]);
    send_and_read(&mut ctl, "fe-a", rig, id, &mut ws, 1);
    drop(ws);
    wait_lease_released(&mut redis.connection(), rig, "fe-a's lease released");
    (a, boot, ctl)
}

/// A rig's session key damaged in Redis: the rig's next hello repairs it rather than failing.
/// A string where the hash belongs, or a `next` that is no seq, is replaced with a fresh
/// session; a command field whose seq is no seq is removed. The broker still holds the session
/// it parked when the rig left, so the rig gets its unacked command again, then the one held
/// for it, in order. Before, the damaged key turned every hello of that boot away (4503), and
/// every hello whose read shared its batch, with nothing logged; and each refused hello
/// extended the damaged key's TTL, so it never went.
#[test]
fn a_damaged_session_key_is_replaced_at_the_hello_and_the_parked_session_resumes() {
    damaged_session_resumes("rig-w", |p, key| {
        p.del(key).set(key, "not a hash");
    });
    damaged_session_resumes("rig-n", |p, key| {
        p.hset(key, "next", "99999999999999999999999");
    });
    damaged_session_resumes("rig-f", |p, key| {
        p.hset(key, "c:x", "{}");
    });
}

fn damaged_session_resumes(rig: &str, damage: impl Fn(&mut redis::Pipeline, &str)) {
    let redis = RedisServer::start();
    let (a, boot, mut ctl) = rig_left_with_one_command(&redis, rig, "w1");
    let mut con = redis.connection();
    let reply_to = ctl.reply_to.clone();
    let msg = json!({"type":"command","id":"held-1","rig_id":rig,"name":"fw","args":{},
                     "reply_to":reply_to,"queue_if_offline":true,"ttl_ms":60_000});
    ctl.publish("fleetlink:broker:fe-a", msg);
    assert_eq!(
        ctl.next(|ch, v| ch == reply_to && v["id"] == "held-1")["queued"],
        true
    );
    let key = format!("sess:{rig}:{boot}");
    let mut pipe = redis::pipe();
    damage(&mut pipe, &key);
    let _: () = pipe.query(&mut con).unwrap();

    let mut ws = resume_on(&a, rig, &boot, Some(0));
    read_command(&mut ws, 1, "w1");
    read_command(&mut ws, 2, "held-1");
    let kind: String = redis::cmd("TYPE").arg(&key).query(&mut con).unwrap();
    assert_eq!(kind, "hash");
    let fields: HashMap<String, String> = con.hgetall(&key).unwrap();
    assert!(
        fields
            .keys()
            .all(|f| ["next", "r", "t", "from"].contains(&f.as_str()) || f.starts_with("c:"))
            && !fields.contains_key("c:x")
            && fields["next"].len() < 20,
        "{rig}: {fields:?}"
    );
}

/// Redis loses its keys while it stays up (FLUSHALL) on a broker with no rig connected, only
/// a session parked for one that left: no lease refresh can notice, so the heartbeat does,
/// finding the broker's own liveness key gone, and the parked session goes back for the rig to
/// resume on any broker.
#[test]
fn a_parked_session_goes_back_after_a_flushall_on_a_broker_with_no_rigs() {
    let redis = RedisServer::start();
    let (_a, boot, _ctl) = rig_left_with_one_command(&redis, "rig-p", "p1");
    let mut con = redis.connection();
    flushall(&mut con);
    let key = format!("sess:rig-p:{boot}");
    // One heartbeat (10 s) and the pass after it.
    eventually(
        Duration::from_secs(15),
        "the parked session back in Redis",
        || con.hexists::<_, _, bool>(&key, "c:1").unwrap(),
    );
    let next: Option<String> = con.hget(&key, "next").unwrap();
    assert_eq!(next.as_deref(), Some("2"));
}

/// What a broker remembers of a session besides its commands goes into Redis when the rig
/// leaves, so a resume on another broker has it too: a result sent there names its command's
/// id (before, null), and `last_ack_at` is the ack's time (before, null).
#[test]
fn a_result_sent_after_a_resume_on_another_broker_names_its_command() {
    let redis = RedisServer::start();
    let (a, b, boot, mut on_a, _) = rig_with_commands_on_a(&redis, "rig-m", "m", 1);
    let mut ctl = Control::new(&redis, &["fleetlink:events"]);
    ack(&mut on_a, 1);
    let acked_at = |broker: &Broker| {
        let mut at = Value::Null;
        eventually(Duration::from_secs(10), "the ack in /v1/rigs", || {
            let rigs: Value = serde_json::from_str(&broker.http("GET", "/v1/rigs", "").1).unwrap();
            at = rigs[0]["last_ack_seq"]
                .as_u64()
                .filter(|&s| s == 1)
                .map_or(Value::Null, |_| rigs[0]["last_ack_at"].clone());
            at.is_string()
        });
        at
    };
    let on_a_at = acked_at(&a);
    drop(on_a);
    let key = format!("sess:rig-m:{boot}");
    eventually(
        Duration::from_secs(10),
        "the session's recall in Redis",
        || redis.connection().hexists(&key, "r").unwrap(),
    );
    let mut on_b = resume_on(&b, "rig-m", &boot, Some(1));
    assert_eq!(acked_at(&b), on_a_at, "the ack's time came along");
    let out = json!({"type": "result", "seq": 1, "ok": true, "output": "done"});
    on_b.send(Message::Text(out.to_string().into())).unwrap();
    let ev = ctl.next_event("result");
    assert_eq!(
        (&ev["id"], &ev["seq"], &ev["broker_id"]),
        (&json!("m1"), &json!(1), &json!("fe-b")),
        "{ev}"
    );
}

/// Closes `ws` from the rig's side and reads the broker's echo, which ends the handshake;
/// nothing else is owed before it.
fn close_handshake(ws: &mut Ws) {
    ws.close(None).unwrap();
    match ws.read() {
        Ok(Message::Close(_)) => {}
        Ok(other) => panic!("{other:?} before the close's echo"),
        Err(e) => panic!("no echo of the close: {e}"),
    }
}

/// 20 rigs on `a`, each given command `<tag><i>` and acking it. After `then`, each leaves `a`
/// by `leave` and at once resumes on `b`, where it sends that command's result. Returns the
/// results whose `id` is not their command's.
fn results_after_leaving_at_once(
    redis: &RedisServer,
    (a, b): (&Broker, &Broker),
    tag: &str,
    then: impl FnOnce(),
    leave: impl Fn(&str, &mut Ws),
) -> Vec<String> {
    let mut ctl = Control::new(redis, &[]);
    let mut events = Control::new(redis, &["fleetlink:events"]);
    let rigs: Vec<(String, String, Ws)> = (0..20)
        .map(|i| {
            let (rig, boot) = (format!("rig-{tag}{i}"), boot_id());
            let (mut ws, _) = connect_hello(a, &rig, &boot, None);
            send_and_read(
                &mut ctl,
                &a.broker_id,
                &rig,
                &format!("{tag}{i}"),
                &mut ws,
                1,
            );
            ack(&mut ws, 1);
            (rig, boot, ws)
        })
        .collect();
    for _ in 0..rigs.len() {
        events.next_event("ack");
    }
    then();
    let mut on_b = Vec::new();
    for (rig, boot, mut ws) in rigs {
        leave(&rig, &mut ws);
        let mut ws = resume_on(b, &rig, &boot, Some(1));
        let out = json!({"type": "result", "seq": 1, "ok": true});
        ws.send(Message::Text(out.to_string().into())).unwrap();
        on_b.push(ws);
    }
    let mut unnamed = Vec::new();
    for _ in 0..on_b.len() {
        let ev = events.next_event("result");
        let rig = ev["rig_id"].as_str().unwrap_or_default();
        let want = format!("{tag}{}", rig.trim_start_matches(&format!("rig-{tag}")));
        if ev["id"] != json!(want) {
            unnamed.push(format!("{rig}: {}", ev["id"]));
        }
    }
    unnamed
}

/// Rigs that end their close handshake with one broker and at once resume on another (as the
/// reference agent does after a drain's `goaway`) have their results named too: the old broker
/// writes what it remembers of the session before it releases the lease, and at once rather
/// than at the pace of replies. Before, the release went first and the note a round trip or
/// a pace later, and the next broker could read the session between the two (review bb152:
/// some results in flight at a drain came with `id` null).
#[test]
fn results_of_rigs_that_resume_elsewhere_the_moment_they_leave_name_their_commands() {
    let redis = RedisServer::start();
    let (a, b) = brokers_a_and_b(&redis);
    let unnamed =
        results_after_leaving_at_once(&redis, (&a, &b), "q", || {}, |_, ws| close_handshake(ws));
    assert!(unnamed.is_empty(), "{} of 20: {unnamed:?}", unnamed.len());
}

/// The echo of a rig's close waits for the session's note only so long: with Redis holding
/// every write, a rig awaiting a result has its close echoed within about half a second,
/// and its reconnect is not held up for the length of the pause.
#[test]
fn a_rigs_close_is_echoed_soon_though_redis_holds_the_sessions_note() {
    let redis = RedisServer::start();
    let (a, _b, _boot, mut on_a, _ctl) = rig_with_commands_on_a(&redis, "rig-e", "e", 1);
    ack(&mut on_a, 1);
    a.wait_metric("fleetlink_commands_total{result=\"acked\"} 1");
    let _: () = redis::cmd("CLIENT")
        .arg("PAUSE")
        .arg(5000)
        .arg("WRITE")
        .query(&mut redis.connection())
        .unwrap();
    let asked = std::time::Instant::now();
    close_handshake(&mut on_a);
    let waited = asked.elapsed();
    assert!(waited < Duration::from_secs(3), "echoed after {waited:?}");
}

/// A rig on a fleet broker started with `extra` holds command `x1` acked and `x2` written
/// unacked. `close` makes the broker close it with `code`; once the broker has said so
/// (`disconnected`), and before reading the close, the rig sends both results and an event.
/// Returns what was published of them: (seq, id) of each result, and the event's data.
fn sent_across_the_close(
    extra: &[&str],
    close: impl FnOnce(&Broker, &mut Control),
    code: u16,
) -> (Vec<(Value, Value)>, Value) {
    let redis = RedisServer::start();
    let a = fleet_broker_with(&redis, "fe-a", extra);
    let mut ctl = Control::new(&redis, &[]);
    let mut events = Control::new(&redis, &["fleetlink:events"]);
    let (mut ws, _) = connect_hello(&a, "rig-x", &boot_id(), None);
    send_and_read(&mut ctl, "fe-a", "rig-x", "x1", &mut ws, 1);
    send_and_read(&mut ctl, "fe-a", "rig-x", "x2", &mut ws, 2);
    ack(&mut ws, 1);
    events.next_event("ack");
    close(&a, &mut ctl);
    let gone = events.next_event("disconnected");
    assert_eq!(gone["code"], code, "{gone}");
    for late in [
        json!({"type": "result", "seq": 1, "ok": true}),
        json!({"type": "result", "seq": 2, "ok": false}),
        json!({"type": "event", "name": "late", "data": {"n": 1}}),
    ] {
        ws.send(Message::Text(late.to_string().into())).unwrap();
    }
    assert_eq!(read_close(&mut ws), code);
    let results = (0..2)
        .map(|_| events.next_event("result"))
        .map(|r| (r["seq"].clone(), r["id"].clone()))
        .collect();
    (results, events.next_event("event")["data"].clone())
}

fn published_with_their_ids((results, data): (Vec<(Value, Value)>, Value)) {
    assert_eq!(
        results,
        vec![(json!(1), json!("x1")), (json!(2), json!("x2"))],
        "results in order, each with its command's id"
    );
    assert_eq!(data, json!({"n": 1}));
}

/// What a rig sent before it read a kick's 1012 is published: the result of a command it
/// acked, of one it had not yet acked, and an event. Read after the close, it was dropped, and
/// a rig that does not send its results again lost their outcomes (review bb155).
#[test]
fn results_a_rig_sent_before_it_read_a_kick_are_published_with_their_ids() {
    let kick = |_: &Broker, ctl: &mut Control| {
        let reply_to = ctl.reply_to.clone();
        let kick = json!({"type": "kick", "id": "k1", "rig_id": "rig-x", "reply_to": reply_to});
        ctl.publish("fleetlink:broker:fe-a", kick);
        let done = ctl.next(|ch, v| ch == reply_to && v["id"] == "k1");
        assert_eq!(done["ok"], true, "{done}");
    };
    published_with_their_ids(sent_across_the_close(&[], kick, 1012));
}

/// The same at a drain's end, for a rig that stayed past its `goaway` (review bb155: 61 of
/// 150 results sent just after the window were lost).
#[test]
fn results_a_rig_sent_before_it_read_a_drains_close_are_published_with_their_ids() {
    let drain = |a: &Broker, _: &mut Control| assert_eq!(a.http("POST", "/v1/drain", "").0, 202);
    published_with_their_ids(sent_across_the_close(&["--drain", "1s"], drain, 1001));
}

/// A broker's copy of a session (parked, or ended by a hello it decided alone) can be older
/// than Redis's: the rig acked some of its commands on another broker since. `unkept_to`
/// says which of them Redis never kept; one above it that Redis kept and has forgotten,
/// below its `next`, was acked, and is neither reported `rig_rebooted` nor written back.
/// One at or below it only the copy knows of, and is reported.
#[test]
fn a_stale_copy_reports_and_writes_back_none_of_what_redis_kept_and_forgot() {
    let (redis, mut con, scripts, mut ctl, rig) = scripts_and_events("rig-s");
    let ttl = Duration::from_secs(60);
    let held: Vec<String> = [1, 2, 3].map(kept_command).into();
    let copy = |old: &BootId, unkept_to: u64, mode: RekeepMode| {
        let session = Rekeep {
            rig: &rig,
            boot: old,
            next: Seq(4),
            cmds: [1, 2, 3]
                .into_iter()
                .map(Seq)
                .zip(held.iter().map(|c| c.as_bytes()))
                .collect(),
            unkept: Unkept::up_to(Seq(unkept_to)),
            mode,
        };
        scripts
            .rekeep(&mut redis.connection(), &[session], "fe-x", ttl, AT)
            .unwrap()
    };
    let reported = |ctl: &mut Control| -> Vec<u64> {
        rebooted_so_far(ctl)
            .iter()
            .map(|ev| ev["seq"].as_u64().unwrap_or_default())
            .collect()
    };
    let sess = |b: &BootId| format!("sess:rig-s:{b}");

    // Parked: boot a acked 1-3 on another broker, then boot b's hello there found nothing
    // to report and left the tombstone. All three were kept: nothing is reported.
    let [a, b] = boots();
    let _: () = con
        .hset_multiple(
            sess(&a),
            &[("next", "4"), ("gone", b.as_str()), ("rep", "")],
        )
        .unwrap();
    let _: () = con.set("sessof:rig-s", b.to_string()).unwrap();
    assert_eq!(copy(&a, 0, RekeepMode::Parked), [Rekept::Reported(0)]);
    assert_eq!(reported(&mut ctl), Vec::<u64>::new());
    // 1 and 2 were delivered while Redis was away: those only this copy tells of.
    assert_eq!(copy(&a, 2, RekeepMode::Parked), [Rekept::Reported(2)]);
    assert_eq!(reported(&mut ctl), [1, 2]);
    assert_eq!(
        copy(&a, 2, RekeepMode::Parked),
        [Rekept::Reported(0)],
        "once"
    );

    // Ended by a hello decided here alone; Redis has the session, acked down to nothing.
    flushall(&mut con);
    let [a, b] = boots();
    let _: () = con.hset(sess(&a), "next", "4").unwrap();
    assert_eq!(copy(&a, 0, RekeepMode::EndedBy(b)), [Rekept::Reported(0)]);
    assert_eq!(reported(&mut ctl), Vec::<u64>::new());
    // Redis lost the session altogether (an empty restart): everything is reported.
    flushall(&mut con);
    assert_eq!(copy(&a, 0, RekeepMode::EndedBy(b)), [Rekept::Reported(3)]);
    assert_eq!(reported(&mut ctl), [1, 2, 3]);

    // Parked, a newer boot holding the rig whose hello has not reported this session yet (the
    // record still names it): written back for that boot's broker to report, but without what
    // was acked.
    flushall(&mut con);
    let [a, b] = boots();
    // (Redis numbered the session from 2, past the 1 this broker gave without it: an
    // emptied field from there on was acked.)
    let _: () = con
        .hset_multiple(
            sess(&a),
            &[("next", "4"), ("from", "2"), ("c:3", held[2].as_str())],
        )
        .unwrap();
    let _: () = con.set("sessof:rig-s", a.to_string()).unwrap();
    let _: () = con.set("rig:rig-s", format!("{b}|fe-y")).unwrap();
    assert_eq!(copy(&a, 1, RekeepMode::Parked), [Rekept::Kept]);
    let left: HashMap<String, String> = con.hgetall(sess(&a)).unwrap();
    let mut fields: Vec<&str> = left.keys().map(String::as_str).collect();
    fields.sort();
    assert_eq!(
        fields,
        ["c:1", "c:3", "from", "next"],
        "2 was acked: {left:?}"
    );

    // A key holding only what a broker remembered at a release (Redis restarted empty) is
    // nobody's session: the copy goes in whole.
    flushall(&mut con);
    let _: () = con.hset(sess(&a), "r", "{}").unwrap();
    assert_eq!(copy(&a, 0, RekeepMode::Parked), [Rekept::Kept]);
    let left: HashMap<String, String> = con.hgetall(sess(&a)).unwrap();
    assert_eq!(left.len(), 6, "{left:?}"); // "r", "next", "from" and three commands
}

/// Damage that comes while a rig is connected is met by the writes: a session `next` that is
/// no count, or a key of another type, no longer fails every persist and re-keep of it (the
/// broker dropped its Redis connection at each `ok|inf` and reconnected in a loop), and a
/// hello no longer takes seqs the other scripts refuse (16 digits, a leading zero).
#[test]
fn damage_to_a_live_session_is_written_over_not_answered_in_a_loop() {
    let (_redis, mut con, scripts, a, _b, boot) = rigs_leased_to_fe_a_and_fe_b();
    let ttl = Duration::from_secs(60);
    let sess = format!("sess:rig-a:{boot}");
    let live = |next: u64| Rekeep {
        rig: &a,
        boot: &boot,
        next: Seq(next),
        cmds: vec![(Seq(5), b"c5".as_slice())],
        unkept: Unkept::up_to(Seq(0)),
        mode: RekeepMode::Live,
    };
    for bad in ["inf", "1e400", "-3", "12345678901234567"] {
        let _: () = con.hset(&sess, "next", bad).unwrap();
        let kept = scripts
            .rekeep(&mut con, &[live(6)], "fe-a", ttl, AT)
            .unwrap();
        assert_eq!(kept, [Rekept::Kept], "next {bad}");
        let next: String = con.hget(&sess, "next").unwrap();
        assert_eq!(next, "6", "next {bad}");

        let _: () = con.hset(&sess, "next", bad).unwrap();
        let one = Persist {
            rig: &a,
            boot: &boot,
            seq: Seq(7),
            json: b"c7",
        };
        let kept = scripts.persist(&mut con, &[one], "fe-a", ttl).unwrap();
        assert_eq!(kept, [Kept::Yes], "next {bad}");
    }
    let _: () = con.del(&sess).unwrap();
    let _: () = con.rpush(&sess, "not a session").unwrap();
    let one = Persist {
        rig: &a,
        boot: &boot,
        seq: Seq(8),
        json: b"c8",
    };
    let kept = scripts.persist(&mut con, &[one], "fe-a", ttl).unwrap();
    // The list deleted, the command starts the session again.
    assert_eq!(kept, [Kept::Anew]);
    let c8: Option<String> = con.hget(&sess, "c:8").unwrap();
    assert_eq!(c8.as_deref(), Some("c8"));
    let _: () = con.del(&sess).unwrap();
    let _: () = con.rpush(&sess, "not a session").unwrap();
    let kept = scripts
        .rekeep(&mut con, &[live(6)], "fe-a", ttl, AT)
        .unwrap();
    assert_eq!(kept, [Rekept::Kept]);

    // At a hello: a 16-digit next and a leading-zero seq are no seqs of ours.
    let _: () = con.del(&sess).unwrap();
    let _: () = con
        .hset_multiple(&sess, &[("next", "9"), ("c:007", "c7"), ("c:8", "c8")])
        .unwrap();
    let found = scripts.resume(&mut con, &a, &boot, ttl, "fe-a").unwrap();
    let seqs: Vec<u64> = found.commands.iter().map(|c| c.0 .0).collect();
    assert_eq!(seqs, [8]);
    let _: () = con.hset(&sess, "next", "1234567890123456").unwrap();
    let found = scripts.resume(&mut con, &a, &boot, ttl, "fe-a").unwrap();
    assert_eq!(found.next, None, "a fresh session");
}

/// An older boot back after a newer one left (its lease free, so hello.lua lets it in: a
/// stale process, or a rig whose clock went back) ends the newer boot's session as any hello
/// ends the rig's latest, and goes on with its own from where its tombstone left it. Before,
/// it was welcomed into its tombstone and its commands went there, while the rig's record
/// still named the newer boot: the next boot's hello reported that one, and never them.
#[test]
fn an_older_boot_back_after_a_newer_one_left_has_its_commands_reported_at_the_next_boot() {
    let (_redis, mut con, scripts, mut ctl, rig) = scripts_and_events("rig-o");
    let ttl = Duration::from_secs(60);
    let [a, newer, newest] = boots();
    let sess = |b: &BootId| format!("sess:rig-o:{b}");
    let reported = |ctl: &mut Control| -> Vec<(String, String, String)> {
        let text = |v: &Value| v.as_str().unwrap_or_default().to_string();
        rebooted_so_far(ctl)
            .iter()
            .map(|ev| {
                (
                    text(&ev["boot_id"]),
                    text(&ev["new_boot_id"]),
                    text(&ev["id"]),
                )
            })
            .collect()
    };

    scripts.resume(&mut con, &rig, &a, ttl, "fe-x").unwrap();
    let _: () = con
        .hset_multiple(sess(&a), &[("next", "2"), ("c:1", r#"{"id":"a1"}"#)])
        .unwrap();
    let found = scripts.resume(&mut con, &rig, &newer, ttl, "fe-x").unwrap();
    assert_eq!(found.rebooted, 1);
    assert_eq!(
        reported(&mut ctl),
        [(a.to_string(), newer.to_string(), "a1".into())]
    );

    // The older boot is back: the newer one's (empty) session ends, its own goes on at 2.
    let found = scripts.resume(&mut con, &rig, &a, ttl, "fe-y").unwrap();
    assert_eq!(found.next, Some(Seq(2)));
    assert_eq!(found.previous_boot.as_deref(), Some(newer.as_str()));
    let gone: Option<String> = con.hget(sess(&a), "gone").unwrap();
    assert_eq!(gone, None, "no longer a tombstone");
    let gone: Option<String> = con.hget(sess(&newer), "gone").unwrap();
    assert_eq!(gone.as_deref(), Some(a.as_str()));
    let latest: String = con.get("sessof:rig-o").unwrap();
    assert_eq!(latest, a.as_str());
    assert_eq!(reported(&mut ctl), []);

    // It gets command 2 and leaves it unacked; the next boot reports it, and not 1 again.
    let _: () = con.set("rig:rig-o", format!("{a}|fe-y")).unwrap();
    let a2 = Persist {
        rig: &rig,
        boot: &a,
        seq: Seq(2),
        json: br#"{"id":"a2"}"#,
    };
    assert_eq!(
        scripts.persist(&mut con, &[a2], "fe-y", ttl).unwrap(),
        [Kept::Yes]
    );
    let found = scripts
        .resume(&mut con, &rig, &newest, ttl, "fe-y")
        .unwrap();
    assert_eq!(found.rebooted, 1);
    assert_eq!(
        reported(&mut ctl),
        [(a.to_string(), newest.to_string(), "a2".into())]
    );
}

/// After an empty restart the brokers put their copies back in whatever order they reconnect.
/// An older boot's parked copy put back first named itself the rig's latest (`sessof`), and
/// the newer boot's copy, put back after it, left that alone: the next boot's hello reported
/// the older session and never the newer one's unacked command. The newer one is recorded.
#[test]
fn a_newer_boots_copy_put_back_after_an_older_ones_becomes_the_rigs_latest() {
    let redis = RedisServer::start();
    let mut con = redis.connection();
    let scripts = SessionScripts::new();
    let ttl = Duration::from_secs(60);
    let rig = RigId::parse("rig-n").unwrap();
    let [older, newer] = boots();
    fn copy<'a>(rig: &'a RigId, boot: &'a BootId, next: u64) -> Rekeep<'a> {
        Rekeep {
            rig,
            boot,
            next: Seq(next),
            cmds: vec![(Seq(next - 1), b"{}".as_slice())],
            unkept: Unkept::up_to(Seq(0)),
            mode: RekeepMode::Parked,
        }
    }
    let kept = scripts
        .rekeep(&mut con, &[copy(&rig, &older, 2)], "fe-1", ttl, AT)
        .unwrap();
    assert_eq!(kept, [Rekept::Kept]);
    let kept = scripts
        .rekeep(&mut con, &[copy(&rig, &newer, 3)], "fe-0", ttl, AT)
        .unwrap();
    assert_eq!(kept, [Rekept::Kept]);
    let latest: String = con.get("sessof:rig-n").unwrap();
    assert_eq!(latest, newer.as_str());
    // The next boot's hello reports the newer boot's command.
    let next_boot = BootId::parse(&boot_id()).unwrap();
    let found = scripts
        .resume(&mut con, &rig, &next_boot, ttl, "fe-0")
        .unwrap();
    assert_eq!(found.previous_boot.as_deref(), Some(newer.as_str()));
    assert_eq!(found.rebooted, 1);
}

/// After an empty restart a broker's copy can meet the session another broker wrote since,
/// numbered past what the copy holds: the rig resumed there with the copy's seqs. What the
/// copy holds up to `unkept_to` (every command, once the broker found Redis had lost keys)
/// Redis may never have had: it is added below that session's `next` too, never over what it
/// holds. Before, it was taken for acked, and the next boot never heard of it.
#[test]
fn a_copy_meeting_a_session_numbered_past_it_adds_what_redis_may_never_have_had() {
    let (_redis, mut con, scripts, a, _b, boot) = rigs_leased_to_fe_a_and_fe_b();
    let ttl = Duration::from_secs(60);
    let sess = format!("sess:rig-a:{boot}");
    let _: () = con.del("rig:rig-a").unwrap();
    let _: () = con
        .hset_multiple(&sess, &[("next", "4"), ("c:3", "theirs")])
        .unwrap();
    let copy = |unkept_to: u64| Rekeep {
        rig: &a,
        boot: &boot,
        next: Seq(3),
        cmds: vec![(Seq(1), b"c1".as_slice()), (Seq(2), b"c2".as_slice())],
        unkept: Unkept::up_to(Seq(unkept_to)),
        mode: RekeepMode::Parked,
    };
    // Kept by Redis before, and gone: acked.
    let kept = scripts
        .rekeep(&mut con, &[copy(0)], "fe-a", ttl, AT)
        .unwrap();
    assert_eq!(kept, [Rekept::Merged]);
    let fields: HashMap<String, String> = con.hgetall(&sess).unwrap();
    assert_eq!(fields.len(), 2, "{fields:?}");
    // Redis may never have had them.
    let kept = scripts
        .rekeep(&mut con, &[copy(2)], "fe-a", ttl, AT)
        .unwrap();
    assert_eq!(kept, [Rekept::Merged]);
    let fields: HashMap<String, String> = con.hgetall(&sess).unwrap();
    let want = hash_of(&[
        ("next", "4"),
        ("c:1", "c1"),
        ("c:2", "c2"),
        ("c:3", "theirs"),
    ]);
    assert_eq!(fields, want);
}

/// A broker decided boot X's hello alone and gave it a command Redis never kept; the rig
/// rebooted as Y, whose hello on another broker came right after Redis returned, before this
/// broker's first refresh made X the rig's latest on record: it reported the boot before X and
/// named Y the latest. X's session, put back by this broker since (a `next` and no commands),
/// is then no tombstone, and no later hello reports it. The copy parked here reports it, once.
#[test]
fn a_copy_of_a_session_a_newer_boots_hello_passed_over_is_reported_once() {
    let (_redis, mut con, scripts, mut ctl, rig) = scripts_and_events("rig-p");
    let ttl = Duration::from_secs(60);
    let [x, y] = boots();
    let _: () = con
        .hset_multiple(format!("sess:rig-p:{x}"), &[("next", "1")])
        .unwrap();
    let _: () = con.set("sessof:rig-p", y.as_str()).unwrap();
    let _: () = con.set("rig:rig-p", format!("{y}|fe-b")).unwrap();
    let copy = Rekeep {
        rig: &rig,
        boot: &x,
        next: Seq(4),
        cmds: vec![(Seq(3), br#"{"id":"x3"}"#.as_slice())],
        unkept: Unkept::up_to(Seq(3)),
        mode: RekeepMode::Parked,
    };
    let kept = scripts
        .rekeep(&mut con, std::slice::from_ref(&copy), "fe-a", ttl, AT)
        .unwrap();
    assert_eq!(kept, [Rekept::Reported(1)]);
    let seen: Vec<(Value, Value)> = rebooted_so_far(&mut ctl)
        .iter()
        .map(|e| (e["id"].clone(), e["new_boot_id"].clone()))
        .collect();
    assert_eq!(seen, [(json!("x3"), json!(y.as_str()))]);
    let kept = scripts
        .rekeep(&mut con, std::slice::from_ref(&copy), "fe-a", ttl, AT)
        .unwrap();
    assert_eq!(kept, [Rekept::Reported(0)], "once");
    assert_eq!(rebooted_so_far(&mut ctl), Vec::<Value>::new());
}

/// Two parked copies Redis must not lose, from the orderings helper (each 3–5 of 5 before):
/// a newer boot's copy under an older boot's lease (often the broker's own, its release
/// waiting for the older copy) is written, not fenced, and the record moves to it, ending the
/// older session and its lease; a copy under its own lease, whose session a newer boot ended
/// meanwhile (a tombstone), reports its unkept command instead of writing it into the
/// tombstone, where no report would ever read it.
#[test]
fn a_parked_copy_is_neither_fenced_by_an_older_boot_nor_hidden_in_its_own_tombstone() {
    let (_redis, mut con, scripts, mut ctl, rig) = scripts_and_events("rig-f");
    let ttl = Duration::from_secs(60);
    let [x, z] = boots();
    let (c1, c2) = (kept_command(1), kept_command(2));

    // X is parked on fe-a, its lease still there; Z (decided alone on fe-a) got c1 unkept.
    let _: () = con.hset(format!("sess:rig-f:{x}"), "next", "1").unwrap();
    let _: () = con.set("sessof:rig-f", x.to_string()).unwrap();
    let _: () = con.set("rig:rig-f", format!("{x}|fe-a")).unwrap();
    let z_copy = Rekeep {
        rig: &rig,
        boot: &z,
        next: Seq(2),
        cmds: vec![(Seq(1), c1.as_bytes())],
        unkept: Unkept::up_to(Seq(1)),
        mode: RekeepMode::Parked,
    };
    let kept = scripts
        .rekeep(&mut con, &[z_copy], "fe-a", ttl, AT)
        .unwrap();
    assert_eq!(kept, [Rekept::Kept]);
    let written: Option<String> = con.hget(format!("sess:rig-f:{z}"), "c:1").unwrap();
    assert_eq!(written, Some(c1.clone()), "Z's command kept for its resume");
    let latest: String = con.get("sessof:rig-f").unwrap();
    assert_eq!(latest, z.to_string());
    let gone: Option<String> = con.hget(format!("sess:rig-f:{x}"), "gone").unwrap();
    assert_eq!(gone, Some(z.to_string()), "X's session ended by Z");
    let lease: Option<String> = con.get("rig:rig-f").unwrap();
    assert_eq!(lease, None, "X's lease went with its session");
    let found = scripts.resume(&mut con, &rig, &z, ttl, "fe-b").unwrap();
    assert_eq!(found.next, Some(Seq(2)));
    assert_eq!(found.commands.len(), 1, "{:?}", found.commands);
    assert_eq!(rebooted_so_far(&mut ctl).len(), 0);

    // X parked on fe-a under its own lease with c1 (kept) and c2 (delivered unkept); Z ended
    // the session meanwhile, reporting c1.
    flushall(&mut con);
    let _: () = con
        .hset_multiple(
            format!("sess:rig-f:{x}"),
            &[("next", "2"), ("gone", &z.to_string()), ("rep", "1")],
        )
        .unwrap();
    let _: () = con.set("sessof:rig-f", z.to_string()).unwrap();
    let _: () = con.set("rig:rig-f", format!("{x}|fe-a")).unwrap();
    let x_copy = Rekeep {
        rig: &rig,
        boot: &x,
        next: Seq(3),
        cmds: vec![(Seq(1), c1.as_bytes()), (Seq(2), c2.as_bytes())],
        unkept: Unkept::up_to(Seq(2)),
        mode: RekeepMode::Parked,
    };
    let kept = scripts
        .rekeep(&mut con, std::slice::from_ref(&x_copy), "fe-a", ttl, AT)
        .unwrap();
    assert_eq!(kept, [Rekept::Reported(1)]);
    let events = rebooted_so_far(&mut ctl);
    assert_eq!(events.len(), 1, "{events:?}");
    assert_eq!(
        (
            &events[0]["seq"],
            &events[0]["boot_id"],
            &events[0]["new_boot_id"]
        ),
        (&json!(2), &json!(x.to_string()), &json!(z.to_string()))
    );
    let tomb: HashMap<String, String> = con.hgetall(format!("sess:rig-f:{x}")).unwrap();
    assert_eq!(tomb.get("rep").map(String::as_str), Some("1,2"), "{tomb:?}");
    assert!(!tomb.keys().any(|k| k.starts_with("c:")), "{tomb:?}");
    let kept = scripts
        .rekeep(&mut con, &[x_copy], "fe-a", ttl, AT)
        .unwrap();
    assert_eq!(kept, [Rekept::Reported(0)], "nothing twice");
}

/// A broker decided an older boot's hello alone (X, a stale process, welcomed once the newer
/// boot Z left), ending Z's session parked there: Z's command, delivered while Redis was away,
/// is reported through `rekeep.lua` (mode `ended`, by X), and the record names X now, as X's
/// hello's `resume.lua` would have made it. Left naming Z, X's refresh would find a newer
/// boot on record and close it, and a later boot's hello would report Z's tombstone, not X.
#[test]
fn a_session_an_older_boots_hello_ended_is_reported_and_the_record_names_that_boot() {
    let (_redis, mut con, scripts, mut ctl, rig) = scripts_and_events("rig-o");
    let ttl = Duration::from_secs(60);
    let [x, z] = boots();
    let c1 = "{\"seq\":1,\"id\":\"c1\"}";
    for on_record in [Some(z), None] {
        flushall(&mut con);
        if let Some(b) = on_record {
            let _: () = con.set("sessof:rig-o", b.to_string()).unwrap();
        }
        let ended = Rekeep {
            rig: &rig,
            boot: &z,
            next: Seq(2),
            cmds: vec![(Seq(1), c1.as_bytes())],
            unkept: Unkept::up_to(Seq(1)),
            mode: RekeepMode::EndedBy(x),
        };
        let kept = scripts
            .rekeep(&mut con, std::slice::from_ref(&ended), "fe-a", ttl, AT)
            .unwrap();
        assert_eq!(kept, [Rekept::Reported(1)], "{on_record:?}");
        let events = rebooted_so_far(&mut ctl);
        assert_eq!(events.len(), 1, "{events:?}");
        assert_eq!(
            (
                &events[0]["boot_id"],
                &events[0]["new_boot_id"],
                &events[0]["id"]
            ),
            (&json!(z.to_string()), &json!(x.to_string()), &json!("c1"))
        );
        let latest: String = con.get("sessof:rig-o").unwrap();
        assert_eq!(latest, x.to_string(), "{on_record:?}");
        let kept = scripts.rekeep(&mut con, &[ended], "fe-a", ttl, AT).unwrap();
        assert_eq!(kept, [Rekept::Reported(0)], "nothing twice");
        let found = scripts.resume(&mut con, &rig, &x, ttl, "fe-a").unwrap();
        assert_eq!(
            found.rebooted, 0,
            "X's next hello finds nothing more to report"
        );
    }
}

/// fe-a (behind `relay`, with `a_args`) and fe-b; `rig`'s new boot says hello to fe-a, is given
/// commands `<prefix>1` and `<prefix>2` (seqs 1 and 2; read by the rig when `read`), and leaves
/// with both unacked, parked on fe-a. Then fe-a is cut off from Redis, Redis restarts empty,
/// and fe-b is back on it. Returns fe-a, fe-b and the boot.
fn parked_on_a_through_an_empty_restart(
    redis: &mut RedisServer,
    relay: &Relay,
    rig: &str,
    prefix: &str,
    a_args: &[&str],
    read: bool,
    named: bool,
) -> (Broker, Broker, String) {
    let url = relay.url();
    let mut args = vec!["--redis", &url, "--broker-id", "fe-a"];
    args.extend_from_slice(a_args);
    let a = Broker::start_logged(&args);
    a.wait_readyz(200, Duration::from_secs(10), "fe-a ready");
    let b = fleet_broker(redis, "fe-b");
    let boot = boot_id();
    let (mut on_a, _) = connect_hello(&a, rig, &boot, None);
    let mut ctl = Control::new(redis, &[]);
    for i in 1..=2u64 {
        let r = ctl.command_id("fe-a", rig, &format!("{prefix}{i}"), "n", json!({}));
        assert_eq!(r["seq"], i, "{r}");
        if read {
            read_command(&mut on_a, i, format!("{prefix}{i}"));
        }
    }
    // With `named`: named for its lapse report, and again as it leaves, before the restart
    // takes the name away. Its entry's due time moves with the second naming (a short TTL
    // counts from the leave).
    let names = || -> Vec<(String, f64)> {
        redis
            .connection()
            .zrange_withscores("sess:lapses", 0, -1)
            .unwrap()
    };
    if named {
        eventually(Duration::from_secs(10), "the session named", || {
            names().len() == 1
        });
    }
    let first = names();
    drop(on_a);
    eventually(Duration::from_secs(10), "fe-a parks the rig", || {
        a.http("GET", "/v1/rigs", "").1.trim() == "[]"
    });
    if named {
        eventually(Duration::from_secs(10), "named again as it left", || {
            names() != first
        });
    }
    relay.down(true);
    a.wait_readyz(503, Duration::from_secs(15), "fe-a away");
    redis.restart();
    b.wait_readyz(200, Duration::from_secs(15), "fe-b back on the empty Redis");
    (a, b, boot)
}

/// After an empty Redis restart, the rig resumes the same boot on B before A, which keeps its
/// session parked, is back on Redis: B finds nothing and welcomes it `resumed: false`. When A
/// puts its copy back, merged into the session B started, B is told (`session_merged`) and
/// gives the rig its unacked commands at once, in order. Before, they waited for control's
/// next command to the rig, which was refused as stale (a black-box review: 5 of 6 runs).
#[test]
fn a_rig_resumed_elsewhere_before_its_parked_session_went_back_is_given_its_commands() {
    let mut redis = RedisServer::start();
    let relay = Relay::start(redis.port());
    // fe-a stays away from Redis until the rig has resumed on fe-b.
    let (_a, b, boot) =
        parked_on_a_through_an_empty_restart(&mut redis, &relay, "rig-m", "m", &[], true, false);
    let (mut on_b, welcome) = connect_hello(&b, "rig-m", &boot, Some(0));
    assert_eq!(welcome["resumed"], false, "Redis had nothing: {welcome}");
    relay.down(false);
    read_command(&mut on_b, 1, "m1");
    read_command(&mut on_b, 2, "m2");
    let mut ctl = Control::new(&redis, &[]);
    send_and_read(&mut ctl, "fe-b", "rig-m", "m3", &mut on_b, 3);
}

/// A broker away from Redis when its drain ends, while Redis restarts empty: back within the
/// drain's wait for it, Redis gets the sessions the broker keeps parked, as at any reconnect,
/// so a rig that resumed elsewhere meanwhile is given its unacked commands there. Before, the
/// broker reconnected only to flush its events and releases, and exited without a word about
/// the sessions (a black-box review: 10 of 10 rigs, every run).
#[test]
fn a_broker_draining_through_an_empty_restart_puts_its_parked_sessions_back() {
    let mut redis = RedisServer::start();
    let relay = Relay::start(redis.port());
    let drain = ["--drain", "0s"];
    let (mut a, b, boot) =
        parked_on_a_through_an_empty_restart(&mut redis, &relay, "rig-d", "d", &drain, true, false);
    a.sigterm();
    let (mut on_b, welcome) = connect_hello(&b, "rig-d", &boot, Some(0));
    assert_eq!(welcome["resumed"], false, "Redis had nothing: {welcome}");
    relay.down(false);
    read_command(&mut on_b, 1, "d1");
    read_command(&mut on_b, 2, "d2");
    let status = a.wait_exit(Duration::from_secs(15)).expect("fe-a exited");
    assert!(status.success(), "{status:?}");
}

/// After an empty Redis restart the rig resumes on fe-b (which finds nothing: `resumed:
/// false`, a new session from seq 1) and, still connected there, says hello to fe-a, cut off
/// from Redis, which resumes it alone from its parked copy and gives it seqs 1 and 2, acked.
/// Back on Redis, fe-a finds the lease on fe-b and closes its connection (4410); its copy goes
/// back up to the rig's last ack, so fe-b numbers past it. Before, a connection that had
/// delivered nothing unkept sent nothing back, and fe-b gave seq 1 again, to another command
/// (a black-box review: deterministic).
#[test]
fn a_rig_back_on_a_broker_deciding_alone_after_an_empty_restart_keeps_its_seqs() {
    let mut redis = RedisServer::start();
    let relay = Relay::start(redis.port());
    // Left unread: parked on fe-a with both commands.
    let (a, b, boot) =
        parked_on_a_through_an_empty_restart(&mut redis, &relay, "rig-r", "r", &[], false, false);
    let (_on_b, welcome) = connect_hello(&b, "rig-r", &boot, None);
    assert_eq!(welcome["resumed"], false, "Redis had nothing: {welcome}");
    let (mut on_a, welcome) = connect_hello(&a, "rig-r", &boot, None);
    assert_eq!(welcome["resumed"], true, "fe-a's parked copy: {welcome}");
    for i in 1..=2u64 {
        read_command(&mut on_a, i, format!("r{i}"));
        ack(&mut on_a, i);
    }
    eventually(Duration::from_secs(10), "fe-a took both acks", || {
        a.http("GET", "/v1/rigs", "")
            .1
            .contains("\"last_ack_seq\":2")
    });
    relay.down(false);
    assert_eq!(read_close(&mut on_a), 4410);
    eventually(Duration::from_secs(15), "fe-b numbers past seq 2", || {
        b.metric("fleetlink_registry_ops_total{op=\"rekeep\",result=\"behind\"}") >= 1
    });
    let mut ctl = Control::new(&redis, &[]);
    let r = ctl.command_id("fe-b", "rig-r", "r3", "n", json!({}));
    assert_eq!(r["seq"], 3, "seqs 1 and 2 are the rig's already: {r}");
}

/// The same drain through an empty restart, the rig never coming back: the parked session goes
/// back with its commands and is named in `sess:lapses` again on the way out (Redis lost the
/// name with the rest), so fe-b's sweep reports both commands `expired` at the session's end.
/// Before, fe-a's own watch ended with it, and they lapsed unreported (a black-box review: 3 of
/// 3 runs).
#[test]
fn a_broker_draining_through_an_empty_restart_names_the_sessions_it_put_back() {
    let mut redis = RedisServer::start();
    let relay = Relay::start(redis.port());
    let args = ["--drain", "0s", "--session-ttl", "10s"];
    let (mut a, _b, _) =
        parked_on_a_through_an_empty_restart(&mut redis, &relay, "rig-e", "e", &args, true, true);
    let mut ctl = Control::new(&redis, &["fleetlink:events"]);
    a.sigterm();
    // Redis comes back in the wait at the drain's end: not to fe-a's running loop, whose
    // reconnect would put everything back anyway.
    a.wait_log(&["draining while Redis is away"]);
    relay.down(false);
    let status = a.wait_exit(Duration::from_secs(15)).expect("fe-a exited");
    assert!(status.success(), "{status:?}");
    let named: usize = redis.connection().zcard("sess:lapses").unwrap();
    assert_eq!(named, 1, "rig-e's session named on fe-a's way out");
    let mut expired: Vec<String> = (0..2)
        .map(|_| ctl.next_event("expired")["id"].as_str().unwrap().to_owned())
        .collect();
    expired.sort();
    assert_eq!(expired, ["e1", "e2"]);
}
