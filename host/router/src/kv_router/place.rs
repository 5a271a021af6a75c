//! Placing a request: the candidates gathered (overlap, load, saturation, predicted
//! latency), the request refused when its objectives are met nowhere, the policy asked,
//! and the placement booked on the chosen worker (and its prefill leg).

use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

use switchyard_ids::{BlockHash, InstanceId, RequestId, Role};
use switchyard_kv::load::Watch;
use switchyard_policy::{CandidateRow, Candidates, Decider, DecisionOutcome, Request};

use super::views::{Admit, Saturated};
use super::{Gathered, KvRouter};
use crate::{
    Ask, Placing, Prediction, PrefillLeg, RouteError, Routed, has_room, prefill_pool_full, quality,
    unsaturated,
};

/// A duration in milliseconds, as the policy sees it.
fn ms(d: Duration) -> f32 {
    (d.as_secs_f64() * 1e3) as f32
}

impl KvRouter {
    /// Routes a request given its token IDs, avoiding `exclude` (workers that already
    /// failed this request).
    pub fn route(
        &self,
        tokens: &[u32],
        session_key: Option<u64>,
        exclude: &[InstanceId],
    ) -> Result<Routed, RouteError> {
        let hashes = self.hasher.hashes(tokens);
        self.route_blocks(
            tokens.len() as u32,
            &hashes,
            session_key,
            exclude,
            Instant::now(),
        )
    }

    /// Routes a streamed request given its block hashes (`prompt_tokens` may exceed the
    /// hashed blocks by a partial block).
    pub fn route_blocks(
        &self,
        prompt_tokens: u32,
        hashes: &[BlockHash],
        session_key: Option<u64>,
        exclude: &[InstanceId],
        now: Instant,
    ) -> Result<Routed, RouteError> {
        let ask = Ask {
            session_key,
            ..Ask::new(prompt_tokens, hashes)
        };
        self.place(&ask, exclude, now, Placing::Any)
    }

    /// Places `ask` on the workers `placing` allows, avoiding `exclude`. Saturated
    /// workers, and workers predicted to miss the request's objectives, are left out
    /// while a worker of their role is not; when every one is, the request is placed
    /// among them all.
    pub fn place(
        &self,
        ask: &Ask<'_>,
        exclude: &[InstanceId],
        now: Instant,
        placing: Placing,
    ) -> Result<Routed, RouteError> {
        self.place_as(ask, exclude, now, placing, Admit::Route)
    }

    /// [`KvRouter::place`] for a request arriving, but [`RouteError::Saturated`] when
    /// every candidate is saturated: the caller queues the request and places it with
    /// [`KvRouter::dispatch`] when [`KvRouter::load_changed`] says so.
    pub fn try_place(&self, ask: &Ask<'_>, now: Instant) -> Result<Routed, RouteError> {
        self.place_as(ask, &[], now, Placing::Any, Admit::Arrive)
    }

    /// [`KvRouter::try_place`] for a request leaving the router's queue: the policy
    /// places it as it would an arrival, and it leaves only if that worker is below
    /// every saturation signal, the expected wait included (else
    /// [`RouteError::Saturated`]: it stays queued). Offering it only the workers below
    /// them sent a held request to whichever worker freed first, without its cache:
    /// the freed worker prefilled the prompt again and was saturated in turn, and on
    /// B7's large-cache shape the queue held what it could not place until the mean TTFT
    /// was 18 s against 3.2 s (docs/benchmarks/predicted-latency.md).
    pub fn dispatch(&self, ask: &Ask<'_>, now: Instant) -> Result<Routed, RouteError> {
        self.place_as(ask, &[], now, Placing::Any, Admit::Dispatch)
    }

