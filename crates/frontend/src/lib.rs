//! The engine as pmcache's frontends serve it, for the `pmcache` command and the benches alike:
//!
//! - [`conn`]: [`CacheConn`], one engine lane served by one NBD connection or one ublk queue:
//!   the one `pmcache_block::BlockConn` both frontends run (the request path alone, which
//!   needs no kernel), and the read latencies by class that `pmcache stats` reports,
//!   [`ReadLatencies`].
//! - [`nbd`]: the engine as an NBD export ([`CacheExport`]), a `CacheConn` per connection.
//! - [`units`]: sizes as the command line gives them and bytes as people read them.
//!
//! The engine they serve is a [`CacheEngine`]: `PmemFile` media (a set of members) in front of any
//! [`Backing`] store.

#![forbid(unsafe_code)]

use std::sync::Arc;

use pmcache_backing::BackingStore;
use pmcache_engine::{Engine, MonotonicClock};
use pmcache_media::{MediumSet, PmemFile, Window};

pub mod conn;
pub mod nbd;
pub mod units;

pub use conn::{CacheConn, ReadLatencies};
pub use nbd::CacheExport;

/// The backing store as the frontends serve it: any engine, chosen at run time.
pub type Backing = Arc<dyn BackingStore>;
/// The medium a served cache is on: one mapped file per member (one member for most caches),
/// all of it — or, for a medium shared by several backing stores, the window of one store.
pub type CacheMedium = MediumSet<Window<Arc<PmemFile>>>;
/// The engine as the frontends serve it.
pub type CacheEngine = Engine<CacheMedium, Backing, MonotonicClock>;
