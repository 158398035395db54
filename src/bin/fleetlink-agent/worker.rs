//! The worker thread: runs accepted commands one at a time, in seq order, so the connection
//! thread keeps reading (and answering pings) while a command runs. It outlives connections:
//! a command accepted before a disconnect finishes, and its result waits for the next one.
//!
//! Both channels are bounded: `--max-pending` jobs (the session stops accepting beyond it) and
//! as many results (the worker waits while the agent is disconnected and the results are full).

use std::fs::{File, OpenOptions};
use std::io::Write;
use std::path::Path;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::mpsc::{self, Receiver, SyncSender};
use std::sync::Arc;
use std::thread;

use anyhow::Context;
use serde_json::Value;

use crate::handler::Handler;
use crate::proto::Command;

/// An accepted command.
pub(crate) struct Job {
    /// The command, its `args` left out (null) while it waits: see `args`.
    cmd: Command,
    /// Its `args` as JSON text, parsed again when its turn comes. Kept parsed, a waiting
    /// command took up to 16 times its text (each array element a 32-byte value): 64 MiB of
    /// waiting text was about 1 GB (review bb98).
    args: Box<str>,
    /// The bytes of the command as it came, counted in [`MAX_QUEUED_BYTES`] until it has run.
    size: usize,
}

impl Job {
    pub(crate) fn new(mut cmd: Command, size: usize) -> Job {
        let args = std::mem::take(&mut cmd.args).to_string().into_boxed_str();
        Job { cmd, args, size }
    }

    /// The command whole again, and its size.
    fn take(self) -> (Command, usize) {
        let mut cmd = self.cmd;
        // Text this agent wrote from a value: it parses (a failure would read as no args).
        cmd.args = serde_json::from_str(&self.args).unwrap_or_default();
        (cmd, self.size)
    }
}

/// Most bytes of accepted commands waiting for the worker or running (beside `--max-pending`,
/// which counts them): a broker sending many big commands to a rig busy with a long one would
/// otherwise grow the agent by up to `--max-pending` times the largest message.
pub(crate) const MAX_QUEUED_BYTES: usize = 64 << 20;

/// A finished command, to be sent as `result`.
#[derive(Debug)]
pub(crate) struct Done {
    pub(crate) seq: u64,
    pub(crate) ok: bool,
    pub(crate) output: Value,
}

/// `--exec-log`: one fsync'd line per executed command, so fault tests can count executions.
pub(crate) struct ExecLog {
    file: File,
}

impl ExecLog {
    /// Opens (creates) `path` for appending.
    pub(crate) fn open(path: &Path) -> anyhow::Result<ExecLog> {
        let file = OpenOptions::new()
            .create(true)
            .append(true)
            .open(path)
            .with_context(|| format!("opening --exec-log {}", path.display()))?;
        Ok(ExecLog { file })
    }

    fn record(&mut self, cmd: &Command, ok: bool) -> std::io::Result<()> {
        let line = format!(
            "seq={} id={} name={} ok={ok}\n",
            cmd.seq,
            token(&cmd.id),
            token(&cmd.name)
        );
        self.file.write_all(line.as_bytes())?;
        self.file.sync_data()
    }
}

/// Keeps a log line's fields one whitespace-free token each.
fn token(s: &str) -> String {
    if s.is_empty() {
        return "-".into();
    }
    s.chars()
        .map(|c| {
            if c.is_whitespace() || c.is_control() {
                '_'
            } else {
                c
            }
        })
        .collect()
}

/// Gives a job's bytes back to the count when dropped, whichever way its turn ends.
struct Freed<'a>(&'a AtomicUsize, usize);

impl Drop for Freed<'_> {
    fn drop(&mut self) {
        self.0.fetch_sub(self.1, Ordering::SeqCst);
    }
}

