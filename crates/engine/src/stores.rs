//! Several backing stores on one cache medium: the store table (docs/FORMAT.md, "Store
//! table").
//!
//! A medium shared by N backing stores starts with a store table instead of a superblock: the
//! name and the window (a byte range of the medium) of each store. Each window holds a whole
//! cache of its own — superblock at the window's offset 0 (with its backing store's identity),
//! slot metadata, slots — so recovery, write-back, detach and the clean/dirty shutdown state
//! are each store's own, and one store's backing device failing or missing leaves the others'
//! caches untouched. Each window is served through [`pmcache_media::Window`].
//!
//! The table is written last at format, after every window's superblock: its body first,
//! persisted with its magic word zero, then the 8-byte magic word alone (failure-atomic),
//! persisted. A power cut anywhere before that leaves a medium with no table (nothing named
//! on it, never a torn table), and never a table naming windows that hold no cache. It is
//! not changed afterwards. Bytes read from a medium are validated into [`StoreTableError`]s.

use std::ops::Range;

use pmcache_media::Medium;

/// Magic bytes at offset 0 of a medium shared by several backing stores.
pub const STORE_TABLE_MAGIC: [u8; 8] = *b"PMCSTORE";
/// The store table version this build writes and reads.
pub const STORE_TABLE_VERSION: u32 = 1;
/// Bytes of the store table, at offset 0 (its CRC32C in the last 4).
pub const STORE_TABLE_BYTES: usize = 4096;
/// Alignment of every window, and the bytes the table's region takes before the first one.
pub const STORE_ALIGN_BYTES: u64 = 64 << 10;
/// Most backing stores one medium holds.
pub const STORES_MAX: usize = 16;
/// Longest store name in bytes.
pub const STORE_NAME_BYTES_MAX: usize = 63;

const HEADER_END: usize = 32;
const ENTRY_BYTES: usize = 128;
const NAME_FIELD_BYTES: usize = 64;
const CRC_OFFSET: usize = STORE_TABLE_BYTES - 4;

/// One backing store's place on the medium.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct StoreEntry {
    /// The store's name: its NBD export name, and part of its control socket's path.
    pub name: String,
    /// Its window: the bytes of the medium its cache is on.
    pub window: Range<u64>,
}

/// The stores of a medium shared by several, in the order they were formatted.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct StoreTable {
    /// The stores.
    pub stores: Vec<StoreEntry>,
}

/// A store table that cannot be used: the bytes on the medium, or what was asked at format.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum StoreTableError {
    /// The medium does not start with a store table.
    #[error("no store table on the medium (magic {found:02x?})")]
    NotATable {
        /// The first 8 bytes found.
        found: [u8; 8],
    },
    /// Written by another version.
    #[error("the medium's store table has version {0}; this build reads version 1")]
    UnsupportedVersion(u32),
    /// The checksum does not match.
    #[error(
        "store table checksum mismatch (stored {stored:#010x}, computed {computed:#010x}): the \
         table is corrupt"
    )]
    BadChecksum {
        /// Checksum on the medium.
        stored: u32,
        /// Checksum of the bytes read.
        computed: u32,
    },
    /// A store count of 0 or past [`STORES_MAX`].
    #[error("a store table holds 1 to {STORES_MAX} stores, not {0}")]
    BadCount(usize),
    /// A name that cannot be a store's.
    #[error("store name {name:?}: {why}")]
    BadName {
        /// The name (lossy, from the medium).
        name: String,
        /// Why not.
        why: &'static str,
    },
    /// Two stores of one name.
    #[error("two stores are named {0:?}")]
    DuplicateName(String),
    /// A window that is not inside the medium, not aligned, or overlaps another.
    #[error("store {name:?}: window {start}..{end} is not a window of this medium: {why}")]
    BadWindow {
        /// The store.
        name: String,
        /// Its first byte.
        start: u64,
        /// Past its last byte.
        end: u64,
        /// Why not.
        why: String,
    },
    /// The medium is too small to give every store a window.
    #[error(
        "a medium of {medium_bytes} bytes is too small for {stores} stores (each needs a \
         window of {STORE_ALIGN_BYTES} bytes at least)"
    )]
    TooSmall {
        /// The medium's size.
        medium_bytes: u64,
        /// The stores asked for.
        stores: usize,
    },
}

