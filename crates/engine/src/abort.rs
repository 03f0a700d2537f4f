//! A broken invariant ends the process.
//!
//! The engine checks its invariants with `assert!`. A panic in the middle of a data path may
//! leave DRAM state that no other path expects: an index entry reserved hidden (its readers
//! wait on the stripe for it), a slot allocated and never published, a superseded entry not
//! zeroed, a stripe's pending free half recorded. Unwinding would release the stripe lock and
//! let the other lanes go on serving on that state. The medium holds every acknowledged write
//! (persist-on-write: docs/DURABILITY.md, "A panic aborts the process"), so the engine aborts
//! instead and the next attach rebuilds the DRAM state from the medium.
//!
//! - Built with `panic = "abort"` (the workspace's release profile), a panic aborts where it
//!   happens and nothing here runs.
//! - Built to unwind (a library embedder's profile, the test profiles), every public data-path
//!   entry point holds an [`AbortOnUnwind`], which aborts if a panic unwinds through it — a
//!   `catch_unwind` further up never sees it.
//! - A lock poisoned by a panic aborts whoever takes it next (`crate::sync::lock`): between
//!   the release of a lock by an unwinding thread and that thread's abort, no other thread
//!   goes on with what the lock protects.

/// Aborts the process if dropped while its thread is panicking: held across an engine entry
/// point, it stops a panic from unwinding out of the engine's critical sections.
///
/// The check costs one relaxed load of the global panic count on every return, and nothing in
/// a build with `panic = "abort"`.
pub(crate) struct AbortOnUnwind {
    /// The entry point, for the message.
    entry: &'static str,
}

impl AbortOnUnwind {
    /// A guard for the entry point named `entry` (e.g. `"Lane::write"`).
    #[inline(always)]
    pub(crate) fn new(entry: &'static str) -> AbortOnUnwind {
        AbortOnUnwind { entry }
    }
}

impl Drop for AbortOnUnwind {
    #[inline(always)]
    fn drop(&mut self) {
        if cfg!(panic = "unwind") && std::thread::panicking() {
            unwound(self.entry);
        }
    }
}

#[cold]
#[inline(never)]
fn unwound(entry: &str) -> ! {
    eprintln!(
        "pmcache-engine: a panic unwound out of {entry}; aborting the process (the cache's DRAM \
         state may be inconsistent; the next attach recovers it from the medium)"
    );
    std::process::abort()
}

/// Aborts the process: a lock was found poisoned, so a thread panicked while holding it.
#[cold]
#[inline(never)]
pub(crate) fn poisoned() -> ! {
    eprintln!(
        "pmcache-engine: an engine lock is poisoned (a thread panicked while holding it); \
         aborting the process (the next attach recovers the cache from the medium)"
    );
    std::process::abort()
}

#[cfg(all(test, not(feature = "shuttle")))]
mod tests {
    use std::os::unix::process::ExitStatusExt;
    use std::process::Command;

    use crate::sync::Mutex;

    /// Set in the child process.
    const CHILD: &str = "PMCACHE_ENGINE_POISON_TEST_CHILD";

    #[test]
    fn a_poisoned_lock_aborts_whoever_takes_it() {
        if std::env::var_os(CHILD).is_some() {
            let mutex = Mutex::new(0u64);
            std::thread::scope(|s| {
                let holder = s.spawn(|| {
                    let _held = mutex.lock().expect("not poisoned yet");
                    panic!("a panic while holding the lock");
                });
                assert!(holder.join().is_err());
            });
            println!("poisoned: {}", mutex.is_poisoned());
            let _held = crate::sync::lock(&mutex);
            println!("unreachable: the poisoned lock was taken");
            return;
        }
        let out = Command::new(std::env::current_exe().expect("this test binary"))
            .args(["--exact", "abort::tests::a_poisoned_lock_aborts_whoever_takes_it"])
            .args(["--nocapture", "--test-threads=1"])
            .env(CHILD, "1")
            .output()
            .expect("run the child");
        let stdout = String::from_utf8_lossy(&out.stdout);
        let stderr = String::from_utf8_lossy(&out.stderr);
        let context = format!("status {:?}\n--- stdout\n{stdout}--- stderr\n{stderr}", out.status);
        assert_eq!(out.status.signal(), Some(libc::SIGABRT), "{context}");
        assert!(stdout.contains("poisoned: true") && !stdout.contains("unreachable"), "{context}");
        assert!(stderr.contains("an engine lock is poisoned"), "{context}");
    }
}
