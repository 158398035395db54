//! Writing results: `<out>/<scenario>.json` (replaced on each run: host, parameters, every
//! run's raw figures and the per-broker summary) and a markdown table appended to
//! `<out>/<scenario>.md` (so earlier runs stay for comparison). Also the median helper every
//! summary uses.

use std::io::Write;
use std::path::Path;
use std::process::Command;

use anyhow::{Context, Result};
use serde_json::{json, Value};

/// Median of `v` (mean of the middle two for an even count); `None` when empty.
pub(crate) fn median(v: &[f64]) -> Option<f64> {
    let mut s: Vec<f64> = v.iter().copied().filter(|x| x.is_finite()).collect();
    if s.is_empty() {
        return None;
    }
    s.sort_by(f64::total_cmp);
    let m = s.len() / 2;
    Some(if s.len() % 2 == 1 {
        s[m]
    } else {
        (s[m - 1] + s[m]) / 2.0
    })
}

/// `runs[i][key]` for every run of `broker`, in run order (runs carry a `"broker"` field).
pub(crate) fn series(runs: &[Value], broker: &str, key: &str) -> Vec<f64> {
    runs.iter()
        .filter(|r| r["broker"] == broker)
        .filter_map(|r| r[key].as_f64())
        .collect()
}

/// Values joined for a "per round" cell: `1.2, 1.4, 1.3`.
pub(crate) fn list(v: &[f64], d: usize) -> String {
    v.iter()
        .map(|x| format!("{x:.d$}"))
        .collect::<Vec<_>>()
        .join(", ")
}

/// UTC now, RFC 3339, seconds precision.
pub(crate) fn now_utc() -> String {
    utc(std::time::SystemTime::now())
}

/// `t` in UTC, RFC 3339, seconds precision.
pub(crate) fn utc(t: std::time::SystemTime) -> String {
    let f = time::macros::format_description!("[year]-[month]-[day]T[hour]:[minute]:[second]Z");
    time::OffsetDateTime::from(t).format(&f).unwrap_or_default()
}

/// Where and on what the figures were measured.
pub(crate) fn host() -> Value {
    let read = |p: &str| {
        std::fs::read_to_string(p)
            .ok()
            .map(|s| s.trim().to_string())
    };
    let cmd = |prog: &str, args: &[&str]| {
        Command::new(prog)
            .args(args)
            .current_dir(env!("CARGO_MANIFEST_DIR"))
            .output()
            .ok()
            .filter(|o| o.status.success())
            .map(|o| String::from_utf8_lossy(&o.stdout).trim().to_string())
    };
    json!({
        "nproc": std::thread::available_parallelism().map(|n| n.get()).unwrap_or(0),
        "kernel": read("/proc/sys/kernel/osrelease"),
        "cpu": read("/proc/cpuinfo").and_then(|c| c.lines()
            .find_map(|l| l.strip_prefix("model name").map(|m| m.trim_start_matches([' ', '\t', ':']).to_string()))),
        "git_commit": cmd("git", &["rev-parse", "--short", "HEAD"]),
        // Dirty means the measured code differs from the commit: the pass's own result files
        // and the docs do not count, as in bench/pass.sh's check.
        "git_dirty": cmd("git", &["status", "--porcelain", "--untracked-files=no", "--",
            ":(top)src", ":(top)lua", ":(top)bench", ":(top,exclude)bench/results",
            ":(top)Cargo.toml", ":(top)Cargo.lock"]).map(|s| !s.is_empty()),
    })
}

/// Writes `<out>/<scenario>.json` and appends `markdown` to `<out>/<scenario>.md`.
pub(crate) fn write(out: &Path, scenario: &str, doc: &Value, markdown: &str) -> Result<()> {
    let json_path = out.join(format!("{scenario}.json"));
    let text = serde_json::to_string_pretty(doc)? + "\n";
    std::fs::write(&json_path, text).with_context(|| format!("{}", json_path.display()))?;
    let md_path = out.join(format!("{scenario}.md"));
    let mut f = std::fs::OpenOptions::new()
        .create(true)
        .append(true)
        .open(&md_path)
        .with_context(|| format!("{}", md_path.display()))?;
    writeln!(f, "{markdown}")?;
    eprintln!(
        "bench: wrote {} and appended to {}",
        json_path.display(),
        md_path.display()
    );
    Ok(())
}

/// `x` with `d` decimals, or `-`.
pub(crate) fn fmt(x: Option<f64>, d: usize) -> String {
    x.map_or_else(|| "-".into(), |x| format!("{x:.d$}"))
}

/// `a / b` as "1.23x", or `-`.
pub(crate) fn ratio(a: Option<f64>, b: Option<f64>) -> String {
    match (a, b) {
        (Some(a), Some(b)) if b > 0.0 => format!("{:.2}x", a / b),
        _ => "-".into(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn medians() {
        assert_eq!(median(&[]), None);
        assert_eq!(median(&[3.0, 1.0, 2.0]), Some(2.0));
        assert_eq!(median(&[4.0, 1.0, 2.0, 3.0]), Some(2.5));
        assert_eq!(ratio(Some(3.0), Some(2.0)), "1.50x");
        assert_eq!(ratio(Some(3.0), Some(0.0)), "-");
    }
}
