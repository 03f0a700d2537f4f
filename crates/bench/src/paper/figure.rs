//! A measured figure: what `bench paper` writes as JSON, prints as a table, draws, and what
//! `bench paper report` reads back.

use serde::{Deserialize, Serialize};

use crate::harness::stats::{median_in_place, min_max};

/// One figure (or one panel) of a paper, re-run here.
#[derive(Clone, Debug, Default, Serialize, Deserialize)]
pub struct Figure {
    /// `000-fig4a`: the paper, the figure and the panel; also the files' stem.
    pub id: String,
    /// What the figure shows, in the paper's terms.
    pub title: String,
    /// Where it ran: `in process (host)`, `QEMU guest`, ….
    pub bed: String,
    /// The x axis: its label and, for each position, what is written under it.
    pub x_label: String,
    /// Labels of the x positions, in order.
    pub x_ticks: Vec<String>,
    /// The y axis' label, unit included.
    pub y_label: String,
    /// Draw y on a log scale.
    pub y_log: bool,
    /// Bars (categories) rather than lines.
    pub bars: bool,
    /// The measured series, the normaliser (when there is one) first.
    pub series: Vec<Series>,
    /// For a normalised figure, the same series in absolute units.
    pub absolute: Option<Absolute>,
    /// The paper's published result, in one sentence.
    pub published: String,
    /// Ours on the same axis, in one sentence, computed from `series`.
    pub ours: String,
    /// How the run was scaled and what that shrank.
    pub scale: ScaleNote,
    /// Choices the paper leaves unstated, made here, and what is not measured on this bed.
    pub notes: Vec<String>,
    /// The command, commit, machine and date of the run.
    pub provenance: Provenance,
}

/// One line (or one group of bars).
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct Series {
    /// `pmcache (write-back)`, `raw medium`, ….
    pub name: String,
    /// One point per x position (`None` where this series was not measured).
    pub points: Vec<Option<Point>>,
}

/// A normalised figure's series before normalising.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct Absolute {
    /// The y unit of these series.
    pub y_label: String,
    /// One per series of the figure, same order.
    pub series: Vec<Series>,
}

/// A median over runs with its range.
#[derive(Clone, Copy, Debug, Serialize, Deserialize, PartialEq)]
pub struct Point {
    /// The median over runs.
    pub median: f64,
    /// The smallest run.
    pub min: f64,
    /// The largest run.
    pub max: f64,
    /// More threads than CPUs: time-shared, not scaling.
    pub oversubscribed: bool,
}

impl Point {
    /// The median, min and max of `values` (at least one).
    pub fn of(values: &[f64], oversubscribed: bool) -> Point {
        assert!(!values.is_empty(), "a point needs at least one run");
        let mut values = values.to_vec();
        let (min, max) = min_max(&values);
        Point { median: median_in_place(&mut values), min, max, oversubscribed }
    }

    /// The median, `star` after it when oversubscribed, and the runs' range where they
    /// differ (a single run has none): `4.00* (3.60–4.40)`.
    pub fn text(&self, star: &str) -> String {
        let star = if self.oversubscribed { star } else { "" };
        let (min, max) = (number(self.min), number(self.max));
        if min == max {
            format!("{}{star}", number(self.median))
        } else {
            format!("{}{star} ({min}–{max})", number(self.median))
        }
    }
}

/// The scale a figure ran at and what it changed from the paper.
#[derive(Clone, Debug, Default, Serialize, Deserialize)]
pub struct ScaleNote {
    /// `smallest`, `small` or `full`.
    pub name: String,
    /// Runs per point (medians are of these).
    pub runs: usize,
    /// Seconds each series ran per point and run.
    pub seconds_per_turn: f64,
    /// What differs from the paper at this scale, one item per change.
    pub shrunk: Vec<String>,
}

/// Where a figure's numbers came from.
#[derive(Clone, Debug, Default, Serialize, Deserialize)]
pub struct Provenance {
    /// The command line that produced the figure.
    pub command: String,
    /// The commit of the code (with `-dirty` when the tree had changes).
    pub commit: String,
    /// CPUs, CPU model, memory, kernel.
    pub machine: String,
    /// UTC date and time of the run.
    pub date: String,
}

impl Figure {
    /// The series named `name`.
    pub fn series(&self, name: &str) -> Option<&Series> {
        self.series.iter().find(|s| s.name == name)
    }

    /// The figure as a fixed-width table: one row per x position, one column per series
    /// (median and range); `*` marks oversubscribed points.
    pub fn table(&self) -> String {
        let mut out = format!("{} — {}\n", self.id, self.title);
        out += &self.table_of(&self.series, &self.y_label);
        if let Some(absolute) = &self.absolute {
            out += &self.table_of(&absolute.series, &absolute.y_label);
        }
        if self.series.iter().flat_map(|s| s.points.iter().flatten()).any(|p| p.oversubscribed) {
            out += "* more threads than CPUs: time-shared, not scaling\n";
        }
        out += &format!("paper: {}\nhere:  {}\n", self.published, self.ours);
        out
    }

    /// One table of `series` with y in `y_label`.
    fn table_of(&self, series: &[Series], y_label: &str) -> String {
        let mut out = String::new();
        let label_width =
            self.x_ticks.iter().map(String::len).chain([self.x_label.len()]).max().unwrap_or(4);
        let cell = |p: &Option<Point>| match p {
            None => "—".to_string(),
            Some(p) => p.text("*"),
        };
        let widths: Vec<usize> = series
            .iter()
            .map(|s| s.points.iter().map(|p| cell(p).chars().count()).chain([s.name.len()]).max())
            .map(|w| w.unwrap_or(8))
            .collect();
        out += &format!("{:<label_width$}", self.x_label);
        for (s, w) in series.iter().zip(&widths) {
            out += &format!("  {:>w$}", s.name);
        }
        out += &format!("\n(y: {y_label})\n");
        for (i, tick) in self.x_ticks.iter().enumerate() {
            out += &format!("{tick:<label_width$}");
            for (s, &w) in series.iter().zip(&widths) {
                let text = cell(s.points.get(i).unwrap_or(&None));
                let pad = w.saturating_sub(text.chars().count());
                out += &format!("  {}{text}", " ".repeat(pad));
            }
            out += "\n";
        }
        out
    }
}

/// A number with three significant digits (no exponent for the ranges printed here).
pub fn number(value: f64) -> String {
    let magnitude = value.abs();
    if magnitude >= 100.0 || value == 0.0 {
        format!("{value:.0}")
    } else if magnitude >= 10.0 {
        format!("{value:.1}")
    } else if magnitude >= 1.0 {
        format!("{value:.2}")
    } else {
        format!("{value:.3}")
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_point_is_the_median_and_range_of_its_runs() {
        assert_eq!(
            Point::of(&[3.0, 1.0, 2.0], false),
            Point { median: 2.0, min: 1.0, max: 3.0, oversubscribed: false }
        );
        assert_eq!(Point::of(&[4.0, 1.0], true).median, 2.5);
    }

    #[test]
    fn a_single_run_has_no_range() {
        assert_eq!(Point::of(&[2.5], false).text("*"), "2.50");
        assert_eq!(Point::of(&[2.5], true).text("*"), "2.50*");
        assert_eq!(Point::of(&[3.0, 1.0, 2.0], true).text("*"), "2.00* (1.00–3.00)");
    }

    #[test]
    fn numbers_keep_three_significant_digits() {
        assert_eq!(number(0.61234), "0.612");
        assert_eq!(number(1.2345), "1.23");
        assert_eq!(number(12.345), "12.3");
        assert_eq!(number(1234.5), "1234");
    }
}
