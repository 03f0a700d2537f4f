//! Where a cache's policy decides (`000-policy`, `scripts/guest/paper000.sh`): the figures the
//! paper does not have, measured on the same layers in the same guest. The paper's figures
//! measure hits; a user's cache also has to get its working set in, keep what was read, serve
//! hits while misses go to a slow device, and take writes when it is full of dirty data.
//!
//! - `000-policy-warmup-guest`: the read hits of each pass over a working set never read
//!   before (random 64 KiB reads, every block once per pass).
//! - `000-policy-scan-guest`: the second of two sequential reads of data never written
//!   through the cache: its hits and bandwidth.
//! - `000-policy-hits-guest`: 4 KiB random reads at QD 16 in front of the throttled HDD, 90 %
//!   on a cached hot tenth: the hits' p50 and p99 against the same layer with every read a
//!   hit.
//! - `000-policy-dirty-guest`: 4 KiB random writes at QD 16 over twice the cache in front of
//!   the throttled SSD: IOPS second by second, beside the SSD alone.

use std::collections::BTreeMap;

use serde::Deserialize;

use super::Ctx;
use super::common::percent;
use super::figure::{Absolute, Figure, Point, Series, number};
use super::guest::GuestRun;

/// The pmcache series of every policy figure.
const PMCACHE: &str = "pmcache (ublk)";
/// The device alone in the write figure.
const SSD_ALONE: &str = "SSD (raw nvme)";
/// The seconds at the start of the write figure's run taken as a layer's rate with room.
const FIRST_SECONDS: usize = 3;

/// One measurement of `000-policy`.
#[derive(Debug, Deserialize)]
pub struct PolicyPoint {
    /// `warm-up`, `scan`, `hits-beside-misses` or `dirty`.
    pub experiment: String,
    /// The layer.
    pub series: String,
    /// The run's index.
    pub run: usize,
    /// The pass (warm-up, scan) or the case (`all`, `90`: hits beside misses).
    pub x: serde_json::Value,
    /// Read hits during the measurement, in the layer's own unit.
    #[serde(default)]
    pub hits: Option<u64>,
    /// Read misses, in the same unit.
    #[serde(default)]
    pub misses: Option<u64>,
    /// fio's bandwidth.
    #[serde(default)]
    pub bytes_per_s: Option<f64>,
    /// fio's requests per second.
    #[serde(default)]
    pub iops: Option<f64>,
    /// The median latency of the requests on the cached hot set.
    #[serde(default)]
    pub hit_p50_us: Option<f64>,
    /// Their 99th percentile.
    #[serde(default)]
    pub hit_p99_us: Option<f64>,
    /// The 99.9th percentile of the writes' latency.
    #[serde(default)]
    pub p999_us: Option<f64>,
    /// Writes completed in each second of the run.
    #[serde(default)]
    pub iops_per_s: Vec<f64>,
    /// Seconds until the layer's backing device stopped being written after the run.
    #[serde(default)]
    pub quiet_after_s: Option<u64>,
    /// What the layer's SSD was sent during the run.
    #[serde(default)]
    pub backing: Option<BackingDuring>,
    /// pmcache: what its cleaner did during the run.
    #[serde(default)]
    pub cleaner: Option<CleanerDuring>,
}

/// A layer's backing SSD over a dirty-data run: the writes it completed and the bytes they
/// carried (`/sys/block/*/stat`), whoever sent them — the write-back, or writes passed through.
#[derive(Debug, Deserialize)]
pub struct BackingDuring {
    pub writes: u64,
    pub bytes: u64,
}

/// pmcache's cleaner over a dirty-data run: its counters' growth during the run, and its
/// dirty slots when the run ended.
#[derive(Debug, Deserialize)]
pub struct CleanerDuring {
    pub blocks_cleaned: u64,
    pub writes_issued: u64,
    pub stalls: u64,
    pub stall_ns_total: u64,
    pub throttled_writes: u64,
    /// Not recorded where the figure's script could not read it.
    #[serde(default)]
    pub throttle_ns_total: Option<u64>,
    pub dirty_slots: u64,
    pub slot_count: u64,
}

