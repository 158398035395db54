//! Operator-facing prose that changes with the docs, not with the code: a long table kept out
//! of the way of the rendering it feeds.

/// `# HELP` text of each family, in the order they are rendered.
pub(super) const HELP: &[(&str, &str)] = &[
    (
        "fleetlink_admin_responses_total",
        "Admin HTTP answers given, by status code (\"other\" for any status not listed).",
    ),
    (
        "fleetlink_admin_unfinished_total",
        "Admin requests closed unanswered because they had not arrived whole within 5 s.",
    ),
    (
        "fleetlink_admin_idle_closed_total",
        "Idle admin keep-alive connections closed to make room for a new one when 1,024 were waiting.",
    ),
    (
        "fleetlink_admin_slow_refused_total",
        "Admin requests still arriving answered 503, the one arriving longest first, to make room for a new connection when 1,024 were waiting and none was idle.",
    ),
    (
        "fleetlink_info",
        "Always 1; labels say the mode (standalone or fleet), broker id and version.",
    ),
    (
        "fleetlink_connections",
        "Open TCP connections per core, in any phase.",
    ),
    (
        "fleetlink_driver",
        "Always 1; the driver label says the core's event loop: io_uring or epoll.",
    ),
    (
        "fleetlink_accepts_total",
        "Accepted TCP connections by result (503s and sheds included).",
    ),
    (
        "fleetlink_upgrades_total",
        "Websocket upgrade requests by result (ok or the HTTP status refused with).",
    ),
    (
        "fleetlink_messages_in_total",
        "Inbound rig messages by type.",
    ),
    (
        "fleetlink_commands_total",
        "Commands by what happened to them.",
    ),
    (
        "fleetlink_pings_sent_total",
        "Websocket PINGs sent to rigs.",
    ),
    (
        "fleetlink_pongs_received_total",
        "Websocket PONGs received from rigs in answer to the last PING.",
    ),
    (
        "fleetlink_rig_rate_paused_total",
        "Times a rig's reads were paused for exceeding --rig-rate.",
    ),
    (
        "fleetlink_rig_events_paused_total",
        "Times a rig's reads were paused for 10 ms because the events waiting for the bridge neared their 64 MiB bound.",
    ),
    (
        "fleetlink_tiny_reads_paused_total",
        "Times a connection's reads were paused because it sent its bytes a few at a time (each read under 256 bytes, leaving a frame or TLS record unfinished), which would otherwise cost a wakeup and a read per byte.",
    ),
    (
        "fleetlink_bridge_queue_full_total",
        "Messages refused by a full cross-thread queue, by sender.",
    ),
    (
        "fleetlink_kicks_total",
        "Rigs kicked (closed with 1012) by control.",
    ),
    (
        "fleetlink_tls_handshake_failures_total",
        "TLS handshakes that failed.",
    ),
    (
        "fleetlink_identity_mismatch_total",
        "Hellos whose rig_id is not the identity the connection proved, its TLS client certificate or its bearer token's rig_id (4403).",
    ),
    (
        "fleetlink_forbidden_total",
        "Commands or events a rig's token did not allow.",
    ),
    (
        "fleetlink_admin_routes_total",
        "Admin commands by the route they took to the rig's core.",
    ),
    (
        "fleetlink_admin_connections_moved_total",
        "Admin connections moved to the core holding the rigs they command.",
    ),
    (
        "fleetlink_admin_refused_total",
        "Admin requests refused 503: request_memory, while they arrived, a core's connections held all the unfinished request bytes they may; answer_memory, the answer built, a core's connections held all the answer bytes being sent they may.",
    ),
    (
        "fleetlink_closes_total",
        "Rig connections closed, by close code (1006: without a close frame).",
    ),
    (
        "fleetlink_outbox_full_total",
        "Commands answered rig_unresponsive because the rig's outbox was full.",
    ),
    (
        "fleetlink_ack_latency_seconds",
        "Time from writing a command to the rig's ack.",
    ),
    (
        "fleetlink_rigs",
        "Welcomed rigs by the value of their --group-label hello label.",
    ),
    (
        "fleetlink_group_commands_total",
        "Commands by the rig's --group-label value and result: enqueued, written, acked, outbox_full (answered rig_unresponsive).",
    ),
    (
        "fleetlink_group_closes_total",
        "Welcomed rigs' connections closed, by their --group-label value and close code (codes not seen are left out).",
    ),
    (
        "fleetlink_group_ack_latency_seconds",
        "Time from writing a command to the rig's ack, by the rig's --group-label value.",
    ),
    (
        "fleetlink_redis_up",
        "1 while Redis answers; always 0 standalone, which has no Redis (see fleetlink_info's mode).",
    ),
    (
        "fleetlink_registry_ops_total",
        "Registry operations by op and result (standalone: op=refused, offline but for forwarded and connected_elsewhere, parked/dropped and parked/expired, and resume/rebooted: commands a new boot dropped).",
    ),
    (
        "fleetlink_pubsub_messages_total",
        "Redis pub/sub messages by direction (fleet mode only).",
    ),
    (
        "fleetlink_bridge_queue_depth",
        "Messages waiting in the bridge's inbox.",
    ),
    ("fleetlink_draining", "1 from the start of a drain."),
    (
        "fleetlink_tls_cert_expiry_timestamp_seconds",
        "When the served TLS certificate expires (Unix time).",
    ),
    (
        "fleetlink_tls_crl_next_update_timestamp_seconds",
        "The earliest nextUpdate of the CRLs in force (Unix time): past it they are stale.",
    ),
    (
        "fleetlink_tls_reloads_total",
        "TLS reloads by result: ok (put in force) or failed (a bad file; the config in force stays).",
    ),
    (
        "fleetlink_heap_live_bytes",
        "Live heap bytes (heap-stats builds only).",
    ),
    (
        "fleetlink_heap_live_allocations",
        "Live heap allocations (heap-stats builds only).",
    ),
];
