//! A reference model of a block device and a harness that runs random or scripted operations
//! against the production engine, with power cuts, and checks every read against the model.

use std::sync::Arc;

use pmcache_backing::BackingStore;
use pmcache_media::numa::Topology;
use pmcache_media::{CrashMedium, CrashSwitch, Medium, MediumSet};
use rand::{Rng, SeedableRng};

use super::SimBacking;
use crate::{
    AdmissionConfig, CacheMode, Clock, Config, Engine, Error, EvictionKind, Lane, ManualClock,
    ReadRequest, WriteRequest,
};

/// Cache block size used by the model runs.
pub const BLOCK: usize = 512;
/// Blocks on the simulated device.
pub const BLOCKS: usize = 48;
/// Bytes on the simulated device.
pub const DEVICE_BYTES: u64 = (BLOCK * BLOCKS) as u64;
/// Sectors of the simulated device per block: a block's backing write may tear between them.
pub const SECTORS: usize = BLOCK / super::SIM_SECTOR_BYTES;
const SECTOR: usize = super::SIM_SECTOR_BYTES;
/// Medium size: 4 KiB superblock + 4 KiB metadata + 20 slots of 512 B.
pub const MEDIUM_BYTES: u64 = 8192 + 20 * BLOCK as u64;
/// Bytes of each member of a cache of several (16 slots each, the fewest a member may have).
pub const MEMBER_BYTES: u64 = 8192 + 16 * BLOCK as u64;

/// One operation of a workload.
#[derive(Clone, Debug)]
pub enum Op {
    /// Read a byte range.
    Read {
        /// Byte offset.
        offset: u64,
        /// Length.
        len: u64,
    },
    /// Write fresh data.
    Write {
        /// Byte offset.
        offset: u64,
        /// Length.
        len: u64,
        /// Force unit access.
        fua: bool,
    },
    /// Trim.
    Trim {
        /// Byte offset.
        offset: u64,
        /// Length.
        len: u64,
    },
    /// Write zeroes.
    WriteZeroes {
        /// Byte offset.
        offset: u64,
        /// Length.
        len: u64,
        /// Force unit access.
        fua: bool,
    },
    /// Several writes handed over as one batch (`Lane::write_batch`): `(offset, len)` each.
    WriteBatch {
        /// The writes, in batch order.
        writes: Vec<(u64, u64)>,
        /// Force unit access on every write.
        fua: bool,
    },
    /// Several reads handed over as one batch (`Lane::read_batch`): `(offset, len)` each.
    ReadBatch {
        /// The reads, in batch order.
        reads: Vec<(u64, u64)>,
    },
    /// Flush.
    Flush,
    /// Write back everything.
    Drain,
    /// Cut power between operations.
    PowerCut,
    /// Switch the cache mode (`Engine::set_mode`); dirty blocks stay dirty.
    SetMode {
        /// The new mode.
        mode: CacheMode,
    },
    /// From now on the backing store fails (EIO, changing nothing) every write, discard or
    /// zeroing that overlaps blocks `first..first + count`: bad sectors, or a path that fails
    /// some requests. Run by the harness ([`run_crash_case`]), not by a lane.
    FailBackingWrites {
        /// First block refused.
        first: u64,
        /// Blocks refused.
        count: u64,
    },
    /// From now on every backing read fails (EIO). Run by the harness.
    FailBackingReads,
    /// From now on every backing flush (`fdatasync`) fails (EIO), making nothing durable.
    /// Run by the harness.
    FailBackingFlushes,
    /// The backing store serves every request again. Run by the harness.
    HealBacking,
}

impl Op {
    /// Whether this operation changes the backing store's fault injection (run by the harness).
    pub fn is_backing_fault(&self) -> bool {
        matches!(
            self,
            Op::FailBackingWrites { .. }
                | Op::FailBackingReads
                | Op::FailBackingFlushes
                | Op::HealBacking
        )
    }
}

/// What a block may hold.
#[derive(Clone, Debug, PartialEq)]
pub enum Expect {
    /// One of these contents.
    OneOf(Vec<Vec<u8>>),
    /// One of `whole`, or a mix of `sectors`: each sector one of its own candidates,
    /// independently of the others. What a power cut leaves of a block whose backing write it
    /// may have torn (the device keeps or loses each sector) while the cache may hold a
    /// whole copy (`whole` lists those, a cached copy never tears).
    Torn {
        /// Whole-block candidates.
        whole: Vec<Vec<u8>>,
        /// Per sector, the candidates a torn backing write may leave there.
        sectors: Vec<Vec<Vec<u8>>>,
    },
    /// Anything (after a trim, until written again).
    Any,
    /// Known bytes and unknown ones: a trimmed block after partial writes (their bytes are
    /// known; the others may read as anything, and differently from one read to the next).
    Masked(Vec<Option<u8>>),
}

impl Expect {
    fn union(&self, other: &Expect) -> Expect {
        match (self, other) {
            (Expect::OneOf(a), Expect::OneOf(b)) => Expect::OneOf(union_of(a, b)),
            (Expect::OneOf(a), Expect::Torn { whole, sectors })
            | (Expect::Torn { whole, sectors }, Expect::OneOf(a)) => {
                Expect::torn(union_of(whole, a), sectors.clone())
            }
            (Expect::Torn { whole: a, sectors: x }, Expect::Torn { whole: b, sectors: y }) => {
                Expect::torn(union_of(a, b), union_per_sector(x, y))
            }
            _ => Expect::Any,
        }
    }

    /// These candidates whole, or any mix of the sectors of `mixable`'s: what a power cut
    /// leaves where the backing store may have torn a write of one of `mixable`'s values
    /// over another. Bytes only partly known (`Masked`) become unknown, as their sectors may
    /// revert to trimmed contents.
    fn torn_by(&self, mixable: &Expect) -> Expect {
        let per_sector = |values: &[Vec<u8>]| -> Vec<Vec<Vec<u8>>> {
            (0..SECTORS)
                .map(|s| {
                    let sectors: Vec<Vec<u8>> =
                        values.iter().map(|v| v[s * SECTOR..(s + 1) * SECTOR].to_vec()).collect();
                    union_of(&[], &sectors)
                })
                .collect()
        };
        let mixed = match mixable {
            Expect::OneOf(values) => per_sector(values),
            Expect::Torn { whole, sectors } => union_per_sector(&per_sector(whole), sectors),
            Expect::Any | Expect::Masked(_) => return Expect::Any,
        };
        match self {
            Expect::OneOf(whole) => Expect::torn(whole.clone(), mixed),
            Expect::Torn { whole, sectors } => {
                Expect::torn(whole.clone(), union_per_sector(sectors, &mixed))
            }
            Expect::Any | Expect::Masked(_) => Expect::Any,
        }
    }

    /// One of `whole`, or a mix of `sectors`: as `OneOf` where the mixes add nothing (a
    /// sector without candidates allows no mix; where every sector has one, the one mix is
    /// a whole candidate).
    fn torn(mut whole: Vec<Vec<u8>>, sectors: Vec<Vec<Vec<u8>>>) -> Expect {
        if sectors.iter().any(Vec::is_empty) {
            return Expect::OneOf(whole);
        }
        if sectors.iter().all(|candidates| candidates.len() == 1) {
            let only: Vec<u8> = sectors.into_iter().flatten().flatten().collect();
            if !whole.contains(&only) {
                whole.push(only);
            }
            return Expect::OneOf(whole);
        }
        Expect::Torn { whole, sectors }
    }

    /// `piece` written at `in_block` over these contents (a partial write's merge).
    fn overlaid(&self, in_block: usize, piece: &[u8]) -> Expect {
        let end = in_block + piece.len();
        match self {
            Expect::OneOf(values) => Expect::OneOf(overlay_each(values, in_block, piece)),
            Expect::Torn { whole, sectors } => Expect::torn(
                overlay_each(whole, in_block, piece),
                sectors
                    .iter()
                    .enumerate()
                    .map(|(s, candidates)| {
                        let (from, to) = (in_block.max(s * SECTOR), end.min((s + 1) * SECTOR));
                        if from >= to {
                            return candidates.clone();
                        }
                        overlay_each(
                            candidates,
                            from - s * SECTOR,
                            &piece[from - in_block..to - in_block],
                        )
                    })
                    .collect(),
            ),
            Expect::Any | Expect::Masked(_) => self.masked_with(in_block, piece),
        }
    }

    /// `piece` written at `in_block` into a block of which only some bytes are known.
    fn masked_with(&self, in_block: usize, piece: &[u8]) -> Expect {
        let mut bytes = match self {
            Expect::Masked(bytes) => bytes.clone(),
            _ => vec![None; BLOCK],
        };
        for (byte, &value) in bytes[in_block..in_block + piece.len()].iter_mut().zip(piece) {
            *byte = Some(value);
        }
        Expect::from_masked(bytes)
    }

    fn from_masked(bytes: Vec<Option<u8>>) -> Expect {
        match bytes.iter().copied().collect::<Option<Vec<u8>>>() {
            Some(known) => Expect::OneOf(vec![known]),
            None => Expect::Masked(bytes),
        }
    }
}

