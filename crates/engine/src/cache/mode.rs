//! The cache mode, and switches of it that are barriers.
//!
//! A write request reads the mode once and keeps it: every block of a request, its FUA and
//! the group commit of a batch follow that one reading. The lane *pins* the mode for the
//! request: it publishes the mode word it read in its [`LaneSlot::mode_pin`] and reads the
//! word again, taking it only if it did not move meanwhile. [`Engine::set_mode`] stores a new
//! word (the mode with a switch count above it), then waits until no lane holds a pin of an
//! older word. Both sides store, then load, sequentially consistent: either the switch sees
//! the lane's pin and waits for it, or the lane sees the new word and pins that instead. Where
//! the kernel offers an expedited membarrier, the switch issues it between its store and its
//! loads (`pmcache_media::barrier::heavy_fence`: a full fence on every thread), and the lane
//! needs only a compiler fence between its own: a write request pays no fence for the pin
//! (a sequentially consistent store is a locked instruction, about a fifth of a 4 KiB
//! write-back write's time, `bench core`).
//!
//! So when `set_mode` returns, every write request that read the old mode has returned, and
//! every later one runs in the new mode: after a switch away from a write-back mode no write
//! of the old mode lands dirty behind a drain, and a FUA write never changes its mind about
//! whether it must flush.
//!
//! `set_mode` must not be called by a thread inside a write request of its own (it would wait
//! for itself); frontends switch from their control thread.

use std::time::Duration;

use super::*;

/// Bits of the mode word below the switch count: the mode.
const MODE_BITS: u32 = 8;

/// The mode word of `mode` after `switches` switches (never 0: the count starts at 1).
pub(super) fn mode_word(mode: CacheMode, switches: u64) -> u64 {
    (switches << MODE_BITS) | u64::from(mode.to_u8())
}

fn mode_of(word: u64) -> CacheMode {
    CacheMode::from_u8((word & ((1 << MODE_BITS) - 1)) as u8)
}

impl<M: Medium, B: BackingStore, C: Clock> Engine<M, B, C> {
    /// The cache mode in force.
    pub fn mode(&self) -> CacheMode {
        mode_of(self.mode.load(Ordering::Relaxed))
    }

    /// Changes the cache mode, for every lane, once every write request that read the old
    /// mode has returned (see the module docs). Dirty blocks stay dirty until written back.
    pub fn set_mode(&self, mode: CacheMode) {
        let _one_switch = lock(&self.mode_switch);
        let word = self.mode.load(Ordering::SeqCst);
        let next = mode_word(mode, (word >> MODE_BITS) + 1);
        self.mode.store(next, Ordering::SeqCst);
        if self.fence_asymmetric {
            assert!(pmcache_media::barrier::heavy_fence(), "membarrier failed once registered");
        }
        for lane in self.lanes.iter() {
            let mut waits = 0u32;
            loop {
                let pin = lane.mode_pin.load(Ordering::SeqCst);
                if pin == 0 || pin == next {
                    break;
                }
                waits += 1;
                if waits < 64 || cfg!(feature = "shuttle") {
                    crate::sync::yield_now();
                } else {
                    std::thread::sleep(Duration::from_micros(50));
                }
            }
        }
    }
}

impl<M: Medium, B: BackingStore, C: Clock> Lane<'_, M, B, C> {
    /// Pins the cache mode for a write request (see the module docs) and returns it; a request
    /// inside another of the same lane (a batch's write run alone) keeps the outer pin. Each
    /// call is matched by [`Lane::unpin_mode`].
    pub(super) fn pin_mode(&mut self) -> CacheMode {
        if let Some(mode) = self.mode_pinned {
            self.mode_pins += 1;
            return mode;
        }
        let engine = self.engine;
        let mode = loop {
            let word = engine.mode.load(Ordering::SeqCst);
            if engine.fence_asymmetric {
                // The switch's membarrier is the fence between this store and the load.
                self.shared.mode_pin.store(word, Ordering::Relaxed);
                std::sync::atomic::compiler_fence(Ordering::SeqCst);
            } else {
                self.shared.mode_pin.store(word, Ordering::SeqCst);
            }
            if engine.mode.load(Ordering::SeqCst) == word {
                break mode_of(word);
            }
        };
        self.mode_pinned = Some(mode);
        self.mode_pins = 1;
        mode
    }

    /// Ends a [`Lane::pin_mode`]; the outermost lets mode switches pass.
    pub(super) fn unpin_mode(&mut self) {
        assert!(self.mode_pins > 0, "a mode unpinned that was not pinned");
        self.mode_pins -= 1;
        if self.mode_pins == 0 {
            self.mode_pinned = None;
            self.shared.mode_pin.store(0, Ordering::Release);
        }
    }

    /// The mode the request in progress pinned.
    pub(super) fn pinned_mode(&self) -> CacheMode {
        self.mode_pinned.expect("a write path ran without its request's mode pinned")
    }
}
