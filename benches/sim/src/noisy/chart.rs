//! The noisy-neighbor chart (the toolkit's SVG writer, [`crate::svg`]), four panels: tenant B's
//! TTFT over time per run (p90 per time bucket, log axis, the burst shaded), B's TTFT p50/p90
//! during the burst per run with tiered priorities against the 1.5x target, tenant A's requests
//! by outcome per run, and the equal-priority run's dispatch shares while both tenants had
//! requests waiting against the 40% target.

use crate::svg::{nice_ceiling, Panel, Svg};

use super::{Priorities, RunSummary, ScenarioConfig, A, B, FAIR_SHARE_TARGET, RUNS, TTFT_TARGET_RATIO};

const WIDTH: f64 = 1400.0;
const HEIGHT: f64 = 580.0;
const TOP: f64 = 100.0;
const BOTTOM: f64 = 440.0;
const TIMELINE: Panel = Panel::new(70.0, 520.0, TOP, BOTTOM);
const B_BARS: Panel = Panel::new(600.0, 880.0, TOP, BOTTOM);
const A_BARS: Panel = Panel::new(940.0, 1140.0, TOP, BOTTOM);
const SHARES: Panel = Panel::new(1200.0, 1370.0, TOP, BOTTOM);
/// Colors of the runs (in [`RUNS`] order; others cycle).
const COLORS: [&str; 5] = ["#59a14f", "#76b7b2", "#e15759", "#4e79a7", "#b07aa1"];
const P50: &str = "#9ecae1";
const P90: &str = "#08519c";
const DONE: &str = "#59a14f";
const SHED: &str = "#f28e2b";
const DROPPED: &str = "#e15759";
const OTHER: &str = "#bab0ac";
const TENANT_COLORS: [&str; 2] = ["#f28e2b", "#4e79a7"];
/// Time buckets of the timeline.
const BUCKETS: usize = 24;

fn color(r: &RunSummary, i: usize) -> &'static str {
    RUNS.iter().position(|s| *s == r.spec).map_or(COLORS[i % COLORS.len()], |k| COLORS[k])
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

