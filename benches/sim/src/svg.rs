//! Hand-written SVG charts (no plotting crate, no system dependency; all text XML-escaped): a
//! small chart writer ([`Svg`], a document; [`Panel`], a plot area with its grid and axes;
//! [`nice_ceiling`] for axis ranges) and the simulator's comparison chart ([`render`]: grouped
//! TTFT p50/p90 bars per policy and a prefix-hit ratio panel, with axes, labels and a legend).
//! The reference worker's demo draws its panels with the same writer.

use std::fmt::Write;

use crate::sim::PolicyReport;

const WIDTH: f64 = 960.0;
const HEIGHT: f64 = 500.0;
const TOP: f64 = 110.0;
const BOTTOM: f64 = 420.0;
const TTFT: Panel = Panel::new(80.0, 600.0, TOP, BOTTOM);
const HITS: Panel = Panel::new(690.0, 930.0, TOP, BOTTOM);
const P50: &str = "#4e79a7";
const P90: &str = "#f28e2b";
const HIT: &str = "#59a14f";
/// Stroke of grid lines.
const GRID: &str = r##"stroke="#e5e5e5""##;
/// Stroke of axes.
const AXIS: &str = r##"stroke="#333""##;

/// Escape text for an XML text node or attribute.
pub fn escape(s: &str) -> String {
    let mut out = String::with_capacity(s.len());
    for c in s.chars() {
        match c {
            '&' => out.push_str("&amp;"),
            '<' => out.push_str("&lt;"),
            '>' => out.push_str("&gt;"),
            '"' => out.push_str("&quot;"),
            '\'' => out.push_str("&apos;"),
            // Characters XML 1.0 forbids.
            c if (c as u32) < 0x20 && !matches!(c, '\t' | '\n' | '\r') => out.push('\u{fffd}'),
            c => out.push(c),
        }
    }
    out
}

/// The smallest 1, 2, 2.5 or 5 × 10^k at or above `v` (within float noise): the top of an axis
/// that holds `v`. 1 when `v` is not a positive number.
pub fn nice_ceiling(v: f64) -> f64 {
    if !(v.is_finite() && v > 0.0) {
        return 1.0;
    }
    let mag = 10f64.powf(v.log10().floor());
    for m in [1.0, 2.0, 2.5, 5.0, 10.0] {
        if m * mag >= v * (1.0 - 1e-12) {
            return m * mag;
        }
    }
    10.0 * mag
}

/// `s` cut to `max_chars` characters, the last one an ellipsis when it was cut.
pub fn clip(s: &str, max_chars: usize) -> String {
    if s.chars().count() <= max_chars {
        s.to_owned()
    } else {
        let mut t: String = s.chars().take(max_chars.saturating_sub(1)).collect();
        t.push('…');
        t
    }
}

/// An SVG document being written: a white page in a sans-serif font, elements in drawing order.
/// Coordinates are written with one decimal; text is escaped.
#[derive(Debug, Clone)]
pub struct Svg {
    out: String,
}

