//! SIGINT and SIGTERM: one thread for the whole process, installed before the cache is
//! opened, that stops every frontend through the server's [`StopHandle`]. A frontend
//! registered after the signal (a store of a shared cache still starting, or a cache still
//! being opened or recovered) is stopped as soon as it registers, so a signal never leaves
//! part of a server running. A second signal ends the process at once.

use signal_hook::consts::{SIGINT, SIGTERM};
use signal_hook::iterator::Signals;

use crate::config::{ServeConfig, StopHandle};

/// With `config.stop_on_signals`, has SIGINT and SIGTERM stop the server through
/// `config.stop` from now on; without it, does nothing.
pub(crate) fn stop_on_signals(config: &ServeConfig) -> Result<(), String> {
    if !config.stop_on_signals {
        return Ok(());
    }
    let mut signals = Signals::new([SIGINT, SIGTERM]).map_err(|e| e.to_string())?;
    let stop = config.stop.clone();
    std::thread::Builder::new()
        .name("pmcache-signals".into())
        .spawn(move || {
            let mut received = signals.forever();
            if received.next().is_some() {
                eprintln!(
                    "pmcache: shutting down: {} (a second SIGINT or SIGTERM stops at once)",
                    what_a_stop_does(&stop)
                );
                stop.stop();
            }
            // A shutdown can wait (a client that stopped reading is cut after a grace
            // period; a detach writes everything back): a second signal ends the process
            // at once. Nothing acknowledged is lost by that: every acknowledged write is
            // already durable on the medium, and the next start recovers the cache as
            // after a crash (unclean shutdown).
            if let Some(signal) = received.next() {
                let lost = if stop.medium_volatile() == Some(true) {
                    " (the medium is volatile: a reboot before that start loses the blocks not \
                     written back)"
                } else {
                    ""
                };
                eprintln!(
                    "pmcache: second signal: stopping at once, without a clean shutdown; \
                     acknowledged writes are on the medium and the next start recovers \
                     them{lost}"
                );
                std::process::exit(128 + signal);
            }
        })
        .map_err(|e| e.to_string())?;
    Ok(())
}

/// What the stop does from here, as the medium is known.
fn what_a_stop_does(stop: &StopHandle) -> &'static str {
    match stop.medium_volatile() {
        Some(true) => {
            "requests in flight finish, then every dirty block is written back (the medium is \
             volatile) and the cache is marked clean"
        }
        Some(false) => "requests in flight finish, then the cache is marked clean",
        None => {
            "the cache is still being opened: once it is, it is stopped before it serves and \
             marked clean"
        }
    }
}
