//! What a command does on the rig. [`Handler`] is the seam; [`Allowlist`] is the default: run
//! the program named by the command, if `--allow`ed, with `args.argv` as its arguments (no
//! shell), stdout and stderr captured up to a cap, killed at a timeout.
//!
//! Called only from the worker thread, one command at a time, in seq order.

use std::collections::BTreeSet;
use std::io::Read;
use std::os::unix::process::{CommandExt, ExitStatusExt};
use std::process::{Child, ExitStatus, Stdio};
use std::sync::atomic::{AtomicI32, Ordering};
use std::sync::{mpsc, Arc, Mutex};
use std::thread;
use std::time::{Duration, Instant};

use serde_json::{json, Value};

use crate::proto::{error_output, Command};

/// How often a running command's exit is polled.
const POLL: Duration = Duration::from_millis(10);
/// After the program exits, how long its pipes may stay open (a daemonized grandchild) before
/// the process group is killed so the output can be collected.
const PIPE_GRACE: Duration = Duration::from_millis(500);

/// What running a command came to.
#[derive(Debug, Clone, PartialEq)]
pub(crate) struct Outcome {
    /// The result's `ok`.
    pub(crate) ok: bool,
    /// The result's `output`.
    pub(crate) output: Value,
    /// Whether anything was executed (an exec-log line is written only then).
    pub(crate) executed: bool,
}

impl Outcome {
    fn refused(why: &str) -> Outcome {
        Outcome {
            ok: false,
            output: error_output(why),
            executed: false,
        }
    }
}

/// Runs commands. Implementations must not panic on any `args` the broker relays.
pub(crate) trait Handler: Send {
    /// Runs `cmd` to completion.
    fn handle(&mut self, cmd: &Command) -> Outcome;
}

/// The process group of the command running now (0 = none, [`Running::STOPPED`] once the
/// agent is stopping), so a stopping agent can kill it.
#[derive(Clone, Default)]
pub(crate) struct Running(Arc<AtomicI32>);

impl Running {
    /// The agent is stopping: a command spawned from now on is killed at once.
    const STOPPED: i32 = -1;

    /// Kills the running command's process group, if any, and any spawned after. A command
    /// the worker was just starting (past its check of the stop, not yet spawned) would
    /// otherwise run its whole course, holding every result behind it past the wind-down.
    pub(crate) fn kill(&self) {
        let pgid = self.0.swap(Self::STOPPED, Ordering::SeqCst);
        if pgid > 0 {
            kill_group(pgid);
        }
    }

    /// Records `pgid` as running; false when the agent is stopping (the caller kills it).
    fn start(&self, pgid: i32) -> bool {
        self.0
            .compare_exchange(0, pgid, Ordering::SeqCst, Ordering::SeqCst)
            .is_ok()
    }

    /// `pgid` has ended (a stop, once set, stays).
    fn end(&self, pgid: i32) {
        let _ = self
            .0
            .compare_exchange(pgid, 0, Ordering::SeqCst, Ordering::SeqCst);
    }
}

/// The default handler: programs named by `--allow`, nothing else.
pub(crate) struct Allowlist {
    allow: BTreeSet<String>,
    output_cap: usize,
    default_timeout: Duration,
    running: Running,
}

impl Allowlist {
    pub(crate) fn new(
        allow: BTreeSet<String>,
        output_cap: usize,
        default_timeout: Duration,
        running: Running,
    ) -> Self {
        Self {
            allow,
            output_cap,
            default_timeout,
            running,
        }
    }
}

impl Handler for Allowlist {
    fn handle(&mut self, cmd: &Command) -> Outcome {
        if !self.allow.contains(&cmd.name) {
            return Outcome::refused("not allowed");
        }
        // CONTRACT.md §2: args is an object (null counts as none, as a missing one does);
        // anything else is not taken for an empty one.
        if !(cmd.args.is_object() || cmd.args.is_null()) {
            return Outcome::refused("bad args: args must be an object");
        }
        let argv = match cmd.args.get("argv") {
            None | Some(Value::Null) => Vec::new(),
            Some(Value::Array(items)) => {
                match items
                    .iter()
                    .map(|v| v.as_str().map(str::to_string))
                    .collect::<Option<Vec<_>>>()
                {
                    Some(argv) => argv,
                    None => return Outcome::refused("bad args: argv must be an array of strings"),
                }
            }
            Some(_) => return Outcome::refused("bad args: argv must be an array of strings"),
        };
        let timeout = match cmd.args.get("timeout_ms") {
            None | Some(Value::Null) => self.default_timeout,
            Some(v) => match v.as_u64().filter(|&ms| ms > 0) {
                Some(ms) => Duration::from_millis(ms),
                None => return Outcome::refused("bad args: timeout_ms must be a positive integer"),
            },
        };
        run_program(&cmd.name, &argv, self.output_cap, timeout, &self.running)
    }
}

