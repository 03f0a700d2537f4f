//! SVG plots on plotters: a white canvas, panels with a caption and axes, lines with a legend.

use std::ops::Range;
use std::path::Path;
use std::sync::OnceLock;

use plotters::coord::Shift;
use plotters::coord::types::RangedCoordf64;
use plotters::prelude::*;
use plotters::style::register_font;

/// A canvas, or a part of one.
pub(crate) type Area<'b> = DrawingArea<SVGBackend<'b>, Shift>;

/// A panel with linear axes.
pub(crate) type Chart<'a, 'b> =
    ChartContext<'a, SVGBackend<'b>, Cartesian2d<RangedCoordf64, RangedCoordf64>>;

/// A plotters error as text.
pub(crate) fn plot_error(e: impl std::fmt::Display) -> String {
    e.to_string()
}

/// Where the font text is laid out with may be (Debian's fonts-dejavu-core), first found wins.
const FONT_PATHS: [&str; 3] = [
    "/usr/share/fonts/truetype/dejavu/DejaVuSans.ttf",
    "/usr/share/fonts/dejavu/DejaVuSans.ttf",
    "/usr/share/fonts/TTF/DejaVuSans.ttf",
];

/// Makes the font plotters lays text out with known as `sans-serif` (plotters reads no system
/// fonts itself), once per process.
pub(crate) fn load_font() -> Result<(), String> {
    static LOADED: OnceLock<Result<(), String>> = OnceLock::new();
    let load = || {
        let Some(path) = FONT_PATHS.into_iter().find(|p| Path::new(p).exists()) else {
            let looked = FONT_PATHS.join(", ");
            return Err(format!(
                "no font for the plot's text ({looked}): install fonts-dejavu-core"
            ));
        };
        let font = std::fs::read(path).map_err(|e| format!("{path}: {e}"))?.leak();
        register_font("sans-serif", FontStyle::Normal, font)
            .map_err(|_| format!("{path}: plotters cannot read this font"))
    };
    LOADED.get_or_init(load).clone()
}

/// A white SVG canvas of `size` pixels, written to `path` when presented.
pub(crate) fn canvas(path: &Path, size: (u32, u32)) -> Result<Area<'_>, String> {
    load_font()?;
    let root = SVGBackend::new(path, size).into_drawing_area();
    root.fill(&WHITE).map_err(plot_error)?;
    Ok(root)
}

/// How a panel is laid out.
pub(crate) struct Layout {
    /// The caption's font size.
    pub(crate) font: u32,
    /// The margin around the panel, pixels.
    pub(crate) margin: u32,
    /// The height of the x axis' labels, pixels.
    pub(crate) x_labels: u32,
}

/// A panel on `area`: `caption` above linear axes over `x` and `y` (the y axis' labels 70
/// pixels wide).
pub(crate) fn panel<'a, 'b>(
    area: &'a Area<'b>,
    caption: impl AsRef<str>,
    layout: &Layout,
    x: Range<f64>,
    y: Range<f64>,
) -> Result<Chart<'a, 'b>, String> {
    ChartBuilder::on(area)
        .caption(caption.as_ref(), ("sans-serif", layout.font))
        .margin(layout.margin)
        .x_label_area_size(layout.x_labels)
        .y_label_area_size(70)
        .build_cartesian_2d(x, y)
        .map_err(plot_error)
}

/// An axis label for whole numbers only (counts: jobs, writers).
pub(crate) fn whole_numbers(x: &f64) -> String {
    if (x - x.round()).abs() < 1e-6 { format!("{x:.0}") } else { String::new() }
}

/// An axis label in thousands (`12K`).
pub(crate) fn thousands(y: &f64) -> String {
    format!("{:.0}K", y / 1000.0)
}

/// A line through `points` in `style`, with `label` in the legend.
pub(crate) fn line(
    chart: &mut Chart<'_, '_>,
    points: Vec<(f64, f64)>,
    style: ShapeStyle,
    label: impl Into<String>,
) -> Result<(), String> {
    chart
        .draw_series(LineSeries::new(points, style))
        .map_err(plot_error)?
        .label(label)
        .legend(move |(x, y)| PathElement::new(vec![(x, y), (x + 20, y)], style));
    Ok(())
}

/// A dot of radius 4 at each of `points`.
pub(crate) fn dots(
    chart: &mut Chart<'_, '_>,
    points: &[(f64, f64)],
    style: ShapeStyle,
) -> Result<(), String> {
    chart.draw_series(points.iter().map(|&p| Circle::new(p, 4, style))).map_err(plot_error)?;
    Ok(())
}

/// The legend at `position`, on a translucent white box with a black border; `font` sets the
/// labels' size.
pub(crate) fn legend<'a, 'b: 'a>(
    chart: &mut Chart<'a, 'b>,
    position: SeriesLabelPosition,
    font: Option<u32>,
) -> Result<(), String> {
    let mut labels = chart.configure_series_labels();
    labels.background_style(WHITE.mix(0.8)).border_style(BLACK).position(position);
    if let Some(size) = font {
        labels.label_font(("sans-serif", size));
    }
    labels.draw().map_err(plot_error)
}
