//! The description of the machine the figures come from.

use std::process::Command;

use serde::Serialize;

/// Runs `program args` and returns its first line of output, or an error naming the
/// package to install.
pub(crate) fn tool_version(program: &str, arg: &str, package: &str) -> Result<String, String> {
    let output = Command::new(program).arg(arg).output().map_err(|e| {
        format!("{program} not found ({e}); install it (apt-get install -y {package})")
    })?;
    let text = String::from_utf8_lossy(&output.stdout);
    let line = text.lines().next().unwrap_or("").trim().to_string();
    if !output.status.success() && line.is_empty() {
        return Err(format!("{program} {arg} failed ({})", output.status));
    }
    Ok(line)
}

/// A description of the machine the figures come from.
#[derive(Debug, Clone, Serialize)]
pub struct Machine {
    /// The kernel's release.
    pub kernel: String,
    /// CPUs available to the process.
    pub cpus: usize,
    /// The CPU's model name.
    pub cpu_model: String,
    /// fio's version.
    pub fio: String,
    /// nbdkit's version, if it was used.
    pub nbdkit: Option<String>,
}

impl Machine {
    /// This machine, with the versions of the tools the figures come from.
    pub(crate) fn probe(fio: String, nbdkit: Option<String>) -> Self {
        Machine { kernel: kernel(), cpus: cpus(), cpu_model: cpu_model(), fio, nbdkit }
    }
}

/// The kernel's release (`/proc/sys/kernel/osrelease`), empty if unknown.
pub(crate) fn kernel() -> String {
    std::fs::read_to_string("/proc/sys/kernel/osrelease")
        .map(|s| s.trim().to_string())
        .unwrap_or_default()
}

/// The CPU's model name (`/proc/cpuinfo`), empty if unknown.
pub(crate) fn cpu_model() -> String {
    std::fs::read_to_string("/proc/cpuinfo")
        .ok()
        .and_then(|s| {
            s.lines()
                .find(|l| l.starts_with("model name"))
                .and_then(|l| l.split(':').nth(1))
                .map(|m| m.trim().to_string())
        })
        .unwrap_or_default()
}

/// CPUs available to the process (1 if unknown).
pub(crate) fn cpus() -> usize {
    std::thread::available_parallelism().map_or(1, |n| n.get())
}
