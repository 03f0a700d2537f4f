//! The attachment state of a backing store served with a cache on a volatile medium (a file on
//! tmpfs, ramfs or hugetlbfs, such as the embedded default in /dev/shm): which cache it is attached to,
//! and whether that cache may hold blocks the backing store lacks. The record lives outside
//! the medium (beside the backing file by default), so that it survives what the medium does
//! not — a reboot — and `serve` can refuse to put a fresh cache over a backing store whose
//! newest blocks were lost with the old one (docs/DURABILITY.md, "Stop and lost volatile
//! media").
//!
//! The file is a few `key=value` lines:
//!
//! ```text
//! # pmcache attachment state (docs/DURABILITY.md, "Stop and lost volatile media")
//! format=2
//! backing=/srv/pmcache-data/backing.img
//! backing_id=file-inode-1835011-born-1767225600.123456789
//! cache=/dev/shm/pmcache-default.pm
//! cache_uuid=5f0c...e1
//! cache_volatile=true
//! backing_stale=true
//! updated_unix_secs=1767225600
//! ```
//!
//! `backing_id` is the backing store's identity (`crate::backing_id`): the record of a file
//! lives beside it under its canonical path and is found after a rename in its directory by
//! that inode and birth time; the record of a block device lives under the state directory
//! (`/var/lib/pmcache`, `--state-dir`), named after the device's persistent name, so that it
//! is found whichever node names the device after a reboot. Format 1 (no `backing_id`) is
//! still read.
//!
//! `backing_stale=true`: the cache may hold blocks not yet written back (written when `serve`
//! attaches, before any client connects); `false`: the backing store holds every block (written
//! after a stop or detach wrote every dirty block back and marked the cache clean). It is
//! replaced atomically: a temporary file, fsync, rename, fsync of the directory.

use std::io::Write;
use std::os::unix::fs::MetadataExt;
use std::path::{Path, PathBuf};

use pmcache_engine::format::{SUPERBLOCK_BYTES, Superblock, hex};

use crate::backing_id::BackingId;

/// The state file's format version (1: without `backing_id`, still read).
const STATE_FORMAT: u32 = 2;
/// The file name suffix of a state file.
const STATE_SUFFIX: &str = ".pmcache-state";
/// Where the state of a backing store that is not a regular file (a block device) is kept by
/// default (`--state-dir`): /dev is itself a tmpfs (devtmpfs), lost at a reboot like the cache.
pub const DEVICE_STATE_DIR: &str = "/var/lib/pmcache";

/// Where a backing store's state record is: found by its identity ([`BackingId`]).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Located {
    /// Where the record is written.
    pub path: PathBuf,
    /// Where the record was found, if not at `path` (a backing file renamed in its
    /// directory): read from there, and moved to `path` when it is next written.
    pub found_at: Option<PathBuf>,
    /// The backing store's key (`backing_id=`), when its identity could be read.
    pub backing_id: Option<String>,
    /// What to tell the operator about the key (a device without a persistent name).
    pub warning: Option<String>,
}

impl Located {
    /// The record at `path`, given by `--state-file`.
    pub fn given(path: &Path, backing: &Path) -> Located {
        let backing_id = BackingId::of(backing).ok().map(|id| id.key());
        Located { path: path.to_path_buf(), found_at: None, backing_id, warning: None }
    }

    /// Where the record is read from.
    pub fn read_path(&self) -> &Path {
        self.found_at.as_deref().unwrap_or(&self.path)
    }

    /// Writes `record` at `path`, and removes the record it was found at elsewhere.
    pub fn store(&self, record: &Record) -> Result<(), String> {
        store(&self.path, record)?;
        match &self.found_at {
            Some(old) => remove(old),
            None => Ok(()),
        }
    }
}

