//! The `kv-cost` routing decision, as plain Rust with no I/O.
//!
//! Used twice: compiled into the `kv-cost` policy component, and linked into the host as
//! the native fallback that decides whenever a policy fails. Both must agree exactly, so
//! there is one implementation.
//!
//! For candidate `i` of a request with `P` full prompt blocks and block size `B`, with
//! `u[i] = P - min(overlap_blocks[i], P)` the blocks it would have to prefill there, `n[i]`
//! its requests in flight, `f[i]` how full its prefix cache is and `k[i]` the KV usage its
//! engine reports (the share held by running requests; each 0 when unknown):
//!
//! ```text
//! q          = min over candidates of pending_prefill_tokens / B, over max(P, 1)
//! m          = min over candidates of n
//! s[i]       = m + stall_local * (n[i] - m) / (1 + q)
//! prefill[i] = pending_prefill_tokens[i] / B
//!            + u[i] * (1 + overload_weight * q + stall_weight * s[i]
//!                        + eviction_weight * f[i])
//! wait[i]    = pending_prefill_tokens[i] / B + u[i]            (the request's own wait)
//!            = predicted_ttft_ms[i] / tau + u[i]   when every candidate's is known and
//!                                             latency_weight is 1 (see below)
//! cost[i]    = overlap_weight * prefill[i]
//!            + in_flight_weight * n[i]
//!            + active_weight * (active_blocks[i] + P)
//!            + pressure_weight * k[i] * P
//! ```
//!
//! With the workers' latency models (`predicted_ttft_ms`, known for every candidate), the
//! request's own wait is the predicted time to its first token on each, in blocks of the
//! fleet's average wait per block (`tau`: the candidates' predicted waits over their
//! `wait[i] + 1`, summed): the same order of magnitude as the blocks it replaces, but
//! each worker at its own measured speed, with what its queue of *requests* costs besides
//! their tokens (a full batch's turnover; `latency_weight` between 0 and 1 blends the
//! two, 0 is the blocks alone). The uncached blocks stay in it as the prefill the
//! request adds to the fleet: in a prediction they count at the worker's time per token
//! over the fleet's time per block *and request*, which on a fleet whose requests cost
//! more than their tokens priced a hit at almost nothing: ten three-turn conversations
//! on three idle workers found 47 % of prompt tokens cached where 59 % could be, each
//! turn's cached blocks outweighed by the workers' small differences in prediction.
//! `tau` is at least `MIN_MS_PER_BLOCK`: a model fitted on sub-millisecond answers (an
//! in-process fleet) predicts differences that are the clock's jitter, not waits.
//!
//! Everything is in blocks of prefill work. The first line is the request's own wait for
//! its first token (the prefill queued ahead of it, then its own). An uncached block
//! costs more than its compute: it stalls the requests decoding on the worker that
//! prefills it for that long (`stall_weight` per request stalled, `s[i]`: by default the
//! requests in flight on the least loaded candidate, the stall wherever the block goes),
//! and on a worker whose cache is full it
//! evicts a block some later request may have wanted (`eviction_weight`, scaled by the
//! cache fullness the router knows from its index: how many blocks it holds over the
//! worker's cache size, not the engine's usage, which counts only running requests'
//! blocks and reads ~0 on an idle worker with a full cache); together these
//! keep a prefix on the worker that holds it, and send a new prefix where it disturbs
//! least. Under saturation the stall is priced at the fleet's least in-flight count, not
//! at each candidate's own: a worker whose cache is full of long prompts runs fewer
//! requests *and* has the longest prefill queue, and a per-candidate price sent every long
//! uncached prompt there (the stall term, `u × n`, outweighed its queue). While some
//! worker has nothing queued that cannot happen, and the own count is the exact price:
//! `stall_local` 1 charges it then (0 by default: it gained E2E on one trace and lost
//! TTFT on another).
//! Each request in flight costs a decode slot and step time (`in_flight_weight`), which
//! is what balances load: a cached prefix wins unless its worker is clearly busier. When
//! the whole fleet is queued (`q`: the least queued worker's waiting prefill, in prompts
//! of this request's size), an uncached block costs more still (`overload_weight`):
//! spreading then shortens no queue for long and the extra prefill lengthens them all.
//! `active_weight` prices the KV memory held by requests in flight; it is 0 by default,
//! since blocks are a poor proxy for time (long prompts would dominate every decision).
//! `pressure_weight` prices the engine's own KV usage (a request may wait for memory, or
//! preempt, where running requests hold most of it); 0 by default (docs/architecture/routing.md
//! says what it was tried at).
//!
//! With `temperature == 0` the lowest cost wins and ties are broken uniformly by the
//! request's seed. With `temperature > 0` the candidate is sampled with probability
//! proportional to `exp(-normalised_cost / temperature)`, where costs are normalised to
//! `[0, 1]` over the candidate set.

