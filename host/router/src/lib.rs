//! `KvRouter`: one per endpoint. Builds the candidates of a request — the endpoint's
//! available instances (from the shared `Client`), each with its KV overlap (from the
//! index) and load (from the tracker) — asks the endpoint's policy, validates the
//! answer, and books the request's load on the chosen worker.
//!
//! The router core, embeddable by any front door: [`client`] (an endpoint's available
//! instances, instance-down reports, outlier detection and re-admission), `KvRouter`,
//! and the subscribers that keep its view of the workers' caches and load current.
//!
//! - `kv_router`: [`KvRouter`] — candidates, decisions, bookings, shadows;
//! - `feeds`: what the subscribers and responses tell it — cache views, load reports,
//!   context lengths, workers' cached-prefix reports.
//!
//! Must not know: wasmtime (it sees `PolicyHandle`), etcd (it sees `Discovery`), HTTP
//! serving.

pub mod central_events;
pub mod client;
pub mod engine_subscriber;
mod feeds;
mod kv_router;
pub mod metrics_scraper;
pub mod quality;
pub mod shadow;
pub mod subscriber;
pub mod zmtp;

use std::sync::Arc;
use std::time::Duration;

use switchyard_ids::{BlockHash, InstanceId, RequestId, Role};
use switchyard_kv::approx::ApproxIndex;
use switchyard_kv::engine_view::ViewCounts;
use switchyard_kv::index::OverlapIndex;
pub use switchyard_kv::latency::Prediction;
use switchyard_policy::{Decision, Rejection};

pub use feeds::UNPREDICTED_STREAK;
pub use kv_router::KvRouter;

/// Approximate mode, for workers that publish no KV events: the router's decisions
/// become predicted cache contents.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Approximate {
    /// How long a prediction lives.
    pub ttl: Duration,
    /// Most (worker, block) predictions kept.
    pub max_blocks: usize,
}

impl Default for Approximate {
    fn default() -> Self {
        Approximate {
            ttl: Duration::from_secs(120),
            max_blocks: 1 << 20,
        }
    }
}

/// When a worker is *saturated*: it gets no new request while a candidate of its role
/// that is not saturated exists, and when every candidate is, requests wait in the
/// router's queue (the front door's) instead of an engine's.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Saturation {
    /// An estimated engine queue ([`switchyard_kv::load::WorkerLoad::queued`]) of this
    /// many requests saturates a worker; 0: never by its queue.
    pub queued: u32,
    /// A reported KV usage at or above this share saturates a worker; above 1: never.
    pub kv_usage: f32,
    /// Requests in flight (the worker's report and this router's bookings) at which a
    /// worker is saturated: a concurrency the operator knows its workers meet their
    /// latency objectives at, or a limit for workers that report nothing; 0: none.
    pub max_in_flight: u32,
    /// Uncached prompt tokens routed to a worker and not yet prefilled at which it is
    /// saturated: a request sent there would wait that long for its first token; 0:
    /// no such limit.
    pub prefill_tokens: u64,
    /// The expected wait for the requests already routed to a worker (its latency model
    /// over what is ahead, [`switchyard_kv::load::WorkerLoad::expected_wait`]) at which
    /// it is saturated: a request sent there would wait at least this long for its
    /// first token; zero: none.
    pub wait: Duration,
    /// A worker whose engine queues requests while as many are in flight there as it
    /// was ever seen running ([`switchyard_kv::load::WorkerLoad::batch_full`]) is
    /// saturated: a request sent there would wait in its engine's queue for a slot.
    pub batch_full: bool,
}

/// The expected wait that saturates a worker by default.
pub const DEFAULT_SATURATION_WAIT: Duration = Duration::from_secs(1);

