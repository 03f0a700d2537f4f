//! ublk frontend for pmcache: the cache as a kernel block device (`/dev/ublkbN`) served from
//! userspace through the kernel's ublk driver (Linux 6.0 and later, module `ublk_drv`).
//!
//! - [`mapping`]: the pure request mapping — a ublk I/O descriptor decoded into a
//!   [`Request`], validated against the device's [`Geometry`], and an outcome turned into the
//!   completion result (bytes done or a negative errno). No kernel needed; unit-tested.
//! - [`target`]: the [`Target`] trait a queue serves (one per queue: the cache gives each its
//!   own engine lane), with batch hooks, and [`TargetError`] (an errno).
//! - [`queue`]: the [`Dispatcher`] of one queue — the requests it received together served
//!   as batches (reads together, writes together: group commit), one completion per tag.
//!   Pure as well: `pmcache bench ublk-mapping` measures it without a kernel.
//! - [`device`]: the device itself through libublk — added, served one thread per queue,
//!   stopped from another thread, deleted.
//! - [`mounts`]: the file systems mounted on a device, synced before it stops (a stop is a
//!   surprise removal for them).
//! - [`recovery`]: devices a server that died left behind (user recovery): described,
//!   listed, removed, or taken over by a new server of the same cache.
//!
//! `docs/UBLK.md` at the repository root says what is served and how to run it.
//!
//! Serving a device, and taking one over after its server died (needs the driver and root):
//!
//! ```no_run
//! use pmcache_ublk::{Device, DeviceConfig, OwnerTag, Target, TargetError, recovery};
//!
//! /// A RAM disk: what a queue serves. (Its bytes die with the server; a target whose device
//! /// is to be taken over keeps them where the next server finds them, as pmcache's medium.)
//! struct Ram(Vec<u8>);
//!
//! impl Target for Ram {
//!     fn read(&mut self, offset: u64, buf: &mut [u8]) -> Result<(), TargetError> {
//!         let at = offset as usize;
//!         buf.copy_from_slice(&self.0[at..at + buf.len()]);
//!         Ok(())
//!     }
//!     fn write(&mut self, offset: u64, data: &[u8], _fua: bool) -> Result<(), TargetError> {
//!         let at = offset as usize;
//!         self.0[at..at + data.len()].copy_from_slice(data);
//!         Ok(())
//!     }
//!     fn flush(&mut self) -> Result<(), TargetError> {
//!         Ok(())
//!     }
//!     fn discard(&mut self, _offset: u64, _len: u64) -> Result<(), TargetError> {
//!         Ok(())
//!     }
//!     fn write_zeroes(&mut self, offset: u64, len: u64, _fua: bool, _unmap: bool)
//!         -> Result<(), TargetError> {
//!         self.0[offset as usize..(offset + len) as usize].fill(0);
//!         Ok(())
//!     }
//! }
//!
//! let config = DeviceConfig {
//!     queues: 1,
//!     depth: 64,
//!     size_bytes: 64 << 20,
//!     logical_block_bytes: 4096,
//!     physical_block_bytes: 4096,
//!     max_io_bytes: 1 << 20,
//!     user_recovery: true,
//!     owner: OwnerTag(0x5eed), // what identifies the data served, recorded in the device
//! };
//! // A device left by a dead server of the same data is taken over; otherwise a new one.
//! let orphan = recovery::list()?
//!     .into_iter()
//!     .find(|d| d.owner == config.owner && d.orphaned());
//! let device = match orphan {
//!     Some(d) => Device::recover(d.id, config)?,
//!     None => Device::add(config)?,
//! };
//! let stopper = device.stopper(); // `stopper.stop()` from another thread ends `run`
//! device.run(vec![Ram(vec![0; 64 << 20])], |started| {
//!     println!("serving {}", started.block_path.display());
//! })?;
//! # drop(stopper);
//! # Ok::<(), pmcache_ublk::DeviceError>(())
//! ```

#![forbid(unsafe_code)]

pub mod device;
pub mod mapping;
pub mod mounts;
pub mod queue;
pub mod recovery;
pub mod target;

/// The per-tag I/O buffer the device uses (libublk's, 4096-byte aligned).
pub use libublk::helpers::IoBuf;

pub use device::{CONTROL_PATH, Device, DeviceConfig, DeviceError, Started, Stopper, check_driver};
pub use mapping::{Geometry, IoDesc, MapError, Request};
pub use queue::Dispatcher;
pub use recovery::{DeviceInfo, DeviceState, OwnerTag};
pub use target::{BatchRead, BatchWrite, Target, TargetError};
