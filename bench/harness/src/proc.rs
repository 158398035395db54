//! Child processes the harness owns: every broker, loadgen and sender runs inside a [`Proc`],
//! which stops it (SIGTERM, a grace period, then SIGKILL) when dropped, so a failed or
//! panicking scenario leaves nothing running. Children also get `PR_SET_PDEATHSIG`, so they die
//! with the harness even if it is killed outright. CPU time and RSS are read from `/proc`.

use std::collections::BTreeMap;
use std::fs::File;
use std::os::unix::process::CommandExt;
use std::path::Path;
use std::process::{Child, Command, ExitStatus, Stdio};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, OnceLock};
use std::time::{Duration, Instant};

use anyhow::{bail, Context, Result};
use fleetlink_loadgen::progress::{Bar, Unit, REDRAW_EVERY};

/// Set by SIGINT/SIGTERM; every wait loop checks it so Drop guards run on the way out.
static INTERRUPTED: OnceLock<Arc<AtomicBool>> = OnceLock::new();

/// Installs the SIGINT/SIGTERM flag. Call once, first thing in `main`.
pub(crate) fn install_signal_flag() -> Result<()> {
    let flag = INTERRUPTED.get_or_init(|| Arc::new(AtomicBool::new(false)));
    for sig in [signal_hook::consts::SIGINT, signal_hook::consts::SIGTERM] {
        signal_hook::flag::register(sig, flag.clone()).context("installing signal handler")?;
    }
    Ok(())
}

/// Fails once a SIGINT/SIGTERM arrived.
pub(crate) fn check_interrupted() -> Result<()> {
    if INTERRUPTED.get().is_some_and(|f| f.load(Ordering::Relaxed)) {
        bail!("interrupted");
    }
    Ok(())
}

/// Sleeps `d` in short slices, failing early on a signal.
pub(crate) fn sleep(d: Duration) -> Result<()> {
    let end = Instant::now() + d;
    loop {
        check_interrupted()?;
        let left = end.saturating_duration_since(Instant::now());
        if left.is_zero() {
            return Ok(());
        }
        std::thread::sleep(left.min(Duration::from_millis(50)));
    }
}

/// [`sleep`] with a progress bar on stderr: for the long measurement windows, so a run by hand
/// shows how far it has to go.
pub(crate) fn sleep_shown(label: &str, d: Duration) -> Result<()> {
    let mut bar = Bar::new(label, d.as_millis() as u64, Unit::Millis);
    let start = Instant::now();
    while let Some(left) = d.checked_sub(start.elapsed()).filter(|l| !l.is_zero()) {
        bar.update(start.elapsed().as_millis() as u64, "");
        sleep(left.min(REDRAW_EVERY))?;
    }
    bar.finish(d.as_millis() as u64, "");
    Ok(())
}

/// A running child that is stopped on drop.
pub(crate) struct Proc {
    /// For messages: "broker fleetlink-fe", "loadgen rigs", …
    name: String,
    child: Child,
    /// Time between SIGTERM and SIGKILL when stopping.
    grace: Duration,
    /// Set once the child was reaped.
    status: Option<ExitStatus>,
}

