//! Changing policies: swaps under load, refused replacements, rollbacks by run and by
//! rate, the history, the compiled-code cache and the compile queue.

mod common;

use std::collections::HashMap;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use common::policy::*;
use common::{Rng, guest, runtime};
use switchyard::ids::InstanceId;
use switchyard::policy::{
    CacheOutcome, Candidates, Decider, PolicyEngine, PolicyError, PolicyHandle, PolicySource,
    RuntimeConfig, native,
};

#[test]
fn a_run_of_failures_rolls_back_to_the_last_good_policy() {
    let engine = PolicyEngine::new(RuntimeConfig {
        rollback_after_failures: 3,
        ..runtime()
    })
    .unwrap();
    let h = handle(&engine, "kv-cost", "{}");
    let bad = engine
        .load_file(&guest("panics"), r#"{"after": 1}"#)
        .unwrap();
    let status = h.swap(bad).unwrap();
    settle(&h, 4);
    assert_eq!(status.info.name, "panics");
    assert_eq!(status.previous.as_ref().unwrap().name, "kv-cost");
    // Decision with sequence 0 was... the handle's sequence is 0 here: well-behaved.
    assert_eq!(h.decide(request(4, 1), &four()).decider, Decider::Policy);
    for _ in 0..3 {
        assert_eq!(h.decide(request(4, 1), &four()).decider, Decider::Fallback);
    }
    let status = h.status();
    assert_eq!(status.info.name, "kv-cost", "rolled back");
    assert_eq!(status.rollbacks, 1);
    assert_eq!(h.decide(request(4, 1), &four()).decider, Decider::Policy);
    // The current policy's own counters start again; the handle's totals never go down.
    assert_eq!(h.status().decisions, 1);
    let totals = h.totals();
    assert_eq!((totals.decisions, totals.failures), (5, 3));
    assert_eq!(
        (totals.automatic_rollbacks, totals.manual_rollbacks),
        (1, 0)
    );
    let good = engine.load_spec("round-robin", "{}").unwrap();
    h.swap(good).unwrap();
    h.rollback().unwrap();
    let after = h.totals();
    assert!(after.decisions >= totals.decisions, "{after:?}");
    assert_eq!((after.automatic_rollbacks, after.manual_rollbacks), (1, 1));
}

/// A policy failing one call in three never fails five in a row, but the failure rate
/// rolls it back within one window of calls; one that fails less than the threshold stays.
#[test]
fn a_policy_failing_a_third_of_its_calls_is_rolled_back_by_rate() {
    let engine = PolicyEngine::new(RuntimeConfig {
        rollback_after_failures: 5,
        rollback_failure_rate: 0.2,
        rollback_window: 60,
        // Enough warm instances that the 20 trapped ones never empty the pool (an empty
        // pool is a fallback that is not the policy's failure, and not in the window).
        warm_instances: 32,
        ..runtime()
    })
    .unwrap();
    let h = handle(&engine, "kv-cost", "{}");
    h.swap(
        engine
            .load_file(&guest("flaky"), r#"{"every": 3}"#)
            .unwrap(),
    )
    .unwrap();
    settle(&h, 32);
    // Seeds 1, 2, 3, ...: every third call panics.
    for seed in 1..60 {
        h.decide(request(4, seed), &four());
        assert_eq!(
            h.status().info.name,
            "flaky",
            "rolled back early, at {seed}"
        );
    }
    h.decide(request(4, 60), &four());
    let status = h.status();
    assert_eq!(
        status.info.name, "kv-cost",
        "rolled back at the end of the window"
    );
    assert_eq!(
        (h.totals().rate_rollbacks, h.totals().automatic_rollbacks),
        (1, 0)
    );
    // One failure in ten stays under a 20 % threshold.
    h.swap(
        engine
            .load_file(&guest("flaky"), r#"{"every": 10}"#)
            .unwrap(),
    )
    .unwrap();
    for seed in 1..=180 {
        h.decide(request(4, seed), &four());
    }
    assert_eq!(h.status().info.name, "flaky");
}

#[test]
fn broken_replacements_are_refused_and_the_current_policy_keeps_serving() {
    let engine = engine();
    let h = handle(&engine, "kv-cost", "{}");
    let before = h.status();

    // A file over the size limit (sparse: nothing is written) is refused unread.
    let dir = tempfile::tempdir().unwrap();
    let huge = dir.path().join("huge.wasm");
    std::fs::File::create(&huge)
        .unwrap()
        .set_len(switchyard::policy::MAX_POLICY_BYTES as u64 + 4096)
        .unwrap();
    let refusals: Vec<(PolicyError, &str)> = vec![
        (
            engine.load_file(&huge, "{}").err().unwrap(),
            "over the limit",
        ),
        (
            engine.load_file(&guest("wrong_world"), "{}").err().unwrap(),
            "does not implement",
        ),
        (
            engine.load_file(&guest("bad_config"), "{}").err().unwrap(),
            "bad-config refuses",
        ),
        (
            h.swap(engine.load_file(&guest("spin_forever"), "{}").unwrap())
                .err()
                .unwrap(),
            "time budget",
        ),
        (
            h.swap(engine.load_file(&guest("panics"), "{}").unwrap())
                .err()
                .unwrap(),
            "trapped",
        ),
        (
            engine
                .load(
                    PolicySource::Uploaded("test".into()),
                    b"not wasm at all",
                    "{}",
                )
                .err()
                .unwrap(),
            "magic bytes",
        ),
        (
            engine
                .load(
                    PolicySource::Uploaded("test".into()),
                    b"\0asm\x01\0\0\0",
                    "{}",
                )
                .err()
                .unwrap(),
            "core WebAssembly module",
        ),
        (
            engine
                .load(
                    PolicySource::Uploaded("test".into()),
                    b"\0asm\x0d\0\x01\0garbage",
                    "{}",
                )
                .err()
                .unwrap(),
            "not a WebAssembly component",
        ),
    ];
    for (err, needle) in refusals {
        assert!(
            err.to_string().contains(needle),
            "`{err}` should mention `{needle}`"
        );
    }
    let after = h.status();
    assert_eq!(after.info.sha256, before.info.sha256);
    assert_eq!(after.generation, before.generation);
    assert_eq!(h.decide(request(4, 1), &four()).decider, Decider::Policy);
}

#[test]
fn hot_swaps_under_concurrent_decisions_never_fail_or_mix_policies() {
    let engine = engine();
    let h = Arc::new(handle(&engine, "kv-cost", "{}"));
    let kv = engine.load_spec("kv-cost", "{}").unwrap();
    let rr = engine.load_spec("round-robin", "").unwrap();
    let candidates: Candidates = (1..=6)
        .map(|i| row(i, (i as u32 * 3) % 7, (i as u32 * 5) % 11, 0))
        .collect();

    let stop = AtomicBool::new(false);
    let mut names: HashMap<u64, String> = HashMap::from([(1, "kv-cost".to_string())]);
    let decisions = std::thread::scope(|s| {
        let deciders: Vec<_> = (0..3u64)
            .map(|t| {
                let (h, candidates, stop) = (&h, &candidates, &stop);
                s.spawn(move || {
                    let mut out = Vec::new();
                    let mut rng = Rng(t);
                    // Bounded: at most 20k decisions per thread.
                    while !stop.load(Ordering::Relaxed) && out.len() < 20_000 {
                        let req = request(8, rng.next() | 1);
                        out.push((req, h.decide(req, candidates)));
                    }
                    out
                })
            })
            .collect();
        for i in 0..100 {
            let next = if i % 2 == 0 { rr.clone() } else { kv.clone() };
            let status = h.swap(next).unwrap();
            names.insert(status.generation, status.info.name.clone());
            std::thread::sleep(Duration::from_millis(1));
        }
        stop.store(true, Ordering::Relaxed);
        deciders
            .into_iter()
            .flat_map(|d| d.join().unwrap())
            .collect::<Vec<_>>()
    });

    let mut by_policy: HashMap<&str, usize> = HashMap::new();
    for (req, d) in &decisions {
        assert_eq!(
            d.decider,
            Decider::Policy,
            "a decision failed: {:?}",
            d.failure
        );
        let name = names[&d.generation].as_str();
        let expected = match name {
            "round-robin" => InstanceId(1 + d.sequence % 6),
            _ => native::choose(&Default::default(), req, &candidates).unwrap(),
        };
        assert_eq!(
            chosen(&d.outcome),
            expected,
            "generation {} ({name})",
            d.generation
        );
        *by_policy.entry(name).or_insert(0) += 1;
    }
    assert!(by_policy.len() == 2, "both policies decided: {by_policy:?}");
}

/// Compiled code is native code the router runs outside the sandbox: the cache gives
/// back only entries this router wrote (their HMAC verifies under its key). A truncated
/// entry, and a forged one (another policy's valid compiled code under this one's name,
/// with the old format's checksum or a tag under another key), are recompiled, never
/// run; a key file that others can read turns the cache off.
#[test]
fn a_cache_entry_this_router_did_not_write_is_never_executed() {
    use std::os::unix::fs::PermissionsExt;
    let dir = tempfile::tempdir().unwrap();
    let cache = dir.path().join("policies");
    let config = || RuntimeConfig {
        cache_dir: Some(cache.clone()),
        ..Default::default()
    };
    let load = |spec: &str| {
        let info = PolicyEngine::new(config())
            .unwrap()
            .load_spec(spec, "")
            .unwrap()
            .info()
            .clone();
        (info.name, info.cache)
    };
    let entries = || -> Vec<std::path::PathBuf> {
        let mut v: Vec<_> = std::fs::read_dir(&cache)
            .unwrap()
            .map(|e| e.unwrap().path())
            .filter(|p| p.extension().is_some_and(|e| e == "cwasm"))
            .collect();
        v.sort();
        v
    };
    let kv = ("kv-cost".to_string(), CacheOutcome::Compiled);
    assert_eq!(load("kv-cost"), kv);
    assert_eq!(load("kv-cost").1, CacheOutcome::Disk);
    let kv_entry = entries()[0].clone();
    let key = cache.join("key");
    assert_eq!(
        std::fs::metadata(&key).unwrap().permissions().mode() & 0o777,
        0o600
    );
    assert_eq!(load("round-robin").1, CacheOutcome::Compiled);
    let rr_entry = entries().into_iter().find(|p| *p != kv_entry).unwrap();
    let rr_artifact = std::fs::read(&rr_entry).unwrap()[32..].to_vec();

    // Truncated.
    let whole = std::fs::read(&kv_entry).unwrap();
    std::fs::write(&kv_entry, &whole[..whole.len() - 1]).unwrap();
    assert_eq!(load("kv-cost"), kv);
    // Round-robin's code under kv-cost's name, tagged with another key.
    let other = ring::hmac::Key::new(ring::hmac::HMAC_SHA256, &[7u8; 32]);
    let mut forged = ring::hmac::sign(&other, &rr_artifact).as_ref().to_vec();
    forged.extend_from_slice(&rr_artifact);
    std::fs::write(&kv_entry, &forged).unwrap();
    assert_eq!(load("kv-cost"), kv, "a forged entry was executed");
    // The same with a checksum anyone can compute (the old format).
    let mut forged = sha256_hex(&rr_artifact).into_bytes();
    forged.extend_from_slice(&rr_artifact);
    std::fs::write(&kv_entry, &forged).unwrap();
    assert_eq!(load("kv-cost"), kv, "a forged entry was executed");
    assert_eq!(load("kv-cost").1, CacheOutcome::Disk);
    // Two entries this router wrote, swapped: each tag covers the policy it was compiled
    // from, so both are recompiled and neither runs the other's code.
    let (kv_whole, rr_whole) = (
        std::fs::read(&kv_entry).unwrap(),
        std::fs::read(&rr_entry).unwrap(),
    );
    std::fs::write(&kv_entry, &rr_whole).unwrap();
    std::fs::write(&rr_entry, &kv_whole).unwrap();
    assert_eq!(load("kv-cost"), kv, "round-robin's entry ran as kv-cost");
    assert_eq!(
        load("round-robin"),
        ("round-robin".to_string(), CacheOutcome::Compiled),
        "kv-cost's entry ran as round-robin"
    );
    assert_eq!(load("kv-cost").1, CacheOutcome::Disk);
    // An entry replaced by a link to a file elsewhere is not followed.
    let elsewhere = dir.path().join("elsewhere.cwasm");
    std::fs::rename(&kv_entry, &elsewhere).unwrap();
    std::os::unix::fs::symlink(&elsewhere, &kv_entry).unwrap();
    assert_eq!(load("kv-cost"), kv, "a linked entry was read");
    assert!(
        !std::fs::symlink_metadata(&kv_entry)
            .unwrap()
            .file_type()
            .is_symlink(),
        "the fresh entry replaced the link"
    );
    // A cache directory others can write is not used.
    std::fs::set_permissions(&cache, std::fs::Permissions::from_mode(0o777)).unwrap();
    assert_eq!(load("kv-cost"), kv);
    assert_eq!(load("kv-cost"), kv);
    std::fs::set_permissions(&cache, std::fs::Permissions::from_mode(0o700)).unwrap();
    assert_eq!(load("kv-cost").1, CacheOutcome::Disk);

    // A key others can read is not trusted: the cache is not used.
    std::fs::set_permissions(&key, std::fs::Permissions::from_mode(0o644)).unwrap();
    assert_eq!(load("kv-cost"), kv);
    assert_eq!(load("kv-cost"), kv);
}

/// Compiles run one at a time: the same policy uploaded four times at once is compiled
/// once. A compile past its budget refuses the load (the work finishes in the background
/// and is kept).
#[test]
fn compiles_are_serialised_deduplicated_and_bounded_in_time() {
    let bytes = std::fs::read(guest("session_affinity")).unwrap();
    let engine = PolicyEngine::new(RuntimeConfig {
        cache_dir: None,
        ..runtime()
    })
    .unwrap();
    let outcomes: Vec<CacheOutcome> = std::thread::scope(|s| {
        let loads: Vec<_> = (0..4)
            .map(|_| {
                s.spawn(|| {
                    engine
                        .load(PolicySource::Uploaded("test".into()), &bytes, "{}")
                        .unwrap()
                        .info()
                        .cache
                })
            })
            .collect();
        loads.into_iter().map(|l| l.join().unwrap()).collect()
    });
    let compiled = outcomes
        .iter()
        .filter(|o| **o == CacheOutcome::Compiled)
        .count();
    assert_eq!(compiled, 1, "{outcomes:?}");

    let hurried = PolicyEngine::new(RuntimeConfig {
        cache_dir: None,
        compile_budget: Duration::from_nanos(1),
        ..runtime()
    })
    .unwrap();
    let err = hurried
        .load(PolicySource::Uploaded("test".into()), &bytes, "{}")
        .err()
        .expect("a compile cannot finish in a nanosecond");
    assert!(matches!(err, PolicyError::Busy(_)), "{err}");
    assert!(err.to_string().contains("longer than"), "{err}");
    let deadline = std::time::Instant::now() + Duration::from_secs(30);
    loop {
        match hurried.load(PolicySource::Uploaded("test".into()), &bytes, "{}") {
            Ok(p) => {
                assert_eq!(p.info().cache, CacheOutcome::Memory);
                break;
            }
            Err(PolicyError::Busy(_)) if std::time::Instant::now() < deadline => {
                std::thread::sleep(Duration::from_millis(20))
            }
            Err(e) => panic!("the background compile was not kept: {e}"),
        }
    }
}

/// The worst case of the compile queue: eight different policies uploaded at once. At
/// most four compile or wait; the rest are answered `busy` at once (never queued without
/// bound), and a refused one loads when tried again: nothing is lost.
#[test]
fn compiles_beyond_the_queue_are_refused_as_busy_and_load_when_retried() {
    let bytes = std::fs::read(guest("session_affinity")).unwrap();
    let engine = PolicyEngine::new(RuntimeConfig {
        cache_dir: None,
        ..runtime()
    })
    .unwrap();
    let variants: Vec<Vec<u8>> = (0..8).map(|n| variant(&bytes, n)).collect();
    let start = std::sync::Barrier::new(variants.len());
    let results: Vec<Result<(), PolicyError>> = std::thread::scope(|s| {
        let loads: Vec<_> = variants
            .iter()
            .map(|v| {
                let (engine, start) = (&engine, &start);
                s.spawn(move || {
                    start.wait();
                    engine
                        .load(PolicySource::Uploaded("test".into()), v, "{}")
                        .map(|_| ())
                })
            })
            .collect();
        loads.into_iter().map(|l| l.join().unwrap()).collect()
    });
    let busy: Vec<usize> = (0..results.len())
        .filter(|&i| matches!(results[i], Err(PolicyError::Busy(_))))
        .collect();
    let loaded = results.iter().filter(|r| r.is_ok()).count();
    assert_eq!(busy.len() + loaded, 8, "{results:?}");
    assert!(!busy.is_empty() && loaded >= 4, "{results:?}");
    for &i in &busy {
        let msg = results[i].as_ref().unwrap_err().to_string();
        assert!(msg.contains("already compiling"), "{msg}");
        engine
            .load(PolicySource::Uploaded("test".into()), &variants[i], "{}")
            .unwrap_or_else(|e| panic!("variant {i} refused when tried alone: {e}"));
    }
}

/// An automatic rollback returns to the most recent policy that served a whole window
/// without a failure (a built-in from the start), never merely to the previous one: a
/// policy that was itself failing is skipped, and with no good policy to return to the
/// failing one stays, decided for by the fallback.
#[test]
fn an_automatic_rollback_returns_to_the_last_policy_that_served_a_clean_window() {
    let engine = PolicyEngine::new(RuntimeConfig {
        rollback_after_failures: 3,
        rollback_failure_rate: 0.5,
        rollback_window: 20,
        warm_instances: 8,
        ..runtime()
    })
    .unwrap();
    let flaky = |every: u32| {
        engine
            .load_file(&guest("flaky"), &format!(r#"{{"every": {every}}}"#))
            .unwrap()
    };
    let panics = || {
        engine
            .load_file(&guest("panics"), r#"{"after": 1}"#)
            .unwrap()
    };
    let h = handle(&engine, "round-robin", "{}");
    assert!(h.status().proven, "a built-in is good from the start");

    // A policy failing one call in three, never three in a row nor half a window.
    h.swap(flaky(3)).unwrap();
    settle(&h, 8);
    for seed in 1..=10 {
        h.decide(request(4, seed), &four());
    }
    let status = h.status();
    assert_eq!((status.info.name.as_str(), status.proven), ("flaky", false));
    h.swap(panics()).unwrap();
    settle(&h, 8);
    let status = h.status();
    assert_eq!(status.previous.unwrap().name, "flaky");
    assert_eq!(status.last_good.unwrap().name, "round-robin");
    for _ in 0..3 {
        assert_eq!(h.decide(request(4, 1), &four()).decider, Decider::Fallback);
    }
    assert_eq!(
        h.status().info.name,
        "round-robin",
        "rolled back past the flaky policy"
    );

    // A custom policy that served a clean window is good.
    h.swap(flaky(0)).unwrap();
    settle(&h, 8);
    for seed in 1..=20 {
        assert_eq!(h.decide(request(4, seed), &four()).decider, Decider::Policy);
    }
    assert!(h.status().proven);
    h.swap(panics()).unwrap();
    settle(&h, 8);
    for _ in 0..3 {
        h.decide(request(4, 1), &four());
    }
    assert_eq!(h.status().info.name, "flaky");
    assert_eq!(h.totals().automatic_rollbacks, 2);

    // Nothing good to return to: the failing policy stays, the fallback decides.
    let alone = PolicyHandle::new(engine.clone(), flaky(3)).unwrap();
    alone.swap(panics()).unwrap();
    settle(&alone, 8);
    // Sequence 0 is well-behaved in these guests.
    assert_eq!(
        alone.decide(request(4, 1), &four()).decider,
        Decider::Policy
    );
    for _ in 0..6 {
        assert_eq!(
            alone.decide(request(4, 1), &four()).decider,
            Decider::Fallback
        );
    }
    assert_eq!(alone.status().info.name, "panics");
    assert_eq!(alone.totals().automatic_rollbacks, 0);
}

/// Every change of an endpoint's policy is kept for the admin page, but at most CHANGES:
/// a push refused on every reconciliation (or an upload loop) cannot grow it.
#[test]
fn the_policy_history_keeps_the_latest_changes_only() {
    let engine = engine();
    let h = handle(&engine, "kv-cost", "{}");
    let first = format!("kv-cost@{}", h.current().info().version);
    assert_eq!(h.changes()[0].kind, "loaded");
    for _ in 0..3 * switchyard::policy::CHANGES {
        let _ = h.swap_spec("no-such-builtin", "{}");
    }
    h.swap_spec("round-robin", "{}").unwrap();
    let changes = h.changes();
    assert_eq!(changes.len(), switchyard::policy::CHANGES);
    assert!(
        changes[..changes.len() - 1]
            .iter()
            .all(|c| c.kind == "refused")
    );
    let last = changes.last().unwrap();
    assert_eq!(
        (last.kind, last.policy.as_str()),
        ("swap", "round-robin@0.1.0")
    );
    assert!(last.detail.contains(&first), "{}", last.detail);
}
