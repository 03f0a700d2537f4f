//! Draws a [`Figure`] on the paper's axes, as SVG and PNG (plotters).
//!
//! The x axis holds the figure's positions in order (threads, request sizes, read shares,
//! devices), evenly spaced as the papers draw them. Lines carry min–max bars; a point measured
//! with more threads than CPUs is drawn hollow. A log y axis is drawn as the log10 of the values
//! with the ticks labelled in the values' own units.
//!
//! The legend stands in a column of its own to the right of the plotting area, so it covers no
//! data whatever the values. Series are told apart by colour (ten well-separated colours), by
//! marker shape and by dash pattern, combined so that no two of up to [`DISTINCT_SERIES`] series
//! share a colour and a marker, nor a colour and a dash pattern.

use std::path::{Path, PathBuf};

use plotters::coord::Shift;
use plotters::element::DashedPathElement;
use plotters::prelude::*;
use plotters::style::text_anchor::{HPos, Pos, VPos};

use super::figure::{Figure, Point, number};

/// The chart's part of the canvas (axes and plotting area); the legend's column is added to
/// its right, and the canvas grows taller when the legend needs it.
const CHART_PX: (u32, u32) = (960, 600);
/// Space around the chart and around the legend's column.
const MARGIN_PX: i32 = 12;
/// The legend's text size.
const LEGEND_FONT_PX: f64 = 14.0;
/// One legend entry's height.
const ROW_PX: i32 = 20;
/// The sample of a series' line drawn before its name.
const SAMPLE_PX: i32 = 32;
/// Space inside the legend's border and between a sample and its name.
const PAD_PX: i32 = 8;
/// A marker's radius.
const MARKER_PX: i32 = 4;

/// Ten colours far apart from each other (Tableau 10).
const COLOURS: [RGBColor; 10] = [
    RGBColor(31, 119, 180),
    RGBColor(255, 127, 14),
    RGBColor(44, 160, 44),
    RGBColor(214, 39, 40),
    RGBColor(148, 103, 189),
    RGBColor(140, 86, 75),
    RGBColor(227, 119, 194),
    RGBColor(127, 127, 127),
    RGBColor(188, 189, 34),
    RGBColor(23, 190, 207),
];

/// Up to this many series, no two share a colour and a marker, nor a colour and a dash.
const DISTINCT_SERIES: usize = COLOURS.len() * MARKERS.len();

/// A point's marker.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
enum Marker {
    Circle,
    Square,
    Triangle,
}

const MARKERS: [Marker; 3] = [Marker::Circle, Marker::Square, Marker::Triangle];

/// A line's dash pattern.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
enum Dash {
    Solid,
    Dashed,
    Dotted,
}

const DASHES: [Dash; 3] = [Dash::Solid, Dash::Dashed, Dash::Dotted];

impl Dash {
    /// Dash and gap lengths in pixels (`None`: a solid line).
    fn lengths_px(self) -> Option<(i32, i32)> {
        match self {
            Dash::Solid => None,
            Dash::Dashed => Some((10, 6)),
            Dash::Dotted => Some((3, 5)),
        }
    }
}

/// How a series is drawn.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
struct Look {
    colour: usize,
    marker: Marker,
    dash: Dash,
}

/// Series `index`'s look. The colour cycles through the palette; the marker cycles with a
/// period (3) prime to the palette's (10), so series of one colour have different markers;
/// the dash changes with each round of the palette, so they have different lines too.
fn look(index: usize) -> Look {
    Look {
        colour: index % COLOURS.len(),
        marker: MARKERS[index % MARKERS.len()],
        dash: DASHES[(index / COLOURS.len()) % DASHES.len()],
    }
}

