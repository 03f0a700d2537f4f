//! The table and the plot of `bench engines`.

use std::fmt::Write as _;
use std::path::Path;

use plotters::prelude::*;

use super::{Machine, Plan, Report, Row};
use crate::harness::plot::{
    Layout, canvas, dots, legend, line, panel, plot_error, thousands, whole_numbers,
};

pub(super) fn table_header(m: &Machine, plan: &Plan) -> String {
    let mut out = String::new();
    let _ = writeln!(
        out,
        "# pmcache bench engines — kernel {}, {} CPUs ({}), {}; {}; 4 KiB, median of {} runs \
         of {:.2} s per point; files of {} MiB",
        m.kernel,
        m.cpus,
        m.cpu_model,
        m.fio_version.as_deref().unwrap_or("no fio"),
        m.cpu_idle,
        plan.runs,
        plan.runtime_secs,
        plan.file_bytes >> 20
    );
    let _ = writeln!(
        out,
        "{:<5} {:<8} {:<9} {:<16} {:>4} {:>3} {:>10} {:>9} {:>9} {:>10} {:>9} {:>6} {:>11}",
        "file",
        "mode",
        "rw",
        "engine",
        "jobs",
        "qd",
        "IOPS",
        "mean µs",
        "p99 µs",
        "fio IOPS",
        "fio µs",
        "ratio",
        "runs"
    );
    out
}

pub(super) fn table_row(r: &Row) -> String {
    let mut out = String::new();
    let mode = if r.direct { "O_DIRECT" } else { "buffered" };
    let us = |ns: f64| ns / 1000.0;
    let (iops, mean, p99) = r.ours.map_or(("-".into(), "-".into(), "-".into()), |s| {
        (
            format!("{:.0}", s.iops),
            format!("{:.1}", us(s.latency_ns_mean)),
            format!("{:.1}", us(s.latency_ns_p99)),
        )
    });
    let (fio_iops, fio_mean) = r.fio.map_or(("-".into(), "-".into()), |s| {
        (format!("{:.0}", s.iops), format!("{:.1}", us(s.latency_ns_mean)))
    });
    let ratio = r.ratio.map_or("-".into(), |x| format!("{x:.2}"));
    let lowest = r.run_ratios.iter().copied().reduce(f64::min);
    let highest = r.run_ratios.iter().copied().reduce(f64::max);
    let spread = match (lowest, highest) {
        (Some(low), Some(high)) => format!("{low:.2}–{high:.2}"),
        _ => "-".into(),
    };
    let _ = writeln!(
        out,
        "{:<5} {:<8} {:<9} {:<16} {:>4} {:>3} {:>10} {:>9} {:>9} {:>10} {:>9} {:>6} {:>11}",
        r.file,
        mode,
        r.rw,
        r.engine,
        r.jobs,
        r.qd,
        iops,
        mean,
        p99,
        fio_iops,
        fio_mean,
        ratio,
        spread
    );
    if let Some(e) = &r.error {
        let _ = writeln!(out, "      ours: {e}");
    }
    if let Some(e) = &r.fio_error {
        let _ = writeln!(out, "      fio:  {e}");
    }
    out
}

pub(super) fn table_summary(rows: &[Row]) -> String {
    let ratios: Vec<f64> = rows.iter().filter_map(|r| r.ratio).collect();
    if ratios.is_empty() {
        return String::new();
    }
    let below = ratios.iter().filter(|&&x| x < 0.90).count();
    let min = ratios.iter().copied().fold(f64::INFINITY, f64::min);
    format!(
        "# {} points with a fio baseline; {} below 0.90x; lowest ratio {:.2}\n",
        ratios.len(),
        below,
        min
    )
}

/// One panel per (file, workload, queue depth): IOPS vs jobs, a solid line per engine (ours)
/// and a dashed-looking line of hollow points for fio's same engine.
pub(super) fn plot(report: &Report, path: &Path) -> Result<(), String> {
    let mut panels: Vec<(String, String, usize)> = Vec::new();
    for r in &report.rows {
        let key = (r.file.clone(), r.rw.clone(), r.qd);
        if !panels.contains(&key) {
            panels.push(key);
        }
    }
    if panels.is_empty() {
        return Ok(());
    }
    let cols = panels.len().min(2);
    let rows = panels.len().div_ceil(cols);
    let root = canvas(path, (720 * cols as u32, 480 * rows as u32))?;
    let areas = root.split_evenly((rows, cols));
    let layout = Layout { font: 18, margin: 10, x_labels: 35 };
    let max_jobs = report.plan.jobs.iter().copied().max().unwrap_or(1).max(2) as f64;
    for ((file, rw, qd), area) in panels.iter().zip(areas.iter()) {
        let mine: Vec<&Row> =
            report.rows.iter().filter(|r| &r.file == file && &r.rw == rw && r.qd == *qd).collect();
        let y_max = mine
            .iter()
            .flat_map(|r| [r.ours.map(|s| s.iops), r.fio.map(|s| s.iops)])
            .flatten()
            .fold(1.0f64, f64::max)
            * 1.1;
        let mode = mine.first().map_or("", |r| if r.direct { "O_DIRECT" } else { "buffered" });
        let caption = format!("{file} ({mode}), 4 KiB {rw}, QD{qd}");
        let mut chart = panel(area, caption, &layout, 0.5..max_jobs + 0.5, 0.0..y_max)?;
        chart
            .configure_mesh()
            .x_desc("jobs")
            .y_desc("IOPS")
            .x_labels(max_jobs as usize + 2)
            .x_label_formatter(&whole_numbers)
            .disable_x_mesh()
            .y_label_formatter(&thousands)
            .draw()
            .map_err(plot_error)?;
        for (i, engine) in report.plan.engines.iter().enumerate() {
            let color = Palette99::pick(i).to_rgba();
            let points = |f: &dyn Fn(&Row) -> Option<f64>| -> Vec<(f64, f64)> {
                let mut p: Vec<(f64, f64)> = mine
                    .iter()
                    .filter(|r| &r.engine == engine)
                    .filter_map(|r| f(r).map(|y| (r.jobs as f64, y)))
                    .collect();
                p.sort_by(|a, b| a.0.total_cmp(&b.0));
                p
            };
            let ours = points(&|r| r.ours.map(|s| s.iops));
            let fio = points(&|r| r.fio.map(|s| s.iops));
            if !ours.is_empty() {
                line(
                    &mut chart,
                    ours.clone(),
                    color.stroke_width(2),
                    format!("{engine} (pmcache)"),
                )?;
                dots(&mut chart, &ours, color.filled())?;
            }
            if !fio.is_empty() {
                let faint = color.mix(0.4).stroke_width(1);
                line(&mut chart, fio.clone(), faint, format!("{engine} (fio)"))?;
                dots(&mut chart, &fio, color.stroke_width(1))?;
            }
        }
        legend(&mut chart, SeriesLabelPosition::UpperLeft, Some(11))?;
    }
    root.present().map_err(plot_error)
}