use serde::Deserialize;

/// Operator configuration of `kv-cost`, given as JSON to `configure`.
#[derive(Debug, Clone, Copy, PartialEq, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct KvCostConfig {
    /// How much a block of prefill work costs relative to the other terms.
    /// Higher values chase cache hits harder; `0` ignores the cache entirely.
    pub overlap_weight: f64,
    /// Softmax temperature; `0` picks the cheapest candidate deterministically.
    pub temperature: f64,
    /// Prefill stalls every sequence decoding on the same worker: each uncached block
    /// also costs this much per request it stalls (see `stall_local`).
    pub stall_weight: f64,
    /// The share of a candidate's in-flight count above the least loaded candidate's
    /// that the stall counts, divided by `1 + q` (`q`: the least queued candidate's
    /// pending prefill, in this request's prompts): with 1, all of it while some worker
    /// has nothing queued, less the busier the fleet. `0` (the default): always the least
    /// loaded count (docs/architecture/routing.md says what 1 did).
    pub stall_local: f64,
    /// Cost of each request in flight on a worker, in blocks of prefill: the decode
    /// slot it holds and the step time it adds for everyone else.
    pub in_flight_weight: f64,
    /// Cost per KV block held by in-flight requests (memory pressure).
    pub active_weight: f64,
    /// Cost of each uncached block on a worker whose cache is full, in blocks: what
    /// placing it there evicts (scaled by the cache fullness the router knows).
    pub eviction_weight: f64,
    /// Cost per prompt block of the KV usage the worker's engine reports (the share
    /// held by running requests): memory pressure, where the request may wait or preempt.
    pub pressure_weight: f64,
    /// Fleet overload: each uncached block also costs this much times the prefill queued
    /// on the least queued candidate, measured in this request's own prompts. When every
    /// worker has prefill waiting, moving a request away from its cache buys little wait
    /// and adds prefill work to a saturated fleet; while any worker has none, the term is 0.
    pub overload_weight: f64,
    /// Disaggregated fleets: a prompt whose uncached part on the best worker that may
    /// serve it alone is at most this many tokens runs there, prefill and all, instead
    /// of being split (conditional disaggregation; Dynamo's `max_local_prefill_length`
    /// default). Past it a prompt still runs alone when the prefill pool's queue would
    /// hold it longer than its prefill stalls the lone worker's decoding requests, all
    /// together, as Dynamo bounds its prefill queue. `0` leaves only that rule.
    pub max_local_prefill_tokens: f64,
    /// How much of the request's own wait is the workers' predicted time to first token
    /// (in blocks of the fleet's average time per block) rather than its blocks queued and
    /// uncached: 1 (the default) uses the predictions whenever every candidate has one,
    /// 0 never.
    pub latency_weight: f64,
    /// Disaggregated fleets: what a block moved to a decode worker costs, relative to
    /// one computed (it is copied, not computed: ~1/20 with a fast interconnect). Prices
    /// the decode worker's overlap when choosing it.
    pub transfer_weight: f64,
}

impl Default for KvCostConfig {
    fn default() -> Self {
        KvCostConfig {
            overlap_weight: 1.0,
            temperature: 0.0,
            stall_weight: 0.25,
            stall_local: 0.0,
            in_flight_weight: 20.0,
            active_weight: 0.0,
            eviction_weight: 10.0,
            pressure_weight: 0.0,
            overload_weight: 4.0,
            max_local_prefill_tokens: 1000.0,
            transfer_weight: 0.05,
            latency_weight: 1.0,
        }
    }
}

