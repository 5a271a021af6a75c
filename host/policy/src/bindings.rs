//! Bindings generated from the WIT, kept private to the policy module: the current world
//! (`wit/policy.wit`, `switchyard:policy@0.2.0`) and the one before it
//! (`wit/v0.1.0/policy.wit`), so that components built against either load. The rest of
//! the crate sees one [`PolicyPre`] and one [`Policy`] and speaks the current types; a
//! 0.1.0 component is handed the same candidates without the columns it does not know.

use wasmtime::Store;
use wasmtime::component::InstancePre;

use super::sandbox::HostState;

mod current {
    wasmtime::component::bindgen!({
        path: "../../wit",
        world: "policy",
    });
}

mod v0_1 {
    wasmtime::component::bindgen!({
        path: "../../wit/v0.1.0",
        world: "policy",
    });
}

/// The current WIT types under short names.
pub(crate) mod wit {
    pub(crate) use super::current::switchyard::policy::types::{
        Candidates, Info, Rejection, RejectionKind, Request,
    };
}

use v0_1::switchyard::policy::types as old;

/// The world version a component implements.
pub(crate) const CURRENT_WORLD: &str = "switchyard:policy@0.2.0";
/// The previous version, still loaded.
pub(crate) const OLD_WORLD: &str = "switchyard:policy@0.1.0";

/// A linked component, ready to instantiate, of either world version.
#[derive(Clone)]
pub(crate) enum PolicyPre {
    Current(current::PolicyPre<HostState>),
    V0_1(v0_1::PolicyPre<HostState>),
}

/// One instance of a policy component.
pub(crate) enum Policy {
    Current(current::Policy),
    V0_1(v0_1::Policy),
}

impl PolicyPre {
    /// The component's world: the current version if it exports it, else 0.1.0; the
    /// current version's complaint if neither.
    pub(crate) fn new(pre: InstancePre<HostState>) -> wasmtime::Result<PolicyPre> {
        match current::PolicyPre::new(pre.clone()) {
            Ok(p) => Ok(PolicyPre::Current(p)),
            Err(e) => match v0_1::PolicyPre::new(pre) {
                Ok(p) => Ok(PolicyPre::V0_1(p)),
                Err(_) => Err(e),
            },
        }
    }

    /// The world version the component implements.
    pub(crate) fn world(&self) -> &'static str {
        match self {
            PolicyPre::Current(_) => CURRENT_WORLD,
            PolicyPre::V0_1(_) => OLD_WORLD,
        }
    }

    pub(crate) fn instantiate(&self, store: &mut Store<HostState>) -> wasmtime::Result<Policy> {
        Ok(match self {
            PolicyPre::Current(p) => Policy::Current(p.instantiate(store)?),
            PolicyPre::V0_1(p) => Policy::V0_1(p.instantiate(store)?),
        })
    }
}

impl Policy {
    pub(crate) fn call_configure(
        &self,
        store: &mut Store<HostState>,
        config: &str,
    ) -> wasmtime::Result<Result<(), String>> {
        match self {
            Policy::Current(p) => p.call_configure(store, config),
            Policy::V0_1(p) => p.call_configure(store, config),
        }
    }

    pub(crate) fn call_describe(
        &self,
        store: &mut Store<HostState>,
    ) -> wasmtime::Result<wit::Info> {
        match self {
            Policy::Current(p) => p.call_describe(store),
            Policy::V0_1(p) => p.call_describe(store).map(|i| wit::Info {
                name: i.name,
                version: i.version,
            }),
        }
    }

    /// `choose`, with the candidates lowered straight from `candidates` for a current
    /// component, and from a copy without `cache-fullness` for a 0.1.0 one.
    pub(crate) fn call_choose(
        &self,
        store: &mut Store<HostState>,
        req: wit::Request,
        candidates: &wit::Candidates,
    ) -> wasmtime::Result<Result<u64, wit::Rejection>> {
        match self {
            Policy::Current(p) => p.call_choose(store, req, candidates),
            Policy::V0_1(p) => {
                let req = old::Request {
                    prompt_tokens: req.prompt_tokens,
                    prompt_blocks: req.prompt_blocks,
                    block_size: req.block_size,
                    session_key: req.session_key,
                    seed: req.seed,
                    sequence: req.sequence,
                };
                let c = candidates;
                let old_candidates = old::Candidates {
                    worker_ids: c.worker_ids.clone(),
                    overlap_blocks: c.overlap_blocks.clone(),
                    active_blocks: c.active_blocks.clone(),
                    pending_prefill_tokens: c.pending_prefill_tokens.clone(),
                    in_flight: c.in_flight.clone(),
                    kv_usage: c.kv_usage.clone(),
                };
                Ok(p.call_choose(store, req, &old_candidates)?
                    .map_err(|r| wit::Rejection {
                        kind: match r.kind {
                            old::RejectionKind::AllBusy => wit::RejectionKind::AllBusy,
                            old::RejectionKind::NoFit => wit::RejectionKind::NoFit,
                            old::RejectionKind::Refused => wit::RejectionKind::Refused,
                        },
                        reason: r.reason,
                    }))
            }
        }
    }
}
