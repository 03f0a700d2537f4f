//! How `bench engine-core` runs its workers: paced, on several threads, separately or taking turns.

use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use hdrhistogram::Histogram;
use rand::SeedableRng;
use rand::rngs::SmallRng;

use super::LATENCY_SAMPLE_EVERY;

/// `worker`, followed by an execution barrier after every call if `serialize` (see
/// [`CoreArgs::serialize`](super::CoreArgs::serialize)).
fn paced<W: FnMut(&mut SmallRng)>(worker: W, serialize: bool) -> impl FnMut(&mut SmallRng) {
    paced_by(worker, serialize.then_some(pmcache_media::serialize_execution as fn()))
}

/// `worker`, followed by `barrier` after every call.
fn paced_by<W: FnMut(&mut SmallRng)>(
    mut worker: W,
    barrier: Option<fn()>,
) -> impl FnMut(&mut SmallRng) {
    move |rng: &mut SmallRng| {
        worker(rng);
        if let Some(barrier) = barrier {
            barrier();
        }
    }
}

/// Runs `threads` workers for `seconds`, each call of a worker doing `ops_per_call`
/// operations; returns total ops/s and merged sampled latencies (of whole calls).
pub(super) fn drive<W>(
    threads: usize,
    seconds: f64,
    ops_per_call: usize,
    serialize: bool,
    make_worker: impl Fn(usize) -> W + Sync,
) -> (f64, Histogram<u64>)
where
    W: FnMut(&mut SmallRng) + Send,
{
    let stop = AtomicBool::new(false);
    let start = Instant::now();
    let results: Vec<(u64, Histogram<u64>)> = std::thread::scope(|scope| {
        let handles: Vec<_> = (0..threads)
            .map(|t| {
                let stop = &stop;
                let make_worker = &make_worker;
                scope.spawn(move || {
                    let mut worker = paced(make_worker(t), serialize);
                    let mut rng = SmallRng::seed_from_u64(t as u64 + 1);
                    let mut histogram = Histogram::<u64>::new(3).expect("histogram");
                    let mut ops = 0u64;
                    while !stop.load(Ordering::Relaxed) {
                        for _ in 0..LATENCY_SAMPLE_EVERY - 1 {
                            worker(&mut rng);
                        }
                        let timed = Instant::now();
                        worker(&mut rng);
                        let _ = histogram.record(timed.elapsed().as_nanos() as u64);
                        ops += LATENCY_SAMPLE_EVERY * ops_per_call as u64;
                    }
                    (ops, histogram)
                })
            })
            .collect();
        std::thread::sleep(Duration::from_secs_f64(seconds));
        stop.store(true, Ordering::Relaxed);
        handles.into_iter().map(|h| h.join().expect("worker panicked")).collect()
    });
    let elapsed = start.elapsed().as_secs_f64();
    let mut merged = Histogram::<u64>::new(3).expect("histogram");
    let mut total = 0;
    for (ops, histogram) in results {
        total += ops;
        merged.add(histogram).expect("same histogram shape");
    }
    (total as f64 / elapsed, merged)
}

/// Operations each thread runs of one kind (baseline, floor or engine) before the next kind's
/// turn in an interleaved run (the default; not with `--separate`).
pub(crate) const INTERLEAVE_BLOCK_OPS: usize = 2048;

