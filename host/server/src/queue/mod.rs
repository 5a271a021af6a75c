//! The router's queue: when every worker of an endpoint is saturated, a request waits
//! here (body parsed, tokens and blocks kept) instead of in an engine's queue, and is
//! placed when a worker leaves saturation — decided then, with that moment's KV view and
//! load, so it still goes where its prefix is.
//!
//! Order: priority classes by rank (every queued request of a lower rank first); within
//! a class, start-time fair queuing between tenants, weighted, measured in prompt
//! tokens dispatched; within a tenant, the oldest first, except that among its
//! [`LOOK_AHEAD`] oldest the one whose prefix a worker with room holds goes first (a
//! worker that frees up serves what it has cached). Bounds: requests and body bytes waiting per
//! endpoint, and each request's deadline. Shedding says why:
//! - 429 (`tenant_over_share`): the queue is full and the tenant holds its share of it
//!   or more (`queue_max` × its weight over the active tenants' weights): its newest
//!   request gives way to another tenant's;
//! - 503 (`fleet_full`): the queue is full of requests of tenants within their shares
//!   and of classes as urgent, or the wait ahead, at the rate requests leave the queue,
//!   exceeds the request's deadline (refused at arrival rather than at the deadline);
//! - 503 (`queue_deadline`): it waited its deadline.
//!
//! A client that leaves drops its ticket, which takes its place out at once.

pub mod classes;
mod outcome;

pub use outcome::{Admission, Job, Outcome, Placed, QueueStats, Shed, ShedReason};

use std::collections::{BTreeMap, HashMap, VecDeque};
use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

use parking_lot::Mutex;
use prometheus_client::metrics::histogram::Histogram;
use tokio::sync::oneshot;

use classes::{Identity, OverloadConfig};
use switchyard_router::{KvRouter, RouteError};

/// How many of a tenant's oldest requests a dispatch looks at for one whose prefix a
/// worker with room holds.
const LOOK_AHEAD: usize = 8;

struct Entry {
    id: u64,
    job: Job,
    bytes: usize,
    enqueued: Instant,
    deadline: Instant,
    tx: oneshot::Sender<Outcome>,
}

struct TenantQueue {
    entries: VecDeque<Entry>,
    /// Virtual start of its head: the class's virtual time when it became active,
    /// advanced by each dispatch's tokens over its weight.
    start: f64,
    weight: u32,
}

#[derive(Default)]
struct ClassQueue {
    tenants: BTreeMap<Arc<str>, TenantQueue>,
    /// The start of the last request dispatched.
    vtime: f64,
    len: usize,
}

#[derive(Default)]
struct State {
    classes: Vec<ClassQueue>,
    /// Requests waiting per tenant (all classes) and the tenant's weight.
    tenants: HashMap<Arc<str>, (usize, u32)>,
    count: usize,
    bytes: usize,
    next_id: u64,
    /// The earliest deadline of a waiting request (a sweep is due then).
    next_deadline: Option<Instant>,
    /// Seconds between dispatches from the queue, smoothed.
    interval: Option<f64>,
    last_dispatch: Option<Instant>,
}

/// The queue of one endpoint.
pub struct Queue {
    router: Arc<KvRouter>,
    config: Arc<OverloadConfig>,
    state: Mutex<State>,
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
            if st.remove(self.class, &self.tenant, self.id).is_some() {
                self.queue.stats.left.fetch_add(1, Ordering::Relaxed);
            }
        }
    }
}

impl State {
    /// The next request to dispatch: the first class with requests, its tenant with the
    /// lowest virtual start.
    fn peek(&self) -> Option<(usize, Arc<str>)> {
        let (c, class) = self.classes.iter().enumerate().find(|(_, c)| c.len > 0)?;
        let (tenant, _) = class
            .tenants
            .iter()
            .filter(|(_, t)| !t.entries.is_empty())
            .min_by(|a, b| a.1.start.total_cmp(&b.1.start))?;
        Some((c, tenant.clone()))
    }

