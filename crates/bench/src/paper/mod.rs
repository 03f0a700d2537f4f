//! `pmcache bench paper`: the papers' block-level experiments re-run with pmcache as a series
//! on the papers' own axes (`../shared/PAPERS-EXPERIMENTS.md` specifies each one).
//!
//! `bench paper <id>` runs one experiment (or `all`), prints its tables, and writes
//! `<out>/<figure>.json` with the figure's SVG and PNG beside it; `bench paper report` reads
//! every JSON in `<out>` and writes `<out>/README.md` and the pictures anew from them.
//!
//! `--scale` sets how close to the paper a run is: `smallest` runs in seconds (CI), `small`
//! in minutes, `full` as close to the paper as the machine allows; each figure records what
//! its scale shrank.

mod common;
mod figure;
mod guest;
mod guest_policy;
mod guest_time;
mod inproc;
mod library;
mod p000;
mod p001;
mod p001_numa;
pub mod p002;
mod p003;
mod p004;
mod plot;
mod report;
mod volumes;
pub mod workload;

use std::path::{Path, PathBuf};

use clap::{Args, ValueEnum};
use indicatif::{ProgressBar, ProgressStyle};

use crate::harness::experiment::{Defaults, Experiment, Run};

pub use figure::{Absolute, Figure, Point, Provenance, ScaleNote, Series};
pub use report::{read_figures, write as write_report};

/// Options of `pmcache bench paper`.
#[derive(Args, Debug, Clone)]
pub struct PaperArgs {
    /// The experiment (`list` names them; `all` runs every one, `host` every one measured on
    /// this host, booting no QEMU guest; a panel's or a sibling's id, such as `000-fig4b` or
    /// `002-table1`, runs the experiment that makes it), `report` to write the report from the
    /// JSON in `--out`, or `list`.
    pub id: String,
    /// How close to the paper: `smallest` (seconds, CI), `small` (minutes), `full`.
    #[arg(long, value_enum, default_value_t = Scale::Small)]
    pub scale: Scale,
    /// Where the JSON and the pictures go (and where `report` reads and writes).
    #[arg(long, default_value = "papers")]
    pub out: PathBuf,
    /// Directory for the cache medium (emulated PM).
    #[arg(long, default_value = "/dev/shm")]
    pub pm_dir: PathBuf,
    /// Directory for backing files: on a disk (the papers' SSD), not a tmpfs.
    #[arg(long, default_value = "/var/tmp")]
    pub dir: PathBuf,
    /// `000-guest`: make the figures from this output of `scripts/guest/paper000.sh` instead
    /// of booting the guest.
    #[arg(long, value_name = "FILE")]
    pub guest_json: Option<PathBuf>,
    /// `004-fig1`: the bed it runs on, as the figures name it: `host`, or `guest-nvme` (set by
    /// `scripts/guest/paper004.sh` inside its guest). `001-fig3-numa`: `guest-numa` measures
    /// here (set by `scripts/guest/paper001.sh` inside its guest of two nodes, whose members
    /// are `<pm-dir>/node<N>`); anything else boots that guest. `003-fig2`: `guest-fs`
    /// measures here (set by `scripts/guest/paper003.sh` inside its guest, where the beds are
    /// mounted); anything else boots that guest.
    #[arg(long, default_value = "host")]
    pub bed: String,
}

#[cfg(test)]
impl PaperArgs {
    /// The options of `bench paper <id> --scale smallest --out <out>`, the rest at their
    /// defaults: what unit tests build figures with.
    pub(crate) fn smallest(id: &str, out: &Path) -> Self {
        PaperArgs {
            id: id.into(),
            scale: Scale::Smallest,
            out: out.into(),
            pm_dir: "/dev/shm".into(),
            dir: "/var/tmp".into(),
            guest_json: None,
            bed: "host".into(),
        }
    }
}

/// How close to the paper a run is.
#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
pub enum Scale {
    /// Seconds per experiment: every code path, no figure worth quoting.
    Smallest,
    /// Minutes per experiment: the paper's points, smaller working sets.
    Small,
    /// As close to the paper as this machine allows.
    Full,
}

