//! `000-library`: pmcache embedded in a process as a library, against the raw medium it runs
//! on, at the points of the guest bed's Figs 4a, 4b, 5 and 6 (`scripts/guest/paper000.sh`).
//!
//! The guest bed measures each kernel cache layer against the raw NVDIMM through the interface
//! both share, the block layer. This is the same comparison for pmcache through its own
//! interface: the engine's lanes on a medium mapped from a DAX file system, against loads and
//! stores of the same mapping (reads copy out; writes copy and persist), the in-process bed's
//! raw series. Inside the guest the medium's directory is an ext4 `-o dax` mount on an
//! emulated NVDIMM, and the script runs this experiment there; on a host it runs on
//! `--pm-dir` (a tmpfs by default), for CI.
//!
//! The points go to `<out>/raw/000-library.jsonl`, one JSON object per line in the guest
//! bed's point format (`figure`, `x`, `series`, `run`, `bytes_per_s`, `iops`, `cache_hits`,
//! `cache_misses`) plus the medium's kind, so that the guest bed's figures take them as two
//! more series: `pmcache (library)` and its normaliser `NVM (DAX loads and stores)`. The
//! experiment makes no figure of its own.

use std::fmt::Write as _;
use std::io::Write as _;

use super::figure::{Figure, Point, number};
use super::inproc::{Bed, SeriesRun, measure};
use super::workload::Access;
use super::{Ctx, Scale};

const KIB: u64 = 1 << 10;
const MIB: u64 = 1 << 20;

/// The normaliser's series name: the raw medium by loads and stores.
pub const RAW_SERIES: &str = "NVM (DAX loads and stores)";
/// pmcache's engine embedded in the process.
pub const LIBRARY_SERIES: &str = "pmcache (library)";

/// One measured point, in the guest bed's format.
#[derive(Debug, serde::Serialize)]
struct LibraryPoint<'a> {
    figure: &'a str,
    x: &'a str,
    series: &'a str,
    run: usize,
    bytes_per_s: f64,
    iops: f64,
    cache_hits: Option<u64>,
    cache_misses: Option<u64>,
    medium: &'a str,
}

/// A figure's positions: (x label, access, threads).
type Positions = Vec<(String, Access, usize)>;

/// Each figure's id and positions.
fn positions(scale: Scale, span: u64) -> Vec<(&'static str, Positions)> {
    let threads = scale.threads();
    let shares: Vec<u32> = match scale {
        Scale::Smallest => vec![100, 90, 50],
        _ => vec![100, 99, 95, 90, 70, 50, 30, 10],
    };
    let by_threads = |access: Access| -> Positions {
        threads.iter().map(|&t| (t.to_string(), access, t)).collect()
    };
    vec![
        ("000-fig4a", by_threads(Access::Random { request: 4 * KIB, span, write_share: 0.0 })),
        ("000-fig4b", by_threads(Access::Sequential { request: 4 * MIB, span, write_share: 0.0 })),
        (
            "000-fig5",
            shares
                .iter()
                .map(|&r| {
                    let write_share = f64::from(100 - r) / 100.0;
                    let access = Access::Sequential { request: 4 * MIB, span, write_share };
                    (format!("{r} %"), access, 1)
                })
                .collect(),
        ),
        ("000-fig6", by_threads(Access::Random { request: 4 * KIB, span, write_share: 0.5 })),
    ]
}

/// Runs the four figures' points and writes them to `<out>/raw/000-library.jsonl`.
pub fn run(ctx: &Ctx) -> Result<Vec<Figure>, String> {
    let scale = ctx.args.scale;
    // The guest bed's working sets (paper000.sh: 32, 160 and 320 MiB).
    let span = scale.pick(320 * MIB, 160 * MIB, 32 * MIB);
    let bed = Bed::new(&ctx.args.pm_dir, &ctx.args.dir, span)?;
    let medium = bed.medium.kind().name();
    eprintln!(
        "000-library: medium {} ({medium}), working set {} MiB",
        ctx.args.pm_dir.display(),
        span / MIB
    );
    let series = [
        SeriesRun::new(RAW_SERIES, |_| bed.raw_worker()),
        SeriesRun::new(LIBRARY_SERIES, |_| bed.lane_worker().expect("a lane")),
    ];
    let raw_dir = ctx.args.out.join("raw");
    std::fs::create_dir_all(&raw_dir).map_err(|e| format!("{}: {e}", raw_dir.display()))?;
    let path = raw_dir.join("000-library.jsonl");
    let mut lines = String::new();
    let mut summary = String::new();
    for (figure, points) in positions(scale, span) {
        let bar = ctx.progress(figure, (points.len() * series.len() * ctx.runs) as u64);
        for (x, access, threads) in &points {
            let rates = measure(&series, *access, *threads, ctx.seconds, ctx.runs, &|| bar.inc(1));
            let request = access.request_max() as f64;
            for (s, one) in series.iter().enumerate() {
                for (run, &bytes_per_s) in rates[s].iter().enumerate() {
                    let point = LibraryPoint {
                        figure,
                        x,
                        series: &one.name,
                        run,
                        bytes_per_s,
                        iops: bytes_per_s / request,
                        cache_hits: None,
                        cache_misses: None,
                        medium,
                    };
                    let line = serde_json::to_string(&point).map_err(|e| e.to_string())?;
                    lines.push_str(&line);
                    lines.push('\n');
                }
            }
            let ratios: Vec<f64> = rates[1].iter().zip(&rates[0]).map(|(p, r)| p / r).collect();
            let _ = writeln!(
                summary,
                "{figure} {x:>5}: {LIBRARY_SERIES} / {RAW_SERIES} = {}",
                number(Point::of(&ratios, false).median)
            );
        }
        bar.finish_and_clear();
    }
    super::common::check_all_hits(&bed, "000-library")?;
    let mut file = std::fs::File::create(&path).map_err(|e| format!("{}: {e}", path.display()))?;
    file.write_all(lines.as_bytes()).map_err(|e| format!("{}: {e}", path.display()))?;
    print!("{summary}");
    println!("wrote {}", path.display());
    Ok(vec![])
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The positions are the guest bed's x labels, so that its figures take the points.
    #[test]
    fn positions_carry_the_guest_beds_x_labels() {
        let figures = positions(Scale::Smallest, 32 * MIB);
        let ids: Vec<&str> = figures.iter().map(|(id, _)| *id).collect();
        assert_eq!(ids, ["000-fig4a", "000-fig4b", "000-fig5", "000-fig6"]);
        let xs = |i: usize| figures[i].1.iter().map(|(x, _, _)| x.clone()).collect::<Vec<_>>();
        assert_eq!(xs(0), ["1", "2", "4"]);
        assert_eq!(xs(2), ["100 %", "90 %", "50 %"]);
        let threads: Vec<usize> = figures[3].1.iter().map(|(_, _, t)| *t).collect();
        assert_eq!(threads, [1, 2, 4]);
        match figures[2].1[2].1 {
            Access::Sequential { request, write_share, .. } => {
                assert_eq!(request, 4 * MIB);
                assert!((write_share - 0.5).abs() < 1e-9);
            }
            other => panic!("Fig 5 is sequential: {other:?}"),
        }
        assert_eq!(positions(Scale::Small, 160 * MIB)[2].1.len(), 8, "Fig 5's eight shares");
    }
}