/// Writes `<dir>/<id>.svg` and `<dir>/<id>.png`; returns their paths.
pub fn draw(figure: &Figure, dir: &Path) -> Result<[PathBuf; 2], String> {
    if figure.series.len() > DISTINCT_SERIES {
        return Err(format!(
            "{}: {} series in one panel; at most {DISTINCT_SERIES} can be told apart",
            figure.id,
            figure.series.len()
        ));
    }
    std::fs::create_dir_all(dir).map_err(|e| format!("{}: {e}", dir.display()))?;
    let svg = dir.join(format!("{}.svg", figure.id));
    let png = dir.join(format!("{}.png", figure.id));
    // Both backends lay text out with the registered font.
    crate::harness::plot::load_font()?;
    let size = canvas_px(figure)?;
    let covered = |path: &Path, drawn: Drawn| match drawn.covered_point() {
        None => Ok(()),
        Some(point) => Err(format!("{}: the legend covers the point at {point:?}", path.display())),
    };
    let drawn = draw_on(SVGBackend::new(&svg, size).into_drawing_area(), figure)
        .map_err(|e| format!("{}: {e}", svg.display()))?;
    covered(&svg, drawn)?;
    let drawn = draw_on(BitMapBackend::new(&png, size).into_drawing_area(), figure)
        .map_err(|e| format!("{}: {e}", png.display()))?;
    covered(&png, drawn)?;
    Ok([svg, png])
}

/// The legend's width and height in pixels: the widest name, its sample, the padding.
fn legend_px(figure: &Figure) -> Result<(u32, u32), String> {
    // The names are measured with the font they are drawn with, which may not be loaded yet.
    crate::harness::plot::load_font()?;
    let font = ("sans-serif", LEGEND_FONT_PX).into_font();
    let mut widest = 0;
    for series in &figure.series {
        let (width, _) =
            font.box_size(&series.name).map_err(|e| format!("{}: {e}", series.name))?;
        widest = widest.max(width);
    }
    // The SVG is laid out by the viewer's own sans-serif font, which may run a little wider.
    let text = widest + widest / 8;
    let width = 3 * PAD_PX as u32 + SAMPLE_PX as u32 + text;
    let height = 2 * PAD_PX as u32 + ROW_PX as u32 * figure.series.len() as u32;
    Ok((width, height))
}

/// The canvas: the chart, and the legend's column to its right.
fn canvas_px(figure: &Figure) -> Result<(u32, u32), String> {
    let (width, height) = legend_px(figure)?;
    let title_px = 40;
    Ok((
        CHART_PX.0 + width + MARGIN_PX as u32,
        CHART_PX.1.max(title_px + height + 2 * MARGIN_PX as u32),
    ))
}

/// The y value as drawn.
fn drawn(y: f64, log: bool) -> f64 {
    if log { y.max(1e-12).log10() } else { y }
}

/// The range of y drawn: from 0 (or a decade below the smallest value on a log axis) to a
/// little above the largest.
fn y_range(figure: &Figure) -> (f64, f64) {
    let values = figure.series.iter().flat_map(|s| s.points.iter().flatten());
    let (lo, hi) = values.fold((f64::INFINITY, f64::NEG_INFINITY), |(lo, hi), p: &Point| {
        (lo.min(p.min.min(p.median)), hi.max(p.max.max(p.median)))
    });
    if !lo.is_finite() {
        return (0.0, 1.0);
    }
    if figure.y_log {
        (drawn(lo, true).floor(), drawn(hi, true).ceil().max(drawn(lo, true).floor() + 1.0))
    } else {
        (0.0, if hi > 0.0 { hi * 1.3 } else { 1.0 })
    }
}

/// Where a drawing put its legend and its points, in the canvas' pixels.
struct Drawn {
    /// The legend's box: left, top, right, bottom.
    legend: (i32, i32, i32, i32),
    /// The centre of every median drawn (a marker, or the middle of a bar's top).
    points: Vec<(i32, i32)>,
}

impl Drawn {
    /// A point whose marker the legend's box would touch, if any.
    fn covered_point(&self) -> Option<(i32, i32)> {
        let (left, top, right, bottom) = self.legend;
        self.points.iter().copied().find(|&(x, y)| {
            x + MARKER_PX >= left
                && x - MARKER_PX <= right
                && y + MARKER_PX >= top
                && y - MARKER_PX <= bottom
        })
    }
}

