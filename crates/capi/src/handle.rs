//! `struct pmcache_handle`: one engine lane, through `pmcache_frontend::CacheConn` (the
//! adapter NBD connections and ublk queues run, so the handles' reads count in `stats` as
//! theirs do), and the I/O calls on it, each request checked here as a frontend checks its
//! own (`pmcache_block::BlockConn` takes only requests that are non-empty, in range and
//! aligned to the block size).
//!
//! A lane borrows its engine (`Lane<'e, ..>`). A handle keeps its lane with that borrow
//! erased (`'static`) beside an `Arc` of the cache's shared state, which holds the engine: the
//! handle owns what its lane borrows, and drops the lane first.

use std::ffi::{c_char, c_int, c_void};
use std::sync::Arc;
use std::sync::atomic::Ordering;

use pmcache_block::{BatchRead, BlockConn, Started};
use pmcache_frontend::{CacheConn, CacheEngine};

use crate::error::{Failure, guard, report, status};
use crate::{CLOSING, Pmcache, Shared, cache_ref};

/// Flag of `pmcache_write`, `pmcache_trim` and `pmcache_write_zeroes`: durable when the call
/// returns, in every mode. In write-back and write-only a write always is (on the cache
/// medium); in the other modes the backing store is synced before the call returns.
pub const PMCACHE_FUA: u32 = 1;

/// A handle on a cache, opaque to C: one engine lane, for one thread at a time; from
/// `pmcache_handle_open`, until `pmcache_handle_close`.
pub struct PmcacheHandle {
    /// The lane, its borrow of `shared.engine` erased. Declared before `shared`, so dropped
    /// before it: the engine outlives the lane.
    conn: CacheConn<'static>,
    /// How each read started, kept from read to read.
    started: Vec<Started>,
    block_bytes: u64,
    size_bytes: u64,
    /// The cache's shared state: keeps the engine the lane borrows.
    shared: Arc<Shared>,
}

/// Opens a handle on `cache`.
fn open(cache: &Pmcache) -> Result<PmcacheHandle, Failure> {
    let shared = &cache.shared;
    shared
        .open
        .fetch_update(Ordering::SeqCst, Ordering::SeqCst, |open| {
            (open < shared.lanes).then_some(open + 1)
        })
        .map_err(|open| match open {
            CLOSING => Failure::new(libc::ESHUTDOWN, "pmcache_handle_open: the cache is closing"),
            _ => Failure::new(
                libc::EBUSY,
                format!(
                    "pmcache_handle_open: all {} handles are open (struct pmcache_config's \
                     lanes)",
                    shared.lanes
                ),
            ),
        })?;
    // SAFETY: the engine is in an `Arc` that `shared` holds and never replaces; the handle
    // made here keeps a clone of `shared` (its last field, dropped after `conn`), so the
    // engine outlives the lane that borrows it through this reference, and the reference
    // reaches nothing else. The engine is `Sync`: lanes on other threads borrow it at once.
    let engine: &'static CacheEngine = unsafe { &*Arc::as_ptr(&shared.engine) };
    let lane = match engine.lane() {
        Ok(lane) => lane,
        Err(e) => {
            shared.open.fetch_sub(1, Ordering::SeqCst);
            return Err(Failure::new(e.errno(), format!("pmcache_handle_open: {e}")));
        }
    };
    shared.opened.fetch_add(1, Ordering::SeqCst);
    Ok(PmcacheHandle {
        conn: CacheConn::new(lane, shared.latencies.clone()),
        started: Vec::with_capacity(1),
        block_bytes: u64::from(engine.block_size()),
        size_bytes: engine.size_bytes(),
        shared: shared.clone(),
    })
}

/// Opens a handle on `cache`: an engine lane of its own, for one thread at a time (it may
/// move to another thread between calls). Each thread doing I/O opens its own; at most
/// `lanes` (`struct pmcache_config`) are open at once.
///
/// Returns NULL if it cannot, with `errno` set (`EBUSY`: all `lanes` handles are open) and the
/// message in `err` (when not NULL: at most `err_len` bytes, NUL-terminated) and in
/// `pmcache_last_error()`.
///
/// # Safety
///
/// `cache` is NULL or a cache from `pmcache_open` not closed yet; `err` is NULL or points to
/// `err_len` writable bytes.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn pmcache_handle_open(
    cache: *mut Pmcache,
    err: *mut c_char,
    err_len: usize,
) -> *mut PmcacheHandle {
    guard(|| {
        // SAFETY: NULL or a live cache (this function's contract).
        let opened = unsafe { cache_ref(cache, "pmcache_handle_open") }.and_then(open);
        match opened {
            Ok(handle) => Box::into_raw(Box::new(handle)),
            Err(failure) => {
                // SAFETY: `err` is NULL or has `err_len` writable bytes (the contract).
                unsafe { report(&failure, err, err_len) };
                std::ptr::null_mut()
            }
        }
    })
}

