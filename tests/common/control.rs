//! A control client over Redis, as `redis-cli`/redis-py would be: publishes requests on broker
//! channels and reads replies and events from its own subscription. Messages read but not yet
//! asked for are kept, so no test loses one to another's read.

use std::collections::VecDeque;
use std::time::{Duration, Instant};

use fleetlink::registry::pubsub::Subscriber;
use redis::{Commands, IntoConnectionInfo};
use serde_json::{json, Value};

use super::broker::{boot_id, eventually, read_json, Ws};
use super::redis::RedisServer;

/// Publishes control messages and collects what comes back.
pub struct Control {
    con: redis::Connection,
    sub: Subscriber,
    /// This client's reply channel (subscribed before anything is published).
    pub reply_to: String,
    backlog: VecDeque<(String, Value)>,
}

impl Control {
    /// Subscribes to a fresh reply channel and `extra` channels (e.g. `fleetlink:events`).
    pub fn new(redis: &RedisServer, extra: &[&str]) -> Control {
        let reply_to = format!("fleetlink:reply:{}", boot_id());
        let mut channels = vec![reply_to.clone()];
        channels.extend(extra.iter().map(|s| s.to_string()));
        let info = redis.url().into_connection_info().unwrap();
        let mut sub = Subscriber::connect(&info, &channels, Duration::from_secs(5)).unwrap();
        eventually(Duration::from_secs(5), "subscribed", || {
            sub.read().unwrap();
            sub.confirmed == channels.len()
        });
        Control {
            // With a read timeout: a PUBLISH to a frozen Redis fails the test, not hangs it.
            con: redis.connection(),
            sub,
            reply_to,
            backlog: VecDeque::new(),
        }
    }

    /// PUBLISHes `msg` on `channel`.
    pub fn publish(&mut self, channel: &str, msg: Value) {
        let _: i64 = self.con.publish(channel, msg.to_string()).unwrap();
    }

    /// The first message (oldest first) that `want` accepts, waiting up to 10 s.
    pub fn next(&mut self, want: impl FnMut(&str, &Value) -> bool) -> Value {
        self.next_within(Duration::from_secs(10), want)
    }

    /// [`Control::next`], waiting up to `limit` (what comes only as a session lapses).
    pub fn next_within(
        &mut self,
        limit: Duration,
        mut want: impl FnMut(&str, &Value) -> bool,
    ) -> Value {
        let deadline = Instant::now() + limit;
        loop {
            self.take_in();
            if let Some(i) = self.backlog.iter().position(|(ch, v)| want(ch, v)) {
                return self.backlog.remove(i).map(|(_, v)| v).unwrap();
            }
            assert!(Instant::now() < deadline, "no matching message in time");
            std::thread::sleep(Duration::from_millis(2));
        }
    }

    /// Reads what has arrived so far into the messages not yet taken.
    pub fn take_in(&mut self) {
        for push in self.sub.read().unwrap() {
            self.backlog
                .push_back((push.channel, serde_json::from_slice(&push.payload).unwrap()));
        }
    }

    /// How many of the messages already read and not yet taken `want` accepts.
    pub fn backlog_count(&self, mut want: impl FnMut(&str, &Value) -> bool) -> usize {
        self.backlog.iter().filter(|(ch, v)| want(ch, v)).count()
    }

    /// The next `n` replies on this client's reply channel, in arrival order.
    pub fn replies(&mut self, n: usize, limit: Duration) -> Vec<Value> {
        let deadline = Instant::now() + limit;
        let reply_to = self.reply_to.clone();
        (0..n)
            .map(|_| {
                assert!(Instant::now() < deadline, "replies too slow");
                self.next(|ch, _| ch == reply_to)
            })
            .collect()
    }

    /// Sends a command for `rig` to `broker` with command id `id`; returns its reply.
    pub fn command_id(
        &mut self,
        broker: &str,
        rig: &str,
        id: &str,
        name: &str,
        args: Value,
    ) -> Value {
        let msg = json!({"type":"command","id":id,"rig_id":rig,"name":name,"args":args,"reply_to":self.reply_to});
        self.publish(&format!("fleetlink:broker:{broker}"), msg);
        let reply_to = self.reply_to.clone();
        self.next(|ch, v| ch == reply_to && v["id"] == id)
    }

    /// Sends a command with a fresh id; returns its reply.
    pub fn command(&mut self, broker: &str, rig: &str, name: &str, args: Value) -> Value {
        self.command_id(broker, rig, &boot_id(), name, args)
    }

    /// The next event of type `kind` on `fleetlink:events` (this control must subscribe to it).
    pub fn next_event(&mut self, kind: &str) -> Value {
        self.next(|ch, v| ch == "fleetlink:events" && v["type"] == kind)
    }
}

/// Control sends command `id` to `rig` through `broker`: the reply numbers it `seq`, and it
/// is the next thing the rig reads.
pub fn send_and_read(ctl: &mut Control, broker: &str, rig: &str, id: &str, ws: &mut Ws, seq: u64) {
    let r = ctl.command_id(broker, rig, id, "n", json!({}));
    assert_eq!(r["seq"], seq, "{r}");
    assert_eq!(
        read_json(ws)["seq"],
        seq,
        "{rig} read another seq than {id}'s"
    );
}
