//! The DRAM slot table: one 32-bit word per slot holding its state and a generation that
//! changes every time the slot is freed.
//!
//! Protocol: every change of a slot's state or generation happens under the stripe lock of the
//! block it holds (or, for a free slot, by the pool or the one lane that holds it in its lists).
//! Writers, write-back and eviction check a slot kept its incarnation (generation and a valid
//! state) across the time they did not hold its stripe. Lock-free readers never load a slot
//! word: the index entry that maps a block to a slot carries the slot's generation when it was
//! published (`index.rs`).

use crate::error::Result;
use crate::sync::{AtomicU32, Ordering, Table, zeroed_table};

const STATE_MASK: u32 = 0b11;
/// Set on a dirty slot whose write-back the backing store refused: reclaim tries such slots
/// only after every other dirty one (DRAM only; cleared when the slot is cleaned or freed).
const REFUSED_BIT: u32 = 0b100;
const GEN_SHIFT: u32 = 8;

/// A slot's state in DRAM.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum SlotState {
    /// In the free pool or a lane's lists (or being filled by the lane that took it).
    Free,
    /// Holds a block the backing store also has.
    Clean,
    /// Holds a block only the cache has.
    Dirty,
}

/// A snapshot of a slot word.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct SlotWord(u32);

impl SlotWord {
    pub(crate) fn state(self) -> SlotState {
        match self.0 & STATE_MASK {
            0 => SlotState::Free,
            1 => SlotState::Clean,
            2 => SlotState::Dirty,
            other => panic!("slot word with state {other}"),
        }
    }
    pub(crate) fn is_valid(self) -> bool {
        self.state() != SlotState::Free
    }
    pub(crate) fn generation(self) -> u32 {
        self.0 >> GEN_SHIFT
    }
    /// Whether the backing store refused this dirty slot's last write-back.
    pub(crate) fn write_back_refused(self) -> bool {
        self.0 & REFUSED_BIT != 0
    }
    /// Same block in the same slot incarnation (ignores clean/dirty).
    pub(crate) fn same_incarnation(self, other: SlotWord) -> bool {
        self.generation() == other.generation() && self.is_valid() && other.is_valid()
    }
    fn with_state(self, state: SlotState) -> SlotWord {
        let bits = match state {
            SlotState::Free => 0,
            SlotState::Clean => 1,
            SlotState::Dirty => 2,
        };
        SlotWord((self.0 & !STATE_MASK) | bits)
    }
}

/// One word per slot.
pub(crate) struct SlotTable {
    words: Table<AtomicU32>,
}

impl SlotTable {
    /// Every slot free, generation 0 (the all-zero word).
    pub(crate) fn new(slot_count: u32) -> Result<Self> {
        Ok(Self { words: zeroed_table(slot_count as usize)? })
    }

    pub(crate) fn len(&self) -> u32 {
        self.words.len() as u32
    }

    #[inline]
    pub(crate) fn load(&self, slot: u32) -> SlotWord {
        SlotWord(self.words[slot as usize].load(Ordering::Acquire))
    }

    /// Starts loading the slot's word into the CPU cache (a hint).
    #[inline]
    pub(crate) fn prefetch(&self, slot: u32) {
        pmcache_media::prefetch(&self.words[slot as usize] as *const AtomicU32);
    }

    /// The generation of a slot: a free slot keeps it when published, so the index entry that
    /// will point at the slot can carry it.
    pub(crate) fn generation(&self, slot: u32) -> u32 {
        self.load(slot).generation()
    }

    /// Makes a free slot valid (its data and metadata entry are already durable).
    pub(crate) fn publish(&self, slot: u32, state: SlotState) {
        self.publish_loaded(slot, self.load(slot), state);
    }

    /// [`SlotTable::publish`] with the slot's word already loaded (by the caller, who holds
    /// the free slot: nobody else changes its word).
    pub(crate) fn publish_loaded(&self, slot: u32, word: SlotWord, state: SlotState) {
        assert_eq!(word.state(), SlotState::Free, "publishing slot {slot} that is not free");
        assert_ne!(state, SlotState::Free);
        self.words[slot as usize].store(word.with_state(state).0, Ordering::Release);
    }

