//! The queue's order and arithmetic, without a router: classes, tenants' weights, the
//! shares of a full queue and who may give way to whom.

use super::*;

fn who(class: usize, tenant: &str, weight: u32) -> Identity {
    Identity {
        class,
        tenant: Arc::from(tenant),
        weight,
        deadline: Duration::from_secs(60),
        objectives: switchyard_router::Objectives::default(),
        known: true,
    }
}

/// Queues a request of `tokens` prompt tokens for `w`; its id.
fn push(st: &mut State, w: &Identity, tokens: u32) -> u64 {
    let id = st.next_id;
    st.next_id += 1;
    let now = Instant::now();
    let (tx, _rx) = oneshot::channel();
    st.push(
        w.class,
        w.tenant.clone(),
        w.weight,
        Entry {
            id,
            job: Arc::new(Job::of(&switchyard_router::Ask::new(tokens, &[]))),
            bytes: 100,
            enqueued: now,
            deadline: now + w.deadline,
            tx,
        },
    );
    id
}

/// Dispatches the next request in order; its tenant.
fn dispatch(st: &mut State) -> Option<(usize, String)> {
    let (c, tenant, front) = st.peek(1)?;
    st.take(c, &tenant, front[0].0, true).expect("peeked");
    Some((c, tenant.to_string()))
}

#[test]
fn every_request_of_a_more_urgent_class_goes_first() {
    let mut st = State::new(3);
    for _ in 0..3 {
        push(&mut st, &who(2, "batch", 1), 100);
    }
    push(&mut st, &who(1, "app", 1), 100);
    push(&mut st, &who(0, "search", 1), 100);
    let order: Vec<usize> = std::iter::from_fn(|| dispatch(&mut st).map(|d| d.0)).collect();
    assert_eq!(order, [0, 1, 2, 2, 2]);
    assert_eq!((st.count, st.bytes), (0, 0));
    assert_eq!(st.waiting.load(Ordering::Acquire), 0);
    assert!(st.tenants.is_empty());
}

/// Within a class, tenants are served in proportion to their weights, in prompt
/// tokens: a tenant of weight 3 gets three times the tokens of one of weight 1, and a
/// tenant sending prompts twice as long gets half as many of them.
#[test]
fn tenants_share_a_class_by_weight_in_prompt_tokens() {
    let mut st = State::new(3);
    for _ in 0..40 {
        push(&mut st, &who(1, "heavy", 3), 100);
        push(&mut st, &who(1, "light", 1), 100);
        push(&mut st, &who(1, "long", 1), 200);
    }
    let mut served = std::collections::HashMap::<String, u32>::new();
    for _ in 0..50 {
        let (_, t) = dispatch(&mut st).unwrap();
        *served.entry(t).or_default() += 1;
    }
    let (heavy, light, long) = (served["heavy"], served["light"], served["long"]);
    assert!((heavy as i32 - 3 * light as i32).abs() <= 2, "{served:?}");
    assert!((light as i32 - 2 * long as i32).abs() <= 2, "{served:?}");
}

/// A tenant returning from idle starts at the class's current virtual time: it saved no
/// credit while away, so it does not take the class over.
#[test]
fn a_tenant_back_from_idle_brings_no_credit() {
    let mut st = State::new(3);
    for _ in 0..20 {
        push(&mut st, &who(1, "steady", 1), 100);
    }
    for _ in 0..10 {
        dispatch(&mut st);
    }
    for _ in 0..10 {
        push(&mut st, &who(1, "returning", 1), 100);
    }
    let next: Vec<String> = (0..6).map(|_| dispatch(&mut st).unwrap().1).collect();
    let returning = next.iter().filter(|t| *t == "returning").count();
    assert!(
        (2..=4).contains(&returning),
        "alternate, not a run: {next:?}"
    );
}

#[test]
fn shares_of_a_full_queue_follow_the_weights_and_never_reach_zero() {
    assert_eq!(share(12, 1, 4), 3);
    assert_eq!(share(12, 3, 4), 9);
    assert_eq!(share(2, 1, 1000), 1, "at least one request");
    assert_eq!(share(10, 5, 0), 10, "its own weight counts");
}

/// A full queue makes room with the newest request of the tenant most over its share,
/// but only from classes as urgent as the arriving request or less: a `low` arrival
/// never takes a `high` request's place, however far over its share that tenant is.
#[test]
fn a_shed_never_takes_a_more_urgent_request() {
    let mut st = State::new(3);
    let hog = who(0, "hog", 1);
    for _ in 0..6 {
        push(&mut st, &hog, 100);
    }
    let low = push(&mut st, &who(2, "hog", 1), 100);
    st.tenants.entry(Arc::from("newcomer")).or_insert((0, 1));
    assert_eq!(
        st.most_over_share(8, 2),
        Some((2, Arc::from("hog"), low)),
        "its low request"
    );
    st.take(2, &Arc::from("hog"), low, false).unwrap();
    assert_eq!(st.most_over_share(8, 2), None, "only high ones are left");
    assert_eq!(
        st.most_over_share(8, 0).map(|(c, t, _)| (c, t)),
        Some((0, Arc::from("hog")))
    );
    assert_eq!(st.newest_less_urgent(2), None);
    assert_eq!(st.newest_less_urgent(0).map(|(c, ..)| c), None);
    push(&mut st, &who(1, "other", 1), 100);
    assert_eq!(st.newest_less_urgent(0).map(|(c, ..)| c), Some(1));
}

/// What is ahead of an arriving request: every more urgent request, and of its own
/// class each tenant's up to its weighted share of the newcomer's position.
#[test]
fn the_requests_ahead_count_classes_and_shares() {
    let mut st = State::new(3);
    for _ in 0..4 {
        push(&mut st, &who(0, "search", 1), 100);
    }
    for _ in 0..10 {
        push(&mut st, &who(1, "big", 2), 100);
    }
    push(&mut st, &who(1, "small", 1), 100);
    // A new tenant of equal weight in `search`'s class alternates with it.
    assert_eq!(st.ahead(&who(0, "new", 1)), 1);
    // "small" has one waiting: its next goes after 2 × 2 of big's and its own one.
    assert_eq!(st.ahead(&who(1, "small", 1)), 4 + 4 + 1);
    assert_eq!(st.ahead(&who(2, "x", 1)), 15);
    st.interval = Some(0.5);
    assert_eq!(st.expected_wait(4), Some(Duration::from_secs(2)));
}

#[test]
fn deadlines_take_late_requests_out_and_set_the_next_sweep() {
    let mut st = State::new(3);
    let mut quick = who(1, "a", 1);
    quick.deadline = Duration::ZERO;
    push(&mut st, &quick, 100);
    let kept = push(&mut st, &who(1, "a", 1), 100);
    let late = st.expired(Instant::now());
    assert_eq!(late.len(), 1);
    assert_eq!(st.count, 1);
    assert!(st.next_deadline.is_some());
    assert!(st.take(1, &Arc::from("a"), kept, false).is_some());
}
