//! Where an experiment keeps its files: a backing file on a disk, a cache medium in shm,
//! a scratch directory.

use std::io::Write as _;
use std::path::{Path, PathBuf};
use std::time::Instant;

use pmcache_frontend::units::human;
use rand::rngs::SmallRng;
use rand::{Rng, SeedableRng};

use super::process::was_interrupted;
use super::servers::{PmcacheServe, ServeOptions, Server};

/// The file system type of the mount holding `dir` (from /proc/mounts).
fn fs_type(dir: &Path) -> Option<String> {
    let dir = dir.canonicalize().ok()?;
    let mounts = std::fs::read_to_string("/proc/mounts").ok()?;
    let mut best: Option<(usize, String)> = None;
    for line in mounts.lines() {
        let mut fields = line.split_whitespace();
        let (Some(_), Some(mount), Some(kind)) = (fields.next(), fields.next(), fields.next())
        else {
            continue;
        };
        let mount = mount.replace("\\040", " ");
        if dir.starts_with(&mount) && best.as_ref().is_none_or(|(len, _)| mount.len() >= *len) {
            best = Some((mount.len(), kind.to_string()));
        }
    }
    best.map(|(_, kind)| kind)
}

/// `--dir`, `--shm-dir` and `--fio` of an experiment that serves a cache to fio.
#[derive(clap::Args, Debug, Clone)]
pub struct ScratchArgs {
    /// Directory for the backing file: on a disk, not a tmpfs.
    #[arg(long, default_value = "/var/tmp")]
    pub dir: PathBuf,
    /// Directory for the cache medium (emulated PM).
    #[arg(long, default_value = "/dev/shm")]
    pub shm_dir: PathBuf,
    /// The fio binary.
    #[arg(long, default_value = "fio")]
    pub fio: String,
}

impl ScratchArgs {
    /// fio's version, and the scratch of experiment `label` in these directories (kept if
    /// `keep`).
    pub(crate) fn prepare(&self, label: &str, keep: bool) -> Result<(String, Scratch), String> {
        let fio_version = super::fio::check_fio(&self.fio)?;
        Ok((fio_version, Scratch::new(&self.dir, &self.shm_dir, label, keep)?))
    }
}

/// Where an experiment keeps its files: the backing file in a directory on a disk, and a
/// scratch directory under the system's temporary directory (short unix socket paths) for
/// sockets, server logs and fio's outputs. Both are removed when dropped, unless kept.
pub(crate) struct Scratch {
    dir: Option<tempfile::TempDir>,
    /// The backing file.
    pub(crate) backing: PathBuf,
    /// The cache medium's path (in the shm directory).
    pub(crate) medium: PathBuf,
    keep: bool,
}

impl Scratch {
    /// Prepares the paths (creates nothing on disk but the scratch directory).
    pub(crate) fn new(
        disk_dir: &Path,
        shm_dir: &Path,
        label: &str,
        keep: bool,
    ) -> Result<Self, String> {
        for dir in [disk_dir, shm_dir] {
            if !dir.is_dir() {
                return Err(format!("{} is not a directory", dir.display()));
            }
        }
        if let Some(kind) = fs_type(disk_dir).filter(|k| k == "tmpfs" || k == "ramfs") {
            return Err(format!(
                "{} is on a {kind}: the backing file belongs on a disk (give --dir)",
                disk_dir.display()
            ));
        }
        let dir = tempfile::Builder::new()
            .prefix("pmcache-bench-")
            .tempdir()
            .map_err(|e| format!("cannot create a scratch directory: {e}"))?;
        let pid = std::process::id();
        Ok(Scratch {
            dir: Some(dir),
            backing: disk_dir.join(format!("pmcache-bench-{label}-{pid}.img")),
            medium: shm_dir.join(format!("pmcache-bench-{label}-{pid}.pm")),
            keep,
        })
    }

    /// A path in the scratch directory.
    pub(crate) fn path(&self, name: &str) -> PathBuf {
        self.dir.as_ref().expect("scratch directory").path().join(name)
    }

