//! The data of one decision, in the host's own types. The candidate list is stored as
//! the generated struct-of-arrays record itself, so a call lowers it without copying.

use super::bindings::wit;
use switchyard_ids::{InstanceId, Role};

/// What the host knows about the request being routed.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct Request {
    /// Prompt length in tokens.
    pub prompt_tokens: u32,
    /// Full KV blocks in the prompt.
    pub prompt_blocks: u32,
    /// Tokens per KV block.
    pub block_size: u32,
    /// Hash of the session/affinity key, if the client gave one.
    pub session_key: Option<u64>,
    /// Per-decision random number; filled in by [`super::PolicyHandle::decide`] when 0.
    pub seed: u64,
    /// Per-endpoint decision counter; filled in by [`super::PolicyHandle::decide`].
    pub sequence: u64,
    /// A `decode` worker may serve the request alone (vLLM's handoff; not SGLang's).
    pub decode_alone: bool,
    /// The most output tokens it asks for, if it says.
    pub max_tokens: Option<u32>,
    /// Its time-to-first-token objective, ms, if any.
    pub ttft_objective_ms: Option<u32>,
    /// Its time-per-output-token objective, ms, if any.
    pub tpot_objective_ms: Option<u32>,
}

impl Request {
    pub(crate) fn to_wit(self) -> wit::Request {
        wit::Request {
            prompt_tokens: self.prompt_tokens,
            prompt_blocks: self.prompt_blocks,
            block_size: self.block_size,
            session_key: self.session_key,
            seed: self.seed,
            sequence: self.sequence,
            decode_alone: self.decode_alone,
            max_tokens: self.max_tokens,
            ttft_objective_ms: self.ttft_objective_ms,
            tpot_objective_ms: self.tpot_objective_ms,
        }
    }
}

fn role_to_wit(r: Role) -> wit::Role {
    match r {
        Role::Both => wit::Role::Both,
        Role::Prefill => wit::Role::Prefill,
        Role::Decode => wit::Role::Decode,
    }
}

fn role_from_wit(r: wit::Role) -> Role {
    match r {
        wit::Role::Both => Role::Both,
        wit::Role::Prefill => Role::Prefill,
        wit::Role::Decode => Role::Decode,
    }
}

/// A column's value, where it is one (negative and non-finite mean unknown).
fn known(v: f32) -> Option<f32> {
    (v >= 0.0 && v.is_finite()).then_some(v)
}

/// One candidate worker, as pushed into [`Candidates`].
#[derive(Debug, Clone, Copy, PartialEq, Default)]
pub struct CandidateRow {
    /// The worker.
    pub id: InstanceId,
    /// Leading prompt blocks it already caches.
    pub overlap_blocks: u32,
    /// Blocks held by its in-flight requests.
    pub active_blocks: u32,
    /// Prompt tokens routed to it and not yet prefilled.
    pub pending_prefill_tokens: u32,
    /// Requests in flight on it.
    pub in_flight: u32,
    /// KV usage its engine reported (the share held by running requests), in [0, 1],
    /// if any.
    pub kv_usage: Option<f32>,
    /// How full its prefix cache is (the router's index over its cache size), in
    /// [0, 1], if its cache size is known.
    pub cache_fullness: Option<f32>,
    /// What it does in a fleet that splits prefill from decode.
    pub role: Role,
    /// Its latency model's predicted time to first token for this request, ms, if known.
    pub predicted_ttft_ms: Option<f32>,
    /// ... and time per output token, ms, if known.
    pub predicted_tpot_ms: Option<f32>,
}

/// The candidate workers of one decision, as parallel columns (struct of arrays).
///
/// Reuse one across decisions (`clear`, then `push`) to avoid allocating.
#[derive(Debug, Clone)]
pub struct Candidates {
    pub(crate) cols: wit::Candidates,
    /// IDs pushed in ascending order so far (the router always does), which makes
    /// `contains` a binary search.
    ascending: bool,
}

impl Default for Candidates {
    fn default() -> Self {
        Candidates::with_capacity(0)
    }
}

