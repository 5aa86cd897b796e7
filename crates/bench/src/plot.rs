//! `--plot PATH`: a PNG of the results for docs/benchmarks.md. Throughput and p99
//! latency against concurrency, one line per system and batch size, log scales; the
//! meta rows (ops/s) get a second row of panels.
//!
//! Text is drawn with plotters' `ab_glyph` backend from a TrueType font read at run time
//! (no fontconfig or system freetype): DejaVu Sans from Debian's fonts-dejavu-core, or
//! the file named by `MESHD_BENCH_FONT`.

use crate::report::{Report, Row};
use anyhow::{anyhow, Context, Result};
use plotters::coord::Shift;
use plotters::prelude::*;
use plotters::style::text_anchor::{HPos, Pos, VPos};
use std::path::{Path, PathBuf};
use std::sync::OnceLock;

/// The font used when `MESHD_BENCH_FONT` is not set.
pub const DEFAULT_FONT: &str = "/usr/share/fonts/truetype/dejavu/DejaVuSans.ttf";
/// Environment variable naming a .ttf/.otf file to draw text with instead.
pub const FONT_ENV: &str = "MESHD_BENCH_FONT";

const FAMILY: &str = "sans-serif";
const WIDTH: u32 = 1600;
const TITLE_HEIGHT: u32 = 56;
const SECTION_HEIGHT: u32 = 600;

/// Distinct colours (Okabe-Ito, then a few more), one per system; the batch size is
/// told apart by the marker and the dashes.
const COLORS: [RGBColor; 10] = [
    RGBColor(0, 114, 178),   // blue
    RGBColor(213, 94, 0),    // vermillion
    RGBColor(0, 158, 115),   // bluish green
    RGBColor(204, 121, 167), // reddish purple
    RGBColor(230, 159, 0),   // orange
    RGBColor(86, 180, 233),  // sky blue
    RGBColor(0, 0, 0),       // black
    RGBColor(140, 86, 75),   // brown
    RGBColor(127, 127, 127), // grey
    RGBColor(188, 189, 34),  // olive
];

/// The font file to use: `MESHD_BENCH_FONT` if set, else DejaVu Sans.
pub fn font_path() -> PathBuf {
    std::env::var_os(FONT_ENV)
        .filter(|v| !v.is_empty())
        .map(PathBuf::from)
        .unwrap_or_else(|| PathBuf::from(DEFAULT_FONT))
}

/// Reads a font file, with an error that says what to install when it is missing.
fn read_font(path: &Path) -> Result<Vec<u8>> {
    std::fs::read(path).with_context(|| {
        format!(
            "meshd-bench --plot: cannot read the font {}; install Debian's fonts-dejavu-core \
             (apt-get install fonts-dejavu-core) or set {FONT_ENV} to a .ttf file",
            path.display()
        )
    })
}

/// Registers the font with plotters, once per process. Call it before a long benchmark
/// run so a missing font fails early rather than after the measurements.
pub fn ensure_font() -> Result<()> {
    static REGISTERED: OnceLock<()> = OnceLock::new();
    if REGISTERED.get().is_some() {
        return Ok(());
    }
    let path = font_path();
    let bytes = read_font(&path)?;
    // plotters 0.3.7 keeps fonts as &'static [u8]; this happens once per process.
    let bytes: &'static [u8] = Box::leak(bytes.into_boxed_slice());
    plotters::style::register_font(FAMILY, FontStyle::Normal, bytes).map_err(|_| {
        anyhow!(
            "meshd-bench --plot: {} is not a TrueType/OpenType font; install Debian's \
             fonts-dejavu-core or set {FONT_ENV} to a .ttf file",
            path.display()
        )
    })?;
    let _ = REGISTERED.set(());
    Ok(())
}

/// One line: a system at one batch size, points sorted by concurrency.
struct Series {
    label: String,
    /// The system's colour.
    color: RGBColor,
    /// Index of the batch size among the group's batch sizes: marker shape and dashes.
    style: usize,
    /// (concurrency, throughput per second, p99 ms).
    points: Vec<(f64, f64, f64)>,
}

/// The rows of one group (events or meta), ready to draw.
struct Group {
    unit: &'static str,
    heading: String,
    concurrencies: Vec<f64>,
    series: Vec<Series>,
}

