//! The C API called as a C program calls it: a round trip, and every refusal with its errno
//! and message.

use std::ffi::{CStr, CString, c_char, c_void};
use std::os::unix::ffi::OsStrExt;
use std::path::{Path, PathBuf};
use std::ptr;

use super::*;

/// A cache medium in /dev/shm and a backing file on disk, in directories of their own.
struct Place {
    shm: tempfile::TempDir,
    disk: tempfile::TempDir,
    cache: CString,
    backing: CString,
}

impl Place {
    fn new() -> Self {
        let shm = tempfile::tempdir_in("/dev/shm").expect("a directory in /dev/shm");
        let disk = tempfile::tempdir().expect("a directory on disk");
        let cache = c_path(&shm.path().join("cache.pm"));
        let backing = c_path(&disk.path().join("backing.img"));
        Self { shm, disk, cache, backing }
    }

    /// An 8 MiB cache in front of a 16 MiB backing file, created if missing; two handles.
    fn config(&self) -> PmcacheConfig {
        PmcacheConfig {
            size: size_of::<PmcacheConfig>(),
            cache_path: self.cache.as_ptr(),
            cache_bytes: 8 << 20,
            backing_path: self.backing.as_ptr(),
            backing_bytes: 16 << 20,
            block_bytes: 0,
            mode: PmcacheMode::WriteBack as u32,
            data_crc: false,
            lanes: 2,
            control_path: ptr::null(),
        }
    }

    fn cache_path(&self) -> PathBuf {
        self.shm.path().join("cache.pm")
    }

    fn backing_path(&self) -> PathBuf {
        self.disk.path().join("backing.img")
    }
}

fn c_path(path: &Path) -> CString {
    CString::new(path.as_os_str().as_bytes()).expect("a path without NUL")
}

/// Opens `config` as a C program does: the cache, or the message `pmcache_open` wrote.
fn open(config: &PmcacheConfig) -> Result<*mut Pmcache, String> {
    let mut err = [0 as c_char; 1024];
    // SAFETY: a config of its own size whose paths live as long as the place; a buffer of
    // `err.len()` bytes.
    let cache = unsafe { pmcache_open(config, err.as_mut_ptr(), err.len()) };
    if cache.is_null() {
        // SAFETY: `pmcache_open` NUL-terminated its message in `err`.
        Err(unsafe { CStr::from_ptr(err.as_ptr()) }.to_string_lossy().into_owned())
    } else {
        Ok(cache)
    }
}

/// A handle on `cache`, or the message `pmcache_handle_open` wrote.
fn handle(cache: *mut Pmcache) -> Result<*mut PmcacheHandle, String> {
    let mut err = [0 as c_char; 1024];
    // SAFETY: an open cache; a buffer of `err.len()` bytes.
    let handle = unsafe { pmcache_handle_open(cache, err.as_mut_ptr(), err.len()) };
    if handle.is_null() {
        // SAFETY: `pmcache_handle_open` NUL-terminated its message in `err`.
        Err(unsafe { CStr::from_ptr(err.as_ptr()) }.to_string_lossy().into_owned())
    } else {
        Ok(handle)
    }
}

/// This thread's last error.
fn last_error() -> String {
    // SAFETY: `pmcache_last_error` returns a NUL-terminated string that lives until the next
    // failure on this thread.
    unsafe { CStr::from_ptr(pmcache_last_error()) }.to_string_lossy().into_owned()
}

fn read(handle: *mut PmcacheHandle, offset: u64, buf: &mut [u8]) -> c_int {
    // SAFETY: an open handle used by this thread alone; `buf` is `buf.len()` writable bytes.
    unsafe { pmcache_read(handle, offset, buf.as_mut_ptr().cast::<c_void>(), buf.len()) }
}

fn write(handle: *mut PmcacheHandle, offset: u64, data: &[u8], flags: u32) -> c_int {
    // SAFETY: an open handle used by this thread alone; `data` is `data.len()` readable bytes.
    unsafe { pmcache_write(handle, offset, data.as_ptr().cast::<c_void>(), data.len(), flags) }
}

