//! Failpoints: test hooks compiled into the shipped engine, so that the binary a test breaks
//! is the binary that ships. They are armed only by the environment variable
//! `PMCACHE_FAILPOINT`, read once per process when the first engine is assembled (formatted
//! or attached); a value that names no failpoint refuses the engine (`Error::Config`).
//! Unarmed, a failpoint costs one relaxed load and a branch not taken. docs/TESTING.md,
//! "Failpoints", lists the tests that arm them.
//!
//! - `panic-mid-write:N` ([`mid_write`]): the `N`th block write in write-back or write-only
//!   mode (counted from 1 over the process, single and group-committed writes alike) panics
//!   after its data is in its slot and its block's index entry is found or reserved (hidden,
//!   for a block new to the cache), with its stripe locked, before its metadata entry is
//!   stored: the state a broken invariant in the write path leaves behind.
//!
//! The counters are plain `std` atomics, under the `shuttle` feature too: they are not part
//! of the protocol the concurrency tests explore, and those tests never arm them.

use std::sync::OnceLock;
use std::sync::atomic::{AtomicU64, Ordering};

/// The environment variable that arms a failpoint.
pub(crate) const ENV: &str = "PMCACHE_FAILPOINT";

/// The write `panic-mid-write` panics on, counted from 1; 0 when unarmed.
static PANIC_MID_WRITE_AT: AtomicU64 = AtomicU64::new(0);
/// Block writes that reached [`mid_write`] while it was armed.
static MID_WRITES: AtomicU64 = AtomicU64::new(0);

/// Reads `PMCACHE_FAILPOINT` (the first call only) and arms what it names.
pub(crate) fn arm_from_env() -> Result<(), String> {
    static READ: OnceLock<Result<u64, String>> = OnceLock::new();
    let at = READ.get_or_init(|| parse(std::env::var(ENV).ok().as_deref())).clone()?;
    PANIC_MID_WRITE_AT.store(at, Ordering::Relaxed);
    Ok(())
}

/// The write `panic-mid-write` panics on (0: none) from the variable's value, if set.
fn parse(value: Option<&str>) -> Result<u64, String> {
    let Some(value) = value.filter(|v| !v.is_empty()) else { return Ok(0) };
    value
        .strip_prefix("panic-mid-write:")
        .and_then(|n| n.parse::<u64>().ok())
        .filter(|&n| n > 0)
        .ok_or_else(|| {
            format!(
                "{ENV}={value}: the only failpoint is panic-mid-write:N, N from 1 (a test hook)"
            )
        })
}

/// The write path between a block's durable data and its metadata entry (see the module).
#[inline(always)]
pub(crate) fn mid_write() {
    if PANIC_MID_WRITE_AT.load(Ordering::Relaxed) != 0 {
        mid_write_armed();
    }
}

#[cold]
#[inline(never)]
fn mid_write_armed() {
    let at = PANIC_MID_WRITE_AT.load(Ordering::Relaxed);
    if MID_WRITES.fetch_add(1, Ordering::Relaxed) + 1 == at {
        panic!(
            "failpoint {ENV}=panic-mid-write:{at}: a panic after the data of write {at} is in \
             its slot and before its metadata entry is stored"
        );
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_panic_mid_write_with_a_positive_count_arms_anything() {
        assert_eq!(parse(None), Ok(0));
        assert_eq!(parse(Some("")), Ok(0));
        assert_eq!(parse(Some("panic-mid-write:1")), Ok(1));
        assert_eq!(parse(Some("panic-mid-write:250")), Ok(250));
        for bad in ["panic-mid-write:0", "panic-mid-write:", "panic-mid-write", "panic:3", "x"] {
            let err = parse(Some(bad)).expect_err(bad);
            assert!(err.contains(bad) && err.contains("panic-mid-write:N"), "{err}");
        }
    }
}