/// Draws marker `marker` centred on pixel `centre` of `area`, hollow unless `filled`.
fn draw_marker<DB: DrawingBackend>(
    area: &DrawingArea<DB, Shift>,
    (x, y): (i32, i32),
    marker: Marker,
    colour: RGBColor,
    filled: bool,
) -> Result<(), DrawingAreaErrorKind<DB::ErrorType>> {
    let r = MARKER_PX;
    let style = if filled { colour.filled() } else { colour.stroke_width(2) };
    match marker {
        Marker::Circle => area.draw(&Circle::new((x, y), r, style)),
        Marker::Square => area.draw(&Rectangle::new([(x - r, y - r), (x + r, y + r)], style)),
        Marker::Triangle => {
            let corners = [(x, y - r - 1), (x + r + 1, y + r), (x - r - 1, y + r)];
            if filled {
                area.draw(&Polygon::new(corners.to_vec(), style))
            } else {
                area.draw(&PathElement::new([&corners[..], &corners[..1]].concat(), style))
            }
        }
    }
}

fn draw_on<DB: DrawingBackend>(
    root: DrawingArea<DB, Shift>,
    figure: &Figure,
) -> Result<Drawn, DrawingAreaErrorKind<DB::ErrorType>> {
    root.fill(&WHITE)?;
    let body = root.titled(&format!("{}: {}", figure.id, figure.title), ("sans-serif", 18))?;
    let (chart_area, legend_area) = body.split_horizontally(CHART_PX.0);
    let positions = figure.x_ticks.len().max(1);
    let (y_lo, y_hi) = y_range(figure);
    let log = figure.y_log;
    let mut chart = ChartBuilder::on(&chart_area)
        .margin(MARGIN_PX)
        .x_label_area_size(48)
        .y_label_area_size(72)
        .build_cartesian_2d(-0.5f64..positions as f64 - 0.5, y_lo..y_hi)?;
    let ticks = figure.x_ticks.clone();
    // At most about a dozen labels under the axis: a long time series labels every n-th point.
    let label_every = positions.div_ceil(12);
    chart
        .configure_mesh()
        .disable_x_mesh()
        .x_labels(positions + 1)
        .x_label_formatter(&move |x: &f64| {
            let i = x.round();
            if (x - i).abs() < 0.01 && i >= 0.0 && (i as usize).is_multiple_of(label_every) {
                ticks.get(i as usize).cloned().unwrap_or_default()
            } else {
                String::new()
            }
        })
        .y_label_formatter(&move |y: &f64| number(if log { 10f64.powf(*y) } else { *y }))
        .x_desc(figure.x_label.as_str())
        .y_desc(figure.y_label.as_str())
        .label_style(("sans-serif", 14))
        .draw()?;
    let count = figure.series.len().max(1);
    let mut centres = vec![];
    for (index, series) in figure.series.iter().enumerate() {
        let look = look(index);
        let colour = COLOURS[look.colour];
        let points: Vec<(f64, Point)> = series
            .points
            .iter()
            .enumerate()
            .filter_map(|(x, p)| p.map(|p| (x as f64, p)))
            .collect();
        if figure.bars {
            let width = 0.8 / count as f64;
            let left = |x: f64| x - 0.4 + width * index as f64;
            chart.draw_series(points.iter().map(|&(x, p)| {
                Rectangle::new(
                    [(left(x), y_lo), (left(x) + width * 0.9, drawn(p.median, log))],
                    colour.filled(),
                )
            }))?;
            chart.draw_series(points.iter().map(|&(x, p)| {
                let middle = left(x) + width * 0.45;
                PathElement::new(
                    vec![(middle, drawn(p.min, log)), (middle, drawn(p.max, log))],
                    BLACK.stroke_width(1),
                )
            }))?;
            centres.extend(points.iter().map(|&(x, p)| {
                chart.backend_coord(&(left(x) + width * 0.45, drawn(p.median, log)))
            }));
            continue;
        }
        let line = points.iter().map(|&(x, p)| (x, drawn(p.median, log)));
        match look.dash.lengths_px() {
            None => chart.draw_series(LineSeries::new(line, colour.stroke_width(2)))?,
            Some((dash, gap)) => {
                chart.draw_series(DashedLineSeries::new(line, dash, gap, colour.stroke_width(2)))?
            }
        };
        chart.draw_series(points.iter().map(|&(x, p)| {
            PathElement::new(
                vec![(x, drawn(p.min, log)), (x, drawn(p.max, log))],
                colour.stroke_width(1),
            )
        }))?;
        for &(x, p) in &points {
            let centre = chart.backend_coord(&(x, drawn(p.median, log)));
            draw_marker(&root, centre, look.marker, colour, !p.oversubscribed)?;
            centres.push(centre);
        }
    }
    let legend = draw_legend(&legend_area, figure)?;
    root.present()?;
    Ok(Drawn { legend, points: centres })
}

