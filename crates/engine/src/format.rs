//! The on-medium format: superblock, slot metadata entries, geometry (see docs/FORMAT.md).
//!
//! Everything here is pure encoding and validation; bytes read from a medium are validated and
//! turned into [`FormatError`]s, never asserted.

use pmcache_backing::BackingIdentity;

/// Magic bytes at offset 0 of a pmcache medium.
pub const MAGIC: [u8; 8] = *b"PMCACHE\0";
/// The format version this build writes. Version 4 gives bytes 120..124 of the header their
/// meaning (feature flags: data checksums); version 3 names a cache's place in a set of
/// members (bytes 112..120); version 2, which left those bytes zero, is read as a one-member
/// set. Versions 2 and 3 are read with no features.
pub const FORMAT_VERSION: u32 = 4;
/// The oldest format version this build reads.
pub const FORMAT_VERSION_MIN: u32 = 2;
/// Bytes reserved for the superblock at the start of the medium.
pub const SUPERBLOCK_BYTES: u64 = 4096;
/// Length of the immutable, checksummed superblock header.
pub const HEADER_BYTES: usize = 128;
/// Offset of the 8-byte shutdown-state word.
pub const SHUTDOWN_WORD_OFFSET: u64 = 256;
/// Offset of the 8-byte synced-sequence word.
pub const SYNCED_SEQ_OFFSET: u64 = 264;
/// Bytes of one slot metadata entry.
pub const ENTRY_BYTES: u64 = 16;
/// Bytes of one slot's data checksum (a CRC32C), in a cache formatted with data checksums.
pub const DATA_CRC_BYTES: u64 = 4;
/// Feature flag (header bytes 120..124): every slot's data has a CRC32C.
pub const FEATURE_DATA_CRC: u32 = 1;
/// The feature flags this build knows; a header with another set is refused.
const FEATURES_KNOWN: u32 = FEATURE_DATA_CRC;
const FEATURES_OFFSET: usize = 120;
/// Largest backing store in blocks: block numbers have 40 bits.
pub const MAX_BACKING_BLOCKS: u64 = 1 << 40;
/// Shutdown word after a clean shutdown.
pub const SHUTDOWN_CLEAN: u64 = u64::from_le_bytes(*b"CLEAN\0\0\x01");
/// Shutdown word while attached (or after a crash).
pub const SHUTDOWN_DIRTY: u64 = u64::from_le_bytes(*b"ATTACHED");

const CRC_OFFSET: usize = 124;
const LBA_BITS: u32 = 40;
const LBA_MASK: u64 = (1 << LBA_BITS) - 1;
const STATE_SHIFT: u32 = 40;
const SEQ_LOW_SHIFT: u32 = 44;
const CHECK_SHIFT: u32 = 52;

/// The medium is not a pmcache of this build, or does not fit what it is used with.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum FormatError {
    /// No pmcache superblock (all zeroes, or foreign magic).
    #[error("no pmcache superblock on the medium (magic {found:02x?})")]
    BadMagic {
        /// The first 8 bytes found.
        found: [u8; 8],
    },
    /// Written by another format version.
    #[error(
        "the medium has pmcache format version {found}; this build reads versions 2 to {supported}"
    )]
    UnsupportedVersion {
        /// Version on the medium.
        found: u32,
        /// Version this build supports.
        supported: u32,
    },
    /// The superblock header's checksum does not match.
    #[error(
        "superblock checksum mismatch (stored {stored:#010x}, computed {computed:#010x}): the superblock is corrupt"
    )]
    BadChecksum {
        /// Checksum stored on the medium.
        stored: u32,
        /// Checksum computed over the header.
        computed: u32,
    },
    /// The superblock's geometry is impossible or does not fit the medium.
    #[error("superblock geometry is invalid: {0}")]
    BadGeometry(String),
    /// The cache belongs to another backing store.
    #[error(
        "this cache belongs to another backing store: it records {recorded_bytes} bytes with fingerprint {recorded_fingerprint}, the backing given is {given_bytes} bytes with fingerprint {given_fingerprint}"
    )]
    BackingMismatch {
        /// Size recorded in the superblock.
        recorded_bytes: u64,
        /// Fingerprint recorded (hex).
        recorded_fingerprint: String,
        /// Size of the backing given.
        given_bytes: u64,
        /// Fingerprint of the backing given (hex).
        given_fingerprint: String,
    },
    /// The backing store at the recorded path is another file than the one the cache was
    /// formatted for (its inode differs): it was replaced, moved over or restored.
    #[error(
        "this cache belongs to another file at the backing store's path: it records inode {recorded_instance}, the file there now is inode {given_instance} (replaced, moved over or restored since); its dirty blocks belong to the other file, so it is not attached"
    )]
    BackingReplaced {
        /// Inode recorded in the superblock.
        recorded_instance: u64,
        /// Inode of the backing given.
        given_instance: u64,
    },
    /// The shutdown-state word holds neither known value.
    #[error("superblock shutdown word is corrupt ({0:#018x})")]
    BadShutdownWord(u64),
    /// The members given do not make up one whole set: one is missing, repeated, from another
    /// cache, or disagrees with the others about what they share.
    #[error("the cache media do not make up one cache: {0}")]
    BadSet(String),
    /// Format parameters rejected before writing anything.
    #[error("cannot format: {0}")]
    Invalid(String),
}

