//! Builds the WebAssembly guests this crate's tests and benchmarks load (the built-in
//! policies are `switchyard-policy`'s): see `build_guests.rs`.
//! - `examples/session-affinity/`: the example custom policy;
//! - `tests/guests/`: deliberately hostile policies for the sandbox tests.

#[path = "build_guests.rs"]
mod guests;

use std::path::PathBuf;

fn main() {
    let manifest_dir = PathBuf::from(std::env::var_os("CARGO_MANIFEST_DIR").unwrap());
    let root = manifest_dir.parent().unwrap().to_path_buf();
    println!("cargo:rerun-if-changed={}", root.join("wit").display());
    guests::build(&root, "examples/session-affinity", &["session_affinity"]);
    guests::build(
        &root,
        "tests/guests",
        &[
            "spin_forever",
            "memory_bomb",
            "panics",
            "wrong_id",
            "stdout_spam",
            "reads_host",
            "bad_config",
            "wrong_world",
            "rounds_ids",
            "imports_http",
            "loud",
            "sleeps",
            "flaky",
            "picks_last",
            "picks_first",
            "built_for_0_1",
            "built_for_0_2",
            "built_for_0_3",
        ],
    );
}
