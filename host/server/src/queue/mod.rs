//! The router's queue: when every worker of an endpoint is saturated, a request waits
//! here (body parsed, tokens and blocks kept) instead of in an engine's queue, and is
//! placed when a worker leaves saturation — decided then, with that moment's KV view and
//! load, so it still goes where its prefix is.
//!
//! The admission rules, in the order a request meets them (the one statement of them
//! in the code; docs/overload.md is the operator's):
//! 1. **Room**: a worker of the request's role that is not saturated takes it at once
//!    (`switchyard_router::Saturation`: expected wait, KV usage, requests in flight,
//!    prefill pending, engine queue, each as configured); nothing is held while the
//!    fleet has room.
//! 2. **Who asks**: its class (`x-switchyard-priority`, else GIE's objective header,
//!    else the default) is capped at its tenant's `max_class`; its tenant is the
//!    configured one whose API key it carries, else the keyless configured one the
//!    tenant header names, else the one `anonymous` tenant (`classes`).
//! 3. **Deadline**: `x-switchyard-deadline-ms`, else its class's, capped at the longest
//!    class deadline; a request whose wait ahead already exceeds it is refused at
//!    arrival.
//! 4. **Place**: within `queue_max` requests and `queue_max_bytes` of bodies; when full,
//!    the shedding below, all or nothing (requests are evicted only if the newcomer
//!    then fits).
//! 5. **Order and dispatch**: as below, each time a worker leaves saturation.
//!
//! Order: priority classes by rank (every queued request of a lower rank first); within
//! a class, start-time fair queuing between tenants, weighted, measured in prompt
//! tokens dispatched; within a tenant, the oldest first, except that among its
//! [`LOOK_AHEAD`] oldest the one whose prefix a worker with room holds goes first (a
//! worker that frees up serves what it has cached). Bounds: requests and body bytes waiting per
//! endpoint, and each request's deadline. Shedding says why:
//! - 429 (`tenant_over_share`): the queue is full and the tenant holds its share of it
//!   or more (`queue_max` × its weight over the active tenants' weights): its newest
//!   request of a class no more urgent than the arrival's gives way to a configured
//!   tenant's request (never to the default tenant's: it takes free places only);
//! - 503 (`fleet_full`): the queue is full of requests of tenants within their shares
//!   and of classes as urgent, or the wait ahead, at the rate requests leave the queue,
//!   exceeds the request's deadline (refused at arrival rather than at the deadline);
//! - 503 (`queue_deadline`): it waited its deadline.
//!
//! No decision is made under the lock: the order is read under it, the router decides
//! outside it, and the request is taken out after. A client that leaves drops its
//! ticket, which takes its place out at once.

pub mod classes;
mod outcome;
mod state;

pub use outcome::{Admission, Job, Outcome, Placed, QueueStats, Shed, ShedReason};

use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use parking_lot::Mutex;
use prometheus_client::metrics::histogram::Histogram;
use tokio::sync::oneshot;

use classes::{Identity, OverloadConfig};
use state::{Entry, State, share};
use switchyard_router::{KvRouter, RouteError, Routed};

/// How many of a tenant's oldest requests a dispatch looks at for one whose prefix a
/// worker with room holds.
const LOOK_AHEAD: usize = 8;

/// The queue of one endpoint.
pub struct Queue {
    router: Arc<KvRouter>,
    config: Arc<OverloadConfig>,
    state: Mutex<State>,
    /// Requests waiting, read without the lock (the state's count).
    waiting: Arc<AtomicUsize>,
    stats: QueueStats,
    /// Time waited, per class.
    waits: Vec<Histogram>,
}

/// A queued request's place: await [`Ticket::wait`]; dropping it leaves the queue.
pub struct Ticket {
    queue: Arc<Queue>,
    id: u64,
    class: usize,
    tenant: Arc<str>,
    rx: Option<oneshot::Receiver<Outcome>>,
}

impl Ticket {
    /// Waits until the request is placed, refused or sent on its way.
    pub async fn wait(mut self) -> Outcome {
        let rx = self.rx.as_mut().expect("waited once");
        let out = rx.await.unwrap_or(Outcome::Route);
        self.rx = None;
        out
    }
}

impl Drop for Ticket {
    fn drop(&mut self) {
        if self.rx.is_some() {
            let mut st = self.queue.state.lock();
            if st.take(self.class, &self.tenant, self.id, false).is_some() {
                self.queue.stats.left.fetch_add(1, Ordering::Relaxed);
            }
        }
    }
}