impl Default for Saturation {
    /// The expected wait, at [`DEFAULT_SATURATION_WAIT`], and a full batch. When every
    /// worker's engine queues beside as many requests as it ever ran at once, requests
    /// wait in the router's queue rather than in the engines': a whole answer's time is
    /// its decode, which the wait for a first token never sees (on B7's Mooncake fleet
    /// at 3× its capacity, whole answers' goodput 13.8 % before this signal, 29.2 %
    /// with it; docs/benchmarks/predicted-latency.md). When every worker would
    /// make a new request wait a second for the prefill routed ahead of it, requests
    /// wait in the router's queue, in order of class and tenant, instead of in an
    /// engine's, and leave it for the worker the policy places them on once it is below
    /// the second (it holds; where a request goes is the policy's, see
    /// [`Saturation::avoided`] and [`KvRouter::dispatch`]). A signal in time
    /// rather than in counts holds for every workload (long prompts or short, cached or
    /// not) and every engine speed, which no one count does: the counts that win on one
    /// trace halve another's throughput; a full batch is the engine's own count, learned.
    /// The engine queue alone is not a default signal because engines that chunk
    /// prefills (vLLM V1, SGLang) queue while they have room: a long prompt holds each
    /// step's token budget for many steps and requests arriving meanwhile wait for it,
    /// with slots and memory free; held in the router instead, they lost their cache and
    /// their place (on B7's large-cache shape kv-cost's mean TTFT was 31 s with the
    /// engine queue at 4, 1.8 s without). KV usage is not one either:
    /// engines run with their cache nearly full by design (vLLM sizes its batch to it),
    /// so a full cache is a busy worker, not a saturated one. An operator who knows the
    /// concurrency or prefill backlog at which workers meet their objectives adds it.
    fn default() -> Self {
        Saturation {
            queued: 0,
            kv_usage: f32::INFINITY,
            max_in_flight: 0,
            prefill_tokens: 0,
            wait: DEFAULT_SATURATION_WAIT,
            batch_full: true,
        }
    }
}

impl Saturation {
    /// Whether a worker with load `l` is saturated, and by what.
    pub fn reason(&self, l: &switchyard_kv::load::WorkerLoad) -> Option<&'static str> {
        self.avoided(l)
            .or_else(|| (self.batch_full && l.batch_full).then_some("batch full"))
            .or_else(|| {
                (!self.wait.is_zero() && l.expected_wait.is_some_and(|w| w >= self.wait))
                    .then_some("expected wait")
            })
    }

    /// Whether a worker with load `l` is saturated by a signal that keeps every new
    /// request away from it while another worker has room (every signal but the
    /// expected wait), and by what. The expected wait decides whether a request waits
    /// in the router's queue, and where one leaving the queue may go; a request
    /// arriving while some worker is below it goes where the policy puts it (whose
    /// costs weigh each worker's pending prefill against its cache): holding a cached
    /// worker's next request back from it at one second of backlog cost a sixth of the
    /// hits below capacity for no time saved.
    pub fn avoided(&self, l: &switchyard_kv::load::WorkerLoad) -> Option<&'static str> {
        if self.queued > 0 && l.queued >= self.queued {
            Some("engine queue")
        } else if l
            .reported
            .and_then(|r| r.kv_usage())
            .is_some_and(|u| u >= self.kv_usage)
        {
            Some("KV cache full")
        } else if self.max_in_flight > 0 && l.in_flight >= self.max_in_flight {
            Some("requests in flight")
        } else if self.prefill_tokens > 0 && l.pending_prefill_tokens >= self.prefill_tokens {
            Some("prefill backlog")
        } else {
            None
        }
    }
}

/// One endpoint's routing configuration.
#[derive(Debug, Clone)]
pub struct KvRouterConfig {
    /// Tokens per KV block (must match the workers').
    pub block_size: u32,
    /// Seed of the block hash chain (must match the workers').
    pub hash_seed: u64,
    /// Predictions for the workers without an event stream (workers with one are
    /// mirrored exactly from their events).
    pub approximate: Approximate,
    /// A booked request still open after this long is released anyway.
    pub load_expiry: Duration,
    /// The trust put in `https://` workers' certificates (event streams, metrics pages).
    pub tls: switchyard_net::upstream::Tls,
    /// The bound sockets engines connect to (central mode), if any.
    pub central_events: Option<Arc<central_events::CentralEvents>>,
    /// Pass clients' `Authorization` header on to this endpoint's workers.
    pub forward_authorization: bool,
    /// How long a worker's load report counts towards its requests in flight.
    pub report_ttl: Duration,
    /// When a worker is saturated.
    pub saturation: Saturation,
    /// The process's one budget for engines' KV event input (clones share it): every
    /// batch's bytes are taken from it before they are read and held until handled.
    pub event_budget: switchyard_bounded::budget::Budget,
}

/// The default budget for KV event input: 512 MiB, room for sixteen of the largest
/// batches (32 MiB) at once, far more than engines send in normal operation.
pub const DEFAULT_EVENT_MEMORY: u64 = 512 << 20;

impl KvRouterConfig {
    /// Defaults for `block_size`: hash seed 0, predictions for 2 minutes, 10-minute
    /// load expiry.
    pub fn new(block_size: u32) -> KvRouterConfig {
        KvRouterConfig {
            block_size,
            hash_seed: 0,
            approximate: Approximate::default(),
            load_expiry: Duration::from_secs(600),
            tls: switchyard_net::upstream::Tls::default(),
            central_events: None,
            forward_authorization: false,
            report_ttl: switchyard_kv::load::REPORT_TTL,
            saturation: Saturation::default(),
            event_budget: switchyard_bounded::budget::Budget::new(DEFAULT_EVENT_MEMORY),
        }
    }
}

