//! The host's layers, each an ext4 file system on a loop device (direct I/O) over a backing
//! file on the disk: through pmcache (`pmcache serve` on a unix socket, its medium in shm →
//! nbdfuse → loop → ext4), on the raw backing file (loop → ext4), the baseline, or through
//! `nbdkit file` (page cache bypassed) on the same path as pmcache's (nbdfuse → loop → ext4):
//! what that path costs without a cache.

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use crate::harness::servers::{PmcacheServe, ServeOptions, Server, ServerFigures};

/// Runs a command and returns its stdout; an error with its stderr otherwise.
pub(super) fn run(program: &str, args: &[&str]) -> Result<String, String> {
    let out = Command::new(program)
        .args(args)
        .output()
        .map_err(|e| format!("cannot run {program}: {e}"))?;
    if out.status.success() {
        Ok(String::from_utf8_lossy(&out.stdout).into_owned())
    } else {
        Err(format!(
            "{program} {} failed ({}): {}",
            args.join(" "),
            out.status,
            String::from_utf8_lossy(&out.stderr).trim()
        ))
    }
}

/// How a layer's bed is made.
pub struct LayerSpec<'a> {
    /// The layer's name in the tables.
    pub name: &'static str,
    /// The directory of its backing file (on a disk).
    pub disk_dir: &'a Path,
    /// The file system's size (the backing file's).
    pub fs_bytes: u64,
    /// Where its sockets, mount point and runtime files go.
    pub work: &'a Path,
    /// What serves the loop device's file.
    pub kind: LayerKind<'a>,
}

/// What is between ext4's loop device and the backing file.
#[derive(Debug, Clone, Copy)]
pub enum LayerKind<'a> {
    /// Nothing: the loop device is on the backing file.
    Raw,
    /// pmcache, its medium and cache size, through nbdfuse.
    Pmcache(&'a Path, u64),
    /// `nbdkit file` (`cache=none`), through nbdfuse.
    Nbdkit,
}

/// A layer's ext4, mounted; torn down when dropped.
pub struct Layer {
    /// The layer's name.
    pub name: &'static str,
    /// Where its ext4 is mounted.
    pub mount: PathBuf,
    /// Its runtime directory (sockets, logs).
    pub work: PathBuf,
    backing: PathBuf,
    loop_dev: Option<String>,
    fuse_dir: Option<PathBuf>,
    nbdfuse: Option<Child>,
    server: Option<Server>,
    mounted: bool,
}

impl Layer {
    /// Makes the layer: the backing file (allocated in full), pmcache and nbdfuse where it
    /// has a cache, the loop device with direct I/O, ext4 (inode tables and journal
    /// initialised now: no lazy-init thread writes during a measurement), mounted.
    pub fn create(spec: &LayerSpec<'_>) -> Result<Layer, String> {
        std::fs::create_dir_all(spec.work).map_err(|e| format!("{}: {e}", spec.work.display()))?;
        let backing = spec.disk_dir.join(format!(
            "pmcache-bench-db-{}-{}.img",
            spec.name,
            std::process::id()
        ));
        let mut layer = Layer {
            name: spec.name,
            mount: spec.work.join("mnt"),
            work: spec.work.to_path_buf(),
            backing: backing.clone(),
            loop_dev: None,
            fuse_dir: None,
            nbdfuse: None,
            server: None,
            mounted: false,
        };
        allocate(&backing, spec.fs_bytes)?;
        let socket = spec.work.join("nbd.sock");
        let server = match spec.kind {
            LayerKind::Raw => None,
            LayerKind::Pmcache(medium, cache_bytes) => {
                Some(Server::start_pmcache(&PmcacheServe {
                    medium,
                    cache_bytes,
                    backing: &backing,
                    socket: &socket,
                    control: &spec.work.join("pmcache.ctl"),
                    log: &spec.work.join("pmcache-serve.log"),
                    cleaner: &[],
                    cpus: None,
                    max_connections: 16,
                    options: ServeOptions::default(),
                })?)
            }
            LayerKind::Nbdkit => Some(Server::start_nbdkit(
                "nbdkit",
                &backing,
                &socket,
                &spec.work.join("nbdkit.log"),
                "none",
            )?),
        };
        let device_file = match server {
            None => backing.clone(),
            Some(server) => {
                let uri = server.uri();
                layer.server = Some(server);
                let fuse_dir = spec.work.join("fuse");
                std::fs::create_dir_all(&fuse_dir).map_err(|e| e.to_string())?;
                let disk = fuse_dir.join("disk");
                let child = Command::new("nbdfuse")
                    .arg(&disk)
                    .arg(&uri)
                    .stdin(Stdio::null())
                    .stdout(Stdio::null())
                    .stderr(Stdio::null())
                    .spawn()
                    .map_err(|e| {
                        format!("cannot run nbdfuse ({e}): apt-get install -y libnbd-bin")
                    })?;
                layer.nbdfuse = Some(child);
                layer.fuse_dir = Some(fuse_dir);
                wait_for(&disk, Duration::from_secs(30))?;
                disk
            }
        };
        let device_file = device_file.to_string_lossy().into_owned();
        let dev = run("losetup", &["--direct-io=on", "-f", "--show", &device_file])?;
        let dev = dev.trim().to_string();
        layer.loop_dev = Some(dev.clone());
        let name = dev.trim_start_matches("/dev/");
        let dio =
            std::fs::read_to_string(format!("/sys/block/{name}/loop/dio")).unwrap_or_default();
        if dio.trim() != "1" {
            return Err(format!(
                "{dev} over {device_file} does not do direct I/O: the host's page cache would \
                 hold the layer's blocks"
            ));
        }
        run("mkfs.ext4", &["-q", "-F", "-E", "lazy_itable_init=0,lazy_journal_init=0", &dev])?;
        std::fs::create_dir_all(&layer.mount).map_err(|e| e.to_string())?;
        let mount = layer.mount.to_string_lossy().into_owned();
        run("mount", &["-t", "ext4", &dev, &mount])?;
        layer.mounted = true;
        Ok(layer)
    }

