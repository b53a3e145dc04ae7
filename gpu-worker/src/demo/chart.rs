//! The comparison chart: a hand-written SVG (no plotting crate, no system dependency) with three
//! panels: TTFT CDF per policy (log time axis), TTFT p50/p90/p99 bars, and prefix-hit rate per
//! policy against the oracle. All text is XML-escaped.

use std::fmt::Write as _;

use super::report::PolicySummary;

const WIDTH: f64 = 1280.0;
const HEIGHT: f64 = 540.0;
const TOP: f64 = 96.0;
const BOTTOM: f64 = 440.0;
const CDF: (f64, f64) = (70.0, 520.0);
const BARS: (f64, f64) = (600.0, 960.0);
const HITS: (f64, f64) = (1030.0, 1250.0);
/// Line colors per policy (cycled).
const COLORS: [&str; 6] = ["#e15759", "#f28e2b", "#4e79a7", "#59a14f", "#b07aa1", "#76b7b2"];
/// Percentile bar shades.
const SHADES: [&str; 3] = ["#9ecae1", "#4292c6", "#08519c"];

/// Escape text for XML.
pub(crate) fn escape(s: &str) -> String {
    let mut out = String::with_capacity(s.len());
    for c in s.chars() {
        match c {
            '&' => out.push_str("&amp;"),
            '<' => out.push_str("&lt;"),
            '>' => out.push_str("&gt;"),
            '"' => out.push_str("&quot;"),
            '\'' => out.push_str("&apos;"),
            c if (c as u32) < 0x20 && !matches!(c, '\t' | '\n' | '\r') => out.push('\u{fffd}'),
            c => out.push(c),
        }
    }
    out
}

fn text(out: &mut String, x: f64, y: f64, size: u32, anchor: &str, extra: &str, s: &str) {
    let _ = writeln!(
        out,
        r#"<text x="{x:.1}" y="{y:.1}" font-size="{size}" text-anchor="{anchor}"{extra}>{}</text>"#,
        escape(s)
    );
}

