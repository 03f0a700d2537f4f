//! The tables and the plot of `bench paper002`.

use std::fmt::Write as _;
use std::path::Path;

use plotters::prelude::*;
use pmcache_frontend::units::human;

use super::{Plan, Report, Row};
use crate::harness::fio::engines_text;
use crate::harness::machine::Machine;
use crate::harness::output::opt;
use crate::harness::plot::{Layout, canvas, dots, legend, line, panel, plot_error, whole_numbers};
use crate::harness::stats::median;

pub(super) fn header(m: &Machine, plan: &Plan) -> String {
    let mut out = String::new();
    let _ = writeln!(
        out,
        "# pmcache bench paper002 — kernel {}, {} CPUs ({}), {}",
        m.kernel, m.cpus, m.cpu_model, m.fio
    );
    let extra = if plan.cleaner.is_empty() {
        String::new()
    } else {
        format!(", cleaner {}", plan.cleaner.join(" "))
    };
    let _ = writeln!(
        out,
        "# {} random writes over NBD (one connection per writer, QD{} each), span {}, cache {} \
         in /dev/shm{extra}; the server's threads confined to CPUs 0..n-1; {} s per run, \
         median of {} runs; ×off: over adaptive=off in the same run; ×{}cpu: over the same \
         with the most CPUs; failed/write: failed insertions (stalls and paced waits) per block written; ctx sw: the server \
         threads' context switches during the run",
        human(plan.bs),
        plan.qd,
        human(plan.span_bytes),
        human(plan.cache_bytes),
        plan.seconds,
        plan.runs,
        plan.cpus.iter().max().copied().unwrap_or(1)
    );
    let _ = writeln!(
        out,
        "{:<4} {:>7} {:<9} {:>8} {:>6} {:>6} {:>6} {:>12} {:>9} {:>9} {:>7} {:>9} {:>10}",
        "cpus",
        "writers",
        "adaptive",
        "MB/s",
        "×off",
        format!("×{}cpu", plan.cpus.iter().max().copied().unwrap_or(1)),
        "×raw",
        "failed/write",
        "failed",
        "ctx sw",
        "boosts",
        "boosted s",
        "cleaned"
    );
    out
}

pub(super) fn main_row(r: &Row) -> String {
    let mut out = String::new();
    let _ = writeln!(
        out,
        "{:<4} {:>7} {:<9} {:>8} {:>6} {:>6} {:>6} {:>12} {:>9} {:>9} {:>7} {:>9} {:>10}",
        r.cpus.map_or("-".into(), |c| c.to_string()),
        r.writers,
        r.adaptive,
        opt(r.mb_per_s, 1),
        opt(r.ratio_to_off, 2),
        opt(r.ratio_to_most_cpus, 2),
        opt(r.ratio_to_raw, 2),
        r.failed_per_write.map_or("-".into(), |x| format!("{x:.2e}")),
        opt(r.failed_insertions, 0),
        opt(r.context_switches, 0),
        opt(r.boosts, 0),
        opt(r.boosted_s, 2),
        opt(r.blocks_cleaned, 0)
    );
    if !r.context_switches_by_thread.is_empty() {
        let parts: Vec<String> =
            r.context_switches_by_thread.iter().map(|(k, v)| format!("{k} {v}")).collect();
        let _ = writeln!(out, "     └ ctx sw by thread (median run): {}", parts.join(", "));
    }
    if !r.raw_engines.is_empty() {
        let _ = writeln!(out, "     └ fio engine (median run): {}", engines_text(&r.raw_engines));
    }
    for e in &r.errors {
        let _ = writeln!(out, "     └ error: {e}");
    }
    out
}

pub(super) fn table1_header(terms: u64, pi_alone: &[f64]) -> String {
    let mut out = String::new();
    let _ = writeln!(
        out,
        "\n# Table 1 — the server on CPU 0 with a CPU-bound job on CPU 0 (π from {terms} \
         Leibniz terms: {} s alone, median of {} runs); fio runs until the π job ends; \
         ×alone: bandwidth over the main table's 1-CPU row; π ×alone: over the π job alone in \
         the same run",
        opt(median(pi_alone.iter().copied()), 2),
        pi_alone.len()
    );
    let _ = writeln!(
        out,
        "{:>7} {:<9} {:>8} {:>7} {:>9} {:>8} {:>8} {:>12} {:>7} {:>9}",
        "writers",
        "adaptive",
        "MB/s",
        "×alone",
        "ctx sw",
        "π s",
        "π ×alone",
        "failed/write",
        "boosts",
        "boosted s"
    );
    out
}

pub(super) fn table1_row(r: &Row) -> String {
    let mut out = String::new();
    let _ = writeln!(
        out,
        "{:>7} {:<9} {:>8} {:>7} {:>9} {:>8} {:>8} {:>12} {:>7} {:>9}",
        r.writers,
        r.adaptive,
        opt(r.mb_per_s, 1),
        opt(r.ratio_to_without_pi, 2),
        opt(r.context_switches, 0),
        opt(r.pi_seconds, 2),
        opt(r.pi_ratio_to_alone, 2),
        r.failed_per_write.map_or("-".into(), |x| format!("{x:.2e}")),
        opt(r.boosts, 0),
        opt(r.boosted_s, 2)
    );
    for e in &r.errors {
        let _ = writeln!(out, "        └ error: {e}");
    }
    out
}

/// A figure of a row, for a plot.
type Figure = fn(&Row) -> Option<f64>;

