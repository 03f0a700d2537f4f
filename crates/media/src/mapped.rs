//! [`PmemFile`]: a file mapped into the address space as the cache medium, of one of three
//! kinds ([`MediumKind`], decided at open by `crate::kind`).
//!
//! On a DAX file system (or a device-dax node) the mapping is made with
//! `MAP_SHARED_VALIDATE | MAP_SYNC`, so flushed cache lines are durable without msync. A
//! regular file on tmpfs, ramfs or hugetlbfs (`/dev/shm` is how pmcache emulates PM on
//! machines without it) gets a plain `MAP_SHARED` mapping with the same flush and fence
//! instructions: its contents survive a crash of the process (they live in the page cache),
//! not a reboot or power loss. Any other file or device is refused unless msync mode is asked
//! for ([`MediumSync::Msync`]): then every flush also calls `msync(MS_SYNC)` on the pages it
//! covers before it returns, so what is flushed is on the device when the flush returns, and
//! non-temporal stores are not used (they would bypass the flush that syncs them).

use std::fs::{File, OpenOptions};
use std::io;
use std::os::fd::AsRawFd;
use std::path::Path;
use std::ptr::NonNull;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Instant;

use crate::kind::{MediumKind, MediumSync, classify, page_bytes};
use crate::persist::{PersistPrimitives, store_fence};
use crate::{MediaError, Medium, Poisoned, Result, check_bounds};

/// Smallest medium accepted: room for a superblock, one metadata block and one data block.
const MIN_MEDIUM_BYTES: u64 = 3 * 4096;

/// How to open a [`PmemFile`].
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct MediumOptions {
    /// Create the file at this length when it is missing or empty.
    pub create_len_bytes: Option<u64>,
    /// Whether a medium that is neither DAX nor volatile is accepted, `msync`ed at every
    /// flush, or refused (the default).
    pub sync: MediumSync,
}

/// What msync mode has synced so far ([`PmemFile::msync_counts`]).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct MsyncCounts {
    /// `msync` calls made.
    pub calls: u64,
    /// Bytes they covered (whole pages).
    pub synced_bytes: u64,
}

/// A mapped cache medium.
#[derive(Debug)]
pub struct PmemFile {
    base: NonNull<u8>,
    len_bytes: u64,
    primitives: PersistPrimitives,
    kind: MediumKind,
    /// The page size, the unit `msync` works in.
    page_bytes: u64,
    /// `msync` calls and bytes synced (msync mode only).
    msync_calls: AtomicU64,
    msync_bytes: AtomicU64,
    /// Where the medium lives (for messages).
    path: String,
    /// The smallest piece of the mapping a poisoned line's `SIGBUS` replaces (`poison.rs`): a
    /// page, or the mapping's own page size where the kernel cannot split it finer.
    poison_granule_bytes: usize,
    _file: File,
}

// SAFETY: the mapping is plain shared memory; every access goes through raw pointers with
// explicit bounds checks, and concurrent access is the caller's protocol (see `Medium`).
unsafe impl Send for PmemFile {}
// SAFETY: as above; `&PmemFile` only hands out copies and atomic word accesses.
unsafe impl Sync for PmemFile {}

impl PmemFile {
    /// Opens (or, when `create_len_bytes` is given and the file is missing or empty, creates)
    /// the medium at `path` and maps all of it: [`PmemFile::open_with`] with the default
    /// [`MediumSync::Auto`] (DAX or volatile media only).
    pub fn open(path: &Path, create_len_bytes: Option<u64>) -> Result<Self> {
        Self::open_with(path, &MediumOptions { create_len_bytes, sync: MediumSync::Auto })
    }