/// Checks that `name` can name a store: 1 to 63 bytes of ASCII letters, digits, `.`, `_`,
/// `-`, not starting with `.` or `-` (it becomes part of a file name and an NBD export name).
pub fn check_store_name(name: &str) -> Result<(), StoreTableError> {
    let bad = |why| Err(StoreTableError::BadName { name: name.to_owned(), why });
    if name.is_empty() || name.len() > STORE_NAME_BYTES_MAX {
        return bad("a store name has 1 to 63 bytes");
    }
    if !name.bytes().all(|b| b.is_ascii_alphanumeric() || b"._-".contains(&b)) {
        return bad("a store name has only ASCII letters, digits, '.', '_' and '-'");
    }
    if name.starts_with(['.', '-']) {
        return bad("a store name does not start with '.' or '-'");
    }
    Ok(())
}

impl StoreTable {
    /// Windows of equal size for `names` on a medium of `medium_bytes`, in order, each
    /// [`STORE_ALIGN_BYTES`]-aligned, after the table's region.
    pub fn plan(medium_bytes: u64, names: &[String]) -> Result<Self, StoreTableError> {
        if names.is_empty() || names.len() > STORES_MAX {
            return Err(StoreTableError::BadCount(names.len()));
        }
        for (i, name) in names.iter().enumerate() {
            check_store_name(name)?;
            if names[..i].contains(name) {
                return Err(StoreTableError::DuplicateName(name.clone()));
            }
        }
        let usable = medium_bytes.saturating_sub(STORE_ALIGN_BYTES);
        let window_bytes = usable / names.len() as u64 / STORE_ALIGN_BYTES * STORE_ALIGN_BYTES;
        if window_bytes == 0 {
            return Err(StoreTableError::TooSmall { medium_bytes, stores: names.len() });
        }
        let stores = names
            .iter()
            .enumerate()
            .map(|(i, name)| {
                let start = STORE_ALIGN_BYTES + i as u64 * window_bytes;
                StoreEntry { name: name.clone(), window: start..start + window_bytes }
            })
            .collect();
        Ok(Self { stores })
    }

    /// The store named `name`.
    pub fn store(&self, name: &str) -> Option<&StoreEntry> {
        self.stores.iter().find(|s| s.name == name)
    }

    /// The names, in order.
    pub fn names(&self) -> Vec<&str> {
        self.stores.iter().map(|s| s.name.as_str()).collect()
    }

    /// The table's bytes for a medium of `medium_bytes`.
    pub fn encode(&self, medium_bytes: u64) -> [u8; STORE_TABLE_BYTES] {
        let mut buf = [0u8; STORE_TABLE_BYTES];
        buf[0..8].copy_from_slice(&STORE_TABLE_MAGIC);
        buf[8..12].copy_from_slice(&STORE_TABLE_VERSION.to_le_bytes());
        buf[12..16].copy_from_slice(&(self.stores.len() as u32).to_le_bytes());
        buf[16..24].copy_from_slice(&medium_bytes.to_le_bytes());
        for (i, store) in self.stores.iter().enumerate() {
            let at = HEADER_END + i * ENTRY_BYTES;
            buf[at..at + store.name.len()].copy_from_slice(store.name.as_bytes());
            let at = at + NAME_FIELD_BYTES;
            buf[at..at + 8].copy_from_slice(&store.window.start.to_le_bytes());
            buf[at + 8..at + 16].copy_from_slice(&store.window.end.to_le_bytes());
        }
        let crc = crc32c::crc32c(&buf[..CRC_OFFSET]);
        buf[CRC_OFFSET..].copy_from_slice(&crc.to_le_bytes());
        buf
    }

