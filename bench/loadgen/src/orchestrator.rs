//! The `rigs` subcommand as seen by the user: splits the rigs over workers (in-process for one,
//! re-exec'd children for more, since a process may hold at most 20,000 descriptors), prints
//! progress and the single `ALL_WELCOMED` line, holds, stops the workers and merges their reports.

use std::io::Write;
use std::net::{IpAddr, SocketAddr};
use std::process::Stdio;
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{bail, Context, Result};
use tokio::io::{AsyncBufReadExt, AsyncWriteExt, BufReader};
use tokio::process::{Child, ChildStdin};
use tokio::signal::unix::{signal, SignalKind};
use tokio::sync::{mpsc, watch, Notify, Semaphore};

use crate::cli::{parse_labels, parse_ws_url, split_slices, RigsArgs};
use crate::progress::{self, Unit};
use crate::report::{Counters, FinalReport, Progress, WorkerReport};
use crate::rig::{ExecLog, Ramp, RigEnv};
use crate::tls::TlsClient;
use crate::worker::{emit_stdout, run_worker, WorkerMsg};

/// Exit codes: 0 every rig welcomed; 2 some were not; 1 (from main) setup errors.
pub const EXIT_INCOMPLETE: i32 = 2;

/// How long stopped workers get to send their reports before children are killed.
const REPORT_GRACE: Duration = Duration::from_secs(15);

enum Event {
    Msg(usize, WorkerMsg),
    Exited(usize),
}

enum Handle {
    InProc(watch::Sender<bool>),
    Child {
        child: Box<Child>,
        stdin: Option<ChildStdin>,
    },
}

impl Handle {
    async fn stop(&mut self) {
        match self {
            Handle::InProc(tx) => {
                let _ = tx.send(true);
            }
            Handle::Child { stdin, .. } => {
                if let Some(mut s) = stdin.take() {
                    let _ = s.write_all(b"stop\n").await;
                    // dropping closes the pipe: EOF also means stop
                }
            }
        }
    }

    fn kill(&mut self) {
        if let Handle::Child { child, .. } = self {
            let _ = child.start_kill();
        }
    }
}

/// Builds the shared rig environment for the worker of rigs `[start, start + count)`.
async fn rig_env(
    args: &RigsArgs,
    start: usize,
    count: usize,
    deadline: tokio::time::Instant,
) -> Result<RigEnv> {
    let (url, tls) = parse_ws_url(&args.url)?;
    args.check_tls_flags(tls)?;
    let tls = match &args.ca {
        Some(ca) if tls => Some(TlsClient::new(
            ca,
            args.tls_cert.as_deref().zip(args.tls_key.as_deref()),
            &args.server_name,
        )?),
        _ => None,
    };
    let addr: SocketAddr = tokio::net::lookup_host((url.host.as_str(), url.port))
        .await
        .with_context(|| format!("resolving {}", url.host))?
        .find(SocketAddr::is_ipv4)
        .or_else(|| {
            url.host
                .parse::<IpAddr>()
                .ok()
                .map(|ip| SocketAddr::new(ip, url.port))
        })
        .with_context(|| format!("no address for {}", url.host))?;
    let loopback_v4 = matches!(addr.ip(), IpAddr::V4(ip) if ip.is_loopback());
    let sources = args.effective_sources(loopback_v4)?;
    if !sources.is_empty() && !addr.is_ipv4() {
        bail!("--sources are IPv4 but the target {addr} is not");
    }
    let labels = parse_labels(&args.labels)?;
    let exec_log = match &args.exec_log {
        Some(path) if count > 0 => {
            let mut file = path.clone().into_os_string();
            file.push(format!(".{start}"));
            let file = std::path::PathBuf::from(file);
            Some(ExecLog::create(&file).with_context(|| format!("creating {}", file.display()))?)
        }
        _ => None,
    };
    Ok(RigEnv {
        addr,
        url: args.url.clone(),
        prefix: args.prefix.clone(),
        id_width: args.id_width,
        tls,
        labels_json: serde_json::to_string(&labels)?,
        sources,
        handshake_timeout: args.handshake_timeout,
        deadline,
        ws_config: RigEnv::small_ws_config(),
        counters: Arc::new(Counters::new(count)),
        permits: Semaphore::new(args.concurrency.max(1)),
        ramp: Ramp::new(args.ramp_rate, args.rigs, start, count),
        settled: Notify::new(),
        reconnect: args.reconnect.then_some(args.reconnect_backoff),
        exec_log,
        timeline_bucket_ms: (args.timeline_bucket.as_millis() as u64).max(1),
        no_ack: args.no_ack,
    })
}

