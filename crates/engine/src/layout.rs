//! Where slots are: a cache is a set of members (one medium per NUMA node, each a whole layout
//! of its own: superblock, metadata entries, data slots), its slots numbered across them in
//! member order. A one-medium cache is a set of one.
//!
//! The members lie end to end in the medium's offset space ([`Medium::members`]); slot `s`
//! of the cache is slot `s - first_slot` of the member whose range holds it, so its entry and
//! its data are on the same member. Member 0's superblock words (shutdown state, synced
//! sequence) are the cache's; the other members' are written at format and never read.

use pmcache_media::{MEMBERS_MAX, Medium, MemberSpan};

use crate::error::Result;
use crate::format::{FormatError, Geometry, HEADER_BYTES, Membership, Superblock};

/// One member of the cache.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Member {
    /// Its number in the set.
    pub index: usize,
    /// Where it starts in the medium's offset space.
    pub base: u64,
    /// Its own layout.
    pub geometry: Geometry,
    /// The cache's number of its slot 0.
    pub first_slot: u32,
    /// Its slots.
    pub slot_count: u32,
    /// The NUMA node it is on, if known: what the medium says now, else what was recorded
    /// when it was formatted.
    pub node: Option<u32>,
}

impl Member {
    /// Whether cache slot `slot` is one of this member's.
    pub fn holds(&self, slot: u32) -> bool {
        (self.first_slot..self.first_slot + self.slot_count).contains(&slot)
    }
}

/// The cache's members and how its slot numbers map onto them.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Layout {
    /// Cache block (slot) size in bytes, the same on every member.
    pub block_size: u32,
    /// Slots of all members.
    pub slot_count: u64,
    /// The slot after member 0's last: most lookups of a one-member cache stop at it.
    first_end: u32,
    /// Member 0's base and geometry, inline: a one-member cache's offsets follow no pointer.
    first_base: u64,
    first_geometry: Geometry,
    members: Box<[Member]>,
}

impl Layout {
    /// The layout a format gives media of these spans, `block_size` blocks, with a checksum
    /// of each slot's data if `data_crc`.
    pub fn for_format(spans: &[MemberSpan], block_size: u32, data_crc: bool) -> Result<Self> {
        let mut geometries = Vec::with_capacity(spans.len());
        for (index, span) in spans.iter().enumerate() {
            let len = span.range.end - span.range.start;
            let geometry = Geometry::plan(len, block_size, data_crc)
                .map_err(|e| member_error(spans.len(), index, e))?;
            geometries.push(geometry);
        }
        Self::of(spans, &geometries, |index| spans[index].node)
    }

    fn of(
        spans: &[MemberSpan],
        geometries: &[Geometry],
        node: impl Fn(usize) -> Option<u32>,
    ) -> Result<Self> {
        if !(1..=MEMBERS_MAX).contains(&spans.len()) {
            return Err(FormatError::BadSet(format!(
                "{} media given; a cache has 1 to {MEMBERS_MAX}",
                spans.len()
            ))
            .into());
        }
        let mut first_slot = 0u64;
        let mut members = Vec::with_capacity(spans.len());
        for (index, (span, geometry)) in spans.iter().zip(geometries).enumerate() {
            members.push(Member {
                index,
                base: span.range.start,
                geometry: *geometry,
                first_slot: first_slot as u32,
                slot_count: geometry.slot_count as u32,
                node: node(index),
            });
            first_slot += geometry.slot_count;
            if first_slot >= u64::from(u32::MAX) {
                return Err(FormatError::Invalid(format!(
                    "the members hold {first_slot} slots together; at most {} are supported",
                    u32::MAX - 1
                ))
                .into());
            }
        }
        Ok(Self {
            block_size: geometries[0].block_size,
            slot_count: first_slot,
            first_end: members[0].slot_count,
            first_base: members[0].base,
            first_geometry: members[0].geometry,
            members: members.into_boxed_slice(),
        })
    }

    /// Reads and checks every member's superblock: each is member `i` of the same cache at
    /// position `i`, and none is missing. Returns the layout and member 0's superblock.
    pub fn read<M: Medium>(medium: &M) -> Result<(Self, Superblock)> {
        let spans = medium.members();
        let mut superblocks = Vec::with_capacity(spans.len());
        for (index, span) in spans.iter().enumerate() {
            let superblock =
                read_superblock(medium, span).map_err(|e| member_error(spans.len(), index, e))?;
            superblocks.push(superblock);
        }
        let first = superblocks[0];
        let count = usize::from(first.membership.count);
        if count != spans.len() {
            let given: Vec<u16> = superblocks.iter().map(|sb| sb.membership.index).collect();
            return Err(FormatError::BadSet(format!(
                "the cache {} has {count} members, {} given (members {given:?}){}",
                crate::format::hex(&first.uuid),
                spans.len(),
                if count > spans.len() { ": every member's medium is needed" } else { "" }
            ))
            .into());
        }
        for (position, superblock) in superblocks.iter().enumerate() {
            check_member(&first, superblock, position)?;
        }
        let geometries: Vec<Geometry> = superblocks.iter().map(|sb| sb.geometry).collect();
        let layout = Self::of(&spans, &geometries, |index| {
            spans[index].node.or(superblocks[index].membership.node)
        })?;
        Ok((layout, first))
    }

