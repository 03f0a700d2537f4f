//! The io_uring engines: interrupt-driven, IOPOLL (the submitting thread polls the device for
//! completions) and SQPOLL (a kernel thread polls the submission queue, so submitting costs no
//! system call).
//!
//! Each [`IoQueue`] owns one ring sized to its depth. Synchronous calls borrow a ring from a
//! pool created at open (rings of the SQPOLL engine share one kernel SQ thread). IOPOLL needs
//! `O_DIRECT` and a file whose file system implements polled completion; both are checked at
//! open (`probe_iopoll`: sysfs, then one polled read of a block holding data) and refused with
//! [`BackingError::Unsupported`]. The kernel also fails polled I/O with `EOPNOTSUPP` on a block
//! device without poll queues (`/sys/block/*/queue/io_poll` = 0, e.g. a virtio disk without
//! `virtio_blk.poll_queues`), so such a disk is refused at open too, the same way fio's `hipri`
//! fails on it.

use std::collections::VecDeque;
use std::io;
use std::os::fd::{AsRawFd, OwnedFd, RawFd};

use rustix::event::{EventfdFlags, eventfd};
use std::os::unix::fs::MetadataExt;
use std::path::Path;
use std::sync::Arc;
use std::time::{Duration, Instant};

use io_uring::{IoUring, opcode, types};

use crate::buf::IoBuf;
use crate::file::{BackingFile, OpenMode, kernel_result};
use crate::pool::Pool;
use crate::queue::{IoCompletion, IoOp, IoQueue, IoRequest, Slots};
use crate::{BackingError, BackingIdentity, BackingStore, Result};

/// How an io_uring ring learns about submissions and completions.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum UringMode {
    /// `io_uring_enter` submits, completions arrive by interrupt.
    Interrupt,
    /// `IORING_SETUP_IOPOLL`: completions are polled by the thread that reaps.
    Iopoll,
    /// `IORING_SETUP_SQPOLL`: a kernel thread polls the submission queue.
    Sqpoll,
}

impl UringMode {
    fn engine(self) -> &'static str {
        match self {
            UringMode::Interrupt => "io_uring",
            UringMode::Iopoll => "io_uring-iopoll",
            UringMode::Sqpoll => "io_uring-sqpoll",
        }
    }
}

/// Idle time after which an SQPOLL kernel thread sleeps, in milliseconds.
const SQPOLL_IDLE_MS: u32 = 1000;
/// Largest single transfer; longer requests are split by the short-transfer loop.
const MAX_TRANSFER_BYTES: usize = 1 << 30;

struct Shared {
    file: BackingFile,
    mode: UringMode,
    pool: Pool<IoUring>,
    /// Queue waiters may poll the CQ before sleeping (see [`SpinWait`]): SQPOLL rings on files
    /// whose I/O completes from the device, not from an io-wq worker. (Synchronous calls on
    /// pooled rings always sleep.)
    spin_waits: bool,
    /// The file's I/O always goes to an io-wq worker (see [`always_punted`]): queue waiters
    /// let completions gather (see [`BATCH_WAIT_US`]).
    punted: bool,
}

impl std::fmt::Debug for Shared {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Shared")
            .field("file", &self.file)
            .field("mode", &self.mode)
            .field("pool", &self.pool)
            .field("spin_waits", &self.spin_waits)
            .field("punted", &self.punted)
            .finish()
    }
}

/// A backing file driven through io_uring.
#[derive(Debug)]
pub struct UringFile {
    shared: Arc<Shared>,
}

/// Who drives a ring.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum RingUse {
    /// A pooled ring for synchronous calls, taken by whichever thread calls.
    Pooled,
    /// An [`IoQueue`]'s ring, driven by one thread.
    Queue,
}

/// How a ring was set up, as far as waiting on it is concerned.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum TaskRun {
    /// Completion work runs when the kernel gets to it (SQPOLL, or an old kernel).
    Plain,
    /// `COOP_TASKRUN`: completions do not interrupt the owning thread; it runs their task work
    /// when it next enters the kernel (Linux 5.19+).
    Cooperative,
    /// `SINGLE_ISSUER | DEFER_TASKRUN`, created disabled (Linux 6.1+): completion work waits
    /// until the one thread driving the ring asks for completions, and a waiter is woken only
    /// once as many completions as it waits for are ready. The ring is enabled by the first
    /// thread that enters it, which then owns it.
    Deferred,
}

fn build_ring(
    mode: UringMode,
    entries: u32,
    attach_wq: Option<RawFd>,
    used_by: RingUse,
) -> io::Result<(IoUring, TaskRun)> {
    let entries = entries.next_power_of_two().max(2);
    let build = |task_run: TaskRun| {
        let mut builder = IoUring::builder();
        match mode {
            UringMode::Interrupt => {}
            UringMode::Iopoll => {
                builder.setup_iopoll();
            }
            UringMode::Sqpoll => {
                builder.setup_sqpoll(SQPOLL_IDLE_MS);
                if let Some(fd) = attach_wq {
                    builder.setup_attach_wq(fd);
                }
            }
        }
        match task_run {
            TaskRun::Plain => {}
            TaskRun::Cooperative => {
                builder.setup_coop_taskrun().setup_taskrun_flag();
            }
            TaskRun::Deferred => {
                // The task-run flag tells a caller that polls (`reap(0)`) when the deferred
                // completions need an enter to be posted (see `UringQueue::reap`).
                builder
                    .setup_single_issuer()
                    .setup_defer_taskrun()
                    .setup_taskrun_flag()
                    .setup_r_disabled();
            }
        }
        builder.build(entries).map(|ring| (ring, task_run))
    };
    // SQPOLL rings are entered by their kernel thread: neither mode applies. Each fallback
    // is for a kernel that refuses the flag (EINVAL).
    let tries: &[TaskRun] = match (mode, used_by) {
        (UringMode::Sqpoll, _) => &[TaskRun::Plain],
        (_, RingUse::Pooled) => &[TaskRun::Cooperative, TaskRun::Plain],
        (_, RingUse::Queue) => &[TaskRun::Deferred, TaskRun::Cooperative, TaskRun::Plain],
    };
    let mut result = build(tries[0]);
    for &task_run in &tries[1..] {
        match result {
            Err(ref e) if e.raw_os_error() == Some(libc::EINVAL) => result = build(task_run),
            _ => break,
        }
    }
    result
}

