//! A private `redis-server` for the fleet-mode brokers of a scenario: on a free loopback port
//! (never 6379), without persistence, emptied before every session so no broker inherits
//! another's leases, and stopped with the harness. Spoken to through `redis-cli`, which comes
//! with the server, so the harness needs no Redis client of its own.

use std::net::TcpListener;
use std::process::Command;
use std::time::{Duration, Instant};

use anyhow::{bail, Context, Result};

use crate::proc::{self, Proc};

/// A running redis-server.
pub(crate) struct Server {
    proc: Proc,
    port: u16,
}

impl Server {
    /// Starts one and waits up to 10 s for its PING.
    pub(crate) fn start(log: &std::path::Path) -> Result<Self> {
        // The kernel's pick of a free port; released just before the server binds it.
        let port = TcpListener::bind("127.0.0.1:0")?.local_addr()?.port();
        let mut cmd = Command::new("redis-server");
        cmd.args(["--port", &port.to_string(), "--bind", "127.0.0.1"])
            .args(["--save", "", "--appendonly", "no"]);
        let proc = Proc::spawn("redis-server", &mut cmd, log, Duration::from_secs(5)).context(
            "redis-server is needed for the fleet-mode brokers (apt-get install redis-server)",
        )?;
        let mut server = Self { proc, port };
        let deadline = Instant::now() + Duration::from_secs(10);
        while server.cli(&["PING"]).ok().as_deref() != Some("PONG") {
            if let Some(st) = server.proc.exited()? {
                bail!("redis-server exited ({st}); log: {}", log.display());
            }
            if Instant::now() >= deadline {
                bail!("redis-server not answering on port {port} after 10 s");
            }
            proc::sleep(Duration::from_millis(50))?;
        }
        Ok(server)
    }

    /// The URL brokers get with `--redis`.
    pub(crate) fn url(&self) -> String {
        format!("redis://127.0.0.1:{}/", self.port)
    }

    /// Empties every key: each session starts with no leases, sessions or held commands.
    pub(crate) fn flush(&self) -> Result<()> {
        match self.cli(&["FLUSHALL"])?.as_str() {
            "OK" => Ok(()),
            other => bail!("FLUSHALL answered {other:?}"),
        }
    }

    /// How many keys match `pattern` (a full scan inside Redis; for counts after a storm).
    pub(crate) fn count(&self, pattern: &str) -> Result<usize> {
        let script =
            "local n, c = 0, '0' repeat local r = redis.call('SCAN', c, 'MATCH', ARGV[1], \
                      'COUNT', 10000) c = r[1] n = n + #r[2] until c == '0' return n";
        let out = self.cli(&["EVAL", script, "0", pattern])?;
        out.parse()
            .with_context(|| format!("key count {pattern}: {out:?}"))
    }

    /// CPU time Redis has used (user + system).
    pub(crate) fn cpu(&self) -> Result<Duration> {
        self.proc.cpu()
    }

    /// Zeroes the counts [`Server::scripts`] reads.
    pub(crate) fn reset_stats(&self) -> Result<()> {
        self.cli(&["CONFIG", "RESETSTAT"]).map(drop)
    }

    /// Script calls since [`Server::reset_stats`] and the time Redis spent in them by its own
    /// count (`INFO commandstats`, EVALSHA and EVAL: the scripts' own commands included).
    pub(crate) fn scripts(&self) -> Result<ScriptStats> {
        Ok(script_stats(&self.cli(&["INFO", "commandstats"])?))
    }

    /// One command through `redis-cli`; its reply, trimmed.
    fn cli(&self, args: &[&str]) -> Result<String> {
        let out = Command::new("redis-cli")
            .args(["-h", "127.0.0.1", "-p", &self.port.to_string()])
            .args(args)
            .output()
            .context("running redis-cli")?;
        if !out.status.success() {
            bail!(
                "redis-cli {args:?}: {}",
                String::from_utf8_lossy(&out.stderr).trim()
            );
        }
        Ok(String::from_utf8_lossy(&out.stdout).trim().to_string())
    }
}

/// Script calls and the microseconds Redis spent in them.
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub(crate) struct ScriptStats {
    pub(crate) calls: u64,
    pub(crate) usec: u64,
}

/// Sums the `cmdstat_evalsha` and `cmdstat_eval` lines of `INFO commandstats`.
fn script_stats(info: &str) -> ScriptStats {
    let mut out = ScriptStats::default();
    for line in info.lines() {
        let Some((name, fields)) = line.trim().split_once(':') else {
            continue;
        };
        if name != "cmdstat_evalsha" && name != "cmdstat_eval" {
            continue;
        }
        for field in fields.split(',') {
            match field.split_once('=') {
                Some(("calls", v)) => out.calls += v.parse::<u64>().unwrap_or(0),
                Some(("usec", v)) => out.usec += v.parse::<u64>().unwrap_or(0),
                _ => {}
            }
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn script_stats_sum_eval_and_evalsha() {
        let info = "# Commandstats\r\ncmdstat_get:calls=9,usec=9,usec_per_call=1.00\r\n\
                    cmdstat_evalsha:calls=79,usec=33586,usec_per_call=425.14,rejected_calls=0\r\n\
                    cmdstat_eval:calls=2,usec=14,usec_per_call=7.00\r\n";
        assert_eq!(
            script_stats(info),
            ScriptStats {
                calls: 81,
                usec: 33600
            }
        );
        assert_eq!(script_stats(""), ScriptStats::default());
    }

    #[test]
    fn counts_keys_by_pattern_and_flushes_them() {
        let dir =
            std::env::temp_dir().join(format!("fleetlink-bench-redis.{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let server = Server::start(&dir.join("redis.log")).unwrap();
        assert!(server.url().starts_with("redis://127.0.0.1:"));
        for key in ["rig:a", "rig:b", "broker:x"] {
            assert_eq!(server.cli(&["SET", key, "1"]).unwrap(), "OK");
        }
        assert_eq!(server.count("rig:*").unwrap(), 2);
        server.flush().unwrap();
        assert_eq!(server.count("rig:*").unwrap(), 0);
        assert!(server.cpu().is_ok());
        server.reset_stats().unwrap();
        server
            .cli(&["EVAL", "return redis.call('GET', KEYS[1])", "1", "rig:a"])
            .unwrap();
        let stats = server.scripts().unwrap();
        assert_eq!(stats.calls, 1, "{stats:?}");
        drop(server);
        let _ = std::fs::remove_dir_all(&dir);
    }
}