impl Scale {
    /// Its name.
    pub fn name(self) -> &'static str {
        match self {
            Scale::Smallest => "smallest",
            Scale::Small => "small",
            Scale::Full => "full",
        }
    }

    fn runs(self) -> usize {
        match self {
            Scale::Smallest => 1,
            Scale::Small => 3,
            Scale::Full => 5,
        }
    }

    fn seconds(self) -> f64 {
        match self {
            Scale::Smallest => 0.03,
            Scale::Small => 0.5,
            Scale::Full => 3.0,
        }
    }

    /// The thread counts of a thread sweep (the papers': 1 … 16).
    fn threads(self) -> Vec<usize> {
        match self {
            Scale::Smallest => vec![1, 2, 4],
            Scale::Small | Scale::Full => vec![1, 2, 4, 8, 16],
        }
    }

    /// `full`, `small` or `smallest`'s value.
    fn pick<T>(self, full: T, small: T, smallest: T) -> T {
        match self {
            Scale::Full => full,
            Scale::Small => small,
            Scale::Smallest => smallest,
        }
    }
}

/// What every experiment runs with.
pub struct Ctx {
    /// The options.
    pub args: PaperArgs,
    /// Runs per point.
    pub runs: usize,
    /// Seconds per turn.
    pub seconds: f64,
    /// `--seconds`, if given.
    pub seconds_given: Option<f64>,
    /// CPUs of this machine (threads beyond are oversubscribed).
    pub cpus: usize,
    /// The command, commit, machine, date.
    pub provenance: Provenance,
}

impl Ctx {
    /// The context of `args` and `run` (`--quick`: `--scale smallest`).
    fn new(args: &PaperArgs, run: &Run) -> Self {
        let mut args = args.clone();
        if run.quick {
            args.scale = Scale::Smallest;
        }
        let seconds_given = (run.seconds > 0.0).then_some(run.seconds);
        Ctx {
            runs: if run.runs > 0 { run.runs } else { args.scale.runs() },
            seconds: seconds_given.unwrap_or(args.scale.seconds()),
            seconds_given,
            cpus: std::thread::available_parallelism().map(|n| n.get()).unwrap_or(1),
            provenance: provenance(&args.out),
            args,
        }
    }

    /// The scale note of a figure, with what the scale shrank.
    pub fn scale_note(&self, shrunk: Vec<String>) -> ScaleNote {
        self.scale_note_timed(shrunk, self.seconds)
    }

    /// [`Ctx::scale_note`] of an experiment that runs each series `seconds_per_turn` seconds
    /// (its own run time, not `--seconds`'s in-process turns).
    pub fn scale_note_timed(&self, shrunk: Vec<String>, seconds_per_turn: f64) -> ScaleNote {
        ScaleNote { name: self.args.scale.name().into(), runs: self.runs, seconds_per_turn, shrunk }
    }

    /// A progress bar of `turns` turns (drawn only on a terminal).
    pub fn progress(&self, label: &str, turns: u64) -> ProgressBar {
        let bar = ProgressBar::new(turns);
        bar.set_style(
            ProgressStyle::with_template("{prefix:>10} [{bar:30}] {pos}/{len} turns, {eta} left")
                .expect("a valid template")
                .progress_chars("=> "),
        );
        bar.set_prefix(label.to_string());
        bar
    }
}

/// An experiment: the figures it makes, and how.
struct PaperExperiment {
    id: &'static str,
    what: &'static str,
    run: fn(&Ctx) -> Result<Vec<Figure>, String>,
    /// Whether it boots a QEMU guest (left out of `host`).
    guest: bool,
}

