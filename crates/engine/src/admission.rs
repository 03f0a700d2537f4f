//! Read-miss admission policies: always, sequential cutoff, n-hit promotion.
//!
//! Both stateful policies use small fixed tables of atomics indexed by hash; races between
//! lanes only blur the heuristics, they never affect correctness.

use crate::config::AdmissionConfig;
use crate::sync::{AtomicU8, AtomicU64, Ordering};

const STREAMS: usize = 64;
const STREAM_EXPIRY_NS: u64 = 5_000_000_000;
const NHIT_COUNTERS: usize = 1 << 16;

/// The policy in force (`Admission::kind`).
const ALWAYS: u8 = 0;
const SEQUENTIAL_CUTOFF: u8 = 1;
const N_HIT: u8 = 2;

/// The admission policy, switchable at run time (`Engine::set_admission`): every policy's
/// tables are kept (about 66 KiB), and the policy in force is one relaxed load on a miss.
pub(crate) struct Admission {
    kind: AtomicU8,
    cutoff_bytes: AtomicU64,
    hits: AtomicU8,
    streams: Box<[Stream]>,
    counters: Box<[AtomicU64]>,
    misses: AtomicU64,
}

/// A recent sequential stream: where it will continue, how long it is, when it was last seen.
pub(crate) struct Stream {
    next_byte: AtomicU64,
    run_bytes: AtomicU64,
    seen_ns: AtomicU64,
}

fn slot_of(value: u64, slots: usize) -> usize {
    (value.wrapping_mul(0x9E37_79B9_7F4A_7C15) >> 40) as usize % slots
}

impl Admission {
    pub(crate) fn new(config: AdmissionConfig) -> Self {
        let admission = Admission {
            kind: AtomicU8::new(ALWAYS),
            cutoff_bytes: AtomicU64::new(0),
            hits: AtomicU8::new(1),
            streams: (0..STREAMS)
                .map(|_| Stream {
                    next_byte: AtomicU64::new(u64::MAX),
                    run_bytes: AtomicU64::new(0),
                    seen_ns: AtomicU64::new(0),
                })
                .collect(),
            counters: (0..NHIT_COUNTERS / 8).map(|_| AtomicU64::new(0)).collect(),
            misses: AtomicU64::new(0),
        };
        admission.set(config);
        admission
    }

    /// Puts `config` in force. A miss racing with the change is judged by either policy.
    pub(crate) fn set(&self, config: AdmissionConfig) {
        match config {
            AdmissionConfig::Always => self.kind.store(ALWAYS, Ordering::Relaxed),
            AdmissionConfig::SequentialCutoff { cutoff_bytes } => {
                self.cutoff_bytes.store(cutoff_bytes, Ordering::Relaxed);
                self.kind.store(SEQUENTIAL_CUTOFF, Ordering::Relaxed);
            }
            AdmissionConfig::NHit { hits } => {
                self.hits.store(hits.max(1), Ordering::Relaxed);
                self.kind.store(N_HIT, Ordering::Relaxed);
            }
        }
    }

    /// The policy in force.
    pub(crate) fn config(&self) -> AdmissionConfig {
        match self.kind.load(Ordering::Relaxed) {
            SEQUENTIAL_CUTOFF => AdmissionConfig::SequentialCutoff {
                cutoff_bytes: self.cutoff_bytes.load(Ordering::Relaxed),
            },
            N_HIT => AdmissionConfig::NHit { hits: self.hits.load(Ordering::Relaxed) },
            _ => AdmissionConfig::Always,
        }
    }

    /// Notes a read request of `len` bytes at `offset` (called once per request).
    /// Returns whether the request is part of a sequential stream beyond the cutoff.
    pub(crate) fn note_request(&self, offset: u64, len: u64, now_ns: u64) -> bool {
        if self.kind.load(Ordering::Relaxed) != SEQUENTIAL_CUTOFF {
            return false;
        }
        let streams = &self.streams;
        let stream = &streams[slot_of(offset, STREAMS)];
        let continues = stream.next_byte.load(Ordering::Relaxed) == offset
            && now_ns.saturating_sub(stream.seen_ns.load(Ordering::Relaxed)) < STREAM_EXPIRY_NS;
        let run = if continues { stream.run_bytes.load(Ordering::Relaxed) + len } else { len };
        let next = &streams[slot_of(offset + len, STREAMS)];
        next.next_byte.store(offset + len, Ordering::Relaxed);
        next.run_bytes.store(run, Ordering::Relaxed);
        next.seen_ns.store(now_ns, Ordering::Relaxed);
        run > self.cutoff_bytes.load(Ordering::Relaxed)
    }