/// Each of `values` with `bytes` written at `at`, without repeats.
fn overlay_each(values: &[Vec<u8>], at: usize, bytes: &[u8]) -> Vec<Vec<u8>> {
    let mut out: Vec<Vec<u8>> = Vec::new();
    for value in values {
        let mut merged = value.clone();
        merged[at..at + bytes.len()].copy_from_slice(bytes);
        if !out.contains(&merged) {
            out.push(merged);
        }
    }
    out
}

/// Per sector, `a`'s candidates and those of `b` it lacks.
fn union_per_sector(a: &[Vec<Vec<u8>>], b: &[Vec<Vec<u8>>]) -> Vec<Vec<Vec<u8>>> {
    a.iter().zip(b).map(|(a, b)| union_of(a, b)).collect()
}

/// `a` and the values of `b` it lacks.
fn union_of(a: &[Vec<u8>], b: &[Vec<u8>]) -> Vec<Vec<u8>> {
    let mut all = a.to_vec();
    for value in b {
        if !all.contains(value) {
            all.push(value.clone());
        }
    }
    all
}

#[derive(Clone, Debug)]
struct BlockModel {
    current: Expect,
    /// What a power cut may leave.
    durable: Expect,
    /// Where writes went to the backing store and it has not been flushed since: the values
    /// it may hold, of which a power cut may leave any mix of sectors, beside `durable`'s
    /// whole candidates. `None` where no write may tear. (A copy in the cache, where the
    /// write-back modes' writes go, never tears: it is whole or absent.)
    tear: Option<Expect>,
    /// Not written or trimmed since the last power cut: what the block holds now is what a
    /// power cut leaves (a block never changes without a write), so a read narrows both.
    settled: bool,
}

/// The reference model.
#[derive(Clone)]
pub struct Model {
    blocks: Vec<BlockModel>,
    durable_at_ack: bool,
    writes: u64,
    /// Whole blocks from which the engine zeroes uncached blocks on the backing store in a
    /// write-back mode (`Engine::set_zero_through_blocks_min`).
    zero_through_blocks_min: u64,
}

/// Bytes of the `id`-th write: unique per write and position.
pub fn pattern(id: u64, offset: u64, len: u64) -> Vec<u8> {
    (0..len).map(|i| ((id.wrapping_mul(131) + (offset + i) * 7) % 251) as u8 + 1).collect()
}

fn block_pieces(offset: u64, len: u64) -> Vec<(usize, usize, usize)> {
    let mut out = Vec::new();
    let mut at = offset;
    while at < offset + len {
        let block = (at / BLOCK as u64) as usize;
        let in_block = (at % BLOCK as u64) as usize;
        let n = (BLOCK - in_block).min((offset + len - at) as usize);
        out.push((block, in_block, n));
        at += n as u64;
    }
    out
}

impl Model {
    /// All zeroes, for a device used in `mode`.
    pub fn new(mode: CacheMode) -> Self {
        let zero = Expect::OneOf(vec![vec![0u8; BLOCK]]);
        Self {
            blocks: vec![
                BlockModel {
                    current: zero.clone(),
                    durable: zero,
                    tear: None,
                    settled: true
                };
                BLOCKS
            ],
            durable_at_ack: mode.writes_back(),
            writes: 0,
            zero_through_blocks_min: u64::MAX,
        }
    }

    /// Follows the engine's `set_zero_through_blocks_min`.
    pub fn set_zero_through_blocks_min(&mut self, blocks: u64) {
        self.zero_through_blocks_min = blocks.max(1);
    }

    /// The data the next write op will carry.
    pub fn next_write_data(&mut self, offset: u64, len: u64) -> Vec<u8> {
        self.writes += 1;
        pattern(self.writes, offset, len)
    }

    fn write_blocks(&mut self, offset: u64, data: &[u8], fua: bool, certain: bool) {
        let mut done = 0;
        for (block, in_block, n) in block_pieces(offset, data.len() as u64) {
            let piece = data[done..done + n].to_vec();
            done += n;
            let model = &mut self.blocks[block];
            model.settled = false;
            let new = if n == BLOCK {
                Expect::OneOf(vec![piece])
            } else {
                model.current.overlaid(in_block, &piece)
            };
            if !self.durable_at_ack {
                // The write goes to the backing store, which may keep any of its sectors
                // over any of what it held before, until a flush.
                let before = model.tear.as_ref().unwrap_or(&model.durable);
                model.tear = Some(before.union(&new));
            }
            if certain && (self.durable_at_ack || fua) {
                model.durable = new.clone();
                model.tear = None;
            } else {
                model.durable = model.durable.union(&new);
            }
            model.current = if certain { new } else { model.current.union(&new) };
        }
    }

    fn trim_blocks(&mut self, offset: u64, len: u64) {
        let first = offset.div_ceil(BLOCK as u64);
        let end = (offset + len) / BLOCK as u64;
        for block in first..end {
            self.blocks[block as usize] = BlockModel {
                current: Expect::Any,
                durable: Expect::Any,
                tear: None,
                settled: false,
            };
        }
    }

    /// Applies a completed operation; `data` is what a write carried (a batch's writes'
    /// data one after another).
    pub fn apply(&mut self, op: &Op, data: &[u8]) {
        match *op {
            Op::Write { offset, fua, .. } => self.write_blocks(offset, data, fua, true),
            Op::WriteBatch { ref writes, fua } => {
                let mut done = 0;
                for &(offset, len) in writes {
                    self.write_blocks(offset, &data[done..done + len as usize], fua, true);
                    done += len as usize;
                }
            }
            Op::WriteZeroes { offset, len, fua } => {
                self.write_blocks(offset, &vec![0u8; len as usize], fua, true)
            }
            Op::Trim { offset, len } => self.trim_blocks(offset, len),
            Op::Flush | Op::Drain => {
                for block in &mut self.blocks {
                    block.durable = block.current.clone();
                    block.tear = None;
                }
            }
            // Writes are durable at their acknowledgement in the modes that write back. In the
            // others a write is durable after the next flush — or at once, where it replaced a
            // dirty cached copy (the engine syncs the backing store first), which the model
            // does not count on: it only keeps more candidates than the engine can show.
            Op::SetMode { mode } => self.durable_at_ack = mode.writes_back(),
            Op::Read { .. }
            | Op::ReadBatch { .. }
            | Op::PowerCut
            | Op::FailBackingWrites { .. }
            | Op::FailBackingReads
            | Op::FailBackingFlushes
            | Op::HealBacking => {}
        }
    }

    /// Applies an operation that failed with a backing-store error: what the engine promises
    /// of a failed request is what a power cut inside it leaves (each block it writes holds
    /// its old or its new data, a trimmed block anything), and nothing else changes — a
    /// failed flush or drain makes nothing durable, a failed read changes nothing.
    pub fn apply_failed(&mut self, op: &Op, data: &[u8]) {
        self.apply_uncertain(op, data);
    }

    /// Applies a batch in which some requests failed (`succeeded` per request, in batch
    /// order): each acknowledged write as acknowledged, each failed one as `apply_failed`;
    /// checks the reads that succeeded (`reads`).
    fn apply_partly_failed(
        &mut self,
        op: &Op,
        data: &[u8],
        succeeded: &[bool],
        reads: &[(u64, Vec<u8>)],
    ) -> Result<(), String> {
        match op {
            Op::WriteBatch { writes, fua } => {
                let mut done = 0;
                for (&(offset, len), &ok) in writes.iter().zip(succeeded) {
                    let one = Op::Write { offset, len, fua: *fua };
                    let piece = &data[done..done + len as usize];
                    done += len as usize;
                    if ok { self.apply(&one, piece) } else { self.apply_failed(&one, piece) }
                }
                Ok(())
            }
            Op::ReadBatch { .. } => {
                reads.iter().try_for_each(|(offset, bytes)| self.check_read(*offset, bytes))
            }
            _ => {
                self.apply_failed(op, data);
                Ok(())
            }
        }
    }

    /// Applies an operation that a power cut interrupted: each block is old or new.
    pub fn apply_uncertain(&mut self, op: &Op, data: &[u8]) {
        match *op {
            Op::Write { offset, fua, .. } => self.write_blocks(offset, data, fua, false),
            Op::WriteBatch { ref writes, fua } => {
                let mut done = 0;
                for &(offset, len) in writes {
                    self.write_blocks(offset, &data[done..done + len as usize], fua, false);
                    done += len as usize;
                }
            }
            Op::WriteZeroes { offset, len, fua } => {
                // Many whole blocks in a write-back mode go to the backing store directly
                // (those not cached): interrupted, such a block may hold a mix of sectors of
                // what it held and zeroes, as a disk's write may.
                let (first, end) = (offset.div_ceil(BLOCK as u64), (offset + len) / BLOCK as u64);
                let through = self.durable_at_ack
                    && end > first
                    && end - first >= self.zero_through_blocks_min;
                let before: Vec<Expect> = (first..end.max(first))
                    .map(|b| {
                        let model = &self.blocks[b as usize];
                        model.tear.clone().unwrap_or_else(|| model.durable.clone())
                    })
                    .collect();
                self.write_blocks(offset, &vec![0u8; len as usize], fua, false);
                if through {
                    let zero = Expect::OneOf(vec![vec![0u8; BLOCK]]);
                    for (b, before) in (first..end).zip(before) {
                        self.blocks[b as usize].tear = Some(before.union(&zero));
                    }
                }
            }
            Op::Trim { offset, len } => self.trim_blocks(offset, len),
            _ => {}
        }
    }