impl Queue {
    /// A queue for `router`'s endpoint; `waits` is the wait histogram of each class.
    pub fn start(
        router: Arc<KvRouter>,
        config: Arc<OverloadConfig>,
        waits: Vec<Histogram>,
    ) -> Arc<Queue> {
        let state = State::new(config.classes.len());
        let queue = Arc::new(Queue {
            router: router.clone(),
            config,
            waiting: state.waiting.clone(),
            state: Mutex::new(state),
            stats: QueueStats::default(),
            waits,
        });
        // The dispatcher: woken by every change of load (a request ended, a report),
        // and every 20 ms while requests wait (deadlines, workers that came back).
        let weak = Arc::downgrade(&queue);
        tokio::spawn(async move {
            loop {
                let pause = match weak.upgrade() {
                    None => return,
                    Some(q) => {
                        if q.pump() > 0 {
                            Duration::from_millis(20)
                        } else {
                            Duration::from_secs(1)
                        }
                    }
                };
                tokio::select! {
                    _ = router.load_changed().notified() => {}
                    _ = tokio::time::sleep(pause) => {}
                }
            }
        });
        queue
    }

    /// The router this queue feeds.
    pub fn router(&self) -> &Arc<KvRouter> {
        &self.router
    }

    /// Its classes, in dispatch order.
    pub fn classes(&self) -> &[classes::Class] {
        &self.config.classes
    }

    /// Its counters.
    pub fn stats(&self) -> &QueueStats {
        &self.stats
    }

    /// Requests waiting per class, and body bytes held.
    pub fn depth(&self) -> (Vec<usize>, usize) {
        let st = self.state.lock();
        (st.classes.iter().map(|c| c.len).collect(), st.bytes)
    }

    /// Requests waiting per tenant (at most `limit` tenants, the longest queues first).
    pub fn tenants(&self, limit: usize) -> Vec<(Arc<str>, usize)> {
        let st = self.state.lock();
        let mut v: Vec<(Arc<str>, usize)> = st
            .tenants
            .iter()
            .map(|(t, (n, _))| (t.clone(), *n))
            .collect();
        v.sort_by(|a, b| b.1.cmp(&a.1).then_with(|| a.0.cmp(&b.0)));
        v.truncate(limit);
        v
    }

    /// Whether the queue is full (a replica in this state is not ready).
    pub fn is_full(&self) -> bool {
        let st = self.state.lock();
        st.count >= self.config.queue_max || st.bytes >= self.config.queue_max_bytes
    }

    /// Takes a request: placed at once when nothing waits and a worker has room (the
    /// decision made without the queue's lock), else queued (making room by the rules of
    /// the module's documentation) or refused.
    pub fn admit(self: &Arc<Self>, who: &Identity, job: Job, bytes: usize) -> Admission {
        if self.waiting.load(Ordering::Acquire) == 0 {
            match self.place(&job, Instant::now(), false) {
                Err(RouteError::Saturated { .. }) => {}
                placed => return Admission::Now(self.outcome(placed)),
            }
        }
        let mut st = self.state.lock();
        let deadline = who.deadline;
        let ahead = st.ahead(who);
        if let Some(wait) = st.expected_wait(ahead).filter(|w| *w > deadline) {
            drop(st);
            return self.shed(Shed {
                reason: ShedReason::FleetFull,
                message: format!(
                    "every worker is saturated and the {ahead} requests ahead would take about {:.1} s, longer than this request's deadline of {:.1} s",
                    wait.as_secs_f64(),
                    deadline.as_secs_f64()
                ),
                retry_after: wait,
            });
        }
        // The arriving tenant counts among the waiting ones for the shares.
        st.tenants
            .entry(who.tenant.clone())
            .or_insert((0, who.weight));
        let room = self.make_room(&mut st, who, bytes);
        if st.tenants.get(&who.tenant).is_some_and(|t| t.0 == 0) {
            st.tenants.remove(&who.tenant);
        }
        let given_way = match room {
            Ok(given_way) => given_way,
            Err((shed, given_way)) => {
                drop(st);
                self.give_way(given_way);
                return self.shed(shed);
            }
        };
        let (tx, rx) = oneshot::channel();
        let id = st.next_id;
        st.next_id += 1;
        let now = Instant::now();
        st.push(
            who.class,
            who.tenant.clone(),
            who.weight,
            Entry {
                id,
                job: Arc::new(job),
                bytes,
                enqueued: now,
                deadline: now + deadline,
                tx,
            },
        );
        drop(st);
        self.give_way(given_way);
        self.stats.queued.fetch_add(1, Ordering::Relaxed);
        // The dispatcher may have room already (a request ended as this one arrived).
        self.router.load_changed().notify_one();
        Admission::Queued(Ticket {
            queue: self.clone(),
            id,
            class: who.class,
            tenant: who.tenant.clone(),
            rx: Some(rx),
        })
    }