    /// The scratch directory.
    pub(crate) fn dir(&self) -> &Path {
        self.dir.as_ref().expect("scratch directory").path()
    }

    /// `pmcache serve` of a `cache_bytes` cache on this scratch's medium in front of its
    /// backing file, its sockets and log in the scratch directory (`pmcache.sock`, `pmcache.ctl`,
    /// `pmcache-serve.log`).
    pub(crate) fn serve(
        &self,
        cache_bytes: u64,
        max_connections: usize,
        cleaner: &[String],
        cpus: Option<&str>,
        options: ServeOptions<'_>,
    ) -> Result<Server, String> {
        let (socket, control) = (self.path("pmcache.sock"), self.path("pmcache.ctl"));
        Server::start_pmcache(&PmcacheServe {
            medium: &self.medium,
            cache_bytes,
            backing: &self.backing,
            socket: &socket,
            control: &control,
            log: &self.path("pmcache-serve.log"),
            cleaner,
            cpus,
            max_connections,
            options,
        })
    }

    /// Creates the backing file, `bytes` long and sparse.
    pub(crate) fn sparse(&self, bytes: u64) -> Result<(), String> {
        std::fs::File::create(&self.backing)
            .and_then(|f| f.set_len(bytes))
            .map_err(|e| format!("cannot create {}: {e}", self.backing.display()))
    }

    /// Writes the backing file in full with random data and syncs it, reporting on stderr.
    pub(crate) fn prefill(&self, bytes: u64) -> Result<(), String> {
        let started = Instant::now();
        eprintln!(
            "writing the backing file {} ({}) in full ...",
            self.backing.display(),
            human(bytes)
        );
        write_random(&self.backing, bytes).map_err(|e| {
            format!("cannot write the backing file {}: {e}", self.backing.display())
        })?;
        eprintln!("  done in {:.1} s", started.elapsed().as_secs_f64());
        Ok(())
    }
}

impl Drop for Scratch {
    fn drop(&mut self) {
        let _ = std::fs::remove_file(&self.medium);
        if self.keep {
            if let Some(dir) = self.dir.take() {
                eprintln!(
                    "kept: {} and the scratch directory {}",
                    self.backing.display(),
                    dir.keep().display()
                );
            }
        } else {
            let _ = std::fs::remove_file(&self.backing);
            let _ = std::fs::remove_file(state_file(&self.backing));
        }
    }
}

/// The attachment record `pmcache serve` keeps beside a backing file when its cache medium is
/// volatile.
pub(crate) fn state_file(backing: &Path) -> PathBuf {
    let mut name = backing.as_os_str().to_owned();
    name.push(".pmcache-state");
    PathBuf::from(name)
}

/// Writes `bytes` of random data to `path` (no holes: a hole reads without touching the disk,
/// and a write into one allocates during the measurement) and syncs it.
pub(crate) fn write_random(path: &Path, bytes: u64) -> std::io::Result<()> {
    let mut file = std::fs::File::create(path)?;
    let mut chunk = vec![0u8; 1 << 20];
    let mut rng = SmallRng::seed_from_u64(0x5eed_0002);
    let mut left = bytes;
    while left > 0 {
        if was_interrupted() {
            return Err(std::io::Error::new(std::io::ErrorKind::Interrupted, "interrupted"));
        }
        rng.fill(&mut chunk[..]);
        let n = left.min(chunk.len() as u64) as usize;
        file.write_all(&chunk[..n])?;
        left -= n as u64;
    }
    file.sync_all()
}

/// Syncs the backing file and drops it from the page cache, so that a measurement starts
/// with nothing of it cached and no dirty pages of the previous one left to write.
pub(crate) fn settle(path: &Path) -> Result<(), String> {
    let file = std::fs::OpenOptions::new()
        .read(true)
        .write(true)
        .open(path)
        .map_err(|e| format!("{}: {e}", path.display()))?;
    file.sync_all().map_err(|e| format!("syncing {}: {e}", path.display()))?;
    rustix::fs::fadvise(&file, 0, None, rustix::fs::Advice::DontNeed)
        .map_err(|e| format!("dropping {} from the page cache: {e}", path.display()))
}
