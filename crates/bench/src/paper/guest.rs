//! Paper 000 on the papers' own systems: bcache, dm-cache and dm-writecache beside pmcache
//! (served by ublk), each on an emulated NVDIMM in front of an emulated NVMe "SSD", in one
//! QEMU guest boot (`scripts/guest/paper000.sh`), fio as the paper ran it.
//!
//! The script writes its measurements as JSON (kept under `<out>/raw/`, so that the figures
//! can be made again from them); this module turns them into the figures `000-fig2-guest` …
//! `000-fig6-guest`. Under TCG absolute speeds mean nothing: the normalised figures are
//! ratios to the raw NVDIMM measured in the same boot, run by run.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::process::Command;

use serde::Deserialize;

use super::common::percent;
use super::figure::{Absolute, Figure, Point, Series, number};
use super::p000::published;
use super::{Ctx, library};

/// The normaliser's series name in the script's output.
pub const NVM_SERIES: &str = "NVM (raw pmem)";
/// The ublk frontend with nothing behind it: pmcache's ceiling in the guest.
pub const UBLK_NULL_SERIES: &str = "ublk null (no cache)";
/// The null device whose queue threads poll (`pmcache ublk null --poll`).
pub const UBLK_NULL_POLL_SERIES: &str = "ublk null (poll)";
/// fio's libpmem engine on the DAX file beside pmcache's library medium: a cross-check of
/// the raw medium's loads and stores.
pub const FIO_LIBPMEM_SERIES: &str = "fio libpmem (DAX)";

/// The script's output.
#[derive(Debug, Deserialize)]
pub struct GuestRun {
    /// The guest and the scale.
    pub bed: GuestBed,
    /// The choices the script made.
    #[serde(default)]
    pub notes: Vec<String>,
    /// One fio run each.
    pub points: Vec<GuestPoint>,
    /// Where a request's time goes (`000-time`): one window of one run each.
    #[serde(default)]
    pub time: Vec<super::guest_time::TimeSample>,
    /// Where a cache's policy decides (`000-policy`).
    #[serde(default)]
    pub policy: Vec<super::guest_policy::PolicyPoint>,
}

/// What the guest was.
#[derive(Debug, Default, Deserialize)]
pub struct GuestBed {
    /// The guest kernel's release.
    pub kernel: String,
    /// vCPUs of the guest.
    pub guest_cpus: usize,
    /// The script's scale.
    pub scale: String,
    /// Runs per point.
    pub runs: usize,
    /// Seconds per fio run.
    pub seconds: f64,
    /// Each emulated NVDIMM's size.
    pub nvdimm_mib: u64,
    /// The working set of figures other than Fig 3.
    pub working_set_mib: u64,
    /// The emulator's version line.
    #[serde(default)]
    pub qemu: String,
    /// The SSDs' throttle: requests per second.
    #[serde(default)]
    pub ssd_iops: u64,
    /// The SSDs' throttle: bytes per second.
    #[serde(default)]
    pub ssd_bytes_per_s: u64,
    /// `000-policy`'s working set (warm-up, scan) and hot set (in front of the HDDs).
    #[serde(default)]
    pub policy_working_set_mib: u64,
    /// `000-policy`'s HDDs.
    #[serde(default)]
    pub policy_hdd_mib: u64,
    /// `000-policy`'s warm-up passes.
    #[serde(default)]
    pub policy_passes: u64,
    /// `000-policy`'s seconds of writes per layer.
    #[serde(default)]
    pub policy_dirty_s: u64,
    /// Seconds per fio run of `000-policy` where its boot differs from the other figures'.
    #[serde(default)]
    pub policy_seconds: Option<f64>,
}

/// One fio run.
#[derive(Debug, Deserialize)]
pub struct GuestPoint {
    /// `000-fig4a`, ….
    pub figure: String,
    /// The x position as printed.
    pub x: String,
    /// The series.
    pub series: String,
    /// The run's index.
    pub run: usize,
    /// fio's bandwidth.
    pub bytes_per_s: f64,
    /// fio's requests per second (reads and writes).
    #[serde(default)]
    pub iops: Option<f64>,
    /// Cache hits during the run, where the layer counts them.
    pub cache_hits: Option<u64>,
    /// Cache misses during the run, where the layer counts them.
    pub cache_misses: Option<u64>,
    /// A point that only read and found too few of its reads cached, after top-ups and
    /// re-runs: it measured misses, not the layer, and is not drawn.
    #[serde(default)]
    pub refused: bool,
}

