//! The command line of `pmcache serve` (NBD or ublk) and of `pmcache ublk`: parsed and
//! checked by clap, nothing opened. Every frontend reads its options from here, whether or
//! not it was built (a build without the `ublk` feature still parses `--ublk`, to refuse it
//! with what to do).

use pmcache_backing::wrappers::LatencyDist;
use pmcache_frontend::units::{parse_nonzero_size, parse_size};
use pmcache_serve::open::parse_admission;
use std::net::SocketAddr;
use std::path::PathBuf;

use pmcache_media::MediumSync;

use pmcache_engine::{AdmissionConfig, CacheMode, EvictionKind, PlacementPolicy};
use pmcache_serve::{CacheConfig, CacheSpec, StoreSpec};

use crate::tls::TlsArgs;

/// Default cache medium of `pmcache serve` with no arguments.
pub const DEFAULT_CACHE: &str = "/dev/shm/pmcache-default.pm";
/// Default backing file of `pmcache serve` with no arguments.
pub const DEFAULT_BACKING: &str = "./pmcache-data/backing.img";

/// `--medium-sync`'s long help (shared by the commands that open a medium).
pub const MEDIUM_SYNC_HELP: &str = "How a cache medium that is neither DAX nor volatile is made \
durable. `auto`: DAX (a MAP_SYNC mapping: a file on a DAX file system, or device-dax) is \
persistent; a file on tmpfs, ramfs or hugetlbfs (/dev/shm) is volatile (survives a crash of \
the process, not a reboot); anything else (a file on ext4, xfs, ..., a block device) is \
refused, since its mapping lives in the page cache and would come back from a power cut as an \
arbitrary subset of its pages. `msync`: accept such a medium and make every persist call \
msync(MS_SYNC) on the pages it covers, so that each acknowledged write is on the device. The \
cost: every cache write waits for two msyncs (its data block's page, then its metadata \
entry's), each a page write and a device flush: some hundreds of writes per second on a disk against hundreds of thousands \
on /dev/shm (`pmcache bench media-kinds` measures it here).";

/// How a new cache medium is shaped, and how a medium is made durable: what `format`
/// records and `serve` formats a new cache with.
#[derive(Debug, Clone, clap::Args)]
pub struct MediumArgs {
    /// How a medium that is neither DAX nor volatile is made durable: `auto` refuses it,
    /// `msync` syncs its pages at every persist (slow: a device write per cache write).
    #[arg(long, default_value = "auto", value_name = "auto|msync", long_help = MEDIUM_SYNC_HELP)]
    pub medium_sync: MediumSync,
    /// Size of a new cache medium, each member's (K, M, G, T suffixes; powers of 1024)
    /// [default: 1G]. Given for an existing cache, it must be the media's size.
    #[arg(long, value_parser = parse_size)]
    pub cache_size: Option<u64>,
    /// Cache block size in bytes, for a new cache [default: 4096]. Given for an existing
    /// cache, it must be the cache's.
    #[arg(long)]
    pub block_size: Option<u32>,
    /// Give each cached block a CRC32C, written with it and checked on every read from the
    /// cache (hits, write-back): a block that fails is re-read from the backing store if it
    /// is clean there, and an error if it is dirty — never other data. For a new cache (a
    /// format choice, costing a checksum per block read or written: docs/PERFORMANCE.md);
    /// an existing cache keeps what it was formatted with.
    #[arg(long)]
    pub data_crc: bool,
}

