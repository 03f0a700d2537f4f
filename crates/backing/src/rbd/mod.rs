//! A Ceph RBD image as the backing store, through librbd's C API ([`ffi`]).
//!
//! - **Synchronous calls** (`rbd_read`, `rbd_write`, `rbd_flush`, `rbd_discard`,
//!   `rbd_write_zeroes`) serve the engine's single-block paths; **`rbd_aio_*`** with
//!   completions serve the queued interface ([`queue`]: the cleaner's write-back, queued read
//!   misses).
//! - **Identity**: the cluster's fsid, the pool's id and namespace (the fingerprint) and the
//!   image's id (the instance): an image renamed keeps its cache; another image, or the same
//!   name in another pool or cluster, is refused.
//! - **One writer**: the image's exclusive lock is taken at open and held until the store is
//!   dropped, so two hosts never cache one image for writing; a second open is refused with
//!   the holder's address ([`BackingError::Locked`]). An image without the `exclusive-lock`
//!   feature is refused.
//! - **Which cache holds dirty blocks** is recorded on the image ([`claim`]): a second cache
//!   is refused while another holds dirty blocks unless the operator says that one is gone
//!   (`takeover=1`), and a cache taken over is refused when it comes back. A client whose lock
//!   another broke writes nothing more ([`BackingError::LockLost`]).
//! - **No second cache**: librbd's own in-memory cache (`rbd_cache`) is off unless the spec
//!   turns it on: pmcache is the cache, and librbd's would hold acknowledged write-back in
//!   volatile memory until a flush.
//! - **Timeouts**: librados waits 300 s for a monitor and forever for an OSD by default. Unless
//!   the configuration or the spec says otherwise, connecting gives up after 10 s
//!   (`client_mount_timeout`, `rados_mon_op_timeout`) and an I/O after 30 s
//!   (`rados_osd_op_timeout`), failing with `ETIMEDOUT`: the cleaner then backs off and retries,
//!   and a read miss fails instead of hanging its client.

pub mod claim;
mod ffi;
mod queue;
mod spec;

use std::ffi::{CString, c_char, c_int};
use std::io;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};

pub use spec::{RBD_PREFIX, RbdSpec};

use crate::psync::bytes_fingerprint;
use crate::{BackingError, BackingIdentity, BackingStore, IoQueue, Result};
use ffi::Api;

/// The engine name (`--engine` is not used for RBD; this is what stats show).
pub const RBD_ENGINE: &str = "rbd";
/// The longest discard or write-zeroes passed in one call (librbd answers in an `int`).
const CHUNK_BYTES: u64 = 1 << 30;
/// Defaults set when the configuration leaves Ceph's own: (option, Ceph's default, ours).
const TIMEOUT_DEFAULTS: [(&str, &str, &str); 3] = [
    ("client_mount_timeout", "300", "10"),
    ("rados_mon_op_timeout", "0", "10"),
    ("rados_osd_op_timeout", "0", "30"),
];

/// What names an image across renames, and the cluster it is in.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct RbdIds {
    /// The cluster's fsid.
    pub fsid: String,
    /// The pool's id.
    pub pool_id: i64,
    /// The RADOS namespace ("" for none).
    pub namespace: String,
    /// The image's id (kept across renames).
    pub image_id: String,
}

impl RbdIds {
    /// The key a state record is filed under: every part of the identity.
    pub fn key(&self) -> String {
        let ns =
            if self.namespace.is_empty() { String::new() } else { format!("-{}", self.namespace) };
        format!("rbd-{}-pool{}{ns}-{}", self.fsid, self.pool_id, self.image_id)
    }

    fn identity(&self, size_bytes: u64) -> BackingIdentity {
        let place = format!("rbd\0{}\0{}\0{}", self.fsid, self.pool_id, self.namespace);
        let id = bytes_fingerprint(self.image_id.as_bytes());
        BackingIdentity {
            size_bytes,
            fingerprint: bytes_fingerprint(place.as_bytes()),
            instance: u64::from_le_bytes(id[..8].try_into().expect("8 bytes")),
        }
    }
}

