//! The part of librados' and librbd's C API the RBD store calls (`rados/librados.h`,
//! `rbd/librbd.h`), loaded at run time with `dlopen`: a pmcache binary runs on hosts without
//! Ceph's libraries, and an `rbd:` backing store there is refused with the package to install.
//!
//! Every function here returns a negative errno on failure, as the headers say.

use std::ffi::{c_char, c_int, c_void};
use std::sync::OnceLock;

use libloading::Library;

/// `rados_t`.
pub(super) type Rados = *mut c_void;
/// `rados_ioctx_t`.
pub(super) type Ioctx = *mut c_void;
/// `rbd_image_t`.
pub(super) type Image = *mut c_void;
/// `rbd_completion_t`.
pub(super) type Completion = *mut c_void;
/// `rbd_callback_t`.
pub(super) type Callback = unsafe extern "C" fn(Completion, *mut c_void);

/// `RBD_LOCK_MODE_EXCLUSIVE`.
pub(super) const RBD_LOCK_MODE_EXCLUSIVE: c_int = 0;

/// Where the libraries are found (Debian's librados2 and librbd1).
const LIBRADOS: &str = "librados.so.2";
const LIBRBD: &str = "librbd.so.1";

/// The functions, resolved once per process.
pub(super) struct Api {
    pub rados_create: unsafe extern "C" fn(*mut Rados, *const c_char) -> c_int,
    pub rados_conf_read_file: unsafe extern "C" fn(Rados, *const c_char) -> c_int,
    pub rados_conf_parse_env: unsafe extern "C" fn(Rados, *const c_char) -> c_int,
    pub rados_conf_set: unsafe extern "C" fn(Rados, *const c_char, *const c_char) -> c_int,
    pub rados_conf_get: unsafe extern "C" fn(Rados, *const c_char, *mut c_char, usize) -> c_int,
    pub rados_connect: unsafe extern "C" fn(Rados) -> c_int,
    pub rados_shutdown: unsafe extern "C" fn(Rados),
    pub rados_cluster_fsid: unsafe extern "C" fn(Rados, *mut c_char, usize) -> c_int,
    pub rados_ioctx_create: unsafe extern "C" fn(Rados, *const c_char, *mut Ioctx) -> c_int,
    pub rados_ioctx_destroy: unsafe extern "C" fn(Ioctx),
    pub rados_ioctx_get_id: unsafe extern "C" fn(Ioctx) -> i64,
    pub rados_ioctx_set_namespace: unsafe extern "C" fn(Ioctx, *const c_char),
    pub rbd_open: unsafe extern "C" fn(Ioctx, *const c_char, *mut Image, *const c_char) -> c_int,
    pub rbd_open_read_only:
        unsafe extern "C" fn(Ioctx, *const c_char, *mut Image, *const c_char) -> c_int,
    pub rbd_close: unsafe extern "C" fn(Image) -> c_int,
    pub rbd_get_size: unsafe extern "C" fn(Image, *mut u64) -> c_int,
    pub rbd_get_id: unsafe extern "C" fn(Image, *mut c_char, usize) -> c_int,
    pub rbd_read: unsafe extern "C" fn(Image, u64, usize, *mut c_char) -> isize,
    pub rbd_write: unsafe extern "C" fn(Image, u64, usize, *const c_char) -> isize,
    pub rbd_flush: unsafe extern "C" fn(Image) -> c_int,
    pub rbd_discard: unsafe extern "C" fn(Image, u64, u64) -> c_int,
    pub rbd_write_zeroes: unsafe extern "C" fn(Image, u64, usize, c_int, c_int) -> isize,
    pub rbd_lock_acquire: unsafe extern "C" fn(Image, c_int) -> c_int,
    pub rbd_lock_release: unsafe extern "C" fn(Image) -> c_int,
    pub rbd_list_lockers: unsafe extern "C" fn(
        Image,
        *mut c_int,
        *mut c_char,
        *mut usize,
        *mut c_char,
        *mut usize,
        *mut c_char,
        *mut usize,
        *mut c_char,
        *mut usize,
    ) -> isize,
    pub rbd_is_exclusive_lock_owner: unsafe extern "C" fn(Image, *mut c_int) -> c_int,
    pub rbd_metadata_get:
        unsafe extern "C" fn(Image, *const c_char, *mut c_char, *mut usize) -> c_int,
    pub rbd_metadata_set: unsafe extern "C" fn(Image, *const c_char, *const c_char) -> c_int,
    pub rbd_metadata_remove: unsafe extern "C" fn(Image, *const c_char) -> c_int,
    pub rbd_aio_create_completion:
        unsafe extern "C" fn(*mut c_void, Callback, *mut Completion) -> c_int,
    pub rbd_aio_get_return_value: unsafe extern "C" fn(Completion) -> isize,
    pub rbd_aio_wait_for_complete: unsafe extern "C" fn(Completion) -> c_int,
    pub rbd_aio_release: unsafe extern "C" fn(Completion),
    pub rbd_aio_read: unsafe extern "C" fn(Image, u64, usize, *mut c_char, Completion) -> c_int,
    pub rbd_aio_write: unsafe extern "C" fn(Image, u64, usize, *const c_char, Completion) -> c_int,
    pub rbd_aio_flush: unsafe extern "C" fn(Image, Completion) -> c_int,
    // The libraries stay loaded for the life of the process: the functions above point into
    // them.
    _rados: Library,
    _rbd: Library,
}