    /// Opens (or, when `options.create_len_bytes` is given and the file is missing or empty,
    /// creates) the medium at `path` and maps all of it, as DAX if `MAP_SYNC` is accepted,
    /// else as a volatile medium if it is a file on tmpfs, ramfs or hugetlbfs, else in msync
    /// mode if `options.sync` asks for it; otherwise it is refused with
    /// [`MediaError::NotDurable`] (a file this call sized is truncated back to empty).
    pub fn open_with(path: &Path, options: &MediumOptions) -> Result<Self> {
        let create_len_bytes = options.create_len_bytes;
        let err = |action: &'static str| {
            move |source: io::Error| MediaError::Io {
                path: path.display().to_string(),
                action,
                source,
            }
        };
        let file = OpenOptions::new()
            .read(true)
            .write(true)
            .create(create_len_bytes.is_some())
            .truncate(false)
            .open(path)
            .map_err(err("open"))?;
        let mut len_bytes = crate_file_len(&file).map_err(err("stat"))?;
        let sized_here = len_bytes == 0;
        if len_bytes == 0 {
            let Some(create_len) = create_len_bytes else {
                return Err(MediaError::Empty { path: path.display().to_string() });
            };
            file.set_len(create_len).map_err(err("set length"))?;
            len_bytes = create_len;
        }
        if len_bytes < MIN_MEDIUM_BYTES {
            return Err(MediaError::TooSmall {
                path: path.display().to_string(),
                len_bytes,
                min_bytes: MIN_MEDIUM_BYTES,
            });
        }
        let synced = map(&file, len_bytes, true).map_err(err("mmap"))?;
        let kind = match classify(&file, path, synced.is_some(), options.sync) {
            Ok(kind) => kind,
            Err(refused) => {
                if sized_here {
                    let _ = file.set_len(0);
                }
                return Err(refused);
            }
        };
        let base = match synced {
            Some(base) => base,
            None => map(&file, len_bytes, false)
                .map_err(err("mmap"))?
                .expect("a plain shared mapping is never refused as unsupported"),
        };
        let mut medium = Self {
            base,
            len_bytes,
            primitives: PersistPrimitives::detect(),
            kind,
            page_bytes: page_bytes() as u64,
            msync_calls: AtomicU64::new(0),
            msync_bytes: AtomicU64::new(0),
            path: path.display().to_string(),
            poison_granule_bytes: poison_granule(&file),
            _file: file,
        };
        let nontemporal = medium.nontemporal_is_faster();
        medium.use_nontemporal(nontemporal);
        crate::poison::install_handler();
        Ok(medium)
    }

    /// Takes an exclusive advisory lock on the medium's file (`flock`), held until this
    /// medium is dropped: a second process that asks for it (another server started with
    /// another control socket, an offline `detach` beside a live server) is refused at once,
    /// before it could recover or write a medium another engine is serving.
    pub fn lock_exclusive(&self) -> Result<()> {
        // SAFETY: a plain system call on a descriptor this medium owns; it reads no memory of
        // ours.
        let rc = unsafe { libc::flock(self._file.as_raw_fd(), libc::LOCK_EX | libc::LOCK_NB) };
        if rc != 0 {
            let source = io::Error::last_os_error();
            return Err(MediaError::Io {
                path: self.path.clone(),
                action: if source.raw_os_error() == Some(libc::EWOULDBLOCK) {
                    "lock it: another process is using this cache medium"
                } else {
                    "lock it (flock)"
                },
                source,
            });
        }
        Ok(())
    }

    /// Allocates every block of a file medium now (`posix_fallocate`), so that a file system
    /// without room for it (a full `/dev/shm`, a full DAX file system) fails here with a clear
    /// error: a sparse medium's first store into a hole the file system cannot fill raises
    /// SIGBUS instead, killing the process mid-run. Blocks already allocated keep their
    /// contents. A device node (device-dax) has all its space: nothing to do.
    pub fn reserve(&self) -> Result<()> {
        if !self._file.metadata().map(|m| m.is_file()).unwrap_or(false) {
            return Ok(());
        }
        let len = libc::off_t::try_from(self.len_bytes).unwrap_or(libc::off_t::MAX);
        // SAFETY: a plain system call on a descriptor this medium owns; it reads no memory of
        // ours.
        let rc = unsafe { libc::posix_fallocate(self._file.as_raw_fd(), 0, len) };
        if rc != 0 {
            return Err(MediaError::Io {
                path: self.path.clone(),
                action: "reserve its space (posix_fallocate)",
                source: io::Error::from_raw_os_error(rc),
            });
        }
        Ok(())
    }

    /// The NUMA node this medium says it is on, and what says so (its device, its tmpfs
    /// mount's policy); `None` where nothing does (see [`crate::numa`]).
    pub fn declared_node(&self) -> Option<(u32, crate::numa::NodeSource)> {
        crate::numa::node_of_file(&self._file)
    }

    /// Where its pages are: `samples` pages spread over the mapping, counted by the node each
    /// is on (a page not yet in memory is brought in, as a read would).
    pub fn page_nodes(&self, samples: u64) -> Vec<(u32, u64)> {
        crate::numa::sample_page_nodes(self.base.as_ptr() as usize, self.len_bytes, samples)
    }

    /// Whether the mapping is synchronous (DAX): flushed lines are durable across power loss.
    pub fn is_dax(&self) -> bool {
        self.kind == MediumKind::Dax
    }

    /// What this medium promises: DAX, volatile, or durable by msync.
    pub fn kind(&self) -> MediumKind {
        self.kind
    }

    /// The `msync` calls made so far and the bytes they covered (zero unless
    /// [`MediumKind::Msync`]).
    pub fn msync_counts(&self) -> MsyncCounts {
        MsyncCounts {
            calls: self.msync_calls.load(Ordering::Relaxed),
            synced_bytes: self.msync_bytes.load(Ordering::Relaxed),
        }
    }

    /// How much of the mapping a poisoned line takes with it: the piece a `SIGBUS` under a
    /// checked read replaces with zeroed private memory, whose stores then never reach the
    /// medium (see [`Medium::poisoned_ranges`]). The page size, or a device-dax mapping's
    /// alignment (2 MiB or 1 GiB), or a hugetlbfs file's huge page size: the kernel does not
    /// split those mappings finer.
    pub fn poison_granule_bytes(&self) -> u64 {
        self.poison_granule_bytes as u64
    }

    /// In msync mode, writes the pages covering `offset..offset + len` to the device and waits
    /// (`msync(MS_SYNC)`); elsewhere nothing. A failure is fail-stop: the process aborts, since
    /// a flush cannot report it and the engine would otherwise acknowledge a write that is not
    /// durable (the next start recovers from what reached the device).
    fn sync_pages(&self, offset: u64, len: u64) {
        if self.kind != MediumKind::Msync || len == 0 {
            return;
        }
        let start = offset - offset % self.page_bytes;
        let end = (offset + len).div_ceil(self.page_bytes) * self.page_bytes;
        // The stores and write-backs before it are ordered before the sync reads the pages.
        store_fence();
        // SAFETY: `start` is page aligned and inside the mapping (`offset` was bounds checked by
        // the caller); the span ends within the mapping's last page, which the kernel rounds
        // the mapping up to. msync reads no memory of ours.
        let rc = unsafe {
            libc::msync(
                self.base.as_ptr().add(start as usize) as *mut libc::c_void,
                (end - start) as usize,
                libc::MS_SYNC,
            )
        };
        if rc != 0 {
            let error = io::Error::last_os_error();
            eprintln!(
                "pmcache: cache medium {}: msync of {} bytes at {start} failed: {error}; \
                 stopping at once (the write being persisted may not be durable; the next start \
                 recovers from what reached the device)",
                self.path,
                end - start
            );
            std::process::abort();
        }
        self.msync_calls.fetch_add(1, Ordering::Relaxed);
        self.msync_bytes.fetch_add(end - start, Ordering::Relaxed);
    }

    /// The persistence primitives in use.
    pub fn primitives(&self) -> PersistPrimitives {
        self.primitives
    }

    /// Turns non-temporal block copies and entry stores on or off, in place of the choice made
    /// at open: for a comparison that must run the same instructions on two media (`pmcache
    /// bench core`'s floor beside the engine's medium), or a test of either choice. The flush
    /// instruction stays the one detected, and on DAX entries stay stored and flushed.
    /// In msync mode they stay off: every write reaches the medium through a flush, which
    /// syncs it.
    pub fn use_nontemporal(&mut self, on: bool) {
        self.primitives.set_nontemporal(on && self.kind != MediumKind::Msync);
        if self.kind == MediumKind::Dax {
            // Real PM: 16-byte entries as PMDK writes anything below its non-temporal threshold
            // (256 bytes), with stores and a flush. Non-temporal entries were measured faster
            // only on DRAM (docs/PERFORMANCE.md, `bench core`); partial-line non-temporal writes
            // cost Optane a read-modify-write of its 256-byte lines.
            self.primitives.nt_pair_store = false;
        }
    }

    fn ptr(&self, offset: u64, len: u64) -> *mut u8 {
        check_bounds(offset, len, self.len_bytes);
        // SAFETY: `offset + len <= len_bytes`, so the result stays inside the mapping.
        unsafe { self.base.as_ptr().add(offset as usize) }
    }

    /// [`Medium::store_pair`]: one alignment and one bounds check for both words. Returns the
    /// pair's address (checked to lie inside the mapping) for a flush.
    #[inline]
    fn store_pair_at(&self, offset: u64, word0: u64, word1: u64) -> *const u8 {
        assert!(offset.is_multiple_of(16), "unaligned pair store at {offset}");
        let start = self.ptr(offset, 16);
        let words = start as *const AtomicU64;
        // SAFETY: 16-byte aligned (the mapping is page aligned) and in bounds, so both words
        // are; only ever accessed atomically by the engine's metadata code (as in `load_u64`).
        unsafe {
            (*words.add(1)).store(word1, Ordering::Release);
            (*words).store(word0, Ordering::Release);
        }
        start
    }

    /// Whether whole-block copies should use non-temporal stores. On DAX (real PM) they do, as
    /// PMDK's do for large copies. Otherwise (DRAM emulation) copy+flush+fence and
    /// non-temporal copy+fence are timed on a private anonymous mapping — never on the medium,
    /// whose contents must not change just because it was opened.
    fn nontemporal_is_faster(&self) -> bool {
        match self.kind {
            MediumKind::Dax => return true,
            MediumKind::Msync => return false,
            MediumKind::Volatile => {}
        }
        const BLOCK: usize = 4096;
        const BLOCKS: usize = 16;
        const ROUNDS: usize = 64;
        let Ok(scratch) = Scratch::new(BLOCK * BLOCKS) else {
            return false;
        };
        let src = vec![0x5au8; BLOCK];
        let time = |nontemporal: bool| {
            let start = Instant::now();
            for round in 0..ROUNDS {
                let dst = scratch.block(round % BLOCKS, BLOCK);
                if nontemporal {
                    // SAFETY: `dst` is page-aligned and valid for BLOCK bytes of the scratch map.
                    unsafe { PersistPrimitives::copy_nontemporal(dst, &src) };
                } else {
                    // SAFETY: `dst` is valid for BLOCK bytes and does not overlap `src`.
                    unsafe {
                        std::ptr::copy_nonoverlapping(src.as_ptr(), dst, BLOCK);
                        self.primitives.flush_range(dst, BLOCK);
                    }
                }
                store_fence();
            }
            start.elapsed()
        };
        let mut cached = Vec::new();
        let mut nontemporal = Vec::new();
        for _ in 0..5 {
            cached.push(time(false));
            nontemporal.push(time(true));
        }
        cached.sort();
        nontemporal.sort();
        nontemporal[2] < cached[2]
    }
}

