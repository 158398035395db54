//! A worker runs one slice of the rigs inside one process: it spawns the rig tasks, emits
//! progress (at once when its ramp settles, else periodically) and, once stopped, its report.
//! The same code runs in-process (`--procs 1`) and in child processes (JSON lines on stdout).

use std::io::Write;
use std::sync::Arc;
use std::time::Duration;

use serde::{Deserialize, Serialize};
use tokio::sync::watch;
use tokio::task::JoinSet;

use crate::report::{Progress, WorkerReport};
use crate::rig::{run_rig, RigEnv};

/// Worker to parent messages (one JSON object per stdout line in child mode).
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(tag = "t", rename_all = "snake_case")]
pub enum WorkerMsg {
    Progress(Progress),
    Report(Box<WorkerReport>),
}

/// Progress cadence while ramping and once settled. Progress is only emitted when it changed, so
/// an idle hold sends nothing; while commands arrive the parent learns their count within a
/// quarter second (for `--until-commands`).
const RAMP_TICK: Duration = Duration::from_millis(250);
const HOLD_TICK: Duration = Duration::from_millis(250);
/// How long rig tasks get to close their sockets after stop.
const CLOSE_GRACE: Duration = Duration::from_secs(5);

/// Runs rigs `[start, start+count)` until `stop` is set, then returns the report (also emitted).
pub async fn run_worker(
    env: Arc<RigEnv>,
    start: usize,
    count: usize,
    mut stop: watch::Receiver<bool>,
    emit: impl Fn(WorkerMsg),
) -> WorkerReport {
    let mut tasks = JoinSet::new();
    for index in start..start + count {
        tasks.spawn(run_rig(env.clone(), index, stop.clone()));
    }
    if count == 0 {
        env.settled.notify_one();
    }
    let mut last_sent: Option<Progress> = None;
    loop {
        let tick = if env.counters.ramp_settled() {
            HOLD_TICK
        } else {
            RAMP_TICK
        };
        tokio::select! {
            _ = tokio::time::sleep(tick) => {}
            _ = env.settled.notified() => {}
            r = stop.changed() => {
                if r.is_err() || *stop.borrow() { break; }
            }
        }
        if let Some(log) = &env.exec_log {
            log.flush();
        }
        let p = env.counters.progress();
        if last_sent != Some(p) {
            emit(WorkerMsg::Progress(p));
            last_sent = Some(p);
        }
    }
    let _ = tokio::time::timeout(CLOSE_GRACE, async {
        while tasks.join_next().await.is_some() {}
    })
    .await;
    tasks.abort_all();
    if let Some(log) = &env.exec_log {
        log.flush();
    }
    let report = env.counters.report();
    emit(WorkerMsg::Progress(env.counters.progress()));
    emit(WorkerMsg::Report(Box::new(report.clone())));
    report
}

/// Child-mode emitter: one JSON line per message on stdout, flushed so the parent sees it now.
pub fn emit_stdout(msg: WorkerMsg) {
    if let Ok(line) = serde_json::to_string(&msg) {
        let mut out = std::io::stdout().lock();
        let _ = writeln!(out, "{line}");
        let _ = out.flush();
    }
}

/// Raises the soft open-files limit to the hard one (20,000 here): sockets are the workload.
pub fn raise_nofile_limit() -> libc::rlim_t {
    let mut lim = libc::rlimit {
        rlim_cur: 0,
        rlim_max: 0,
    };
    // SAFETY: getrlimit/setrlimit with a valid pointer to an rlimit struct.
    unsafe {
        if libc::getrlimit(libc::RLIMIT_NOFILE, &mut lim) == 0 {
            lim.rlim_cur = lim.rlim_max;
            libc::setrlimit(libc::RLIMIT_NOFILE, &lim);
        }
    }
    lim.rlim_cur
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::report::Counters;

    #[test]
    fn messages_round_trip_as_json_lines() {
        let c = Counters::new(3);
        c.command(1_000, Some(900));
        let line = serde_json::to_string(&WorkerMsg::Report(Box::new(c.report()))).unwrap();
        assert!(!line.contains('\n'));
        match serde_json::from_str::<WorkerMsg>(&line).unwrap() {
            WorkerMsg::Report(r) => assert_eq!(*r, c.report()),
            WorkerMsg::Progress(_) => panic!("wrong variant"),
        }
        let line = serde_json::to_string(&WorkerMsg::Progress(c.progress())).unwrap();
        assert!(
            matches!(serde_json::from_str(&line).unwrap(), WorkerMsg::Progress(p) if p.total == 3)
        );
    }
}
