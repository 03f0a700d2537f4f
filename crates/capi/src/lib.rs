//! libpmcache: pmcache embedded in a C program (a database engine, a VMM) or any language
//! with a C FFI, without a frontend: the program opens a cache of a backing store on a
//! persistent-memory medium and reads and writes it through per-thread handles.
//!
//! The C API is `include/pmcache.h`, generated from this crate by cbindgen (`tests/header.rs`
//! fails when it differs). Under it is the serving library, as `pmcache serve` runs it
//! ([`pmcache_serve::Serving`]): the cleaner, the control socket (`pmcache stats`, `pmcache
//! detach`), the state record of a volatile medium, and at the close the write-back a volatile
//! medium needs and the clean mark. docs/EMBEDDING.md is the guide.
//!
//! - `struct pmcache` ([`Pmcache`]): a cache, opened by `pmcache_open` from a `struct
//!   pmcache_config` ([`PmcacheConfig`], `config.rs`) and closed by `pmcache_close`; its calls
//!   may come from any thread at once.
//! - `struct pmcache_handle` ([`PmcacheHandle`], `handle.rs`): an engine lane, used by one
//!   thread at a time; reads, writes, flushes, trims and write-zeroes go through one.
//! - Errors (`error.rs`): a call returns 0 or a negative errno (NULL with `errno` set, for
//!   those that return a pointer), and keeps its message for `pmcache_last_error()` on the
//!   calling thread.
//!
//! This crate's `unsafe` code is the C boundary: pointers from C, and each handle's lane,
//! which borrows the engine, kept with its lifetime erased beside an `Arc` of the engine
//! (see `handle.rs`). A panic, a broken invariant, aborts the process (`error::guard`) rather
//! than unwind into C.

use std::ffi::{CString, c_char, c_int};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};

use pmcache_frontend::{CacheEngine, ReadLatencies};
use pmcache_serve::{Announce, Frontend, Serving, Silent};

mod config;
mod error;
mod handle;

pub use config::{PmcacheConfig, PmcacheMode};
pub use handle::{
    PMCACHE_FUA, PmcacheHandle, pmcache_flush, pmcache_handle_close, pmcache_handle_open,
    pmcache_read, pmcache_trim, pmcache_write, pmcache_write_zeroes,
};

use crate::error::{Failure, guard, report, status};

/// Lanes the engine keeps beside the handles': the cleaner's, and two for control requests
/// (a `pmcache flush` without a running cleaner drains through a lane of its own).
const LANES_BESIDE_HANDLES: usize = 3;

/// `Shared::open` of a cache being closed: no handle opens any more.
const CLOSING: usize = usize::MAX;

/// An open cache, opaque to C: from `pmcache_open`, until `pmcache_close`.
pub struct Pmcache {
    shared: Arc<Shared>,
    /// The cache as served: finished by `pmcache_close`.
    serving: Serving,
}

/// What the cache's handles and its control socket share.
struct Shared {
    engine: Arc<CacheEngine>,
    /// The handles' read latencies, for `stats`.
    latencies: Arc<ReadLatencies>,
    /// Handles open at once at most (`struct pmcache_config`'s `lanes`).
    lanes: usize,
    /// Handles open now, or [`CLOSING`].
    open: AtomicUsize,
    /// Handles opened since the cache was.
    opened: AtomicU64,
    /// A `pmcache detach` (or another stop) asked the program to close the cache.
    stop_requested: AtomicBool,
}

/// The program, as the control socket sees it: what `pmcache stats` shows of its handles,
/// and what `pmcache detach` stops.
#[derive(Clone)]
struct Embedder(Arc<Shared>);

impl Frontend for Embedder {
    /// The program is told through `pmcache_stop_requested`; its `pmcache_close` then
    /// finishes the stop (a detach: everything written back, the cache's copies dropped).
    fn stop(&self) {
        self.0.stop_requested.store(true, Ordering::SeqCst);
    }

    fn stats(&self) -> Vec<(&'static str, u64)> {
        let open = match self.0.open.load(Ordering::SeqCst) {
            CLOSING => 0,
            open => open as u64,
        };
        vec![
            ("handles_open", open),
            ("handles_opened", self.0.opened.load(Ordering::SeqCst)),
            ("handles_max", self.0.lanes as u64),
        ]
    }
}

// `struct pmcache` is used from any thread at once, a handle from one thread at a time (and
// may move between threads between calls).
const _: () = {
    const fn shared_between_threads<T: Send + Sync>() {}
    const fn sent_between_threads<T: Send>() {}
    shared_between_threads::<Pmcache>();
    sent_between_threads::<PmcacheHandle>();
};