    /// Dirty to clean, same incarnation (a refused write-back no longer matters).
    pub(crate) fn set_clean(&self, slot: u32) {
        let word = self.load(slot);
        assert_eq!(word.state(), SlotState::Dirty, "cleaning slot {slot} that is not dirty");
        let clean = word.with_state(SlotState::Clean).0 & !REFUSED_BIT;
        self.words[slot as usize].store(clean, Ordering::Release);
    }

    /// Records that the backing store refused the write-back of dirty `slot`, whose word is
    /// `seen` (same incarnation; the caller holds its block's stripe).
    pub(crate) fn mark_write_back_refused(&self, slot: u32, seen: SlotWord) {
        assert_eq!(seen.state(), SlotState::Dirty, "refused write-back of a slot not dirty");
        self.words[slot as usize].store(seen.0 | REFUSED_BIT, Ordering::Release);
    }

    /// Frees a valid slot: new generation, so every holder of the old incarnation (a writer
    /// or evictor between lock holds; a reader through its index entry) tells it changed.
    /// Returns the state it had.
    pub(crate) fn free(&self, slot: u32) -> SlotState {
        let word = self.load(slot);
        let state = word.state();
        assert_ne!(state, SlotState::Free, "freeing slot {slot} that is already free");
        let next_generation = (word.generation() + 1) & ((1 << (32 - GEN_SHIFT)) - 1);
        self.words[slot as usize].store(next_generation << GEN_SHIFT, Ordering::Release);
        state
    }
}

#[cfg(all(test, not(feature = "shuttle")))]
mod tests {
    use super::*;

    #[test]
    fn free_bumps_the_generation_and_cleaning_keeps_the_incarnation() {
        let table = SlotTable::new(4).unwrap();
        assert_eq!(table.generation(1), 0);
        table.publish(1, SlotState::Dirty);
        let before = table.load(1);
        assert_eq!(before.generation(), 0, "publishing keeps the free slot's generation");
        table.set_clean(1);
        assert!(table.load(1).same_incarnation(before));
        table.free(1);
        let freed = table.load(1);
        assert_eq!(freed.state(), SlotState::Free);
        assert_eq!(freed.generation(), before.generation() + 1);
        assert_eq!(table.generation(1), 1);
        table.publish(1, SlotState::Clean);
        assert!(!table.load(1).same_incarnation(before));
    }

    /// A refused write-back marks the dirty slot without changing its incarnation; cleaning
    /// or freeing it forgets the mark.
    #[test]
    fn a_refused_write_back_is_marked_until_the_slot_is_cleaned_or_freed() {
        let table = SlotTable::new(2).unwrap();
        for slot in 0..2 {
            table.publish(slot, SlotState::Dirty);
            let seen = table.load(slot);
            assert!(!seen.write_back_refused());
            table.mark_write_back_refused(slot, seen);
            let marked = table.load(slot);
            assert!(marked.write_back_refused());
            assert!(marked.same_incarnation(seen));
            assert_eq!(marked.state(), SlotState::Dirty);
        }
        table.set_clean(0);
        assert!(!table.load(0).write_back_refused());
        assert_eq!(table.load(0).state(), SlotState::Clean);
        table.free(1);
        table.publish(1, SlotState::Dirty);
        assert!(!table.load(1).write_back_refused());
    }

    /// The generation counts every free through all its 24 bits, then wraps to 0: wider than
    /// the at most 18 bits an index entry keeps, so the index's wrap is the one that counts.
    #[test]
    fn the_generation_counts_through_24_bits_then_wraps() {
        let table = SlotTable::new(2).unwrap();
        let wrap = 1u32 << (32 - GEN_SHIFT);
        for frees in 1..=wrap {
            table.publish(0, SlotState::Dirty);
            table.free(0);
            let generation = table.generation(0);
            if generation != frees % wrap {
                panic!("after {frees} frees, generation {generation}");
            }
        }
        assert_eq!(table.generation(0), 0);
        assert_eq!(table.generation(1), 0, "the other slot's word is untouched");
    }
}
