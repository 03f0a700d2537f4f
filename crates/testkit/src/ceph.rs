//! A throwaway single-host Ceph cluster for the RBD tests: `scripts/ceph/cluster.sh` started in
//! a temporary directory, stopped (daemons and directory) when the [`Cluster`] is dropped.

use std::path::{Path, PathBuf};
use std::process::Command;

/// A running cluster (one monitor, one OSD, pool `rbd`).
pub struct Cluster {
    dir: PathBuf,
    conf: PathBuf,
}

/// The workspace's `scripts/ceph/cluster.sh`.
fn script() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../../scripts/ceph/cluster.sh")
}

fn run_script(args: &[&str]) -> Result<String, String> {
    let out = Command::new("bash")
        .arg(script())
        .args(args)
        .output()
        .map_err(|e| format!("cluster.sh {args:?}: {e}"))?;
    if !out.status.success() {
        return Err(format!(
            "cluster.sh {args:?} failed: {}\n{}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        ));
    }
    Ok(String::from_utf8_lossy(&out.stdout).into_owned())
}

impl Cluster {
    /// Starts a cluster; panics with the script's output when it cannot (the packages are
    /// missing: `scripts/deps.sh install`).
    pub fn start() -> Cluster {
        let base = tempfile_dir();
        let dir = base.join("cluster");
        let out = run_script(&["start", dir.to_str().expect("utf-8 path")])
            .unwrap_or_else(|e| panic!("starting a Ceph cluster: {e}"));
        let conf = out
            .lines()
            .find_map(|l| l.strip_prefix("CEPH_CONF="))
            .map(PathBuf::from)
            .unwrap_or_else(|| panic!("cluster.sh printed no CEPH_CONF: {out}"));
        Cluster { dir, conf }
    }

    /// The cluster's configuration file.
    pub fn conf(&self) -> &Path {
        &self.conf
    }

    /// The spec of image `name` in pool `rbd`, with this cluster's configuration and `options`
    /// (`KEY=VALUE` each).
    pub fn spec(&self, name: &str, options: &[&str]) -> String {
        let mut spec = format!("rbd:rbd/{name}:conf={}", self.conf.display());
        for option in options {
            spec.push(':');
            spec.push_str(option);
        }
        spec
    }

    /// Runs `rbd ARGS` against this cluster; its stdout, or its error output.
    pub fn rbd(&self, args: &[&str]) -> Result<String, String> {
        let out = Command::new("rbd")
            .arg("-c")
            .arg(&self.conf)
            .args(args)
            .output()
            .map_err(|e| format!("rbd {args:?}: {e}"))?;
        if !out.status.success() {
            return Err(format!("rbd {args:?}: {}", String::from_utf8_lossy(&out.stderr)));
        }
        Ok(String::from_utf8_lossy(&out.stdout).into_owned())
    }

    /// Creates image `name` of `size` (`rbd create --size`, e.g. `64M`) in pool `rbd`.
    pub fn create_image(&self, name: &str, size: &str) {
        self.rbd(&["create", "--size", size, &format!("rbd/{name}")]).expect("rbd create");
    }

    /// The whole image as `rbd export` writes it.
    pub fn export(&self, name: &str) -> Vec<u8> {
        let out = self.dir.with_file_name(format!("export-{name}"));
        self.rbd(&["export", &format!("rbd/{name}"), out.to_str().expect("utf-8")])
            .expect("rbd export");
        let data = std::fs::read(&out).expect("read the export");
        let _ = std::fs::remove_file(&out);
        data
    }

    /// Image `name`'s metadata `key` (`rbd image-meta get`), `None` when it is not set.
    pub fn image_meta(&self, name: &str, key: &str) -> Option<String> {
        let value = self.rbd(&["image-meta", "get", &format!("rbd/{name}"), key]).ok()?;
        Some(value.strip_suffix('\n').unwrap_or(&value).to_string())
    }

    /// Breaks image `name`'s lock as an operator does (`rbd lock rm`, which blocklists the
    /// holder: the cluster refuses its requests from then on); the holder's address.
    pub fn break_lock(&self, name: &str) -> String {
        let image = format!("rbd/{name}");
        let listed = self.rbd(&["lock", "ls", "--format", "json", &image]).expect("rbd lock ls");
        let field = |key: &str| -> String {
            let at = listed
                .find(&format!("\"{key}\":\""))
                .unwrap_or_else(|| panic!("no {key} in rbd lock ls: {listed}"));
            let rest = &listed[at + key.len() + 4..];
            rest[..rest.find('"').expect("a closing quote")].to_string()
        };
        let (id, locker, address) = (field("id"), field("locker"), field("address"));
        self.rbd(&["lock", "rm", &image, &id, &locker]).expect("rbd lock rm");
        address
    }

    /// Stops the OSD (its process exits): I/O to the pool waits, then times out.
    pub fn stop_osd(&self) {
        run_script(&["osd-stop", self.dir.to_str().expect("utf-8")]).expect("osd-stop");
    }

    /// Starts the OSD again and waits until it is up.
    pub fn start_osd(&self) {
        run_script(&["osd-start", self.dir.to_str().expect("utf-8")]).expect("osd-start");
    }
}

impl Drop for Cluster {
    fn drop(&mut self) {
        if let Err(e) = run_script(&["stop", self.dir.to_str().expect("utf-8")]) {
            eprintln!("stopping the Ceph cluster in {}: {e}", self.dir.display());
        }
        if let Some(base) = self.dir.parent() {
            let _ = std::fs::remove_dir_all(base);
        }
    }
}

/// A new empty directory under the temporary directory.
fn tempfile_dir() -> PathBuf {
    let base = std::env::temp_dir();
    for attempt in 0..1000u32 {
        let dir = base.join(format!("pmcache-ceph-{}-{attempt}", std::process::id()));
        if std::fs::create_dir(&dir).is_ok() {
            return dir;
        }
    }
    panic!("no temporary directory for a Ceph cluster under {}", base.display());
}