/// Six panels: bandwidth, context switches and failed insertions per write against writers (a line per
/// CPU count and mode, the raw file dashed), and Table 1's bandwidth, π time and context
/// switches as bars beside their references.
pub(super) fn plot(report: &Report, path: &Path) -> Result<(), String> {
    let root = canvas(path, (1440, 1440))?;
    let areas = root.split_evenly((3, 2));
    let layout = Layout { font: 18, margin: 12, x_labels: 35 };

    // The lines: one per (cpus, adaptive).
    let mut lines: Vec<(Option<usize>, String)> = Vec::new();
    for r in &report.rows {
        let key = (r.cpus, r.adaptive.clone());
        if !lines.contains(&key) {
            lines.push(key);
        }
    }
    let max_writers = report.plan.writers.iter().copied().max().unwrap_or(1).max(2) as f64;
    let panels: [(&str, &str, Figure); 3] = [
        ("bandwidth, 4 MiB random writes over NBD", "MB/s", |r| r.mb_per_s),
        ("server context switches during the run", "context switches", |r| r.context_switches),
        ("failed insertions per block written", "failed / write", |r| r.failed_per_write),
    ];
    for (i, (title, y_desc, value)) in panels.iter().enumerate() {
        let y_max = report.rows.iter().filter_map(value).fold(0.0f64, f64::max).max(1e-9) * 1.15;
        let mut chart = panel(&areas[i], title, &layout, 0.5..max_writers + 0.5, 0.0..y_max)?;
        chart
            .configure_mesh()
            .x_desc("writers (NBD connections)")
            .y_desc(*y_desc)
            .x_labels(max_writers as usize + 2)
            .x_label_formatter(&whole_numbers)
            .disable_x_mesh()
            .draw()
            .map_err(plot_error)?;
        for (k, (cpus, adaptive)) in lines.iter().enumerate() {
            let mut points: Vec<(f64, f64)> = report
                .rows
                .iter()
                .filter(|r| r.cpus == *cpus && &r.adaptive == adaptive)
                .filter_map(|r| value(r).map(|y| (r.writers as f64, y)))
                .collect();
            if points.is_empty() {
                continue;
            }
            points.sort_by(|a, b| a.0.total_cmp(&b.0));
            let color = if cpus.is_none() { BLACK.mix(0.5) } else { Palette99::pick(k).to_rgba() };
            let label = match cpus {
                Some(c) => format!("{c} CPU, {adaptive}"),
                None => "raw file".into(),
            };
            let width = if adaptive == "off" || cpus.is_none() { 1 } else { 2 };
            line(&mut chart, points.clone(), color.stroke_width(width), label)?;
            dots(&mut chart, &points, color.filled())?;
        }
        legend(&mut chart, SeriesLabelPosition::UpperLeft, Some(11))?;
    }

    // Table 1: bars, one group per row.
    let t1 = &report.table1;
    let pi_alone = median(report.pi_alone_seconds.iter().copied());
    let bar_panels: [(&str, &str, Figure, Option<Figure>); 3] = [
        (
            "Table 1: bandwidth with the π job (light: without it)",
            "MB/s",
            |r| r.mb_per_s,
            Some(|r| r.mb_per_s.zip(r.ratio_to_without_pi).map(|(b, x)| b / x)),
        ),
        ("Table 1: the π job's time (line: alone)", "seconds", |r| r.pi_seconds, None),
        ("Table 1: server context switches", "context switches", |r| r.context_switches, None),
    ];
    for (i, (title, y_desc, value, reference)) in bar_panels.iter().enumerate() {
        let area = &areas[3 + i];
        if t1.is_empty() {
            continue;
        }
        let mut y_max = t1.iter().filter_map(value).fold(0.0f64, f64::max);
        if let Some(reference) = reference {
            y_max = t1.iter().filter_map(reference).fold(y_max, f64::max);
        }
        if i == 1 {
            y_max = y_max.max(pi_alone.unwrap_or(0.0));
        }
        let y_max = y_max.max(1e-9) * 1.15;
        let n = t1.len();
        let mut chart = panel(area, title, &layout, -0.5..n as f64 - 0.5, 0.0..y_max)?;
        let names: Vec<String> =
            t1.iter().map(|r| format!("{} w, {}", r.writers, r.adaptive)).collect();
        chart
            .configure_mesh()
            .y_desc(*y_desc)
            .x_labels(n)
            .x_label_formatter(&|x| {
                let k = x.round();
                if (x - k).abs() < 1e-6 && k >= 0.0 {
                    names.get(k as usize).cloned().unwrap_or_default()
                } else {
                    String::new()
                }
            })
            .disable_x_mesh()
            .draw()
            .map_err(plot_error)?;
        for (k, row) in t1.iter().enumerate() {
            let x = k as f64;
            let color = Palette99::pick(k).to_rgba();
            if let Some(reference) = reference.and_then(|f| f(row)) {
                chart
                    .draw_series(std::iter::once(Rectangle::new(
                        [(x - 0.4, 0.0), (x, reference)],
                        color.mix(0.3).filled(),
                    )))
                    .map_err(plot_error)?;
            }
            if let Some(y) = value(row) {
                let left = if reference.is_some() { x } else { x - 0.3 };
                chart
                    .draw_series(std::iter::once(Rectangle::new(
                        [(left, 0.0), (x + 0.3, y)],
                        color.filled(),
                    )))
                    .map_err(plot_error)?;
            }
        }
        if i == 1
            && let Some(alone) = pi_alone
        {
            chart
                .draw_series(LineSeries::new(
                    vec![(-0.5, alone), (n as f64 - 0.5, alone)],
                    BLACK.stroke_width(2),
                ))
                .map_err(plot_error)?;
        }
    }
    root.present().map_err(plot_error)
}
