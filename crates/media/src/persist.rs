//! Persistence primitives: cache-line write-back (clwb, else clflushopt, else clflush), the
//! store fence, non-temporal block copies and non-temporal entry stores — chosen at run time
//! from CPUID and (on DRAM) a timing at open.

/// The cache-line write-back instruction in use.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum FlushInstruction {
    /// `clwb`: write back, keep the line cached.
    Clwb,
    /// `clflushopt`: write back and invalidate, weakly ordered.
    Clflushopt,
    /// `clflush`: write back and invalidate, strongly ordered (no fence needed, but slow).
    Clflush,
    /// Not x86-64: no cache-line control; the mapping's own persistence (msync-free DRAM) only.
    None,
}

/// The primitives a mapped medium uses, detected once.
#[derive(Clone, Copy, Debug)]
pub struct PersistPrimitives {
    /// Which write-back instruction `flush` issues.
    pub flush: FlushInstruction,
    /// Whether whole-block copies use non-temporal stores (then no flush is needed for them).
    pub nt_block_copy: bool,
    /// Whether 16-byte entry pairs (`Medium::store_pair_flush`) use non-temporal stores:
    /// no read of the line before the store and no flush after it. Set together with
    /// `nt_block_copy` (x86-64 only): where bypassing the cache pays for a block it pays for a
    /// metadata line that is written once and not read again on the write path (see
    /// docs/PERFORMANCE.md, `bench core`). Off on DAX (real PM), where it is not measured.
    pub nt_pair_store: bool,
}

impl PersistPrimitives {
    /// Detects the best available write-back instruction; non-temporal stores off.
    pub fn detect() -> Self {
        Self { flush: detect_flush(), nt_block_copy: false, nt_pair_store: false }
    }

    /// Turns non-temporal block copies and entry stores on or off together (entry stores only
    /// where the instruction exists).
    pub fn set_nontemporal(&mut self, on: bool) {
        self.nt_block_copy = on;
        self.nt_pair_store = on && cfg!(target_arch = "x86_64");
    }

    /// Stores `word1` at `at + 8`, then `word0` at `at`, each with one non-temporal 8-byte store
    /// (`movnti`): the line is neither read first nor left in the cache. Both are visible to
    /// other threads and durable after this thread's next [`store_fence`], and may reach
    /// memory in either order (non-temporal stores are weakly ordered), each atomically.
    /// x86-64 only (`set_nontemporal` never turns `nt_pair_store` on elsewhere).
    ///
    /// # Safety
    /// `at` must be 16-byte aligned and valid for 16 bytes of writes. Until this thread's next
    /// [`store_fence`] the stores act as if made by another thread (Rust's rule for
    /// non-temporal stores): this thread must fence before any store that publishes the pair,
    /// and other threads may only read the words meanwhile with atomic 8-byte loads, as
    /// racing reads whose result they validate.
    #[cfg(target_arch = "x86_64")]
    #[inline]
    pub unsafe fn store_pair_nontemporal(at: *mut u8, word0: u64, word1: u64) {
        assert!((at as usize).is_multiple_of(16), "unaligned non-temporal pair store");
        // SAFETY: the caller guarantees both aligned words are writable, a fence before the
        // pair is published, and that other threads' loads before it are validated racing
        // reads. Each `movnti` is an aligned 8-byte store, single-copy atomic on x86-64, so
        // such a load returns the old or the new word, never a mix of bytes (the engine
        // validates the pair: a lone new word 0 decodes as torn, a lone word 1 as free).
        // Inline assembly, rather than the `_mm_stream_si64` intrinsic, so that the compiler
        // treats the stores as the opaque operation they are. `movnti` is SSE2, part of the
        // x86-64 baseline.
        unsafe {
            std::arch::asm!(
                "movnti qword ptr [{at} + 8], {word1}",
                "movnti qword ptr [{at}], {word0}",
                at = in(reg) at,
                word0 = in(reg) word0,
                word1 = in(reg) word1,
                options(nostack, preserves_flags),
            );
        }
    }