/// How a served cache behaves: its mode and policies, and how its backing store is driven.
#[derive(Debug, Clone, clap::Args)]
pub struct PolicyArgs {
    /// Cache mode: writeback, writethrough, writearound, passthrough, writeonly (also with a
    /// hyphen: write-back, ...).
    #[arg(long, default_value = "writeback")]
    pub mode: CacheMode,
    /// Backing-store I/O engine: psync, pvsync2, pvsync2-hipri, libaio, io_uring,
    /// io_uring-iopoll, io_uring-sqpoll (default: io_uring; see docs/ENGINES.md).
    #[arg(long)]
    pub engine: Option<String>,
    /// Eviction policy: clock or fifo.
    #[arg(long, default_value = "clock")]
    pub eviction: EvictionKind,
    /// Which read misses are admitted into the cache: `always`; `seq-cutoff=SIZE` (all but
    /// what a sequential stream reads past SIZE, so a backup's scan does not flush the cache;
    /// the default, at 4M); `n-hit=N` (a block on its N-th miss within the recent window).
    /// Changed at run time with `pmcache set admission=...`.
    #[arg(long, default_value = "seq-cutoff=4M", value_parser = parse_admission, value_name = "always|seq-cutoff=SIZE|n-hit=N")]
    pub admission: AdmissionConfig,
    /// Where a cache of several members places writes: `local` (the member of the writer's
    /// NUMA node, falling back to the nearest) or `interleave` (every member in turn).
    #[arg(long, default_value = "local", value_name = "local|interleave")]
    pub placement: PlacementPolicy,
    /// Attach an existing cache although the file at --backing is another file than the one
    /// it was formatted for (another inode: a copy, a move across file systems, a restore).
    /// You vouch that it holds the data the cache was written over; its size and path must
    /// still match. Needed at every attach until the cache is formatted again.
    #[arg(long)]
    pub backing_moved: bool,
    /// Give every backing-store read and write at least this latency, as a slower device
    /// would (for benches and tests of a cache in front of a network disk or an HDD): a time
    /// (`2ms`, `500us`) or a device preset (`hdd`: 2–14 ms, `sata-ssd`: 90–300 µs,
    /// `nvme-ssd`: 60–70 µs). Requests overlap without limit.
    #[arg(long, value_parser = LatencyDist::parse, value_name = "TIME|hdd|sata-ssd|nvme-ssd")]
    pub backing_latency: Option<LatencyDist>,
}

/// The cache on `cache` in front of `backing`, shaped by `medium` and run by `policy`.
pub fn cache_config(
    cache: Vec<CacheSpec>,
    backing: PathBuf,
    medium: &MediumArgs,
    policy: &PolicyArgs,
) -> CacheConfig {
    CacheConfig {
        cache,
        medium_sync: medium.medium_sync,
        backing,
        cache_size: medium.cache_size,
        block_size: medium.block_size,
        data_crc: medium.data_crc,
        mode: policy.mode,
        engine: policy.engine.clone(),
        eviction: policy.eviction,
        placement: policy.placement,
        backing_moved: policy.backing_moved,
        admission: policy.admission,
        backing_latency: policy.backing_latency,
    }
}

