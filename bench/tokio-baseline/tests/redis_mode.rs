//! Redis mode end to end: the baseline binary against its own redis-server (a free port, no
//! persistence), driven by tokio-tungstenite rigs and a redis client playing control.

use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use futures_util::{SinkExt, StreamExt};
use redis::AsyncCommands;
use serde_json::{json, Value};
use tokio_tungstenite::tungstenite::Message;

mod common;
use common::{http_get, Broker};

const OLD: &str = "017f22e2-79b0-7cc3-98c4-dc0c0c07398f";
const NEW: &str = "019f22e2-79b0-7cc3-98c4-dc0c0c07398f";
const NEWER: &str = "01af22e2-79b0-7cc3-98c4-dc0c0c07398f";
const WAIT: Duration = Duration::from_secs(10);

/// A redis-server of our own on a free port; stopped on drop.
struct Redis {
    child: Child,
    url: String,
}

impl Drop for Redis {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

async fn start_redis() -> Redis {
    for _ in 0..5 {
        // A port the kernel just handed out (and we released): free unless someone races us.
        let port = std::net::TcpListener::bind("127.0.0.1:0")
            .unwrap()
            .local_addr()
            .unwrap()
            .port();
        if let Some(r) = redis_on(port).await {
            return r;
        }
    }
    panic!("could not start redis-server");
}

/// A redis-server on `port`, once it answers as itself (PING, and `INFO server` naming this
/// child's pid, so a stranger that took the port is never mistaken for ours); None if it exited
/// (port taken) or did not answer within [`WAIT`].
async fn redis_on(port: u16) -> Option<Redis> {
    let mut child = Command::new("redis-server")
        .args(["--port", &port.to_string(), "--bind", "127.0.0.1"])
        .args(["--save", "", "--appendonly", "no"])
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .expect("redis-server");
    let url = format!("redis://127.0.0.1:{port}/");
    let deadline = Instant::now() + WAIT;
    while Instant::now() < deadline {
        if child.try_wait().unwrap().is_some() {
            break; // lost the port race: try another
        }
        if answers_as(&url, child.id()).await {
            return Some(Redis { child, url });
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let _ = child.kill();
    let _ = child.wait();
    None
}

/// True once the server at `url` answers PING and reports `pid` as its `process_id`; every
/// step bounded, so a server that accepts but never answers counts as not ready.
async fn answers_as(url: &str, pid: u32) -> bool {
    let probe = async {
        let client = redis::Client::open(url).ok()?;
        let mut con = client.get_multiplexed_async_connection().await.ok()?;
        let pong: String = redis::cmd("PING").query_async(&mut con).await.ok()?;
        let info: String = redis::cmd("INFO")
            .arg("server")
            .query_async(&mut con)
            .await
            .ok()?;
        let ours = format!("process_id:{pid}");
        Some(pong == "PONG" && info.lines().any(|l| l.trim() == ours))
    };
    matches!(
        tokio::time::timeout(Duration::from_secs(1), probe).await,
        Ok(Some(true))
    )
}

async fn start_broker(redis: &Redis, id: &str, extra: &[&str]) -> Broker {
    let mut args = vec!["--workers", "2", "--redis", &redis.url, "--broker-id", id];
    args.extend_from_slice(extra);
    let b = common::start(id, &args);
    // Ready = our own canary came back through the subscription.
    let deadline = Instant::now() + WAIT;
    while !http_get(&b.admin, "/readyz")
        .await
        .starts_with("HTTP/1.1 200")
    {
        assert!(Instant::now() < deadline, "{id} not ready");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    b
}

type Client =
    tokio_tungstenite::WebSocketStream<tokio_tungstenite::MaybeTlsStream<tokio::net::TcpStream>>;

async fn hello(b: &Broker, rig: &str, boot: &str, labels: Value) -> Client {
    let (mut ws, _) = tokio_tungstenite::connect_async(format!("ws://{}/agent", b.rigs))
        .await
        .unwrap();
    let h = json!({"type": "hello", "rig_id": rig, "boot_id": boot, "version": "t",
                   "labels": labels});
    ws.send(Message::text(h.to_string())).await.unwrap();
    ws
}

/// The next JSON message, or `{"close": code}` (pings and pongs skipped).
async fn next_msg(ws: &mut Client) -> Value {
    loop {
        match tokio::time::timeout(WAIT, ws.next())
            .await
            .expect("timeout")
        {
            Some(Ok(Message::Text(t))) => return serde_json::from_str(&t).unwrap(),
            Some(Ok(Message::Close(f))) => {
                return json!({"close": f.map_or(0, |f| u16::from(f.code))})
            }
            Some(Ok(_)) => {}
            other => return json!({"end": format!("{other:?}")}),
        }
    }
}

/// A control client: a command connection plus a subscription to replies and events.
struct Control {
    con: redis::aio::MultiplexedConnection,
    msgs: redis::aio::PubSubStream,
}

impl Control {
    async fn new(redis: &Redis, channels: &[&str]) -> Control {
        let client = redis::Client::open(redis.url.as_str()).unwrap();
        let con = client.get_multiplexed_async_connection().await.unwrap();
        let mut ps = client.get_async_pubsub().await.unwrap();
        ps.subscribe(channels).await.unwrap();
        Control {
            con,
            msgs: ps.into_on_message(),
        }
    }

    async fn publish(&mut self, channel: &str, v: Value) {
        let _: i64 = self.con.publish(channel, v.to_string()).await.unwrap();
    }

    async fn get(&mut self, key: &str) -> Option<String> {
        self.con.get(key).await.unwrap()
    }

    /// The next message on `channel` for which `pick` holds (others skipped).
    async fn wait_for(&mut self, channel: &str, pick: impl Fn(&Value) -> bool) -> Value {
        let deadline = tokio::time::Instant::now() + WAIT;
        loop {
            let msg = tokio::time::timeout_at(deadline, self.msgs.next())
                .await
                .unwrap_or_else(|_| panic!("nothing matching on {channel}"))
                .expect("subscription ended");
            if msg.get_channel_name() != channel {
                continue;
            }
            let v: Value = serde_json::from_slice(msg.get_payload_bytes()).unwrap();
            if pick(&v) {
                return v;
            }
        }
    }

    /// Polls `key` until it holds `want` (None = gone).
    async fn wait_key(&mut self, key: &str, want: Option<&str>) {
        let deadline = Instant::now() + WAIT;
        loop {
            let got = self.get(key).await;
            if got.as_deref() == want {
                return;
            }
            assert!(Instant::now() < deadline, "{key} = {got:?}, want {want:?}");
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn registry_commands_and_events() {
    let redis = start_redis().await;
    let mut ctl = Control::new(&redis, &["replies", "fleetlink:events"]).await;
    let b = start_broker(&redis, "tb-a", &[]).await;

    // The liveness key.
    let blob: Value = serde_json::from_str(&ctl.get("broker:tb-a").await.unwrap()).unwrap();
    assert_eq!(blob["broker_id"], "tb-a");

    // hello writes the lease, and `connected` is published.
    let mut rig = hello(&b, "r1", OLD, json!({"group": "g1"})).await;
    assert_eq!(next_msg(&mut rig).await["type"], "welcome");
    assert_eq!(
        ctl.get("rig:r1").await.as_deref(),
        Some(&*format!("{OLD}|tb-a"))
    );
    let ev = ctl
        .wait_for("fleetlink:events", |v| v["type"] == "connected")
        .await;
    assert_eq!(
        (&ev["rig_id"], &ev["broker_id"]),
        (&json!("r1"), &json!("tb-a"))
    );

    // A command on the broker's channel reaches the rig; the reply carries its seq.
    let cmd = json!({"type": "command", "id": "c1", "rig_id": "r1", "name": "reboot",
                     "args": {"x": 1}, "reply_to": "replies"});
    ctl.publish("fleetlink:broker:tb-a", cmd).await;
    let got = next_msg(&mut rig).await;
    assert_eq!(
        got,
        json!({"type": "command", "seq": 1, "id": "c1", "name": "reboot", "args": {"x": 1}})
    );
    let reply = ctl.wait_for("replies", |v| v["id"] == "c1").await;
    assert_eq!(
        reply,
        json!({"id": "c1", "ok": true, "rig_id": "r1", "seq": 1})
    );

    // The ack is published with the command's id.
    rig.send(Message::text(r#"{"type":"ack","seq":1}"#))
        .await
        .unwrap();
    let ev = ctl
        .wait_for("fleetlink:events", |v| v["type"] == "ack")
        .await;
    assert_eq!((&ev["seq"], &ev["id"]), (&json!(1), &json!("c1")));

    // Errors: an unknown rig, a malformed command.
    let cmd = json!({"type": "command", "id": "c2", "rig_id": "ghost", "name": "x",
                     "reply_to": "replies"});
    ctl.publish("fleetlink:broker:tb-a", cmd).await;
    let reply = ctl.wait_for("replies", |v| v["id"] == "c2").await;
    assert_eq!(
        (&reply["ok"], &reply["error"], &reply["rig_id"]),
        (&json!(false), &json!("rig_not_connected"), &json!("ghost"))
    );
    let cmd = json!({"type": "command", "id": "c3", "rig_id": "r1", "name": "x", "args": [1],
                     "reply_to": "replies"});
    ctl.publish("fleetlink:broker:tb-a", cmd).await;
    let reply = ctl.wait_for("replies", |v| v["id"] == "c3").await;
    assert_eq!(reply["error"], "bad_request");

    // A broadcast: one reply from this broker, with what matched.
    let cmd = json!({"type": "command", "id": "b1", "selector": {"group": "g1"}, "name": "x",
                     "reply_to": "replies"});
    ctl.publish("fleetlink:broadcast", cmd).await;
    let reply = ctl.wait_for("replies", |v| v["id"] == "b1").await;
    assert_eq!(
        (&reply["broker_id"], &reply["matched"], &reply["enqueued"]),
        (&json!("tb-a"), &json!(1), &json!(1))
    );
    assert_eq!(next_msg(&mut rig).await["seq"], 2);

    // An older boot is refused with 4409 and writes nothing.
    let mut older = hello(&b, "r1", "0170f2e2-79b0-7cc3-98c4-dc0c0c07398f", json!({})).await;
    assert_eq!(next_msg(&mut older).await, json!({"close": 4409}));
    assert_eq!(
        ctl.get("rig:r1").await.as_deref(),
        Some(&*format!("{OLD}|tb-a"))
    );

    // Kick: 1012, and the clean disconnect releases the lease.
    let cmd = json!({"type": "kick", "id": "k1", "rig_id": "r1", "reply_to": "replies"});
    ctl.publish("fleetlink:broker:tb-a", cmd).await;
    let reply = ctl.wait_for("replies", |v| v["id"] == "k1").await;
    assert_eq!(reply, json!({"id": "k1", "ok": true, "rig_id": "r1"}));
    assert_eq!(next_msg(&mut rig).await, json!({"close": 1012}));
    ctl.wait_key("rig:r1", None).await;
    let ev = ctl
        .wait_for("fleetlink:events", |v| v["type"] == "disconnected")
        .await;
    assert_eq!((&ev["rig_id"], &ev["code"]), (&json!("r1"), &json!(1012)));

    let metrics = http_get(&b.admin, "/metrics").await;
    assert!(
        metrics.contains("fleetlink_registry_ops_total{op=\"hello\",result=\"older\"} 1\n"),
        "{metrics}"
    );
    assert!(metrics.contains("fleetlink_redis_up 1\n"), "{metrics}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn takeover_across_brokers_and_refresh() {
    let redis = start_redis().await;
    let mut ctl = Control::new(&redis, &["unused"]).await;
    // A long refresh on A: its socket must go by the evict, not by a refresh.
    let a = start_broker(&redis, "tb-a", &["--registry-refresh", "60s"]).await;
    let b = start_broker(&redis, "tb-b", &["--registry-refresh", "200ms"]).await;

    let mut on_a = hello(&a, "r2", OLD, json!({})).await;
    assert_eq!(next_msg(&mut on_a).await["type"], "welcome");
    let started = Instant::now();
    let mut on_b = hello(&b, "r2", NEW, json!({})).await;
    assert_eq!(next_msg(&mut on_b).await["type"], "welcome");
    assert_eq!(next_msg(&mut on_a).await, json!({"close": 4410}));
    assert!(started.elapsed() < Duration::from_secs(5));
    ctl.wait_key("rig:r2", Some(&format!("{NEW}|tb-b"))).await;
    // A's cleanup did not delete B's entry.
    assert_eq!(
        ctl.get("rig:r2").await.as_deref(),
        Some(&*format!("{NEW}|tb-b"))
    );
    // An older boot on A is refused by the registry, though A no longer holds the rig.
    let mut stale = hello(&a, "r2", OLD, json!({})).await;
    assert_eq!(next_msg(&mut stale).await, json!({"close": 4409}));

    // Refresh: the lease is kept; when someone else's entry replaces it, B closes with 4410.
    let _: () = redis::cmd("PEXPIRE")
        .arg("rig:r2")
        .arg(1500)
        .query_async(&mut ctl.con)
        .await
        .unwrap();
    let deadline = Instant::now() + WAIT;
    loop {
        let ttl: i64 = redis::cmd("PTTL")
            .arg("rig:r2")
            .query_async(&mut ctl.con)
            .await
            .unwrap();
        if ttl > 10_000 {
            break; // extended to --registry-ttl (60 s) by a refresh
        }
        assert!(
            Instant::now() < deadline,
            "lease not refreshed (pttl {ttl})"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let _: () = ctl
        .con
        .set("rig:r2", format!("{NEWER}|tb-elsewhere"))
        .await
        .unwrap();
    assert_eq!(next_msg(&mut on_b).await, json!({"close": 4410}));
    assert_eq!(
        ctl.get("rig:r2").await.as_deref(),
        Some(&*format!("{NEWER}|tb-elsewhere")),
        "a superseded broker releases nothing"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn redis_restart_restores_leases() {
    let redis = start_redis().await;
    let port: u16 = redis
        .url
        .trim_end_matches('/')
        .rsplit(':')
        .next()
        .unwrap()
        .parse()
        .unwrap();
    let b = start_broker(&redis, "tb-r", &["--registry-refresh", "60s"]).await;
    let mut rig = hello(&b, "r3", OLD, json!({})).await;
    assert_eq!(next_msg(&mut rig).await["type"], "welcome");

    // Redis comes back empty on the same port: the broker resubscribes, writes its lease again
    // at once (not at the next 60 s refresh) and is ready again.
    drop(redis);
    let deadline = Instant::now() + WAIT;
    let redis = loop {
        if let Some(r) = redis_on(port).await {
            break r;
        }
        assert!(Instant::now() < deadline, "port {port} not reusable");
    };
    let mut ctl = Control::new(&redis, &["unused"]).await;
    ctl.wait_key("rig:r3", Some(&format!("{OLD}|tb-r"))).await;
    let deadline = Instant::now() + WAIT;
    while !http_get(&b.admin, "/readyz")
        .await
        .starts_with("HTTP/1.1 200")
    {
        assert!(Instant::now() < deadline, "not ready after the restart");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    // The rig stayed connected and commands flow again.
    let cmd = json!({"type": "command", "id": "c9", "rig_id": "r3", "name": "x",
                     "reply_to": "unused"});
    ctl.publish("fleetlink:broker:tb-r", cmd).await;
    assert_eq!(next_msg(&mut rig).await["id"], "c9");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn session_ttl_keeps_each_command_before_writing_it() {
    let redis = start_redis().await;
    let mut ctl = Control::new(&redis, &["replies"]).await;
    let b = start_broker(&redis, "tb-k", &["--session-ttl", "60s"]).await;
    let sess = format!("sess:r3:{OLD}");
    let mut rig = hello(&b, "r3", OLD, json!({})).await;
    assert_eq!(next_msg(&mut rig).await["type"], "welcome");

    // Written only once kept: Redis holds exactly the text the rig got, and "next" moved on.
    let cmd = json!({"type": "command", "id": "c1", "rig_id": "r3", "name": "dmesg",
                     "args": {"lines": 500}, "reply_to": "replies"});
    ctl.publish("fleetlink:broker:tb-k", cmd).await;
    let got = next_msg(&mut rig).await;
    assert_eq!(got["seq"], 1);
    let kept: Option<String> = ctl.con.hget(&sess, "c:1").await.unwrap();
    let kept: Value = serde_json::from_str(&kept.expect("c:1 kept before it was written")).unwrap();
    assert_eq!(kept, got);
    let next: Option<String> = ctl.con.hget(&sess, "next").await.unwrap();
    assert_eq!(next.as_deref(), Some("2"));
    let ttl: i64 = ctl.con.pttl(&sess).await.unwrap();
    assert!(ttl > 50_000 && ttl <= 60_000, "session ttl {ttl}");
    let reply = ctl.wait_for("replies", |v| v["id"] == "c1").await;
    assert_eq!(
        reply,
        json!({"id": "c1", "ok": true, "rig_id": "r3", "seq": 1})
    );

    // The ack forgets it.
    rig.send(Message::text(r#"{"type":"ack","seq":1}"#))
        .await
        .unwrap();
    let deadline = Instant::now() + WAIT;
    while ctl.con.hexists::<_, _, bool>(&sess, "c:1").await.unwrap() {
        assert!(Instant::now() < deadline, "acked c:1 still kept");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }

    // Another broker's lease fences the keep: control hears rig_not_connected and the
    // command is never written (the next one the rig sees is seq 3).
    let _: () = ctl
        .con
        .set("rig:r3", format!("{NEW}|tb-elsewhere"))
        .await
        .unwrap();
    let cmd = json!({"type": "command", "id": "c2", "rig_id": "r3", "name": "x",
                     "reply_to": "replies"});
    ctl.publish("fleetlink:broker:tb-k", cmd).await;
    let reply = ctl.wait_for("replies", |v| v["id"] == "c2").await;
    assert_eq!(
        (&reply["ok"], &reply["error"]),
        (&json!(false), &json!("rig_not_connected"))
    );
    let _: () = ctl.con.set("rig:r3", format!("{OLD}|tb-k")).await.unwrap();
    let cmd = json!({"type": "command", "id": "c3", "rig_id": "r3", "name": "x",
                     "reply_to": "replies"});
    ctl.publish("fleetlink:broker:tb-k", cmd).await;
    let got = next_msg(&mut rig).await;
    assert_eq!((&got["seq"], &got["id"]), (&json!(3), &json!("c3")));
    let fenced: Option<String> = ctl.con.hget(&sess, "c:2").await.unwrap();
    assert_eq!(fenced, None);

    let metrics = http_get(&b.admin, "/metrics").await;
    for line in [
        "fleetlink_registry_ops_total{op=\"persist\",result=\"ok\"} 2\n",
        "fleetlink_registry_ops_total{op=\"persist\",result=\"fenced\"} 1\n",
        "fleetlink_registry_ops_total{op=\"forget\",result=\"ok\"} 1\n",
    ] {
        assert!(metrics.contains(line), "{line}: {metrics}");
    }
}
