//! Finding (and if needed building) the kvroute filter's wasm.

use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::OnceLock;

use crate::error::HostError;
use crate::host::{Host, Plugin};

/// Environment variable: path of a prebuilt filter `.wasm` to use as is (no build).
pub const FILTER_WASM_ENV: &str = "KVROUTE_FILTER_WASM";
/// Environment variable: when set (to anything), never run cargo; use the wasm already built.
pub const FILTER_NO_BUILD_ENV: &str = "KVROUTE_FILTER_NO_BUILD";

/// The workspace root (this crate lives in `wasm-filter/host`).
fn workspace_root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("..").join("..")
}

/// The filter's artifact name from `wasm-filter/Cargo.toml`: `[lib] name` (or the package name with
/// `-` as `_`) + `.wasm`.
fn artifact_name(manifest: &str) -> Option<String> {
    let mut section = "";
    let mut lib_name = None;
    let mut package_name = None;
    for line in manifest.lines() {
        let line = line.trim();
        if line.starts_with('[') {
            section = line;
            continue;
        }
        let Some((key, value)) = line.split_once('=') else { continue };
        let value = value.trim().trim_matches('"').to_string();
        match (section, key.trim()) {
            ("[lib]", "name") => lib_name = Some(value),
            ("[package]", "name") => package_name = Some(value),
            _ => {}
        }
    }
    lib_name.or_else(|| package_name.map(|n| n.replace('-', "_"))).map(|n| format!("{n}.wasm"))
}

fn package_name(manifest: &str) -> Option<String> {
    let mut in_package = false;
    for line in manifest.lines() {
        let line = line.trim();
        if line.starts_with('[') {
            in_package = line == "[package]";
            continue;
        }
        if let Some((key, value)) = line.split_once('=') {
            if in_package && key.trim() == "name" {
                return Some(value.trim().trim_matches('"').to_string());
            }
        }
    }
    None
}

/// Path of the kvroute filter wasm, building it first unless told not to.
///
/// Order: `$KVROUTE_FILTER_WASM` if set; else `cargo build -p <filter package> --target
/// wasm32-wasip1 --profile wasm-release` in the workspace (a no-op when up to date; skipped when
/// `$KVROUTE_FILTER_NO_BUILD` is set), and the artifact
/// `<target dir>/wasm32-wasip1/wasm-release/<lib name>.wasm` (target dir: `$CARGO_TARGET_DIR` or
/// `<workspace>/target`). The result is computed once per process.
pub fn kvroute_filter_wasm_path() -> Result<PathBuf, HostError> {
    static PATH: OnceLock<Result<PathBuf, String>> = OnceLock::new();
    PATH.get_or_init(find_or_build).clone().map_err(HostError::Filter)
}

fn find_or_build() -> Result<PathBuf, String> {
    if let Some(path) = std::env::var_os(FILTER_WASM_ENV) {
        let path = PathBuf::from(path);
        return if path.is_file() {
            Ok(path)
        } else {
            Err(format!("${FILTER_WASM_ENV} = {} is no file", path.display()))
        };
    }
    let root = workspace_root();
    let manifest_path = root.join("wasm-filter").join("Cargo.toml");
    let manifest = std::fs::read_to_string(&manifest_path)
        .map_err(|e| format!("{}: {e} (the filter crate is not there yet?)", manifest_path.display()))?;
    let artifact = artifact_name(&manifest).ok_or_else(|| format!("{}: no package name", manifest_path.display()))?;
    let package = package_name(&manifest).ok_or_else(|| format!("{}: no package name", manifest_path.display()))?;
    let target_dir = std::env::var_os("CARGO_TARGET_DIR").map(PathBuf::from).unwrap_or_else(|| root.join("target"));
    let path = target_dir.join("wasm32-wasip1").join("wasm-release").join(&artifact);
    if std::env::var_os(FILTER_NO_BUILD_ENV).is_none() {
        let cargo = std::env::var_os("CARGO").unwrap_or_else(|| "cargo".into());
        let output = Command::new(cargo)
            .current_dir(&root)
            .args(["build", "--quiet", "-p", &package, "--target", "wasm32-wasip1", "--profile", "wasm-release"])
            .output();
        match output {
            Ok(out) if out.status.success() => {}
            Ok(out) => {
                return Err(format!(
                    "cargo build -p {package} --target wasm32-wasip1 --profile wasm-release failed:\n{}",
                    String::from_utf8_lossy(&out.stderr)
                ))
            }
            // no cargo: fall back to what is built
            Err(_) => {}
        }
    }
    if path.is_file() {
        Ok(path)
    } else {
        Err(format!(
            "{} not found; build it with `cargo build -p {package} --target wasm32-wasip1 --profile wasm-release`",
            path.display()
        ))
    }
}

impl Host {
    /// Compiles the kvroute Envoy filter (see [`kvroute_filter_wasm_path`] for where it comes from).
    /// Compiled once per process and shared by all hosts.
    pub fn load_kvroute_filter(&self) -> Result<Plugin, HostError> {
        self.compile_file(kvroute_filter_wasm_path()?)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn artifact_name_prefers_lib_name() {
        let manifest =
            "[package]\nname = \"kvroute-wasm\"\n\n[lib]\nname = \"kvroute_filter\"\npath = \"src/lib.rs\"\n";
        assert_eq!(artifact_name(manifest).as_deref(), Some("kvroute_filter.wasm"));
        assert_eq!(package_name(manifest).as_deref(), Some("kvroute-wasm"));
        assert_eq!(artifact_name("[package]\nname = \"a-b\"\n").as_deref(), Some("a_b.wasm"));
    }
}