/// Options of `pmcache serve`. With none, it runs on the embedded default.
#[derive(Debug, Clone, clap::Args)]
pub struct ServeArgs {
    /// Read these settings from a TOML file, one key per flag under the flag's name, without
    /// the leading `--` (`cache = "/dev/shm/pm0"`, `cache-size = "1G"`, `mode = "write-back"`,
    /// `data-crc = true`, `cleaner = ["order=lba"]`); a flag given beside it replaces the
    /// file's setting (docs/OPERATIONS.md).
    #[arg(long, value_name = "FILE")]
    pub config: Option<PathBuf>,
    /// The cache medium: a file on a DAX file system, a device-dax node, or a file in /dev/shm
    /// (emulated PM); any other file only with --medium-sync msync (default: a 1 GiB file in
    /// /dev/shm). Given several times, one medium per NUMA node as PATH@NODE, the cache is a
    /// set of members and each write lands on its writer's node (docs/NUMA.md).
    #[arg(long, value_name = "PATH[@NODE]")]
    pub cache: Vec<CacheSpec>,
    /// The backing store: a file, a block device, or a Ceph RBD image as
    /// rbd:POOL[/NAMESPACE]/IMAGE[:id=USER][:conf=PATH][:KEY=VALUE]... (docs/RBD.md) (default:
    /// a sparse 8 GiB file under ./pmcache-data, created if missing).
    #[arg(long)]
    pub backing: Option<PathBuf>,
    /// A backing store of a cache shared by several, as NAME=PATH (repeatable, instead of
    /// --backing): the medium is cut into one window per store at format, each a cache of
    /// its own served as NBD export NAME (or its own /dev/ublkbN with --ublk), with its own
    /// control socket (the cache path + ".NAME.ctl": `pmcache stats --store NAME`), recovery,
    /// write-back, detach and state record. A store whose backing store cannot be opened is
    /// refused by name and the others are served (docs/STORES.md).
    #[arg(long = "store", value_name = "NAME=PATH", value_parser = parse_store, conflicts_with_all = ["backing", "export", "recover", "state_file"])]
    pub stores: Vec<StoreSpec>,
    #[command(flatten)]
    pub medium: MediumArgs,
    #[command(flatten)]
    pub policy: PolicyArgs,
    /// TCP address to listen on (loopback unless --allow-remote).
    #[arg(long, default_value = "127.0.0.1:10809", conflicts_with = "socket")]
    pub listen: SocketAddr,
    /// Listen on a unix socket instead of TCP.
    #[arg(long)]
    pub socket: Option<PathBuf>,
    /// Allow listening on a non-loopback address. Other hosts must then be authenticated
    /// (--tls=require with --tls-psk, or with --tls-certificates and --tls-verify-peer) unless
    /// --allow-unauthenticated is given.
    #[arg(long)]
    pub allow_remote: bool,
    /// With --allow-remote: serve other hosts although no client is authenticated (TLS off,
    /// `--tls=on`, which serves plain clients too, or certificates without
    /// --tls-verify-peer): anyone who reaches the port reads and writes the device.
    #[arg(long, requires = "allow_remote")]
    pub allow_unauthenticated: bool,
    #[command(flatten)]
    pub tls: TlsArgs,
    /// Export name.
    #[arg(long, default_value = "pmcache")]
    pub export: String,
    /// Most simultaneous client connections.
    #[arg(long, default_value_t = 16)]
    pub max_connections: usize,
    /// Seconds a client has to take each batch of replies off its socket; a client that stops
    /// reading (or reads too slowly) is dropped then, freeing its connection, engine lane and
    /// buffers.
    #[arg(long, value_name = "SECONDS", default_value_t = 30.0, value_parser = positive_seconds)]
    pub write_timeout: f64,
    /// Seconds a connection may stay idle (no request from its client) before it is dropped;
    /// 0 keeps idle connections (the default: the kernel's NBD client keeps an idle mounted
    /// device's connection open for as long as the mount lives).
    #[arg(long, value_name = "SECONDS", default_value_t = 0.0, value_parser = seconds)]
    pub idle_timeout: f64,
    /// Control socket for `pmcache stats/flush/detach` (default: the cache path + ".ctl").
    #[arg(long)]
    pub control: Option<PathBuf>,
    /// A setting of the background cleaner, `KEY=VALUE` (repeatable; change it later with
    /// `pmcache set`): order=lba|oldest|none, adaptive=off|boost|boost-pid, target_pct,
    /// high_pct, low_pct, idle_target_pct, idle_ms, queue_depth, batch_blocks, merge_blocks,
    /// kp, ki, kd, rate_min, rate_max, nice_base, nice_boost, nice_writers, stall_timeout_ms,
    /// throttle_pct.
    /// `order=none` runs no cleaner (writers then write back inline).
    #[arg(long = "cleaner", value_name = "KEY=VALUE")]
    pub cleaner: Vec<String>,
    /// Where the attachment of the backing store to a cache on a volatile medium (tmpfs,
    /// ramfs, hugetlbfs: lost at a reboot) is recorded, outside the medium [default: found by
    /// the backing store's identity — beside a backing file, under its canonical path (or the
    /// record in its directory that names its inode, after a rename); for a block device,
    /// <state dir>/<its persistent name>.pmcache-state, the name from its device-mapper UUID,
    /// loop file, WWID or /dev/disk/by-id]. `serve` refuses to start when it records blocks
    /// that may not have been written back from a cache that is gone (docs/DURABILITY.md,
    /// "Stop and lost volatile media").
    #[arg(long, value_name = "PATH")]
    pub state_file: Option<PathBuf>,
    /// The directory of the state records of block devices [default: /var/lib/pmcache].
    #[arg(long, value_name = "DIR", conflicts_with = "state_file")]
    pub state_dir: Option<PathBuf>,
    /// Serve the cache as a kernel block device, /dev/ublkbN, through the kernel's ublk
    /// driver (Linux 6.0 or later, module ublk_drv; needs root) instead of over NBD
    /// (docs/UBLK.md). One thread and one engine lane per queue.
    #[arg(long, conflicts_with_all = ["listen", "socket", "allow_remote", "allow_unauthenticated", "export"])]
    pub ublk: bool,
    /// ublk hardware queues: a thread and an engine lane each.
    #[arg(long, value_name = "N", default_value_t = 1, requires = "ublk")]
    pub ublk_queues: u16,
    /// ublk tags per queue: the requests each queue can have in flight.
    #[arg(long, value_name = "N", default_value_t = 128, requires = "ublk")]
    pub ublk_depth: u16,
    /// What a device does when its server dies: `on`, it stays with its requests waiting
    /// (and a file system mounted on it waiting too) until `--recover N` takes it over; `off`,
    /// the driver fails its requests at once (the file system sees I/O errors) and `pmcache
    /// ublk remove N` deletes it. Kernels without user recovery behave as `off`.
    #[arg(long, value_enum, value_name = "on|off", default_value = "on", requires = "ublk")]
    pub ublk_recovery: Switch,
    /// Poll each ublk queue's ring instead of sleeping on it while requests keep coming: the
    /// next request is picked up without a wake-up (lower latency, above all at queue depth
    /// 1), at the cost of a CPU busy per queue while I/O flows and for --ublk-poll-idle-us
    /// after the last request (docs/UBLK.md, "Polling").
    #[arg(long, requires = "ublk")]
    pub ublk_poll: bool,
    /// With --ublk-poll: how long a queue goes on polling after its last request before it
    /// sleeps again, in microseconds.
    #[arg(long, value_name = "N", default_value_t = 1000, requires = "ublk_poll", value_parser = poll_idle_us)]
    pub ublk_poll_idle_us: u64,
    /// Serve the cache as a VM's virtio-blk disk to a VMM on this unix socket, instead of over
    /// NBD: QEMU's `-device vhost-user-blk-pci` (guest memory shared, `memory-backend-memfd
    /// ... share=on`) connects to it, and the guest's requests are served from and into its
    /// own memory, no kernel module needed (docs/VHOST.md). A VMM that goes away is waited for
    /// again (QEMU's `-chardev socket,...,reconnect-ms=1000` reconnects after a restart). With
    /// --store, a directory: each store is served on NAME.sock in it.
    #[arg(long, value_name = "SOCKET", conflicts_with_all = ["listen", "socket", "allow_remote", "allow_unauthenticated", "export", "ublk"])]
    pub vhost_user_blk: Option<PathBuf>,
    /// vhost-user-blk virtqueues: a thread and an engine lane each (QEMU's num-queues may be
    /// up to this).
    #[arg(long, value_name = "N", default_value_t = 1, requires = "vhost_user_blk")]
    pub vhost_queues: u16,
    /// Descriptors per vhost-user-blk virtqueue, at most (QEMU's queue-size, 128 by default,
    /// may be up to this; a power of two).
    #[arg(long, value_name = "N", default_value_t = 256, requires = "vhost_user_blk")]
    pub vhost_queue_size: u16,
    /// Offer the vhost-user-blk disk read-only: the guest sees a read-only disk, and writes,
    /// discards and write-zeroes are refused.
    #[arg(long, requires = "vhost_user_blk")]
    pub vhost_read_only: bool,
    /// Take over /dev/ublkbN, left by a server of this cache that died (user recovery): the
    /// cache is recovered from its medium, the device keeps its number, queues and depth, and
    /// a file system mounted on it carries on. Refused for a device of another cache, a
    /// device still served, or one added without user recovery (`pmcache ublk list` shows
    /// them all).
    #[arg(long, value_name = "N", requires = "ublk")]
    pub recover: Option<u32>,
    /// Start although the state file records that the backing store may lack blocks that only
    /// a volatile cache held, and that cache is gone (or is not the one given): those blocks
    /// are abandoned, and the backing store is served as it is.
    #[arg(long)]
    pub accept_stale_backing: bool,
}