fn close_handle(handle: *mut PmcacheHandle) {
    // SAFETY: an open handle, not used after this.
    assert_eq!(unsafe { pmcache_handle_close(handle) }, 0);
}

fn close(cache: *mut Pmcache) {
    // SAFETY: an open cache with no handle open, not used after this.
    let closed = unsafe { pmcache_close(cache) };
    assert_eq!(closed, 0, "{}", last_error());
}

fn stats(cache: *mut Pmcache) -> serde_json::Value {
    // SAFETY: an open cache.
    let text = unsafe { pmcache_stats_json(cache) };
    assert!(!text.is_null(), "{}", last_error());
    // SAFETY: a NUL-terminated string from `pmcache_stats_json`, freed right after.
    let json = unsafe { CStr::from_ptr(text) }.to_str().expect("UTF-8").to_owned();
    // SAFETY: from `pmcache_stats_json`, not freed yet.
    unsafe { pmcache_string_free(text) };
    serde_json::from_str(&json).expect("a JSON object")
}

/// Writes, reads, trims and zeroes through a handle; `stats` (of the library and of the
/// control socket) counts the handle; a close writes the volatile medium back and marks the
/// cache clean, and the next open finds the data.
#[test]
fn a_cache_serves_its_handles_and_closes_clean() {
    let place = Place::new();
    let cache = open(&place.config()).expect("a new cache");
    // SAFETY: an open cache.
    let (size, block) = unsafe { (pmcache_size_bytes(cache), pmcache_block_bytes(cache)) };
    assert_eq!((size, block), (16 << 20, 4096));
    let h = handle(cache).expect("a handle");
    let data: Vec<u8> = (0..2 * 4096).map(|i| (i % 251) as u8).collect();
    assert_eq!(write(h, 8192, &data, PMCACHE_FUA), 0, "{}", last_error());
    let mut back = vec![0u8; data.len()];
    assert_eq!(read(h, 8192, &mut back), 0, "{}", last_error());
    assert_eq!(back, data);
    // A miss, answered from the backing store: zeroes.
    let mut miss = vec![0xffu8; 4096];
    assert_eq!(read(h, 1 << 20, &mut miss), 0, "{}", last_error());
    assert!(miss.iter().all(|&b| b == 0));
    // SAFETY: an open handle used by this thread alone.
    unsafe {
        assert_eq!(pmcache_write_zeroes(h, 8192, 4096, 0), 0, "{}", last_error());
        assert_eq!(pmcache_trim(h, 1 << 20, 4096, PMCACHE_FUA), 0, "{}", last_error());
        assert_eq!(pmcache_flush(h), 0, "{}", last_error());
    }
    assert_eq!(read(h, 8192, &mut back), 0, "{}", last_error());
    assert!(back[..4096].iter().all(|&b| b == 0));
    assert_eq!(back[4096..], data[4096..]);

    let ours = stats(cache);
    assert_eq!(ours["handles_open"], 1, "{ours}");
    assert_eq!(ours["handles_max"], 2, "{ours}");
    assert_eq!(ours["medium"], "volatile", "{ours}");
    let control = pmcache_serve::control::default_control_path(&place.cache_path());
    let mut reply = String::new();
    pmcache_serve::control::request(&control, "stats", |line| reply = line.to_owned())
        .expect("stats on the control socket");
    let theirs: serde_json::Value = serde_json::from_str(&reply).expect("JSON");
    assert_eq!(theirs["handles_open"], 1, "{theirs}");
    assert_eq!(theirs["slot_count"], ours["slot_count"], "{theirs}");
    // SAFETY: an open cache.
    assert!(!unsafe { pmcache_stop_requested(cache) });

    close_handle(h);
    // A handle's read latencies are counted once it closes (or every 4096 reads).
    let after = stats(cache);
    assert_eq!(after["handles_open"], 0, "{after}");
    assert_eq!(after["handles_opened"], 1, "{after}");
    assert!(after["read_hit_latency_count"].as_u64() >= Some(1), "{after}");
    assert!(after["read_miss_latency_count"].as_u64() >= Some(1), "{after}");
    close(cache);
    assert!(!control.exists(), "the control socket stayed after a clean close");
    // The volatile medium was written back: the backing file holds the data.
    let on_disk = std::fs::read(place.backing_path()).expect("the backing file");
    assert_eq!(on_disk[8192 + 4096..8192 + 8192], data[4096..]);

    let cache = open(&place.config()).expect("the cache again");
    let h = handle(cache).expect("a handle");
    assert_eq!(read(h, 8192 + 4096, &mut back[..4096]), 0, "{}", last_error());
    assert_eq!(back[..4096], data[4096..]);
    close_handle(h);
    close(cache);
}

