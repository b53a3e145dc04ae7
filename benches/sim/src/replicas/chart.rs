//! The replicas chart (the toolkit's SVG writer, [`crate::svg`]), four panels: the hit rate
//! relative to one router against the number of replicas, sync off and on, with the 0.95 target
//! and the peers' no-sync figure; TTFT p90 against the number of replicas; the kill + restart
//! timeline (the restarted replica's hit rate per window against the others', with and without
//! the stream replay); the bus-outage timeline (the fleet's hit rate per window against the same
//! run without the outage).

use crate::svg::{nice_ceiling, Panel, Svg};

use super::{Fault, RunSummary, Window, PEER_NO_SYNC_RATIO, SYNC_TARGET};

const WIDTH: f64 = 1400.0;
const HEIGHT: f64 = 560.0;
const TOP: f64 = 100.0;
const BOTTOM: f64 = 430.0;
const RELATIVE: Panel = Panel::new(70.0, 350.0, TOP, BOTTOM);
const TTFT: Panel = Panel::new(430.0, 650.0, TOP, BOTTOM);
const KILL: Panel = Panel::new(730.0, 1030.0, TOP, BOTTOM);
const OUTAGE: Panel = Panel::new(1090.0, 1370.0, TOP, BOTTOM);
const SYNC: &str = "#59a14f";
const NO_SYNC: &str = "#e15759";
const PEER: &str = "#888888";
const REPLICA: &str = "#4e79a7";
const NO_REPLAY: &str = "#f28e2b";
const FLEET: &str = "#59a14f";
const BASELINE: &str = "#bab0ac";
const DOWN: &str = "#fde0dd";
/// Seconds shown before the fault and after its end in the timelines.
const BEFORE_S: f64 = 20.0;
/// Top of the relative hit-rate axis.
const REL_MAX: f64 = 1.2;
const AFTER_S: f64 = 30.0;

