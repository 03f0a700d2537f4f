//! Write-back policies: which of the dirty blocks the cleaner found go first.

use super::config::WriteBackOrder;

/// A dirty block the cleaner may write back, as its scan saw it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Candidate {
    /// The block.
    pub lba: u64,
    /// Its write's sequence number (older writes have smaller ones).
    pub seq: u64,
    /// The slot holding it.
    pub slot: u32,
}

/// Orders a scan's candidates for write-back. `resume_lba` is the block after the last one
/// the previous batch wrote, for policies that sweep.
pub trait WriteBackPolicy: Send + Sync {
    /// The policy's name.
    fn name(&self) -> &'static str;
    /// Reorders `candidates` into the order they are written back.
    fn order(&self, candidates: &mut [Candidate], resume_lba: u64);
}

/// Oldest first, by sequence number.
pub struct OldestFirst;

impl WriteBackPolicy for OldestFirst {
    fn name(&self) -> &'static str {
        "oldest"
    }
    fn order(&self, candidates: &mut [Candidate], _resume_lba: u64) {
        candidates.sort_unstable_by_key(|c| (c.seq, c.lba));
    }
}

/// Ascending block numbers from `resume_lba` on, then from the start: an elevator, so that
/// consecutive batches sweep the device in one direction and adjacent blocks merge.
pub struct LbaSorted;

impl WriteBackPolicy for LbaSorted {
    fn name(&self) -> &'static str {
        "lba"
    }
    fn order(&self, candidates: &mut [Candidate], resume_lba: u64) {
        candidates.sort_unstable_by_key(|c| (c.lba < resume_lba, c.lba, c.seq));
    }
}

/// Writes nothing back (the cleaner is off).
pub struct NoWriteBack;

impl WriteBackPolicy for NoWriteBack {
    fn name(&self) -> &'static str {
        "none"
    }
    fn order(&self, candidates: &mut [Candidate], _resume_lba: u64) {
        let _ = candidates;
    }
}

impl WriteBackOrder {
    /// The policy implementing this order.
    pub fn policy(self) -> &'static dyn WriteBackPolicy {
        match self {
            WriteBackOrder::Lba => &LbaSorted,
            WriteBackOrder::Oldest => &OldestFirst,
            WriteBackOrder::None => &NoWriteBack,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn candidates() -> Vec<Candidate> {
        [(40, 3), (7, 9), (41, 1), (12, 5), (3, 7)]
            .into_iter()
            .enumerate()
            .map(|(slot, (lba, seq))| Candidate { lba, seq, slot: slot as u32 })
            .collect()
    }

    fn lbas(c: &[Candidate]) -> Vec<u64> {
        c.iter().map(|c| c.lba).collect()
    }

    #[test]
    fn each_policy_orders_as_documented() {
        let mut c = candidates();
        OldestFirst.order(&mut c, 0);
        assert_eq!(lbas(&c), [41, 40, 12, 3, 7]);
        LbaSorted.order(&mut c, 0);
        assert_eq!(lbas(&c), [3, 7, 12, 40, 41]);
        LbaSorted.order(&mut c, 10);
        assert_eq!(lbas(&c), [12, 40, 41, 3, 7], "from the resume point, then wrapped");
        let before = c.clone();
        NoWriteBack.order(&mut c, 10);
        assert_eq!(c, before);
        for order in WriteBackOrder::ALL {
            assert_eq!(order.policy().name(), order.to_string());
        }
    }
}