/// Where things are on the medium.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Geometry {
    /// Total medium length in bytes.
    pub medium_bytes: u64,
    /// Cache block (slot) size in bytes: a power of two, 512..=1 MiB.
    pub block_size: u32,
    /// Number of slots.
    pub slot_count: u64,
    /// Offset of the slot metadata table.
    pub meta_offset: u64,
    /// Offset of slot 0's data; block-aligned.
    pub data_offset: u64,
    /// Whether each slot's data has a CRC32C, in an array after the metadata entries (at
    /// `meta_offset + 16 * slot_count`, 4 bytes per slot).
    pub data_crc: bool,
}

impl Geometry {
    /// The largest geometry that fits a medium of `medium_bytes` with `block_size` blocks,
    /// without data checksums.
    pub fn for_medium(medium_bytes: u64, block_size: u32) -> Result<Self, FormatError> {
        Self::plan(medium_bytes, block_size, false)
    }

    /// The largest geometry that fits a medium of `medium_bytes` with `block_size` blocks and,
    /// if `data_crc`, a data checksum per slot.
    pub fn plan(medium_bytes: u64, block_size: u32, data_crc: bool) -> Result<Self, FormatError> {
        if !block_size.is_power_of_two() || !(512..=1 << 20).contains(&block_size) {
            return Err(FormatError::Invalid(format!(
                "block size {block_size} is not a power of two between 512 and 1048576"
            )));
        }
        let block = u64::from(block_size);
        let align = block.max(4096);
        let meta_offset = SUPERBLOCK_BYTES;
        let usable = medium_bytes.saturating_sub(meta_offset);
        let meta_bytes_per_slot = ENTRY_BYTES + if data_crc { DATA_CRC_BYTES } else { 0 };
        let mut slot_count = usable / (block + meta_bytes_per_slot);
        let data_offset_for =
            |slots: u64| (meta_offset + slots * meta_bytes_per_slot).next_multiple_of(align);
        while slot_count > 0 && data_offset_for(slot_count) + slot_count * block > medium_bytes {
            slot_count -= 1;
        }
        let slot_count = slot_count.min(u64::from(u32::MAX - 1));
        if slot_count < 16 {
            return Err(FormatError::Invalid(format!(
                "a medium of {medium_bytes} bytes holds {slot_count} blocks of {block_size} bytes; at least 16 are needed"
            )));
        }
        Ok(Self {
            medium_bytes,
            block_size,
            slot_count,
            meta_offset,
            data_offset: data_offset_for(slot_count),
            data_crc,
        })
    }

    /// Byte offset of `slot`'s data checksum (a cache formatted with data checksums).
    pub fn crc_offset(&self, slot: u32) -> u64 {
        assert!(self.data_crc, "a data checksum asked of a cache formatted without");
        assert!(u64::from(slot) < self.slot_count, "slot {slot} out of range");
        self.meta_offset + self.slot_count * ENTRY_BYTES + u64::from(slot) * DATA_CRC_BYTES
    }

    /// Byte offset of `slot`'s metadata entry.
    pub fn entry_offset(&self, slot: u32) -> u64 {
        assert!(u64::from(slot) < self.slot_count, "slot {slot} out of range");
        self.meta_offset + u64::from(slot) * ENTRY_BYTES
    }

    /// Byte offset of `slot`'s data block.
    pub fn data_offset(&self, slot: u32) -> u64 {
        assert!(u64::from(slot) < self.slot_count, "slot {slot} out of range");
        self.data_offset + u64::from(slot) * u64::from(self.block_size)
    }

    fn validate(&self, actual_medium_bytes: u64) -> Result<(), FormatError> {
        let bad = |why: String| Err(FormatError::BadGeometry(why));
        if self.medium_bytes != actual_medium_bytes {
            return bad(format!(
                "superblock says the medium is {} bytes, it is {actual_medium_bytes} (truncated or resized?)",
                self.medium_bytes
            ));
        }
        let Ok(expected) = Self::plan(self.medium_bytes, self.block_size, self.data_crc) else {
            return bad(format!("block size {} is not valid", self.block_size));
        };
        if expected != *self {
            return bad(format!("recorded {self:?}, expected {expected:?} for this medium size"));
        }
        Ok(())
    }
}

/// A medium's place in its cache's set of members (one per NUMA node).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Membership {
    /// Its number in the set, from 0.
    pub index: u16,
    /// How many members the set has (1 for a cache of one medium).
    pub count: u16,
    /// The NUMA node it was formatted for, if one was known.
    pub node: Option<u32>,
}

