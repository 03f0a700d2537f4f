//! Poisoned lines: bytes a medium cannot return.
//!
//! A persistent-memory device that finds an uncorrectable error in a line *poisons* it: a load
//! of it raises a machine check, which Linux delivers to the reading thread as `SIGBUS`
//! (`BUS_MCEERR_AR`), and the kernel lists the bad range in the device's `badblocks`. A cache
//! must turn that into an error for the one block whose data is there, not die.
//!
//! [`Medium::read_checked`](crate::Medium::read_checked) is the read that may fail so. For a
//! mapped medium ([`crate::PmemFile`]) this module guards it: the reading thread records the
//! address range it is copying, and the mapping it lies in, in a thread-local word; a `SIGBUS`
//! handler that finds the faulting address inside that range records the *granule* around it
//! as poisoned, maps zeroed anonymous memory over it so that the interrupted copy can finish,
//! and returns. The read then sees the granule in the poisoned list and fails. A fault
//! anywhere else (an unguarded access, another mapping) is not this module's: the handler puts
//! back the action that was there before (the standard library's stack-overflow reporter, or
//! the default, which ends the process) and returns, so the access faults again into it.
//!
//! The granule is the smallest piece of the mapping that can be replaced: a page, or the
//! mapping's own page size where the kernel cannot split it finer — a device-dax mapping of
//! 2 MiB (or 1 GiB) alignment, a hugetlbfs file (see `PmemFile`). A replacement of one page
//! inside such a mapping is refused by the kernel; the fault would then end the process.
//!
//! The replaced granule no longer reaches the file: what was there is gone for this process
//! (the whole granule reads as zeroes, not only the poisoned line), and what is stored there
//! is lost. [`crate::Medium::poisoned_ranges`] lists the granules, and the engine keeps every
//! slot whose data, checksum or metadata entry lies in one out of use.

use std::cell::Cell;
use std::ops::Range;
use std::sync::Once;
use std::sync::atomic::{AtomicPtr, AtomicU64, AtomicUsize, Ordering, compiler_fence};

/// A read found a poisoned line: the medium cannot return the data there.
#[derive(Clone, Copy, Debug, PartialEq, Eq, thiserror::Error)]
#[error(
    "the cache medium cannot read byte {offset}: a poisoned line (an uncorrectable media error)"
)]
pub struct Poisoned {
    /// The medium offset of the first byte read that the medium cannot return.
    pub offset: u64,
}

/// Most poisoned granules remembered in one process: past it a new poisoned granule is not
/// recoverable (the fault ends the process, as it would without this module).
const GRANULES_MAX: usize = 4096;

/// Start addresses of the granules found poisoned (0: an unused entry). Written by the signal
/// handler (a compare-and-swap into an unused entry, its length stored first) and cleared when
/// their mapping goes away.
static POISONED_STARTS: [AtomicUsize; GRANULES_MAX] = [const { AtomicUsize::new(0) }; GRANULES_MAX];
/// The length of each granule of `POISONED_STARTS`, in bytes.
static POISONED_LENS: [AtomicUsize; GRANULES_MAX] = [const { AtomicUsize::new(0) }; GRANULES_MAX];
/// One more than the highest entry of `POISONED_STARTS` ever used: 0 while no granule was
/// found poisoned, so that a guarded read costs one load beside the copy.
static POISONED_USED: AtomicUsize = AtomicUsize::new(0);
/// Granules found poisoned in this process so far, counted before each is replaced
/// ([`crate::Medium::losses`]).
static LOSSES: AtomicU64 = AtomicU64::new(0);
/// The `SIGBUS` action that was installed before this module's: put back for faults that are
/// not a guarded read's.
static PREVIOUS_ACTION: AtomicPtr<libc::sigaction> = AtomicPtr::new(std::ptr::null_mut());
static INSTALL: Once = Once::new();

/// What a guarded read tells the signal handler: the source range it copies, the mapping
/// that range lies in, and the mapping's replacement granule.
#[derive(Clone, Copy)]
pub(crate) struct Guard {
    /// The first address copied, and how many bytes (0: no guarded read in progress).
    pub(crate) start: usize,
    pub(crate) len: usize,
    /// The mapping's first address and length: a replacement never reaches past them.
    pub(crate) map_start: usize,
    pub(crate) map_len: usize,
    /// The granule, a power of two (a page, or the mapping's page size).
    pub(crate) granule: usize,
}