    /// Whether a missed block should be admitted (counts the miss for n-hit).
    pub(crate) fn admit_block(&self, lba: u64) -> bool {
        if self.kind.load(Ordering::Relaxed) != N_HIT {
            return true;
        }
        let (counters, misses) = (&self.counters, &self.misses);
        // 8 one-byte counters per word.
        let index = slot_of(lba, NHIT_COUNTERS);
        let word = &counters[index / 8];
        let shift = (index % 8) * 8;
        // Saturating at 0xfe, by compare-and-swap: an add that could pass it is never made,
        // so racing lanes cannot wrap a counter or carry into the next one. (Adding first and
        // taking the add back at the top does not hold with three lanes: one that adds while
        // another's add has wrapped the byte to 0 sees a count of 1 and keeps its add.)
        let mut current = word.load(Ordering::Relaxed);
        let count = loop {
            let counter = (current >> shift) & 0xff;
            if counter >= 0xfe {
                break counter + 1;
            }
            match word.compare_exchange_weak(
                current,
                current + (1 << shift),
                Ordering::Relaxed,
                Ordering::Relaxed,
            ) {
                Ok(_) => break counter + 1,
                Err(now) => current = now,
            }
        };
        // Age the counters: halve them all every 8 misses per counter.
        let seen = misses.fetch_add(1, Ordering::Relaxed) + 1;
        if seen % (NHIT_COUNTERS as u64 * 8) == 0 {
            for word in counters.iter() {
                let value = word.load(Ordering::Relaxed);
                word.store((value >> 1) & 0x7f7f_7f7f_7f7f_7f7f, Ordering::Relaxed);
            }
        }
        count >= u64::from(self.hits.load(Ordering::Relaxed))
    }
}

#[cfg(all(test, not(feature = "shuttle")))]
mod tests {
    use super::*;

    #[test]
    fn sequential_cutoff_bypasses_only_the_long_tail_of_a_stream() {
        let admission = Admission::new(AdmissionConfig::SequentialCutoff { cutoff_bytes: 1 << 20 });
        let mut bypassed = 0;
        for i in 0..512u64 {
            if admission.note_request(i * 4096, 4096, i) {
                bypassed += 1;
            }
        }
        assert_eq!(bypassed, 512 - 256, "the first 1 MiB is admitted, the rest bypassed");
        // Random requests are never bypassed.
        assert!(!(0..100u64).any(|i| admission.note_request(i * 7_777_777 * 4096, 4096, 1000)));
        // A stream expires five seconds after its last request (at 511 ns): still going a
        // nanosecond before, over at five seconds.
        let stream_of_2_mib = || {
            let admission =
                Admission::new(AdmissionConfig::SequentialCutoff { cutoff_bytes: 1 << 20 });
            for i in 0..512u64 {
                admission.note_request(i * 4096, 4096, i);
            }
            admission
        };
        assert!(stream_of_2_mib().note_request(512 * 4096, 4096, 511 + STREAM_EXPIRY_NS - 1));
        assert!(!stream_of_2_mib().note_request(512 * 4096, 4096, 511 + STREAM_EXPIRY_NS));
    }

    #[test]
    fn n_hit_admits_on_the_nth_miss() {
        let admission = Admission::new(AdmissionConfig::NHit { hits: 3 });
        assert!(!admission.admit_block(42));
        assert!(!admission.admit_block(42));
        assert!(admission.admit_block(42));
        assert!(Admission::new(AdmissionConfig::Always).admit_block(42));
    }

