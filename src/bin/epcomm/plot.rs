//! A dependency-free SVG line chart for the benchmark results (GB/s or microseconds per token
//! against T): log-scale x, linear or log-scale y.

use std::fmt::Write;

/// One line of the chart: a label and its (x, y) points.
pub struct Series {
    pub label: String,
    pub points: Vec<(f64, f64)>,
    /// Drawn dashed (e.g. a roofline).
    pub dashed: bool,
}

const W: f64 = 760.0;
const H: f64 = 440.0;
const LEFT: f64 = 70.0;
const RIGHT: f64 = 230.0;
const TOP: f64 = 40.0;
const BOTTOM: f64 = 60.0;
const COLORS: [&str; 8] = [
    "#1f77b4", "#d62728", "#2ca02c", "#9467bd", "#ff7f0e", "#8c564b", "#e377c2", "#17becf",
];

fn esc(s: &str) -> String {
    s.replace('&', "&amp;")
        .replace('<', "&lt;")
        .replace('>', "&gt;")
}

/// The plot area and its scales: log2 x in `[x0, x1]`; y linear in `[0, ymax]`, or with
/// `log_y` log10 in `[y0, ymax]` (whole decades).
struct Frame {
    x0: f64,
    x1: f64,
    log_y: bool,
    y0: f64,
    ymax: f64,
    pw: f64,
    ph: f64,
}

impl Frame {
    fn new(series: &[Series], log_y: bool) -> Frame {
        let pts = series.iter().flat_map(|s| s.points.iter());
        let xs: Vec<f64> = pts.clone().map(|p| p.0.max(1.0).log2()).collect();
        let (x0, x1) = xs
            .iter()
            .fold((f64::INFINITY, f64::NEG_INFINITY), |(a, b), &x| {
                (a.min(x), b.max(x))
            });
        let (x0, x1) = if x0.is_finite() && x1 > x0 {
            (x0, x1)
        } else {
            (0.0, x0.max(0.0) + 1.0)
        };
        let ys: Vec<f64> = pts.map(|p| p.1).filter(|y| y.is_finite()).collect();
        let (y0, ymax) = if log_y {
            let logs = ys.iter().filter(|&&y| y > 0.0).map(|y| y.log10());
            let (lo, hi) = logs.fold((f64::INFINITY, f64::NEG_INFINITY), |(a, b), y| {
                (a.min(y), b.max(y))
            });
            if lo.is_finite() {
                (lo.floor(), hi.ceil().max(lo.floor() + 1.0))
            } else {
                (0.0, 1.0)
            }
        } else {
            let ymax = ys.iter().copied().fold(0.0, f64::max);
            (0.0, if ymax > 0.0 { ymax * 1.1 } else { 1.0 })
        };
        Frame {
            x0,
            x1,
            log_y,
            y0,
            ymax,
            pw: W - LEFT - RIGHT,
            ph: H - TOP - BOTTOM,
        }
    }

    fn px(&self, x: f64) -> f64 {
        LEFT + (x.max(1.0).log2() - self.x0) / (self.x1 - self.x0) * self.pw
    }

    fn py(&self, y: f64) -> f64 {
        let frac = if self.log_y {
            (y.max(f64::MIN_POSITIVE).log10() - self.y0) / (self.ymax - self.y0)
        } else {
            y / self.ymax
        };
        TOP + self.ph - frac.clamp(0.0, 1.0) * self.ph
    }

    /// A y tick's label: one decimal, or a decade without rounding noise.
    fn y_text(&self, y: f64) -> String {
        if !self.log_y {
            return format!("{y:.1}");
        }
        let d = y.log10().round() as i32;
        format!("{:.*}", (-d).max(0) as usize, y)
    }

    /// The y grid values: six linear steps, or every decade.
    fn y_ticks(&self) -> Vec<f64> {
        if self.log_y {
            let decades = (self.ymax - self.y0).round() as i32;
            (0..=decades)
                .map(|d| 10f64.powf(self.y0 + d as f64))
                .collect()
        } else {
            (0..=5).map(|i| self.ymax * i as f64 / 5.0).collect()
        }
    }
}

/// Renders `series` with a log2 x axis (x > 0) and a linear y axis from 0.
pub fn line_chart(title: &str, x_label: &str, y_label: &str, series: &[Series]) -> String {
    chart(title, x_label, y_label, series, false)
}