    /// Takes block `block`'s expectations from `other` (a model of the same device).
    fn take_block(&mut self, other: &Model, block: usize) {
        self.blocks[block] = other.blocks[block].clone();
    }

    /// Widens every block to what either this model or `other` allows (two orders of the same
    /// operations, when which one happened is not known).
    fn widen_to(&mut self, other: &Model) {
        for (mine, theirs) in self.blocks.iter_mut().zip(&other.blocks) {
            mine.current = mine.current.union(&theirs.current);
            mine.durable = mine.durable.union(&theirs.durable);
            mine.tear = match (&mine.tear, &theirs.tear) {
                (None, None) => None,
                (Some(a), None) | (None, Some(a)) => Some(a.clone()),
                (Some(a), Some(b)) => Some(a.union(b)),
            };
            mine.settled &= theirs.settled;
        }
    }

    /// Power is lost: each block now holds one of its durable candidates (or, where the
    /// backing store may have torn a write, a mix of their sectors).
    pub fn power_cut(&mut self) {
        for block in &mut self.blocks {
            if let Some(tear) = block.tear.take() {
                block.durable = block.durable.torn_by(&tear);
            }
            block.current = block.durable.clone();
            block.settled = true;
        }
    }

    /// Checks a read of `offset..offset + data.len()` and narrows the candidates.
    pub fn check_read(&mut self, offset: u64, data: &[u8]) -> Result<(), String> {
        let mut done = 0;
        for (block, in_block, n) in block_pieces(offset, data.len() as u64) {
            let got = &data[done..done + n];
            done += n;
            let model = &mut self.blocks[block];
            match &model.current {
                Expect::OneOf(values) => {
                    let matching: Vec<Vec<u8>> = values
                        .iter()
                        .filter(|v| &v[in_block..in_block + n] == got)
                        .cloned()
                        .collect();
                    if matching.is_empty() {
                        // Where the read first differs from each candidate, and how many of
                        // its bytes do.
                        let differences: Vec<(usize, usize)> = values
                            .iter()
                            .map(|v| {
                                let wanted = &v[in_block..in_block + n];
                                let first = wanted.iter().zip(got).position(|(w, g)| w != g);
                                let count = wanted.iter().zip(got).filter(|(w, g)| w != g).count();
                                (in_block + first.unwrap_or(0), count)
                            })
                            .collect();
                        return Err(format!(
                            "block {block} bytes {in_block}..{}: read {:?}..., expected one of {} candidates starting {:?} (first differing byte, bytes differing: {differences:?})",
                            in_block + n,
                            &got[..got.len().min(8)],
                            values.len(),
                            values
                                .iter()
                                .map(|v| v[in_block..in_block + n.min(8)].to_vec())
                                .collect::<Vec<_>>()
                        ));
                    }
                    model.current = Expect::OneOf(matching);
                }
                Expect::Torn { whole, sectors } => {
                    let whole_matching: Vec<Vec<u8>> = whole
                        .iter()
                        .filter(|v| &v[in_block..in_block + n] == got)
                        .cloned()
                        .collect();
                    let mut narrowed = Vec::with_capacity(SECTORS);
                    let mut unmatched = None;
                    for (s, candidates) in sectors.iter().enumerate() {
                        let (from, to) =
                            (in_block.max(s * SECTOR), (in_block + n).min((s + 1) * SECTOR));
                        if from >= to {
                            narrowed.push(candidates.clone());
                            continue;
                        }
                        let read = &got[from - in_block..to - in_block];
                        let matching: Vec<Vec<u8>> = candidates
                            .iter()
                            .filter(|c| &c[from - s * SECTOR..to - s * SECTOR] == read)
                            .cloned()
                            .collect();
                        if matching.is_empty() && unmatched.is_none() {
                            unmatched = Some((s, from, to, read, candidates));
                        }
                        narrowed.push(matching);
                    }
                    if let Some((s, from, to, read, candidates)) = unmatched
                        && whole_matching.is_empty()
                    {
                        return Err(format!(
                            "block {block} bytes {in_block}..{}: no whole candidate of {} matches, and sector {s} bytes {from}..{to} read {:?}..., not one of its {} candidates starting {:?}",
                            in_block + n,
                            whole.len(),
                            &read[..read.len().min(8)],
                            candidates.len(),
                            candidates
                                .iter()
                                .map(|c| c[from - s * SECTOR..][..8.min(to - from)].to_vec())
                                .collect::<Vec<_>>()
                        ));
                    }
                    model.current = Expect::torn(whole_matching, narrowed);
                }
                Expect::Masked(bytes) => {
                    let known = &bytes[in_block..in_block + n];
                    if let Some(at) =
                        known.iter().zip(got).position(|(k, g)| k.is_some_and(|k| k != *g))
                    {
                        return Err(format!(
                            "block {block} byte {}: read {:#x}, but a write put {:#x} there",
                            in_block + at,
                            got[at],
                            known[at].expect("known")
                        ));
                    }
                }
                // A trimmed block's contents are unspecified until it is written (the NBD
                // spec's TRIM): not even stable. After a power cut between a trim's discard
                // and the drop of a cached copy, the clean copy and the backing store may
                // differ, and which one a read returns depends on whether the copy is still
                // cached.
                Expect::Any => {}
            }
            if model.settled {
                model.durable = model.current.clone();
            }
        }
        Ok(())
    }

    /// Checks the backing store after a drain: every block with one known value holds it.
    pub fn check_backing(&self, backing: &[u8]) -> Result<(), String> {
        for (block, model) in self.blocks.iter().enumerate() {
            if let Expect::OneOf(values) = &model.current
                && values.len() == 1
                && backing[block * BLOCK..(block + 1) * BLOCK] != values[0][..]
            {
                return Err(format!("after drain, backing block {block} does not hold the data"));
            }
        }
        Ok(())
    }
}

/// The simulated cache medium: a set of crash-simulating members (one for most runs).
pub type SimMedium = MediumSet<CrashMedium>;

/// The engine on simulated parts.
pub type SimEngine = Engine<SimMedium, SimBacking, Arc<ManualClock>>;

/// A medium and a backing store cut by one switch.
pub struct World {
    /// The switch.
    pub switch: Arc<CrashSwitch>,
    /// The cache medium.
    pub medium: SimMedium,
    /// The backing store.
    pub backing: SimBacking,
}

impl World {
    /// New, zeroed parts. Half the seeds give a backing store with a queue (the engine's
    /// queued paths run), half one without (its one-call-at-a-time paths run).
    pub fn fresh(seed: u64) -> Self {
        Self::fresh_set(seed, 1)
    }

    /// [`World::fresh`] with a cache medium of `members` members: one of `MEDIUM_BYTES`, or
    /// several of `MEMBER_BYTES`, member `i` on node `i` (of [`simulated_topology`]).
    pub fn fresh_set(seed: u64, members: usize) -> Self {
        let switch = CrashSwitch::new();
        let backing = SimBacking::new(DEVICE_BYTES, switch.clone(), seed ^ 0xabc);
        backing.set_queued(seed & 1 == 1);
        let medium = if members == 1 {
            MediumSet::single(CrashMedium::new(MEDIUM_BYTES, switch.clone(), seed))
        } else {
            MediumSet::new(
                (0..members)
                    .map(|i| {
                        let medium =
                            CrashMedium::new(MEMBER_BYTES, switch.clone(), seed + i as u64);
                        (medium, Some(i as u32))
                    })
                    .collect(),
            )
        };
        Self { medium, backing, switch }
    }

    /// The world a power cut leaves behind (the switch must have cut power).
    pub fn after_power_cut(&self, seed: u64) -> Self {
        let switch = CrashSwitch::new();
        let backing_image = self.backing.crash_image().expect("power was cut");
        let backing = SimBacking::from_image(backing_image, switch.clone(), seed ^ 0xabc);
        backing.set_queued(self.backing.is_queued());
        let nodes: Vec<Option<u32>> = self.medium.members().iter().map(|m| m.node).collect();
        let medium = MediumSet::new(
            self.medium
                .media()
                .zip(nodes)
                .enumerate()
                .map(|(i, (member, node))| {
                    let image = member.crash_image().expect("power was cut");
                    (CrashMedium::from_image(image, switch.clone(), seed + i as u64), node)
                })
                .collect(),
        );
        Self { medium, backing, switch }
    }
}

/// A machine of `nodes` nodes, every other node 21 away, with `MEMBERS_MAX` CPUs dealt
/// round-robin (CPU `c` on node `c % nodes`): what model runs of a cache of several members
/// place on.
pub fn simulated_topology(nodes: usize) -> Topology {
    let distances =
        (0..nodes).map(|i| (0..nodes).map(|j| if i == j { 10 } else { 21 }).collect()).collect();
    let cpu_node = (0..pmcache_media::MEMBERS_MAX).map(|cpu| (cpu % nodes) as u32).collect();
    Topology::simulated(cpu_node, distances)
}