    /// The members, in order.
    pub fn members(&self) -> &[Member] {
        &self.members
    }

    /// The number of the member holding cache slot `slot`.
    #[inline(always)]
    pub fn member_of(&self, slot: u32) -> usize {
        if slot < self.first_end {
            return 0;
        }
        self.members.partition_point(|m| m.first_slot <= slot) - 1
    }

    /// The slot after the last of `slot`'s member: consecutive slots lie one after another
    /// on the medium only up to there (the next member's slot 0 is elsewhere).
    #[inline]
    pub fn member_end(&self, slot: u32) -> u32 {
        if slot < self.first_end {
            return self.first_end;
        }
        let member = &self.members[self.member_of(slot)];
        member.first_slot + member.slot_count
    }

    /// Byte offset of `slot`'s metadata entry.
    #[inline]
    pub fn entry_offset(&self, slot: u32) -> u64 {
        if slot < self.first_end {
            return self.first_base + self.first_geometry.entry_offset(slot);
        }
        let member = &self.members[self.member_of(slot)];
        member.base + member.geometry.entry_offset(slot - member.first_slot)
    }

    /// Whether each slot's data has a checksum.
    #[inline]
    pub fn data_crc(&self) -> bool {
        self.first_geometry.data_crc
    }

    /// Byte offset of `slot`'s data checksum (a cache with data checksums).
    #[inline]
    pub fn crc_offset(&self, slot: u32) -> u64 {
        if slot < self.first_end {
            return self.first_base + self.first_geometry.crc_offset(slot);
        }
        let member = &self.members[self.member_of(slot)];
        member.base + member.geometry.crc_offset(slot - member.first_slot)
    }

    /// Byte offset of `slot`'s data block.
    #[inline]
    pub fn data_offset(&self, slot: u32) -> u64 {
        if slot < self.first_end {
            return self.first_base + self.first_geometry.data_offset(slot);
        }
        let member = &self.members[self.member_of(slot)];
        member.base + member.geometry.data_offset(slot - member.first_slot)
    }
}

/// A member's error, said as that member's where there are several.
fn member_error(count: usize, index: usize, error: FormatError) -> crate::error::Error {
    if count == 1 {
        return error.into();
    }
    FormatError::BadSet(format!("the medium given as member {index}: {error}")).into()
}

/// Reads and validates the superblock of the member at `span`.
fn read_superblock<M: Medium>(
    medium: &M,
    span: &MemberSpan,
) -> std::result::Result<Superblock, FormatError> {
    let len = span.range.end - span.range.start;
    if len < HEADER_BYTES as u64 {
        return Err(FormatError::BadGeometry(format!(
            "the medium is {len} bytes, smaller than a superblock"
        )));
    }
    let mut header = [0u8; HEADER_BYTES];
    medium.read(span.range.start, &mut header);
    Superblock::decode(&header, len)
}

/// Checks that `member`, given at `position`, is that member of `first`'s cache.
fn check_member(first: &Superblock, member: &Superblock, position: usize) -> Result<()> {
    let bad = |why: String| Err(FormatError::BadSet(why).into());
    if member.uuid != first.uuid {
        return bad(format!(
            "the medium given as member {position} belongs to the cache {}, not {} (the other \
             members' cache)",
            crate::format::hex(&member.uuid),
            crate::format::hex(&first.uuid)
        ));
    }
    let Membership { index, count, .. } = member.membership;
    if usize::from(index) != position {
        return bad(format!(
            "the medium given as member {position} is member {index} of {count}: each member \
             is given once, in order"
        ));
    }
    if member.geometry.block_size != first.geometry.block_size
        || member.geometry.data_crc != first.geometry.data_crc
        || member.backing != first.backing
        || member.created_unix_secs != first.created_unix_secs
        || member.membership.count != first.membership.count
    {
        return bad(format!(
            "member {position} disagrees with member 0 about the cache they make up (block \
             size, data checksums, backing store, creation time or member count): a copy from \
             another time?"
        ));
    }
    Ok(())
}

/// Orders `media` by the member number their superblocks record, for [`Layout::read`]: the
/// order they were given in does not matter. A medium whose superblock cannot be read keeps
/// its place among the others (the check that follows names it).
pub fn sort_members<M: Medium>(media: &mut [(M, Option<u32>)]) {
    media.sort_by_key(|(medium, _)| {
        let span = MemberSpan { range: 0..medium.len_bytes(), node: None };
        read_superblock(medium, &span).map_or(u16::MAX, |sb| sb.membership.index)
    });
}