/// The state record of the backing store at `backing` (see the module): beside a regular file
/// (`<canonical path>.pmcache-state`, or a record in its directory that names its inode); for
/// a block device `<state_dir>/<persistent name>.pmcache-state` (`state_dir` defaults to
/// /var/lib/pmcache). A path that cannot be read (not there yet) is named as given.
pub fn locate(backing: &Path, state_dir: Option<&Path>) -> Located {
    let suffixed = |path: &Path| {
        let mut name = path.as_os_str().to_owned();
        name.push(STATE_SUFFIX);
        PathBuf::from(name)
    };
    let is_rbd = backing.to_str().is_some_and(pmcache_backing::RbdSpec::is_rbd);
    let Ok(id) = BackingId::of(backing) else {
        if is_rbd {
            // The cluster could not be reached: the record is named after the spec, and opening
            // the image says why it cannot be reached.
            let dir = state_dir.unwrap_or(Path::new(DEVICE_STATE_DIR));
            let name = format!("rbd-spec-{}{STATE_SUFFIX}", crate::backing_id::escape(backing));
            return Located {
                path: dir.join(name),
                found_at: None,
                backing_id: None,
                warning: None,
            };
        }
        return Located {
            path: suffixed(backing),
            found_at: None,
            backing_id: None,
            warning: None,
        };
    };
    let key = id.key();
    match &id {
        BackingId::File { canonical, .. } => {
            let path = suffixed(canonical);
            let legacy = id.legacy_key();
            let found_at = if path.exists() {
                None
            } else {
                canonical.parent().and_then(|dir| find_by_id(dir, &key, legacy.as_deref()))
            };
            Located { path, found_at, backing_id: Some(key), warning: None }
        }
        BackingId::Rbd { .. } => {
            let dir = state_dir.unwrap_or(Path::new(DEVICE_STATE_DIR));
            Located {
                path: dir.join(format!("{key}{STATE_SUFFIX}")),
                found_at: None,
                backing_id: Some(key),
                warning: None,
            }
        }
        BackingId::Device { stable, .. } => {
            let dir = state_dir.unwrap_or(Path::new(DEVICE_STATE_DIR));
            let warning = (!stable).then(|| {
                format!(
                    "{} has no persistent name (no device-mapper UUID, loop file, WWID or \
                     /dev/disk/by-id link): its state record is named after this path, which \
                     may name another device after a reboot; give --state-file to keep it \
                     elsewhere",
                    backing.display()
                )
            });
            let path = dir.join(format!("{key}{STATE_SUFFIX}"));
            Located { path, found_at: None, backing_id: Some(key), warning }
        }
    }
}

/// A state record in `dir` whose `backing_id` is `key`, or `legacy` (the same file's key in a
/// record that predates birth times).
fn find_by_id(dir: &Path, key: &str, legacy: Option<&str>) -> Option<PathBuf> {
    std::fs::read_dir(dir)
        .ok()?
        .filter_map(|entry| entry.ok())
        .map(|entry| entry.path())
        .filter(|path| path.to_string_lossy().ends_with(STATE_SUFFIX))
        .find(|path| {
            let id = load(path).ok().flatten().and_then(|record| record.backing_id);
            id.as_deref() == Some(key) || (legacy.is_some() && id.as_deref() == legacy)
        })
}

/// `path` made absolute: canonical if it exists, else its canonical directory joined with its
/// name (or the current directory joined with it).
pub fn absolute(path: &Path) -> PathBuf {
    if path.to_str().is_some_and(pmcache_backing::RbdSpec::is_rbd) {
        return path.to_path_buf();
    }
    if let Ok(canonical) = std::fs::canonicalize(path) {
        return canonical;
    }
    let (Some(dir), Some(name)) = (path.parent(), path.file_name()) else {
        return path.to_path_buf();
    };
    let dir = if dir.as_os_str().is_empty() { Path::new(".") } else { dir };
    match std::fs::canonicalize(dir) {
        Ok(dir) => dir.join(name),
        Err(_) => std::env::current_dir().map(|cwd| cwd.join(path)).unwrap_or(path.to_path_buf()),
    }
}

