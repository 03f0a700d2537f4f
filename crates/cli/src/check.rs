//! `pmcache check`: a cache's medium read and checked without a server and without writing
//! — its superblock and every metadata entry, as recovery would find them; for a medium
//! shared by several backing stores, its store table and each store's cache.

use std::path::Path;

use pmcache_engine::check_medium;
use pmcache_engine::format::Superblock;
use pmcache_engine::stores::{STORE_TABLE_VERSION, StoreTable};
use pmcache_frontend::units::human;
use pmcache_media::{FileSystem, Medium, MediumKind, MediumSync};

use pmcache_serve::CacheSpec;
use pmcache_serve::stores::store_table_of;

/// `pmcache check`.
#[derive(Debug, clap::Args)]
pub struct CheckArgs {
    /// The cache medium; every member's, for a cache of several (in any order).
    #[arg(long, required = true, value_name = "PATH[@NODE]")]
    cache: Vec<CacheSpec>,
    /// Print the report as JSON.
    #[arg(long)]
    json: bool,
}

pub fn check(args: CheckArgs) -> Result<(), String> {
    // A snapshot read with read(2), not `PmemFile::open`: opening a mapping probes the medium
    // by writing to its first 64 KiB and restoring them, which rolls back entries a live
    // server persisted meanwhile (found by `check_on_a_live_cache_leaves_it_intact`).
    if let [spec] = args.cache.as_slice()
        && let Some(table) = store_table_of(&spec.path)?
    {
        return check_stores(&args, &spec.path, &table);
    }
    let mut snapshots = Vec::with_capacity(args.cache.len());
    for spec in &args.cache {
        snapshots.push((MetadataSnapshot::read(&spec.path)?, spec.node));
    }
    if snapshots.len() > pmcache_media::MEMBERS_MAX {
        return Err(format!("{} cache media given; a cache has at most 8", snapshots.len()));
    }
    let version = u32::from_le_bytes(snapshots[0].0.head[8..12].try_into().unwrap_or([0; 4]));
    pmcache_engine::layout::sort_members(&mut snapshots);
    let medium = pmcache_media::MediumSet::new(snapshots);
    let named = args.cache.iter().map(|s| s.path.display().to_string()).collect::<Vec<_>>();
    let named = named.join(" + ");
    let report = check_medium(&medium).map_err(|e| format!("{named}: {e}"))?;
    let superblock = report.superblock.expect("a decoded superblock");
    let (kind, file_system) = medium_kind(&args.cache[0].path)?;
    let slots: u64 = medium
        .media()
        .map(|snapshot| {
            Superblock::decode(&snapshot.head, snapshot.len_bytes)
                .map_or(0, |sb| sb.geometry.slot_count)
        })
        .sum();
    let members = superblock.membership.count;
    if args.json {
        let mut json = report_json(version, slots, &superblock, &report);
        json["cache"] = named.clone().into();
        json["members"] = members.into();
        json["medium"] = kind.name().into();
        json["file_system"] = file_system.clone().into();
        println!("{json}");
    } else {
        println!("{named}: pmcache format version {version}");
        if members > 1 {
            println!("  {members} members (one cache, its slots on every member)");
        }
        println!(
            "  {} slots of {} B{}, caching a backing store of {}",
            slots,
            superblock.geometry.block_size,
            if superblock.geometry.data_crc { " with data checksums" } else { "" },
            human(superblock.backing.size_bytes)
        );
        let promise = match kind {
            MediumKind::Dax => "persistent memory, mapped MAP_SYNC".to_string(),
            MediumKind::Volatile => {
                format!("{file_system}: survives a process crash, not a reboot")
            }
            MediumKind::Msync => format!(
                "{file_system}: durable only in msync mode, served with --medium-sync msync"
            ),
        };
        println!("  medium: {kind} ({promise})");
        println!(
            "  last shutdown: {}",
            if report.was_clean_shutdown { "clean" } else { "unclean (or still attached)" }
        );
        println!(
            "  blocks: {} clean, {} dirty; {} slots free; {} superseded copies",
            report.clean, report.dirty, report.free, report.superseded
        );
        println!(
            "  entries dropped on attach: {} torn (power cut mid-update), {} corrupt, {} on \
             ranges recorded lost",
            report.torn, report.corrupt, report.lost_entries
        );
    }
    if report.synced_seq_invalid {
        return Err("the synced sequence word is corrupt (attach would take it as 0 and make \
                    every clean block dirty)"
            .into());
    }
    if report.corrupt > 0 {
        return Err(format!("{} corrupt metadata entries", report.corrupt));
    }
    Ok(())
}