impl CleanerDuring {
    /// One sentence: what the cleaner wrote back and how long the writers waited, over
    /// `seconds` of a run that completed `writes` writes.
    fn sentence(&self, series: &str, writes: f64, seconds: f64) -> String {
        let per = |n: u64| number(n as f64 / seconds.max(1.0));
        format!(
            "{series}'s cleaner during the run: {} blocks a second written back in {} writes a \
             second ({} blocks a write), against {} writes a second taken; writers stalled \
             {} times ({} s in all) and waited for their pace {} times{}; {} % of its slots \
             dirty when the run ended.",
            per(self.blocks_cleaned),
            per(self.writes_issued),
            number(self.blocks_cleaned as f64 / self.writes_issued.max(1) as f64),
            number(writes / seconds.max(1.0)),
            self.stalls,
            number(self.stall_ns_total as f64 / 1e9),
            self.throttled_writes,
            self.throttle_ns_total
                .map_or_else(String::new, |ns| format!(" ({} s in all)", number(ns as f64 / 1e9))),
            number(100.0 * self.dirty_slots as f64 / self.slot_count.max(1) as f64),
        )
    }
}

impl PolicyPoint {
    fn x(&self) -> String {
        match &self.x {
            serde_json::Value::String(s) => s.clone(),
            other => other.to_string(),
        }
    }

    /// Hits over all reads, if the layer counted them.
    fn hit_ratio(&self) -> Option<f64> {
        let (hits, misses) = (self.hits?, self.misses?);
        (hits + misses > 0).then(|| hits as f64 / (hits + misses) as f64)
    }
}

/// The layers of `points`, in the order they first appear.
fn layers(points: &[&PolicyPoint]) -> Vec<String> {
    let mut names: Vec<String> = vec![];
    for p in points {
        if !names.contains(&p.series) {
            names.push(p.series.clone());
        }
    }
    names
}

/// Each layer's values at each x (by `xs`), over runs.
fn series_of(
    points: &[&PolicyPoint],
    names: &[String],
    xs: &[String],
    value: impl Fn(&PolicyPoint) -> Option<f64>,
) -> Vec<Series> {
    names
        .iter()
        .map(|name| Series {
            name: name.clone(),
            points: xs
                .iter()
                .map(|x| {
                    let values: Vec<f64> = points
                        .iter()
                        .filter(|p| &p.series == name && &p.x() == x)
                        .filter_map(|p| value(p))
                        .collect();
                    (!values.is_empty()).then(|| Point::of(&values, false))
                })
                .collect(),
        })
        .collect()
}

fn median_at(series: &[Series], name: &str, x: usize) -> Option<f64> {
    series.iter().find(|s| s.name == name)?.points.get(x).copied().flatten().map(|p| p.median)
}

/// What every policy figure says of its bed.
fn bed_notes(run: &GuestRun) -> Vec<String> {
    vec![
        "One QEMU TCG guest runs every layer in the same boot; the layers are set up as for \
         the 000-*-guest figures (their notes), each on an emulated NVDIMM of its own. Under \
         TCG every instruction is emulated: pmcache is served through ublk, whose round trip \
         from the kernel to the server and back TCG makes costly (000-time-*-guest), while \
         bcache and dm-* stay in the kernel — hit ratios compare the layers' policies, \
         speeds mostly their paths."
            .into(),
        format!(
            "The SSDs are NVMe namespaces throttled by QEMU to {} IOPS and {} MB/s \
             (throttling.iops-total, bps-total: an SSD's cost, about a quarter of the emulated \
             NVDIMM's bandwidth); the HDDs to 200 IOPS and 150 MB/s.",
            run.bed.ssd_iops,
            number(run.bed.ssd_bytes_per_s as f64 / 1e6)
        ),
    ]
}

