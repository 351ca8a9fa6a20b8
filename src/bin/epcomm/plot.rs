//! A dependency-free SVG line chart for the benchmark results (GB/s or microseconds per token
//! against T): log-scale x with a tick at each measured T only, log-scale y (the values span
//! decades: memcpy beside the backends), a marker at every measured point, a cross at each
//! refused one, and the legend inside the picture (the picture grows to hold it).

use std::fmt::Write;

/// The shape of a series' markers (e.g. one per rank count).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Marker {
    Circle,
    Square,
    Triangle,
    Diamond,
}

/// One line of the chart.
pub struct Series {
    pub label: String,
    /// The measured (x, y) points, in x order.
    pub points: Vec<(f64, f64)>,
    /// Drawn dashed (e.g. a roofline).
    pub dashed: bool,
    /// Its colour (the caller keys it by what the series is, so it is the same in every
    /// chart).
    pub color: &'static str,
    pub marker: Marker,
    /// The x of cases that were not measured (refused): a cross on the x axis.
    pub refused: Vec<f64>,
}

const PLOT_W: f64 = 520.0;
const PLOT_H: f64 = 340.0;
const LEFT: f64 = 70.0;
const TOP: f64 = 40.0;
const BOTTOM: f64 = 60.0;
/// Legend: its gap from the plot, row height, and the width of one character (font-size 12).
const LEGEND_GAP: f64 = 14.0;
const ROW: f64 = 18.0;
const CHAR_W: f64 = 7.2;

fn esc(s: &str) -> String {
    s.replace('&', "&amp;")
        .replace('<', "&lt;")
        .replace('>', "&gt;")
}

/// The plot area and its scales: log2 x in `[x0, x1]`, log10 y in `[y0, y1]` (whole decades).
struct Frame {
    x0: f64,
    x1: f64,
    y0: f64,
    y1: f64,
    /// Every measured (or refused) x, in order: the only x ticks.
    xs: Vec<f64>,
}

impl Frame {
    fn new(series: &[Series]) -> Frame {
        let mut xs: Vec<f64> = series
            .iter()
            .flat_map(|s| {
                s.points
                    .iter()
                    .map(|p| p.0)
                    .chain(s.refused.iter().copied())
            })
            .filter(|x| x.is_finite() && *x > 0.0)
            .collect();
        xs.sort_by(f64::total_cmp);
        xs.dedup();
        let (x0, x1) = match (xs.first(), xs.last()) {
            (Some(a), Some(b)) if b > a => (a.log2(), b.log2()),
            (Some(a), _) => (a.log2() - 1.0, a.log2() + 1.0),
            _ => (0.0, 1.0),
        };
        let logs = series
            .iter()
            .flat_map(|s| s.points.iter().map(|p| p.1))
            .filter(|y| y.is_finite() && *y > 0.0)
            .map(f64::log10);
        let (lo, hi) = logs.fold((f64::INFINITY, f64::NEG_INFINITY), |(a, b), y| {
            (a.min(y), b.max(y))
        });
        let (y0, y1) = if lo.is_finite() {
            (lo.floor(), hi.ceil().max(lo.floor() + 1.0))
        } else {
            (0.0, 1.0)
        };
        Frame { x0, x1, y0, y1, xs }
    }

    fn px(&self, x: f64) -> f64 {
        LEFT + (x.max(f64::MIN_POSITIVE).log2() - self.x0) / (self.x1 - self.x0) * PLOT_W
    }

    fn py(&self, y: f64) -> f64 {
        let frac = (y.max(f64::MIN_POSITIVE).log10() - self.y0) / (self.y1 - self.y0);
        TOP + PLOT_H - frac.clamp(0.0, 1.0) * PLOT_H
    }

    /// A decade's label without rounding noise.
    fn y_text(y: f64) -> String {
        let d = y.log10().round() as i32;
        format!("{:.*}", (-d).max(0) as usize, y)
    }

