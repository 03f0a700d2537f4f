//! `pmcache bench engines` (being written).