    /// Writes back every cache line in `start..start + len`.
    ///
    /// # Safety
    /// `start..start + len` must lie inside one live mapping.
    pub unsafe fn flush_range(&self, start: *const u8, len: usize) {
        if len == 0 {
            return;
        }
        let line = crate::CACHE_LINE_BYTES as usize;
        let first = start as usize & !(line - 1);
        let end = start as usize + len;
        let mut at = first;
        while at < end {
            // SAFETY: `at` is inside (or at the line start of) the caller's live mapping.
            unsafe { flush_line(self.flush, at as *const u8) };
            at += line;
        }
    }

    /// Copies `src` to `dst` with non-temporal stores, a cache line (four 16-byte stores) per
    /// iteration, then 16 bytes at a time.
    ///
    /// Never inlined: the raw baseline, the floor and the engine of `pmcache bench` then run
    /// the same machine code, and a tight loop's speed does not depend on where each caller's
    /// copy of it happens to land relative to 32-byte instruction boundaries.
    ///
    /// # Safety
    /// `dst` must be valid for `src.len()` bytes of writes, 16-byte aligned, and `src.len()` a
    /// multiple of 16.
    #[inline(never)]
    pub unsafe fn copy_nontemporal(dst: *mut u8, src: &[u8]) {
        assert!(
            (dst as usize).is_multiple_of(16) && src.len().is_multiple_of(16),
            "unaligned non-temporal copy"
        );
        #[cfg(target_arch = "x86_64")]
        {
            use std::arch::x86_64::{__m128i, _mm_loadu_si128, _mm_stream_si128};
            let lines_end = src.len() / 64 * 64;
            let mut at = 0;
            while at < lines_end {
                // SAFETY: `at + 64 <= src.len()`; the caller guarantees `dst + at..+64` is
                // writable and 16-byte aligned. SSE2 is part of the x86-64 baseline.
                unsafe {
                    let from = src.as_ptr().add(at) as *const __m128i;
                    let to = dst.add(at) as *mut __m128i;
                    let (a, b) = (_mm_loadu_si128(from), _mm_loadu_si128(from.add(1)));
                    let (c, d) = (_mm_loadu_si128(from.add(2)), _mm_loadu_si128(from.add(3)));
                    _mm_stream_si128(to, a);
                    _mm_stream_si128(to.add(1), b);
                    _mm_stream_si128(to.add(2), c);
                    _mm_stream_si128(to.add(3), d);
                }
                at += 64;
            }
            while at < src.len() {
                // SAFETY: `at + 16 <= src.len()`; as above.
                unsafe {
                    let value = _mm_loadu_si128(src.as_ptr().add(at) as *const __m128i);
                    _mm_stream_si128(dst.add(at) as *mut __m128i, value);
                }
                at += 16;
            }
        }
        #[cfg(not(target_arch = "x86_64"))]
        // SAFETY: the caller guarantees `dst` is valid for `src.len()` bytes.
        unsafe {
            std::ptr::copy_nonoverlapping(src.as_ptr(), dst, src.len())
        };
    }
}

/// A store fence: every earlier flush and non-temporal store of this thread is complete after it.
pub fn store_fence() {
    #[cfg(target_arch = "x86_64")]
    // SAFETY: sfence has no memory operands; SSE is part of the x86-64 baseline.
    unsafe {
        std::arch::x86_64::_mm_sfence()
    };
    #[cfg(not(target_arch = "x86_64"))]
    std::sync::atomic::fence(std::sync::atomic::Ordering::SeqCst);
}

