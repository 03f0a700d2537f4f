//! An `IoBuf` gives its memory back when dropped: every request carries one, so a leak would
//! grow the process by a buffer per I/O. Counted with a global allocator that tracks the bytes
//! outstanding of the test's own thread (this file is its own test binary, and the test
//! harness's other threads allocate at moments of their own: they are not counted).

use std::alloc::{GlobalAlloc, Layout, System};
use std::cell::Cell;
use std::sync::atomic::{AtomicIsize, Ordering};

use pmcache_backing::IoBuf;

struct Counting;

static OUTSTANDING_BYTES: AtomicIsize = AtomicIsize::new(0);

thread_local! {
    /// Set on the test's thread: only its allocations are counted.
    static COUNTED: Cell<bool> = const { Cell::new(false) };
}

/// Adds `bytes` to the count if the calling thread is the counted one. The thread-local is
/// const-initialized without a destructor, so reading it never allocates.
fn count(bytes: isize) {
    if COUNTED.try_with(Cell::get).unwrap_or(false) {
        OUTSTANDING_BYTES.fetch_add(bytes, Ordering::SeqCst);
    }
}

// SAFETY: every call is forwarded unchanged to the system allocator; the counter only
// observes sizes.
unsafe impl GlobalAlloc for Counting {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        count(layout.size() as isize);
        // SAFETY: forwarded with the caller's layout, as `GlobalAlloc::alloc` requires.
        unsafe { System.alloc(layout) }
    }

    unsafe fn alloc_zeroed(&self, layout: Layout) -> *mut u8 {
        count(layout.size() as isize);
        // SAFETY: as in `alloc`.
        unsafe { System.alloc_zeroed(layout) }
    }

    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        count(-(layout.size() as isize));
        // SAFETY: `ptr` came from this allocator (hence from `System`) with `layout`.
        unsafe { System.dealloc(ptr, layout) }
    }
}

#[global_allocator]
static ALLOCATOR: Counting = Counting;

#[test]
fn dropped_buffers_give_their_memory_back() {
    COUNTED.with(|c| c.set(true));
    let before = OUTSTANDING_BYTES.load(Ordering::SeqCst);
    let held = IoBuf::new(1 << 20);
    let during = OUTSTANDING_BYTES.load(Ordering::SeqCst);
    assert!(during - before >= 1 << 20, "the buffer was not counted: {}", during - before);
    drop(held);
    for len in [0, 1, 4096, 4097, 1 << 20] {
        drop(IoBuf::new(len));
        drop(IoBuf::with_align(len, 512));
        drop(IoBuf::from_slice(&vec![7u8; len]));
    }
    let after = OUTSTANDING_BYTES.load(Ordering::SeqCst);
    assert_eq!(after, before, "bytes still allocated after every buffer was dropped");
}