/// The handles of one open image: the cluster connection, the pool's I/O context and the
/// image, closed in reverse order on drop (after every queue that shares them is gone).
struct Handle {
    api: &'static Api,
    cluster: ffi::Rados,
    ioctx: ffi::Ioctx,
    image: ffi::Image,
    /// The exclusive lock is held (taken at open, released by `release` or at drop).
    locked: AtomicBool,
    /// The store as messages name it (`rbd:POOL/IMAGE`).
    name: String,
    /// The lock was lost while attached: nothing more is written ([`claim`]).
    lock_lost: AtomicBool,
    /// The answer that showed the lock lost.
    lost_why: Mutex<String>,
    /// Writes wait for a claim: the image records a holder or a cache taken over.
    gated: AtomicBool,
    /// What the image recorded, for the refusal.
    gate_record: Mutex<String>,
    /// The uuid of the cache this attachment claimed the image for.
    claimed: Mutex<Option<String>>,
}

// SAFETY: librados' cluster and I/O context handles and librbd's image handle may be used from
// any thread, concurrently (librbd serialises what it must internally); `Handle` only passes
// them to those libraries.
unsafe impl Send for Handle {}
// SAFETY: as for `Send`: every call through the handles is thread-safe in librbd/librados.
unsafe impl Sync for Handle {}

impl Drop for Handle {
    fn drop(&mut self) {
        // SAFETY: each handle was created by the matching call and is released once, image
        // before I/O context before cluster; no queue uses them any more (queues hold an `Arc`
        // of this handle and wait for their requests when dropped).
        unsafe {
            if !self.image.is_null() {
                if self.locked.load(Ordering::SeqCst) {
                    (self.api.rbd_lock_release)(self.image);
                }
                (self.api.rbd_close)(self.image);
            }
            if !self.ioctx.is_null() {
                (self.api.rados_ioctx_destroy)(self.ioctx);
            }
            if !self.cluster.is_null() {
                (self.api.rados_shutdown)(self.cluster);
            }
        }
    }
}

/// An RBD image opened as a backing store.
pub struct RbdImage {
    handle: Arc<Handle>,
    spec: RbdSpec,
    ids: RbdIds,
    size_bytes: u64,
    read_only: bool,
    /// librbd's cache is on (the spec asked for it): its writes are volatile until a flush.
    rbd_cache: bool,
}

fn cstring(what: &str, text: &str) -> io::Result<CString> {
    CString::new(text).map_err(|_| {
        io::Error::new(io::ErrorKind::InvalidInput, format!("{what} {text:?} contains a NUL byte"))
    })
}

fn errno(ret: i64) -> io::Error {
    io::Error::from_raw_os_error((-ret) as i32)
}

impl RbdImage {
    /// Opens the image of `spec` (`rbd:POOL/IMAGE[:KEY=VALUE]...`) for reading and writing
    /// and takes its exclusive lock.
    pub fn open(spec: &str) -> Result<Self> {
        Self::open_with(spec, false)
    }

