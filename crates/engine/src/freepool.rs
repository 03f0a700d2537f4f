//! The global pool of free slots: a bitmap (one bit per slot) behind a mutex, taken from and
//! returned to in batches by lanes, so the lock is amortised over many allocations.

use crate::sync::{Mutex, lock};

struct Bits {
    words: Vec<u64>,
    cursor: usize,
    free: u64,
}

pub(crate) struct FreePool {
    bits: Mutex<Bits>,
}

impl FreePool {
    pub(crate) fn new(slot_count: u32) -> Self {
        let words = vec![0u64; (slot_count as usize).div_ceil(64)];
        Self { bits: Mutex::new(Bits { words, cursor: 0, free: 0 }) }
    }

    pub(crate) fn bytes(&self) -> usize {
        lock(&self.bits).words.len() * 8
    }

    /// Returns free slots (their metadata entries are durably free).
    pub(crate) fn put(&self, slots: impl IntoIterator<Item = u32>) {
        let mut bits = lock(&self.bits);
        for slot in slots {
            let (word, bit) = (slot as usize / 64, slot % 64);
            assert!(bits.words[word] & (1 << bit) == 0, "slot {slot} freed twice");
            bits.words[word] |= 1 << bit;
            bits.free += 1;
        }
    }

    /// Moves up to `max` free slots into `out`, lowest first from the cursor (so a lane gets a
    /// contiguous run when the cache is fresh). Returns how many.
    pub(crate) fn take(&self, max: usize, out: &mut Vec<u32>) -> usize {
        let mut bits = lock(&self.bits);
        let mut taken = 0;
        let words = bits.words.len();
        let mut scanned = 0;
        while taken < max && bits.free > 0 && scanned <= words {
            let at = bits.cursor;
            while bits.words[at] != 0 && taken < max {
                let bit = bits.words[at].trailing_zeros();
                bits.words[at] &= !(1 << bit);
                bits.free -= 1;
                out.push((at * 64) as u32 + bit);
                taken += 1;
            }
            if bits.words[at] == 0 {
                bits.cursor = (at + 1) % words;
                scanned += 1;
            }
        }
        // Hand out the lowest first when popping from the end.
        let start = out.len() - taken;
        out[start..].reverse();
        taken
    }
}
