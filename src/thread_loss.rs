//! Fail-stop for the broker's own threads.
//!
//! A core that panics takes its rigs and its shard of the connection table with it, while
//! the bridge goes on renewing those rigs' leases in Redis and routing their commands to a
//! mailbox nobody reads; a dead bridge leaves the cores without a registry. Serving half a
//! broker that way loses commands silently, so the first thread lost makes the process drain
//! what is left and exit non-zero, and its supervisor (`Restart=on-failure` in
//! `tuning/fleetlink-fe.service`) starts a whole one, where the rigs resume.

use std::sync::OnceLock;

use crossbeam_channel::{Receiver, Sender};

/// A thread that stopped while the broker was not shutting down.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Lost {
    /// The thread's name (`fleetlink-core-0`, `fleetlink-bridge`, ...).
    pub thread: String,
    /// The panic's message, or the error it stopped with.
    pub why: String,
}

impl std::fmt::Display for Lost {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "thread {} stopped: {}", self.thread, self.why)
    }
}

/// More losses than this at once need no more than the first few to be told.
const BOUND: usize = 64;

static LOSSES: OnceLock<Sender<Lost>> = OnceLock::new();

/// Installs the panic hook (after the default one, which still prints the panic) and
/// returns where losses arrive. Call it once, before spawning the threads it watches; a
/// second call returns a receiver that never hears anything.
pub fn watch() -> Receiver<Lost> {
    let (tx, rx) = crossbeam_channel::bounded(BOUND);
    if LOSSES.set(tx).is_err() {
        return crossbeam_channel::never();
    }
    let default = std::panic::take_hook();
    std::panic::set_hook(Box::new(move |info| {
        default(info);
        let why = if let Some(s) = info.payload().downcast_ref::<&str>() {
            (*s).to_owned()
        } else if let Some(s) = info.payload().downcast_ref::<String>() {
            s.clone()
        } else {
            "panicked".to_owned()
        };
        let why = match info.location() {
            Some(at) => format!("panicked at {at}: {why}"),
            None => format!("panicked: {why}"),
        };
        report_current(why);
    }));
    rx
}

/// Reports the calling thread lost: it is about to stop although nothing asked it to.
pub fn report_current(why: String) {
    let thread = std::thread::current()
        .name()
        .unwrap_or("unnamed")
        .to_owned();
    report(Lost { thread, why });
}

fn report(lost: Lost) {
    if let Some(tx) = LOSSES.get() {
        // Full: the drain has its first losses already.
        let _ = tx.try_send(lost);
    }
}

/// Names of the fault-injection points tests reach through `FLEETLINK_FAILPOINT` in debug
/// builds only (`<point>=<rig_id>`): release builds never read the variable.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Failpoint {
    /// A core panics on this rig's hello.
    CoreHello,
    /// The bridge panics on this rig's hello.
    BridgeHello,
    /// The bridge names sessions for their lapse reports only on its way out (any target), so
    /// that a test can tell the naming at exit from the naming a moment after a rig left.
    LapseNamesAtExitOnly,
}

impl Failpoint {
    /// Panics when the test asked this point to fire for `rig`.
    pub fn check(self, rig: &str) {
        if self.target() == Some(rig) {
            panic!("failpoint {} for rig {rig}", self.name());
        }
    }

    /// Whether the test set this point, for whichever target.
    pub fn is_set(self) -> bool {
        self.target().is_some()
    }

    fn name(self) -> &'static str {
        match self {
            Failpoint::CoreHello => "core-panic-on-hello",
            Failpoint::BridgeHello => "bridge-panic-on-hello",
            Failpoint::LapseNamesAtExitOnly => "lapse-names-at-exit-only",
        }
    }

    /// The target the test set this point for, if it did (debug builds only).
    fn target(self) -> Option<&'static str> {
        #[cfg(debug_assertions)]
        {
            static SET: OnceLock<Option<String>> = OnceLock::new();
            let set = SET.get_or_init(|| std::env::var("FLEETLINK_FAILPOINT").ok());
            let (point, target) = set.as_deref()?.split_once('=')?;
            (point == self.name()).then_some(target)
        }
        #[cfg(not(debug_assertions))]
        {
            let _ = self;
            None
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_panicking_thread_is_reported_by_name_with_its_message() {
        let lost = watch();
        let joined = std::thread::Builder::new()
            .name("fleetlink-test-victim".into())
            .spawn(|| panic!("boom {}", 7))
            .map(|h| h.join());
        assert!(matches!(joined, Ok(Err(_))));
        // Only this test's threads: another test failing meanwhile is reported here too.
        let next_from = |name: &str| loop {
            match lost.recv_timeout(std::time::Duration::from_secs(5)) {
                Ok(l) if l.thread == name => break l.why,
                Ok(_) => continue,
                Err(e) => break format!("nothing from {name}: {e}"),
            }
        };
        let why = next_from("fleetlink-test-victim");
        assert!(
            why.ends_with(": boom 7") && why.contains("thread_loss.rs"),
            "{why:?}"
        );
        std::thread::Builder::new()
            .name("fleetlink-test-failed".into())
            .spawn(|| report_current("stopped: no ring".into()))
            .map(|h| h.join())
            .ok();
        assert_eq!(next_from("fleetlink-test-failed"), "stopped: no ring");
        // A second watcher hears nothing; the first keeps hearing.
        assert!(watch().try_recv().is_err());
    }
}
