//! The one rule that orders the backing store's writes: whoever writes or discards a block
//! there — other than the cleaner itself — holds the block's stripe and, under it, waits until
//! no copy the cleaner took of the stripe's blocks is still on its way (`Stripe::cleaning`).
//!
//! The cleaner copies a dirty block under its stripe and writes the copy back with no lock
//! held (`cache/cleaner/`); the copy may land any time until its completion. Without the rule,
//! a newer write of the block (an inline write-back, a write-through, the zeroes of a
//! write-zeroes, a discard) could land first and the older copy over it, and the backing store
//! would keep the older data for ever. With it, every copy in flight when the stripe was taken
//! lands first, and no new one starts: the cleaner only *tries* stripe locks.
//!
//! The rule is enforced by type: [`Engine::backing_write`], [`Engine::backing_write_zeroes`]
//! and [`Engine::backing_discard`] take a [`BackingTurn`] for the range they touch, and a turn
//! is made only here, after the wait. A single block's turn borrows the caller's guard of its
//! stripe ([`Engine::backing_turn`]); a range's comes from a [`RangeHold`], which holds the
//! stripes of a run of blocks at once ([`Engine::hold_range`]), so that a range is written or
//! discarded in one call per run while no other request can change, cache or write one of its
//! blocks: overlapping requests in flight then end as one of their two orders, block by block.
//!
//! A lane's write-throughs in flight (`through.rs`) are a second kind of copy on its way: a
//! stripe's `writing` count. It is waited for *before* the stripe is held
//! (`Lane::lock_stripe_for_backing`, `Lane::hold_range_for_backing`: take the stripe, and if
//! the count is not zero, release it and wait), because the lane that lowers it takes the
//! stripe to do so; the cleaner and a reclaim's write-back skip such a stripe.
//!
//! No deadlock: the cleaner never waits for a stripe while it has copies in flight, and lowers
//! the count at completion without the lock; a lane holding stripes waits for no other stripe
//! (a range hold waits for its first stripe only when it holds none, and only tries the rest,
//! as a group commit does).

use std::marker::PhantomData;
use std::time::Duration;

use pmcache_backing::{IoQueue, IoRequest};

use super::*;

/// Most blocks a [`RangeHold`] covers: the stripes it holds at once, across backing-store
/// I/O (a discard, a zeroing, the wait for the cleaner's copies). Of at least 1,024 stripes,
/// 32 blocks take about 3 %: writes and read misses of other blocks seldom wait behind a
/// range, and a 4 GiB range still goes in 32 Ki calls.
pub(super) const RANGE_HOLD_BLOCKS_MAX: u64 = 32;

/// Proof that the rule holds for blocks `first..end`: the caller holds their stripes (for
/// `'g`) and no copy of them from the cleaner is in flight.
pub(super) struct BackingTurn<'g> {
    first: u64,
    end: u64,
    _held: PhantomData<&'g ()>,
}

impl BackingTurn<'_> {
    /// Asserts that the byte range `offset..offset + len` is inside the turn's blocks.
    fn check(&self, offset: u64, len: u64, block_bytes: u64, op: &str) {
        let inside = offset >= self.first * block_bytes
            && offset.checked_add(len).is_some_and(|end| end <= self.end * block_bytes);
        assert!(
            inside,
            "{op} of bytes {offset}..+{len} outside the turn of blocks {}..{}",
            self.first, self.end
        );
    }
}

/// A guard of one stripe lock: what [`Engine::backing_turn`] borrows for as long as its turn
/// lasts.
pub(super) trait HoldsStripe {}

impl HoldsStripe for MutexGuard<'_, u64> {}

impl HoldsStripe for StripeGuard<'_> {}

/// The stripes of blocks `first..end`, held together (see [`Engine::hold_range`]).
pub(super) struct RangeHold<'e> {
    first: u64,
    end: u64,
    stripes: SmallVec<[usize; RANGE_HOLD_BLOCKS_MAX as usize]>,
    guards: SmallVec<[MutexGuard<'e, u64>; RANGE_HOLD_BLOCKS_MAX as usize]>,
}

impl RangeHold<'_> {
    /// The end of the blocks held (exclusive); they start where asked.
    pub(super) fn end(&self) -> u64 {
        self.end
    }

    /// The stripes held.
    pub(super) fn stripes(&self) -> &[usize] {
        &self.stripes
    }

    /// The last sequence number issued under `stripe`, one of those held (for
    /// `Engine::global_seq`).
    pub(super) fn stripe_last(&mut self, stripe: usize) -> &mut u64 {
        let at = self.stripes.iter().position(|&s| s == stripe).expect("a stripe of the hold");
        &mut self.guards[at]
    }

    /// The turn to write or discard the blocks held.
    pub(super) fn turn(&self) -> BackingTurn<'_> {
        BackingTurn { first: self.first, end: self.end, _held: PhantomData }
    }
}

