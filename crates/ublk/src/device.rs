//! The ublk device: added through `/dev/ublk-control` with libublk, one thread per queue, each
//! with its own [`BlockConn`] (the cache gives each one its own engine lane) and its own io_uring;
//! the descriptors a queue receives in one wait on its ring go to a [`Dispatcher`] as one
//! batch.
//!
//! Data moves through per-tag buffers that libublk allocates and registers with the driver:
//! the driver copies a write's data into its tag's buffer before handing the request over,
//! and a read's data out of it when the result is committed, so between those two points the
//! buffer belongs to the queue's thread alone.
//!
//! A queue thread sleeps on its ring until the driver hands it requests, or, with
//! [`DeviceConfig::poll_idle`], polls it while requests keep coming ([`crate::poll`]).
//!
//! [`Device::add`] creates the device (with `UBLK_F_USER_RECOVERY` and, where offered,
//! `UBLK_F_USER_RECOVERY_REISSUE`, when asked for and the driver offers them: a server that
//! dies leaves the device to a successor, which takes it over with [`Device::recover`]);
//! [`Device::run`] serves it until it is stopped ([`Stopper::stop`]: the driver lets
//! in-flight requests complete, then ends the queues) and deletes it.
//!
//! Serving a device, and taking one over after its server died (needs the driver and root):
//!
//! ```no_run
//! use pmcache_block::{BlockConn, BlockError};
//! use pmcache_ublk::{Device, DeviceConfig, OwnerTag, recovery};
//!
//! /// A RAM disk: what a queue serves. (Its bytes die with the server; a target whose device
//! /// is to be taken over keeps them where the next server finds them, as pmcache's medium.)
//! struct Ram(Vec<u8>);
//!
//! impl BlockConn for Ram {
//!     fn read(&mut self, offset: u64, buf: &mut [u8]) -> Result<(), BlockError> {
//!         let at = offset as usize;
//!         buf.copy_from_slice(&self.0[at..at + buf.len()]);
//!         Ok(())
//!     }
//!     fn write(&mut self, offset: u64, data: &[u8], _fua: bool) -> Result<(), BlockError> {
//!         let at = offset as usize;
//!         self.0[at..at + data.len()].copy_from_slice(data);
//!         Ok(())
//!     }
//!     fn flush(&mut self) -> Result<(), BlockError> {
//!         Ok(())
//!     }
//!     fn trim(&mut self, _offset: u64, _len: u64, _fua: bool) -> Result<(), BlockError> {
//!         Ok(())
//!     }
//!     fn write_zeroes(&mut self, offset: u64, len: u64, _fua: bool, _unmap: bool)
//!         -> Result<(), BlockError> {
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
//!     // Queue threads poll their rings for 1 ms after each request (None: they sleep).
//!     poll_idle: Some(std::time::Duration::from_micros(1000)),
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

use std::os::fd::AsRawFd;
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, PoisonError, Weak};
use std::time::{Duration, Instant};

use libublk::ctrl::{UblkCtrl, UblkCtrlBuilder};
use libublk::io::{UblkDev, UblkIOCtx, UblkQueue};
use libublk::{BufDesc, BufDescList, UblkError, UblkFlags, UblkIORes, UblkUringData, sys};

use crate::mapping::{self, Geometry, IoDesc, SECTOR_BYTES};
use crate::poll::PollPolicy;
use crate::queue::Dispatcher;
use crate::recovery::OwnerTag;
use pmcache_block::BlockConn;

/// The ublk driver's control device.
pub const CONTROL_PATH: &str = "/dev/ublk-control";

