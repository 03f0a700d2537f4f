//! What an experiment is to the harness: its name, its own options beside the shared
//! [`RunArgs`], a run that returns a report, and how the report is printed.
//!
//! `pmcache bench NAME` parses [`Cli<E>`] (the experiment's options and `RunArgs`, with the
//! experiment's [`Defaults`] shown in `--help`), resolves `RunArgs` into a [`Run`], calls
//! [`Experiment::run`], then prints the report's table, or its JSON with `--json`, writes the
//! JSON to `--json-out`, and calls [`Experiment::finish`] (pictures, checks on the figures).

use std::path::PathBuf;

use clap::{ArgMatches, Args, Command, FromArgMatches};
use serde::Serialize;

use crate::harness::output::write_json;

/// The options every experiment takes.
#[derive(Args, Debug, Clone, Default)]
pub struct RunArgs {
    /// Runs (medians are reported).
    #[arg(long)]
    pub runs: Option<usize>,
    /// Seconds per measurement.
    #[arg(long, alias = "runtime-secs")]
    pub seconds: Option<f64>,
    /// A smoke run: small sizes, at most the experiment's smoke count of runs and seconds.
    #[arg(long)]
    pub quick: bool,
    /// Print JSON instead of the table.
    #[arg(long)]
    pub json: bool,
    /// Also write the JSON report to this file.
    #[arg(long, value_name = "FILE")]
    pub json_out: Option<PathBuf>,
}

/// An experiment's counts when `--runs` and `--seconds` are not given, and their bounds under
/// `--quick`. `None`: the experiment takes no such option (it is hidden and refused; [`Run`]
/// holds 1 run, 0 seconds). A default of 0 leaves the count to the experiment's other options
/// (`bench paper`: its `--scale`): [`Run`] then holds 0 unless the option is given.
#[derive(Debug, Clone, Copy)]
pub struct Defaults {
    /// Runs.
    pub runs: Option<usize>,
    /// Seconds per measurement.
    pub seconds: Option<f64>,
    /// At most this many runs under `--quick`.
    pub quick_runs: usize,
    /// At most this many seconds per measurement under `--quick`.
    pub quick_seconds: f64,
}

/// `RunArgs` resolved against an experiment's [`Defaults`].
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct Run {
    /// A smoke run.
    pub quick: bool,
    /// Runs, at least 1 (0: not given, where the default is 0).
    pub runs: usize,
    /// Seconds per measurement, positive (0: not given, where the default is 0 or none).
    pub seconds: f64,
    /// The report goes out as JSON: nothing else is printed on stdout.
    pub json: bool,
}

impl RunArgs {
    /// The run these options ask of an experiment with `defaults`.
    pub fn resolve(&self, defaults: Defaults) -> Result<Run, String> {
        let runs = match (self.runs, defaults.runs) {
            (Some(_), None) => return Err("this experiment takes no --runs".into()),
            (Some(0), _) => return Err("--runs must be at least 1".into()),
            (given, default) => given.or(default).unwrap_or(1),
        };
        let seconds = match (self.seconds, defaults.seconds) {
            (Some(_), None) => return Err("this experiment takes no --seconds".into()),
            (Some(s), _) if !(s > 0.0 && s.is_finite()) => {
                return Err(format!("--seconds {s}: must be positive"));
            }
            (given, default) => given.or(default).unwrap_or(0.0),
        };
        Ok(Run {
            quick: self.quick,
            runs: if self.quick { runs.min(defaults.quick_runs) } else { runs },
            seconds: if self.quick { seconds.min(defaults.quick_seconds) } else { seconds },
            json: self.json,
        })
    }
}

/// One `pmcache bench` experiment: its options (without [`RunArgs`]), how it runs, what it
/// reports.
pub trait Experiment: Args + FromArgMatches {
    /// `pmcache bench NAME`; its module is `NAME` with `_` for `-`.
    const NAME: &'static str;
    /// `--runs` and `--seconds` when not given, and their bounds under `--quick`.
    const DEFAULTS: Defaults;
    /// What a run finds.
    type Report: Serialize;

    /// Runs the experiment (printing, unless `run.json`, what it shows as it goes).
    fn run(&self, run: &Run) -> Result<Self::Report, String>;

    /// The table printed without `--json` once the run is over.
    fn table(&self, report: &Self::Report, run: &Run) -> String;