/// A private anonymous mapping used for calibration.
struct Scratch {
    base: NonNull<u8>,
    len: usize,
}

impl Scratch {
    fn new(len: usize) -> io::Result<Self> {
        let prot = libc::PROT_READ | libc::PROT_WRITE;
        let flags = libc::MAP_PRIVATE | libc::MAP_ANONYMOUS;
        // SAFETY: a fresh anonymous mapping at an address of the kernel's choosing.
        let addr = unsafe { libc::mmap(std::ptr::null_mut(), len, prot, flags, -1, 0) };
        if addr == libc::MAP_FAILED {
            return Err(io::Error::last_os_error());
        }
        Ok(Self { base: NonNull::new(addr as *mut u8).expect("mmap returned null"), len })
    }

    fn block(&self, index: usize, block_len: usize) -> *mut u8 {
        assert!((index + 1) * block_len <= self.len, "scratch block out of range");
        // SAFETY: in bounds (asserted above).
        unsafe { self.base.as_ptr().add(index * block_len) }
    }
}

impl Drop for Scratch {
    fn drop(&mut self) {
        // SAFETY: unmaps exactly the mapping made in `new`, once.
        unsafe { libc::munmap(self.base.as_ptr() as *mut libc::c_void, self.len) };
    }
}

/// The medium's length: a regular file's size; a device-dax node's from sysfs (it has no
/// size a seek can find: `/sys/dev/char/MAJ:MIN/size`, rounded down to its mapping alignment,
/// `align`, which every mapping of it must be a multiple of); another device's by a seek to
/// its end.
fn crate_file_len(file: &File) -> io::Result<u64> {
    use std::io::{Seek, SeekFrom};
    use std::os::unix::fs::{FileTypeExt, MetadataExt};
    let meta = file.metadata()?;
    if meta.is_file() {
        return Ok(meta.len());
    }
    if meta.file_type().is_char_device() {
        let (major, minor) = (libc::major(meta.rdev()), libc::minor(meta.rdev()));
        let sys = std::path::PathBuf::from(format!("/sys/dev/char/{major}:{minor}"));
        return char_device_len(&sys);
    }
    let mut handle = file;
    let len = handle.seek(SeekFrom::End(0))?;
    handle.seek(SeekFrom::Start(0))?;
    Ok(len)
}

/// The usable length of the character device whose sysfs directory is `sys`: its `size`,
/// rounded down to a multiple of its `align` (device-dax; 1 where there is none). A device
/// without a `size` (not a device-dax) has no length.
fn char_device_len(sys: &Path) -> io::Result<u64> {
    let read = |name: &str| sysfs_number(sys, name);
    let Some(size) = read("size")? else {
        return Err(io::Error::new(
            io::ErrorKind::Unsupported,
            format!(
                "a character device without a size in sysfs ({}): not a device-dax",
                sys.display()
            ),
        ));
    };
    let align = read("align")?.filter(|&a| a > 0).unwrap_or(1);
    Ok(size / align * align)
}