    /// Makes room for a request of `who` with a body of `bytes` in a full queue: the
    /// newest request of the tenant most over its share, of a class no more urgent,
    /// gives way (429) — if `who` is a configured tenant: requests of the default tenant
    /// take free places only —, else the newest of a less urgent class (503); or the
    /// arriving request is refused. Returns the requests that gave way, to be told
    /// outside the lock.
    #[allow(clippy::type_complexity)]
    fn make_room(
        &self,
        st: &mut State,
        who: &Identity,
        bytes: usize,
    ) -> Result<Vec<(Entry, Shed)>, (Shed, Vec<(Entry, Shed)>)> {
        let mut taken = Vec::new();
        match self.evict_for(st, who, bytes, &mut taken) {
            Ok(()) => Ok(taken.into_iter().map(|(_, _, _, e, s)| (e, s)).collect()),
            Err(shed) => {
                // The newcomer does not fit after all: the requests taken out for it go
                // back where they were (each was its tenant's newest), and none is lost.
                for (class, tenant, weight, entry, _) in taken.into_iter().rev() {
                    st.push(class, tenant, weight, entry);
                }
                Err((shed, Vec::new()))
            }
        }
    }

    /// Takes out, into `taken` (with each one's class, tenant and weight), the requests
    /// that give way to a newcomer of `who` with `bytes`, by the module's rules, until it
    /// fits; or says why it does not.
    fn evict_for(
        &self,
        st: &mut State,
        who: &Identity,
        bytes: usize,
        taken: &mut Vec<(usize, Arc<str>, u32, Entry, Shed)>,
    ) -> Result<(), Shed> {
        let max = self.config.queue_max;
        while st.count >= max || st.bytes.saturating_add(bytes) > self.config.queue_max_bytes {
            let own = st.tenants.get(&who.tenant).map_or(0, |t| t.0);
            let retry_after = st.expected_wait(st.count).unwrap_or(Duration::from_secs(1));
            let refuse = |reason, message| Shed {
                reason,
                message,
                retry_after,
            };
            if st.count == 0 {
                let message = format!(
                    "every worker is saturated and the request's {bytes} bytes exceed the queue's {} bytes",
                    self.config.queue_max_bytes
                );
                return Err(refuse(ShedReason::FleetFull, message));
            }
            if own >= share(max, who.weight, st.total_weight()) {
                let (reason, message) = if st.tenants.len() > 1 {
                    (
                        ShedReason::TenantShare,
                        format!(
                            "tenant `{}` has {own} requests waiting, its share of the full queue; other tenants' requests go first",
                            who.tenant
                        ),
                    )
                } else {
                    (
                        ShedReason::FleetFull,
                        format!(
                            "every worker is saturated and the queue is full ({} requests)",
                            st.count
                        ),
                    )
                };
                return Err(refuse(reason, message));
            }
            let over = who
                .known
                .then(|| st.most_over_share(max, who.class))
                .flatten();
            if let Some((c, tenant, id)) = over {
                let weight = st.tenants.get(&tenant).map_or(1, |t| t.1);
                let e = st.take(c, &tenant, id, false).expect("found");
                let shed = refuse(
                    ShedReason::TenantShare,
                    format!(
                        "tenant `{tenant}` held more than its share of the full queue; this request gave way to another tenant's"
                    ),
                );
                taken.push((c, tenant, weight, e, shed));
                continue;
            }
            // A request of no configured tenant takes a free place only: it never sheds.
            let less_urgent = who
                .known
                .then(|| st.newest_less_urgent(who.class))
                .flatten();
            let Some((c, tenant, id)) = less_urgent else {
                let message = if who.known {
                    format!(
                        "every worker is saturated and the queue is full ({} requests, {} bytes)",
                        st.count, st.bytes
                    )
                } else {
                    format!(
                        "every worker is saturated and the queue is full ({} requests); a request of no configured tenant takes a free place only",
                        st.count
                    )
                };
                return Err(refuse(ShedReason::FleetFull, message));
            };
            let weight = st.tenants.get(&tenant).map_or(1, |t| t.1);
            let e = st.take(c, &tenant, id, false).expect("found");
            let shed = refuse(
                ShedReason::FleetFull,
                format!(
                    "the queue is full and a request of a more urgent class than `{}` took this one's place",
                    self.config.classes[c].name
                ),
            );
            taken.push((c, tenant, weight, e, shed));
        }
        Ok(())
    }

