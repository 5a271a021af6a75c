use super::*;
use crate::replay::Outcome;

fn outcome(ttft: f64, e2e: f64, status: Option<u16>) -> Outcome {
    Outcome {
        ok: status.is_none(),
        ttft,
        e2e,
        prompt_tokens: 100,
        cached_tokens: 50,
        itl: vec![0.02, 0.04],
        status,
        error: status.map(|s| format!("{s}")),
        class: None,
        whole: false,
    }
}

#[test]
fn goodput_counts_the_answers_within_both_objectives_and_refusals_are_counted_apart() {
    let run = PolicyRun {
        policy: "p".into(),
        outcomes: vec![
            outcome(1.0, 10.0, None),
            outcome(3.0, 10.0, None),
            outcome(1.0, 40.0, None),
            outcome(0.0, 0.0, Some(503)),
            outcome(0.0, 0.0, Some(500)),
        ],
        span: 10.0,
        router: None,
        live: None,
        worker_requests: vec![1, 2],
        fleet_hit_rate: None,
        telemetry: None,
        floors: Default::default(),
    };
    let m = summarise(&run, Slo::default());
    assert_eq!((m.requests, m.failed, m.refused), (5, 2, 1));
    assert!((m.goodput - 0.2).abs() < 1e-9, "{}", m.goodput);
    let loose = Slo {
        ttft: 5.0,
        e2e: 60.0,
    };
    assert!((summarise(&run, loose).goodput - 0.6).abs() < 1e-9);
    assert!((m.itl[0] - 0.03).abs() < 1e-6 && (m.itl[1] - 0.04).abs() < 1e-6);
}

#[test]
fn repeated_runs_give_each_figure_as_median_and_range() {
    let run = |name: &str, ttft: f64, hit: f64| PolicyRun {
        policy: name.into(),
        outcomes: vec![outcome(ttft, 2.0, None)],
        span: 2.0,
        router: None,
        live: None,
        worker_requests: vec![1],
        fleet_hit_rate: Some(hit),
        telemetry: None,
        floors: Default::default(),
    };
    assert!(spread_table(&[run("a", 0.1, 0.2), run("b", 0.1, 0.2)], Slo::default()).is_none());
    let t = spread_table(
        &[
            run("a", 0.3, 0.20),
            run("b", 0.2, 0.5),
            run("a", 0.1, 0.25),
            run("a", 0.2, 0.22),
        ],
        Slo::default(),
    )
    .unwrap();
    let a = t.lines().find(|l| l.starts_with("| a ")).unwrap();
    assert!(a.contains("| 3 |"), "{a}");
    assert!(a.contains("200 (100–300) ms"), "{a}");
    assert!(a.contains("22.0 (20.0–25.0) %"), "{a}");
    let b = t.lines().find(|l| l.starts_with("| b ")).unwrap();
    assert!(b.contains("200 (200–200) ms"), "{b}");
}

#[test]
fn classes_are_summarised_apart_with_refusals_by_status() {
    let marked = |class, ttft, status| Outcome {
        class: Some(class),
        ..outcome(ttft, 10.0, status)
    };
    let run = PolicyRun {
        policy: "p".into(),
        outcomes: vec![
            marked("interactive", 1.0, None),
            marked("interactive", 0.0, Some(429)),
            marked("batch", 3.0, None),
            marked("batch", 1.0, None),
            marked("batch", 0.0, Some(503)),
            marked("batch", 0.0, Some(500)),
        ],
        span: 10.0,
        router: None,
        live: None,
        worker_requests: vec![],
        fleet_hit_rate: None,
        telemetry: None,
        floors: Default::default(),
    };
    let c = by_class(&run, Slo::default());
    assert_eq!(c.len(), 2);
    let (batch, interactive) = (&c[0], &c[1]);
    assert_eq!(
        (
            interactive.requests,
            interactive.refused_429,
            interactive.refused_503
        ),
        (2, 1, 0)
    );
    assert!((interactive.goodput - 0.5).abs() < 1e-9);
    assert_eq!((batch.requests, batch.refused_503, batch.failed), (4, 1, 1));
    assert!((batch.goodput - 0.25).abs() < 1e-9);
    assert!((batch.ttft[0] - 2.0).abs() < 1e-9, "{:?}", batch.ttft);
    assert!(
        class_table(std::slice::from_ref(&run), Slo::default())
            .unwrap()
            .contains("| p | interactive | 2 | 50.0 % | 1 | 0 | 0 |")
    );
    // Reasons: the answer's error code where it has one, else its status.
    let mut run = run;
    run.outcomes[1].error =
        Some(r#"429 Too Many Requests: {"error":{"code":"tenant_over_share"}}"#.into());
    assert_eq!(
        refusal_reasons(&run),
        vec![("503".to_string(), 1), ("tenant_over_share".to_string(), 1)]
    );
}