/// The number in the sysfs file `name` of the directory `sys`, `None` if there is no such file.
fn sysfs_number(sys: &Path, name: &str) -> io::Result<Option<u64>> {
    match std::fs::read_to_string(sys.join(name)) {
        Ok(text) => text.trim().parse().map(Some).map_err(|_| {
            io::Error::new(
                io::ErrorKind::InvalidData,
                format!("{}/{name}: {:?} is not a number", sys.display(), text.trim()),
            )
        }),
        Err(e) if e.kind() == io::ErrorKind::NotFound => Ok(None),
        Err(e) => Err(e),
    }
}

/// `f_type` of hugetlbfs.
const HUGETLBFS_MAGIC: u64 = 0x9584_58f6;

/// The replacement granule of a mapping of `file` ([`PmemFile::poison_granule_bytes`]): what
/// [`poison_granule_for`] decides from the device-dax alignment in sysfs (a character device)
/// and the huge page size of a hugetlbfs file (`fstatfs`'s block size there). Whatever cannot
/// be read counts as absent.
fn poison_granule(file: &File) -> usize {
    use std::os::unix::fs::{FileTypeExt, MetadataExt};
    let page = crate::poison::system_page_bytes();
    let Ok(meta) = file.metadata() else { return page };
    let device_align = meta.file_type().is_char_device().then(|| {
        let (major, minor) = (libc::major(meta.rdev()), libc::minor(meta.rdev()));
        let sys = std::path::PathBuf::from(format!("/sys/dev/char/{major}:{minor}"));
        sysfs_number(&sys, "align").ok().flatten()
    });
    // SAFETY: `statfs` is plain old data; all zeroes is a valid value to be overwritten.
    let mut stat: libc::statfs = unsafe { std::mem::zeroed() };
    // SAFETY: a plain system call on an open descriptor, writing into `stat`, which lives for
    // the call.
    let statted = unsafe { libc::fstatfs(file.as_raw_fd(), &mut stat) } == 0;
    let huge_page = (statted && (stat.f_type as u64) & 0xffff_ffff == HUGETLBFS_MAGIC)
        .then_some(stat.f_bsize as u64);
    poison_granule_for(page, device_align.flatten(), huge_page)
}

/// The replacement granule for a mapping on a system of `page`-byte pages: the largest of the
/// page, a device-dax mapping's `device_align` and a hugetlbfs file's `huge_page` (each only
/// if a power of two: anything else is not a page size and is not trusted). A device-dax
/// mapping of 2 MiB alignment refuses to be split anywhere else (`dev_dax_may_split`), and a
/// hugetlbfs one at anything finer than its huge page: replacing one page there fails, which
/// would end the process, so the whole aligned granule is replaced.
pub(crate) fn poison_granule_for(
    page: usize,
    device_align: Option<u64>,
    huge_page: Option<u64>,
) -> usize {
    [device_align, huge_page]
        .into_iter()
        .flatten()
        .filter(|bytes| bytes.is_power_of_two() && *bytes <= 1 << 40)
        .fold(page, |granule, bytes| granule.max(bytes as usize))
}

/// Maps `len` bytes of `file`: synchronously (`MAP_SYNC`) if `sync`, which only DAX accepts
/// (`None` elsewhere), else with a plain `MAP_SHARED`.
fn map(file: &File, len: u64, sync: bool) -> io::Result<Option<NonNull<u8>>> {
    let fd = file.as_raw_fd();
    let prot = libc::PROT_READ | libc::PROT_WRITE;
    let len = usize::try_from(len).map_err(|_| io::Error::from_raw_os_error(libc::EFBIG))?;
    let flags = if sync { libc::MAP_SHARED_VALIDATE | libc::MAP_SYNC } else { libc::MAP_SHARED };
    // SAFETY: a fresh mapping at an address of the kernel's choosing; `fd` is open and owned
    // by `file`, which the returned `PmemFile` keeps alive as long as the mapping.
    let addr = unsafe { libc::mmap(std::ptr::null_mut(), len, prot, flags, fd, 0) };
    if addr != libc::MAP_FAILED {
        return Ok(Some(NonNull::new(addr as *mut u8).expect("mmap returned null")));
    }
    let error = io::Error::last_os_error();
    // MAP_SYNC on a non-DAX file fails with EOPNOTSUPP (or EINVAL on older kernels).
    let unsupported = matches!(error.raw_os_error(), Some(libc::EOPNOTSUPP | libc::EINVAL));
    if sync && unsupported { Ok(None) } else { Err(error) }
}

impl Drop for PmemFile {
    fn drop(&mut self) {
        let base = self.base.as_ptr() as usize;
        crate::poison::forget(base..base + self.len_bytes as usize);
        // SAFETY: `base` and `len_bytes` describe the mapping made in `open`, unmapped once here.
        unsafe { libc::munmap(self.base.as_ptr() as *mut libc::c_void, self.len_bytes as usize) };
    }
}

impl Medium for PmemFile {
    fn len_bytes(&self) -> u64 {
        self.len_bytes
    }

    fn read(&self, offset: u64, buf: &mut [u8]) {
        let src = self.ptr(offset, buf.len() as u64);
        // SAFETY: `src` is valid for `buf.len()` bytes (bounds checked) and cannot overlap the
        // caller's buffer. Another thread may be writing these bytes concurrently (a lock-free
        // reader copying a slot that is being refilled). That is a data race by Rust's memory
        // model, the one every seqlock's reader runs (per-byte atomic copies, RFC 3301, are not
        // stable); on the hardware it yields some mix of old and new bytes, and the engine's
        // read path discards such a copy: it trusts a copy only once it has validated the
        // slot's generation after it.
        unsafe { std::ptr::copy_nonoverlapping(src, buf.as_mut_ptr(), buf.len()) };
    }