/// Requests a frontend would refuse are refused with EINVAL and say why.
#[test]
fn requests_out_of_shape_are_refused_with_einval() {
    let place = Place::new();
    let cache = open(&place.config()).expect("a cache");
    let h = handle(cache).expect("a handle");
    let size = 16u64 << 20;
    let mut buf = vec![0u8; 8192];
    for (offset, len, said) in [
        (1, 4096, "multiples of the block size"),
        (0, 100, "multiples of the block size"),
        (0, 0, "a request of 0 bytes"),
        (size, 4096, "past the end of the device"),
        (size - 4096, 8192, "past the end of the device"),
        (u64::MAX - 4095, 8192, "past the end of the device"),
    ] {
        let len = len as usize;
        assert_eq!(read(h, offset, &mut buf[..len]), -libc::EINVAL, "read {len} at {offset}");
        assert!(last_error().contains(said), "{}", last_error());
        assert_eq!(write(h, offset, &buf[..len], 0), -libc::EINVAL, "write {len} at {offset}");
        assert!(last_error().starts_with("pmcache_write: "), "{}", last_error());
        // SAFETY: an open handle used by this thread alone.
        unsafe {
            assert_eq!(pmcache_trim(h, offset, len as u64, 0), -libc::EINVAL);
            assert!(last_error().contains(said), "{}", last_error());
            assert_eq!(pmcache_write_zeroes(h, offset, len as u64, 0), -libc::EINVAL);
            assert!(last_error().contains(said), "{}", last_error());
        }
    }
    assert_eq!(write(h, 0, &buf[..4096], 2), -libc::EINVAL);
    assert!(last_error().contains("unknown flags 0x2"), "{}", last_error());
    // SAFETY: an open handle; a NULL buffer is refused before it is used.
    let null = unsafe { pmcache_read(h, 0, ptr::null_mut(), 4096) };
    assert_eq!(null, -libc::EINVAL);
    assert!(last_error().contains("buf is NULL"), "{}", last_error());
    close_handle(h);
    close(cache);
}

/// `pmcache_close` refuses while a handle is open, changing nothing; handles beyond `lanes`
/// are refused.
#[test]
fn a_cache_with_handles_open_is_not_closed_and_lanes_bound_the_handles() {
    let place = Place::new();
    let cache = open(&place.config()).expect("a cache");
    let (first, second) = (handle(cache).expect("a handle"), handle(cache).expect("another"));
    let third = handle(cache).expect_err("a third handle of two lanes");
    assert!(third.contains("all 2 handles are open"), "{third}");
    assert_eq!(std::io::Error::last_os_error().raw_os_error(), Some(libc::EBUSY));
    assert_eq!(last_error(), third);
    // SAFETY: an open cache; refused, it stays open.
    assert_eq!(unsafe { pmcache_close(cache) }, -libc::EBUSY);
    assert!(last_error().contains("2 handles are still open"), "{}", last_error());
    close_handle(first);
    // SAFETY: as above.
    assert_eq!(unsafe { pmcache_close(cache) }, -libc::EBUSY);
    assert_eq!(write(second, 0, &[7u8; 4096], 0), 0, "{}", last_error());
    close_handle(second);
    close(cache);
}