impl<M: Medium, B: BackingStore, C: Clock> Engine<M, B, C> {
    /// The turn to write block `lba` to the backing store, whose stripe the caller holds
    /// (`held` is its guard): waits for the cleaner's copies of the stripe's blocks first.
    pub(super) fn backing_turn<'g>(&self, lba: u64, held: &'g impl HoldsStripe) -> BackingTurn<'g> {
        let _ = held;
        self.wait_cleaner_writes(self.stripe_index(lba));
        BackingTurn { first: lba, end: lba + 1, _held: PhantomData }
    }

    /// Holds the stripes of blocks `first..` — as many as it can, below `end` and at most
    /// `max_blocks` — and waits for the cleaner's copies of them. The first stripe is waited
    /// for; the others are only tried, and the run stops before the first block whose stripe
    /// another holds. At least block `first` is held.
    pub(super) fn hold_range(&self, first: u64, end: u64, max_blocks: u64) -> RangeHold<'_> {
        let hold = self.lock_range(first, end, max_blocks);
        for &stripe in &hold.stripes {
            self.wait_cleaner_writes(stripe);
        }
        hold
    }

    /// The locking half of [`Engine::hold_range`].
    fn lock_range(&self, first: u64, end: u64, max_blocks: u64) -> RangeHold<'_> {
        assert!(first < end, "an empty range {first}..{end} to hold");
        let last = end.min(first.saturating_add(max_blocks.max(1)));
        let mut hold =
            RangeHold { first, end: first, stripes: SmallVec::new(), guards: SmallVec::new() };
        for lba in first..last {
            let stripe = self.stripe_index(lba);
            if !hold.stripes.contains(&stripe) {
                let guard = if hold.guards.is_empty() {
                    self.lock_stripe_index(stripe)
                } else {
                    match self.stripes[stripe].try_lock() {
                        Some(guard) => guard,
                        None => break,
                    }
                };
                hold.stripes.push(stripe);
                hold.guards.push(guard);
            }
            hold.end = lba + 1;
        }
        hold
    }

    /// Waits, holding `stripe`, until no cleaner copy of its blocks is in flight.
    fn wait_cleaner_writes(&self, stripe: usize) {
        let mut spins = 0u32;
        while self.stripes[stripe].cleaning.load(Ordering::Acquire) != 0 {
            spins += 1;
            if spins < 64 {
                crate::sync::yield_now();
            } else {
                std::thread::sleep(Duration::from_micros(50));
            }
        }
    }

    /// Writes the backing store, in `turn`. Every write counts as one a later flush must sync,
    /// a failed one too: it may have changed part of its range (a short write, then an error)
    /// before a read admits that range as a clean block.
    pub(super) fn backing_write(&self, data: &[u8], offset: u64, turn: &BackingTurn) -> Result<()> {
        turn.check(offset, data.len() as u64, self.block_bytes(), "a backing write");
        let result = self.backing.write_at(data, offset);
        self.backing_writes.fetch_add(1, Ordering::SeqCst);
        self.backing_outcome(BackingOp::Write, result)
    }

    /// Queues a write of the backing store on a lane's `queue`, in `turn`; the caller raises
    /// the stripe's `writing` count before it releases the stripe (`through.rs`), which keeps
    /// every other writer of the block away until the write completed.
    pub(super) fn queue_backing_write(
        &self,
        queue: &mut dyn IoQueue,
        request: IoRequest,
        turn: &BackingTurn,
    ) {
        turn.check(request.offset, request.buf.len() as u64, self.block_bytes(), "a queued write");
        if let Err(refused) = queue.push(request) {
            // The queue holds READS_PENDING_MAX requests and the lane had a ticket free.
            panic!("the lane's queue refused write {} with room for it", refused.user_data);
        }
    }

    /// Writes zeroes over a range of the backing store, in `turn`.
    pub(super) fn backing_write_zeroes(
        &self,
        offset: u64,
        len: u64,
        turn: &BackingTurn,
    ) -> Result<()> {
        turn.check(offset, len, self.block_bytes(), "a backing write-zeroes");
        let result = self.backing.write_zeroes(offset, len);
        self.backing_writes.fetch_add(1, Ordering::SeqCst);
        self.backing_outcome(BackingOp::Write, result)
    }

    /// Discards a range of the backing store, in `turn`.
    pub(super) fn backing_discard(&self, offset: u64, len: u64, turn: &BackingTurn) -> Result<()> {
        turn.check(offset, len, self.block_bytes(), "a backing discard");
        let result = self.backing.discard(offset, len);
        self.backing_writes.fetch_add(1, Ordering::SeqCst);
        self.backing_outcome(BackingOp::Write, result)
    }

    fn block_bytes(&self) -> u64 {
        u64::from(self.layout.block_size)
    }
}
