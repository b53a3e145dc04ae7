//! A hand-written SVG chart of a comparison: grouped TTFT p50/p90 bars per policy and a prefix-hit
//! ratio panel, with axes, labels and a legend. No plotting crate; all text is XML-escaped.

use std::fmt::Write;

use crate::sim::PolicyReport;

const WIDTH: f64 = 960.0;
const HEIGHT: f64 = 500.0;
const TOP: f64 = 110.0;
const BOTTOM: f64 = 420.0;
const TTFT_LEFT: f64 = 80.0;
const TTFT_RIGHT: f64 = 600.0;
const HIT_LEFT: f64 = 690.0;
const HIT_RIGHT: f64 = 930.0;
const P50: &str = "#4e79a7";
const P90: &str = "#f28e2b";
const HIT: &str = "#59a14f";

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

/// The smallest 1/2/5 × 10^k at or above `v` (at least 1).
fn nice_ceiling(v: f64) -> f64 {
    if !(v.is_finite() && v > 1.0) {
        return 1.0;
    }
    let mag = 10f64.powf(v.log10().floor());
    for m in [1.0, 2.0, 2.5, 5.0, 10.0] {
        if m * mag >= v {
            return m * mag;
        }
    }
    10.0 * mag
}

fn text(out: &mut String, x: f64, y: f64, size: u32, anchor: &str, extra: &str, s: &str) {
    let _ = writeln!(
        out,
        r#"<text x="{x:.1}" y="{y:.1}" font-size="{size}" text-anchor="{anchor}"{extra}>{}</text>"#,
        escape(s)
    );
}

fn rect(out: &mut String, x: f64, y: f64, w: f64, h: f64, fill: &str, title: &str) {
    let _ = writeln!(
        out,
        r#"<rect x="{x:.1}" y="{y:.1}" width="{w:.1}" height="{h:.1}" fill="{fill}"><title>{}</title></rect>"#,
        escape(title)
    );
}

fn fmt_ms(v: f64) -> String {
    if v >= 100.0 {
        format!("{v:.0}")
    } else {
        format!("{v:.1}")
    }
}

fn clip(s: &str, max_chars: usize) -> String {
    if s.chars().count() <= max_chars {
        s.to_owned()
    } else {
        let mut t: String = s.chars().take(max_chars.saturating_sub(1)).collect();
        t.push('…');
        t
    }
}

