//! How a call fails: a negative errno returned (or NULL with `errno` set, from the calls that
//! return a pointer), and its message kept for `pmcache_last_error` on the calling thread. Also the
//! guard every `extern "C"` function runs its body in.

use std::cell::RefCell;
use std::ffi::{CString, c_char, c_int};

use pmcache_block::BlockError;

/// A call that failed: its errno and what happened.
#[derive(Debug)]
pub(crate) struct Failure {
    pub(crate) errno: c_int,
    pub(crate) message: String,
}

impl Failure {
    pub(crate) fn new(errno: c_int, message: impl Into<String>) -> Self {
        Self { errno, message: message.into() }
    }

    /// A request or argument the library refuses (`EINVAL`).
    pub(crate) fn invalid(message: impl Into<String>) -> Self {
        Self::new(libc::EINVAL, message)
    }
}

impl From<BlockError> for Failure {
    fn from(e: BlockError) -> Self {
        Self::new(e.errno(), e.to_string())
    }
}

thread_local! {
    /// The message of the last call that failed on this thread.
    static LAST_ERROR: RefCell<CString> = RefCell::new(CString::default());
}

/// Keeps `message` as this thread's last error.
pub(crate) fn set_last_error(message: &str) {
    // A message with a NUL byte in it (none is made so) is cut there.
    let text = message.split('\0').next().unwrap_or_default();
    let text = CString::new(text).unwrap_or_default();
    LAST_ERROR.with(|last| *last.borrow_mut() = text);
}

/// This thread's last error: valid until the next call that fails on this thread replaces it.
pub(crate) fn last_error() -> *const c_char {
    // The string stays in the thread-local cell, which outlives this borrow; the pointer is
    // valid until `set_last_error` replaces it on this thread.
    LAST_ERROR.with(|last| last.borrow().as_ptr())
}

/// 0 for a success; for a failure, its message kept as the thread's last error and its
/// negative errno.
pub(crate) fn status(result: Result<(), Failure>) -> c_int {
    match result {
        Ok(()) => 0,
        Err(failure) => {
            set_last_error(&failure.message);
            -failure.errno
        }
    }
}

/// For a call that returns NULL: keeps `failure` as the thread's last error, sets `errno` to
/// its errno, and copies its message into `err` (when not NULL and `err_len` is not 0), cut
/// to fit at a character boundary and NUL-terminated.
///
/// # Safety
///
/// `err` is NULL or points to `err_len` writable bytes.
pub(crate) unsafe fn report(failure: &Failure, err: *mut c_char, err_len: usize) {
    set_last_error(&failure.message);
    // SAFETY: `__errno_location` returns the calling thread's `errno`, valid for as long as
    // the thread runs; nothing else writes it during this store.
    unsafe { *libc::__errno_location() = failure.errno };
    if err.is_null() || err_len == 0 {
        return;
    }
    let message = failure.message.split('\0').next().unwrap_or_default();
    let mut len = message.len().min(err_len - 1);
    while !message.is_char_boundary(len) {
        len -= 1;
    }
    // SAFETY: the caller gives `err_len` writable bytes at `err`; `len + 1 <= err_len`, and
    // the message is a distinct allocation of at least `len` bytes, so the ranges do not
    // overlap.
    unsafe {
        std::ptr::copy_nonoverlapping(message.as_ptr(), err.cast::<u8>(), len);
        *err.add(len) = 0;
    }
}

/// Runs the body of an `extern "C"` function. A panic is a broken invariant: it aborts the
/// process here rather than unwind into the C caller (as a release build, `panic = "abort"`,
/// does where it happens), and the next `pmcache_open` recovers the cache from its medium as
/// after any crash.
pub(crate) fn guard<R>(body: impl FnOnce() -> R) -> R {
    match std::panic::catch_unwind(std::panic::AssertUnwindSafe(body)) {
        Ok(result) => result,
        // The panic hook has printed the panic's message and place.
        Err(_) => std::process::abort(),
    }
}
