//! The figures of every run on every layer, their ratios run by run, medians, and the tables
//! they are printed in: shared by the host's bed and the guest's.

use std::fmt::Write as _;

use serde::{Deserialize, Serialize};

use super::speedtest1::SpeedTest;
use crate::harness::output::opt;
use crate::harness::servers::ServerFigures;
use crate::harness::stats::median;

/// One pgbench run on one layer.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct PgbenchPoint {
    /// The layer.
    pub layer: String,
    /// The run (1, 2, …).
    pub run: usize,
    /// Transactions per second.
    pub tps: f64,
    /// Transactions the run finished.
    pub transactions: u64,
    /// The median transaction's latency, milliseconds.
    pub latency_ms_p50: f64,
    /// The 99th percentile, milliseconds.
    pub latency_ms_p99: f64,
    /// CPU seconds the layer's server used over the run (host: pmcache, nbdkit).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub server_cpu_s: Option<f64>,
    /// The guest's busy CPU seconds over the run, all vCPUs (guest).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub guest_busy_s: Option<f64>,
    /// The guest's idle CPU seconds over the run, all vCPUs (guest).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub guest_idle_s: Option<f64>,
    /// CPU seconds nbdfuse used over the run (host).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub nbdfuse_cpu_s: Option<f64>,
    /// pmcache's counters over the run, where the layer is pmcache on the host.
    #[serde(default, skip_serializing_if = "Option::is_none", skip_deserializing)]
    pub pmcache: Option<ServerFigures>,
}

/// One speedtest1 run on one layer.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct SpeedtestPoint {
    /// The layer.
    pub layer: String,
    /// The run (1, 2, …).
    pub run: usize,
    /// speedtest1's total, seconds.
    pub total_s: f64,
    /// Each test.
    pub tests: Vec<SpeedTest>,
}

/// A layer's medians, and its ratios to the baseline (and to the best kernel layer) taken run
/// by run.
#[derive(Debug, Clone, Serialize)]
pub struct LayerSummary {
    /// The layer.
    pub layer: String,
    /// Median TPS.
    pub tps_median: Option<f64>,
    /// Median of the runs' p50 latencies, milliseconds.
    pub latency_ms_p50_median: Option<f64>,
    /// Median of the runs' p99 latencies, milliseconds.
    pub latency_ms_p99_median: Option<f64>,
    /// Median over runs of this layer's TPS / the baseline's TPS in the same run.
    pub tps_ratio_to_baseline_median: Option<f64>,
    /// Median over runs of this layer's TPS / the best kernel layer's TPS in the same run
    /// (guest only).
    pub tps_ratio_to_best_kernel_median: Option<f64>,
    /// Median speedtest1 total, seconds.
    pub speedtest1_total_s_median: Option<f64>,
    /// Median over runs of the baseline's speedtest1 time / this layer's in the same run
    /// (above 1: faster than the baseline).
    pub speedtest1_speedup_to_baseline_median: Option<f64>,
}

fn pg<'a>(points: &'a [PgbenchPoint], layer: &str, run: usize) -> Option<&'a PgbenchPoint> {
    points.iter().find(|p| p.layer == layer && p.run == run)
}

fn st<'a>(points: &'a [SpeedtestPoint], layer: &str, run: usize) -> Option<&'a SpeedtestPoint> {
    points.iter().find(|p| p.layer == layer && p.run == run)
}

/// The TPS ratio of `layer` to `other` in each run both have.
pub fn tps_ratios(points: &[PgbenchPoint], layer: &str, other: &str) -> Vec<(usize, f64)> {
    points
        .iter()
        .filter(|p| p.layer == layer)
        .filter_map(|p| Some((p.run, p.tps / pg(points, other, p.run)?.tps)))
        .collect()
}

/// The kernel layer (of `kernel_layers`) with the highest median TPS.
pub fn best_kernel_layer(points: &[PgbenchPoint], kernel_layers: &[String]) -> Option<String> {
    kernel_layers
        .iter()
        .filter_map(|k| Some((k, median(points.iter().filter(|p| &p.layer == k).map(|p| p.tps))?)))
        .max_by(|a, b| a.1.total_cmp(&b.1))
        .map(|(k, _)| k.clone())
}

