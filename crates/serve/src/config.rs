//! What a server is asked to serve: [`ServeConfig`], built once (by the command line from its
//! flags, or by a program that embeds the server) and read by everything below.

use std::path::PathBuf;
use std::sync::{Arc, Mutex, PoisonError};

use pmcache_engine::CleanerConfig;

use crate::open::CacheConfig;

/// A served cache: the cache, where its control socket is, its cleaner's settings, and where
/// the state record of a volatile medium is kept.
#[derive(Debug, Clone)]
pub struct ServeConfig {
    /// The cache and its backing store. With `stores`, its `backing` is not used: each store
    /// names its own.
    pub cache: CacheConfig,
    /// The backing stores of a cache shared by several (one window of the medium each); empty
    /// for a cache of one backing store.
    pub stores: Vec<StoreSpec>,
    /// The control socket (the cache path + `.ctl` when `None`; a store's is the cache path
    /// + `.NAME.ctl`).
    pub control: Option<PathBuf>,
    /// The background cleaner's settings.
    pub cleaner: CleanerConfig,
    /// Where the state record of a volatile medium is.
    pub state: StateConfig,
    /// Stop on SIGINT or SIGTERM (a second signal ends the process at once): what a server
    /// process wants, and what a server opened inside another program does not.
    pub stop_on_signals: bool,
    /// Stops the server from inside the process, as a signal would.
    pub stop: StopHandle,
}

impl ServeConfig {
    /// A server of `cache` with the defaults of `pmcache serve`.
    pub fn new(cache: CacheConfig) -> Self {
        Self {
            cache,
            stores: Vec::new(),
            control: None,
            cleaner: CleanerConfig::default(),
            state: StateConfig::default(),
            stop_on_signals: false,
            stop: StopHandle::default(),
        }
    }
}

/// Where the state record of a backing store served with a volatile cache is (`crate::state`).
#[derive(Debug, Clone, Default)]
pub struct StateConfig {
    /// The record's path (found by the backing store's identity when `None`).
    pub file: Option<PathBuf>,
    /// The directory of block devices' records ([`crate::state::DEVICE_STATE_DIR`] when
    /// `None`).
    pub dir: Option<PathBuf>,
    /// Start although the record says the backing store may lack blocks of a lost cache.
    pub accept_stale_backing: bool,
}

/// One backing store of a cache shared by several.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct StoreSpec {
    /// The store's name (its NBD export name).
    pub name: String,
    /// Its backing store (a file, a block device or an RBD image).
    pub backing: PathBuf,
}

/// Stops a server from inside its process, as SIGTERM does: requests in flight finish, then
/// the stop's write-back and the clean mark. A stop asked for before the frontend runs stops
/// it as soon as it does.
#[derive(Clone, Default)]
pub struct StopHandle(Arc<Mutex<Stops>>);

#[derive(Default)]
struct Stops {
    requested: bool,
    frontends: Vec<Box<dyn Fn() + Send>>,
    /// Whether the cache's medium is volatile, once it is open.
    volatile: Option<bool>,
}

impl StopHandle {
    /// Stops every frontend the server runs.
    pub fn stop(&self) {
        let mut stops = self.0.lock().unwrap_or_else(PoisonError::into_inner);
        stops.requested = true;
        for stop in &stops.frontends {
            stop();
        }
    }

    /// Whether a stop was asked for.
    pub fn is_requested(&self) -> bool {
        self.0.lock().unwrap_or_else(PoisonError::into_inner).requested
    }

    /// `stop` stops a running frontend: called now if a stop was asked for already.
    pub(crate) fn register(&self, stop: impl Fn() + Send + 'static) {
        let mut stops = self.0.lock().unwrap_or_else(PoisonError::into_inner);
        if stops.requested {
            stop();
        }
        stops.frontends.push(Box::new(stop));
    }

    /// The cache is open, on a volatile medium or not: what a stop then does.
    pub(crate) fn set_medium_volatile(&self, volatile: bool) {
        self.0.lock().unwrap_or_else(PoisonError::into_inner).volatile = Some(volatile);
    }

    /// Whether the cache's medium is volatile; `None` while it is being opened.
    pub(crate) fn medium_volatile(&self) -> Option<bool> {
        self.0.lock().unwrap_or_else(PoisonError::into_inner).volatile
    }
}

impl std::fmt::Debug for StopHandle {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("StopHandle").field("requested", &self.is_requested()).finish()
    }
}
