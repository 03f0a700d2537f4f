//! Test helpers: an experiment's arguments parsed from a command line.

use clap::{Args, FromArgMatches};

/// `A` parsed from `argv`, whose first word is the command's name.
pub(crate) fn parse_args<A: Args + FromArgMatches>(argv: &[&str]) -> Result<A, clap::Error> {
    let command = A::augment_args(clap::Command::new("bench"));
    A::from_arg_matches(&command.try_get_matches_from(argv)?)
}
