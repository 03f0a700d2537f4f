//! `bench paper` at `--scale smallest`: every experiment runs, its figures hold what the
//! paper's axes need, and the report is regenerated from their JSON.

use pmcache_bench::harness::experiment::Run;
use pmcache_bench::paper::{self, Figure, PaperArgs, Scale};

/// Two runs of 0.02 s per point.
const RUN: Run = Run { quick: false, runs: 2, seconds: 0.02, json: true };

fn args(id: &str, out: &std::path::Path) -> PaperArgs {
    PaperArgs {
        id: id.into(),
        scale: Scale::Smallest,
        out: out.to_path_buf(),
        pm_dir: "/dev/shm".into(),
        dir: std::env::temp_dir(),
        guest_json: None,
        bed: "host".into(),
    }
}

fn check(figure: &Figure) {
    let id = &figure.id;
    assert!(!figure.series.is_empty(), "{id}: no series");
    assert!(!figure.published.is_empty() && !figure.ours.is_empty(), "{id}: sentences");
    assert!(!figure.provenance.commit.is_empty() && !figure.provenance.machine.is_empty());
    assert_eq!(figure.scale.name, "smallest");
    assert!(!figure.scale.shrunk.is_empty(), "{id}: the smallest scale shrinks something");
    let mut all = figure.series.clone();
    if let Some(absolute) = &figure.absolute {
        assert_eq!(absolute.series.len(), figure.series.len(), "{id}: one absolute per series");
        all.extend(absolute.series.iter().cloned());
    }
    for series in &all {
        // A series this bed cannot measure (IOPOLL without poll queues) says why in a note
        // that names it or its engine.
        let engine = series.name.rsplit(' ').next().unwrap_or_default();
        assert!(
            series.points.iter().any(Option::is_some)
                || figure.notes.iter().any(|n| n.contains(&series.name) || n.contains(engine)),
            "{id} {}: nothing measured, and no note says why",
            series.name
        );
        assert_eq!(
            series.points.len(),
            figure.x_ticks.len(),
            "{id} {}: a point per x",
            series.name
        );
        for point in series.points.iter().flatten() {
            assert!(
                point.median.is_finite() && point.median > 0.0,
                "{id} {}: {point:?}",
                series.name
            );
            assert!(point.min <= point.median && point.median <= point.max, "{id}: {point:?}");
        }
    }
    if figure.absolute.is_some() {
        // A normalised figure: its first series is the normaliser, 1 in every run.
        for point in figure.series[0].points.iter().flatten() {
            assert!((point.min - 1.0).abs() < 1e-9 && (point.max - 1.0).abs() < 1e-9);
        }
    }
}

#[test]
fn every_experiment_makes_its_figures_and_the_report_is_made_from_their_json() {
    let out = tempfile::tempdir().expect("tempdir");
    let mut files = vec![];
    let mut figures = vec![];
    // Every in-process experiment of the host. `000-guest`, `001-fig3-numa` and `004-guest`
    // boot a QEMU guest (scripts/test.sh runs them); `002-fig2` spawns `pmcache serve` from the executable
    // running it, so the cli's end-to-end tests run it on the built binary.
    for id in ["000-fig2", "000-fig3", "000-fig4", "000-fig5", "000-fig6", "001-fig3", "004-fig1"] {
        let made = paper::run(&args(id, out.path()), &RUN, &mut |_, written| {
            files.extend(written.iter().cloned())
        });
        figures.extend(made.unwrap_or_else(|e| panic!("bench paper {id}: {e}")));
    }
    let ids: Vec<&str> = figures.iter().map(|f| f.id.as_str()).collect();
    assert_eq!(
        ids,
        [
            "000-fig2",
            "000-fig3",
            "000-fig4a",
            "000-fig4b",
            "000-fig5",
            "000-fig6",
            "001-fig3a",
            "001-fig3b",
            "001-fig3c",
            "001-fig3d",
            "004-fig1a",
            "004-fig1b"
        ]
    );
    figures.iter().for_each(check);
    assert_eq!(files.len(), 3 * figures.len(), "a JSON, an SVG and a PNG per figure");
    assert!(files.iter().all(|f| f.metadata().is_ok_and(|m| m.len() > 0)), "{files:?}");

    let read = paper::read_figures(out.path()).expect("the JSON reads back");
    assert_eq!(read.len(), figures.len());
    for (back, made) in read.iter().zip(&figures) {
        assert_eq!(
            (&back.id, &back.ours, back.series.len()),
            (&made.id, &made.ours, made.series.len())
        );
        for (b, m) in back.series.iter().zip(&made.series) {
            for (b, m) in b.points.iter().zip(&m.points) {
                match (b, m) {
                    (Some(b), Some(m)) => {
                        assert!(
                            (b.median - m.median).abs() <= m.median.abs() * 1e-12,
                            "{b:?} {m:?}"
                        )
                    }
                    (b, m) => assert!(b.is_none() && m.is_none(), "{b:?} read back as {m:?}"),
                }
            }
        }
    }
    let report = std::fs::read_to_string(paper::write_report(out.path()).expect("report"))
        .expect("the report");
    for figure in &figures {
        assert!(report.contains(&format!("## {}", figure.id)), "{}'s section", figure.id);
        assert!(report.contains(&format!("({}.svg)", figure.id)), "{}'s picture", figure.id);
        assert!(report.contains(&figure.ours), "{}'s sentence", figure.id);
    }
}

#[test]
fn an_unknown_experiment_is_refused_with_the_list() {
    let out = tempfile::tempdir().expect("tempdir");
    let error =
        paper::run(&args("000-fig9", out.path()), &RUN, &mut |_, _| {}).expect_err("unknown");
    assert!(error.contains("000-fig4") && error.contains("all"), "{error}");
}

/// The NUMA panels measured in place need a machine of two nodes with a directory bound to
/// each; on one node they say so (without `--bed guest-numa` they boot the guest instead).
#[test]
fn the_numa_panels_refuse_to_measure_on_a_machine_of_one_node() {
    let nodes = std::fs::read_dir("/sys/devices/system/node")
        .map(|d| {
            d.filter_map(Result::ok)
                .filter(|e| e.file_name().to_string_lossy().starts_with("node"))
                .count()
        })
        .unwrap_or(1);
    if nodes > 1 {
        eprintln!("skipped: this machine has {nodes} NUMA nodes");
        return;
    }
    let out = tempfile::tempdir().expect("tempdir");
    let guest_bed = PaperArgs { bed: "guest-numa".into(), ..args("001-fig3-numa", out.path()) };
    let error = paper::run(&guest_bed, &RUN, &mut |_, _| {}).expect_err("one node");
    assert!(error.contains("needs two NUMA nodes") && error.contains("has 1"), "{error}");
}

#[test]
fn a_panel_id_runs_its_figure() {
    let out = tempfile::tempdir().expect("tempdir");
    let figures = paper::run(&args("000-fig4b", out.path()), &RUN, &mut |_, _| {}).expect("fig4");
    let ids: Vec<&str> = figures.iter().map(|f| f.id.as_str()).collect();
    assert_eq!(ids, ["000-fig4a", "000-fig4b"], "a panel runs its whole experiment");
}