/// Render the chart. `title` and up to two `subtitles` lines are shown at the top (escaped,
/// clipped to the chart's width).
pub fn render(reports: &[PolicyReport], title: &str, subtitles: &[&str]) -> String {
    let mut o = String::new();
    let _ = writeln!(
        o,
        r#"<svg xmlns="http://www.w3.org/2000/svg" width="{WIDTH}" height="{HEIGHT}" viewBox="0 0 {WIDTH} {HEIGHT}" font-family="Helvetica, Arial, sans-serif">"#
    );
    let _ = writeln!(o, r#"<rect width="100%" height="100%" fill="white"/>"#);
    text(&mut o, WIDTH / 2.0, 30.0, 20, "middle", r#" font-weight="bold""#, &clip(title, 80));
    for (i, line) in subtitles.iter().take(2).enumerate() {
        text(&mut o, WIDTH / 2.0, 50.0 + 15.0 * i as f64, 11, "middle", r##" fill="#555""##, &clip(line, 165));
    }

    let n = reports.len().max(1) as f64;
    let plot_h = BOTTOM - TOP;

    // TTFT panel.
    let max_ms = nice_ceiling(reports.iter().map(|r| r.ttft_p90_ms.max(r.ttft_p50_ms)).fold(0.0, f64::max) * 1.08);
    text(
        &mut o,
        (TTFT_LEFT + TTFT_RIGHT) / 2.0,
        TOP - 22.0,
        14,
        "middle",
        r#" font-weight="bold""#,
        "Time to first token",
    );
    for i in 0..=5 {
        let v = max_ms * f64::from(i) / 5.0;
        let y = BOTTOM - plot_h * f64::from(i) / 5.0;
        let _ = writeln!(o, r##"<line x1="{TTFT_LEFT}" y1="{y:.1}" x2="{TTFT_RIGHT}" y2="{y:.1}" stroke="#e3e3e3"/>"##);
        let label = if max_ms >= 10.0 { format!("{v:.0}") } else { format!("{v:.1}") };
        text(&mut o, TTFT_LEFT - 6.0, y + 4.0, 11, "end", "", &label);
    }
    let _ = writeln!(
        o,
        r##"<line x1="{TTFT_LEFT}" y1="{TOP}" x2="{TTFT_LEFT}" y2="{BOTTOM}" stroke="#333"/><line x1="{TTFT_LEFT}" y1="{BOTTOM}" x2="{TTFT_RIGHT}" y2="{BOTTOM}" stroke="#333"/>"##
    );
    let ylab = (TOP + BOTTOM) / 2.0;
    text(&mut o, 24.0, ylab, 12, "middle", &format!(r#" transform="rotate(-90 24 {ylab:.1})""#), "TTFT (ms)");
    let group_w = (TTFT_RIGHT - TTFT_LEFT) / n;
    let bar_w = (group_w * 0.32).min(70.0);
    for (i, r) in reports.iter().enumerate() {
        let cx = TTFT_LEFT + group_w * (i as f64 + 0.5);
        for (k, (v, color, label)) in [(r.ttft_p50_ms, P50, "p50"), (r.ttft_p90_ms, P90, "p90")].into_iter().enumerate()
        {
            let h = (v / max_ms * plot_h).clamp(0.0, plot_h);
            let x = cx - bar_w - 2.0 + k as f64 * (bar_w + 4.0);
            rect(&mut o, x, BOTTOM - h, bar_w, h, color, &format!("{} TTFT {label}: {} ms", r.policy, fmt_ms(v)));
            text(&mut o, x + bar_w / 2.0, BOTTOM - h - 5.0, 11, "middle", "", &fmt_ms(v));
        }
        text(&mut o, cx, BOTTOM + 20.0, 13, "middle", "", &r.policy);
        let grey = r##" fill="#666""##;
        text(&mut o, cx, BOTTOM + 35.0, 11, "middle", grey, &format!("p99 {} ms", fmt_ms(r.ttft_p99_ms)));
        text(&mut o, cx, BOTTOM + 49.0, 11, "middle", grey, &format!("imbalance {:.2}x", r.load_imbalance));
    }
    // Legend.
    let lx = TTFT_RIGHT - 150.0;
    for (k, (color, label)) in [(P50, "TTFT p50"), (P90, "TTFT p90")].into_iter().enumerate() {
        let x = lx + k as f64 * 78.0;
        let _ = writeln!(o, r#"<rect x="{x:.1}" y="{:.1}" width="12" height="12" fill="{color}"/>"#, TOP - 12.0);
        text(&mut o, x + 16.0, TOP - 2.0, 11, "start", "", label);
    }

    // Hit-ratio panel.
    text(
        &mut o,
        (HIT_LEFT + HIT_RIGHT) / 2.0,
        TOP - 22.0,
        14,
        "middle",
        r#" font-weight="bold""#,
        "Prefix cache hit ratio",
    );
    for i in 0..=4 {
        let y = BOTTOM - plot_h * f64::from(i) / 4.0;
        let _ = writeln!(o, r##"<line x1="{HIT_LEFT}" y1="{y:.1}" x2="{HIT_RIGHT}" y2="{y:.1}" stroke="#e3e3e3"/>"##);
        text(&mut o, HIT_LEFT - 6.0, y + 4.0, 11, "end", "", &format!("{}%", i * 25));
    }
    let _ = writeln!(
        o,
        r##"<line x1="{HIT_LEFT}" y1="{TOP}" x2="{HIT_LEFT}" y2="{BOTTOM}" stroke="#333"/><line x1="{HIT_LEFT}" y1="{BOTTOM}" x2="{HIT_RIGHT}" y2="{BOTTOM}" stroke="#333"/>"##
    );
    let hx = HIT_LEFT - 44.0;
    text(
        &mut o,
        hx,
        ylab,
        12,
        "middle",
        &format!(r#" transform="rotate(-90 {hx:.1} {ylab:.1})""#),
        "true cached / prompt tokens",
    );
    let hgroup = (HIT_RIGHT - HIT_LEFT) / n;
    let hbar = (hgroup * 0.6).min(60.0);
    for (i, r) in reports.iter().enumerate() {
        let cx = HIT_LEFT + hgroup * (i as f64 + 0.5);
        let h = (r.hit_ratio * plot_h).clamp(0.0, plot_h);
        let pct = format!("{:.1}%", r.hit_ratio * 100.0);
        rect(&mut o, cx - hbar / 2.0, BOTTOM - h, hbar, h, HIT, &format!("{} hit ratio: {pct}", r.policy));
        text(&mut o, cx, BOTTOM - h - 5.0, 11, "middle", "", &pct);
        let _ = writeln!(
            o,
            r#"<text x="{cx:.1}" y="{:.1}" font-size="12" text-anchor="end" transform="rotate(-30 {cx:.1} {:.1})">{}</text>"#,
            BOTTOM + 16.0,
            BOTTOM + 16.0,
            escape(&r.policy)
        );
    }
    text(
        &mut o,
        WIDTH / 2.0,
        HEIGHT - 12.0,
        11,
        "middle",
        r##" fill="#888""##,
        "kvroute-sim · same workload for every policy · TTFT = arrival to end of prefill",
    );
    o.push_str("</svg>\n");
    o
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
        assert_eq!(nice_ceiling(7.0), 10.0);
        assert_eq!(nice_ceiling(180.0), 200.0);
        assert_eq!(nice_ceiling(2100.0), 2500.0);
        assert_eq!(nice_ceiling(500.0), 500.0);
    }
}
