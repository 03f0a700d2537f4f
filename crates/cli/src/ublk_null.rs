//! `pmcache ublk null`: a ublk device with nothing behind it — reads return zeroes, writes
//! are dropped — served by the same frontend as `pmcache serve --ublk` (the driver, the
//! queues' io_uring commands, the copies to and from the tags' buffers). Its speed is the
//! frontend's ceiling on a machine: what `serve --ublk` would reach with a cache that cost
//! nothing. Benchmarks measure it beside the cache; it stores nothing.

use std::time::Duration;

use pmcache_block::{BlockConn, BlockError};
use pmcache_ublk::{Device, DeviceConfig, OwnerTag, Started};
use signal_hook::consts::{SIGINT, SIGTERM};
use signal_hook::iterator::Signals;

use crate::args::NullArgs;

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

/// Serves a null device until SIGINT or SIGTERM, then removes it.
pub fn run(args: &NullArgs) -> Result<(), String> {
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
    let polling = crate::ublk::polling(config.poll_idle);
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