impl Proc {
    /// Starts `cmd` with stdout to `stdout_path` and stderr to `<stdout_path>.err`.
    pub(crate) fn spawn(
        name: &str,
        cmd: &mut Command,
        stdout_path: &Path,
        grace: Duration,
    ) -> Result<Self> {
        let out =
            File::create(stdout_path).with_context(|| format!("{}", stdout_path.display()))?;
        let err_path = stdout_path.with_extension("err");
        let err = File::create(&err_path).with_context(|| format!("{}", err_path.display()))?;
        cmd.stdin(Stdio::null()).stdout(out).stderr(err);
        // SAFETY: prctl is async-signal-safe and touches no memory of the parent.
        unsafe {
            cmd.pre_exec(|| {
                if libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGKILL) != 0 {
                    return Err(std::io::Error::last_os_error());
                }
                Ok(())
            });
        }
        let child = cmd
            .spawn()
            .with_context(|| format!("starting {name}: {:?}", cmd.get_program()))?;
        Ok(Self {
            name: name.to_string(),
            child,
            grace,
            status: None,
        })
    }

    /// The child's pid.
    pub(crate) fn pid(&self) -> u32 {
        self.child.id()
    }

    /// The name given at spawn.
    pub(crate) fn name(&self) -> &str {
        &self.name
    }

    /// The exit status if the child has ended (reaping it), `None` while it runs.
    pub(crate) fn exited(&mut self) -> Result<Option<ExitStatus>> {
        if self.status.is_none() {
            self.status = self.child.try_wait().context("try_wait")?;
        }
        Ok(self.status)
    }

    /// Waits for the child to end by itself until `deadline`; `None` if it still runs then.
    pub(crate) fn wait_until(&mut self, deadline: Instant) -> Result<Option<ExitStatus>> {
        loop {
            if let Some(st) = self.exited()? {
                return Ok(Some(st));
            }
            if Instant::now() >= deadline {
                return Ok(None);
            }
            sleep(Duration::from_millis(20))?;
        }
    }

    /// User + system CPU time of the whole process (all threads, live and ended) so far.
    pub(crate) fn cpu(&self) -> Result<Duration> {
        let stat = std::fs::read_to_string(format!("/proc/{}/stat", self.pid()))
            .with_context(|| format!("{} (pid {}) is gone", self.name, self.pid()))?;
        parse_cpu_ticks(&stat)
            .map(|ticks| Duration::from_secs_f64(ticks as f64 / clock_ticks_per_s()))
            .with_context(|| format!("parsing /proc/{}/stat", self.pid()))
    }

    /// CPU time summed over the live threads' `/proc/PID/task/TID/schedstat` (nanoseconds,
    /// unlike the 10 ms ticks of [`Proc::cpu`]) and the thread count. Threads that ended are
    /// missing from the sum, so compare counts before using a difference of two readings.
    pub(crate) fn cpu_threads(&self) -> Result<(Duration, usize)> {
        let dir = format!("/proc/{}/task", self.pid());
        let (mut ns, mut threads) = (0u64, 0);
        for task in std::fs::read_dir(&dir).with_context(|| dir.clone())? {
            let path = task?.path().join("schedstat");
            // A thread may end between the listing and the read: skip it.
            let Ok(text) = std::fs::read_to_string(&path) else {
                continue;
            };
            ns += text
                .split_whitespace()
                .next()
                .and_then(|v| v.parse::<u64>().ok())
                .unwrap_or(0);
            threads += 1;
        }
        Ok((Duration::from_nanos(ns), threads))
    }

    /// CPU time of the live threads grouped by name with trailing digits dropped
    /// (`fleetlink-admin-3` → `fleetlink-admin`): each thread's `schedstat` run time in
    /// nanoseconds, or its `stat` ticks (10 ms) where that cannot be read. Ticks summed per
    /// thread lost up to a tick each, so groups read 0.00 s beside a total of 0.02 s.
    pub(crate) fn cpu_by_thread(&self) -> Result<BTreeMap<String, Duration>> {
        let dir = format!("/proc/{}/task", self.pid());
        let mut out = BTreeMap::new();
        for task in std::fs::read_dir(&dir).with_context(|| dir.clone())? {
            let task = task?.path();
            let Ok(stat) = std::fs::read_to_string(task.join("stat")) else {
                continue;
            };
            let ran = std::fs::read_to_string(task.join("schedstat"))
                .ok()
                .and_then(|t| t.split_whitespace().next()?.parse::<u64>().ok())
                .map(Duration::from_nanos);
            let name = stat
                .split_once('(')
                .and_then(|(_, r)| r.rsplit_once(')'))
                .map_or("?", |(n, _)| n)
                .trim_end_matches(|c: char| c.is_ascii_digit() || c == '-' || c == '_');
            let ticks = parse_cpu_ticks(&stat).unwrap_or(0);
            *out.entry(name.to_string()).or_default() +=
                ran.unwrap_or_else(|| Duration::from_secs_f64(ticks as f64 / clock_ticks_per_s()));
        }
        Ok(out)
    }

    /// Resident set size in KiB (VmRSS).
    pub(crate) fn rss_kb(&self) -> Result<u64> {
        let status = std::fs::read_to_string(format!("/proc/{}/status", self.pid()))?;
        status
            .lines()
            .find_map(|l| l.strip_prefix("VmRSS:"))
            .and_then(|v| v.trim().trim_end_matches("kB").trim().parse().ok())
            .context("no VmRSS")
    }

    /// SIGTERM, up to the grace period for the child to exit, then SIGKILL. Idempotent.
    pub(crate) fn stop(&mut self) -> Option<ExitStatus> {
        if let Ok(Some(st)) = self.exited() {
            return Some(st);
        }
        // SAFETY: kill(2) on our own un-reaped child's pid: it cannot have been recycled.
        unsafe { libc::kill(self.pid() as libc::pid_t, libc::SIGTERM) };
        let deadline = Instant::now() + self.grace;
        while Instant::now() < deadline {
            if let Ok(Some(st)) = self.exited() {
                return Some(st);
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        eprintln!(
            "bench: {} did not stop in {:?}; killing it",
            self.name, self.grace
        );
        let _ = self.child.kill();
        self.status = self.child.wait().ok();
        self.status
    }
}

impl Drop for Proc {
    fn drop(&mut self) {
        self.stop();
    }
}

/// utime + stime (fields 14 and 15) in clock ticks. The command name (field 2) may contain
/// spaces and parentheses, so fields are counted after the last ')'.
fn parse_cpu_ticks(stat: &str) -> Option<u64> {
    let rest = stat.get(stat.rfind(')')? + 1..)?;
    let mut fields = rest.split_whitespace().skip(11); // field 3 is the first after ')'
    let utime: u64 = fields.next()?.parse().ok()?;
    let stime: u64 = fields.next()?.parse().ok()?;
    Some(utime + stime)
}

fn clock_ticks_per_s() -> f64 {
    // SAFETY: sysconf has no preconditions.
    let t = unsafe { libc::sysconf(libc::_SC_CLK_TCK) };
    if t > 0 {
        t as f64
    } else {
        100.0
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn cpu_fields_after_the_command_name() {
        let stat = "1234 (a (b) c) S 1 2 3 4 5 6 7 8 9 10 250 30 0 0 20 0 4 0 100";
        assert_eq!(parse_cpu_ticks(stat), Some(280));
        assert_eq!(parse_cpu_ticks("garbage"), None);
    }

    /// A child that spins a while shows it in its thread's figure, in nanoseconds rather than
    /// whole 10 ms ticks.
    #[test]
    fn thread_figures_count_time_below_a_tick() {
        let dir = std::env::temp_dir().join(format!("proc-threads-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let mut cmd = Command::new("sh");
        cmd.args([
            "-c",
            "i=0; while [ $i -lt 100000 ]; do i=$((i+1)); done; exec sleep 5",
        ]);
        let mut p =
            Proc::spawn("spin", &mut cmd, &dir.join("out"), Duration::from_secs(1)).unwrap();
        let deadline = Instant::now() + Duration::from_secs(10);
        let spun = loop {
            let total: Duration = p.cpu_by_thread().unwrap().values().sum();
            let name = std::fs::read_to_string(format!("/proc/{}/comm", p.pid())).unwrap();
            if name.trim() == "sleep" || Instant::now() > deadline {
                break total;
            }
            std::thread::sleep(Duration::from_millis(5));
        };
        p.stop();
        let _ = std::fs::remove_dir_all(&dir);
        assert!(spun >= Duration::from_millis(5), "{spun:?}");
        assert!(
            spun.subsec_nanos() % 10_000_000 != 0,
            "whole ticks: {spun:?}"
        );
    }

    #[test]
    fn own_cpu_is_readable() {
        let stat = std::fs::read_to_string("/proc/self/stat").unwrap();
        assert!(parse_cpu_ticks(&stat).is_some());
    }
}