/// Render the chart of `runs`.
pub fn render(runs: &[RunSummary], title: &str, subtitle: &str) -> String {
    let mut s = Svg::new(WIDTH, HEIGHT);
    s.text(WIDTH / 2.0, 30.0, 20, "middle", r#" font-weight="bold""#, title);
    s.text(WIDTH / 2.0, 52.0, 12, "middle", r##" fill="#555""##, subtitle);
    let counts = counts(runs);
    relative(&mut s, runs, &counts);
    ttft(&mut s, runs, &counts);
    kill(&mut s, runs);
    outage(&mut s, runs);
    s.text(
        WIDTH / 2.0,
        HEIGHT - 14.0,
        11,
        "middle",
        r##" fill="#888""##,
        "kvroute-sim · virtual time, seeded · hit rate = true cached / prompt tokens at the engine each request went to",
    );
    s.finish()
}

fn counts(runs: &[RunSummary]) -> Vec<u32> {
    let mut c: Vec<u32> = runs.iter().filter(|r| r.spec.fault == Fault::None).map(|r| r.spec.replicas).collect();
    c.sort_unstable();
    c.dedup();
    c
}

fn x_of(p: &Panel, counts: &[u32], n: u32) -> f64 {
    let k = counts.iter().position(|&c| c == n).unwrap_or(0) as f64;
    let slots = counts.len().max(1) as f64;
    p.left + (p.right - p.left) * (k + 0.5) / slots
}

fn series(runs: &[RunSummary], sync: bool, value: impl Fn(&RunSummary) -> Option<f64>) -> Vec<(u32, f64)> {
    let mut v: Vec<(u32, f64)> = runs
        .iter()
        .filter(|r| r.spec.fault == Fault::None && r.spec.sync == sync)
        .filter_map(|r| Some((r.spec.replicas, value(r)?)))
        .collect();
    v.sort_by_key(|x| x.0);
    v.dedup_by_key(|x| x.0);
    v
}

fn marker(s: &mut Svg, x: f64, y: f64, color: &str, title: &str) {
    s.rect(x - 4.0, y - 4.0, 8.0, 8.0, color, title);
}

fn legend(s: &mut Svg, p: &Panel, items: &[(&str, &str)]) {
    for (k, (color, label)) in items.iter().enumerate() {
        let y = p.bottom + 52.0 + 15.0 * k as f64;
        s.rect(p.left, y - 9.0, 12.0, 10.0, color, label);
        s.text(p.left + 17.0, y, 11, "start", "", label);
    }
}

fn relative(s: &mut Svg, runs: &[RunSummary], counts: &[u32]) {
    let p = RELATIVE;
    p.title(s, 16.0, "hit rate relative to one router");
    p.grid(s, 6, |f| format!("{:.1}", f * REL_MAX));
    p.axes(s);
    p.y_label(s, p.left - 40.0, "hit rate / single router's");
    for &n in counts {
        p.x_grid(s, x_of(&p, counts, n), &n.to_string());
    }
    s.text(p.center(), p.bottom + 32.0, 11, "middle", r##" fill="#555""##, "router replicas");
    let ty = p.y(SYNC_TARGET / REL_MAX);
    s.line(p.left, ty, p.right, ty, r##"stroke="#333" stroke-dasharray="5 4""##);
    s.text(p.right - 4.0, ty + 13.0, 10, "end", "", &format!("target {SYNC_TARGET} with sync"));
    for (sync, color, name) in [(false, NO_SYNC, "no sync"), (true, SYNC, "sync")] {
        let v = series(runs, sync, |r| r.relative);
        let pts: Vec<(f64, f64)> = v.iter().map(|&(n, y)| (x_of(&p, counts, n), p.y(y / REL_MAX))).collect();
        s.polyline(&pts, color, 2, name);
        for (&(n, y), &(px, py)) in v.iter().zip(&pts) {
            if !sync && n == 1 {
                continue;
            }
            marker(s, px, py, color, &format!("{n} replicas, {name}: {y:.3}"));
            let dy = if sync { -8.0 } else { 16.0 };
            s.text(px, py + dy, 10, "middle", "", &format!("{y:.2}"));
        }
    }
    if counts.contains(&8) {
        let (px, py) = (x_of(&p, counts, 8) + 12.0, p.y(PEER_NO_SYNC_RATIO / REL_MAX));
        marker(s, px, py, PEER, &format!("peers: {PEER_NO_SYNC_RATIO} at 8 gateways without sync"));
        s.text(px - 8.0, py + 16.0, 10, "end", r##" fill="#666""##, "peers, no sync");
    }
    legend(s, &p, &[(SYNC, "sync over the bus"), (NO_SYNC, "no sync"), (PEER, "peers without sync (0.66 at 8)")]);
}

fn ttft(s: &mut Svg, runs: &[RunSummary], counts: &[u32]) {
    let p = TTFT;
    let max = nice_ceiling(runs.iter().map(|r| r.ttft_p90_ms).fold(0.0, f64::max) * 1.1).max(1.0);
    p.title(s, 16.0, "TTFT p90");
    p.grid(s, 5, |f| format!("{:.0}", f * max));
    p.axes(s);
    p.y_label(s, p.left - 40.0, "ms");
    for &n in counts {
        p.x_grid(s, x_of(&p, counts, n), &n.to_string());
    }
    s.text(p.center(), p.bottom + 32.0, 11, "middle", r##" fill="#555""##, "router replicas");
    for (sync, color, name) in [(false, NO_SYNC, "no sync"), (true, SYNC, "sync")] {
        let v = series(runs, sync, |r| Some(r.ttft_p90_ms));
        let pts: Vec<(f64, f64)> = v.iter().map(|&(n, y)| (x_of(&p, counts, n), p.y(y / max))).collect();
        s.polyline(&pts, color, 2, name);
        for (&(n, y), &(px, py)) in v.iter().zip(&pts) {
            marker(s, px, py, color, &format!("{n} replicas, {name}: TTFT p90 {y:.0} ms"));
            s.text(px, py - 8.0, 10, "middle", "", &format!("{y:.0}"));
        }
    }
    legend(s, &p, &[(SYNC, "sync"), (NO_SYNC, "no sync")]);
}

/// The timeline's x range, s, around a fault run's fault.
fn range(r: &RunSummary) -> Option<(f64, f64)> {
    let f = r.fault.as_ref()?;
    Some(((f.start_s - BEFORE_S).max(0.0), f.end_s + AFTER_S))
}

fn timeline_axes(s: &mut Svg, p: &Panel, r: &RunSummary, lo: f64, hi: f64, title: &str) {
    p.title(s, 16.0, title);
    let x = |t: f64| p.left + (p.right - p.left) * (t - lo) / (hi - lo).max(1e-9);
    if let Some(f) = &r.fault {
        s.rect(x(f.start_s), p.top, x(f.end_s) - x(f.start_s), p.bottom - p.top, DOWN, "the fault");
    }
    p.grid(s, 5, |f| format!("{:.0}%", f * 100.0));
    p.axes(s);
    p.y_label(s, p.left - 44.0, "hit rate per 1-s window");
    let step = if hi - lo > 60.0 { 20.0 } else { 10.0 };
    let origin = r.fault.as_ref().map_or(lo, |f| f.start_s);
    let mut t = origin - (((origin - lo) / step).floor() * step);
    while t <= hi + 1e-9 {
        p.x_grid(s, x(t), &format!("{:+.0}", t - origin));
        t += step;
    }
    s.text(p.center(), p.bottom + 32.0, 11, "middle", r##" fill="#555""##, "s from the fault's start");
}

/// A series of `windows` (`v` of each) in `color`, `width` px.
struct Series<'a> {
    color: &'a str,
    width: u32,
    name: &'a str,
}

fn line(
    s: &mut Svg,
    p: &Panel,
    windows: &[Window],
    (lo, hi): (f64, f64),
    k: &Series<'_>,
    v: impl Fn(&Window) -> Option<f64>,
) {
    let (color, name) = (k.color, k.name);
    let x = |t: f64| p.left + (p.right - p.left) * (t - lo) / (hi - lo).max(1e-9);
    // One polyline per run of windows with a value (gaps where there is none).
    let mut seg: Vec<(f64, f64)> = Vec::new();
    for w in windows.iter().filter(|w| w.t_s >= lo && w.t_s + 1.0 <= hi) {
        match v(w) {
            Some(h) => seg.push((x(w.t_s + 0.5), p.y(h))),
            None => {
                if seg.len() > 1 {
                    s.polyline(&seg, color, k.width, name);
                }
                seg.clear();
            }
        }
    }
    if seg.len() > 1 {
        s.polyline(&seg, color, k.width, name);
    }
}

fn kill(s: &mut Svg, runs: &[RunSummary]) {
    let p = KILL;
    let Some(r) = runs.iter().find(|r| r.spec.fault == Fault::KillRestart) else { return };
    let Some((lo, hi)) = range(r) else { return };
    timeline_axes(s, &p, r, lo, hi, "kill router-0, restart it 5 s later");
    let others = Series { color: FLEET, width: 2, name: "the other replicas" };
    line(s, &p, &r.windows, (lo, hi), &others, |w| w.others);
    if let Some(nr) = runs.iter().find(|r| r.spec.fault == Fault::KillRestartNoReplay) {
        let k = Series { color: NO_REPLAY, width: 2, name: "router-0 restarted without the replay" };
        line(s, &p, &nr.windows, (lo, hi), &k, |w| w.replica);
    }
    let k = Series { color: REPLICA, width: 2, name: "router-0 (restarted with the stream replay)" };
    line(s, &p, &r.windows, (lo, hi), &k, |w| w.replica);
    if let Some(f) = &r.fault {
        let text = match f.recovery_s {
            Some(v) => format!("back within 10% {v:.0} s after the restart"),
            None => "not back within the run".to_owned(),
        };
        s.text(p.center(), p.top + 14.0, 11, "middle", "", &text);
    }
    legend(
        s,
        &p,
        &[
            (REPLICA, "router-0, replaying the stream"),
            (NO_REPLAY, "router-0, live batches only"),
            (FLEET, "the other replicas"),
        ],
    );
}

fn outage(s: &mut Svg, runs: &[RunSummary]) {
    let p = OUTAGE;
    let Some(r) = runs.iter().find(|r| r.spec.fault == Fault::BusOutage) else { return };
    let Some((lo, hi)) = range(r) else { return };
    timeline_axes(s, &p, r, lo, hi, "bus outage (5 s)");
    let base = Series { color: BASELINE, width: 6, name: "the same run without the outage" };
    line(s, &p, &r.windows, (lo, hi), &base, |w| w.baseline);
    let fleet = Series { color: FLEET, width: 2, name: "the fleet, with the outage" };
    line(s, &p, &r.windows, (lo, hi), &fleet, |w| w.fleet);
    let lost = r.requests - r.served;
    s.text(p.center(), p.top + 14.0, 11, "middle", "", &format!("{lost} of {} requests not served", r.requests));
    legend(s, &p, &[(FLEET, "fleet, bus down"), (BASELINE, "same run, no outage")]);
}