/// Why a request could not be routed.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum RouteError {
    /// The endpoint has no available instance (or all were excluded by retries).
    #[error("no available instance for endpoint {endpoint} ({excluded} excluded after failures)")]
    NoInstances {
        /// The endpoint.
        endpoint: String,
        /// Instances excluded by the caller.
        excluded: usize,
    },
    /// Every remaining instance asked for a pause (429/503 with `Retry-After`).
    #[error("every available instance of endpoint {endpoint} is busy; retry after {}s", .retry_after.as_secs().max(1))]
    Busy {
        /// The endpoint.
        endpoint: String,
        /// The shortest pause left.
        retry_after: Duration,
    },
    /// The policy refused the request.
    #[error("the routing policy rejected the request: {}", .0.reason)]
    Rejected(Rejection),
    /// Every candidate is saturated ([`KvRouter::try_place`] only): the request should
    /// wait.
    #[error("every worker of endpoint {endpoint} is saturated ({workers} workers)")]
    Saturated {
        /// The endpoint.
        endpoint: String,
        /// Saturated candidates.
        workers: usize,
    },
    /// Every candidate is predicted to miss the request's objectives, which one of them
    /// would meet with nothing ahead: the load is why, and it may pass.
    #[error("no worker of endpoint {endpoint} is predicted to meet the request's objectives now ({why}); retry after {}s", .retry_after.as_secs().max(1))]
    Late {
        /// The endpoint.
        endpoint: String,
        /// What the best candidate was predicted to miss, and by how much.
        why: String,
        /// How long until the best candidate is predicted to meet them (the time its
        /// predicted first token is past the objective, at least a second, at most a
        /// minute).
        retry_after: Duration,
    },
}

/// A request's latency objectives: the worst time to first token and time per output
/// token it accepts (see [`Ask::objectives`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct Objectives {
    /// Time to first token.
    pub ttft: Option<Duration>,
    /// Time per output token after the first.
    pub tpot: Option<Duration>,
}

impl Objectives {
    /// Whether it sets any.
    pub fn any(&self) -> bool {
        self.ttft.is_some() || self.tpot.is_some()
    }

    /// Whether `p` misses one (an unknown prediction misses nothing).
    pub fn missed_by(&self, p: &Prediction) -> bool {
        self.overshoot(p).is_some()
    }

    /// By how much `p` misses them, the worse of the two as a share of its objective
    /// (`None`: it meets both, or what it would miss is unknown).
    pub fn overshoot(&self, p: &Prediction) -> Option<f64> {
        let over = |objective: Option<Duration>, predicted: Option<Duration>| {
            let (o, p) = objective.zip(predicted)?;
            (p > o).then(|| (p.as_secs_f64() - o.as_secs_f64()) / o.as_secs_f64().max(1e-9))
        };
        match (over(self.ttft, p.ttft), over(self.tpot, p.tpot)) {
            (Some(a), Some(b)) => Some(a.max(b)),
            (a, b) => a.or(b),
        }
    }
}

/// A request as the router places it: its prompt, how its answer comes back (which says
/// what the latency model can learn from it) and its objectives.
#[derive(Debug, Clone, Copy)]
pub struct Ask<'a> {
    /// Prompt length in tokens (it may exceed the hashed blocks by a partial block).
    pub prompt_tokens: u32,
    /// The prompt's block hashes.
    pub hashes: &'a [BlockHash],
    /// A hash of its session or affinity key, if it has one.
    pub session_key: Option<u64>,
    /// Whether its answer is streamed: the router then sees its first token (else only
    /// the whole answer).
    pub stream: bool,
    /// The most output tokens it asks for, if it says.
    pub max_tokens: Option<u32>,
    /// Its latency objectives: a worker predicted to miss one while another is not is
    /// left out of its placement, and when every worker is (and would not be idle),
    /// the request is refused ([`RouteError::Late`]) rather than queued.
    pub objectives: Objectives,
}