/// Runs the guest bed (or reads `--guest-json`), keeps its JSON under `<out>/raw/`, and makes
/// the figures.
pub fn run(ctx: &Ctx) -> Result<Vec<Figure>, String> {
    let raw_dir = ctx.args.out.join("raw");
    std::fs::create_dir_all(&raw_dir).map_err(|e| format!("{}: {e}", raw_dir.display()))?;
    let kept = raw_dir.join("000-guest.json");
    match &ctx.args.guest_json {
        Some(from) => {
            if from != &kept {
                std::fs::copy(from, &kept).map_err(|e| format!("{}: {e}", from.display()))?;
            }
        }
        None => run_script(ctx, &kept)?,
    }
    let text = std::fs::read_to_string(&kept).map_err(|e| format!("{}: {e}", kept.display()))?;
    let run: GuestRun = serde_json::from_str(&text)
        .map_err(|e| format!("{}: not the guest bed's output: {e}", kept.display()))?;
    figures(ctx, &run)
}

fn run_script(ctx: &Ctx, out: &Path) -> Result<(), String> {
    let script = PathBuf::from("scripts/guest/paper000.sh");
    if !script.exists() {
        return Err(format!(
            "{}: not found; run `bench paper 000-guest` from the repository's root, or give \
             --guest-json with the script's output",
            script.display()
        ));
    }
    let mut command = Command::new("bash");
    command.arg(&script).args(["--scale", ctx.args.scale.name()]);
    command.args(["--runs", &ctx.runs.to_string()]);
    if let Some(seconds) = ctx.seconds_given {
        command.args(["--seconds", &seconds.max(1.0).round().to_string()]);
    }
    command.arg("--out").arg(out);
    let status = command.status().map_err(|e| format!("{}: {e}", script.display()))?;
    if !status.success() {
        return Err(format!("{} failed ({status})", script.display()));
    }
    Ok(())
}

/// Runs `script` (a guest bed that runs an experiment inside its guest and writes the
/// figures' JSON to `--out`) at the context's scale and runs, with `extra` arguments, and
/// reads back the figures it wrote that `keep` selects.
pub(super) fn figures_from_guest(
    ctx: &Ctx,
    script: &str,
    extra: &[String],
    keep: impl Fn(&Figure) -> bool,
) -> Result<Vec<Figure>, String> {
    let script = Path::new(script);
    if !script.exists() {
        return Err(format!("{}: not found; run from the repository's root", script.display()));
    }
    let mut command = Command::new("bash");
    command.arg(script).args(["--scale", ctx.args.scale.name(), "--runs", &ctx.runs.to_string()]);
    command.args(extra).arg("--out").arg(&ctx.args.out);
    let status = command.status().map_err(|e| format!("{}: {e}", script.display()))?;
    if !status.success() {
        return Err(format!("{} failed ({status})", script.display()));
    }
    Ok(super::report::read_figures(&ctx.args.out)?.into_iter().filter(keep).collect())
}

/// The guest run's series at one figure: names (normaliser first), x positions, and
/// `rates[x][series]` = (run, bytes/s) pairs.
struct Table {
    names: Vec<String>,
    xs: Vec<String>,
    rates: Vec<Vec<Vec<(usize, f64)>>>,
}

fn table(run: &GuestRun, figure: &str) -> Option<Table> {
    let points: Vec<&GuestPoint> =
        run.points.iter().filter(|p| p.figure == figure && !p.refused).collect();
    if points.is_empty() {
        return None;
    }
    let mut names: Vec<String> = vec![];
    let mut xs: Vec<String> = vec![];
    for p in &points {
        if !names.contains(&p.series) {
            names.push(p.series.clone());
        }
        if !xs.contains(&p.x) {
            xs.push(p.x.clone());
        }
    }
    // Normalisers first, in the order seen.
    names.sort_by_key(|n| !n.starts_with("NVM"));
    let mut rates = vec![vec![vec![]; names.len()]; xs.len()];
    for p in points {
        let x = xs.iter().position(|x| *x == p.x).expect("seen");
        let s = names.iter().position(|n| *n == p.series).expect("seen");
        rates[x][s].push((p.run, p.bytes_per_s));
    }
    Some(Table { names, xs, rates })
}

