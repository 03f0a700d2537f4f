//! What the papers' experiments share: sizes and shares as the figures write them, and the
//! in-process bed's sweep over a figure's positions.

use pmcache_backing::BackingStore;

use super::Ctx;
use super::inproc::{Bed, SeriesRun, Sweep, measure};
use super::workload::Access;

pub(super) const KIB: u64 = 1 << 10;
pub(super) const MIB: u64 = 1 << 20;
pub(super) const GIB: u64 = 1 << 30;

/// `4 KiB`, `256 MiB`, `10 GiB`.
pub(super) fn size(bytes: u64) -> String {
    match bytes {
        b if b >= GIB && b % GIB == 0 => format!("{} GiB", b / GIB),
        b if b >= MIB && b % MIB == 0 => format!("{} MiB", b / MIB),
        b if b >= KIB && b % KIB == 0 => format!("{} KiB", b / KIB),
        b => format!("{b} B"),
    }
}

/// `63 %`.
pub(super) fn percent(ratio: f64) -> String {
    format!("{:.0} %", ratio * 100.0)
}

/// Runs `series` at each `(tick, access, threads)` position.
pub(super) fn sweep(
    ctx: &Ctx,
    label: &str,
    series: &[SeriesRun<'_>],
    positions: &[(String, Access, usize)],
) -> Sweep {
    let bar = ctx.progress(label, (positions.len() * series.len() * ctx.runs) as u64);
    let mut sweep = Sweep::new(series);
    for (_, access, threads) in positions {
        let rates = measure(series, *access, *threads, ctx.seconds, ctx.runs, &|| bar.inc(1));
        sweep.push(rates, *threads > ctx.cpus);
    }
    bar.finish_and_clear();
    sweep
}

/// An error unless every read of `bed` hit the cache.
pub(super) fn check_all_hits<B: BackingStore>(bed: &Bed<B>, figure: &str) -> Result<(), String> {
    match bed.read_misses() {
        0 => Ok(()),
        n => Err(format!("{figure}: {n} read misses in a run meant to be all hits")),
    }
}