impl UringFile {
    /// Opens `path` with `sync_rings` rings for synchronous calls.
    pub fn open_with(
        path: &Path,
        mode: UringMode,
        direct: bool,
        read_only: bool,
        sync_rings: usize,
    ) -> Result<Self> {
        let engine = mode.engine();
        if mode == UringMode::Iopoll && !direct {
            return Err(BackingError::Unsupported {
                engine,
                option: "IOPOLL",
                reason: "polled completion needs O_DIRECT (buffered I/O completes in the page \
                         cache, which cannot be polled); add --direct or pick io_uring"
                    .into(),
            });
        }
        let file = BackingFile::open(path, engine, OpenMode { direct, read_only })?;
        let option = match mode {
            UringMode::Interrupt => "io_uring",
            UringMode::Iopoll => "IOPOLL",
            UringMode::Sqpoll => "SQPOLL",
        };
        let unsupported =
            |e| BackingError::setup_failed(engine, option, "create a ring".to_string(), e);
        let (first, _) = build_ring(mode, 2, None, RingUse::Pooled).map_err(unsupported)?;
        if mode == UringMode::Sqpoll && !first.params().is_feature_ext_arg() {
            // Every wait on an SQPOLL ring is timed (`enter`): without the extended arguments
            // (Linux 5.11) it would fail with a request in flight.
            return Err(BackingError::Unsupported {
                engine,
                option: "SQPOLL",
                reason: "this kernel's io_uring has no timed waits (IORING_FEAT_EXT_ARG, \
                         Linux 5.11); pick io_uring"
                    .into(),
            });
        }
        let attach = (mode == UringMode::Sqpoll).then(|| first.as_raw_fd());
        let mut rings = vec![first];
        for _ in 1..sync_rings.max(1) {
            rings.push(build_ring(mode, 2, attach, RingUse::Pooled).map_err(unsupported)?.0);
        }
        let punted = always_punted(&file);
        let spin_waits = mode == UringMode::Sqpoll && !punted;
        let shared = Arc::new(Shared { file, mode, pool: Pool::new(rings), spin_waits, punted });
        if mode == UringMode::Iopoll {
            probe_iopoll(&shared)?;
        }
        Ok(Self { shared })
    }
}

/// Checks that polled I/O works on the file, before any request depends on it: the device's
/// queue must be able to poll (sysfs `queue/io_poll`, where the device is found there), and
/// one polled read of a block holding data must not fail with `EOPNOTSUPP` (the file system
/// has no iopoll). The read must reach the device: a hole, or a read past the end, is
/// answered without a bio, and would pass on any device.
fn probe_iopoll(shared: &Shared) -> Result<()> {
    let file = &shared.file;
    let refuse = |reason: String| {
        Err(BackingError::Unsupported { engine: file.engine, option: "IOPOLL", reason })
    };
    let device = device_io_poll(file);
    if let Some((device, false)) = &device {
        return refuse(format!(
            "{} is on block device {device}, whose queue cannot poll (its queue/io_poll is 0; \
             polled I/O would fail with EOPNOTSUPP): give the device poll queues (set \
             nvme.poll_queues=N or virtio_blk.poll_queues=N); pick io_uring",
            file.path.display()
        ));
    }
    let Some(at) = first_data_block(file) else {
        if device.is_some() {
            return Ok(());
        }
        return refuse(format!(
            "{} holds no data to probe polled I/O with, and its device is not in \
             /sys/dev/block to ask: write some data first, or pick io_uring",
            file.path.display()
        ));
    };
    let mut buf = IoBuf::new(file.block_bytes as usize);
    let mut ring = shared.pool.take();
    match ring_transfer(&mut ring, file.fd(), IoOp::Read, buf.as_mut_ptr(), buf.len(), at) {
        Err(e) if e.raw_os_error() == Some(libc::EOPNOTSUPP) => refuse(format!(
            "{} cannot complete polled I/O (a polled read returned EOPNOTSUPP): its file \
             system has no iopoll, or its block device has no poll queues (set \
             nvme.poll_queues=N or virtio_blk.poll_queues=N); pick io_uring",
            file.path.display()
        )),
        _ => Ok(()),
    }
}

/// The block device under `file` (the file itself, or the one its file system is on), as
/// `major:minor`, and whether its queue can poll, from sysfs (a partition's queue is its
/// disk's). `None` where sysfs does not list it: a file system without one block device
/// (overlayfs, btrfs, NFS) or no sysfs.
fn device_io_poll(file: &BackingFile) -> Option<(String, bool)> {
    let meta = file.file.metadata().ok()?;
    let dev = if file.is_block_device { meta.rdev() } else { meta.dev() };
    let device = format!("{}:{}", libc::major(dev), libc::minor(dev));
    let base = Path::new("/sys/dev/block").join(&device);
    let polls = ["queue/io_poll", "../queue/io_poll"]
        .iter()
        .find_map(|attr| std::fs::read_to_string(base.join(attr)).ok())?;
    Some((device, polls.trim() != "0"))
}

/// The offset of the first block of `file` that holds data (`SEEK_DATA`), if any within its
/// size; block 0 where the file system cannot tell.
fn first_data_block(file: &BackingFile) -> Option<u64> {
    let block = u64::from(file.block_bytes);
    if file.size_bytes < block {
        return None;
    }
    // SAFETY: lseek on a descriptor this `BackingFile` owns; it only moves the file offset,
    // which no transfer uses (they are all positioned).
    let at = unsafe { libc::lseek(file.fd(), 0, libc::SEEK_DATA) };
    if at < 0 {
        let e = io::Error::last_os_error();
        // ENXIO: no data at or after 0. Anything else (EINVAL: no SEEK_DATA) tells nothing.
        return (e.raw_os_error() != Some(libc::ENXIO)).then_some(0);
    }
    let at = at as u64 / block * block;
    (at + block <= file.size_bytes).then_some(at)
}

