//! pmcache's vhost-user-blk frontend: a block device served to a VMM (QEMU's
//! `vhost-user-blk-pci`, cloud-hypervisor, ...) through virtqueues in memory the VM shares
//! with this process. A guest's request reaches the cache with no system call and no copy on
//! the way: the VMM hands over the guest's memory once, the guest's driver places requests
//! in its virtqueues and kicks an eventfd, a thread per virtqueue serves them on its own
//! [`BlockConn`] (an engine lane) straight into and out of the guest's buffers. It needs no
//! kernel module, unlike ublk and the kernel's NBD client.
//!
//! - [`virtio`]: the device as the guest's driver sees it: features, configuration space,
//!   request headers and ranges.
//! - [`queue`]: one virtqueue's requests served as batches, answered in the order the guest
//!   made them available (what lets QEMU resubmit, after a restart, exactly the requests a
//!   killed server never answered).
//! - `backend`: the rust-vmm `VhostUserBackend` of one connection.
//! - [`server`]: the socket, one connection after another, and the stop.
//!
//! Built on the rust-vmm crates: `vhost` (the vhost-user protocol), `vhost-user-backend`
//! (the daemon and its worker threads), `virtio-queue` and `vm-memory`.
//!
//! [`BlockConn`]: pmcache_block::BlockConn

mod backend;
pub mod queue;
pub mod server;
pub mod virtio;

pub use queue::{QueueCounters, QueueServer};
pub use server::{Error, Stopper, serve};
pub use virtio::Geometry;
