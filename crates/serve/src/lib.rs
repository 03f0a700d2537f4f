//! The serving library: a cache opened from one [`ServeConfig`], served by a frontend (NBD,
//! or a kernel block device through ublk), and stopped — what `pmcache serve` runs, and what
//! the benches and tests open in process.
//!
//! - [`config`]: [`ServeConfig`] (the cache, its stores, control socket, cleaner, state
//!   record) and [`CacheConfig`] (media, backing store, engine settings). The command line
//!   builds them; nothing below takes an argument type.
//! - [`open`]: media and backing store opened, and a cache formatted, attached (recovered)
//!   or refused; [`stores`]: a medium shared by several backing stores.
//! - [`serving`]: the life of a served cache ([`Serving`]): the control socket bound, the
//!   state record checked, the cache opened, the cleaner started; at the stop, the write-back
//!   a volatile medium or a detach needs, the cache marked clean, the record written.
//! - [`nbd`], [`vhost`] and `ublk` (feature `ublk`): the frontends, each run to its stop
//!   ([`nbd::serve`], [`vhost::serve`], `ublk::serve`), announcing what they serve through
//!   [`Announce`]. A program that serves the engine's lanes itself opens a [`Serving`], gives
//!   the control socket a [`Frontend`] of its own ([`Serving::start_control`]) and finishes it
//!   ([`Serving::finish`]): docs/EMBEDDING.md.
//! - [`control`]: the control socket (`pmcache stats/flush/set/detach`); `signals`:
//!   SIGINT and SIGTERM stop the whole server, whenever they come; `health`: the backing
//!   store's health changes said in the log as they happen.
//! - [`state`], [`backing_id`], [`attachment`]: the record of a volatile cache's attachment,
//!   kept outside the medium.

#![forbid(unsafe_code)]

pub mod attachment;
pub mod backing_id;
pub mod config;
pub mod control;
mod health;
pub mod nbd;
mod numa;
pub mod open;
pub mod serving;
mod signals;
pub mod state;
pub mod stores;
#[cfg(feature = "ublk")]
pub mod ublk;
pub mod vhost;

pub use config::{ServeConfig, StateConfig, StopHandle, StoreSpec};
pub use control::Frontend;
pub use open::{CacheConfig, CacheSpec};
pub use serving::{Announce, CacheSummary, Ready, Serving, Silent};