/// Which file an entry names: a plain descriptor, or slot 0 of the ring's registered files
/// (no per-request reference counting on the shared `struct file`).
#[derive(Clone, Copy, Debug)]
enum FileRef {
    Fd(RawFd),
    Registered,
}

fn entry_for(
    file: FileRef,
    op: IoOp,
    ptr: *mut u8,
    len: usize,
    offset: u64,
) -> io_uring::squeue::Entry {
    macro_rules! build {
        ($target:expr) => {{
            let len = len.min(MAX_TRANSFER_BYTES) as u32;
            match op {
                IoOp::Read => opcode::Read::new($target, ptr, len).offset(offset).build(),
                IoOp::Write => opcode::Write::new($target, ptr, len).offset(offset).build(),
                IoOp::Flush => {
                    opcode::Fsync::new($target).flags(types::FsyncFlags::DATASYNC).build()
                }
            }
        }};
    }
    match file {
        FileRef::Fd(fd) => build!(types::Fd(fd)),
        FileRef::Registered => build!(types::Fixed(0)),
    }
}

/// How long one wait in `io_uring_enter` on an SQPOLL ring lasts before the caller looks at
/// the rings again (a guard against a lost wake-up; completions normally end it much sooner).
const ENTER_WAIT: types::Timespec = types::Timespec::new().sec(1);

/// Submits what is queued and waits (up to [`ENTER_WAIT`]) for `want` completions, retrying
/// the transient `io_uring_enter` errors. Any other error means the ring is unusable while
/// the kernel may still own buffers: a broken invariant.
fn enter(ring: &IoUring, want: usize) {
    // Only SQPOLL needs the timed wait; a plain wait saves copying the extra arguments.
    let args = types::SubmitArgs::new().timespec(&ENTER_WAIT);
    let args = ring.params().is_setup_sqpoll().then_some(&args);
    if let Err(e) = enter_with(ring, want, args) {
        // Only a single-issuer ring refuses a thread (EEXIST); its owner uses `enter_with`.
        crate::abort_with_io_in_flight(format_args!("io_uring_enter refused this thread: {e}"));
    }
}

/// `enter` with the given extended arguments (or none: an untimed wait). Fails only with
/// `EEXIST`: a single-issuer ring entered by a thread other than its owner.
fn enter_with(ring: &IoUring, want: usize, args: Option<&types::SubmitArgs>) -> io::Result<()> {
    loop {
        let entered = match args {
            Some(args) => ring.submitter().submit_with_args(want, args),
            None => ring.submit_and_wait(want),
        };
        match entered {
            Ok(_) => return Ok(()),
            Err(e) if e.raw_os_error() == Some(libc::ETIME) => return Ok(()),
            Err(e)
                if matches!(e.raw_os_error(), Some(libc::EINTR | libc::EAGAIN | libc::EBUSY)) =>
            {
                std::thread::yield_now();
            }
            Err(e) if e.raw_os_error() == Some(libc::EEXIST) => return Err(e),
            Err(e) => crate::abort_with_io_in_flight(format_args!("io_uring_enter failed: {e}")),
        }
    }
}

/// How long a thread waiting on an SQPOLL ring polls the completion queue from user space
/// before it sleeps in `io_uring_enter`. SQPOLL trades CPU for latency: with a kernel thread
/// submitting, the waiting side can poll too and skip the sleep and wake-up of every request
/// (fio's SQPOLL mode polls without bound). The bound keeps an oversubscribed machine usable:
/// a waiter that never sleeps takes the CPU from the SQ threads it waits for.
const SQPOLL_SPIN: Duration = Duration::from_micros(250);
/// CQ polls between looks at the clock while spinning.
const SQPOLL_SPINS_PER_CLOCK: u32 = 64;

/// Whether io_uring hands every read and write on `file` to an io-wq worker: the file lacks
/// `FMODE_NOWAIT` (tmpfs, for one), which a one-block `preadv2(RWF_NOWAIT)` reports as
/// `EOPNOTSUPP`. Completions then come from a kernel thread that needs a CPU, so a waiter must
/// not spin on one.
fn always_punted(file: &BackingFile) -> bool {
    let mut buf = IoBuf::new(file.block_bytes as usize);
    let iov = libc::iovec { iov_base: buf.as_mut_ptr().cast(), iov_len: buf.len() };
    // SAFETY: `iov` describes `buf`, an aligned allocation valid for writes of its length for
    // the whole (synchronous) call, and the descriptor is open.
    let n = unsafe { libc::preadv2(file.fd(), &iov, 1, 0, libc::RWF_NOWAIT) };
    n < 0 && io::Error::last_os_error().raw_os_error() == Some(libc::EOPNOTSUPP)
}

/// Waits after a spin that found nothing, before a waiter spins again (see [`SpinWait`]).
const SQPOLL_SPIN_BACKOFF_WAITS: u32 = 64;

/// Waits until the ring has a completion to reap (or [`ENTER_WAIT`] passes). With `spin` the
/// CQ is polled first for up to [`SQPOLL_SPIN`], waking the SQ thread if it went to sleep;
/// then the thread waits in `io_uring_enter`. Returns false if a spin ran out of time.
fn await_completion(ring: &mut IoUring, spin: bool) -> bool {
    if spin {
        let started = Instant::now();
        let mut spins = 0u32;
        loop {
            if !ring.completion().is_empty() {
                return true;
            }
            if ring.submission().need_wakeup() {
                // Only enters the kernel to wake the SQ thread; EAGAIN/EBUSY leave it to the
                // next look, and the final `enter` reports anything lasting.
                let _ = ring.submit();
            }
            spins += 1;
            if spins.is_multiple_of(SQPOLL_SPINS_PER_CLOCK) && started.elapsed() >= SQPOLL_SPIN {
                break;
            }
            std::hint::spin_loop();
        }
    }
    enter(ring, 1);
    !spin
}