thread_local! {
    static NEXT_CPU: std::cell::Cell<usize> = const { std::cell::Cell::new(0) };
}

/// A simulated `sched_getcpu` for model runs: each call on a thread says the next CPU (of
/// [`simulated_topology`]'s), as if the thread moved at every refill, so
/// that one thread's writes land on every member of the set in turn and fall back when one
/// is full.
pub fn rotating_cpu() -> Option<usize> {
    Some(NEXT_CPU.with(|next| {
        let cpu = next.get();
        next.set(cpu.wrapping_add(1));
        cpu % pmcache_media::MEMBERS_MAX
    }))
}

/// A configuration for the model runs.
pub fn config(mode: CacheMode, eviction: EvictionKind, admission: AdmissionConfig) -> Config {
    Config {
        mode,
        block_size: BLOCK as u32,
        max_lanes: 2,
        admission,
        eviction,
        ..Config::default()
    }
}

/// What one operation did.
#[derive(Clone, Default)]
pub struct Done {
    /// The data its writes carried, one after another.
    pub data: Vec<u8>,
    /// What its reads returned: (offset, bytes).
    pub reads: Vec<(u64, Vec<u8>)>,
}

impl Done {
    /// Checks every read against the model (narrowing its candidates).
    pub fn check_reads(&self, model: &mut Model) -> Result<(), String> {
        self.reads.iter().try_for_each(|(offset, bytes)| model.check_read(*offset, bytes))
    }
}

/// The data a write operation will carry (one buffer per write; none for other operations),
/// drawn from the model's sequence of unique patterns.
pub fn write_data_for(model: &mut Model, op: &Op) -> Vec<Vec<u8>> {
    match *op {
        Op::Write { offset, len, .. } => vec![model.next_write_data(offset, len)],
        Op::WriteBatch { ref writes, .. } => {
            writes.iter().map(|&(offset, len)| model.next_write_data(offset, len)).collect()
        }
        _ => Vec::new(),
    }
}

/// Runs one operation on a lane.
pub fn run_op<M: Medium, B: BackingStore, C: Clock>(
    lane: &mut Lane<'_, M, B, C>,
    model: &mut Model,
    op: &Op,
) -> Result<Done, String> {
    let datas = write_data_for(model, op);
    execute_op(lane, op, datas).map_err(|failure| failure.message)
}

/// Why an operation failed (a batch: why some of its requests did).
#[derive(Clone, Debug, Default)]
pub struct OpFailure {
    /// The operation and the (first) error.
    pub message: String,
    /// Some error is the backing store's I/O error (`Error::Backing`).
    pub backing_io: bool,
    /// Some error is `Error::BackingSyncFailedBefore` (after a failed sync).
    pub sync_failed_before: bool,
    /// Some error is neither.
    pub other: bool,
    /// For a batch: which requests succeeded, in batch order.
    pub succeeded: Vec<bool>,
    /// For a read batch: what the reads that succeeded returned.
    pub reads: Vec<(u64, Vec<u8>)>,
}

impl OpFailure {
    fn of(op: &Op, errors: &[&Error]) -> Self {
        let mut failure =
            OpFailure { message: format!("{op:?} failed: {}", errors[0]), ..OpFailure::default() };
        for e in errors {
            match e {
                Error::Backing(_) => failure.backing_io = true,
                Error::BackingSyncFailedBefore => failure.sync_failed_before = true,
                _ => failure.other = true,
            }
        }
        failure
    }
}

impl From<String> for OpFailure {
    fn from(message: String) -> Self {
        Self { message, other: true, ..OpFailure::default() }
    }
}

/// Runs one operation on a lane with the data `write_data_for` drew for it.
pub fn execute_op<M: Medium, B: BackingStore, C: Clock>(
    lane: &mut Lane<'_, M, B, C>,
    op: &Op,
    datas: Vec<Vec<u8>>,
) -> Result<Done, OpFailure> {
    let fail = |e: Error| OpFailure::of(op, &[&e]);
    let nothing = |_| Done::default();
    match *op {
        Op::Read { offset, len } => {
            let mut buf = vec![0u8; len as usize];
            lane.read(offset, &mut buf).map_err(fail)?;
            Ok(Done { data: Vec::new(), reads: vec![(offset, buf)] })
        }
        Op::Write { offset, fua, .. } => {
            let data = datas.concat();
            lane.write(offset, &data, fua).map_err(fail)?;
            Ok(Done { data, reads: Vec::new() })
        }
        Op::WriteBatch { ref writes, fua } => {
            let requests: Vec<WriteRequest<'_>> = writes
                .iter()
                .zip(&datas)
                .map(|(&(offset, _), data)| WriteRequest { offset, data, fua })
                .collect();
            let mut outcomes = Vec::new();
            lane.write_batch(&requests, &mut outcomes);
            assert_eq!(outcomes.len(), writes.len(), "one outcome per write");
            let errors: Vec<&Error> = outcomes.iter().filter_map(|o| o.as_ref().err()).collect();
            if !errors.is_empty() {
                return Err(OpFailure {
                    succeeded: outcomes.iter().map(Result::is_ok).collect(),
                    ..OpFailure::of(op, &errors)
                });
            }
            Ok(Done { data: datas.concat(), reads: Vec::new() })
        }
        Op::ReadBatch { ref reads } => {
            let mut bufs: Vec<Vec<u8>> =
                reads.iter().map(|&(_, len)| vec![0u8; len as usize]).collect();
            let mut requests: Vec<ReadRequest<'_>> = reads
                .iter()
                .zip(bufs.iter_mut())
                .map(|(&(offset, _), buf)| ReadRequest { offset, buf })
                .collect();
            let mut outcomes = Vec::new();
            lane.read_batch(&mut requests, &mut outcomes);
            drop(requests);
            assert_eq!(outcomes.len(), reads.len(), "one outcome per read");
            let done: Vec<(u64, Vec<u8>)> =
                reads.iter().map(|&(offset, _)| offset).zip(bufs).collect();
            let errors: Vec<&Error> = outcomes.iter().filter_map(|o| o.as_ref().err()).collect();
            if !errors.is_empty() {
                return Err(OpFailure {
                    succeeded: outcomes.iter().map(Result::is_ok).collect(),
                    reads: done
                        .into_iter()
                        .zip(&outcomes)
                        .filter(|(_, o)| o.is_ok())
                        .map(|(read, _)| read)
                        .collect(),
                    ..OpFailure::of(op, &errors)
                });
            }
            Ok(Done { data: Vec::new(), reads: done })
        }
        Op::Trim { offset, len } => lane.trim(offset, len).map(nothing).map_err(fail),
        Op::WriteZeroes { offset, len, fua } => {
            lane.write_zeroes(offset, len, fua).map(nothing).map_err(fail)
        }
        Op::Flush => lane.flush().map(nothing).map_err(fail),
        Op::Drain => lane.drain().map(nothing).map_err(fail),
        Op::PowerCut => Ok(Done::default()),
        Op::SetMode { mode } => {
            lane.engine().set_mode(mode);
            Ok(Done::default())
        }
        Op::FailBackingWrites { .. }
        | Op::FailBackingReads
        | Op::FailBackingFlushes
        | Op::HealBacking => {
            Err(format!("{op:?}: backing faults are injected by run_crash_case, not a lane").into())
        }
    }
}

/// Reads every block and checks it against the model.
pub fn verify_all<M: Medium, B: BackingStore, C: Clock>(
    lane: &mut Lane<'_, M, B, C>,
    model: &mut Model,
) -> Result<(), String> {
    for block in 0..BLOCKS as u64 {
        let mut buf = vec![0u8; BLOCK];
        lane.read(block * BLOCK as u64, &mut buf).map_err(|e| format!("verify read: {e}"))?;
        model.check_read(block * BLOCK as u64, &buf).map_err(|e| format!("after recovery: {e}"))?;
    }
    Ok(())
}

/// Settings of one crash run.
#[derive(Clone, Debug)]
pub struct CrashRun {
    /// Cache mode.
    pub mode: CacheMode,
    /// Eviction policy.
    pub eviction: EvictionKind,
    /// Admission policy.
    pub admission: AdmissionConfig,
    /// Cut power at this persist point of the first segment (None: only explicit cuts).
    pub cut_at_point: Option<u64>,
    /// Cut power again at this point during the recovery that follows the first cut.
    pub cut_during_recovery_at: Option<u64>,
    /// Seed of every random choice of the simulated parts.
    pub seed: u64,
    /// Buckets of the index (`Config::index_buckets`; `Some(2)` for this model's 20 slots
    /// makes blocks compete for index room).
    pub index_buckets: Option<u64>,
    /// Run some pairs of consecutive operations on disjoint blocks on the two lanes at once
    /// (chosen from `seed`), so that power is also cut while two operations are in flight.
    pub concurrent_pairs: bool,
    /// With `concurrent_pairs`: pairs may also be two writes, trims or write-zeroes that touch
    /// the same blocks (not while backing faults are injected). The engine must end them as one
    /// of their two orders, block by block: after the pair, each block both touched is read
    /// back and the model takes that block from whichever order the read matches (a power
    /// cut inside the pair allows what either order allows).
    pub overlapping_pairs: bool,
    /// Run a cleaner with these settings on a thread of its own beside the workload, in every
    /// segment (the engine then has a third lane for it): power is cut inside its batches, it
    /// writes back blocks the workload overwrites, and writers that find no slot stall on it.
    pub cleaner: Option<crate::CleanerConfig>,
    /// Members of the cache medium (1: one medium; more: one per simulated node, each
    /// `MEMBER_BYTES`, the lanes' threads moving from node to node at every refill).
    pub members: usize,
    /// Format with a checksum of each slot's data (`Config::data_crc`): every hit and
    /// write-back checks it, so a checksum that is not durable with its entry shows as an
    /// error after a cut.
    pub data_crc: bool,
}

