//! The built-in policies, compiled from `policies/` by the build script and embedded in
//! the binary.

/// A policy shipped inside the binary.
#[derive(Debug)]
pub struct Builtin {
    /// The name used on the command line and in configs.
    pub name: &'static str,
    /// One line on what it does.
    pub summary: &'static str,
    /// The component's bytes.
    pub wasm: &'static [u8],
}

/// Every built-in policy; the first is the default.
pub static BUILTINS: &[Builtin] = &[
    Builtin {
        name: "kv-cost",
        summary: "lowest overlap_weight x prefill blocks + decode blocks; KV-cache aware (default). \
                  Config: {\"overlap_weight\": 1.0, \"temperature\": 0.0}",
        wasm: include_bytes!(env!("SWITCHYARD_KV_COST_WASM")),
    },
    Builtin {
        name: "round-robin",
        summary: "even spread over the available workers, ignoring the cache. No config.",
        wasm: include_bytes!(env!("SWITCHYARD_ROUND_ROBIN_WASM")),
    },
    Builtin {
        name: "random",
        summary: "a uniformly random available worker (a baseline). No config.",
        wasm: include_bytes!(env!("SWITCHYARD_RANDOM_WASM")),
    },
];

/// The built-in policy called `name`.
pub fn builtin(name: &str) -> Option<&'static Builtin> {
    BUILTINS.iter().find(|b| b.name == name)
}
