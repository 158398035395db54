// Included by fuzz/fuzz_targets/control_msg.rs (libFuzzer) and by tests/fuzz_checks.rs (the seeds and
// their mutations under `cargo test`): one set of checks for both.
use fleetlink::ids::{RigId, Seq, CONTROL_NAME_MAX};
use fleetlink::protocol::encode_command;
use fleetlink::registry::control::{forwarded_hold, offline_ttl, parse, Bad, Control};
use fleetlink::registry::msg::ReplyTo;
use fleetlink::registry::offline::MAX_TTL;
use serde_json::{json, Value};
use std::time::Duration;

fn check_bad(bad: &Bad) {
    if let Some((_, channel)) = &bad.reply_to {
        assert!(!channel.is_empty(), "answered on an empty channel");
        assert!(
            channel.len() <= CONTROL_NAME_MAX,
            "answered on a {}-byte channel",
            channel.len()
        );
    }
}

fn check_name_args(name: &str, args: &fleetlink::args::Args) {
    assert!(
        !name.is_empty() && name.len() <= 128,
        "name of {} bytes",
        name.len()
    );
    let parsed: Value = serde_json::from_str(args.get()).expect("args a rig cannot parse");
    assert!(parsed.is_object(), "args not an object: {}", args.get());
}

fn reparse(msg: &Value, broadcast: bool) -> Control {
    let text = serde_json::to_vec(msg).expect("serialise");
    match parse(&text, broadcast) {
        Ok(c) => c,
        Err(bad) => panic!(
            "the broker's own message is refused ({}): {}",
            bad.why,
            String::from_utf8_lossy(&text)
        ),
    }
}

fn check_on(data: &[u8], broadcast: bool) {
    let control = match parse(data, broadcast) {
        Ok(c) => c,
        Err(bad) => return check_bad(&bad),
    };
    match control {
        Control::Command(req) => {
            assert!(
                !broadcast,
                "a single-rig command from the broadcast channel"
            );
            assert_eq!(RigId::parse(req.rig.as_str()).as_ref(), Some(&req.rig));
            check_name_args(&req.name, &req.args);
            if let Some(ttl) = req.offline_ttl {
                assert!(ttl >= Duration::from_millis(1) && ttl <= MAX_TTL, "{ttl:?}");
            }
            let frame = encode_command(1, Seq(1), &req.id, &req.name, req.args.raw());
            let sent: Value = serde_json::from_slice(&frame).expect("a command frame is JSON");
            assert_eq!(sent["id"].as_str(), Some(req.id.as_str()));
            assert_eq!(sent["name"].as_str(), Some(req.name.as_str()));
            assert!(
                !req.id.is_empty() && req.id.len() <= CONTROL_NAME_MAX,
                "id of {} bytes",
                req.id.len()
            );
            match &req.reply {
                ReplyTo::Channel(channel) => {
                    assert!(!channel.is_empty() && channel.len() <= CONTROL_NAME_MAX)
                }
                ReplyTo::Event => assert!(req.offline_ttl.is_some()),
                other => panic!("control names no such reply: {other:?}"),
            }
            // As another broker forwards a held command to the rig's broker (bridge/holds.rs).
            let left = req.offline_ttl.unwrap_or(MAX_TTL).as_millis() as u64;
            let forwarded = forwarded_hold(&req.id, &req.rig, &req.name, &req.args, left);
            let again = match parse(&forwarded, false) {
                Ok(Control::Command(again)) => again,
                Ok(_) => panic!("a forwarded command is not a command"),
                Err(bad) => panic!(
                    "the broker's own message is refused ({}): {}",
                    bad.why,
                    String::from_utf8_lossy(&forwarded)
                ),
            };
            assert_eq!(
                (&again.id, &again.rig, &again.name),
                (&req.id, &req.rig, &req.name)
            );
            assert_eq!(again.args.get(), req.args.get(), "args changed on the way");
            assert!(matches!(again.reply, ReplyTo::Event));
            assert_eq!(again.offline_ttl, Some(offline_ttl(Some(left))));
        }
        Control::Broadcast {
            id,
            selector,
            name,
            args,
            reply_to,
        } => {
            assert!(broadcast, "a broadcast from a broker's own channel");
            assert!(!reply_to.is_empty() && reply_to.len() <= CONTROL_NAME_MAX);
            assert!(!id.is_empty() && id.len() <= CONTROL_NAME_MAX, "id of {} bytes", id.len());
            check_name_args(&name, &args);
            let sel: serde_json::Map<String, Value> = selector
                .iter()
                .map(|(k, v)| (k.clone(), Value::from(v.as_str())))
                .collect();
            let msg = json!({"type": "command", "id": id, "selector": sel, "name": name,
                             "args": args, "reply_to": reply_to});
            let Control::Broadcast {
                id: id2,
                selector: sel2,
                name: name2,
                reply_to: reply_to2,
                ..
            } = reparse(&msg, true)
            else {
                panic!("a broadcast is not a broadcast");
            };
            assert_eq!((id2, name2, reply_to2), (id, name, reply_to));
            let (mut s1, mut s2) = (selector, sel2);
            s1.sort();
            s1.dedup_by(|a, b| a.0 == b.0);
            s2.sort();
            assert_eq!(s1, s2);
        }
        Control::Kick { id, rig, reply_to } => {
            assert!(!broadcast, "a kick from the broadcast channel");
            assert!(!reply_to.is_empty() && reply_to.len() <= CONTROL_NAME_MAX);
            assert!(!id.is_empty() && id.len() <= CONTROL_NAME_MAX, "id of {} bytes", id.len());
            let msg =
                json!({"type": "kick", "id": id, "rig_id": rig.as_str(), "reply_to": reply_to});
            let Control::Kick {
                id: id2,
                rig: rig2,
                reply_to: reply_to2,
            } = reparse(&msg, false)
            else {
                panic!("a kick is not a kick");
            };
            assert_eq!((id2, rig2, reply_to2), (id, rig, reply_to));
        }
        Control::Evict { rig, boot } => {
            assert!(!broadcast, "an evict from the broadcast channel");
            // As bridge/hellos.rs sends it.
            let msg = json!({"type": "evict", "rig_id": rig.as_str(), "boot_id": boot.as_str()});
            let Control::Evict {
                rig: rig2,
                boot: boot2,
            } = reparse(&msg, false)
            else {
                panic!("an evict is not an evict");
            };
            assert_eq!((rig2, boot2), (rig, boot));
        }
        Control::Merged { rig, boot } => {
            assert!(!broadcast, "a session_merged notice from the broadcast channel");
            // As a broker that put its parked copy back sends it.
            let msg = json!({"type": "session_merged", "rig_id": rig.as_str(), "boot_id": boot.as_str()});
            let Control::Merged {
                rig: rig2,
                boot: boot2,
            } = reparse(&msg, false)
            else {
                panic!("a session_merged notice is not one");
            };
            assert_eq!((rig2, boot2), (rig, boot));
        }
        Control::Canary {
            broker_id,
            instance,
        } => {
            // As bridge/upkeep.rs sends it.
            let msg = json!({"type": "canary", "broker_id": broker_id, "instance": instance,
                             "at": 1_700_000_000_000u64});
            let Control::Canary {
                broker_id: b2,
                instance: i2,
            } = reparse(&msg, broadcast)
            else {
                panic!("a canary is not a canary");
            };
            assert_eq!((b2, i2), (broker_id, instance));
        }
    }
}

/// The checks on one input, on a broker's own channel and on the broadcast channel.
pub fn check(data: &[u8]) {
    check_on(data, false);
    check_on(data, true);
}
