//! Asymmetric fences: a fence a rare thread pays for on every thread of the process, so that
//! frequent threads pair with it through a compiler fence alone. The heavy side is Linux's
//! `membarrier(MEMBARRIER_CMD_PRIVATE_EXPEDITED)`: when it returns, every thread of the
//! process that was running has executed a full memory barrier, and every other one will
//! before it runs again.

/// `MEMBARRIER_CMD_PRIVATE_EXPEDITED` (linux/membarrier.h).
const PRIVATE_EXPEDITED: libc::c_int = 1 << 3;
/// `MEMBARRIER_CMD_REGISTER_PRIVATE_EXPEDITED`.
const REGISTER_PRIVATE_EXPEDITED: libc::c_int = 1 << 4;

/// Registers the process for [`heavy_fence`]; false where the kernel offers no expedited
/// membarrier (the caller then fences on the frequent side too).
pub fn register_heavy_fence() -> bool {
    // SAFETY: membarrier takes two integers and touches no memory of the caller.
    unsafe { libc::syscall(libc::SYS_membarrier, REGISTER_PRIVATE_EXPEDITED, 0, 0) == 0 }
}

/// A full memory barrier on every running thread of the process (see the module); false if
/// it failed (the process is not registered: see [`register_heavy_fence`]).
pub fn heavy_fence() -> bool {
    // SAFETY: as in `register_heavy_fence`.
    unsafe { libc::syscall(libc::SYS_membarrier, PRIVATE_EXPEDITED, 0, 0) == 0 }
}

#[cfg(test)]
mod tests {
    #[test]
    fn a_registered_process_can_fence_every_thread() {
        if super::register_heavy_fence() {
            assert!(super::heavy_fence());
        }
    }
}
