//! The server's CPU in `bench paper002`: its threads' context switches, and the π job beside it.

use std::collections::BTreeMap;
use std::path::PathBuf;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use serde::Serialize;

use crate::harness::process::{check_interrupted, was_interrupted};
use crate::harness::servers::control_stats;

/// The server threads' context switches over a measurement.
#[derive(Debug, Clone, Default, Serialize)]
pub struct ContextSwitches {
    /// Voluntary context switches (the thread waited).
    pub voluntary: u64,
    /// Involuntary context switches (the thread was preempted).
    pub involuntary: u64,
    /// Voluntary + involuntary by thread name (digits and the dash before them dropped:
    /// `nbd-conn-3` counts as `nbd-conn`).
    pub by_thread: BTreeMap<String, u64>,
}

impl ContextSwitches {
    pub(super) fn total(&self) -> u64 {
        self.voluntary + self.involuntary
    }
}

/// One thread's counters.
#[derive(Debug, Clone)]
struct TaskCounters {
    name: String,
    voluntary: u64,
    involuntary: u64,
}

/// Threads of this process that are the bench's, not the server's: the π job and the sampler.
const BENCH_THREADS: [&str; 2] = [PI_THREAD, SAMPLER_THREAD];
const PI_THREAD: &str = "pi-job";
const SAMPLER_THREAD: &str = "ctx-sampler";

/// Every thread of `pid` (`/proc/<pid>/task/<tid>/status`); of this process, where the server
/// runs beside the bench, the server's alone (not its main thread nor `BENCH_THREADS`).
fn read_tasks(pid: u32) -> BTreeMap<u32, TaskCounters> {
    let mut tasks = BTreeMap::new();
    let Ok(entries) = std::fs::read_dir(format!("/proc/{pid}/task")) else { return tasks };
    for entry in entries.flatten() {
        let Some(tid) = entry.file_name().to_str().and_then(|t| t.parse::<u32>().ok()) else {
            continue;
        };
        let Ok(status) = std::fs::read_to_string(entry.path().join("status")) else { continue };
        let mut task = TaskCounters { name: String::new(), voluntary: 0, involuntary: 0 };
        for line in status.lines() {
            let Some((key, value)) = line.split_once(':') else { continue };
            let value = value.trim();
            match key {
                "Name" => task.name = value.to_string(),
                "voluntary_ctxt_switches" => task.voluntary = value.parse().unwrap_or(0),
                "nonvoluntary_ctxt_switches" => task.involuntary = value.parse().unwrap_or(0),
                _ => {}
            }
        }
        let ours = pid == std::process::id()
            && (tid == pid || BENCH_THREADS.contains(&task.name.as_str()));
        if !ours {
            tasks.insert(tid, task);
        }
    }
    tasks
}

/// The server's write and stall counters at one moment of a measurement.
#[derive(Debug, Clone, Copy, Default, Serialize)]
pub struct CounterTick {
    /// Seconds since the sampler started (just before fio).
    pub t_s: f64,
    /// Blocks written since the server started.
    pub writes: u64,
    /// Failed insertions since the server started: writes that found no free or clean slot
    /// and waited for the cleaner (stalls), and writes paced to the cleaner's rate that
    /// waited for their turn.
    pub failed_insertions: u64,
}

/// What a [`RunSampler`] saw.
#[derive(Debug, Clone, Default)]
pub(super) struct Sampled {
    pub(super) switches: ContextSwitches,
    /// The server's counters every [`STATS_EVERY_TICKS`] ticks (500 ms).
    pub(super) counters: Vec<CounterTick>,
    /// How long the cleaner had been boosted when sampling stopped, if it still was (the
    /// server's `cleaner_boosted_ns` counts boosts once they end), seconds.
    pub(super) open_boost_s: f64,
}

/// Ticks of 100 ms between two reads of the server's statistics.
const STATS_EVERY_TICKS: u64 = 5;

/// Samples a process's threads' context-switch counters every 100 ms until stopped (a thread
/// that appears meanwhile counts from zero, one that ends keeps its last sample), and the
/// cleaner's boost state and the write and stall counters through the control socket every
/// 500 ms.
pub(super) struct RunSampler {
    stop: Arc<AtomicBool>,
    handle: Option<JoinHandle<Sampled>>,
}

