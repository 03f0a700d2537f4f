//! The virtio-blk device as a guest's driver sees it: the features offered, the configuration
//! space, and a request's header and status codes (virtio 1.2, section 5.2). Pure: no guest
//! memory here.

use virtio_bindings::virtio_blk::{
    VIRTIO_BLK_F_BLK_SIZE, VIRTIO_BLK_F_DISCARD, VIRTIO_BLK_F_FLUSH, VIRTIO_BLK_F_MQ,
    VIRTIO_BLK_F_RO, VIRTIO_BLK_F_SEG_MAX, VIRTIO_BLK_F_TOPOLOGY, VIRTIO_BLK_F_WRITE_ZEROES,
    VIRTIO_BLK_ID_BYTES, VIRTIO_BLK_S_IOERR, VIRTIO_BLK_S_OK, VIRTIO_BLK_S_UNSUPP,
    VIRTIO_BLK_T_DISCARD, VIRTIO_BLK_T_FLUSH, VIRTIO_BLK_T_GET_ID, VIRTIO_BLK_T_IN,
    VIRTIO_BLK_T_OUT, VIRTIO_BLK_T_WRITE_ZEROES,
};
use virtio_bindings::virtio_config::VIRTIO_F_VERSION_1;
use virtio_bindings::virtio_ring::{VIRTIO_RING_F_EVENT_IDX, VIRTIO_RING_F_INDIRECT_DESC};

/// The unit of a request's `sector` and of the capacity: 512 bytes, whatever the block size.
pub const SECTOR_BYTES: u64 = 512;
/// A request's header: type, reserved, sector (little-endian).
pub const HEADER_BYTES: usize = 16;
/// One range of a discard or write-zeroes request: sector, sectors, flags.
pub const RANGE_BYTES: usize = 16;
/// The device ID a GET_ID request reads.
pub const ID_BYTES: usize = VIRTIO_BLK_ID_BYTES as usize;
/// Ranges a discard or write-zeroes request may carry (`max_discard_seg`).
pub const RANGES_MAX: u32 = 16;
/// The largest range of a discard or write-zeroes, in sectors (`max_discard_sectors`).
const RANGE_SECTORS_MAX: u32 = 1 << 22;
/// Bit 0 of a write-zeroes range's flags: the device may deallocate the range.
pub const FLAG_UNMAP: u32 = 1;
/// The vhost-user feature bit that lets the protocol features be negotiated.
const VHOST_USER_F_PROTOCOL_FEATURES: u32 = 30;

/// Status byte values.
pub const STATUS_OK: u8 = VIRTIO_BLK_S_OK as u8;
/// The request failed.
pub const STATUS_IOERR: u8 = VIRTIO_BLK_S_IOERR as u8;
/// The request type is not supported.
pub const STATUS_UNSUPP: u8 = VIRTIO_BLK_S_UNSUPP as u8;

/// What the device is: its size, block size, queues and whether it takes writes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Geometry {
    /// The device's size in bytes (a multiple of `block_bytes`).
    pub size_bytes: u64,
    /// Its logical block size: every request's offset and length are multiples of it.
    pub block_bytes: u32,
    /// The physical block is `block_bytes << physical_block_exp` (the cache's block, where it
    /// is larger than the logical block the guest is told of).
    pub physical_block_exp: u8,
    /// Virtqueues (a thread and an engine lane each).
    pub queues: u16,
    /// Descriptors per virtqueue, at most.
    pub queue_size: u16,
    /// Refuse writes, discards and write-zeroes (`VIRTIO_BLK_F_RO`).
    pub read_only: bool,
    /// The device ID GET_ID answers (NUL-padded).
    pub serial: [u8; ID_BYTES],
}

