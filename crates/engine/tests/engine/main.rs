//! The engine's integration tests, one module per concern, in one test binary: every module
//! links the same engine, so one binary compiles and links it once. The shuttle tests are
//! `tests/shuttle.rs`: they need the engine built with the `shuttle` feature.

mod abort;
mod attach;
mod batch;
mod checked;
mod cleaner;
mod counts;
mod crash;
mod eviction;
mod full_cache;
mod lost_pages;
mod members;
mod misses;
mod ordering;
mod pending_free;
mod read_completion;
mod read_spans;
mod regressions;
mod shm_model;
mod stores;
mod stress;
mod write_completion;
mod write_runs;