impl KvCostConfig {
    /// Parses and validates the operator's JSON (`""` and `{}` give the defaults).
    pub fn from_json(text: &str) -> Result<KvCostConfig, String> {
        let text = text.trim();
        let config: KvCostConfig = if text.is_empty() {
            KvCostConfig::default()
        } else {
            serde_json::from_str(text).map_err(|e| format!("invalid kv-cost config: {e}"))?
        };
        if config.latency_weight > 1.0 {
            return Err(format!(
                "invalid kv-cost config: latency_weight is a share from 0 to 1, got {}",
                config.latency_weight
            ));
        }
        for (name, value) in [
            ("overlap_weight", config.overlap_weight),
            ("temperature", config.temperature),
            ("stall_weight", config.stall_weight),
            ("stall_local", config.stall_local),
            ("in_flight_weight", config.in_flight_weight),
            ("active_weight", config.active_weight),
            ("eviction_weight", config.eviction_weight),
            ("pressure_weight", config.pressure_weight),
            ("overload_weight", config.overload_weight),
            ("max_local_prefill_tokens", config.max_local_prefill_tokens),
            ("transfer_weight", config.transfer_weight),
            ("latency_weight", config.latency_weight),
        ] {
            if !(value.is_finite() && value >= 0.0) {
                return Err(format!(
                    "invalid kv-cost config: {name} must be a finite number >= 0, got {value}"
                ));
            }
        }
        Ok(config)
    }
}

/// The request-level inputs of one decision.
#[derive(Debug, Clone, Copy)]
pub struct RequestShape {
    /// Full KV blocks in the prompt.
    pub prompt_blocks: u32,
    /// Tokens per block (treated as 1 if 0).
    pub block_size: u32,
    /// The host's per-decision random number.
    pub seed: u64,
}

/// The per-candidate inputs, as parallel slices of equal length.
#[derive(Debug, Clone, Copy)]
pub struct CandidateView<'a> {
    /// Leading prompt blocks each candidate holds.
    pub overlap_blocks: &'a [u32],
    /// Blocks held by in-flight requests on each candidate.
    pub active_blocks: &'a [u32],
    /// Prompt tokens waiting for prefill on each candidate.
    pub pending_prefill_tokens: &'a [u32],
    /// Requests in flight on each candidate.
    pub in_flight: &'a [u32],
    /// KV usage in [0, 1] each candidate's engine reported: the share held by running
    /// requests (negative: not reported).
    pub kv_usage: &'a [f32],
    /// How full each candidate's prefix cache is, in [0, 1] (negative: unknown).
    pub cache_fullness: &'a [f32],
    /// Each candidate's predicted time to first token for the request, ms (negative:
    /// unknown).
    pub predicted_ttft_ms: &'a [f32],
}

impl CandidateView<'_> {
    /// Number of candidates (the shortest of the slices, so a malformed view cannot
    /// index out of bounds).
    pub fn len(&self) -> usize {
        self.overlap_blocks
            .len()
            .min(self.active_blocks.len())
            .min(self.pending_prefill_tokens.len())
            .min(self.in_flight.len())
            .min(self.kv_usage.len())
            .min(self.cache_fullness.len())
            .min(self.predicted_ttft_ms.len())
    }

    /// True when there is no candidate.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

/// The cost of sending the request to candidate `i` (lower is better).
pub fn cost(config: &KvCostConfig, req: &RequestShape, c: &CandidateView<'_>, i: usize) -> f64 {
    Costs::new(config, req, c).of(c, i)
}

/// The per-request constants of the cost function, computed once per decision.
struct Costs {
    config: KvCostConfig,
    blocks: f64,
    per_token: f64,
    prompt_blocks: u32,
    /// What every uncached block costs besides its own compute, the same on every
    /// candidate: 1 plus the fleet-overload and stall terms.
    base: f64,
    /// The least in-flight count among the candidates.
    least_in_flight: f64,
    /// The stall's price per request in flight above `least_in_flight`.
    local_stall: f64,
    /// The fleet's average predicted wait per block of wait, ms, when every candidate's
    /// time to first token is predicted (and `latency_weight` uses it).
    tau: Option<f64>,
}