/// One captured stream: the first `cap` bytes and the total seen.
type Captured = (Vec<u8>, u64);

fn run_program(
    program: &str,
    argv: &[String],
    cap: usize,
    timeout: Duration,
    running: &Running,
) -> Outcome {
    let started = Instant::now();
    let mut command = std::process::Command::new(program);
    command
        .args(argv)
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        // Its own process group, so a timeout kills whatever it started too.
        .process_group(0);
    die_with_the_agent(&mut command);
    let spawned = command.spawn();
    let mut child = match spawned {
        Ok(child) => child,
        // Nothing ran: no exec-log line, which counts executions.
        Err(e) => {
            return Outcome {
                ok: false,
                output: error_output(&format!("spawn failed: {e}")),
                executed: false,
            }
        }
    };
    let pgid = child.id() as i32;
    if !running.start(pgid) {
        kill_group(pgid);
    }
    // Each pipe's reader keeps what it read here as it reads, and says on `tx` when its pipe
    // ended: a pipe that never ends (a process started outside the group, setsid, holds it)
    // still leaves what came before it.
    let (tx, rx) = mpsc::channel();
    let read: [Arc<Mutex<Captured>>; 2] = Default::default();
    spawn_reader(child.stdout.take(), cap, tx.clone(), read[0].clone());
    spawn_reader(child.stderr.take(), cap, tx, read[1].clone());
    let (status, timed_out) = wait_until(&mut child, started + timeout, pgid);
    let mut pending = 2;
    let mut grace = Instant::now() + PIPE_GRACE;
    let mut killed = false;
    while pending > 0 {
        match rx.recv_timeout(grace.saturating_duration_since(Instant::now())) {
            Ok(()) => pending -= 1,
            Err(mpsc::RecvTimeoutError::Timeout) if !killed => {
                kill_group(pgid);
                killed = true;
                grace = Instant::now() + PIPE_GRACE;
            }
            Err(_) => break,
        }
    }
    running.end(pgid);
    let [(out, out_total), (err, err_total)] = read.map(|r| {
        r.lock()
            .map(|mut got| std::mem::take(&mut *got))
            .unwrap_or_default()
    });
    let exit_code = status.and_then(|s| s.code());
    let signal = status.and_then(|s| s.signal());
    let mut output = json!({
        "exit_code": exit_code,
        "signal": signal,
        "timed_out": timed_out,
        "duration_ms": started.elapsed().as_millis() as u64,
        "stdout": String::from_utf8_lossy(&out),
        "stderr": String::from_utf8_lossy(&err),
        "stdout_truncated": out_total > out.len() as u64,
        "stderr_truncated": err_total > err.len() as u64,
    });
    if pending > 0 {
        output["output_incomplete"] = json!(
            "a process it started outside its process group kept the output open; what came after is not here"
        );
    }
    let ok = !timed_out && status.is_some_and(|s| s.success());
    Outcome {
        ok,
        output,
        executed: true,
    }
}

/// Waits for `child` until `deadline`, then kills its process group. Returns the exit status
/// (`None` if waiting failed) and whether it timed out.
fn wait_until(child: &mut Child, deadline: Instant, pgid: i32) -> (Option<ExitStatus>, bool) {
    loop {
        match child.try_wait() {
            Ok(Some(status)) => return (Some(status), false),
            Ok(None) => {}
            Err(e) => {
                log::warn!("waiting for pid {pgid}: {e}");
                kill_group(pgid);
                return (child.wait().ok(), false);
            }
        }
        if Instant::now() >= deadline {
            kill_group(pgid);
            return (child.wait().ok(), true);
        }
        thread::sleep(POLL);
    }
}