/// Draws the legend at the top of `area`, a sample and a name per series; returns its box in
/// the canvas' pixels.
fn draw_legend<DB: DrawingBackend>(
    area: &DrawingArea<DB, Shift>,
    figure: &Figure,
) -> Result<(i32, i32, i32, i32), DrawingAreaErrorKind<DB::ErrorType>> {
    let (width, _) = area.dim_in_pixel();
    let right = width as i32 - MARGIN_PX;
    let (top, bottom) = (MARGIN_PX, MARGIN_PX + 2 * PAD_PX + ROW_PX * figure.series.len() as i32);
    area.draw(&Rectangle::new([(0, top), (right, bottom)], WHITE.filled()))?;
    area.draw(&Rectangle::new([(0, top), (right, bottom)], BLACK.stroke_width(1)))?;
    let text = TextStyle::from(("sans-serif", LEGEND_FONT_PX).into_font())
        .pos(Pos::new(HPos::Left, VPos::Center));
    for (index, series) in figure.series.iter().enumerate() {
        let look = look(index);
        let colour = COLOURS[look.colour];
        let y = top + PAD_PX + ROW_PX * index as i32 + ROW_PX / 2;
        let (start, end) = (PAD_PX, PAD_PX + SAMPLE_PX);
        if figure.bars {
            area.draw(&Rectangle::new([(start + 8, y - 6), (end - 8, y + 6)], colour.filled()))?;
        } else {
            let sample = [(start, y), (end, y)];
            match look.dash.lengths_px() {
                None => area.draw(&PathElement::new(sample.to_vec(), colour.stroke_width(2)))?,
                Some((dash, gap)) => {
                    area.draw(&DashedPathElement::new(sample, dash, gap, colour.stroke_width(2)))?
                }
            }
            draw_marker(area, ((start + end) / 2, y), look.marker, colour, true)?;
        }
        area.draw_text(&series.name, &text, (end + PAD_PX, y))?;
    }
    let (x0, y0) = area.get_base_pixel();
    Ok((x0, y0 + top, x0 + right, y0 + bottom))
}

#[cfg(test)]
mod tests {
    use std::collections::HashSet;

    use super::super::figure::Series;
    use super::*;

    /// A figure of `count` series over five positions, the last series highest at the right
    /// (where a legend in the plotting area's upper right corner would stand).
    fn crowded(count: usize, bars: bool) -> Figure {
        let point = |median: f64| {
            Some(Point { median, min: median * 0.95, max: median * 1.05, oversubscribed: false })
        };
        Figure {
            id: "000-test".into(),
            title: "a crowded panel".into(),
            x_label: "threads".into(),
            x_ticks: ["1", "2", "4", "8", "16"].map(String::from).to_vec(),
            y_label: "GB/s".into(),
            bars,
            series: (0..count)
                .map(|s| Series {
                    name: format!("series {s} with a long name (ublk, poll)"),
                    points: (0..5).map(|x| point(1.0 + s as f64 + x as f64 * s as f64)).collect(),
                })
                .collect(),
            ..Figure::default()
        }
    }