/// Most queues a device can have (`UBLK_MAX_NR_QUEUES`).
pub const MAX_QUEUES: u16 = sys::UBLK_MAX_NR_QUEUES as u16;
/// Most tags per queue (`UBLK_MAX_QUEUE_DEPTH`).
pub const MAX_DEPTH: u16 = sys::UBLK_MAX_QUEUE_DEPTH as u16;
/// Largest request buffer the driver takes (`UBLK_IO_BUF_BITS`: 32 MiB).
pub const MAX_IO_BYTES: u32 = 1 << sys::UBLK_IO_BUF_BITS;
/// Largest discard or write-zeroes request advertised: 1 GiB.
const MAX_DISCARD_BYTES: u64 = 1 << 30;
/// Largest logical block size the driver takes (the page size on x86-64 and arm64's default).
const MAX_LOGICAL_BLOCK_BYTES: u32 = 4096;

// The mapping's constants are the UAPI header's.
const _: () = {
    assert!(mapping::UBLK_IO_OP_READ as u32 == sys::UBLK_IO_OP_READ);
    assert!(mapping::UBLK_IO_OP_WRITE as u32 == sys::UBLK_IO_OP_WRITE);
    assert!(mapping::UBLK_IO_OP_FLUSH as u32 == sys::UBLK_IO_OP_FLUSH);
    assert!(mapping::UBLK_IO_OP_DISCARD as u32 == sys::UBLK_IO_OP_DISCARD);
    assert!(mapping::UBLK_IO_OP_WRITE_SAME as u32 == sys::UBLK_IO_OP_WRITE_SAME);
    assert!(mapping::UBLK_IO_OP_WRITE_ZEROES as u32 == sys::UBLK_IO_OP_WRITE_ZEROES);
    assert!(mapping::UBLK_IO_F_FUA == sys::UBLK_IO_F_FUA);
    assert!(mapping::UBLK_IO_F_NOUNMAP == sys::UBLK_IO_F_NOUNMAP);
    assert!(size_of::<sys::ublksrv_io_desc>() == 24);
};

/// Why a device could not be set up or served.
#[derive(Debug, thiserror::Error)]
pub enum DeviceError {
    /// The kernel has no ublk driver loaded.
    #[error(
        "{CONTROL_PATH} does not exist: this kernel has no ublk driver loaded (load it with \
         `modprobe ublk_drv`, Linux 6.0 or later), or serve over NBD instead (`pmcache serve` \
         without --ublk)"
    )]
    NoDriver,
    /// The control device exists but cannot be used.
    #[error("{CONTROL_PATH}: {0} (adding a ublk device needs root, or CAP_SYS_ADMIN)")]
    ControlAccess(std::io::Error),
    /// A configuration the driver would refuse, or a device that cannot be used as asked.
    #[error("ublk device: {0}")]
    Config(String),
    /// There is no such device.
    #[error("there is no ublk device {0} (/dev/ublkc{0} does not exist)")]
    NoDevice(u32),
    /// A libublk call failed.
    #[error("ublk: {what}: {}", describe(.source))]
    Ublk {
        /// What was being done.
        what: &'static str,
        /// libublk's error.
        source: UblkError,
    },
}

/// libublk's errors carry a negative errno where the kernel gave one; shown as the OS text.
fn describe(e: &UblkError) -> String {
    match e {
        UblkError::OtherError(errno) | UblkError::UringIOError(errno) => {
            std::io::Error::from_raw_os_error(-errno).to_string()
        }
        UblkError::IOError(e) => e.to_string(),
        e => format!("{e} ({e:?})"),
    }
}

pub(crate) fn ublk(what: &'static str) -> impl FnOnce(UblkError) -> DeviceError {
    move |source| DeviceError::Ublk { what, source }
}

/// Checks that the ublk driver is there (its control device exists and can be opened), before
/// anything else is set up.
pub fn check_driver() -> Result<(), DeviceError> {
    match std::fs::OpenOptions::new().read(true).write(true).open(CONTROL_PATH) {
        Ok(_) => Ok(()),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Err(DeviceError::NoDriver),
        Err(e) => Err(DeviceError::ControlAccess(e)),
    }
}

