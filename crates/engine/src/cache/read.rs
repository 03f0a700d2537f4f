//! The read path: lock-free hits, the locked path, misses and admission.

use super::spans::MISS_SPAN_BLOCKS_MAX;
use super::*;

/// What a lock-free copy of a hit came to.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum HitCopy {
    /// The block's data, checked.
    Hit,
    /// The slot changed under the copy: try again.
    Raced,
    /// The copy is the block's but cannot be trusted (a poisoned line, a checksum mismatch):
    /// the locked path decides what to do with it.
    Unreadable,
}

/// Blocks copied with one copy at most, when a read's blocks lie in consecutive slots (a
/// sequential read of blocks written in order: `pmcache bench paper 000-fig4b`).
const RUN_BLOCKS_MAX: usize = 64;

/// The share of the cache's slots that must be free for a sequential stream's tail to be
/// admitted anyway: 1/8.
const SCAN_ROOM_SHARE_INV: u64 = 8;

impl<M: Medium, B: BackingStore, C: Clock> Engine<M, B, C> {
    /// Whether a missed block of a sequential stream past the cutoff bypasses the cache: only
    /// while fewer than an eighth of the slots are free. The cutoff keeps a scan from evicting
    /// the working set; a scan into free slots evicts nothing, so a cache that has room caches
    /// data read sequentially (a first copy, a restore) as it caches the rest.
    pub(super) fn scan_bypasses(&self) -> bool {
        self.pools.len() * SCAN_ROOM_SHARE_INV < u64::from(self.slots.len())
    }
}

impl<'e, M: Medium, B: BackingStore, C: Clock> Lane<'e, M, B, C> {
    /// Reads `buf.len()` bytes at byte `offset`.
    pub fn read(&mut self, offset: u64, buf: &mut [u8]) -> Result<()> {
        let _unwind = AbortOnUnwind::new("Lane::read");
        self.engine.cleaner.follow_writer_nice(false);
        let engine = self.engine;
        engine.check_range("read", offset, buf.len() as u64)?;
        // Sequential streams are tracked from the first miss on: hits need no admission
        // decision, and tracking every hit would put shared stores on the hit path.
        let mut sequential_tail = None;
        let request_len = buf.len() as u64;
        let block = self.block_bytes();
        let end = offset + request_len;
        let mut done = 0;
        while done < buf.len() {
            let hit = self.hits_at(offset, buf, done);
            if hit > 0 {
                done += hit;
                continue;
            }
            let at = offset + done as u64;
            let (lba, in_block) = (block_of(at, block), offset_in_block(at, block) as usize);
            let len = (block - in_block as u64).min(end - at) as usize;
            let past_cutoff = *sequential_tail.get_or_insert_with(|| {
                engine.admission.note_request(offset, request_len, engine.clock.now_ns())
            });
            let tail = past_cutoff && engine.scan_bypasses();
            // Whole blocks from here on that are not cached: one backing read for them.
            let uncached = if in_block == 0 && len as u64 == block {
                let whole_blocks = ((end - at) / block).min(MISS_SPAN_BLOCKS_MAX);
                (lba..lba + whole_blocks).take_while(|&l| engine.index.lookup(l).is_none()).count()
            } else {
                0
            };
            if uncached >= 2 {
                let span = uncached * block as usize;
                self.read_span_now(lba, &mut buf[done..done + span], !tail)?;
                done += span;
                continue;
            }
            self.read_locked(lba, in_block, &mut buf[done..done + len], !tail)?;
            done += len;
        }
        bump(&self.counters().bytes_read, buf.len() as u64);
        Ok(())
    }

    /// Lock-free hits at byte `done` of a read of `buf.len()` bytes at `offset`, into `buf`:
    /// a run of whole blocks copied together, or the block (or part of it) there. Returns the
    /// bytes answered; 0 when the block there is not a lock-free hit.
    pub(super) fn hits_at(&mut self, offset: u64, buf: &mut [u8], done: usize) -> usize {
        let block = self.block_bytes();
        let (at, end) = (offset + done as u64, offset + buf.len() as u64);
        let (lba, in_block) = (block_of(at, block), offset_in_block(at, block) as usize);
        let len = (block - in_block as u64).min(end - at) as usize;
        if in_block == 0 && len as u64 == block {
            let whole_blocks = ((end - at) / block) as usize;
            if whole_blocks > 1 {
                let hits = self.read_hit_run(lba, whole_blocks, &mut buf[done..]);
                if hits > 0 {
                    return hits * block as usize;
                }
            }
        }
        if self.read_hit(lba, in_block, &mut buf[done..done + len]) { len } else { 0 }
    }