/// Opens (formats if new, recovers if it holds this backing store's cache) the cache that
/// `config` describes, binds its control socket and starts its cleaner. Refused while the
/// cache is open elsewhere, in this process or another.
///
/// # Safety
///
/// As `config::read`.
unsafe fn open(config: *const PmcacheConfig) -> Result<Pmcache, Failure> {
    // SAFETY: this function's contract is `config::read`'s.
    let asked = unsafe { config::read(config) }?;
    let backing = asked.serve.cache.backing.clone();
    let created = match asked.create_backing {
        Some(bytes) => config::create_backing(&backing, bytes)?,
        None => false,
    };
    let announce: Arc<dyn Announce> = Arc::new(Silent);
    let lanes = asked.lanes + LANES_BESIDE_HANDLES;
    let mut serving = match Serving::open(&asked.serve, lanes, || Ok(()), &announce) {
        Ok(serving) => serving,
        Err(e) => {
            if created {
                let _ = std::fs::remove_file(&backing);
            }
            // The serving library's refusals carry no errno; EIO stands for all of them.
            return Err(Failure::new(libc::EIO, e));
        }
    };
    let shared = Arc::new(Shared {
        engine: serving.engine.clone(),
        latencies: serving.latencies.clone(),
        lanes: asked.lanes,
        open: AtomicUsize::new(0),
        opened: AtomicU64::new(0),
        stop_requested: AtomicBool::new(false),
    });
    if let Err(e) = serving.start_control(Embedder(shared.clone())) {
        let e = serving.finish(Err(e)).err().unwrap_or_default();
        return Err(Failure::new(libc::EIO, e));
    }
    serving.keep_control_socket();
    Ok(Pmcache { shared, serving })
}

/// Opens the cache that `config` describes: formats a new medium, or attaches (recovers) the
/// cache of this backing store on it, after a crash too; binds its control socket and starts
/// its cleaner. The cache is closed by `pmcache_close`.
///
/// Returns NULL if it cannot, with `errno` set (`EINVAL` for a config refused before anything
/// is opened, `EIO` for a cache that cannot be opened as asked) and the message in `err`
/// (when not NULL: at most `err_len` bytes, NUL-terminated) and in `pmcache_last_error()`. A
/// cache open elsewhere, in this process or another, is refused.
///
/// # Safety
///
/// `config` points to a `struct pmcache_config` of `config->size` bytes whose paths are NULL
/// or NUL-terminated strings; `err` is NULL or points to `err_len` writable bytes.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn pmcache_open(
    config: *const PmcacheConfig,
    err: *mut c_char,
    err_len: usize,
) -> *mut Pmcache {
    // SAFETY: `config` is as `open` needs it (this function's contract).
    guard(|| match unsafe { open(config) } {
        Ok(cache) => Box::into_raw(Box::new(cache)),
        Err(failure) => {
            // SAFETY: `err` is NULL or has `err_len` writable bytes (this function's contract).
            unsafe { report(&failure, err, err_len) };
            std::ptr::null_mut()
        }
    })
}

/// Closes `cache`: stops its cleaner; on a volatile medium (tmpfs), or after a `pmcache
/// detach` asked for it (`pmcache_stop_requested`), writes every dirty block back to the
/// backing store first (a detach also drops the cache's clean copies); marks the cache clean
/// and removes its control socket. This can take as long as the write-back does.
///
/// Returns 0, or a negative errno: `-EBUSY` while handles are open (nothing is done: close
/// them first); `-EIO` if the stop was not completed (a write-back failed, or the clean mark
/// or the state record could not be written), in which case the cache is closed all the same
/// and the message, in `pmcache_last_error()`, says what was left undone. Nothing
/// acknowledged is lost while the medium lasts: a cache not marked clean is recovered by the
/// next `pmcache_open`.
///
/// # Safety
///
/// `cache` is NULL or a cache from `pmcache_open` not closed yet. Once this returns anything
/// but `-EBUSY` it is freed: no call on it may be running or made afterwards.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn pmcache_close(cache: *mut Pmcache) -> c_int {
    guard(|| {
        status((|| {
            if cache.is_null() {
                return Err(Failure::invalid("pmcache_close: cache is NULL"));
            }
            // SAFETY: a cache from `pmcache_open`, not closed yet (this function's contract).
            let shared = unsafe { &(*cache).shared };
            if let Err(open) =
                shared.open.compare_exchange(0, CLOSING, Ordering::SeqCst, Ordering::SeqCst)
            {
                return Err(Failure::new(
                    libc::EBUSY,
                    format!(
                        "pmcache_close: {open} handles are still open; close them first \
                         (pmcache_handle_close)"
                    ),
                ));
            }
            // SAFETY: from `Box::into_raw` in `pmcache_open`; no handle is open and none
            // opens from here (`CLOSING`), and no other call runs on it (the contract), so
            // this is its only user.
            let Pmcache { shared, serving } = *unsafe { Box::from_raw(cache) };
            let finished = serving.finish(Ok(()));
            drop(shared);
            finished.map_err(|e| Failure::new(libc::EIO, format!("pmcache_close: {e}")))
        })())
    })
}

