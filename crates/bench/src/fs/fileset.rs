//! A fileset as filebench keeps one: its entries' paths (a tree of directories `dir_width`
//! wide), their planned sizes (gamma-distributed about the mean), which exist, and which a
//! thread holds. A flowop picks an entry at random among the free ones in the state it wants
//! (existing or not), waiting while all of them are held by other threads.

use std::fs::{self, File};
use std::io::Write;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Condvar, Mutex};
use std::time::Duration;

use rand::rngs::SmallRng;
use rand::seq::SliceRandom;
use rand::{Rng, SeedableRng};
use rand_distr::{Distribution, Gamma};

use super::personality::FilesetSpec;

/// Which entries a pick wants.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Want {
    /// An entry whose file exists (`openfile`, `deletefile`, `statfile`).
    Existing,
    /// An entry whose file does not (`createfile`).
    Absent,
}

/// A set of entry numbers with O(1) insert, remove and random pick.
#[derive(Debug, Default)]
struct Pool {
    members: Vec<u32>,
    /// Where each entry sits in `members`, or `u32::MAX`.
    position: Vec<u32>,
}

impl Pool {
    fn new(entries: usize) -> Self {
        Pool { members: Vec::with_capacity(entries), position: vec![u32::MAX; entries] }
    }

    fn insert(&mut self, entry: usize) {
        assert_eq!(self.position[entry], u32::MAX, "entry {entry} is in the pool already");
        self.position[entry] = self.members.len() as u32;
        self.members.push(entry as u32);
    }

    fn take_random(&mut self, rng: &mut SmallRng) -> Option<usize> {
        if self.members.is_empty() {
            return None;
        }
        let at = rng.gen_range(0..self.members.len());
        let entry = self.members.swap_remove(at) as usize;
        if let Some(&moved) = self.members.get(at) {
            self.position[moved as usize] = at as u32;
        }
        self.position[entry] = u32::MAX;
        Some(entry)
    }

    #[cfg(test)]
    fn len(&self) -> usize {
        self.members.len()
    }
}

/// Which entries exist and which are free, under the fileset's lock.
#[derive(Debug)]
struct Entries {
    exists: Vec<bool>,
    /// Existing entries no thread holds.
    free_existing: Pool,
    /// Absent entries no thread holds.
    free_absent: Pool,
    /// Existing entries, held or not.
    existing: usize,
}

/// A fileset in a directory.
#[derive(Debug)]
pub struct Fileset {
    /// What it is.
    pub spec: FilesetSpec,
    root: PathBuf,
    /// Each entry's planned size in bytes.
    sizes: Vec<u64>,
    /// Directory levels between the root and the files.
    depth: u32,
    /// The bytes of the files created before the run.
    preallocated_bytes: u64,
    entries: Mutex<Entries>,
    freed: Condvar,
}

impl Fileset {
    /// The fileset `spec` under `dir` (`dir/<name>`), its sizes drawn and its preallocated
    /// entries chosen from `seed`; nothing is created yet.
    pub fn plan(spec: &FilesetSpec, dir: &Path, seed: u64) -> Fileset {
        let n = spec.entries as usize;
        let mut rng = SmallRng::seed_from_u64(seed);
        let sizes = planned_sizes(spec, n, &mut rng);
        let mut order: Vec<usize> = (0..n).collect();
        order.shuffle(&mut rng);
        let preallocated = (spec.entries * spec.prealloc_percent / 100) as usize;
        let mut exists = vec![false; n];
        let mut preallocated_bytes = 0;
        for &e in &order[..preallocated] {
            exists[e] = true;
            preallocated_bytes += sizes[e];
        }
        let mut free_existing = Pool::new(n);
        let mut free_absent = Pool::new(n);
        for (e, &there) in exists.iter().enumerate() {
            if there { free_existing.insert(e) } else { free_absent.insert(e) }
        }
        let leaf_dirs = spec.entries.div_ceil(spec.dir_width.max(1));
        let mut depth = 0;
        let mut reach = 1u64;
        while reach < leaf_dirs {
            reach = reach.saturating_mul(spec.dir_width.max(2));
            depth += 1;
        }
        Fileset {
            spec: spec.clone(),
            root: dir.join(spec.name),
            sizes,
            depth,
            preallocated_bytes,
            entries: Mutex::new(Entries {
                exists,
                free_existing,
                free_absent,
                existing: preallocated,
            }),
            freed: Condvar::new(),
        }
    }