fn parse_store(text: &str) -> Result<StoreSpec, String> {
    let (name, path) = text.split_once('=').ok_or_else(|| {
        format!("{text:?} is not NAME=PATH (a store's name, then its backing store)")
    })?;
    pmcache_engine::stores::check_store_name(name).map_err(|e| e.to_string())?;
    if path.is_empty() {
        return Err(format!("store {name:?}: no backing store after '='"));
    }
    Ok(StoreSpec { name: name.to_owned(), backing: PathBuf::from(path) })
}

/// A feature turned on or off.
#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
pub enum Switch {
    /// Turned on.
    On,
    /// Turned off.
    Off,
}

/// A number of seconds, 0 or more (at most a day).
fn seconds(text: &str) -> Result<f64, String> {
    match text.parse::<f64>() {
        Ok(s) if (0.0..=86_400.0).contains(&s) => Ok(s),
        _ => Err(format!("{text:?} is not a number of seconds between 0 and 86400")),
    }
}

/// A number of seconds above 0 (at most a day).
fn positive_seconds(text: &str) -> Result<f64, String> {
    seconds(text).and_then(|s| if s > 0.0 { Ok(s) } else { Err("must be above 0".into()) })
}

/// A polling budget in microseconds: from 1 to 10 s.
fn poll_idle_us(text: &str) -> Result<u64, String> {
    match text.parse::<u64>() {
        Ok(us) if (1..=10_000_000).contains(&us) => Ok(us),
        _ => Err(format!("{text:?} is not a number of microseconds from 1 to 10000000")),
    }
}