    /// Opens the image; `read_only` opens it without a lock (for looking at it: its identity,
    /// its size).
    pub fn open_with(spec: &str, read_only: bool) -> Result<Self> {
        let parsed = RbdSpec::parse(spec).map_err(|reason| BackingError::Open {
            path: spec.into(),
            source: io::Error::new(io::ErrorKind::InvalidInput, reason),
        })?;
        let fail = |step: String, source: io::Error| BackingError::Open {
            path: format!("{parsed} ({step})"),
            source,
        };
        let api =
            ffi::api().map_err(|reason| fail("loading librbd".into(), io::Error::other(reason)))?;
        let mut handle = Handle {
            api,
            cluster: std::ptr::null_mut(),
            ioctx: std::ptr::null_mut(),
            image: std::ptr::null_mut(),
            locked: AtomicBool::new(false),
            name: parsed.to_string(),
            lock_lost: AtomicBool::new(false),
            lost_why: Mutex::new(String::new()),
            gated: AtomicBool::new(false),
            gate_record: Mutex::new(String::new()),
            claimed: Mutex::new(None),
        };
        let user = parsed
            .user
            .as_deref()
            .map(|u| cstring("user", u))
            .transpose()
            .map_err(|e| fail("the user".into(), e))?;
        // SAFETY: `handle.cluster` receives the new handle; `user` is NUL-terminated or null.
        let ret = unsafe {
            (api.rados_create)(
                &mut handle.cluster,
                user.as_ref().map_or(std::ptr::null(), |u| u.as_ptr()),
            )
        };
        if ret < 0 {
            return Err(fail("creating a cluster handle".into(), errno(ret.into())));
        }
        configure(&handle, &parsed).map_err(|(step, e)| fail(step, e))?;
        // SAFETY: the cluster handle is configured and not yet connected.
        let ret = unsafe { (api.rados_connect)(handle.cluster) };
        if ret < 0 {
            let mon_host = conf_get(&handle, "mon_host").unwrap_or_default();
            let timeout = conf_get(&handle, "client_mount_timeout").unwrap_or_default();
            return Err(fail(
                format!(
                    "connecting to the monitors at {mon_host:?}; client_mount_timeout {} s",
                    timeout.parse::<f64>().map_or(timeout.clone(), |t| t.to_string())
                ),
                errno(ret.into()),
            ));
        }
        let fsid = fsid(&handle).map_err(|e| fail("reading the cluster's fsid".into(), e))?;
        let pool = cstring("pool", &parsed.pool).map_err(|e| fail("the pool".into(), e))?;
        // SAFETY: connected cluster; `pool` is NUL-terminated; `handle.ioctx` receives it.
        let ret =
            unsafe { (api.rados_ioctx_create)(handle.cluster, pool.as_ptr(), &mut handle.ioctx) };
        if ret < 0 {
            return Err(fail(format!("opening pool {:?}", parsed.pool), errno(ret.into())));
        }
        if !parsed.namespace.is_empty() {
            let ns = cstring("namespace", &parsed.namespace)
                .map_err(|e| fail("the namespace".into(), e))?;
            // SAFETY: valid I/O context; `ns` is NUL-terminated (copied by librados).
            unsafe { (api.rados_ioctx_set_namespace)(handle.ioctx, ns.as_ptr()) };
        }
        // SAFETY: valid I/O context.
        let pool_id = unsafe { (api.rados_ioctx_get_id)(handle.ioctx) };
        let image = cstring("image", &parsed.image).map_err(|e| fail("the image".into(), e))?;
        let open = if read_only { api.rbd_open_read_only } else { api.rbd_open };
        // SAFETY: valid I/O context; `image` is NUL-terminated; no snapshot (null).
        let ret =
            unsafe { open(handle.ioctx, image.as_ptr(), &mut handle.image, std::ptr::null()) };
        if ret < 0 {
            return Err(fail(
                format!("opening image {:?} in pool {:?}", parsed.image, parsed.pool),
                errno(ret.into()),
            ));
        }
        let mut size_bytes = 0u64;
        // SAFETY: open image; `size_bytes` receives the size.
        let ret = unsafe { (api.rbd_get_size)(handle.image, &mut size_bytes) };
        if ret < 0 {
            return Err(fail("reading the image's size".into(), errno(ret.into())));
        }
        let image_id = image_id(&handle).map_err(|e| fail("reading the image's id".into(), e))?;
        let ids = RbdIds { fsid, pool_id, namespace: parsed.namespace.clone(), image_id };
        if !read_only {
            // SAFETY: open image.
            let ret = unsafe { (api.rbd_lock_acquire)(handle.image, ffi::RBD_LOCK_MODE_EXCLUSIVE) };
            if ret < 0 {
                let errno = -ret;
                if errno == libc::EOPNOTSUPP || errno == libc::EINVAL {
                    return Err(fail(
                        format!(
                            "taking its exclusive lock: the image lacks the exclusive-lock \
                             feature, without which two hosts could cache it for writing at once \
                             (rbd feature enable {} exclusive-lock)",
                            parsed.image_path()
                        ),
                        io::Error::from_raw_os_error(errno),
                    ));
                }
                let holder = lockers(&handle)
                    .unwrap_or_else(|e| format!("(the holder could not be read: {e})"));
                return Err(BackingError::Locked {
                    store: parsed.to_string(),
                    holder,
                    source: io::Error::from_raw_os_error(errno),
                });
            }
            handle.locked.store(true, Ordering::SeqCst);
            handle
                .gate_if_recorded()
                .map_err(|e| fail("reading the image's pmcache.holder metadata".into(), e))?;
        }
        let rbd_cache = conf_get(&handle, "rbd_cache").as_deref() == Some("true");
        Ok(Self { handle: Arc::new(handle), spec: parsed, ids, size_bytes, read_only, rbd_cache })
    }

