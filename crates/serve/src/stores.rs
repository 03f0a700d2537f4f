//! A cache medium shared by several backing stores (`serve --store NAME=PATH`, repeated):
//! formatting it (one window per store, then the store table: `pmcache_engine::stores`) or
//! attaching each store's cache on its window. Every store is opened on its own: one whose
//! backing store cannot be opened, or whose cache cannot be attached, is refused by name and
//! the others are served.

use std::path::{Path, PathBuf};
use std::sync::Arc;

use pmcache_engine::stores::{STORE_TABLE_BYTES, STORE_TABLE_MAGIC, StoreTable};
use pmcache_engine::{Engine, MonotonicClock};
use pmcache_frontend::{CacheEngine, CacheMedium};
use pmcache_media::{Medium, MediumSet, PmemFile, Window};

use crate::config::StoreSpec;
use crate::open::{
    Before, CacheConfig, MediumError, Opened, attach_error, backing_to_attach, backing_to_format,
    before_open, check_size_asked, engine_config, open_cache_backing, open_member,
};

/// One store as opened: its cache, or why it is not served.
pub(crate) struct StoreOpened {
    /// The store's name.
    pub(crate) name: String,
    /// Its backing store's path.
    pub(crate) backing: PathBuf,
    /// Its cache, or why it is not served.
    pub(crate) opened: Result<(CacheEngine, Opened), String>,
}

/// The cache of `window` of `medium`.
fn window_of(medium: &Arc<PmemFile>, window: std::ops::Range<u64>) -> CacheMedium {
    MediumSet::single(Window::new(medium.clone(), window))
}

/// The arguments of one store: the cache's, with the store's backing store.
fn store_config(config: &CacheConfig, store: &StoreSpec) -> CacheConfig {
    CacheConfig { backing: store.backing.clone(), ..config.clone() }
}

/// Formats a new medium for `stores`, or attaches each of them on an existing one. An error
/// is about the medium as a whole (nothing served); a store's own failure is in its
/// [`StoreOpened`].
pub(crate) fn open_or_format(
    config: &CacheConfig,
    stores: &[StoreSpec],
    max_lanes: usize,
) -> Result<Vec<StoreOpened>, String> {
    if config.cache.len() != 1 {
        return Err("a cache shared by several backing stores (--store) is on one medium: give \
                    one --cache"
            .into());
    }
    let path = &config.cache[0].path;
    match before_open(path)? {
        Before::Holding => attach(config, path, stores, max_lanes),
        before => format(config, path, before, stores, max_lanes),
    }
}

/// Formats a new (missing or empty) medium: every store's backing store must open, each
/// window is formatted, and the table is written last.
fn format(
    config: &CacheConfig,
    path: &Path,
    before: Before,
    stores: &[StoreSpec],
    max_lanes: usize,
) -> Result<Vec<StoreOpened>, String> {
    let names: Vec<String> = stores.iter().map(|s| s.name.clone()).collect();
    // Refused before anything is created; planned again on the medium as opened.
    StoreTable::plan(config.new_cache_bytes(), &names)
        .map_err(|e| format!("{}: {e}", path.display()))?;
    let mut backings = Vec::with_capacity(stores.len());
    for store in stores {
        let backing = open_cache_backing(&store_config(config, store)).map_err(|e| {
            format!(
                "store {:?}: {e}; a new cache is formatted for all its stores at once, so \
                 nothing was created",
                store.name
            )
        })?;
        backings.push(backing);
    }
    let undo = || {
        let _ = match before {
            Before::Missing => std::fs::remove_file(path),
            _ => std::fs::OpenOptions::new().write(true).open(path).and_then(|f| f.set_len(0)),
        };
    };
    if before == Before::Missing {
        // Created here, atomically, as a one-store cache is: a racing server attaches or
        // refuses, never removes what this one formats.
        std::fs::OpenOptions::new()
            .write(true)
            .create_new(true)
            .open(path)
            .map_err(|e| format!("{}: {e}", path.display()))?;
    }
    let (medium, _node) = match open_member(config, &config.cache[0]) {
        Ok(opened) => opened,
        // Another process holds the medium: it is theirs now, whoever created it.
        Err(MediumError::Locked(e)) => return Err(e),
        Err(MediumError::Other(e)) => {
            undo();
            return Err(e);
        }
    };
    let table = StoreTable::plan(medium.len_bytes(), &names).map_err(|e| {
        undo();
        format!("{}: {e}", path.display())
    })?;
    let medium = Arc::new(medium);
    let settings = engine_config(config, max_lanes);
    StoreTable::clear(&*medium);
    let mut opened = Vec::with_capacity(stores.len());
    for ((store, entry), backing) in stores.iter().zip(&table.stores).zip(backings) {
        let window = window_of(&medium, entry.window.clone());
        let backing = backing_to_format(&store_config(config, store), backing);
        match Engine::format(window, backing, MonotonicClock::default(), &settings) {
            Ok(engine) => {
                let describe = format!("store {:?}", store.name);
                let claimed =
                    crate::open::claim(engine.backing(), engine.superblock().uuid, &describe);
                opened.push(StoreOpened {
                    name: store.name.clone(),
                    backing: store.backing.clone(),
                    opened: claimed.map(|()| (engine, Opened::Formatted)),
                })
            }
            Err(e) => {
                drop(opened);
                undo();
                return Err(format!(
                    "store {:?} (a window of {} B of {}): {e}; nothing was created",
                    store.name,
                    entry.window.end - entry.window.start,
                    path.display()
                ));
            }
        }
    }
    // The commit point: before it, the medium names no store.
    table.write(&*medium);
    Ok(opened)
}

