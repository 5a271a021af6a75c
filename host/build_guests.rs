//! Building WebAssembly guest workspaces from a build script, shared by the build scripts
//! of `switchyard-policy` (the built-in policies it embeds) and `switchyard` (the example
//! and hostile policies its tests load). Included with `#[path]`: a build script cannot
//! depend on a workspace crate without building it for the host first.
//!
//! Each guest workspace is built with a nested `cargo build --target wasm32-wasip2
//! --release` into its own target directory (`target/guests`): sharing the outer build's
//! target directory would deadlock on its lock. The resulting `.wasm` paths are passed
//! to the crate as `SWITCHYARD_*_WASM` environment variables at compile time.

use std::path::{Path, PathBuf};
use std::process::Command;

const TARGET: &str = "wasm32-wasip2";

/// Builds the guest workspace `dir` (relative to the repository's root, `root`) and
/// passes each of `artifacts` to the crate as `SWITCHYARD_{ARTIFACT}_WASM`.
pub fn build(root: &Path, dir: &str, artifacts: &[&str]) {
    let target_dir = guest_target_dir(root);
    let ws = root.join(dir);
    rerun_if_changed_tree(&ws);
    build_guests(&ws, &target_dir);
    for artifact in artifacts {
        let path = target_dir
            .join(TARGET)
            .join("release")
            .join(format!("{artifact}.wasm"));
        assert!(
            path.exists(),
            "guest build did not produce {}",
            path.display()
        );
        println!(
            "cargo:rustc-env=SWITCHYARD_{}_WASM={}",
            artifact.to_uppercase(),
            path.display()
        );
    }
}

/// `target/guests` beside the outer build's target directory.
fn guest_target_dir(root: &Path) -> PathBuf {
    match std::env::var_os("CARGO_TARGET_DIR") {
        Some(dir) => PathBuf::from(dir).join("guests"),
        None => root.join("target").join("guests"),
    }
}

/// The policies compile for `wasm32-wasip2`, which `rust-toolchain.toml` lists; rustup
/// installs listed targets only when it installs the toolchain, so a machine that already
/// had the toolchain may lack it. Add it once, through rustup, with a clear message.
fn ensure_target() {
    let rustc = std::env::var_os("RUSTC").unwrap_or_else(|| "rustc".into());
    let sysroot = Command::new(&rustc)
        .args(["--print", "sysroot"])
        .output()
        .ok()
        .map(|o| PathBuf::from(String::from_utf8_lossy(&o.stdout).trim()));
    let installed =
        sysroot.is_some_and(|root| root.join("lib/rustlib").join(TARGET).join("lib").is_dir());
    if installed {
        return;
    }
    println!(
        "cargo:warning=the {TARGET} target is missing; adding it with `rustup target add {TARGET}`"
    );
    let added = Command::new("rustup")
        .args(["target", "add", TARGET])
        .status()
        .is_ok_and(|s| s.success());
    assert!(
        added,
        "the policies need the {TARGET} target: run `rustup target add {TARGET}`"
    );
}

fn build_guests(workspace: &Path, target_dir: &Path) {
    ensure_target();
    let cargo = std::env::var_os("CARGO").unwrap_or_else(|| "cargo".into());
    let mut cmd = Command::new(cargo);
    cmd.current_dir(workspace)
        .args(["build", "--release", "--target", TARGET, "--target-dir"])
        .arg(target_dir);
    // The outer build's flags are for the host target; never leak them into the guests.
    for var in [
        "RUSTFLAGS",
        "CARGO_ENCODED_RUSTFLAGS",
        "CARGO_BUILD_RUSTFLAGS",
        "RUSTC_WRAPPER",
        "RUSTC_WORKSPACE_WRAPPER",
        "CARGO_TARGET_DIR",
    ] {
        cmd.env_remove(var);
    }
    let status = cmd
        .status()
        .unwrap_or_else(|e| panic!("cannot run cargo for {}: {e}", workspace.display()));
    assert!(
        status.success(),
        "building the guests in {} failed",
        workspace.display()
    );
}

fn rerun_if_changed_tree(dir: &Path) {
    let Ok(entries) = std::fs::read_dir(dir) else {
        return;
    };
    for entry in entries.flatten() {
        let path = entry.path();
        let name = entry.file_name();
        if name == "target" || name == "Cargo.lock" {
            continue;
        }
        if path.is_dir() {
            rerun_if_changed_tree(&path);
        } else {
            println!("cargo:rerun-if-changed={}", path.display());
        }
    }
}