/// Child mode: run one slice, talk JSON lines on stdout, stop on "stop"/EOF on stdin or a signal.
pub async fn run_child(args: RigsArgs, start: usize, count: usize) -> Result<i32> {
    crate::worker::raise_nofile_limit();
    // Retries stop at the run's bound; the parent normally stops us well before our own safety.
    let deadline = tokio::time::Instant::now() + args.max_time;
    let env = Arc::new(rig_env(&args, start, count, deadline).await?);
    let (stop_tx, stop_rx) = watch::channel(false);
    let safety = args.max_time + Duration::from_secs(20);
    tokio::spawn(async move {
        let mut term = signal(SignalKind::terminate()).ok();
        let mut lines = BufReader::new(tokio::io::stdin()).lines();
        tokio::select! {
            _ = async { while let Ok(Some(l)) = lines.next_line().await { if l.trim() == "stop" { break; } } } => {}
            _ = async { match term.as_mut() { Some(t) => { t.recv().await; } None => std::future::pending().await } } => {}
            _ = tokio::signal::ctrl_c() => {}
            _ = tokio::time::sleep(safety) => {}
        }
        let _ = stop_tx.send(true);
    });
    run_worker(env, start, count, stop_rx, emit_stdout).await;
    Ok(0)
}

/// Re-executes this binary as a child over one slice.
fn spawn_child(args: &RigsArgs, start: usize, count: usize) -> Result<(Child, ChildStdin)> {
    let exe = std::env::current_exe().context("locating own executable")?;
    let ms = |d: Duration| format!("{}ms", d.as_millis());
    let mut cmd = tokio::process::Command::new(exe);
    cmd.arg("rigs")
        .args(["--url", &args.url])
        .args(["--rigs", &args.rigs.to_string()])
        .args(["--prefix", &args.prefix])
        .args(["--id-width", &args.id_width.to_string()])
        .args(["--server-name", &args.server_name])
        .args(["--labels", &args.labels])
        .args(["--concurrency", &args.concurrency.to_string()])
        .args(["--ramp-rate", &args.ramp_rate.to_string()])
        .args(["--hold", &ms(args.hold)])
        .args(["--max-time", &ms(args.max_time)])
        .args(["--handshake-timeout", &ms(args.handshake_timeout)])
        .args(["--reconnect-backoff", &ms(args.reconnect_backoff)])
        .args(["--timeline-bucket", &ms(args.timeline_bucket)])
        .args(["--child-slice", &format!("{start}:{count}")]);
    if args.reconnect {
        cmd.arg("--reconnect");
    }
    if args.no_ack {
        cmd.arg("--no-ack");
    }
    if let Some(p) = &args.exec_log {
        cmd.arg("--exec-log").arg(p);
    }
    if let Some(s) = &args.sources {
        cmd.args(["--sources", s]);
    }
    for (flag, path) in [
        ("--ca", &args.ca),
        ("--tls-cert", &args.tls_cert),
        ("--tls-key", &args.tls_key),
    ] {
        if let Some(p) = path {
            cmd.arg(flag).arg(p);
        }
    }
    cmd.stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::inherit())
        .kill_on_drop(true);
    let mut child = cmd.spawn().context("spawning child")?;
    let stdin = child.stdin.take().context("child stdin")?;
    Ok((child, stdin))
}

/// Per-worker state as the parent sees it.
#[derive(Default)]
struct WorkerView {
    progress: Progress,
    report: Option<WorkerReport>,
    exited: bool,
}

impl WorkerView {
    fn settled(&self) -> bool {
        self.exited || (self.progress.settled() && self.progress.total > 0)
    }
}