impl Membership {
    /// The only member of a one-medium cache.
    pub const SOLE: Membership = Membership { index: 0, count: 1, node: None };
}

/// The immutable superblock header of one medium (one member of a set).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Superblock {
    /// Identifies this cache instance: every member of a set carries the same.
    pub uuid: [u8; 16],
    /// Layout of this medium.
    pub geometry: Geometry,
    /// Its place in the set.
    pub membership: Membership,
    /// The backing store this cache belongs to.
    pub backing: BackingIdentity,
    /// When it was formatted (seconds since the Unix epoch).
    pub created_unix_secs: u64,
}

fn put_u32(buf: &mut [u8], at: usize, v: u32) {
    buf[at..at + 4].copy_from_slice(&v.to_le_bytes());
}
fn put_u64(buf: &mut [u8], at: usize, v: u64) {
    buf[at..at + 8].copy_from_slice(&v.to_le_bytes());
}
fn get_u32(buf: &[u8], at: usize) -> u32 {
    u32::from_le_bytes(buf[at..at + 4].try_into().expect("4 bytes"))
}
fn get_u64(buf: &[u8], at: usize) -> u64 {
    u64::from_le_bytes(buf[at..at + 8].try_into().expect("8 bytes"))
}

/// Hex rendering of a fingerprint, for messages.
pub fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

impl Superblock {
    /// Encodes the header (layout in docs/FORMAT.md).
    pub fn encode(&self) -> [u8; HEADER_BYTES] {
        let mut buf = [0u8; HEADER_BYTES];
        buf[0..8].copy_from_slice(&MAGIC);
        put_u32(&mut buf, 8, FORMAT_VERSION);
        put_u32(&mut buf, 12, HEADER_BYTES as u32);
        buf[16..32].copy_from_slice(&self.uuid);
        put_u64(&mut buf, 32, self.geometry.medium_bytes);
        put_u32(&mut buf, 40, self.geometry.block_size);
        put_u64(&mut buf, 48, self.geometry.slot_count);
        put_u64(&mut buf, 56, self.geometry.meta_offset);
        put_u64(&mut buf, 64, self.geometry.data_offset);
        put_u64(&mut buf, 72, self.backing.size_bytes);
        buf[80..96].copy_from_slice(&self.backing.fingerprint);
        put_u64(&mut buf, 96, self.created_unix_secs);
        put_u64(&mut buf, 104, self.backing.instance);
        let member = &self.membership;
        buf[112..114].copy_from_slice(&member.index.to_le_bytes());
        buf[114..116].copy_from_slice(&member.count.to_le_bytes());
        put_u32(&mut buf, 116, member.node.map_or(0, |node| node + 1));
        let features = if self.geometry.data_crc { FEATURE_DATA_CRC } else { 0 };
        put_u32(&mut buf, FEATURES_OFFSET, features);
        let crc = crc32c::crc32c(&buf[..CRC_OFFSET]);
        put_u32(&mut buf, CRC_OFFSET, crc);
        buf
    }

    /// Decodes and validates a header read from a medium of `medium_bytes`.
    pub fn decode(buf: &[u8], medium_bytes: u64) -> Result<Self, FormatError> {
        if buf.len() < HEADER_BYTES {
            return Err(FormatError::BadGeometry(format!(
                "medium of {} bytes is too small for a superblock",
                buf.len()
            )));
        }
        let magic: [u8; 8] = buf[0..8].try_into().expect("8 bytes");
        if magic != MAGIC {
            return Err(FormatError::BadMagic { found: magic });
        }
        let version = get_u32(buf, 8);
        if !(FORMAT_VERSION_MIN..=FORMAT_VERSION).contains(&version) {
            return Err(FormatError::UnsupportedVersion {
                found: version,
                supported: FORMAT_VERSION,
            });
        }
        let stored = get_u32(buf, CRC_OFFSET);
        let computed = crc32c::crc32c(&buf[..CRC_OFFSET]);
        if stored != computed {
            return Err(FormatError::BadChecksum { stored, computed });
        }
        if get_u32(buf, 12) as usize != HEADER_BYTES {
            return Err(FormatError::BadGeometry(format!("header length {}", get_u32(buf, 12))));
        }
        let features = if version >= 4 { get_u32(buf, FEATURES_OFFSET) } else { 0 };
        if features & !FEATURES_KNOWN != 0 {
            return Err(FormatError::BadGeometry(format!(
                "feature flags {features:#x}: this build knows {FEATURES_KNOWN:#x} only"
            )));
        }
        let geometry = Geometry {
            medium_bytes: get_u64(buf, 32),
            block_size: get_u32(buf, 40),
            slot_count: get_u64(buf, 48),
            meta_offset: get_u64(buf, 56),
            data_offset: get_u64(buf, 64),
            data_crc: features & FEATURE_DATA_CRC != 0,
        };
        geometry.validate(medium_bytes)?;
        let membership = if version == 2 {
            Membership::SOLE
        } else {
            let index = u16::from_le_bytes(buf[112..114].try_into().expect("2 bytes"));
            let count = u16::from_le_bytes(buf[114..116].try_into().expect("2 bytes"));
            if index >= count {
                return Err(FormatError::BadGeometry(format!(
                    "member {index} of a set of {count}"
                )));
            }
            let node = get_u32(buf, 116).checked_sub(1);
            Membership { index, count, node }
        };
        Ok(Self {
            uuid: buf[16..32].try_into().expect("16 bytes"),
            geometry,
            membership,
            backing: BackingIdentity {
                size_bytes: get_u64(buf, 72),
                fingerprint: buf[80..96].try_into().expect("16 bytes"),
                instance: get_u64(buf, 104),
            },
            created_unix_secs: get_u64(buf, 96),
        })
    }

