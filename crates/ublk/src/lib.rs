//! ublk frontend for pmcache: the cache as a kernel block device (`/dev/ublkbN`) served from
//! userspace through the kernel's ublk driver (Linux 6.0 and later, module `ublk_drv`). Each
//! queue serves a `pmcache_block::BlockConn` of its own (the cache gives each its own engine
//! lane); a `pmcache_block::BlockError`'s errno completes a failed request.
//!
//! - [`mapping`]: the pure request mapping — a ublk I/O descriptor decoded into a
//!   [`Request`], validated against the device's [`Geometry`], and an outcome turned into the
//!   completion result (bytes done or a negative errno). No kernel needed; unit-tested.
//! - [`queue`]: the [`Dispatcher`] of one queue — the requests it received together served
//!   as batches (reads together, writes together: group commit), one completion per tag.
//!   Pure as well: `pmcache bench ublk-mapping` measures it without a kernel.
//! - [`device`]: the device itself through libublk — added, served one thread per queue,
//!   stopped from another thread, deleted.
//! - [`poll`]: the [`PollPolicy`] of a queue thread — when it polls its ring (`--ublk-poll`)
//!   and when it sleeps on it. Pure as well.
//! - [`mounts`]: the file systems mounted on a device, synced before it stops (a stop is a
//!   surprise removal for them).
//! - [`recovery`]: devices a server that died left behind (user recovery): described,
//!   listed, removed, or taken over by a new server of the same cache.
//!
//! `docs/UBLK.md` at the repository root says what is served and how to run it.
//!
//! The kernel half ([`device`], [`recovery`]) is behind the cargo feature `device`: libublk
//! generates its kernel bindings with bindgen at build time, which needs libclang
//! (`apt-get install libclang-dev`). Without it the crate is the pure request path, which
//! `pmcache bench ublk-mapping` measures.

#![forbid(unsafe_code)]

#[cfg(feature = "device")]
pub mod device;
pub mod mapping;
pub mod mounts;
pub mod poll;
pub mod queue;
#[cfg(feature = "device")]
pub mod recovery;

/// The per-tag I/O buffer the device uses (libublk's, 4096-byte aligned).
#[cfg(feature = "device")]
pub use libublk::helpers::IoBuf;

#[cfg(feature = "device")]
pub use device::{
    CONTROL_PATH, Device, DeviceConfig, DeviceError, QueueWaits, Started, Stopper, check_driver,
};
pub use mapping::{Geometry, IoDesc, MapError, Request};
pub use poll::PollPolicy;
pub use queue::Dispatcher;
#[cfg(feature = "device")]
pub use recovery::{DeviceInfo, DeviceState, OwnerTag};