impl Table {
    fn absolute(&self, unit: f64, oversubscribed: &dyn Fn(&str) -> bool) -> Vec<Series> {
        self.series(|x, s| {
            let values: Vec<f64> = self.rates[x][s].iter().map(|(_, r)| r / unit).collect();
            (!values.is_empty()).then(|| Point::of(&values, oversubscribed(&self.xs[x])))
        })
    }

    /// Each series over its normaliser (`normaliser_of(name)`), run by run.
    fn normalised(
        &self,
        normaliser_of: &dyn Fn(&str) -> Option<String>,
        oversubscribed: &dyn Fn(&str) -> bool,
    ) -> Vec<Series> {
        self.series(|x, s| {
            let over = oversubscribed(&self.xs[x]);
            if normaliser_of(&self.names[s]).is_none() {
                // A normaliser is 1 wherever it was measured, drawn as the paper's NVM line.
                return (!self.rates[x][s].is_empty()).then(|| Point::of(&[1.0], over));
            }
            let ratios = self.ratios(x, s, normaliser_of)?;
            Some(Point::of(&ratios, over))
        })
    }

    fn ratios(
        &self,
        x: usize,
        s: usize,
        normaliser_of: &dyn Fn(&str) -> Option<String>,
    ) -> Option<Vec<f64>> {
        let by = normaliser_of(&self.names[s])?;
        let n = self.names.iter().position(|name| *name == by)?;
        let ratios: Vec<f64> = self.rates[x][s]
            .iter()
            .filter_map(|&(run, rate)| {
                let base = self.rates[x][n].iter().find(|(r, _)| *r == run)?.1;
                (base > 0.0).then_some(rate / base)
            })
            .collect();
        (!ratios.is_empty()).then_some(ratios)
    }

    fn median_ratio(
        &self,
        x: usize,
        s: usize,
        normaliser_of: &dyn Fn(&str) -> Option<String>,
    ) -> Option<f64> {
        self.ratios(x, s, normaliser_of).map(|r| Point::of(&r, false).median)
    }

    fn series(&self, point: impl Fn(usize, usize) -> Option<Point>) -> Vec<Series> {
        (0..self.names.len())
            .map(|s| Series {
                name: self.names[s].clone(),
                points: (0..self.xs.len()).map(|x| point(x, s)).collect(),
            })
            .collect()
    }
}

/// `NVM (raw pmem)` for every series measured through the block layer; the raw medium by
/// loads and stores for those measured on its DAX mapping (pmcache embedded as a library, fio's
/// libpmem engine); for Fig 3's `<layer> <working set>`, `NVM <working set>`.
fn nvm_of(name: &str) -> Option<String> {
    if name.starts_with("NVM") {
        None
    } else if name == library::LIBRARY_SERIES || name == FIO_LIBPMEM_SERIES {
        Some(library::RAW_SERIES.to_string())
    } else {
        Some(NVM_SERIES.to_string())
    }
}

/// Whether a series is a cache layer (not a raw device, a null target or a plain remapper).
fn is_cache(name: &str) -> bool {
    ["bcache", "dm-", "pmcache"].iter().any(|p| name.starts_with(p))
}

/// For each x: the cache layer closest to its device, its ratio and its lead over the next
/// layer; and pmcache's own layers' ratios.
fn leaders(table: &Table, normaliser_of: &dyn Fn(&str) -> Option<String>, x_name: &str) -> String {
    let mut parts = vec![];
    for (x, tick) in table.xs.iter().enumerate() {
        let mut ranked: Vec<(f64, &str)> = table
            .names
            .iter()
            .enumerate()
            .filter(|(_, name)| is_cache(name))
            .filter_map(|(s, name)| Some((table.median_ratio(x, s, normaliser_of)?, name.as_str())))
            .collect();
        ranked.sort_by(|a, b| b.0.total_cmp(&a.0));
        let Some(&(best, leader)) = ranked.first() else { continue };
        let lead = match ranked.get(1) {
            Some(&(next, second)) => {
                format!(
                    ", {}× {second}",
                    number(if next > 0.0 { best / next } else { f64::INFINITY })
                )
            }
            None => String::new(),
        };
        let ours: Vec<String> = ranked
            .iter()
            .filter(|(_, name)| name.starts_with("pmcache") && *name != leader)
            .map(|(r, name)| format!("{name} {}", percent(*r)))
            .collect();
        let ours = if ours.is_empty() { String::new() } else { format!("; {}", ours.join(", ")) };
        parts.push(format!("{tick} {x_name}: {leader} leads at {}{lead}{ours}", percent(best)));
    }
    format!("Closest to its device (ratio to it): {}.", parts.join("; ").replace("  ", " "))
}

