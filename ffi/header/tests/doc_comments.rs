//! Every function the header declares carries a doc comment that states ownership, NULL
//! behaviour and thread safety (the contract of the C API: a reader of `kvroute.h` alone can
//! use each function correctly).
#![allow(clippy::unwrap_used)]

/// (function name, its doc comment) for every function declaration in the header.
fn functions(header: &str) -> Vec<(String, String)> {
    let lines: Vec<&str> = header.lines().collect();
    let mut out = Vec::new();
    for (i, line) in lines.iter().enumerate() {
        let declaration = !line.is_empty()
            && !line.starts_with(|c: char| c.is_whitespace() || matches!(c, '/' | '#' | '}' | '{' | '*'))
            && !line.starts_with("typedef")
            && !line.starts_with("struct")
            && !line.starts_with("extern");
        // The identifier right before the first `(`.
        let Some(paren) = line.find('(').filter(|_| declaration) else { continue };
        let name = line[..paren].rsplit(|c: char| !(c.is_ascii_alphanumeric() || c == '_')).next().unwrap_or("");
        if !name.starts_with("kvroute_") {
            continue;
        }
        let doc: Vec<&str> = lines[..i].iter().rev().take_while(|l| l.starts_with("//")).copied().collect();
        let doc: Vec<&str> = doc.into_iter().rev().collect();
        out.push((name.to_owned(), doc.join("\n")));
    }
    out
}

#[test]
fn every_function_states_ownership_null_and_threads() {
    let header = std::fs::read_to_string(kvroute_ffi_header::header_path()).unwrap();
    let functions = functions(&header);
    assert!(functions.len() >= 60, "only {} functions found", functions.len());
    let mut missing = Vec::new();
    for (name, doc) in &functions {
        for (what, needle) in [("ownership", "Ownership"), ("NULL behaviour", "NULL"), ("thread safety", "hread")] {
            if !doc.contains(needle) {
                missing.push(format!("{name}: no {what}"));
            }
        }
    }
    assert!(missing.is_empty(), "doc comments incomplete:\n{}", missing.join("\n"));
}

#[test]
fn the_parser_sees_a_missing_statement() {
    let header = "// Does things. NULL: fine. Thread safety: any.\nint kvroute_x_y(int a);\n";
    let f = functions(header);
    assert_eq!(f.len(), 1);
    assert_eq!(f[0].0, "kvroute_x_y");
    assert!(!f[0].1.contains("Ownership"));
}
