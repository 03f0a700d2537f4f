//! `pmcache serve --vhost-user-blk SOCKET`: the cache as a virtio-blk disk of a VM, served to
//! its VMM (QEMU's `vhost-user-blk-pci`) over a unix socket (`pmcache_vhost`): one thread and
//! one engine lane per virtqueue, the guest's requests served from and into its own memory.
//! No kernel module is involved. A VMM that goes away (a VM shut down, or QEMU waiting to
//! reconnect after this server was killed) is waited for again; SIGINT, SIGTERM or `pmcache
//! detach` stop the server: the connection is closed and the cache finished as for the other
//! frontends (`crate::serving`). A cache shared by several backing stores serves each store on
//! a socket of its own, `SOCKET/NAME.sock`, SOCKET then being a directory.

use std::path::{Path, PathBuf};
use std::sync::Arc;

use pmcache_frontend::{CacheConn, CacheEngine};
use pmcache_vhost::{Geometry, Stopper};

use crate::config::ServeConfig;
use crate::control::Frontend;
use crate::nbd::remove_stale_socket;
use crate::serving::{Announce, CacheSummary, FrontendReady, Ready, Serving};

/// Largest logical block the guest is told of (Linux takes up to the page size).
const MAX_LOGICAL_BLOCK_BYTES: u32 = 4096;

/// How a cache is served to a VMM.
#[derive(Clone, Debug)]
pub struct VhostConfig {
    /// The socket the VMM connects to (a directory of `NAME.sock` sockets for a cache shared
    /// by several stores).
    pub socket: PathBuf,
    /// Virtqueues: a thread and an engine lane each (QEMU's `num-queues` up to this).
    pub queues: u16,
    /// Descriptors per virtqueue, at most (QEMU's `queue-size` up to this).
    pub queue_size: u16,
    /// Offer the disk read-only: writes, discards and write-zeroes are refused.
    pub read_only: bool,
}

/// The running server, as the control socket and the signals see it.
#[derive(Clone)]
struct VhostFrontend {
    stopper: Stopper,
    queues: u16,
}

impl Frontend for VhostFrontend {
    fn stop(&self) {
        self.stopper.stop();
    }

    fn stats(&self) -> Vec<(&'static str, u64)> {
        let c = self.stopper.counters();
        vec![
            ("vhost_queues", u64::from(self.queues)),
            ("vhost_connections", self.stopper.connections()),
            ("vhost_requests", c.requests),
            ("vhost_batches", c.batches),
            ("vhost_request_errors", c.errors),
            ("vhost_requests_bounced", c.bounced),
        ]
    }
}

/// Serves the cache of `config` to VMMs on `vhost.socket` until SIGINT, SIGTERM (with
/// `config.stop_on_signals`) or `pmcache detach`.
pub fn serve(
    config: &ServeConfig,
    vhost: VhostConfig,
    announce: Arc<dyn Announce>,
) -> Result<(), String> {
    if vhost.queues == 0 || vhost.queues > 64 {
        return Err(format!("{} virtqueues: from 1 to 64", vhost.queues));
    }
    if !vhost.queue_size.is_power_of_two() || vhost.queue_size < 2 {
        return Err(format!("a queue size of {}: a power of two from 2", vhost.queue_size));
    }
    crate::signals::stop_on_signals(config)?;
    // One lane per virtqueue, plus two for control requests and the cleaner's.
    let lanes = usize::from(vhost.queues) + 3;
    if !config.stores.is_empty() {
        return serve_stores(config, vhost, lanes, announce);
    }
    let mut serving =
        Serving::open(config, lanes, || remove_stale_socket(&vhost.socket), &announce)?;
    let served = serve_socket(&mut serving, &vhost, &vhost.socket, announce);
    serving.finish(served)
}

