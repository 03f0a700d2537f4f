//! Aligned, owned I/O buffers.
//!
//! An [`IoBuf`] is what a queued request carries: the engine owns it from `push` until the
//! completion hands it back, so the kernel can DMA into it while the caller does other work.
//! Its memory is aligned (4096 bytes by default), which satisfies `O_DIRECT` on every device
//! pmcache targets, so queued requests never need a bounce buffer.

use std::alloc::{self, Layout};
use std::fmt;
use std::ops::{Deref, DerefMut};
use std::ptr::NonNull;

/// The alignment of buffers made by [`IoBuf::new`], in bytes.
pub const IO_BUF_ALIGN_BYTES: usize = 4096;

/// A heap buffer with a fixed capacity and alignment, zeroed at allocation.
pub struct IoBuf {
    ptr: NonNull<u8>,
    len: usize,
    layout: Layout,
}

// SAFETY: `IoBuf` owns its allocation exclusively (like `Vec<u8>`); nothing aliases the pointer.
unsafe impl Send for IoBuf {}
// SAFETY: shared references only give out `&[u8]`, which is `Sync`.
unsafe impl Sync for IoBuf {}

impl IoBuf {
    /// A zeroed buffer of `len` bytes aligned to [`IO_BUF_ALIGN_BYTES`].
    pub fn new(len: usize) -> Self {
        Self::with_align(len, IO_BUF_ALIGN_BYTES)
    }

    /// A zeroed buffer of `len` bytes aligned to `align` (a power of two).
    pub fn with_align(len: usize, align: usize) -> Self {
        assert!(align.is_power_of_two(), "alignment {align} is not a power of two");
        // Capacity is rounded up to the alignment (and is never zero, which `alloc` forbids).
        let capacity = len
            .max(1)
            .checked_next_multiple_of(align)
            .unwrap_or_else(|| panic!("an I/O buffer of {len} bytes overflows the address space"));
        let layout = Layout::from_size_align(capacity, align).expect("I/O buffer layout overflows");
        // SAFETY: `layout` has a non-zero size (`capacity` is at least 1, without overflow).
        let raw = unsafe { alloc::alloc_zeroed(layout) };
        let Some(ptr) = NonNull::new(raw) else { alloc::handle_alloc_error(layout) };
        Self { ptr, len, layout }
    }

    /// A buffer holding a copy of `data`.
    pub fn from_slice(data: &[u8]) -> Self {
        let mut buf = Self::new(data.len());
        buf.copy_from_slice(data);
        buf
    }

    /// Bytes in use (what a request reads or writes).
    pub fn len(&self) -> usize {
        self.len
    }

    /// Whether the buffer holds no bytes.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// Bytes allocated.
    pub fn capacity(&self) -> usize {
        self.layout.size()
    }

    /// Alignment of the allocation in bytes.
    pub fn align(&self) -> usize {
        self.layout.align()
    }

    /// Changes the bytes in use; newly exposed bytes keep their old contents (zero at first).
    pub fn set_len(&mut self, len: usize) {
        assert!(len <= self.capacity(), "IoBuf length {len} > capacity {}", self.capacity());
        self.len = len;
    }
}

impl Deref for IoBuf {
    type Target = [u8];
    fn deref(&self) -> &[u8] {
        // SAFETY: `ptr` is valid for `capacity >= len` initialised (zeroed) bytes and owned by us.
        unsafe { std::slice::from_raw_parts(self.ptr.as_ptr(), self.len) }
    }
}

impl DerefMut for IoBuf {
    fn deref_mut(&mut self) -> &mut [u8] {
        // SAFETY: as in `deref`, and `&mut self` guarantees exclusive access.
        unsafe { std::slice::from_raw_parts_mut(self.ptr.as_ptr(), self.len) }
    }
}

impl Drop for IoBuf {
    fn drop(&mut self) {
        // SAFETY: `ptr` was allocated with exactly `layout` and is freed once.
        unsafe { alloc::dealloc(self.ptr.as_ptr(), self.layout) }
    }
}

impl fmt::Debug for IoBuf {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("IoBuf")
            .field("len", &self.len)
            .field("capacity", &self.capacity())
            .field("align", &self.align())
            .finish()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn aligned_zeroed_and_resizable() {
        let mut buf = IoBuf::new(100);
        assert_eq!(buf.as_ptr() as usize % IO_BUF_ALIGN_BYTES, 0);
        assert_eq!(buf.capacity(), 4096);
        assert!(buf.iter().all(|&b| b == 0));
        buf[99] = 7;
        buf.set_len(4096);
        assert_eq!(buf[99], 7);
        assert_eq!(IoBuf::new(0).capacity(), 4096);
        assert_eq!(&IoBuf::from_slice(b"abc")[..], b"abc");
    }

    /// Length, capacity and alignment are kept apart: shrinking and growing the length moves
    /// neither, and the debug form shows all three.
    #[test]
    fn length_capacity_and_alignment_are_reported() {
        let mut buf = IoBuf::with_align(5000, 512);
        assert_eq!((buf.len(), buf.capacity(), buf.align()), (5000, 5120, 512));
        assert_eq!(buf.as_ptr() as usize % 512, 0);
        assert!(!buf.is_empty());
        buf.set_len(0);
        assert!(buf.is_empty());
        assert_eq!(buf.len(), 0);
        assert!(buf[..].is_empty());
        buf.set_len(5120);
        assert_eq!(buf.len(), 5120);
        assert_eq!(format!("{buf:?}"), "IoBuf { len: 5120, capacity: 5120, align: 512 }");
        assert_eq!(IoBuf::new(1).align(), IO_BUF_ALIGN_BYTES);
    }

    #[test]
    #[should_panic(expected = "IoBuf length 4097 > capacity 4096")]
    fn a_length_past_the_capacity_is_refused() {
        IoBuf::new(10).set_len(4097);
    }

    /// A length whose rounding up to the alignment overflows is refused before anything is
    /// allocated (it wrapped to a zero-sized allocation before).
    #[test]
    #[should_panic(expected = "overflows the address space")]
    fn a_length_that_overflows_when_aligned_is_refused() {
        IoBuf::new(usize::MAX - 100);
    }
}
