//! The pmcache engine (stub; being written).