fn group(rows: &[&Row], unit: &'static str, heading: String) -> Group {
    let mut concurrencies: Vec<usize> = rows.iter().map(|r| r.concurrency).collect();
    concurrencies.sort_unstable();
    concurrencies.dedup();
    let mut batches: Vec<usize> = rows.iter().map(|r| r.batch).collect();
    batches.sort_unstable();
    batches.dedup();
    // Systems in the order they ran, then batch sizes ascending.
    let mut systems: Vec<&str> = Vec::new();
    for r in rows {
        if !systems.contains(&r.system) {
            systems.push(r.system);
        }
    }
    let mut series = Vec::new();
    for (si, system) in systems.iter().enumerate() {
        for (bi, &batch) in batches.iter().enumerate() {
            let mut points: Vec<(f64, f64, f64)> = rows
                .iter()
                .filter(|r| r.system == *system && r.batch == batch)
                .map(|r| (r.concurrency as f64, r.events_per_sec, r.p99_us / 1000.0))
                .collect();
            if points.is_empty() {
                continue;
            }
            points.sort_by(|a, b| a.0.total_cmp(&b.0));
            series.push(Series {
                label: format!("{system} batch {batch}"),
                color: COLORS[si % COLORS.len()],
                style: bi,
                points,
            });
        }
    }
    Group {
        unit,
        heading,
        concurrencies: concurrencies.iter().map(|&c| c as f64).collect(),
        series,
    }
}

/// Writes the plot of `report` to `path` as a PNG.
pub fn write_png(report: &Report, path: &Path) -> Result<()> {
    ensure_font()?;
    let m = &report.meta;
    let (meta_rows, rows): (Vec<&Row>, Vec<&Row>) =
        report.rows.iter().partition(|r| r.scenario == "meta");
    let mut groups = Vec::new();
    if !rows.is_empty() {
        groups.push(group(
            &rows,
            "events/s",
            format!(
                "events: {} B data per event, {} meshd topic partition(s)",
                m.data_bytes, m.partitions
            ),
        ));
    }
    if !meta_rows.is_empty() {
        groups.push(group(
            &meta_rows,
            "ops/s",
            format!(
                "meta: {} B values, one transaction per op (batch 1)",
                m.meta_value_bytes
            ),
        ));
    }
    let title = if rows.is_empty() {
        format!(
            "meshd-bench {}: {} B values, {} CPU(s), median of {} run(s) of {} s",
            m.scenario, m.meta_value_bytes, m.cpus, m.repeat, m.seconds
        )
    } else {
        format!(
            "meshd-bench {}: {} B events, {} CPU(s), median of {} run(s) of {} s",
            m.scenario, m.event_bytes, m.cpus, m.repeat, m.seconds
        )
    };
    let sections = groups.len().max(1) as u32;
    let height = TITLE_HEIGHT + SECTION_HEIGHT * sections;
    let root = BitMapBackend::new(path, (WIDTH, height)).into_drawing_area();
    let err = |e: &dyn std::fmt::Display| anyhow!("drawing {}: {e}", path.display());
    root.fill(&WHITE).map_err(|e| err(&e))?;
    let root = root
        .margin(10, 0, 0, 0)
        .titled(&title, (FAMILY, 30).into_font().color(&BLACK))
        .map_err(|e| err(&e))?;
    if groups.is_empty() {
        root.draw(&Text::new(
            "no results",
            (20, 20),
            (FAMILY, 24).into_font().color(&BLACK),
        ))
        .map_err(|e| err(&e))?;
    }
    let areas = root.split_evenly((groups.len().max(1), 1));
    for (g, area) in groups.iter().zip(areas.iter()) {
        draw_group(g, area).map_err(|e| err(&e))?;
    }
    root.present()
        .with_context(|| format!("writing {}", path.display()))?;
    Ok(())
}

/// Draws a marker with `$draw` (given the element as `$m`): filled circle, triangle,
/// square, cross, then hollow circle, by batch index. A macro, not a function returning
/// a `DynElement`, since that would need a `'static` backend.
macro_rules! with_marker {
    ($style:expr, $at:expr, $color:expr, |$m:ident| $draw:expr) => {{
        let (at, color) = ($at, $color);
        match $style % 5 {
            0 => {
                let $m = Circle::new(at, 6, color.filled());
                $draw
            }
            1 => {
                let $m = TriangleMarker::new(at, 8, color.filled());
                $draw
            }
            2 => {
                let $m = EmptyElement::at(at) + Rectangle::new([(-5, -5), (5, 5)], color.filled());
                $draw
            }
            3 => {
                let $m = Cross::new(at, 6, color.stroke_width(3));
                $draw
            }
            _ => {
                let $m = Circle::new(at, 6, color.stroke_width(2));
                $draw
            }
        }
    }};
}

