//! The backing store's health in the server's log: a thread waits on the engine's health
//! changes (`Engine::wait_backing_health`) and says each on stderr as it happens — the store
//! starting to fail (which kinds of operation, the last error), the kinds failing changing, the
//! store taking every kind again (after how long, how many failed operations) — so an operator
//! reading the log sees a failing disk or an unreachable network store without polling
//! `pmcache stats`. A store that flaps is said at most once a second.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use pmcache_engine::{BackingHealth, BackingOp, BackingState};
use pmcache_frontend::CacheEngine;

/// How often a change is said at most.
const LINE_INTERVAL: Duration = Duration::from_secs(1);
/// How long the thread waits for a change before it looks for its stop again: a stop wakes it,
/// and one that comes just before it starts to wait is seen this much later.
const WAIT: Duration = Duration::from_secs(1);
/// How often the thread looks for its stop between two lines.
const STOP_POLL: Duration = Duration::from_millis(100);

/// The watching thread; stopped (and joined) when dropped.
pub(crate) struct HealthWatch {
    engine: Arc<CacheEngine>,
    stop: Arc<AtomicBool>,
    thread: Option<JoinHandle<()>>,
}

impl HealthWatch {
    /// Starts watching `engine`'s backing store, called `label` in the log.
    pub(crate) fn start(engine: Arc<CacheEngine>, label: String) -> Result<Self, String> {
        let stop = Arc::new(AtomicBool::new(false));
        let thread = {
            let (engine, stop) = (engine.clone(), stop.clone());
            std::thread::Builder::new()
                .name("pmcache-health".into())
                .spawn(move || watch(&engine, &label, &stop))
                .map_err(|e| format!("starting the backing store's health watch: {e}"))?
        };
        Ok(Self { engine, stop, thread: Some(thread) })
    }
}

impl Drop for HealthWatch {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::SeqCst);
        self.engine.wake_backing_health_watchers();
        if let Some(thread) = self.thread.take() {
            let _ = thread.join();
        }
    }
}

fn watch(engine: &CacheEngine, label: &str, stop: &AtomicBool) {
    let mut seen = 0;
    let mut said = BackingHealth::default();
    let mut errors_said = engine.stats().backing_errors;
    let mut failing_since: Option<Instant> = None;
    while !stop.load(Ordering::SeqCst) {
        let (now_seen, health) = engine.wait_backing_health(seen, WAIT);
        if now_seen == seen {
            continue;
        }
        seen = now_seen;
        if same(&health, &said) {
            continue;
        }
        let errors = engine.stats().backing_errors;
        if health.state == BackingState::Ok {
            let failed_ms = failing_since.take().map_or(0, |t| t.elapsed().as_millis() as u64);
            eprintln!("pmcache: {}", recovered_line(label, failed_ms, errors - errors_said));
        } else {
            failing_since.get_or_insert_with(Instant::now);
            let dirty_slots = engine.dirty_slots();
            eprintln!("pmcache: warning: {}", failing_line(label, &health, dirty_slots));
        }
        errors_said = errors;
        said = health;
        // A flapping store: one line a second at most; the next wait sees what changed since.
        let said_at = Instant::now();
        while said_at.elapsed() < LINE_INTERVAL && !stop.load(Ordering::SeqCst) {
            std::thread::sleep(STOP_POLL);
        }
    }
}

/// The same state, failing in the same kinds of operation.
fn same(a: &BackingHealth, b: &BackingHealth) -> bool {
    a.state == b.state && a.failing == b.failing
}

/// The line for a store failing, `dirty_slots` waiting for it.
fn failing_line(label: &str, health: &BackingHealth, dirty_slots: u64) -> String {
    let how = match health.state {
        BackingState::Unreachable => "cannot be reached",
        _ => "is failing",
    };
    let mut line = format!(
        "backing store {label} {how}: {} fail (last: {})",
        health.failing_names(),
        health.last_error.as_deref().unwrap_or("no message")
    );
    if health.failing.contains(&BackingOp::Write) && dirty_slots > 0 {
        line += &format!(
            "; the {dirty_slots} dirty blocks stay in the cache and their write-back is retried"
        );
    }
    line += "; `pmcache stats` shows its state";
    line
}

fn recovered_line(label: &str, failed_ms: u64, failed_ops: u64) -> String {
    format!(
        "backing store {label} is ok again: its operations succeed, after {:.1} s of failures \
         ({failed_ops} failed operations)",
        failed_ms as f64 / 1000.0
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    fn failing(state: BackingState, failing: Vec<BackingOp>) -> BackingHealth {
        BackingHealth {
            state,
            failing,
            last_error: Some("write at byte 0 (+4096) on the backing store: EIO".into()),
            failing_ms: 10,
        }
    }

    #[test]
    fn the_lines_say_what_fails_and_what_is_kept() {
        let writes = failing(BackingState::Failing, vec![BackingOp::Write]);
        assert_eq!(
            failing_line("/dev/sdb", &writes, 12),
            "backing store /dev/sdb is failing: writes fail (last: write at byte 0 (+4096) on \
             the backing store: EIO); the 12 dirty blocks stay in the cache and their \
             write-back is retried; `pmcache stats` shows its state"
        );
        // A write-through write that failed: nothing dirty waits for the store.
        assert!(!failing_line("/dev/sdb", &writes, 0).contains("dirty"));
        let line = failing_line(
            "rbd:pool/img",
            &failing(BackingState::Unreachable, vec![BackingOp::Read, BackingOp::Flush]),
            12,
        );
        assert!(
            line.starts_with(
                "backing store rbd:pool/img cannot be reached: reads and flushes fail"
            ),
            "{line}"
        );
        assert!(!line.contains("dirty blocks"), "{line}");
        assert_eq!(
            recovered_line("/dev/sdb", 2345, 17),
            "backing store /dev/sdb is ok again: its operations succeed, after 2.3 s of failures \
             (17 failed operations)"
        );
    }

    #[test]
    fn a_change_of_message_alone_is_not_said_again() {
        let a = failing(BackingState::Failing, vec![BackingOp::Write]);
        let mut b = a.clone();
        b.last_error = Some("write at byte 8192 (+4096) on the backing store: EIO".into());
        assert!(same(&a, &b));
        assert!(!same(
            &a,
            &failing(BackingState::Failing, vec![BackingOp::Read, BackingOp::Write])
        ));
        assert!(!same(&a, &BackingHealth::default()));
    }
}
