//! Results tables (Markdown, aligned for the terminal) and nearest-rank percentiles: the
//! simulator's [`table`], and the pieces the reference worker's demo builds its own table from.

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
    markdown(&COLUMNS, &rows, &[0])
}

/// An aligned Markdown table: a header row of `columns`, then `rows` (one cell per column).
/// Every column is as wide as its widest cell; the columns whose indices are in `left` are
/// left-aligned (text), the others right-aligned (numbers, `---:` in the separator).
pub fn markdown<R: AsRef<[String]>>(columns: &[&str], rows: &[R], left: &[usize]) -> String {
    let widths: Vec<usize> = (0..columns.len())
        .map(|c| {
            rows.iter()
                .filter_map(|r| r.as_ref().get(c))
                .map(|cell| cell.chars().count())
                .chain(std::iter::once(columns[c].chars().count()))
                .max()
                .unwrap_or(0)
        })
        .collect();
    let line = |out: &mut String, cells: &mut dyn Iterator<Item = &str>| {
        out.push('|');
        for (c, cell) in cells.enumerate() {
            let pad = " ".repeat(widths.get(c).copied().unwrap_or(0).saturating_sub(cell.chars().count()));
            if left.contains(&c) {
                out.push_str(&format!(" {cell}{pad} |"));
            } else {
                out.push_str(&format!(" {pad}{cell} |"));
            }
        }
        out.push('\n');
    };
    let mut out = String::new();
    line(&mut out, &mut columns.iter().copied());
    out.push('|');
    for (c, w) in widths.iter().enumerate() {
        if left.contains(&c) {
            out.push_str(&format!(" {} |", "-".repeat(*w)));
        } else {
            out.push_str(&format!(" {}: |", "-".repeat(w.saturating_sub(1))));
        }
    }
    out.push('\n');
    for r in rows {
        line(&mut out, &mut r.as_ref().iter().map(String::as_str));
    }
    out
}

/// The 1-based nearest rank of quantile `q` (0–1, clamped) among `n` sorted values: ⌈q·n⌉,
/// within `1..=n` (1 when `n` is 0).
pub fn nearest_rank(q: f64, n: usize) -> usize {
    ((q.clamp(0.0, 1.0) * n as f64).ceil() as usize).clamp(1, n.max(1))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn markdown_aligns_columns() {
        let rows = [vec!["a".to_owned(), "1".to_owned(), "x".to_owned()], vec!["bbb".into(), "22".into(), "yy".into()]];
        let t = markdown(&["name", "n", "note"], &rows, &[0, 2]);
        assert_eq!(
            t, "| name |  n | note |\n| ---- | -: | ---- |\n| a    |  1 | x    |\n| bbb  | 22 | yy   |\n",
            "{t}"
        );
        assert_eq!(markdown::<Vec<String>>(&["µs"], &[], &[]), "| µs |\n| -: |\n");
    }

    #[test]
    fn nearest_ranks() {
        assert_eq!([0.0, 0.01, 0.5, 0.9, 0.99, 1.0, 2.0].map(|q| nearest_rank(q, 100)), [1, 1, 50, 90, 99, 100, 100]);
        assert_eq!(nearest_rank(0.5, 3), 2);
        assert_eq!(nearest_rank(0.5, 0), 1);
    }
}
