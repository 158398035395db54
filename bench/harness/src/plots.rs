//! `plots`: SVG figures from the result files other scenarios and scripts wrote.
//!
//! - `density.svg`: RSS (MiB, log scale) vs open connections, one line per
//!   `density-<broker>.json` (`points[].conns`, `points[].rss_kb`, written by `density.sh`).
//! - `latency-single.svg`, `latency-fanout.svg`: latency CDF per `latency-<broker>.json`
//!   (written by `latency.sh`). Each session there keeps the loadgen's distribution at every
//!   percentile 1–99, 99.5, 99.9 and the max (`latency_us.cdf`); a curve is the median over a
//!   broker's sessions at each of those. Files from before the loadgen wrote `cdf` have only
//!   min, p50, p90, p99, p99.9 and max, and their curves join those six points.
//!
//! A plot draws one run: the scripts name a file `<prefix><broker>.json`, or
//! `<prefix><broker>-<SFX>.json` when run with `--name SFX`, and every file records its
//! `broker`. By default only the files written without `--name` are drawn, into `density.svg`
//! and `latency-*.svg`; `plots --name SFX` draws the files of that run into
//! `density-SFX.svg` and `latency-*-SFX.svg`. Files of other runs in the same directory are
//! left out, so a plot never mixes runs.

use std::ops::Range;
use std::path::{Path, PathBuf};

use anyhow::{bail, Context, Result};
use clap::Args;
use plotters::coord::ranged1d::{AsRangedCoord, ValueFormatter};
use plotters::prelude::*;
use serde_json::Value;

use crate::record::median;

/// Flags of `plots`.
#[derive(Args, Debug)]
pub(crate) struct Opts {
    /// Directory holding the result files; the SVGs are written there too.
    #[arg(long, default_value = concat!(env!("CARGO_MANIFEST_DIR"), "/../results"))]
    out: PathBuf,
    /// Draw the run written with `--name SFX` (files `<prefix><broker>-SFX.json`) into SVGs
    /// named with `-SFX`. Default: the run written without `--name`.
    #[arg(long)]
    name: Option<String>,
}

/// One line of a plot: legend label and (x, y) points in x order.
struct Line {
    label: String,
    points: Vec<(f64, f64)>,
}

/// The loadgen's quantiles and the cumulative fraction each stands for.
const QUANTILES: [(&str, f64); 6] = [
    ("min", 0.0),
    ("p50", 0.5),
    ("p90", 0.9),
    ("p99", 0.99),
    ("p999", 0.999),
    ("max", 1.0),
];

/// Writes every plot whose inputs exist; fails only if none do.
pub(crate) fn run(o: &Opts) -> Result<()> {
    let out = o
        .out
        .canonicalize()
        .with_context(|| format!("{}", o.out.display()))?;
    let run = o.name.as_deref().unwrap_or("");
    let svg = |stem: &str| match run {
        "" => format!("{stem}.svg"),
        sfx => format!("{stem}-{sfx}.svg"),
    };
    let mut wrote = 0;
    let density = lines_from(&out, "density-", run, density_line)?;
    if !density.is_empty() {
        let (x, y) = bounds(&density);
        let path = out.join(svg("density"));
        draw(
            &path,
            "RSS vs open connections (incremental, idle rigs)",
            "connections",
            "RSS (MiB, log scale)",
            0.0..x.end,
            (decade_below(y.start)..y.end * 1.25).log_scale(),
            &density,
        )?;
        wrote += 1;
    }
    for shape in ["single", "fanout"] {
        let lines = lines_from(&out, "latency-", run, |v| latency_line(v, shape))?;
        if lines.is_empty() {
            continue;
        }
        let (x, _) = bounds(&lines);
        let path = out.join(svg(&format!("latency-{shape}")));
        let title =
            format!("Command latency CDF, {shape} (median over sessions at each percentile)");
        draw(
            &path,
            &title,
            "publish to receipt (ms, log scale)",
            "fraction of commands",
            (x.start * 0.8..x.end * 1.25).log_scale(),
            0.0..1.0,
            &lines,
        )?;
        wrote += 1;
    }
    if wrote == 0 {
        match run {
            "" => bail!(
                "no density-<broker>.json or latency-<broker>.json (written without --name) in {}",
                out.display()
            ),
            sfx => bail!(
                "no density-<broker>-{sfx}.json or latency-<broker>-{sfx}.json in {}",
                out.display()
            ),
        }
    }
    Ok(())
}

