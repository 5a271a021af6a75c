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
    let built = clean_if_built_for_another_wit(root, dir, &ws, &target_dir, artifacts);
    build_guests(&ws, &target_dir);
    built();
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

/// A guest's bindings come from `wit/` through a macro, which Cargo does not track: a
/// guest built against another WIT than today's would be taken as fresh and keep its
/// contract. Each workspace's build records a digest of the WIT it was built against
/// (`target/guests/wit-of-DIR`); when the WIT differs (it changed, or another checkout
/// shared the target directory), the guests (each artifact `a_b` is package `a-b`) are
/// cleaned first.
fn clean_if_built_for_another_wit(
    root: &Path,
    dir: &str,
    workspace: &Path,
    target_dir: &Path,
    artifacts: &[&str],
) -> impl FnOnce() {
    use std::hash::{Hash, Hasher};
    let mut files = Vec::new();
    let mut stack = vec![root.join("wit")];
    while let Some(d) = stack.pop() {
        for entry in std::fs::read_dir(&d).into_iter().flatten().flatten() {
            let path = entry.path();
            if path.is_dir() {
                stack.push(path);
            } else {
                files.push(path);
            }
        }
    }
    files.sort();
    // SipHash with fixed keys: the same digest for the same files, build after build.
    let mut h = std::collections::hash_map::DefaultHasher::new();
    for f in &files {
        f.strip_prefix(root).unwrap_or(f).hash(&mut h);
        std::fs::read(f).unwrap_or_default().hash(&mut h);
    }
    let digest = format!("{:016x}", h.finish());
    let stamp = target_dir.join(format!("wit-of-{}", dir.replace('/', "-")));
    if std::fs::read_to_string(&stamp).ok().as_deref() != Some(digest.as_str()) {
        let built: Vec<String> = artifacts
            .iter()
            .filter(|a| {
                let wasm = target_dir
                    .join(TARGET)
                    .join("release")
                    .join(format!("{a}.wasm"));
                wasm.exists()
            })
            .map(|a| a.replace('_', "-"))
            .collect();
        if !built.is_empty() {
            let mut cmd = cargo(workspace, "clean", target_dir);
            for p in &built {
                cmd.args(["-p", p]);
            }
            let cleaned = cmd.status().is_ok_and(|s| s.success());
            assert!(
                cleaned,
                "cleaning the guests built against another WIT ({built:?}) failed"
            );
        }
    }
    move || {
        let _ = std::fs::create_dir_all(stamp.parent().unwrap_or(Path::new(".")));
        let _ = std::fs::write(&stamp, digest);
    }
}

/// `cargo SUBCOMMAND --release --target wasm32-wasip2 --target-dir TARGET_DIR` in
/// `workspace`, without the outer build's flags.
fn cargo(workspace: &Path, subcommand: &str, target_dir: &Path) -> Command {
    let cargo = std::env::var_os("CARGO").unwrap_or_else(|| "cargo".into());
    let mut cmd = Command::new(cargo);
    cmd.current_dir(workspace)
        .args([subcommand, "--release", "--target", TARGET, "--target-dir"])
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
    cmd
}

fn build_guests(workspace: &Path, target_dir: &Path) {
    ensure_target();
    let status = cargo(workspace, "build", target_dir)
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
