//! `pmcache serve --ublk`: the cache as a kernel block device, `/dev/ublkbN`, through the
//! kernel's ublk driver (`pmcache_ublk`): one queue per thread, one engine lane per queue, the
//! requests a queue received together served as the engine's batches. The cache, the
//! cleaner, the control socket and the stop are those both frontends share (`crate::serving`);
//! SIGINT or SIGTERM stops the device (the driver lets in-flight requests complete), then
//! the device is deleted and the cache marked clean. A server killed leaves the device (user
//! recovery); `--recover N` takes it over, and `pmcache ublk remove N` deletes it.

use std::io::Read;
use std::path::Path;
use std::sync::Arc;
use std::time::Duration;

use pmcache_engine::format::{HEADER_BYTES, Superblock};
use pmcache_frontend::{CacheConn, CacheEngine};
use pmcache_ublk::{
    Device, DeviceConfig, DeviceInfo, DeviceState, OwnerTag, QueueWaits, Started, Stopper, recovery,
};

use crate::config::ServeConfig;
use crate::control::Frontend;
use crate::serving::{Announce, CacheSummary, FrontendReady, Ready, Serving};

/// Largest read or write a request carries: each tag's buffer (per queue: depth × this).
const MAX_IO_BYTES: u32 = 1 << 20;
/// Largest logical block size the driver takes (the page size).
const MAX_LOGICAL_BLOCK_BYTES: u32 = 4096;

/// The running device, as the control socket and the signals see it.
#[derive(Clone)]
struct UblkFrontend {
    stopper: Stopper,
    id: u32,
    queues: u16,
    depth: u16,
    poll_idle: Option<Duration>,
    waits: Arc<QueueWaits>,
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
            (
                "ublk_poll_idle_us",
                self.poll_idle.map_or(0, |d| u64::try_from(d.as_micros()).unwrap_or(u64::MAX)),
            ),
            ("ublk_sleeping_waits", self.waits.slept()),
            ("ublk_polls", self.waits.polled()),
        ]
    }
}

/// How a cache is served as a ublk device.
#[derive(Clone, Copy, Debug)]
pub struct UblkConfig {
    /// Hardware queues: a thread and an engine lane each.
    pub queues: u16,
    /// Tags per queue.
    pub depth: u16,
    /// Keep the device, its requests waiting, when the server dies (user recovery).
    pub user_recovery: bool,
    /// Poll each queue's ring for this long after its last request (`None`: sleep on it).
    pub poll_idle: Option<Duration>,
    /// Take over device N, left by a server of this cache that died.
    pub recover: Option<u32>,
}

/// Serves the cache of `config` as `/dev/ublkbN` until SIGINT, SIGTERM (with
/// `config.stop_on_signals`) or `pmcache detach`; with `ublk.recover`, takes over that
/// device, left by a server of this cache that died.
pub fn serve(
    config: &ServeConfig,
    ublk: UblkConfig,
    announce: Arc<dyn Announce>,
) -> Result<(), String> {
    // Without the driver nothing is opened: the error says what to load, or to use NBD.
    pmcache_ublk::check_driver().map_err(|e| e.to_string())?;
    crate::signals::stop_on_signals(config)?;
    // A device taken over keeps its queues and depth: read them before the lanes are sized.
    // A server killed moments ago may not have been noticed by the driver yet: waited for.
    let takeover = ublk.recover.map(recovery::settle).transpose().map_err(|e| e.to_string())?;
    // Refusals that depend only on the medium's identity come before the medium is opened
    // (opening runs recovery; a refused start would then stop cleanly, writing back).
    let cache = config.cache.cache.first().map(|c| c.path.clone()).unwrap_or_default();
    if !config.stores.is_empty() {
        return serve_stores(config, ublk, &cache, announce);
    }
    if let Some(owner) = owner_of_medium(&cache) {
        match &takeover {
            // The device's shape is checked against the cache's once it is open.
            Some(info) => {
                let (size, block) = (info.size_bytes, info.logical_block_bytes);
                if let Some(why) = recovery::takeover_refusal(info, owner, size, block) {
                    return Err(why);
                }
            }
            None => refuse_orphans(owner)?,
        }
    }
    let (queues, depth) =
        takeover.as_ref().map_or((ublk.queues, ublk.depth), |d| (d.queues, d.depth));
    // One lane per queue, plus two for control requests and the cleaner's.
    let mut serving = Serving::open(config, usize::from(queues) + 3, || Ok(()), &announce)?;
    let shape = UblkConfig { queues, depth, ..ublk };
    let served = serve_device(&mut serving, shape, takeover.as_ref(), announce);
    serving.finish(served)
}