/// Attaches each store given on a medium that holds a store table.
fn attach(
    config: &CacheConfig,
    path: &Path,
    stores: &[StoreSpec],
    max_lanes: usize,
) -> Result<Vec<StoreOpened>, String> {
    let (medium, _node) = open_member(config, &config.cache[0]).map_err(|e| e.into_message())?;
    check_size_asked(config, path, &medium)?;
    let medium = Arc::new(medium);
    if !StoreTable::is_on(&*medium) {
        let mut head = [0u8; 4096];
        medium.read(0, &mut head);
        let has_superblock = head[..8] == pmcache_engine::format::MAGIC;
        return Err(if has_superblock {
            format!(
                "{} holds the cache of one backing store, not a cache shared by several: serve \
                 it with --backing (or detach it and format it again for --store)",
                path.display()
            )
        } else {
            format!(
                "{} holds no store table (its first 4 KiB are {}); refusing to format it \
                 (`pmcache format --force` formats it; nothing on it was changed)",
                path.display(),
                if head.iter().all(|&b| b == 0) { "zero" } else { "not a pmcache cache" }
            )
        });
    }
    let table = StoreTable::read(&*medium).map_err(|e| format!("{}: {e}", path.display()))?;
    let known = table.names().join(", ");
    for entry in &table.stores {
        if !stores.iter().any(|s| s.name == entry.name) {
            eprintln!(
                "pmcache: warning: store {:?} of {} is not served (no --store {}=PATH): its \
                 cache stays on the medium as it is, dirty blocks included",
                entry.name,
                path.display(),
                entry.name
            );
        }
    }
    let settings = engine_config(config, max_lanes);
    let opened = stores
        .iter()
        .map(|store| {
            let one = store_config(config, store);
            let opened = match table.store(&store.name) {
                None => Err(format!(
                    "store {:?} is not on {} (its stores: {known}); stores are chosen when the \
                     cache is formatted",
                    store.name,
                    path.display()
                )),
                Some(entry) => open_cache_backing(&one).and_then(|backing| {
                    let window = window_of(&medium, entry.window.clone());
                    let backing = backing_to_attach(&one, backing, &window);
                    crate::open::claim_for_medium(&backing, &window, &one.describe())?;
                    Engine::open(window, backing, MonotonicClock::default(), &settings)
                        .map(|(engine, report)| (engine, Opened::Attached(report)))
                        .map_err(|e| attach_error(&one, e))
                }),
            };
            StoreOpened { name: store.name.clone(), backing: store.backing.clone(), opened }
        })
        .collect();
    Ok(opened)
}

/// The store table at the start of the medium at `path`, if it starts with one's magic (an
/// error if that table is not valid).
pub fn store_table_of(path: &Path) -> Result<Option<StoreTable>, String> {
    use std::io::{Read, Seek, SeekFrom};
    let describe = |e: std::io::Error| format!("{}: {e}", path.display());
    let mut file = std::fs::File::open(path).map_err(describe)?;
    let len_bytes = file.seek(SeekFrom::End(0)).map_err(describe)?;
    file.seek(SeekFrom::Start(0)).map_err(describe)?;
    let mut table = vec![0u8; STORE_TABLE_BYTES];
    if len_bytes < STORE_TABLE_BYTES as u64 || file.read_exact(&mut table).is_err() {
        return Ok(None);
    }
    if table[..8] != STORE_TABLE_MAGIC {
        return Ok(None);
    }
    StoreTable::decode(&table, len_bytes).map(Some).map_err(|e| format!("{}: {e}", path.display()))
}