/// The device's shape and queues.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct DeviceConfig {
    /// Hardware queues: one thread and one target each.
    pub queues: u16,
    /// Tags (requests in flight) per queue.
    pub depth: u16,
    /// Device size; a multiple of `logical_block_bytes`.
    pub size_bytes: u64,
    /// Logical block size: a power of two from 512 to 4096.
    pub logical_block_bytes: u32,
    /// Physical block size (the cache block): a power of two, at least the logical one; also
    /// the minimum and optimal I/O size and the discard granularity.
    pub physical_block_bytes: u32,
    /// Largest read or write, the size of each tag's buffer: a multiple of the logical block
    /// size, at most [`MAX_IO_BYTES`].
    pub max_io_bytes: u32,
    /// Ask for user recovery (`UBLK_F_USER_RECOVERY`) where the driver offers it.
    pub user_recovery: bool,
    /// The cache served, recorded in the device (see [`crate::recovery`]).
    pub owner: OwnerTag,
    /// Poll the queues' rings instead of sleeping on them while requests keep coming, and
    /// for this long after the last one ([`PollPolicy`]): a request is picked up without a
    /// wake-up, at the cost of a CPU busy per queue while I/O flows. `None` (or zero): the
    /// queue threads sleep until the driver hands them requests.
    pub poll_idle: Option<Duration>,
}

impl DeviceConfig {
    /// Refuses what the driver would refuse, with the reason.
    pub fn validate(&self) -> Result<(), DeviceError> {
        let refuse = |why: String| Err(DeviceError::Config(why));
        if !(1..=MAX_QUEUES).contains(&self.queues) {
            return refuse(format!("{} queues: from 1 to {MAX_QUEUES}", self.queues));
        }
        if !(1..=MAX_DEPTH).contains(&self.depth) {
            return refuse(format!("queue depth {}: from 1 to {MAX_DEPTH}", self.depth));
        }
        let logical = self.logical_block_bytes;
        if !logical.is_power_of_two() || !(512..=MAX_LOGICAL_BLOCK_BYTES).contains(&logical) {
            return refuse(format!(
                "logical block size {logical}: a power of two from 512 to \
                 {MAX_LOGICAL_BLOCK_BYTES}"
            ));
        }
        let physical = self.physical_block_bytes;
        if !physical.is_power_of_two() || physical < logical {
            return refuse(format!(
                "physical block size {physical}: a power of two, at least the logical {logical}"
            ));
        }
        if self.max_io_bytes < logical
            || !self.max_io_bytes.is_multiple_of(logical)
            || self.max_io_bytes > MAX_IO_BYTES
        {
            return refuse(format!(
                "largest request {} B: a multiple of {logical} up to {MAX_IO_BYTES}",
                self.max_io_bytes
            ));
        }
        if self.size_bytes == 0 || !self.size_bytes.is_multiple_of(u64::from(logical)) {
            return refuse(format!("size {} B: a non-zero multiple of {logical}", self.size_bytes));
        }
        Ok(())
    }

    /// What requests are validated against.
    pub fn geometry(&self) -> Geometry {
        Geometry {
            size_bytes: self.size_bytes,
            logical_block_bytes: self.logical_block_bytes,
            max_io_bytes: self.max_io_bytes,
        }
    }

    /// The parameters given to the driver: basic (block sizes, largest request, size, a
    /// volatile write cache with FUA: FLUSH and FUA reach the target; not rotational) and
    /// discard (granularity the cache block, write-zeroes too).
    pub fn params(&self) -> sys::ublk_params {
        let shift = |bytes: u32| bytes.trailing_zeros() as u8;
        let discard_sectors = (MAX_DISCARD_BYTES / SECTOR_BYTES) as u32;
        sys::ublk_params {
            len: size_of::<sys::ublk_params>() as u32,
            types: sys::UBLK_PARAM_TYPE_BASIC | sys::UBLK_PARAM_TYPE_DISCARD,
            basic: sys::ublk_param_basic {
                // No UBLK_ATTR_ROTATIONAL: the device is not rotational.
                attrs: sys::UBLK_ATTR_VOLATILE_CACHE | sys::UBLK_ATTR_FUA,
                logical_bs_shift: shift(self.logical_block_bytes),
                physical_bs_shift: shift(self.physical_block_bytes),
                io_min_shift: shift(self.physical_block_bytes),
                io_opt_shift: shift(self.physical_block_bytes),
                max_sectors: self.max_io_bytes / SECTOR_BYTES as u32,
                dev_sectors: self.size_bytes / SECTOR_BYTES,
                ..Default::default()
            },
            discard: sys::ublk_param_discard {
                discard_alignment: 0,
                discard_granularity: self.physical_block_bytes,
                max_discard_sectors: discard_sectors,
                max_write_zeroes_sectors: discard_sectors,
                max_discard_segments: 1,
                ..Default::default()
            },
            ..Default::default()
        }
    }
}