    /// Entry `entry`'s path: `<root>/<d1>/…/<file>`, directories `dir_width` wide.
    pub fn path(&self, entry: usize) -> PathBuf {
        let width = self.spec.dir_width.max(1);
        let mut leaf = entry as u64 / width;
        let mut parts = vec![];
        for _ in 0..self.depth {
            parts.push(format!("{:08}", leaf % width.max(2) + 1));
            leaf /= width.max(2);
        }
        let mut path = self.root.clone();
        for part in parts.iter().rev() {
            path.push(part);
        }
        path.push(format!("{:08}", entry + 1));
        path
    }

    /// Entry `entry`'s planned size.
    pub fn size(&self, entry: usize) -> u64 {
        self.sizes[entry]
    }

    /// The planned sizes of every entry.
    pub fn sizes(&self) -> &[u64] {
        &self.sizes
    }

    /// The bytes of the files created before the run.
    pub fn preallocated_bytes(&self) -> u64 {
        self.preallocated_bytes
    }

    /// Entries whose file exists now.
    pub fn existing(&self) -> usize {
        self.entries.lock().expect("fileset lock").existing
    }

    /// Makes the directories and writes every preallocated file at its planned size (pieces
    /// of `buffer`'s length), on `threads` threads; then `syncfs` and drops the files' pages
    /// from the page cache (filebench's `cached=0`), so that the run starts from the device.
    pub fn create(&self, buffer: &[u8], threads: usize) -> Result<(), String> {
        let _ = fs::remove_dir_all(&self.root);
        let n = self.sizes.len();
        let mut dirs: Vec<PathBuf> =
            (0..n).filter_map(|e| self.path(e).parent().map(Path::to_path_buf)).collect();
        dirs.dedup();
        for d in &dirs {
            fs::create_dir_all(d).map_err(|e| format!("{}: {e}", d.display()))?;
        }
        let existing: Vec<usize> = {
            let entries = self.entries.lock().expect("fileset lock");
            (0..n).filter(|&e| entries.exists[e]).collect()
        };
        let next = std::sync::atomic::AtomicUsize::new(0);
        let failure = Mutex::new(None);
        std::thread::scope(|scope| {
            for _ in 0..threads.max(1) {
                scope.spawn(|| {
                    loop {
                        let i = next.fetch_add(1, Ordering::Relaxed);
                        let Some(&entry) = existing.get(i) else { break };
                        if let Err(e) = self.write_file(entry, buffer) {
                            *failure.lock().expect("failure lock") = Some(e);
                            next.store(existing.len(), Ordering::Relaxed);
                        }
                    }
                });
            }
        });
        if let Some(e) = failure.into_inner().expect("failure lock") {
            return Err(e);
        }
        sync_fs(&self.root)?;
        for &entry in &existing {
            drop_cached_pages(&self.path(entry));
        }
        Ok(())
    }

    fn write_file(&self, entry: usize, buffer: &[u8]) -> Result<(), String> {
        let path = self.path(entry);
        let mut file =
            File::create(&path).map_err(|e| format!("creating {}: {e}", path.display()))?;
        let mut left = self.sizes[entry];
        while left > 0 {
            let piece = left.min(buffer.len() as u64) as usize;
            file.write_all(&buffer[..piece])
                .map_err(|e| format!("writing {}: {e}", path.display()))?;
            left -= piece as u64;
        }
        Ok(())
    }