/// The cache behind `cache`, refused if NULL.
///
/// # Safety
///
/// `cache` is NULL or a cache from `pmcache_open` not closed yet.
unsafe fn cache_ref<'a>(cache: *const Pmcache, call: &str) -> Result<&'a Pmcache, Failure> {
    // SAFETY: NULL or a live cache (this function's contract); only shared references to it
    // are made until `pmcache_close`.
    unsafe { cache.as_ref() }.ok_or_else(|| Failure::invalid(format!("{call}: cache is NULL")))
}

/// The size of the device `cache` serves, in bytes (the backing store's size, a multiple of
/// the block size); 0 if `cache` is NULL.
///
/// # Safety
///
/// `cache` is NULL or a cache from `pmcache_open` not closed yet.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn pmcache_size_bytes(cache: *const Pmcache) -> u64 {
    guard(|| {
        // SAFETY: this function's contract is `cache_ref`'s.
        unsafe { cache_ref(cache, "pmcache_size_bytes") }.map_or(0, |c| c.engine().size_bytes())
    })
}

/// The block size of `cache` in bytes: every offset and length given to the I/O calls is a
/// multiple of it. 0 if `cache` is NULL.
///
/// # Safety
///
/// `cache` is NULL or a cache from `pmcache_open` not closed yet.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn pmcache_block_bytes(cache: *const Pmcache) -> u32 {
    guard(|| {
        // SAFETY: this function's contract is `cache_ref`'s.
        unsafe { cache_ref(cache, "pmcache_block_bytes") }.map_or(0, |c| c.engine().block_size())
    })
}

/// The counters of `cache` as one JSON object, the same that `pmcache stats --control PATH`
/// shows (`pmcache stats --all` names them all), with the handles' (`handles_open`,
/// `handles_opened`, `handles_max`). Free it with `pmcache_string_free`. NULL, with `errno`
/// `EINVAL`, if `cache` is NULL.
///
/// # Safety
///
/// `cache` is NULL or a cache from `pmcache_open` not closed yet.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn pmcache_stats_json(cache: *const Pmcache) -> *mut c_char {
    guard(|| {
        // SAFETY: this function's contract is `cache_ref`'s.
        let cache = match unsafe { cache_ref(cache, "pmcache_stats_json") } {
            Ok(cache) => cache,
            Err(failure) => {
                // SAFETY: no buffer is given.
                unsafe { report(&failure, std::ptr::null_mut(), 0) };
                return std::ptr::null_mut();
            }
        };
        let shared = &cache.shared;
        let embedder = Embedder(shared.clone());
        let stats =
            pmcache_serve::control::served_stats_json(&shared.engine, &shared.latencies, &embedder);
        // JSON escapes control characters: the text holds no NUL byte.
        CString::new(stats.to_string()).unwrap_or_default().into_raw()
    })
}

/// Frees a string returned by `pmcache_stats_json`. NULL is ignored.
///
/// # Safety
///
/// `text` is NULL or a string from `pmcache_stats_json`, not freed yet.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn pmcache_string_free(text: *mut c_char) {
    guard(|| {
        if !text.is_null() {
            // SAFETY: from `CString::into_raw` in `pmcache_stats_json`, not freed yet (this
            // function's contract).
            drop(unsafe { CString::from_raw(text) });
        }
    })
}

/// Whether the cache was asked to stop from outside the program: `pmcache detach` on its
/// control socket, which waits until the program closes its handles and calls
/// `pmcache_close` (the close then writes every block back, drops the cache's copies and marks
/// it clean). The handles go on working meanwhile. False if `cache` is NULL.
///
/// # Safety
///
/// `cache` is NULL or a cache from `pmcache_open` not closed yet.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn pmcache_stop_requested(cache: *const Pmcache) -> bool {
    guard(|| {
        // SAFETY: this function's contract is `cache_ref`'s.
        unsafe { cache_ref(cache, "pmcache_stop_requested") }
            .is_ok_and(|c| c.shared.stop_requested.load(Ordering::SeqCst))
    })
}

/// The message of the last call that failed on this thread (an empty string before any):
/// what happened, and where it can, what to do. It stays valid until the next call that fails
/// on this thread; a call that succeeds leaves it as it is.
#[unsafe(no_mangle)]
pub extern "C" fn pmcache_last_error() -> *const c_char {
    guard(error::last_error)
}

impl Pmcache {
    fn engine(&self) -> &CacheEngine {
        &self.shared.engine
    }
}

#[cfg(test)]
mod tests;

/// docs/EMBEDDING.md, whose Rust example runs as a doctest.
#[cfg(doctest)]
#[doc = include_str!("../../../docs/EMBEDDING.md")]
struct EmbeddingGuide;