    fn place_as(
        &self,
        ask: &Ask<'_>,
        exclude: &[InstanceId],
        now: Instant,
        placing: Placing,
        admit: Admit,
    ) -> Result<Routed, RouteError> {
        let started = Instant::now();
        let busy = self.client.busy(now);
        let Gathered {
            mut candidates,
            saturation,
            predictions,
            ..
        } = if busy.is_empty() {
            self.gather(ask, exclude)
        } else {
            let mut skip = exclude.to_vec();
            skip.extend(busy.iter().map(|(id, _)| *id));
            self.gather(ask, &skip)
        };
        if !saturation.is_empty() && saturation.iter().all(|s| s.late) {
            self.quality.unrouted(quality::UNROUTED_OBJECTIVES);
            return Err(self.late(ask, &predictions));
        }
        let saturated: Vec<bool> = saturation.iter().map(|s| s.is_some()).collect();
        // Whether a decode worker may serve a request by itself (vLLM's handoff; SGLang's
        // needs its prefill worker): then a full prefill pool does not fill the fleet.
        let mut decode_alone = !candidates.disaggregated() || self.decode_alone();
        let holding = admit != Admit::Route && !saturated.is_empty();
        if holding && !has_room(&candidates, &saturated, decode_alone) {
            return Err(self.held(saturated.len()));
        }
        let prefill_full = holding && prefill_pool_full(&candidates, &saturated);
        let workers = saturated.len();
        // A request leaving the queue is offered what an arrival is, and stays in the
        // queue while the policy's choice is saturated (see [`KvRouter::dispatch`]).
        let left_out: Vec<bool> = saturation.iter().map(|s| s.avoided).collect();
        if left_out.iter().any(|s| *s) {
            candidates = unsaturated(candidates, &left_out);
        }
        if candidates.disaggregated() {
            let keep = |role: Role| match placing {
                Placing::Any => true,
                Placing::Alone => role == Role::Both || (decode_alone && role == Role::Decode),
                Placing::Decode => role == Role::Decode,
            };
            if placing != Placing::Any {
                candidates = (0..candidates.len())
                    .map(|i| candidates.row(i))
                    .filter(|r| keep(r.role))
                    .collect();
            }
            if placing == Placing::Decode {
                decode_alone = true;
            }
        }
        if candidates.is_empty() {
            return Err(self.unrouted(&busy, exclude));
        }
        let prompt_blocks = ask.hashes.len() as u32;
        let request = Request {
            decode_alone,
            ..self.request(ask)
        };
        let decision = self.policy.decide(request, &candidates);
        if admit == Admit::Dispatch
            && let DecisionOutcome::Chosen(id) = &decision.outcome
            && (predictions.iter().zip(&saturated)).any(|((w, _), s)| *s && w == id)
        {
            return Err(self.held(workers));
        }
        if prefill_full && decision.prefill.is_some() {
            // The policy split it, and every prefill worker is saturated: it waits, as it
            // would had no decode worker had room.
            return Err(self.held(workers));
        }
        if let Some(shadow) = &*self.shadow.load() {
            let live = match &decision.outcome {
                DecisionOutcome::Chosen(id) => Some(*id),
                _ => None,
            };
            let seen = Request {
                sequence: decision.sequence,
                seed: decision.seed,
                ..request
            };
            shadow.offer(decision.sequence, &seen, &candidates, live);
        }
        let worker = match &decision.outcome {
            DecisionOutcome::Chosen(id) => *id,
            DecisionOutcome::Rejected(r) => {
                self.quality.unrouted(quality::rejection_index(r.kind));
                return Err(RouteError::Rejected(r.clone()));
            }
            DecisionOutcome::NoCandidates => {
                self.quality.unrouted(0);
                return Err(RouteError::NoInstances {
                    endpoint: self.endpoint.to_string(),
                    excluded: exclude.len(),
                });
            }
        };
        debug_assert!(decision.decider == Decider::Fallback || candidates.contains(worker));
        let overlap_blocks = candidates.overlap_of(worker).unwrap_or(0);
        let prefill = decision.prefill.map(|p| PrefillLeg {
            worker: p,
            request: RequestId(self.next_request.fetch_add(1, Ordering::Relaxed)),
            overlap_blocks: candidates.overlap_of(p).unwrap_or(0),
        });
        // The prompt's blocks are computed where its prefill runs.
        let (computes, computed_overlap) =
            prefill.map_or((worker, overlap_blocks), |p| (p.worker, p.overlap_blocks));
        self.quality
            .routed(computes, computed_overlap, candidates.best_overlap());
        let request = RequestId(self.next_request.fetch_add(1, Ordering::Relaxed));
        let predicted = self.book(ask, worker, request, overlap_blocks, prefill, now);
        // Both workers of a split hold the prompt's blocks after it.
        for w in std::iter::once(worker).chain(prefill.map(|p| p.worker)) {
            if !self.is_exact(w) {
                self.index.write().predicted.record(w, ask.hashes, now);
            }
        }
        let decision_time = started.elapsed();
        self.quality.record_latency(decision_time);
        Ok(Routed {
            worker,
            request,
            overlap_blocks,
            prompt_blocks,
            decision,
            decision_time,
            prefill,
            predicted,
        })
    }

