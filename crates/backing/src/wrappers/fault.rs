//! Fault injection: errors with a chosen errno on the N-th I/O, on an address range or with a
//! probability, and short (torn) transfers.
//!
//! Rules are checked in order; the first that fires decides the request. A fired error rule
//! does not touch the inner store. A short transfer moves only the first `bytes` bytes through
//! the inner store and then reports [`BackingError::ShortRead`] / [`BackingError::ShortWrite`],
//! which is what a torn write looks like to the cache engine.

use std::io;
use std::sync::Mutex;
use std::sync::atomic::{AtomicU64, Ordering};

use rand::rngs::SmallRng;
use rand::{Rng, SeedableRng};

use super::OpMask;
use crate::{BackingError, BackingStore, Result};

/// When a rule fires.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum FaultTrigger {
    /// On the N-th matching request (1-based), once.
    Nth(u64),
    /// On every matching request that overlaps `[start, end)` bytes.
    Range {
        /// First byte.
        start: u64,
        /// One past the last byte.
        end: u64,
    },
    /// On each matching request with this probability (0.0..=1.0).
    Probability(f64),
}

/// What a fired rule does.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum FaultAction {
    /// Fail with this errno (e.g. `libc::EIO`), without touching the store.
    Error(i32),
    /// Transfer only the first `bytes` bytes, then report a short read or write.
    Short {
        /// Bytes actually transferred (clamped to the request length).
        bytes: u64,
    },
}

/// One fault rule.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct FaultRule {
    /// Operations it applies to.
    pub ops: OpMask,
    /// When it fires.
    pub trigger: FaultTrigger,
    /// What it does.
    pub action: FaultAction,
}

#[derive(Debug)]
struct State {
    /// Matching requests seen, per rule.
    seen: Vec<u64>,
    rng: SmallRng,
}

/// A store that injects faults according to its rules.
#[derive(Debug)]
pub struct FaultStore<S> {
    inner: S,
    rules: Vec<FaultRule>,
    state: Mutex<State>,
    injected: AtomicU64,
}

impl<S: BackingStore> FaultStore<S> {
    /// A wrapper with no rules yet; `seed` drives probabilistic rules.
    pub fn new(inner: S, seed: u64) -> Self {
        Self {
            inner,
            rules: Vec::new(),
            state: Mutex::new(State { seen: Vec::new(), rng: SmallRng::seed_from_u64(seed) }),
            injected: AtomicU64::new(0),
        }
    }

    /// Adds a rule (checked after the ones already added).
    pub fn with_rule(mut self, rule: FaultRule) -> Self {
        if let FaultTrigger::Probability(p) = rule.trigger {
            assert!((0.0..=1.0).contains(&p), "fault probability {p} is outside 0..=1");
        }
        self.rules.push(rule);
        self.state.get_mut().unwrap_or_else(|e| e.into_inner()).seen.push(0);
        self
    }

    /// Fails the `n`-th request among `ops` (1-based) with `errno`.
    pub fn fail_nth(self, ops: OpMask, n: u64, errno: i32) -> Self {
        self.with_rule(FaultRule {
            ops,
            trigger: FaultTrigger::Nth(n),
            action: FaultAction::Error(errno),
        })
    }

    /// Fails every request among `ops` overlapping `[start, end)` with `errno`.
    pub fn fail_range(self, ops: OpMask, start: u64, end: u64, errno: i32) -> Self {
        self.with_rule(FaultRule {
            ops,
            trigger: FaultTrigger::Range { start, end },
            action: FaultAction::Error(errno),
        })
    }

    /// Fails each request among `ops` with probability `p` with `errno`.
    pub fn fail_probability(self, ops: OpMask, p: f64, errno: i32) -> Self {
        self.with_rule(FaultRule {
            ops,
            trigger: FaultTrigger::Probability(p),
            action: FaultAction::Error(errno),
        })
    }

