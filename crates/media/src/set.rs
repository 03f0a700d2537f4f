//! [`MediumSet`]: several media served as one, each a member of a cache placed on a NUMA node.
//!
//! The members are laid end to end in one offset space (member `i` starts where member
//! `i - 1` ends), so the engine addresses a set as one medium; every access lies inside one
//! member (a caller bug otherwise: it panics) and goes to that member's own mapping. A drain
//! drains every member: each one's flushes are durable after it.

use std::ops::Range;

use crate::Medium;

/// Most members a set holds (sockets of a machine, one PM region each).
pub const MEMBERS_MAX: usize = 8;

/// One member of a medium as the engine sees it: where it lies in the set's offset space
/// and the NUMA node its memory is on, if known.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct MemberSpan {
    /// Its bytes in the set's offset space.
    pub range: Range<u64>,
    /// Its node, if the medium knows it (the operator said, or its device or mount does).
    pub node: Option<u32>,
}

/// Media served as one, in member order.
#[derive(Clone, Debug)]
pub struct MediumSet<M: Medium> {
    /// Member 0, inline: a one-member set's accesses reach it without a pointer to follow.
    first: M,
    /// The other members, each with the offset it starts at in the set.
    rest: Vec<(u64, M)>,
    /// Where member 0 ends: most accesses of a one-member set stop at this compare.
    first_end: u64,
    nodes: Vec<Option<u32>>,
    len_bytes: u64,
}

impl<M: Medium> MediumSet<M> {
    /// A set of `members` (each with its node, if known), in member order.
    ///
    /// # Panics
    /// With no members or more than [`MEMBERS_MAX`] (the caller checks what a user gave).
    pub fn new(members: Vec<(M, Option<u32>)>) -> Self {
        assert!(
            (1..=MEMBERS_MAX).contains(&members.len()),
            "a medium set has 1 to {MEMBERS_MAX} members, not {}",
            members.len()
        );
        let mut nodes = Vec::with_capacity(members.len());
        let mut members = members.into_iter();
        let (first, node) = members.next().expect("checked: one member at least");
        nodes.push(node);
        let first_end = first.len_bytes();
        let mut at = first_end;
        let rest: Vec<(u64, M)> = members
            .map(|(medium, node)| {
                let start = at;
                at += medium.len_bytes();
                nodes.push(node);
                (start, medium)
            })
            .collect();
        Self { first, rest, first_end, nodes, len_bytes: at }
    }

    /// A set of one member of unknown node.
    pub fn single(medium: M) -> Self {
        Self::new(vec![(medium, None)])
    }

    /// The members, in order.
    pub fn media(&self) -> impl Iterator<Item = &M> {
        std::iter::once(&self.first).chain(self.rest.iter().map(|(_, medium)| medium))
    }

    /// Each member with the offset it starts at, in order.
    fn spans(&self) -> impl Iterator<Item = (u64, &M)> {
        std::iter::once((0, &self.first)).chain(self.rest.iter().map(|(start, m)| (*start, m)))
    }

    /// The member holding `offset..offset + len`, and the offset within it.
    #[inline(always)]
    fn at(&self, offset: u64, len: u64) -> (&M, u64) {
        if offset + len <= self.first_end {
            return (&self.first, offset);
        }
        self.at_slow(offset, len)
    }

    #[cold]
    fn at_slow(&self, offset: u64, len: u64) -> (&M, u64) {
        let index = self.rest.partition_point(|(start, _)| *start <= offset);
        let (start, medium) = match index {
            0 => (0, &self.first),
            i => (self.rest[i - 1].0, &self.rest[i - 1].1),
        };
        let within = offset - start;
        assert!(
            within + len <= medium.len_bytes(),
            "medium access {offset}+{len} crosses the end of member {index} (or of the set of \
             {} bytes)",
            self.len_bytes
        );
        (medium, within)
    }
}

impl MediumSet<crate::CrashMedium> {
    /// What every member durably holds, laid end to end as the set lays them: the set's
    /// durable 8-byte words by offset / 8 ([`crate::CrashMedium::durable_image`]).
    pub fn durable_image(&self) -> Vec<u64> {
        self.media().flat_map(|medium| medium.durable_image()).collect()
    }
}