impl Costs {
    fn new(config: &KvCostConfig, req: &RequestShape, c: &CandidateView<'_>) -> Costs {
        // The prefill queued on the least queued candidate, in units of this request's
        // own prompt (a pass over the candidates only when the term is on): 0 while any
        // worker has no prefill waiting.
        let floor = if config.overload_weight > 0.0 || config.stall_local > 0.0 {
            let least = c.pending_prefill_tokens[..c.len()]
                .iter()
                .copied()
                .min()
                .unwrap_or(0);
            f64::from(least)
                / f64::from(req.block_size.max(1))
                / f64::from(req.prompt_blocks.max(1))
        } else {
            0.0
        };
        // The stall an uncached block causes wherever it goes: the requests in flight on
        // the least loaded candidate; the rest of each candidate's own count is added per
        // candidate, scaled down as the whole fleet queues.
        let least = c.in_flight[..c.len()].iter().copied().min().unwrap_or(0);
        let stall = config.stall_weight * f64::from(least);
        let per_token = 1.0 / f64::from(req.block_size.max(1));
        let blocks = f64::from(req.prompt_blocks);
        let tau = (config.latency_weight > 0.0)
            .then(|| {
                let (mut ms, mut waits) = (0.0, 0.0);
                for i in 0..c.len() {
                    let t = c.predicted_ttft_ms[i];
                    if !(t >= 0.0 && t.is_finite()) {
                        return None;
                    }
                    let uncached = blocks - f64::from(c.overlap_blocks[i].min(req.prompt_blocks));
                    ms += f64::from(t);
                    waits += f64::from(c.pending_prefill_tokens[i]) * per_token + uncached + 1.0;
                }
                // At least a millisecond a block: differences below that are the timing's
                // jitter (a model fitted on sub-millisecond answers), not a wait.
                (ms > 0.0 && waits > 0.0).then(|| (ms / waits).max(MIN_MS_PER_BLOCK))
            })
            .flatten();
        Costs {
            config: *config,
            blocks,
            per_token,
            prompt_blocks: req.prompt_blocks,
            base: 1.0 + config.overload_weight * floor + stall,
            least_in_flight: f64::from(least),
            local_stall: config.stall_weight * config.stall_local / (1.0 + floor),
            tau,
        }
    }

    #[inline]
    fn of(&self, c: &CandidateView<'_>, i: usize) -> f64 {
        self.cost(Row {
            overlap: c.overlap_blocks[i],
            active: c.active_blocks[i],
            pending: c.pending_prefill_tokens[i],
            in_flight: c.in_flight[i],
            usage: c.kv_usage[i],
            fullness: c.cache_fullness[i],
            ttft_ms: c.predicted_ttft_ms[i],
        })
    }

    #[inline(always)]
    fn cost(&self, row: Row) -> f64 {
        let Row {
            overlap,
            active,
            pending,
            in_flight,
            usage,
            fullness,
            ttft_ms,
        } = row;
        let k = &self.config;
        let uncached = self.blocks - f64::from(overlap.min(self.prompt_blocks));
        let n = f64::from(in_flight);
        // Negative (unknown) and NaN both read as 0.
        let usage = f64::from(usage.clamp(0.0, 1.0));
        let fullness = f64::from(fullness.clamp(0.0, 1.0));
        let stall = self.local_stall * (n - self.least_in_flight);
        // The request's own wait: its blocks queued and uncached, or its predicted time to
        // first token in blocks of the fleet's average; and the prefill it adds there, its
        // uncached blocks, either way. A prediction prices the cache only as this
        // request's wait, at the worker's time per token against its time per request: on
        // a fleet whose requests cost more than their tokens (full batches turning over)
        // a hit would be worth almost nothing, though every block not recomputed is
        // capacity the fleet keeps.
        let mut wait = f64::from(pending) * self.per_token + uncached;
        if let Some(tau) = self.tau {
            let w = k.latency_weight;
            wait = (1.0 - w) * wait + w * (f64::from(ttft_ms) / tau + uncached);
        }
        let prefill = wait + uncached * (self.base - 1.0 + stall + k.eviction_weight * fullness);
        k.overlap_weight * prefill
            + k.in_flight_weight * n
            + k.active_weight * (f64::from(active) + self.blocks)
            + k.pressure_weight * usage * self.blocks
    }
}

/// One candidate's columns.
#[derive(Clone, Copy)]
struct Row {
    overlap: u32,
    active: u32,
    pending: u32,
    in_flight: u32,
    usage: f32,
    fullness: f32,
    ttft_ms: f32,
}