/// The four figures, from the run's policy points (none if it has none).
pub fn figures(ctx: &Ctx, run: &GuestRun, bed: &str) -> Vec<Figure> {
    let common_notes = &bed_notes(run);
    let of = |experiment: &str| -> Vec<&PolicyPoint> {
        run.policy.iter().filter(|p| p.experiment == experiment).collect()
    };
    let scale = ctx.scale_note_timed(
        vec![format!(
            "scale {} of scripts/guest/paper000.sh: working set {} MiB, HDD of {} MiB, {} \
             warm-up passes, {} s of writes",
            run.bed.scale,
            run.bed.policy_working_set_mib,
            run.bed.policy_hdd_mib,
            run.bed.policy_passes,
            run.bed.policy_dirty_s
        )],
        run.bed.policy_seconds.unwrap_or(run.bed.seconds),
    );
    let published = "The paper has no such figure: it measures hits only.";
    let base = |id: &str, title: &str| Figure {
        id: id.into(),
        title: title.into(),
        bed: bed.into(),
        published: published.into(),
        scale: scale.clone(),
        provenance: ctx.provenance.clone(),
        ..Figure::default()
    };
    let mut figures = vec![];
    let warm = of("warm-up");
    if !warm.is_empty() {
        figures.push(warmup(
            &warm,
            base(
                "000-policy-warmup-guest",
                "read hits, pass by pass, \
             over a working set never read before",
            ),
            run,
            common_notes,
        ));
    }
    let scan = of("scan");
    if !scan.is_empty() {
        figures.push(scan_figure(
            &scan,
            base(
                "000-policy-scan-guest",
                "the second of two \
             sequential reads of data never written through the cache",
            ),
            run,
            common_notes,
        ));
    }
    let hits = of("hits-beside-misses");
    if !hits.is_empty() {
        figures.push(hits_figure(
            &hits,
            base(
                "000-policy-hits-guest",
                "read hits' latency while \
             a tenth of the reads miss to the throttled HDD (4 KiB random, QD 16)",
            ),
            run,
            common_notes,
        ));
    }
    let dirty = of("dirty");
    if !dirty.is_empty() {
        figures.push(dirty_figure(
            &dirty,
            base(
                "000-policy-dirty-guest",
                "4 KiB random writes \
             (QD 16) over twice the cache in front of the throttled SSD, second by second",
            ),
            run,
            common_notes,
        ));
    }
    figures
}

fn warmup(points: &[&PolicyPoint], mut f: Figure, run: &GuestRun, common: &[String]) -> Figure {
    let names = layers(points);
    let passes = points.iter().filter_map(|p| p.x.as_u64()).max().unwrap_or(0);
    let xs: Vec<String> = (1..=passes).map(|p| p.to_string()).collect();
    let series = series_of(points, &names, &xs, |p| p.hit_ratio().map(|r| r * 100.0));
    let mut said = vec![];
    for s in &series {
        let after_one = s.points.get(1).copied().flatten().map(|p| p.median);
        let reach = s.points.iter().position(|p| p.is_some_and(|p| p.median >= 95.0));
        said.push(format!(
            "{} {} after one pass ({})",
            s.name,
            after_one.map_or_else(|| "—".into(), |h| format!("{h:.0} %")),
            reach.map_or_else(
                || format!("under 95 % after {passes} passes"),
                |x| format!("95 % from pass {}", x + 1)
            )
        ));
    }
    f.ours = format!("Read hits of the second pass: {}.", said.join("; "));
    f.x_label = "pass over the working set".into();
    f.x_ticks = xs;
    f.y_label = "read hits (%)".into();
    f.series = series;
    f.notes = vec![
        format!(
            "Each layer in front of its SSD, its own defaults (bcache write-through with its 4 \
             MiB sequential cutoff, dm-cache smq with 256 KiB blocks, dm-writecache, pmcache \
             write-back); a working set of {} MiB of the SSD that no other figure reads, read \
             with random 64 KiB requests, every block once per pass (fio's random map). Pass 1 \
             is cold: its hits are 0 for every layer. One run: a working set is cold once.",
            run.bed.policy_working_set_mib
        ),
        "Hits and misses in each layer's own unit: bcache sectors read from its cache and its \
         backing device, dm-cache's read hits and misses (dmsetup status), pmcache's 4 KiB \
         blocks (pmcache stats), and for dm-writecache (which counts nothing) the sectors read \
         from its SSD against fio's."
            .into(),
    ];
    f.notes.extend(common.iter().cloned());
    f
}

