//! One point of `bench engines`: the backing-store engine's runs beside fio's.

use std::process::Command;
use std::sync::{Arc, Barrier};
use std::time::{Duration, Instant};

use hdrhistogram::Histogram;
use pmcache_backing::{BackingStore, EngineKind, EngineOptions, IoBuf, IoRequest, open_backing};
use rand::rngs::SmallRng;
use rand::{Rng, SeedableRng};

use super::{BLOCK_BYTES, EnginesArgs, Plan, Row, Sample, TestFile};
use crate::harness::fio::{captured_report, fio_engine};
use crate::harness::stats::median;

/// Each figure's median over `samples`.
pub(super) fn median_sample(samples: &[Sample]) -> Option<Sample> {
    let of = |figure: fn(&Sample) -> f64| median(samples.iter().map(figure));
    Some(Sample {
        iops: of(|s| s.iops)?,
        latency_ns_mean: of(|s| s.latency_ns_mean)?,
        latency_ns_p99: of(|s| s.latency_ns_p99)?,
    })
}

pub(super) fn measure_point(
    args: &EnginesArgs,
    plan: &Plan,
    file: &TestFile,
    rw: &str,
    engine: EngineKind,
    jobs: usize,
    qd: usize,
) -> Row {
    let mut row = Row {
        file: file.label.clone(),
        path: file.path.display().to_string(),
        direct: file.direct,
        rw: rw.to_string(),
        engine: engine.name().to_string(),
        jobs,
        qd,
        ours: None,
        fio: None,
        ratio: None,
        run_ratios: Vec::new(),
        ours_runs_iops: Vec::new(),
        fio_runs_iops: Vec::new(),
        error: None,
        fio_error: None,
    };
    let runtime = Duration::from_secs_f64(plan.runtime_secs);
    let opts = EngineOptions { sync_contexts: jobs + 1, ..EngineOptions::new(engine, file.direct) };
    let store = match open_backing(&file.path, &opts) {
        Ok(store) => Some(store),
        Err(e) => {
            row.error = Some(e.to_string());
            None
        }
    };
    let (mut ours, mut theirs, mut ratios) = (Vec::new(), Vec::new(), Vec::new());
    // Ours and fio alternate which goes first, so drift in the machine's load hits both.
    for run in 0..plan.runs {
        let (mut ours_now, mut fio_now) = (None, None);
        for side in [run % 2, 1 - run % 2] {
            if side == 0 {
                if let Some(store) = &store {
                    match run_ours(store, rw == "randwrite", jobs, qd, runtime) {
                        Ok(s) => ours_now = Some(s),
                        Err(e) => row.error = Some(e),
                    }
                }
            } else if !args.no_fio && row.fio_error.is_none() {
                match run_fio(args, file, rw, engine, jobs, qd, plan) {
                    Ok(s) => fio_now = Some(s),
                    Err(e) => row.fio_error = Some(e),
                }
            }
        }
        if let (Some(o), Some(f)) = (ours_now, fio_now) {
            ratios.push(o.iops / f.iops);
        }
        ours.extend(ours_now);
        theirs.extend(fio_now);
    }
    row.ours = median_sample(&ours);
    row.fio = median_sample(&theirs);
    row.ratio = median(ratios.iter().copied());
    row.run_ratios = ratios;
    row.ours_runs_iops = ours.iter().map(|s| s.iops).collect();
    row.fio_runs_iops = theirs.iter().map(|s| s.iops).collect();
    row
}

/// `jobs` threads, each keeping `qd` 4 KiB requests in flight at random aligned offsets.
pub(super) fn run_ours(
    store: &Arc<dyn BackingStore>,
    write: bool,
    jobs: usize,
    qd: usize,
    runtime: Duration,
) -> Result<Sample, String> {
    let barrier = Arc::new(Barrier::new(jobs));
    let blocks = store.size_bytes() / BLOCK_BYTES;
    let results: Vec<Result<JobResult, String>> = std::thread::scope(|s| {
        let handles: Vec<_> = (0..jobs)
            .map(|job| {
                let store = store.clone();
                let barrier = barrier.clone();
                s.spawn(move || run_job(&*store, write, qd, runtime, blocks, job as u64, &barrier))
            })
            .collect();
        handles
            .into_iter()
            .map(|h| h.join().unwrap_or_else(|_| Err("job panicked".into())))
            .collect()
    });
    let mut hist =
        Histogram::<u64>::new_with_bounds(1, 60_000_000_000, 3).expect("histogram bounds");
    let (mut ios, mut elapsed_max) = (0u64, Duration::ZERO);
    for r in results {
        let job = r?;
        ios += job.ios;
        elapsed_max = elapsed_max.max(job.elapsed);
        hist.add(&job.hist).map_err(|e| e.to_string())?;
    }
    Ok(Sample {
        iops: ios as f64 / elapsed_max.as_secs_f64(),
        latency_ns_mean: hist.mean(),
        latency_ns_p99: hist.value_at_quantile(0.99) as f64,
    })
}

