//! Latency histograms kept by the front door, per endpoint where it says.

use std::time::Duration;

use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::histogram::{Histogram, exponential_buckets};
use prometheus_client::registry::Registry;

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub(super) struct EndpointLabel {
    endpoint: String,
}

pub(super) type ByEndpoint = Family<EndpointLabel, Histogram, fn() -> Histogram>;

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub(super) struct ClassLabel {
    endpoint: String,
    class: String,
}

/// Latency histograms (prometheus-client), so that a live median and tail are visible,
/// not only a mean.
pub struct Timings {
    pub(super) registry: Registry,
    pub(super) decision: ByEndpoint,
    pub(super) policy_call: ByEndpoint,
    pub(super) tokenize: Histogram,
    pub(super) first_byte: ByEndpoint,
    pub(super) duration: ByEndpoint,
    pub(super) migration_gap: Histogram,
    pub(super) queue_wait: Family<ClassLabel, Histogram, fn() -> Histogram>,
}

/// 1 µs to ~0.5 s, doubling.
pub(super) fn micro_buckets() -> Histogram {
    Histogram::new(exponential_buckets(1e-6, 2.0, 20))
}

/// 1 ms to ~9 min, doubling.
pub(super) fn request_buckets() -> Histogram {
    Histogram::new(exponential_buckets(1e-3, 2.0, 20))
}

impl Default for Timings {
    fn default() -> Self {
        let mut registry = Registry::with_prefix("switchyard");
        let decision = ByEndpoint::new_with_constructor(micro_buckets as fn() -> Histogram);
        let policy_call = ByEndpoint::new_with_constructor(micro_buckets as fn() -> Histogram);
        let tokenize = Histogram::new(exponential_buckets(1e-6, 2.0, 24));
        let first_byte = ByEndpoint::new_with_constructor(request_buckets as fn() -> Histogram);
        let duration = ByEndpoint::new_with_constructor(request_buckets as fn() -> Histogram);
        let migration_gap = request_buckets();
        let queue_wait = Family::<ClassLabel, Histogram, fn() -> Histogram>::new_with_constructor(
            request_buckets as fn() -> Histogram,
        );
        registry.register(
            "queue_wait_seconds",
            "Time requests waited in the router's queue before a worker had room, per priority class (placed requests only)",
            queue_wait.clone(),
        );
        registry.register(
            "decision_seconds",
            "Routing decisions: candidates, overlaps, the policy call and the booking",
            decision.clone(),
        );
        registry.register(
            "policy_call_seconds",
            "The policy's own call alone (failed calls included, the native fallback not)",
            policy_call.clone(),
        );
        registry.register(
            "tokenize_seconds",
            "Tokenizing a text or chat prompt",
            tokenize.clone(),
        );
        registry.register(
            "time_to_first_byte_seconds",
            "From the request's arrival to the worker's first bytes (the first token of a stream)",
            first_byte.clone(),
        );
        registry.register(
            "request_duration_seconds",
            "From the request's arrival to the end of a complete response",
            duration.clone(),
        );
        registry.register(
            "migration_gap_seconds",
            "What a client of a migrated stream waited: from the last token before the break to the first after it",
            migration_gap.clone(),
        );
        Timings {
            migration_gap,
            queue_wait,
            registry,
            decision,
            policy_call,
            tokenize,
            first_byte,
            duration,
        }
    }
}

impl std::fmt::Debug for Timings {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("Timings")
    }
}

pub(super) fn label(endpoint: &str) -> EndpointLabel {
    EndpointLabel {
        endpoint: endpoint.to_string(),
    }
}

impl Timings {
    /// One routing decision and its policy call.
    pub fn decision(&self, endpoint: &str, decision: Duration, policy: Duration) {
        let l = label(endpoint);
        self.decision
            .get_or_create(&l)
            .observe(decision.as_secs_f64());
        self.policy_call
            .get_or_create(&l)
            .observe(policy.as_secs_f64());
    }

    /// One tokenization.
    pub fn tokenize(&self, took: Duration) {
        self.tokenize.observe(took.as_secs_f64());
    }

    /// A response's first bytes arrived.
    pub fn first_byte(&self, endpoint: &str, after: Duration) {
        self.first_byte
            .get_or_create(&label(endpoint))
            .observe(after.as_secs_f64());
    }

    /// A response ended complete.
    pub fn request_duration(&self, endpoint: &str, took: Duration) {
        self.duration
            .get_or_create(&label(endpoint))
            .observe(took.as_secs_f64());
    }

    /// A migrated stream's gap.
    pub fn migration_gap(&self, gap: Duration) {
        self.migration_gap.observe(gap.as_secs_f64());
    }

    /// The queue-wait histogram of `endpoint`'s `class` (shared with the queue).
    pub fn queue_wait(&self, endpoint: &str, class: &str) -> Histogram {
        self.queue_wait
            .get_or_create(&ClassLabel {
                endpoint: endpoint.to_string(),
                class: class.to_string(),
            })
            .clone()
    }

    /// Drops the queue-wait series of an endpoint whose queue was let go of.
    pub fn forget_queue(&self, endpoint: &str, classes: &[crate::queue::classes::Class]) {
        for c in classes {
            self.queue_wait.remove(&ClassLabel {
                endpoint: endpoint.to_string(),
                class: c.name.clone(),
            });
        }
    }

    /// Drops the series of an endpoint the router let go of.
    pub fn forget(&self, endpoint: &str) {
        let l = label(endpoint);
        for family in [
            &self.decision,
            &self.policy_call,
            &self.first_byte,
            &self.duration,
        ] {
            family.remove(&l);
        }
    }
}