fn nvm_of_set(name: &str) -> Option<String> {
    if name.starts_with("NVM") {
        return None;
    }
    let set = name.split_once(' ').map(|(_, set)| set)?;
    Some(format!("NVM {set}"))
}

/// At one job and queue depth 1 a request's time is 1 / IOPS: each cache layer's time per
/// request beyond its own device's (the raw NVDIMM through the block layer, or its loads and
/// stores for the library), run by run, median. A ratio to the device favours a layer whose
/// device is reached through an expensive interface (a system call and the block layer per
/// request); the added time does not.
fn added_time_note(run: &GuestRun, figure: &str, x: &str) -> Option<String> {
    let at = |series: &str, r: usize| {
        run.points
            .iter()
            .find(|p| p.figure == figure && p.x == x && p.series == series && p.run == r)
            .and_then(|p| p.iops)
            .filter(|&iops| iops > 0.0)
    };
    let mut names: Vec<&str> = vec![];
    for p in run.points.iter().filter(|p| p.figure == figure && p.x == x) {
        if is_cache(&p.series) && !names.contains(&p.series.as_str()) {
            names.push(&p.series);
        }
    }
    let mut parts = vec![];
    for name in names {
        let device = nvm_of(name)?;
        let added: Vec<f64> = (0..run.bed.runs.max(1))
            .filter_map(|r| Some(1e6 / at(name, r)? - 1e6 / at(&device, r)?))
            .collect();
        if !added.is_empty() {
            parts.push(format!("{name} {} µs", number(Point::of(&added, false).median)));
        }
    }
    (!parts.is_empty()).then(|| {
        format!(
            "Time each request spends beyond its own device's, at {x} job (QD 1: a request's \
             time is 1 / IOPS), median of the runs: {}. Measured in the guest, where every \
             instruction is emulated; the ratios above favour the kernel layers, whose device \
             is reached through a system call and the block layer per request, while the \
             library's is reached by loads and stores.",
            parts.join(", ")
        )
    })
}

/// Hit ratios over a figure's measured runs, per series that counts them.
fn hit_notes(run: &GuestRun, figure: &str) -> Vec<String> {
    let mut counted: BTreeMap<&str, (u64, u64)> = BTreeMap::new();
    for p in run.points.iter().filter(|p| p.figure == figure && !p.refused) {
        if let (Some(hits), Some(misses)) = (p.cache_hits, p.cache_misses) {
            let entry = counted.entry(&p.series).or_default();
            entry.0 += hits;
            entry.1 += misses;
        }
    }
    counted
        .into_iter()
        .filter(|(_, (h, m))| h + m > 0)
        .map(|(series, (hits, misses))| {
            format!(
                "{series}: {} hits over the drawn runs ({hits} hits, {misses} misses).",
                percent(hits as f64 / (hits + misses) as f64)
            )
        })
        .collect()
}

/// One sentence: each layer's median ratio to its normaliser at the first and last x.
fn ours(table: &Table, normaliser_of: &dyn Fn(&str) -> Option<String>, x_name: &str) -> String {
    let last = table.xs.len() - 1;
    let mut parts = vec![];
    for x in [0, last] {
        let mut at = vec![];
        for (s, name) in table.names.iter().enumerate() {
            if let Some(r) = table.median_ratio(x, s, normaliser_of) {
                at.push(format!("{name} {}", percent(r)));
            }
        }
        if !at.is_empty() {
            parts.push(format!("at {} {x_name}: {}", table.xs[x], at.join(", ")));
        }
        if last == 0 {
            break;
        }
    }
    format!("Of the raw NVDIMM in the same boot, {}.", parts.join("; "))
}