/// A queue's choice between spinning and sleeping while it waits, adapted to what spinning
/// achieves: when a spin runs out of time (completions come slower than [`SQPOLL_SPIN`], as
/// they do once SQ threads and spinning waiters outnumber the CPUs), the next
/// [`SQPOLL_SPIN_BACKOFF_WAITS`] waits sleep at once, then spinning is tried again.
#[derive(Debug)]
struct SpinWait {
    allowed: bool,
    skip_waits: u32,
}

impl SpinWait {
    fn wait(&mut self, ring: &mut IoUring) {
        let spin = self.allowed && self.skip_waits == 0;
        self.skip_waits = self.skip_waits.saturating_sub(1);
        if !await_completion(ring, spin) && spin {
            self.skip_waits = SQPOLL_SPIN_BACKOFF_WAITS;
        }
    }
}

/// The `user_data` of a pooled ring's one request.
const POOLED_USER_DATA: u64 = 0x706d_6361_6368_6501;

/// Issues one transfer on an idle ring and waits for it.
fn ring_transfer(
    ring: &mut IoUring,
    fd: RawFd,
    op: IoOp,
    ptr: *mut u8,
    len: usize,
    offset: u64,
) -> io::Result<usize> {
    let entry = entry_for(FileRef::Fd(fd), op, ptr, len, offset).user_data(POOLED_USER_DATA);
    // SAFETY: the buffer `ptr..ptr+len` is valid (borrowed by our caller) until this function
    // returns, and it returns only after reaping this entry's completion below: nothing in
    // between unwinds (a failing `io_uring_enter` aborts the process), so the ring goes back
    // to its pool idle, with room in its SQ.
    if unsafe { ring.submission().push(&entry) }.is_err() {
        crate::abort_with_io_in_flight(format_args!("a pooled ring's SQ is full"));
    }
    loop {
        if let Some(cqe) = ring.completion().next() {
            if cqe.user_data() != POOLED_USER_DATA {
                crate::abort_with_io_in_flight(format_args!(
                    "a pooled ring completed request {:#x}, not its own",
                    cqe.user_data()
                ));
            }
            return kernel_result(i64::from(cqe.result()));
        }
        await_completion(ring, false);
    }
}

impl BackingStore for UringFile {
    fn size_bytes(&self) -> u64 {
        self.shared.file.size_bytes
    }
    fn logical_block_size(&self) -> u32 {
        self.shared.file.block_bytes
    }
    fn identity(&self) -> BackingIdentity {
        self.shared.file.identity()
    }
    fn read_at(&self, buf: &mut [u8], offset: u64) -> Result<()> {
        let file = &self.shared.file;
        let mut ring = self.shared.pool.take();
        file.read_full(buf, offset, |b, at| {
            ring_transfer(&mut ring, file.fd(), IoOp::Read, b.as_mut_ptr(), b.len(), at)
        })
    }
    fn write_at(&self, data: &[u8], offset: u64) -> Result<()> {
        let file = &self.shared.file;
        let mut ring = self.shared.pool.take();
        file.write_full(data, offset, |d, at| {
            // The kernel only reads through a write's pointer.
            ring_transfer(&mut ring, file.fd(), IoOp::Write, d.as_ptr().cast_mut(), d.len(), at)
        })
    }
    fn flush(&self) -> Result<()> {
        self.shared.file.flush()
    }
    fn discard(&self, offset: u64, len: u64) -> Result<()> {
        self.shared.file.discard(offset, len)
    }
    fn write_zeroes(&self, offset: u64, len: u64) -> Result<()> {
        self.shared.file.write_zeroes(offset, len)
    }
    fn extent_at(&self, offset: u64, len: u64) -> Result<crate::Extent> {
        self.shared.file.extent_at(offset, len)
    }
    fn engine_name(&self) -> &'static str {
        self.shared.file.engine
    }
    fn is_direct(&self) -> bool {
        self.shared.file.direct
    }
    fn open_queue(&self, depth: usize) -> Result<Box<dyn IoQueue>> {
        Ok(Box::new(self.open_uring_queue(depth)?))
    }
}

impl UringFile {
    fn open_uring_queue(&self, depth: usize) -> Result<UringQueue> {
        let (ring, task_run) = build_ring(self.shared.mode, depth as u32, None, RingUse::Queue)
            .map_err(|e| {
                let what = format!("create a ring of depth {depth}");
                BackingError::setup_failed(self.shared.file.engine, "queue", what, e)
            })?;
        let batch_waits = task_run == TaskRun::Deferred
            && self.shared.punted
            && ring.params().is_feature_min_timeout();
        // Register the file with the ring when the kernel allows; otherwise name it by fd.
        let fd = self.shared.file.fd();
        let file_ref = match ring.submitter().register_files(&[fd]) {
            Ok(()) => FileRef::Registered,
            Err(_) => FileRef::Fd(fd),
        };
        let completion_event = (self.shared.mode != UringMode::Iopoll
            && task_run != TaskRun::Cooperative)
            .then(|| eventfd(0, EventfdFlags::NONBLOCK | EventfdFlags::CLOEXEC).ok())
            .flatten()
            .filter(|event| ring.submitter().register_eventfd(event.as_raw_fd()).is_ok());
        Ok(UringQueue {
            shared: self.shared.clone(),
            ring,
            file_ref,
            slots: Slots::new(depth),
            cqes: Vec::with_capacity(depth),
            backlog: VecDeque::with_capacity(depth),
            spin: SpinWait { allowed: self.shared.spin_waits, skip_waits: 0 },
            enabled: task_run != TaskRun::Deferred,
            batch_waits,
            submit_each: self.shared.mode != UringMode::Sqpoll && !self.shared.punted,
            sq_fresh: 0,
            completion_event,
            submit_enters: 0,
        })
    }
}

