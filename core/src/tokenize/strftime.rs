//! `strftime_now` for chat templates: Python's `datetime.now().strftime(format)` in UTC, on the
//! time the render was given (`ChatOptions::now_unix_s`, never the system clock).

use std::fmt::Write as _;

use minijinja::{ErrorKind, State};

use super::template::NOW_VAR;

pub(super) fn strftime_now(state: &State<'_, '_>, format: String) -> Result<String, minijinja::Error> {
    // The request's time, passed in by the caller: the core reads no clock (sans-IO).
    let now = state.lookup(NOW_VAR).and_then(|v| i64::try_from(v).ok()).ok_or_else(|| {
        minijinja::Error::new(
            ErrorKind::InvalidOperation,
            "strftime_now needs the request's time (ChatOptions::now_unix_s); kvroute reads no clock",
        )
    })?;
    Ok(strftime(&format, now))
}

const MONTHS: [&str; 12] = [
    "January",
    "February",
    "March",
    "April",
    "May",
    "June",
    "July",
    "August",
    "September",
    "October",
    "November",
    "December",
];
const WEEKDAYS: [&str; 7] = ["Monday", "Tuesday", "Wednesday", "Thursday", "Friday", "Saturday", "Sunday"];

/// `(year, month 1-12, day 1-31)` of a day count since 1970-01-01 (proleptic Gregorian).
fn civil_from_days(z: i64) -> (i64, u32, u32) {
    let z = z + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z.rem_euclid(146_097);
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let d = (doy - (153 * mp + 2) / 5 + 1) as u32;
    let m = if mp < 10 { mp + 3 } else { mp - 9 } as u32;
    let y = yoe + era * 400 + i64::from(m <= 2);
    (y, m, d)
}

/// The strftime directives chat templates use (`%d %b %Y`, `%B`, `%A`, `%H:%M`, …) on a Unix time
/// in UTC; a `-` flag drops zero padding (glibc); unknown directives are kept as written.
fn strftime(format: &str, unix_s: i64) -> String {
    let days = unix_s.div_euclid(86_400);
    let secs = unix_s.rem_euclid(86_400);
    let (y, m, d) = civil_from_days(days);
    let (hh, mm, ss) = (secs / 3600, (secs / 60) % 60, secs % 60);
    let wd = (days + 3).rem_euclid(7) as usize; // 1970-01-01 was a Thursday (Monday = 0)
    let is_leap = (y % 4 == 0 && y % 100 != 0) || y % 400 == 0;
    let cum = [0, 31, 59, 90, 120, 151, 181, 212, 243, 273, 304, 334];
    let yday = cum[(m - 1) as usize] + d + u32::from(is_leap && m > 2);
    let month = MONTHS[(m - 1) as usize];
    let mut out = String::with_capacity(format.len() + 16);
    let mut chars = format.chars().peekable();
    while let Some(c) = chars.next() {
        if c != '%' {
            out.push(c);
            continue;
        }
        let no_pad = chars.peek() == Some(&'-');
        if no_pad {
            chars.next();
        }
        let num = |out: &mut String, v: i64, width: usize| {
            if no_pad {
                let _ = write!(out, "{v}");
            } else {
                let _ = write!(out, "{v:0width$}");
            }
        };
        match chars.next() {
            Some('Y') => {
                let _ = write!(out, "{y}");
            }
            Some('y') => num(&mut out, y.rem_euclid(100), 2),
            Some('m') => num(&mut out, i64::from(m), 2),
            Some('d') => num(&mut out, i64::from(d), 2),
            Some('e') => {
                let _ = write!(out, "{d:2}");
            }
            Some('j') => num(&mut out, i64::from(yday), 3),
            Some('H') => num(&mut out, hh, 2),
            Some('I') => num(&mut out, if hh % 12 == 0 { 12 } else { hh % 12 }, 2),
            Some('M') => num(&mut out, mm, 2),
            Some('S') => num(&mut out, ss, 2),
            Some('p') => out.push_str(if hh < 12 { "AM" } else { "PM" }),
            Some('B') => out.push_str(month),
            Some('b') | Some('h') => out.push_str(&month[..3]),
            Some('A') => out.push_str(WEEKDAYS[wd]),
            Some('a') => out.push_str(&WEEKDAYS[wd][..3]),
            Some('u') => num(&mut out, wd as i64 + 1, 1),
            Some('w') => num(&mut out, (wd as i64 + 1) % 7, 1),
            Some('F') => {
                let _ = write!(out, "{y}-{m:02}-{d:02}");
            }
            Some('T') => {
                let _ = write!(out, "{hh:02}:{mm:02}:{ss:02}");
            }
            Some('%') => out.push('%'),
            Some(other) => {
                out.push('%');
                if no_pad {
                    out.push('-');
                }
                out.push(other);
            }
            None => out.push('%'),
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn strftime_matches_python() {
        // 2026-11-29 13:05:09 UTC, a Sunday; python: datetime(2026,11,29,13,5,9).strftime(...)
        let t = 1_795_957_509;
        assert_eq!(strftime("%d %b %Y", t), "29 Nov 2026");
        assert_eq!(strftime("%A %B %-d, %H:%M:%S %p %j %y %%", t), "Sunday November 29, 13:05:09 PM 333 26 %");
        assert_eq!(strftime("%Y-%m-%d %a %I %Q", 0), "1970-01-01 Thu 12 %Q");
        assert_eq!(strftime("%d %b %Y", 951_782_400), "29 Feb 2000");
        assert_eq!(strftime("%F %T", -1), "1969-12-31 23:59:59");
    }
}