impl Svg {
    /// A `width` × `height` page.
    pub fn new(width: f64, height: f64) -> Svg {
        let mut out = String::with_capacity(32 << 10);
        let _ = writeln!(
            out,
            r#"<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" viewBox="0 0 {width} {height}" font-family="Helvetica, Arial, sans-serif">"#
        );
        let _ = writeln!(out, r#"<rect width="100%" height="100%" fill="white"/>"#);
        Svg { out }
    }

    /// Text `s` at (`x`, `y`) in `size` px, `anchor` `start`, `middle` or `end`; `extra` is more
    /// attributes as written (e.g. ` font-weight="bold"`, with its leading space).
    pub fn text(&mut self, x: f64, y: f64, size: u32, anchor: &str, extra: &str, s: &str) {
        let _ = writeln!(
            self.out,
            r#"<text x="{x:.1}" y="{y:.1}" font-size="{size}" text-anchor="{anchor}"{extra}>{}</text>"#,
            escape(s)
        );
    }

    /// A filled rectangle with a tooltip (`title`); negative sizes are drawn as 0.
    pub fn rect(&mut self, x: f64, y: f64, w: f64, h: f64, fill: &str, title: &str) {
        let _ = writeln!(
            self.out,
            r#"<rect x="{x:.1}" y="{y:.1}" width="{:.1}" height="{:.1}" fill="{fill}"><title>{}</title></rect>"#,
            w.max(0.0),
            h.max(0.0),
            escape(title)
        );
    }

    /// A line; `style` is its attributes as written (e.g. `stroke="#333"`).
    pub fn line(&mut self, x1: f64, y1: f64, x2: f64, y2: f64, style: &str) {
        let _ = writeln!(self.out, r#"<line x1="{x1:.1}" y1="{y1:.1}" x2="{x2:.1}" y2="{y2:.1}" {style}/>"#);
    }

    /// An unfilled polyline through `points` in `color`, `width` px wide, with a tooltip.
    pub fn polyline(&mut self, points: &[(f64, f64)], color: &str, width: u32, title: &str) {
        let mut pts = String::with_capacity(points.len() * 12);
        for (i, (x, y)) in points.iter().enumerate() {
            let sep = if i == 0 { "" } else { " " };
            let _ = write!(pts, "{sep}{x:.1},{y:.1}");
        }
        let _ = writeln!(
            self.out,
            r#"<polyline points="{pts}" fill="none" stroke="{color}" stroke-width="{width}"><title>{}</title></polyline>"#,
            escape(title)
        );
    }

    /// The finished document.
    pub fn finish(mut self) -> String {
        self.out.push_str("</svg>\n");
        self.out
    }
}

/// A plot area: `left`..`right` across, `top`..`bottom` down (SVG coordinates).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Panel {
    /// x of the y axis.
    pub left: f64,
    /// Right edge.
    pub right: f64,
    /// Top edge (the value axis's maximum).
    pub top: f64,
    /// y of the x axis (the value axis's zero).
    pub bottom: f64,
}

impl Panel {
    /// The area `left`..`right` × `top`..`bottom`.
    pub const fn new(left: f64, right: f64, top: f64, bottom: f64) -> Panel {
        Panel { left, right, top, bottom }
    }

    /// Horizontal middle.
    pub fn center(&self) -> f64 {
        (self.left + self.right) / 2.0
    }

    /// The y of a value at `fraction` (0–1, clamped) of the value axis.
    pub fn y(&self, fraction: f64) -> f64 {
        self.bottom - fraction.clamp(0.0, 1.0) * (self.bottom - self.top)
    }