/// The run a result file belongs to: `""` for `<prefix><broker>.json`, `SFX` for
/// `<prefix><broker>-SFX.json`, `None` when the file name does not start with its broker.
fn run_of<'a>(stem: &'a str, prefix: &str, broker: &str) -> Option<&'a str> {
    let rest = stem.strip_prefix(prefix)?.strip_prefix(broker)?;
    match rest {
        "" => Some(""),
        _ => rest.strip_prefix('-').filter(|sfx| !sfx.is_empty()),
    }
}

/// One line per `<prefix><broker>[-<run>].json` in `dir` (sorted by name) of run `run` (see
/// [`run_of`]) that `line` accepts, labelled with its broker.
fn lines_from(
    dir: &Path,
    prefix: &str,
    run: &str,
    line: impl Fn(&Value) -> Option<Vec<(f64, f64)>>,
) -> Result<Vec<Line>> {
    let mut files: Vec<PathBuf> = std::fs::read_dir(dir)
        .with_context(|| format!("{}", dir.display()))?
        .filter_map(|e| e.ok().map(|e| e.path()))
        .filter(|p| p.extension().is_some_and(|e| e == "json"))
        .filter(|p| {
            p.file_name()
                .and_then(|n| n.to_str())
                .is_some_and(|n| n.starts_with(prefix))
        })
        .collect();
    files.sort();
    let mut out = Vec::new();
    for f in files {
        let v: Value = serde_json::from_str(&std::fs::read_to_string(&f)?)
            .with_context(|| format!("{} is not JSON", f.display()))?;
        let stem = f.file_stem().and_then(|s| s.to_str()).unwrap_or_default();
        let Some(broker) = v["broker"].as_str() else {
            continue;
        };
        if run_of(stem, prefix, broker) != Some(run) {
            continue;
        }
        if let Some(points) = line(&v).filter(|p| p.len() >= 2) {
            eprintln!("bench: plotting {}", f.display());
            let label = broker.to_string();
            out.push(Line { label, points });
        }
    }
    Ok(out)
}

/// (connections, RSS MiB) per density point.
fn density_line(v: &Value) -> Option<Vec<(f64, f64)>> {
    let mut pts: Vec<(f64, f64)> = v["points"]
        .as_array()?
        .iter()
        .filter_map(|p| Some((p["conns"].as_f64()?, p["rss_kb"].as_f64()? / 1024.0)))
        .collect();
    pts.sort_by(|a, b| a.0.total_cmp(&b.0));
    Some(pts)
}

/// (latency ms, cumulative fraction) at each quantile: the median over `shape`'s sessions.
fn latency_line(v: &Value, shape: &str) -> Option<Vec<(f64, f64)>> {
    let sessions: Vec<&Value> = v["sessions"]
        .as_array()?
        .iter()
        .filter(|s| s["shape"] == shape)
        .collect();
    if let Some(pts) = cdf_line(&sessions) {
        return Some(pts);
    }
    let pts = QUANTILES.iter().filter_map(|&(q, frac)| {
        let vals: Vec<f64> = sessions
            .iter()
            .filter_map(|s| s["latency_us"][q].as_f64())
            .collect();
        median(&vals).map(|us| ((us / 1e3).max(0.001), frac))
    });
    Some(pts.collect())
}

/// The median over sessions at each fraction of their `latency_us.cdf`, when every session
/// has one on the same fractions.
fn cdf_line(sessions: &[&Value]) -> Option<Vec<(f64, f64)>> {
    let cdfs: Vec<Vec<(f64, f64)>> = sessions
        .iter()
        .map(|s| {
            s["latency_us"]["cdf"]
                .as_array()?
                .iter()
                .map(|p| Some((p[0].as_f64()?, p[1].as_f64()?)))
                .collect::<Option<Vec<_>>>()
        })
        .collect::<Option<_>>()?;
    let first = cdfs.first().filter(|c| !c.is_empty())?;
    let same_grid = cdfs
        .iter()
        .all(|c| c.len() == first.len() && c.iter().zip(first).all(|(a, b)| a.0 == b.0));
    if !same_grid {
        return None;
    }
    let pts = first.iter().enumerate().filter_map(|(i, &(frac, _))| {
        let vals: Vec<f64> = cdfs.iter().map(|c| c[i].1).collect();
        median(&vals).map(|us| ((us / 1e3).max(0.001), frac))
    });
    Some(pts.collect())
}

/// Lines with at most this many points get a marker at each.
const MARKED_POINTS: usize = 12;