    /// The table in `buf` (the first [`STORE_TABLE_BYTES`] of a medium of `medium_bytes`),
    /// validated: magic, version, checksum, names, and windows that are aligned, inside the
    /// medium, after the table's region and disjoint.
    pub fn decode(buf: &[u8], medium_bytes: u64) -> Result<Self, StoreTableError> {
        let mut magic = [0u8; 8];
        let head = buf.len().min(8);
        magic[..head].copy_from_slice(&buf[..head]);
        if magic != STORE_TABLE_MAGIC || buf.len() < STORE_TABLE_BYTES {
            return Err(StoreTableError::NotATable { found: magic });
        }
        let word = |at: usize| u64::from_le_bytes(buf[at..at + 8].try_into().expect("8 bytes"));
        let half = |at: usize| u32::from_le_bytes(buf[at..at + 4].try_into().expect("4 bytes"));
        let version = half(8);
        if version != STORE_TABLE_VERSION {
            return Err(StoreTableError::UnsupportedVersion(version));
        }
        let stored = half(CRC_OFFSET);
        let computed = crc32c::crc32c(&buf[..CRC_OFFSET]);
        if stored != computed {
            return Err(StoreTableError::BadChecksum { stored, computed });
        }
        let count = half(12) as usize;
        if count == 0 || count > STORES_MAX {
            return Err(StoreTableError::BadCount(count));
        }
        let formatted_bytes = word(16);
        let mut stores: Vec<StoreEntry> = Vec::with_capacity(count);
        for i in 0..count {
            let at = HEADER_END + i * ENTRY_BYTES;
            let field = &buf[at..at + NAME_FIELD_BYTES];
            let len = field.iter().position(|&b| b == 0).unwrap_or(NAME_FIELD_BYTES);
            let name = String::from_utf8_lossy(&field[..len]).into_owned();
            check_store_name(&name)?;
            if stores.iter().any(|s| s.name == name) {
                return Err(StoreTableError::DuplicateName(name));
            }
            let (start, end) = (word(at + NAME_FIELD_BYTES), word(at + NAME_FIELD_BYTES + 8));
            let bad =
                |why: String| StoreTableError::BadWindow { name: name.clone(), start, end, why };
            if formatted_bytes != medium_bytes {
                return Err(bad(format!(
                    "the table was written for a medium of {formatted_bytes} bytes, this one has \
                     {medium_bytes}"
                )));
            }
            if start < STORE_ALIGN_BYTES || end <= start || end > medium_bytes {
                return Err(bad(format!("outside {STORE_ALIGN_BYTES}..{medium_bytes}")));
            }
            if !start.is_multiple_of(STORE_ALIGN_BYTES) || !end.is_multiple_of(STORE_ALIGN_BYTES) {
                return Err(bad(format!("not aligned to {STORE_ALIGN_BYTES} bytes")));
            }
            if let Some(other) =
                stores.iter().find(|s| s.window.start < end && start < s.window.end)
            {
                return Err(bad(format!("overlaps the window of store {:?}", other.name)));
            }
            stores.push(StoreEntry { name, window: start..end });
        }
        Ok(Self { stores })
    }

    /// Whether `medium` starts with a store table's magic (a table, maybe a corrupt one).
    pub fn is_on(medium: &impl Medium) -> bool {
        let mut magic = [0u8; 8];
        medium.read(0, &mut magic);
        magic == STORE_TABLE_MAGIC
    }

    /// The table at the start of `medium`, validated.
    pub fn read(medium: &impl Medium) -> Result<Self, StoreTableError> {
        let mut buf = vec![0u8; STORE_TABLE_BYTES];
        medium.read(0, &mut buf);
        Self::decode(&buf, medium.len_bytes())
    }

    /// Makes the start of `medium` name nothing (zeroes where a table or a superblock would
    /// be), durably: the first step of a format, so that a power cut before the table is
    /// written leaves no table and no older superblock naming the windows being formatted.
    pub fn clear(medium: &impl Medium) {
        // The magic word first: from then on no table is named, whatever is left behind it.
        medium.store_u64(0, 0);
        medium.persist(0, 8);
        medium.write_persist(0, &[0u8; STORE_TABLE_BYTES]);
    }