const UNGUARDED: Guard = Guard { start: 0, len: 0, map_start: 0, map_len: 0, granule: 0 };

thread_local! {
    /// The guarded read this thread is doing. Constant initialised and without a destructor,
    /// so the signal handler reads it without any lazy initialisation.
    static GUARDED: Cell<Guard> = const { Cell::new(UNGUARDED) };
}

/// The system page size.
pub(crate) fn system_page_bytes() -> usize {
    // SAFETY: sysconf has no preconditions.
    let page = unsafe { libc::sysconf(libc::_SC_PAGESIZE) };
    if page > 0 { page as usize } else { 4096 }
}

/// Installs the `SIGBUS` handler once per process.
pub(crate) fn install_handler() {
    INSTALL.call_once(|| {
        // SAFETY: a zeroed `sigaction` is a valid value to fill; `sigemptyset` and `sigaction`
        // get valid pointers. The previous action is leaked so the handler may read it at any
        // time.
        unsafe {
            let mut action: libc::sigaction = std::mem::zeroed();
            action.sa_sigaction = on_sigbus as *const () as usize;
            action.sa_flags = libc::SA_SIGINFO | libc::SA_ONSTACK;
            libc::sigemptyset(&mut action.sa_mask);
            let previous: *mut libc::sigaction = Box::into_raw(Box::new(std::mem::zeroed()));
            if libc::sigaction(libc::SIGBUS, &action, previous) == 0 {
                PREVIOUS_ACTION.store(previous, Ordering::SeqCst);
            }
        }
    });
}

/// The part of the mapping `guard` describes that a fault at `address` replaces: the
/// granule-aligned granule around it, cut to the mapping.
pub(crate) fn replaced_range(guard: &Guard, address: usize) -> Range<usize> {
    let start = address & !(guard.granule - 1);
    let end = start.saturating_add(guard.granule);
    start.max(guard.map_start)..end.min(guard.map_start + guard.map_len)
}

/// The `SIGBUS` handler: recovers a guarded read's fault (see the module), passes any other on.
extern "C" fn on_sigbus(
    _signal: libc::c_int,
    info: *mut libc::siginfo_t,
    _context: *mut libc::c_void,
) {
    // SAFETY: the kernel passes a valid siginfo for a handler installed with SA_SIGINFO.
    let address = unsafe { (*info).si_addr() } as usize;
    let guard = GUARDED.with(Cell::get);
    if guard.len != 0 && (guard.start..guard.start + guard.len).contains(&address) {
        let replaced = replaced_range(&guard, address);
        if record(replaced.clone()) {
            // A thread storing into the granule after it is replaced must see it counted: the
            // count first, then a fence on every thread (the frequent side's fence, in a
            // process registered for it; elsewhere those threads fence themselves), then the
            // replacement. membarrier is a plain system call, safe in a signal handler.
            LOSSES.fetch_add(1, Ordering::SeqCst);
            let _ = crate::barrier::heavy_fence();
            // SAFETY: `replaced` lies inside the guarded mapping (the copy's source is inside
            // it, and the range is cut to it); replacing it with private zeroed memory changes
            // nothing else. mmap is a plain system call, safe in a signal handler on Linux.
            let mapped = unsafe {
                libc::mmap(
                    replaced.start as *mut libc::c_void,
                    replaced.end - replaced.start,
                    libc::PROT_READ | libc::PROT_WRITE,
                    libc::MAP_FIXED | libc::MAP_PRIVATE | libc::MAP_ANONYMOUS,
                    -1,
                    0,
                )
            };
            if mapped != libc::MAP_FAILED {
                return;
            }
            // The kernel refused to split the mapping there (a device-dax or hugetlbfs mapping
            // asked for less than its page size): the granule stays listed, and the fault ends
            // the process below.
        }
    }
    let previous = PREVIOUS_ACTION.load(Ordering::SeqCst);
    // SAFETY: `previous` is the action saved at install (or null: then the default). With it
    // back in place, returning re-runs the access, which faults into that action.
    unsafe {
        if previous.is_null() {
            libc::signal(libc::SIGBUS, libc::SIG_DFL);
        } else {
            libc::sigaction(libc::SIGBUS, previous, std::ptr::null_mut());
        }
    }
}

/// Granules found poisoned in this process so far ([`crate::Medium::losses`]).
pub(crate) fn losses() -> u64 {
    LOSSES.load(Ordering::SeqCst)
}