/// Line colours, chosen to stay apart on white (the first is fleetlink-fe where files sort so).
const COLORS: [RGBColor; 8] = [
    RGBColor(0xd6, 0x27, 0x28),
    RGBColor(0x1f, 0x77, 0xb4),
    RGBColor(0x2c, 0xa0, 0x2c),
    RGBColor(0xff, 0x7f, 0x0e),
    RGBColor(0x94, 0x67, 0xbd),
    RGBColor(0x44, 0x44, 0x44),
    RGBColor(0x8c, 0x56, 0x4b),
    RGBColor(0x17, 0xbe, 0xcf),
];

/// An axis label without float noise: `2000`, `0.5`, `0.01`.
fn tick(v: f64) -> String {
    let s = format!("{v:.3}");
    s.trim_end_matches('0').trim_end_matches('.').to_string()
}

/// The power of ten at or below `v`: a log axis labels only its powers of ten, so one that
/// started between two left its lowest points (a few MiB) under no label at all.
fn decade_below(v: f64) -> f64 {
    10f64.powf(v.log10().floor())
}

/// The x and y ranges covering every point.
fn bounds(lines: &[Line]) -> (Range<f64>, Range<f64>) {
    let pts = || lines.iter().flat_map(|l| l.points.iter());
    let lo = |f: fn(&(f64, f64)) -> f64| pts().map(f).fold(f64::INFINITY, f64::min);
    let hi = |f: fn(&(f64, f64)) -> f64| pts().map(f).fold(f64::NEG_INFINITY, f64::max);
    (lo(|p| p.0)..hi(|p| p.0), lo(|p| p.1)..hi(|p| p.1))
}

