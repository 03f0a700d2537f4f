//! A memory cgroup for the databases' processes: its limit bounds the page cache they can
//! fill, so that their reads reach the block device under the file system (the layer being
//! measured) instead of being served from the host's memory.

use std::path::{Path, PathBuf};
use std::process::Command;

/// Where the kernel's memory controller is, and which interface it speaks.
#[derive(Debug, Clone, PartialEq)]
enum Hierarchy {
    /// The unified hierarchy (cgroup2): `memory.max`.
    V2(PathBuf),
    /// The legacy memory controller (cgroup v1): `memory.limit_in_bytes`.
    V1(PathBuf),
}

/// The memory controller under `root` (`/sys/fs/cgroup`): cgroup2 when its root lists
/// `memory` among its controllers, else a v1 `memory` hierarchy, else the unified
/// hierarchy mounted at `unified` (the hybrid layout) if it lists `memory`.
fn find(root: &Path) -> Option<Hierarchy> {
    let lists_memory = |dir: &Path| {
        std::fs::read_to_string(dir.join("cgroup.controllers"))
            .is_ok_and(|c| c.split_whitespace().any(|name| name == "memory"))
    };
    if lists_memory(root) {
        return Some(Hierarchy::V2(root.to_path_buf()));
    }
    if root.join("memory").join("memory.limit_in_bytes").exists() {
        return Some(Hierarchy::V1(root.join("memory")));
    }
    let unified = root.join("unified");
    lists_memory(&unified).then_some(Hierarchy::V2(unified))
}

/// A memory cgroup made for a run, removed when dropped (once its processes ended).
pub struct MemoryCgroup {
    dir: PathBuf,
    limit_bytes: u64,
}

impl MemoryCgroup {
    /// A new cgroup `name` whose processes share `limit_bytes` of memory (page cache
    /// included).
    pub fn create(name: &str, limit_bytes: u64) -> Result<Self, String> {
        let root = Path::new("/sys/fs/cgroup");
        let (dir, limit_file) = match find(root) {
            Some(Hierarchy::V2(base)) => {
                // Lets the new child take the memory controller (already on: no change).
                let _ = std::fs::write(base.join("cgroup.subtree_control"), "+memory");
                (base.join(name), "memory.max")
            }
            Some(Hierarchy::V1(base)) => (base.join(name), "memory.limit_in_bytes"),
            None => {
                return Err(format!(
                    "no memory cgroup controller under {}: the databases' page cache could \
                     not be bounded",
                    root.display()
                ));
            }
        };
        if dir.exists() {
            let _ = std::fs::remove_dir(&dir);
        }
        std::fs::create_dir(&dir).map_err(|e| format!("creating {}: {e}", dir.display()))?;
        let cgroup = MemoryCgroup { dir, limit_bytes };
        std::fs::write(cgroup.dir.join(limit_file), limit_bytes.to_string())
            .map_err(|e| format!("{}/{limit_file}: {e}", cgroup.dir.display()))?;
        Ok(cgroup)
    }

    /// The limit.
    pub fn limit_bytes(&self) -> u64 {
        self.limit_bytes
    }

    /// `program args` started inside the cgroup (a shell moves itself in, then runs it).
    pub fn command(&self, program: &str, args: &[String]) -> Command {
        let mut command = Command::new("sh");
        command
            .arg("-c")
            .arg(r#"echo $$ > "$0" && exec "$@""#)
            .arg(self.dir.join("cgroup.procs"))
            .arg(program)
            .args(args);
        command
    }
}

impl Drop for MemoryCgroup {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir(&self.dir);
    }
}

/// Writes back every dirty page and drops the page cache, dentries and inodes
/// (`/proc/sys/vm/drop_caches`): no measurement starts with another's data in memory.
pub fn drop_caches() -> Result<(), String> {
    rustix::fs::sync();
    std::fs::write("/proc/sys/vm/drop_caches", "3")
        .map_err(|e| format!("dropping the page cache (/proc/sys/vm/drop_caches): {e}"))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_controller_is_found_in_each_layout() {
        let v2 = tempfile::tempdir().expect("tempdir");
        std::fs::write(v2.path().join("cgroup.controllers"), "cpu io memory pids\n").expect("w");
        assert_eq!(find(v2.path()), Some(Hierarchy::V2(v2.path().into())));
        let hybrid = tempfile::tempdir().expect("tempdir");
        std::fs::create_dir_all(hybrid.path().join("memory")).expect("mkdir");
        std::fs::write(hybrid.path().join("memory/memory.limit_in_bytes"), "9\n").expect("w");
        assert_eq!(find(hybrid.path()), Some(Hierarchy::V1(hybrid.path().join("memory"))));
        let none = tempfile::tempdir().expect("tempdir");
        std::fs::write(none.path().join("cgroup.controllers"), "cpu pids\n").expect("w");
        assert_eq!(find(none.path()), None);
    }
}