    /// Removes the fileset's directory and everything in it.
    pub fn remove(&self) -> Result<(), String> {
        match fs::remove_dir_all(&self.root) {
            Ok(()) => Ok(()),
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(()),
            Err(e) => Err(format!("removing {}: {e}", self.root.display())),
        }
    }

    /// Takes a free entry in the state `want` at random, waiting while every such entry is
    /// held; `None` when no entry is in that state at all, or `stop` is set.
    pub fn pick(&self, want: Want, rng: &mut SmallRng, stop: &AtomicBool) -> Option<usize> {
        let mut entries = self.entries.lock().expect("fileset lock");
        loop {
            let pool = match want {
                Want::Existing => &mut entries.free_existing,
                Want::Absent => &mut entries.free_absent,
            };
            if let Some(entry) = pool.take_random(rng) {
                return Some(entry);
            }
            let in_state = match want {
                Want::Existing => entries.existing,
                Want::Absent => entries.exists.len() - entries.existing,
            };
            if in_state == 0 || stop.load(Ordering::Relaxed) {
                return None;
            }
            entries = self
                .freed
                .wait_timeout(entries, Duration::from_millis(50))
                .expect("fileset lock")
                .0;
        }
    }

    /// Gives back a held entry, its file now existing or not.
    pub fn release(&self, entry: usize, exists: bool) {
        let mut entries = self.entries.lock().expect("fileset lock");
        let was = entries.exists[entry];
        entries.exists[entry] = exists;
        match (was, exists) {
            (false, true) => entries.existing += 1,
            (true, false) => entries.existing -= 1,
            _ => {}
        }
        if exists {
            entries.free_existing.insert(entry);
        } else {
            entries.free_absent.insert(entry);
        }
        drop(entries);
        self.freed.notify_all();
    }

    /// Free entries (existing, absent): for tests.
    #[cfg(test)]
    fn free(&self) -> (usize, usize) {
        let entries = self.entries.lock().expect("fileset lock");
        (entries.free_existing.len(), entries.free_absent.len())
    }
}

/// Each entry's planned size: gamma-distributed about the mean (shape `size_gamma`, scale
/// mean / shape, as filebench draws its `cvar-gamma` sizes), at least 1 byte; or the mean.
fn planned_sizes(spec: &FilesetSpec, n: usize, rng: &mut SmallRng) -> Vec<u64> {
    match spec.size_gamma {
        None => vec![spec.mean_size; n],
        Some(shape) => {
            let gamma = Gamma::new(shape, spec.mean_size as f64 / shape)
                .expect("a positive shape and scale");
            (0..n).map(|_| (gamma.sample(rng).round() as u64).max(1)).collect()
        }
    }
}

/// `syncfs` of the file system holding `path`.
fn sync_fs(path: &Path) -> Result<(), String> {
    let dir = File::open(path).map_err(|e| format!("{}: {e}", path.display()))?;
    rustix::fs::syncfs(&dir).map_err(|e| format!("syncfs {}: {e}", path.display()))
}