/// Each layer's summary, in `layers`' order.
pub fn summarize(
    layers: &[String],
    baseline: &str,
    best_kernel: Option<&str>,
    pgbench: &[PgbenchPoint],
    speedtest1: &[SpeedtestPoint],
) -> Vec<LayerSummary> {
    layers
        .iter()
        .map(|layer| {
            let mine: Vec<&PgbenchPoint> = pgbench.iter().filter(|p| &p.layer == layer).collect();
            let tests: Vec<&SpeedtestPoint> =
                speedtest1.iter().filter(|p| &p.layer == layer).collect();
            let speedups = tests
                .iter()
                .filter_map(|p| Some(st(speedtest1, baseline, p.run)?.total_s / p.total_s));
            LayerSummary {
                layer: layer.clone(),
                tps_median: median(mine.iter().map(|p| p.tps)),
                latency_ms_p50_median: median(mine.iter().map(|p| p.latency_ms_p50)),
                latency_ms_p99_median: median(mine.iter().map(|p| p.latency_ms_p99)),
                tps_ratio_to_baseline_median: median(
                    tps_ratios(pgbench, layer, baseline).into_iter().map(|(_, r)| r),
                ),
                tps_ratio_to_best_kernel_median: best_kernel.and_then(|k| {
                    median(tps_ratios(pgbench, layer, k).into_iter().map(|(_, r)| r))
                }),
                speedtest1_total_s_median: median(tests.iter().map(|p| p.total_s)),
                speedtest1_speedup_to_baseline_median: median(speedups),
            }
        })
        .collect()
}

fn ratio(value: Option<f64>) -> String {
    value.filter(|v| v.is_finite()).map_or_else(|| "-".into(), |v| format!("{v:.2}x"))
}

