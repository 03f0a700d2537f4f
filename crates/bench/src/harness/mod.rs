//! What the experiments share: fio jobs and their reports, the servers they drive, scratch
//! files, child processes and signals, statistics over runs, plots, the JSON report and the
//! description of the machine.

pub mod bed;
pub mod experiment;
pub mod fio;
pub mod machine;
pub mod output;
pub(crate) mod plot;
pub(crate) mod process;
pub(crate) mod scratch;
pub mod servers;
pub(crate) mod stats;