fn figures(ctx: &Ctx, run: &GuestRun) -> Result<Vec<Figure>, String> {
    let bed = format!(
        "QEMU guest (TCG, {} vCPUs, Linux {}{}): one emulated NVDIMM per layer as its cache, \
         emulated NVMe drives as the SSD; fio psync direct=1, QD 1 per job",
        run.bed.guest_cpus,
        run.bed.kernel,
        if run.bed.qemu.is_empty() { String::new() } else { format!(", {}", run.bed.qemu) }
    );
    let cpus = run.bed.guest_cpus;
    let threads_over = move |x: &str| x.parse::<usize>().is_ok_and(|t| t > cpus);
    let never = |_: &str| false;
    let specs: [(&str, &str, &str, bool, bool); 6] = [
        (
            "000-fig2",
            "bandwidth of the devices alone and of the cache stacks",
            "workload (1 job)",
            true,
            false,
        ),
        (
            "000-fig3",
            "random-read bandwidth by request size and working set (1 job)",
            "request size",
            false,
            false,
        ),
        (
            "000-fig4a",
            "4 KiB random reads by jobs, normalised to the raw NVDIMM",
            "jobs",
            false,
            true,
        ),
        ("000-fig4b", "4 MiB sequential reads by jobs", "jobs", false, false),
        (
            "000-fig5",
            "4 MiB sequential reads and writes, read share falling, normalised to the raw NVDIMM",
            "read share (1 job)",
            false,
            true,
        ),
        (
            "000-fig6",
            "4 KiB random reads and writes 50:50 by jobs, normalised to the raw NVDIMM",
            "jobs",
            false,
            true,
        ),
    ];
    let mut figures = vec![];
    for (id, title, x_label, log, normalised) in specs {
        let Some(table) = table(run, id) else { continue };
        let over: &dyn Fn(&str) -> bool = if x_label == "jobs" { &threads_over } else { &never };
        let normaliser_of: &dyn Fn(&str) -> Option<String> =
            if id == "000-fig3" { &nvm_of_set } else { &nvm_of };
        let (series, absolute, y_label) = if normalised {
            (
                table.normalised(normaliser_of, over),
                Some(Absolute { y_label: "MB/s".into(), series: table.absolute(1e6, over) }),
                "bandwidth / raw NVDIMM".to_string(),
            )
        } else {
            (table.absolute(1e6, over), None, if log { "MB/s (log)" } else { "MB/s" }.to_string())
        };
        let x_name = match x_label {
            "jobs" => "jobs",
            "read share (1 job)" => "reads",
            _ => "",
        };
        let mut notes = vec![
            "Under TCG every instruction is emulated: absolute speeds are the emulator's, and \
             kernel work (bcache, dm-cache) and user-space work (pmcache) are both slowed; \
             only ratios to the raw NVDIMM of the same boot are the figure."
                .to_string(),
            format!(
                "Each NVDIMM {} MiB; working set {} MiB (Fig 3: per line); {} of {} s per \
                 point, series taking turns.",
                run.bed.nvdimm_mib,
                run.bed.working_set_mib,
                runs_of(run, id),
                number(run.bed.seconds)
            ),
        ];
        let null = table.names.iter().position(|n| n == UBLK_NULL_SERIES);
        let pmcache = table.names.iter().position(|n| n == "pmcache (ublk)");
        if let (Some(_), Some(_)) = (null, pmcache) {
            let last = table.xs.len() - 1;
            // Each pmcache server over the null device of the same wait (sleeping, polling).
            let pairs = [
                ("pmcache (ublk)", UBLK_NULL_SERIES),
                ("pmcache (ublk, poll)", UBLK_NULL_POLL_SERIES),
            ];
            let mut reached = vec![];
            for (server, null) in pairs {
                let Some(s) = table.names.iter().position(|n| n == server) else { continue };
                if !table.names.iter().any(|n| n == null) {
                    continue;
                }
                let of_null = |x: usize| {
                    table
                        .median_ratio(x, s, &|_| Some(null.to_string()))
                        .map_or_else(|| "—".into(), percent)
                };
                reached.push(format!(
                    "{server} reaches {} of '{null}' at {} {x_name} and {} at {}",
                    of_null(0),
                    table.xs[0],
                    of_null(last),
                    table.xs[last]
                ));
            }
            notes.push(format!(
                "pmcache is served through ublk: each request goes from the kernel to the server \
                 in user space and back (io_uring commands), which TCG emulates instruction by \
                 instruction, while bcache and dm-* stay in the kernel. '{UBLK_NULL_SERIES}' is \
                 the same frontend with nothing behind it (`pmcache ublk null`: reads return \
                 zeroes, writes are dropped), the ceiling of any server behind ublk here; {}. \
                 'pmcache (library)' measures the cache itself, through its own interface.",
                reached.join("; ")
            ));
        } else if table.names.iter().any(|n| n.starts_with("pmcache (ublk")) {
            notes.push(
                "pmcache is served through ublk: each request goes from the kernel to the \
                 server in user space and back (io_uring commands), which TCG emulates \
                 instruction by instruction, while bcache and dm-* stay in the kernel. \
                 `000-time-*-guest` shows where a request's time goes on each layer."
                    .to_string(),
            );
        }
        if x_label == "jobs" {
            notes.push(format!(
                "The guest has {cpus} vCPUs (on {} host CPUs): points past {cpus} jobs \
                 time-share them.",
                ctx.cpus
            ));
        }
        if table.names.iter().any(|n| n == library::LIBRARY_SERIES) {
            notes.push(format!(
                "'{}' is pmcache's engine embedded in a process of the guest (`pmcache bench \
                 paper 000-library`), its medium a file on ext4 -o dax on an NVDIMM of its own, \
                 normalised to '{}': the same requests as loads and stores of the same \
                 mapping (reads copy out; writes copy and persist) — each cache against its \
                 device through the interface it is used by, as the kernel layers are against \
                 the raw NVDIMM through the block layer. '{}' is fio's libpmem engine on a file \
                 of the same file system, a cross-check of that normaliser.",
                library::LIBRARY_SERIES,
                library::RAW_SERIES,
                FIO_LIBPMEM_SERIES
            ));
        }
        if id == "000-fig4a" || id == "000-fig6" {
            notes.extend(added_time_note(run, id, "1"));
        }
        notes.extend(run.notes.iter().cloned());
        notes.extend(hit_notes(run, id));
        figures.push(Figure {
            id: format!("{id}-guest"),
            title: title.into(),
            bed: bed.clone(),
            x_label: x_label.into(),
            x_ticks: table.xs.clone(),
            y_label,
            y_log: log,
            bars: id == "000-fig2",
            ours: if id == "000-fig2" || id == "000-fig3" {
                ours(&table, normaliser_of, x_name)
            } else {
                leaders(&table, normaliser_of, x_name)
            },
            series,
            absolute,
            published: published(id).into(),
            scale: ctx.scale_note_timed(
                vec![format!(
                    "scale {} of scripts/guest/paper000.sh (its header says what each shrinks)",
                    run.bed.scale
                )],
                run.bed.seconds,
            ),
            notes,
            provenance: ctx.provenance.clone(),
        });
    }
    figures.extend(super::guest_time::figures(ctx, &run.time, &bed, run.bed.seconds));
    figures.extend(super::guest_policy::figures(ctx, run, &bed));
    if figures.is_empty() {
        return Err("the guest bed's output has no figure's points".into());
    }
    Ok(figures)
}