impl Geometry {
    /// The virtio feature bits offered.
    pub fn features(&self) -> u64 {
        let mut bits = [
            VIRTIO_F_VERSION_1,
            VIRTIO_RING_F_EVENT_IDX,
            VIRTIO_RING_F_INDIRECT_DESC,
            VHOST_USER_F_PROTOCOL_FEATURES,
            VIRTIO_BLK_F_SEG_MAX,
            VIRTIO_BLK_F_BLK_SIZE,
            VIRTIO_BLK_F_TOPOLOGY,
            VIRTIO_BLK_F_FLUSH,
            VIRTIO_BLK_F_MQ,
        ]
        .iter()
        .fold(0u64, |acc, &bit| acc | 1 << bit);
        if self.read_only {
            bits |= 1 << VIRTIO_BLK_F_RO;
        } else {
            bits |= 1 << VIRTIO_BLK_F_DISCARD | 1 << VIRTIO_BLK_F_WRITE_ZEROES;
        }
        bits
    }

    /// The configuration space (`struct virtio_blk_config`, little-endian), as far as the
    /// features offered define it.
    pub fn config_space(&self) -> Vec<u8> {
        let mut c = Vec::with_capacity(64);
        let block_sectors = self.block_bytes / SECTOR_BYTES as u32;
        c.extend_from_slice(&(self.size_bytes / SECTOR_BYTES).to_le_bytes()); // capacity
        c.extend_from_slice(&0u32.to_le_bytes()); // size_max (not offered)
        // seg_max: a chain holds the header and the status beside the data.
        c.extend_from_slice(&u32::from(self.queue_size.saturating_sub(2).max(1)).to_le_bytes());
        c.extend_from_slice(&[0u8; 4]); // geometry (not offered)
        c.extend_from_slice(&self.block_bytes.to_le_bytes()); // blk_size
        c.push(self.physical_block_exp);
        c.push(0); // alignment_offset
        c.extend_from_slice(&1u16.to_le_bytes()); // min_io_size, in logical blocks
        c.extend_from_slice(&0u32.to_le_bytes()); // opt_io_size: no preference
        c.push(0); // wce (CONFIG_WCE not offered: FLUSH says there is a cache)
        c.push(0); // unused
        c.extend_from_slice(&self.queues.to_le_bytes()); // num_queues
        let range_sectors = RANGE_SECTORS_MAX / block_sectors * block_sectors;
        c.extend_from_slice(&range_sectors.to_le_bytes()); // max_discard_sectors
        c.extend_from_slice(&RANGES_MAX.to_le_bytes()); // max_discard_seg
        c.extend_from_slice(&block_sectors.to_le_bytes()); // discard_sector_alignment
        c.extend_from_slice(&range_sectors.to_le_bytes()); // max_write_zeroes_sectors
        c.extend_from_slice(&RANGES_MAX.to_le_bytes()); // max_write_zeroes_seg
        c.push(1); // write_zeroes_may_unmap
        c.extend_from_slice(&[0u8; 3]); // unused1
        c
    }
}

/// A request's type, from its header.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Kind {
    /// `VIRTIO_BLK_T_IN`.
    Read,
    /// `VIRTIO_BLK_T_OUT`.
    Write,
    /// `VIRTIO_BLK_T_FLUSH`.
    Flush,
    /// `VIRTIO_BLK_T_GET_ID`.
    GetId,
    /// `VIRTIO_BLK_T_DISCARD`.
    Discard,
    /// `VIRTIO_BLK_T_WRITE_ZEROES`.
    WriteZeroes,
    /// Any other type: answered `VIRTIO_BLK_S_UNSUPP`.
    Unsupported(u32),
}

/// A request's header, decoded.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Header {
    /// The type.
    pub kind: Kind,
    /// Where a read or write starts, in 512-byte sectors.
    pub sector: u64,
}

impl Header {
    /// Decodes the 16 bytes of a request's header.
    pub fn decode(bytes: &[u8; HEADER_BYTES]) -> Self {
        let kind = u32::from_le_bytes(bytes[0..4].try_into().expect("4 bytes"));
        let sector = u64::from_le_bytes(bytes[8..16].try_into().expect("8 bytes"));
        let kind = match kind {
            VIRTIO_BLK_T_IN => Kind::Read,
            VIRTIO_BLK_T_OUT => Kind::Write,
            VIRTIO_BLK_T_FLUSH => Kind::Flush,
            VIRTIO_BLK_T_GET_ID => Kind::GetId,
            VIRTIO_BLK_T_DISCARD => Kind::Discard,
            VIRTIO_BLK_T_WRITE_ZEROES => Kind::WriteZeroes,
            other => Kind::Unsupported(other),
        };
        Self { kind, sector }
    }
}