    /// A policy put in force at run time is the one that judges the next miss, and says so.
    #[test]
    fn the_policy_switches_at_run_time() {
        let admission = Admission::new(AdmissionConfig::Always);
        assert!(admission.admit_block(7));
        admission.set(AdmissionConfig::NHit { hits: 2 });
        assert_eq!(admission.config(), AdmissionConfig::NHit { hits: 2 });
        assert!(!admission.admit_block(9), "the first miss of a block is cold under n-hit");
        assert!(admission.admit_block(9));
        admission.set(AdmissionConfig::SequentialCutoff { cutoff_bytes: 8192 });
        assert!(admission.admit_block(11), "n-hit is no longer in force");
        let bypassed: Vec<bool> =
            (0..4u64).map(|i| admission.note_request(i * 4096, 4096, i)).collect();
        assert_eq!(bypassed, [false, false, true, true]);
        admission.set(AdmissionConfig::Always);
        assert!(!admission.note_request(4 * 4096, 4096, 5));
        assert_eq!(admission.config(), AdmissionConfig::Always);
    }

    /// A block with `slot_of(block) == counter`.
    fn block_on_counter(counter: usize) -> u64 {
        (0..).find(|&lba| slot_of(lba, NHIT_COUNTERS) == counter).expect("some block")
    }

    /// A counter that saturates stays saturated and leaves its neighbours in the same word as
    /// they were; every `NHIT_COUNTERS * 8` misses all counters halve, so an old miss counts
    /// for less.
    #[test]
    fn n_hit_counters_saturate_alone_and_age() {
        let admission = Admission::new(AdmissionConfig::NHit { hits: 2 });
        let hot = 42;
        let index = slot_of(hot, NHIT_COUNTERS);
        // The counter above `hot`'s in the same word (or below, for the top byte).
        let neighbour = block_on_counter(if index % 8 == 7 { index - 1 } else { index + 1 });
        for _ in 0..600 {
            admission.admit_block(hot);
        }
        assert!(
            !admission.admit_block(neighbour),
            "a saturated counter spilled into its neighbour"
        );
        assert!(admission.admit_block(neighbour));
        assert!(admission.admit_block(hot), "a saturated counter wrapped");

        let admission = Admission::new(AdmissionConfig::NHit { hits: 3 });
        let old = (0..).find(|&lba| slot_of(lba, NHIT_COUNTERS) % 8 != 7).expect("some block");
        let index = slot_of(old, NHIT_COUNTERS);
        // An odd count in the byte above `old`'s: halving must not shift its low bit into
        // `old`'s counter.
        let odd = block_on_counter(index + 1);
        let other = block_on_counter((index + 8) % NHIT_COUNTERS);
        assert!(!admission.admit_block(old));
        assert!(!admission.admit_block(old));
        assert!(!admission.admit_block(odd));
        // Misses elsewhere until the counters halve: `old`'s two become one.
        for _ in 3..NHIT_COUNTERS * 8 {
            admission.admit_block(other);
        }
        assert!(
            !admission.admit_block(old),
            "the counters did not halve, or halving moved a neighbour's bit in"
        );
        assert!(admission.admit_block(old));
    }
}

#[cfg(all(test, feature = "shuttle"))]
mod shuttle_tests {
    use std::sync::Arc;

    use super::*;

    /// Three lanes miss a block whose n-hit counter is one below saturation, at once (under
    /// shuttle's scheduler, which interleaves their adds and undos): the counter ends
    /// saturated, neither wrapped nor carried into the counters beside it in its word.
    #[test]
    fn misses_racing_at_saturation_neither_wrap_nor_spill() {
        shuttle::check_random(
            || {
                let admission = Arc::new(Admission::new(AdmissionConfig::NHit { hits: 2 }));
                let lba = 42;
                let index = slot_of(lba, NHIT_COUNTERS);
                let shift = (index % 8) * 8;
                admission.counters[index / 8].store(0xfe << shift, Ordering::Relaxed);
                let lanes: Vec<_> = (0..3)
                    .map(|_| {
                        let admission = admission.clone();
                        shuttle::thread::spawn(move || assert!(admission.admit_block(lba)))
                    })
                    .collect();
                lanes.into_iter().for_each(|lane| lane.join().unwrap());
                let word = admission.counters[index / 8].load(Ordering::Relaxed);
                assert_eq!(word, 0xfe << shift, "counter {index}: word {word:#018x}");
            },
            2000,
        );
    }
}
