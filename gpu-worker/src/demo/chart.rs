//! The comparison chart: a hand-written SVG (the simulator toolkit's chart writer,
//! `kvroute_sim::svg`; no plotting crate, no system dependency) with three panels: TTFT CDF per
//! policy (log time axis), TTFT p50/p90/p99 bars, and prefix-hit rate per policy against the
//! oracle. All text is XML-escaped.

use kvroute_sim::svg::{nice_ceiling, Panel, Svg};

use super::report::PolicySummary;

const WIDTH: f64 = 1280.0;
const HEIGHT: f64 = 540.0;
const TOP: f64 = 96.0;
const BOTTOM: f64 = 440.0;
const CDF: Panel = Panel::new(70.0, 520.0, TOP, BOTTOM);
const BARS: Panel = Panel::new(600.0, 960.0, TOP, BOTTOM);
const HITS: Panel = Panel::new(1030.0, 1250.0, TOP, BOTTOM);
/// Line colors per policy (cycled).
const COLORS: [&str; 6] = ["#e15759", "#f28e2b", "#4e79a7", "#59a14f", "#b07aa1", "#76b7b2"];
/// Percentile bar shades.
const SHADES: [&str; 3] = ["#9ecae1", "#4292c6", "#08519c"];

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

fn percent(f: f64) -> String {
    format!("{:.0}%", f * 100.0)
}

