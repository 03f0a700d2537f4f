//! The lines, the summary and the plot of `bench writeback`.

use std::fmt::Write as _;
use std::path::Path;

use plotters::prelude::*;

use super::{DrainRun, Plan, Report, Sample, Shape, ShapeRow};
use crate::harness::fio::engines_text;
use crate::harness::plot::{Layout, canvas, legend, line, panel, plot_error, thousands};
use crate::harness::stats::median_of_finite as median;

/// A run's line of configuration `config`.
pub(super) fn sample_line(
    run: usize,
    shape: Shape,
    config: &str,
    s: &Sample,
    raw: Option<f64>,
) -> String {
    let ratio = match (config, raw) {
        ("raw", _) | (_, None) => String::from("    -"),
        (_, Some(raw)) => format!("{:5.2}", s.iops / raw),
    };
    let mut line = format!(
        "  run {} {shape:>5} {config:<8} {:>9.0} IOPS  ×raw {ratio}  min1s/mean {}  p50 {}  \
         p99 {}  p99.9 {}  max {}",
        run + 1,
        s.iops,
        share(s.min_window_ratio),
        us(s.latency_ns_p50),
        us(s.latency_ns_p99),
        us(s.latency_ns_p999),
        us(s.latency_ns_max),
    );
    if !s.raw_engines.is_empty() {
        let _ = write!(line, "  fio engine {}", engines_text(&s.raw_engines));
    }
    if let Some(c) = &s.cleaner {
        let _ = write!(
            line,
            "  dirty {:.0}%  full@{}  cleaned {} in {} writes  inline {}  stalls {} (p99 {}, max \
             {})  boosts {} ({:.1} s)",
            s.dirty_fraction_end.unwrap_or(f64::NAN) * 100.0,
            s.full_after_s.map_or("-".into(), |t| format!("{t:.1}s")),
            c.blocks_cleaned,
            c.writes_issued,
            c.inline_writebacks,
            c.stalls,
            us(c.stall_ns_p99 as f64),
            us(c.stall_ns_max as f64),
            c.boosts,
            c.boosted_s
        );
    }
    line
}

fn us(ns: f64) -> String {
    if !ns.is_finite() {
        "-".into()
    } else if ns >= 1e6 {
        format!("{:.1}ms", ns / 1e6)
    } else {
        format!("{:.0}µs", ns / 1e3)
    }
}

pub(super) fn summary(plan: &Plan, rows: &[ShapeRow], drains: &[DrainRun]) -> String {
    let mut out = String::new();
    let _ = writeln!(
        out,
        "\nmedians of {} run(s): steady IOPS (after the cache is full), ratio to raw in the \
         same run, slowest second / mean, latency of writes after the cache is full",
        plan.runs
    );
    let _ = writeln!(
        out,
        "{:>6} {:<8} {:>9} {:>6} {:>10} {:>9} {:>9} {:>9} {:>9}",
        "shape", "config", "IOPS", "×raw", "min1s/mean", "p99", "p99.9", "max", "p99.9/raw"
    );
    for row in rows {
        let m = |f: &dyn Fn(&Sample) -> f64| median(&row.runs.iter().map(f).collect::<Vec<_>>());
        let raw_p999 = rows
            .iter()
            .find(|r| r.shape == row.shape && r.config == "raw")
            .map(|r| median(&r.runs.iter().map(|s| s.latency_ns_p999).collect::<Vec<_>>()));
        let p999 = m(&|s| s.latency_ns_p999);
        let _ = writeln!(
            out,
            "{:>6} {:<8} {:>9.0} {:>6} {:>10} {:>9} {:>9} {:>9} {:>9}",
            row.shape.to_string(),
            row.config,
            m(&|s| s.iops),
            if row.ratios.is_empty() { "-".into() } else { format!("{:.2}", median(&row.ratios)) },
            share(m(&|s| s.min_window_ratio)),
            us(m(&|s| s.latency_ns_p99)),
            us(p999),
            us(m(&|s| s.latency_ns_max)),
            match raw_p999 {
                Some(raw) if row.config != "raw" => format!("{:.2}", p999 / raw),
                _ => "-".into(),
            }
        );
    }
    if !drains.is_empty() {
        let cleaner = median(&drains.iter().map(|d| d.cleaner_blocks_per_s).collect::<Vec<_>>());
        let fio = median(&drains.iter().filter_map(|d| d.fio_blocks_per_s).collect::<Vec<_>>());
        let ratio = median(&drains.iter().filter_map(|d| d.ratio).collect::<Vec<_>>());
        let _ = writeln!(
            out,
            "drain of {} dirty blocks: cleaner {cleaner:.0} blocks/s, fio writing the same \
             blocks (its best engine, QD {}) {fio:.0} blocks/s, ratio {ratio:.2}",
            drains[0].blocks, plan.cleaner.queue_depth
        );
    }
    out
}