/// A ring of its own, driven by one thread.
struct UringQueue {
    shared: Arc<Shared>,
    ring: IoUring,
    /// How entries name the file.
    file_ref: FileRef,
    slots: Slots,
    /// Completions copied out of the CQ before they are processed: `(slot, result)`.
    cqes: Vec<(usize, i32)>,
    /// Slots issued but not yet in the SQ (it was full), in order.
    backlog: VecDeque<usize>,
    /// How this queue waits for completions.
    spin: SpinWait,
    /// The ring has been enabled (a deferred ring is created disabled, and enabled by the
    /// first thread that enters it).
    enabled: bool,
    /// Waits ask for a share of the requests in the kernel, with [`BATCH_WAIT_US`] as the
    /// longest delay before fewer will do (Linux 6.12+ `min_wait_usec`): only on files whose
    /// I/O is all handed to io-wq workers. A device's completions arrive by interrupt, and
    /// holding back its resubmissions only costs queue depth (the disk at QD32 measured 0.90
    /// of fio with batch waits).
    batch_waits: bool,
    /// Each pushed request enters the kernel at once (one `io_uring_enter` per request, as
    /// fio submits with its default `iodepth_batch_submit=1`) rather than at the next `submit`
    /// or wait: on files whose I/O the device completes by interrupt, a request the caller
    /// holds back while it prepares the rest of its batch is device queue depth lost. The
    /// disk at 1 job, QD32 measured 0.81-0.89x fio batching its refills, 0.99-1.05x submitting
    /// each. Not on always-punted files (tmpfs): there each submission wakes an io-wq worker,
    /// and batches let one wake-up carry several requests (2 jobs QD32 on tmpfs fell to 0.81x
    /// submitting each). Not with SQPOLL, whose kernel thread takes entries as they appear.
    submit_each: bool,
    /// Entries put in the SQ since the last `submit`: what an SQPOLL ring's `submit` reports
    /// as passed (its kernel thread takes them on its own; the ring's own count is of the
    /// entries it has not taken yet, which a second `submit` would count again).
    sq_fresh: usize,
    /// Signalled by the kernel whenever a completion is posted or completion work is queued
    /// for this thread (a ring whose work is deferred to its thread wakes no poller of the
    /// ring itself): what `completion_fd` offers. Drained at each `reap`, before the ring is
    /// looked at; a reap that leaves completion work pending signals it again (see
    /// `keep_completion_fd_armed`). `None` on IOPOLL rings (they post nothing unless
    /// polled), on cooperative rings (their completion work waits for the thread to leave
    /// the kernel, which a thread asleep in `poll` does not) and where the kernel refused
    /// the registration.
    completion_event: Option<OwnedFd>,
    /// `io_uring_enter` calls made to submit or to poll without waiting.
    submit_enters: u64,
}

/// How long a waiter on a queue with many requests in the kernel lets completions gather
/// before it takes what has arrived (at least one). Each completion of a request that the
/// kernel hands to an io-wq worker (all of them on tmpfs) otherwise wakes the waiting thread
/// on its own, and those wake-ups cost the worker — the one thread doing every copy — a
/// large part of its time. A wait for one completion never uses it: timed waits for a lone
/// request took ~44 µs each (the kernel's timer slack; QD1 on tmpfs fell to 0.2x fio).
const BATCH_WAIT_US: u32 = 5;

/// A batch wait asks for this fraction of the requests in the kernel. Measured on tmpfs at
/// QD32 (ratio to fio, 1 job / 2 jobs, two runs each): all of them 1.22, 0.96 / 0.81, 0.76;
/// a quarter 1.00–1.19 / 0.92–0.97; an eighth 1.11, 1.14 / 1.02, 0.98; no batch wait
/// 0.83, 0.87 / 1.00, 1.00. With two jobs on two CPUs the waiter competes with both workers,
/// and waiting for many completions delays its resubmissions more than it saves.
const BATCH_DIVISOR: usize = 8;

/// A deferred ring refuses to be entered by a thread other than its owner.
fn second_thread(engine: &'static str) -> BackingError {
    BackingError::Unsupported {
        engine,
        option: "queue",
        reason: "an io_uring queue is driven by the thread that first submitted on it (its ring \
                 is single-issuer); open a queue per thread"
            .into(),
    }
}

impl UringQueue {
    /// Enables a deferred ring on its first use; the calling thread becomes its owner.
    fn enable(&mut self) -> Result<()> {
        if !self.enabled {
            self.ring.submitter().register_enable_rings().map_err(|e| {
                BackingError::Unsupported {
                    engine: self.shared.file.engine,
                    option: "queue",
                    reason: format!("cannot enable the ring: {e}"),
                }
            })?;
            self.enabled = true;
        }
        Ok(())
    }

    /// Keeps the promise of `completion_fd` at the end of a reap: completion work still
    /// pending leaves the descriptor readable. The kernel signals the descriptor only when
    /// work is queued on an empty list, so a signal drained by this reap may stand for work
    /// queued after the last enter that ran any; and one enter runs a bounded batch of work.
    /// The ring's task-run flag shows work pending: it is run here if the reap has not
    /// entered the kernel yet, and the descriptor is signalled for whatever is left.
    fn keep_completion_fd_armed(
        &mut self,
        entered: bool,
        out: &mut Vec<IoCompletion>,
        got: &mut usize,
    ) -> Result<()> {
        if self.completion_event.is_none() || !self.ring.submission().taskrun() {
            return Ok(());
        }
        if !entered {
            // The task-run flag makes this enter ask for completions, which runs the work.
            self.enter_now()?;
            self.drain_cq();
            *got += self.slots.drain_ready(out);
            if !self.ring.submission().is_empty() {
                self.submit()?;
            }
        }
        if let Some(event) = &self.completion_event
            && self.ring.submission().taskrun()
        {
            // A full counter (never reached: one add per reap) would only mean "readable".
            let _signalled = rustix::io::write(event, &1u64.to_ne_bytes());
        }
        Ok(())
    }