/// Drops a written-back file's pages from the page cache (`POSIX_FADV_DONTNEED`); a file
/// system that keeps none (tmpfs, DAX) ignores it.
fn drop_cached_pages(path: &Path) {
    if let Ok(file) = File::open(path) {
        let _ = rustix::fs::fadvise(&file, 0, None, rustix::fs::Advice::DontNeed);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn spec(entries: u64, dir_width: u64, mean: u64, gamma: Option<f64>) -> FilesetSpec {
        FilesetSpec {
            name: "bigfileset",
            entries,
            dir_width,
            mean_size: mean,
            size_gamma: gamma,
            prealloc_percent: 80,
            readonly: false,
        }
    }

    #[test]
    fn sizes_follow_filebench_gamma_about_the_mean() {
        let set = Fileset::plan(&spec(20_000, 20, 128 << 10, Some(1.5)), Path::new("/x"), 7);
        let sizes: Vec<f64> = set.sizes().iter().map(|&s| s as f64).collect();
        let n = sizes.len() as f64;
        let mean = sizes.iter().sum::<f64>() / n;
        let var = sizes.iter().map(|s| (s - mean).powi(2)).sum::<f64>() / n;
        let cv = var.sqrt() / mean;
        assert!((mean / (128 << 10) as f64 - 1.0).abs() < 0.03, "mean {mean}");
        // Gamma of shape 1.5: a coefficient of variation of 1/sqrt(1.5) = 0.816.
        assert!((cv - 1.0 / 1.5f64.sqrt()).abs() < 0.03, "coefficient of variation {cv}");
        let fixed = Fileset::plan(&spec(10, 1024, 4096, None), Path::new("/x"), 7);
        assert!(fixed.sizes().iter().all(|&s| s == 4096));
    }

    #[test]
    fn prealloc_creates_its_share_and_the_tree_is_dir_width_wide() {
        let set = Fileset::plan(&spec(1000, 20, 1024, Some(1.5)), Path::new("/r"), 1);
        assert_eq!(set.existing(), 800, "prealloc=80");
        assert_eq!(set.free(), (800, 200));
        // 1000 files, 20 per leaf: 50 leaves under a tree of depth 2.
        assert_eq!(set.path(0), Path::new("/r/bigfileset/00000001/00000001/00000001"));
        assert_eq!(set.path(21), Path::new("/r/bigfileset/00000001/00000002/00000022"));
        let leaves: std::collections::BTreeSet<PathBuf> =
            (0..1000).map(|e| set.path(e).parent().expect("dir").to_path_buf()).collect();
        assert_eq!(leaves.len(), 50);
        let flat = Fileset::plan(&spec(1000, 1_000_000, 1024, None), Path::new("/r"), 1);
        assert_eq!(flat.path(999), Path::new("/r/bigfileset/00001000"), "one flat directory");
    }

    #[test]
    fn a_pick_holds_its_entry_until_released_and_waits_when_all_are_held() {
        let set = Fileset::plan(
            &FilesetSpec { prealloc_percent: 50, ..spec(2, 20, 10, None) },
            Path::new("/r"),
            3,
        );
        let mut rng = SmallRng::seed_from_u64(1);
        let stop = AtomicBool::new(false);
        let held = set.pick(Want::Existing, &mut rng, &stop).expect("one exists");
        let absent = set.pick(Want::Absent, &mut rng, &stop).expect("one is absent");
        assert_ne!(held, absent);
        std::thread::scope(|s| {
            let waiter = s.spawn(|| {
                let mut rng = SmallRng::seed_from_u64(2);
                set.pick(Want::Existing, &mut rng, &AtomicBool::new(false))
            });
            std::thread::sleep(Duration::from_millis(100));
            assert!(!waiter.is_finished(), "the only existing entry is held");
            set.release(absent, true); // created
            assert!(waiter.join().expect("waiter").is_some());
        });
        set.release(held, false); // deleted
        assert_eq!(set.existing(), 1);
        // Nothing in a state at all: no wait.
        let none = Fileset::plan(
            &FilesetSpec { prealloc_percent: 100, ..spec(3, 20, 10, None) },
            Path::new("/r"),
            3,
        );
        assert_eq!(none.pick(Want::Absent, &mut rng, &stop), None);
    }

    #[test]
    fn create_writes_the_preallocated_files_at_their_sizes() {
        let dir = tempfile::tempdir().expect("tempdir");
        let set = Fileset::plan(&spec(50, 8, 3000, Some(1.5)), dir.path(), 9);
        set.create(&vec![7u8; 1024], 3).expect("create");
        let mut found = 0;
        for e in 0..50 {
            if let Ok(meta) = fs::metadata(set.path(e)) {
                assert_eq!(meta.len(), set.size(e));
                found += 1;
            }
        }
        assert_eq!(found, 40);
        set.remove().expect("remove");
        assert!(!dir.path().join("bigfileset").exists());
    }
}