/// Closes `handle`, giving its lane back. Returns 0, or `-EINVAL` if `handle` is NULL.
///
/// # Safety
///
/// `handle` is NULL or a handle from `pmcache_handle_open` not closed yet, with no call on it
/// running; it is freed.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn pmcache_handle_close(handle: *mut PmcacheHandle) -> c_int {
    guard(|| {
        if handle.is_null() {
            return status(Err(Failure::invalid("pmcache_handle_close: handle is NULL")));
        }
        // SAFETY: from `Box::into_raw` in `pmcache_handle_open`, not closed yet, and not in
        // use (the contract): this is its only user.
        let PmcacheHandle { conn, shared, .. } = *unsafe { Box::from_raw(handle) };
        // The lane goes back before the handle stops counting: once `pmcache_close` sees no
        // handle open, every lane of theirs is closed.
        drop(conn);
        shared.open.fetch_sub(1, Ordering::SeqCst);
        0
    })
}

/// The handle behind `handle`, refused if NULL.
///
/// # Safety
///
/// `handle` is NULL or a handle from `pmcache_handle_open` not closed yet, used by no other
/// call meanwhile.
unsafe fn handle_mut<'a>(
    handle: *mut PmcacheHandle,
    call: &str,
) -> Result<&'a mut PmcacheHandle, Failure> {
    // SAFETY: NULL or a live handle no other call uses (this function's contract).
    unsafe { handle.as_mut() }.ok_or_else(|| Failure::invalid(format!("{call}: handle is NULL")))
}

impl PmcacheHandle {
    /// Refuses a request that is empty, not aligned to the block size, or past the end of the
    /// device.
    fn check(&self, call: &str, offset: u64, len: u64) -> Result<(), Failure> {
        let block = self.block_bytes;
        if len == 0 {
            return Err(Failure::invalid(format!("{call}: a request of 0 bytes at byte {offset}")));
        }
        if !offset.is_multiple_of(block) || !len.is_multiple_of(block) {
            return Err(Failure::invalid(format!(
                "{call}: {len} bytes at byte {offset}: the offset and the length must be \
                 multiples of the block size ({block} bytes)"
            )));
        }
        if offset.checked_add(len).is_none_or(|end| end > self.size_bytes) {
            return Err(Failure::invalid(format!(
                "{call}: {len} bytes at byte {offset} reach past the end of the device ({} \
                 bytes)",
                self.size_bytes
            )));
        }
        Ok(())
    }

    /// Reads through the lane's batch interface, one read long: a hit is answered at once, a
    /// miss when its backing read completes, and each class's latency counts in `stats` as
    /// an NBD connection's do.
    fn read(&mut self, offset: u64, buf: &mut [u8]) -> Result<(), Failure> {
        self.started.clear();
        let mut reads = [BatchRead { offset_bytes: offset, buf: &mut *buf }];
        self.conn.read_batch_start(&mut reads, &mut self.started);
        match self.started.pop() {
            Some(Started::Done(result)) => result.map_err(Failure::from),
            Some(Started::Pending(_)) => {
                let mut outcome = Err(Failure::new(libc::EIO, "the read was not completed"));
                self.conn.complete(1, &mut |_, result| {
                    outcome = result.map(|data| buf.copy_from_slice(data)).map_err(Failure::from);
                });
                outcome
            }
            None => Err(Failure::new(libc::EIO, "the read was not started")),
        }
    }
}

/// Refuses flags other than `PMCACHE_FUA`; returns whether it is set.
fn fua(call: &str, flags: u32) -> Result<bool, Failure> {
    if flags & !PMCACHE_FUA != 0 {
        return Err(Failure::invalid(format!(
            "{call}: unknown flags {:#x} (only PMCACHE_FUA is defined)",
            flags & !PMCACHE_FUA
        )));
    }
    Ok(flags & PMCACHE_FUA != 0)
}

/// Refuses a NULL buffer or one longer than a Rust slice may be.
fn check_buffer(call: &str, buf: *const c_void, len: usize) -> Result<(), Failure> {
    if buf.is_null() {
        return Err(Failure::invalid(format!("{call}: buf is NULL")));
    }
    if len > isize::MAX as usize {
        return Err(Failure::invalid(format!("{call}: {len} bytes is too long a buffer")));
    }
    Ok(())
}

/// Reads `len` bytes at byte `offset` of the device into `buf`: from the cache, or on a miss
/// from the backing store (and caches them, as the mode and admission policy say).
///
/// Returns 0, or a negative errno with the message in `pmcache_last_error()`: `-EINVAL` for a
/// request that is empty, not aligned to the block size (`pmcache_block_bytes`) or past the
/// end of the device, `-EIO` (or the backing store's errno) for one that failed.
///
/// # Safety
///
/// `handle` is a handle from `pmcache_handle_open`, not closed, and used by no other call
/// meanwhile; `buf` points to `len` writable bytes that nothing else reads or writes during
/// the call.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn pmcache_read(
    handle: *mut PmcacheHandle,
    offset: u64,
    buf: *mut c_void,
    len: usize,
) -> c_int {
    const CALL: &str = "pmcache_read";
    guard(|| {
        status((|| {
            // SAFETY: a live handle no other call uses (this function's contract).
            let handle = unsafe { handle_mut(handle, CALL) }?;
            handle.check(CALL, offset, len as u64)?;
            check_buffer(CALL, buf, len)?;
            // SAFETY: `buf` is not NULL and points to `len <= isize::MAX` writable bytes that
            // nothing else touches during the call (the contract).
            let buf = unsafe { std::slice::from_raw_parts_mut(buf.cast::<u8>(), len) };
            handle.read(offset, buf)
        })())
    })
}

