//! Eviction policies: which clean slot the sweeping hand takes when a lane needs space.
//!
//! The engine owns the mechanism — one shared hand (an atomic counter each lane claims slots
//! from, 32 at a time; no list and no list lock), the stripe locks, the metadata updates — and
//! asks the policy two questions: what a hit does to a slot, and what the hand does with a
//! clean slot it passes. Policies are stateless apart from the reference bit in each block's
//! index entry, so they cost no DRAM per slot.

/// What the hand does with a clean slot.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Sweep {
    /// Evict it.
    Evict,
    /// Clear its reference bit and pass it (a second chance).
    SecondChance,
}

/// An eviction policy.
pub trait EvictionPolicy: Send + Sync + std::fmt::Debug {
    /// Policy name, as `--eviction` takes it.
    fn name(&self) -> &'static str;
    /// Whether a read hit sets the reference bit of its block's index entry.
    fn marks_hits(&self) -> bool;
    /// What the hand does with a clean slot whose reference bit is `referenced`.
    fn sweep(&self, referenced: bool) -> Sweep;
}

/// CLOCK: referenced blocks get a second chance.
#[derive(Debug)]
pub struct Clock;

impl EvictionPolicy for Clock {
    fn name(&self) -> &'static str {
        "clock"
    }
    fn marks_hits(&self) -> bool {
        true
    }
    fn sweep(&self, referenced: bool) -> Sweep {
        if referenced { Sweep::SecondChance } else { Sweep::Evict }
    }
}

/// FIFO: the same hand without reference bits. Once the cache is full, evicted slots are
/// refilled in hand order, so the hand meets blocks in the order they were inserted.
#[derive(Debug)]
pub struct Fifo;

impl EvictionPolicy for Fifo {
    fn name(&self) -> &'static str {
        "fifo"
    }
    fn marks_hits(&self) -> bool {
        false
    }
    fn sweep(&self, _referenced: bool) -> Sweep {
        Sweep::Evict
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn clock_gives_a_second_chance_and_fifo_does_not() {
        assert_eq!(Clock.sweep(true), Sweep::SecondChance);
        assert_eq!(Clock.sweep(false), Sweep::Evict);
        assert_eq!(Fifo.sweep(true), Sweep::Evict);
        assert!(Clock.marks_hits() && !Fifo.marks_hits());
    }

    #[test]
    fn each_policy_is_named_as_its_option_value() {
        use crate::EvictionKind;
        for kind in [EvictionKind::Clock, EvictionKind::Fifo] {
            assert_eq!(kind.policy().name().parse::<EvictionKind>(), Ok(kind));
        }
    }
}