impl Default for CrashRun {
    /// Write-back, CLOCK, every miss admitted, one member, no cut but the script's, seed 0, and
    /// nothing else: a case names only what it is about.
    fn default() -> Self {
        Self {
            mode: CacheMode::WriteBack,
            eviction: EvictionKind::Clock,
            admission: AdmissionConfig::Always,
            cut_at_point: None,
            cut_during_recovery_at: None,
            seed: 0,
            index_buckets: None,
            concurrent_pairs: false,
            overlapping_pairs: false,
            cleaner: None,
            members: 1,
            data_crc: false,
        }
    }
}

/// Stops the engine's cleaner when dropped: a segment that ends early (an error) must not leave
/// its scope waiting for a cleaner thread that never stops.
struct StopCleaner<'e, M: Medium, B: BackingStore, C: Clock>(&'e Engine<M, B, C>);

impl<M: Medium, B: BackingStore, C: Clock> Drop for StopCleaner<'_, M, B, C> {
    fn drop(&mut self) {
        self.0.stop_cleaner();
    }
}

/// The blocks an operation that may run beside another touches (`None`: it must run alone —
/// flushes, drains, mode switches and cuts order or cover other operations).
fn blocks_touched(op: &Op) -> Option<Vec<u64>> {
    let range = |offset: u64, len: u64| {
        let block = BLOCK as u64;
        if len == 0 { 0..0 } else { offset / block..(offset + len - 1) / block + 1 }
    };
    match op {
        Op::Read { offset, len }
        | Op::Write { offset, len, .. }
        | Op::Trim { offset, len }
        | Op::WriteZeroes { offset, len, .. } => Some(range(*offset, *len).collect()),
        Op::WriteBatch { writes, .. } => {
            Some(writes.iter().flat_map(|&(offset, len)| range(offset, len)).collect())
        }
        Op::ReadBatch { reads } => {
            Some(reads.iter().flat_map(|&(offset, len)| range(offset, len)).collect())
        }
        Op::Flush
        | Op::Drain
        | Op::PowerCut
        | Op::SetMode { .. }
        | Op::FailBackingWrites { .. }
        | Op::FailBackingReads
        | Op::FailBackingFlushes
        | Op::HealBacking => None,
    }
}

/// Whether `a` and `b` may run at once: neither orders the other, and no block is in both —
/// or one is a mode switch and the other a request, which runs in either mode.
fn may_run_together(a: &Op, b: &Op) -> bool {
    match (blocks_touched(a), blocks_touched(b)) {
        (Some(a), Some(b)) => a.iter().all(|block| !b.contains(block)),
        (Some(_), None) => matches!(b, Op::SetMode { .. }),
        (None, Some(_)) => matches!(a, Op::SetMode { .. }),
        (None, None) => false,
    }
}

/// Whether `a` and `b` may run at once although they touch the same blocks: both change
/// blocks (a write, a batch of writes, a trim, a write-zeroes), or one reads and the other
/// changes exactly one block the read covers, once (the read then ran wholly before or after
/// that block's change, which the model tells apart by its data; a batch writing the block
/// twice has a state between its two writes, which a read beside it may see).
fn may_overlap(a: &Op, b: &Op) -> bool {
    let changes = |op: &Op| {
        matches!(
            op,
            Op::Write { .. } | Op::WriteBatch { .. } | Op::Trim { .. } | Op::WriteZeroes { .. }
        )
    };
    let reads = |op: &Op| matches!(op, Op::Read { .. } | Op::ReadBatch { .. });
    let changed_once = |changer: &Op, block: u64| {
        blocks_touched(changer)
            .is_some_and(|blocks| blocks.iter().filter(|&&touched| touched == block).count() == 1)
    };
    if changes(a) && changes(b) {
        return true;
    }
    let changer = match (reads(a) && changes(b), changes(a) && reads(b)) {
        (true, _) => b,
        (_, true) => a,
        _ => return false,
    };
    matches!(blocks_in_both(a, b)[..], [block] if changed_once(changer, block))
}

/// Settles a mode switch and a request that ran at once: the request ran in the old mode or
/// the new one, so it is durable at its acknowledgement only if both modes make it so.
fn settle_beside_mode_switch(
    model: &mut Model,
    pair: [&Op; 2],
    data: &[Vec<u8>],
    results: [(Result<Done, OpFailure>, bool); 2],
    faults: Faults,
    outcome: &mut RunOutcome,
) -> Result<(), String> {
    let switch_at = usize::from(!matches!(pair[0], Op::SetMode { .. }));
    let Op::SetMode { mode } = *pair[switch_at] else {
        unreachable!("one of the pair is a mode switch");
    };
    let [first, second] = results;
    let (request, switch) = if switch_at == 0 { (second, first) } else { (first, second) };
    let durable_at_ack = model.durable_at_ack;
    model.durable_at_ack = durable_at_ack && mode.writes_back();
    settle(
        model,
        pair[1 - switch_at],
        &data[1 - switch_at],
        request.0,
        request.1,
        faults,
        outcome,
    )?;
    model.durable_at_ack = durable_at_ack;
    settle(model, pair[switch_at], &[], switch.0, switch.1, faults, outcome)
}

/// The blocks both `a` and `b` touch.
fn blocks_in_both(a: &Op, b: &Op) -> Vec<u64> {
    match (blocks_touched(a), blocks_touched(b)) {
        (Some(a), Some(b)) => {
            let mut both: Vec<u64> = a.into_iter().filter(|block| b.contains(block)).collect();
            both.sort_unstable();
            both.dedup();
            both
        }
        _ => Vec::new(),
    }
}

/// What a run did, for the enumeration tests.
#[derive(Debug, Default)]
pub struct RunOutcome {
    /// Persist points counted before the first power cut (or the end).
    pub persist_points_first_segment: u64,
    /// In a run without power cuts, every persist point counted, re-attaches included.
    pub persist_points_without_cuts: u64,
    /// Power cuts that happened.
    pub power_cuts: u64,
    /// Of those, cuts that landed inside a recovery.
    pub cuts_during_recovery: u64,
    /// Of those, cuts that landed while two operations were in flight.
    pub cuts_during_pairs: u64,
    /// Pairs run at once that touched the same blocks (`CrashRun::overlapping_pairs`).
    pub overlapping_pairs: u64,
    /// Pairs run at once of which one was a mode switch (`CrashRun::concurrent_pairs`).
    pub pairs_beside_mode_switches: u64,
    /// Backing-store fault operations run (`Op::FailBacking*`, `Op::HealBacking`).
    pub backing_fault_ops: u64,
    /// Operations that failed with a backing-store error while faults were injected.
    pub failed_ops: u64,
    /// Clean re-attaches after segments with injected faults (see `run_crash_case`).
    pub reattaches: u64,
    /// Blocks the cleaner wrote back and marked clean (`CrashRun::cleaner`), over all segments.
    pub cleaner_blocks_cleaned: u64,
}

/// How a segment of a crash run ended.
enum SegmentEnd {
    /// Every operation ran, and the final drain and checks passed.
    Finished,
    /// Power was cut.
    PowerCut,
    /// Every operation ran in a segment with injected backing faults: the engine is attached
    /// again (no power cut) to a healed backing store before the final drain. After a failed
    /// `fdatasync` nothing is trusted until then (docs/DURABILITY.md, rule 6).
    Reattach,
}

/// Injects the backing fault `op` asks for, and records it in `faults`.
fn inject_backing_fault(backing: &SimBacking, op: &Op, faults: &mut Faults) {
    let block = BLOCK as u64;
    match *op {
        Op::FailBackingWrites { first, count } => {
            backing.fail_writes_in(first * block..(first + count) * block)
        }
        Op::FailBackingReads => backing.fail_reads_from(0),
        Op::FailBackingFlushes => {
            backing.fail_flushes(true);
            faults.sync_failed = true;
        }
        Op::HealBacking => {
            backing.heal();
            faults.active = false;
            return;
        }
        _ => panic!("{op:?} is not a backing fault"),
    }
    faults.active = true;
}

/// The backing faults of a segment: which errors an operation may fail with.
#[derive(Clone, Copy, Default)]
struct Faults {
    /// A fault is injected and not healed since: backing I/O errors are expected.
    active: bool,
    /// Flushes were made to fail in this segment: after a failed sync, the engine refuses
    /// what needs one (`BackingSyncFailedBefore`) until it is attached again, healed or not.
    sync_failed: bool,
}