/// A cache open here is refused to a second open, by its control socket, and with another
/// control socket by its medium's lock.
#[test]
fn a_second_open_of_a_live_cache_is_refused() {
    let place = Place::new();
    let cache = open(&place.config()).expect("a cache");
    let refused = open(&place.config()).expect_err("a second open");
    assert!(refused.contains("in use: another pmcache server runs on this cache"), "{refused}");
    let other_control = c_path(&place.shm.path().join("other.ctl"));
    let refused = open(&PmcacheConfig { control_path: other_control.as_ptr(), ..place.config() })
        .expect_err("a second open with its own control socket");
    assert!(refused.contains(&*place.cache_path().to_string_lossy()), "{refused}");
    close(cache);
    // Closed, it opens again.
    close(open(&place.config()).expect("the cache, closed"));
}

/// A backing store that is not there (and not to be created) is named, and nothing is left
/// behind; a backing file created for an open that fails is removed.
#[test]
fn a_missing_backing_store_is_named() {
    let place = Place::new();
    let refused = open(&PmcacheConfig { backing_bytes: 0, ..place.config() })
        .expect_err("a cache of no backing store");
    let backing = place.backing_path().to_string_lossy().into_owned();
    assert!(refused.contains(&backing), "{refused}");
    assert!(!place.cache_path().exists(), "a medium was left behind");
    let nowhere = c_path(&place.shm.path().join("missing/cache.pm"));
    let refused = open(&PmcacheConfig { cache_path: nowhere.as_ptr(), ..place.config() })
        .expect_err("a medium in a directory that does not exist");
    assert!(refused.contains("does not exist"), "{refused}");
    assert!(!place.backing_path().exists(), "the backing file created was left behind");
}

/// The config's size, paths and mode are checked before anything is opened.
#[test]
fn a_config_out_of_shape_is_refused() {
    let place = Place::new();
    let too_small = open(&PmcacheConfig { size: 8, ..place.config() }).expect_err("size 8");
    assert!(too_small.contains("set it to sizeof(struct pmcache_config)"), "{too_small}");
    let no_cache = open(&PmcacheConfig { cache_path: ptr::null(), ..place.config() })
        .expect_err("no cache path");
    assert!(no_cache.contains("cache_path and config.backing_path are required"), "{no_cache}");
    let mode = open(&PmcacheConfig { mode: 9, ..place.config() }).expect_err("mode 9");
    assert!(mode.contains("config.mode is 9"), "{mode}");
    assert_eq!(std::io::Error::last_os_error().raw_os_error(), Some(libc::EINVAL));
    // SAFETY: a NULL config is refused before it is read; so is a NULL `err`.
    assert!(unsafe { pmcache_open(ptr::null(), ptr::null_mut(), 0) }.is_null());
    assert!(last_error().contains("config is NULL"), "{}", last_error());

    /// A struct pmcache_config of a newer header: a field more.
    #[repr(C)]
    struct Newer {
        config: PmcacheConfig,
        more: u64,
    }
    let newer =
        |more| Newer { config: PmcacheConfig { size: size_of::<Newer>(), ..place.config() }, more };
    let set = newer(1);
    let mut err = [0 as c_char; 512];
    // SAFETY: a config of `size` bytes, whose first are a `PmcacheConfig`; a buffer of
    // `err.len()` bytes.
    let refused = unsafe { pmcache_open(&set.config, err.as_mut_ptr(), err.len()) };
    assert!(refused.is_null());
    assert!(last_error().contains("newer pmcache.h"), "{}", last_error());
    let unset = newer(0);
    // SAFETY: as above.
    let cache = unsafe { pmcache_open(&unset.config, err.as_mut_ptr(), err.len()) };
    assert!(!cache.is_null(), "{}", last_error());
    close(cache);
}