impl<M: Medium> Medium for MediumSet<M> {
    fn len_bytes(&self) -> u64 {
        self.len_bytes
    }
    fn members(&self) -> Vec<MemberSpan> {
        self.spans()
            .zip(&self.nodes)
            .map(|((start, medium), &node)| MemberSpan {
                range: start..start + medium.len_bytes(),
                node,
            })
            .collect()
    }
    #[inline]
    fn read(&self, offset: u64, buf: &mut [u8]) {
        let (medium, at) = self.at(offset, buf.len() as u64);
        medium.read(at, buf)
    }
    #[inline]
    fn read_checked(
        &self,
        offset: u64,
        buf: &mut [u8],
    ) -> std::result::Result<(), crate::Poisoned> {
        let (medium, at) = self.at(offset, buf.len() as u64);
        medium
            .read_checked(at, buf)
            .map_err(|poisoned| crate::Poisoned { offset: poisoned.offset - at + offset })
    }
    fn losses(&self) -> u64 {
        self.media().map(|medium| medium.losses()).sum()
    }
    fn poisoned_ranges(&self) -> Vec<std::ops::Range<u64>> {
        self.spans()
            .flat_map(|(start, medium)| {
                medium.poisoned_ranges().into_iter().map(move |r| start + r.start..start + r.end)
            })
            .collect()
    }
    #[inline]
    fn write(&self, offset: u64, data: &[u8]) {
        let (medium, at) = self.at(offset, data.len() as u64);
        medium.write(at, data)
    }
    #[inline]
    fn load_u64(&self, offset: u64) -> u64 {
        let (medium, at) = self.at(offset, 8);
        medium.load_u64(at)
    }
    #[inline]
    fn store_u64(&self, offset: u64, value: u64) {
        let (medium, at) = self.at(offset, 8);
        medium.store_u64(at, value)
    }
    fn compare_exchange_u64(&self, offset: u64, current: u64, new: u64) -> bool {
        let (medium, at) = self.at(offset, 8);
        medium.compare_exchange_u64(at, current, new)
    }
    #[inline]
    fn flush(&self, offset: u64, len: u64) {
        let (medium, at) = self.at(offset, len);
        medium.flush(at, len)
    }
    #[inline]
    fn drain(&self) {
        self.first.drain();
        for (_, medium) in &self.rest {
            medium.drain();
        }
    }
    #[inline]
    fn persist(&self, offset: u64, len: u64) {
        let (medium, at) = self.at(offset, len);
        medium.flush(at, len);
        self.drain();
    }
    #[inline]
    fn write_flush(&self, offset: u64, data: &[u8]) {
        let (medium, at) = self.at(offset, data.len() as u64);
        medium.write_flush(at, data)
    }
    #[inline]
    fn prefetch(&self, offset: u64, len: u64) {
        let (medium, at) = self.at(offset, len);
        medium.prefetch(at, len)
    }
    fn write_persist(&self, offset: u64, data: &[u8]) {
        self.write_flush(offset, data);
        self.drain();
    }
    #[inline]
    fn store_pair(&self, offset: u64, word0: u64, word1: u64) {
        let (medium, at) = self.at(offset, 16);
        medium.store_pair(at, word0, word1)
    }
    #[inline]
    fn store_pair_flush(&self, offset: u64, word0: u64, word1: u64) {
        let (medium, at) = self.at(offset, 16);
        medium.store_pair_flush(at, word0, word1)
    }
    #[inline]
    fn prefetch_pair_store(&self, offset: u64) {
        let (medium, at) = self.at(offset, 16);
        medium.prefetch_pair_store(at)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::{CrashMedium, CrashSwitch};

    fn set_of(lens: &[u64]) -> MediumSet<CrashMedium> {
        let switch = CrashSwitch::new();
        MediumSet::new(
            lens.iter()
                .enumerate()
                .map(|(i, &len)| (CrashMedium::new(len, switch.clone(), i as u64), Some(i as u32)))
                .collect(),
        )
    }

    #[test]
    fn members_lie_end_to_end_and_each_access_reaches_its_own_member() {
        let set = set_of(&[4096, 8192, 4096]);
        assert_eq!(set.len_bytes(), 16384);
        let spans = set.members();
        assert_eq!(
            spans.iter().map(|s| (s.range.clone(), s.node)).collect::<Vec<_>>(),
            [(0..4096, Some(0)), (4096..12288, Some(1)), (12288..16384, Some(2))]
        );
        set.store_u64(4096 - 8, 1);
        set.store_u64(4096, 2);
        set.write(12288 + 64, b"third");
        let media: Vec<&CrashMedium> = set.media().collect();
        assert_eq!(media[0].load_u64(4088), 1);
        assert_eq!(media[1].load_u64(0), 2);
        let mut buf = [0u8; 5];
        media[2].read(64, &mut buf);
        assert_eq!(&buf, b"third");
        set.read(12288 + 64, &mut buf);
        assert_eq!(&buf, b"third");
        assert_eq!(set.load_u64(4096), 2);
    }

    /// A drain makes every member's flushes durable, whichever member the flush went to.
    #[test]
    fn a_drain_makes_every_members_flushes_durable() {
        let set = set_of(&[4096, 4096]);
        set.store_u64(0, 7);
        set.store_u64(4096 + 64, 9);
        set.flush(0, 8);
        set.flush(4096 + 64, 8);
        set.drain();
        let media: Vec<&CrashMedium> = set.media().collect();
        assert_eq!(media[0].durable_image()[0], 7);
        assert_eq!(media[1].durable_image()[8], 9);
    }

    #[test]
    #[should_panic(expected = "crosses the end of member 1")]
    fn an_access_across_two_members_is_a_caller_bug() {
        let set = set_of(&[4096, 4096, 4096]);
        set.write(8192 - 4, &[0u8; 8]);
    }
}
