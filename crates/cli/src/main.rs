//! The pmcache command.
fn main() {}