    /// Checks that `given` is the backing store this cache was formatted for.
    /// The size and path fingerprint must match; the instance (inode) too where both the
    /// superblock and the store know it (0 is unknown: a block device, or a version-2 cache
    /// whose bytes 104..112 were left zero when it was formatted).
    pub fn check_backing(&self, given: &BackingIdentity) -> Result<(), FormatError> {
        let recorded = &self.backing;
        if recorded.size_bytes == given.size_bytes && recorded.fingerprint == given.fingerprint {
            if recorded.instance != 0 && given.instance != 0 && recorded.instance != given.instance
            {
                return Err(FormatError::BackingReplaced {
                    recorded_instance: recorded.instance,
                    given_instance: given.instance,
                });
            }
            return Ok(());
        }
        Err(FormatError::BackingMismatch {
            recorded_bytes: self.backing.size_bytes,
            recorded_fingerprint: hex(&self.backing.fingerprint),
            given_bytes: given.size_bytes,
            given_fingerprint: hex(&given.fingerprint),
        })
    }
}

/// Whether a cached block matches the backing store (clean) or is newer (dirty).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum BlockState {
    /// The backing store holds the same data (subject to the synced-sequence rule).
    Clean,
    /// Only the cache holds this data.
    Dirty,
}

/// A valid slot metadata entry.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct SlotEntry {
    /// Backing block number.
    pub lba: u64,
    /// Clean or dirty.
    pub state: BlockState,
    /// Sequence number: larger is newer. Never 0, never a multiple of 256.
    pub seq: u64,
}

/// What a metadata entry read from the medium holds.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum DecodedEntry {
    /// No block.
    Free,
    /// A block.
    Valid(SlotEntry),
    /// The two words come from different updates (a torn update cut by power loss).
    Torn,
    /// The words do not form any entry this build writes.
    Corrupt,
}

/// A sequence number the engine may issue: not 0 and not a multiple of 256, so that a freed
/// entry's zero second word never matches an entry's sequence low byte.
pub fn is_issuable_seq(seq: u64) -> bool {
    seq & 0xff != 0 && seq <= SEQ_MAX
}

/// The largest sequence number the engine issues (2^56 - 1: ten million writes a second for
/// more than two centuries). Entries above it are corrupt, so that no number read from the
/// medium can carry the counters into overflow; the synced word keeps its check in the
/// 8 bits above it.
pub const SEQ_MAX: u64 = (1 << 56) - 1;

/// The synced word: the synced sequence number (56 bits) and an 8-bit check of it (the
/// CRC32C of the number, its four bytes folded by XOR) in the top byte, so that a word
/// rotted or torn into another value is not trusted. Format version 2.
pub fn encode_synced_seq(seq: u64) -> u64 {
    assert!(seq <= SEQ_MAX, "synced sequence {seq:#x} beyond SEQ_MAX");
    seq | u64::from(synced_check(seq)) << 56
}

/// The synced sequence number a synced word holds, if its check matches.
pub fn decode_synced_seq(word: u64) -> Option<u64> {
    let seq = word & SEQ_MAX;
    (word >> 56 == u64::from(synced_check(seq))).then_some(seq)
}

fn synced_check(seq: u64) -> u8 {
    let crc = crc32c_two_words(seq, SYNCED_SALT);
    crc.to_le_bytes().iter().fold(0, |check, byte| check ^ byte)
}

/// Mixed into the synced word's check, so that it differs from an entry's for equal numbers.
const SYNCED_SALT: u64 = u64::from_le_bytes(*b"SYNCED\0\x02");

fn entry_check(word0_without_check: u64, seq: u64) -> u64 {
    u64::from(crc32c_two_words(word0_without_check, seq) & 0xfff)
}