/// NULL is refused everywhere, and a message is cut to the buffer it is given.
#[test]
fn null_pointers_are_refused_and_messages_fit_their_buffer() {
    // SAFETY: NULL is refused before anything is read.
    unsafe {
        assert_eq!(pmcache_close(ptr::null_mut()), -libc::EINVAL);
        assert_eq!(pmcache_handle_close(ptr::null_mut()), -libc::EINVAL);
        assert_eq!(pmcache_flush(ptr::null_mut()), -libc::EINVAL);
        assert!(last_error().contains("pmcache_flush: handle is NULL"), "{}", last_error());
        assert_eq!(pmcache_size_bytes(ptr::null()), 0);
        assert!(pmcache_stats_json(ptr::null()).is_null());
        assert!(pmcache_handle_open(ptr::null_mut(), ptr::null_mut(), 0).is_null());
        pmcache_string_free(ptr::null_mut());
    }
    let mut err = [0x55 as c_char; 8];
    // SAFETY: a NULL config; a buffer of `err.len()` bytes.
    assert!(unsafe { pmcache_open(ptr::null(), err.as_mut_ptr(), err.len()) }.is_null());
    // SAFETY: NUL-terminated within `err`.
    let cut = unsafe { CStr::from_ptr(err.as_ptr()) }.to_str().expect("UTF-8");
    assert_eq!(cut, "pmcache");
}

/// A `pmcache detach` on the control socket asks the program to close; the close then
/// detaches: every block written back, the cache's copies dropped, the cache marked clean.
#[test]
fn a_detach_on_the_control_socket_asks_the_program_to_close() {
    let place = Place::new();
    let cache = open(&place.config()).expect("a cache");
    let h = handle(cache).expect("a handle");
    assert_eq!(write(h, 0, &[9u8; 4096], 0), 0, "{}", last_error());
    let control = pmcache_serve::control::default_control_path(&place.cache_path());
    let mut replies = Vec::new();
    pmcache_serve::control::request(&control, "detach", |line| replies.push(line.to_owned()))
        .expect("detach on the control socket");
    assert_eq!(replies, ["detaching"]);
    // SAFETY: an open cache.
    assert!(unsafe { pmcache_stop_requested(cache) });
    // The handle still works until the program closes it.
    let mut back = [0u8; 4096];
    assert_eq!(read(h, 0, &mut back), 0, "{}", last_error());
    assert_eq!(back, [9u8; 4096]);
    close_handle(h);
    close(cache);
    assert!(!control.exists(), "the control socket stayed after the detach");
    let on_disk = std::fs::read(place.backing_path()).expect("the backing file");
    assert_eq!(on_disk[..4096], [9u8; 4096]);
    // Detached: the cache holds no copy of the block any more.
    let cache = open(&place.config()).expect("the cache again");
    assert_eq!(stats(cache)["dirty_slots"], 0);
    let h = handle(cache).expect("a handle");
    assert_eq!(read(h, 0, &mut back), 0, "{}", last_error());
    close_handle(h);
    let reread = stats(cache);
    assert_eq!(reread["read_hits"], 0, "{reread}");
    close(cache);
}

/// The mode asked for is the mode served.
#[test]
fn the_mode_asked_for_is_served() {
    let place = Place::new();
    let through = PmcacheConfig { mode: PmcacheMode::WriteThrough as u32, ..place.config() };
    let cache = open(&through).expect("a write-through cache");
    assert_eq!(stats(cache)["mode"], "writethrough");
    let h = handle(cache).expect("a handle");
    assert_eq!(write(h, 4096, &[3u8; 4096], 0), 0, "{}", last_error());
    // Written through: on the backing file before any close.
    let on_disk = std::fs::read(place.backing_path()).expect("the backing file");
    assert_eq!(on_disk[4096..8192], [3u8; 4096]);
    close_handle(h);
    close(cache);
}
