//! Scripted decisions for `switchyard policy test`: a policy author writes requests,
//! candidates and what the policy should answer, and checks a `.wasm` without a fleet.
//!
//! A cases file is a JSON array of objects:
//!
//! ```json
//! [
//!   {"name": "the worker holding the prefix wins",
//!    "request": {"prompt_blocks": 62, "session_key": 7},
//!    "candidates": [{"id": 1, "overlap_blocks": 62}, {"id": 2, "in_flight": 3}],
//!    "expect": {"worker": 1}},
//!   {"name": "either idle worker",
//!    "candidates": [{"id": 1}, {"id": 2}],
//!    "expect": {"worker_in": [1, 2]}},
//!   {"name": "full fleet",
//!    "candidates": [{"id": 1, "in_flight": 99}],
//!    "expect": {"reject": "all-busy"}}
//! ]
//! ```
//!
//! Request fields (all optional): `prompt_tokens` (default `prompt_blocks × block_size`),
//! `prompt_blocks`, `block_size` (16), `session_key`, `seed` (1), `sequence` (the case's
//! number, from 1: 0 is the canary's), `decode_alone` (true), `max_tokens`,
//! `ttft_objective_ms`, `tpot_objective_ms` (omitted: none). Candidate fields: `id`
//! (required), `overlap_blocks`, `active_blocks`, `pending_prefill_tokens`, `in_flight`,
//! `kv_usage`, `cache_fullness`, `predicted_ttft_ms` and `predicted_tpot_ms` (omitted:
//! unknown), `role` (`both`, `prefill` or `decode`; default `both`).
//! `expect`: `{"worker": ID}`, `{"worker_in": [IDs]}`, `{"pair": [PREFILL, DECODE]}` (a
//! split request), `{"reject": KIND}` (`all-busy`, `no-fit`, `refused`, or `any`), or
//! `{"answer": true}` (any valid answer).

use serde::Deserialize;

use super::loaded::{CallOutcome, LoadedPolicy};
use super::types::{CandidateRow, Candidates, RejectionKind, Request};
use switchyard_ids::{InstanceId, Role};

/// One scripted decision.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Case {
    /// Shown in the report (default: `case N`).
    #[serde(default)]
    pub name: Option<String>,
    /// The request.
    #[serde(default)]
    pub request: CaseRequest,
    /// The candidate workers.
    pub candidates: Vec<CaseCandidate>,
    /// What the policy should answer.
    pub expect: Expect,
}

/// A case's request; see the module documentation for defaults.
#[derive(Debug, Clone, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct CaseRequest {
    prompt_tokens: Option<u32>,
    #[serde(default)]
    prompt_blocks: u32,
    block_size: Option<u32>,
    session_key: Option<u64>,
    seed: Option<u64>,
    sequence: Option<u64>,
    decode_alone: Option<bool>,
    max_tokens: Option<u32>,
    ttft_objective_ms: Option<u32>,
    tpot_objective_ms: Option<u32>,
}

/// A case's candidate worker.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct CaseCandidate {
    id: u64,
    #[serde(default)]
    overlap_blocks: u32,
    #[serde(default)]
    active_blocks: u32,
    #[serde(default)]
    pending_prefill_tokens: u32,
    #[serde(default)]
    in_flight: u32,
    kv_usage: Option<f32>,
    cache_fullness: Option<f32>,
    predicted_ttft_ms: Option<f32>,
    predicted_tpot_ms: Option<f32>,
    #[serde(default)]
    role: CaseRole,
}

/// A case candidate's role.
#[derive(Debug, Clone, Copy, Default, Deserialize)]
#[serde(rename_all = "snake_case")]
enum CaseRole {
    #[default]
    Both,
    Prefill,
    Decode,
}

/// What a case expects.
#[derive(Debug, Clone, Deserialize)]
#[serde(rename_all = "snake_case", deny_unknown_fields)]
pub enum Expect {
    /// This worker.
    Worker(u64),
    /// One of these workers.
    WorkerIn(Vec<u64>),
    /// This prefill worker and this decode worker.
    Pair([u64; 2]),
    /// A rejection of this kind (`all-busy`, `no-fit`, `refused`) or `any`.
    Reject(String),
    /// Any valid answer (a candidate or a rejection).
    Answer(bool),
}

/// Reads a cases file's text; says which case is malformed and why.
pub fn parse(text: &str) -> Result<Vec<Case>, String> {
    let cases: Vec<Case> = serde_json::from_str(text)
        .map_err(|e| format!("not a list of cases ({e}); see `switchyard policy test --help`"))?;
    for (i, case) in cases.iter().enumerate() {
        if case.candidates.is_empty() {
            return Err(format!("{}: no candidates", case.label(i)));
        }
        if let Expect::Reject(kind) = &case.expect
            && !matches!(kind.as_str(), "all-busy" | "no-fit" | "refused" | "any")
        {
            return Err(format!(
                "{}: `reject` is all-busy, no-fit, refused or any, not `{kind}`",
                case.label(i)
            ));
        }
    }
    Ok(cases)
}

impl Case {
    /// Its name, or `case N` (from 1).
    pub fn label(&self, index: usize) -> String {
        self.name
            .clone()
            .unwrap_or_else(|| format!("case {}", index + 1))
    }