    /// The panel's title (bold, centered) `above` px above its top.
    pub fn title(&self, svg: &mut Svg, above: f64, title: &str) {
        svg.text(self.center(), self.top - above, 14, "middle", r#" font-weight="bold""#, title);
    }

    /// `ticks` + 1 horizontal grid lines from the bottom to the top, each labelled on the left with
    /// `label(fraction)` (fraction 0, 1/ticks, …, 1 of the value axis).
    pub fn grid(&self, svg: &mut Svg, ticks: u32, label: impl Fn(f64) -> String) {
        let ticks = ticks.max(1);
        for i in 0..=ticks {
            let f = f64::from(i) / f64::from(ticks);
            let y = self.y(f);
            svg.line(self.left, y, self.right, y, GRID);
            svg.text(self.left - 6.0, y + 4.0, 11, "end", "", &label(f));
        }
    }

    /// A vertical grid line at `x`, labelled `label` below the x axis.
    pub fn x_grid(&self, svg: &mut Svg, x: f64, label: &str) {
        svg.line(x, self.top, x, self.bottom, GRID);
        svg.text(x, self.bottom + 16.0, 11, "middle", "", label);
    }

    /// The x and y axes.
    pub fn axes(&self, svg: &mut Svg) {
        svg.line(self.left, self.bottom, self.right, self.bottom, AXIS);
        svg.line(self.left, self.top, self.left, self.bottom, AXIS);
    }

    /// The value axis's label, rotated, centered on the panel's height at `x`.
    pub fn y_label(&self, svg: &mut Svg, x: f64, label: &str) {
        let y = (self.top + self.bottom) / 2.0;
        svg.text(x, y, 12, "middle", &format!(r#" transform="rotate(-90 {x:.1} {y:.1})""#), label);
    }
}

fn fmt_ms(v: f64) -> String {
    if v >= 100.0 {
        format!("{v:.0}")
    } else {
        format!("{v:.1}")
    }
}

/// Render the simulator's chart of `reports`. `title` and up to two `subtitles` lines are shown
/// at the top (escaped, clipped to the chart's width).
pub fn render(reports: &[PolicyReport], title: &str, subtitles: &[&str]) -> String {
    let mut o = Svg::new(WIDTH, HEIGHT);
    o.text(WIDTH / 2.0, 30.0, 20, "middle", r#" font-weight="bold""#, &clip(title, 80));
    for (i, line) in subtitles.iter().take(2).enumerate() {
        o.text(WIDTH / 2.0, 50.0 + 15.0 * i as f64, 11, "middle", r##" fill="#555""##, &clip(line, 165));
    }
    let n = reports.len().max(1) as f64;

    // TTFT panel.
    let max_ms =
        nice_ceiling(reports.iter().map(|r| r.ttft_p90_ms.max(r.ttft_p50_ms)).fold(0.0, f64::max) * 1.08).max(1.0);
    TTFT.title(&mut o, 22.0, "Time to first token");
    TTFT.grid(&mut o, 5, |f| {
        let v = max_ms * f;
        if max_ms >= 10.0 {
            format!("{v:.0}")
        } else {
            format!("{v:.1}")
        }
    });
    TTFT.axes(&mut o);
    TTFT.y_label(&mut o, 24.0, "TTFT (ms)");
    let group_w = (TTFT.right - TTFT.left) / n;
    let bar_w = (group_w * 0.32).min(70.0);
    for (i, r) in reports.iter().enumerate() {
        let cx = TTFT.left + group_w * (i as f64 + 0.5);
        for (k, (v, color, label)) in [(r.ttft_p50_ms, P50, "p50"), (r.ttft_p90_ms, P90, "p90")].into_iter().enumerate()
        {
            let y = TTFT.y(v / max_ms);
            let x = cx - bar_w - 2.0 + k as f64 * (bar_w + 4.0);
            o.rect(x, y, bar_w, BOTTOM - y, color, &format!("{} TTFT {label}: {} ms", r.policy, fmt_ms(v)));
            o.text(x + bar_w / 2.0, y - 5.0, 11, "middle", "", &fmt_ms(v));
        }
        o.text(cx, BOTTOM + 20.0, 13, "middle", "", &r.policy);
        let grey = r##" fill="#666""##;
        o.text(cx, BOTTOM + 35.0, 11, "middle", grey, &format!("p99 {} ms", fmt_ms(r.ttft_p99_ms)));
        o.text(cx, BOTTOM + 49.0, 11, "middle", grey, &format!("imbalance {:.2}x", r.load_imbalance));
    }
    // Legend.
    let lx = TTFT.right - 150.0;
    for (k, (color, label)) in [(P50, "TTFT p50"), (P90, "TTFT p90")].into_iter().enumerate() {
        let x = lx + k as f64 * 78.0;
        o.rect(x, TOP - 12.0, 12.0, 12.0, color, label);
        o.text(x + 16.0, TOP - 2.0, 11, "start", "", label);
    }

    // Hit-ratio panel.
    HITS.title(&mut o, 22.0, "Prefix cache hit ratio");
    HITS.grid(&mut o, 4, |f| format!("{:.0}%", f * 100.0));
    HITS.axes(&mut o);
    HITS.y_label(&mut o, HITS.left - 44.0, "true cached / prompt tokens");
    let hgroup = (HITS.right - HITS.left) / n;
    let hbar = (hgroup * 0.6).min(60.0);
    for (i, r) in reports.iter().enumerate() {
        let cx = HITS.left + hgroup * (i as f64 + 0.5);
        let y = HITS.y(r.hit_ratio);
        let pct = format!("{:.1}%", r.hit_ratio * 100.0);
        o.rect(cx - hbar / 2.0, y, hbar, BOTTOM - y, HIT, &format!("{} hit ratio: {pct}", r.policy));
        o.text(cx, y - 5.0, 11, "middle", "", &pct);
        let ly = BOTTOM + 16.0;
        o.text(cx, ly, 12, "end", &format!(r#" transform="rotate(-30 {cx:.1} {ly:.1})""#), &r.policy);
    }
    o.text(
        WIDTH / 2.0,
        HEIGHT - 12.0,
        11,
        "middle",
        r##" fill="#888""##,
        "kvroute-sim · same workload for every policy · TTFT = arrival to end of prefill",
    );
    o.finish()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn escaping() {
        assert_eq!(escape(r#"a<b>&"c'"#), "a&lt;b&gt;&amp;&quot;c&apos;");
        assert_eq!(escape("x\u{1}y"), "x\u{fffd}y");
    }

    #[test]
    fn nice_ceilings() {
        assert_eq!(nice_ceiling(0.0), 1.0);
        assert_eq!(nice_ceiling(-3.0), 1.0);
        assert_eq!(nice_ceiling(f64::NAN), 1.0);
        assert_eq!(nice_ceiling(0.3), 0.5);
        assert_eq!(nice_ceiling(7.0), 10.0);
        assert_eq!(nice_ceiling(180.0), 200.0);
        assert_eq!(nice_ceiling(730.0), 1000.0);
        assert_eq!(nice_ceiling(1800.0), 2000.0);
        assert_eq!(nice_ceiling(2100.0), 2500.0);
        assert_eq!(nice_ceiling(500.0), 500.0);
        assert_eq!(nice_ceiling(500.0 * (1.0 + 1e-15)), 500.0, "float noise above 500 is 500");
    }

    #[test]
    fn clipping() {
        assert_eq!(clip("abc", 3), "abc");
        assert_eq!(clip("abcd", 3), "ab…");
    }

    #[test]
    fn writer_writes_well_formed_elements() {
        let p = Panel::new(10.0, 110.0, 20.0, 220.0);
        assert_eq!((p.y(0.0), p.y(0.5), p.y(2.0), p.center()), (220.0, 120.0, 20.0, 60.0));
        let mut s = Svg::new(200.0, 300.0);
        p.title(&mut s, 5.0, "a < b");
        p.grid(&mut s, 2, |f| format!("{f}"));
        p.x_grid(&mut s, 50.0, "x");
        p.axes(&mut s);
        p.y_label(&mut s, 4.0, "y");
        s.rect(1.0, 2.0, -3.0, 4.0, "red", "t & u");
        s.polyline(&[(1.0, 2.0), (3.0, 4.0)], "blue", 2, "l");
        let out = s.finish();
        assert!(out.starts_with("<svg") && out.ends_with("</svg>\n"), "{out}");
        assert!(out.contains(">a &lt; b</text>") && out.contains("<title>t &amp; u</title>"));
        assert!(out.contains(r#"width="0.0" height="4.0""#), "negative sizes drawn as 0: {out}");
        assert!(out.contains(r#"points="1.0,2.0 3.0,4.0""#), "{out}");
        assert_eq!(out.matches("<line").count(), 3 + 1 + 2);
        assert_eq!(out.matches("<text").count(), out.matches("</text>").count());
    }
}
