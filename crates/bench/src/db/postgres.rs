//! A PostgreSQL cluster on a layer's file system, run as user `postgres` inside the memory
//! cgroup, listening on a unix socket only; pgbench against it.

use std::path::{Path, PathBuf};
use std::process::{Command, Output};

use super::cgroup::MemoryCgroup;
use super::pgbench::{PgbenchFigures, figures, tail};

/// The newest PostgreSQL server installed (Debian's `/usr/lib/postgresql/N/bin`).
pub fn bin_dir() -> Result<PathBuf, String> {
    let mut found: Vec<(u32, PathBuf)> = std::fs::read_dir("/usr/lib/postgresql")
        .map_err(|e| {
            format!("/usr/lib/postgresql: {e}; install PostgreSQL (apt-get install -y postgresql)")
        })?
        .flatten()
        .filter_map(|e| {
            let version = e.file_name().to_string_lossy().parse::<u32>().ok()?;
            let bin = e.path().join("bin");
            bin.join("postgres").is_file().then_some((version, bin))
        })
        .collect();
    found.sort();
    found
        .pop()
        .map(|(_, bin)| bin)
        .ok_or_else(|| "no PostgreSQL server under /usr/lib/postgresql".into())
}

/// The settings of a cluster.
#[derive(Debug, Clone)]
pub struct PgSettings {
    /// `shared_buffers` (PostgreSQL's own cache), e.g. `16MB`.
    pub shared_buffers: String,
    /// pgbench's scale factor.
    pub scale: u32,
    /// pgbench's clients.
    pub clients: usize,
    /// pgbench's threads.
    pub threads: usize,
}

/// A cluster's directories.
pub struct Cluster {
    bin: PathBuf,
    data: PathBuf,
    socket_dir: PathBuf,
    log: PathBuf,
    running: bool,
}

fn checked(what: &str, output: std::io::Result<Output>) -> Result<String, String> {
    let output = output.map_err(|e| format!("{what}: {e}"))?;
    let stdout = String::from_utf8_lossy(&output.stdout).into_owned();
    if output.status.success() {
        Ok(stdout)
    } else {
        let stderr = String::from_utf8_lossy(&output.stderr);
        Err(format!("{what} failed ({}): {}{}", output.status, tail(&stdout), tail(&stderr)))
    }
}

fn chown_postgres(path: &Path) -> Result<(), String> {
    checked(
        &format!("chown postgres: {}", path.display()),
        Command::new("chown").arg("postgres:postgres").arg(path).output(),
    )
    .map(drop)
}

impl Cluster {
    /// `initdb` of a new cluster in `data` (on the layer's file system), its socket and log
    /// in `run_dir`.
    pub fn init(
        bin: &Path,
        data: &Path,
        run_dir: &Path,
        settings: &PgSettings,
    ) -> Result<Self, String> {
        for dir in [data, run_dir] {
            std::fs::create_dir_all(dir).map_err(|e| format!("{}: {e}", dir.display()))?;
            chown_postgres(dir)?;
        }
        let cluster = Cluster {
            bin: bin.to_path_buf(),
            data: data.to_path_buf(),
            socket_dir: run_dir.to_path_buf(),
            log: run_dir.join("postgres.log"),
            running: false,
        };
        cluster.as_postgres(
            "initdb",
            &["-A", "trust", "--locale=C", "-E", "UTF8", "-D"],
            Some(&cluster.data),
            None,
        )?;
        let conf = format!(
            "\nlisten_addresses = ''\nunix_socket_directories = '{}'\nshared_buffers = {}\n\
             max_wal_size = 256MB\nfsync = on\nsynchronous_commit = on\n\
             timezone = 'UTC'\nlog_timezone = 'UTC'\n",
            run_dir.display(),
            settings.shared_buffers
        );
        let path = data.join("postgresql.conf");
        let mut text = std::fs::read_to_string(&path).map_err(|e| e.to_string())?;
        text.push_str(&conf);
        std::fs::write(&path, text).map_err(|e| format!("{}: {e}", path.display()))?;
        Ok(cluster)
    }