/// One range of a discard or write-zeroes request, in bytes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Range {
    /// Where it starts.
    pub offset_bytes: u64,
    /// How long it is.
    pub len_bytes: u64,
    /// A write-zeroes range that may be deallocated.
    pub unmap: bool,
}

/// Why a request is refused before it reaches the device's target: its status byte.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum Refused {
    /// A request the device does not serve (an unknown type, a write to a read-only device).
    #[error("unsupported: {0}")]
    Unsupported(String),
    /// A malformed or out-of-range request.
    #[error("{0}")]
    Invalid(String),
}

impl Refused {
    /// The status byte the guest is answered with.
    pub fn status(&self) -> u8 {
        match self {
            Self::Unsupported(_) => STATUS_UNSUPP,
            Self::Invalid(_) => STATUS_IOERR,
        }
    }
}

impl Geometry {
    /// Checks that `len_bytes` at `sector` are whole blocks inside the device.
    pub fn check_extent(&self, sector: u64, len_bytes: u64) -> Result<u64, Refused> {
        let block = u64::from(self.block_bytes);
        let offset_bytes = sector
            .checked_mul(SECTOR_BYTES)
            .ok_or_else(|| Refused::Invalid(format!("sector {sector} is past any device")))?;
        if !offset_bytes.is_multiple_of(block) || !len_bytes.is_multiple_of(block) {
            return Err(Refused::Invalid(format!(
                "{len_bytes} bytes at byte {offset_bytes} are not whole {block}-byte blocks"
            )));
        }
        if offset_bytes.checked_add(len_bytes).is_none_or(|end| end > self.size_bytes) {
            return Err(Refused::Invalid(format!(
                "{len_bytes} bytes at byte {offset_bytes} end past the device's {} bytes",
                self.size_bytes
            )));
        }
        Ok(offset_bytes)
    }

