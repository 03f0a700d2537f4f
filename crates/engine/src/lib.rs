//! The pmcache engine: a persist-on-write block cache of a backing store on a byte-addressable
//! persistent medium.
//!
//! - [`Engine`] owns the medium, the backing store and the shared DRAM structures (slot table,
//!   index, stripe locks, free pool); it is generic over [`Medium`](pmcache_media::Medium),
//!   [`BackingStore`](pmcache_backing::BackingStore) and [`Clock`], so tests run the production
//!   code on a crash-simulating medium, a fault-injecting backing store and a manual clock.
//! - [`Lane`] is one thread's handle: reads, writes, trims, write-zeroes, flush, drain.
//! - Recovery ([`Engine::open`]) rebuilds everything from the medium alone.
//!
//! docs/ARCHITECTURE.md, docs/FORMAT.md and docs/DURABILITY.md describe the design.

#![forbid(unsafe_code)]

mod abort;
mod admission;
mod cache;
pub mod cleaner_policy;
mod clock;
mod config;
mod error;
pub mod eviction;
mod failpoint;
pub mod format;
mod freepool;
mod health;
mod index;
pub mod layout;
mod placement;
mod recovery;
mod slots;
mod stats;
pub mod stores;
mod sync;
#[cfg(any(test, feature = "testing"))]
pub mod testing;

pub use cache::{
    BatchOutcome, Cleaner, Engine, Lane, MISS_SPAN_BLOCKS_MAX, READ_DATA_PREFETCH_AHEAD,
    READS_PENDING_MAX, ReadRequest, ReadStart, Ticket, WriteRequest, WriteStart,
};
pub use cleaner_policy::{Adaptive, CleanerConfig, CleanerStats, WriteBackOrder};
pub use clock::{Clock, ManualClock, MonotonicClock};
pub use config::{AdmissionConfig, CacheMode, Config, EvictionKind};
pub use error::{Error, Result, Unreadable};
pub use health::{BackingHealth, BackingOp, BackingState};
pub use layout::{Layout, Member};
pub use placement::{MemberStats, PlacementConfig, PlacementPolicy};
pub use recovery::{CheckReport, RecoveryReport, check_medium};
pub use stats::Stats;
