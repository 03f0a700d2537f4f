//! [`Window`]: a byte range of a medium served as a medium of its own.
//!
//! One cache medium shared by several backing stores is cut into windows, one per store, each
//! holding a whole cache (its own superblock, metadata and slots) at offset 0 of its window.
//! Offsets are translated by the window's start and checked against its length, so a cache
//! can never reach outside its window; flushes and drains go to the medium underneath.

use std::ops::Range;

use crate::{Medium, MemberSpan, Poisoned};

/// The bytes `range` of `medium`, addressed from 0.
#[derive(Clone, Debug)]
pub struct Window<M: Medium> {
    medium: M,
    start: u64,
    len_bytes: u64,
}

impl<M: Medium> Window<M> {
    /// The bytes `range` of `medium`.
    ///
    /// # Panics
    /// If `range` does not lie inside the medium or does not start on a cache line (the
    /// word and line accesses of the medium need that alignment; the caller lays windows
    /// out).
    pub fn new(medium: M, range: Range<u64>) -> Self {
        assert!(
            range.start <= range.end && range.end <= medium.len_bytes(),
            "window {range:?} outside a medium of {} bytes",
            medium.len_bytes()
        );
        assert!(range.start.is_multiple_of(64), "window start {} is not line aligned", range.start);
        Self { len_bytes: range.end - range.start, start: range.start, medium }
    }

    /// All of `medium`.
    pub fn whole(medium: M) -> Self {
        let len = medium.len_bytes();
        Self::new(medium, 0..len)
    }

    /// The medium underneath.
    pub fn inner(&self) -> &M {
        &self.medium
    }

    /// Where the window lies in the medium underneath.
    pub fn range(&self) -> Range<u64> {
        self.start..self.start + self.len_bytes
    }

    /// `offset` in the medium underneath, after checking `offset..offset + len` lies inside.
    #[inline(always)]
    fn at(&self, offset: u64, len: u64) -> u64 {
        crate::check_bounds(offset, len, self.len_bytes);
        self.start + offset
    }
}

impl<M: Medium> Medium for Window<M> {
    fn len_bytes(&self) -> u64 {
        self.len_bytes
    }
    fn members(&self) -> Vec<MemberSpan> {
        let node = self.medium.members().first().and_then(|m| m.node);
        vec![MemberSpan { range: 0..self.len_bytes, node }]
    }
    #[inline]
    fn read(&self, offset: u64, buf: &mut [u8]) {
        self.medium.read(self.at(offset, buf.len() as u64), buf)
    }
    #[inline]
    fn read_checked(&self, offset: u64, buf: &mut [u8]) -> std::result::Result<(), Poisoned> {
        let at = self.at(offset, buf.len() as u64);
        self.medium
            .read_checked(at, buf)
            .map_err(|poisoned| Poisoned { offset: poisoned.offset - self.start })
    }
    fn losses(&self) -> u64 {
        self.medium.losses()
    }
    fn poisoned_ranges(&self) -> Vec<Range<u64>> {
        let end = self.start + self.len_bytes;
        self.medium
            .poisoned_ranges()
            .into_iter()
            .filter(|r| r.start < end && r.end > self.start)
            .map(|r| r.start.max(self.start) - self.start..r.end.min(end) - self.start)
            .collect()
    }
    #[inline]
    fn write(&self, offset: u64, data: &[u8]) {
        self.medium.write(self.at(offset, data.len() as u64), data)
    }
    #[inline]
    fn load_u64(&self, offset: u64) -> u64 {
        self.medium.load_u64(self.at(offset, 8))
    }
    #[inline]
    fn store_u64(&self, offset: u64, value: u64) {
        self.medium.store_u64(self.at(offset, 8), value)
    }
    fn compare_exchange_u64(&self, offset: u64, current: u64, new: u64) -> bool {
        self.medium.compare_exchange_u64(self.at(offset, 8), current, new)
    }
    #[inline]
    fn flush(&self, offset: u64, len: u64) {
        self.medium.flush(self.at(offset, len), len)
    }
    #[inline]
    fn drain(&self) {
        self.medium.drain()
    }
    #[inline]
    fn persist(&self, offset: u64, len: u64) {
        self.medium.persist(self.at(offset, len), len)
    }
    #[inline]
    fn write_flush(&self, offset: u64, data: &[u8]) {
        self.medium.write_flush(self.at(offset, data.len() as u64), data)
    }
    #[inline]
    fn prefetch(&self, offset: u64, len: u64) {
        self.medium.prefetch(self.at(offset, len), len)
    }
    fn write_persist(&self, offset: u64, data: &[u8]) {
        self.medium.write_persist(self.at(offset, data.len() as u64), data)
    }
    #[inline]
    fn store_pair(&self, offset: u64, word0: u64, word1: u64) {
        self.medium.store_pair(self.at(offset, 16), word0, word1)
    }
    #[inline]
    fn store_pair_flush(&self, offset: u64, word0: u64, word1: u64) {
        self.medium.store_pair_flush(self.at(offset, 16), word0, word1)
    }
    #[inline]
    fn prefetch_pair_store(&self, offset: u64) {
        self.medium.prefetch_pair_store(self.at(offset, 16))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::{CrashMedium, CrashSwitch};
    use std::sync::Arc;

    #[test]
    fn a_window_translates_offsets_and_sees_only_its_bytes() {
        let medium = Arc::new(CrashMedium::new(16384, CrashSwitch::new(), 0));
        let low = Window::new(medium.clone(), 0..8192);
        let high = Window::new(medium.clone(), 8192..16384);
        assert_eq!(high.len_bytes(), 8192);
        high.store_u64(0, 7);
        high.write(64, b"store");
        assert_eq!(medium.load_u64(8192), 7);
        assert_eq!(low.load_u64(0), 0);
        let mut buf = [0u8; 5];
        medium.read(8192 + 64, &mut buf);
        assert_eq!(&buf, b"store");
        high.persist(0, 8);
        assert_eq!(medium.durable_image()[8192 / 8], 7);
    }

    #[test]
    fn poisoned_lines_are_reported_in_the_windows_offsets() {
        let medium = Arc::new(CrashMedium::new(16384, CrashSwitch::new(), 0));
        medium.poison(8192 + 128, 64);
        let high = Window::new(medium.clone(), 8192..16384);
        let low = Window::new(medium.clone(), 0..8192);
        assert_eq!(high.poisoned_ranges(), vec![std::ops::Range { start: 128, end: 192 }]);
        assert!(low.poisoned_ranges().is_empty());
        let mut buf = [0u8; 64];
        assert_eq!(high.read_checked(128, &mut buf), Err(Poisoned { offset: 128 }));
        assert_eq!(low.read_checked(128, &mut buf), Ok(()));
    }

    #[test]
    #[should_panic(expected = "outside a medium of 8192 bytes")]
    fn an_access_past_the_window_is_a_caller_bug() {
        let medium = Arc::new(CrashMedium::new(16384, CrashSwitch::new(), 0));
        Window::new(medium, 0..8192).write(8190, &[0u8; 4]);
    }
}