/// One attachment: a backing store, the cache in front of it, and whether the backing store
/// may lack blocks that only the cache holds.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Record {
    /// The backing store (absolute path).
    pub backing: PathBuf,
    /// The backing store's identity (`crate::backing_id`); `None` in a format 1 record.
    pub backing_id: Option<String>,
    /// The cache medium (absolute path).
    pub cache: PathBuf,
    /// The cache's identity: its superblock's uuid.
    pub cache_uuid: [u8; 16],
    /// The medium does not survive a reboot (tmpfs, ramfs, hugetlbfs).
    pub cache_volatile: bool,
    /// The cache may hold blocks the backing store lacks (dirty, or written since the last
    /// complete write-back).
    pub backing_stale: bool,
    /// When the record was written (seconds since the Unix epoch).
    pub updated_unix_secs: u64,
}

impl Record {
    /// The file's text.
    pub fn encode(&self) -> String {
        format!(
            "# pmcache attachment state (docs/DURABILITY.md, \"Stop and lost volatile media\")\n\
             format={STATE_FORMAT}\nbacking={}\n{}cache={}\ncache_uuid={}\ncache_volatile={}\n\
             backing_stale={}\nupdated_unix_secs={}\n",
            self.backing.display(),
            self.backing_id.as_ref().map(|id| format!("backing_id={id}\n")).unwrap_or_default(),
            self.cache.display(),
            hex(&self.cache_uuid),
            self.cache_volatile,
            self.backing_stale,
            self.updated_unix_secs
        )
    }

    /// Parses the file's text: every key above, in any order; comments, blank lines and
    /// unknown keys are skipped.
    pub fn parse(text: &str) -> Result<Record, String> {
        let mut fields = std::collections::HashMap::new();
        for (number, line) in text.lines().enumerate() {
            let line = line.trim();
            if line.is_empty() || line.starts_with('#') {
                continue;
            }
            let (key, value) = line
                .split_once('=')
                .ok_or_else(|| format!("line {} is not KEY=VALUE: {line:?}", number + 1))?;
            if fields.insert(key.trim(), value.trim()).is_some() {
                return Err(format!("{} is given twice", key.trim()));
            }
        }
        let field = |key: &str| fields.get(key).copied().ok_or_else(|| format!("no {key}"));
        let flag = |key: &str| match field(key)? {
            "true" => Ok(true),
            "false" => Ok(false),
            other => Err(format!("{key}={other} is neither true nor false")),
        };
        let format = field("format")?;
        if format != "1" && format != STATE_FORMAT.to_string() {
            return Err(format!("format {format} is neither 1 nor {STATE_FORMAT}"));
        }
        let uuid = field("cache_uuid")?;
        let cache_uuid =
            parse_uuid(uuid).ok_or_else(|| format!("cache_uuid={uuid} is not 32 hex digits"))?;
        let secs = field("updated_unix_secs")?;
        Ok(Record {
            backing: PathBuf::from(field("backing")?),
            backing_id: field("backing_id").ok().map(str::to_owned),
            cache: PathBuf::from(field("cache")?),
            cache_uuid,
            cache_volatile: flag("cache_volatile")?,
            backing_stale: flag("backing_stale")?,
            updated_unix_secs: secs
                .parse()
                .map_err(|_| format!("updated_unix_secs={secs} is not a number"))?,
        })
    }
}

fn parse_uuid(text: &str) -> Option<[u8; 16]> {
    if text.len() != 32 || !text.is_ascii() {
        return None;
    }
    let mut uuid = [0u8; 16];
    for (i, byte) in uuid.iter_mut().enumerate() {
        *byte = u8::from_str_radix(&text[2 * i..2 * i + 2], 16).ok()?;
    }
    Some(uuid)
}

/// Seconds since the Unix epoch.
pub fn now_unix_secs() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_secs())
        .unwrap_or(0)
}

/// Reads the state file: `None` if there is none.
pub fn load(path: &Path) -> Result<Option<Record>, String> {
    match std::fs::read_to_string(path) {
        Ok(text) => Record::parse(&text)
            .map(Some)
            .map_err(|e| format!("the state file {} cannot be read: {e}", path.display())),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(None),
        Err(e) => Err(format!("the state file {}: {e}", path.display())),
    }
}