    fn read_checked(&self, offset: u64, buf: &mut [u8]) -> std::result::Result<(), Poisoned> {
        let src = self.ptr(offset, buf.len() as u64);
        let guard = crate::poison::Guard {
            start: 0,
            len: 0,
            map_start: self.base.as_ptr() as usize,
            map_len: self.len_bytes as usize,
            granule: self.poison_granule_bytes,
        };
        // SAFETY: as in `read`: `src` is valid for `buf.len()` bytes of this shared file
        // mapping, which `guard` names, and does not overlap `buf`.
        match unsafe { crate::poison::guarded_copy(src, buf.as_mut_ptr(), buf.len(), guard) } {
            None => Ok(()),
            Some(address) => {
                Err(Poisoned { offset: (address - self.base.as_ptr() as usize) as u64 })
            }
        }
    }

    fn losses(&self) -> u64 {
        crate::poison::losses()
    }
    fn poisoned_ranges(&self) -> Vec<std::ops::Range<u64>> {
        let base = self.base.as_ptr() as usize;
        crate::poison::poisoned_in(base..base + self.len_bytes as usize)
            .map(|granule| {
                let start = (granule.start - base) as u64;
                start..(granule.end - base) as u64
            })
            .collect()
    }

    fn write(&self, offset: u64, data: &[u8]) {
        let dst = self.ptr(offset, data.len() as u64);
        // SAFETY: `dst` is valid for `data.len()` bytes and does not overlap `data`.
        unsafe { std::ptr::copy_nonoverlapping(data.as_ptr(), dst, data.len()) };
    }

    fn load_u64(&self, offset: u64) -> u64 {
        assert!(offset.is_multiple_of(8), "unaligned word load at {offset}");
        let ptr = self.ptr(offset, 8) as *const AtomicU64;
        // SAFETY: 8-byte aligned (mapping is page aligned) and in bounds. The words accessed
        // this way (header words, metadata entries) are copied with `read`/`write` only where
        // no other thread accesses them: by format before any lane exists, and in tests.
        unsafe { (*ptr).load(Ordering::Acquire) }
    }

    fn store_u64(&self, offset: u64, value: u64) {
        assert!(offset.is_multiple_of(8), "unaligned word store at {offset}");
        let ptr = self.ptr(offset, 8) as *const AtomicU64;
        // SAFETY: as in `load_u64`.
        unsafe { (*ptr).store(value, Ordering::Release) }
    }

    fn compare_exchange_u64(&self, offset: u64, current: u64, new: u64) -> bool {
        assert!(offset.is_multiple_of(8), "unaligned word exchange at {offset}");
        let ptr = self.ptr(offset, 8) as *const AtomicU64;
        // SAFETY: as in `load_u64`.
        unsafe {
            (*ptr).compare_exchange(current, new, Ordering::AcqRel, Ordering::Acquire).is_ok()
        }
    }

    fn flush(&self, offset: u64, len: u64) {
        let start = self.ptr(offset, len);
        // SAFETY: the range is inside the mapping (bounds checked by `ptr`).
        unsafe { self.primitives.flush_range(start, len as usize) };
        self.sync_pages(offset, len);
    }

    fn drain(&self) {
        store_fence();
    }

    fn prefetch(&self, offset: u64, len: u64) {
        /// Lines hinted: enough for the hardware prefetcher to take over the stream.
        const LINES_MAX: u64 = 2;
        let start = self.ptr(offset, len);
        for line in 0..len.div_ceil(crate::CACHE_LINE_BYTES).min(LINES_MAX) {
            crate::prefetch(start.wrapping_add((line * crate::CACHE_LINE_BYTES) as usize));
        }
    }

    fn prefetch_pair_store(&self, offset: u64) {
        // A non-temporal store needs no copy of the line; one in the cache it must evict.
        if !self.primitives.nt_pair_store {
            self.prefetch(offset, 16);
        }
    }

    #[inline]
    fn store_pair(&self, offset: u64, word0: u64, word1: u64) {
        self.store_pair_at(offset, word0, word1);
    }

    #[inline]
    fn store_pair_flush(&self, offset: u64, word0: u64, word1: u64) {
        #[cfg(target_arch = "x86_64")]
        if self.primitives.nt_pair_store {
            let start = self.ptr(offset, 16);
            // SAFETY: 16-byte aligned (the mapping is page aligned) and in bounds (checked by
            // `ptr`). The `Medium` contract makes the caller drain before publishing the pair;
            // other threads read entry words only with `load_u64`, validating what they read.
            unsafe { PersistPrimitives::store_pair_nontemporal(start, word0, word1) };
            return;
        }
        let start = self.store_pair_at(offset, word0, word1);
        // SAFETY: `store_pair_at` checked that `start..start + 16` lies inside the mapping.
        unsafe { self.primitives.flush_range(start, 16) };
        self.sync_pages(offset, 16);
    }