    /// The request and candidates the policy is called with (case `index`, from 0).
    pub fn decision(&self, index: usize) -> (Request, Candidates) {
        let r = &self.request;
        let block_size = r.block_size.unwrap_or(16).max(1);
        let req = Request {
            prompt_tokens: r
                .prompt_tokens
                .unwrap_or(r.prompt_blocks.saturating_mul(block_size)),
            prompt_blocks: r.prompt_blocks,
            block_size,
            session_key: r.session_key,
            seed: r.seed.unwrap_or(1),
            sequence: r.sequence.unwrap_or(index as u64 + 1),
            decode_alone: r.decode_alone.unwrap_or(true),
            max_tokens: r.max_tokens,
            ttft_objective_ms: r.ttft_objective_ms,
            tpot_objective_ms: r.tpot_objective_ms,
        };
        let mut rows: Vec<CandidateRow> = self
            .candidates
            .iter()
            .map(|c| CandidateRow {
                id: InstanceId(c.id),
                overlap_blocks: c.overlap_blocks,
                active_blocks: c.active_blocks,
                pending_prefill_tokens: c.pending_prefill_tokens,
                in_flight: c.in_flight,
                kv_usage: c.kv_usage,
                cache_fullness: c.cache_fullness,
                role: match c.role {
                    CaseRole::Both => Role::Both,
                    CaseRole::Prefill => Role::Prefill,
                    CaseRole::Decode => Role::Decode,
                },
                predicted_ttft_ms: c.predicted_ttft_ms,
                predicted_tpot_ms: c.predicted_tpot_ms,
            })
            .collect();
        // The router hands candidates sorted by ID.
        rows.sort_by_key(|c| c.id);
        (req, rows.into_iter().collect())
    }

    /// Calls the policy and says whether it answered as expected: `Ok(what it did)` or
    /// `Err(what it did instead)`.
    pub fn run(&self, index: usize, policy: &LoadedPolicy) -> Result<String, String> {
        let (req, candidates) = self.decision(index);
        let outcome = policy
            .call(&req, &candidates)
            .map_err(|failure| format!("the call failed: {failure}"))?;
        let did = match &outcome {
            CallOutcome::Chosen(id) => format!("chose worker {}", id.0),
            CallOutcome::Pair { prefill, decode } => {
                format!(
                    "split: prefill on worker {}, decode on worker {}",
                    prefill.0, decode.0
                )
            }
            CallOutcome::Rejected(r) => {
                format!("rejected ({}): {}", kind_name(r.kind), r.reason)
            }
        };
        let ok = match (&self.expect, &outcome) {
            (Expect::Answer(_), _) => true,
            (Expect::Worker(w), CallOutcome::Chosen(id)) => id.0 == *w,
            (Expect::WorkerIn(ws), CallOutcome::Chosen(id)) => ws.contains(&id.0),
            (Expect::Pair([p, d]), CallOutcome::Pair { prefill, decode }) => {
                (prefill.0, decode.0) == (*p, *d)
            }
            (Expect::Reject(kind), CallOutcome::Rejected(r)) => {
                kind == "any" || kind == kind_name(r.kind)
            }
            _ => false,
        };
        if ok { Ok(did) } else { Err(did) }
    }

    /// The expectation, in words.
    pub fn expected(&self) -> String {
        match &self.expect {
            Expect::Worker(w) => format!("worker {w}"),
            Expect::WorkerIn(ws) => format!("one of workers {ws:?}"),
            Expect::Pair([p, d]) => format!("prefill on worker {p}, decode on worker {d}"),
            Expect::Reject(k) => format!("a rejection ({k})"),
            Expect::Answer(_) => "any answer".into(),
        }
    }
}

fn kind_name(kind: RejectionKind) -> &'static str {
    match kind {
        RejectionKind::AllBusy => "all-busy",
        RejectionKind::NoFit => "no-fit",
        RejectionKind::Refused => "refused",
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn cases_parse_with_defaults_and_bad_ones_say_which_and_why() {
        let cases = parse(
            r#"[{"request": {"prompt_blocks": 4, "session_key": 9},
                 "candidates": [{"id": 20, "in_flight": 2}, {"id": 3, "kv_usage": 0.5}],
                 "expect": {"worker_in": [3, 20]}}]"#,
        )
        .unwrap();
        let (req, candidates) = cases[0].decision(0);
        assert_eq!(
            (req.prompt_tokens, req.block_size, req.sequence, req.seed),
            (64, 16, 1, 1)
        );
        assert_eq!(req.session_key, Some(9));
        assert_eq!(candidates.row(0).id, InstanceId(3));
        assert_eq!(candidates.row(0).kv_usage, Some(0.5));
        assert_eq!(candidates.row(1).in_flight, 2);
        assert_eq!(cases[0].label(0), "case 1");

        let err = parse(r#"[{"candidates": [], "expect": {"answer": true}}]"#).unwrap_err();
        assert!(err.contains("case 1: no candidates"), "{err}");
        let err =
            parse(r#"[{"name": "x", "candidates": [{"id": 1}], "expect": {"reject": "busy"}}]"#)
                .unwrap_err();
        assert!(err.contains("x: `reject`"), "{err}");
        let err = parse(r#"[{"candidates": [{"id": 1, "load": 3}], "expect": {"worker": 1}}]"#)
            .unwrap_err();
        assert!(err.contains("load"), "{err}");
    }
}