/// Starts the worker; it ends when the job sender is dropped.
pub(crate) fn spawn(
    mut handler: Box<dyn Handler>,
    mut exec_log: Option<ExecLog>,
    max_pending: usize,
    abandon: Arc<AtomicBool>,
    queued: Arc<AtomicUsize>,
) -> anyhow::Result<(SyncSender<Job>, Receiver<Done>)> {
    let (job_tx, job_rx) = mpsc::sync_channel::<Job>(max_pending);
    let (done_tx, done_rx) = mpsc::sync_channel::<Done>(max_pending);
    thread::Builder::new()
        .name("agent-worker".into())
        .spawn(move || {
            for job in job_rx {
                let (cmd, size) = job.take();
                // Its bytes are freed once it has run (or been reported not run), before its
                // result waits (a result is capped at --max-message); given back on any way out.
                let freed = Freed(&queued, size);
                // The agent is stopping: what it accepted and has not started ends now, as a
                // result saying so. It was acked, so the broker will not send it again, and
                // control must hear it did not run rather than nothing at all.
                if abandon.load(Ordering::SeqCst) {
                    log::warn!(
                        "seq={} name={} not run: the agent is stopping (reported ok:false)",
                        cmd.seq,
                        cmd.name
                    );
                    let done = Done {
                        seq: cmd.seq,
                        ok: false,
                        output: serde_json::json!({"error": "not run: the agent stopped first"}),
                    };
                    drop(freed);
                    if done_tx.send(done).is_err() {
                        return;
                    }
                    continue;
                }
                let outcome = handler.handle(&cmd);
                log::info!(
                    "finished seq={} name={} ok={}",
                    cmd.seq,
                    cmd.name,
                    outcome.ok
                );
                if outcome.executed {
                    if let Some(log) = exec_log.as_mut() {
                        if let Err(e) = log.record(&cmd, outcome.ok) {
                            log::error!("writing --exec-log: {e}");
                        }
                    }
                }
                let done = Done {
                    seq: cmd.seq,
                    ok: outcome.ok,
                    output: outcome.output,
                };
                drop(freed);
                if done_tx.send(done).is_err() {
                    return;
                }
            }
        })?;
    Ok((job_tx, done_rx))
}

#[cfg(test)]
mod tests {
    use super::*;

    use std::time::Duration;

    use serde_json::json;

    use crate::handler::Outcome;

    struct Echo;

    impl Handler for Echo {
        fn handle(&mut self, cmd: &Command) -> Outcome {
            Outcome {
                ok: cmd.name != "fail",
                output: cmd.args.clone(),
                executed: cmd.name != "refuse",
            }
        }
    }

    #[test]
    fn runs_in_order_and_logs_executed_commands() {
        let dir = std::env::temp_dir().join(format!("agent-worker-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join("exec.log");
        let _ = std::fs::remove_file(&path);
        let abandon = Arc::new(AtomicBool::new(false));
        let queued = Arc::new(AtomicUsize::new(0));
        let (jobs, done) = spawn(
            Box::new(Echo),
            Some(ExecLog::open(&path).unwrap()),
            4,
            abandon.clone(),
            queued.clone(),
        )
        .unwrap();
        for (seq, name) in [(1, "a"), (2, "refuse"), (3, "fail"), (4, "with space")] {
            let cmd = Command {
                seq,
                id: format!("id {seq}"),
                name: name.into(),
                args: json!({"n": seq}),
            };
            queued.fetch_add(100, Ordering::SeqCst);
            jobs.send(Job::new(cmd, 100)).unwrap();
        }
        let got: Vec<Done> = (0..4)
            .map(|_| {
                done.recv_timeout(Duration::from_secs(10))
                    .expect("a job done")
            })
            .collect();
        assert_eq!(got.iter().map(|d| d.seq).collect::<Vec<_>>(), [1, 2, 3, 4]);
        assert_eq!(
            queued.load(Ordering::SeqCst),
            0,
            "every job's bytes given back"
        );
        assert!(!got[2].ok);
        assert_eq!(got[3].output["n"], 4);
        let log = std::fs::read_to_string(&path).unwrap();
        assert_eq!(
            log,
            "seq=1 id=id_1 name=a ok=true\nseq=3 id=id_3 name=fail ok=false\nseq=4 id=id_4 name=with_space ok=true\n"
        );
        let _ = std::fs::remove_dir_all(&dir);
    }
}
