//! `pmcache serve --ublk`: the cache as a kernel block device, `/dev/ublkbN`, through the
//! kernel's ublk driver (`pmcache_ublk`): one queue per thread, one engine lane per queue, the
//! requests a queue received together served as the engine's batches. The cache, the
//! cleaner, the control socket and the stop are those of NBD serving (`crate::serving`);
//! SIGINT or SIGTERM stops the device (the driver lets in-flight requests complete), then
//! the device is deleted and the cache marked clean.

use pmcache_engine::{Error, ReadRequest, WriteRequest};
use pmcache_ublk::{
    BatchRead, BatchWrite, Device, DeviceConfig, Started, Stopper, Target, TargetError,
};

use crate::serve::{CacheConn, ServeArgs};
use crate::serving::{Frontend, Serving};

/// Largest read or write a request carries: each tag's buffer (per queue: depth × this).
const MAX_IO_BYTES: u32 = 1 << 20;
/// Largest logical block size the driver takes (the page size).
const MAX_LOGICAL_BLOCK_BYTES: u32 = 4096;

fn target_error(err: Error) -> TargetError {
    TargetError::new(err.errno(), err.to_string())
}

impl Target for CacheConn {
    fn read(&mut self, offset_bytes: u64, buf: &mut [u8]) -> Result<(), TargetError> {
        self.lane.read(offset_bytes, buf).map_err(target_error)
    }

    fn write(&mut self, offset_bytes: u64, data: &[u8], fua: bool) -> Result<(), TargetError> {
        self.lane.write(offset_bytes, data, fua).map_err(target_error)
    }

    /// The writes a queue received together, group-committed by the engine
    /// (`Lane::write_batch`).
    fn write_batch(
        &mut self,
        writes: &[BatchWrite<'_>],
        outcomes: &mut Vec<Result<(), TargetError>>,
    ) {
        let requests: Vec<WriteRequest<'_>> = writes
            .iter()
            .map(|w| WriteRequest { offset: w.offset_bytes, data: w.data, fua: w.fua })
            .collect();
        let mut results = Vec::with_capacity(writes.len());
        self.lane.write_batch(&requests, &mut results);
        outcomes.extend(results.into_iter().map(|r| r.map_err(target_error)));
    }

    /// The reads a queue received together, pipelined by the engine (`Lane::read_batch`).
    fn read_batch(
        &mut self,
        reads: &mut [BatchRead<'_>],
        outcomes: &mut Vec<Result<(), TargetError>>,
    ) {
        let mut requests: Vec<ReadRequest<'_>> = reads
            .iter_mut()
            .map(|r| ReadRequest { offset: r.offset_bytes, buf: &mut *r.buf })
            .collect();
        let mut results = Vec::with_capacity(requests.len());
        self.lane.read_batch(&mut requests, &mut results);
        outcomes.extend(results.into_iter().map(|r| r.map_err(target_error)));
    }

    fn flush(&mut self) -> Result<(), TargetError> {
        self.lane.flush().map_err(target_error)
    }

    fn discard(&mut self, offset_bytes: u64, len_bytes: u64) -> Result<(), TargetError> {
        self.lane.trim(offset_bytes, len_bytes).map_err(target_error)
    }

    fn write_zeroes(
        &mut self,
        offset_bytes: u64,
        len_bytes: u64,
        fua: bool,
        _may_unmap: bool,
    ) -> Result<(), TargetError> {
        self.lane.write_zeroes(offset_bytes, len_bytes, fua).map_err(target_error)
    }
}

/// The running device, as the control socket and the signals see it.
#[derive(Clone)]
struct UblkFrontend {
    stopper: Stopper,
    id: u32,
    queues: u16,
    depth: u16,
}

impl Frontend for UblkFrontend {
    fn stop(&self) {
        if let Err(e) = self.stopper.stop() {
            eprintln!("pmcache: {e}");
        }
    }

    fn stats(&self) -> Vec<(&'static str, u64)> {
        vec![
            ("ublk_device", u64::from(self.id)),
            ("ublk_queues", u64::from(self.queues)),
            ("ublk_depth", u64::from(self.depth)),
        ]
    }
}

/// Serves the cache as `/dev/ublkbN` until SIGINT, SIGTERM or `pmcache detach`.
pub fn run(args: ServeArgs) -> Result<(), String> {
    // Without the driver nothing is opened: the error says what to load, or to use NBD.
    pmcache_ublk::check_driver().map_err(|e| e.to_string())?;
    let (queues, depth) = (args.ublk_queues, args.ublk_depth);
    // One lane per queue, plus two for control requests and the cleaner's.
    let mut serving = Serving::open(&args, usize::from(queues) + 3, || Ok(()))?;
    let served = serve_device(&mut serving, queues, depth);
    serving.finish(served)
}

/// Adds the device over the opened cache and serves it until it is stopped.
fn serve_device(serving: &mut Serving, queues: u16, depth: u16) -> Result<(), String> {
    let engine = serving.engine;
    let block = engine.block_size();
    let config = DeviceConfig {
        queues,
        depth,
        size_bytes: engine.size_bytes(),
        logical_block_bytes: block.min(MAX_LOGICAL_BLOCK_BYTES),
        physical_block_bytes: block,
        max_io_bytes: MAX_IO_BYTES.max(block),
        user_recovery: true,
    };
    let device = Device::add(config).map_err(|e| e.to_string())?;
    let targets = (0..queues)
        .map(|_| engine.lane().map(|lane| CacheConn { lane }))
        .collect::<Result<Vec<_>, _>>()
        .map_err(|e| format!("engine lanes for the ublk queues: {e}"))?;
    let frontend = UblkFrontend { stopper: device.stopper(), id: device.id(), queues, depth };
    serving.start_control(frontend)?;
    let (cache, backing, control) =
        (serving.cache.clone(), serving.backing.clone(), serving.control_path.clone());
    serving.keep_control_socket();
    device
        .run(targets, move |started: &Started| {
            crate::serve::print_serving(&cache, &backing, engine);
            let recovery = if started.user_recovery { "on" } else { "not offered by the driver" };
            let device = started.block_path.display();
            println!("  ublk device: {device} ({queues} queues of depth {depth}, user recovery {recovery})");
            println!("  format:      mkfs.ext4 {device}");
            println!("  stats:       pmcache stats --control {}", control.display());
            println!(
                "  stop:        Ctrl-C or SIGTERM (the device is removed once the requests in \
                 flight complete), or `pmcache detach --cache {}`",
                cache.display()
            );
        })
        .map_err(|e| e.to_string())
}
