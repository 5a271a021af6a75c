//! What an answer or a failure says about the worker that gave it, said once for every
//! path that learns it: the front door's attempts (`proxy::settle`), a broken stream's
//! continuation (`proxy::migrate`), a stream's stalls and breaks (`proxy::relay`) and
//! the endpoint picker's answers (`epp::outcome`). Each path decides which verdict an
//! event is (it alone knows whether a 5xx was confirmed by another worker serving, or
//! whether a gateway said who answered); what a verdict does to the worker, under the
//! router's settings, is here.
//!
//! - answered: counted well (ends a probation);
//! - busy: skipped for its `Retry-After` (else the default pause), never a failure;
//! - unreachable: down at once;
//! - failing: one more in its run of failures (outlier detection ejects after the run,
//!   never past the endpoint's ejection share; without it, at once);
//! - doubtful (maybe not its fault): a health probe now, and only a failed probe counts
//!   (without outlier detection: down at once, as every failure is).
//!
//! With `--availability false` nothing is ever reported down or ejected: busy and
//! answered still count.

use std::sync::Arc;
use std::time::Duration;

use switchyard_ids::InstanceId;
use switchyard_router::client::Client;

use crate::Gateway;

/// What an event says about a worker.
#[derive(Debug, Clone, Copy)]
pub enum Verdict<'a> {
    /// It answered (a 2xx, or a 4xx: the client's fault).
    Answered,
    /// 429/503: busy, for its `Retry-After` if it gave one.
    Busy(Option<Duration>),
    /// It could not be reached: refused, reset, closed before answering.
    Unreachable(&'a str),
    /// Its own failure: a 5xx another worker then served, a stall, a broken stream.
    Failing(&'a str),
    /// Maybe its fault: a whole answer past the request timeout, a 5xx a gateway
    /// does not say who gave.
    Doubtful(&'a str),
}

/// Applies `verdict` to `worker`; how long a busy worker is skipped (zero otherwise).
pub fn apply(
    gw: &Gateway,
    client: &Arc<Client>,
    worker: InstanceId,
    verdict: Verdict<'_>,
) -> Duration {
    let may_eject = gw.config.availability;
    match verdict {
        Verdict::Answered => client.record_success(worker),
        Verdict::Busy(retry_after) => return client.report_busy(worker, retry_after),
        Verdict::Unreachable(why) if may_eject => {
            client.report_instance_down(worker, why);
        }
        Verdict::Failing(why) if may_eject => {
            client.record_failure(worker, why);
        }
        Verdict::Doubtful(why) if may_eject && gw.config.outlier_detection => {
            let (c, why) = (client.clone(), why.to_string());
            tokio::spawn(async move { c.check_now(worker, &why).await });
        }
        Verdict::Doubtful(why) if may_eject => {
            client.report_instance_down(worker, why);
        }
        Verdict::Unreachable(_) | Verdict::Failing(_) | Verdict::Doubtful(_) => {}
    }
    Duration::ZERO
}