    /// CPU seconds used so far by the server (pmcache: this process, whose other threads
    /// wait meanwhile) and by nbdfuse, where the layer has them.
    pub fn cpu_seconds(&self) -> (Option<f64>, Option<f64>) {
        (
            self.server.as_ref().and_then(|s| process_cpu_seconds(s.pid())),
            self.nbdfuse.as_ref().and_then(|c| process_cpu_seconds(c.id())),
        )
    }

    /// pmcache's counters, where the layer has a cache.
    pub fn figures(&self) -> Option<ServerFigures> {
        let stats = self.server.as_ref()?.stats().ok()?;
        Some(ServerFigures::from_stats(&stats))
    }
}

/// A process's CPU time (user and system, its threads' included), seconds, from
/// `/proc/PID/stat`.
pub fn process_cpu_seconds(pid: u32) -> Option<f64> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    cpu_ticks_of_stat(&stat).map(|ticks| ticks as f64 / clock_ticks_per_second())
}

/// utime + stime (fields 14 and 15) of a `/proc/PID/stat` line, whose second field (the
/// command, in parentheses) may hold spaces.
fn cpu_ticks_of_stat(stat: &str) -> Option<u64> {
    let fields: Vec<&str> = stat.rsplit_once(')')?.1.split_whitespace().collect();
    // Field 3 (the state) is the first after the parenthesis.
    Some(fields.get(11)?.parse::<u64>().ok()? + fields.get(12)?.parse::<u64>().ok()?)
}

fn clock_ticks_per_second() -> f64 {
    // SAFETY: sysconf only reads a system constant.
    let ticks = unsafe { libc::sysconf(libc::_SC_CLK_TCK) };
    if ticks > 0 { ticks as f64 } else { 100.0 }
}

/// Creates `path` with `bytes` allocated (no holes: writes into one would allocate on the
/// host's file system during a measurement).
fn allocate(path: &Path, bytes: u64) -> Result<(), String> {
    let file = std::fs::File::create(path).map_err(|e| format!("{}: {e}", path.display()))?;
    rustix::fs::fallocate(&file, rustix::fs::FallocateFlags::empty(), 0, bytes)
        .map_err(|e| format!("allocating {}: {e}", path.display()))
}

fn wait_for(path: &Path, limit: Duration) -> Result<(), String> {
    let deadline = Instant::now() + limit;
    while !path.exists() {
        crate::harness::process::check_interrupted()?;
        if Instant::now() > deadline {
            return Err(format!("{} did not appear within {} s", path.display(), limit.as_secs()));
        }
        std::thread::sleep(Duration::from_millis(50));
    }
    Ok(())
}

impl Drop for Layer {
    fn drop(&mut self) {
        if self.mounted {
            let mount = self.mount.to_string_lossy().into_owned();
            let unmounted = run("umount", &[&mount]);
            if let Err(e) = unmounted {
                eprintln!("warning: {e}");
                let _ = run("umount", &["-l", &mount]);
            }
        }
        if let Some(dev) = self.loop_dev.take() {
            let _ = run("losetup", &["-d", &dev]);
        }
        if let Some(dir) = self.fuse_dir.take() {
            let _ = run("fusermount", &["-u", &dir.to_string_lossy()]);
        }
        if let Some(mut child) = self.nbdfuse.take() {
            let deadline = Instant::now() + Duration::from_secs(10);
            while matches!(child.try_wait(), Ok(None)) && Instant::now() < deadline {
                std::thread::sleep(Duration::from_millis(50));
            }
            let _ = child.kill();
            let _ = child.wait();
        }
        if let Some(Err(e)) = self.server.take().map(Server::stop) {
            eprintln!("warning: {e}");
        }
        let _ = std::fs::remove_file(&self.backing);
        let _ = std::fs::remove_file(crate::harness::scratch::state_file(&self.backing));
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn cpu_time_is_user_plus_system_after_the_command() {
        let stat = "4242 (nbd fuse) S 1 4242 4242 0 -1 4194560 100 0 0 0 250 75 0 0 20 0 4 0";
        assert_eq!(cpu_ticks_of_stat(stat), Some(325));
        assert_eq!(cpu_ticks_of_stat("4242 (x) S 1"), None);
        assert!(process_cpu_seconds(std::process::id()).is_some());
    }
}