    /// Every decade of the y range.
    fn y_ticks(&self) -> Vec<f64> {
        let decades = (self.y1 - self.y0).round() as i32;
        (0..=decades)
            .map(|d| 10f64.powf(self.y0 + d as f64))
            .collect()
    }
}

/// Renders `series` against a log2 x axis (x > 0) and a log10 y axis (y > 0).
pub fn line_chart(title: &str, x_label: &str, y_label: &str, series: &[Series]) -> String {
    let f = Frame::new(series);
    let refused = series.iter().any(|s| !s.refused.is_empty());
    let rows = series.len() + usize::from(refused);
    let longest = series
        .iter()
        .map(|s| s.label.chars().count())
        .chain([
            title.chars().count() / 2,
            "refused (did not fit in memory)".len(),
        ])
        .max()
        .unwrap_or(0);
    let width = LEFT + PLOT_W + LEGEND_GAP + 30.0 + longest as f64 * CHAR_W + 10.0;
    let height = (TOP + PLOT_H + BOTTOM).max(TOP + 10.0 + ROW * rows as f64 + 10.0);
    let mut s = String::new();
    let _ = writeln!(
        s,
        r#"<svg xmlns="http://www.w3.org/2000/svg" width="{width:.0}" height="{height:.0}" viewBox="0 0 {width:.0} {height:.0}" font-family="sans-serif" font-size="12">"#
    );
    let _ = writeln!(s, r#"<rect width="100%" height="100%" fill="white"/>"#);
    let _ = writeln!(
        s,
        r#"<text x="{}" y="22" text-anchor="middle" font-size="14">{}</text>"#,
        LEFT + PLOT_W / 2.0,
        esc(title)
    );
    axes(&mut s, &f, x_label, y_label, height);
    // The crosses of refused cases stack upwards from the x axis, one row per series that has
    // any, so those at the same T stay apart.
    let mut stacked = 0;
    for (i, ser) in series.iter().enumerate() {
        line(&mut s, &f, ser, stacked);
        stacked += usize::from(!ser.refused.is_empty());
        legend_row(&mut s, i, ser);
    }
    if refused {
        let (lx, ly) = legend_at(series.len());
        cross(&mut s, lx + 11.0, ly, "#555");
        let _ = writeln!(
            s,
            r#"<text x="{}" y="{}">refused (did not fit in memory)</text>"#,
            lx + 30.0,
            ly + 4.0
        );
    }
    s.push_str("</svg>\n");
    s
}

/// The axes, the y grid (decades), the x ticks (measured T only) and both axes' labels.
fn axes(s: &mut String, f: &Frame, x_label: &str, y_label: &str, height: f64) {
    for y in f.y_ticks() {
        let _ = writeln!(
            s,
            r##"<line x1="{LEFT}" x2="{0}" y1="{1:.1}" y2="{1:.1}" stroke="#ddd"/><text x="{2}" y="{3:.1}" text-anchor="end">{4}</text>"##,
            LEFT + PLOT_W,
            f.py(y),
            LEFT - 6.0,
            f.py(y) + 4.0,
            Frame::y_text(y)
        );
    }
    for &x in &f.xs {
        let _ = writeln!(
            s,
            r##"<line x1="{0:.1}" x2="{0:.1}" y1="{1}" y2="{2}" stroke="#000"/><text x="{0:.1}" y="{3}" text-anchor="middle">{x}</text>"##,
            f.px(x),
            TOP + PLOT_H,
            TOP + PLOT_H + 5.0,
            TOP + PLOT_H + 18.0
        );
    }
    let _ = writeln!(
        s,
        r#"<line x1="{LEFT}" x2="{LEFT}" y1="{TOP}" y2="{0}" stroke="black"/><line x1="{LEFT}" x2="{1}" y1="{0}" y2="{0}" stroke="black"/>"#,
        TOP + PLOT_H,
        LEFT + PLOT_W
    );
    let _ = writeln!(
        s,
        r#"<text x="{}" y="{}" text-anchor="middle">{}</text>"#,
        LEFT + PLOT_W / 2.0,
        (TOP + PLOT_H + BOTTOM).min(height) - 18.0,
        esc(x_label)
    );
    let _ = writeln!(
        s,
        r#"<text transform="translate(18,{}) rotate(-90)" text-anchor="middle">{}</text>"#,
        TOP + PLOT_H / 2.0,
        esc(y_label)
    );
}

/// One marker of `shape` centred at (x, y).
fn marker(s: &mut String, shape: Marker, x: f64, y: f64, color: &str) {
    let _ = match shape {
        Marker::Circle => writeln!(
            s,
            r#"<circle cx="{x:.1}" cy="{y:.1}" r="3.5" fill="{color}"/>"#
        ),
        Marker::Square => writeln!(
            s,
            r#"<rect x="{:.1}" y="{:.1}" width="7" height="7" fill="{color}"/>"#,
            x - 3.5,
            y - 3.5
        ),
        Marker::Triangle => writeln!(
            s,
            r#"<path d="M{x:.1},{:.1} L{:.1},{:.1} L{:.1},{:.1} Z" fill="{color}"/>"#,
            y - 4.5,
            x + 4.5,
            y + 3.5,
            x - 4.5,
            y + 3.5
        ),
        Marker::Diamond => writeln!(
            s,
            r#"<path d="M{x:.1},{:.1} L{:.1},{y:.1} L{x:.1},{:.1} L{:.1},{y:.1} Z" fill="{color}"/>"#,
            y - 4.5,
            x + 4.5,
            y + 4.5,
            x - 4.5
        ),
    };
}

/// A cross centred at (x, y): a refused case.
fn cross(s: &mut String, x: f64, y: f64, color: &str) {
    let _ = writeln!(
        s,
        r#"<path d="M{:.1},{:.1} L{:.1},{:.1} M{:.1},{:.1} L{:.1},{:.1}" stroke="{color}" stroke-width="2"/>"#,
        x - 4.0,
        y - 4.0,
        x + 4.0,
        y + 4.0,
        x - 4.0,
        y + 4.0,
        x + 4.0,
        y - 4.0
    );
}

fn dash(ser: &Series) -> &'static str {
    if ser.dashed {
        r#" stroke-dasharray="6,4""#
    } else {
        ""
    }
}

