//! The queue's waiting requests and their order, without the router: classes by rank,
//! tenants by start-time fair queuing within a class, each tenant's requests oldest
//! first; and the arithmetic of shares and expected waits. Pure; [`super::Queue`] holds
//! it under its lock and makes every decision outside it.

use std::collections::{BTreeMap, HashMap, VecDeque};
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use tokio::sync::oneshot;

use super::classes::Identity;
use super::{Job, Outcome};

pub(super) struct Entry {
    pub(super) id: u64,
    pub(super) job: Arc<Job>,
    pub(super) bytes: usize,
    pub(super) enqueued: Instant,
    pub(super) deadline: Instant,
    pub(super) tx: oneshot::Sender<Outcome>,
}

struct TenantQueue {
    entries: VecDeque<Entry>,
    /// Virtual start of its head: the class's virtual time when it became active,
    /// advanced by each dispatch's tokens over its weight.
    start: f64,
    weight: u32,
}

#[derive(Default)]
pub(super) struct ClassQueue {
    tenants: BTreeMap<Arc<str>, TenantQueue>,
    /// The start of the last request dispatched.
    vtime: f64,
    pub(super) len: usize,
}

/// The next tenant to dispatch from: its class, its name and its first requests (id
/// and job).
pub(super) type Next = (usize, Arc<str>, Vec<(u64, Arc<Job>)>);

#[derive(Default)]
pub(super) struct State {
    pub(super) classes: Vec<ClassQueue>,
    /// Requests waiting per tenant (all classes) and the tenant's weight.
    pub(super) tenants: HashMap<Arc<str>, (usize, u32)>,
    pub(super) count: usize,
    /// `count`, readable without the lock: a request arriving at an empty queue is
    /// placed without taking it.
    pub(super) waiting: Arc<AtomicUsize>,
    pub(super) bytes: usize,
    pub(super) next_id: u64,
    /// The earliest deadline of a waiting request (a sweep is due then).
    pub(super) next_deadline: Option<Instant>,
    /// Seconds between dispatches from the queue, smoothed.
    pub(super) interval: Option<f64>,
    pub(super) last_dispatch: Option<Instant>,
}

impl State {
    pub(super) fn new(classes: usize) -> State {
        State {
            classes: (0..classes).map(|_| ClassQueue::default()).collect(),
            ..State::default()
        }
    }

    /// The next tenant to dispatch from: the first class with requests, its tenant with
    /// the lowest virtual start; and that tenant's first `n` requests.
    pub(super) fn peek(&self, n: usize) -> Option<Next> {
        let (c, class) = self.classes.iter().enumerate().find(|(_, c)| c.len > 0)?;
        let (tenant, t) = class
            .tenants
            .iter()
            .filter(|(_, t)| !t.entries.is_empty())
            .min_by(|a, b| a.1.start.total_cmp(&b.1.start))?;
        let front = t
            .entries
            .iter()
            .take(n)
            .map(|e| (e.id, e.job.clone()))
            .collect();
        Some((c, tenant.clone(), front))
    }

    pub(super) fn push(&mut self, class: usize, tenant: Arc<str>, weight: u32, entry: Entry) {
        self.count += 1;
        self.waiting.store(self.count, Ordering::Release);
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

    /// Takes `tenant`'s request `id` out of `class`; `dispatch` advances the tenant's
    /// virtual start by it (a removal does not). None if it is no longer there.
    pub(super) fn take(
        &mut self,
        class: usize,
        tenant: &Arc<str>,
        id: u64,
        dispatch: bool,
    ) -> Option<Entry> {
        let q = &mut self.classes[class];
        let t = q.tenants.get_mut(tenant)?;
        let at = t.entries.iter().position(|e| e.id == id)?;
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
        self.waiting.store(self.count, Ordering::Release);
        self.bytes -= entry.bytes;
        if let Some(n) = self.tenants.get_mut(tenant) {
            n.0 -= 1;
            if n.0 == 0 {
                self.tenants.remove(tenant);
            }
        }
        Some(entry)
    }

    /// The weights of the tenants waiting (an arriving one is counted among them by
    /// [`super::Queue::admit`] first).
    pub(super) fn total_weight(&self) -> u64 {
        self.tenants
            .values()
            .map(|(_, w)| u64::from((*w).max(1)))
            .sum()
    }

    /// Requests that would leave the queue before a new one of `who`: every request of a
    /// more urgent class, and of its own class each tenant's up to its weighted share of
    /// the new one's position.
    pub(super) fn ahead(&self, who: &Identity) -> usize {
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
    pub(super) fn expected_wait(&self, ahead: usize) -> Option<Duration> {
        let interval = self.interval?;
        Duration::try_from_secs_f64(interval * ahead as f64).ok()
    }

    /// The newest request of the waiting tenant most over its share, among the classes
    /// from `from` on (as urgent as the arriving request or less), the least urgent
    /// first: a request never takes the place of a more urgent one.
    pub(super) fn most_over_share(
        &self,
        max: usize,
        from: usize,
    ) -> Option<(usize, Arc<str>, u64)> {
        let total = self.total_weight();
        let mut over: Vec<(&Arc<str>, i64)> = self
            .tenants
            .iter()
            .map(|(t, (n, w))| (t, *n as i64 - share(max, *w, total) as i64))
            .filter(|(_, over)| *over > 0)
            .collect();
        // Most over first; by name on a tie, so the choice does not depend on hashing.
        over.sort_by(|a, b| b.1.cmp(&a.1).then_with(|| a.0.cmp(b.0)));
        over.into_iter().find_map(|(tenant, _)| {
            self.classes
                .iter()
                .enumerate()
                .skip(from)
                .rev()
                .find_map(|(c, q)| {
                    Some((c, tenant.clone(), q.tenants.get(tenant)?.entries.back()?.id))
                })
        })
    }

    /// The newest request of the least urgent class below `class`, if any.
    pub(super) fn newest_less_urgent(&self, class: usize) -> Option<(usize, Arc<str>, u64)> {
        let c = (class + 1..self.classes.len())
            .rev()
            .find(|c| self.classes[*c].len > 0)?;
        self.classes[c]
            .tenants
            .iter()
            .filter_map(|(t, q)| q.entries.back().map(|e| (e.enqueued, e.id, t.clone())))
            .max_by_key(|(at, id, _)| (*at, *id))
            .map(|(_, id, t)| (c, t, id))
    }

    /// Takes every request past its deadline out; the next deadline is due then.
    pub(super) fn expired(&mut self, now: Instant) -> Vec<Entry> {
        let mut late = Vec::new();
        let mut next: Option<Instant> = None;
        for (c, q) in self.classes.iter().enumerate() {
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
        self.next_deadline = next;
        late.into_iter()
            .filter_map(|(c, t, id)| self.take(c, &t, id, false))
            .collect()
    }

    /// A dispatch at `now`: the smoothed interval between dispatches learns from it.
    pub(super) fn dispatched(&mut self, now: Instant) {
        if let Some(last) = self.last_dispatch.replace(now) {
            let dt = now.saturating_duration_since(last).as_secs_f64();
            self.interval = Some(self.interval.map_or(dt, |i| 0.9 * i + 0.1 * dt));
        }
    }
}

/// A tenant of `weight`'s share of a queue of `max`, among waiting tenants whose weights
/// sum to `total` (its own included): at least one request.
pub(super) fn share(max: usize, weight: u32, total: u64) -> usize {
    let w = u64::from(weight.max(1));
    ((max as u64).saturating_mul(w) / total.max(w)).max(1) as usize
}

#[cfg(test)]
#[path = "state_tests.rs"]
mod tests;