    /// What `--json` prints: the report pretty-printed.
    fn json(&self, report: &Self::Report) -> Result<String, String> {
        serde_json::to_string_pretty(report).map_err(|e| e.to_string())
    }

    /// What follows the printed report: pictures, checks on the figures.
    fn finish(&self, _report: &Self::Report, _run: &Run) -> Result<(), String> {
        Ok(())
    }
}

/// An error naming how many of `figures` (one a configuration) are missing: those
/// configurations measured nothing (each row says why).
pub(crate) fn check_measured(figures: impl Iterator<Item = Option<f64>>) -> Result<(), String> {
    match figures.filter(Option::is_none).count() {
        0 => Ok(()),
        failed => Err(format!("{failed} configurations measured nothing (see their errors)")),
    }
}

/// Each of `rows` as one line of JSON.
pub(crate) fn json_lines<T: Serialize>(rows: &[T]) -> Result<String, String> {
    let lines: Result<Vec<String>, _> = rows.iter().map(serde_json::to_string).collect();
    Ok(lines.map_err(|e| e.to_string())?.join("\n"))
}

/// An experiment's options and the run they ask for, parsed from `argv` (whose first word is
/// the command's name).
pub(crate) fn parse<E: Experiment>(argv: &[&str]) -> Result<(E, Run), String> {
    let command = Cli::<E>::augment_args(Command::new("bench"));
    let matches = command.try_get_matches_from(argv).map_err(|e| e.to_string())?;
    let cli = Cli::<E>::from_arg_matches(&matches).map_err(|e| e.to_string())?;
    let run = cli.run.resolve(E::DEFAULTS)?;
    Ok((cli.experiment, run))
}

/// An experiment's command line: its own options and the shared ones.
#[derive(Debug, Clone)]
pub struct Cli<E> {
    /// The shared options.
    pub run: RunArgs,
    /// The experiment's own.
    pub experiment: E,
}

impl<E: Experiment> Cli<E> {
    /// Runs the experiment and prints its report as the options ask.
    pub fn main(&self) -> Result<(), String> {
        let run = self.run.resolve(E::DEFAULTS)?;
        let report = self.experiment.run(&run)?;
        if run.json {
            println!("{}", self.experiment.json(&report)?);
        } else {
            print!("{}", self.experiment.table(&report, &run));
        }
        write_json(&report, false, self.run.json_out.as_deref())?;
        self.experiment.finish(&report, &run)
    }
}

impl<E: Experiment> FromArgMatches for Cli<E> {
    fn from_arg_matches(matches: &ArgMatches) -> Result<Self, clap::Error> {
        Ok(Cli {
            run: RunArgs::from_arg_matches(matches)?,
            experiment: E::from_arg_matches(matches)?,
        })
    }

    fn update_from_arg_matches(&mut self, matches: &ArgMatches) -> Result<(), clap::Error> {
        self.run.update_from_arg_matches(matches)?;
        self.experiment.update_from_arg_matches(matches)
    }
}

impl<E: Experiment> Args for Cli<E> {
    fn augment_args(command: Command) -> Command {
        with_defaults(RunArgs::augment_args(E::augment_args(command)), E::DEFAULTS)
    }

    fn augment_args_for_update(command: Command) -> Command {
        with_defaults(
            RunArgs::augment_args_for_update(E::augment_args_for_update(command)),
            E::DEFAULTS,
        )
    }
}

/// `command` with `defaults` in the help of `--runs`, `--seconds` and `--quick`.
fn with_defaults(command: Command, defaults: Defaults) -> Command {
    let quick = format!(
        "A smoke run: small sizes, at most {} run(s){}",
        defaults.quick_runs,
        if defaults.seconds.is_some() {
            format!(" of at most {} s", defaults.quick_seconds)
        } else {
            String::new()
        }
    );
    let command = command.mut_arg("quick", |a| a.help(quick));
    let command = match defaults.runs {
        Some(0) => command,
        Some(runs) => command.mut_arg("runs", |a| a.default_value(runs.to_string())),
        None => command.mut_arg("runs", |a| a.hide(true)),
    };
    match defaults.seconds {
        Some(seconds) if seconds <= 0.0 => command,
        Some(seconds) => command.mut_arg("seconds", |a| a.default_value(seconds.to_string())),
        None => command.mut_arg("seconds", |a| a.hide(true)),
    }
}