type DrawResult<T> = std::result::Result<T, Box<dyn std::error::Error>>;

fn draw_group<DB: DrawingBackend>(g: &Group, area: &DrawingArea<DB, Shift>) -> DrawResult<()>
where
    DB::ErrorType: 'static,
{
    let heading = (FAMILY, 22).into_font().color(&BLACK);
    let area = area.titled(&g.heading, heading)?;
    // The legend gets its own strip under the panels, so it never covers data.
    let legend_font = (FAMILY, 18).into_font().color(&BLACK);
    let (w, h) = area.dim_in_pixel();
    let entries: Vec<(u32, &Series)> = g
        .series
        .iter()
        .map(|s| {
            let (tw, _) = area.estimate_text_size(&s.label, &legend_font)?;
            Ok((48 + tw + 28, s))
        })
        .collect::<DrawResult<_>>()?;
    let mut lines: Vec<Vec<(u32, &Series)>> = vec![Vec::new()];
    let mut line_w = 0;
    for e in entries {
        if line_w + e.0 > w.saturating_sub(40) && !lines[lines.len() - 1].is_empty() {
            lines.push(Vec::new());
            line_w = 0;
        }
        line_w += e.0;
        if let Some(l) = lines.last_mut() {
            l.push(e);
        }
    }
    let line_h = 28;
    let legend_h = 12 + line_h * lines.len() as u32;
    let (panels, legend) = area.split_vertically(h.saturating_sub(legend_h));
    for (i, line) in lines.iter().enumerate() {
        let total: u32 = line.iter().map(|e| e.0).sum();
        let mut x = (w.saturating_sub(total) / 2) as i32;
        let y = (6 + line_h / 2 + line_h * i as u32) as i32;
        for &(ew, s) in line {
            let style = s.color.stroke_width(3);
            if s.style == 0 {
                legend.draw(&PathElement::new(vec![(x, y), (x + 40, y)], style))?;
            } else {
                legend.draw(&PathElement::new(vec![(x, y), (x + 12, y)], style))?;
                legend.draw(&PathElement::new(vec![(x + 28, y), (x + 40, y)], style))?;
            }
            with_marker!(s.style, (x + 20, y), s.color, |m| legend.draw(&m))?;
            legend.draw(&Text::new(
                s.label.clone(),
                (x + 48, y),
                legend_font.pos(Pos::new(HPos::Left, VPos::Center)),
            ))?;
            x += ew as i32;
        }
    }
    let (left, right) = panels.split_horizontally(w / 2);
    panel(
        &left,
        g,
        &format!("throughput ({}, log scale)", g.unit),
        g.unit,
        |p| p.1,
    )?;
    panel(
        &right,
        g,
        "p99 latency (ms, log scale)",
        "p99 latency (ms)",
        |p| p.2,
    )?;
    Ok(())
}