const EXPERIMENTS: &[PaperExperiment] = &[
    PaperExperiment {
        id: "000-fig2",
        what: "devices alone vs the cache stacks (log MB/s)",
        run: p000::fig2,
        guest: false,
    },
    PaperExperiment {
        id: "000-fig3",
        what: "lookup cost by request size and working set",
        run: p000::fig3,
        guest: false,
    },
    PaperExperiment {
        id: "000-fig4",
        what: "threads: 4 KiB random reads (a), 4 MiB sequential reads (b)",
        run: p000::fig4,
        guest: false,
    },
    PaperExperiment {
        id: "000-fig5",
        what: "4 MiB sequential, read share 100 → 10 %",
        run: p000::fig5,
        guest: false,
    },
    PaperExperiment {
        id: "000-fig6",
        what: "4 KiB random 50:50 by threads",
        run: p000::fig6,
        guest: false,
    },
    PaperExperiment {
        id: "000-library",
        what: "Figs 4a, 4b, 5 and 6's points with pmcache embedded as a library beside the raw \
               medium by loads and stores (in the guest: on a DAX file system), for 000-guest",
        run: library::run,
        guest: false,
    },
    PaperExperiment {
        id: "000-guest",
        what: "Figs 2-6 on the papers' own systems: bcache, dm-cache, dm-writecache and \
               pmcache (ublk) on emulated NVDIMMs in one QEMU guest",
        run: guest::run,
        guest: true,
    },
    PaperExperiment {
        id: "001-fig3",
        what: "FxMark analogues: private, shared, mixed 75/25 and 25/75 (a–d)",
        run: p001::fig3,
        guest: false,
    },
    PaperExperiment {
        id: "001-fig3-numa",
        what: "Fig 3 a and d as local and remote accesses on a cache of a member per node (a \
               QEMU guest of two NUMA nodes)",
        run: p001_numa::run,
        guest: true,
    },
    PaperExperiment {
        id: "002-fig2",
        what: "the cleaner's priority: Figs 2, 3, 4 and Table 1 in one run (bench paper002)",
        run: p002::figures,
        guest: false,
    },
    PaperExperiment {
        id: "003-fig2",
        what: "filebench's four personalities on ext4 on brd, over pmcache (ublk) and -o dax \
               on an emulated NVDIMM, in a QEMU guest",
        run: p003::run,
        guest: true,
    },
    PaperExperiment {
        id: "003-fig2-host",
        what: "003-fig2's roles on this host: tmpfs, ext4 over pmcache (NBD, nbdfuse, loop), \
               ext4 on a loop device in /dev/shm (as root)",
        run: p003::run_host,
        guest: false,
    },
    PaperExperiment {
        id: "004-fig1",
        what: "backing engines against fio's, 4 KiB random reads by jobs, QD 1 and 32",
        run: p004::run,
        guest: false,
    },
    PaperExperiment {
        id: "004-guest",
        what: "004-fig1 in a QEMU guest on NVMe with poll queues (the reads counted by queue)",
        run: p004::run_guest,
        guest: true,
    },
];

impl Experiment for PaperArgs {
    const NAME: &'static str = "paper";
    /// Runs and seconds by `--scale` (1, 3, 5 runs per point; 0.03, 0.5, 3 s per series,
    /// point and run); `--quick` is `--scale smallest`.
    const DEFAULTS: Defaults =
        Defaults { runs: Some(0), seconds: Some(0.0), quick_runs: 1, quick_seconds: 0.03 };
    type Report = Vec<Figure>;

    /// `list` and `report` print what they did; an experiment prints each figure's table as
    /// it is made (unless `run.json`) and returns the figures.
    fn run(&self, run: &Run) -> Result<Vec<Figure>, String> {
        match self.id.as_str() {
            "list" => {
                for e in EXPERIMENTS {
                    println!("{:<10} {}", e.id, e.what);
                }
                Ok(Vec::new())
            }
            "report" => {
                let written = report::write(&self.out)?;
                println!("wrote {}", written.display());
                Ok(Vec::new())
            }
            _ => self::run(self, run, &mut |figure, files| {
                if !run.json {
                    println!("{}", figure.table());
                    let names: Vec<String> =
                        files.iter().map(|f| f.display().to_string()).collect();
                    println!("wrote {}\n", names.join(", "));
                }
            }),
        }
    }

    fn table(&self, _figures: &Vec<Figure>, _run: &Run) -> String {
        String::new()
    }
}