/// Draws `lines` (with a marker at each point) and a legend into an SVG at `path`.
fn draw<X, Y>(
    path: &Path,
    title: &str,
    x_desc: &str,
    y_desc: &str,
    x: X,
    y: Y,
    lines: &[Line],
) -> Result<()>
where
    X: AsRangedCoord<Value = f64>,
    Y: AsRangedCoord<Value = f64>,
    X::CoordDescType: ValueFormatter<f64>,
    Y::CoordDescType: ValueFormatter<f64>,
{
    let root = SVGBackend::new(path, (960, 600)).into_drawing_area();
    root.fill(&WHITE)?;
    let mut chart = ChartBuilder::on(&root)
        .caption(title, ("sans-serif", 18))
        .margin(16)
        .x_label_area_size(44)
        .y_label_area_size(64)
        .build_cartesian_2d(x, y)?;
    chart
        .configure_mesh()
        .x_desc(x_desc)
        .y_desc(y_desc)
        .x_label_formatter(&|v| tick(*v))
        .y_label_formatter(&|v| tick(*v))
        .draw()?;
    for (i, line) in lines.iter().enumerate() {
        let color = COLORS[i % COLORS.len()];
        chart
            .draw_series(LineSeries::new(
                line.points.iter().copied(),
                color.stroke_width(2),
            ))?
            .label(&line.label)
            .legend(move |(x, y)| {
                PathElement::new(vec![(x, y), (x + 20, y)], color.stroke_width(2))
            });
        // Marks only where a line joins a few measured points; a full CDF is its own curve.
        if line.points.len() <= MARKED_POINTS {
            chart.draw_series(
                line.points
                    .iter()
                    .map(|&p| Circle::new(p, 3, color.filled())),
            )?;
        }
    }
    chart
        .configure_series_labels()
        .position(SeriesLabelPosition::UpperLeft)
        .background_style(WHITE.mix(0.85))
        .border_style(BLACK)
        .draw()?;
    root.present()?;
    eprintln!("bench: wrote {}", path.display());
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn latency_quantiles_take_the_median_session() {
        let q = |p50| json!({"min": 100, "p50": p50, "p90": 900, "p99": 2000, "p999": 3000, "max": 4000});
        let v = json!({"sessions": [
            {"shape": "single", "latency_us": q(400)},
            {"shape": "single", "latency_us": q(600)},
            {"shape": "single", "latency_us": q(500)},
            {"shape": "fanout", "latency_us": q(9000)},
        ]});
        let pts = latency_line(&v, "single").unwrap();
        assert_eq!(pts.len(), 6);
        assert_eq!(pts[1], (0.5, 0.5));
        assert_eq!(pts[5], (4.0, 1.0));
    }

    #[test]
    fn a_cdf_takes_the_median_session_at_each_fraction_and_wins_over_the_quantiles() {
        let s = |p50, max| {
            json!({"shape": "single", "latency_us": {"p50": 1, "max": 1,
                "cdf": [[0.5, p50], [0.99, 2000], [1.0, max]]}})
        };
        let v = json!({"sessions": [s(400, 3000), s(600, 5000), s(500, 4000)]});
        assert_eq!(
            latency_line(&v, "single").unwrap(),
            vec![(0.5, 0.5), (2.0, 0.99), (4.0, 1.0)]
        );
        // A session without a cdf, or on other fractions: back to the six quantiles.
        let v = json!({"sessions": [s(400, 3000),
            {"shape": "single", "latency_us": {"min": 1, "p50": 2, "p90": 3, "p99": 4, "p999": 5, "max": 6}}]});
        assert_eq!(latency_line(&v, "single").unwrap().len(), 6);
    }

    #[test]
    fn a_file_belongs_to_the_run_its_name_adds_to_its_broker() {
        let run = |stem, broker| run_of(stem, "latency-", broker);
        assert_eq!(
            run("latency-fleetlink-fe-redis", "fleetlink-fe-redis"),
            Some("")
        );
        assert_eq!(
            run("latency-fleetlink-fe-redis-r12", "fleetlink-fe-redis"),
            Some("r12")
        );
        // A broker whose name extends another's is not that broker's run.
        assert_eq!(
            run(
                "latency-fleetlink-fe-redis-nopersist",
                "fleetlink-fe-redis-nopersist"
            ),
            Some("")
        );
        assert_eq!(
            run("latency-fleetlink-fe-admin-admin-r3", "fleetlink-fe-admin"),
            Some("admin-r3")
        );
        assert_eq!(
            run(
                "latency-fleetlink-fe-redis+nice-nice1",
                "fleetlink-fe-redis+nice"
            ),
            Some("nice1")
        );
        assert_eq!(
            run("latency-tokio-baseline-default", "fleetlink-fe-redis"),
            None
        );
        assert_eq!(
            run("latency-fleetlink-fe-redis-", "fleetlink-fe-redis"),
            None
        );
        assert_eq!(run_of("density-rounds", "density-", ""), None);
    }

    #[test]
    fn only_the_chosen_run_is_drawn() {
        let dir = tempfile::tempdir().unwrap();
        let q = json!({"min": 100, "p50": 500, "p90": 900, "p99": 2000, "p999": 3000, "max": 4000});
        let file = |name: &str, broker: &str| {
            let v = json!({"broker": broker, "sessions": [{"shape": "single", "latency_us": q}]});
            std::fs::write(dir.path().join(name), v.to_string()).unwrap();
        };
        file("latency-fleetlink-fe-redis.json", "fleetlink-fe-redis");
        file(
            "latency-fleetlink-fe-redis-nopersist.json",
            "fleetlink-fe-redis-nopersist",
        );
        file("latency-fleetlink-fe-redis-r12.json", "fleetlink-fe-redis");
        file(
            "latency-fleetlink-fe-admin-admin-r3.json",
            "fleetlink-fe-admin",
        );
        let labels = |run| {
            lines_from(dir.path(), "latency-", run, |v| latency_line(v, "single"))
                .unwrap()
                .into_iter()
                .map(|l| l.label)
                .collect::<Vec<_>>()
        };
        // In file-name order: '-' sorts before '.'.
        assert_eq!(
            labels(""),
            ["fleetlink-fe-redis-nopersist", "fleetlink-fe-redis"]
        );
        assert_eq!(labels("r12"), ["fleetlink-fe-redis"]);
        assert_eq!(labels("admin-r3"), ["fleetlink-fe-admin"]);
        assert!(labels("r99").is_empty());
    }

    #[test]
    fn a_log_axis_starts_at_a_labelled_decade() {
        assert_eq!(decade_below(4.7), 1.0);
        assert_eq!(decade_below(10.0), 10.0);
        assert_eq!(decade_below(123.0), 100.0);
    }

    #[test]
    fn ticks_drop_float_noise() {
        assert_eq!(tick(2000.0), "2000");
        assert_eq!(tick(0.30000000000000004), "0.3");
        assert_eq!(tick(0.01), "0.01");
    }

    #[test]
    fn density_points_in_mib_sorted() {
        let v = json!({"points": [{"conns": 1000, "rss_kb": 2048}, {"conns": 0, "rss_kb": 1024}]});
        assert_eq!(density_line(&v).unwrap(), vec![(0.0, 1.0), (1000.0, 2.0)]);
    }
}