/// Serves one opened cache on `socket` until it is stopped.
fn serve_socket(
    serving: &mut Serving,
    vhost: &VhostConfig,
    socket: &Path,
    announce: Arc<dyn Announce>,
) -> Result<(), String> {
    // The virtqueues' threads are the daemon's: each connection's lanes borrow an engine kept
    // for the whole process.
    let engine: &'static Arc<CacheEngine> = Box::leak(Box::new(serving.engine.clone()));
    let block = engine.block_size();
    let logical = block.min(MAX_LOGICAL_BLOCK_BYTES);
    let geometry = Geometry {
        size_bytes: engine.size_bytes(),
        block_bytes: logical,
        physical_block_exp: (block / logical).trailing_zeros() as u8,
        queues: vhost.queues,
        queue_size: vhost.queue_size,
        read_only: vhost.read_only,
        serial: serial_of(&engine.superblock().uuid),
    };
    let stopper = Stopper::default();
    serving.start_control(VhostFrontend { stopper: stopper.clone(), queues: vhost.queues })?;
    let (cache, backing, control) =
        (serving.cache.clone(), serving.backing.clone(), serving.control_path.clone());
    let store = serving.store.clone();
    serving.keep_control_socket();
    let latencies = serving.latencies.clone();
    let targets = || {
        (0..vhost.queues)
            .map(|_| engine.lane().map(|lane| CacheConn::new(lane, latencies.clone())))
            .collect::<Result<Vec<_>, _>>()
            .map_err(|e| format!("engine lanes for the virtqueues: {e}"))
    };
    let ready = || {
        announce.serving(&Ready {
            cache: &cache,
            backing: &backing,
            store: store.as_deref(),
            control: &control,
            summary: CacheSummary::of(engine),
            frontend: FrontendReady::VhostUserBlk {
                socket,
                queues: vhost.queues,
                queue_size: vhost.queue_size,
                read_only: vhost.read_only,
            },
        })
    };
    pmcache_vhost::serve(socket, geometry, targets, &stopper, ready).map_err(|e| e.to_string())
}

/// The device ID a guest reads (GET_ID, `/sys/block/vdX/serial`): "pmcache-" and the first
/// six bytes of the cache's UUID in hex, 20 bytes.
fn serial_of(uuid: &[u8; 16]) -> [u8; pmcache_vhost::virtio::ID_BYTES] {
    let text: String = std::iter::once("pmcache-".to_string())
        .chain(uuid[..6].iter().map(|b| format!("{b:02x}")))
        .collect();
    let mut serial = [0u8; pmcache_vhost::virtio::ID_BYTES];
    serial[..text.len()].copy_from_slice(text.as_bytes());
    serial
}

/// `serve` for a cache shared by several backing stores: each store on its own socket in the
/// directory `vhost.socket`, served and finished on its own; SIGINT or SIGTERM stops them all.
fn serve_stores(
    config: &ServeConfig,
    vhost: VhostConfig,
    lanes: usize,
    announce: Arc<dyn Announce>,
) -> Result<(), String> {
    let dir = vhost.socket.clone();
    let check = || {
        if !dir.is_dir() {
            return Err(format!(
                "{}: with --store, --vhost-user-blk names the directory of the stores' sockets \
                 (NAME.sock each), which must exist",
                dir.display()
            ));
        }
        config.stores.iter().try_for_each(|s| remove_stale_socket(&store_socket(&dir, &s.name)))
    };
    let (servings, refused) = Serving::open_stores(config, lanes, check, &announce)?;
    for why in &refused {
        eprintln!("pmcache: not serving {why}");
    }
    crate::serving::serve_each_store(servings, move |serving| {
        let socket = store_socket(&dir, serving.store.as_deref().unwrap_or_default());
        serve_socket(serving, &vhost, &socket, announce.clone())
    })
}

/// The socket of store `name` in the directory `dir`.
pub fn store_socket(dir: &Path, name: &str) -> PathBuf {
    dir.join(format!("{name}.sock"))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_serial_is_twenty_bytes_of_the_uuid() {
        let uuid = [0xab, 0xcd, 0xef, 0x01, 0x23, 0x45, 0x67, 0, 0, 0, 0, 0, 0, 0, 0, 0];
        assert_eq!(&serial_of(&uuid), b"pmcache-abcdef012345");
    }
}