    fn push(&mut self, class: usize, tenant: Arc<str>, weight: u32, entry: Entry) {
        self.count += 1;
        self.bytes += entry.bytes;
        self.next_deadline = Some(
            self.next_deadline
                .map_or(entry.deadline, |d| d.min(entry.deadline)),
        );
        let t = self.tenants.entry(tenant.clone()).or_insert((0, weight));
        t.0 += 1;
        let q = &mut self.classes[class];
        q.len += 1;
        let vtime = q.vtime;
        q.tenants
            .entry(tenant)
            .or_insert_with(|| TenantQueue {
                entries: VecDeque::new(),
                start: vtime,
                weight,
            })
            .entries
            .push_back(entry);
    }

    /// Takes `tenant`'s entry at `at` out of `class`; `dispatch` advances the tenant's
    /// virtual start by it (a removal does not).
    fn take(
        &mut self,
        class: usize,
        tenant: &Arc<str>,
        at: usize,
        dispatch: bool,
    ) -> Option<Entry> {
        let q = &mut self.classes[class];
        let t = q.tenants.get_mut(tenant)?;
        let entry = t.entries.remove(at)?;
        if dispatch {
            q.vtime = t.start;
            t.start += f64::from(entry.job.prompt_tokens.max(1)) / f64::from(t.weight.max(1));
        }
        if t.entries.is_empty() {
            q.tenants.remove(tenant);
        }
        q.len -= 1;
        self.count -= 1;
        self.bytes -= entry.bytes;
        if let Some(n) = self.tenants.get_mut(tenant) {
            n.0 -= 1;
            if n.0 == 0 {
                self.tenants.remove(tenant);
            }
        }
        Some(entry)
    }

    fn remove(&mut self, class: usize, tenant: &Arc<str>, id: u64) -> Option<Entry> {
        let at = self.classes[class]
            .tenants
            .get(tenant)?
            .entries
            .iter()
            .position(|e| e.id == id)?;
        self.take(class, tenant, at, false)
    }

    /// The weights of the tenants waiting (an arriving one is counted among them by
    /// [`Queue::admit`] first).
    fn total_weight(&self) -> u64 {
        self.tenants
            .values()
            .map(|(_, w)| u64::from((*w).max(1)))
            .sum()
    }

    /// Requests that would leave the queue before a new one of `who`: every request of a
    /// more urgent class, and of its own class each tenant's up to its weighted share of
    /// the new one's position.
    fn ahead(&self, who: &Identity) -> usize {
        let mut n: usize = self.classes[..who.class].iter().map(|c| c.len).sum();
        let class = &self.classes[who.class];
        let own = class
            .tenants
            .get(&who.tenant)
            .map_or(0, |t| t.entries.len());
        let w = f64::from(who.weight.max(1));
        for (name, t) in &class.tenants {
            n += if *name == who.tenant {
                own
            } else {
                let fair = ((own + 1) as f64 * f64::from(t.weight.max(1)) / w).ceil() as usize;
                t.entries.len().min(fair)
            };
        }
        n
    }

    /// The expected wait for `ahead` requests at the recent rate of dispatches.
    fn expected_wait(&self, ahead: usize) -> Option<Duration> {
        let interval = self.interval?;
        Duration::try_from_secs_f64(interval * ahead as f64).ok()
    }

    /// The newest request of the waiting tenant most over its share, looking at the
    /// least urgent classes first.
    fn most_over_share(&self, max: usize) -> Option<(usize, Arc<str>, u64)> {
        let total = self.total_weight();
        let (tenant, _) = self
            .tenants
            .iter()
            .map(|(t, (n, w))| (t, *n as i64 - share(max, *w, total) as i64))
            .filter(|(_, over)| *over > 0)
            .max_by_key(|(_, over)| *over)?;
        self.classes
            .iter()
            .enumerate()
            .rev()
            .find_map(|(c, q)| Some((c, tenant.clone(), q.tenants.get(tenant)?.entries.back()?.id)))
    }
}

/// A tenant of `weight`'s share of a queue of `max`, among waiting tenants whose weights
/// sum to `total` (its own included): at least one request.
fn share(max: usize, weight: u32, total: u64) -> usize {
    let w = u64::from(weight.max(1));
    ((max as u64).saturating_mul(w) / total.max(w)).max(1) as usize
}