    /// Tells the requests that gave way.
    fn give_way(&self, given_way: Vec<(Entry, Shed)>) {
        for (e, shed) in given_way {
            self.stats.count(shed.reason);
            let _ = e.tx.send(Outcome::Shed(shed));
        }
    }

    fn shed(&self, shed: Shed) -> Admission {
        self.stats.count(shed.reason);
        Admission::Now(Outcome::Shed(shed))
    }

    /// The router's decision for `job` (candidates, the policy, bookings) arriving, or
    /// leaving the queue (`dispatch`: only to workers below every saturation signal):
    /// never under the queue's lock.
    fn place(&self, job: &Job, now: Instant, dispatch: bool) -> Result<Routed, RouteError> {
        if dispatch {
            self.router.dispatch(&job.ask(), now)
        } else {
            self.router.try_place(&job.ask(), now)
        }
    }

    fn outcome(&self, placed: Result<Routed, RouteError>) -> Outcome {
        match placed {
            Ok(routed) => Outcome::Placed(Placed {
                router: self.router.clone(),
                routed: Some(routed),
            }),
            // Its own objectives, met by no worker now: the router's answer, decided.
            Err(e @ RouteError::Late { .. }) => Outcome::Refused(e),
            Err(_) => Outcome::Route,
        }
    }

    /// Places waiting requests while a worker has room, and refuses those past their
    /// deadline. The order is read under the lock; each decision is made outside it, and
    /// the request taken out only then (a client that left meanwhile drops its
    /// placement, which releases its bookings). Returns how many still wait.
    fn pump(&self) -> usize {
        let now = Instant::now();
        let late = {
            let mut st = self.state.lock();
            if st.next_deadline.is_some_and(|d| now >= d) {
                st.expired(now)
            } else {
                Vec::new()
            }
        };
        self.refuse_late(late, now);
        loop {
            let Some((c, tenant, front)) = self.state.lock().peek(LOOK_AHEAD) else {
                break;
            };
            let (id, job) = self.prefix_pick(front);
            let placed = self.place(&job, now, true);
            if let Err(RouteError::Saturated { .. }) = placed {
                break;
            }
            let outcome = self.outcome(placed);
            let mut st = self.state.lock();
            let Some(e) = st.take(c, &tenant, id, true) else {
                // Gone meanwhile (its client left): the placement is dropped, released.
                continue;
            };
            // Each dispatch at its own time: the interval between dispatches is what the
            // expected waits (arrival sheds, Retry-After) are estimated from.
            st.dispatched(Instant::now());
            drop(st);
            let waited = now.saturating_duration_since(e.enqueued);
            if let Some(h) = self.waits.get(c) {
                h.observe(waited.as_secs_f64());
            }
            self.stats.dispatched.fetch_add(1, Ordering::Relaxed);
            // A client gone meanwhile drops the placement, which releases its bookings.
            let _ = e.tx.send(outcome);
        }
        let mut st = self.state.lock();
        if st.count == 0 {
            // The next busy spell measures its own rate.
            st.last_dispatch = None;
        }
        st.count
    }

    /// Which of a tenant's first [`LOOK_AHEAD`] requests goes next: the one whose prefix
    /// the workers with room hold most of (the oldest on a tie, so FCFS when none has
    /// one). A request passed over keeps its place at the front and its deadline.
    fn prefix_pick(&self, front: Vec<(u64, Arc<Job>)>) -> (u64, Arc<Job>) {
        let mut best = (0, 0u32);
        for (i, (_, job)) in front.iter().enumerate() {
            let Some(overlap) = self.router.overlap_with_room(&job.hashes) else {
                break;
            };
            if overlap > best.1 {
                best = (i, overlap);
            }
        }
        front
            .into_iter()
            .nth(best.0)
            .expect("a front of one at least")
    }

    /// Refuses the requests past their deadline.
    fn refuse_late(&self, late: Vec<Entry>, now: Instant) {
        if late.is_empty() {
            return;
        }
        let retry_after = {
            let st = self.state.lock();
            st.expected_wait(st.count).unwrap_or(Duration::from_secs(1))
        };
        for e in late {
            self.stats.count(ShedReason::Deadline);
            let waited = now.saturating_duration_since(e.enqueued);
            let _ = e.tx.send(Outcome::Shed(Shed {
                reason: ShedReason::Deadline,
                message: format!(
                    "every worker stayed saturated for the request's deadline ({:.1} s in the queue)",
                    waited.as_secs_f64()
                ),
                retry_after,
            }));
        }
    }
}