/// Runs `threads` threads, each with its own baseline, floor and engine worker (made by
/// `make_workers`, in that order), taking turns in blocks of `INTERLEAVE_BLOCK_OPS`
/// operations — every thread on the same kind at once, a barrier between kinds — until each
/// kind has run `seconds` on the first thread. The kinds' order rotates every round, so that
/// none always follows the same other kind. A turn lasts as long as its slowest thread (the
/// others wait at the barrier), so a kind's throughput is its operations over the sum of its
/// turns' slowest times — not a sum of per-thread rates, which would credit a thread that
/// finished early with time it spent waiting. Every kind's calls are timed alike (one in
/// `LATENCY_SAMPLE_EVERY`), so the timing costs each the same. `run` seeds the threads'
/// random sequences: each run draws other blocks. Returns the three throughputs (ops/s) and
/// the engine's sampled call latencies.
pub(super) fn drive_interleaved<R, F, E>(
    threads: usize,
    seconds: f64,
    ops_per_call: usize,
    run: usize,
    serialize: bool,
    make_workers: impl Fn(usize) -> (R, F, E) + Sync,
) -> ([f64; 3], Histogram<u64>)
where
    R: FnMut(&mut SmallRng) + Send,
    F: FnMut(&mut SmallRng) + Send,
    E: FnMut(&mut SmallRng) + Send,
{
    /// Rounds a thread records before the run starts (more only grow the record, between
    /// timed turns).
    const ROUNDS_RESERVED: usize = 1 << 14;
    let barrier = std::sync::Barrier::new(threads);
    let stop = AtomicBool::new(false);
    // The baseline does one operation per call, the floor and the engine `ops_per_call`.
    let calls = [INTERLEAVE_BLOCK_OPS, (INTERLEAVE_BLOCK_OPS / ops_per_call).max(1)];
    let calls_per_turn = [calls[0], calls[1], calls[1]];
    let ops_per_turn = [calls[0], calls[1] * ops_per_call, calls[1] * ops_per_call];
    type ThreadRecord = (Vec<[Duration; 3]>, Histogram<u64>);
    let records: Vec<ThreadRecord> = std::thread::scope(|scope| {
        let handles: Vec<_> = (0..threads)
            .map(|t| {
                let (barrier, stop, make_workers) = (&barrier, &stop, &make_workers);
                scope.spawn(move || {
                    let (raw, floor, engine) = make_workers(t);
                    let (mut raw, mut floor, mut engine) =
                        (paced(raw, serialize), paced(floor, serialize), paced(engine, serialize));
                    let seed = ((run as u64) << 32) | (t as u64 + 1);
                    let mut rng = SmallRng::seed_from_u64(seed);
                    let mut histograms: [Histogram<u64>; 3] =
                        std::array::from_fn(|_| Histogram::new(3).expect("histogram"));
                    let mut rounds: Vec<[Duration; 3]> = Vec::with_capacity(ROUNDS_RESERVED);
                    let mut busy = [Duration::ZERO; 3];
                    loop {
                        barrier.wait();
                        if stop.load(Ordering::Relaxed) {
                            break;
                        }
                        let mut round = [Duration::ZERO; 3];
                        for step in 0..3 {
                            let kind = (step + rounds.len()) % 3;
                            let mut call = |rng: &mut SmallRng| match kind {
                                0 => raw(rng),
                                1 => floor(rng),
                                _ => engine(rng),
                            };
                            barrier.wait();
                            let started = Instant::now();
                            // The last call of every `LATENCY_SAMPLE_EVERY` is timed, as in
                            // `drive`: never a turn's first, which follows another kind's turn
                            // and would skew the percentiles.
                            for n in 1..=calls_per_turn[kind] as u64 {
                                if n % LATENCY_SAMPLE_EVERY == 0 {
                                    let timed = Instant::now();
                                    call(&mut rng);
                                    let ns = timed.elapsed().as_nanos() as u64;
                                    let _ = histograms[kind].record(ns);
                                } else {
                                    call(&mut rng);
                                }
                            }
                            round[kind] = started.elapsed();
                            busy[kind] += round[kind];
                        }
                        rounds.push(round);
                        // The first thread decides, before the next round's barrier, for all.
                        if t == 0 && busy.iter().all(|spent| spent.as_secs_f64() >= seconds) {
                            stop.store(true, Ordering::Relaxed);
                        }
                    }
                    let [_, _, engine_latencies] = histograms;
                    (rounds, engine_latencies)
                })
            })
            .collect();
        handles.into_iter().map(|h| h.join().expect("worker panicked")).collect()
    });
    let round_count = records[0].0.len();
    assert!(records.iter().all(|(rounds, _)| rounds.len() == round_count), "rounds differ");
    let mut walls = [Duration::ZERO; 3];
    for round in 0..round_count {
        for (kind, wall) in walls.iter_mut().enumerate() {
            *wall += records.iter().map(|(rounds, _)| rounds[round][kind]).max().expect("threads");
        }
    }
    let rates = std::array::from_fn(|kind| {
        let ops = (threads * round_count * ops_per_turn[kind]) as f64;
        ops / walls[kind].as_secs_f64()
    });
    let mut merged = Histogram::<u64>::new(3).expect("histogram");
    for (_, histogram) in records {
        merged.add(histogram).expect("same histogram shape");
    }
    (rates, merged)
}

