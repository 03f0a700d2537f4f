//! What the experiments share: fio jobs and their reports, the servers they drive, scratch
//! files, child processes and signals, statistics over runs, plots, the JSON report and the
//! description of the machine.

pub(crate) mod fio;
pub(crate) mod machine;
pub(crate) mod output;
pub(crate) mod process;
pub(crate) mod scratch;
pub(crate) mod servers;
pub(crate) mod stats;
