//! Builds the built-in policies this crate embeds (`policies/`): see
//! `host/build_guests.rs`.

#[path = "../build_guests.rs"]
mod guests;

use std::path::PathBuf;

fn main() {
    let manifest_dir = PathBuf::from(std::env::var_os("CARGO_MANIFEST_DIR").unwrap());
    let root = manifest_dir
        .parent()
        .unwrap()
        .parent()
        .unwrap()
        .to_path_buf();
    println!("cargo:rerun-if-changed={}", root.join("wit").display());
    guests::build(&root, "policies", &["kv_cost", "round_robin", "random"]);
}