/// Replaces the state file atomically: the record into a temporary file beside it, fsync,
/// rename over the file, fsync of the directory.
pub fn store(path: &Path, record: &Record) -> Result<(), String> {
    let describe = |what: &str, e: std::io::Error| {
        format!("writing the state file {} ({what}): {e}", path.display())
    };
    let dir = match path.parent() {
        Some(dir) if !dir.as_os_str().is_empty() => dir.to_path_buf(),
        _ => PathBuf::from("."),
    };
    if !dir.is_dir() {
        std::fs::create_dir_all(&dir).map_err(|e| describe("creating its directory", e))?;
    }
    let mut temp_name = path.file_name().unwrap_or_default().to_owned();
    temp_name.push(format!(".tmp{}", std::process::id()));
    let temp = dir.join(temp_name);
    let written = std::fs::File::create(&temp)
        .and_then(|mut file| {
            file.write_all(record.encode().as_bytes())?;
            file.sync_all()
        })
        .map_err(|e| describe("temporary file", e));
    if let Err(e) = written {
        let _ = std::fs::remove_file(&temp);
        return Err(e);
    }
    if let Err(e) = std::fs::rename(&temp, path) {
        let _ = std::fs::remove_file(&temp);
        return Err(describe("rename", e));
    }
    std::fs::File::open(&dir).and_then(|d| d.sync_all()).map_err(|e| describe("directory sync", e))
}

/// Removes the state file (and syncs its directory); a missing file is fine.
pub fn remove(path: &Path) -> Result<(), String> {
    match std::fs::remove_file(path) {
        Err(e) if e.kind() != std::io::ErrorKind::NotFound => {
            return Err(format!("removing the state file {}: {e}", path.display()));
        }
        _ => {}
    }
    if let Some(dir) = path.parent().filter(|d| !d.as_os_str().is_empty()) {
        let _ = std::fs::File::open(dir).and_then(|d| d.sync_all());
    }
    Ok(())
}

/// Marks the backing store complete (`backing_stale=false`) in the state file at `path`, if it
/// records the cache at `cache` with `uuid`: after every dirty block was written back and the
/// cache marked clean. Anything else recorded there is left alone. Returns whether it wrote.
pub fn mark_backing_complete(path: &Path, cache: &Path, uuid: [u8; 16]) -> Result<bool, String> {
    let Some(record) = load(path)? else { return Ok(false) };
    if record.cache_uuid != uuid || !same_file(&record.cache, cache) || !record.backing_stale {
        return Ok(false);
    }
    store(path, &Record { backing_stale: false, updated_unix_secs: now_unix_secs(), ..record })
        .map(|()| true)
}

/// Whether two paths name the same file (by device and inode where both exist, else by
/// absolute path).
pub fn same_file(a: &Path, b: &Path) -> bool {
    match (std::fs::metadata(a), std::fs::metadata(b)) {
        (Ok(x), Ok(y)) => x.dev() == y.dev() && x.ino() == y.ino(),
        _ => absolute(a) == absolute(b),
    }
}

/// What a cache medium's path holds now.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum MediumNow {
    /// No file.
    Missing,
    /// An empty file (re-created).
    Empty,
    /// No pmcache superblock (zeroes, foreign data, or unreadable).
    NoCache,
    /// A pmcache cache with this uuid.
    Cache([u8; 16]),
}

/// Reads what the medium at `path` holds, by its superblock (a plain read, nothing written).
pub fn probe_medium(path: &Path) -> MediumNow {
    use std::io::{Read, Seek, SeekFrom};
    let Ok(mut file) = std::fs::File::open(path) else {
        return if path.exists() { MediumNow::NoCache } else { MediumNow::Missing };
    };
    // The end, not the metadata's length: a device node has 0.
    let Ok(len_bytes) = file.seek(SeekFrom::End(0)) else { return MediumNow::NoCache };
    if len_bytes == 0 {
        return MediumNow::Empty;
    }
    let mut head = vec![0u8; SUPERBLOCK_BYTES.min(len_bytes) as usize];
    if file.seek(SeekFrom::Start(0)).and_then(|_| file.read_exact(&mut head)).is_err() {
        return MediumNow::NoCache;
    }
    match Superblock::decode(&head, len_bytes) {
        Ok(superblock) => MediumNow::Cache(superblock.uuid),
        Err(_) => MediumNow::NoCache,
    }
}