impl Faults {
    fn expect(&self, failure: &OpFailure) -> bool {
        !failure.other
            && (!failure.backing_io || self.active)
            && (!failure.sync_failed_before || self.sync_failed)
    }
}

/// Applies what an operation did to the model and checks its reads: `cut` if power was
/// already off when it returned (it may or may not have taken effect). With backing `faults`
/// injected, an operation may fail with the errors they explain; a failed request leaves
/// what a cut inside it would, and a batch's other requests are checked as acknowledged.
/// Counts failed operations in `outcome`.
fn settle(
    model: &mut Model,
    op: &Op,
    data: &[u8],
    result: Result<Done, OpFailure>,
    cut: bool,
    faults: Faults,
    outcome: &mut RunOutcome,
) -> Result<(), String> {
    match result {
        Ok(_) if cut => model.apply_uncertain(op, data),
        Ok(done) => {
            done.check_reads(model)?;
            model.apply(op, data);
        }
        Err(_) if cut => model.apply_failed(op, data),
        Err(failure) if faults.expect(&failure) => {
            if std::env::var_os("PMCACHE_MODEL_TRACE").is_some() {
                eprintln!("failed: {}", failure.message);
            }
            model.apply_partly_failed(op, data, &failure.succeeded, &failure.reads)?;
            outcome.failed_ops += 1;
        }
        Err(failure) => return Err(failure.message),
    }
    Ok(())
}

/// A lane thread's channels: operations (with their writes' data) in, results (with whether
/// power was off when it returned) out.
type LaneChannels<'a> = (
    &'a std::sync::mpsc::Sender<(Op, Vec<Vec<u8>>)>,
    &'a std::sync::mpsc::Receiver<(Result<Done, OpFailure>, bool)>,
);

/// Settles a pair that ran at once on overlapping blocks `both` (see
/// `CrashRun::overlapping_pairs`): the model of each order is made; without a power cut, each
/// block in `both` is read back through a lane (`lane`: its channels) and taken from the order
/// the read matches, or the pair fails the run; with a cut (during the pair or during those
/// reads), the model allows what either order allows. Returns whether power was cut.
#[expect(clippy::too_many_arguments, reason = "the pair's whole context, from one call site")]
fn settle_overlapping(
    model: &mut Model,
    pair: [&Op; 2],
    data: &[Vec<u8>],
    results: [(Result<Done, OpFailure>, bool); 2],
    both: &[u64],
    lane: LaneChannels<'_>,
    switch: &CrashSwitch,
    outcome: &mut RunOutcome,
) -> Result<bool, String> {
    let [(first, first_cut), (second, second_cut)] = results;
    // Each order's model, or why the reads of the pair rule it out (a read that ran beside a
    // write saw the block before or after it, not both).
    let mut orders = [Ok(model.clone()), Ok(model.clone())];
    for (order, sequence) in orders.iter_mut().zip([[0usize, 1], [1, 0]]) {
        for at in sequence {
            let (result, cut) = if at == 0 { (&first, first_cut) } else { (&second, second_cut) };
            let result = match result {
                Ok(done) => Ok(done.clone()),
                Err(failure) if cut || switch.has_crashed() => Err(failure.clone()),
                Err(failure) => return Err(format!("failed: {}", failure.message)),
            };
            if let Ok(model) = order {
                let settled =
                    settle(model, pair[at], &data[at], result, cut, Faults::default(), outcome);
                if let Err(why) = settled {
                    *order = Err(why);
                }
            }
        }
    }
    let (mut ab, ba) = match orders {
        [Ok(ab), Ok(ba)] => (ab, ba),
        [Ok(only), Err(_)] | [Err(_), Ok(only)] => (only.clone(), only),
        [Err(ab), Err(ba)] => {
            return Err(format!(
                "{:?} and {:?} at once match neither order: {ab}; {ba}",
                pair[0], pair[1]
            ));
        }
    };
    let widen = |ab: &mut Model, ba: &Model| {
        ab.widen_to(ba);
        true
    };
    if switch.has_crashed() {
        let ended = widen(&mut ab, &ba);
        *model = ab;
        return Ok(ended);
    }
    let mut chosen = ab.clone();
    for &block in both {
        let offset = block * BLOCK as u64;
        let read = Op::Read { offset, len: BLOCK as u64 };
        lane.0.send((read, Vec::new())).map_err(|e| e.to_string())?;
        let (result, _) = lane.1.recv().map_err(|e| e.to_string())?;
        if switch.has_crashed() {
            let ended = widen(&mut ab, &ba);
            *model = ab;
            return Ok(ended);
        }
        let done =
            result.map_err(|failure| format!("reading block {block} back: {}", failure.message))?;
        let bytes = &done.reads[0].1;
        let mut from_ab = ab.clone();
        let mut from_ba = ba.clone();
        if from_ab.check_read(offset, bytes).is_ok() {
            chosen.take_block(&from_ab, block as usize);
        } else if let Err(e) = from_ba.check_read(offset, bytes) {
            return Err(format!(
                "block {block} after {:?} and {:?} at once is neither order: {e}",
                pair[0], pair[1]
            ));
        } else {
            chosen.take_block(&from_ba, block as usize);
        }
    }
    *model = chosen;
    Ok(false)
}

