//! `pmcache ublk`: the ublk devices there are (`list`), removing one a dead server left
//! (`remove`), and what `serve --ublk` prints of its device.
//!
//! `pmcache ublk null`: a ublk device with nothing behind it — reads return zeroes, writes
//! are dropped — served by the same frontend as `pmcache serve --ublk` (the driver, the
//! queues' io_uring commands, the copies to and from the tags' buffers). Its speed is the
//! frontend's ceiling on a machine: what `serve --ublk` would reach with a cache that cost
//! nothing. Benchmarks measure it beside the cache; it stores nothing.

use std::time::Duration;

use pmcache_block::{BlockConn, BlockError};
use pmcache_serve::Ready;
use pmcache_ublk::{Device, DeviceConfig, OwnerTag, Started, recovery};
use signal_hook::consts::{SIGINT, SIGTERM};
use signal_hook::iterator::Signals;

use crate::args::{NullArgs, UblkArgs, UblkCommand};

/// Logical block size of the null device.
const BLOCK_BYTES: u32 = 4096;
/// Largest request, as `serve --ublk`'s.
const MAX_IO_BYTES: u32 = 1 << 20;
/// The owner tag of null devices: no cache has it (`pmcache ublk list` shows it).
const NULL_OWNER: OwnerTag = OwnerTag(0);

/// One queue's target: stores nothing.
struct NullTarget;

impl BlockConn for NullTarget {
    fn read(&mut self, _offset_bytes: u64, buf: &mut [u8]) -> Result<(), BlockError> {
        buf.fill(0);
        Ok(())
    }

    fn write(&mut self, _offset_bytes: u64, _data: &[u8], _fua: bool) -> Result<(), BlockError> {
        Ok(())
    }

    fn flush(&mut self) -> Result<(), BlockError> {
        Ok(())
    }

    fn trim(&mut self, _offset_bytes: u64, _len_bytes: u64, _fua: bool) -> Result<(), BlockError> {
        Ok(())
    }

    fn write_zeroes(
        &mut self,
        _offset_bytes: u64,
        _len_bytes: u64,
        _fua: bool,
        _may_unmap: bool,
    ) -> Result<(), BlockError> {
        Ok(())
    }
}

/// Runs `pmcache ublk …`.
pub fn manage(args: UblkArgs) -> Result<(), String> {
    match args.command {
        UblkCommand::List => {
            let devices = recovery::list().map_err(|e| e.to_string())?;
            if devices.is_empty() {
                println!("no ublk devices");
            }
            for d in devices {
                let server = if d.server_alive { "running" } else { "gone" };
                let recovery = match (d.user_recovery, d.orphaned()) {
                    (false, _) => "no user recovery",
                    (true, true) => "can be taken over",
                    (true, false) => "user recovery on",
                };
                println!(
                    "/dev/ublkb{}: {}, server {} ({server}), {} queues of depth {}, {} B, owner \
                     {:#018x}, {recovery}",
                    d.id, d.state, d.server_pid, d.queues, d.depth, d.size_bytes, d.owner.0
                );
            }
            Ok(())
        }
        UblkCommand::Null(args) => run_null(&args),
        UblkCommand::Remove { id } => {
            recovery::remove(id).map_err(|e| e.to_string())?;
            println!(
                "removed /dev/ublkb{id}: its number is free once nothing holds it (unmount a \
                 file system mounted on it)"
            );
            Ok(())
        }
    }
}

/// What the startup lines say of the queue threads' waits.
fn polling(poll_idle: Option<Duration>) -> String {
    match poll_idle {
        Some(idle) => format!("polling: on, {} µs after the last request", idle.as_micros()),
        None => "polling: off".to_owned(),
    }
}

/// The lines `serve --ublk` prints once its device is up: where it is, what a kill does, and
/// how to stop it.
pub fn print_device(
    ready: &Ready<'_>,
    started: &Started,
    (queues, depth): (u16, u16),
    poll_idle: Option<Duration>,
    user_recovery_asked: bool,
) {
    let device = started.block_path.display();
    let id = started.id;
    let polling = polling(poll_idle);
    if started.recovered {
        println!(
            "  ublk device: {device}, taken over ({queues} queues of depth {depth}, {polling})"
        );
    } else {
        println!("  ublk device: {device} ({queues} queues of depth {depth}, {polling})");
        println!("  format:      mkfs.ext4 {device}");
    }
    if started.user_recovery {
        println!(
            "  if killed:   the device stays; `pmcache serve --ublk --recover {id}` with the same \
             cache takes it over"
        );
    } else {
        println!(
            "  if killed:   the device fails its requests (user recovery {}); `pmcache ublk \
             remove {id}` deletes it, and a restart serves a new device",
            if user_recovery_asked { "not offered by this kernel" } else { "off" }
        );
    }
    println!("  stats:       pmcache stats --control {}", ready.control.display());
    let store_arg = ready.store.map(|name| format!(" --store {name}")).unwrap_or_default();
    println!(
        "  stop:        Ctrl-C or SIGTERM (the device is removed once the requests in flight \
         complete), or `pmcache detach --cache {}{store_arg}`",
        ready.cache.display()
    );
}

/// Serves a null device until SIGINT or SIGTERM, then removes it.
pub fn run_null(args: &NullArgs) -> Result<(), String> {
    pmcache_ublk::check_driver().map_err(|e| e.to_string())?;
    if !args.size_bytes.is_multiple_of(u64::from(BLOCK_BYTES)) {
        return Err(format!("--size must be a multiple of {BLOCK_BYTES} bytes"));
    }
    let config = DeviceConfig {
        queues: args.queues,
        depth: args.depth,
        size_bytes: args.size_bytes,
        logical_block_bytes: BLOCK_BYTES,
        physical_block_bytes: BLOCK_BYTES,
        max_io_bytes: MAX_IO_BYTES,
        user_recovery: false,
        owner: NULL_OWNER,
        poll_idle: args.poll.then(|| Duration::from_micros(args.poll_idle_us)),
    };
    config.validate().map_err(|e| e.to_string())?;
    let device = Device::add(config).map_err(|e| e.to_string())?;
    let stopper = device.stopper();
    let mut signals = Signals::new([SIGINT, SIGTERM]).map_err(|e| e.to_string())?;
    std::thread::Builder::new()
        .name("pmcache-signals".into())
        .spawn(move || {
            if signals.forever().next().is_some()
                && let Err(e) = stopper.stop()
            {
                eprintln!("pmcache: {e}");
            }
        })
        .map_err(|e| format!("signal thread: {e}"))?;
    let (queues, depth) = (args.queues, args.depth);
    let polling = polling(config.poll_idle);
    let targets = (0..queues).map(|_| NullTarget).collect();
    device
        .run(targets, move |started: &Started| {
            println!(
                "  ublk device: {} (null: reads return zeroes, writes are dropped; {queues} \
                 queues of depth {depth}, {polling})",
                started.block_path.display()
            );
            println!("  stop:        Ctrl-C or SIGTERM");
        })
        .map_err(|e| e.to_string())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reads_are_zeroes_and_everything_else_succeeds() {
        let mut target = NullTarget;
        let mut buf = vec![0xa5u8; 8192];
        target.read(4096, &mut buf).expect("read");
        assert!(buf.iter().all(|&b| b == 0));
        target.write(0, &[1; 4096], true).expect("write");
        target.flush().expect("flush");
        target.trim(0, 1 << 20, false).expect("trim");
        target.write_zeroes(0, 1 << 20, false, true).expect("write zeroes");
    }
}