    /// The image's identity in its cluster.
    pub fn ids(&self) -> &RbdIds {
        &self.ids
    }

    /// The parsed spec.
    pub fn spec(&self) -> &RbdSpec {
        &self.spec
    }

    fn check(&self, op: &'static str, offset: u64, len: u64) -> Result<()> {
        check_request(self.read_only, self.size_bytes, op, offset, len)?;
        if op != "read" {
            self.handle.check_write(op)?;
        }
        Ok(())
    }

    /// Whether this attachment lost the image's exclusive lock (another client broke it):
    /// every write, discard, write-zeroes and flush then fails with
    /// [`BackingError::LockLost`].
    pub fn lock_lost(&self) -> bool {
        self.handle.lock_lost.load(Ordering::SeqCst)
    }
}

/// Refuses a request that writes to an image opened read-only (`EROFS`) or reaches past its
/// end; what the synchronous calls and the queue both check before librbd sees a request.
fn check_request(
    read_only: bool,
    size_bytes: u64,
    op: &'static str,
    offset: u64,
    len: u64,
) -> Result<()> {
    if read_only && op != "read" {
        return Err(BackingError::Io {
            op,
            offset,
            len,
            source: io::Error::from_raw_os_error(libc::EROFS),
        });
    }
    match offset.checked_add(len) {
        Some(end) if end <= size_bytes => Ok(()),
        _ => Err(BackingError::OutOfRange { op, offset, len, size: size_bytes }),
    }
}