fn scan_figure(
    points: &[&PolicyPoint],
    mut f: Figure,
    run: &GuestRun,
    common: &[String],
) -> Figure {
    let names = layers(points);
    let second: Vec<&PolicyPoint> =
        points.iter().copied().filter(|p| p.x.as_u64() == Some(2)).collect();
    let xs = vec!["2".to_string()];
    let hits = series_of(&second, &names, &xs, |p| p.hit_ratio().map(|r| r * 100.0));
    let mbs = series_of(&second, &names, &xs, |p| p.bytes_per_s.map(|b| b / 1e6));
    f.ours = format!(
        "The second read: {}.",
        names
            .iter()
            .map(|n| format!(
                "{n} {} hits, {} MB/s",
                median_at(&hits, n, 0).map_or_else(|| "—".into(), |h| format!("{h:.0} %")),
                median_at(&mbs, n, 0).map_or_else(|| "—".into(), number)
            ))
            .collect::<Vec<_>>()
            .join("; ")
    );
    f.x_label = "read of the same data".into();
    f.x_ticks = vec!["second sequential read".into()];
    f.y_label = "read hits (%)".into();
    f.bars = true;
    f.series = hits;
    f.absolute = Some(Absolute { y_label: "MB/s".into(), series: mbs });
    f.notes = vec![
        format!(
            "{} MiB of each layer's SSD that nothing wrote through the cache, read from start \
             to end with 1 MiB requests, twice; the figure is the second read (the first is \
             cold). A backup, a restore, a first copy: data whose first access is a \
             sequential read. One run.",
            run.bed.policy_working_set_mib
        ),
        "bcache bypasses sequential reads past its 4 MiB sequential_cutoff; dm-writecache \
         caches writes only; pmcache's cutoff (4 MiB) applies only while fewer than an eighth \
         of its slots are free."
            .into(),
    ];
    f.notes.extend(common.iter().cloned());
    f
}

fn hits_figure(
    points: &[&PolicyPoint],
    mut f: Figure,
    run: &GuestRun,
    common: &[String],
) -> Figure {
    let names = layers(points);
    let cases = [("all", "all hits"), ("90", "90 % hits")];
    let mut xs = vec![];
    let mut ticks = vec![];
    for (quantile, label) in [("p50", "hit p50"), ("p99", "hit p99")] {
        for (case, case_label) in cases {
            xs.push(format!("{quantile}|{case}"));
            ticks.push(format!("{label}, {case_label}"));
        }
    }
    let series: Vec<Series> = names
        .iter()
        .map(|name| Series {
            name: name.clone(),
            points: xs
                .iter()
                .map(|x| {
                    let (quantile, case) = x.split_once('|').expect("quantile|case");
                    let values: Vec<f64> = points
                        .iter()
                        .filter(|p| &p.series == name && p.x() == case)
                        .filter_map(|p| if quantile == "p50" { p.hit_p50_us } else { p.hit_p99_us })
                        .collect();
                    (!values.is_empty()).then(|| Point::of(&values, false))
                })
                .collect(),
        })
        .collect();
    // The hits' p50 beside misses over the same layer's all-hit p50, run by run.
    let mut said = vec![];
    for name in &names {
        let of_case = |case: &str| -> BTreeMap<usize, f64> {
            points
                .iter()
                .filter(|p| &p.series == name && p.x() == case)
                .filter_map(|p| Some((p.run, p.hit_p50_us?)))
                .collect()
        };
        let (all, mixed) = (of_case("all"), of_case("90"));
        let ratios: Vec<f64> =
            mixed.iter().filter_map(|(r, m)| all.get(r).map(|a| m / a)).collect();
        let p99 =
            series.iter().find(|s| &s.name == name).and_then(|s| s.points[3]).map(|p| p.median);
        said.push(format!(
            "{name} {}× its all-hit p50, hit p99 {} µs",
            if ratios.is_empty() { "—".into() } else { number(Point::of(&ratios, false).median) },
            p99.map_or_else(|| "—".into(), number)
        ));
    }
    let lowest = series
        .iter()
        .filter_map(|s| s.points[3].map(|p| (s.name.clone(), p.median)))
        .min_by(|a, b| a.1.total_cmp(&b.1));
    f.ours = format!(
        "Hits beside misses: {}{}.",
        said.join("; "),
        lowest.map_or_else(String::new, |(n, _)| format!("; the lowest hit p99: {n}"))
    );
    let hit_shares: Vec<String> = names
        .iter()
        .filter_map(|name| {
            let (mut hits, mut misses) = (0, 0);
            for p in points.iter().filter(|p| &p.series == name && p.x() == "90") {
                hits += p.hits?;
                misses += p.misses?;
            }
            (hits + misses > 0)
                .then(|| format!("{name} {}", percent(hits as f64 / (hits + misses) as f64)))
        })
        .collect();
    f.x_label = "".into();
    f.x_ticks = ticks;
    f.y_label = "latency (µs, log)".into();
    f.y_log = true;
    f.bars = true;
    f.series = series;
    f.notes = vec![
        format!(
            "Each layer on an NVDIMM of its own in front of an HDD of its own ({} MiB, throttled \
             to 200 IOPS and 150 MB/s); its first {} MiB (a tenth) read until cached (random \
             256 KiB reads, at most 30 passes; dm-writecache: written through it). Then fio, \
             libaio, QD 16, 4 KiB random reads with random_distribution=zoned:90/10:10/90 (90 \
             % of the reads on the hot tenth), and for the all-hit case every read on the hot \
             tenth; {} run(s) of {} s each.",
            run.bed.policy_hdd_mib,
            run.bed.policy_working_set_mib,
            run.bed.runs,
            number(run.bed.policy_seconds.unwrap_or(run.bed.seconds))
        ),
        "A hit is a request on the hot tenth: fio logs every request's latency with its offset \
         (write_lat_log, log_offset), and the percentiles are of those on the hot tenth."
            .into(),
        format!("Reads the layers counted as hits in the 90 % case: {}.", hit_shares.join(", ")),
        format!(
            "Reads per second in the 90 % case (median of the runs), what the HDD's misses let \
             through: {}.",
            names
                .iter()
                .map(|name| {
                    let iops: Vec<f64> = points
                        .iter()
                        .filter(|p| &p.series == name && p.x() == "90")
                        .filter_map(|p| p.iops)
                        .collect();
                    let median = (!iops.is_empty()).then(|| Point::of(&iops, false).median);
                    format!("{name} {}", median.map_or_else(|| "—".into(), number))
                })
                .collect::<Vec<_>>()
                .join(", ")
        ),
    ];
    f.notes.extend(common.iter().cloned());
    f
}