/// Renders `series` with a log2 x axis and a log10 y axis (y > 0), for values spanning
/// decades.
pub fn line_chart_log_y(title: &str, x_label: &str, y_label: &str, series: &[Series]) -> String {
    chart(title, x_label, y_label, series, true)
}

fn chart(title: &str, x_label: &str, y_label: &str, series: &[Series], log_y: bool) -> String {
    let f = Frame::new(series, log_y);
    let mut s = String::new();
    let _ = writeln!(
        s,
        r#"<svg xmlns="http://www.w3.org/2000/svg" width="{W}" height="{H}" font-family="sans-serif" font-size="12">"#
    );
    let _ = writeln!(s, r#"<rect width="100%" height="100%" fill="white"/>"#);
    let _ = writeln!(
        s,
        r#"<text x="{}" y="22" text-anchor="middle" font-size="14">{}</text>"#,
        LEFT + f.pw / 2.0,
        esc(title)
    );
    axes(&mut s, &f, x_label, y_label);
    for (i, ser) in series.iter().enumerate() {
        line(&mut s, &f, i, ser);
    }
    s.push_str("</svg>\n");
    s
}

/// The axes, the y grid and both axes' ticks and labels.
fn axes(s: &mut String, f: &Frame, x_label: &str, y_label: &str) {
    let (pw, ph) = (f.pw, f.ph);
    for y in f.y_ticks() {
        let _ = writeln!(
            s,
            r##"<line x1="{LEFT}" x2="{0}" y1="{1:.1}" y2="{1:.1}" stroke="#ddd"/><text x="{2}" y="{3:.1}" text-anchor="end">{4}</text>"##,
            LEFT + pw,
            f.py(y),
            LEFT - 6.0,
            f.py(y) + 4.0,
            f.y_text(y)
        );
    }
    let mut tick = 2f64.powf(f.x0.floor());
    while tick.log2() <= f.x1 + 1e-9 {
        if tick.log2() >= f.x0 - 1e-9 {
            let _ = writeln!(
                s,
                r#"<text x="{:.1}" y="{}" text-anchor="middle">{tick}</text>"#,
                f.px(tick),
                TOP + ph + 18.0
            );
        }
        tick *= 2.0;
    }
    let _ = writeln!(
        s,
        r#"<line x1="{LEFT}" x2="{LEFT}" y1="{TOP}" y2="{0}" stroke="black"/><line x1="{LEFT}" x2="{1}" y1="{0}" y2="{0}" stroke="black"/>"#,
        TOP + ph,
        LEFT + pw
    );
    let _ = writeln!(
        s,
        r#"<text x="{}" y="{}" text-anchor="middle">{}</text>"#,
        LEFT + pw / 2.0,
        H - 18.0,
        esc(x_label)
    );
    let _ = writeln!(
        s,
        r#"<text transform="translate(18,{}) rotate(-90)" text-anchor="middle">{}</text>"#,
        TOP + ph / 2.0,
        esc(y_label)
    );
}

/// Series `i`: its polyline, its points and its legend entry.
fn line(s: &mut String, f: &Frame, i: usize, ser: &Series) {
    let color = COLORS[i % COLORS.len()];
    let dash = if ser.dashed {
        r#" stroke-dasharray="6,4""#
    } else {
        ""
    };
    let path: Vec<String> = ser
        .points
        .iter()
        .map(|&(x, y)| format!("{:.1},{:.1}", f.px(x), f.py(y)))
        .collect();
    let _ = writeln!(
        s,
        r#"<polyline fill="none" stroke="{color}" stroke-width="2"{dash} points="{}"/>"#,
        path.join(" ")
    );
    for &(x, y) in &ser.points {
        let _ = writeln!(
            s,
            r#"<circle cx="{:.1}" cy="{:.1}" r="3" fill="{color}"/>"#,
            f.px(x),
            f.py(y)
        );
    }
    let ly = TOP + 10.0 + 18.0 * i as f64;
    let lx = LEFT + f.pw + 14.0;
    let _ = writeln!(
        s,
        r#"<line x1="{lx}" x2="{}" y1="{ly}" y2="{ly}" stroke="{color}" stroke-width="2"{dash}/><text x="{}" y="{}">{}</text>"#,
        lx + 22.0,
        lx + 28.0,
        ly + 4.0,
        esc(&ser.label)
    );
}