/// CRC32C (Castagnoli, reflected polynomial 0x82F63B78) tables for slicing by 8:
/// `CRC32C_TABLES[k][b]` is the CRC of byte `b` followed by `k` zero bytes.
const CRC32C_TABLES: [[u32; 256]; 8] = {
    let mut tables = [[0u32; 256]; 8];
    let mut byte = 0;
    while byte < 256 {
        let mut crc = byte as u32;
        let mut bit = 0;
        while bit < 8 {
            crc = if crc & 1 != 0 { crc >> 1 ^ 0x82F6_3B78 } else { crc >> 1 };
            bit += 1;
        }
        tables[0][byte] = crc;
        byte += 1;
    }
    let mut k = 1;
    while k < 8 {
        let mut byte = 0;
        while byte < 256 {
            let previous = tables[k - 1][byte];
            tables[k][byte] = previous >> 8 ^ tables[0][(previous & 0xff) as usize];
            byte += 1;
        }
        k += 1;
    }
    tables
};

/// `crc32c::crc32c` of the 16 little-endian bytes of `first` then `second`: an entry is
/// checked on every write and every recovery, and the general routine's set-up costs more than
/// the two words themselves. With the CPU's CRC32C instruction, two of them; without it,
/// slicing by 8 (sixteen table lookups).
#[inline]
fn crc32c_two_words(first: u64, second: u64) -> u32 {
    match pmcache_media::Crc32cInstruction::detect() {
        Some(crc) => !crc.fold_u64(crc.fold_u64(!0, first), second),
        None => crc32c_two_words_by_tables(first, second),
    }
}

fn crc32c_two_words_by_tables(first: u64, second: u64) -> u32 {
    let t = &CRC32C_TABLES;
    let fold = |crc: u32, word: u64| {
        let low = word as u32 ^ crc;
        let high = (word >> 32) as u32;
        let byte = |x: u32, at: u32| (x >> at & 0xff) as usize;
        t[7][byte(low, 0)]
            ^ t[6][byte(low, 8)]
            ^ t[5][byte(low, 16)]
            ^ t[4][byte(low, 24)]
            ^ t[3][byte(high, 0)]
            ^ t[2][byte(high, 8)]
            ^ t[1][byte(high, 16)]
            ^ t[0][byte(high, 24)]
    };
    !fold(fold(!0, first), second)
}

/// The backing block number word 0 of an entry names, whatever else the word holds.
pub fn word0_lba(word0: u64) -> u64 {
    word0 & LBA_MASK
}

impl SlotEntry {
    /// Encodes as (word0, word1); see docs/FORMAT.md.
    pub fn encode(&self) -> (u64, u64) {
        assert!(self.lba <= LBA_MASK, "block number {} does not fit 40 bits", self.lba);
        assert!(is_issuable_seq(self.seq), "sequence {} may not be issued", self.seq);
        let state = match self.state {
            BlockState::Clean => 1u64,
            BlockState::Dirty => 2u64,
        };
        let word0 = self.lba | state << STATE_SHIFT | (self.seq & 0xff) << SEQ_LOW_SHIFT;
        (word0 | entry_check(word0, self.seq) << CHECK_SHIFT, self.seq)
    }

