//! Draws a [`Figure`] on the paper's axes, as SVG and PNG (plotters).
//!
//! The x axis holds the figure's positions in order (threads, request sizes, read shares,
//! devices), evenly spaced as the papers draw them. Lines carry min–max bars; a point measured
//! with more threads than CPUs is drawn hollow. A log y axis is drawn as the log10 of the values
//! with the ticks labelled in the values' own units.

use std::path::{Path, PathBuf};

use plotters::coord::Shift;
use plotters::prelude::*;

use super::figure::{Figure, Point, number};

const SIZE_PX: (u32, u32) = (960, 600);

/// Writes `<dir>/<id>.svg` and `<dir>/<id>.png`; returns their paths.
pub fn draw(figure: &Figure, dir: &Path) -> Result<[PathBuf; 2], String> {
    std::fs::create_dir_all(dir).map_err(|e| format!("{}: {e}", dir.display()))?;
    let svg = dir.join(format!("{}.svg", figure.id));
    let png = dir.join(format!("{}.png", figure.id));
    // Both backends lay text out with the registered font.
    crate::harness::plot::load_font()?;
    draw_on(SVGBackend::new(&svg, SIZE_PX).into_drawing_area(), figure)
        .map_err(|e| format!("{}: {e}", svg.display()))?;
    draw_on(BitMapBackend::new(&png, SIZE_PX).into_drawing_area(), figure)
        .map_err(|e| format!("{}: {e}", png.display()))?;
    Ok([svg, png])
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

fn draw_on<DB: DrawingBackend>(
    root: DrawingArea<DB, Shift>,
    figure: &Figure,
) -> Result<(), DrawingAreaErrorKind<DB::ErrorType>> {
    root.fill(&WHITE)?;
    let positions = figure.x_ticks.len().max(1);
    let (y_lo, y_hi) = y_range(figure);
    let log = figure.y_log;
    let mut chart = ChartBuilder::on(&root)
        .caption(format!("{}: {}", figure.id, figure.title), ("sans-serif", 18))
        .margin(12)
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
    for (index, series) in figure.series.iter().enumerate() {
        let color = Palette99::pick(index).to_rgba();
        let points: Vec<(f64, Point)> = series
            .points
            .iter()
            .enumerate()
            .filter_map(|(x, p)| p.map(|p| (x as f64, p)))
            .collect();
        if figure.bars {
            let width = 0.8 / count as f64;
            let left = |x: f64| x - 0.4 + width * index as f64;
            chart
                .draw_series(points.iter().map(|&(x, p)| {
                    Rectangle::new(
                        [(left(x), y_lo), (left(x) + width * 0.9, drawn(p.median, log))],
                        color.filled(),
                    )
                }))?
                .label(series.name.as_str())
                .legend(move |(x, y)| {
                    Rectangle::new([(x, y - 5), (x + 12, y + 5)], color.filled())
                });
            chart.draw_series(points.iter().map(|&(x, p)| {
                let middle = left(x) + width * 0.45;
                PathElement::new(
                    vec![(middle, drawn(p.min, log)), (middle, drawn(p.max, log))],
                    BLACK.stroke_width(1),
                )
            }))?;
            continue;
        }
        chart
            .draw_series(LineSeries::new(
                points.iter().map(|&(x, p)| (x, drawn(p.median, log))),
                color.stroke_width(2),
            ))?
            .label(series.name.as_str())
            .legend(move |(x, y)| {
                PathElement::new(vec![(x, y), (x + 18, y)], color.stroke_width(2))
            });
        chart.draw_series(points.iter().map(|&(x, p)| {
            PathElement::new(
                vec![(x, drawn(p.min, log)), (x, drawn(p.max, log))],
                color.stroke_width(1),
            )
        }))?;
        chart.draw_series(points.iter().map(|&(x, p)| {
            let style = if p.oversubscribed { color.stroke_width(2) } else { color.filled() };
            Circle::new((x, drawn(p.median, log)), 4, style)
        }))?;
    }
    chart
        .configure_series_labels()
        .background_style(WHITE.mix(0.85))
        .border_style(BLACK)
        .label_font(("sans-serif", 14))
        .position(SeriesLabelPosition::UpperRight)
        .draw()?;
    root.present()?;
    Ok(())
}