/// The control flags asked of the driver: user recovery with re-issue when `user_recovery`
/// asks for it and `features` (what the driver offers, `UBLK_U_CMD_GET_FEATURES`) has them.
/// Kernels before 6.5 cannot list their features (`None`): both are asked for, and the
/// driver clears from a new device's flags those it does not know (its feature negotiation),
/// so the flags read back after the add say what is on.
pub fn control_flags(user_recovery: bool, features: Option<u64>) -> u64 {
    let offered = |flag: u64| features.is_none_or(|f| f & flag != 0);
    let recovery = u64::from(sys::UBLK_F_USER_RECOVERY);
    let reissue = u64::from(sys::UBLK_F_USER_RECOVERY_REISSUE);
    if !user_recovery || !offered(recovery) {
        return 0;
    }
    if offered(reissue) { recovery | reissue } else { recovery }
}

/// A device added to the driver, not yet serving. Dropped without [`Device::run`], it is
/// deleted.
pub struct Device {
    pub(crate) ctrl: Arc<UblkCtrl>,
    /// Set by a [`Stopper`].
    pub(crate) stop_requested: Arc<AtomicBool>,
    pub(crate) config: DeviceConfig,
    /// Taken over from a server that died ([`Device::recover`]), rather than added.
    pub(crate) recovered: bool,
    /// How the queue threads waited, counted as they serve.
    pub(crate) waits: Arc<QueueWaits>,
}

/// How a device's queue threads waited on their rings: sleeping until the driver handed
/// them requests, or polling ([`DeviceConfig::poll_idle`]). Each queue's thread counts its
/// own; read from any thread.
#[derive(Debug)]
pub struct QueueWaits(Box<[QueueWaitCounts]>);

/// One queue's counts, on cache lines of their own: a polling thread writes them at every
/// poll, and the other queues' threads none of them.
#[derive(Debug, Default)]
#[repr(align(128))]
struct QueueWaitCounts {
    slept: AtomicU64,
    polled: AtomicU64,
}

impl QueueWaits {
    pub(crate) fn new(queues: u16) -> Self {
        Self((0..queues).map(|_| QueueWaitCounts::default()).collect())
    }

    /// Waits that slept until a completion came, over every queue.
    pub fn slept(&self) -> u64 {
        self.0.iter().map(|q| q.slept.load(Ordering::Relaxed)).sum()
    }

    /// Polls (waits that returned at once, whether they found requests or not), over every
    /// queue.
    pub fn polled(&self) -> u64 {
        self.0.iter().map(|q| q.polled.load(Ordering::Relaxed)).sum()
    }
}

/// What the started device is, given to `run`'s `started` callback.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Started {
    /// The device number N.
    pub id: u32,
    /// `/dev/ublkbN`.
    pub block_path: PathBuf,
    /// User recovery is on: a server that dies leaves the device for a successor.
    pub user_recovery: bool,
    /// The device was taken over from a server that died.
    pub recovered: bool,
}

/// Entries of the control ring a [`Stopper`] opens on its thread.
const CONTROL_RING_DEPTH: u32 = 8;

