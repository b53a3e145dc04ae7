//! Writes `kvroute.pc`, the pkg-config file of libkvroute, next to the libraries it describes
//! (`target/<profile>/`, or `target/<triple>/<profile>/` when cross-compiling), so a C program
//! builds against the build tree with
//! `PKG_CONFIG_PATH=target/release pkg-config --cflags --libs kvroute` (shared) or
//! `... --static ...` (static: `Libs.private` lists the native libraries the Rust static library
//! needs, as `rustc --print native-static-libs` reports them for this target).
//!
//! `libdir` is that output directory and `includedir` is `ffi/include`; to install the library
//! elsewhere, copy the two libraries, the header and this file and edit those two lines.

use std::path::{Path, PathBuf};

fn main() {
    println!("cargo:rerun-if-changed=build.rs");
    println!("cargo:rerun-if-env-changed=CARGO_FEATURE_ZMQ");
    if let Err(e) = write_pc() {
        // Not fatal: the libraries still build; only the convenience file is missing.
        println!("cargo:warning=kvroute.pc was not written: {e}");
    }
}

/// `OUT_DIR` is `<target>/[<triple>/]<profile>/build/kvroute-ffi-<hash>/out`: the profile
/// directory, where cargo puts `libkvroute.so` and `libkvroute.a`, is three levels up.
fn profile_dir() -> Result<PathBuf, String> {
    let out = std::env::var_os("OUT_DIR").ok_or("OUT_DIR is not set")?;
    Path::new(&out).ancestors().nth(3).map(Path::to_path_buf).ok_or_else(|| "unexpected OUT_DIR layout".to_owned())
}

/// The native libraries a program linking `libkvroute.a` needs (`-l` flags), by target.
fn native_static_libs() -> Vec<&'static str> {
    let os = std::env::var("CARGO_CFG_TARGET_OS").unwrap_or_default();
    let env = std::env::var("CARGO_CFG_TARGET_ENV").unwrap_or_default();
    let mut libs = Vec::new();
    // The system libzmq (linked dynamically by the `zmq` feature).
    if std::env::var_os("CARGO_FEATURE_ZMQ").is_some() {
        libs.push("-lzmq");
    }
    // Rust's standard library.
    match (os.as_str(), env.as_str()) {
        ("linux", "gnu") => libs.extend(["-lgcc_s", "-lutil", "-lrt", "-lpthread", "-lm", "-ldl", "-lc"]),
        ("linux", _) => libs.extend(["-lunwind", "-lc"]),
        ("macos", _) => libs.extend(["-framework", "Security", "-liconv", "-lSystem", "-lc", "-lm"]),
        _ => libs.extend(["-lpthread", "-lm", "-ldl", "-lc"]),
    }
    libs
}

fn write_pc() -> Result<(), String> {
    let dir = profile_dir()?;
    let manifest = std::env::var_os("CARGO_MANIFEST_DIR").ok_or("CARGO_MANIFEST_DIR is not set")?;
    let include = Path::new(&manifest).join("include");
    let version = std::env::var("CARGO_PKG_VERSION").unwrap_or_default();
    let pc = format!(
        "libdir={libdir}\n\
         includedir={includedir}\n\
         \n\
         Name: kvroute\n\
         Description: KV-cache-aware routing for LLM serving (the C library of kvroute)\n\
         Version: {version}\n\
         Cflags: -I${{includedir}}\n\
         Libs: -L${{libdir}} -lkvroute\n\
         Libs.private: {private}\n",
        libdir = dir.display(),
        includedir = include.display(),
        private = native_static_libs().join(" "),
    );
    let path = dir.join("kvroute.pc");
    // Unchanged content is not rewritten (keeps the file's time stable for make-like tools).
    if std::fs::read_to_string(&path).ok().as_deref() == Some(pc.as_str()) {
        return Ok(());
    }
    std::fs::write(&path, pc).map_err(|e| format!("{}: {e}", path.display()))
}