fn panel<DB: DrawingBackend>(
    area: &DrawingArea<DB, Shift>,
    g: &Group,
    caption: &str,
    y_desc: &str,
    value: fn(&(f64, f64, f64)) -> f64,
) -> DrawResult<()>
where
    DB::ErrorType: 'static,
{
    let ys: Vec<f64> = g
        .series
        .iter()
        .flat_map(|s| s.points.iter().map(value))
        .filter(|v| v.is_finite() && *v > 0.0)
        .collect();
    let caption_font = (FAMILY, 22).into_font().color(&BLACK);
    if ys.is_empty() || g.concurrencies.is_empty() {
        area.titled(caption, caption_font)?.draw(&Text::new(
            "no data",
            (20, 20),
            (FAMILY, 20).into_font().color(&BLACK),
        ))?;
        return Ok(());
    }
    let (y_lo, y_hi, y_ticks) = log_axis(
        ys.iter().copied().fold(f64::INFINITY, f64::min),
        ys.iter().copied().fold(0.0, f64::max),
    );
    let c_lo = g.concurrencies[0];
    let c_hi = g.concurrencies[g.concurrencies.len() - 1];
    // Some room either side so the markers at the ends are not cut by the axes.
    let x_range = (c_lo / 1.5)..(c_hi * 1.5);
    let mut chart = ChartBuilder::on(area)
        .caption(caption, caption_font)
        .margin(16)
        .margin_right(28)
        .x_label_area_size(56)
        .y_label_area_size(84)
        .build_cartesian_2d(
            x_range.log_scale().with_key_points(g.concurrencies.clone()),
            (y_lo..y_hi).log_scale().with_key_points(y_ticks),
        )?;
    let label_font = (FAMILY, 17).into_font().color(&BLACK);
    let desc_font = (FAMILY, 18).into_font().color(&BLACK);
    chart
        .configure_mesh()
        .x_desc("concurrency (requests in flight)")
        .y_desc(y_desc)
        .x_label_formatter(&|c| format!("{c}"))
        .y_label_formatter(&|v| short(*v))
        .label_style(label_font)
        .axis_desc_style(desc_font)
        .bold_line_style(RGBColor(200, 200, 200).stroke_width(1))
        .light_line_style(WHITE)
        .draw()?;
    for s in &g.series {
        let pts: Vec<(f64, f64)> = s
            .points
            .iter()
            .map(|p| (p.0, value(p)))
            .filter(|p| p.1.is_finite() && p.1 > 0.0)
            .collect();
        let style = s.color.stroke_width(3);
        if s.style == 0 {
            chart.draw_series(LineSeries::new(pts.clone(), style))?;
        } else {
            chart.draw_series(DashedLineSeries::new(pts.clone(), 12, 8, style))?;
        }
        for p in pts {
            with_marker!(s.style, p, s.color, |m| chart
                .draw_series(std::iter::once(m)))?;
        }
    }
    Ok(())
}

/// A log axis around [lo, hi]: bounds widened to the nearest 1-2-5 values beyond
/// some margin, so there are always ticks, and the ticks between them.
fn log_axis(lo: f64, hi: f64) -> (f64, f64, Vec<f64>) {
    let nice = |d: i32| [1.0, 2.0, 5.0].map(|m| m * 10f64.powi(d));
    let lo_m = lo / 1.3;
    let hi_m = hi * 1.3;
    let d_lo = lo_m.log10().floor() as i32;
    let d_hi = hi_m.log10().ceil() as i32;
    let all: Vec<f64> = (d_lo..=d_hi).flat_map(nice).collect();
    let start = all
        .iter()
        .copied()
        .filter(|v| *v <= lo_m * (1.0 + 1e-9))
        .fold(all[0], f64::max);
    let end = all
        .iter()
        .copied()
        .find(|v| *v >= hi_m * (1.0 - 1e-9))
        .unwrap_or(10f64.powi(d_hi));
    let in_range = |v: &f64| *v >= start * (1.0 - 1e-9) && *v <= end * (1.0 + 1e-9);
    // Over more than three decades 2 and 5 crowd the axis: powers of ten only.
    let ticks: Vec<f64> = if (end / start).log10() > 3.0 {
        (d_lo..=d_hi)
            .map(|d| 10f64.powi(d))
            .filter(in_range)
            .collect()
    } else {
        all.iter().copied().filter(in_range).collect()
    };
    (start, end, ticks)
}