/// CPUs this process may run on.
fn online_cpus() -> usize {
    std::thread::available_parallelism().map_or(1, |n| n.get())
}

/// What an operator is told when polling queue threads would share every CPU with the
/// application: with as many queues as CPUs, the block layer maps each CPU to a queue of its
/// own and libublk pins the queue's thread there, so a polling thread spins on the very CPU
/// whose submissions it waits for (in the QEMU guest bed, QD 1 reads ran at about half the
/// sleeping server's rate that way).
fn poll_warning(poll_idle: Option<Duration>, queues: u16, cpus: usize) -> Option<String> {
    (poll_idle.is_some() && usize::from(queues) >= cpus).then(|| {
        format!(
            "--ublk-poll with {queues} queues on {cpus} CPUs: each queue's thread polls on the \
             CPU that submits to it, time-sharing it with the application; fewer queues than \
             CPUs (--ublk-queues) leave the polling threads CPUs of their own (docs/UBLK.md, \
             \"Polling\")"
        )
    })
}

/// Adds the device over the opened cache (or takes over `takeover`) and serves it until it
/// is stopped.
fn serve_device(
    serving: &mut Serving,
    shape: UblkConfig,
    takeover: Option<&DeviceInfo>,
    announce: Arc<dyn Announce>,
) -> Result<(), String> {
    let UblkConfig { queues, depth, user_recovery, poll_idle, .. } = shape;
    if let Some(warning) = poll_warning(poll_idle, queues, online_cpus()) {
        tracing::warn!("{warning}");
    }
    // The queues run on libublk's threads, which need their lanes' engine for the whole
    // process: a ublk server keeps its engine until it exits.
    let engine: &'static Arc<CacheEngine> = Box::leak(Box::new(serving.engine.clone()));
    let block = engine.block_size();
    let config = DeviceConfig {
        queues,
        depth,
        size_bytes: engine.size_bytes(),
        logical_block_bytes: block.min(MAX_LOGICAL_BLOCK_BYTES),
        physical_block_bytes: block,
        max_io_bytes: MAX_IO_BYTES.max(block),
        user_recovery,
        owner: OwnerTag::of_uuid(&engine.superblock().uuid),
        poll_idle,
    };
    let device = match takeover {
        Some(info) => Device::recover(info.id, config),
        None => Device::add(config),
    }
    .map_err(|e| e.to_string())?;
    let targets = (0..queues)
        .map(|_| engine.lane().map(|lane| CacheConn::new(lane, serving.latencies.clone())))
        .collect::<Result<Vec<_>, _>>()
        .map_err(|e| format!("engine lanes for the ublk queues: {e}"))?;
    let frontend = UblkFrontend {
        stopper: device.stopper(),
        id: device.id(),
        queues,
        depth,
        poll_idle,
        waits: device.waits(),
    };
    serving.start_control(frontend)?;
    let (cache, backing, control) =
        (serving.cache.clone(), serving.backing.clone(), serving.control_path.clone());
    let store = serving.store.clone();
    serving.keep_control_socket();
    device
        .run(targets, move |started: &Started| {
            announce.serving(&Ready {
                cache: &cache,
                backing: &backing,
                store: store.as_deref(),
                control: &control,
                summary: CacheSummary::of(engine),
                frontend: FrontendReady::Ublk {
                    started,
                    queues,
                    depth,
                    poll_idle,
                    user_recovery_asked: user_recovery,
                },
            });
        })
        .map_err(|e| e.to_string())
}

/// The owner tag of the cache on the medium at `path`, from its superblock; `None` when there
/// is no medium there or it has no valid superblock (then no device can be its).
/// `serve` for a cache shared by several backing stores: one device per store served, each
/// with its queues, stopped and detached on its own; SIGINT or SIGTERM stops them all.
fn serve_stores(
    config: &ServeConfig,
    shape: UblkConfig,
    cache: &Path,
    announce: Arc<dyn Announce>,
) -> Result<(), String> {
    for owner in owners_of_stores(cache) {
        refuse_orphans(owner)?;
    }
    let (servings, refused) =
        Serving::open_stores(config, usize::from(shape.queues) + 3, || Ok(()), &announce)?;
    for why in &refused {
        eprintln!("pmcache: not serving {why}");
    }
    crate::serving::serve_each_store(servings, move |serving| {
        serve_device(serving, shape, None, announce.clone())
    })
}

