//! Paper 002 (adaptive priority boosting of pblk's writer daemon): `bench paper002`'s
//! experiment — pmcache's cleaner in the writer daemon's place, 4 MiB random writes over NBD
//! into a cache smaller than the span, the server confined to 1 or 2 CPUs — drawn the paper's
//! way: bandwidth by CPUs (Fig 2), failed insertions with boost off and on (Fig 3), boost off and on by
//! CPUs (Fig 4), and Table 1 beside a CPU-bound π job.

use super::{CLEANER_APART, CounterTick, Paper002Args, Row, Sample};
use crate::harness::experiment::{Experiment, Run, parse};
use crate::harness::fio::engines_text;
use crate::paper::common::percent;
use crate::paper::figure::{Absolute, Figure, Point, Series, number};
use crate::paper::{Ctx, Scale};

const BED: &str = "pmcache served over NBD in the bench's process; its threads (the cleaner's \
                   too) and fio's writers confined to the same CPUs, CPU 0 or CPUs 0-1; 4 MiB \
                   random writes, QD 1 per writer, into a cache smaller than the span; backing \
                   file on the root disk";

/// The arguments of `bench paper002` for a scale (`--json`: it prints nothing).
fn arguments(ctx: &Ctx) -> Result<(Paper002Args, Run), String> {
    let cpus = if ctx.cpus >= 2 { "1,2" } else { "1" };
    let seconds = ctx.seconds_given.map(|s| s.max(1.0)).unwrap_or(match ctx.args.scale {
        Scale::Smallest => 2.0,
        Scale::Small => 10.0,
        Scale::Full => 30.0,
    });
    let (span, cache) = ctx.args.scale.pick(("2G", "256M"), ("2G", "256M"), ("256M", "32M"));
    let argv: Vec<String> = [
        "paper002",
        "--cpus",
        cpus,
        "--writers",
        "1,4",
        "--adaptive",
        "off,boost",
        "--seconds",
        &seconds.to_string(),
        "--runs",
        &ctx.runs.to_string(),
        "--span",
        span,
        "--cache-size",
        cache,
        "--table1-writers",
        "4",
        "--pi-seconds",
        &seconds.to_string(),
        "--dir",
        &ctx.args.dir.display().to_string(),
        "--shm-dir",
        &ctx.args.pm_dir.display().to_string(),
        "--json",
    ]
    .iter()
    .map(|s| s.to_string())
    .collect();
    parse(&argv.iter().map(String::as_str).collect::<Vec<_>>())
}

fn find<'a>(rows: &'a [Row], cpus: usize, writers: usize, adaptive: &str) -> Option<&'a Row> {
    rows.iter().find(|r| r.cpus == Some(cpus) && r.writers == writers && r.adaptive == adaptive)
}

/// A row's per-run values of `value`, as a point.
fn point(row: Option<&Row>, value: impl Fn(&Sample) -> Option<f64>) -> Option<Point> {
    let values: Vec<f64> = row?.samples.iter().filter_map(value).collect();
    (!values.is_empty()).then(|| Point::of(&values, false))
}

/// A figure read off one run's sample.
type Metric = dyn Fn(&Sample) -> Option<f64>;

fn mb_per_s(sample: &Sample) -> Option<f64> {
    Some(sample.mb_per_s).filter(|v| v.is_finite())
}

fn failed_per_1000_writes(sample: &Sample) -> Option<f64> {
    let server = sample.server.as_ref()?;
    (server.writes > 0).then(|| server.failed_insertions() as f64 * 1000.0 / server.writes as f64)
}

fn context_switches(sample: &Sample) -> Option<f64> {
    sample.context_switches.as_ref().map(|c| (c.voluntary + c.involuntary) as f64)
}

/// Seconds between two readings of the server's counters in a run (`bench paper002`'s
/// sampler reads them every 500 ms).
const COUNTER_INTERVAL_S: f64 = 0.5;