/// Runs experiment `args.id` (or `all`), writing each figure's JSON, SVG and PNG to
/// `args.out` and handing it to `done` with those files' paths; returns the figures.
pub fn run(
    args: &PaperArgs,
    run: &Run,
    done: &mut dyn FnMut(&Figure, &[PathBuf]),
) -> Result<Vec<Figure>, String> {
    let chosen: Vec<&PaperExperiment> = if args.id == "all" {
        EXPERIMENTS.iter().collect()
    } else if args.id == "host" {
        EXPERIMENTS.iter().filter(|e| !e.guest).collect()
    } else {
        let id = args.id.as_str();
        let experiment = EXPERIMENTS
            .iter()
            .find(|e| {
                e.id == id
                    || id.strip_prefix(e.id).is_some_and(|panel| panel.len() == 1)
                    || (e.id == "002-fig2"
                        && ["002-fig3", "002-fig3-totals", "002-fig4", "002-table1"].contains(&id))
            })
            .ok_or_else(|| {
                let ids: Vec<&str> = EXPERIMENTS.iter().map(|e| e.id).collect();
                format!("no experiment {id:?}: one of {}, all, host, report, list", ids.join(", "))
            })?;
        vec![experiment]
    };
    std::fs::create_dir_all(&args.out).map_err(|e| format!("{}: {e}", args.out.display()))?;
    let ctx = Ctx::new(args, run);
    let mut figures = vec![];
    for experiment in chosen {
        eprintln!("{}: {} (scale {})", experiment.id, experiment.what, args.scale.name());
        for figure in (experiment.run)(&ctx)? {
            let json_path = args.out.join(format!("{}.json", figure.id));
            let json = serde_json::to_string_pretty(&figure).map_err(|e| e.to_string())?;
            std::fs::write(&json_path, json + "\n")
                .map_err(|e| format!("{}: {e}", json_path.display()))?;
            let [svg, png] = plot::draw(&figure, &args.out)?;
            done(&figure, &[json_path, svg, png]);
            figures.push(figure);
        }
    }
    Ok(figures)
}

/// The command line, the commit (of the working directory's repository, if any; `-dirty`
/// when files other than those under `out`, where the figures go, differ from it), the
/// machine and the date.
fn provenance(out: &Path) -> Provenance {
    let output = |program: &str, args: &[&str]| {
        std::process::Command::new(program)
            .args(args)
            .output()
            .ok()
            .filter(|o| o.status.success())
            .map(|o| String::from_utf8_lossy(&o.stdout).trim().to_string())
    };
    let commit = std::env::var("PMCACHE_BENCH_COMMIT")
        .ok()
        .filter(|c| !c.is_empty())
        .or_else(|| output("git", &["rev-parse", "--short=7", "HEAD"]))
        .map(|hash| {
            // The figures written so far in this run change nothing that made them.
            let out = out.canonicalize().unwrap_or_else(|_| out.to_path_buf());
            let outside_out = format!(":(exclude){}", out.display());
            let status =
                ["status", "--porcelain", "--untracked-files=no", "--", ":/", &outside_out];
            let dirty = output("git", &status).is_some_and(|s| !s.is_empty());
            if dirty { format!("{hash}-dirty") } else { hash }
        })
        .unwrap_or_else(|| format!("v{} (no git repository here)", env!("CARGO_PKG_VERSION")));
    let cpu_model = crate::harness::machine::cpu_model();
    let memory_gib = std::fs::read_to_string("/proc/meminfo")
        .ok()
        .and_then(|s| {
            s.lines()
                .find(|l| l.starts_with("MemTotal:"))
                .and_then(|l| l.split_whitespace().nth(1).and_then(|kib| kib.parse::<u64>().ok()))
        })
        .map_or(0.0, |kib| kib as f64 / (1 << 20) as f64);
    let kernel = crate::harness::machine::kernel();
    let cpus = crate::harness::machine::cpus();
    Provenance {
        command: std::env::args()
            .enumerate()
            .map(|(i, a)| if i == 0 { "pmcache".to_string() } else { a })
            .collect::<Vec<_>>()
            .join(" "),
        commit,
        machine: format!("{cpus} CPUs ({cpu_model}), {memory_gib:.0} GiB, Linux {kernel}"),
        date: output("date", &["-u", "+%Y-%m-%d %H:%M UTC"]).unwrap_or_default(),
    }
}