impl Candidates {
    /// An empty list with room for `n` candidates.
    pub fn with_capacity(n: usize) -> Self {
        Candidates {
            cols: wit::Candidates {
                worker_ids: Vec::with_capacity(n),
                overlap_blocks: Vec::with_capacity(n),
                active_blocks: Vec::with_capacity(n),
                pending_prefill_tokens: Vec::with_capacity(n),
                in_flight: Vec::with_capacity(n),
                kv_usage: Vec::with_capacity(n),
                cache_fullness: Vec::with_capacity(n),
                roles: Vec::with_capacity(n),
                predicted_ttft_ms: Vec::with_capacity(n),
                predicted_tpot_ms: Vec::with_capacity(n),
            },
            ascending: true,
        }
    }

    /// Appends one candidate.
    pub fn push(&mut self, row: CandidateRow) {
        let c = &mut self.cols;
        self.ascending &= c.worker_ids.last().is_none_or(|&last| last < row.id.0);
        c.worker_ids.push(row.id.0);
        c.overlap_blocks.push(row.overlap_blocks);
        c.active_blocks.push(row.active_blocks);
        c.pending_prefill_tokens.push(row.pending_prefill_tokens);
        c.in_flight.push(row.in_flight);
        c.kv_usage.push(row.kv_usage.unwrap_or(-1.0));
        c.cache_fullness.push(row.cache_fullness.unwrap_or(-1.0));
        c.roles.push(role_to_wit(row.role));
        c.predicted_ttft_ms
            .push(row.predicted_ttft_ms.unwrap_or(-1.0));
        c.predicted_tpot_ms
            .push(row.predicted_tpot_ms.unwrap_or(-1.0));
    }

    /// Removes every candidate, keeping the allocations.
    pub fn clear(&mut self) {
        let c = &mut self.cols;
        c.worker_ids.clear();
        c.overlap_blocks.clear();
        c.active_blocks.clear();
        c.pending_prefill_tokens.clear();
        c.in_flight.clear();
        c.kv_usage.clear();
        c.cache_fullness.clear();
        c.roles.clear();
        c.predicted_ttft_ms.clear();
        c.predicted_tpot_ms.clear();
        self.ascending = true;
    }

    /// Makes this list a copy of `other`, reusing its allocations.
    pub fn copy_from(&mut self, other: &Candidates) {
        let (c, o) = (&mut self.cols, &other.cols);
        c.worker_ids.clone_from(&o.worker_ids);
        c.overlap_blocks.clone_from(&o.overlap_blocks);
        c.active_blocks.clone_from(&o.active_blocks);
        c.pending_prefill_tokens
            .clone_from(&o.pending_prefill_tokens);
        c.in_flight.clone_from(&o.in_flight);
        c.kv_usage.clone_from(&o.kv_usage);
        c.cache_fullness.clone_from(&o.cache_fullness);
        c.roles.clone_from(&o.roles);
        c.predicted_ttft_ms.clone_from(&o.predicted_ttft_ms);
        c.predicted_tpot_ms.clone_from(&o.predicted_tpot_ms);
        self.ascending = other.ascending;
    }

    /// Number of candidates.
    pub fn len(&self) -> usize {
        self.cols.worker_ids.len()
    }

    /// True when there is no candidate.
    pub fn is_empty(&self) -> bool {
        self.cols.worker_ids.is_empty()
    }

    /// Candidate `i`.
    pub fn row(&self, i: usize) -> CandidateRow {
        let c = &self.cols;
        CandidateRow {
            id: InstanceId(c.worker_ids[i]),
            overlap_blocks: c.overlap_blocks[i],
            active_blocks: c.active_blocks[i],
            pending_prefill_tokens: c.pending_prefill_tokens[i],
            in_flight: c.in_flight[i],
            kv_usage: (c.kv_usage[i] >= 0.0).then_some(c.kv_usage[i]),
            cache_fullness: (c.cache_fullness[i] >= 0.0).then_some(c.cache_fullness[i]),
            role: role_from_wit(c.roles[i]),
            predicted_ttft_ms: known(c.predicted_ttft_ms[i]),
            predicted_tpot_ms: known(c.predicted_tpot_ms[i]),
        }
    }

    /// Candidate `i`'s role.
    pub fn role(&self, i: usize) -> Role {
        role_from_wit(self.cols.roles[i])
    }

    /// The role of candidate `id`.
    pub fn role_of(&self, id: InstanceId) -> Option<Role> {
        self.position(id).map(|i| self.role(i))
    }

    /// True when some candidate is not a `both` worker (the fleet splits prefill from
    /// decode).
    pub fn disaggregated(&self) -> bool {
        self.cols.roles.iter().any(|r| *r != wit::Role::Both)
    }

