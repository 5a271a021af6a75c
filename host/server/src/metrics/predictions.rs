//! Each worker's latency model against what happened.

use prometheus_client::encoding::DescriptorEncoder;
use prometheus_client::metrics::MetricType;
use prometheus_client::metrics::counter::ConstCounter;

use switchyard_kv::latency::ErrorSum;

use super::scrape::{Labels, Scrape, family, per_router};

impl Scrape {
    /// The sum of each worker's absolute percentage errors and how many predictions it
    /// compared, by what was predicted (their ratio is the mean absolute percentage
    /// error).
    pub(super) fn prediction_errors(&self, e: &mut DescriptorEncoder) -> std::fmt::Result {
        // One pass over the workers' models; both families are read from it.
        let errors = per_router(&self.routers, |r| {
            let mut out = Vec::new();
            for id in r.client().snapshot().instances.keys() {
                let errors = r.load_of(*id).latency.errors;
                let each = [
                    ("ttft", errors.ttft),
                    ("tpot", errors.tpot),
                    ("e2e", errors.e2e),
                ];
                for (of, err) in each.into_iter().filter(|(_, e)| e.count > 0) {
                    out.push((
                        vec![("instance", id.to_string()), ("of", of.to_string())],
                        err,
                    ));
                }
            }
            out
        });
        let rows = |f: fn(&ErrorSum) -> f64| -> Vec<(Labels, ConstCounter<f64>)> {
            errors
                .iter()
                .map(|(labels, err)| (labels.clone(), ConstCounter::new(f(err))))
                .collect()
        };
        family(
            e,
            "prediction_error",
            "Sum over compared predictions of |predicted - observed| / observed, by worker and by what was predicted (of=ttft: time to first token, seen on streams and prefill legs; tpot: time per output token, on streams; e2e: whole non-streamed answers); over switchyard_predictions_compared_total, the mean absolute percentage error",
            MetricType::Counter,
            &rows(|err| err.sum),
        )?;
        family(
            e,
            "predictions_compared",
            "Predictions compared with what happened, by worker and by what was predicted",
            MetricType::Counter,
            &rows(|err| err.count as f64),
        )
    }
}