/// Stops a running device from another thread.
#[derive(Clone)]
pub struct Stopper {
    ctrl: Weak<UblkCtrl>,
    /// Set by the first stop: a stop that comes before the device has started (when the
    /// driver ignores it) is made when it starts.
    requested: Arc<AtomicBool>,
}

impl Stopper {
    /// Stops the device: a file system still mounted on it is synced first (the stop is a
    /// surprise removal for it: [`crate::mounts`]), then the driver completes the requests in
    /// flight through the queues, ends them, and [`Device::run`] returns. Does nothing once
    /// the device is gone.
    pub fn stop(&self) -> Result<(), DeviceError> {
        self.requested.store(true, Ordering::SeqCst);
        let Some(ctrl) = self.ctrl.upgrade() else { return Ok(()) };
        let name = format!("ublkb{}", ctrl.dev_info().dev_id);
        for (mount_point, synced) in crate::mounts::sync_mounted(&name) {
            let point = mount_point.display();
            match synced {
                Ok(()) => tracing::warn!(
                    "/dev/{name} is still mounted at {point}: synced it before stopping; it \
                     sees I/O errors from now on (unmount file systems before stopping)"
                ),
                Err(e) => tracing::error!(
                    "/dev/{name} is still mounted at {point} and could not be synced ({e}): \
                     what it had not written is lost at the stop"
                ),
            }
        }
        // libublk sends control commands through a ring of the calling thread's own; a thread
        // other than the one that added the device (a signal handler's) needs one first.
        libublk::ctrl::ublk_init_ctrl_task_ring(|ring| {
            if ring.is_none() {
                *ring = Some(
                    io_uring::IoUring::builder()
                        .build(CONTROL_RING_DEPTH)
                        .map_err(libublk::UblkError::IOError)?,
                );
            }
            Ok(())
        })
        .map_err(ublk("opening a control ring to stop the device"))?;
        ctrl.kill_dev().map(drop).map_err(ublk("stopping the device"))
    }
}

impl Device {
    /// Adds a device of `config` (a new number, `/dev/ublkcN` created; `/dev/ublkbN` appears
    /// when it runs).
    pub fn add(config: DeviceConfig) -> Result<Self, DeviceError> {
        config.validate()?;
        check_driver()?;
        let flags = control_flags(config.user_recovery, UblkCtrl::get_features());
        let ctrl = UblkCtrlBuilder::default()
            .name("pmcache")
            .id(-1)
            .nr_queues(config.queues)
            .depth(config.depth)
            .io_buf_bytes(config.max_io_bytes)
            .ctrl_flags(flags)
            .ctrl_target_flags(config.owner.0)
            .dev_flags(UblkFlags::UBLK_DEV_F_ADD_DEV)
            .build()
            .map_err(ublk("adding the device"))?;
        // The flags the driver kept (it clears those it does not know).
        ctrl.read_dev_info().map_err(ublk("reading the new device's information"))?;
        Ok(Self {
            ctrl: Arc::new(ctrl),
            stop_requested: Arc::default(),
            config,
            recovered: false,
            waits: Arc::new(QueueWaits::new(config.queues)),
        })
    }

    /// The device number N.
    pub fn id(&self) -> u32 {
        self.ctrl.dev_info().dev_id
    }

    /// Whether user recovery is on.
    pub fn user_recovery(&self) -> bool {
        self.ctrl.dev_info().flags & u64::from(sys::UBLK_F_USER_RECOVERY) != 0
    }

    /// A handle that stops the device from another thread.
    pub fn stopper(&self) -> Stopper {
        Stopper { ctrl: Arc::downgrade(&self.ctrl), requested: self.stop_requested.clone() }
    }

    /// How the queue threads waited on their rings, counted while the device runs.
    pub fn waits(&self) -> Arc<QueueWaits> {
        self.waits.clone()
    }