/// What `check --json` says of one cache: its format, geometry and what recovery would find.
fn report_json(
    version: u32,
    slots: u64,
    superblock: &Superblock,
    report: &pmcache_engine::CheckReport,
) -> serde_json::Value {
    serde_json::json!({
        "format_version": version,
        "slots": slots,
        "block_size": superblock.geometry.block_size,
        "data_crc": superblock.geometry.data_crc,
        "backing_bytes": superblock.backing.size_bytes,
        "clean_shutdown": report.was_clean_shutdown,
        "free": report.free, "clean": report.clean, "dirty": report.dirty,
        "superseded": report.superseded, "torn": report.torn, "corrupt": report.corrupt,
        "lost_entries": report.lost_entries,
        "synced_seq_invalid": report.synced_seq_invalid,
    })
}

/// `pmcache check` of a medium shared by several backing stores: its table, then each store's
/// cache as `check` reports one.
fn check_stores(args: &CheckArgs, path: &Path, table: &StoreTable) -> Result<(), String> {
    let (kind, file_system) = medium_kind(path)?;
    let mut reports = Vec::with_capacity(table.stores.len());
    let mut failures = Vec::new();
    for store in &table.stores {
        let snapshot = MetadataSnapshot::read_window(path, Some(store.window.clone()))?;
        let version = u32::from_le_bytes(snapshot.head[8..12].try_into().unwrap_or([0; 4]));
        let medium = pmcache_media::MediumSet::single(snapshot);
        match check_medium(&medium) {
            Ok(report) => {
                let superblock = report.superblock.expect("a decoded superblock");
                if report.corrupt > 0 || report.synced_seq_invalid {
                    failures.push(format!("store {:?}: corrupt metadata", store.name));
                }
                let mut json =
                    report_json(version, superblock.geometry.slot_count, &superblock, &report);
                json["store"] = store.name.clone().into();
                json["window"] = serde_json::json!([store.window.start, store.window.end]);
                reports.push(json);
            }
            Err(e) => {
                failures.push(format!("store {:?}: {e}", store.name));
                reports.push(serde_json::json!({ "store": store.name, "error": e.to_string() }));
            }
        }
    }
    if args.json {
        let json = serde_json::json!({
            "cache": path.display().to_string(),
            "medium": kind.name(),
            "file_system": file_system,
            "stores": reports,
        });
        println!("{json}");
    } else {
        println!(
            "{}: a cache shared by {} backing stores (store table version {STORE_TABLE_VERSION}); \
             medium: {kind} ({file_system})",
            path.display(),
            table.stores.len()
        );
        for r in &reports {
            let name = r["store"].as_str().unwrap_or("");
            if let Some(e) = r["error"].as_str() {
                println!("  store {name}: {e}");
                continue;
            }
            println!(
                "  store {name}: {} slots of {} B{}, caching a backing store of {}; last \
                 shutdown {}; {} clean, {} dirty, {} free; {} torn and {} corrupt entries",
                r["slots"],
                r["block_size"],
                if r["data_crc"] == true { " with data checksums" } else { "" },
                human(r["backing_bytes"].as_u64().unwrap_or(0)),
                if r["clean_shutdown"] == true { "clean" } else { "unclean (or still attached)" },
                r["clean"],
                r["dirty"],
                r["free"],
                r["torn"],
                r["corrupt"]
            );
        }
    }
    if failures.is_empty() { Ok(()) } else { Err(failures.join("; ")) }
}

