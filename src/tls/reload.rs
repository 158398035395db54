//! Hot reload of the TLS files: certificate and key, client CA bundle, CRLs.
//!
//! [`TlsReloader`] holds the config in force. A reload builds a whole new config from the files
//! and swaps it in; a failed reload keeps the old one. Readers on the cores do not lock per
//! connection: each keeps a [`ConfigCache`] and consults the shared slot only when the atomic
//! generation moved, i.e. once per core per reload. Connections keep the `Arc<ServerConfig>`
//! they were created with until their handshake ends (rustls drops it then), so a reload
//! never disturbs a live connection.
//!
//! The watcher thread ([`TlsReloader::spawn_watcher`]) polls the files' identity (device,
//! inode, size, mtime, ctime) and reloads when any changed since the last attempt; a second
//! thread reloads on SIGHUP. File stamps are taken *before* the files are read, so a change
//! racing a reload is seen at the next poll (at worst one extra reload, never a missed one).

use std::os::unix::fs::MetadataExt;
use std::path::Path;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, PoisonError, Weak};
use std::thread;
use std::time::Duration;

use rustls::ServerConfig;
use signal_hook::consts::SIGHUP;
use signal_hook::iterator::Signals;

use super::{build, TlsError, TlsPaths, Validity};

/// The TLS config in force, and how to rebuild it. Shared by `main`, the watcher and the cores.
pub struct TlsReloader {
    /// The files every rebuild reads.
    paths: TlsPaths,
    /// Mirror of `current.0`, bumped after each swap: what cores poll, without locking.
    generation: AtomicU64,
    /// The config in force and its generation, swapped as one.
    current: Mutex<(u64, Arc<ServerConfig>)>,
    /// When the material in force stops being usable (for `/metrics`).
    validity: Mutex<Validity>,
    /// Reloads refused (a bad file): the old config stays, so only this and the log say so.
    failed: AtomicU64,
    /// Held for a whole reload, so reloads from the watcher and SIGHUP do not interleave;
    /// holds the file stamps of the last attempt, good or bad, so a bad file set is not retried
    /// until it changes again.
    attempted: Mutex<Vec<Option<Stamp>>>,
}

impl TlsReloader {
    /// Builds the first config (generation 0) from `paths`.
    pub fn new(paths: TlsPaths) -> Result<Arc<TlsReloader>, TlsError> {
        let stamps = stamps(&paths);
        let (config, validity) = build(&paths)?;
        Ok(Arc::new(TlsReloader {
            paths,
            generation: AtomicU64::new(0),
            current: Mutex::new((0, config)),
            validity: Mutex::new(validity),
            failed: AtomicU64::new(0),
            attempted: Mutex::new(stamps),
        }))
    }

    /// The files this reloader builds from.
    pub fn paths(&self) -> &TlsPaths {
        &self.paths
    }

    /// How many reloads succeeded: 0 for the config built by [`TlsReloader::new`].
    pub fn generation(&self) -> u64 {
        self.generation.load(Ordering::Acquire)
    }

    /// How many reloads were refused, the config in force kept.
    pub fn failed_reloads(&self) -> u64 {
        self.failed.load(Ordering::Relaxed)
    }

    /// When the certificate and the CRLs in force stop being usable.
    pub fn validity(&self) -> Validity {
        *lock(&self.validity)
    }

    /// The config in force. Takes a lock: per connection, use a [`ConfigCache`] instead.
    pub fn current(&self) -> Arc<ServerConfig> {
        lock(&self.current).1.clone()
    }

    /// Rebuilds the config from the files and puts it in force. On error the config in force
    /// stays, and the error says which file is at fault.
    pub fn reload(&self) -> Result<(), TlsError> {
        let mut attempted = lock(&self.attempted);
        *attempted = stamps(&self.paths);
        let (config, validity) = build(&self.paths).inspect_err(|_| {
            self.failed.fetch_add(1, Ordering::Relaxed);
        })?;
        let mut current = lock(&self.current);
        let generation = current.0 + 1;
        *current = (generation, config);
        *lock(&self.validity) = validity;
        self.generation.store(generation, Ordering::Release);
        Ok(())
    }

    /// Starts the reload threads: `tls-watch` polls the files every `period` and reloads when
    /// they changed; `tls-sighup` reloads on each SIGHUP. Both log what happened and stop once
    /// the reloader is dropped (the SIGHUP thread at the watcher's next poll). Call it once:
    /// each call adds its own pair of threads.
    pub fn spawn_watcher(self: &Arc<Self>, period: Duration) -> std::io::Result<()> {
        let mut signals = Signals::new([SIGHUP])?;
        let handle = signals.handle();
        let weak = Arc::downgrade(self);
        thread::Builder::new()
            .name("tls-sighup".into())
            .spawn(move || {
                for _ in signals.forever() {
                    let Some(this) = weak.upgrade() else { break };
                    log::info!("SIGHUP: reloading TLS files");
                    this.reload_logged();
                }
            })?;
        let weak: Weak<Self> = Arc::downgrade(self);
        let spawned = thread::Builder::new()
            .name("tls-watch".into())
            .spawn(move || loop {
                thread::sleep(period);
                let Some(this) = weak.upgrade() else {
                    handle.close();
                    break;
                };
                if this.changed() {
                    this.reload_logged();
                }
            });
        spawned.map(drop)
    }

    /// True when a file's stamp differs from the last reload attempt's.
    fn changed(&self) -> bool {
        *lock(&self.attempted) != stamps(&self.paths)
    }

    fn reload_logged(&self) {
        match self.reload() {
            Ok(()) => log::info!("TLS config reloaded (generation {})", self.generation()),
            Err(e) => log::warn!(
                "TLS reload failed, generation {} stays in force: {e}",
                self.generation()
            ),
        }
    }
}

/// A core's view of the config in force: one atomic load per call, the shared lock only when a
/// reload happened since the last call. Owned by one core; not shared.
pub struct ConfigCache {
    reloader: Arc<TlsReloader>,
    generation: u64,
    config: Arc<ServerConfig>,
}

impl ConfigCache {
    /// A cache holding the config in force now.
    pub fn new(reloader: Arc<TlsReloader>) -> ConfigCache {
        let (generation, config) = lock(&reloader.current).clone();
        ConfigCache {
            reloader,
            generation,
            config,
        }
    }

    /// The config in force, for the next connection.
    pub fn config(&mut self) -> &Arc<ServerConfig> {
        if self.reloader.generation() != self.generation {
            let (generation, config) = lock(&self.reloader.current).clone();
            self.generation = generation;
            self.config = config;
        }
        &self.config
    }
}

/// What identifies a file's content without reading it. `None`: the file is missing or
/// unreadable (a change too: the reload will report it).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Stamp {
    dev: u64,
    ino: u64,
    len: u64,
    mtime: (i64, i64),
    ctime: (i64, i64),
}

fn stamps(paths: &TlsPaths) -> Vec<Option<Stamp>> {
    paths.files().map(stamp).collect()
}

/// Follows symlinks, so a Kubernetes-style `..data` symlink swap shows as a new inode.
fn stamp(path: &Path) -> Option<Stamp> {
    let m = std::fs::metadata(path).ok()?;
    Some(Stamp {
        dev: m.dev(),
        ino: m.ino(),
        len: m.size(),
        mtime: (m.mtime(), m.mtime_nsec()),
        ctime: (m.ctime(), m.ctime_nsec()),
    })
}

/// Nothing panics while these locks are held (no user code, no indexing), and the data behind
/// them is valid at every step, so a poisoned lock is used as is.
fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(PoisonError::into_inner)
}