fn run_job(
    store: &dyn BackingStore,
    write: bool,
    qd: usize,
    runtime: Duration,
    blocks: u64,
    job: u64,
    barrier: &Barrier,
) -> Result<JobResult, String> {
    let mut hist =
        Histogram::<u64>::new_with_bounds(1, 60_000_000_000, 3).expect("histogram bounds");
    let mut queue = store.open_queue(qd).map_err(|e| e.to_string())?;
    let mut rng = SmallRng::seed_from_u64(0xb10c ^ job.wrapping_mul(0x9e37_79b9_7f4a_7c15));
    let mut spare: Vec<IoBuf> = (0..qd)
        .map(|_| {
            let mut buf = IoBuf::new(BLOCK_BYTES as usize);
            if write {
                rng.fill(&mut buf[..]);
            }
            buf
        })
        .collect();
    let mut out = Vec::with_capacity(qd);
    barrier.wait();
    let epoch = Instant::now();
    let deadline = epoch + runtime;
    let mut ios = 0u64;
    let mut now = epoch;
    while now < deadline {
        while let Some(buf) = spare.pop() {
            let offset = rng.gen_range(0..blocks) * BLOCK_BYTES;
            let issued_ns = epoch.elapsed().as_nanos() as u64;
            let req = if write {
                IoRequest::write(offset, buf, issued_ns)
            } else {
                IoRequest::read(offset, buf, issued_ns)
            };
            if let Err(req) = queue.push(req) {
                spare.push(req.buf);
                break;
            }
        }
        out.clear();
        queue.reap(1, &mut out).map_err(|e| e.to_string())?;
        now = Instant::now();
        let now_ns = (now - epoch).as_nanos() as u64;
        for c in out.drain(..) {
            if let Err(e) = c.result {
                return Err(format!("{} failed: {e}", c.op.name()));
            }
            hist.record(now_ns.saturating_sub(c.user_data).max(1)).map_err(|e| e.to_string())?;
            ios += 1;
            spare.push(c.buf);
        }
    }
    let elapsed = now - epoch;
    // Drain what is still in flight (not counted).
    while queue.in_flight() > 0 {
        out.clear();
        queue.reap(queue.in_flight(), &mut out).map_err(|e| e.to_string())?;
    }
    Ok(JobResult { ios, elapsed, hist })
}

/// What one job measured.
struct JobResult {
    /// Requests completed before the deadline.
    ios: u64,
    /// Time from the start to the last counted completion.
    elapsed: Duration,
    /// Latency of every counted request, in nanoseconds.
    hist: Histogram<u64>,
}

pub(super) fn run_fio(
    args: &EnginesArgs,
    file: &TestFile,
    rw: &str,
    engine: EngineKind,
    jobs: usize,
    qd: usize,
    plan: &Plan,
) -> Result<Sample, String> {
    let (ioengine, extra) = fio_engine(engine);
    let runtime_ms = (plan.runtime_secs * 1000.0).round().max(1.0) as u64;
    let output = Command::new(&args.fio)
        .arg("--name=pmcache")
        .arg(format!("--filename={}", file.path.display()))
        .arg(format!("--size={}", plan.file_bytes))
        .arg(format!("--direct={}", u8::from(file.direct)))
        .arg(format!("--rw={rw}"))
        .arg(format!("--bs={BLOCK_BYTES}"))
        .arg(format!("--ioengine={ioengine}"))
        .arg(format!("--iodepth={qd}"))
        .arg(format!("--numjobs={jobs}"))
        .arg(format!("--runtime={runtime_ms}ms"))
        .args(["--time_based", "--thread", "--group_reporting", "--norandommap"])
        .args(["--randrepeat=0", "--invalidate=0", "--output-format=json"])
        .args(extra)
        .output()
        .map_err(|e| format!("cannot run {}: {e}", args.fio))?;
    let doc = captured_report(&output, &format!("fio {ioengine} {}", extra.join(" ")))?;
    let job = &doc["jobs"][0];
    let side = if rw == "randwrite" { &job["write"] } else { &job["read"] };
    let iops = side["iops"].as_f64().ok_or("fio JSON has no iops")?;
    Ok(Sample {
        iops,
        latency_ns_mean: side["lat_ns"]["mean"].as_f64().unwrap_or(f64::NAN),
        latency_ns_p99: side["clat_ns"]["percentile"]["99.000000"].as_f64().unwrap_or(f64::NAN),
    })
}
