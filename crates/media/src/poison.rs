//! Poisoned lines: bytes a medium cannot return.
//!
//! A persistent-memory device that finds an uncorrectable error in a line *poisons* it: a load
//! of it raises a machine check, which Linux delivers to the reading thread as `SIGBUS`
//! (`BUS_MCEERR_AR`), and the kernel lists the bad range in the device's `badblocks`. A cache
//! must turn that into an error for the one block whose data is there, not die.
//!
//! [`Medium::read_checked`](crate::Medium::read_checked) is the read that may fail so. For a
//! mapped medium ([`crate::PmemFile`]) this module guards it: the reading thread records the
//! address range it is copying in a thread-local word; a `SIGBUS` handler that finds the
//! faulting address inside that range records the page as poisoned, maps a zeroed anonymous
//! page over it so that the interrupted copy can finish, and returns. The read then sees the
//! page in the poisoned list and fails. A fault anywhere else (an unguarded access, another
//! mapping) is not this module's: the handler puts back the action that was there before (the
//! standard library's stack-overflow reporter, or the default, which ends the process) and
//! returns, so the access faults again into it.
//!
//! The replaced page no longer reaches the file: what is stored there is lost. The engine
//! therefore never places data in a poisoned page again ([`crate::Medium::poisoned_ranges`]).

use std::cell::Cell;
use std::ops::Range;
use std::sync::Once;
use std::sync::atomic::{AtomicPtr, AtomicUsize, Ordering, compiler_fence};

/// A read found a poisoned line: the medium cannot return the data there.
#[derive(Clone, Copy, Debug, PartialEq, Eq, thiserror::Error)]
#[error(
    "the cache medium cannot read byte {offset}: a poisoned line (an uncorrectable media error)"
)]
pub struct Poisoned {
    /// The medium offset of the first byte read that the medium cannot return.
    pub offset: u64,
}

/// Most poisoned pages remembered in one process: past it a new poisoned page is not
/// recoverable (the fault ends the process, as it would without this module).
const PAGES_MAX: usize = 4096;

/// Addresses of the pages found poisoned (0: an unused entry). Written by the signal handler
/// (a compare-and-swap into an unused entry) and cleared when their mapping goes away.
static POISONED_PAGES: [AtomicUsize; PAGES_MAX] = [const { AtomicUsize::new(0) }; PAGES_MAX];
/// One more than the highest entry of `POISONED_PAGES` ever used: 0 while no page was found
/// poisoned, so that a guarded read costs one load beside the copy.
static POISONED_USED: AtomicUsize = AtomicUsize::new(0);
/// The page size, set when the handler is installed.
static PAGE_BYTES: AtomicUsize = AtomicUsize::new(4096);
/// The `SIGBUS` action that was installed before this module's: put back for faults that are
/// not a guarded read's.
static PREVIOUS_ACTION: AtomicPtr<libc::sigaction> = AtomicPtr::new(std::ptr::null_mut());
static INSTALL: Once = Once::new();

thread_local! {
    /// The address range this thread is copying in a guarded read (`(0, 0)`: none). Constant
    /// initialised and without a destructor, so the signal handler reads it without any lazy
    /// initialisation.
    static GUARDED: Cell<(usize, usize)> = const { Cell::new((0, 0)) };
}

/// Installs the `SIGBUS` handler once per process.
pub(crate) fn install_handler() {
    INSTALL.call_once(|| {
        // SAFETY: sysconf has no preconditions.
        let page = unsafe { libc::sysconf(libc::_SC_PAGESIZE) };
        if page > 0 {
            PAGE_BYTES.store(page as usize, Ordering::SeqCst);
        }
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

/// The `SIGBUS` handler: recovers a guarded read's fault (see the module), passes any other on.
extern "C" fn on_sigbus(
    _signal: libc::c_int,
    info: *mut libc::siginfo_t,
    _context: *mut libc::c_void,
) {
    // SAFETY: the kernel passes a valid siginfo for a handler installed with SA_SIGINFO.
    let address = unsafe { (*info).si_addr() } as usize;
    let (start, len) = GUARDED.with(Cell::get);
    if len != 0 && (start..start + len).contains(&address) {
        let page = address & !(PAGE_BYTES.load(Ordering::Relaxed) - 1);
        if record(page) {
            // SAFETY: `page` is a page of the guarded mapping (the copy's source is inside
            // it); replacing it with a private zeroed page changes nothing else. mmap is a
            // plain system call, safe in a signal handler on Linux.
            let mapped = unsafe {
                libc::mmap(
                    page as *mut libc::c_void,
                    PAGE_BYTES.load(Ordering::Relaxed),
                    libc::PROT_READ | libc::PROT_WRITE,
                    libc::MAP_FIXED | libc::MAP_PRIVATE | libc::MAP_ANONYMOUS,
                    -1,
                    0,
                )
            };
            if mapped != libc::MAP_FAILED {
                return;
            }
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

/// Adds `page` to the poisoned list (async-signal-safe: atomics only). False when the list is
/// full.
fn record(page: usize) -> bool {
    for (index, entry) in POISONED_PAGES.iter().enumerate() {
        match entry.compare_exchange(0, page, Ordering::SeqCst, Ordering::SeqCst) {
            Ok(_) => {
                POISONED_USED.fetch_max(index + 1, Ordering::SeqCst);
                return true;
            }
            Err(existing) if existing == page => return true,
            Err(_) => {}
        }
    }
    false
}

/// Copies `len` bytes from `src` to `dst` with `SIGBUS` recovery, and returns the address of
/// the first poisoned page the source overlaps (found now or before), if any.
///
/// # Safety
/// `src` must be valid for reads of `len` bytes inside a shared file mapping, `dst` valid
/// for writes of `len` bytes, and the two must not overlap.
pub(crate) unsafe fn guarded_copy(src: *const u8, dst: *mut u8, len: usize) -> Option<usize> {
    GUARDED.with(|g| g.set((src as usize, len)));
    compiler_fence(Ordering::SeqCst);
    // SAFETY: the caller's contract.
    unsafe { std::ptr::copy_nonoverlapping(src, dst, len) };
    compiler_fence(Ordering::SeqCst);
    GUARDED.with(|g| g.set((0, 0)));
    if POISONED_USED.load(Ordering::Acquire) == 0 {
        return None;
    }
    poisoned_in(src as usize..src as usize + len).next().map(|page| page.max(src as usize))
}

/// The poisoned pages overlapping `range` of addresses, in list order.
pub(crate) fn poisoned_in(range: Range<usize>) -> impl Iterator<Item = usize> {
    let page_bytes = PAGE_BYTES.load(Ordering::Relaxed);
    let used = POISONED_USED.load(Ordering::Acquire);
    POISONED_PAGES[..used]
        .iter()
        .map(|entry| entry.load(Ordering::Acquire))
        .filter(move |&page| page != 0 && page < range.end && page + page_bytes > range.start)
}

/// Forgets the poisoned pages of `range` (a mapping going away: its addresses may be reused).
pub(crate) fn forget(range: Range<usize>) {
    for entry in &POISONED_PAGES[..POISONED_USED.load(Ordering::Acquire)] {
        let page = entry.load(Ordering::Acquire);
        if page != 0 && range.contains(&page) {
            let _ = entry.compare_exchange(page, 0, Ordering::SeqCst, Ordering::SeqCst);
        }
    }
}

/// The page size the handler works in.
pub(crate) fn page_bytes() -> usize {
    PAGE_BYTES.load(Ordering::Relaxed)
}