/// Has the kernel SIGKILL the command when the thread that spawned it ends. An agent killed
/// with SIGKILL (or crashing) cannot kill what it runs itself, and the agent started next
/// knows nothing of it: left alive, the command would go on unobserved, its result never
/// sent, beside whatever the operator runs next. The spawning thread is the worker, which
/// lives as long as the agent. Only the direct child is covered: what it started in its group
/// outlives it unless it dies with its parent too.
fn die_with_the_agent(command: &mut std::process::Command) {
    let agent = std::process::id() as libc::pid_t;
    // SAFETY: the closure runs in the forked child before exec and calls only prctl and
    // getppid, both async-signal-safe; it allocates nothing.
    unsafe {
        command.pre_exec(move || {
            if libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGKILL) == -1 {
                return Err(std::io::Error::last_os_error());
            }
            // The agent died between the fork and the prctl: no signal will come.
            if libc::getppid() != agent {
                return Err(std::io::Error::from_raw_os_error(libc::ESRCH));
            }
            Ok(())
        })
    };
}

fn kill_group(pgid: i32) {
    // SAFETY: plain syscall on our own child's process group.
    unsafe { libc::kill(-pgid, libc::SIGKILL) };
}

/// Reads a pipe to its end on a thread into `so_far` (`cap` bytes kept, the rest counted),
/// then says so on `tx`.
fn spawn_reader<R: Read + Send + 'static>(
    pipe: Option<R>,
    cap: usize,
    tx: mpsc::Sender<()>,
    so_far: Arc<Mutex<Captured>>,
) {
    let spawned = thread::Builder::new()
        .name("agent-pipe".into())
        .spawn(move || {
            if let Some(mut pipe) = pipe {
                let mut buf = [0u8; 8192];
                loop {
                    match pipe.read(&mut buf) {
                        Ok(0) => break,
                        Ok(n) => {
                            let Ok(mut got) = so_far.lock() else { break };
                            let (kept, total) = &mut *got;
                            *total += n as u64;
                            let room = cap.saturating_sub(kept.len()).min(n);
                            kept.extend_from_slice(buf.get(..room).unwrap_or_default());
                        }
                        Err(e) if e.kind() == std::io::ErrorKind::Interrupted => continue,
                        Err(_) => break,
                    }
                }
            }
            let _ = tx.send(());
        });
    if let Err(e) = spawned {
        log::warn!("no thread to read a command's output: {e}");
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A command that leaves a process of its own session (setsid) holding its output pipes:
    /// what it printed before is reported, and the result says the rest is missing. Before,
    /// the output came back empty, marked neither truncated nor incomplete.
    #[test]
    fn output_held_open_by_a_process_outside_the_group_is_kept_and_flagged() {
        let out = run_program(
            "sh",
            &[
                "-c".to_string(),
                "echo important; echo err >&2; setsid sleep 3 & exit 0".to_string(),
            ],
            1024,
            Duration::from_secs(10),
            &Running::default(),
        );
        assert_eq!(out.output["stdout"], "important\n", "{out:?}");
        assert_eq!(out.output["stderr"], "err\n", "{out:?}");
        assert!(out.output["output_incomplete"].is_string(), "{out:?}");
    }

    /// The stop came between the worker's check of it and the spawn: the command is killed as
    /// it starts, not left to run its course.
    #[test]
    fn a_command_spawned_after_the_stop_is_killed_at_once() {
        let running = Running::default();
        running.kill();
        let started = Instant::now();
        let out = run_program(
            "sleep",
            &["10".to_string()],
            1024,
            Duration::from_secs(60),
            &running,
        );
        assert!(started.elapsed() < Duration::from_secs(5), "{out:?}");
        assert_eq!(out.output["signal"], 9, "{}", out.output);
    }

    fn cmd(name: &str, args: Value) -> Command {
        Command {
            seq: 1,
            id: "c".into(),
            name: name.into(),
            args,
        }
    }

    fn allow(names: &[&str], cap: usize) -> Allowlist {
        let allow = names.iter().map(|s| s.to_string()).collect();
        Allowlist::new(allow, cap, Duration::from_secs(10), Running::default())
    }

    #[test]
    fn not_allowed_is_refused_and_not_run() {
        let out =
            allow(&["echo"], 100).handle(&cmd("rm", json!({"argv": ["-rf", "/nonexistent"]})));
        assert_eq!(
            out,
            Outcome {
                ok: false,
                output: json!({"error": "not allowed"}),
                executed: false
            }
        );
    }

    #[test]
    fn runs_with_argv_and_captures() {
        let out = allow(&["echo"], 100).handle(&cmd("echo", json!({"argv": ["hello", "rig"]})));
        assert!(out.ok && out.executed, "{out:?}");
        assert_eq!(out.output["stdout"], "hello rig\n");
        assert_eq!(out.output["exit_code"], 0);
        assert_eq!(out.output["stdout_truncated"], false);
    }

    #[test]
    fn no_shell_is_involved() {
        let out = allow(&["echo"], 100).handle(&cmd("echo", json!({"argv": ["$HOME;", "`id`"]})));
        assert_eq!(out.output["stdout"], "$HOME; `id`\n");
    }

    #[test]
    fn failures_and_bad_args() {
        let mut h = allow(&["false", "no-such-program-fleetlink"], 100);
        let out = h.handle(&cmd("false", json!({})));
        assert!(!out.ok && out.executed);
        assert_eq!(out.output["exit_code"], 1);
        let out = h.handle(&cmd("no-such-program-fleetlink", json!({})));
        assert!(!out.ok && !out.executed, "nothing ran: {out:?}");
        assert!(out.output["error"]
            .as_str()
            .unwrap()
            .starts_with("spawn failed"));
        for bad in [
            json!({"argv": "x"}),
            json!({"argv": [1]}),
            json!({"timeout_ms": -5}),
            json!({"timeout_ms": 0}),
            json!("not an object"),
            json!(["argv"]),
        ] {
            let out = h.handle(&cmd("false", bad.clone()));
            assert!(!out.ok && !out.executed, "{bad}");
        }
    }

    #[test]
    fn output_is_capped() {
        let out = allow(&["head"], 1000)
            .handle(&cmd("head", json!({"argv": ["-c", "100000", "/dev/zero"]})));
        assert!(out.ok, "{out:?}");
        assert_eq!(out.output["stdout"].as_str().unwrap().len(), 1000);
        assert_eq!(out.output["stdout_truncated"], true);
    }

    /// Whether `pid` is gone: no such process, or a zombie (killed, not yet reaped by whoever
    /// inherited it).
    fn gone(pid: i32) -> bool {
        // SAFETY: signal 0 only checks that the process exists.
        if unsafe { libc::kill(pid, 0) } == -1 {
            return std::io::Error::last_os_error().raw_os_error() == Some(libc::ESRCH);
        }
        std::fs::read_to_string(format!("/proc/{pid}/stat"))
            .ok()
            .and_then(|stat| Some(stat.rsplit_once(')')?.1.trim_start().starts_with('Z')))
            .unwrap_or(true)
    }

    #[test]
    fn timeout_kills_the_process_group() {
        let dir = std::env::temp_dir().join(format!("agent-handler-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let pid_file = dir.join("grandchild.pid");
        let _ = std::fs::remove_file(&pid_file);
        // The grandchild does not hold the output pipes, so only the timeout's kill can end it
        // (not the kill that frees pipes held open after the child exits).
        let script = format!(
            "sleep 30 >/dev/null 2>&1 & echo $! > '{}'; wait",
            pid_file.display()
        );
        let started = Instant::now();
        let out = allow(&["sh"], 100).handle(&cmd(
            "sh",
            json!({"argv": ["-c", script], "timeout_ms": 1000}),
        ));
        assert!(!out.ok && out.executed);
        assert_eq!(out.output["timed_out"], true);
        assert_eq!(out.output["signal"], libc::SIGKILL);
        assert!(
            started.elapsed() < Duration::from_secs(5),
            "{:?}",
            started.elapsed()
        );
        let pid: i32 = std::fs::read_to_string(&pid_file)
            .expect("the grandchild's pid file")
            .trim()
            .parse()
            .unwrap();
        let _ = std::fs::remove_dir_all(&dir);
        let deadline = Instant::now() + Duration::from_secs(5);
        while !gone(pid) {
            if Instant::now() >= deadline {
                // SAFETY: plain syscall; do not leave the survivor behind.
                unsafe { libc::kill(pid, libc::SIGKILL) };
                panic!("grandchild {pid} outlived the timeout");
            }
            thread::sleep(POLL);
        }
    }

    #[test]
    fn a_grandchild_holding_the_pipes_does_not_hang_the_worker() {
        let started = Instant::now();
        let out =
            allow(&["sh"], 100).handle(&cmd("sh", json!({"argv": ["-c", "echo hi; sleep 30 &"]})));
        assert!(out.ok, "{out:?}");
        assert_eq!(out.output["stdout"], "hi\n");
        assert!(
            started.elapsed() < Duration::from_secs(5),
            "{:?}",
            started.elapsed()
        );
    }
}
