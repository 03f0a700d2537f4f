//! The `pmcache` command: serve a cache over NBD or as a ublk block device, manage caches, run
//! the experiments.

#![forbid(unsafe_code)]

use std::io::IsTerminal;
use std::process::ExitCode;

use clap::{CommandFactory, Parser, Subcommand, ValueEnum};

mod args;
mod bench;
mod check;
mod config_file;
mod manage;
mod serve;
mod summary;
mod tls;
#[cfg(feature = "ublk")]
mod ublk;

/// pmcache: a block cache on persistent memory, served over NBD or as a ublk block device.
#[derive(Parser)]
#[command(version, about, long_about = None)]
struct Cli {
    #[command(subcommand)]
    command: Command,
    /// How log lines on stderr are written: `text` (coloured only when stderr is a terminal)
    /// or `json` (one object per line, for a log collector).
    #[arg(long, global = true, value_enum, default_value = "text")]
    log_format: LogFormat,
}

/// The format of log lines.
#[derive(Clone, Copy, Debug, ValueEnum)]
enum LogFormat {
    Text,
    Json,
}

/// Logs to stderr: `RUST_LOG` filters (default `info`; `warn` for `bench`, whose servers run in
/// its process and would log each start and stop between the figures); colour only on a
/// terminal, so that a log written to a file or a pipe carries no escape codes.
fn init_logs(format: LogFormat, default_filter: &str) {
    let filter = tracing_subscriber::EnvFilter::try_from_default_env()
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new(default_filter));
    let logs = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr)
        .with_target(false);
    match format {
        LogFormat::Text => logs.with_ansi(std::io::stderr().is_terminal()).init(),
        LogFormat::Json => logs.json().with_ansi(false).init(),
    }
}

#[derive(Subcommand)]
enum Command {
    /// Serve a cache over NBD (with no options: a 1 GiB cache in /dev/shm in front of a sparse
    /// 8 GiB file under ./pmcache-data, on 127.0.0.1:10809). The medium is DAX (persistent),
    /// volatile (tmpfs, ramfs, hugetlbfs: a stop writes every dirty block back first, and the
    /// attachment is recorded beside the backing file), or, with --medium-sync msync, a file
    /// on another file system synced at every persist; any other medium is refused. With
    /// --ublk: a kernel block device, /dev/ublkbN, instead of NBD.
    Serve(Box<args::ServeArgs>),
    /// Format a cache medium for a backing store.
    Format(manage::FormatArgs),
    /// Verify a cache medium's superblock and metadata (non-zero exit on corruption).
    Check(check::CheckArgs),
    /// Statistics of a running server: a summary, every counter (--all), --json or
    /// --prometheus; --watch SECONDS refreshes.
    Stats(manage::StatsArgs),
    /// Show or change a running server's settings: its cache mode (`mode=`), its admission
    /// policy (`admission=`) and its cleaner's settings.
    Set(manage::SetArgs),
    /// Write back every dirty block of a running server.
    Flush(manage::ControlArgs),
    /// Write back everything, drop the cache's copies and mark it clean, so the backing store
    /// can be used alone (the cache, attached again later, starts empty).
    Detach(manage::DetachArgs),
    /// Run an experiment and print its figures beside their baselines.
    Bench(bench::BenchArgs),
    /// List ublk devices, remove one a server that died left behind, or serve a null device.
    Ublk(args::UblkArgs),
}

#[cfg(feature = "ublk")]
fn manage_ublk(args: args::UblkArgs) -> Result<(), String> {
    ublk::manage(args)
}

#[cfg(not(feature = "ublk"))]
fn manage_ublk(_args: args::UblkArgs) -> Result<(), String> {
    Err(serve::UBLK_NOT_BUILT.to_string())
}

/// Makes a panic end the process, whatever the build profile: a panic is a broken invariant,
/// and the next start recovers the cache from the medium (docs/DURABILITY.md, "A panic aborts
/// the process"). The release profile aborts on its own; the test profile unwinds, so that its
/// libraries are built once for the test harnesses and this binary.
fn abort_on_panic() {
    let report = std::panic::take_hook();
    std::panic::set_hook(Box::new(move |info| {
        report(info);
        std::process::abort();
    }));
}

fn main() -> ExitCode {
    abort_on_panic();
    let command = Cli::command();
    let serve = command.find_subcommand("serve").expect("a serve command");
    let argv = match config_file::expand(std::env::args_os().collect(), serve) {
        Ok(argv) => argv,
        Err(message) => {
            eprintln!("pmcache: {message}");
            return ExitCode::FAILURE;
        }
    };
    let cli = Cli::parse_from(argv);
    // libublk logs each control device it opens at info: its own lines from warn on.
    let filter = match cli.command {
        Command::Bench(_) => "warn",
        _ => "info,libublk=warn",
    };
    init_logs(cli.log_format, filter);
    let result = match cli.command {
        Command::Serve(args) => serve::run(*args),
        Command::Format(args) => manage::format(args),
        Command::Check(args) => check::check(args),
        Command::Stats(args) => manage::stats(args),
        Command::Set(args) => manage::set(args),
        Command::Flush(args) => manage::flush(args),
        Command::Detach(args) => manage::detach(args),
        Command::Bench(args) => bench::run(args),
        Command::Ublk(args) => manage_ublk(args),
    };
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(message) => {
            eprintln!("pmcache: {message}");
            ExitCode::FAILURE
        }
    }
}

#[cfg(test)]
mod tests {
    use std::os::unix::process::ExitStatusExt;

    /// After `abort_on_panic`, a panic on any thread kills the process with SIGABRT once its
    /// message is printed: checked in a child process.
    #[test]
    fn a_panic_aborts_the_process() {
        const CHILD: &str = "PMCACHE_TEST_PANIC_CHILD";
        if std::env::var_os(CHILD).is_some() {
            super::abort_on_panic();
            let panicked = std::thread::spawn(|| panic!("an invariant broke")).join();
            // Unreached: the hook aborts before the thread unwinds.
            eprintln!("the panic unwound: {}", panicked.is_err());
            return;
        }
        let out = std::process::Command::new(std::env::current_exe().expect("test binary"))
            .args(["--exact", "tests::a_panic_aborts_the_process", "--nocapture"])
            .env(CHILD, "1")
            .output()
            .expect("run the child");
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.signal(), Some(6), "{}\n{stderr}", out.status);
        assert!(stderr.contains("an invariant broke"), "{stderr}");
        assert!(!stderr.contains("the panic unwound"), "{stderr}");
    }
}