    /// Submits what is queued and waits for completions on a deferred ring: for one, or with
    /// batch waits (at least [`BATCH_DIVISOR`] × 2 requests in the kernel) for one in
    /// [`BATCH_DIVISOR`] of them or whatever has arrived after [`BATCH_WAIT_US`]. The overall
    /// [`ENTER_WAIT`] is required for the batch delay to mean "then take at least one" rather
    /// than "then return".
    fn wait_deferred(&mut self) -> Result<()> {
        let batch = self.slots.in_kernel() / BATCH_DIVISOR;
        let (want, args) = if self.batch_waits && batch >= 2 {
            let args = types::SubmitArgs::new().timespec(&ENTER_WAIT).min_wait_usec(BATCH_WAIT_US);
            (batch, args)
        } else {
            (1, types::SubmitArgs::new().timespec(&ENTER_WAIT))
        };
        enter_with(&self.ring, want, Some(&args))
            .map_err(|_| second_thread(self.shared.file.engine))
    }

    /// Queues a slot's (remaining) transfer for the SQ.
    fn issue(&mut self, slot: usize) {
        assert!(self.backlog.len() < self.slots.depth(), "backlog holds each slot at most once");
        self.backlog.push_back(slot);
        self.fill_sq();
    }

    /// Moves backlogged transfers into the SQ while it has room. The SQ can be full although
    /// fewer than `depth` requests are in flight: an SQPOLL thread posts completions for the
    /// first entries of a batch before it publishes the new SQ head.
    fn fill_sq(&mut self) {
        while let Some(&slot) = self.backlog.front() {
            let rem = self.slots.remaining(slot);
            let entry = entry_for(self.file_ref, rem.op, rem.ptr, rem.len, rem.offset)
                .user_data(slot as u64);
            // SAFETY: the buffer belongs to the request held in `slot`, which stays in the slot
            // table (its heap allocation unmoved) until this entry's completion is processed;
            // `Drop` waits for every request in the kernel, and no wait unwinds (a failing
            // `io_uring_enter` aborts the process).
            if unsafe { self.ring.submission().push(&entry) }.is_err() {
                return;
            }
            self.backlog.pop_front();
            self.sq_fresh += 1;
        }
    }

    /// Processes every CQE available now; short transfers are issued again.
    fn drain_cq(&mut self) {
        self.cqes.extend(self.ring.completion().map(|c| (c.user_data() as usize, c.result())));
        for i in 0..self.cqes.len() {
            let (slot, res) = self.cqes[i];
            if self.slots.on_result(slot, kernel_result(i64::from(res))) {
                self.issue(slot);
            }
        }
        self.cqes.clear();
    }

    /// Passes what is queued to the kernel with one `io_uring_enter`, not waiting (which also
    /// runs completion work the ring defers to this thread, and polls an IOPOLL ring once);
    /// returns how many entries were passed.
    fn enter_now(&mut self) -> Result<usize> {
        self.fill_sq();
        self.enable()?;
        self.submit_enters += 1;
        let fresh = std::mem::take(&mut self.sq_fresh);
        loop {
            match self.ring.submit() {
                Ok(_) if self.shared.mode == UringMode::Sqpoll => return Ok(fresh),
                Ok(n) => return Ok(n),
                Err(e) if e.raw_os_error() == Some(libc::EINTR) => {}
                Err(e) if matches!(e.raw_os_error(), Some(libc::EAGAIN | libc::EBUSY)) => {
                    // Left in the SQ for the next enter; an SQPOLL thread takes them anyway.
                    let sqpoll = self.shared.mode == UringMode::Sqpoll;
                    return Ok(if sqpoll { fresh } else { 0 });
                }
                Err(e) if e.raw_os_error() == Some(libc::EEXIST) => {
                    return Err(second_thread(self.shared.file.engine));
                }
                Err(source) => {
                    return Err(BackingError::Io { op: "submit", offset: 0, len: 0, source });
                }
            }
        }
    }
}

impl IoQueue for UringQueue {
    fn depth(&self) -> usize {
        self.slots.depth()
    }

    fn in_flight(&self) -> usize {
        self.slots.in_flight()
    }

    fn push(&mut self, req: IoRequest) -> std::result::Result<(), IoRequest> {
        if self.slots.is_full() {
            return Err(req);
        }
        let file = &self.shared.file;
        let check = match req.op {
            // IOPOLL rings only take polled reads and writes; flush synchronously instead.
            IoOp::Flush if self.shared.mode == UringMode::Iopoll => {
                let result = file.flush();
                self.slots.complete_now(req, result);
                return Ok(());
            }
            IoOp::Flush => Ok(()),
            IoOp::Read | IoOp::Write => {
                file.check_rw(req.op.name(), req.offset, req.buf.len() as u64)
            }
        };
        if let Some(slot) = self.slots.admit(req, check) {
            self.issue(slot);
            if self.submit_each {
                // A refusal here (a ring entered from a second thread, a failing enter) leaves
                // the entry in the SQ; the caller's next `submit` or `reap` reports it.
                let _refused = self.submit();
            }
        }
        Ok(())
    }

    fn submit(&mut self) -> Result<usize> {
        self.fill_sq();
        // An SQPOLL ring's kernel thread may have taken entries not yet reported as passed.
        let unreported = self.shared.mode == UringMode::Sqpoll && self.sq_fresh > 0;
        if self.ring.submission().is_empty() && !unreported {
            // Nothing to pass: no system call. The read path submits after every batch, and
            // a batch of hits queued nothing (a wasted `io_uring_enter` per request served).
            return Ok(0);
        }
        self.enter_now()
    }