/// `pmcache ublk`: the ublk devices there are, and removing one a dead server left.
#[derive(clap::Args)]
pub struct UblkArgs {
    #[command(subcommand)]
    pub command: UblkCommand,
}

#[derive(clap::Subcommand)]
pub enum UblkCommand {
    /// List the ublk devices: state, server, queues, size, and whether a successor can take
    /// them over.
    List,
    /// Remove device N, which no running server holds (left by one that died): requests
    /// waiting on it fail, and a file system mounted on it sees I/O errors. The cache keeps
    /// every acknowledged write; `pmcache serve --ublk` serves it again on a new device.
    Remove {
        /// The device number N of /dev/ublkbN.
        id: u32,
    },
    /// Serve a null device until SIGINT or SIGTERM: reads return zeroes, writes are dropped,
    /// through the same frontend as `serve --ublk` — its ceiling, for benchmarks beside the
    /// cache. It stores nothing.
    Null(NullArgs),
}

/// Arguments of `pmcache ublk null`.
#[derive(clap::Args, Debug)]
pub struct NullArgs {
    /// The device's size (a multiple of 4 KiB).
    #[arg(long = "size", value_name = "BYTES", value_parser = parse_nonzero_size, default_value = "1G")]
    pub size_bytes: u64,
    /// ublk hardware queues: a thread each (the name `serve` gives it; `--queues` also works).
    #[arg(long = "ublk-queues", alias = "queues", value_name = "N", default_value_t = 1)]
    pub queues: u16,
    /// ublk tags per queue: the requests each queue can have in flight (`--depth` also works).
    #[arg(long = "ublk-depth", alias = "depth", value_name = "N", default_value_t = 128)]
    pub depth: u16,
    /// Poll each queue's ring instead of sleeping on it while requests keep coming, as
    /// `serve --ublk --ublk-poll` (`--poll` also works).
    #[arg(long = "ublk-poll", alias = "poll")]
    pub poll: bool,
    /// With --ublk-poll: how long a queue goes on polling after its last request before it
    /// sleeps again, in microseconds (`--poll-idle-us` also works).
    #[arg(long = "ublk-poll-idle-us", alias = "poll-idle-us", value_name = "N", default_value_t = 1000, requires = "poll", value_parser = poll_idle_us)]
    pub poll_idle_us: u64,
}

