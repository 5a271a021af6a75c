//! Bindings generated from `wit/policy.wit`, kept private to the policy module.

wasmtime::component::bindgen!({
    path: "../../wit",
    world: "policy",
});

/// The WIT types under short names.
pub(crate) mod wit {
    pub(crate) use super::switchyard::policy::types::{
        Candidates, Rejection, RejectionKind, Request,
    };
}