/// Why `serve` refuses to start over a backing store.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Refusal {
    /// The volatile cache that may hold the backing store's newest blocks is gone.
    CacheLost(MediumNow),
    /// That cache is still there, but another cache was asked for.
    OtherCacheHoldsDirtyBlocks,
}

/// The start-up decision on a recorded attachment: `recorded_now` is what the recorded medium
/// holds now, `same_medium` whether it is the medium `serve` was given. Refused only when the
/// record says the backing store may be stale in a volatile cache and that cache is not the
/// one being attached.
pub fn check(record: &Record, recorded_now: MediumNow, same_medium: bool) -> Result<(), Refusal> {
    if !record.backing_stale || !record.cache_volatile {
        return Ok(());
    }
    match recorded_now {
        MediumNow::Cache(uuid) if uuid == record.cache_uuid => {
            if same_medium {
                Ok(())
            } else {
                Err(Refusal::OtherCacheHoldsDirtyBlocks)
            }
        }
        // The medium given still holds something that is not a cache (its superblock page
        // lost, say, with the dirty entries still behind it): the attach refuses it with its
        // own message, never formatting it, and that message says more.
        MediumNow::NoCache if same_medium => Ok(()),
        now => Err(Refusal::CacheLost(now)),
    }
}

/// The message for a refusal: what happened, what is lost, how to go on.
pub fn refusal_message(refusal: &Refusal, record: &Record, state: &Path, cache: &Path) -> String {
    let recorded = record.cache.display();
    let uuid = hex(&record.cache_uuid);
    let backing = record.backing.display();
    match refusal {
        Refusal::CacheLost(now) => {
            let what = match now {
                MediumNow::Missing => "the medium file no longer exists".to_string(),
                MediumNow::Empty => "the medium file is empty (re-created)".to_string(),
                MediumNow::NoCache => "the medium holds no pmcache superblock".to_string(),
                MediumNow::Cache(other) => {
                    format!("the medium now holds another cache (uuid {})", hex(other))
                }
            };
            format!(
                "refusing to start: the state file {} records that {backing} was served through \
                 the cache {recorded} (uuid {uuid}) on a volatile medium, with blocks that may \
                 not have been written back, and that cache is gone: {what} (a reboot, or the \
                 file was removed). The blocks that were dirty in it are lost: {backing} holds \
                 older data for them, and what is on it (a file system, say) may be \
                 inconsistent. Nothing was changed. To start anyway with a new cache over the \
                 backing store as it is, pass --accept-stale-backing (then check what it holds, \
                 e.g. with fsck)",
                state.display()
            )
        }
        Refusal::OtherCacheHoldsDirtyBlocks => format!(
            "refusing to start: the state file {} records that {backing} is attached to the \
             cache {recorded} (uuid {uuid}) on a volatile medium, which may hold blocks not yet \
             written back and is still there; serving the backing store through {} would \
             bypass them. Serve with --cache {recorded}, or write them back first with \
             `pmcache detach --cache {recorded} --backing {backing}`. Nothing was changed \
             (--accept-stale-backing starts anyway and abandons those blocks)",
            state.display(),
            cache.display()
        ),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn record() -> Record {
        Record {
            backing: PathBuf::from("/srv/data/backing.img"),
            backing_id: Some("file-inode-1835011".into()),
            cache: PathBuf::from("/dev/shm/cache.pm"),
            cache_uuid: [0xab; 16],
            cache_volatile: true,
            backing_stale: true,
            updated_unix_secs: 1_767_225_600,
        }
    }

    #[test]
    fn a_record_round_trips_and_bad_ones_are_named() {
        let r = record();
        let text = r.encode();
        assert!(text.contains("backing_stale=true\n"), "{text}");
        assert!(text.contains(&format!("cache_uuid={}\n", "ab".repeat(16))), "{text}");
        assert_eq!(Record::parse(&text), Ok(r.clone()));
        // Order, blank lines, comments and unknown keys do not matter.
        let mut lines: Vec<&str> = text.lines().collect();
        lines.reverse();
        let shuffled = format!("\n# note\n{}\nfuture_key=1\n", lines.join("\n"));
        assert_eq!(Record::parse(&shuffled), Ok(r));
        let broken = [
            (text.replace("backing_stale=true", "backing_stale=maybe"), "neither true nor false"),
            (text.replace("format=2", "format=3"), "format 3 is neither 1 nor 2"),
            (text.replace("cache_uuid=abab", "cache_uuid=zzab"), "not 32 hex digits"),
            (text.replace("cache=/dev/shm/cache.pm\n", ""), "no cache"),
            (format!("{text}cache=/x\n"), "cache is given twice"),
            (format!("{text}garbage\n"), "is not KEY=VALUE"),
        ];
        for (text, why) in broken {
            let err = Record::parse(&text).expect_err(why);
            assert!(err.contains(why), "{err} (expected {why})");
        }
    }

    #[test]
    fn serve_refuses_only_a_stale_backing_store_whose_volatile_cache_is_not_attached() {
        let r = record();
        let same = MediumNow::Cache(r.cache_uuid);
        // The recorded cache is there and is the one attached: it recovers the dirty blocks.
        assert_eq!(check(&r, same, true), Ok(()));
        // It is there, and another medium was asked for.
        assert_eq!(check(&r, same, false), Err(Refusal::OtherCacheHoldsDirtyBlocks));
        // It is gone, however it went.
        for now in
            [MediumNow::Missing, MediumNow::Empty, MediumNow::NoCache, MediumNow::Cache([1; 16])]
        {
            assert_eq!(check(&r, now, false), Err(Refusal::CacheLost(now)));
            if now != MediumNow::NoCache {
                assert_eq!(check(&r, now, true), Err(Refusal::CacheLost(now)));
            }
        }
        // The medium given holds no superblock: left to the attach, which refuses it without
        // formatting.
        assert_eq!(check(&r, MediumNow::NoCache, true), Ok(()));
        // A backing store recorded complete, or a cache recorded persistent, starts anyway.
        let complete = Record { backing_stale: false, ..r.clone() };
        let persistent = Record { cache_volatile: false, ..r.clone() };
        for r in [complete, persistent] {
            assert_eq!(check(&r, MediumNow::Missing, false), Ok(()));
        }
        let message = refusal_message(
            &Refusal::CacheLost(MediumNow::Missing),
            &record(),
            Path::new("/srv/data/backing.img.pmcache-state"),
            Path::new("/dev/shm/cache.pm"),
        );
        for part in [
            "refusing to start",
            "/srv/data/backing.img.pmcache-state",
            "the medium file no longer exists",
            "are lost",
            "Nothing was changed",
            "--accept-stale-backing",
        ] {
            assert!(message.contains(part), "{part}: {message}");
        }
    }

    #[test]
    fn the_state_file_is_replaced_atomically_and_marked_complete_for_its_cache_only() {
        let dir = std::env::temp_dir().join(format!("pmcache-state-test-{}", std::process::id()));
        std::fs::create_dir_all(&dir).expect("dir");
        let cache = dir.join("cache.pm");
        std::fs::write(&cache, b"medium").expect("cache");
        let path = dir.join("backing.img.pmcache-state");
        assert_eq!(load(&path), Ok(None));
        let r = Record { cache: cache.clone(), ..record() };
        store(&path, &r).expect("store");
        assert_eq!(load(&path), Ok(Some(r.clone())));
        let leftovers: Vec<_> = std::fs::read_dir(&dir)
            .expect("list")
            .filter_map(|e| e.ok())
            .filter(|e| e.file_name().to_string_lossy().contains(".tmp"))
            .collect();
        assert!(leftovers.is_empty(), "temporary files left: {leftovers:?}");
        // Another cache's uuid, or another medium: left alone.
        assert_eq!(mark_backing_complete(&path, &cache, [1; 16]), Ok(false));
        assert_eq!(mark_backing_complete(&path, &dir.join("other.pm"), r.cache_uuid), Ok(false));
        assert!(load(&path).expect("load").expect("record").backing_stale);
        assert_eq!(mark_backing_complete(&path, &cache, r.cache_uuid), Ok(true));
        let marked = load(&path).expect("load").expect("record");
        assert!(!marked.backing_stale && marked.cache == cache, "{marked:?}");
        std::fs::write(&path, "format=1\n").expect("truncated");
        assert!(load(&path).expect_err("refused").contains("cannot be read: no cache_uuid"));
        remove(&path).expect("remove");
        remove(&path).expect("remove again");
        let _ = std::fs::remove_dir_all(&dir);
    }

    #[test]
    fn a_format_1_record_is_still_read() {
        let text = record()
            .encode()
            .replace("format=2", "format=1")
            .replace("backing_id=file-inode-1835011\n", "");
        assert_eq!(Record::parse(&text), Ok(Record { backing_id: None, ..record() }));
    }

    /// A file's record is beside it under its canonical path (a symlink finds it); after a
    /// rename in its directory it is found by the inode it names, and moved beside the file
    /// when next written. A path that is not there is named as given.
    #[test]
    fn a_files_record_is_found_through_a_symlink_and_after_a_rename() {
        let dir = tempfile::tempdir().expect("tempdir");
        let file = dir.path().join("backing.img");
        std::fs::write(&file, b"data").expect("backing");
        let link = dir.path().join("link.img");
        std::os::unix::fs::symlink(&file, &link).expect("link");
        let located = locate(&file, None);
        let canonical = std::fs::canonicalize(&file).expect("canonical");
        assert_eq!(located.path, PathBuf::from(format!("{}.pmcache-state", canonical.display())));
        assert_eq!(locate(&link, None), located);
        let r = Record { backing_id: located.backing_id.clone(), ..record() };
        located.store(&r).expect("store");

        let renamed = dir.path().join("renamed.img");
        std::fs::rename(&file, &renamed).expect("rename");
        let after = locate(&renamed, None);
        assert_eq!(after.read_path(), located.path, "found by its inode");
        assert_eq!(load(after.read_path()), Ok(Some(r.clone())));
        after.store(&r).expect("store");
        assert!(!located.path.exists(), "the old record stays");
        assert_eq!(locate(&renamed, None).read_path(), after.path);

        let missing = dir.path().join("none.img");
        assert_eq!(locate(&missing, None).path, dir.path().join("none.img.pmcache-state"));
    }

    /// A deleted file's record does not follow a later file that the file system gave the
    /// deleted one's inode number: the record also names its file's birth time. (The later
    /// file is stood in for by a record naming this inode with another birth time.) A record
    /// written before birth times were kept, naming the inode alone, is still followed.
    #[test]
    fn a_deleted_files_record_does_not_follow_a_new_file_with_its_inode() {
        let dir = tempfile::tempdir().expect("tempdir");
        let file = dir.path().join("new.img");
        std::fs::write(&file, b"data").expect("backing");
        let id = BackingId::of(&file).expect("id");
        let BackingId::File { inode, born, .. } = &id else { panic!("a file: {id:?}") };
        let (secs, nanos) =
            born.unwrap_or_else(|| panic!("{} keeps birth times", dir.path().display()));
        assert_eq!(id.key(), format!("file-inode-{inode}-born-{secs}.{nanos:09}"));
        // What a record written for this file names: not the inode alone.
        let written = Record { backing_id: locate(&file, None).backing_id, ..record() };
        assert_eq!(written.backing_id, Some(id.key()));
        let old = dir.path().join("deleted.img.pmcache-state");
        let stale = |backing_id: String| Record {
            backing: dir.path().join("deleted.img"),
            backing_id: Some(backing_id),
            ..record()
        };
        std::fs::write(&old, stale(format!("file-inode-{inode}-born-1.000000001")).encode())
            .expect("record");
        let located = locate(&file, None);
        assert_eq!(located.found_at, None, "another file's record");
        assert_eq!(located.read_path(), located.path);
        std::fs::write(&old, stale(format!("file-inode-{inode}")).encode()).expect("record");
        assert_eq!(locate(&file, None).found_at.as_deref(), Some(old.as_path()), "a legacy key");
        std::fs::write(&old, stale(id.key()).encode()).expect("record");
        assert_eq!(locate(&file, None).found_at.as_deref(), Some(old.as_path()), "its own key");
    }
}
