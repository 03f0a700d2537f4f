//! Writers yielding to the cleaner (`CleanerConfig::nice_writers`). While the cleaner is
//! boosted, the threads that write through the engine run at a higher nice value, so that the
//! cleaner gains the CPU from its own writers, the threads it is behind, rather than from the
//! machine's other programs. Lowering the cleaner's nice value (`nice_boost`) takes CPU from
//! everything else on its CPUs; raising the writers' gives a neighbour more of it.
//!
//! The cleaner publishes the nice value the writers should have (or none: as they were) with
//! an epoch. Each thread applies it to itself at its next entry into the engine, so the setting
//! costs one relaxed load per request while nothing changes, and a system call per thread per
//! change. A thread keeps the nice value it had before its first change and goes back to it.

use std::cell::Cell;

use crate::sync::{AtomicU32, AtomicU64, Ordering};

/// Epochs of every engine of the process from one count, so that a thread serving several
/// engines never takes one engine's epoch for another's.
static EPOCHS: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);

/// `nice` stored when writers run as they were.
const AS_THEY_WERE: u32 = u32::MAX;

thread_local! {
    /// The epoch this thread last followed (0: none), and its own nice value once it was
    /// changed (`None`: never changed).
    static APPLIED: Cell<(u64, Option<i32>)> = const { Cell::new((0, None)) };
}

/// The writers' nice value the cleaner asks for.
pub(super) struct WriterNice {
    /// 0 until the first change.
    epoch: AtomicU64,
    /// The nice value + 20, or [`AS_THEY_WERE`].
    nice: AtomicU32,
}

impl WriterNice {
    pub(super) fn new() -> Self {
        Self { epoch: AtomicU64::new(0), nice: AtomicU32::new(AS_THEY_WERE) }
    }

    /// Writers run at `nice` from their next request on (`None`: as they were).
    pub(super) fn set(&self, nice: Option<i32>) {
        let stored = nice.map_or(AS_THEY_WERE, |n| (n + 20) as u32);
        if self.nice.load(Ordering::Relaxed) == stored {
            return;
        }
        self.nice.store(stored, Ordering::Relaxed);
        self.epoch.store(EPOCHS.fetch_add(1, Ordering::Relaxed) + 1, Ordering::Release);
    }

    /// The nice value asked for now (`None`: as they were).
    pub(super) fn asked(&self) -> Option<i32> {
        let stored = self.nice.load(Ordering::Relaxed);
        (stored != AS_THEY_WERE).then(|| stored as i32 - 20)
    }

    /// Applies the value asked for to the calling thread if it changed since this thread last
    /// looked. A request that writes (`writing`) takes it either way; one that only reads
    /// takes a thread back to its own value, never away from it: readers do not compete with
    /// the cleaner for slots.
    #[inline]
    pub(super) fn follow(&self, writing: bool) {
        let epoch = self.epoch.load(Ordering::Acquire);
        if epoch == 0 || APPLIED.with(|a| a.get().0) == epoch {
            return;
        }
        self.apply(epoch, writing);
    }

    #[cold]
    fn apply(&self, epoch: u64, writing: bool) {
        use rustix::process::{getpriority_process, setpriority_process};
        let (_, own) = APPLIED.with(Cell::get);
        let asked = self.asked();
        let own = match (asked, own) {
            // A read never demotes: the thread looks again at its next request.
            (Some(_), _) if !writing => return,
            // Never changed and nothing asked: nothing to undo.
            (None, None) => None,
            (asked, own) => {
                let tid = rustix::thread::gettid();
                let own = own.unwrap_or_else(|| getpriority_process(Some(tid)).unwrap_or(0));
                // A thread that may not go back to a lower nice value stays where it is:
                // raising it is always allowed, lowering it needs CAP_SYS_NICE or RLIMIT_NICE,
                // which the cleaner checked before asking (`Cleaner::run`).
                let _ = setpriority_process(Some(tid), asked.map_or(own, |n| n.max(own)));
                Some(own)
            }
        };
        APPLIED.with(|a| a.set((epoch, own)));
    }
}

#[cfg(all(test, not(feature = "shuttle")))]
mod tests {
    use super::*;

    fn nice_of_this_thread() -> i32 {
        rustix::process::getpriority_process(Some(rustix::thread::gettid())).expect("getpriority")
    }

    /// A writer's thread takes the nice value asked for at its next write, not at a read, and
    /// goes back to its own at its next request (a read too) once the cleaner no longer
    /// asks; a thread that does not enter keeps its own.
    #[test]
    fn a_writer_follows_the_nice_value_asked_for_and_goes_back_to_its_own() {
        let writers = WriterNice::new();
        std::thread::scope(|scope| {
            scope
                .spawn(|| {
                    let own = nice_of_this_thread();
                    writers.follow(true);
                    assert_eq!(nice_of_this_thread(), own, "nothing asked yet");
                    writers.set(Some(own + 5));
                    assert_eq!(writers.asked(), Some(own + 5));
                    assert_eq!(nice_of_this_thread(), own, "applied at the next request only");
                    writers.follow(false);
                    assert_eq!(nice_of_this_thread(), own, "a read does not demote");
                    writers.follow(true);
                    assert_eq!(nice_of_this_thread(), own + 5);
                    writers.set(None);
                    writers.follow(false);
                    // Going back down needs CAP_SYS_NICE or RLIMIT_NICE (root here).
                    if rustix::process::geteuid().is_root() {
                        assert_eq!(nice_of_this_thread(), own);
                    }
                })
                .join()
                .expect("the writer thread");
            let untouched = scope.spawn(nice_of_this_thread).join().expect("another thread");
            assert_eq!(untouched, nice_of_this_thread(), "a thread that never entered");
        });
    }
}