/// Reads the configuration (file, `CEPH_ARGS`), sets pmcache's defaults where it left Ceph's,
/// then the spec's options. Returns the failed step.
fn configure(handle: &Handle, spec: &RbdSpec) -> std::result::Result<(), (String, io::Error)> {
    let api = handle.api;
    let conf = spec
        .conf
        .as_deref()
        .map(|c| cstring("conf", c))
        .transpose()
        .map_err(|e| ("the conf path".to_string(), e))?;
    // SAFETY: unconnected cluster handle; `conf` is NUL-terminated or null (librados' search).
    let ret = unsafe {
        (api.rados_conf_read_file)(
            handle.cluster,
            conf.as_ref().map_or(std::ptr::null(), |c| c.as_ptr()),
        )
    };
    // No file found by the search is fine when the spec names the monitors itself.
    if ret < 0 && (spec.conf.is_some() || spec.option("mon_host").is_none()) {
        let what = match &spec.conf {
            Some(path) => format!("reading the configuration {path}"),
            None => "reading the configuration ($CEPH_CONF, /etc/ceph/ceph.conf, ~/.ceph/config, ./ceph.conf; give :conf=PATH or :mon_host=ADDR)".into(),
        };
        return Err((what, errno(ret.into())));
    }
    // SAFETY: unconnected cluster handle; null names the default variable (CEPH_ARGS).
    let ret = unsafe { (api.rados_conf_parse_env)(handle.cluster, std::ptr::null()) };
    if ret < 0 {
        return Err(("reading CEPH_ARGS".into(), errno(ret.into())));
    }
    let set = |key: &str, value: &str| -> std::result::Result<(), (String, io::Error)> {
        let k = cstring("option", key).map_err(|e| (format!("option {key}"), e))?;
        let v = cstring("value", value).map_err(|e| (format!("option {key}"), e))?;
        // SAFETY: unconnected cluster handle; both strings NUL-terminated (copied by librados).
        let ret = unsafe { (api.rados_conf_set)(handle.cluster, k.as_ptr(), v.as_ptr()) };
        if ret < 0 {
            return Err((format!("setting Ceph option {key}={value}"), errno(ret.into())));
        }
        Ok(())
    };
    for (key, ceph_default, ours) in TIMEOUT_DEFAULTS {
        let now = conf_get(handle, key).unwrap_or_default();
        if now.parse::<f64>().ok() == ceph_default.parse::<f64>().ok() {
            set(key, ours)?;
        }
    }
    set("rbd_cache", "false")?;
    for (key, value) in &spec.options {
        set(key, value)?;
    }
    Ok(())
}

/// The value of Ceph option `key` on `handle`.
fn conf_get(handle: &Handle, key: &str) -> Option<String> {
    let key = CString::new(key).ok()?;
    let mut buf = vec![0u8; 1024];
    // SAFETY: valid cluster handle; `buf` holds `buf.len()` bytes for the NUL-terminated value.
    let ret = unsafe {
        (handle.api.rados_conf_get)(
            handle.cluster,
            key.as_ptr(),
            buf.as_mut_ptr().cast(),
            buf.len(),
        )
    };
    (ret == 0).then(|| c_string(&buf))
}

/// The text up to the first NUL of `buf`.
fn c_string(buf: &[u8]) -> String {
    let end = buf.iter().position(|&b| b == 0).unwrap_or(buf.len());
    String::from_utf8_lossy(&buf[..end]).into_owned()
}

fn fsid(handle: &Handle) -> io::Result<String> {
    let mut buf = [0u8; 64];
    // SAFETY: connected cluster; `buf` holds 64 bytes (an fsid is 36 and a NUL).
    let ret = unsafe {
        (handle.api.rados_cluster_fsid)(handle.cluster, buf.as_mut_ptr().cast(), buf.len())
    };
    if ret < 0 {
        return Err(errno(ret.into()));
    }
    Ok(c_string(&buf))
}

fn image_id(handle: &Handle) -> io::Result<String> {
    let mut buf = [0u8; 128];
    // SAFETY: open image; `buf` holds 128 bytes for the NUL-terminated id.
    let ret = unsafe { (handle.api.rbd_get_id)(handle.image, buf.as_mut_ptr().cast(), buf.len()) };
    if ret < 0 {
        return Err(errno(ret.into()));
    }
    Ok(c_string(&buf))
}