/// A run's failed insertions per 1,000 blocks written in each interval between two readings of the
/// server's counters (`None` for an interval without writes).
fn failed_per_1000_by_interval(counters: &[CounterTick]) -> Vec<Option<f64>> {
    counters
        .windows(2)
        .map(|w| {
            let writes = w[1].writes.saturating_sub(w[0].writes);
            let failed = w[1].failed_insertions.saturating_sub(w[0].failed_insertions);
            (writes > 0).then(|| failed as f64 * 1000.0 / writes as f64)
        })
        .collect()
}

/// A row's failed insertions per 1,000 writes over time: one point per interval, the median over the
/// runs that reached it.
fn failed_over_time(row: Option<&Row>) -> Vec<Option<Point>> {
    let runs: Vec<Vec<Option<f64>>> = row.map_or(Vec::new(), |r| {
        r.samples.iter().map(|s| failed_per_1000_by_interval(&s.counters)).collect()
    });
    let intervals = runs.iter().map(Vec::len).max().unwrap_or(0);
    (0..intervals)
        .map(|i| {
            let values: Vec<f64> =
                runs.iter().filter_map(|r| r.get(i).copied().flatten()).collect();
            (!values.is_empty()).then(|| Point::of(&values, false))
        })
        .collect()
}

/// A row's total failed insertions (median over runs).
fn total_failed(row: Option<&Row>) -> f64 {
    point_median(point(row, |s| s.server.as_ref().map(|f| f.failed_insertions() as f64)))
}

/// `1 and 2`, `1, 2 and 4`.
fn cpus_text(cpus: &[usize]) -> String {
    let names: Vec<String> = cpus.iter().map(usize::to_string).collect();
    match names.split_last() {
        Some((last, rest)) if !rest.is_empty() => format!("{} and {last}", rest.join(", ")),
        _ => names.join(""),
    }
}

/// The most writers of any row.
fn writers_max(rows: &[Row]) -> usize {
    rows.iter().map(|r| r.writers).max().unwrap_or(1)
}

/// A point's median, NaN for no point.
fn point_median(p: Option<Point>) -> f64 {
    p.map_or(f64::NAN, |p| p.median)
}