/// How many runs each point of `figure` has, from its points: "3 runs", or, where series
/// come from boots of different run counts, "1 run (pmcache (library): 3)".
fn runs_of(run: &GuestRun, figure: &str) -> String {
    let mut per_series: Vec<(&str, usize)> = vec![];
    for p in run.points.iter().filter(|p| p.figure == figure) {
        match per_series.iter_mut().find(|(name, _)| *name == p.series) {
            Some((_, runs)) => *runs = (*runs).max(p.run + 1),
            None => per_series.push((&p.series, p.run + 1)),
        }
    }
    let plural = |n: usize| if n == 1 { format!("{n} run") } else { format!("{n} runs") };
    let mut counts: Vec<usize> = per_series.iter().map(|&(_, runs)| runs).collect();
    counts.sort_unstable();
    // The count most series have, and the series that have another.
    let Some(&most) = counts.iter().max_by_key(|&&n| counts.iter().filter(|&&m| m == n).count())
    else {
        return plural(run.bed.runs);
    };
    let others: Vec<String> = per_series
        .iter()
        .filter(|&&(_, runs)| runs != most)
        .map(|&(name, runs)| format!("{name}: {runs}"))
        .collect();
    if others.is_empty() {
        plural(most)
    } else {
        format!("{} ({})", plural(most), others.join(", "))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn point(figure: &str, x: &str, series: &str, run: usize, rate: f64) -> GuestPoint {
        GuestPoint {
            figure: figure.into(),
            x: x.into(),
            series: series.into(),
            run,
            bytes_per_s: rate,
            iops: Some(rate),
            cache_hits: series.starts_with("bcache").then_some(90),
            cache_misses: series.starts_with("bcache").then_some(10),
            refused: false,
        }
    }

    fn guest_run(points: Vec<GuestPoint>) -> GuestRun {
        GuestRun {
            bed: GuestBed {
                kernel: "6.12".into(),
                guest_cpus: 2,
                scale: "smallest".into(),
                runs: 2,
                seconds: 1.0,
                nvdimm_mib: 128,
                working_set_mib: 32,
                ..GuestBed::default()
            },
            notes: vec!["bcache in writethrough".into()],
            points,
            time: vec![],
            policy: vec![],
        }
    }

    #[test]
    fn ratios_are_taken_run_by_run_against_the_nvdimm_of_the_same_run() {
        let run = guest_run(vec![
            point("000-fig4a", "1", "bcache", 0, 60.0),
            point("000-fig4a", "1", NVM_SERIES, 0, 100.0),
            point("000-fig4a", "1", "bcache", 1, 30.0),
            point("000-fig4a", "1", NVM_SERIES, 1, 50.0),
            point("000-fig4a", "4", NVM_SERIES, 0, 100.0),
            point("000-fig4a", "4", "bcache", 0, 20.0),
        ]);
        let t = table(&run, "000-fig4a").expect("points");
        assert_eq!(t.names, [NVM_SERIES, "bcache"], "the normaliser first");
        assert_eq!(t.xs, ["1", "4"]);
        let over = |x: &str| x == "4";
        let series = t.normalised(&nvm_of, &over);
        let bcache = series[1].points.clone();
        assert_eq!(
            bcache[0],
            Some(Point { median: 0.6, min: 0.6, max: 0.6, oversubscribed: false })
        );
        assert_eq!(bcache[1].map(|p| (p.median, p.oversubscribed)), Some((0.2, true)));
        assert_eq!(series[0].points[0].map(|p| p.median), Some(1.0), "the normaliser is 1");
        let sentence = ours(&t, &nvm_of, "jobs");
        assert_eq!(
            sentence,
            "Of the raw NVDIMM in the same boot, at 1 jobs: bcache 60 %; at 4 jobs: bcache 20 %."
        );
    }

    /// A figure whose series came from boots of different run counts says which.
    #[test]
    fn the_runs_note_counts_each_series_runs() {
        let mut points = vec![];
        for series in [NVM_SERIES, "bcache", "dm-cache"] {
            points.push(point("000-fig4a", "1", series, 0, 100.0));
        }
        for run in 0..3 {
            points.push(point("000-fig4a", "1", "pmcache (library)", run, 100.0));
            points.push(point("000-fig2", "4K", "bcache", run, 100.0));
        }
        let run = guest_run(points);
        assert_eq!(runs_of(&run, "000-fig4a"), "1 run (pmcache (library): 3)");
        assert_eq!(runs_of(&run, "000-fig2"), "3 runs");
        assert_eq!(runs_of(&run, "000-fig6"), "2 runs", "no points: the bed's count");
    }

    /// The summary names the cache layer closest to its device at each x and its lead;
    /// pmcache embedded as a library is taken against the raw medium by loads and stores.
    #[test]
    fn the_summary_names_the_leader_at_each_x_and_by_how_much() {
        let run = guest_run(vec![
            point("000-fig4a", "1", NVM_SERIES, 0, 100.0),
            point("000-fig4a", "1", library::RAW_SERIES, 0, 1000.0),
            point("000-fig4a", "1", "bcache", 0, 77.0),
            point("000-fig4a", "1", "dm-writecache", 0, 92.0),
            point("000-fig4a", "1", "pmcache (ublk)", 0, 6.0),
            point("000-fig4a", "1", UBLK_NULL_SERIES, 0, 9.0),
            point("000-fig4a", "1", library::LIBRARY_SERIES, 0, 800.0),
            point("000-fig4a", "4", NVM_SERIES, 0, 100.0),
            point("000-fig4a", "4", library::RAW_SERIES, 0, 1000.0),
            point("000-fig4a", "4", "bcache", 0, 50.0),
            point("000-fig4a", "4", library::LIBRARY_SERIES, 0, 950.0),
        ]);
        let t = table(&run, "000-fig4a").expect("points");
        assert_eq!(t.names[..2], [NVM_SERIES, library::RAW_SERIES], "both normalisers first");
        let sentence = leaders(&t, &nvm_of, "jobs");
        assert_eq!(
            sentence,
            "Closest to its device (ratio to it): 1 jobs: dm-writecache leads at 92 %, 1.15× \
             pmcache (library); pmcache (library) 80 %, pmcache (ublk) 6 %; 4 jobs: pmcache \
             (library) leads at 95 %, 1.90× bcache."
        );
    }

    /// At one job, each cache's time per request beyond its own device's, run by run.
    #[test]
    fn the_added_time_per_request_is_taken_against_each_layers_own_device() {
        let run = guest_run(vec![
            point("000-fig4a", "1", NVM_SERIES, 0, 100.0),
            point("000-fig4a", "1", NVM_SERIES, 1, 50.0),
            point("000-fig4a", "1", "bcache", 0, 50.0),
            point("000-fig4a", "1", "bcache", 1, 25.0),
            point("000-fig4a", "1", library::RAW_SERIES, 0, 1000.0),
            point("000-fig4a", "1", library::LIBRARY_SERIES, 0, 500.0),
            point("000-fig4a", "1", UBLK_NULL_SERIES, 0, 10.0),
        ]);
        let note = added_time_note(&run, "000-fig4a", "1").expect("a note");
        // bcache: 1/50 - 1/100 s = 10,000 µs in run 0, 1/25 - 1/50 = 20,000 in run 1.
        assert!(note.contains("bcache 15000 µs"), "{note}");
        assert!(note.contains("pmcache (library) 1000 µs"), "{note}");
        assert!(!note.contains("ublk null"), "not a cache: {note}");
        assert_eq!(added_time_note(&run, "000-fig4a", "2"), None);
    }

    #[test]
    fn fig3_lines_are_normalised_to_the_nvdimm_of_their_own_working_set() {
        assert_eq!(nvm_of_set("dm-cache 32 MiB").as_deref(), Some("NVM 32 MiB"));
        assert_eq!(nvm_of_set("NVM 32 MiB"), None);
        assert_eq!(nvm_of("pmcache (ublk)").as_deref(), Some(NVM_SERIES));
    }

    #[test]
    fn figures_carry_the_papers_sentence_the_hit_ratios_and_the_guest() {
        let dir = tempfile::tempdir().expect("tempdir");
        let args = super::super::PaperArgs::smallest("000-guest", dir.path());
        let ctx = super::super::Ctx::new(&args, &crate::harness::experiment::Run::default());
        let run = guest_run(vec![
            point("000-fig4a", "1", NVM_SERIES, 0, 100.0),
            point("000-fig4a", "1", "bcache", 0, 62.0),
            point("000-fig4a", "1", "pmcache (ublk)", 0, 4.0),
            point("000-fig4a", "1", UBLK_NULL_SERIES, 0, 8.0),
            point("000-fig2", "4K rand read", NVM_SERIES, 0, 100.0),
            point("000-fig2", "4K rand read", "SSD (raw nvme)", 0, 10.0),
        ]);
        let figures = figures(&ctx, &run).expect("figures");
        let ids: Vec<&str> = figures.iter().map(|f| f.id.as_str()).collect();
        assert_eq!(ids, ["000-fig2-guest", "000-fig4a-guest"]);
        let fig4a = &figures[1];
        assert!(fig4a.published.contains("60 %"));
        assert!(
            fig4a.notes.iter().any(|n| n.starts_with("bcache: 90 % hits")),
            "{:?}",
            fig4a.notes
        );
        assert!(fig4a.bed.contains("Linux 6.12"));
        assert!(
            fig4a
                .notes
                .iter()
                .any(|n| n
                    .contains("pmcache (ublk) reaches 50 % of 'ublk null (no cache)' at 1 jobs")),
            "pmcache against the ublk frontend alone: {:?}",
            fig4a.notes
        );
        assert!(figures[0].bars && figures[0].y_log);
    }
}