impl RunSampler {
    pub(super) fn start(pid: u32, control: Option<PathBuf>) -> Self {
        let stop = Arc::new(AtomicBool::new(false));
        let base = read_tasks(pid);
        let handle = {
            let stop = stop.clone();
            std::thread::Builder::new()
                .name(SAMPLER_THREAD.into())
                .spawn(move || {
                    let mut last = base.clone();
                    let mut boost: Option<(Instant, u64)> = None;
                    let mut counters = Vec::new();
                    let start = Instant::now();
                    for tick in 0u64.. {
                        let done = stop.load(Ordering::Acquire);
                        last.extend(read_tasks(pid));
                        if tick.is_multiple_of(STATS_EVERY_TICKS)
                            && let Some(stats) =
                                control.as_deref().and_then(|c| control_stats(c).ok())
                        {
                            counters.push(CounterTick {
                                t_s: start.elapsed().as_secs_f64(),
                                writes: stats["writes"].as_u64().unwrap_or(0),
                                failed_insertions: stats["stalls"].as_u64().unwrap_or(0)
                                    + stats["throttled_writes"].as_u64().unwrap_or(0),
                            });
                            let boosts = stats["cleaner_boosts"].as_u64().unwrap_or(0);
                            boost = match (stats["cleaner_boosted"].as_bool(), boost) {
                                // The same boost as at the last sample.
                                (Some(true), Some((since, n))) if n == boosts => Some((since, n)),
                                (Some(true), _) => Some((Instant::now(), boosts)),
                                _ => None,
                            };
                        }
                        if done {
                            break;
                        }
                        // Ticks on a 100 ms grid from the start, whatever each one's reads cost.
                        let next = Duration::from_millis(100 * (tick + 1));
                        std::thread::sleep(next.saturating_sub(start.elapsed()));
                    }
                    let mut out = ContextSwitches::default();
                    for (tid, now) in &last {
                        let (v0, i0) =
                            base.get(tid).map_or((0, 0), |b| (b.voluntary, b.involuntary));
                        let (v, i) =
                            (now.voluntary.saturating_sub(v0), now.involuntary.saturating_sub(i0));
                        out.voluntary += v;
                        out.involuntary += i;
                        let name = now.name.trim_end_matches(|c: char| c.is_ascii_digit());
                        let name = name.strip_suffix('-').unwrap_or(name).to_string();
                        *out.by_thread.entry(name).or_default() += v + i;
                    }
                    let open_boost_s =
                        boost.map_or(0.0, |(since, _)| since.elapsed().as_secs_f64());
                    Sampled { switches: out, counters, open_boost_s }
                })
                .expect("a thread for the sampler")
        };
        RunSampler { stop, handle: Some(handle) }
    }

    pub(super) fn finish(mut self) -> Sampled {
        self.stop.store(true, Ordering::Release);
        self.handle.take().and_then(|h| h.join().ok()).unwrap_or_default()
    }
}

impl Drop for RunSampler {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Release);
        if let Some(handle) = self.handle.take() {
            let _ = handle.join();
        }
    }
}

/// Confines the calling thread to one CPU.
fn pin_current_thread(cpu: usize) -> Result<(), String> {
    let mut set = rustix::thread::CpuSet::new();
    set.set(cpu);
    rustix::thread::sched_setaffinity(None, &set).map_err(|e| format!("pinning to CPU {cpu}: {e}"))
}

/// π from `terms` terms of the Leibniz series: a chain of dependent divisions and additions,
/// all CPU and nothing else.
fn leibniz_pi(terms: u64) -> f64 {
    let terms = std::hint::black_box(terms);
    let mut sum = 0.0f64;
    let mut sign = 1.0f64;
    let mut k = 0;
    // In slices of 2^22 terms, between which an interruption is noticed.
    while k < terms && !was_interrupted() {
        let end = terms.min(k + (1 << 22));
        while k < end {
            sum += sign / (2 * k + 1) as f64;
            sign = -sign;
            k += 1;
        }
    }
    std::hint::black_box(4.0 * sum)
}

/// Starts the π job on a thread pinned to CPU 0; it returns its run time.
pub(super) fn spawn_pi(terms: u64) -> JoinHandle<Result<Duration, String>> {
    let pi = std::thread::Builder::new().name(PI_THREAD.into()).spawn(move || {
        pin_current_thread(0)?;
        let started = Instant::now();
        let pi = leibniz_pi(terms);
        let elapsed = started.elapsed();
        check_interrupted()?;
        if (pi - std::f64::consts::PI).abs() > 1e-3 {
            return Err(format!("the π job computed {pi}"));
        }
        Ok(elapsed)
    });
    pi.expect("a thread for the π job")
}

pub(super) fn join_pi(handle: JoinHandle<Result<Duration, String>>) -> Result<Duration, String> {
    handle.join().map_err(|_| "the π job panicked".to_string())?
}

/// The number of terms that take about `seconds` on CPU 0: from the fastest of three short
/// timed runs (the least disturbed by other load).
pub(super) fn calibrate_pi(seconds: f64) -> Result<u64, String> {
    let probe = (seconds / 20.0).clamp(0.1, 0.5);
    let mut terms = 1u64 << 20;
    while join_pi(spawn_pi(terms))?.as_secs_f64() < probe {
        terms *= 2;
    }
    let mut best = f64::INFINITY;
    for _ in 0..3 {
        best = best.min(join_pi(spawn_pi(terms))?.as_secs_f64());
    }
    Ok((terms as f64 / best * seconds).max(1.0) as u64)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn leibniz_converges_to_pi() {
        assert!((leibniz_pi(1_000_000) - std::f64::consts::PI).abs() < 1e-5);
    }

    #[test]
    fn this_process_has_readable_context_switch_counters() {
        let tasks = read_tasks(std::process::id());
        assert!(!tasks.is_empty());
        assert!(tasks.values().all(|t| !t.name.is_empty()));
    }

    /// The server runs in the bench's process: the bench's own threads are not counted as its.
    #[test]
    fn the_bench_threads_are_not_the_servers() {
        let (tx, rx) = std::sync::mpsc::channel::<()>();
        let pi = std::thread::Builder::new()
            .name(PI_THREAD.into())
            .spawn(move || rx.recv())
            .expect("thread");
        let server = std::thread::Builder::new()
            .name("pmcache-cleaner".into())
            .spawn(|| std::thread::sleep(std::time::Duration::from_millis(300)))
            .expect("thread");
        std::thread::sleep(std::time::Duration::from_millis(50));
        let tasks = read_tasks(std::process::id());
        drop(tx);
        let _ = (pi.join(), server.join());
        assert!(!tasks.contains_key(&std::process::id()), "the main thread was counted");
        assert!(tasks.values().all(|t| t.name != PI_THREAD), "the π job was counted");
        assert!(tasks.values().any(|t| t.name == "pmcache-cleaner"), "a server thread was not");
    }
}
