//! The rows of `bench paper002`'s tables: medians over runs and ratios between rows.

use super::{Config, Row, Sample};
use crate::harness::servers::ServerFigures;
use crate::harness::stats::{median, median_index};

/// Medians over a row's samples.
fn base_row(
    cpus: Option<usize>,
    writers: usize,
    adaptive: &str,
    mine: Vec<Sample>,
    errors: Vec<String>,
) -> Row {
    let server = |f: fn(&ServerFigures) -> f64| -> Option<f64> {
        median(mine.iter().filter_map(|s| s.server.as_ref().map(f)))
    };
    let bandwidth: Vec<f64> = mine.iter().map(|s| s.mb_per_s).collect();
    let median_run = median_index(&bandwidth).map(|i| &mine[i]);
    Row {
        cpus,
        writers,
        adaptive: adaptive.to_string(),
        mb_per_s: median(bandwidth.iter().copied()),
        ratio_to_off: None,
        ratio_to_most_cpus: None,
        ratio_to_raw: None,
        failed_per_write: server(|s| s.failed_insertions() as f64 / s.writes.max(1) as f64),
        failed_insertions: server(|s| s.failed_insertions() as f64),
        failed_per_request: median(mine.iter().filter_map(|s| {
            s.server.as_ref().map(|f| f.failed_insertions() as f64 / s.fio.ios.max(1) as f64)
        })),
        context_switches: median(
            mine.iter().filter_map(|s| s.context_switches.as_ref().map(|c| c.total() as f64)),
        ),
        boosts: server(|s| s.boosts as f64),
        boosted_s: median(mine.iter().filter_map(|s| s.boosted_s)),
        blocks_cleaned: server(|s| s.blocks_cleaned as f64),
        pi_seconds: median(mine.iter().filter_map(|s| s.pi_seconds)),
        pi_ratio_to_alone: None,
        ratio_to_without_pi: None,
        context_switches_by_thread: median_run
            .and_then(|s| s.context_switches.as_ref().map(|c| c.by_thread.clone()))
            .unwrap_or_default(),
        server: median_run.and_then(|s| s.server.clone()),
        raw_engines: median_run.map(|s| s.raw_engines.clone()).unwrap_or_default(),
        samples: mine,
        errors,
    }
}

pub(super) fn main_rows(
    configs: &[Config],
    samples: Vec<Vec<Sample>>,
    errors: Vec<Vec<String>>,
) -> Vec<Row> {
    let mut rows: Vec<Row> = configs
        .iter()
        .zip(samples)
        .zip(errors)
        .map(|((c, s), e)| base_row(c.cpus, c.writers, &c.adaptive, s, e))
        .collect();
    let most_cpus = configs.iter().filter_map(|c| c.cpus).max();
    let snapshot = rows.clone();
    for row in rows.iter_mut().filter(|r| r.cpus.is_some()) {
        let find = |cpus: Option<usize>, adaptive: &str| {
            snapshot
                .iter()
                .find(|r| r.cpus == cpus && r.writers == row.writers && r.adaptive == adaptive)
        };
        if let Some(off) = find(row.cpus, "off") {
            let ratios = row.samples.iter().filter_map(|s| {
                off.samples.iter().find(|o| o.run == s.run).map(|o| s.mb_per_s / o.mb_per_s)
            });
            row.ratio_to_off = median(ratios);
        }
        if let Some(top) = find(most_cpus, &row.adaptive) {
            row.ratio_to_most_cpus = row.mb_per_s.zip(top.mb_per_s).map(|(a, b)| a / b);
        }
        if let Some(raw) = find(None, "raw") {
            row.ratio_to_raw = row.mb_per_s.zip(raw.mb_per_s).map(|(a, b)| a / b);
        }
    }
    rows
}

pub(super) fn table1_rows(
    t1: &[(usize, String)],
    samples: Vec<Vec<Sample>>,
    errors: Vec<Vec<String>>,
    main: &[Row],
    pi_alone: &[f64],
) -> Vec<Row> {
    t1.iter()
        .zip(samples)
        .zip(errors)
        .map(|(((writers, adaptive), s), e)| {
            let mut row = base_row(Some(1), *writers, adaptive, s, e);
            // The π job's time over its time alone in the same run.
            row.pi_ratio_to_alone = median(
                row.samples.iter().filter_map(|s| Some(s.pi_seconds? / *pi_alone.get(s.run)?)),
            );
            let without = main
                .iter()
                .find(|r| r.cpus == Some(1) && r.writers == *writers && r.adaptive == *adaptive);
            row.ratio_to_without_pi =
                row.mb_per_s.zip(without.and_then(|r| r.mb_per_s)).map(|(a, b)| a / b);
            if row.samples.iter().any(|s| s.fio_ended_first) {
                row.errors.push("fio reached its time limit before the π job ended".into());
            }
            row
        })
        .collect()
}