    /// Every candidate of the request is saturated: it waits in the router's queue.
    fn held(&self, workers: usize) -> RouteError {
        RouteError::Saturated {
            endpoint: self.endpoint.to_string(),
            workers,
        }
    }

    /// Why no worker would meet `ask`'s objectives now, from the candidate that misses
    /// them least, and when it is predicted to meet them.
    fn late(&self, ask: &Ask<'_>, predictions: &[(InstanceId, Prediction)]) -> RouteError {
        let o = ask.objectives;
        let best = predictions
            .iter()
            .filter_map(|(_, p)| Some((o.overshoot(p)?, p)))
            .min_by(|a, b| a.0.total_cmp(&b.0))
            .map(|(_, p)| *p)
            .unwrap_or_default();
        let shown = |d: Duration| format!("{} ms", d.as_millis());
        let mut why = Vec::new();
        let mut retry_after = Duration::from_secs(1);
        if let Some((objective, predicted)) = o.ttft.zip(best.ttft).filter(|(o, p)| p > o) {
            why.push(format!(
                "time to first token {} against {}",
                shown(predicted),
                shown(objective)
            ));
            retry_after = retry_after.max(predicted - objective);
        }
        if let Some((objective, predicted)) = o.tpot.zip(best.tpot).filter(|(o, p)| p > o) {
            why.push(format!(
                "time per output token {} against {}",
                shown(predicted),
                shown(objective)
            ));
        }
        RouteError::Late {
            endpoint: self.endpoint.to_string(),
            why: why.join(", "),
            retry_after: retry_after.min(Duration::from_secs(60)),
        }
    }

    /// Why a request found no candidate: every routable worker left is busy (and for
    /// how long), or there is none.
    fn unrouted(
        &self,
        busy: &[(InstanceId, std::time::Duration)],
        exclude: &[InstanceId],
    ) -> RouteError {
        let routable = self.client.routable();
        if let Some(retry_after) = busy
            .iter()
            .filter(|(id, _)| routable.contains(id) && !exclude.contains(id))
            .map(|(_, left)| *left)
            .min()
        {
            self.quality.unrouted(1);
            return RouteError::Busy {
                endpoint: self.endpoint.to_string(),
                retry_after,
            };
        }
        self.quality.unrouted(0);
        RouteError::NoInstances {
            endpoint: self.endpoint.to_string(),
            excluded: exclude.len(),
        }
    }

    /// Books `ask` on `worker` (and its prefill leg, if split), each leg watched as what
    /// its answer will show; sweeps leaked bookings on the way. Returns the prediction
    /// for `worker`.
    fn book(
        &self,
        ask: &Ask<'_>,
        worker: InstanceId,
        request: RequestId,
        overlap_blocks: u32,
        prefill: Option<PrefillLeg>,
        now: Instant,
    ) -> Prediction {
        let uncached = |overlap: u32| self.uncached(ask, overlap);
        let (predicted, expired) = {
            let mut load = self.load.lock();
            let expired = load.maybe_expire(now, self.config.load_expiry);
            let watch = if ask.stream {
                Watch::FirstToken
            } else {
                Watch::WholeAnswer
            };
            let predicted = match prefill {
                None => load.book(
                    request,
                    worker,
                    ask.hashes,
                    uncached(overlap_blocks),
                    now,
                    watch,
                ),
                Some(p) => {
                    // The prefill leg's answer is its first token.
                    load.book(
                        p.request,
                        p.worker,
                        ask.hashes,
                        uncached(p.overlap_blocks),
                        now,
                        Watch::FirstToken,
                    );
                    // The decode worker receives the full blocks: it computes the rest.
                    let rest = uncached(ask.hashes.len() as u32);
                    let predicted = load.book(request, worker, ask.hashes, rest, now, watch);
                    // Its clock starts at the handoff.
                    load.link(p.request, request);
                    predicted
                }
            };
            (predicted, expired)
        };
        if expired > 0 {
            self.expired_bookings
                .fetch_add(expired as u64, Ordering::Relaxed);
            tracing::warn!(endpoint = %self.endpoint, expired, "load bookings leaked and were released by the hard expiry");
        }
        predicted
    }