#[cfg(test)]
mod tests {
    use clap::Parser;

    use super::*;

    #[derive(Parser)]
    struct Serve {
        #[command(flatten)]
        args: ServeArgs,
    }

    #[derive(Parser)]
    struct Null {
        #[command(flatten)]
        args: NullArgs,
    }

    fn serve(args: &[&str]) -> Result<ServeArgs, clap::Error> {
        Serve::try_parse_from(["serve"].iter().chain(args)).map(|s| s.args)
    }

    fn null(args: &[&str]) -> Result<NullArgs, clap::Error> {
        Null::try_parse_from(["null"].iter().chain(args)).map(|n| n.args)
    }

    /// `--ublk-poll` turns polling on with a 1 ms budget unless `--ublk-poll-idle-us` says
    /// otherwise; off by default.
    #[test]
    fn ublk_poll_and_its_budget() {
        let off = serve(&["--ublk"]).expect("--ublk");
        assert!(!off.ublk_poll);
        let on = serve(&["--ublk", "--ublk-poll"]).expect("--ublk-poll");
        assert!(on.ublk_poll);
        assert_eq!(on.ublk_poll_idle_us, 1000);
        let short = serve(&["--ublk", "--ublk-poll", "--ublk-poll-idle-us", "50"]).expect("50");
        assert_eq!((short.ublk_poll, short.ublk_poll_idle_us), (true, 50));
    }

    /// The budget needs `--ublk-poll` (which needs `--ublk`), and is at least 1 µs.
    #[test]
    fn ublk_poll_options_are_refused_without_what_they_need() {
        use clap::error::ErrorKind;
        for (args, kind) in [
            (&["--ublk", "--ublk-poll-idle-us", "50"][..], ErrorKind::MissingRequiredArgument),
            (&["--ublk-poll"][..], ErrorKind::MissingRequiredArgument),
            (
                &["--ublk", "--ublk-poll", "--ublk-poll-idle-us", "0"][..],
                ErrorKind::ValueValidation,
            ),
            (
                &["--ublk", "--ublk-poll", "--ublk-poll-idle-us", "x"][..],
                ErrorKind::ValueValidation,
            ),
        ] {
            match serve(args) {
                Ok(_) => panic!("{args:?} accepted"),
                Err(e) => assert_eq!(e.kind(), kind, "{args:?}: {e}"),
            }
        }
    }

    /// `ublk null --ublk-poll [--ublk-poll-idle-us N]`, the budget refused without polling.
    #[test]
    fn ublk_null_poll() {
        let off = null(&[]).expect("no options");
        assert!(!off.poll);
        let on = null(&["--ublk-poll", "--ublk-poll-idle-us", "200"]).expect("--ublk-poll");
        assert_eq!((on.poll, on.poll_idle_us), (true, 200));
        assert_eq!(null(&["--ublk-poll"]).expect("--ublk-poll").poll_idle_us, 1000);
        let err = null(&["--ublk-poll-idle-us", "200"]).expect_err("a budget without polling");
        assert_eq!(err.kind(), clap::error::ErrorKind::MissingRequiredArgument);
    }

    /// `ublk null` takes the names `serve --ublk` gives its queues, depth and polling, and
    /// still the short ones.
    #[test]
    fn ublk_null_takes_the_flag_names_of_serve() {
        for args in [
            &[
                "--ublk-queues",
                "2",
                "--ublk-depth",
                "64",
                "--ublk-poll",
                "--ublk-poll-idle-us",
                "9",
            ],
            &["--queues", "2", "--depth", "64", "--poll", "--poll-idle-us", "9"],
        ] {
            let n = null(args).expect("the flags");
            assert_eq!((n.queues, n.depth, n.poll, n.poll_idle_us), (2, 64, true, 9), "{args:?}");
        }
    }
}