/// The least time a block of wait stands for when predictions price the wait, ms.
pub const MIN_MS_PER_BLOCK: f64 = 1.0;

/// Picks a candidate index, or `None` when there are no candidates.
///
/// One pass: ties for the lowest cost are broken by reservoir sampling driven by the
/// seed, so each tied candidate is equally likely.
pub fn choose(config: &KvCostConfig, req: &RequestShape, c: &CandidateView<'_>) -> Option<usize> {
    let n = c.len();
    if n == 0 {
        return None;
    }
    if config.temperature > 0.0 {
        return Some(softmax_sample(config, req, c));
    }
    let costs = Costs::new(config, req, c);
    let mut best = f64::INFINITY;
    let mut pick = 0;
    let mut ties = 0u64;
    let mut bits = req.seed;
    // Zipped iterators rather than indexing: no bounds checks in the hot loop.
    let rows = c.overlap_blocks[..n]
        .iter()
        .zip(&c.active_blocks[..n])
        .zip(&c.pending_prefill_tokens[..n])
        .zip(&c.in_flight[..n])
        .zip(&c.kv_usage[..n])
        .zip(&c.cache_fullness[..n])
        .zip(&c.predicted_ttft_ms[..n]);
    for (i, ((((((&overlap, &active), &pending), &in_flight), &usage), &fullness), &ttft_ms)) in
        rows.enumerate()
    {
        let x = costs.cost(Row {
            overlap,
            active,
            pending,
            in_flight,
            usage,
            fullness,
            ttft_ms,
        });
        if x < best {
            best = x;
            pick = i;
            ties = 1;
        } else if x == best {
            ties += 1;
            bits = mix(bits);
            if uniform_below(bits, ties) == 0 {
                pick = i;
            }
        }
    }
    Some(pick)
}

fn softmax_sample(config: &KvCostConfig, req: &RequestShape, c: &CandidateView<'_>) -> usize {
    let n = c.len();
    let costs = Costs::new(config, req, c);
    let (mut lo, mut hi) = (f64::INFINITY, f64::NEG_INFINITY);
    for i in 0..n {
        let x = costs.of(c, i);
        lo = lo.min(x);
        hi = hi.max(x);
    }
    let range = hi - lo;
    let weight = |i: usize| {
        if range > 0.0 {
            (-((costs.of(c, i) - lo) / range) / config.temperature).exp()
        } else {
            1.0
        }
    };
    let total: f64 = (0..n).map(weight).sum();
    let mut target = unit_interval(mix(req.seed)) * total;
    for i in 0..n {
        target -= weight(i);
        if target < 0.0 {
            return i;
        }
    }
    n - 1
}

/// What a candidate does in a fleet that splits prefill from decode.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Role {
    /// The whole request.
    Both,
    /// Prefill only, handing the KV over.
    Prefill,
    /// Decode from KV handed over (or the whole request, where the protocol allows).
    Decode,
}

/// Where a request goes, by candidate index.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Placement {
    /// One worker serves the whole request.
    Worker(usize),
    /// Prefill on one, decode on the other.
    Pair {
        /// The prefill worker's index.
        prefill: usize,
        /// The decode worker's index.
        decode: usize,
    },
}

