//! Generates the C header of libkvroute, `ffi/include/kvroute.h`, from the sources of the
//! `kvroute-ffi` crate (`ffi/src`) and `ffi/cbindgen.toml`.
//!
//! The header is committed. The test `tests/drift.rs` fails when it differs from what this
//! generates; regenerate it with `KVROUTE_BLESS_HEADER=1 cargo test -p kvroute-ffi-header`.

use std::path::{Path, PathBuf};

/// The `ffi/` directory.
pub fn ffi_dir() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("..")
}

/// The committed header's path.
pub fn header_path() -> PathBuf {
    ffi_dir().join("include/kvroute.h")
}

/// The header as cbindgen generates it now.
///
/// Only the crate's own sources are parsed (no `cargo metadata`): cbindgen starts at
/// `ffi/src/lib.rs` and follows its `mod` declarations, in their order.
pub fn generate() -> Result<String, String> {
    let dir = ffi_dir();
    let config = cbindgen::Config::from_file(dir.join("cbindgen.toml"))?;
    let bindings = cbindgen::Builder::new()
        .with_config(config)
        .with_src(dir.join("src/lib.rs"))
        .generate()
        .map_err(|e| e.to_string())?;
    let mut out = Vec::new();
    bindings.write(&mut out);
    String::from_utf8(out).map_err(|e| e.to_string())
}
