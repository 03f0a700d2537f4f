//! DRAM tables for the engine's volatile metadata (index buckets, slot words), in anonymous
//! mappings advised for transparent huge pages.
//!
//! The engine's read hit makes two dependent random accesses into these tables before it can
//! start copying data; with 4 KiB pages each is also a TLB miss and a page walk. A 2 MiB page
//! covers 32 768 index entries' worth of buckets, so the tables of a 1 M-slot cache fit in a
//! handful of TLB entries. Where THP is off (`never`) the advice is ignored and the table works
//! the same on small pages.

use std::marker::PhantomData;
use std::ops::Deref;
use std::ptr::NonNull;
use std::sync::atomic::{AtomicU32, AtomicU64};

use crate::error::{MediaError, Result};

const HUGE_PAGE_BYTES: usize = 2 << 20;
const SMALL_PAGE_BYTES: usize = 4 << 10;

mod sealed {
    pub trait Sealed {}
    impl Sealed for std::sync::atomic::AtomicU64 {}
    impl Sealed for std::sync::atomic::AtomicU32 {}
    impl<T: Sealed, const N: usize> Sealed for [T; N] {}
}

/// A type for which all-zero bytes are a valid value and which needs no drop: what an
/// anonymous mapping starts as.
pub trait ZeroValid: sealed::Sealed + Sync + Send + 'static {}
impl ZeroValid for AtomicU64 {}
impl ZeroValid for AtomicU32 {}
/// An array of zero-valid elements is zero-valid (an index bucket: a cache line of entries).
impl<T: ZeroValid, const N: usize> ZeroValid for [T; N] {}

/// A fixed-length, zero-initialised array of `T` in its own anonymous mapping, advised for
/// transparent huge pages.
pub struct DramTable<T: ZeroValid> {
    ptr: NonNull<T>,
    len: usize,
    mapped_bytes: usize,
    _owns: PhantomData<T>,
}

// SAFETY: the table owns its mapping exclusively; `T` is Sync + Send (atomics), so sharing
// `&[T]` across threads is what `T` already allows.
unsafe impl<T: ZeroValid> Send for DramTable<T> {}
// SAFETY: as above; only shared references to the elements are ever handed out.
unsafe impl<T: ZeroValid> Sync for DramTable<T> {}

impl<T: ZeroValid> DramTable<T> {
    /// `len` zeroed elements. Fails only if the kernel refuses the mapping.
    pub fn zeroed(len: usize) -> Result<Self> {
        // An impossible size saturates and the kernel refuses it (ENOMEM).
        let bytes = len.saturating_mul(std::mem::size_of::<T>()).max(1);
        let mapped_bytes = bytes.div_ceil(SMALL_PAGE_BYTES).saturating_mul(SMALL_PAGE_BYTES);
        // Reserve a huge page more than needed, then trim both ends so the table starts on a
        // huge-page boundary: every whole 2 MiB of it can be one huge page, and only the tail
        // stays on small pages (so the DRAM used is the table rounded to 4 KiB, not to 2 MiB).
        let reserved_bytes = mapped_bytes.saturating_add(HUGE_PAGE_BYTES);
        // SAFETY: a fresh private anonymous mapping; no existing memory is affected.
        let reserved = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                reserved_bytes,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_PRIVATE | libc::MAP_ANONYMOUS,
                -1,
                0,
            )
        };
        if reserved == libc::MAP_FAILED {
            return Err(MediaError::Io {
                path: "(anonymous DRAM table)".into(),
                action: "mmap",
                source: std::io::Error::last_os_error(),
            });
        }
        let head_bytes = (reserved as usize).next_multiple_of(HUGE_PAGE_BYTES) - reserved as usize;
        let tail_bytes = reserved_bytes - head_bytes - mapped_bytes;
        // SAFETY: `addr` lies `head_bytes` (< 2 MiB) into the reservation and `mapped_bytes`
        // more still fit in it; the trimmed head and tail are parts of the reservation that
        // nothing references; the advice changes no contents, and failing (THP compiled out)
        // leaves small pages, which are correct, so its result is ignored.
        let addr = unsafe {
            let addr = reserved.cast::<u8>().add(head_bytes).cast::<libc::c_void>();
            if head_bytes > 0 {
                libc::munmap(reserved, head_bytes);
            }
            if tail_bytes > 0 {
                libc::munmap(addr.cast::<u8>().add(mapped_bytes).cast(), tail_bytes);
            }
            libc::madvise(addr, mapped_bytes, libc::MADV_HUGEPAGE);
            addr
        };
        let ptr = NonNull::new(addr.cast::<T>()).expect("mmap returned a null mapping");
        Ok(Self { ptr, len, mapped_bytes, _owns: PhantomData })
    }

    /// Bytes the table maps: its size rounded up to whole 4 KiB pages.
    pub fn mapped_bytes(&self) -> usize {
        self.mapped_bytes
    }
}

impl<T: ZeroValid> Deref for DramTable<T> {
    type Target = [T];
    fn deref(&self) -> &[T] {
        // SAFETY: the mapping holds `len` elements, is aligned to a page (more than `T`
        // needs), zero-initialised (a valid `T`, per `ZeroValid`), and lives as long as `self`.
        unsafe { std::slice::from_raw_parts(self.ptr.as_ptr(), self.len) }
    }
}

impl<T: ZeroValid> Drop for DramTable<T> {
    fn drop(&mut self) {
        // SAFETY: unmaps exactly the mapping made in `zeroed`; no reference into it outlives
        // `self` (they borrow from it).
        unsafe {
            libc::munmap(self.ptr.as_ptr().cast(), self.mapped_bytes);
        }
    }
}

#[cfg(test)]
mod tests {
    use std::sync::atomic::Ordering;

    use super::*;

    #[test]
    fn tables_start_zeroed_and_hold_stores() {
        let table = DramTable::<AtomicU64>::zeroed(300_000).unwrap();
        assert_eq!(table.len(), 300_000);
        assert!(table.iter().all(|w| w.load(Ordering::Relaxed) == 0));
        table[299_999].store(7, Ordering::Relaxed);
        assert_eq!(table[299_999].load(Ordering::Relaxed), 7);
        assert_eq!(table.mapped_bytes(), (300_000 * 8usize).next_multiple_of(4096));
        assert_eq!(table.as_ptr() as usize % HUGE_PAGE_BYTES, 0, "not huge-page aligned");
        let small = DramTable::<AtomicU32>::zeroed(0).unwrap();
        assert!(small.is_empty());
        let lines = DramTable::<[AtomicU64; 8]>::zeroed(1000).unwrap();
        assert_eq!(lines.mapped_bytes(), (1000 * 64usize).next_multiple_of(4096));
        assert!(lines.iter().flatten().all(|w| w.load(Ordering::Relaxed) == 0));
        lines[999][7].store(9, Ordering::Relaxed);
        assert_eq!(lines[999][7].load(Ordering::Relaxed), 9);
    }
}
