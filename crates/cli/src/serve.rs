//! `pmcache serve`: the arguments (`crate::args`) go to one frontend — NBD (`crate::nbd`)
//! or, with `--ublk`, a kernel block device (`crate::ublk`) — which opens the cache
//! (`crate::serving`: medium, backing store, engine, state record, cleaner, control socket),
//! serves it until a signal, `pmcache detach` or an error, and stops it.

use crate::args::ServeArgs;

/// Runs the server until SIGINT, SIGTERM or `pmcache detach`.
pub fn run(args: ServeArgs) -> Result<(), String> {
    if args.ublk {
        return run_ublk(&args);
    }
    crate::nbd::run(&args)
}

#[cfg(feature = "ublk")]
fn run_ublk(args: &ServeArgs) -> Result<(), String> {
    crate::ublk::run(args)
}

#[cfg(not(feature = "ublk"))]
fn run_ublk(_args: &ServeArgs) -> Result<(), String> {
    Err(UBLK_NOT_BUILT.to_string())
}

/// Why `--ublk` and `pmcache ublk` fail in a build without the `ublk` feature, and how to get
/// one.
#[cfg(not(feature = "ublk"))]
pub const UBLK_NOT_BUILT: &str = "this pmcache was built without the ublk frontend (cargo \
    feature `ublk`, off by default: its kernel bindings are generated at build time with \
    libclang). Build it with `apt-get install -y libclang-dev && cargo build --release -p \
    pmcache-cli --features ublk`, or serve over NBD (`pmcache serve` without --ublk)";