impl<'a> Ask<'a> {
    /// A streamed request with this prompt and nothing else said.
    pub fn new(prompt_tokens: u32, hashes: &'a [BlockHash]) -> Ask<'a> {
        Ask {
            prompt_tokens,
            hashes,
            session_key: None,
            stream: true,
            max_tokens: None,
            objectives: Objectives::default(),
        }
    }
}

/// A routed request. Call [`KvRouter::prefill_done`] at its first token, and
/// [`KvRouter::complete`] when it ends complete or [`KvRouter::finish`] when it fails or
/// is cancelled.
#[derive(Debug, Clone)]
pub struct Routed {
    /// The chosen worker.
    pub worker: InstanceId,
    /// The load booking.
    pub request: RequestId,
    /// Leading prompt blocks the worker already holds.
    pub overlap_blocks: u32,
    /// Full prompt blocks.
    pub prompt_blocks: u32,
    /// How the policy decided.
    pub decision: Decision,
    /// How long the whole decision took (candidates, overlaps, policy, booking); the
    /// policy's own call is `decision.call_time`.
    pub decision_time: Duration,
    /// A split request's prefill leg (`worker` then decodes it).
    pub prefill: Option<PrefillLeg>,
    /// What `worker`'s latency model predicted for it (for a split, the decode leg's).
    pub predicted: Prediction,
}

/// The prefill worker of a split request, booked for the prompt's prefill. Call
/// [`KvRouter::finish`] with its `request` when the handoff is done or failed.
#[derive(Debug, Clone, Copy)]
pub struct PrefillLeg {
    /// The prefill worker.
    pub worker: InstanceId,
    /// Its load booking.
    pub request: RequestId,
    /// Leading prompt blocks it already holds.
    pub overlap_blocks: u32,
}

/// Which workers a decision may place a request on.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Placing {
    /// Any placement the fleet allows: one worker, or a prefill and decode pair.
    #[default]
    Any,
    /// One worker serving the whole request: a `both` worker, or a `decode` worker
    /// where the fleet's handoff lets it serve alone (a stream's continuation).
    Alone,
    /// A `decode` worker for a prefill already done (vLLM's handoff, retried).
    Decode,
}

/// Exact caches of the workers with event streams, predicted caches of the others. A
/// worker is only ever in one of them.
pub(crate) struct Index {
    pub(crate) events: OverlapIndex,
    pub(crate) predicted: ApproxIndex,
}

impl Index {
    pub(crate) fn overlaps(&self, hashes: &[BlockHash], mut f: impl FnMut(InstanceId, u32)) {
        self.events.overlaps(hashes, &mut f);
        self.predicted.index().overlaps(hashes, f);
    }

    /// The blocks the index holds for `worker`: its cache as its events say, or as the
    /// router predicts it.
    pub(crate) fn worker_blocks(&self, worker: InstanceId) -> usize {
        self.events.worker_blocks(worker) + self.predicted.index().worker_blocks(worker)
    }

    pub(crate) fn worker_block_list(&self, worker: InstanceId) -> Vec<BlockHash> {
        let mut v = self.events.worker_block_list(worker);
        v.extend(self.predicted.index().worker_block_list(worker));
        v.sort_unstable();
        v
    }
}

/// The client of the router's background readers (event streams, metrics pages), for
/// `http://` and `https://` workers alike.
pub(crate) fn background_http(
    tls: &switchyard_net::upstream::Tls,
    connect_timeout: Duration,
) -> hyper_util::client::legacy::Client<
    switchyard_net::upstream::Connector,
    http_body_util::Empty<bytes::Bytes>,
> {
    hyper_util::client::legacy::Client::builder(hyper_util::rt::TokioExecutor::new())
        .build(tls.connector(connect_timeout))
}

/// Where the router's idea of a worker's cache comes from.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize)]
#[serde(rename_all = "snake_case")]
pub enum CacheView {
    /// The worker's own events, followed without a gap: exact.
    Events,
    /// Its events, but with a gap not yet refilled (or not yet in sync): the router
    /// blends in its own predictions.
    Incomplete,
    /// No events: predicted from the router's own decisions.
    Approximate,
}

/// A worker's event-fed view, as the subscriber last reported it.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct ViewStatus {
    /// Every rank in sync, no unfilled gap.
    pub complete: bool,
    /// The engine view's counters (zero for the NDJSON stream).
    pub counts: ViewCounts,
    /// Batches that could not be decoded.
    pub malformed: u64,
    /// Replay requests that failed (each silences replay requests for a while).
    pub replay_failures: u64,
}

/// Whether a request has somewhere to go below saturation: a `both` worker, or a prefill
/// and a decode worker, or a decode worker on a fleet without prefill workers or whose
/// decode workers may serve alone (`decode_alone`: vLLM's handoff, not SGLang's). A
/// fleet that splits prefill from decode, its decode workers unable to serve alone, is
/// full when either of its pools is: a split needs both.
pub(crate) fn has_room(
    candidates: &switchyard_policy::Candidates,
    saturated: &[bool],
    decode_alone: bool,
) -> bool {
    free(candidates, saturated, Role::Both)
        || (free(candidates, saturated, Role::Decode)
            && (decode_alone || !prefill_pool_full(candidates, saturated)))
}