    fn reap(&mut self, min: usize, out: &mut Vec<IoCompletion>) -> Result<usize> {
        if let Some(event) = &self.completion_event {
            // Drained first: a completion posted from here on signals it again.
            let _empty_or_drained = rustix::io::read(event, &mut [0u8; 8]);
        }
        let mut got = self.slots.drain_ready(out);
        let mut entered = false;
        loop {
            self.drain_cq();
            got += self.slots.drain_ready(out);
            if got >= min.max(1) || self.slots.in_kernel() == 0 || entered {
                // Whatever was pushed goes to the kernel now, not at the next wait: a caller
                // that keeps finding completions would otherwise hold its new requests back
                // while the kernel runs dry.
                if !self.ring.submission().is_empty() {
                    self.submit()?;
                }
                self.keep_completion_fd_armed(entered, out, &mut got)?;
                return Ok(got);
            }
            self.fill_sq();
            self.enable()?;
            if min == 0 {
                // A poll that found nothing: one enter without waiting, which runs deferred
                // or cooperative completion work when the ring flags it (the task-run flag)
                // and polls an IOPOLL ring once. Without it a deferred ring posts nothing.
                self.enter_now()?;
                entered = true;
            } else if self.ring.params().is_setup_single_issuer() {
                // Only deferred rings (see `TaskRun::Deferred`) are single-issuer.
                self.wait_deferred()?;
            } else {
                self.spin.wait(&mut self.ring);
            }
        }
    }

    /// The ring's registered eventfd (see `completion_event`).
    fn completion_fd(&self) -> Option<std::os::fd::BorrowedFd<'_>> {
        use std::os::fd::AsFd;
        self.completion_event.as_ref().map(|event| event.as_fd())
    }
}