    /// The index of candidate `id`.
    pub fn position(&self, id: InstanceId) -> Option<usize> {
        if self.ascending {
            self.cols.worker_ids.binary_search(&id.0).ok()
        } else {
            self.cols.worker_ids.iter().position(|&w| w == id.0)
        }
    }

    /// True when `id` is one of the candidates.
    pub fn contains(&self, id: InstanceId) -> bool {
        self.position(id).is_some()
    }

    /// The overlap the candidates list gives `id`.
    pub fn overlap_of(&self, id: InstanceId) -> Option<u32> {
        self.position(id).map(|i| self.cols.overlap_blocks[i])
    }

    /// The longest overlap any candidate has (0 with none).
    pub fn best_overlap(&self) -> u32 {
        self.cols.overlap_blocks.iter().copied().max().unwrap_or(0)
    }

    /// The candidates' IDs, in list order.
    pub fn ids(&self) -> impl Iterator<Item = InstanceId> + '_ {
        self.cols.worker_ids.iter().map(|&id| InstanceId(id))
    }

    /// The candidate as the shared cost model reads it.
    pub fn view(&self) -> switchyard_cost_model::CandidateView<'_> {
        switchyard_cost_model::CandidateView {
            overlap_blocks: &self.cols.overlap_blocks,
            active_blocks: &self.cols.active_blocks,
            pending_prefill_tokens: &self.cols.pending_prefill_tokens,
            in_flight: &self.cols.in_flight,
            kv_usage: &self.cols.kv_usage,
            cache_fullness: &self.cols.cache_fullness,
            predicted_ttft_ms: &self.cols.predicted_ttft_ms,
        }
    }
}

impl FromIterator<CandidateRow> for Candidates {
    fn from_iter<I: IntoIterator<Item = CandidateRow>>(iter: I) -> Self {
        let mut c = Candidates::default();
        for row in iter {
            c.push(row);
        }
        c
    }
}

/// Why a policy refused to pick a worker (a legitimate answer, not a failure).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum RejectionKind {
    /// Every candidate is too busy.
    AllBusy,
    /// No candidate fits the request.
    NoFit,
    /// Refused by the operator's rules.
    Refused,
}

/// A policy's refusal, with its reason.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Rejection {
    /// The kind of refusal.
    pub kind: RejectionKind,
    /// The policy's reason, for logs and the client.
    pub reason: String,
}

/// Longest text a policy may hand the host (a rejection reason, a configuration error),
/// bytes; longer text is cut at a character boundary and marked.
pub const MAX_GUEST_TEXT: usize = 512;
/// Longest name or version a policy may give itself, characters.
pub const MAX_GUEST_LABEL: usize = 64;

/// Text from a policy, made safe to carry: at most [`MAX_GUEST_TEXT`] bytes, control
/// characters (newlines included) as spaces, so that it can go into a client's error
/// body, a log line or a header without bloating or splitting it.
pub fn guest_text(s: &str) -> String {
    let mut out = String::with_capacity(s.len().min(MAX_GUEST_TEXT + 3));
    for c in s.chars() {
        if out.len() + c.len_utf8() > MAX_GUEST_TEXT {
            out.push('…');
            break;
        }
        out.push(if c.is_control() { ' ' } else { c });
    }
    out
}

/// A policy's name or version, made safe for a metrics label and a log field: at most
/// [`MAX_GUEST_LABEL`] characters of `A–Z a–z 0–9 . _ - + : / @`, anything else as `_`;
/// empty becomes `unnamed`.
pub fn guest_label(s: &str) -> String {
    let out: String = s
        .chars()
        .take(MAX_GUEST_LABEL)
        .map(|c| {
            if c.is_ascii_alphanumeric() || "._-+:/@".contains(c) {
                c
            } else {
                '_'
            }
        })
        .collect();
    if out.is_empty() {
        "unnamed".into()
    } else {
        out
    }
}

impl From<wit::Rejection> for Rejection {
    fn from(r: wit::Rejection) -> Self {
        Rejection {
            kind: match r.kind {
                wit::RejectionKind::AllBusy => RejectionKind::AllBusy,
                wit::RejectionKind::NoFit => RejectionKind::NoFit,
                wit::RejectionKind::Refused => RejectionKind::Refused,
            },
            reason: guest_text(&r.reason),
        }
    }
}