/// A series' polyline through its measured points, their markers, and a cross above the x
/// axis (in row `stack` of the crosses) at each refused x.
fn line(s: &mut String, f: &Frame, ser: &Series, stack: usize) {
    let path: Vec<String> = ser
        .points
        .iter()
        .map(|&(x, y)| format!("{:.1},{:.1}", f.px(x), f.py(y)))
        .collect();
    let _ = writeln!(
        s,
        r#"<polyline fill="none" stroke="{}" stroke-width="1.5"{} points="{}"/>"#,
        ser.color,
        dash(ser),
        path.join(" ")
    );
    for &(x, y) in &ser.points {
        marker(s, ser.marker, f.px(x), f.py(y), ser.color);
    }
    for &x in &ser.refused {
        cross(
            s,
            f.px(x),
            TOP + PLOT_H - 8.0 - 11.0 * stack as f64,
            ser.color,
        );
    }
}

/// Where legend row `i` starts (its line's left end, its middle).
fn legend_at(i: usize) -> (f64, f64) {
    (LEFT + PLOT_W + LEGEND_GAP, TOP + 10.0 + ROW * i as f64)
}

/// Legend row `i`: the series' line and marker, and its label.
fn legend_row(s: &mut String, i: usize, ser: &Series) {
    let (lx, ly) = legend_at(i);
    let _ = writeln!(
        s,
        r#"<line x1="{lx}" x2="{}" y1="{ly}" y2="{ly}" stroke="{}" stroke-width="1.5"{}/>"#,
        lx + 22.0,
        ser.color,
        dash(ser)
    );
    marker(s, ser.marker, lx + 11.0, ly, ser.color);
    let _ = writeln!(
        s,
        r#"<text x="{}" y="{}">{}</text>"#,
        lx + 30.0,
        ly + 4.0,
        esc(&ser.label)
    );
}