    /// Makes the `n`-th request among `ops` transfer only `bytes` bytes.
    pub fn short_nth(self, ops: OpMask, n: u64, bytes: u64) -> Self {
        self.with_rule(FaultRule {
            ops,
            trigger: FaultTrigger::Nth(n),
            action: FaultAction::Short { bytes },
        })
    }

    /// Faults injected so far.
    pub fn injected(&self) -> u64 {
        self.injected.load(Ordering::Relaxed)
    }

    /// The wrapped store.
    pub fn inner(&self) -> &S {
        &self.inner
    }

    /// The action of the first rule that fires for this request, if any.
    fn decide(&self, op: OpMask, range: Option<(u64, u64)>) -> Option<FaultAction> {
        let mut state = self.state.lock().unwrap_or_else(|e| e.into_inner());
        let State { seen, rng } = &mut *state;
        let mut fired = None;
        for (rule, seen) in self.rules.iter().zip(seen.iter_mut()) {
            if !rule.ops.contains(op) {
                continue;
            }
            *seen += 1;
            let fires = match rule.trigger {
                FaultTrigger::Nth(n) => *seen == n,
                FaultTrigger::Range { start, end } => {
                    range.is_some_and(|(offset, len)| offset < end && offset + len.max(1) > start)
                }
                FaultTrigger::Probability(p) => rng.gen_bool(p),
            };
            if fires && fired.is_none() {
                fired = Some(rule.action);
            }
        }
        if fired.is_some() {
            self.injected.fetch_add(1, Ordering::Relaxed);
        }
        fired
    }
}

fn injected_error(op: &'static str, offset: u64, len: u64, errno: i32) -> BackingError {
    BackingError::Io { op, offset, len, source: io::Error::from_raw_os_error(errno) }
}

impl<S: BackingStore> BackingStore for FaultStore<S> {
    crate::forward_to!(inner: size_bytes, logical_block_size, identity, extent_at, engine_name,
        is_direct, failed_flush_loses_writes, release, claim, disclaim);
    fn read_at(&self, buf: &mut [u8], offset: u64) -> Result<()> {
        let len = buf.len() as u64;
        match self.decide(OpMask::READ, Some((offset, len))) {
            None => self.inner.read_at(buf, offset),
            Some(FaultAction::Error(errno)) => Err(injected_error("read", offset, len, errno)),
            Some(FaultAction::Short { bytes }) => {
                let got = bytes.min(len);
                self.inner.read_at(&mut buf[..got as usize], offset)?;
                Err(BackingError::ShortRead { offset, len, got })
            }
        }
    }
    fn write_at(&self, data: &[u8], offset: u64) -> Result<()> {
        let len = data.len() as u64;
        match self.decide(OpMask::WRITE, Some((offset, len))) {
            None => self.inner.write_at(data, offset),
            Some(FaultAction::Error(errno)) => Err(injected_error("write", offset, len, errno)),
            Some(FaultAction::Short { bytes }) => {
                let got = bytes.min(len);
                self.inner.write_at(&data[..got as usize], offset)?;
                Err(BackingError::ShortWrite { offset, len, got })
            }
        }
    }
    fn flush(&self) -> Result<()> {
        match self.decide(OpMask::FLUSH, None) {
            Some(FaultAction::Error(errno)) => Err(injected_error("flush", 0, 0, errno)),
            _ => self.inner.flush(),
        }
    }
    fn discard(&self, offset: u64, len: u64) -> Result<()> {
        match self.decide(OpMask::DISCARD, Some((offset, len))) {
            Some(FaultAction::Error(errno)) => Err(injected_error("discard", offset, len, errno)),
            _ => self.inner.discard(offset, len),
        }
    }
    fn write_zeroes(&self, offset: u64, len: u64) -> Result<()> {
        match self.decide(OpMask::DISCARD, Some((offset, len))) {
            Some(FaultAction::Error(errno)) => {
                Err(injected_error("write_zeroes", offset, len, errno))
            }
            _ => self.inner.write_zeroes(offset, len),
        }
    }
}