    /// Lock-free hits of up to `blocks` whole blocks from `lba` on, into `out`: the blocks
    /// whose slots follow one another are copied with one copy, then each is validated as
    /// [`Lane::copy_validated`] validates one (its index entry still holds the same slot and
    /// generation after the copy). Returns how many blocks, from the first, were validated
    /// hits (0: the first block is not a visible hit); the caller reads the rest.
    fn read_hit_run(&mut self, lba: u64, blocks: usize, out: &mut [u8]) -> usize {
        let engine = self.engine;
        let block = self.block_bytes() as usize;
        let Some(first) = engine.index.lookup(lba).filter(|f| !f.hidden) else { return 0 };
        let mut run: SmallVec<[Found; RUN_BLOCKS_MAX]> = SmallVec::new();
        run.push(first);
        // One copy covers the run: it stops at the end of the first slot's member, where the
        // next slot number is on another medium.
        let member_end = engine.layout.member_end(first.slot);
        let wanted = blocks.min(RUN_BLOCKS_MAX);
        while run.len() < wanted {
            let previous = run[run.len() - 1].slot;
            match engine.index.lookup(lba + run.len() as u64) {
                Some(next)
                    if !next.hidden
                        && previous.checked_add(1) == Some(next.slot)
                        && next.slot < member_end =>
                {
                    run.push(next)
                }
                _ => break,
            }
        }
        let copied = &mut out[..run.len() * block];
        if engine.medium.read_checked(engine.layout.data_offset(first.slot), copied).is_err() {
            // A poisoned line: the blocks are read one by one, where each is told apart.
            return 0;
        }
        let mut stored: SmallVec<[Option<u32>; RUN_BLOCKS_MAX]> = SmallVec::new();
        if engine.layout.data_crc() {
            stored.extend(run.iter().map(|found| engine.stored_crc(found.slot).ok()));
        }
        fence(Ordering::Acquire);
        let mut held = run.iter().take_while(|found| engine.index.still_holds(found)).count();
        if engine.layout.data_crc() {
            // A copy that validated is the block's data: one that fails its checksum is
            // read again alone, by the locked path, which tells what to do with it.
            held = copied
                .chunks(block)
                .zip(&stored)
                .take(held)
                .take_while(|(data, stored)| {
                    stored.is_some_and(|stored| Engine::<M, B, C>::verify(data, stored).is_ok())
                })
                .count();
        }
        if engine.marks_hits {
            run[..held].iter().for_each(|found| engine.index.touch(found));
        }
        bump(&self.counters().read_hits, held as u64);
        self.count_read(first.slot, held as u64);
        if held < run.len() {
            bump(&self.counters().read_retries, 1);
        }
        held
    }

    /// The lock-free hit path. Returns false on a miss or after repeated interference.
    pub(super) fn read_hit(&mut self, lba: u64, in_block: usize, out: &mut [u8]) -> bool {
        for _ in 0..READ_ATTEMPTS {
            // Absent, or hidden (being filled under its stripe): the locked path.
            let Some(found) = self.engine.index.lookup(lba).filter(|f| !f.hidden) else {
                return false;
            };
            match self.copy_validated(&found, in_block, out) {
                HitCopy::Hit => return true,
                HitCopy::Raced => {}
                HitCopy::Unreadable => return false,
            }
        }
        false
    }

    /// Copies out of the slot `found` (a visible index entry) and validates the copy; counts a
    /// hit, or a retry if the copy must be discarded. Always inlined: left to the compiler it
    /// became a call once it also counted reads per member, and a 4 KiB read hit lost 4 %
    /// (`bench core`, read-hit-4k).
    #[inline(always)]
    pub(super) fn copy_validated(
        &mut self,
        found: &Found,
        in_block: usize,
        out: &mut [u8],
    ) -> HitCopy {
        let engine = self.engine;
        assert!(!found.hidden, "lock-free copy from a hidden index entry");
        // The copy is validated after it is made: the block's index entry still holds the same
        // slot *and the same slot generation*. A slot's data never changes while an entry
        // points at it with its current generation (writes go out of place; a slot is freed —
        // a new generation — before it is reused), so the copy is the block's data at a point
        // inside the copy. A failed validation discards the copy. No other DRAM line is read.
        // With data checksums the whole block is copied, with its checksum, and checked once
        // the copy is known to be the block's (`checked.rs`).
        let data_crc = engine.layout.data_crc();
        let whole = data_crc && out.len() != self.checked_block.len();
        if data_crc {
            // Its line loads while the block is copied.
            engine.medium.prefetch(engine.layout.crc_offset(found.slot), 4);
        }
        let at = engine.layout.data_offset(found.slot);
        let copied = if whole {
            engine.medium.read_checked(at, &mut self.checked_block)
        } else {
            engine.medium.read_checked(at + in_block as u64, out)
        };
        let stored = if data_crc { engine.stored_crc(found.slot).ok() } else { None };
        fence(Ordering::Acquire);
        if !engine.index.still_holds(found) {
            bump(&self.counters().read_retries, 1);
            return HitCopy::Raced;
        }
        if copied.is_err() {
            return HitCopy::Unreadable;
        }
        if data_crc {
            let data = if whole { &self.checked_block[..] } else { &out[..] };
            if stored.is_none_or(|stored| Engine::<M, B, C>::verify(data, stored).is_err()) {
                return HitCopy::Unreadable;
            }
            if whole {
                out.copy_from_slice(&self.checked_block[in_block..in_block + out.len()]);
            }
        }
        if engine.marks_hits {
            engine.index.touch(found);
        }
        bump(&self.counters().read_hits, 1);
        self.count_read(found.slot, 1);
        HitCopy::Hit
    }

