//! The C library's names, and its pkg-config file.
//!
//! The crate's Rust lib is `kvroute_ffi` (the core's is `kvroute`), so cargo writes
//! `libkvroute_ffi.so` and `libkvroute_ffi.a`. Their C names stay `libkvroute.so` and
//! `libkvroute.a`:
//! - the shared library's SONAME is `libkvroute.so` (on macOS its install name is
//!   `@rpath/libkvroute.dylib`), so whatever the file is called, programs linked against it load
//!   `libkvroute.so`; to install it, copy it under that name;
//! - in the output directory (`target/<profile>/`, or `target/<triple>/<profile>/` when
//!   cross-compiling) `libkvroute.so` and `libkvroute.a` are symbolic links to cargo's files, so the
//!   build tree links with `-lkvroute` and runs with `LD_LIBRARY_PATH` pointing there (`cp`
//!   copies the files the links point to).
//!
//! It also writes `kvroute.pc`, the pkg-config file of libkvroute, into that directory, so a C
//! program builds against the build tree with
//! `PKG_CONFIG_PATH=target/release pkg-config --cflags --libs kvroute` (shared) or
//! `... --static ...` (static: `Libs.private` lists the native libraries the Rust static library
//! needs, as `rustc --print native-static-libs` reports them for this target).
//!
//! `libdir` is that output directory and `includedir` is `ffi/include`; to install the library
//! elsewhere, copy the two libraries (as `libkvroute.so` and `libkvroute.a`), the header and this
//! file and edit those two lines.

use std::path::{Path, PathBuf};

/// The C name of the libraries (`lib<NAME>.so`, `lib<NAME>.a`, `-l<NAME>`).
const C_NAME: &str = "kvroute";
/// The crate's `[lib] name` (what cargo names the files).
const RUST_NAME: &str = "kvroute_ffi";

fn main() {
    println!("cargo:rerun-if-changed=build.rs");
    println!("cargo:rerun-if-env-changed=CARGO_FEATURE_ZMQ");
    let os = std::env::var("CARGO_CFG_TARGET_OS").unwrap_or_default();
    // The shared library's own name, recorded by every program linked against it.
    match os.as_str() {
        "macos" | "ios" => println!("cargo:rustc-cdylib-link-arg=-Wl,-install_name,@rpath/lib{C_NAME}.dylib"),
        "windows" => {}
        _ => println!("cargo:rustc-cdylib-link-arg=-Wl,-soname,lib{C_NAME}.so"),
    }
    // Neither is fatal: the libraries still build under cargo's names; only the conveniences of
    // the build tree are missing.
    if let Err(e) = link_c_names(&os) {
        println!("cargo:warning=libkvroute.so / libkvroute.a were not linked to cargo's files: {e}");
    }
    if let Err(e) = write_pc() {
        println!("cargo:warning=kvroute.pc was not written: {e}");
    }
}

/// `OUT_DIR` is `<target>/[<triple>/]<profile>/build/kvroute-ffi-<hash>/out`: the profile
/// directory, where cargo puts `libkvroute_ffi.so` and `libkvroute_ffi.a`, is three levels up.
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

/// `libkvroute.{so,a}` -> `libkvroute_ffi.{so,a}` (relative symbolic links in the profile
/// directory; they resolve once cargo has linked the libraries). Unix hosts only; nothing to do
/// for Windows targets, whose files are `kvroute_ffi.dll` and `kvroute_ffi.lib`.
fn link_c_names(os: &str) -> Result<(), String> {
    let shared = match os {
        "windows" => return Ok(()),
        "macos" | "ios" => "dylib",
        _ => "so",
    };
    let dir = profile_dir()?;
    for ext in [shared, "a"] {
        let (link, target) = (dir.join(format!("lib{C_NAME}.{ext}")), format!("lib{RUST_NAME}.{ext}"));
        if std::fs::read_link(&link).is_ok_and(|t| t == Path::new(&target)) {
            continue;
        }
        // A stale file (e.g. the library of a build from before the rename) or another link.
        if std::fs::symlink_metadata(&link).is_ok() {
            std::fs::remove_file(&link).map_err(|e| format!("{}: {e}", link.display()))?;
        }
        symlink(&target, &link).map_err(|e| format!("{}: {e}", link.display()))?;
    }
    Ok(())
}

#[cfg(unix)]
fn symlink(target: &str, link: &Path) -> std::io::Result<()> {
    std::os::unix::fs::symlink(target, link)
}

#[cfg(not(unix))]
fn symlink(_target: &str, _link: &Path) -> std::io::Result<()> {
    Err(std::io::Error::new(std::io::ErrorKind::Unsupported, "symbolic links need a unix host"))
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
         Libs: -L${{libdir}} -l{C_NAME}\n\
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