    /// `ask`'s prompt tokens past `overlap` cached blocks: what a worker holding them
    /// would prefill.
    fn uncached(&self, ask: &Ask<'_>, overlap: u32) -> u64 {
        let cached = u64::from(overlap) * u64::from(self.config.block_size);
        u64::from(ask.prompt_tokens).saturating_sub(cached)
    }

    /// [`KvRouter::candidates`], and whether each candidate is saturated.
    pub(super) fn gather(&self, ask: &Ask<'_>, exclude: &[InstanceId]) -> Gathered {
        let hashes = ask.hashes;
        let snapshot = self.client.snapshot();
        let available = snapshot.routable.clone();
        let mut overlaps = Vec::new();
        // Each candidate's cache fullness: the blocks the index holds for it over its
        // cache size, where its reports gave one.
        let fullness: Vec<Option<f32>> = {
            let index = self.index.read();
            index.overlaps(hashes, |w, n| overlaps.push((w, n)));
            let capacities = self.capacities.lock();
            available
                .iter()
                .map(|id| {
                    let capacity = *capacities.get(id).filter(|c| **c > 0)?;
                    Some((index.worker_blocks(*id) as f64 / capacity as f64).min(1.0) as f32)
                })
                .collect()
        };
        overlaps.sort_unstable();
        // A worker whose event view is incomplete may have predictions too: the longer wins.
        overlaps.dedup_by(|later, kept| {
            if later.0 == kept.0 {
                kept.1 = kept.1.max(later.1);
                true
            } else {
                false
            }
        });
        let mut candidates = Candidates::with_capacity(available.len());
        let mut saturation = Vec::with_capacity(available.len());
        let mut predictions = Vec::with_capacity(available.len());
        let now = Instant::now();
        let mut load = self.load.lock();
        load.settle(now);
        for (&id, &cache_fullness) in available.iter().zip(&fullness) {
            if exclude.contains(&id) {
                continue;
            }
            let l = load.load(id, now);
            let cached = overlaps
                .binary_search_by_key(&id, |(w, _)| *w)
                .map_or(0, |i| overlaps[i].1);
            let overlap = load.extend_overlap(id, hashes, cached);
            let uncached = self.uncached(ask, overlap);
            let predicted = load.predict(id, uncached, now);
            // Late: predicted to miss an objective it would meet with nothing ahead
            // (an objective no worker could meet is not held against the load).
            let late = ask.objectives.missed_by(&predicted)
                && !ask.objectives.missed_by(&load.predict_alone(id, uncached));
            let sat = &self.config.saturation;
            saturation.push(Saturated {
                any: sat.reason(&l).is_some(),
                avoided: late || sat.avoided(&l).is_some(),
                late,
            });
            predictions.push((id, predicted));
            candidates.push(CandidateRow {
                id,
                overlap_blocks: overlap,
                active_blocks: l.active_blocks,
                pending_prefill_tokens: l.pending_prefill_tokens.min(u64::from(u32::MAX)) as u32,
                in_flight: l.in_flight,
                kv_usage: l.reported.and_then(|r| r.kv_usage()),
                cache_fullness,
                role: snapshot
                    .instances
                    .get(&id)
                    .map_or(Role::Both, |s| s.info.role),
                predicted_ttft_ms: predicted.ttft.map(ms),
                predicted_tpot_ms: predicted.tpot.map(ms),
            });
        }
        Gathered {
            candidates,
            overlaps,
            saturation,
            predictions,
        }
    }
}