/// Runs `ops` against the engine on the crash medium, cutting power as asked, checking every
/// read, every recovery and (at the end) a drained backing store against the model.
pub fn run_crash_case(ops: &[Op], run: &CrashRun) -> Result<RunOutcome, String> {
    let base = config(run.mode, run.eviction, run.admission);
    let cfg = Config {
        index_buckets: run.index_buckets,
        max_lanes: base.max_lanes + usize::from(run.cleaner.is_some()),
        data_crc: run.data_crc,
        placement: crate::PlacementConfig {
            topology: Some(Arc::new(simulated_topology(run.members.max(1)))),
            current_cpu: rotating_cpu,
            ..Default::default()
        },
        ..base
    };
    let clock = Arc::new(ManualClock::default());
    let mut world = World::fresh_set(run.seed, run.members.max(1));
    let mut model = Model::new(run.mode);
    let mut outcome = RunOutcome::default();
    let mut engine: SimEngine =
        Engine::format(world.medium.clone(), world.backing.clone(), clock.clone(), &cfg)
            .map_err(|e| format!("format: {e}"))?;
    let format_points = world.switch.points();
    if let Some(point) = run.cut_at_point {
        world.switch.arm(format_points + point);
    }
    let mut next = 0;
    let mut segment = 0;
    // Backing faults of this segment (a power cut or a re-attach starts a clean one).
    let mut faults = Faults::default();
    let mut faults_seen = false;
    let mut pairing = rand::rngs::SmallRng::seed_from_u64(run.seed ^ 0x9a12);
    loop {
        // Half the seeds zero from 2 whole blocks on through the backing store (the path of
        // a large write-zeroes, cache/zeroes.rs), half through the cache.
        let zero_through_blocks_min = if run.seed & 2 == 2 { 2 } else { 1 << 20 };
        engine.set_zero_through_blocks_min(zero_through_blocks_min);
        model.set_zero_through_blocks_min(zero_through_blocks_min);
        // Two lanes, used alternately, each on a thread of its own: a block's versions come
        // from different lanes, so recovery's "newest wins" depends on cross-lane sequence
        // order; and the crash medium keeps unfenced flushes per thread, so a lane that relied
        // on another lane's fence would lose data here.
        let ended: Result<SegmentEnd, String> = std::thread::scope(|scope| {
            let mut to_lanes = Vec::new();
            let mut from_lanes = Vec::new();
            let mut workers = Vec::new();
            for _ in 0..2 {
                let mut lane = engine.lane().map_err(|e| e.to_string())?;
                let (op_tx, op_rx) = std::sync::mpsc::channel::<(Op, Vec<Vec<u8>>)>();
                // With each result, whether power was already off when the operation returned:
                // one that returned before the cut was acknowledged, and must be durable as
                // any other acknowledged operation (a pair's other operation may be the one
                // the cut interrupted).
                let (done_tx, done_rx) =
                    std::sync::mpsc::channel::<(Result<Done, OpFailure>, bool)>();
                let switch = world.switch.clone();
                workers.push(scope.spawn(move || {
                    while let Ok((op, datas)) = op_rx.recv() {
                        let result = execute_op(&mut lane, &op, datas);
                        if done_tx.send((result, switch.has_crashed())).is_err() {
                            break;
                        }
                    }
                }));
                to_lanes.push(op_tx);
                from_lanes.push(done_rx);
            }
            let cleaned_before = engine.stats().cleaner.blocks_cleaned;
            let stop_cleaner = StopCleaner(&engine);
            let cleaner_thread = match &run.cleaner {
                Some(settings) => {
                    let mut cleaner =
                        engine.cleaner(settings.clone()).map_err(|e| format!("cleaner: {e}"))?;
                    Some(scope.spawn(move || cleaner.run(|_| {})))
                }
                None => None,
            };
            while next < ops.len() {
                let op = &ops[next];
                next += 1;
                clock.advance_ns(1_000);
                if let Op::PowerCut = op {
                    world.switch.cut_now();
                    break;
                }
                if op.is_backing_fault() {
                    inject_backing_fault(&world.backing, op, &mut faults);
                    faults_seen |= faults.active;
                    outcome.backing_fault_ops += 1;
                    continue;
                }
                if run.concurrent_pairs
                    && let Some(second) = ops.get(next)
                    && (may_run_together(op, second)
                        || (run.overlapping_pairs && !faults.active && may_overlap(op, second)))
                    && pairing.gen_bool(0.5)
                {
                    next += 1;
                    let pair = [op, second];
                    let mut pair_data = Vec::new();
                    for (lane, op) in pair.into_iter().enumerate() {
                        let datas = write_data_for(&mut model, op);
                        pair_data.push(datas.concat());
                        to_lanes[lane].send((op.clone(), datas)).map_err(|e| e.to_string())?;
                    }
                    let results = [
                        from_lanes[0].recv().map_err(|e| e.to_string())?,
                        from_lanes[1].recv().map_err(|e| e.to_string())?,
                    ];
                    if std::env::var_os("PMCACHE_MODEL_TRACE").is_some() {
                        eprintln!(
                            "segment {segment} ops {} and {} together {pair:?}: points {} crashed {}",
                            next - 2,
                            next - 1,
                            world.switch.points(),
                            world.switch.has_crashed()
                        );
                    }
                    if pair.iter().any(|op| matches!(op, Op::SetMode { .. })) {
                        outcome.pairs_beside_mode_switches += 1;
                        let crashed = world.switch.has_crashed();
                        settle_beside_mode_switch(
                            &mut model,
                            pair,
                            &pair_data,
                            results,
                            faults,
                            &mut outcome,
                        )
                        .map_err(|e| format!("ops {} and {}: {e}", next - 1, next))?;
                        if crashed {
                            outcome.cuts_during_pairs += 1;
                            break;
                        }
                        continue;
                    }
                    let both = blocks_in_both(pair[0], pair[1]);
                    if !both.is_empty() {
                        outcome.overlapping_pairs += 1;
                        let ended = settle_overlapping(
                            &mut model,
                            pair,
                            &pair_data,
                            results,
                            &both,
                            (&to_lanes[0], &from_lanes[0]),
                            &world.switch,
                            &mut outcome,
                        )
                        .map_err(|e| format!("ops {} and {}: {e}", next - 1, next))?;
                        if ended {
                            outcome.cuts_during_pairs += 1;
                            break;
                        }
                        continue;
                    }
                    // Disjoint blocks: the two commute, so the model applies them in order. One
                    // that returned before a cut is applied as acknowledged, one the cut
                    // interrupted as uncertain (each of its blocks old or new).
                    let crashed = world.switch.has_crashed();
                    for ((op, data), (result, cut_before_return)) in
                        pair.into_iter().zip(&pair_data).zip(results)
                    {
                        settle(
                            &mut model,
                            op,
                            data,
                            result,
                            cut_before_return,
                            faults,
                            &mut outcome,
                        )
                        .map_err(|e| format!("op {next}: {e}"))?;
                    }
                    if crashed {
                        outcome.cuts_during_pairs += 1;
                        break;
                    }
                    continue;
                }
                let datas = write_data_for(&mut model, op);
                let data = datas.concat();
                let lane = next % 2;
                to_lanes[lane].send((op.clone(), datas)).map_err(|e| e.to_string())?;
                let (result, _) = from_lanes[lane].recv().map_err(|e| e.to_string())?;
                if std::env::var_os("PMCACHE_MODEL_TRACE").is_some() {
                    eprintln!(
                        "segment {segment} op {} {op:?}: points {} crashed {}",
                        next - 1,
                        world.switch.points(),
                        world.switch.has_crashed()
                    );
                }
                let crashed = world.switch.has_crashed();
                settle(&mut model, op, &data, result, crashed, faults, &mut outcome)
                    .map_err(|e| format!("op {next}: {e}"))?;
                if crashed {
                    break;
                }
            }
            drop(to_lanes);
            for worker in workers {
                worker.join().map_err(|_| "a lane thread panicked".to_string())?;
            }
            drop(stop_cleaner);
            if let Some(thread) = cleaner_thread {
                thread.join().map_err(|_| "the cleaner thread panicked".to_string())?;
            }
            outcome.cleaner_blocks_cleaned +=
                engine.stats().cleaner.blocks_cleaned - cleaned_before;
            if segment == 0 {
                outcome.persist_points_first_segment = world.switch.points() - format_points;
            }
            if world.switch.has_crashed() {
                return Ok(SegmentEnd::PowerCut);
            }
            engine.audit().map_err(|e| format!("audit after the workload: {e}"))?;
            if faults_seen {
                return Ok(SegmentEnd::Reattach);
            }
            let mut lane = engine.lane().map_err(|e| e.to_string())?;
            let drained = lane.drain();
            if segment == 0 {
                outcome.persist_points_first_segment = world.switch.points() - format_points;
            }
            if outcome.power_cuts == 0 {
                outcome.persist_points_without_cuts = world.switch.points() - format_points;
            }
            if world.switch.has_crashed() {
                // Cut mid-drain: recovered and checked like any other cut (a drain changes no
                // block's contents, so the model has nothing uncertain to add).
                return Ok(SegmentEnd::PowerCut);
            }
            drained.map_err(|e| format!("final drain: {e}"))?;
            model.apply(&Op::Drain, &[]);
            verify_all(&mut lane, &mut model)?;
            // What the backing store holds *durably*: a drain that skipped its sync would
            // leave the data in the device's volatile cache only.
            model.check_backing(&world.backing.durable_contents())?;
            drop(lane);
            engine.audit().map_err(|e| format!("audit after the final drain: {e}"))?;
            Ok(SegmentEnd::Finished)
        });
        match ended? {
            SegmentEnd::Finished => return Ok(outcome),
            SegmentEnd::PowerCut => drop(engine),
            SegmentEnd::Reattach => {
                drop(engine);
                world.backing.heal();
                faults = Faults::default();
                faults_seen = false;
                let opened =
                    Engine::open(world.medium.clone(), world.backing.clone(), clock.clone(), &cfg);
                if !world.switch.has_crashed() {
                    // No power cut: the medium and the backing store hold everything they did.
                    let (attached, report) =
                        opened.map_err(|e| format!("attach after faults: {e}"))?;
                    engine = attached;
                    if report.corrupt != 0 || report.synced_seq_invalid {
                        return Err(format!("re-attach after faults found corruption: {report:?}"));
                    }
                    outcome.reattaches += 1;
                    engine.audit().map_err(|e| format!("audit after re-attach: {e}"))?;
                    let mut lane = engine.lane().map_err(|e| e.to_string())?;
                    verify_all(&mut lane, &mut model).map_err(|e| format!("re-attach: {e}"))?;
                    drop(lane);
                    segment += 1;
                    continue;
                }
                // Power was cut inside that attach: recovered like any other cut.
                drop(opened);
                outcome.cuts_during_recovery += 1;
            }
        }
        faults = Faults::default();
        faults_seen = false;
        outcome.power_cuts += 1;
        model.power_cut();
        // The engine attaches in the configured mode, whatever mode it was switched to.
        model.apply(&Op::SetMode { mode: run.mode }, &[]);
        world = world.after_power_cut(run.seed + outcome.power_cuts);
        if segment == 0
            && let Some(point) = run.cut_during_recovery_at
        {
            world.switch.arm(point);
        }
        let opened = Engine::open(world.medium.clone(), world.backing.clone(), clock.clone(), &cfg);
        let (recovered, report) = if world.switch.has_crashed() {
            // Power was lost again during recovery: recover from what that left.
            drop(opened);
            outcome.power_cuts += 1;
            outcome.cuts_during_recovery += 1;
            world = world.after_power_cut(run.seed + 1000 + outcome.power_cuts);
            Engine::open(world.medium.clone(), world.backing.clone(), clock.clone(), &cfg)
                .map_err(|e| format!("second recovery: {e}"))?
        } else {
            opened.map_err(|e| format!("recovery: {e}"))?
        };
        engine = recovered;
        // A power cut tears entries (counted as torn) but never makes one fail its check, and
        // never leaves two copies of a block under one sequence number: either would mean a
        // slot reused over a still-durable entry, or a number issued twice.
        if report.corrupt != 0 || report.synced_seq_invalid {
            return Err(format!("recovery found corruption after a power cut: {report:?}"));
        }
        engine.audit().map_err(|e| format!("audit after recovery: {e}"))?;
        {
            let mut lane = engine.lane().map_err(|e| e.to_string())?;
            verify_all(&mut lane, &mut model)?;
        }
        segment += 1;
    }
}

#[cfg(all(test, not(feature = "shuttle")))]
mod tests {
    use super::*;

    fn read_of(block: usize, fill: impl Fn(usize) -> u8) -> (u64, Vec<u8>) {
        ((block * BLOCK) as u64, (0..BLOCK).map(fill).collect())
    }