fn total_progress(views: &[WorkerView]) -> Progress {
    let mut p = Progress::default();
    views.iter().for_each(|v| p.add(&v.progress));
    p
}

/// Prints one stdout line and flushes at once: scripts block on it. (No lock is held across an
/// await, so `run_parent` stays `Send`.)
fn print_line(line: &str) {
    let mut out = std::io::stdout().lock();
    let _ = writeln!(out, "{line}");
    let _ = out.flush();
}

/// Parent mode: the whole `rigs` run. Returns the process exit code.
pub async fn run_parent(args: RigsArgs) -> Result<i32> {
    let started = Instant::now();
    let deadline = tokio::time::Instant::now() + args.max_time;
    let procs = args.effective_procs()?;
    let slices = split_slices(args.start_index, args.rigs, procs);
    let (tx, mut rx) = mpsc::unbounded_channel::<Event>();
    let mut handles = Vec::new();
    let sources_n;

    if slices.len() <= 1 {
        crate::worker::raise_nofile_limit();
        let (start, count) = slices.first().copied().unwrap_or((args.start_index, 0));
        let env = Arc::new(rig_env(&args, start, count, deadline).await?);
        sources_n = env.sources.len();
        let (stop_tx, stop_rx) = watch::channel(false);
        let tx2 = tx.clone();
        tokio::spawn(async move {
            let emit = |m| {
                let _ = tx2.send(Event::Msg(0, m));
            };
            run_worker(env, start, count, stop_rx, emit).await;
            let _ = tx2.send(Event::Exited(0));
        });
        handles.push(Handle::InProc(stop_tx));
    } else {
        // Validate once here so a bad flag fails fast rather than in every child.
        sources_n = rig_env(&args, 0, 0, deadline).await?.sources.len();
        for (i, &(start, count)) in slices.iter().enumerate() {
            let (mut child, stdin) = spawn_child(&args, start, count)?;
            let stdout = child.stdout.take().context("child stdout")?;
            let tx2 = tx.clone();
            tokio::spawn(async move {
                let mut lines = BufReader::new(stdout).lines();
                while let Ok(Some(line)) = lines.next_line().await {
                    match serde_json::from_str::<WorkerMsg>(&line) {
                        Ok(m) => {
                            let _ = tx2.send(Event::Msg(i, m));
                        }
                        Err(_) => eprintln!("loadgen: child {i}: unexpected output: {line}"),
                    }
                }
                let _ = tx2.send(Event::Exited(i));
            });
            handles.push(Handle::Child {
                child: Box::new(child),
                stdin: Some(stdin),
            });
        }
    }
    drop(tx);

    let mut views: Vec<WorkerView> = (0..handles.len()).map(|_| WorkerView::default()).collect();
    let apply = |views: &mut Vec<WorkerView>, ev: Event| match ev {
        Event::Msg(i, WorkerMsg::Progress(p)) => views[i].progress = p,
        Event::Msg(i, WorkerMsg::Report(r)) => views[i].report = Some(*r),
        Event::Exited(i) => views[i].exited = true,
    };
    let mut term = signal(SignalKind::terminate()).context("SIGTERM handler")?;
    let mut tick = tokio::time::interval(progress::REDRAW_EVERY);
    tick.tick().await;
    let mut exit_reason = None;

    // Ramp: until every worker has settled (each rig welcomed or failed for good).
    let all_settled = |views: &[WorkerView]| views.iter().all(WorkerView::settled);
    let ramp_detail = |p: &Progress| {
        format!(
            "connected={} welcomed={} failed={} retries_503={}",
            p.open, p.welcomed, p.failed, p.retries_503
        )
    };
    let mut bar = progress::Bar::new("loadgen ramp", args.rigs as u64, Unit::Count("rigs"));
    while exit_reason.is_none() && !all_settled(&views) {
        tokio::select! {
            ev = rx.recv() => match ev {
                Some(ev) => apply(&mut views, ev),
                None => exit_reason = Some("workers_gone"),
            },
            _ = tick.tick() => {
                let p = total_progress(&views);
                bar.update(p.welcomed + p.failed, &ramp_detail(&p));
            }
            _ = tokio::time::sleep_until(deadline) => exit_reason = Some("max_time"),
            _ = term.recv() => exit_reason = Some("signal"),
            _ = tokio::signal::ctrl_c() => exit_reason = Some("signal"),
        }
    }
    let p = total_progress(&views);
    bar.finish(p.welcomed + p.failed, &ramp_detail(&p));
    // The one line that says how the ramp ended, cut short or not.
    let elapsed = started.elapsed().as_millis() as u64;
    let all_welcomed = exit_reason.is_none() && p.welcomed as usize == args.rigs;
    let ramp_ms = exit_reason.is_none().then_some(elapsed);
    print_line(&if all_welcomed {
        format!("ALL_WELCOMED rigs={} elapsed_ms={elapsed}", args.rigs)
    } else {
        let cut = exit_reason.map(|why| format!(" stopped_by={why}"));
        format!(
            "RAMP_INCOMPLETE rigs={} welcomed={} failed={} elapsed_ms={elapsed}{}",
            args.rigs,
            p.welcomed,
            p.failed,
            cut.unwrap_or_default()
        )
    });
    if exit_reason.is_none() {
        eprintln!(
            "loadgen: ramp done in {elapsed} ms: welcomed={} failed={}; holding {:?}",
            p.welcomed, p.failed, args.hold
        );

        // Hold: keep draining events (children's pipes must not fill) until hold/max-time/signal,
        // or until `--until-commands` commands have arrived.
        let hold_end = (tokio::time::Instant::now() + args.hold).min(deadline);
        let enough = |views: &[WorkerView]| {
            args.until_commands
                .is_some_and(|n| total_progress(views).commands >= n)
        };
        // The hold's bar counts toward what ends it: the commands awaited, else the time.
        let hold_total = args
            .hold
            .min(deadline.saturating_duration_since(tokio::time::Instant::now()));
        let mut bar = match args.until_commands {
            Some(n) => progress::Bar::new("loadgen commands", n, Unit::Count("commands")),
            None => progress::Bar::new("loadgen hold", hold_total.as_millis() as u64, Unit::Millis),
        };
        let hold_started = tokio::time::Instant::now();
        let hold_done = |views: &[WorkerView]| match args.until_commands {
            Some(_) => total_progress(views).commands,
            None => hold_started.elapsed().as_millis() as u64,
        };
        let hold_detail = |p: &Progress| {
            format!(
                "commands={} welcomed={} open={} failed={}",
                p.commands, p.welcomed, p.open, p.failed
            )
        };
        while exit_reason.is_none() {
            // Without --reconnect a closed rig stays closed: once none is open there is
            // nothing left to hold (every rig failed, or the broker went away).
            if !args.reconnect && total_progress(&views).open == 0 {
                exit_reason = Some("none_open");
                break;
            }
            if enough(&views) {
                exit_reason = Some("until_commands");
                // Before the rigs close: scripts measuring the broker stop their clocks here.
                print_line(&format!(
                    "COMMANDS_DONE commands={}",
                    total_progress(&views).commands
                ));
                break;
            }
            tokio::select! {
                ev = rx.recv() => match ev {
                    Some(ev) => apply(&mut views, ev),
                    None => exit_reason = Some("workers_gone"),
                },
                _ = tokio::time::sleep_until(hold_end) => {
                    exit_reason = Some(if hold_end < deadline { "hold_elapsed" } else { "max_time" });
                }
                _ = tick.tick() => bar.update(hold_done(&views), &hold_detail(&total_progress(&views))),
                _ = term.recv() => exit_reason = Some("signal"),
                _ = tokio::signal::ctrl_c() => exit_reason = Some("signal"),
            }
        }
        bar.finish(hold_done(&views), &hold_detail(&total_progress(&views)));
    }

    // Stop and collect reports.
    for h in &mut handles {
        h.stop().await;
    }
    let grace_end = tokio::time::Instant::now() + REPORT_GRACE;
    while !views.iter().all(|v| v.exited) {
        tokio::select! {
            ev = rx.recv() => match ev {
                Some(ev) => apply(&mut views, ev),
                None => break,
            },
            _ = tokio::time::sleep_until(grace_end) => {
                eprintln!("loadgen: workers did not report within {REPORT_GRACE:?}; killing");
                handles.iter_mut().for_each(Handle::kill);
                break;
            }
        }
    }
    for h in &mut handles {
        if let Handle::Child { child, .. } = h {
            let _ = tokio::time::timeout(Duration::from_secs(2), child.wait()).await;
        }
    }

    let mut merged = WorkerReport::default();
    let mut lost = 0;
    for v in &views {
        match &v.report {
            Some(r) => merged.merge(r),
            None => lost += 1,
        }
    }
    let report = FinalReport {
        url: args.url.clone(),
        rigs: args.rigs as u64,
        start_index: args.start_index as u64,
        procs: views.len() as u64,
        sources: sources_n as u64,
        all_welcomed,
        ramp_ms,
        elapsed_ms: started.elapsed().as_millis() as u64,
        exit_reason: exit_reason.unwrap_or("hold_elapsed").to_string(),
        children_lost: lost,
        welcomed: merged.welcomed,
        failed: merged.failed,
        failed_by_reason: merged.failed_by_reason.clone(),
        retries_503: merged.retries_503,
        retries_4503: merged.retries_4503,
        dropped_after_welcome: merged.dropped_after_welcome,
        commands_received: merged.commands_received,
        acks_sent: merged.acks_sent,
        goaways: merged.goaways,
        close_codes: merged.close_codes.clone(),
        latency_us: merged.latency_us.summary(),
        handshake_us: merged.handshake_us.summary(),
        first_command_unix_us: merged.first_command_unix_us,
        last_command_unix_us: merged.last_command_unix_us,
        reconnects: merged.reconnects,
        resumed: merged.resumed,
        sessions_restarted: merged.sessions_restarted,
        reconnect_failures_by_reason: merged.reconnect_failures_by_reason.clone(),
        executed: merged.executed,
        duplicates: merged.duplicates,
        seq_gaps: merged.seq_gaps,
        seqs_missing: merged.seqs_missing,
        goaway_delay_ms: merged.goaway_delay_ms.summary(),
        reconnect_gap_us: merged.reconnect_gap_us.summary(),
        timeline_bucket_ms: args.timeline_bucket.as_millis() as u64,
        reconnect_timeline: merged.reconnect_timeline.clone(),
    };
    let json = serde_json::to_string_pretty(&report)?;
    match args.report.as_deref() {
        Some("-") => {
            // A reader that went away (`| head`) must not turn the run into a panic.
            let mut out = std::io::stdout().lock();
            if let Err(e) = writeln!(out, "{json}").and_then(|()| out.flush()) {
                eprintln!("loadgen: the report could not be written to stdout: {e}");
            }
        }
        Some(path) => {
            std::fs::write(path, format!("{json}\n")).with_context(|| format!("writing {path}"))?
        }
        None => {}
    }
    eprintln!(
        "loadgen: done ({}) welcomed={} failed={} dropped_after_welcome={} commands={} latency_us p50={:?} p99={:?} max={:?}",
        report.exit_reason,
        report.welcomed,
        report.failed,
        report.dropped_after_welcome,
        report.commands_received,
        report.latency_us.p50,
        report.latency_us.p99,
        report.latency_us.max
    );
    if !report.failed_by_reason.is_empty() {
        eprintln!("loadgen: failed by reason: {:?}", report.failed_by_reason);
    }
    // Without --reconnect a rig the broker dropped stays gone: the hold did not hold it.
    let dropped = !args.reconnect && report.dropped_after_welcome > 0;
    if dropped {
        eprintln!(
            "loadgen: {} rigs lost their connection after the welcome and were not held (close codes: {:?}); exit {EXIT_INCOMPLETE}",
            report.dropped_after_welcome, report.close_codes
        );
    }
    Ok(if all_welcomed && lost == 0 && !dropped {
        0
    } else {
        EXIT_INCOMPLETE
    })
}