/// The owner tags of the stores' caches on a medium shared by several (from its store table
/// and each window's superblock), for the devices a dead server left.
fn owners_of_stores(path: &Path) -> Vec<OwnerTag> {
    use std::os::unix::fs::FileExt;
    let Ok(Some(table)) = crate::stores::store_table_of(path) else { return Vec::new() };
    let Ok(file) = std::fs::File::open(path) else { return Vec::new() };
    table
        .stores
        .iter()
        .filter_map(|store| {
            let mut header = [0u8; HEADER_BYTES];
            file.read_exact_at(&mut header, store.window.start).ok()?;
            let window_bytes = store.window.end - store.window.start;
            let superblock = Superblock::decode(&header, window_bytes).ok()?;
            Some(OwnerTag::of_uuid(&superblock.uuid))
        })
        .collect()
}

fn owner_of_medium(path: &Path) -> Option<OwnerTag> {
    let mut file = std::fs::File::open(path).ok()?;
    let medium_bytes = file.metadata().ok()?.len();
    let mut header = [0u8; HEADER_BYTES];
    file.read_exact(&mut header).ok()?;
    let superblock = Superblock::decode(&header, medium_bytes).ok()?;
    Some(OwnerTag::of_uuid(&superblock.uuid))
}

/// Refuses to add a device for a cache that a device left by a dead server still holds: the
/// file system mounted on it would wait forever, and its blocks are this cache's. Devices of
/// this cache that the driver already stopped (their server died without user recovery) are
/// removed: nothing waits on them.
fn refuse_orphans(owner: OwnerTag) -> Result<(), String> {
    // Listing is best effort: a device that cannot be read is not this cache's orphan. One
    // whose server died moments ago is waited for until the driver has noticed.
    let devices: Vec<DeviceInfo> = recovery::list()
        .unwrap_or_default()
        .into_iter()
        .filter(|d| d.owner == owner)
        .map(|d| if d.server_alive { d } else { recovery::settle(d.id).unwrap_or(d) })
        .collect();
    let ours = devices.iter();
    for dead in ours.clone().filter(|d| d.state == DeviceState::Dead && !d.server_alive) {
        match recovery::remove(dead.id) {
            // The driver forgets the server's process once it stops the device (-1).
            Ok(()) if dead.server_pid > 0 => eprintln!(
                "pmcache: removed /dev/ublkb{}, stopped after its server (process {}) died",
                dead.id, dead.server_pid
            ),
            Ok(()) => {
                eprintln!("pmcache: removed /dev/ublkb{}, stopped after its server died", dead.id)
            }
            Err(e) => eprintln!("pmcache: warning: /dev/ublkb{} stays: {e}", dead.id),
        }
    }
    match ours.clone().find(|d| d.orphaned()) {
        None => Ok(()),
        Some(orphan) if !orphan.user_recovery => Err(format!(
            "/dev/ublkb{id} (left by process {pid}, which died; no user recovery: its requests \
             fail) serves this cache: remove it with `pmcache ublk remove {id}` and start again",
            id = orphan.id,
            pid = orphan.server_pid,
        )),
        Some(orphan) => Err(format!(
            "/dev/ublkb{id} ({state}, left by process {pid}) serves this cache: take it over \
             with `pmcache serve --ublk --recover {id}` (a file system mounted on it carries \
             on), or remove it with `pmcache ublk remove {id}` (its waiting requests fail) and \
             start again",
            id = orphan.id,
            state = orphan.state,
            pid = orphan.server_pid,
        )),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Polling is warned about only when every CPU has a queue (and so a pinned poller).
    #[test]
    fn polling_on_every_cpu_is_warned_about() {
        let on = Some(Duration::from_micros(1000));
        let warning = poll_warning(on, 2, 2).expect("a queue per CPU");
        assert!(warning.contains("2 queues on 2 CPUs") && warning.contains("--ublk-queues"));
        assert!(poll_warning(on, 4, 2).is_some());
        assert_eq!(poll_warning(on, 1, 2), None, "one queue leaves a CPU free");
        assert_eq!(poll_warning(None, 2, 2), None, "a sleeping server is not warned about");
    }
}