    /// Serves the device, queue `q` on `targets[q]` (one per queue) in a thread of its own,
    /// until it is stopped; then deletes it. `started` is called once every queue is ready
    /// and `/dev/ublkbN` exists.
    pub fn run<T, S>(self, targets: Vec<T>, started: S) -> Result<(), DeviceError>
    where
        T: BlockConn + Send + 'static,
        S: FnOnce(&Started) + Send + Sync + 'static,
    {
        if targets.len() != usize::from(self.config.queues) {
            return Err(DeviceError::Config(format!(
                "{} targets for {} queues",
                targets.len(),
                self.config.queues
            )));
        }
        let geometry = self.config.geometry();
        let params = self.config.params();
        let size_bytes = self.config.size_bytes;
        let init = move |dev: &mut UblkDev| {
            dev.set_default_params(size_bytes);
            dev.tgt.params = params;
            Ok(())
        };
        let targets = Arc::new(Mutex::new(targets.into_iter().map(Some).collect::<Vec<_>>()));
        let (waits, poll_idle) = (self.waits.clone(), self.config.poll_idle.unwrap_or_default());
        let serve = move |queue: u16, dev: &UblkDev| {
            let target =
                targets.lock().unwrap_or_else(PoisonError::into_inner)[usize::from(queue)].take();
            let policy = PollPolicy::new(poll_idle);
            match (target, waits.0.get(usize::from(queue))) {
                (Some(target), Some(waits)) => {
                    serve_queue(queue, dev, target, geometry, policy, waits);
                }
                (None, _) => tracing::error!(queue, "ublk queue started twice"),
                (_, None) => tracing::error!(queue, "ublk queue beyond the device's queues"),
            }
        };
        let (user_recovery, recovered) = (self.user_recovery(), self.recovered);
        let stop_requested = self.stop_requested.clone();
        let on_started = move |ctrl: &UblkCtrl| {
            // A stop made before the device started was ignored by the driver: made now.
            if stop_requested.load(Ordering::SeqCst) {
                if let Err(e) = ctrl.kill_dev() {
                    tracing::error!("stopping the device asked to stop: {}", describe(&e));
                }
                return;
            }
            started(&Started {
                id: ctrl.dev_info().dev_id,
                block_path: PathBuf::from(ctrl.get_bdev_path()),
                user_recovery,
                recovered,
            });
        };
        if recovered {
            // Sent only now, with everything that can fail before it done: a recovery started
            // and left without queues makes the driver refuse the next start.
            crate::recovery::start_user_recovery(&self.ctrl)?;
        }
        if let Err(e) = self.ctrl.run_target(init, serve, on_started) {
            // Queue threads may still hold the device: deleted without waiting for them (the
            // process ends on this error, and with it they).
            let _ = self.ctrl.del_dev_async();
            return Err(DeviceError::Ublk { what: "serving the device", source: e });
        }
        // The queues have ended and the device is stopped (a file system still mounted on it
        // was synced by the stop, and sees I/O errors from now on). Deleted here without
        // waiting for that file system's unmount where the driver can (`DEL_DEV_ASYNC`, Linux
        // 6.9: the number is freed at the unmount); older drivers are sent `DEL_DEV`, which
        // waits for it.
        if self.ctrl.del_dev_async().is_err() {
            self.ctrl.del_dev().map_err(ublk("deleting the device"))?;
        }
        Ok(())
    }
}