#[cfg(test)]
mod tests {
    use std::sync::atomic::AtomicU64;

    use super::*;

    #[test]
    fn an_interleaved_run_gives_every_kind_the_same_operations_and_its_own_rate() {
        const BATCH: usize = 16;
        let ops = [AtomicU64::new(0), AtomicU64::new(0), AtomicU64::new(0)];
        let spin = |ns: u64| {
            let until = Instant::now() + Duration::from_nanos(ns);
            while Instant::now() < until {}
        };
        let ops_ref = &ops;
        let ([raw, floor, engine], latencies) = drive_interleaved(2, 0.02, BATCH, 0, false, |_| {
            (
                move |_: &mut SmallRng| {
                    ops_ref[0].fetch_add(1, Ordering::Relaxed);
                },
                move |_: &mut SmallRng| {
                    ops_ref[1].fetch_add(BATCH as u64, Ordering::Relaxed);
                    spin(2_000);
                },
                move |_: &mut SmallRng| {
                    ops_ref[2].fetch_add(BATCH as u64, Ordering::Relaxed);
                    spin(8_000);
                },
            )
        });
        let done = ops.each_ref().map(|o| o.load(Ordering::Relaxed));
        assert_eq!(done[0], done[1], "baseline and floor ran different operation counts");
        assert_eq!(done[1], done[2], "floor and engine ran different operation counts");
        assert_eq!(done[0] % (2 * INTERLEAVE_BLOCK_OPS as u64), 0, "whole blocks on both threads");
        assert!(done[0] > 0);
        // A call of 16 operations that spins 8 µs runs at about 2 M op/s per thread, 4 times
        // slower than one that spins 2 µs; the baseline does no work at all.
        assert!(raw > floor && floor > engine, "rates {raw} {floor} {engine}");
        let per_thread_ns = 2.0 * 1e9 * BATCH as f64 / engine;
        assert!(
            (8_000.0..100_000.0).contains(&per_thread_ns),
            "engine call took {per_thread_ns} ns"
        );
        assert!(!latencies.is_empty() && latencies.min() >= 7_900, "sampled engine call latencies");
    }

    /// A turn lasts as long as its slowest thread: with one thread's calls 4 times slower than
    /// the other's, the rate is both threads' operations over the slow thread's time, not the
    /// sum of the two threads' own rates (which would be 2.5 times higher).
    #[test]
    fn an_interleaved_rate_counts_each_turn_at_its_slowest_thread() {
        let spin = |ns: u64| {
            let until = Instant::now() + Duration::from_nanos(ns);
            while Instant::now() < until {}
        };
        let rates = drive_interleaved(2, 0.03, 1, 0, false, |t| {
            let ns = if t == 0 { 8_000 } else { 2_000 };
            let kind = move |_: &mut SmallRng| spin(ns);
            (kind, kind, kind)
        })
        .0;
        // 2 operations per 8 µs: at most 250 k op/s (spins only ever take longer, on a busy
        // machine much longer: other tests spin beside this one). The sum of per-thread rates
        // would be 125 k + 500 k = 625 k op/s.
        for rate in rates {
            assert!((40_000.0..=262_000.0).contains(&rate), "rate {rate}");
        }
    }

    #[test]
    fn a_paced_worker_is_followed_by_the_barrier_after_every_call_and_only_if_asked() {
        static BARRIERS: AtomicU64 = AtomicU64::new(0);
        fn count_barrier() {
            BARRIERS.fetch_add(1, Ordering::Relaxed);
        }
        for (barrier, barriers_wanted) in [(None, 0), (Some(count_barrier as fn()), 5)] {
            BARRIERS.store(0, Ordering::Relaxed);
            let mut calls = 0;
            let mut worker = paced_by(|_: &mut SmallRng| calls += 1, barrier);
            let mut rng = SmallRng::seed_from_u64(1);
            (0..5).for_each(|_| worker(&mut rng));
            drop(worker);
            assert_eq!((calls, BARRIERS.load(Ordering::Relaxed)), (5, barriers_wanted));
        }
    }
}