    fn write_flush(&self, offset: u64, data: &[u8]) {
        let dst = self.ptr(offset, data.len() as u64);
        let whole_lines = (dst as usize).is_multiple_of(64) && data.len().is_multiple_of(64);
        if self.primitives.nt_block_copy && whole_lines {
            // SAFETY: `dst` is valid for `data.len()` bytes, 64-byte aligned, length a multiple
            // of 16. Non-temporal stores bypass the cache, so the next fence makes them durable;
            // the caller does not access these bytes before that fence (the `Medium` contract:
            // the engine copies, then fences), and other threads' reads of them are the racing
            // reads described in `read`.
            unsafe { PersistPrimitives::copy_nontemporal(dst, data) };
        } else {
            self.write(offset, data);
            self.flush(offset, data.len() as u64);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A directory on tmpfs, where a medium is volatile.
    fn shm_dir() -> tempfile::TempDir {
        tempfile::tempdir_in("/dev/shm").expect("a directory in /dev/shm")
    }

    /// A directory on the file system the tests are built on (a disk: ext4 here), asserted not
    /// to be volatile: where a medium is refused without msync mode.
    fn disk_dir() -> tempfile::TempDir {
        let exe = std::env::current_exe().expect("the test binary's path");
        let dir = tempfile::tempdir_in(exe.parent().expect("its directory")).expect("a disk dir");
        let fs = crate::FileSystem::of_path(dir.path()).expect("fstatfs");
        assert!(!fs.is_volatile(), "the build directory is on {}: no disk here", fs.name);
        dir
    }

    /// Kilobytes of the mapping at `base` that `/proc/self/smaps` reports dirty (in the page
    /// tables or the page cache): what an msync writes back and cleans.
    fn dirty_kib(base: *const u8) -> u64 {
        let smaps = std::fs::read_to_string("/proc/self/smaps").expect("smaps");
        let start = format!("{:x}-", base as usize);
        let mut lines = smaps.lines().skip_while(|line| !line.starts_with(&start));
        assert!(lines.next().is_some(), "no mapping at {base:p} in smaps");
        lines
            .take_while(|line| line.split_whitespace().next().is_some_and(|key| key.ends_with(':')))
            .filter(|line| line.starts_with("Shared_Dirty:") || line.starts_with("Private_Dirty:"))
            .map(|line| line.split_whitespace().nth(1).unwrap().parse::<u64>().unwrap())
            .sum()
    }

    /// A file on a disk file system is refused with a message naming the file, its file
    /// system and the way out, and the file it created is left empty; in msync mode it opens
    /// as `msync`. A file on tmpfs is volatile whatever was asked.
    #[test]
    fn a_disk_file_is_refused_unless_msync_is_asked_for() {
        let dir = disk_dir();
        let path = dir.path().join("pm");
        let err = PmemFile::open(&path, Some(1 << 20)).unwrap_err();
        let fs = crate::FileSystem::of_path(dir.path()).unwrap();
        let text = err.to_string();
        assert!(matches!(err, MediaError::NotDurable { .. }), "{text}");
        assert!(text.contains(&path.display().to_string()), "{text}");
        assert!(text.contains(&format!("a file on {}", fs.name)), "{text}");
        assert!(text.contains("--medium-sync msync") && text.contains("/dev/shm"), "{text}");
        assert_eq!(std::fs::metadata(&path).unwrap().len(), 0, "the refused file was sized");
        let options = MediumOptions { create_len_bytes: Some(1 << 20), sync: MediumSync::Msync };
        let medium = PmemFile::open_with(&path, &options).unwrap();
        assert_eq!(medium.kind(), MediumKind::Msync);
        assert!(!medium.primitives().nt_block_copy && !medium.primitives().nt_pair_store);
        assert_eq!(crate::probe_kind(&path, MediumSync::Msync).unwrap(), MediumKind::Msync);
        assert!(crate::probe_kind(&path, MediumSync::Auto).is_err());

        let shm = shm_dir();
        let medium = PmemFile::open_with(&shm.path().join("pm"), &options).unwrap();
        assert_eq!(medium.kind(), MediumKind::Volatile);
        medium.write_persist(4096, &[1; 4096]);
        assert_eq!(medium.msync_counts(), MsyncCounts::default(), "a volatile medium msynced");
    }

    /// In msync mode every flush syncs the whole pages it covers and leaves none of them
    /// dirty (smaps: the kernel wrote them back); a store not yet flushed stays dirty. Entry
    /// pairs, unaligned spans across a page boundary and whole blocks alike.
    #[test]
    fn msync_mode_syncs_every_page_a_flush_covers() {
        let dir = disk_dir();
        let options = MediumOptions { create_len_bytes: Some(1 << 20), sync: MediumSync::Msync };
        let medium = PmemFile::open_with(&dir.path().join("pm"), &options).unwrap();
        let base = medium.base.as_ptr();
        let page = medium.page_bytes;
        medium.write(2 * page, &[1; 4096]);
        assert!(dirty_kib(base) >= 4, "a stored page is not dirty: no observable");
        assert_eq!(medium.msync_counts(), MsyncCounts::default());
        medium.flush(2 * page, 4096);
        assert_eq!(dirty_kib(base), 0, "a flushed page left dirty");
        assert_eq!(medium.msync_counts(), MsyncCounts { calls: 1, synced_bytes: page });

        // 5000 bytes from 100 bytes into page 5: pages 5 and 6.
        medium.write(5 * page + 100, &[2; 5000]);
        medium.persist(5 * page + 100, 5000);
        assert_eq!(dirty_kib(base), 0);
        assert_eq!(medium.msync_counts(), MsyncCounts { calls: 2, synced_bytes: 3 * page });

        medium.store_pair_flush(9 * page + 32, 0x11, 0x22);
        medium.drain();
        medium.write_persist(12 * page, &[3; 4096]);
        assert_eq!(dirty_kib(base), 0);
        assert_eq!(medium.msync_counts(), MsyncCounts { calls: 4, synced_bytes: 5 * page });
        let file = std::fs::read(dir.path().join("pm")).unwrap();
        let at = |offset: u64, len: usize| &file[offset as usize..offset as usize + len];
        assert!(at(5 * page + 100, 5000).iter().all(|&b| b == 2));
        assert_eq!(at(9 * page + 32, 16), [0x11, 0, 0, 0, 0, 0, 0, 0, 0x22, 0, 0, 0, 0, 0, 0, 0]);
    }

    #[test]
    fn round_trips_and_survives_reopen() {
        let dir = shm_dir();
        let path = dir.path().join("pm");
        let medium = PmemFile::open(&path, Some(1 << 20)).unwrap();
        assert_eq!(medium.len_bytes(), 1 << 20);
        medium.write_persist(4096, &[7u8; 4096]);
        medium.store_u64(64, 0xdead_beef);
        medium.persist(64, 8);
        drop(medium);
        let medium = PmemFile::open(&path, None).unwrap();
        let mut buf = [0u8; 4096];
        medium.read(4096, &mut buf);
        assert_eq!(buf, [7u8; 4096]);
        assert_eq!(medium.load_u64(64), 0xdead_beef);
    }

    /// One holder at a time: a second open of the same file cannot take the lock while the
    /// first holds it, and can once the first is dropped.
    #[test]
    fn the_exclusive_lock_has_one_holder() {
        let dir = shm_dir();
        let path = dir.path().join("pm");
        let first = PmemFile::open(&path, Some(1 << 20)).unwrap();
        first.lock_exclusive().unwrap();
        let second = PmemFile::open(&path, None).unwrap();
        let err = second.lock_exclusive().unwrap_err().to_string();
        assert!(err.contains("another process is using this cache medium"), "{err}");
        drop(first);
        second.lock_exclusive().unwrap();
    }

    /// A created medium is sparse; reserving allocates all of it and keeps what was written.
    #[test]
    fn reserving_allocates_every_block_and_keeps_the_contents() {
        use std::os::unix::fs::MetadataExt;
        let dir = shm_dir();
        let path = dir.path().join("pm");
        let len = 16u64 << 20;
        let medium = PmemFile::open(&path, Some(len)).unwrap();
        medium.write_persist(8192, &[9u8; 4096]);
        let allocated = || std::fs::metadata(&path).unwrap().blocks() * 512;
        assert!(allocated() < len / 2, "a created medium is sparse: {} bytes", allocated());
        medium.reserve().unwrap();
        assert!(allocated() >= len, "{} of {len} bytes allocated", allocated());
        let mut buf = [0u8; 4096];
        medium.read(8192, &mut buf);
        assert_eq!(buf, [9u8; 4096]);
        medium.read(len - 4096, &mut buf);
        assert_eq!(buf, [0u8; 4096]);
    }

    #[test]
    fn a_device_dax_length_comes_from_sysfs_rounded_to_its_alignment() {
        let dir = tempfile::tempdir().unwrap();
        let sys = dir.path();
        assert_eq!(
            char_device_len(sys).unwrap_err().kind(),
            io::ErrorKind::Unsupported,
            "no size: not a device-dax"
        );
        std::fs::write(sys.join("size"), "262144000\n").unwrap();
        assert_eq!(char_device_len(sys).unwrap(), 262_144_000, "no align file: the size");
        std::fs::write(sys.join("align"), "2097152\n").unwrap();
        assert_eq!(char_device_len(sys).unwrap(), 262_144_000, "a multiple of 2 MiB");
        std::fs::write(sys.join("size"), "263000000\n").unwrap();
        assert_eq!(char_device_len(sys).unwrap(), 262_144_000, "rounded down to 2 MiB");
        std::fs::write(sys.join("size"), "lots\n").unwrap();
        assert!(char_device_len(sys).unwrap_err().to_string().contains("not a number"));
    }

    /// The replacement granule: the page, unless the mapping cannot be split that finely — a
    /// device-dax node's alignment (2 MiB, 1 GiB) or a hugetlbfs file's huge page; a size
    /// that is not a power of two (an unreadable or odd sysfs value) is not trusted.
    #[test]
    fn the_poison_granule_is_the_page_or_the_mappings_own_page_size() {
        const MIB: u64 = 1 << 20;
        assert_eq!(poison_granule_for(4096, None, None), 4096);
        assert_eq!(poison_granule_for(4096, Some(4096), None), 4096, "devdax of 4 KiB align");
        assert_eq!(poison_granule_for(4096, Some(2 * MIB), None), 2 << 20, "devdax, 2 MiB");
        assert_eq!(poison_granule_for(4096, Some(1 << 30), None), 1 << 30, "devdax, 1 GiB");
        assert_eq!(poison_granule_for(4096, None, Some(2 * MIB)), 2 << 20, "hugetlbfs");
        assert_eq!(poison_granule_for(4096, Some(3 * MIB), None), 4096, "not a page size");
        assert_eq!(poison_granule_for(65536, Some(4096), None), 65536, "never below a page");
        // A file in /dev/shm: the page.
        let dir = shm_dir();
        let medium = PmemFile::open(&dir.path().join("pm"), Some(1 << 20)).unwrap();
        assert_eq!(medium.poison_granule_bytes(), crate::poison::system_page_bytes() as u64);
    }

    /// A mapping whose granule is 2 MiB (as a device-dax node of 2 MiB alignment): a fault
    /// under a checked read replaces the whole granule around it, cut to the mapping — every
    /// page of it then reads as zeroes without a fault, and the medium lists it as one range.
    #[test]
    fn a_fault_replaces_the_whole_granule_of_a_mapping_of_large_pages() {
        const MIB: u64 = 1 << 20;
        let dir = shm_dir();
        let path = dir.path().join("pm");
        let mut medium = PmemFile::open(&path, Some(8 * MIB)).unwrap();
        medium.poison_granule_bytes = 2 << 20;
        medium.write_persist(MIB, &[7u8; 4096]);
        std::fs::OpenOptions::new().write(true).open(&path).unwrap().set_len(3 * MIB).unwrap();
        let mut buf = [0u8; 64];
        let err = medium.read_checked(5 * MIB + 64, &mut buf).expect_err("past the file");
        assert_eq!(err.offset, 5 * MIB + 64);
        let base = medium.base.as_ptr() as u64;
        let granule_start = (base + 5 * MIB) & !(2 * MIB - 1);
        let expected =
            granule_start.max(base) - base..(granule_start + 2 * MIB - base).min(8 * MIB);
        assert_eq!(medium.poisoned_ranges(), vec![expected.clone()]);
        // Every page of the granule was replaced: plain reads there no longer fault.
        for page in (expected.start..expected.end).step_by(4096) {
            medium.read(page, &mut buf);
            assert_eq!(buf, [0u8; 64], "page at {page}");
        }
        // The page before the cut is outside the granule (when the mapping is aligned) and
        // still the file's.
        if base.is_multiple_of(2 * MIB) {
            medium.read_checked(MIB, &mut buf).expect("a page the file has");
            assert_eq!(buf, [7u8; 64]);
        }
    }

    #[test]
    fn opening_a_medium_changes_none_of_its_bytes() {
        let dir = shm_dir();
        let path = dir.path().join("pm");
        let contents: Vec<u8> =
            (0..(1u32 << 18)).map(|i| (i.wrapping_mul(2_654_435_761) >> 13) as u8).collect();
        std::fs::write(&path, &contents).unwrap();
        let medium = PmemFile::open(&path, None).unwrap();
        drop(medium);
        assert!(std::fs::read(&path).unwrap() == contents, "open() modified the medium");
    }

    #[test]
    fn refuses_missing_empty_and_tiny_files() {
        let dir = shm_dir();
        let missing = PmemFile::open(&dir.path().join("nope"), None).unwrap_err();
        assert!(matches!(missing, MediaError::Io { action: "open", .. }), "{missing}");
        let empty = dir.path().join("empty");
        File::create(&empty).unwrap();
        assert!(matches!(PmemFile::open(&empty, None), Err(MediaError::Empty { .. })));
        let tiny = dir.path().join("tiny");
        File::create(&tiny).unwrap().set_len(100).unwrap();
        let err = PmemFile::open(&tiny, None).unwrap_err();
        assert!(err.to_string().contains("100 bytes"), "{err}");
    }

    /// A medium of exactly the minimum size opens; one byte less is refused. A file in
    /// /dev/shm (tmpfs) is not DAX: mapped without MAP_SYNC, and said so.
    #[test]
    fn the_minimum_size_opens_and_tmpfs_is_not_dax() {
        let dir = shm_dir();
        // A superblock page, a metadata page and a data block.
        let min_bytes = 3 * 4096;
        let medium = PmemFile::open(&dir.path().join("min"), Some(min_bytes)).unwrap();
        assert_eq!(medium.len_bytes(), min_bytes);
        assert!(!medium.is_dax(), "a tmpfs file taken for DAX");
        let short = dir.path().join("short");
        File::create(&short).unwrap().set_len(min_bytes - 1).unwrap();
        let err = PmemFile::open(&short, None).unwrap_err();
        assert!(matches!(err, MediaError::TooSmall { .. }), "{err}");
        assert_eq!(err.errno(), libc::EINVAL);
    }

    /// `write_flush` copies exactly what it is given whichever way it copies: non-temporal
    /// stores for whole, line-aligned lines, plain stores and flushes for anything else (an
    /// unaligned start, a length not a multiple of a line), with non-temporal copies forced on
    /// and off.
    #[test]
    fn write_flush_copies_every_alignment_with_and_without_nontemporal_stores() {
        let dir = shm_dir();
        let mut medium = PmemFile::open(&dir.path().join("pm"), Some(1 << 16)).unwrap();
        for nontemporal in [true, false] {
            medium.primitives.set_nontemporal(nontemporal);
            let cases = [(4096u64, 4096usize), (8192 + 8, 64), (8192 + 16, 64), (12288, 100)];
            for (round, (offset, len)) in cases.into_iter().enumerate() {
                let data: Vec<u8> = (0..len).map(|i| (i + round * 31) as u8 ^ 0x5a).collect();
                medium.write(offset - 8, &[0xee; 8]);
                medium.write(offset + len as u64, &[0xee; 8]);
                medium.write_flush(offset, &data);
                medium.drain();
                let mut back = vec![0u8; len + 16];
                medium.read(offset - 8, &mut back);
                assert_eq!(back[8..len + 8], data[..], "{len} at {offset}, nt {nontemporal}");
                assert_eq!((&back[..8], &back[len + 8..]), (&[0xee; 8][..], &[0xee; 8][..]));
            }
        }
    }

    /// With non-temporal entry stores forced on and off: both words land where they belong,
    /// the neighbours in their line keep theirs, and a reopened mapping reads them back.
    #[test]
    fn a_pair_store_writes_both_words_and_survives_reopen() {
        for nontemporal in [true, false] {
            let dir = shm_dir();
            let path = dir.path().join("pm");
            let mut medium = PmemFile::open(&path, Some(1 << 16)).unwrap();
            medium.use_nontemporal(nontemporal);
            let expected = nontemporal && cfg!(target_arch = "x86_64");
            assert_eq!(medium.primitives().nt_pair_store, expected);
            medium.store_u64(4096, 0x77);
            medium.store_u64(4096 + 40, 0x99);
            medium.prefetch_pair_store(4096 + 16);
            medium.store_pair_flush(4096 + 16, 0x1111, 0x2222);
            medium.store_pair_flush(4096 + 32, 0x5555, 0x6666);
            medium.drain();
            // This thread reads its own stores back before the mapping is gone.
            assert_eq!(medium.load_u64(4096 + 32), 0x5555, "nt {nontemporal}");
            medium.store_pair((1 << 16) - 16, 0x3333, 0x4444);
            medium.persist((1 << 16) - 16, 16);
            drop(medium);
            let medium = PmemFile::open(&path, None).unwrap();
            let words: Vec<u64> = (0..6).map(|i| medium.load_u64(4096 + 8 * i)).collect();
            assert_eq!(words, [0x77, 0, 0x1111, 0x2222, 0x5555, 0x6666], "nt {nontemporal}");
            assert_eq!(medium.load_u64(4096 + 48), 0, "the pairs' neighbours are untouched");
            let last = (1 << 16) - 16;
            assert_eq!((medium.load_u64(last), medium.load_u64(last + 8)), (0x3333, 0x4444));
        }
    }

    #[test]
    #[should_panic(expected = "outside a medium")]
    fn a_pair_store_past_the_end_is_a_bug() {
        let dir = shm_dir();
        let medium = PmemFile::open(&dir.path().join("pm"), Some(1 << 16)).unwrap();
        medium.store_pair_flush(1 << 16, 1, 2);
    }

    #[test]
    #[should_panic(expected = "unaligned pair store")]
    fn an_unaligned_pair_store_is_a_bug() {
        let dir = shm_dir();
        let medium = PmemFile::open(&dir.path().join("pm"), Some(1 << 16)).unwrap();
        medium.store_pair(8, 1, 2);
    }

    #[test]
    #[should_panic(expected = "outside a medium")]
    fn out_of_bounds_access_is_a_bug() {
        let dir = shm_dir();
        let medium = PmemFile::open(&dir.path().join("pm"), Some(1 << 16)).unwrap();
        medium.write((1 << 16) - 4, &[0u8; 8]);
    }
}
