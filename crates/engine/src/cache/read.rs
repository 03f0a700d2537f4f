//! The read path: lock-free hits, the locked path, misses and admission.

use super::*;

/// Blocks copied with one copy at most, when a read's blocks lie in consecutive slots (a
/// sequential read of blocks written in order: `pmcache bench paper 000-fig4b`).
const RUN_BLOCKS_MAX: usize = 64;

impl<'e, M: Medium, B: BackingStore, C: Clock> Lane<'e, M, B, C> {
    /// Reads `buf.len()` bytes at byte `offset`.
    pub fn read(&mut self, offset: u64, buf: &mut [u8]) -> Result<()> {
        let _unwind = AbortOnUnwind::new("Lane::read");
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
            let at = offset + done as u64;
            let (lba, in_block) = (block_of(at, block), offset_in_block(at, block) as usize);
            let len = (block - in_block as u64).min(end - at) as usize;
            if in_block == 0 && len as u64 == block {
                let whole_blocks = ((end - at) / block) as usize;
                if whole_blocks > 1 {
                    let hits = self.read_hit_run(lba, whole_blocks, &mut buf[done..]);
                    if hits > 0 {
                        done += hits * block as usize;
                        continue;
                    }
                }
            }
            let out = &mut buf[done..done + len];
            if !self.read_hit(lba, in_block, out) {
                let tail = *sequential_tail.get_or_insert_with(|| {
                    engine.admission.note_request(offset, request_len, engine.clock.now_ns())
                });
                self.read_locked(lba, in_block, out, !tail)?;
            }
            done += len;
        }
        bump(&self.counters().bytes_read, buf.len() as u64);
        Ok(())
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
        engine.medium.read(engine.layout.data_offset(first.slot), &mut out[..run.len() * block]);
        fence(Ordering::Acquire);
        let held = run.iter().take_while(|found| engine.index.still_holds(found)).count();
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
            if self.copy_validated(&found, in_block, out) {
                return true;
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
    ) -> bool {
        let engine = self.engine;
        assert!(!found.hidden, "lock-free copy from a hidden index entry");
        // The copy is validated after it is made: the block's index entry still holds the same
        // slot *and the same slot generation*. A slot's data never changes while an entry
        // points at it with its current generation (writes go out of place; a slot is freed —
        // a new generation — before it is reused), so the copy is the block's data at a point
        // inside the copy. A failed validation discards the copy. No other DRAM line is read.
        engine.medium.read(engine.layout.data_offset(found.slot) + in_block as u64, out);
        fence(Ordering::Acquire);
        if engine.index.still_holds(found) {
            if engine.marks_hits {
                engine.index.touch(found);
            }
            bump(&self.counters().read_hits, 1);
            self.count_read(found.slot, 1);
            return true;
        }
        bump(&self.counters().read_retries, 1);
        false
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
        let reserved = self.reserve_for_admission(admit);
        let mut guard = engine.lock_stripe(lba);
        if let Some(found) = engine.index.lookup(lba) {
            engine.medium.read(engine.layout.data_offset(found.slot) + in_block as u64, out);
            drop(guard);
            if let Some(slot) = reserved {
                self.give_back(slot);
            }
            bump(&self.counters().read_hits, 1);
            self.count_read(found.slot, 1);
            return Ok(());
        }
        let block = self.block_bytes();
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
        engine.index.replace(&inserted, slot, engine.slots.generation(slot));
        engine.slots.publish(slot, SlotState::Clean);
        out.copy_from_slice(&data[in_block..in_block + out.len()]);
        self.block = data;
        drop(guard);
        bump(&self.counters().read_misses_admitted, 1);
        Ok(())
    }

    /// Fills the scratch block with `lba`'s current contents (cache or backing). Stripe held.
    pub(super) fn load_block(&mut self, lba: u64, cached: Option<&Found>) -> Result<()> {
        let engine = self.engine;
        match cached {
            Some(found) => {
                engine.medium.read(engine.layout.data_offset(found.slot), &mut self.block)
            }
            None => {
                let offset = lba * self.block_bytes();
                engine.backing_read(&mut self.block, offset)?
            }
        }
        Ok(())
    }
}
