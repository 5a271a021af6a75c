//! `session-affinity`: keeps each session on one worker, unless that worker is overloaded.
//!
//! - A request with a session key goes to the candidate chosen by rendezvous hashing of
//!   (session key, worker ID): stable while the worker set is stable, and when a worker
//!   leaves only its own sessions move.
//! - If that worker already has `max_in_flight` requests in flight, the request spills
//!   over to the least-loaded candidate.
//! - A request without a session key goes to the least-loaded candidate; ties are broken
//!   with the host's seed.
//! - If every candidate is at `max_in_flight` and `reject_when_full` is set, the request is
//!   rejected as `all-busy` so the client backs off.
//!
//! Configuration (JSON): `{"max_in_flight": 8, "reject_when_full": false}`.

use serde::Deserialize;
use std::cell::Cell;
use switchyard::policy::types::{Pair, RejectionKind, Role};

wit_bindgen::generate!({ path: "../../wit", world: "policy" });

#[derive(Clone, Copy, Deserialize)]
#[serde(deny_unknown_fields, default)]
struct Config {
    max_in_flight: u32,
    reject_when_full: bool,
}

impl Default for Config {
    fn default() -> Self {
        Config { max_in_flight: 8, reject_when_full: false }
    }
}

thread_local! {
    static CONFIG: Cell<Config> = Cell::new(Config::default());
}

struct SessionAffinity;

impl Guest for SessionAffinity {
    fn configure(config: String) -> Result<(), String> {
        let config: Config = if config.trim().is_empty() {
            Config::default()
        } else {
            serde_json::from_str(&config).map_err(|e| format!("session-affinity config: {e}"))?
        };
        if config.max_in_flight == 0 {
            return Err("session-affinity config: max_in_flight must be at least 1".into());
        }
        CONFIG.set(config);
        Ok(())
    }

    fn describe() -> Info {
        Info { name: "session-affinity".into(), version: env!("CARGO_PKG_VERSION").into() }
    }

    fn choose(req: Request, c: Candidates) -> Result<Placement, Rejection> {
        let has = |role: Role| c.roles.contains(&role);
        let id = |i: usize| c.worker_ids[i];
        if has(Role::Both) {
            return pick(&req, &c, Role::Both).map(|i| Placement::Worker(id(i)));
        }
        // Prefill and decode on separate workers: the session keeps its prefill worker
        // (where its prefix is) and its decode worker alike.
        let (prefill, decode) = (has(Role::Prefill), has(Role::Decode));
        if !prefill && req.decode_alone && decode {
            return pick(&req, &c, Role::Decode).map(|i| Placement::Worker(id(i)));
        }
        if !prefill || !decode {
            return Err(Rejection { kind: RejectionKind::NoFit, reason: "no worker, nor prefill and decode pair".into() });
        }
        let p = pick(&req, &c, Role::Prefill)?;
        let d = pick(&req, &c, Role::Decode)?;
        Ok(Placement::Pair(Pair { prefill: id(p), decode: id(d) }))
    }
}

/// The session's worker among the candidates of `role` (there is one), or the least
/// loaded of them. No allocation: a decision over a thousand workers stays a few passes.
fn pick(req: &Request, c: &Candidates, role: Role) -> Result<usize, Rejection> {
    let config = CONFIG.get();
    let rows = || (0..c.worker_ids.len()).filter(move |&i| c.roles[i] == role);
    if let Some(key) = req.session_key {
        let home = rows().max_by_key(|&i| mix(key ^ mix(c.worker_ids[i]))).unwrap();
        if c.in_flight[home] < config.max_in_flight {
            return Ok(home);
        }
    }
    let least = rows().map(|i| c.in_flight[i]).min().unwrap();
    if least >= config.max_in_flight && config.reject_when_full {
        return Err(Rejection {
            kind: RejectionKind::AllBusy,
            reason: format!("every worker has {} or more requests in flight", config.max_in_flight),
        });
    }
    let tied = || rows().filter(|&i| c.in_flight[i] == least);
    let k = (mix(req.seed) % tied().count() as u64) as usize;
    Ok(tied().nth(k).unwrap())
}

/// SplitMix64's finaliser: a cheap, well-spread 64-bit hash.
fn mix(x: u64) -> u64 {
    let mut z = x.wrapping_add(0x9e37_79b9_7f4a_7c15);
    z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    z ^ (z >> 31)
}

export!(SessionAffinity);
