//! The committed C header is what cbindgen generates from the current sources. After changing
//! the C API, regenerate it and commit it:
//! `KVROUTE_BLESS_HEADER=1 cargo test -p kvroute-ffi-header`.
#![allow(clippy::unwrap_used)]

#[test]
fn header_is_up_to_date() {
    let path = kvroute_ffi_header::header_path();
    let fresh = kvroute_ffi_header::generate().unwrap();
    if std::env::var_os("KVROUTE_BLESS_HEADER").is_some() {
        std::fs::write(&path, &fresh).unwrap();
    }
    let committed = std::fs::read_to_string(&path).unwrap_or_default();
    let first_difference = committed.lines().zip(fresh.lines()).take_while(|(a, b)| a == b).count() + 1;
    assert!(
        committed == fresh,
        "{} is out of date (first difference at line {first_difference}): regenerate it with \
         `KVROUTE_BLESS_HEADER=1 cargo test -p kvroute-ffi-header` and commit it",
        path.display()
    );
}