/// Render the chart of `runs` (of the scenario `cfg`).
pub fn render(cfg: &ScenarioConfig, runs: &[RunSummary], title: &str, subtitle: &str) -> String {
    let mut s = Svg::new(WIDTH, HEIGHT);
    s.text(WIDTH / 2.0, 30.0, 20, "middle", r#" font-weight="bold""#, title);
    s.text(WIDTH / 2.0, 52.0, 12, "middle", r##" fill="#555""##, subtitle);
    timeline(&mut s, cfg, runs);
    b_bars(&mut s, runs);
    a_bars(&mut s, runs);
    shares(&mut s, runs);
    s.finish()
}

/// p90 of B's TTFT per time bucket, (bucket middle s, ms), buckets without requests left out.
fn buckets(cfg: &ScenarioConfig, r: &RunSummary) -> Vec<(f64, f64)> {
    let width = cfg.duration_s / BUCKETS as f64;
    let mut bins: Vec<Vec<f64>> = vec![Vec::new(); BUCKETS];
    for &(t, v) in &r.b_points {
        let k = ((t / width) as usize).min(BUCKETS - 1);
        bins[k].push(v);
    }
    bins.into_iter()
        .enumerate()
        .filter(|(_, b)| !b.is_empty())
        .map(|(k, mut b)| {
            b.sort_by(f64::total_cmp);
            let v = b[crate::report::nearest_rank(0.9, b.len()) - 1];
            ((k as f64 + 0.5) * width, v)
        })
        .collect()
}

fn timeline(s: &mut Svg, cfg: &ScenarioConfig, runs: &[RunSummary]) {
    let p = TIMELINE;
    p.title(s, 16.0, "tenant B's TTFT p90 over time (log axis)");
    let series: Vec<Vec<(f64, f64)>> = runs.iter().map(|r| buckets(cfg, r)).collect();
    let all = series.iter().flatten().map(|&(_, v)| v).filter(|v| *v > 0.0);
    let (lo, hi) = all.fold((f64::INFINITY, 0.0f64), |(lo, hi), v| (lo.min(v), hi.max(v)));
    let (lo, hi) = if lo.is_finite() && hi > 0.0 { (lo, hi) } else { (1.0, 1000.0) };
    let (lo_e, hi_e) = (lo.log10().floor(), hi.log10().ceil().max(lo.log10().floor() + 1.0));
    let frac = |v: f64| (v.max(1e-9).log10() - lo_e) / (hi_e - lo_e);
    let x = |t: f64| p.left + t / cfg.duration_s.max(1e-9) * (p.right - p.left);
    // The burst.
    let (bx0, bx1) = (x(cfg.burst_start_s), x(cfg.burst_end_s));
    s.rect(bx0, p.top, bx1 - bx0, p.bottom - p.top, "#f3f3f3", "tenant A's burst");
    s.text(
        (bx0 + bx1) / 2.0,
        p.top + 14.0,
        11,
        "middle",
        r##" fill="#777""##,
        &format!("A bursts {:.0}x", cfg.burst_factor),
    );
    let decades = (hi_e - lo_e).round().max(1.0) as u32;
    p.grid(s, decades, |f| fmt_ms(10f64.powf(lo_e + f * (hi_e - lo_e))));
    for k in 0..=4 {
        let t = cfg.duration_s * f64::from(k) / 4.0;
        p.x_grid(s, x(t), &format!("{t:.0}"));
    }
    p.axes(s);
    s.text(p.center(), BOTTOM + 36.0, 12, "middle", "", "arrival time (s)");
    p.y_label(s, 22.0, "TTFT p90 (ms)");
    for (i, (r, pts)) in runs.iter().zip(&series).enumerate() {
        let c = color(r, i);
        let line: Vec<(f64, f64)> = pts.iter().map(|&(t, v)| (x(t), p.y(frac(v)))).collect();
        if !line.is_empty() {
            s.polyline(&line, c, 2, r.spec.name);
        }
        let ly = BOTTOM + 56.0 + (i / 2) as f64 * 18.0;
        let lx = p.left + (i % 2) as f64 * 230.0;
        s.line(lx, ly - 4.0, lx + 24.0, ly - 4.0, &format!(r#"stroke="{c}" stroke-width="3""#));
        s.text(lx + 30.0, ly, 12, "start", "", r.spec.name);
    }
}

fn label_runs(s: &mut Svg, p: Panel, runs: &[RunSummary]) {
    let group = (p.right - p.left) / runs.len().max(1) as f64;
    for (i, r) in runs.iter().enumerate() {
        let (lx, ly) = (p.left + group * (i as f64 + 0.5), p.bottom + 12.0);
        s.text(lx, ly, 10, "end", &format!(r#" transform="rotate(-35 {lx:.1} {ly:.1})""#), r.spec.name);
    }
}

fn b_bars(s: &mut Svg, all: &[RunSummary]) {
    let p = B_BARS;
    p.title(s, 16.0, "B's TTFT during the burst (ms)");
    // The equal-priority run is about fairness (B gets its share, not priority): in the table.
    let runs: Vec<RunSummary> = all.iter().filter(|r| r.spec.priorities == Priorities::Tiered).cloned().collect();
    // The target line: 1.5x the lower of the two no-burst p90s (the stricter).
    let base = runs
        .iter()
        .filter(|r| !r.spec.burst)
        .map(|r| r.tenant(B).burst_ttft_p90_ms)
        .filter(|v| v.is_finite())
        .fold(f64::INFINITY, f64::min);
    let target = Some(base * TTFT_TARGET_RATIO).filter(|v| v.is_finite());
    let max = runs
        .iter()
        .flat_map(|r| [r.tenant(B).burst_ttft_p50_ms, r.tenant(B).burst_ttft_p90_ms])
        .chain(target)
        .filter(|v| v.is_finite())
        .fold(0.0, f64::max);
    let top = nice_ceiling(max * 1.05);
    p.grid(s, 4, |f| fmt_ms(top * f));
    p.axes(s);
    let group = (p.right - p.left) / runs.len().max(1) as f64;
    let bar = group * 0.8 / 2.0;
    for (i, r) in runs.iter().enumerate() {
        let gx = p.left + group * i as f64 + group * 0.1;
        let b = r.tenant(B);
        for (k, (v, c, label)) in
            [(b.burst_ttft_p50_ms, P50, "p50"), (b.burst_ttft_p90_ms, P90, "p90")].into_iter().enumerate()
        {
            if !v.is_finite() {
                continue;
            }
            let (bx, y) = (gx + bar * k as f64, p.y(v / top));
            s.rect(bx, y, bar - 1.0, p.bottom - y, c, &format!("{} B {label}: {v:.1} ms", r.spec.name));
            s.text(bx + bar / 2.0, y - 3.0, 9, "middle", "", &fmt_ms(v));
        }
    }
    if let Some(t) = target {
        let y = p.y(t / top);
        s.line(p.left, y, p.right, y, r##"stroke="#000" stroke-dasharray="6,4" stroke-width="1.5""##);
    }
    for (k, (c, label)) in [(P50, "p50"), (P90, "p90")].into_iter().enumerate() {
        let lx = p.left + 10.0 + k as f64 * 56.0;
        s.rect(lx, p.top + 4.0, 12.0, 12.0, c, label);
        s.text(lx + 16.0, p.top + 14.0, 11, "start", "", label);
    }
    if target.is_some() {
        let lx = p.left + 128.0;
        s.line(
            lx,
            p.top + 10.0,
            lx + 22.0,
            p.top + 10.0,
            r##"stroke="#000" stroke-dasharray="6,4" stroke-width="1.5""##,
        );
        s.text(lx + 26.0, p.top + 14.0, 11, "start", "", &format!("{TTFT_TARGET_RATIO}x the lower no-burst p90"));
    }
    label_runs(s, p, &runs);
}

fn a_bars(s: &mut Svg, runs: &[RunSummary]) {
    let p = A_BARS;
    p.title(s, 16.0, "tenant A's requests");
    let max = runs.iter().map(|r| r.tenant(A).requests).max().unwrap_or(0) as f64;
    let top = nice_ceiling(max.max(1.0));
    p.grid(s, 4, |f| format!("{:.0}", top * f));
    p.axes(s);
    let group = (p.right - p.left) / runs.len().max(1) as f64;
    for (i, r) in runs.iter().enumerate() {
        let a = r.tenant(A);
        let bx = p.left + group * i as f64 + group * 0.2;
        let other = a.requests.saturating_sub(a.completed + a.shed + a.dropped);
        let mut acc = 0.0;
        for (n, c, label) in [
            (a.completed, DONE, "completed"),
            (a.shed, SHED, "shed"),
            (a.dropped, DROPPED, "dropped"),
            (other, OTHER, "other"),
        ] {
            if n == 0 {
                continue;
            }
            let (y0, y1) = (p.y(acc / top), p.y((acc + n as f64) / top));
            s.rect(bx, y1, group * 0.6, y0 - y1, c, &format!("{}: A {label} {n}", r.spec.name));
            acc += n as f64;
        }
        s.text(bx + group * 0.3, p.y(acc / top) - 3.0, 9, "middle", "", &format!("{}", a.completed));
    }
    for (k, (c, label)) in [(DONE, "completed"), (SHED, "shed"), (DROPPED, "dropped")].into_iter().enumerate() {
        let ly = p.top + 10.0 + k as f64 * 15.0;
        s.rect(p.right - 70.0, ly - 9.0, 10.0, 10.0, c, label);
        s.text(p.right - 56.0, ly, 10, "start", "", label);
    }
    label_runs(s, p, runs);
}

fn shares(s: &mut Svg, all: &[RunSummary]) {
    let p = SHARES;
    p.title(s, 16.0, "fair shares");
    s.text(p.center(), p.top - 3.0, 10, "middle", r##" fill="#555""##, "dispatches while both tenants waited");
    p.grid(s, 4, |f| format!("{:.0}%", f * 100.0));
    p.axes(s);
    // Equal priorities only: with tiered ones the higher band goes first by design.
    let runs: Vec<RunSummary> = all.iter().filter(|r| r.spec.priorities == Priorities::Equal).cloned().collect();
    let runs = &runs[..];
    let group = (p.right - p.left) / runs.len().max(1) as f64;
    let bar = (group * 0.8 / 2.0).min(40.0);
    for (i, r) in runs.iter().enumerate() {
        if r.contended_dispatches == 0 {
            continue;
        }
        let gx = p.left + group * (i as f64 + 0.5) - bar;
        for (t, c) in TENANT_COLORS.iter().enumerate() {
            let v = r.contended_share[t];
            if !v.is_finite() {
                continue;
            }
            let (bx, y) = (gx + bar * t as f64, p.y(v));
            s.rect(
                bx,
                y,
                bar - 1.0,
                p.bottom - y,
                c,
                &format!("{}: {} {:.0}%", r.spec.name, super::TENANTS[t], v * 100.0),
            );
            s.text(bx + bar / 2.0, y - 3.0, 9, "middle", "", &format!("{:.0}", v * 100.0));
        }
    }
    let y = p.y(FAIR_SHARE_TARGET);
    s.line(p.left, y, p.right, y, r##"stroke="#000" stroke-dasharray="6,4" stroke-width="1.5""##);
    s.text(p.left + 4.0, y - 4.0, 10, "start", "", &format!("target {:.0}%", FAIR_SHARE_TARGET * 100.0));
    for (t, c) in TENANT_COLORS.iter().enumerate() {
        let lx = p.left + 8.0 + t as f64 * 80.0;
        s.rect(lx, p.top + 8.0, 10.0, 10.0, c, super::TENANTS[t]);
        s.text(lx + 14.0, p.top + 17.0, 10, "start", "", super::TENANTS[t]);
    }
    label_runs(s, p, runs);
}