    /// The locked read path: a hit that raced with writers, or a miss (admitted or not).
    pub(super) fn read_locked(
        &mut self,
        lba: u64,
        in_block: usize,
        out: &mut [u8],
        may_admit: bool,
    ) -> Result<()> {
        let engine = self.engine;
        let admissible = may_admit && engine.mode().admits_reads();
        let admit = admissible && engine.admission.admit_block(lba);
        let cold = admissible && !admit;
        let mut reserved = self.reserve_for_admission(admit);
        let stripe = &engine.stripes[engine.stripe_index(lba)];
        let mut guard = engine.lock_stripe(lba);
        if let Some(found) = engine.index.lookup(lba) {
            let read = engine.read_slot_checked(found.slot, in_block, out, &mut self.checked_block);
            let dropped = read.map_err(|why| self.unreadable(lba, found.slot, why));
            drop(guard);
            if let Some(slot) = reserved {
                self.give_back(slot);
            }
            if let Err(dropped) = dropped {
                // A clean copy that could not be read is gone: the block is a miss now. A
                // dirty one is the request's error.
                dropped?;
                return self.read_locked(lba, in_block, out, may_admit);
            }
            bump(&self.counters().read_hits, 1);
            self.count_read(found.slot, 1);
            return Ok(());
        }
        let block = self.block_bytes();
        if stripe.writing.load(Ordering::Relaxed) != 0
            && let Some(slot) = reserved.take()
        {
            // A write of the stripe is on its way to the backing store and may land before
            // or after this read: what the read finds there may be served (the two overlap),
            // never admitted — a clean copy of the old data would hide the write for good.
            self.give_back(slot);
        }
        let Some(slot) = reserved else {
            engine.backing_read(out, lba * block + in_block as u64)?;
            let counters = self.counters();
            bump(
                if may_admit {
                    &counters.read_misses_bypassed
                } else {
                    &counters.read_misses_sequential
                },
                1,
            );
            if cold {
                bump(&counters.read_misses_cold, 1);
            }
            return Ok(());
        };
        if let Err(err) = engine.backing_read(&mut self.block, lba * block) {
            drop(guard);
            self.give_back(slot);
            return Err(err);
        }
        let inserted = match self.index_insert(lba, slot) {
            Ok(inserted) => inserted,
            Err(err) => {
                drop(guard);
                self.give_back(slot);
                return Err(err);
            }
        };
        // The sequence number is taken after the backing read completed (the synced rule).
        let seq = engine.global_seq(&mut guard);
        let data = std::mem::take(&mut self.block);
        self.write_data(slot, &data);
        self.persist_entry(slot, SlotEntry { lba, state: BlockState::Clean, seq });
        let admitted = self.reveal_clean_copy(&inserted, slot);
        if !admitted {
            self.give_back(slot);
        }
        out.copy_from_slice(&data[in_block..in_block + out.len()]);
        self.block = data;
        drop(guard);
        let counters = self.counters();
        bump(
            if admitted { &counters.read_misses_admitted } else { &counters.read_misses_bypassed },
            1,
        );
        Ok(())
    }

    /// Fills the scratch block with `lba`'s current contents (cache or backing). Stripe held.
    pub(super) fn load_block(&mut self, lba: u64, cached: Option<&Found>) -> Result<()> {
        let engine = self.engine;
        if let Some(found) = cached {
            let Err(why) = engine.read_block_checked(found.slot, &mut self.block) else {
                return Ok(());
            };
            // The caller replaces the slot: a clean block is read from the backing store
            // instead, a dirty one fails the caller's request.
            if self.note_unreadable(found.slot, why) {
                return Err(Error::CachedBlockUnreadable { lba, why });
            }
        }
        let offset = lba * self.block_bytes();
        engine.backing_read(&mut self.block, offset)?;
        Ok(())
    }
}