/// Figs 2, 3, 4 and Table 1.
pub fn run(ctx: &Ctx) -> Result<Vec<Figure>, String> {
    let (args, run) = arguments(ctx)?;
    eprintln!("002: bench paper002 {:?} CPUs, writers 1 and 4, boost off and on", args.cpus);
    let report = args.run(&run)?;
    let rows = &report.rows;
    let cpus = args.cpus.clone();
    let ticks: Vec<String> =
        cpus.iter().map(|c| format!("{c} CPU{}", if *c > 1 { "s" } else { "" })).collect();
    let mut notes = vec![
        "pblk's ring buffer is pmcache's cache, its writer daemon pmcache's cleaner; a failed \
         insertion is a write that could not take a slot at once: a stall (no free or clean \
         slot: the writer waited for the cleaner) or a paced write that waited for its turn \
         (above the throttle threshold writers are paced to the cleaner's rate), both counted \
         by the server. fio, the server's threads and its cleaner run on the same CPUs."
            .to_string(),
        format!(
            "This machine has {} CPUs: the sweep is {} (the paper's 1 … 8 vCPUs); {} writers \
             with the cleaner beside them need {} CPUs to be free of contention.",
            ctx.cpus,
            cpus_text(&cpus),
            writers_max(rows),
            writers_max(rows) + 1
        ),
        format!(
            "Span {}, cache {}, {} s per run, {} run(s) per point.",
            pmcache_frontend::units::human(report.plan.span_bytes),
            pmcache_frontend::units::human(report.plan.cache_bytes),
            number(report.plan.seconds),
            report.plan.runs
        ),
    ];
    if let Some(raw) = rows.iter().find(|r| r.adaptive == "raw") {
        notes.push(format!(
            "The raw backing file took {} MB/s with {} writer(s) (the best of fio's psync, \
             libaio and io_uring, O_DIRECT, each measured in the run: {}): the ceiling once the \
             cache is full.",
            number(raw.mb_per_s.unwrap_or(f64::NAN)),
            raw.writers,
            engines_text(&raw.raw_engines)
        ));
    }
    let shrunk = match ctx.args.scale {
        Scale::Full => vec![format!("CPUs {} only (the paper: 1 … 8 vCPUs)", cpus_text(&cpus))],
        _ => vec![format!(
            "CPUs {} only; {} s per run (the paper's run time is not stated)",
            cpus_text(&cpus),
            number(report.plan.seconds)
        )],
    };
    let figure = |id: &str,
                  title: &str,
                  x_label: &str,
                  ticks: Vec<String>,
                  y_label: &str,
                  series: Vec<Series>,
                  published: &str,
                  ours: String| Figure {
        id: id.into(),
        title: title.into(),
        bed: BED.into(),
        x_label: x_label.into(),
        x_ticks: ticks,
        y_label: y_label.into(),
        series,
        published: published.into(),
        ours,
        scale: ctx.scale_note_timed(shrunk.clone(), report.plan.seconds),
        notes: notes.clone(),
        provenance: ctx.provenance.clone(),
        ..Figure::default()
    };
    let by_cpus = |writers: usize, adaptive: &str, value: &dyn Fn(&Sample) -> Option<f64>| {
        cpus.iter().map(|&c| point(find(rows, c, writers, adaptive), value)).collect::<Vec<_>>()
    };
    let last = cpus.len() - 1;
    // Fig 2: vanilla, 1 and 4 writers.
    let one = by_cpus(1, "off", &mb_per_s);
    let four = by_cpus(4, "off", &mb_per_s);
    let fig2 = figure(
        "002-fig2",
        "bandwidth by CPUs, boost off (the vanilla writer)",
        "CPUs of the server and fio",
        ticks.clone(),
        "MB/s",
        vec![
            Series { name: "1 writer".into(), points: one.clone() },
            Series { name: "4 writers".into(), points: four.clone() },
        ],
        "Bandwidth rises with CPUs until there is one per runnable thread: from 2 vCPUs with 1 \
         writer, from 5 with 4.",
        format!(
            "1 writer: {} MB/s on 1 CPU, {} on {}; 4 writers: {} and {}.",
            number(point_median(one[0])),
            number(point_median(one[last])),
            ticks[last],
            number(point_median(four[0])),
            number(point_median(four[last]))
        ),
    );
    // Fig 3: failed insertions per write over time, 1 writer on 1 CPU, boost off and on; beside it the
    // totals by CPUs.
    let (row_off, row_on) = (find(rows, cpus[0], 1, "off"), find(rows, cpus[0], 1, "boost"));
    let (over_time_off, over_time_on) = (failed_over_time(row_off), failed_over_time(row_on));
    let intervals = over_time_off.len().max(over_time_on.len());
    let pad = |mut points: Vec<Option<Point>>| {
        points.resize(intervals, None);
        points
    };
    let (failed_off_1, failed_on_1) = (total_failed(row_off), total_failed(row_on));
    let bw_ratio = point_median(point(row_on, mb_per_s)) / point_median(point(row_off, mb_per_s));
    let totals = if failed_on_1 > 0.0 {
        format!(
            "{} failed insertions in all with boost off and {} with it on ({}× as many without boost)",
            number(failed_off_1),
            number(failed_on_1),
            number(failed_off_1 / failed_on_1)
        )
    } else {
        format!(
            "{} failed insertions in all with boost off and none with it on",
            number(failed_off_1)
        )
    };
    let mut fig3 = figure(
        "002-fig3",
        "failed insertions (stalls and paced waits) per 1,000 writes over time, 1 writer on 1 CPU, boost off and on",
        "seconds into the run (end of each 0.5 s interval)",
        (1..=intervals).map(|i| format!("{:.1}", i as f64 * COUNTER_INTERVAL_S)).collect(),
        "failed insertions per 1,000 blocks written",
        vec![
            Series { name: "boost off".into(), points: pad(over_time_off) },
            Series { name: "boost on".into(), points: pad(over_time_on) },
        ],
        "On 1 vCPU with 1 writer, the boosted writer gives more than 2× the bandwidth, and \
         vanilla pblk fails more than 70× as many insertions in all.",
        format!(
            "On 1 CPU with 1 writer: {totals}; bandwidth with boost {}× without.",
            number(bw_ratio)
        ),
    );
    fig3.notes.push(
        "The paper's x axis is successive successful insertions and its y the failures before \
         each; a write here waits once (for the cleaner, or for its paced turn) instead of \
         retrying, so the series is the share of writes that waited, per 0.5 s interval (the server's counters \
         read through its control socket), median over runs. The cache starts empty: writes \
         wait only once it has filled."
            .into(),
    );
    let failed_off = by_cpus(1, "off", &failed_per_1000_writes);
    let failed_on = by_cpus(1, "boost", &failed_per_1000_writes);
    let fig3_totals = figure(
        "002-fig3-totals",
        "failed insertions (stalls and paced waits) per 1,000 writes over whole runs, 1 writer, boost off and on, by CPUs",
        "CPUs of the server and fio",
        ticks.clone(),
        "failed insertions per 1,000 blocks written",
        vec![
            Series { name: "boost off".into(), points: failed_off.clone() },
            Series { name: "boost on".into(), points: failed_on.clone() },
        ],
        "Vanilla pblk fails more than 70× as many insertions as the boosted one (1 vCPU).",
        format!(
            "{}: {} failed insertions per 1,000 writes with boost off, {} with it on; {}: {} and {}.",
            ticks[0],
            number(point_median(failed_off[0])),
            number(point_median(failed_on[0])),
            ticks[last],
            number(point_median(failed_off[last])),
            number(point_median(failed_on[last]))
        ),
    );
    // Fig 4: 4 writers, boost off and on, against the contention-free reference.
    let off4 = by_cpus(4, "off", &mb_per_s);
    let on4 = by_cpus(4, "boost", &mb_per_s);
    let reference =
        point(rows.iter().find(|r| r.writers == 4 && r.adaptive == CLEANER_APART), mb_per_s);
    let mut series = vec![
        Series { name: "boost off".into(), points: off4.clone() },
        Series { name: "boost on".into(), points: on4.clone() },
    ];
    let loss = |p: Option<Point>| percent(1.0 - point_median(p) / point_median(reference));
    let ours = if reference.is_some() {
        series.push(Series {
            name: "reference: the cleaner alone on CPU 1".into(),
            points: vec![reference; cpus.len()],
        });
        format!(
            "Against the contention-free reference ({} MB/s: writers and connections on CPU 0, \
             the cleaner alone on CPU 1), boost off loses {} on 1 CPU and boost on {}; on {}: \
             {} and {}.",
            number(point_median(reference)),
            loss(off4[0]),
            loss(on4[0]),
            ticks[last],
            loss(off4[last]),
            loss(on4[last])
        )
    } else {
        format!(
            "On 1 CPU boost off reaches {} of its bandwidth on {}, boost on {} (no \
             contention-free reference: it needs 2 CPUs).",
            percent(point_median(off4[0]) / point_median(off4[last])),
            ticks[last],
            percent(point_median(on4[0]) / point_median(on4[last]))
        )
    };
    let fig4 = figure(
        "002-fig4",
        "bandwidth by CPUs, 4 writers, boost off and on",
        "CPUs of the server and fio",
        ticks.clone(),
        "MB/s",
        series,
        "The boosted pblk loses 1.5–7.6 % against the contention-free point whatever the CPUs; \
         the vanilla one loses 27.7–84.1 %.",
        ours,
    );
    // Table 1: 4 writers on 1 CPU beside the π job.
    let t1 = |adaptive: &str| report.table1.iter().find(|r| r.adaptive == adaptive);
    let metrics: [(&str, &Metric); 3] = [
        ("MB/s", &mb_per_s),
        ("context switches / 1,000", &|s| context_switches(s).map(|c| c / 1000.0)),
        ("π job (s)", &|s| s.pi_seconds),
    ];
    let table_series = |adaptive: &str| Series {
        name: format!("boost {}", if adaptive == "off" { "off" } else { "on" }),
        points: metrics.iter().map(|(_, value)| point(t1(adaptive), value)).collect(),
    };
    let (t_off, t_on) = (table_series("off"), table_series("boost"));
    let pi_alone = if report.pi_alone_seconds.is_empty() {
        f64::NAN
    } else {
        Point::of(&report.pi_alone_seconds, false).median
    };
    let value = |s: &Series, i: usize| point_median(s.points[i]);
    // One quantity on the axis: each metric with boost on over boost off, run by run.
    let ratios = Series {
        name: "pmcache: boost on ÷ boost off (same run)".into(),
        points: metrics
            .iter()
            .map(|(_, metric)| {
                let (on, off) = (t1("boost")?, t1("off")?);
                let values: Vec<f64> = on
                    .samples
                    .iter()
                    .filter_map(|s| {
                        let o = off.samples.iter().find(|o| o.run == s.run)?;
                        Some(metric(s)? / metric(o)?).filter(|r| r.is_finite())
                    })
                    .collect();
                (!values.is_empty()).then(|| Point::of(&values, false))
            })
            .collect(),
    };
    let paper = Series {
        name: "paper: priority-adjusted pblk ÷ pblk".into(),
        points: [204.53 / 20.11, 110.0 / 4905.0, 167.0 / 246.0]
            .iter()
            .map(|&r| Some(Point::of(&[r], false)))
            .collect(),
    };
    let mut table1 = figure(
        "002-table1",
        "beside a CPU-bound π job on the server's CPU: 4 writers, 1 CPU",
        "metric",
        metrics.iter().map(|(name, _)| name.to_string()).collect(),
        "boost on ÷ boost off (log)",
        vec![ratios, paper],
        "pblk 20.11 MB/s, 4,905 context switches, π job 246 s; priority-adjusted pblk 204.53 \
         MB/s, 110 switches, 167 s.",
        format!(
            "Boost off: {} MB/s, {} context switches, π job {} s; boost on: {} MB/s, {}, {} s \
             (π alone: {} s).",
            number(value(&t_off, 0)),
            number(value(&t_off, 1) * 1000.0),
            number(value(&t_off, 2)),
            number(value(&t_on, 0)),
            number(value(&t_on, 1) * 1000.0),
            number(value(&t_on, 2)),
            number(pi_alone)
        ),
    );
    table1.absolute =
        Some(Absolute { y_label: "value".into(), series: vec![t_off.clone(), t_on.clone()] });
    table1.bars = true;
    table1.y_log = true;
    table1.notes.push(
        "Context switches are the server process's threads' (voluntary + involuntary, from \
         /proc); the paper does not say whose it counted. The π job is a thread pinned to CPU \
         0 computing a fixed number of Leibniz terms."
            .into(),
    );
    Ok(vec![fig2, fig3, fig3_totals, fig4, table1])
}

#[cfg(test)]
mod tests {
    use super::super::CounterTick;
    use super::*;

    fn ticks(counters: &[(u64, u64)]) -> Vec<CounterTick> {
        counters
            .iter()
            .enumerate()
            .map(|(i, &(writes, failed_insertions))| CounterTick {
                t_s: i as f64 * 0.5,
                writes,
                failed_insertions,
            })
            .collect()
    }

    #[test]
    fn failed_insertions_are_counted_per_interval_between_readings() {
        let run = ticks(&[(0, 0), (1000, 0), (3000, 10), (3000, 10), (4000, 40)]);
        assert_eq!(
            failed_per_1000_by_interval(&run),
            [Some(0.0), Some(5.0), None, Some(30.0)],
            "the counters are totals since the server started"
        );
    }
}