    /// Runs `bin/program args [path]` as user postgres, inside `cgroup` when given.
    fn as_postgres(
        &self,
        program: &str,
        args: &[&str],
        path: Option<&Path>,
        cgroup: Option<&MemoryCgroup>,
    ) -> Result<String, String> {
        let exe = self.bin.join(program).to_string_lossy().into_owned();
        let mut argv: Vec<String> = ["-u", "postgres", "--", &exe].map(String::from).to_vec();
        argv.extend(args.iter().map(|a| a.to_string()));
        argv.extend(path.map(|p| p.to_string_lossy().into_owned()));
        let mut command = match cgroup {
            Some(cg) => cg.command("runuser", &argv),
            None => {
                let mut c = Command::new("runuser");
                c.args(&argv);
                c
            }
        };
        // PostgreSQL's tools change to their own directories; the caller's may be unreadable.
        command.current_dir("/");
        checked(&format!("{program} (as postgres)"), command.output())
    }

    /// Starts the server in `cgroup` and waits until it accepts connections.
    pub fn start(&mut self, cgroup: &MemoryCgroup) -> Result<(), String> {
        let log = self.log.to_string_lossy().into_owned();
        let data = self.data.to_string_lossy().into_owned();
        self.as_postgres(
            "pg_ctl",
            &["-D", &data, "-l", &log, "-w", "-t", "300", "start"],
            None,
            Some(cgroup),
        )
        .map_err(|e| format!("{e}; {}", crate::harness::process::log_tail(&self.log)))?;
        self.running = true;
        Ok(())
    }

    /// Stops the server (`-m fast`: a shutdown checkpoint writes every dirty buffer).
    pub fn stop(&mut self) -> Result<(), String> {
        let data = self.data.to_string_lossy().into_owned();
        self.as_postgres(
            "pg_ctl",
            &["-D", &data, "-m", "fast", "-w", "-t", "300", "stop"],
            None,
            None,
        )?;
        self.running = false;
        Ok(())
    }

    /// One SQL query's unaligned result.
    pub fn query(&self, sql: &str) -> Result<String, String> {
        let sock = self.socket_dir.to_string_lossy().into_owned();
        let out = self.as_postgres(
            "psql",
            &["-h", &sock, "-X", "-A", "-t", "-c", sql, "postgres"],
            None,
            None,
        )?;
        Ok(out.trim().to_string())
    }

    /// The database's size in bytes (`pg_database_size`).
    pub fn database_bytes(&self) -> Result<u64, String> {
        let text = self.query("SELECT pg_database_size('postgres')")?;
        text.parse().map_err(|_| format!("pg_database_size: {text:?}"))
    }

    /// `pgbench -i -s SCALE` (in `cgroup`).
    pub fn pgbench_init(&self, settings: &PgSettings, cgroup: &MemoryCgroup) -> Result<(), String> {
        let sock = self.socket_dir.to_string_lossy().into_owned();
        let scale = settings.scale.to_string();
        self.as_postgres(
            "pgbench",
            &["-h", &sock, "-i", "-q", "-s", &scale, "postgres"],
            None,
            Some(cgroup),
        )
        .map(drop)
    }

    /// One `pgbench -T seconds` run (in `cgroup`), each transaction logged in a fresh
    /// directory under the run directory.
    pub fn pgbench_run(
        &self,
        settings: &PgSettings,
        seconds: u64,
        cgroup: &MemoryCgroup,
    ) -> Result<PgbenchFigures, String> {
        let logs = self.socket_dir.join("pgbench-logs");
        let _ = std::fs::remove_dir_all(&logs);
        std::fs::create_dir_all(&logs).map_err(|e| format!("{}: {e}", logs.display()))?;
        chown_postgres(&logs)?;
        let sock = self.socket_dir.to_string_lossy().into_owned();
        let prefix = format!("--log-prefix={}/pgbench_log", logs.display());
        let (clients, threads, secs) =
            (settings.clients.to_string(), settings.threads.to_string(), seconds.to_string());
        let summary = self.as_postgres(
            "pgbench",
            &["-h", &sock, "-c", &clients, "-j", &threads, "-T", &secs, "-l", &prefix, "postgres"],
            None,
            Some(cgroup),
        )?;
        figures(&summary, &logs)
    }
}

impl Drop for Cluster {
    fn drop(&mut self) {
        if self.running {
            let _ = self.stop();
        }
    }
}