/// Render the chart. `title` and `subtitle` go on top.
pub(crate) fn render(rows: &[PolicySummary], title: &str, subtitle: &str) -> String {
    let mut s = Svg::new(WIDTH, HEIGHT);
    s.text(WIDTH / 2.0, 30.0, 20, "middle", r#" font-weight="bold""#, title);
    s.text(WIDTH / 2.0, 52.0, 12, "middle", r##" fill="#555""##, subtitle);
    cdf_panel(&mut s, rows);
    bar_panel(&mut s, rows);
    hit_panel(&mut s, rows);
    s.finish()
}

fn cdf_panel(s: &mut Svg, rows: &[PolicySummary]) {
    let p = CDF;
    p.title(s, 16.0, "TTFT CDF (log time axis)");
    let all = rows.iter().flat_map(|r| r.ttft_sorted_ms.iter().copied()).filter(|v| *v > 0.0);
    let (lo, hi) = all.fold((f64::INFINITY, 0.0f64), |(lo, hi), v| (lo.min(v), hi.max(v)));
    let (lo, hi) = if lo.is_finite() && hi > 0.0 { (lo, hi) } else { (1.0, 1000.0) };
    let (lo_exp, hi_exp) = (lo.log10().floor(), hi.log10().ceil().max(lo.log10().floor() + 1.0));
    let x = |v: f64| p.left + (v.max(1e-9).log10() - lo_exp) / (hi_exp - lo_exp) * (p.right - p.left);
    // Grid.
    p.grid(s, 4, percent);
    let mut e = lo_exp;
    while e <= hi_exp + 1e-9 {
        let v = 10f64.powf(e);
        p.x_grid(s, x(v), &fmt_ms(v));
        e += 1.0;
    }
    p.axes(s);
    s.text(p.center(), BOTTOM + 36.0, 12, "middle", "", "time to first token (ms)");
    for (i, r) in rows.iter().enumerate() {
        let color = COLORS[i % COLORS.len()];
        // Requests that never got a token keep the curve below 100%.
        let n = r.requests;
        if r.ttft_sorted_ms.is_empty() {
            continue;
        }
        let mut pts = Vec::with_capacity(2 * r.ttft_sorted_ms.len());
        let mut prev_q = 0.0;
        for (k, v) in r.ttft_sorted_ms.iter().enumerate() {
            let q = (k + 1) as f64 / n as f64;
            pts.extend([(x(*v), p.y(prev_q)), (x(*v), p.y(q))]);
            prev_q = q;
        }
        s.polyline(&pts, color, 2, &r.name);
        // Legend.
        let ly = TOP + 14.0 + i as f64 * 18.0;
        s.line(p.right - 150.0, ly - 4.0, p.right - 126.0, ly - 4.0, &format!(r#"stroke="{color}" stroke-width="3""#));
        s.text(p.right - 120.0, ly, 12, "start", "", &r.name);
    }
}

fn bar_panel(s: &mut Svg, rows: &[PolicySummary]) {
    let p = BARS;
    p.title(s, 16.0, "TTFT p50 / p90 / p99 (ms)");
    let max = rows
        .iter()
        .flat_map(|r| [r.ttft(0.99), r.ttft_sorted_ms.last().copied().unwrap_or(0.0)])
        .filter(|v| v.is_finite())
        .fold(0.0, f64::max);
    let top = nice_ceiling(max);
    let y = |v: f64| p.y(v / top);
    p.grid(s, 4, |f| fmt_ms(top * f));
    p.axes(s);
    let n = rows.len().max(1) as f64;
    let group = (p.right - p.left) / n;
    let bar = group * 0.8 / 3.0;
    for (i, r) in rows.iter().enumerate() {
        let gx = p.left + group * i as f64 + group * 0.1;
        for (k, (q, label)) in [(0.5, "p50"), (0.9, "p90"), (0.99, "p99")].into_iter().enumerate() {
            let v = r.ttft(q);
            let bx = gx + bar * k as f64;
            if v == f64::INFINITY {
                // Unfinished: a full-height grey bar.
                s.rect(bx, TOP, bar - 1.0, BOTTOM - TOP, "#d9d9d9", &format!("{} {label}: unfinished", r.name));
                s.text(bx + bar / 2.0, TOP - 3.0, 9, "middle", "", "∞");
                continue;
            }
            if !v.is_finite() {
                continue;
            }
            s.rect(bx, y(v), bar - 1.0, BOTTOM - y(v), SHADES[k], &format!("{} {label}: {v:.1} ms", r.name));
            s.text(bx + bar / 2.0, y(v) - 3.0, 9, "middle", "", &fmt_ms(v));
        }
        s.text(gx + group * 0.4, BOTTOM + 16.0, 11, "middle", "", &r.name);
    }
    for (k, label) in ["p50", "p90", "p99"].into_iter().enumerate() {
        let lx = p.left + 10.0 + k as f64 * 60.0;
        s.rect(lx, TOP + 4.0, 12.0, 12.0, SHADES[k], label);
        s.text(lx + 16.0, TOP + 14.0, 11, "start", "", label);
    }
}

fn hit_panel(s: &mut Svg, rows: &[PolicySummary]) {
    let p = HITS;
    p.title(s, 16.0, "prefix-cache hit rate");
    p.grid(s, 4, percent);
    p.axes(s);
    let n = rows.len().max(1) as f64;
    let group = (p.right - p.left) / n;
    for (i, r) in rows.iter().enumerate() {
        let bx = p.left + group * i as f64 + group * 0.15;
        let color = COLORS[i % COLORS.len()];
        let y = p.y(r.hit_rate);
        s.rect(bx, y, group * 0.7, BOTTOM - y, color, &format!("{}: hit", r.name));
        s.text(bx + group * 0.35, y - 4.0, 10, "middle", "", &percent(r.hit_rate));
        // Labels may be long: rotate them.
        let (lx, ly) = (bx + group * 0.35, BOTTOM + 12.0);
        s.text(lx, ly, 10, "end", &format!(r#" transform="rotate(-35 {lx:.1} {ly:.1})""#), &r.name);
    }
    if let Some(oracle) = rows.first().map(|r| r.oracle_hit_rate) {
        let y = p.y(oracle);
        s.line(p.left, y, p.right, y, r##"stroke="#000" stroke-dasharray="6,4" stroke-width="1.5""##);
        s.text(p.right, y - 5.0, 11, "end", "", &format!("oracle {:.0}%", oracle * 100.0));
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
    }
}