    /// Decodes the ranges of a discard or write-zeroes request (`bytes`: its data), each
    /// checked to be whole blocks inside the device.
    pub fn decode_ranges(&self, kind: Kind, bytes: &[u8]) -> Result<Vec<Range>, Refused> {
        if bytes.is_empty() || !bytes.len().is_multiple_of(RANGE_BYTES) {
            return Err(Refused::Invalid(format!(
                "{} bytes of ranges are not a whole number of {RANGE_BYTES}-byte ranges",
                bytes.len()
            )));
        }
        if bytes.len() / RANGE_BYTES > RANGES_MAX as usize {
            return Err(Refused::Invalid(format!(
                "{} ranges, more than the {RANGES_MAX} offered",
                bytes.len() / RANGE_BYTES
            )));
        }
        bytes
            .chunks_exact(RANGE_BYTES)
            .map(|r| {
                let sector = u64::from_le_bytes(r[0..8].try_into().expect("8 bytes"));
                let sectors = u32::from_le_bytes(r[8..12].try_into().expect("4 bytes"));
                let flags = u32::from_le_bytes(r[12..16].try_into().expect("4 bytes"));
                let unmap = flags & FLAG_UNMAP != 0;
                if flags & !FLAG_UNMAP != 0 || (unmap && kind == Kind::Discard) {
                    return Err(Refused::Unsupported(format!("range flags {flags:#x}")));
                }
                let len_bytes = u64::from(sectors) * SECTOR_BYTES;
                let offset_bytes = self.check_extent(sector, len_bytes)?;
                Ok(Range { offset_bytes, len_bytes, unmap })
            })
            .collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn geometry() -> Geometry {
        Geometry {
            size_bytes: 1 << 30,
            block_bytes: 4096,
            physical_block_exp: 0,
            queues: 2,
            queue_size: 256,
            read_only: false,
            serial: [0; ID_BYTES],
        }
    }

    /// The configuration space's fields are where `struct virtio_blk_config` has them.
    #[test]
    fn the_config_space_matches_the_kernels_layout() {
        let c = geometry().config_space();
        let field = |offset: usize, len: usize| &c[offset..offset + len];
        assert_eq!(field(0, 8), &((1u64 << 30) / 512).to_le_bytes(), "capacity");
        assert_eq!(field(12, 4), &254u32.to_le_bytes(), "seg_max");
        assert_eq!(field(20, 4), &4096u32.to_le_bytes(), "blk_size");
        assert_eq!(field(34, 2), &2u16.to_le_bytes(), "num_queues");
        assert_eq!(field(40, 4), &RANGES_MAX.to_le_bytes(), "max_discard_seg");
        assert_eq!(field(44, 4), &8u32.to_le_bytes(), "discard_sector_alignment");
        assert_eq!(c[56], 1, "write_zeroes_may_unmap");
        assert_eq!(
            c.len(),
            std::mem::offset_of!(
                virtio_bindings::virtio_blk::virtio_blk_config,
                max_secure_erase_sectors
            )
        );
    }

    /// A read-only device offers RO and neither discard nor write-zeroes.
    #[test]
    fn a_read_only_device_offers_no_discard() {
        let rw = geometry().features();
        let ro = Geometry { read_only: true, ..geometry() }.features();
        assert_eq!(rw & 1 << VIRTIO_BLK_F_RO, 0);
        assert_ne!(ro & 1 << VIRTIO_BLK_F_RO, 0);
        assert_ne!(rw & 1 << VIRTIO_BLK_F_DISCARD, 0);
        assert_eq!(ro & (1 << VIRTIO_BLK_F_DISCARD | 1 << VIRTIO_BLK_F_WRITE_ZEROES), 0);
        assert_ne!(ro & 1 << VIRTIO_F_VERSION_1, 0);
    }

    /// Extents must be whole blocks inside the device.
    #[test]
    fn extents_are_checked() {
        let g = geometry();
        assert_eq!(g.check_extent(8, 4096), Ok(4096));
        assert!(matches!(g.check_extent(1, 4096), Err(Refused::Invalid(_))), "misaligned");
        assert!(matches!(g.check_extent(0, 512), Err(Refused::Invalid(_))), "short");
        let last = (1u64 << 30) / 512 - 8;
        assert_eq!(g.check_extent(last, 4096), Ok((1 << 30) - 4096));
        assert!(g.check_extent(last, 8192).is_err(), "past the end");
        assert!(g.check_extent(u64::MAX / 256, 4096).is_err(), "overflow");
    }

    /// Ranges decode with their unmap flag; bad flags and sizes are refused.
    #[test]
    fn ranges_decode() {
        let g = geometry();
        let range = |sector: u64, sectors: u32, flags: u32| {
            let mut r = sector.to_le_bytes().to_vec();
            r.extend_from_slice(&sectors.to_le_bytes());
            r.extend_from_slice(&flags.to_le_bytes());
            r
        };
        let mut two = range(8, 16, FLAG_UNMAP);
        two.extend(range(64, 8, 0));
        let ranges = g.decode_ranges(Kind::WriteZeroes, &two).unwrap();
        assert_eq!(
            ranges,
            vec![
                Range { offset_bytes: 4096, len_bytes: 8192, unmap: true },
                Range { offset_bytes: 32768, len_bytes: 4096, unmap: false },
            ]
        );
        let unmap_discard = g.decode_ranges(Kind::Discard, &range(8, 8, FLAG_UNMAP));
        assert!(matches!(unmap_discard, Err(Refused::Unsupported(_))));
        assert!(g.decode_ranges(Kind::Discard, &range(8, 8, 2)).is_err());
        assert!(g.decode_ranges(Kind::Discard, &two[..20]).is_err());
        assert!(g.decode_ranges(Kind::Discard, &range(1, 8, 0)).is_err());
    }

    #[test]
    fn headers_decode() {
        let mut h = [0u8; HEADER_BYTES];
        h[0..4].copy_from_slice(&VIRTIO_BLK_T_OUT.to_le_bytes());
        h[8..16].copy_from_slice(&77u64.to_le_bytes());
        assert_eq!(Header::decode(&h), Header { kind: Kind::Write, sector: 77 });
        h[0..4].copy_from_slice(&99u32.to_le_bytes());
        assert_eq!(Header::decode(&h).kind, Kind::Unsupported(99));
    }
}
