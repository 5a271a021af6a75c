//! The policy runtime: every routing decision goes through here.
//!
//! A policy is a WebAssembly component implementing the `switchyard:policy` world in
//! `wit/`. This module compiles it (with an on-disk cache), instantiates it in a sandbox
//! with no filesystem, network, environment or clock, keeps warm instances in a
//! checkout pool, and calls `choose` under a time budget and a memory cap. Whatever the
//! guest does — trap, spin, allocate without bound, answer with a worker that is not a
//! candidate — the decision is still made: by the native `kv-cost` ([`native`]), and
//! the failure is counted and logged.
//!
//! [`PolicyHandle`] is what the rest of the host holds: the endpoint's current policy
//! behind an `ArcSwap`, replaced whole by a validated hot swap, and rolled back to the
//! last good policy after a run of failures.
//!
//! Must not know: HTTP, discovery, the KV index. Only this module knows wasmtime.

pub mod bench;
mod bindings;
mod builtin;
mod cache;
mod canary;
pub mod cases;
mod engine;
mod handle;
mod load;
mod loaded;
pub mod native;
mod sandbox;
pub mod scaffold;
mod types;
mod warmer;

pub use builtin::{BUILTINS, Builtin, builtin};
pub use cache::CacheOutcome;
pub use engine::{PolicyEngine, RuntimeConfig};
pub use handle::{
    CHANGES, Decider, Decision, DecisionOutcome, PolicyChange, PolicyHandle, PolicyStatus,
    PolicyTotals, policy_label,
};
pub use loaded::{CallFailure, CallOutcome, LoadedPolicy, PolicyInfo, PolicySource};
pub use types::{
    CandidateRow, Candidates, MAX_GUEST_LABEL, MAX_GUEST_TEXT, Rejection, RejectionKind, Request,
    guest_label, guest_text,
};

/// Largest policy component accepted, however it arrives (file, upload, etcd push),
/// bytes. Real policies are tens to hundreds of KiB; the limit bounds compile time and
/// memory.
pub const MAX_POLICY_BYTES: usize = 32 << 20;

/// Why a policy could not be loaded or swapped in. The current policy keeps serving.
#[derive(Debug, thiserror::Error)]
pub enum PolicyError {
    /// Larger than [`MAX_POLICY_BYTES`].
    #[error("the policy is over the limit of {MAX_POLICY_BYTES} bytes")]
    TooLarge,
    /// The bytes are not a WebAssembly component (e.g. a core module or garbage).
    #[error("not a WebAssembly component: {0}")]
    NotAComponent(String),
    /// A component, but not one implementing `switchyard:policy@0.4.0` (or 0.3.0, 0.2.0, 0.1.0).
    #[error(
        "the component does not implement the switchyard:policy@0.4.0 world `policy` (nor 0.3.0, 0.2.0 or 0.1.0): {0}"
    )]
    WrongWorld(String),
    /// The component imports something the sandbox does not grant.
    #[error("the component cannot be instantiated in the policy sandbox: {0}")]
    Instantiate(String),
    /// The policy's `configure` refused the operator's configuration.
    #[error("the policy refused its configuration: {0}")]
    BadConfig(String),
    /// A lifecycle call (`configure`, `describe`) trapped.
    #[error("the policy trapped while loading: {0}")]
    Trap(String),
    /// The self-test decision on a synthetic candidate list failed.
    #[error("the policy failed its canary decision: {0}")]
    Canary(String),
    /// No built-in policy has this name.
    #[error("no built-in policy named `{0}` (built-ins: kv-cost, round-robin, random)")]
    UnknownBuiltin(String),
    /// Reading the policy file failed.
    #[error("cannot read policy file {path}: {source}")]
    Io {
        /// The file.
        path: std::path::PathBuf,
        /// What went wrong.
        source: std::io::Error,
    },
    /// A pushed policy without a valid signature from a key this router trusts.
    #[error("the pushed policy is refused: {0}")]
    Unsigned(String),
    /// Too much compiling at once, or a compile past its time budget; the load is
    /// refused and may be tried again.
    #[error("the policy runtime is busy: {0}")]
    Busy(String),
    /// The runtime itself could not be set up (engine configuration).
    #[error("policy runtime error: {0}")]
    Runtime(String),
}

impl PolicyError {
    /// Every [`PolicyError::reason`], in a fixed order.
    pub const REASONS: [&'static str; 12] = [
        "too_large",
        "not_a_component",
        "wrong_world",
        "instantiate",
        "bad_config",
        "trap",
        "canary",
        "unknown_builtin",
        "io",
        "busy",
        "runtime",
        "unsigned",
    ];

    /// A short label naming the kind of refusal (for metrics).
    pub fn reason(&self) -> &'static str {
        Self::REASONS[self.reason_index()]
    }

    pub(crate) fn reason_index(&self) -> usize {
        match self {
            PolicyError::TooLarge => 0,
            PolicyError::NotAComponent(_) => 1,
            PolicyError::WrongWorld(_) => 2,
            PolicyError::Instantiate(_) => 3,
            PolicyError::BadConfig(_) => 4,
            PolicyError::Trap(_) => 5,
            PolicyError::Canary(_) => 6,
            PolicyError::UnknownBuiltin(_) => 7,
            PolicyError::Io { .. } => 8,
            PolicyError::Busy(_) => 9,
            PolicyError::Runtime(_) => 10,
            PolicyError::Unsigned(_) => 11,
        }
    }
}

/// Renders a wasmtime error with its whole cause chain on one line.
pub(crate) fn describe_error(e: &wasmtime::Error) -> String {
    let mut parts: Vec<String> = Vec::new();
    for cause in e.chain() {
        let s = cause.to_string();
        if !parts.iter().any(|p| p.contains(&s)) {
            parts.push(s);
        }
    }
    parts.join(": ")
}