/// The tables: pgbench run by run (each layer's TPS, p50, p99 and its TPS ratio to the
/// baseline and, with a best kernel layer, to it, in that run), speedtest1 run by run
/// (total and the baseline's time over this layer's), then the medians.
pub fn tables(
    layers: &[String],
    baseline: &str,
    best_kernel: Option<&str>,
    pgbench: &[PgbenchPoint],
    speedtest1: &[SpeedtestPoint],
    summary: &[LayerSummary],
) -> String {
    let runs = pgbench.iter().map(|p| p.run).max().unwrap_or(0);
    let st_runs = speedtest1.iter().map(|p| p.run).max().unwrap_or(0);
    let width = layers.iter().map(String::len).max().unwrap_or(5).max(5);
    let kernel_col = best_kernel.map_or(String::new(), |k| format!("  vs {k}"));
    let mut out = String::new();
    let _ = writeln!(out, "\n## pgbench (TPC-B-like), run by run");
    let _ = writeln!(
        out,
        "run  {:<width$}  {:>9}  {:>10}  {:>10}  {:>8}{kernel_col}",
        "layer",
        "tps",
        "lat_ms_p50",
        "lat_ms_p99",
        format!("vs {baseline}")
    );
    for run in 1..=runs {
        for layer in layers {
            let Some(p) = pg(pgbench, layer, run) else { continue };
            let base = pg(pgbench, baseline, run).map(|b| p.tps / b.tps);
            let kernel = best_kernel
                .map(|k| format!("  {}", ratio(pg(pgbench, k, run).map(|b| p.tps / b.tps))));
            let _ = writeln!(
                out,
                "{run:<3}  {layer:<width$}  {:>9.1}  {:>10.2}  {:>10.2}  {:>8}{}",
                p.tps,
                p.latency_ms_p50,
                p.latency_ms_p99,
                ratio(base),
                kernel.unwrap_or_default()
            );
        }
    }
    if st_runs > 0 {
        let _ =
            writeln!(out, "\n## speedtest1, run by run (speedup: {baseline}'s time / the layer's)");
        let _ = writeln!(out, "run  {:<width$}  {:>9}  {:>8}", "layer", "total_s", "speedup");
        for run in 1..=st_runs {
            for layer in layers {
                let Some(p) = st(speedtest1, layer, run) else { continue };
                let speedup = st(speedtest1, baseline, run).map(|b| b.total_s / p.total_s);
                let _ = writeln!(
                    out,
                    "{run:<3}  {layer:<width$}  {:>9.3}  {:>8}",
                    p.total_s,
                    ratio(speedup)
                );
            }
        }
    }
    let _ = writeln!(out, "\n## medians over runs (ratios: medians of the per-run ratios)");
    let kernel_head =
        best_kernel.map_or(String::new(), |k| format!("  {:>10}", format!("tps vs {k}")));
    let _ = writeln!(
        out,
        "{:<width$}  {:>9}  {:>10}  {:>10}  {:>10}{kernel_head}  {:>10}  {:>10}",
        "layer",
        "tps",
        "lat_ms_p50",
        "lat_ms_p99",
        format!("tps vs {baseline}"),
        "st1_total_s",
        "st1_speedup"
    );
    for s in summary {
        let kernel = best_kernel.map_or(String::new(), |_| {
            format!("  {:>10}", ratio(s.tps_ratio_to_best_kernel_median))
        });
        let _ = writeln!(
            out,
            "{:<width$}  {:>9}  {:>10}  {:>10}  {:>10}{kernel}  {:>10}  {:>10}",
            s.layer,
            opt(s.tps_median, 1),
            opt(s.latency_ms_p50_median, 2),
            opt(s.latency_ms_p99_median, 2),
            ratio(s.tps_ratio_to_baseline_median),
            opt(s.speedtest1_total_s_median, 3),
            ratio(s.speedtest1_speedup_to_baseline_median)
        );
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    fn point(layer: &str, run: usize, tps: f64) -> PgbenchPoint {
        PgbenchPoint {
            layer: layer.into(),
            run,
            tps,
            transactions: 10,
            latency_ms_p50: 1.0,
            latency_ms_p99: 2.0,
            server_cpu_s: None,
            guest_busy_s: None,
            guest_idle_s: None,
            nbdfuse_cpu_s: None,
            pmcache: None,
        }
    }

    fn speed(layer: &str, run: usize, total_s: f64) -> SpeedtestPoint {
        SpeedtestPoint { layer: layer.into(), run, total_s, tests: vec![] }
    }

    #[test]
    fn ratios_are_taken_run_by_run_then_their_median() {
        let points = [
            point("pm", 1, 300.0),
            point("raw", 1, 100.0),
            point("bc", 1, 200.0),
            point("pm", 2, 100.0),
            point("raw", 2, 100.0),
            point("bc", 2, 50.0),
            point("pm", 3, 400.0),
            point("raw", 3, 200.0),
            point("bc", 3, 100.0),
        ];
        let layers: Vec<String> = ["pm", "bc", "raw"].map(String::from).to_vec();
        let best = best_kernel_layer(&points, &["bc".into()]);
        assert_eq!(best.as_deref(), Some("bc"));
        let speeds = [speed("pm", 1, 2.0), speed("raw", 1, 4.0)];
        let summary = summarize(&layers, "raw", best.as_deref(), &points, &speeds);
        // pm/raw: 3, 1, 2 -> 2; pm/bc: 1.5, 2, 4 -> 2.
        assert_eq!(summary[0].tps_ratio_to_baseline_median, Some(2.0));
        assert_eq!(summary[0].tps_ratio_to_best_kernel_median, Some(2.0));
        assert_eq!(summary[0].tps_median, Some(300.0));
        assert_eq!(summary[0].speedtest1_speedup_to_baseline_median, Some(2.0));
        assert_eq!(summary[2].tps_ratio_to_baseline_median, Some(1.0));
        assert_eq!(summary[1].speedtest1_total_s_median, None);
        let text = tables(&layers, "raw", best.as_deref(), &points, &speeds, &summary);
        assert!(text.contains("vs bc"), "{text}");
        assert!(text.contains("3.00x"), "{text}");
    }

    #[test]
    fn the_best_kernel_layer_is_the_one_of_highest_median_tps() {
        let points = [point("a", 1, 10.0), point("b", 1, 30.0), point("b", 2, 5.0)];
        assert_eq!(best_kernel_layer(&points, &["a".into(), "b".into()]).as_deref(), Some("b"));
        assert_eq!(best_kernel_layer(&points, &[]), None);
    }
}