    /// Writes the table at the start of `medium` and makes it durable: the last step of a
    /// format, after every window's cache is formatted.
    pub fn write(&self, medium: &impl Medium) {
        let bytes = self.encode(medium.len_bytes());
        // The body, durable, while the magic word still names nothing; then the magic word
        // alone, in one failure-atomic store: a table is whole or absent.
        medium.write_persist(8, &bytes[8..]);
        medium.store_u64(0, u64::from_le_bytes(bytes[..8].try_into().expect("8 bytes")));
        medium.persist(0, 8);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn names(names: &[&str]) -> Vec<String> {
        names.iter().map(|s| s.to_string()).collect()
    }

    #[test]
    fn a_plan_gives_equal_aligned_disjoint_windows_after_the_table() {
        let table = StoreTable::plan(64 << 20, &names(&["db", "logs", "home"])).expect("plan");
        let w: Vec<_> = table.stores.iter().map(|s| s.window.clone()).collect();
        assert_eq!(w[0].start, STORE_ALIGN_BYTES);
        assert_eq!(w[0].end, w[1].start);
        assert_eq!(w[1].end, w[2].start);
        assert!(w[2].end <= 64 << 20);
        let len = w[0].end - w[0].start;
        assert!(w.iter().all(|r| r.end - r.start == len && len.is_multiple_of(STORE_ALIGN_BYTES)));
        assert!((64 << 20) - w[2].end < 3 * STORE_ALIGN_BYTES);
    }

    #[test]
    fn a_table_round_trips_and_its_bytes_are_checked() {
        let table = StoreTable::plan(32 << 20, &names(&["a", "b-2"])).expect("plan");
        let bytes = table.encode(32 << 20);
        assert_eq!(StoreTable::decode(&bytes, 32 << 20), Ok(table.clone()));
        let mut flipped = bytes;
        flipped[HEADER_END + 1] ^= 1;
        assert!(matches!(
            StoreTable::decode(&flipped, 32 << 20),
            Err(StoreTableError::BadChecksum { .. })
        ));
        assert!(matches!(
            StoreTable::decode(&bytes, 64 << 20),
            Err(StoreTableError::BadWindow { .. })
        ));
        assert!(matches!(
            StoreTable::decode(&[0u8; STORE_TABLE_BYTES], 32 << 20),
            Err(StoreTableError::NotATable { .. })
        ));
    }

    #[test]
    fn overlapping_or_unaligned_windows_on_the_medium_are_refused() {
        let mut table = StoreTable::plan(32 << 20, &names(&["a", "b"])).expect("plan");
        table.stores[1].window.start -= STORE_ALIGN_BYTES;
        let err = StoreTable::decode(&table.encode(32 << 20), 32 << 20).unwrap_err();
        assert!(err.to_string().contains("overlaps the window of store \"a\""), "{err}");
        table.stores[1].window.start += 8;
        let err = StoreTable::decode(&table.encode(32 << 20), 32 << 20).unwrap_err();
        assert!(err.to_string().contains("not aligned"), "{err}");
    }

    #[test]
    fn names_and_counts_that_cannot_be_are_refused() {
        for bad in ["", ".hidden", "-x", "a/b", "sp ace", &"x".repeat(64)] {
            assert!(
                matches!(check_store_name(bad), Err(StoreTableError::BadName { .. })),
                "{bad:?}"
            );
        }
        assert_eq!(check_store_name("db_1.vol-2"), Ok(()));
        assert_eq!(
            StoreTable::plan(32 << 20, &names(&["a", "a"])),
            Err(StoreTableError::DuplicateName("a".into()))
        );
        assert_eq!(StoreTable::plan(32 << 20, &[]), Err(StoreTableError::BadCount(0)));
        assert!(matches!(
            StoreTable::plan(STORE_ALIGN_BYTES * 2, &names(&["a", "b"])),
            Err(StoreTableError::TooSmall { .. })
        ));
    }
}