/// Two panels per write shape: each configuration's writes per second in its first run, and
/// the cache's dirty share.
pub(super) fn plot(report: &Report, path: &Path) -> Result<(), String> {
    // The write shapes (the read-miss rows have no dirty share to plot).
    let written = |r: &&ShapeRow| ["raw", "cleaner", "inline"].contains(&r.config.as_str());
    let shapes: Vec<Shape> = report.rows.iter().filter(written).fold(Vec::new(), |mut v, r| {
        if !v.contains(&r.shape) {
            v.push(r.shape);
        }
        v
    });
    if shapes.is_empty() {
        return Ok(());
    }
    let root = canvas(path, (1100, 380 * shapes.len() as u32 * 2))?;
    let areas = root.split_evenly((shapes.len() * 2, 1));
    let layout = Layout { font: 16, margin: 10, x_labels: 30 };
    let configs = ["raw", "cleaner", "inline"];
    for (i, shape) in shapes.iter().enumerate() {
        // The first run of each configuration.
        let series: Vec<(&str, &Sample)> = configs
            .iter()
            .filter_map(|c| {
                report
                    .rows
                    .iter()
                    .find(|r| r.shape == *shape && r.config == *c)
                    .and_then(|r| r.runs.first().map(|s| (*c, s)))
            })
            .collect();
        let seconds = series.iter().map(|(_, s)| s.iops_timeline.len()).max().unwrap_or(1).max(1);
        let y_max =
            series.iter().flat_map(|(_, s)| s.iops_timeline.iter().copied()).fold(1.0f64, f64::max)
                * 1.1;
        let caption = format!(
            "{shape} writers×depth: 4 KiB random writes per second, cache {} MiB, span {} MiB",
            report.cache_mib, report.span_mib
        );
        let mut chart = panel(&areas[2 * i], caption, &layout, 0.0..seconds as f64, 0.0..y_max)?;
        chart
            .configure_mesh()
            .x_desc("s")
            .y_desc("IOPS")
            .y_label_formatter(&thousands)
            .draw()
            .map_err(plot_error)?;
        for (j, (config, sample)) in series.iter().enumerate() {
            let points = timeline(&sample.iops_timeline, 0.5);
            line(&mut chart, points, Palette99::pick(j).stroke_width(2), *config)?;
        }
        legend(&mut chart, SeriesLabelPosition::LowerRight, None)?;
        let caption = format!("{shape}: dirty share of the cache");
        let mut dirty = panel(&areas[2 * i + 1], caption, &layout, 0.0..seconds as f64, 0.0..1.0)?;
        dirty
            .configure_mesh()
            .x_desc("s")
            .y_desc("dirty")
            .y_label_formatter(&|y| format!("{:.0}%", y * 100.0))
            .draw()
            .map_err(plot_error)?;
        for (j, (config, sample)) in series.iter().enumerate() {
            if sample.dirty_timeline.is_empty() {
                continue;
            }
            let points = timeline(&sample.dirty_timeline, 1.0);
            line(&mut dirty, points, Palette99::pick(j).stroke_width(2), *config)?;
        }
        legend(&mut dirty, SeriesLabelPosition::LowerRight, None)?;
    }
    root.present().map_err(plot_error)
}

/// A per-second timeline as points, the first at `offset` seconds.
fn timeline(values: &[f64], offset: f64) -> Vec<(f64, f64)> {
    values.iter().enumerate().map(|(t, &v)| (t as f64 + offset, v)).collect()
}

/// A share to two places, or `-` where there is none (fio's reads keep no per-second log).
fn share(value: f64) -> String {
    if value.is_finite() { format!("{value:.2}") } else { "-".into() }
}