/// Asks the CPU to start loading the cache line holding `at` into all cache levels: a hint with
/// no visible effect, for software pipelining (the miss overlaps the caller's other work). The
/// pointer is never dereferenced, so any address is allowed.
#[inline]
pub fn prefetch<T>(at: *const T) {
    #[cfg(target_arch = "x86_64")]
    // SAFETY: prefetch never faults and has no architectural effect, whatever the address; SSE
    // is part of the x86-64 baseline.
    unsafe {
        std::arch::x86_64::_mm_prefetch::<{ std::arch::x86_64::_MM_HINT_T0 }>(at.cast::<i8>())
    };
    #[cfg(not(target_arch = "x86_64"))]
    let _ = at;
}

/// Lets no later instruction start before every earlier one has completed (`lfence` on
/// x86-64: so on Intel, and on AMD where the kernel or the hypervisor sets the bit that makes
/// it dispatch-serializing, as Linux does on bare metal; elsewhere a sequentially consistent
/// fence, which orders memory accesses only). A benchmark calls it between two requests to
/// model a request/response boundary: without it, the CPU may start the next request's loads
/// while the current one's copy is still finishing, which no client that waits for each
/// reply gets.
#[inline]
pub fn serialize_execution() {
    #[cfg(target_arch = "x86_64")]
    // SAFETY: `lfence` has no operands and no effect on memory or registers; SSE2 is part of
    // the x86-64 baseline.
    unsafe {
        std::arch::x86_64::_mm_lfence()
    };
    #[cfg(not(target_arch = "x86_64"))]
    std::sync::atomic::fence(std::sync::atomic::Ordering::SeqCst);
}

/// The CPU's CRC32C instruction (SSE4.2 `crc32`), for checksums computed on every write: a
/// token that exists only where the instruction does.
#[derive(Clone, Copy, Debug)]
pub struct Crc32cInstruction(());

impl Crc32cInstruction {
    /// The instruction, if this CPU has it (the detection result is cached by `std`).
    #[inline]
    pub fn detect() -> Option<Self> {
        #[cfg(target_arch = "x86_64")]
        if std::arch::is_x86_feature_detected!("sse4.2") {
            return Some(Self(()));
        }
        None
    }

    /// Folds the 8 little-endian bytes of `word` into a running CRC32C `crc` (no pre- or
    /// post-inversion: the caller's, as with the table-driven form).
    #[inline]
    pub fn fold_u64(self, crc: u32, word: u64) -> u32 {
        #[cfg(target_arch = "x86_64")]
        // SAFETY: `self` exists only if `detect` found SSE4.2 on this CPU; the instruction has
        // no memory operands.
        let folded = unsafe { std::arch::x86_64::_mm_crc32_u64(u64::from(crc), word) } as u32;
        #[cfg(not(target_arch = "x86_64"))]
        let folded = {
            let _ = (crc, word);
            unreachable!("no CRC32C instruction token off x86-64")
        };
        folded
    }
}

#[cfg(target_arch = "x86_64")]
fn detect_flush() -> FlushInstruction {
    use std::arch::x86_64::{__cpuid, __cpuid_count};
    let max_leaf = __cpuid(0).eax;
    if max_leaf >= 7 {
        let leaf7 = __cpuid_count(7, 0);
        if leaf7.ebx & (1 << 24) != 0 {
            return FlushInstruction::Clwb;
        }
        if leaf7.ebx & (1 << 23) != 0 {
            return FlushInstruction::Clflushopt;
        }
    }
    if __cpuid(1).edx & (1 << 19) != 0 {
        return FlushInstruction::Clflush;
    }
    FlushInstruction::None
}

#[cfg(not(target_arch = "x86_64"))]
fn detect_flush() -> FlushInstruction {
    FlushInstruction::None
}