/// Whether the fleet has prefill workers and every one of them is saturated: a split
/// would wait behind their backlog.
pub(crate) fn prefill_pool_full(
    candidates: &switchyard_policy::Candidates,
    saturated: &[bool],
) -> bool {
    (0..candidates.len()).any(|i| candidates.row(i).role == Role::Prefill)
        && !free(candidates, saturated, Role::Prefill)
}

/// Whether a worker of `role` is not saturated.
fn free(candidates: &switchyard_policy::Candidates, saturated: &[bool], role: Role) -> bool {
    (0..candidates.len())
        .zip(saturated)
        .any(|(i, s)| !*s && candidates.row(i).role == role)
}

/// `candidates` without the saturated ones, role by role: a role whose every worker is
/// saturated keeps them all (the request still needs one of them).
pub(crate) fn unsaturated(
    candidates: switchyard_policy::Candidates,
    saturated: &[bool],
) -> switchyard_policy::Candidates {
    let open_roles: Vec<Role> = [Role::Both, Role::Prefill, Role::Decode]
        .into_iter()
        .filter(|r| free(&candidates, saturated, *r))
        .collect();
    let rows: Vec<switchyard_policy::CandidateRow> =
        (0..candidates.len()).map(|i| candidates.row(i)).collect();
    rows.into_iter()
        .zip(saturated)
        .filter(|(r, s)| !**s || !open_roles.contains(&r.role))
        .map(|(r, _)| r)
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use switchyard_policy::{CandidateRow, Candidates};

    fn fleet(roles: &[Role]) -> Candidates {
        roles
            .iter()
            .enumerate()
            .map(|(i, &role)| CandidateRow {
                id: InstanceId(i as u64),
                role,
                ..CandidateRow::default()
            })
            .collect()
    }

    /// A split fleet whose decode workers cannot serve alone is full when either pool
    /// is: a request needs a prefill worker and a decode worker (a `both` worker alone
    /// will do). Where they may serve alone, a decode worker with room is room.
    #[test]
    fn a_split_fleet_has_room_with_room_in_both_pools_or_a_decode_worker_that_may_serve_alone() {
        use Role::{Both, Decode, Prefill};
        let split = fleet(&[Prefill, Prefill, Decode]);
        for alone in [false, true] {
            assert!(has_room(&split, &[true, false, false], alone));
            assert!(
                !has_room(&split, &[false, false, true], alone),
                "decode pool full"
            );
        }
        assert!(
            !has_room(&split, &[true, true, false], false),
            "prefill pool full"
        );
        assert!(has_room(&split, &[true, true, false], true), "decode alone");
        assert!(prefill_pool_full(&split, &[true, true, false]));
        assert!(!prefill_pool_full(&split, &[true, false, true]));
        let mixed = fleet(&[Prefill, Decode, Both]);
        assert!(
            has_room(&mixed, &[true, true, false], false),
            "a both worker"
        );
        assert!(!has_room(&mixed, &[true, false, true], false));
        assert!(has_room(&mixed, &[true, false, true], true));
        let decode_only = fleet(&[Decode, Decode]);
        assert!(has_room(&decode_only, &[true, false], false));
        assert!(!has_room(&decode_only, &[true, true], true));
        assert!(
            !prefill_pool_full(&decode_only, &[true, true]),
            "no prefill pool"
        );
        let whole = fleet(&[Both, Both]);
        assert!(has_room(&whole, &[false, true], false) && !has_room(&whole, &[true, true], true));
    }

    /// A full batch holds requests as the expected wait does (when every worker is
    /// saturated), keeps no arrival away, and can be turned off.
    #[test]
    fn a_full_batch_saturates_a_worker_unless_turned_off() {
        use switchyard_kv::load::WorkerLoad;
        let s = Saturation::default();
        let full = WorkerLoad {
            batch_full: true,
            ..WorkerLoad::default()
        };
        assert_eq!(s.reason(&full), Some("batch full"));
        assert_eq!(
            s.avoided(&full),
            None,
            "arrivals go where the policy puts them"
        );
        let off = Saturation {
            batch_full: false,
            ..Saturation::default()
        };
        assert_eq!(off.reason(&full), None);
        let waiting = WorkerLoad {
            expected_wait: Some(DEFAULT_SATURATION_WAIT),
            ..WorkerLoad::default()
        };
        assert_eq!(s.reason(&waiting), Some("expected wait"));
        assert_eq!(s.reason(&WorkerLoad::default()), None, "idle");
    }
}
