//! A progress bar on stderr for the long phases of a bench (a 19,000-rig ramp, a 60 s hold),
//! so whoever runs one by hand sees it move and how far it has to go.
//!
//! On a terminal the bar redraws in place. Scripts capture stderr into logs, where a redrawn
//! line would pile up as carriage returns, so there it becomes one plain line every
//! [`LOG_EVERY`] and one at the end.

use std::io::{IsTerminal, Write};
use std::time::{Duration, Instant};

/// How often a bar writes a line when stderr is not a terminal.
pub const LOG_EVERY: Duration = Duration::from_secs(2);
/// How often a caller should redraw: fast enough to look alive, slow enough to cost nothing.
pub const REDRAW_EVERY: Duration = Duration::from_millis(250);
const WIDTH: usize = 30;

/// What a bar counts.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Unit {
    /// Things: rigs, commands.
    Count(&'static str),
    /// Time, given in milliseconds and shown in seconds.
    Millis,
}

/// One phase's bar: `done` out of `total` units.
pub struct Bar {
    label: String,
    total: u64,
    unit: Unit,
    tty: bool,
    started: Instant,
    last_line: Option<Instant>,
}

impl Bar {
    /// A bar for a phase of `total` `unit`s, drawn on stderr.
    pub fn new(label: &str, total: u64, unit: Unit) -> Self {
        Self {
            label: label.to_string(),
            total,
            unit,
            tty: std::io::stderr().is_terminal(),
            started: Instant::now(),
            last_line: None,
        }
    }

    /// Shows `done` and a free-form `detail` (counts that matter in this phase).
    pub fn update(&mut self, done: u64, detail: &str) {
        let line = render(
            &self.label,
            done,
            self.total,
            self.unit,
            self.started.elapsed(),
            detail,
        );
        if self.tty {
            // \r and erase-line: the bar is redrawn over itself.
            eprint!("\r\x1b[2K{line}");
            let _ = std::io::stderr().flush();
        } else if self.last_line.is_none_or(|t| t.elapsed() >= LOG_EVERY) {
            self.last_line = Some(Instant::now());
            eprintln!("{line}");
        }
    }

    /// Draws the final state and ends the bar's line.
    pub fn finish(&mut self, done: u64, detail: &str) {
        self.last_line = None;
        self.update(done, detail);
        if self.tty {
            eprintln!();
        }
    }
}

/// One bar as text: `label [=====>     ] done/total unit  pct%  elapsed  detail`.
pub fn render(
    label: &str,
    done: u64,
    total: u64,
    unit: Unit,
    elapsed: Duration,
    detail: &str,
) -> String {
    let frac = if total == 0 {
        1.0
    } else {
        (done as f64 / total as f64).clamp(0.0, 1.0)
    };
    let filled = (frac * WIDTH as f64).round() as usize;
    let mut bar = "=".repeat(filled);
    if filled < WIDTH {
        bar.push('>');
        bar.push_str(&" ".repeat(WIDTH - filled - 1));
    }
    let amount = match unit {
        Unit::Count(what) => format!("{done}/{total} {what}"),
        Unit::Millis => format!("{:.1}/{:.1} s", done as f64 / 1e3, total as f64 / 1e3),
    };
    let mut line = format!(
        "{label} [{bar}] {amount} {:>3.0}% {:.1}s",
        frac * 100.0,
        elapsed.as_secs_f64()
    );
    if !detail.is_empty() {
        line.push_str("  ");
        line.push_str(detail);
    }
    line
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_bar_fills_with_the_fraction_done_and_keeps_its_width() {
        let rigs = Unit::Count("rigs");
        let half = render(
            "ramp",
            500,
            1000,
            rigs,
            Duration::from_millis(1500),
            "failed=0",
        );
        assert_eq!(
            half,
            format!(
                "ramp [{}>{}] 500/1000 rigs  50% 1.5s  failed=0",
                "=".repeat(15),
                " ".repeat(14)
            )
        );
        let empty = render("hold", 0, 60_000, Unit::Millis, Duration::ZERO, "");
        assert_eq!(
            empty,
            format!("hold [>{}] 0.0/60.0 s   0% 0.0s", " ".repeat(29))
        );
        let full = render(
            "hold",
            60_000,
            60_000,
            Unit::Millis,
            Duration::from_secs(60),
            "",
        );
        assert!(full.starts_with(&format!("hold [{}] 60.0/60.0 s 100%", "=".repeat(30))));
    }

    #[test]
    fn more_than_the_total_or_a_zero_total_shows_a_full_bar() {
        let rigs = Unit::Count("rigs");
        let over = render("ramp", 12, 10, rigs, Duration::ZERO, "");
        assert!(over.contains(&"=".repeat(30)) && over.contains("100%"));
        let zero = render("ramp", 0, 0, rigs, Duration::ZERO, "");
        assert!(zero.contains(&"=".repeat(30)) && zero.contains("100%"));
    }
}