    /// Decodes two words read from the medium.
    pub fn decode(word0: u64, word1: u64) -> DecodedEntry {
        if word0 == 0 {
            return DecodedEntry::Free;
        }
        let state = match (word0 >> STATE_SHIFT) & 0xf {
            1 => BlockState::Clean,
            2 => BlockState::Dirty,
            _ => return DecodedEntry::Corrupt,
        };
        if (word0 >> SEQ_LOW_SHIFT) & 0xff != word1 & 0xff {
            return DecodedEntry::Torn;
        }
        let without_check = word0 & ((1 << CHECK_SHIFT) - 1);
        if word0 >> CHECK_SHIFT != entry_check(without_check, word1) || !is_issuable_seq(word1) {
            return DecodedEntry::Corrupt;
        }
        DecodedEntry::Valid(SlotEntry { lba: word0 & LBA_MASK, state, seq: word1 })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn superblock() -> Superblock {
        Superblock {
            uuid: [9; 16],
            geometry: Geometry::for_medium(1 << 24, 4096).unwrap(),
            membership: Membership { index: 1, count: 3, node: Some(0) },
            backing: BackingIdentity { size_bytes: 1 << 30, fingerprint: [3; 16], instance: 77 },
            created_unix_secs: 1_700_000_000,
        }
    }

    #[test]
    fn geometry_fits_the_medium() {
        for (len, block) in [(1u64 << 24, 4096u32), (1 << 20, 512), ((1 << 24) + 12345, 65536)] {
            let g = Geometry::for_medium(len, block).unwrap();
            assert!(g.data_offset + g.slot_count * u64::from(block) <= len);
            assert!(g.meta_offset + g.slot_count * ENTRY_BYTES <= g.data_offset);
            assert_eq!(g.data_offset % u64::from(block.max(4096)), 0);
            // One more slot would not fit.
            let more = g.slot_count + 1;
            let off =
                (g.meta_offset + more * ENTRY_BYTES).next_multiple_of(u64::from(block.max(4096)));
            assert!(off + more * u64::from(block) > len);
        }
        assert!(Geometry::for_medium(1 << 20, 3000).is_err());
        assert!(Geometry::for_medium(8192, 4096).is_err());
        // The smallest medium accepted holds 16 slots; a byte less is refused.
        let smallest = 8192 + 16 * 512;
        assert_eq!(Geometry::for_medium(smallest, 512).map(|g| g.slot_count), Ok(16));
        assert!(Geometry::for_medium(smallest - 1, 512).is_err());
        // Slot numbers and the slot count are 32-bit: a huge medium is capped below u32::MAX.
        let huge = Geometry::for_medium(1 << 45, 512).unwrap();
        assert_eq!(huge.slot_count, u64::from(u32::MAX - 1));
        assert!(huge.data_offset + huge.slot_count * 512 <= 1 << 45);
        // Media too small even for the superblock are refused, not underflowed.
        for len in [0, 100, SUPERBLOCK_BYTES - 1, SUPERBLOCK_BYTES, SUPERBLOCK_BYTES + 512] {
            for block in [512, 4096] {
                let err = Geometry::for_medium(len, block).unwrap_err();
                assert!(err.to_string().contains("at least 16"), "{len} bytes: {err}");
            }
        }
    }

    #[test]
    fn superblock_round_trips_and_every_corruption_is_refused() {
        let sb = superblock();
        let bytes = sb.encode();
        assert_eq!(Superblock::decode(&bytes, 1 << 24), Ok(sb));
        for at in 0..HEADER_BYTES {
            let mut bad = bytes;
            bad[at] ^= 0x10;
            assert!(Superblock::decode(&bad, 1 << 24).is_err(), "flip at byte {at} accepted");
        }
        let truncated = Superblock::decode(&bytes, (1 << 24) - 4096).unwrap_err();
        assert!(truncated.to_string().contains("truncated"), "{truncated}");
        assert!(matches!(
            Superblock::decode(&[0u8; 128], 1 << 24),
            Err(FormatError::BadMagic { .. })
        ));
        // The next version and version 1 (it had an unchecked synced word) are refused.
        for other in [FORMAT_VERSION + 1, FORMAT_VERSION_MIN - 1] {
            let mut bytes = bytes;
            put_u32(&mut bytes, 8, other);
            assert_eq!(
                Superblock::decode(&bytes, 1 << 24),
                Err(FormatError::UnsupportedVersion { found: other, supported: 4 })
            );
        }
        assert!(Superblock::decode(&bytes[..64], 1 << 24).is_err());
    }

    /// With data checksums a slot takes 20 bytes of metadata (its entry, then its checksum in
    /// an array after the entries), still below the block-aligned data; the flag round-trips
    /// through the header; a version-3 header is read without it.
    #[test]
    fn data_checksums_take_four_bytes_a_slot_after_the_entries() {
        for (len, block) in [(1u64 << 24, 4096u32), (1 << 20, 512), ((1 << 24) + 12345, 65536)] {
            let plain = Geometry::plan(len, block, false).unwrap();
            let checked = Geometry::plan(len, block, true).unwrap();
            assert!(checked.data_crc && !plain.data_crc);
            assert!(checked.slot_count <= plain.slot_count);
            let end = checked.meta_offset + checked.slot_count * (ENTRY_BYTES + DATA_CRC_BYTES);
            assert!(end <= checked.data_offset);
            assert_eq!(checked.crc_offset(0), checked.meta_offset + checked.slot_count * 16);
            assert!(checked.data_offset + checked.slot_count * u64::from(block) <= len);
        }
        let sb = superblock();
        let checked = Superblock { geometry: Geometry::plan(1 << 24, 4096, true).unwrap(), ..sb };
        let bytes = checked.encode();
        assert_eq!(get_u32(&bytes, FEATURES_OFFSET), FEATURE_DATA_CRC);
        assert_eq!(Superblock::decode(&bytes, 1 << 24), Ok(checked));
        let mut v3 = sb.encode();
        put_u32(&mut v3, 8, 3);
        let crc = crc32c::crc32c(&v3[..CRC_OFFSET]);
        put_u32(&mut v3, CRC_OFFSET, crc);
        assert!(!Superblock::decode(&v3, 1 << 24).unwrap().geometry.data_crc);
    }

    /// Version 3 records the member's place and node in bytes 112..120; a member number past
    /// the set's size is refused; a version-2 header (those bytes zero) is a one-member set.
    #[test]
    fn the_membership_round_trips_and_version_2_reads_as_a_set_of_one() {
        let sb = superblock();
        let bytes = sb.encode();
        assert_eq!(&bytes[112..120], &[1, 0, 3, 0, 1, 0, 0, 0]);
        let decoded = Superblock::decode(&bytes, 1 << 24).unwrap();
        assert_eq!(decoded.membership, Membership { index: 1, count: 3, node: Some(0) });
        let unknown = Superblock { membership: Membership::SOLE, ..sb }.encode();
        assert_eq!(get_u32(&unknown, 116), 0);
        assert_eq!(Superblock::decode(&unknown, 1 << 24).unwrap().membership, Membership::SOLE);
        let mut past =
            Superblock { membership: Membership { index: 3, count: 3, node: None }, ..sb }.encode();
        let err = Superblock::decode(&past, 1 << 24).unwrap_err();
        assert!(err.to_string().contains("member 3 of a set of 3"), "{err}");
        // A version-2 header as that version wrote it: bytes 112..124 zero.
        past[112..124].fill(0);
        put_u32(&mut past, 8, 2);
        let crc = crc32c::crc32c(&past[..CRC_OFFSET]);
        put_u32(&mut past, CRC_OFFSET, crc);
        let old = Superblock::decode(&past, 1 << 24).unwrap();
        assert_eq!(
            (old.membership, old.uuid, old.geometry),
            (Membership::SOLE, sb.uuid, sb.geometry)
        );
    }

    #[test]
    fn backing_identity_is_checked() {
        let sb = superblock();
        assert!(sb.check_backing(&sb.backing).is_ok());
        let other = BackingIdentity { size_bytes: 1 << 30, fingerprint: [4; 16], instance: 77 };
        let err = sb.check_backing(&other).unwrap_err().to_string();
        assert!(err.contains("another backing store"), "{err}");
        // Both fingerprints, in hex, so that an operator can tell which device is which.
        assert!(err.contains(&format!("fingerprint {}", "03".repeat(16))), "{err}");
        assert!(err.contains(&format!("fingerprint {}", "04".repeat(16))), "{err}");
        assert_eq!(hex(&[0x00, 0x0f, 0xa5, 0xff]), "000fa5ff");
        // The same path and size, another file there (its inode): refused, naming both.
        let replaced = BackingIdentity { instance: 78, ..sb.backing };
        assert_eq!(
            sb.check_backing(&replaced),
            Err(FormatError::BackingReplaced { recorded_instance: 77, given_instance: 78 })
        );
        // Where either side does not know the inode (a block device; a superblock whose field
        // reads 0), path and size decide.
        assert!(sb.check_backing(&BackingIdentity { instance: 0, ..sb.backing }).is_ok());
        let mut old = sb;
        old.backing.instance = 0;
        assert!(old.check_backing(&replaced).is_ok());
        // The inode round-trips through the header, in bytes 104..112.
        let bytes = sb.encode();
        assert_eq!(get_u64(&bytes, 104), 77);
        assert_eq!(
            Superblock::decode(&bytes, sb.geometry.medium_bytes).map(|d| d.backing),
            Ok(sb.backing)
        );
    }

    #[test]
    fn a_torn_entry_over_a_freed_slot_is_always_detected() {
        let entry = SlotEntry { lba: 77, state: BlockState::Dirty, seq: 0x1234_5601 };
        let (w0, w1) = entry.encode();
        assert_eq!(SlotEntry::decode(w0, w1), DecodedEntry::Valid(entry));
        // A freed slot holds (0, 0); either word alone reaching the medium is not an entry.
        assert_eq!(SlotEntry::decode(w0, 0), DecodedEntry::Torn);
        assert_eq!(SlotEntry::decode(0, w1), DecodedEntry::Free);
        // A state change rewrites word 0 only.
        let clean = SlotEntry { state: BlockState::Clean, ..entry };
        assert_eq!(SlotEntry::decode(clean.encode().0, w1), DecodedEntry::Valid(clean));
    }

    /// Power loss tears an entry at 8-byte granularity and bits rot: no single flipped bit of
    /// either word turns an entry into another valid one (the check is 12 bits of a CRC, and a
    /// CRC sees every single-bit error; a flip in the sequence number's low byte reads as torn).
    #[test]
    fn no_single_bit_flip_of_an_entry_decodes_as_an_entry() {
        let entries = [
            SlotEntry { lba: 0, state: BlockState::Clean, seq: 1 },
            SlotEntry { lba: 77, state: BlockState::Dirty, seq: 0x1234_5601 },
            SlotEntry { lba: LBA_MASK, state: BlockState::Dirty, seq: SEQ_MAX - 1 },
            SlotEntry { lba: 0x55_5555_5555, state: BlockState::Clean, seq: 0x00aa_aaaa_aaaa_aa01 },
        ];
        for entry in entries {
            let (w0, w1) = entry.encode();
            assert_eq!(SlotEntry::decode(w0, w1), DecodedEntry::Valid(entry));
            for bit in 0..64 {
                for (word, flipped) in [
                    (0, SlotEntry::decode(w0 ^ 1 << bit, w1)),
                    (1, SlotEntry::decode(w0, w1 ^ 1 << bit)),
                ] {
                    assert!(
                        !matches!(flipped, DecodedEntry::Valid(_)),
                        "{entry:?}: bit {bit} of word {word} flipped decodes as {flipped:?}"
                    );
                }
            }
        }
    }

    /// A freed entry's second word is 0, so no entry may have a sequence number whose low byte
    /// is 0: the engine never issues one, and an entry holding one, checksum and all, is corrupt.
    #[test]
    fn sequence_numbers_with_a_zero_low_byte_are_never_entries() {
        for seq in [0, 0x100, 0x1200, u64::MAX - 0xff] {
            assert!(!is_issuable_seq(seq), "{seq:#x}");
            let word0 = 5 | 2 << STATE_SHIFT;
            let word0 = word0 | entry_check(word0, seq) << CHECK_SHIFT;
            assert_eq!(SlotEntry::decode(word0, seq), DecodedEntry::Corrupt, "{seq:#x}");
        }
        for seq in [1, 0xff, 0x101, 0x1234_5601, SEQ_MAX - 1] {
            assert!(is_issuable_seq(seq), "{seq:#x}");
        }
    }

    /// The synced word round-trips every number up to `SEQ_MAX`, and no single flipped bit
    /// (of the number or of its check) decodes: the check's syndrome for a flip depends only
    /// on the bit's position (CRC32C is affine), so trying every position on a few numbers
    /// covers all. All zeroes (a version-1 word for 0) is not a valid word either.
    #[test]
    fn a_synced_word_with_any_single_bit_flipped_is_refused() {
        for seq in [0, 1, 0x1234_5678, SEQ_MAX - 1, SEQ_MAX] {
            let word = encode_synced_seq(seq);
            assert_eq!(decode_synced_seq(word), Some(seq));
            for bit in 0..64 {
                assert_eq!(decode_synced_seq(word ^ 1 << bit), None, "{seq:#x}, bit {bit}");
            }
        }
        assert_eq!(decode_synced_seq(0), None);
        assert_eq!(decode_synced_seq(u64::MAX), None);
    }

    /// No sequence number above `SEQ_MAX` is an entry, however well its check matches: a
    /// crafted or rotted number near 2^64 would otherwise carry the engine's counters into
    /// overflow (and wrap them below the numbers still on the medium).
    #[test]
    fn sequence_numbers_beyond_seq_max_are_never_entries() {
        let entry = |seq: u64| {
            let word0 = 5 | 2 << STATE_SHIFT | (seq & 0xff) << SEQ_LOW_SHIFT;
            (word0 | entry_check(word0, seq) << CHECK_SHIFT, seq)
        };
        for seq in [SEQ_MAX + 1, SEQ_MAX + 0x1ff, u64::MAX, u64::MAX - 0x100] {
            assert!(!is_issuable_seq(seq), "{seq:#x}");
            let (word0, word1) = entry(seq);
            assert_eq!(SlotEntry::decode(word0, word1), DecodedEntry::Corrupt, "{seq:#x}");
        }
        let (word0, word1) = entry(SEQ_MAX - 1);
        assert!(matches!(SlotEntry::decode(word0, word1), DecodedEntry::Valid(_)));
    }

    #[test]
    fn the_entry_check_matches_crc32c_on_fixed_words() {
        // The standard CRC32C check value ("123456789" gives 0xE3069283) pins the polynomial;
        // the words below pin the byte order the format documents.
        assert_eq!(crc32c::crc32c(b"123456789"), 0xE306_9283);
        for (first, second) in [(0, 0), (u64::MAX, 0), (0x0123_4567_89ab_cdef, 42), (1, 1 << 63)] {
            let mut bytes = [0u8; 16];
            bytes[..8].copy_from_slice(&u64::to_le_bytes(first));
            bytes[8..].copy_from_slice(&u64::to_le_bytes(second));
            assert_eq!(crc32c_two_words(first, second), crc32c::crc32c(&bytes));
            assert_eq!(crc32c_two_words_by_tables(first, second), crc32c::crc32c(&bytes));
        }
    }

    proptest! {
        #[test]
        fn entries_round_trip(lba in 0u64..MAX_BACKING_BLOCKS, seq in 1u64..=SEQ_MAX, dirty: bool) {
            prop_assume!(is_issuable_seq(seq));
            let state = if dirty { BlockState::Dirty } else { BlockState::Clean };
            let entry = SlotEntry { lba, state, seq };
            let (w0, w1) = entry.encode();
            prop_assert_eq!(SlotEntry::decode(w0, w1), DecodedEntry::Valid(entry));
        }

        #[test]
        fn the_entry_check_is_crc32c_of_the_two_words(first: u64, second: u64) {
            let mut bytes = [0u8; 16];
            bytes[..8].copy_from_slice(&first.to_le_bytes());
            bytes[8..].copy_from_slice(&second.to_le_bytes());
            prop_assert_eq!(crc32c_two_words(first, second), crc32c::crc32c(&bytes));
            prop_assert_eq!(crc32c_two_words_by_tables(first, second), crc32c::crc32c(&bytes));
        }

        #[test]
        fn decoding_arbitrary_words_never_panics(w0: u64, w1: u64) {
            let _ = SlotEntry::decode(w0, w1);
        }

        #[test]
        fn decoding_arbitrary_superblocks_never_panics(bytes in proptest::collection::vec(any::<u8>(), 0..200), len: u64) {
            let _ = Superblock::decode(&bytes, len);
        }
    }
}