/// 200000 -> "200k", 1500000 -> "1.5M", 0.05 -> "0.05".
fn short(v: f64) -> String {
    let trim = |x: f64| {
        let s = format!("{x:.3}");
        let s = s.trim_end_matches('0').trim_end_matches('.');
        s.to_string()
    };
    if v >= 1e6 {
        format!("{}M", trim(v / 1e6))
    } else if v >= 1e3 {
        format!("{}k", trim(v / 1e3))
    } else {
        trim(v)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::report::{Meta, Run};

    fn run(
        scenario: &'static str,
        system: &'static str,
        concurrency: usize,
        batch: usize,
        events_per_sec: f64,
        p99_us: f64,
    ) -> Run {
        Run {
            scenario,
            system,
            durability: "sync",
            concurrency,
            batch,
            repeat_index: 0,
            event_bytes: 1154,
            events: (events_per_sec * 0.5) as u64,
            requests: (events_per_sec * 0.5 / batch as f64) as u64,
            seconds: 0.5,
            events_per_sec,
            p50_us: p99_us / 3.0,
            p99_us,
            p999_us: p99_us * 2.0,
            cpu_s: Some(0.4),
            client_cpu_s: Some(0.2),
            peak_rss_bytes: Some(50 << 20),
        }
    }

    fn meta(scenario: &str) -> Meta {
        Meta {
            scenario: scenario.into(),
            seconds: 0.5,
            warmup: 0.1,
            data_bytes: 1024,
            event_bytes: 1154,
            repeat: 1,
            partitions: 1,
            cpus: 2,
            tiny: true,
            meshd: "meshd".into(),
            nats_server: None,
            etcd: None,
            meta_value_bytes: 128,
        }
    }

    /// Width and height from a PNG's IHDR, after checking the signature.
    fn png_size(path: &Path) -> (u32, u32) {
        let bytes = std::fs::read(path).expect("reading the PNG");
        assert!(bytes.len() > 24, "PNG too short: {} bytes", bytes.len());
        assert_eq!(&bytes[..8], b"\x89PNG\r\n\x1a\n", "PNG signature");
        let w = u32::from_be_bytes([bytes[16], bytes[17], bytes[18], bytes[19]]);
        let h = u32::from_be_bytes([bytes[20], bytes[21], bytes[22], bytes[23]]);
        (w, h)
    }

    #[test]
    fn plot_writes_a_png() -> Result<()> {
        let dir = tempfile::tempdir()?;
        let mut runs = Vec::new();
        for (c, f) in [(1, 1.0), (16, 6.0), (64, 9.0)] {
            runs.push(run("publish", "meshd", c, 1, 2_000.0 * f, 900.0 * f));
            runs.push(run("publish", "meshd", c, 100, 30_000.0 * f, 4_000.0 * f));
            runs.push(run("publish", "jetstream", c, 1, 1_200.0 * f, 1_500.0 * f));
            runs.push(run(
                "publish",
                "jetstream",
                c,
                100,
                20_000.0 * f,
                9_000.0 * f,
            ));
            runs.push(run("meta", "raw-etcd/cas", c, 1, 3_000.0 * f, 800.0 * f));
            runs.push(run("meta", "meshd-etcd/cas", c, 1, 2_800.0 * f, 850.0 * f));
        }
        let report = Report::build(meta("all"), runs);
        let path = dir.path().join("plot.png");
        write_png(&report, &path)?;
        let (w, h) = png_size(&path);
        assert!(w > 0 && h > 0, "{w}x{h}");
        assert_eq!((w, h), (WIDTH, TITLE_HEIGHT + 2 * SECTION_HEIGHT));

        // One concurrency value, no meta rows: still a plot (markers only).
        let runs = vec![
            run("publish", "meshd", 4, 1, 5_000.0, 700.0),
            run("publish", "jetstream", 4, 1, 3_000.0, 1_100.0),
        ];
        let report = Report::build(meta("publish"), runs);
        let path = dir.path().join("single.png");
        write_png(&report, &path)?;
        let (w, h) = png_size(&path);
        assert!(w > 0 && h > 0, "{w}x{h}");
        Ok(())
    }

    #[test]
    fn plot_missing_font_is_a_clear_error() {
        let e = read_font(Path::new("/nonexistent/NoSuchFont.ttf")).unwrap_err();
        let msg = format!("{e:#}");
        assert!(msg.contains("/nonexistent/NoSuchFont.ttf"), "{msg}");
        assert!(msg.contains("fonts-dejavu-core"), "{msg}");
    }

    #[test]
    fn plot_log_axis_always_has_ticks() {
        for (lo, hi) in [(3000.0, 8000.0), (1.0, 200_000.0), (0.05, 0.07), (5.0, 5.0)] {
            let (start, end, ticks) = log_axis(lo, hi);
            assert!(start < lo && end > hi, "{lo}..{hi}: {start}..{end}");
            assert!(ticks.len() >= 2, "{lo}..{hi}: {ticks:?}");
        }
        assert_eq!(short(200_000.0), "200k");
        assert_eq!(short(1_500_000.0), "1.5M");
        assert_eq!(short(0.05), "0.05");
        assert_eq!(short(2.0), "2");
    }
}