/// The kind a medium is served as (a medium that is neither DAX nor volatile can only be
/// served in msync mode) and its file system's name, probed without writing to it.
fn medium_kind(path: &Path) -> Result<(MediumKind, String), String> {
    let kind = pmcache_media::probe_kind(path, MediumSync::Msync).map_err(|e| e.to_string())?;
    let file_system =
        FileSystem::of_path(path).map_err(|e| format!("{}: fstatfs: {e}", path.display()))?;
    Ok((kind, file_system.name))
}

/// A read-only copy of a medium's superblock and metadata table (everything before the data
/// area), for `check`: it never writes to the medium, so it is safe on a live cache. Reads
/// past the copy (the data area, which `check_medium` does not read) return zeros; writes
/// are refused.
struct MetadataSnapshot {
    head: Vec<u8>,
    len_bytes: u64,
}

impl MetadataSnapshot {
    fn read(path: &Path) -> Result<Self, String> {
        Self::read_window(path, None)
    }

    /// The snapshot of the bytes `window` of the medium at `path` (all of it for `None`),
    /// as a medium of their own: a store's cache on a medium shared by several.
    fn read_window(path: &Path, window: Option<std::ops::Range<u64>>) -> Result<Self, String> {
        use std::io::{Read, Seek, SeekFrom};
        let describe = |e: std::io::Error| format!("{}: {e}", path.display());
        let mut file = std::fs::File::open(path).map_err(describe)?;
        // The end, not the metadata's length: a device node (device-dax, /dev/pmemN) has 0.
        let end = file.seek(SeekFrom::End(0)).map_err(describe)?;
        let window = window.unwrap_or(0..end);
        let len_bytes = window.end.min(end).saturating_sub(window.start);
        file.seek(SeekFrom::Start(window.start)).map_err(describe)?;
        let mut header = vec![0u8; len_bytes.min(4096) as usize];
        file.read_exact(&mut header).map_err(describe)?;
        // The metadata table is read only as far as a validated superblock says it reaches:
        // bytes that are not a pmcache superblock size nothing (`check_medium` then reports
        // why they are not one).
        let data_offset = match Superblock::decode(&header, len_bytes) {
            Ok(superblock) => superblock.geometry.data_offset,
            Err(_) => header.len() as u64,
        };
        let mut head = header;
        head.resize(data_offset as usize, 0);
        let at = 4096.min(data_offset as usize);
        file.read_exact(&mut head[at..]).map_err(describe)?;
        Ok(Self { head, len_bytes })
    }
}

impl Medium for MetadataSnapshot {
    fn len_bytes(&self) -> u64 {
        self.len_bytes
    }

    fn read(&self, offset: u64, buf: &mut [u8]) {
        buf.fill(0);
        let start = (offset as usize).min(self.head.len());
        let end = (offset as usize).saturating_add(buf.len()).min(self.head.len());
        buf[..end - start].copy_from_slice(&self.head[start..end]);
    }

    fn write(&self, _offset: u64, _data: &[u8]) {
        panic!("pmcache check never writes to the medium");
    }

    fn load_u64(&self, offset: u64) -> u64 {
        let mut word = [0u8; 8];
        self.read(offset, &mut word);
        u64::from_le_bytes(word)
    }

    fn store_u64(&self, _offset: u64, _value: u64) {
        panic!("pmcache check never writes to the medium");
    }

    fn compare_exchange_u64(&self, _offset: u64, _current: u64, _new: u64) -> bool {
        panic!("pmcache check never writes to the medium");
    }

    fn flush(&self, _offset: u64, _len: u64) {}

    fn drain(&self) {}
}