fn line(out: &mut String, x1: f64, y1: f64, x2: f64, y2: f64, style: &str) {
    let _ = writeln!(out, r#"<line x1="{x1:.1}" y1="{y1:.1}" x2="{x2:.1}" y2="{y2:.1}" {style}/>"#);
}

fn rect(out: &mut String, x: f64, y: f64, w: f64, h: f64, fill: &str, title: &str) {
    let _ = writeln!(
        out,
        r#"<rect x="{x:.1}" y="{y:.1}" width="{:.1}" height="{:.1}" fill="{fill}"><title>{}</title></rect>"#,
        w.max(0.0),
        h.max(0.0),
        escape(title)
    );
}

/// The smallest 1/2/2.5/5 × 10^k at or above `v`.
fn nice_ceiling(v: f64) -> f64 {
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

fn fmt_ms(v: f64) -> String {
    if v >= 10_000.0 {
        format!("{:.0}s", v / 1000.0)
    } else if v >= 1000.0 {
        format!("{:.1}s", v / 1000.0)
    } else if v >= 10.0 {
        format!("{v:.0}")
    } else {
        format!("{v:.1}")
    }
}

/// Render the chart. `title` and `subtitle` go on top.
pub(crate) fn render(rows: &[PolicySummary], title: &str, subtitle: &str) -> String {
    let mut s = String::with_capacity(32 << 10);
    let _ = writeln!(
        s,
        r#"<svg xmlns="http://www.w3.org/2000/svg" width="{WIDTH}" height="{HEIGHT}" viewBox="0 0 {WIDTH} {HEIGHT}" font-family="Helvetica, Arial, sans-serif">"#
    );
    let _ = writeln!(s, r##"<rect width="100%" height="100%" fill="#ffffff"/>"##);
    text(&mut s, WIDTH / 2.0, 30.0, 20, "middle", r#" font-weight="bold""#, title);
    text(&mut s, WIDTH / 2.0, 52.0, 12, "middle", r##" fill="#555""##, subtitle);
    cdf_panel(&mut s, rows);
    bar_panel(&mut s, rows);
    hit_panel(&mut s, rows);
    s.push_str("</svg>\n");
    s
}

fn cdf_panel(s: &mut String, rows: &[PolicySummary]) {
    let (left, right) = CDF;
    text(s, (left + right) / 2.0, TOP - 16.0, 14, "middle", r#" font-weight="bold""#, "TTFT CDF (log time axis)");
    let all = rows.iter().flat_map(|r| r.ttft_sorted_ms.iter().copied()).filter(|v| *v > 0.0);
    let (lo, hi) = all.fold((f64::INFINITY, 0.0f64), |(lo, hi), v| (lo.min(v), hi.max(v)));
    let (lo, hi) = if lo.is_finite() && hi > 0.0 { (lo, hi) } else { (1.0, 1000.0) };
    let (lo_exp, hi_exp) = (lo.log10().floor(), hi.log10().ceil().max(lo.log10().floor() + 1.0));
    let x = |v: f64| left + (v.max(1e-9).log10() - lo_exp) / (hi_exp - lo_exp) * (right - left);
    let y = |q: f64| BOTTOM - q * (BOTTOM - TOP);
    // Grid.
    for i in 0..=4 {
        let q = f64::from(i) / 4.0;
        line(s, left, y(q), right, y(q), r##"stroke="#e5e5e5""##);
        text(s, left - 6.0, y(q) + 4.0, 11, "end", "", &format!("{:.0}%", q * 100.0));
    }
    let mut e = lo_exp;
    while e <= hi_exp + 1e-9 {
        let v = 10f64.powf(e);
        line(s, x(v), TOP, x(v), BOTTOM, r##"stroke="#e5e5e5""##);
        text(s, x(v), BOTTOM + 16.0, 11, "middle", "", &fmt_ms(v));
        e += 1.0;
    }
    line(s, left, BOTTOM, right, BOTTOM, r##"stroke="#333""##);
    line(s, left, TOP, left, BOTTOM, r##"stroke="#333""##);
    text(s, (left + right) / 2.0, BOTTOM + 36.0, 12, "middle", "", "time to first token (ms)");
    for (i, r) in rows.iter().enumerate() {
        let color = COLORS[i % COLORS.len()];
        // Requests that never got a token keep the curve below 100%.
        let n = r.requests;
        if r.ttft_sorted_ms.is_empty() {
            continue;
        }
        let mut pts = String::new();
        let mut prev_q = 0.0;
        for (k, v) in r.ttft_sorted_ms.iter().enumerate() {
            let q = (k + 1) as f64 / n as f64;
            let _ = write!(pts, "{:.1},{:.1} {:.1},{:.1} ", x(*v), y(prev_q), x(*v), y(q));
            prev_q = q;
        }
        let _ = writeln!(
            s,
            r#"<polyline points="{}" fill="none" stroke="{color}" stroke-width="2"><title>{}</title></polyline>"#,
            pts.trim_end(),
            escape(&r.name)
        );
        // Legend.
        let ly = TOP + 14.0 + i as f64 * 18.0;
        line(s, right - 150.0, ly - 4.0, right - 126.0, ly - 4.0, &format!(r#"stroke="{color}" stroke-width="3""#));
        text(s, right - 120.0, ly, 12, "start", "", &r.name);
    }
}

fn bar_panel(s: &mut String, rows: &[PolicySummary]) {
    let (left, right) = BARS;
    text(s, (left + right) / 2.0, TOP - 16.0, 14, "middle", r#" font-weight="bold""#, "TTFT p50 / p90 / p99 (ms)");
    let max = rows
        .iter()
        .flat_map(|r| [r.ttft(0.99), r.ttft_sorted_ms.last().copied().unwrap_or(0.0)])
        .filter(|v| v.is_finite())
        .fold(0.0, f64::max);
    let top = nice_ceiling(max);
    let y = |v: f64| BOTTOM - (v / top).clamp(0.0, 1.0) * (BOTTOM - TOP);
    for i in 0..=4 {
        let v = top * f64::from(i) / 4.0;
        line(s, left, y(v), right, y(v), r##"stroke="#e5e5e5""##);
        text(s, left - 6.0, y(v) + 4.0, 11, "end", "", &fmt_ms(v));
    }
    line(s, left, BOTTOM, right, BOTTOM, r##"stroke="#333""##);
    line(s, left, TOP, left, BOTTOM, r##"stroke="#333""##);
    let n = rows.len().max(1) as f64;
    let group = (right - left) / n;
    let bar = group * 0.8 / 3.0;
    for (i, r) in rows.iter().enumerate() {
        let gx = left + group * i as f64 + group * 0.1;
        for (k, (q, label)) in [(0.5, "p50"), (0.9, "p90"), (0.99, "p99")].into_iter().enumerate() {
            let v = r.ttft(q);
            let bx = gx + bar * k as f64;
            if v == f64::INFINITY {
                // Unfinished: a full-height hatched bar.
                rect(s, bx, TOP, bar - 1.0, BOTTOM - TOP, "#d9d9d9", &format!("{} {label}: unfinished", r.name));
                text(s, bx + bar / 2.0, TOP - 3.0, 9, "middle", "", "∞");
                continue;
            }
            if !v.is_finite() {
                continue;
            }
            rect(s, bx, y(v), bar - 1.0, BOTTOM - y(v), SHADES[k], &format!("{} {label}: {v:.1} ms", r.name));
            text(s, bx + bar / 2.0, y(v) - 3.0, 9, "middle", "", &fmt_ms(v));
        }
        text(s, gx + group * 0.4, BOTTOM + 16.0, 11, "middle", "", &r.name);
    }
    for (k, label) in ["p50", "p90", "p99"].into_iter().enumerate() {
        let lx = left + 10.0 + k as f64 * 60.0;
        rect(s, lx, TOP + 4.0, 12.0, 12.0, SHADES[k], label);
        text(s, lx + 16.0, TOP + 14.0, 11, "start", "", label);
    }
}

fn hit_panel(s: &mut String, rows: &[PolicySummary]) {
    let (left, right) = HITS;
    text(s, (left + right) / 2.0, TOP - 16.0, 14, "middle", r#" font-weight="bold""#, "prefix-cache hit rate");
    let y = |v: f64| BOTTOM - v.clamp(0.0, 1.0) * (BOTTOM - TOP);
    for i in 0..=4 {
        let v = f64::from(i) / 4.0;
        line(s, left, y(v), right, y(v), r##"stroke="#e5e5e5""##);
        text(s, left - 6.0, y(v) + 4.0, 11, "end", "", &format!("{:.0}%", v * 100.0));
    }
    line(s, left, BOTTOM, right, BOTTOM, r##"stroke="#333""##);
    line(s, left, TOP, left, BOTTOM, r##"stroke="#333""##);
    let n = rows.len().max(1) as f64;
    let group = (right - left) / n;
    for (i, r) in rows.iter().enumerate() {
        let bx = left + group * i as f64 + group * 0.15;
        let color = COLORS[i % COLORS.len()];
        rect(s, bx, y(r.hit_rate), group * 0.7, BOTTOM - y(r.hit_rate), color, &format!("{}: hit", r.name));
        text(s, bx + group * 0.35, y(r.hit_rate) - 4.0, 10, "middle", "", &format!("{:.0}%", r.hit_rate * 100.0));
        // Labels may be long: rotate them.
        let lx = bx + group * 0.35;
        text(
            s,
            lx,
            BOTTOM + 12.0,
            10,
            "end",
            &format!(r#" transform="rotate(-35 {lx:.1} {:.1})""#, BOTTOM + 12.0),
            &r.name,
        );
    }
    if let Some(oracle) = rows.first().map(|r| r.oracle_hit_rate) {
        line(s, left, y(oracle), right, y(oracle), r##"stroke="#000" stroke-dasharray="6,4" stroke-width="1.5""##);
        text(s, right, y(oracle) - 5.0, 11, "end", "", &format!("oracle {:.0}%", oracle * 100.0));
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::demo::report::Outcome;

    #[test]
    fn renders_well_formed_svg_with_every_policy() {
        let o = |t: f64| Outcome {
            worker: Some(0),
            ttft_ms: Some(t),
            e2e_ms: Some(t),
            prompt_tokens: 10,
            cached_tokens: 5,
            output_tokens: 1,
            error: None,
        };
        let rows = vec![
            PolicySummary::new("round-robin", &[o(5.0), o(900.0)], 0.8, 1, 1.0, 1.0),
            PolicySummary::new("kvroute <precise> & co", &[o(2.0), o(40.0)], 0.8, 1, 1.0, 1.0),
            PolicySummary::new("empty", &[], 0.8, 1, 1.0, 1.0),
        ];
        let svg = render(&rows, "t", "s & t");
        assert!(svg.starts_with("<svg") && svg.trim_end().ends_with("</svg>"));
        assert!(svg.contains("kvroute &lt;precise&gt; &amp; co"));
        assert!(svg.contains("s &amp; t"));
        assert!(svg.contains("oracle 80%"));
        assert_eq!(svg.matches("<polyline").count(), 2);
        assert!(!svg.contains("NaN") && !svg.contains("inf"));
        assert_eq!(nice_ceiling(730.0), 1000.0);
        assert_eq!(nice_ceiling(1800.0), 2000.0);
    }
}
