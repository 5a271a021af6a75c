//! Bindings generated from the WIT, kept private to the policy module: the current world
//! (`wit/policy.wit`, `switchyard:policy@0.4.0`) and the three before it
//! (`wit/v0.3.0/policy.wit`, `wit/v0.2.0/policy.wit`, `wit/v0.1.0/policy.wit`), so that
//! components built against any of them load. The rest of the crate sees one
//! [`PolicyPre`] and one [`Policy`] and speaks the current types; an older component is
//! handed the same request and candidates without the fields it does not know, and one
//! older than 0.3.0, on a fleet that splits prefill from decode, is asked twice: once
//! among the prefill workers, once among the decode workers.

use wasmtime::Store;
use wasmtime::component::InstancePre;

use super::sandbox::HostState;

mod current {
    wasmtime::component::bindgen!({
        path: "../../wit",
        world: "policy",
    });
}

mod v0_3 {
    wasmtime::component::bindgen!({
        path: "../../wit/v0.3.0",
        world: "policy",
    });
}

mod v0_2 {
    wasmtime::component::bindgen!({
        path: "../../wit/v0.2.0",
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
        Candidates, Info, Pair, Placement, Rejection, RejectionKind, Request, Role,
    };
}

use v0_1::switchyard::policy::types as old1;
use v0_2::switchyard::policy::types as old2;
use v0_3::switchyard::policy::types as old3;

/// The world version a component implements.
pub(crate) const CURRENT_WORLD: &str = "switchyard:policy@0.4.0";
/// The versions before it, still loaded.
pub(crate) const WORLD_0_3: &str = "switchyard:policy@0.3.0";
pub(crate) const WORLD_0_2: &str = "switchyard:policy@0.2.0";
pub(crate) const WORLD_0_1: &str = "switchyard:policy@0.1.0";

/// A linked component, ready to instantiate, of any world version.
#[derive(Clone)]
pub(crate) enum PolicyPre {
    Current(current::PolicyPre<HostState>),
    V0_3(v0_3::PolicyPre<HostState>),
    V0_2(v0_2::PolicyPre<HostState>),
    V0_1(v0_1::PolicyPre<HostState>),
}

/// One instance of a policy component.
pub(crate) enum Policy {
    Current(current::Policy),
    V0_3(v0_3::Policy),
    V0_2(v0_2::Policy),
    V0_1(v0_1::Policy),
}

impl PolicyPre {
    /// The component's world: the newest version it exports; the current version's
    /// complaint if none.
    pub(crate) fn new(pre: InstancePre<HostState>) -> wasmtime::Result<PolicyPre> {
        match current::PolicyPre::new(pre.clone()) {
            Ok(p) => Ok(PolicyPre::Current(p)),
            Err(e) => {
                if let Ok(p) = v0_3::PolicyPre::new(pre.clone()) {
                    return Ok(PolicyPre::V0_3(p));
                }
                if let Ok(p) = v0_2::PolicyPre::new(pre.clone()) {
                    return Ok(PolicyPre::V0_2(p));
                }
                match v0_1::PolicyPre::new(pre) {
                    Ok(p) => Ok(PolicyPre::V0_1(p)),
                    Err(_) => Err(e),
                }
            }
        }
    }

    /// The world version the component implements.
    pub(crate) fn world(&self) -> &'static str {
        match self {
            PolicyPre::Current(_) => CURRENT_WORLD,
            PolicyPre::V0_3(_) => WORLD_0_3,
            PolicyPre::V0_2(_) => WORLD_0_2,
            PolicyPre::V0_1(_) => WORLD_0_1,
        }
    }