/// Who holds the image's lock, as `client.N at ADDR`, from the image header's lockers.
fn lockers(handle: &Handle) -> io::Result<String> {
    let api = handle.api;
    let mut exclusive: c_int = 0;
    let mut lens = [0usize; 4];
    let mut bufs: [Vec<u8>; 4] = Default::default();
    for _ in 0..4 {
        let [tag, clients, cookies, addrs] = &mut bufs;
        let [tag_len, clients_len, cookies_len, addrs_len] = &mut lens;
        // SAFETY: open image; each buffer holds its length's bytes (the first call passes
        // empty buffers and lengths 0, and librbd answers -ERANGE with the lengths it needs).
        let ret = unsafe {
            (api.rbd_list_lockers)(
                handle.image,
                &mut exclusive,
                tag.as_mut_ptr().cast::<c_char>(),
                tag_len,
                clients.as_mut_ptr().cast::<c_char>(),
                clients_len,
                cookies.as_mut_ptr().cast::<c_char>(),
                cookies_len,
                addrs.as_mut_ptr().cast::<c_char>(),
                addrs_len,
            )
        };
        if ret == -(libc::ERANGE as isize) {
            for (buf, len) in bufs.iter_mut().zip(lens) {
                buf.resize(len, 0);
            }
            continue;
        }
        if ret < 0 {
            return Err(errno(ret as i64));
        }
        if ret == 0 {
            return Ok("no client any more (the lock was released meanwhile: try again)".into());
        }
        let split = |buf: &[u8], len: usize| -> Vec<String> {
            buf[..len.min(buf.len())]
                .split(|&b| b == 0)
                .filter(|s| !s.is_empty())
                .map(|s| String::from_utf8_lossy(s).into_owned())
                .collect()
        };
        let clients = split(&bufs[1], lens[1]);
        let addrs = split(&bufs[3], lens[3]);
        let holders: Vec<String> = clients
            .iter()
            .zip(addrs.iter().map(Some).chain(std::iter::repeat(None)))
            .map(|(client, addr)| match addr {
                Some(addr) => format!("{client} at {addr}"),
                None => client.clone(),
            })
            .collect();
        return Ok(holders.join(", "));
    }
    Err(io::Error::from_raw_os_error(libc::ERANGE))
}

impl BackingStore for RbdImage {
    fn size_bytes(&self) -> u64 {
        self.size_bytes
    }

    fn logical_block_size(&self) -> u32 {
        512
    }

    fn identity(&self) -> BackingIdentity {
        self.ids.identity(self.size_bytes)
    }

    fn read_at(&self, buf: &mut [u8], offset: u64) -> Result<()> {
        self.check("read", offset, buf.len() as u64)?;
        let (ptr, len) = (buf.as_mut_ptr(), buf.len());
        transfer("read", offset, len, |done| {
            // SAFETY: open image; `buf[done..]` is writable for `len - done` bytes for the
            // call (`buf` is borrowed mutably for all of `read_at`).
            unsafe {
                (self.handle.api.rbd_read)(
                    self.handle.image,
                    offset + done as u64,
                    len - done,
                    ptr.add(done).cast(),
                )
            }
        })
    }

    fn write_at(&self, data: &[u8], offset: u64) -> Result<()> {
        self.check("write", offset, data.len() as u64)?;
        self.written(transfer("write", offset, data.len(), |done| {
            let rest = &data[done..];
            // SAFETY: open image; `rest` is readable for `rest.len()` bytes for the call.
            unsafe {
                (self.handle.api.rbd_write)(
                    self.handle.image,
                    offset + done as u64,
                    rest.len(),
                    rest.as_ptr().cast(),
                )
            }
        }))
    }

    fn flush(&self) -> Result<()> {
        self.handle.check_write("flush")?;
        // SAFETY: open image.
        let ret = unsafe { (self.handle.api.rbd_flush)(self.handle.image) };
        if ret < 0 {
            let error =
                BackingError::Io { op: "flush", offset: 0, len: 0, source: errno(ret.into()) };
            return Err(self.handle.write_failed(ret.into(), error));
        }
        Ok(())
    }

    fn discard(&self, offset: u64, len: u64) -> Result<()> {
        self.check("discard", offset, len)?;
        let mut at = offset;
        while at < offset + len {
            let n = CHUNK_BYTES.min(offset + len - at);
            // SAFETY: open image; the range lies inside it.
            let ret = unsafe { (self.handle.api.rbd_discard)(self.handle.image, at, n) };
            if ret < 0 {
                let error =
                    BackingError::Io { op: "discard", offset, len, source: errno(ret.into()) };
                return Err(self.handle.write_failed(ret.into(), error));
            }
            at += n;
        }
        Ok(())
    }