/// Adds `range` to the poisoned list (async-signal-safe: atomics only). False when the list is
/// full.
fn record(range: Range<usize>) -> bool {
    for (index, entry) in POISONED_STARTS.iter().enumerate() {
        let existing = entry.load(Ordering::SeqCst);
        if existing == range.start {
            return true;
        }
        if existing != 0 {
            continue;
        }
        POISONED_LENS[index].store(range.end - range.start, Ordering::SeqCst);
        match entry.compare_exchange(0, range.start, Ordering::SeqCst, Ordering::SeqCst) {
            Ok(_) => {
                POISONED_USED.fetch_max(index + 1, Ordering::SeqCst);
                return true;
            }
            Err(existing) if existing == range.start => return true,
            Err(_) => {}
        }
    }
    false
}

/// Copies `len` bytes from `src` to `dst` with `SIGBUS` recovery (see [`Guard`]: `guard`
/// names the mapping `src` lies in and its granule; its `start` and `len` are set here), and
/// returns the address of the first poisoned byte of the first granule in the poisoned list
/// that the source overlaps (found now or before), if any.
///
/// # Safety
/// `src` must be valid for reads of `len` bytes inside the shared file mapping `guard` names,
/// `dst` valid for writes of `len` bytes, and the two must not overlap.
pub(crate) unsafe fn guarded_copy(
    src: *const u8,
    dst: *mut u8,
    len: usize,
    guard: Guard,
) -> Option<usize> {
    GUARDED.with(|g| g.set(Guard { start: src as usize, len, ..guard }));
    compiler_fence(Ordering::SeqCst);
    // SAFETY: the caller's contract.
    unsafe { std::ptr::copy_nonoverlapping(src, dst, len) };
    compiler_fence(Ordering::SeqCst);
    GUARDED.with(|g| g.set(UNGUARDED));
    if POISONED_USED.load(Ordering::Acquire) == 0 {
        return None;
    }
    poisoned_in(src as usize..src as usize + len)
        .next()
        .map(|granule| granule.start.max(src as usize))
}

/// The poisoned granules overlapping `range` of addresses, in list order.
pub(crate) fn poisoned_in(range: Range<usize>) -> impl Iterator<Item = Range<usize>> {
    let used = POISONED_USED.load(Ordering::Acquire);
    (0..used)
        .filter_map(|index| {
            let start = POISONED_STARTS[index].load(Ordering::Acquire);
            let len = POISONED_LENS[index].load(Ordering::Acquire);
            (start != 0).then_some(start..start + len)
        })
        .filter(move |granule| granule.start < range.end && granule.end > range.start)
}

/// Forgets the poisoned granules of `range` (a mapping going away: its addresses may be
/// reused).
pub(crate) fn forget(range: Range<usize>) {
    for entry in &POISONED_STARTS[..POISONED_USED.load(Ordering::Acquire)] {
        let start = entry.load(Ordering::Acquire);
        if start != 0 && range.contains(&start) {
            let _ = entry.compare_exchange(start, 0, Ordering::SeqCst, Ordering::SeqCst);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A fault replaces its granule, aligned, and never anything outside the mapping.
    #[test]
    fn a_replacement_is_the_granule_around_the_fault_cut_to_the_mapping() {
        const MIB: usize = 1 << 20;
        let guard = |map_start, map_len, granule| Guard {
            start: map_start,
            len: map_len,
            map_start,
            map_len,
            granule,
        };
        // A page in a page-aligned mapping.
        let page = guard(0x7f00_0000_0000, 16 * MIB, 4096);
        assert_eq!(replaced_range(&page, 0x7f00_0000_1234), 0x7f00_0000_1000..0x7f00_0000_2000);
        // A 2 MiB granule in a 2 MiB-aligned mapping (device-dax): the whole aligned 2 MiB.
        let dax = guard(0x7f00_0000_0000, 16 * MIB, 2 * MIB);
        assert_eq!(
            replaced_range(&dax, 0x7f00_0000_0000 + 3 * MIB + 5),
            0x7f00_0000_0000 + 2 * MIB..0x7f00_0000_0000 + 4 * MIB
        );
        // A mapping that does not start or end on the granule: cut to it at both ends.
        let start = 0x7f00_0010_0000; // 1 MiB into a 2 MiB granule
        let unaligned = guard(start, 2 * MIB, 2 * MIB);
        assert_eq!(replaced_range(&unaligned, start + 10), start..start + MIB);
        assert_eq!(replaced_range(&unaligned, start + MIB + 10), start + MIB..start + 2 * MIB);
    }
}