/// Writes back the cache line holding `addr`.
///
/// # Safety
/// `addr` must point into a live mapping.
#[inline]
unsafe fn flush_line(kind: FlushInstruction, addr: *const u8) {
    #[cfg(target_arch = "x86_64")]
    // SAFETY: the caller guarantees `addr` is mapped; each instruction only writes back (and
    // maybe invalidates) the line, it does not change memory contents. The instruction was
    // detected through CPUID before being chosen.
    unsafe {
        match kind {
            FlushInstruction::Clwb => {
                std::arch::asm!("clwb [{0}]", in(reg) addr, options(nostack, preserves_flags))
            }
            FlushInstruction::Clflushopt => {
                std::arch::asm!("clflushopt [{0}]", in(reg) addr, options(nostack, preserves_flags))
            }
            FlushInstruction::Clflush => std::arch::x86_64::_mm_clflush(addr),
            FlushInstruction::None => {}
        }
    }
    #[cfg(not(target_arch = "x86_64"))]
    let _ = (kind, addr);
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The CPU's features as the kernel lists them (`/proc/cpuinfo`'s first `flags` line).
    fn cpu_flags() -> Vec<String> {
        let info = std::fs::read_to_string("/proc/cpuinfo").expect("/proc/cpuinfo");
        let line = info.lines().find(|l| l.starts_with("flags")).expect("a flags line");
        line.split(':').nth(1).expect("flags").split_whitespace().map(str::to_owned).collect()
    }

    /// The write-back instruction chosen is the best the kernel says this CPU has.
    #[cfg(target_arch = "x86_64")]
    #[test]
    fn the_flush_instruction_is_the_best_the_cpu_has() {
        let flags = cpu_flags();
        let has = |name: &str| flags.iter().any(|f| f == name);
        let expected = if has("clwb") {
            FlushInstruction::Clwb
        } else if has("clflushopt") {
            FlushInstruction::Clflushopt
        } else if has("clflush") {
            FlushInstruction::Clflush
        } else {
            FlushInstruction::None
        };
        assert_eq!(PersistPrimitives::detect().flush, expected, "cpu flags: {flags:?}");
        // Each instruction the CPU has runs on a live line without changing it.
        let mut line = [7u8; 128];
        for kind in
            [FlushInstruction::Clwb, FlushInstruction::Clflushopt, FlushInstruction::Clflush]
        {
            let name = format!("{kind:?}").to_lowercase();
            if has(&name) {
                let primitives =
                    PersistPrimitives { flush: kind, nt_block_copy: false, nt_pair_store: false };
                // SAFETY: `line` is a live local array of 128 bytes.
                unsafe { primitives.flush_range(line.as_ptr().wrapping_add(3), 100) };
                store_fence();
            }
        }
        line[0] = 8;
        assert_eq!((line[0], line[127]), (8, 7));
    }

    /// The CRC32C instruction is found where the kernel lists SSE4.2, and folds a word as the
    /// table-driven CRC32C does (without its pre- and post-inversion).
    #[cfg(target_arch = "x86_64")]
    #[test]
    fn the_crc32c_instruction_folds_as_crc32c_does() {
        let found = Crc32cInstruction::detect();
        assert_eq!(found.is_some(), cpu_flags().iter().any(|f| f == "sse4_2"));
        let Some(crc) = found else { return };
        for (start, word) in [(0u32, 0u64), (!0, 1), (0x1234_5678, 0xdead_beef_0bad_f00d)] {
            let expected = !crc32c::crc32c_append(!start, &word.to_le_bytes());
            assert_eq!(crc.fold_u64(start, word), expected, "{start:#x} {word:#x}");
        }
    }

    #[test]
    fn a_nontemporal_copy_copies_lines_and_a_16_byte_tail() {
        let mut dst = vec![0u128; 16];
        let src: Vec<u8> = (0..176u32).map(|i| (i * 3) as u8).collect();
        // SAFETY: `dst` holds 256 bytes, 16-byte aligned (u128); 176 is a multiple of 16.
        unsafe { PersistPrimitives::copy_nontemporal(dst.as_mut_ptr().cast(), &src) };
        store_fence();
        let bytes: Vec<u8> = dst.iter().flat_map(|w| w.to_ne_bytes()).collect();
        assert_eq!(bytes[..176], src[..]);
        assert!(bytes[176..].iter().all(|&b| b == 0), "copied past the end");
    }
}