fn dirty_figure(
    points: &[&PolicyPoint],
    mut f: Figure,
    run: &GuestRun,
    common: &[String],
) -> Figure {
    let names = layers(points);
    let seconds = points.iter().map(|p| p.iops_per_s.len()).max().unwrap_or(0);
    let series: Vec<Series> = names
        .iter()
        .map(|name| {
            let p = points.iter().find(|p| &p.series == name).expect("a layer's point");
            Series {
                name: name.clone(),
                points: (0..seconds)
                    .map(|s| p.iops_per_s.get(s).map(|&v| Point::of(&[v], false)))
                    .collect(),
            }
        })
        .collect();
    // Sustained: the mean over the run's second half; the floor: its slowest second.
    let summary = |p: &PolicyPoint| -> (f64, f64) {
        let half = &p.iops_per_s[p.iops_per_s.len() / 2..];
        let mean = half.iter().sum::<f64>() / half.len().max(1) as f64;
        let floor = p.iops_per_s.iter().copied().fold(f64::INFINITY, f64::min);
        (mean, floor)
    };
    // The first seconds, into a cache with room: what the layer does before it must clean.
    let first = |p: &PolicyPoint| -> f64 {
        let head = &p.iops_per_s[..p.iops_per_s.len().min(FIRST_SECONDS)];
        head.iter().sum::<f64>() / head.len().max(1) as f64
    };
    let alone = points.iter().find(|p| p.series == SSD_ALONE).map(|p| summary(p).0);
    let mut said = vec![];
    for p in points {
        let (sustained, floor) = summary(p);
        said.push(format!(
            "{} sustains {} IOPS{} (slowest second {}, p99.9 {} µs; {}× its first {} s)",
            p.series,
            number(sustained),
            match alone {
                Some(a) if p.series != SSD_ALONE =>
                    format!(", {}× the SSD alone", number(sustained / a)),
                _ => String::new(),
            },
            number(floor),
            p.p999_us.map_or_else(|| "—".into(), number),
            number(sustained / first(p)),
            FIRST_SECONDS
        ));
    }
    f.ours = format!("Over the second half of the run: {}.", said.join("; "));
    f.x_label = "second of the run".into();
    f.x_ticks = (1..=seconds).map(|s| s.to_string()).collect();
    f.y_label = "writes per second".into();
    f.series = series;
    let quiet: Vec<String> = points
        .iter()
        .filter_map(|p| Some(format!("{} {} s", p.series, p.quiet_after_s?)))
        .collect();
    f.notes = vec![
        format!(
            "fio, libaio, QD 16, 4 KiB random writes over {} MiB of each layer's SSD (twice the \
             NVDIMM, so at least twice each cache) for {} s, the writes of each second \
             (write_iops_log, 1 s averages); the write-back layers: bcache in writeback mode, \
             dm-cache (writeback), dm-writecache and pmcache (write-back), each with its own \
             defaults for cleaning; 'pmcache (ublk, poll)' is the same cache served by a ublk \
             server whose queue thread polls its ring instead of sleeping (--ublk-poll), where \
             there is one; 'SSD (raw nvme)' is the same SSD alone, throttled to {} IOPS and {} \
             MB/s. One run.",
            2 * run.bed.nvdimm_mib,
            run.bed.policy_dirty_s,
            run.bed.ssd_iops,
            number(run.bed.ssd_bytes_per_s as f64 / 1e6)
        ),
        format!(
            "After its run each layer was left until its SSD had written nothing for 3 s (at \
             most 240 s), so that one layer's cleaning does not run beside the next one's \
             writes: {}.",
            quiet.join(", ")
        ),
    ];
    if let Some(p) = points.iter().find(|p| p.series == PMCACHE) {
        let (sustained, floor) = summary(p);
        if let Some(a) = alone {
            f.notes.push(format!(
                "pmcache against the SSD alone: sustained {}×, its slowest second {}× the SSD's \
                 sustained rate.",
                number(sustained / a),
                number(floor / a)
            ));
        }
    }
    let sent: Vec<String> = points
        .iter()
        .filter_map(|p| {
            let b = p.backing.as_ref()?;
            let seconds = (p.iops_per_s.len() as f64).max(1.0);
            Some(format!(
                "{} {} writes a second of {} KiB",
                p.series,
                number(b.writes as f64 / seconds),
                number(b.bytes as f64 / 1024.0 / b.writes.max(1) as f64)
            ))
        })
        .collect();
    if !sent.is_empty() {
        f.notes.push(format!(
            "What each layer's SSD completed during the run (its /sys/block stat: writes, and \
             the average size they carried; the SSD counts a request, whatever its size, as one \
             of its IOPS): {}.",
            sent.join("; ")
        ));
    }
    for p in points {
        if let Some(cleaner) = &p.cleaner {
            let writes: f64 = p.iops_per_s.iter().sum();
            f.notes.push(cleaner.sentence(&p.series, writes, p.iops_per_s.len() as f64));
        }
    }
    f.notes.extend(common.iter().cloned());
    f
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::paper::guest::GuestRun;

    fn run_of(policy: serde_json::Value) -> GuestRun {
        serde_json::from_value(serde_json::json!({
            "bed": {"kernel": "6.12", "guest_cpus": 2, "scale": "smallest", "runs": 2,
                    "seconds": 1.0, "nvdimm_mib": 128, "working_set_mib": 32,
                    "policy_working_set_mib": 16, "policy_hdd_mib": 160, "policy_passes": 3,
                    "policy_dirty_s": 4},
            "notes": ["one guest"],
            "points": [],
            "policy": policy,
        }))
        .expect("a guest run")
    }

    fn ctx() -> Ctx {
        let args = crate::paper::PaperArgs::smallest("000-guest", &std::env::temp_dir());
        Ctx::new(&args, &crate::harness::experiment::Run::default())
    }

    #[test]
    fn the_four_figures_say_what_each_layer_did() {
        let warm = |series: &str, pass: u64, hits: u64, misses: u64| {
            serde_json::json!({"experiment": "warm-up", "series": series, "run": 0, "x": pass,
                               "hits": hits, "misses": misses, "bytes_per_s": 1e6})
        };
        let hits = |series: &str, run: usize, case: &str, p50: f64, p99: f64| {
            serde_json::json!({"experiment": "hits-beside-misses", "series": series, "run": run,
                               "x": case, "hits": 90, "misses": 10, "hit_p50_us": p50,
                               "hit_p99_us": p99})
        };
        let run = run_of(serde_json::json!([
            warm("bcache", 1, 0, 100), warm("bcache", 2, 40, 60), warm("bcache", 3, 96, 4),
            warm(PMCACHE, 1, 0, 100), warm(PMCACHE, 2, 100, 0), warm(PMCACHE, 3, 100, 0),
            {"experiment": "scan", "series": "bcache", "run": 0, "x": 1, "hits": 0, "misses": 8, "bytes_per_s": 1e8},
            {"experiment": "scan", "series": "bcache", "run": 0, "x": 2, "hits": 0, "misses": 8, "bytes_per_s": 1e8},
            {"experiment": "scan", "series": PMCACHE, "run": 0, "x": 2, "hits": 8, "misses": 0, "bytes_per_s": 5e8},
            hits("bcache", 0, "all", 10.0, 20.0), hits("bcache", 0, "90", 30.0, 900.0),
            hits("bcache", 1, "all", 20.0, 20.0), hits("bcache", 1, "90", 40.0, 800.0),
            hits(PMCACHE, 0, "all", 10.0, 20.0), hits(PMCACHE, 0, "90", 12.0, 50.0),
            hits(PMCACHE, 1, "all", 10.0, 20.0), hits(PMCACHE, 1, "90", 14.0, 70.0),
            {"experiment": "dirty", "series": SSD_ALONE, "run": 0, "x": "", "p999_us": 900.0,
             "iops_per_s": [100.0, 100.0, 100.0, 100.0], "quiet_after_s": 3},
            {"experiment": "dirty", "series": PMCACHE, "run": 0, "x": "", "p999_us": 500.0,
             "iops_per_s": [1000.0, 800.0, 150.0, 250.0], "quiet_after_s": 30,
             "backing": {"writes": 400, "bytes": 4915200},
             "cleaner": {"blocks_cleaned": 1200, "writes_issued": 400, "stalls": 3,
                         "stall_ns_total": 500000000, "throttled_writes": 40,
                         "throttle_ns_total": 2000000000, "dirty_slots": 90,
                         "slot_count": 100}},
        ]));
        let figures = figures(&ctx(), &run, "a guest");
        let ids: Vec<&str> = figures.iter().map(|f| f.id.as_str()).collect();
        assert_eq!(
            ids,
            [
                "000-policy-warmup-guest",
                "000-policy-scan-guest",
                "000-policy-hits-guest",
                "000-policy-dirty-guest"
            ]
        );
        let [warmup, scan, hits, dirty] = &figures[..] else { unreachable!() };
        assert_eq!(warmup.x_ticks, ["1", "2", "3"]);
        assert_eq!(warmup.series[0].points[1].map(|p| p.median), Some(40.0));
        assert!(
            warmup.ours.contains("bcache 40 % after one pass (95 % from pass 3)"),
            "{}",
            warmup.ours
        );
        assert!(warmup.ours.contains("pmcache (ublk) 100 % after one pass (95 % from pass 2)"));
        assert!(scan.ours.contains("bcache 0 % hits, 100 MB/s"), "{}", scan.ours);
        assert!(scan.ours.contains("pmcache (ublk) 100 % hits, 500 MB/s"), "{}", scan.ours);
        // Run by run: bcache 30/10 and 40/20 (median 2.5), pmcache 1.2 and 1.4 (median 1.3).
        assert!(
            hits.ours.contains("bcache 2.50× its all-hit p50, hit p99 850 µs"),
            "{}",
            hits.ours
        );
        assert!(hits.ours.contains("pmcache (ublk) 1.30× its all-hit p50, hit p99 60.0 µs"));
        assert!(hits.ours.ends_with("the lowest hit p99: pmcache (ublk)."), "{}", hits.ours);
        assert_eq!(dirty.x_ticks.len(), 4);
        // The second half: (150 + 250) / 2 = 200 against the SSD's 100; slowest second 150.
        assert!(
            dirty.ours.contains(
                "pmcache (ublk) sustains 200 IOPS, 2.00× the SSD alone (slowest second 150, \
                 p99.9 500 µs; 0.308× its first 3 s)"
            ),
            "{}",
            dirty.ours
        );
        assert!(
            dirty.notes.iter().any(|n| n.contains("its slowest second 1.50×")),
            "{:?}",
            dirty.notes
        );
        // 400 writes of 4,915,200 bytes over 4 s: 100 a second of 12 KiB.
        assert!(
            dirty
                .notes
                .iter()
                .any(|n| n.contains("): pmcache (ublk) 100 writes a second of 12.0 KiB.")),
            "{:?}",
            dirty.notes
        );
        // 2,200 writes over 4 s; 1,200 blocks in 400 writes.
        assert!(
            dirty.notes.iter().any(|n| n.contains(
                "pmcache (ublk)'s cleaner during the run: 300 blocks a second written back in \
                 100 writes a second (3.00 blocks a write), against 550 writes a second taken; \
                 writers stalled 3 times (0.500 s in all) and waited for their pace 40 times \
                 (2.00 s in all); 90.0 % of its slots dirty when the run ended."
            )),
            "{:?}",
            dirty.notes
        );
    }
}