/// Writes the `len` bytes at `buf` at byte `offset` of the device, as the cache's mode says:
/// in write-back (and write-only) into the cache, durable on the medium when this returns 0;
/// in write-through, write-around and pass-through to the backing store too. `flags` is 0 or
/// `PMCACHE_FUA`.
///
/// Returns 0, or a negative errno with the message in `pmcache_last_error()`: `-EINVAL` for a
/// request that is empty, not aligned to the block size or past the end of the device, or
/// unknown flags; `-EIO` (or the backing store's errno) for one that failed.
///
/// # Safety
///
/// `handle` is a handle from `pmcache_handle_open`, not closed, and used by no other call
/// meanwhile; `buf` points to `len` readable bytes that nothing writes during the call.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn pmcache_write(
    handle: *mut PmcacheHandle,
    offset: u64,
    buf: *const c_void,
    len: usize,
    flags: u32,
) -> c_int {
    const CALL: &str = "pmcache_write";
    guard(|| {
        status((|| {
            // SAFETY: a live handle no other call uses (this function's contract).
            let handle = unsafe { handle_mut(handle, CALL) }?;
            let fua = fua(CALL, flags)?;
            handle.check(CALL, offset, len as u64)?;
            check_buffer(CALL, buf, len)?;
            // SAFETY: `buf` is not NULL and points to `len <= isize::MAX` readable bytes that
            // nothing writes during the call (the contract).
            let data = unsafe { std::slice::from_raw_parts(buf.cast::<u8>(), len) };
            handle.conn.write(offset, data, fua).map_err(Failure::from)
        })())
    })
}

/// Makes every write that returned before this call durable. In write-back and write-only a
/// write is durable on the cache medium when it returns; what reached the backing store
/// (write-through, write-around and pass-through writes, blocks the cleaner wrote back) is
/// synced there. A flush does not write dirty blocks back.
///
/// Returns 0, or a negative errno with the message in `pmcache_last_error()`.
///
/// # Safety
///
/// `handle` is a handle from `pmcache_handle_open`, not closed, and used by no other call
/// meanwhile.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn pmcache_flush(handle: *mut PmcacheHandle) -> c_int {
    guard(|| {
        status((|| {
            // SAFETY: a live handle no other call uses (this function's contract).
            let handle = unsafe { handle_mut(handle, "pmcache_flush") }?;
            handle.conn.flush().map_err(Failure::from)
        })())
    })
}

/// Discards `len` bytes at byte `offset` of the device: the cache drops its copies and the
/// backing store is told to discard them; they read as unspecified data until written again.
/// `flags` is 0 or `PMCACHE_FUA`.
///
/// Returns 0, or a negative errno with the message in `pmcache_last_error()` (`-EINVAL` as for
/// `pmcache_write`).
///
/// # Safety
///
/// `handle` is a handle from `pmcache_handle_open`, not closed, and used by no other call
/// meanwhile.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn pmcache_trim(
    handle: *mut PmcacheHandle,
    offset: u64,
    len: u64,
    flags: u32,
) -> c_int {
    const CALL: &str = "pmcache_trim";
    guard(|| {
        status((|| {
            // SAFETY: a live handle no other call uses (this function's contract).
            let handle = unsafe { handle_mut(handle, CALL) }?;
            let fua = fua(CALL, flags)?;
            handle.check(CALL, offset, len)?;
            handle.conn.trim(offset, len, fua).map_err(Failure::from)
        })())
    })
}

/// Makes `len` bytes at byte `offset` of the device read as zeroes, as a write of zeroes
/// would (a large range is zeroed on the backing store rather than written into the cache).
/// `flags` is 0 or `PMCACHE_FUA`.
///
/// Returns 0, or a negative errno with the message in `pmcache_last_error()` (`-EINVAL` as for
/// `pmcache_write`).
///
/// # Safety
///
/// `handle` is a handle from `pmcache_handle_open`, not closed, and used by no other call
/// meanwhile.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn pmcache_write_zeroes(
    handle: *mut PmcacheHandle,
    offset: u64,
    len: u64,
    flags: u32,
) -> c_int {
    const CALL: &str = "pmcache_write_zeroes";
    guard(|| {
        status((|| {
            // SAFETY: a live handle no other call uses (this function's contract).
            let handle = unsafe { handle_mut(handle, CALL) }?;
            let fua = fua(CALL, flags)?;
            handle.check(CALL, offset, len)?;
            handle.conn.write_zeroes(offset, len, fua, false).map_err(Failure::from)
        })())
    })
}