impl Queue {
    /// A queue for `router`'s endpoint; `waits` is the wait histogram of each class.
    pub fn start(
        router: Arc<KvRouter>,
        config: Arc<OverloadConfig>,
        waits: Vec<Histogram>,
    ) -> Arc<Queue> {
        let state = State {
            classes: config
                .classes
                .iter()
                .map(|_| ClassQueue::default())
                .collect(),
            ..State::default()
        };
        let queue = Arc::new(Queue {
            router: router.clone(),
            config,
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

    /// Takes a request: placed at once when nothing waits and a worker has room, else
    /// queued (making room by the rules of the module's documentation) or refused.
    pub fn admit(self: &Arc<Self>, who: &Identity, job: Job, bytes: usize) -> Admission {
        let mut st = self.state.lock();
        if st.count == 0 {
            match self.router.try_place(
                job.prompt_tokens,
                &job.hashes,
                job.session_key,
                Instant::now(),
            ) {
                Ok(routed) => {
                    return Admission::Now(Outcome::Placed(Placed {
                        router: self.router.clone(),
                        routed: Some(routed),
                    }));
                }
                Err(RouteError::Saturated { .. }) => {}
                Err(_) => return Admission::Now(Outcome::Route),
            }
        }
        let deadline = who.deadline;
        let ahead = st.ahead(who);
        if let Some(wait) = st.expected_wait(ahead).filter(|w| *w > deadline) {
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
        if let Err(shed) = room {
            return self.shed(shed);
        }
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
                job,
                bytes,
                enqueued: now,
                deadline: now + deadline,
                tx,
            },
        );
        drop(st);
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
    /// newest request of the tenant most over its share gives way (429), else the
    /// newest of a less urgent class (503); or the arriving request is refused.
    fn make_room(&self, st: &mut State, who: &Identity, bytes: usize) -> Result<(), Shed> {
        let max = self.config.queue_max;
        while st.count >= max || st.bytes.saturating_add(bytes) > self.config.queue_max_bytes {
            let own = st.tenants.get(&who.tenant).map_or(0, |t| t.0);
            let retry_after = st.expected_wait(st.count).unwrap_or(Duration::from_secs(1));
            if st.count == 0 || own >= share(max, who.weight, st.total_weight()) {
                let (reason, message) = if st.count == 0 {
                    (
                        ShedReason::FleetFull,
                        format!(
                            "every worker is saturated and the request's {bytes} bytes exceed the queue's {} bytes",
                            self.config.queue_max_bytes
                        ),
                    )
                } else if st.tenants.len() > 1 {
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
                return Err(Shed {
                    reason,
                    message,
                    retry_after,
                });
            }
            if let Some((c, tenant, id)) = st.most_over_share(max) {
                let e = st.remove(c, &tenant, id).expect("found");
                self.stats.count(ShedReason::TenantShare);
                let _ = e.tx.send(Outcome::Shed(Shed {
                    reason: ShedReason::TenantShare,
                    message: format!(
                        "tenant `{tenant}` held more than its share of the full queue; this request gave way to another tenant's"
                    ),
                    retry_after,
                }));
                continue;
            }
            let less_urgent = (who.class + 1..st.classes.len())
                .rev()
                .find(|c| st.classes[*c].len > 0);
            let Some(c) = less_urgent else {
                return Err(Shed {
                    reason: ShedReason::FleetFull,
                    message: format!(
                        "every worker is saturated and the queue is full ({} requests, {} bytes)",
                        st.count, st.bytes
                    ),
                    retry_after,
                });
            };
            // The newest request of the least urgent class gives way.
            let newest = st.classes[c]
                .tenants
                .iter()
                .filter_map(|(t, q)| q.entries.back().map(|e| (e.enqueued, e.id, t.clone())))
                .max_by_key(|(at, id, _)| (*at, *id));
            let Some((_, id, tenant)) = newest else {
                return Ok(());
            };
            let e = st.remove(c, &tenant, id).expect("found");
            self.stats.count(ShedReason::FleetFull);
            let _ = e.tx.send(Outcome::Shed(Shed {
                reason: ShedReason::FleetFull,
                message: format!(
                    "the queue is full and a request of a more urgent class than `{}` took this one's place",
                    self.config.classes[c].name
                ),
                retry_after,
            }));
        }
        Ok(())
    }

    fn shed(&self, shed: Shed) -> Admission {
        self.stats.count(shed.reason);
        Admission::Now(Outcome::Shed(shed))
    }

    /// Places waiting requests while a worker has room, and refuses those past their
    /// deadline. Returns how many still wait.
    fn pump(&self) -> usize {
        let mut st = self.state.lock();
        let now = Instant::now();
        if st.next_deadline.is_some_and(|d| now >= d) {
            self.expire(&mut st, now);
        }
        while let Some((c, tenant)) = st.peek() {
            let at = self.prefix_pick(&st.classes[c].tenants[&tenant].entries);
            let job = &st.classes[c].tenants[&tenant].entries[at].job;
            let placed =
                self.router
                    .try_place(job.prompt_tokens, &job.hashes, job.session_key, now);
            let outcome = match placed {
                Err(RouteError::Saturated { .. }) => break,
                Ok(routed) => Outcome::Placed(Placed {
                    router: self.router.clone(),
                    routed: Some(routed),
                }),
                Err(_) => Outcome::Route,
            };
            let e = st.take(c, &tenant, at, true).expect("peeked");
            let waited = now.saturating_duration_since(e.enqueued);
            if let Some(h) = self.waits.get(c) {
                h.observe(waited.as_secs_f64());
            }
            if let Some(last) = st.last_dispatch.replace(now) {
                let dt = now.saturating_duration_since(last).as_secs_f64();
                st.interval = Some(st.interval.map_or(dt, |i| 0.9 * i + 0.1 * dt));
            }
            self.stats.dispatched.fetch_add(1, Ordering::Relaxed);
            // A client gone meanwhile drops the placement, which releases its bookings.
            let _ = e.tx.send(outcome);
        }
        if st.count == 0 {
            // The next busy spell measures its own rate.
            st.last_dispatch = None;
        }
        st.count
    }

    /// Which of a tenant's first [`LOOK_AHEAD`] requests goes next: the one whose prefix
    /// the workers with room hold most of (the oldest on a tie, so FCFS when none has
    /// one). A request passed over keeps its place at the front and its deadline.
    fn prefix_pick(&self, entries: &VecDeque<Entry>) -> usize {
        let mut best = (0, 0u32);
        for (i, e) in entries.iter().take(LOOK_AHEAD).enumerate() {
            let Some(overlap) = self.router.overlap_with_room(&e.job.hashes) else {
                return 0;
            };
            if overlap > best.1 {
                best = (i, overlap);
            }
        }
        best.0
    }

    /// Refuses every request past its deadline.
    fn expire(&self, st: &mut State, now: Instant) {
        let mut late = Vec::new();
        let mut next: Option<Instant> = None;
        for (c, q) in st.classes.iter().enumerate() {
            for (t, tq) in &q.tenants {
                for e in &tq.entries {
                    if e.deadline <= now {
                        late.push((c, t.clone(), e.id));
                    } else {
                        next = Some(next.map_or(e.deadline, |n| n.min(e.deadline)));
                    }
                }
            }
        }
        st.next_deadline = next;
        for (c, t, id) in late {
            let Some(e) = st.remove(c, &t, id) else {
                continue;
            };
            self.stats.count(ShedReason::Deadline);
            let waited = now.saturating_duration_since(e.enqueued);
            let _ = e.tx.send(Outcome::Shed(Shed {
                reason: ShedReason::Deadline,
                message: format!(
                    "every worker stayed saturated for the request's deadline ({:.1} s in the queue)",
                    waited.as_secs_f64()
                ),
                retry_after: st
                    .expected_wait(st.count)
                    .unwrap_or(Duration::from_secs(1)),
            }));
        }
    }
}