    /// A trimmed block reads as anything, but the bytes a later partial write put there must
    /// read back; the others may read differently each time.
    #[test]
    fn a_partial_write_into_a_trimmed_block_is_checked_byte_by_byte() {
        let mut model = Model::new(CacheMode::WriteBack);
        let trim = Op::Trim { offset: 0, len: BLOCK as u64 };
        model.apply(&trim, &[]);
        let write = Op::Write { offset: 10, len: 4, fua: false };
        model.apply(&write, &[1, 2, 3, 4]);
        let (offset, mut bytes) = read_of(0, |_| 0xd5);
        bytes[10..14].copy_from_slice(&[1, 2, 3, 4]);
        let mut wrong = bytes.clone();
        wrong[12] = 0xd5;
        assert!(model.check_read(offset, &wrong).is_err(), "a lost byte of the write passed");
        model.check_read(offset, &bytes).expect("the write's bytes and anything else");
        let mut changed = bytes.clone();
        changed[100] = 0;
        model.check_read(offset, &changed).expect("an unwritten byte of a trimmed block");
        changed[11] = 0;
        assert!(model.check_read(offset, &changed).is_err(), "a lost byte of the write passed");
    }

    /// After a power cut, a block not written since reads the same across a second cut.
    #[test]
    fn a_read_after_a_cut_settles_what_the_next_cut_leaves() {
        let mut model = Model::new(CacheMode::WriteThrough);
        let write = Op::Write { offset: 0, len: BLOCK as u64, fua: false };
        model.apply(&write, &[7; BLOCK]);
        model.power_cut();
        let (offset, zeroes) = read_of(0, |_| 0);
        model.check_read(offset, &zeroes).expect("the unflushed write lost");
        model.power_cut();
        assert!(model.check_read(offset, &[7; BLOCK]).is_err(), "the lost write came back");
    }

    /// Sector `s` of block 0 from `old` or `new` as `from_new[s]` says.
    fn mix(old: u8, new: u8, from_new: [bool; SECTORS]) -> Vec<u8> {
        (0..BLOCK).map(|i| if from_new[i / SECTOR] { new } else { old }).collect()
    }

    /// An unflushed write-through write may reach the backing store in part: after a cut,
    /// any mix of old and new sectors reads back, and the first read pins the mix.
    #[test]
    fn a_cut_backing_write_may_leave_a_mix_of_sectors_which_then_stays() {
        let mut model = Model::new(CacheMode::WriteThrough);
        model.apply(&Op::Write { offset: 0, len: BLOCK as u64, fua: false }, &[7; BLOCK]);
        model.power_cut();
        let torn = mix(0, 7, [true, false, true, false]);
        model.check_read(0, &torn).expect("a torn backing write");
        let other = mix(0, 7, [true, true, true, false]);
        assert!(model.check_read(0, &other).is_err(), "a second, different mix passed");
        model.power_cut();
        assert!(model.check_read(0, &other).is_err(), "a different mix after a second cut");
        model.check_read(0, &torn).expect("the same mix");
        assert!(model.check_read(0, &mix(0, 9, [true; SECTORS])).is_err(), "bytes never written");
    }

    /// In the write-back modes a block's copy lives in the cache, whole or not at all: a
    /// write the cut interrupted leaves the old or the new block, never a mix.
    #[test]
    fn a_cut_write_back_write_leaves_a_whole_block() {
        let mut model = Model::new(CacheMode::WriteBack);
        model.apply_uncertain(&Op::Write { offset: 0, len: BLOCK as u64, fua: false }, &[7; BLOCK]);
        model.power_cut();
        let mut probe = Model { blocks: model.blocks.clone(), ..Model::new(CacheMode::WriteBack) };
        assert!(probe.check_read(0, &mix(0, 7, [false, true, true, true])).is_err(), "a mix");
        probe.check_read(0, &[7; BLOCK]).expect("the new block");
        model.check_read(0, &[0; BLOCK]).expect("the old block");
    }

    /// A block written through to the backing store, then written in write-back mode by a
    /// write the cut interrupted: the cut may leave a mix of the backing store's values, or
    /// the cached write whole, never a mix of the cached write with anything.
    #[test]
    fn a_cached_write_never_mixes_with_a_torn_backing_write() {
        let mut model = Model::new(CacheMode::WriteThrough);
        model.apply(&Op::Write { offset: 0, len: BLOCK as u64, fua: false }, &[1; BLOCK]);
        model.apply(&Op::SetMode { mode: CacheMode::WriteBack }, &[]);
        model.apply_uncertain(&Op::Write { offset: 0, len: BLOCK as u64, fua: false }, &[2; BLOCK]);
        model.power_cut();
        for (read, allowed) in [
            (mix(1, 2, [true, false, false, false]), false),
            (mix(0, 2, [true, false, false, false]), false),
            (mix(0, 1, [true, false, true, false]), true),
            (vec![2; BLOCK], true),
            (vec![1; BLOCK], true),
            (vec![0; BLOCK], true),
        ] {
            let mut probe =
                Model { blocks: model.blocks.clone(), ..Model::new(CacheMode::WriteBack) };
            assert_eq!(
                probe.check_read(0, &read).is_ok(),
                allowed,
                "{:?}",
                &read[..BLOCK].chunks(SECTOR).map(|c| c[0]).collect::<Vec<_>>()
            );
        }
        // A read of a whole candidate that is also a mix keeps both readings possible until
        // a read tells them apart; a torn read pins the mix across the next cut.
        model.check_read(0, &mix(0, 1, [false, true, true, false])).expect("a backing mix");
        model.power_cut();
        assert!(model.check_read(0, &[2; BLOCK]).is_err(), "the cached write after a torn read");
    }

    /// A flush makes the backing store's writes whole: no mix after a cut that follows it.
    #[test]
    fn a_flushed_write_no_longer_tears() {
        let mut model = Model::new(CacheMode::WriteAround);
        model.apply(&Op::Write { offset: 0, len: BLOCK as u64, fua: false }, &[7; BLOCK]);
        model.apply(&Op::Flush, &[]);
        model.power_cut();
        assert!(model.check_read(0, &mix(0, 7, [true, false, true, true])).is_err(), "a mix");
        model.check_read(0, &[7; BLOCK]).expect("the flushed write");
    }

    /// A partial write over a torn block: the sectors it covers whole are known, the rest keep
    /// their own candidates, merged with the write where it covers them in part.
    #[test]
    fn a_partial_write_over_a_torn_block_keeps_per_sector_candidates() {
        let mut model = Model::new(CacheMode::WriteThrough);
        model.apply(&Op::Write { offset: 0, len: BLOCK as u64, fua: false }, &[7; BLOCK]);
        model.power_cut();
        // Covers sector 1 whole and sector 2 in part.
        let (at, len) = (SECTOR, SECTOR + 10);
        model.apply(&Op::Write { offset: at as u64, len: len as u64, fua: true }, &vec![3; len]);
        let expected = |sector0: u8, sector2: u8, sector3: u8| -> Vec<u8> {
            let mut block = mix(sector0, sector0, [true; SECTORS]);
            block[SECTOR..2 * SECTOR + 10].fill(3);
            block[2 * SECTOR + 10..3 * SECTOR].fill(sector2);
            block[3 * SECTOR..].fill(sector3);
            block
        };
        let mut probe =
            Model { blocks: model.blocks.clone(), ..Model::new(CacheMode::WriteThrough) };
        probe.check_read(0, &expected(7, 0, 7)).expect("old sector 2, new sectors 0 and 3");
        let mut probe =
            Model { blocks: model.blocks.clone(), ..Model::new(CacheMode::WriteThrough) };
        probe.check_read(0, &expected(0, 7, 0)).expect("new sector 2, old sectors 0 and 3");
        let mut wrong = expected(0, 7, 0);
        wrong[SECTOR + 5] = 7;
        assert!(model.check_read(0, &wrong).is_err(), "a byte of the fua write lost");
    }
}

#[cfg(all(test, not(feature = "shuttle")))]
mod sim_backing_tests {
    use super::super::SIM_SECTOR_BYTES;
    use super::*;

    /// A power cut keeps or loses an unflushed write per device sector, at the device's
    /// sector boundaries (not the write's): a write that starts inside a sector is split
    /// there, and no cut leaves a kept piece that crosses a boundary.
    #[test]
    fn a_cut_keeps_or_loses_each_sector_of_an_unflushed_write() {
        let sector = SIM_SECTOR_BYTES;
        let (at, len) = (sector / 2, 2 * sector);
        let mut kinds = std::collections::BTreeSet::new();
        for seed in 0..64 {
            let world = World::fresh(seed);
            world.backing.write_at(&vec![9; len], at as u64).expect("write");
            world.switch.cut_now();
            let image = world.backing.crash_image().expect("cut");
            // The written range's three pieces, each all 9 or all 0.
            let pieces = [at..sector, sector..2 * sector, 2 * sector..at + len];
            let kept: Vec<bool> = pieces
                .iter()
                .map(|piece| {
                    let bytes = &image[piece.clone()];
                    assert!(
                        bytes.iter().all(|&b| b == 9) || bytes.iter().all(|&b| b == 0),
                        "seed {seed}: a sector torn inside"
                    );
                    bytes[0] == 9
                })
                .collect();
            assert!(image[..at].iter().chain(&image[at + len..]).all(|&b| b == 0), "outside");
            kinds.insert(kept);
        }
        assert!(kinds.len() > 4, "cuts left too few patterns: {kinds:?}");
    }
}