    fn write_zeroes(&self, offset: u64, len: u64) -> Result<()> {
        self.check("write-zeroes", offset, len)?;
        let mut at = offset;
        while at < offset + len {
            let n = CHUNK_BYTES.min(offset + len - at);
            // SAFETY: open image; the range lies inside it; no zero or op flags.
            let ret = unsafe {
                (self.handle.api.rbd_write_zeroes)(self.handle.image, at, n as usize, 0, 0)
            };
            if ret < 0 {
                let error =
                    BackingError::Io { op: "write-zeroes", offset, len, source: errno(ret as i64) };
                return Err(self.handle.write_failed(ret as i64, error));
            }
            at += n;
        }
        Ok(())
    }

    fn engine_name(&self) -> &'static str {
        RBD_ENGINE
    }

    fn is_direct(&self) -> bool {
        !self.rbd_cache
    }

    fn failed_flush_loses_writes(&self) -> bool {
        // Without librbd's cache every completed write was acknowledged by the OSDs, so a flush
        // that fails (an OSD out of reach past rados_osd_op_timeout) has lost none of them. With
        // it, written-back data may sit in librbd's memory and a failed flush may mean it is
        // gone.
        self.rbd_cache
    }

    fn release(&self) -> Result<()> {
        if self.handle.locked.swap(false, Ordering::SeqCst) {
            // SAFETY: open image, whose lock this handle took.
            let ret = unsafe { (self.handle.api.rbd_lock_release)(self.handle.image) };
            if ret < 0 {
                return Err(BackingError::Io {
                    op: "release the exclusive lock",
                    offset: 0,
                    len: 0,
                    source: errno(ret.into()),
                });
            }
        }
        Ok(())
    }

    fn claim(&self, cache_uuid: [u8; 16], takeover: bool) -> Result<()> {
        if self.read_only {
            return Ok(());
        }
        self.handle.claim(&self.spec.image_path(), cache_uuid, takeover || self.spec.takeover)
    }

    fn disclaim(&self) -> Result<()> {
        if self.read_only {
            return Ok(());
        }
        self.handle.disclaim()
    }

    fn open_queue(&self, depth: usize) -> Result<Box<dyn IoQueue>> {
        Ok(Box::new(queue::RbdQueue::new(
            self.handle.clone(),
            depth,
            self.size_bytes,
            self.read_only,
        )?))
    }
}

impl RbdImage {
    /// A write's result, with an error that shows the lock lost made [`BackingError::LockLost`].
    fn written(&self, result: Result<()>) -> Result<()> {
        match result {
            Err(error @ BackingError::Io { .. }) => {
                let ret = -i64::from(error.errno());
                Err(self.handle.write_failed(ret, error))
            }
            other => other,
        }
    }
}

/// Moves `len` bytes at `offset` with `call(done)`, which passes the rest (from byte `done`) to
/// librbd and returns its answer: bytes moved, or a negative errno. No progress is a short
/// read or write.
fn transfer(
    op: &'static str,
    offset: u64,
    len: usize,
    mut call: impl FnMut(usize) -> isize,
) -> Result<()> {
    let mut done = 0usize;
    while done < len {
        let ret = call(done);
        if ret < 0 {
            return Err(BackingError::Io {
                op,
                offset,
                len: len as u64,
                source: errno(ret as i64),
            });
        }
        if ret == 0 {
            let (len, got) = (len as u64, done as u64);
            return Err(match op {
                "read" => BackingError::ShortRead { offset, len, got },
                _ => BackingError::ShortWrite { offset, len, got },
            });
        }
        done += ret as usize;
    }
    Ok(())
}

/// The identity of the image `spec` names, opened read-only (no lock) and closed again: what a
/// state record is filed under before the cache is opened.
pub fn rbd_ids(spec: &str) -> Result<RbdIds> {
    Ok(RbdImage::open_with(spec, true)?.ids)
}
