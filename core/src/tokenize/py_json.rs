//! A JSON writer byte-compatible with Python's `json.dumps` (what transformers' `tojson`
//! filter calls): separators, indentation, `ensure_ascii`, `sort_keys`, and `repr(float)`.

use std::fmt::Write as _;

use minijinja::value::{Value, ValueKind};
use minijinja::ErrorKind;

pub(super) struct JsonOpts {
    pub(super) ensure_ascii: bool,
    pub(super) indent: Option<String>,
    pub(super) item_sep: String,
    pub(super) key_sep: String,
    pub(super) sort_keys: bool,
}

fn json_newline(out: &mut String, opts: &JsonOpts, depth: usize) {
    if let Some(ind) = &opts.indent {
        out.push('\n');
        for _ in 0..depth {
            out.push_str(ind);
        }
    }
}

pub(super) fn write_json(out: &mut String, v: &Value, opts: &JsonOpts, depth: usize) -> Result<(), minijinja::Error> {
    let not_serializable = |what: &str| {
        minijinja::Error::new(ErrorKind::InvalidOperation, format!("tojson: {what} is not JSON serializable"))
    };
    if depth > 512 {
        return Err(not_serializable("a value nested this deep"));
    }
    match v.kind() {
        ValueKind::None => out.push_str("null"),
        ValueKind::Undefined => return Err(not_serializable("undefined")),
        ValueKind::Bool => out.push_str(if v.is_true() { "true" } else { "false" }),
        ValueKind::Number => write_json_number(out, v)?,
        ValueKind::String => write_json_str(out, v.as_str().unwrap_or_default(), opts.ensure_ascii),
        ValueKind::Seq | ValueKind::Iterable => {
            let items: Vec<Value> = v.try_iter()?.collect();
            if items.is_empty() {
                out.push_str("[]");
                return Ok(());
            }
            out.push('[');
            for (i, item) in items.iter().enumerate() {
                if i > 0 {
                    out.push_str(&opts.item_sep);
                }
                json_newline(out, opts, depth + 1);
                write_json(out, item, opts, depth + 1)?;
            }
            json_newline(out, opts, depth);
            out.push(']');
        }
        ValueKind::Map => {
            let mut entries: Vec<(String, Value)> = Vec::new();
            for k in v.try_iter()? {
                let val = v.get_item(&k)?;
                let key = match k.kind() {
                    ValueKind::String => k.as_str().unwrap_or_default().to_owned(),
                    ValueKind::None => "null".to_owned(),
                    ValueKind::Bool => (if k.is_true() { "true" } else { "false" }).to_owned(),
                    ValueKind::Number => {
                        let mut s = String::new();
                        write_json_number(&mut s, &k)?;
                        s
                    }
                    _ => return Err(not_serializable("a map key of this type")),
                };
                entries.push((key, val));
            }
            if opts.sort_keys {
                entries.sort_by(|a, b| a.0.cmp(&b.0));
            }
            if entries.is_empty() {
                out.push_str("{}");
                return Ok(());
            }
            out.push('{');
            for (i, (key, val)) in entries.iter().enumerate() {
                if i > 0 {
                    out.push_str(&opts.item_sep);
                }
                json_newline(out, opts, depth + 1);
                write_json_str(out, key, opts.ensure_ascii);
                out.push_str(&opts.key_sep);
                write_json(out, val, opts, depth + 1)?;
            }
            json_newline(out, opts, depth);
            out.push('}');
        }
        _ => return Err(not_serializable("this value")),
    }
    Ok(())
}

fn write_json_number(out: &mut String, v: &Value) -> Result<(), minijinja::Error> {
    if v.is_integer() {
        let _ = write!(out, "{v}");
        return Ok(());
    }
    let f = f64::try_from(v.clone())?;
    out.push_str(&py_float_repr(f));
    Ok(())
}

/// Python's `repr(float)` (and `json.dumps` of a float): shortest round-trip digits, positional
/// for exponents -4..16, else `d.ddde±XX`.
fn py_float_repr(f: f64) -> String {
    if f.is_nan() {
        return "NaN".to_owned();
    }
    if f.is_infinite() {
        return if f > 0.0 { "Infinity" } else { "-Infinity" }.to_owned();
    }
    let sci = format!("{f:e}"); // e.g. "-1.2345e-7", shortest round-trip digits
    let (mant, exp) = sci.split_once('e').unwrap_or((&sci, "0"));
    let exp: i32 = exp.parse().unwrap_or(0);
    let (neg, mant) = match mant.strip_prefix('-') {
        Some(m) => (true, m),
        None => (false, mant),
    };
    let digits: String = mant.chars().filter(char::is_ascii_digit).collect();
    let mut s = String::new();
    if neg {
        s.push('-');
    }
    if (-4..16).contains(&exp) {
        let n = digits.len() as i32;
        if exp < 0 {
            s.push_str("0.");
            for _ in 0..(-exp - 1) {
                s.push('0');
            }
            s.push_str(&digits);
        } else if exp + 1 >= n {
            s.push_str(&digits);
            for _ in 0..(exp + 1 - n) {
                s.push('0');
            }
            s.push_str(".0");
        } else {
            let (a, b) = digits.split_at((exp + 1) as usize);
            s.push_str(a);
            s.push('.');
            s.push_str(b);
        }
    } else {
        let (a, b) = digits.split_at(1);
        s.push_str(a);
        if !b.is_empty() {
            s.push('.');
            s.push_str(b);
        }
        let _ = write!(s, "e{}{:02}", if exp < 0 { '-' } else { '+' }, exp.abs());
    }
    s
}

fn write_json_str(out: &mut String, s: &str, ensure_ascii: bool) {
    out.push('"');
    for c in s.chars() {
        match c {
            '"' => out.push_str("\\\""),
            '\\' => out.push_str("\\\\"),
            '\n' => out.push_str("\\n"),
            '\r' => out.push_str("\\r"),
            '\t' => out.push_str("\\t"),
            '\u{8}' => out.push_str("\\b"),
            '\u{c}' => out.push_str("\\f"),
            c if (c as u32) < 0x20 => {
                let _ = write!(out, "\\u{:04x}", c as u32);
            }
            c if ensure_ascii && !c.is_ascii() => {
                let mut buf = [0u16; 2];
                for unit in c.encode_utf16(&mut buf) {
                    let _ = write!(out, "\\u{unit:04x}");
                }
            }
            c => out.push(c),
        }
    }
    out.push('"');
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn float_repr_matches_python() {
        for (f, want) in [
            (1.0, "1.0"),
            (0.5, "0.5"),
            (-2.25, "-2.25"),
            (1e-5, "1e-05"),
            (0.0001, "0.0001"),
            (1e16, "1e+16"),
            (1234567890123456.0, "1234567890123456.0"),
            (0.1 + 0.2, "0.30000000000000004"),
            (1.5e300, "1.5e+300"),
            (f64::INFINITY, "Infinity"),
        ] {
            assert_eq!(py_float_repr(f), want, "{f}");
        }
    }
}