/// Places a request on a fleet whose candidate `i` does `role(i)`; `decode_alone`:
/// a decode worker may serve a request alone. `None` when no placement is possible.
///
/// An aggregated fleet (every role `Both`) is [`choose`]. Otherwise, with a prefill and
/// a decode worker available, the request is split: the prefill worker by the cost
/// above among the prefill workers (its prefix cache and prefill queue), the decode
/// worker by its load, a block moved to it priced at `transfer_weight` of a computed
/// one (its overlap saves moving) and no stall, eviction or overload term (a block
/// copied stalls no one and queues behind no prefill).
/// But the best worker that may serve alone (`Both`, or `Decode` with `decode_alone`)
/// serves the request itself when it would compute at most `max_local_prefill_tokens`
/// uncached tokens (a short or mostly cached prompt is not worth a handoff), or when
/// the prefill worker's wait (its queued prefill tokens and the request's uncached
/// ones) exceeds its own by more than the stall its prefill causes (its requests in
/// flight × its uncached tokens: the sum of the delays it adds): a queued prefill pool
/// does not hold a request an idle decode worker can start (conditional
/// disaggregation, as Dynamo's with its prefill queue bound). With no pair possible, the best worker that may
/// serve alone does.
pub fn place(
    config: &KvCostConfig,
    req: &RequestShape,
    c: &CandidateView<'_>,
    role: impl Fn(usize) -> Role,
    decode_alone: bool,
) -> Option<Placement> {
    let n = c.len();
    let (mut both, mut prefill, mut decode) = (Vec::new(), Vec::new(), Vec::new());
    for i in 0..n {
        match role(i) {
            Role::Both => both.push(i),
            Role::Prefill => prefill.push(i),
            Role::Decode => decode.push(i),
        }
    }
    if prefill.is_empty() && decode.is_empty() {
        return choose(config, req, c).map(Placement::Worker);
    }
    let mut alone = both;
    if decode_alone {
        alone.extend_from_slice(&decode);
        alone.sort_unstable();
    }
    let local = choose_among(config, req, c, &alone);
    if prefill.is_empty() || decode.is_empty() {
        return local.map(Placement::Worker);
    }
    // Tokens a worker computes before this request's first token: its queued prefill,
    // then the request's uncached part.
    let block = f64::from(req.block_size.max(1));
    let uncached = |i: usize| {
        f64::from(req.prompt_blocks - c.overlap_blocks[i].min(req.prompt_blocks)) * block
    };
    let wait = |i: usize| f64::from(c.pending_prefill_tokens[i]) + uncached(i);
    let p = choose_among(config, req, c, &prefill)?;
    if let Some(l) = local {
        if uncached(l) <= config.max_local_prefill_tokens {
            return Some(Placement::Worker(l));
        }
        // The time the request would save against the time it costs the others: its
        // prefill on the lone worker stalls each request decoding there for as long.
        let stall = f64::from(c.in_flight[l]) * uncached(l);
        if wait(p) - wait(l) > stall {
            return Some(Placement::Worker(l));
        }
    }
    // The decode worker: its load decides. The blocks moved to it are copied, not
    // computed: they stall no one and queue behind no prefill, so only their wire time
    // counts, at `transfer_weight` of a computed block's.
    let moving = KvCostConfig {
        overlap_weight: config.overlap_weight * config.transfer_weight,
        stall_weight: 0.0,
        stall_local: 0.0,
        eviction_weight: 0.0,
        overload_weight: 0.0,
        ..*config
    };
    let d = choose_among(&moving, req, c, &decode)?;
    Some(Placement::Pair {
        prefill: p,
        decode: d,
    })
}

/// [`choose`] among the candidates at `rows`; the index in the whole list.
fn choose_among(
    config: &KvCostConfig,
    req: &RequestShape,
    c: &CandidateView<'_>,
    rows: &[usize],
) -> Option<usize> {
    fn pick<T: Copy>(col: &[T], rows: &[usize]) -> Vec<T> {
        rows.iter().map(|&i| col[i]).collect()
    }
    let (o, a, p, f, u, k, t) = (
        pick(c.overlap_blocks, rows),
        pick(c.active_blocks, rows),
        pick(c.pending_prefill_tokens, rows),
        pick(c.in_flight, rows),
        pick(c.kv_usage, rows),
        pick(c.cache_fullness, rows),
        pick(c.predicted_ttft_ms, rows),
    );
    let sub = CandidateView {
        overlap_blocks: &o,
        active_blocks: &a,
        pending_prefill_tokens: &p,
        in_flight: &f,
        kv_usage: &u,
        cache_fullness: &k,
        predicted_ttft_ms: &t,
    };
    choose(config, req, &sub).map(|j| rows[j])
}

/// SplitMix64's finaliser: spreads any seed (even a counter) over all 64 bits.
pub fn mix(seed: u64) -> u64 {
    let mut z = seed.wrapping_add(0x9e37_79b9_7f4a_7c15);
    z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    z ^ (z >> 31)
}

/// Maps 64 random bits to `0..n` without modulo bias worth measuring (Lemire's
/// multiply-shift).
pub fn uniform_below(bits: u64, n: u64) -> u64 {
    ((u128::from(bits) * u128::from(n)) >> 64) as u64
}

fn unit_interval(bits: u64) -> f64 {
    (bits >> 11) as f64 * (1.0 / (1u64 << 53) as f64)
}

#[cfg(test)]
mod tests;
