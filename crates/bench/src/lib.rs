//! pmcache's experiment harness: each `pmcache bench` experiment lives in its own module and
//! prints figures beside the baseline it is measured against, in the same run.

pub mod engine_core;
pub mod engines;
pub mod fs;
pub mod harness;
pub mod lookup_cost;
pub mod media_kinds;
pub mod mixed;
pub mod nbd_fio;
pub mod nbd_tls;
pub mod paper;
pub mod paper002;
pub mod serve_memory;
pub mod ublk_mapping;
pub mod writeback;