    pub(crate) fn instantiate(&self, store: &mut Store<HostState>) -> wasmtime::Result<Policy> {
        Ok(match self {
            PolicyPre::Current(p) => Policy::Current(p.instantiate(store)?),
            PolicyPre::V0_3(p) => Policy::V0_3(p.instantiate(store)?),
            PolicyPre::V0_2(p) => Policy::V0_2(p.instantiate(store)?),
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
            Policy::V0_3(p) => p.call_configure(store, config),
            Policy::V0_2(p) => p.call_configure(store, config),
            Policy::V0_1(p) => p.call_configure(store, config),
        }
    }

    pub(crate) fn call_describe(
        &self,
        store: &mut Store<HostState>,
    ) -> wasmtime::Result<wit::Info> {
        let (name, version) = match self {
            Policy::Current(p) => return p.call_describe(store),
            Policy::V0_3(p) => {
                let i = p.call_describe(store)?;
                (i.name, i.version)
            }
            Policy::V0_2(p) => {
                let i = p.call_describe(store)?;
                (i.name, i.version)
            }
            Policy::V0_1(p) => {
                let i = p.call_describe(store)?;
                (i.name, i.version)
            }
        };
        Ok(wit::Info { name, version })
    }

    /// `choose`, with the candidates lowered straight from `candidates` for a current
    /// component. An older one is asked among the workers of one role at a time: the
    /// `both` workers if there are any, else the prefill workers and then the decode
    /// workers (the pair), or the decode workers alone when they may serve alone and
    /// there is no prefill worker.
    pub(crate) fn call_choose(
        &self,
        store: &mut Store<HostState>,
        req: wit::Request,
        candidates: &wit::Candidates,
    ) -> wasmtime::Result<Result<wit::Placement, wit::Rejection>> {
        match self {
            Policy::Current(p) => return p.call_choose(store, req, candidates),
            Policy::V0_3(p) => return v03_choose(p, store, req, candidates),
            _ => {}
        }
        let roles = &candidates.roles;
        let has = |r: wit::Role| roles.contains(&r);
        if !has(wit::Role::Prefill) && !has(wit::Role::Decode) {
            return Ok(self
                .old_choose(store, req, candidates, |_| true)?
                .map(wit::Placement::Worker));
        }
        if has(wit::Role::Both) {
            return Ok(self
                .old_choose(store, req, candidates, |r| r == wit::Role::Both)?
                .map(wit::Placement::Worker));
        }
        if !has(wit::Role::Decode) {
            return Ok(Err(wit::Rejection {
                kind: wit::RejectionKind::NoFit,
                reason: "no decode worker is available".into(),
            }));
        }
        if !has(wit::Role::Prefill) {
            if !req.decode_alone {
                return Ok(Err(wit::Rejection {
                    kind: wit::RejectionKind::NoFit,
                    reason: "no prefill worker is available".into(),
                }));
            }
            return Ok(self
                .old_choose(store, req, candidates, |r| r == wit::Role::Decode)?
                .map(wit::Placement::Worker));
        }
        let prefill = match self.old_choose(store, req, candidates, |r| r == wit::Role::Prefill)? {
            Ok(id) => id,
            Err(r) => return Ok(Err(r)),
        };
        Ok(self
            .old_choose(store, req, candidates, |r| r == wit::Role::Decode)?
            .map(|decode| wit::Placement::Pair(wit::Pair { prefill, decode })))
    }

    /// One call of an older component's `choose` among the candidates whose role
    /// `keep` accepts.
    fn old_choose(
        &self,
        store: &mut Store<HostState>,
        req: wit::Request,
        c: &wit::Candidates,
        keep: impl Fn(wit::Role) -> bool,
    ) -> wasmtime::Result<Result<u64, wit::Rejection>> {
        let rows: Vec<usize> = (0..c.worker_ids.len())
            .filter(|&i| c.roles.get(i).is_none_or(|r| keep(*r)))
            .collect();
        fn pick<T: Copy>(col: &[T], rows: &[usize]) -> Vec<T> {
            rows.iter().filter_map(|&i| col.get(i).copied()).collect()
        }
        // The request and a rejection are the same records in every version: one
        // conversion, written once for each version's generated types.
        macro_rules! call {
            ($p:expr, $m:ident, $cols:expr) => {{
                let req = $m::Request {
                    prompt_tokens: req.prompt_tokens,
                    prompt_blocks: req.prompt_blocks,
                    block_size: req.block_size,
                    session_key: req.session_key,
                    seed: req.seed,
                    sequence: req.sequence,
                };
                Ok($p
                    .call_choose(store, req, &$cols)?
                    .map_err(|r| wit::Rejection {
                        kind: match r.kind {
                            $m::RejectionKind::AllBusy => wit::RejectionKind::AllBusy,
                            $m::RejectionKind::NoFit => wit::RejectionKind::NoFit,
                            $m::RejectionKind::Refused => wit::RejectionKind::Refused,
                        },
                        reason: r.reason,
                    }))
            }};
        }
        match self {
            Policy::Current(_) | Policy::V0_3(_) => {
                unreachable!("a component that knows roles is called directly")
            }
            Policy::V0_2(p) => call!(
                p,
                old2,
                old2::Candidates {
                    worker_ids: pick(&c.worker_ids, &rows),
                    overlap_blocks: pick(&c.overlap_blocks, &rows),
                    active_blocks: pick(&c.active_blocks, &rows),
                    pending_prefill_tokens: pick(&c.pending_prefill_tokens, &rows),
                    in_flight: pick(&c.in_flight, &rows),
                    kv_usage: pick(&c.kv_usage, &rows),
                    cache_fullness: pick(&c.cache_fullness, &rows),
                }
            ),
            Policy::V0_1(p) => call!(
                p,
                old1,
                old1::Candidates {
                    worker_ids: pick(&c.worker_ids, &rows),
                    overlap_blocks: pick(&c.overlap_blocks, &rows),
                    active_blocks: pick(&c.active_blocks, &rows),
                    pending_prefill_tokens: pick(&c.pending_prefill_tokens, &rows),
                    in_flight: pick(&c.in_flight, &rows),
                    kv_usage: pick(&c.kv_usage, &rows),
                }
            ),
        }
    }
}

/// `choose` of a 0.3.0 component: the request and candidates without what 0.4.0 added
/// (predictions, `max-tokens`, objectives), its placement read back.
fn v03_choose(
    p: &v0_3::Policy,
    store: &mut Store<HostState>,
    req: wit::Request,
    c: &wit::Candidates,
) -> wasmtime::Result<Result<wit::Placement, wit::Rejection>> {
    let req = old3::Request {
        prompt_tokens: req.prompt_tokens,
        prompt_blocks: req.prompt_blocks,
        block_size: req.block_size,
        session_key: req.session_key,
        seed: req.seed,
        sequence: req.sequence,
        decode_alone: req.decode_alone,
    };
    let role = |r: &wit::Role| match r {
        wit::Role::Both => old3::Role::Both,
        wit::Role::Prefill => old3::Role::Prefill,
        wit::Role::Decode => old3::Role::Decode,
    };
    let cols = old3::Candidates {
        worker_ids: c.worker_ids.clone(),
        overlap_blocks: c.overlap_blocks.clone(),
        active_blocks: c.active_blocks.clone(),
        pending_prefill_tokens: c.pending_prefill_tokens.clone(),
        in_flight: c.in_flight.clone(),
        kv_usage: c.kv_usage.clone(),
        cache_fullness: c.cache_fullness.clone(),
        roles: c.roles.iter().map(role).collect(),
    };
    Ok(p.call_choose(store, req, &cols)?
        .map(|placement| match placement {
            old3::Placement::Worker(id) => wit::Placement::Worker(id),
            old3::Placement::Pair(pair) => wit::Placement::Pair(wit::Pair {
                prefill: pair.prefill,
                decode: pair.decode,
            }),
        })
        .map_err(|r| wit::Rejection {
            kind: match r.kind {
                old3::RejectionKind::AllBusy => wit::RejectionKind::AllBusy,
                old3::RejectionKind::NoFit => wit::RejectionKind::NoFit,
                old3::RejectionKind::Refused => wit::RejectionKind::Refused,
            },
            reason: r.reason,
        }))
}
