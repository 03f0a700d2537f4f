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
/// holds 1 run, 0 seconds). A default of 0 leaves the count to the experiment's `--scale`
/// (`bench paper`, `bench fs`): [`Run`] then holds 0 unless the option is given.
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
    let by_scale = defaults.seconds.is_some_and(|s| s <= 0.0);
    let quick = match defaults.seconds {
        _ if by_scale => "A smoke run: as --scale smallest".to_string(),
        Some(_) => format!(
            "A smoke run: small sizes, at most {} run(s) of at most {} s",
            defaults.quick_runs, defaults.quick_seconds
        ),
        None => format!("A smoke run: small sizes, at most {} run(s)", defaults.quick_runs),
    };
    let command = command.mut_arg("quick", |a| a.help(quick));
    let command = match defaults.runs {
        Some(0) => command.mut_arg("runs", |a| a.help("Runs (medians are reported); by --scale")),
        Some(runs) => command.mut_arg("runs", |a| a.default_value(runs.to_string())),
        None => command.mut_arg("runs", |a| a.hide(true)),
    };
    match defaults.seconds {
        _ if by_scale => {
            command.mut_arg("seconds", |a| a.help("Seconds per measurement; by --scale"))
        }
        Some(seconds) => command.mut_arg("seconds", |a| a.default_value(seconds.to_string())),
        None => command.mut_arg("seconds", |a| a.hide(true)),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const TIMED: Defaults =
        Defaults { runs: Some(5), seconds: Some(2.0), quick_runs: 3, quick_seconds: 0.2 };

    fn resolved(args: RunArgs, defaults: Defaults) -> Result<Run, String> {
        args.resolve(defaults)
    }

    #[test]
    fn options_not_given_take_the_experiments_defaults_and_quick_bounds_them() {
        let run = resolved(RunArgs::default(), TIMED).expect("defaults");
        assert_eq!((run.runs, run.seconds, run.quick), (5, 2.0, false));
        let quick = RunArgs { quick: true, ..RunArgs::default() };
        let run = resolved(quick.clone(), TIMED).expect("quick");
        assert_eq!((run.runs, run.seconds), (3, 0.2));
        let fewer = RunArgs { runs: Some(1), seconds: Some(0.05), ..quick };
        assert_eq!(resolved(fewer, TIMED).map(|r| (r.runs, r.seconds)), Ok((1, 0.05)));
    }

    #[test]
    fn zero_runs_a_bad_time_and_options_an_experiment_does_not_take_are_refused() {
        let zero = RunArgs { runs: Some(0), ..RunArgs::default() };
        assert!(resolved(zero, TIMED).unwrap_err().contains("--runs"));
        let negative = RunArgs { seconds: Some(-1.0), ..RunArgs::default() };
        assert!(resolved(negative, TIMED).unwrap_err().contains("--seconds"));
        let untimed = Defaults { seconds: None, runs: None, ..TIMED };
        let timed = RunArgs { seconds: Some(1.0), ..RunArgs::default() };
        assert!(resolved(timed, untimed).unwrap_err().contains("no --seconds"));
        let counted = RunArgs { runs: Some(2), ..RunArgs::default() };
        assert!(resolved(counted, untimed).unwrap_err().contains("no --runs"));
        let run = resolved(RunArgs::default(), untimed).expect("no counts");
        assert_eq!((run.runs, run.seconds), (1, 0.0));
    }

    #[test]
    fn counts_left_to_the_scale_stay_zero_unless_given() {
        let by_scale = Defaults { runs: Some(0), seconds: Some(0.0), ..TIMED };
        let run = resolved(RunArgs { quick: true, ..RunArgs::default() }, by_scale).expect("scale");
        assert_eq!((run.runs, run.seconds), (0, 0.0));
        let given = RunArgs { runs: Some(4), seconds: Some(1.5), ..RunArgs::default() };
        assert_eq!(resolved(given, by_scale).map(|r| (r.runs, r.seconds)), Ok((4, 1.5)));
    }
}
