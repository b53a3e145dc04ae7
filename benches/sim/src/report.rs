//! The results table (a Markdown table, aligned for the terminal).

use crate::sim::PolicyReport;

/// Column headers of [`table`].
pub const COLUMNS: [&str; 8] =
    ["policy", "requests", "prefix hit", "TTFT p50 ms", "TTFT p90 ms", "TTFT p99 ms", "imbalance", "route µs"];

/// The cells of one report's row.
pub fn row(r: &PolicyReport) -> [String; 8] {
    [
        r.policy.clone(),
        r.requests.to_string(),
        format!("{:.1}%", r.hit_ratio * 100.0),
        format!("{:.1}", r.ttft_p50_ms),
        format!("{:.1}", r.ttft_p90_ms),
        format!("{:.1}", r.ttft_p99_ms),
        format!("{:.2}x", r.load_imbalance),
        format!("{:.2}", r.mean_route_us),
    ]
}

/// Render the reports as an aligned Markdown table (first column left-aligned, numbers right).
pub fn table(reports: &[PolicyReport]) -> String {
    let rows: Vec<[String; 8]> = reports.iter().map(row).collect();
    let width = |c: usize| {
        rows.iter().map(|r| r[c].chars().count()).chain(std::iter::once(COLUMNS[c].chars().count())).max().unwrap_or(0)
    };
    let widths: Vec<usize> = (0..COLUMNS.len()).map(width).collect();
    let line = |cells: &[String]| {
        let mut s = String::from("|");
        for (c, cell) in cells.iter().enumerate() {
            let pad = widths[c] - cell.chars().count();
            if c == 0 {
                s.push_str(&format!(" {cell}{} |", " ".repeat(pad)));
            } else {
                s.push_str(&format!(" {}{cell} |", " ".repeat(pad)));
            }
        }
        s.push('\n');
        s
    };
    let mut out = line(&COLUMNS.map(str::to_owned));
    out.push('|');
    for (c, w) in widths.iter().enumerate() {
        if c == 0 {
            out.push_str(&format!(" {} |", "-".repeat(*w)));
        } else {
            out.push_str(&format!(" {}: |", "-".repeat(w.saturating_sub(1))));
        }
    }
    out.push('\n');
    for r in &rows {
        out.push_str(&line(r));
    }
    out
}