/// Resolves `name` in `lib` as a function of type `T`.
///
/// # Safety
/// `T` must be the function's type as the C header declares it.
unsafe fn symbol<T: Copy>(lib: &Library, name: &str) -> Result<T, String> {
    // SAFETY: the caller guarantees that `T` is the symbol's type; the library outlives the
    // copied pointer (it is kept in `Api`, which lives for the process).
    unsafe { lib.get::<T>(name.as_bytes()) }
        .map(|s| *s)
        .map_err(|e| format!("{name} is missing from Ceph's client libraries: {e}"))
}

fn load() -> Result<Api, String> {
    let open = |name: &str| {
        // SAFETY: loading librados/librbd runs their initialisers, which only set up their own
        // state; nothing else in this process depends on them.
        unsafe { Library::new(name) }.map_err(|e| {
            format!(
                "cannot load {name} ({e}): an rbd: backing store needs Ceph's client libraries \
                 (Debian: apt-get install librbd1)"
            )
        })
    };
    let rados = open(LIBRADOS)?;
    let rbd = open(LIBRBD)?;
    // SAFETY: each type below is the function's prototype in rados/librados.h or
    // rbd/librbd.h (Ceph 16 and later).
    unsafe {
        Ok(Api {
            rados_create: symbol(&rados, "rados_create")?,
            rados_conf_read_file: symbol(&rados, "rados_conf_read_file")?,
            rados_conf_parse_env: symbol(&rados, "rados_conf_parse_env")?,
            rados_conf_set: symbol(&rados, "rados_conf_set")?,
            rados_conf_get: symbol(&rados, "rados_conf_get")?,
            rados_connect: symbol(&rados, "rados_connect")?,
            rados_shutdown: symbol(&rados, "rados_shutdown")?,
            rados_cluster_fsid: symbol(&rados, "rados_cluster_fsid")?,
            rados_ioctx_create: symbol(&rados, "rados_ioctx_create")?,
            rados_ioctx_destroy: symbol(&rados, "rados_ioctx_destroy")?,
            rados_ioctx_get_id: symbol(&rados, "rados_ioctx_get_id")?,
            rados_ioctx_set_namespace: symbol(&rados, "rados_ioctx_set_namespace")?,
            rbd_open: symbol(&rbd, "rbd_open")?,
            rbd_open_read_only: symbol(&rbd, "rbd_open_read_only")?,
            rbd_close: symbol(&rbd, "rbd_close")?,
            rbd_get_size: symbol(&rbd, "rbd_get_size")?,
            rbd_get_id: symbol(&rbd, "rbd_get_id")?,
            rbd_read: symbol(&rbd, "rbd_read")?,
            rbd_write: symbol(&rbd, "rbd_write")?,
            rbd_flush: symbol(&rbd, "rbd_flush")?,
            rbd_discard: symbol(&rbd, "rbd_discard")?,
            rbd_write_zeroes: symbol(&rbd, "rbd_write_zeroes")?,
            rbd_lock_acquire: symbol(&rbd, "rbd_lock_acquire")?,
            rbd_lock_release: symbol(&rbd, "rbd_lock_release")?,
            rbd_list_lockers: symbol(&rbd, "rbd_list_lockers")?,
            rbd_is_exclusive_lock_owner: symbol(&rbd, "rbd_is_exclusive_lock_owner")?,
            rbd_metadata_get: symbol(&rbd, "rbd_metadata_get")?,
            rbd_metadata_set: symbol(&rbd, "rbd_metadata_set")?,
            rbd_metadata_remove: symbol(&rbd, "rbd_metadata_remove")?,
            rbd_aio_create_completion: symbol(&rbd, "rbd_aio_create_completion")?,
            rbd_aio_get_return_value: symbol(&rbd, "rbd_aio_get_return_value")?,
            rbd_aio_wait_for_complete: symbol(&rbd, "rbd_aio_wait_for_complete")?,
            rbd_aio_release: symbol(&rbd, "rbd_aio_release")?,
            rbd_aio_read: symbol(&rbd, "rbd_aio_read")?,
            rbd_aio_write: symbol(&rbd, "rbd_aio_write")?,
            rbd_aio_flush: symbol(&rbd, "rbd_aio_flush")?,
            _rados: rados,
            _rbd: rbd,
        })
    }
}

/// The API, loaded at the first call; the error says what to install.
pub(super) fn api() -> Result<&'static Api, String> {
    static API: OnceLock<Result<Api, String>> = OnceLock::new();
    API.get_or_init(load).as_ref().map_err(Clone::clone)
}