/// One queue's loop: wait for the requests the driver hands over, dispatch them as one
/// batch, commit their results (each commit also fetches the tag's next request), until the
/// queue is stopped. The commits are queued on the ring and submitted together by the next
/// wait, which sleeps until requests come or, while `policy` polls, returns at once.
///
/// libublk pins the thread to the CPUs of its queue in the driver's map (`set_thread_affinity`).
fn serve_queue<T: BlockConn>(
    queue_id: u16,
    dev: &UblkDev,
    mut target: T,
    geometry: Geometry,
    mut policy: PollPolicy,
    waits: &QueueWaitCounts,
) {
    let mut bufs = dev.alloc_queue_io_bufs();
    let queue = match UblkQueue::new(queue_id, dev)
        .and_then(|q| q.submit_fetch_commands_unified(BufDescList::Slices(Some(&bufs))))
    {
        Ok(queue) => queue,
        Err(e) => {
            tracing::error!(queue = queue_id, "ublk queue setup failed: {}", describe(&e));
            // The device's start waits for every queue: told this one failed, it fails.
            dev.notify_buffer_registration_complete(true);
            return;
        }
    };
    let mut dispatcher = Dispatcher::new(geometry, dev.dev_info.queue_depth);
    // A poll of the target's completion descriptor is on the ring (its CQE is the only target
    // I/O this queue issues).
    let mut completion_poll_armed = false;
    loop {
        // 0 polls: `io_uring_enter` without waiting runs the ring's pending completions (the
        // ring is COOP_TASKRUN: the driver's completions are posted only when the thread
        // enters the kernel, so spinning on the CQ alone would never see them), submits the
        // queued commits and returns. 1 sleeps until a completion is posted.
        let to_wait = policy.to_wait();
        let mut completion_polled = false;
        let received = queue.flush_and_wake_io_tasks(
            |user_data, cqe, _last| {
                // A target CQE is the completion poll firing; a result other than OK on a
                // driver's request is the queue going down (UBLK_IO_RES_ABORT).
                if user_data & UblkUringData::Target as u64 != 0 {
                    completion_polled = true;
                    return;
                }
                if cqe.result() != sys::UBLK_IO_RES_OK as i32 {
                    return;
                }
                let tag = UblkIOCtx::user_data_to_tag(user_data) as u16;
                let iod = queue.get_iod(tag);
                let desc = IoDesc {
                    op_flags: iod.op_flags,
                    nr_sectors: iod.nr_sectors,
                    start_sector: iod.start_sector,
                };
                dispatcher.receive(tag, &desc);
            },
            to_wait,
        );
        // An error is the queue going down, in either mode.
        let Ok(cqes) = received else { break };
        let count = if to_wait == 0 { &waits.polled } else { &waits.slept };
        count.fetch_add(1, Ordering::Relaxed);
        policy.saw(usize::try_from(cqes).unwrap_or(0), Instant::now);
        if cqes == 0 && to_wait == 0 {
            // Nothing came: nothing to serve or commit (target reads in flight are waited
            // for by the completion poll on the ring, or were completed before this wait).
            std::hint::spin_loop();
            continue;
        }
        if completion_polled {
            completion_poll_armed = false;
        }
        // Reads in flight that completed, then the new requests: each tag is committed as
        // soon as it is answered, whatever else is in flight.
        dispatcher.complete_pending(&mut target, &mut bufs, 0);
        dispatcher.dispatch(&mut target, &mut bufs);
        if target.pending() > 0 && !completion_poll_armed {
            if let Some(fd) = target.completion_fd() {
                let poll = io_uring::opcode::PollAdd::new(
                    io_uring::types::Fd(fd.as_raw_fd()),
                    libc::POLLIN as u32,
                )
                .build()
                .user_data(UblkIOCtx::build_user_data(0, 0, 0, true));
                match queue.ublk_submit_sqe_sync(poll) {
                    Ok(()) => completion_poll_armed = true,
                    Err(e) => {
                        tracing::warn!(queue = queue_id, "ublk completion poll: {}", describe(&e));
                    }
                }
            }
            if !completion_poll_armed {
                // Nothing to wake this queue when they complete: wait for them here.
                let pending = target.pending();
                dispatcher.complete_pending(&mut target, &mut bufs, pending);
            }
        }
        for (tag, result) in dispatcher.completions() {
            let buf = BufDesc::Slice(bufs[usize::from(tag)].as_slice());
            if let Err(e) = queue.complete_io_cmd_unified(tag, buf, Ok(UblkIORes::Result(result))) {
                tracing::error!(queue = queue_id, tag, "ublk commit failed: {}", describe(&e));
            }
        }
    }
    for tag in queue.tags() {
        queue.unregister_io_buf(tag);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn config() -> DeviceConfig {
        DeviceConfig {
            queues: 2,
            depth: 64,
            size_bytes: 8 << 30,
            logical_block_bytes: 4096,
            physical_block_bytes: 4096,
            max_io_bytes: 1 << 20,
            user_recovery: true,
            owner: OwnerTag(1),
            poll_idle: None,
        }
    }

    /// The parameters say what the cache is: block sizes, largest request, size, discard
    /// granularity, a write cache with FUA, not rotational.
    #[test]
    fn params_come_from_the_configuration() {
        let c = DeviceConfig { physical_block_bytes: 16384, ..config() };
        let p = c.params();
        assert_eq!(p.types, sys::UBLK_PARAM_TYPE_BASIC | sys::UBLK_PARAM_TYPE_DISCARD);
        assert_eq!((p.basic.logical_bs_shift, p.basic.physical_bs_shift), (12, 14));
        assert_eq!((p.basic.io_min_shift, p.basic.io_opt_shift), (14, 14));
        assert_eq!(p.basic.max_sectors, 2048);
        assert_eq!(p.basic.dev_sectors, 16 << 20);
        assert_eq!(p.basic.attrs & sys::UBLK_ATTR_ROTATIONAL, 0);
        assert_ne!(p.basic.attrs & sys::UBLK_ATTR_VOLATILE_CACHE, 0);
        assert_ne!(p.basic.attrs & sys::UBLK_ATTR_FUA, 0);
        assert_eq!(p.discard.discard_granularity, 16384);
        assert_eq!(p.discard.max_discard_segments, 1);
        assert!(p.discard.max_write_zeroes_sectors > 0);
    }

    /// What the driver would refuse is refused first, naming the value.
    #[test]
    fn configurations_the_driver_refuses_are_refused() {
        assert!(config().validate().is_ok());
        let bad = [
            (DeviceConfig { queues: 0, ..config() }, "0 queues"),
            (DeviceConfig { depth: MAX_DEPTH + 1, ..config() }, "queue depth"),
            (DeviceConfig { logical_block_bytes: 8192, ..config() }, "logical block size 8192"),
            (DeviceConfig { logical_block_bytes: 1000, ..config() }, "logical block size 1000"),
            (DeviceConfig { physical_block_bytes: 512, ..config() }, "physical block size 512"),
            (DeviceConfig { max_io_bytes: 6000, ..config() }, "largest request 6000"),
            (DeviceConfig { max_io_bytes: 64 << 20, ..config() }, "largest request"),
            (DeviceConfig { size_bytes: 4097, ..config() }, "size 4097"),
        ];
        for (c, what) in bad {
            let err = c.validate().unwrap_err().to_string();
            assert!(err.contains(what), "{c:?}: {err}");
        }
    }

    /// User recovery (with re-issue where offered) only when asked for and not known to be
    /// missing.
    #[test]
    fn user_recovery_only_where_offered() {
        let recovery = u64::from(sys::UBLK_F_USER_RECOVERY);
        let reissue = u64::from(sys::UBLK_F_USER_RECOVERY_REISSUE);
        // A kernel that cannot list its features is asked for both.
        assert_eq!(control_flags(true, None), recovery | reissue);
        assert_eq!(control_flags(false, None), 0);
        assert_eq!(control_flags(false, Some(u64::MAX)), 0);
        assert_eq!(control_flags(true, Some(recovery)), recovery);
        assert_eq!(control_flags(true, Some(recovery | reissue)), recovery | reissue);
        assert_eq!(control_flags(true, Some(reissue)), 0);
    }

    /// Without the driver, the error names the control device, the module and NBD.
    #[test]
    fn a_missing_driver_says_what_to_do() {
        let text = DeviceError::NoDriver.to_string();
        for part in [CONTROL_PATH, "modprobe ublk_drv", "NBD"] {
            assert!(text.contains(part), "{text}");
        }
    }
}