    /// Draws `figure` into an RGB buffer: the buffer, its width and where things went.
    fn render(figure: &Figure) -> (Vec<u8>, u32, Drawn) {
        crate::harness::plot::load_font().expect("font");
        let (width, height) = canvas_px(figure).expect("canvas");
        let mut pixels = vec![0u8; (width * height * 3) as usize];
        let drawn = draw_on(
            BitMapBackend::with_buffer(&mut pixels, (width, height)).into_drawing_area(),
            figure,
        )
        .expect("drawn");
        (pixels, width, drawn)
    }

    #[test]
    fn the_legend_covers_no_point_and_every_marker_keeps_its_colour() {
        for bars in [false, true] {
            let figure = crowded(16, bars);
            let (pixels, width, drawn) = render(&figure);
            assert_eq!(drawn.points.len(), 16 * 5, "bars {bars}: a centre per point");
            assert_eq!(drawn.covered_point(), None, "bars {bars}: legend {:?}", drawn.legend);
            if bars {
                continue;
            }
            // The last series is drawn last: its markers show its own colour unless something
            // (the legend) was drawn over them.
            let colour = COLOURS[look(15).colour];
            for &(x, y) in &drawn.points[15 * 5..] {
                let at = ((y as u32 * width + x as u32) * 3) as usize;
                let rgb = &pixels[at..at + 3];
                let near = [colour.0, colour.1, colour.2]
                    .iter()
                    .zip(rgb)
                    .all(|(want, got)| want.abs_diff(*got) <= 16);
                assert!(near, "the marker at ({x}, {y}) is {rgb:?}, not {colour:?}");
            }
        }
    }

    #[test]
    fn the_legend_fits_the_canvas_beside_the_chart() {
        let figure = crowded(19, false);
        let (width, height) = canvas_px(&figure).expect("canvas");
        let (_, _, drawn) = render(&figure);
        let (left, top, right, bottom) = drawn.legend;
        assert!(left >= CHART_PX.0 as i32, "the legend starts right of the chart: {left}");
        assert!(
            right < width as i32 && bottom < height as i32,
            "{:?} in {width}×{height}",
            drawn.legend
        );
        assert!(bottom - top >= ROW_PX * 19, "a row per series: {:?}", drawn.legend);
        let longest = ("sans-serif", LEGEND_FONT_PX)
            .into_font()
            .box_size(&figure.series[0].name)
            .expect("text size")
            .0 as i32;
        assert!(right - left >= SAMPLE_PX + longest, "the longest name fits: {:?}", drawn.legend);
    }

    #[test]
    fn series_differ_in_colour_and_marker_and_in_colour_and_dash() {
        let looks: Vec<Look> = (0..DISTINCT_SERIES).map(look).collect();
        let marked: HashSet<(usize, Marker)> = looks.iter().map(|l| (l.colour, l.marker)).collect();
        let dashed: HashSet<(usize, Dash)> = looks.iter().map(|l| (l.colour, l.dash)).collect();
        assert_eq!(marked.len(), DISTINCT_SERIES);
        assert_eq!(dashed.len(), DISTINCT_SERIES);
        let colours: HashSet<usize> = looks[..COLOURS.len()].iter().map(|l| l.colour).collect();
        assert_eq!(colours.len(), COLOURS.len(), "the first ten series have ten colours");
    }

    #[test]
    fn every_recorded_figure_has_few_enough_series_to_be_told_apart() {
        let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../docs/papers");
        let figures = super::super::report::read_figures(&dir).expect("docs/papers");
        assert!(!figures.is_empty(), "{} holds the recorded figures", dir.display());
        for figure in &figures {
            let count = figure.series.len();
            assert!(count <= DISTINCT_SERIES, "{}: {count} series", figure.id);
        }
    }

    #[test]
    fn the_palette_colours_are_far_apart() {
        for (i, a) in COLOURS.iter().enumerate() {
            for b in &COLOURS[i + 1..] {
                let distance: u32 = [(a.0, b.0), (a.1, b.1), (a.2, b.2)]
                    .iter()
                    .map(|&(x, y)| u32::from(x.abs_diff(y)))
                    .sum();
                assert!(distance >= 90, "{a:?} and {b:?} are {distance} apart");
            }
        }
    }
}