impl Drop for UringQueue {
    fn drop(&mut self) {
        // The kernel may still write into buffers held by the slots: wait for all of them.
        let mut sink = Vec::with_capacity(self.slots.depth());
        while self.slots.in_kernel() > 0 {
            if self.reap(1, &mut sink).is_err() {
                // Dropped on a thread the ring refuses (see `second_thread`): the buffers the
                // kernel may still write into are leaked, never freed under it.
                std::mem::forget(std::mem::replace(&mut self.slots, Slots::new(1)));
                return;
            }
            sink.clear();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn file_in(dir: &str) -> (tempfile::TempDir, BackingFile) {
        let dir = tempfile::tempdir_in(dir).expect("temp dir");
        let path = dir.path().join("f");
        std::fs::write(&path, vec![7u8; 8192]).expect("write");
        let mode = OpenMode { direct: false, read_only: true };
        (dir, BackingFile::open(&path, "io_uring-sqpoll", mode).expect("open"))
    }

    /// tmpfs cannot do non-blocking reads (io_uring hands them to io-wq), ext4 can: only the
    /// latter lets SQPOLL waiters spin.
    #[test]
    fn tmpfs_is_always_punted_and_a_disk_file_system_is_not() {
        let (_dir, shm) = file_in("/dev/shm");
        assert!(always_punted(&shm), "a tmpfs file accepted RWF_NOWAIT");
        const EXT4_SUPER_MAGIC: i64 = 0xEF53;
        let (dir, disk) = file_in("/var/tmp");
        let path = std::ffi::CString::new(dir.path().as_os_str().as_encoded_bytes()).expect("path");
        // SAFETY: `path` is a NUL-terminated string and `fs` a writable statfs for the call.
        let mut fs: libc::statfs = unsafe { std::mem::zeroed() };
        // SAFETY: as above.
        assert_eq!(unsafe { libc::statfs(path.as_ptr(), &mut fs) }, 0, "statfs /var/tmp");
        if fs.f_type == EXT4_SUPER_MAGIC {
            assert!(!always_punted(&disk), "an ext4 file refused RWF_NOWAIT");
        } else {
            eprintln!("/var/tmp is not ext4 (f_type {:#x}): its answer is not checked", fs.f_type);
        }
    }

    /// A file of `len` bytes on the disk, with `data` written at each offset given (the rest
    /// holes), opened with `O_DIRECT` so its block is the device's.
    fn sparse_file(len: u64, data_at: &[u64]) -> (tempfile::TempDir, BackingFile) {
        use std::os::unix::fs::FileExt;
        let dir = tempfile::tempdir_in("/var/tmp").expect("temp dir");
        let path = dir.path().join("s");
        let f = std::fs::File::create(&path).expect("create");
        f.set_len(len).expect("length");
        for &at in data_at {
            f.write_all_at(&[9u8; 100], at).expect("data");
        }
        f.sync_all().expect("sync");
        let mode = OpenMode { direct: true, read_only: true };
        (dir, BackingFile::open(&path, "io_uring-iopoll", mode).expect("open"))
    }

    /// The IOPOLL probe reads the first block that holds data, rounded down to the block,
    /// and only within the file; a file with no data, or smaller than a block, has none.
    #[test]
    fn the_iopoll_probe_reads_the_first_block_holding_data() {
        let block = 4096u64;
        let (_d, f) = sparse_file(1 << 20, &[5 * block + 700]);
        let unit = u64::from(f.block_bytes);
        let found = first_data_block(&f).expect("a data block");
        // File systems report data at their own block granularity (here 4 KiB or finer).
        assert!(found <= 5 * block + 700 && found + block > 5 * block + 700, "{found}");
        assert_eq!(found % unit, 0, "{found} is not a multiple of {unit}");
        let (_d, f) = sparse_file(1 << 20, &[]);
        assert_eq!(first_data_block(&f), None, "a file of holes");
        let (_d, f) = sparse_file(0, &[]);
        assert_eq!(first_data_block(&f), None, "an empty file");
        let (_d, f) = sparse_file(1 << 20, &[0]);
        assert_eq!(first_data_block(&f), Some(0));
        // A file of exactly one block, and one a byte short of it.
        let unit_len = u64::from(f.block_bytes);
        let (_d, f) = sparse_file(unit_len, &[0]);
        assert_eq!(first_data_block(&f), Some(0), "a one-block file");
        let (_d, f) = sparse_file(unit_len - 1, &[0]);
        assert_eq!(first_data_block(&f), None, "a file shorter than a block");
        let (_d, f) = sparse_file(1 << 20, &[(1 << 20) - 100]);
        let last = first_data_block(&f).expect("the last block");
        assert!(last + unit <= 1 << 20 && last + block >= 1 << 20, "{last}");
    }

    /// sysfs names the device under a file and whether its queue polls: here a disk without
    /// poll queues (a virtio disk), for a file on it; tmpfs has no device.
    #[test]
    fn sysfs_tells_whether_the_device_under_a_file_polls() {
        use std::os::unix::fs::MetadataExt;
        let (_d, f) = sparse_file(1 << 20, &[0]);
        let dev = std::fs::metadata(&f.path).expect("stat").dev();
        let expected = format!("{}:{}", libc::major(dev), libc::minor(dev));
        match device_io_poll(&f) {
            Some((device, polls)) => {
                assert_eq!(device, expected);
                let attr = ["queue/io_poll", "../queue/io_poll"]
                    .iter()
                    .find_map(|a| {
                        std::fs::read_to_string(Path::new("/sys/dev/block").join(&device).join(a))
                            .ok()
                    })
                    .expect("the attribute just read");
                assert_eq!(polls, attr.trim() == "1", "{device}: io_poll {attr:?}");
            }
            None => assert!(
                !Path::new("/sys/dev/block").join(&expected).exists(),
                "{expected} is in sysfs but was not found"
            ),
        }
        let (_d, shm) = file_in("/dev/shm");
        assert_eq!(device_io_poll(&shm), None, "tmpfs has no block device");
    }

    #[test]
    fn a_store_shows_its_file_and_mode_when_debugged() {
        let (_dir, file) = queue_file();
        let shown = format!("{file:?}");
        assert!(shown.contains("Interrupt") && shown.contains("spin_waits"), "{shown}");
    }

    fn queue_file() -> (tempfile::TempDir, UringFile) {
        let dir = tempfile::tempdir_in("/dev/shm").expect("temp dir");
        let path = dir.path().join("q");
        std::fs::write(&path, (0..64 * 1024u32).map(|i| (i % 251) as u8).collect::<Vec<_>>())
            .expect("write");
        let file =
            UringFile::open_with(&path, UringMode::Interrupt, false, false, 1).expect("open");
        (dir, file)
    }

    fn read_one(queue: &mut dyn IoQueue, offset: u64) -> Result<IoCompletion> {
        queue.push(IoRequest::read(offset, IoBuf::new(4096), offset)).expect("room");
        let mut out = Vec::new();
        queue.reap(1, &mut out)?;
        Ok(out.pop().expect("one completion"))
    }

    /// A submit with nothing queued makes no system call (the read path submits after every
    /// batch, most of them all hits); one with requests queued enters once, and a poll that
    /// finds nothing still enters, for completion work the ring defers to the thread.
    #[test]
    fn submitting_nothing_enters_no_system_call() {
        let (_dir, file) = queue_file();
        let mut queue = file.open_uring_queue(4).expect("queue");
        for _ in 0..3 {
            assert_eq!(queue.submit().expect("submit"), 0);
        }
        assert_eq!(queue.submit_enters, 0, "an empty submit entered the kernel");
        let done = read_one(&mut queue, 4096).expect("read");
        assert_eq!(done.buf[0], (4096 % 251) as u8);
        let after_read = queue.submit_enters;
        assert_eq!(queue.submit().expect("submit"), 0);
        assert_eq!(queue.submit_enters, after_read, "an empty submit after a read entered");
        let mut out = Vec::new();
        assert_eq!(queue.reap(0, &mut out).expect("poll"), 0);
        assert_eq!(queue.submit_enters, after_read, "a poll with nothing in flight entered");
        queue.push(IoRequest::read(0, IoBuf::new(4096), 1)).expect("room");
        let before = queue.submit_enters;
        queue.submit().expect("submit");
        assert!(queue.submit_enters > before || queue.submit_each, "a queued read was not passed");
        out.clear();
        queue.reap(1, &mut out).expect("reap");
        assert_eq!(out.len(), 1);
    }

    /// A queue may be opened on one thread and driven by another; once driven, it refuses a
    /// second thread with a clear error, and dropping it there neither hangs nor frees buffers
    /// the kernel may still own.
    #[test]
    fn a_queue_belongs_to_the_thread_that_first_drives_it() {
        let (_dir, file) = queue_file();
        let mut queue = file.open_queue(4).expect("queue");
        let mut queue = std::thread::spawn(move || {
            let done = read_one(&mut *queue, 8192).expect("read on the driving thread");
            assert_eq!(done.buf[0], (8192 % 251) as u8);
            queue
        })
        .join()
        .expect("driver");
        let (_, task_run) =
            build_ring(UringMode::Interrupt, 2, None, RingUse::Queue).expect("ring");
        if task_run != TaskRun::Deferred {
            eprintln!("this kernel has no DEFER_TASKRUN: queues are not bound to a thread");
            return;
        }
        let err = read_one(&mut *queue, 0).expect_err("a second thread drove the queue");
        let text = err.to_string();
        assert!(text.contains("thread that first submitted"), "unclear error: {text}");
        assert_eq!(queue.in_flight(), 1, "the refused request is still held");
        drop(queue);
    }

    /// On a file the device completes by interrupt a pushed request is in the kernel before
    /// `submit`; on an always-punted file (tmpfs) it waits for the batch's `submit`.
    #[test]
    fn pushes_enter_the_kernel_at_once_only_on_files_the_device_completes() {
        for (dir, each) in [("/var/tmp", true), ("/dev/shm", false)] {
            let tmp = tempfile::tempdir_in(dir).expect("temp dir");
            let path = tmp.path().join("f");
            std::fs::write(&path, vec![7u8; 8192]).expect("write");
            let file =
                UringFile::open_with(&path, UringMode::Interrupt, false, true, 1).expect("open");
            if file.shared.punted == each {
                eprintln!("{dir}: punted {} (not ext4/tmpfs?): not checked", file.shared.punted);
                continue;
            }
            let mut queue = file.open_queue(4).expect("queue");
            queue.push(IoRequest::read(0, IoBuf::new(4096), 0)).expect("room");
            let passed = queue.submit().expect("submit");
            assert_eq!(passed, usize::from(!each), "{dir}: requests passed by submit");
            let mut out = Vec::new();
            queue.reap(1, &mut out).expect("reap");
            assert_eq!(out[0].buf[0], 7, "{dir}: read back");
            assert!(out[0].result.is_ok(), "{dir}: read failed");
        }
    }
}
