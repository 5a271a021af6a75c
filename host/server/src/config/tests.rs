use super::*;
use switchyard_discovery::EngineEventSource;

fn file(text: &str) -> tempfile::NamedTempFile {
    let f = tempfile::NamedTempFile::new().unwrap();
    std::fs::write(f.path(), text).unwrap();
    f
}

#[test]
fn the_admin_token_comes_from_a_private_file_or_the_environment_and_is_long() {
    use std::os::unix::fs::PermissionsExt;
    let args = |token: Option<&str>, path: Option<&std::path::Path>| ServeArgs {
        workers: vec!["http://a:1".into()],
        admin_token: token.map(str::to_string),
        admin_token_file: path.map(std::path::Path::to_path_buf),
        ..Default::default()
    };
    let private = |text: &str| {
        let f = file(text);
        std::fs::set_permissions(f.path(), std::fs::Permissions::from_mode(0o600)).unwrap();
        f
    };
    let f = private("s3cret-s3cret-s3cret\n");
    let c = args(None, Some(f.path())).resolve().unwrap();
    assert_eq!(
        c.gateway.admin_token.as_deref(),
        Some("s3cret-s3cret-s3cret")
    );
    let err = args(Some("x"), Some(f.path())).resolve().unwrap_err();
    assert!(err.to_string().contains("not both"), "{err}");
    let empty = private("  \n");
    let err = args(None, Some(empty.path())).resolve().unwrap_err();
    assert!(err.to_string().contains("is empty"), "{err}");
    let missing = std::path::Path::new("/nonexistent/token");
    assert!(args(None, Some(missing)).resolve().is_err());
    // Readable by others, too short, or on the command line: refused, saying why.
    std::fs::set_permissions(f.path(), std::fs::Permissions::from_mode(0o644)).unwrap();
    let err = args(None, Some(f.path())).resolve().unwrap_err();
    assert!(err.to_string().contains("chmod 600"), "{err}");
    let err = args(Some("short"), None).resolve().unwrap_err();
    assert!(err.to_string().contains("at least 16"), "{err}");
    assert!(args(Some("a-long-enough-token"), None).resolve().is_ok());
    let err = ServeArgs {
        workers: vec!["http://a:1".into()],
        admin_token_on_command_line: Some("a-long-enough-token".into()),
        ..Default::default()
    }
    .resolve()
    .unwrap_err();
    assert!(err.to_string().contains("process list"), "{err}");
}

#[test]
fn the_etcd_password_file_is_private_bounded_and_read_for_its_first_line() {
    use std::os::unix::fs::PermissionsExt;
    let access = |path: &std::path::Path| EtcdAccessArgs {
        etcd_user: Some("router".into()),
        etcd_password_file: Some(path.to_path_buf()),
        etcd_ca_files: Vec::new(),
    };
    let config =
        || switchyard_discovery::etcd::EtcdConfig::new(vec!["http://127.0.0.1:2379".into()]);
    let f = file("pass word\nignored\n");
    std::fs::set_permissions(f.path(), std::fs::Permissions::from_mode(0o600)).unwrap();
    let c = access(f.path()).apply(config()).unwrap();
    assert_eq!(c.auth.unwrap().password, "pass word");
    // Readable by others: refused, saying how to fix it.
    std::fs::set_permissions(f.path(), std::fs::Permissions::from_mode(0o640)).unwrap();
    let err = access(f.path()).apply(config()).unwrap_err();
    assert!(err.to_string().contains("chmod 600"), "{err}");
    // Larger than a secret: refused whole, not cut.
    let big = file(&"x".repeat(5000));
    std::fs::set_permissions(big.path(), std::fs::Permissions::from_mode(0o600)).unwrap();
    let err = access(big.path()).apply(config()).unwrap_err();
    assert!(err.to_string().contains("over 4096 bytes"), "{err}");
}

#[test]
fn flags_beat_the_file_and_the_file_beats_defaults() {
    let f = file(
        r#"
        listen = "127.0.0.1:9000"
        workers = ["http://127.0.0.1:8001/"]
        policy = "round-robin"
        max_attempts = 5
        [endpoints."default/other/generate"]
        policy = "kv-cost"
        policy_config = '{"overlap_weight": 2}'
        "#,
    );
    let args = ServeArgs {
        config: Some(f.path().into()),
        max_attempts: Some(2),
        ..Default::default()
    };
    let c = args.resolve().unwrap();
    assert_eq!(c.listen.port(), 9000);
    assert_eq!(c.gateway.max_attempts, 2);
    assert_eq!(c.default_policy.spec, "round-robin");
    let ep: EndpointPath = "default/other/generate".parse().unwrap();
    assert_eq!(c.endpoint_policies[&ep].config, r#"{"overlap_weight": 2}"#);
    match c.discovery {
        DiscoveryConfig::Static { workers, model, .. } => {
            assert_eq!(
                workers,
                vec![StaticWorker {
                    url: "http://127.0.0.1:8001".into(),
                    engine_events: None,
                    role: switchyard_discovery::Role::Both,
                    bootstrap_port: None,
                }]
            );
            assert_eq!(model, "mock-model");
        }
        other => panic!("{other:?}"),
    }
}

#[test]
fn the_policy_cache_directory_comes_from_the_flag_or_the_file() {
    let f = file("workers = [\"http://x:1\"]\npolicy_cache = \"/var/cache/sy\"\n");
    let c = ServeArgs {
        config: Some(f.path().into()),
        ..Default::default()
    }
    .resolve()
    .unwrap();
    assert_eq!(c.runtime.cache_dir, Some(PathBuf::from("/var/cache/sy")));
    let c = ServeArgs {
        config: Some(f.path().into()),
        policy_cache: Some("/tmp/other".into()),
        ..Default::default()
    }
    .resolve()
    .unwrap();
    assert_eq!(c.runtime.cache_dir, Some(PathBuf::from("/tmp/other")));
}

#[test]
fn prediction_lifetime_and_size_come_from_flags_or_the_file() {
    let f = file(
        "workers = [\"http://x:1\"]\nprediction_ttl_secs = 6.5\nprediction_max_blocks = 5000\n",
    );
    let c = ServeArgs {
        config: Some(f.path().into()),
        ..Default::default()
    }
    .resolve()
    .unwrap();
    assert_eq!(c.approximate.ttl, Duration::from_millis(6500));
    assert_eq!(c.approximate.max_blocks, 5000);
    let c = ServeArgs {
        config: Some(f.path().into()),
        prediction_ttl_secs: Some(30.0),
        ..Default::default()
    }
    .resolve()
    .unwrap();
    assert_eq!(c.approximate.ttl, Duration::from_secs(30));
    let err = ServeArgs {
        config: Some(f.path().into()),
        prediction_ttl_secs: Some(0.0),
        ..Default::default()
    }
    .resolve()
    .unwrap_err();
    assert!(err.to_string().contains("prediction_ttl_secs"), "{err}");
}

/// A duration past a year would overflow `Instant` arithmetic on the request path;
/// each is refused at start with the setting's name, whether from a flag or the file.
/// The chain is keyed at random where only the router computes it, shared (0, or
/// the key given) where workers may publish NDJSON events hashed with it.
#[test]
fn the_hash_chain_is_keyed_at_random_only_where_no_worker_computes_it() {
    let args = |kv_events: Option<bool>, key: Option<u64>| ServeArgs {
        workers: vec!["http://a:1".into()],
        kv_events,
        kv_hash_key: key,
        ..Default::default()
    };
    let (a, b) = (
        args(None, None).resolve().unwrap().kv_hash_key,
        args(None, None).resolve().unwrap().kv_hash_key,
    );
    assert!(a != 0 && b != 0 && a != b, "{a} {b}");
    assert_eq!(args(Some(true), None).resolve().unwrap().kv_hash_key, 0);
    assert_eq!(
        args(Some(true), Some(42)).resolve().unwrap().kv_hash_key,
        42
    );
    assert_eq!(args(None, Some(42)).resolve().unwrap().kv_hash_key, 42);
}

#[test]
fn durations_that_would_overflow_a_clock_are_refused_by_name() {
    let f = file("workers = [\"http://x:1\"]\nrequest_timeout_secs = 18446744073709551615\n");
    let err = ServeArgs {
        config: Some(f.path().into()),
        ..Default::default()
    }
    .resolve()
    .unwrap_err();
    assert!(err.to_string().contains("request_timeout_secs"), "{err}");
    let workers = vec!["http://x:1".to_string()];
    for args in [
        ServeArgs {
            prediction_ttl_secs: Some(1e19),
            ..Default::default()
        },
        ServeArgs {
            max_retry_after_secs: Some(u64::MAX),
            ..Default::default()
        },
        ServeArgs {
            base_ejection_ms: Some(u64::MAX),
            ..Default::default()
        },
        ServeArgs {
            shutdown_grace_secs: Some(u64::MAX / 2),
            ..Default::default()
        },
    ] {
        let err = ServeArgs {
            workers: workers.clone(),
            ..args
        }
        .resolve()
        .unwrap_err();
        assert!(err.to_string().contains("a year"), "{err}");
    }
    let c = ServeArgs {
        workers,
        max_retry_after_secs: Some(3600),
        ..Default::default()
    }
    .resolve()
    .unwrap();
    assert_eq!(c.client.outlier.busy_max, Duration::from_secs(3600));
}

#[test]
fn unknown_keys_and_missing_workers_are_errors() {
    let f = file("workers = [\"http://x:1\"]\npolcy = \"kv-cost\"\n");
    let err = ServeArgs {
        config: Some(f.path().into()),
        ..Default::default()
    }
    .resolve()
    .unwrap_err();
    assert!(err.to_string().contains("unknown field `polcy`"), "{err}");
    let err = ServeArgs::default().resolve().unwrap_err();
    assert!(err.to_string().contains("no workers"), "{err}");
    let err = ServeArgs {
        workers: vec!["localhost:1".into()],
        ..Default::default()
    }
    .resolve()
    .unwrap_err();
    assert!(err.to_string().contains("not an http(s) URL"), "{err}");
}

#[test]
fn workers_name_their_engines_kv_event_sockets_on_the_command_line_or_in_the_file() {
    let w = StaticWorker::parse(
        "http://10.0.0.7:8000/#kv_events=tcp://10.0.0.7:5557&kv_replay=tcp://10.0.0.7:5558&topic=kv&dp=2",
    )
    .unwrap();
    assert_eq!(w.url, "http://10.0.0.7:8000");
    let src = w.engine_events.unwrap();
    assert_eq!(src.endpoint, "tcp://10.0.0.7:5557");
    assert_eq!(src.replay.as_deref(), Some("tcp://10.0.0.7:5558"));
    assert_eq!((src.topic.as_str(), src.data_parallel_size), ("kv", 2));
    // Central mode: the engine connects to the router; its topic names it.
    let w = StaticWorker::parse("http://h:1#kv_events=bound&topic=w1&kv_replay=tcp://h:2").unwrap();
    assert_eq!(w.engine_events.unwrap().endpoint, "bound");
    for bad in [
        "http://h:1#kv_events=tcp://*:5557",
        "http://h:1#kv_events=ipc:///tmp/x",
        "http://h:1#kv_replay=tcp://h:2",
        "http://h:1#kv_events=tcp://h:2&dp=0",
        "http://h:1#kv_event=tcp://h:2",
        "http://h:1#kv_events=bound",
    ] {
        assert!(StaticWorker::parse(bad).is_err(), "{bad}");
    }
    let f = file(
        "[[workers]]\nurl = \"http://a:8000\"\nkv_events = \"tcp://a:5557\"\n\n[[workers]]\nurl = \"http://b:8000\"\n",
    );
    let c = ServeArgs {
        config: Some(f.path().into()),
        ..Default::default()
    }
    .resolve()
    .unwrap();
    let DiscoveryConfig::Static { workers, .. } = c.discovery else {
        panic!()
    };
    assert_eq!(
        workers[0].engine_events,
        Some(EngineEventSource::new("tcp://a:5557"))
    );
    assert_eq!(workers[1].engine_events, None);
}

#[test]
fn a_worker_says_its_role_and_bootstrap_port_in_the_url_or_the_table() {
    use switchyard_discovery::Role;
    let w = StaticWorker::parse("http://p:1#role=prefill&bootstrap_port=8998").unwrap();
    assert_eq!((w.role, w.bootstrap_port), (Role::Prefill, Some(8998)));
    let w = StaticWorker::parse("http://d:1#role=decode").unwrap();
    assert_eq!((w.role, w.bootstrap_port), (Role::Decode, None));
    assert_eq!(StaticWorker::parse("http://b:1").unwrap().role, Role::Both);
    let e = StaticWorker::parse("http://x:1#role=verifier").unwrap_err();
    assert!(
        e.to_string().contains("not one of both, prefill, decode"),
        "{e}"
    );
    let e = StaticWorker::parse("http://x:1#role=decode&bootstrap_port=8998").unwrap_err();
    assert!(e.to_string().contains("prefill worker's"), "{e}");
    let e = StaticWorker::parse("http://x:1#role=prefill&bootstrap_port=99999").unwrap_err();
    assert!(e.to_string().contains("not a port"), "{e}");
    let f = file(
        "model = \"m\"\n[[workers]]\nurl = \"http://p:1\"\nrole = \"prefill\"\nbootstrap_port = 8998\n",
    );
    let c = ServeArgs {
        config: Some(f.path().into()),
        ..Default::default()
    }
    .resolve()
    .unwrap();
    match c.discovery {
        DiscoveryConfig::Static { workers, .. } => {
            assert_eq!(
                (workers[0].role, workers[0].bootstrap_port),
                (Role::Prefill, Some(8998))
            )
        }
        other => panic!("{other:?}"),
    }
}

#[test]
fn the_overload_pages_file_is_read_as_it_says() {
    // The example of docs/overload.md, as written.
    let page = include_str!("../../../../docs/overload.md");
    let start = page.find("```toml\n").expect("a toml block") + 8;
    let toml = &page[start..start + page[start..].find("```").unwrap()];
    let f = file(&format!("workers = [\"http://x:1\"]\n{toml}"));
    let c = ServeArgs {
        config: Some(f.path().into()),
        ..Default::default()
    }
    .resolve()
    .unwrap();
    let o = &c.gateway.overload;
    assert_eq!(o.queue_max, 2048);
    assert_eq!(c.saturation.max_in_flight, 16);
    let names: Vec<&str> = o.classes.iter().map(|c| c.name.as_str()).collect();
    assert_eq!(names, ["high", "search", "normal", "low"], "by rank");
    assert_eq!(o.classes[3].deadline, Duration::from_secs(600));
    let mut h = hyper::HeaderMap::new();
    h.insert("authorization", "Bearer sk-nightly".parse().unwrap());
    let who = o.identify(&h, Duration::from_secs(3600)).unwrap();
    assert_eq!(
        (&*who.tenant, o.classes[who.class].name.as_str()),
        ("nightly", "low")
    );
    // The key wins over the header; `app` (no key) is named by the header.
    h.insert("x-switchyard-tenant", "app".parse().unwrap());
    assert_eq!(
        &*o.identify(&h, Duration::from_secs(3600)).unwrap().tenant,
        "nightly"
    );
    h.remove("authorization");
    assert_eq!(o.identify(&h, Duration::from_secs(3600)).unwrap().weight, 4);
    // `app` may ask for high; `nightly` (its cap is its class, low) may not.
    h.insert("x-switchyard-priority", "high".parse().unwrap());
    let app = o.identify(&h, Duration::from_secs(3600)).unwrap();
    assert_eq!(o.classes[app.class].name, "high");
    h.insert("authorization", "Bearer sk-nightly".parse().unwrap());
    let nightly = o.identify(&h, Duration::from_secs(3600)).unwrap();
    assert_eq!(o.classes[nightly.class].name, "low");
    h.remove("authorization");
    h.remove("x-switchyard-priority");
    // `nightly` has a key: its name in the header is not enough.
    h.insert("x-switchyard-tenant", "nightly".parse().unwrap());
    assert_eq!(
        &*o.identify(&h, Duration::from_secs(3600)).unwrap().tenant,
        "anonymous"
    );
    // A tenant naming a class that does not exist, and a weight of 0, are refused.
    for bad in [
        "[[tenants]]\nname = \"x\"\nclass = \"urgent\"\n",
        "[[tenants]]\nname = \"x\"\nmax_class = \"urgent\"\n",
        "[[tenants]]\nname = \"x\"\nweight = 0\n",
        "[[tenants]]\nname = \"x\"\napi_key_sha256 = \"abc\"\n",
    ] {
        let f = file(&format!("workers = [\"http://x:1\"]\n{bad}"));
        let err = ServeArgs {
            config: Some(f.path().into()),
            ..Default::default()
        }
        .resolve()
        .unwrap_err();
        assert!(err.to_string().contains("tenant `x`"), "{err}");
    }
    // `anonymous` is every unconfigured client: no configured tenant may be it.
    let f = file("workers = [\"http://x:1\"]\n[[tenants]]\nname = \"anonymous\"\n");
    let err = ServeArgs {
        config: Some(f.path().into()),
        ..Default::default()
    }
    .resolve()
    .unwrap_err();
    assert!(err.to_string().contains("tenant `anonymous`"), "{err}");
}

/// A class's objectives are read from its table, and one outside 1 ms to an hour stops
/// the router at start, naming the class and the key.
#[test]
fn a_class_s_objectives_are_bounded() {
    let resolve = |table: &str| {
        let f = file(&format!(
            "workers = [\"http://x:1\"]\n[[classes]]\nname = \"chat\"\nrank = 1\ndeadline_ms = 1000\n{table}"
        ));
        ServeArgs {
            config: Some(f.path().into()),
            ..Default::default()
        }
        .resolve()
    };
    let c = resolve("ttft_ms = 300\ntpot_ms = 50\n").unwrap();
    let o = &c.gateway.overload;
    let chat = &o.classes[o.class_index("chat").unwrap()];
    assert_eq!(chat.objectives.ttft, Some(Duration::from_millis(300)));
    assert_eq!(chat.objectives.tpot, Some(Duration::from_millis(50)));
    for (bad, key) in [
        ("ttft_ms = 0\n", "ttft_ms"),
        ("tpot_ms = 3600001\n", "tpot_ms"),
    ] {
        let err = resolve(bad).unwrap_err().to_string();
        assert!(err.contains("class `chat`") && err.contains(key), "{err}");
    }
}

#[test]
fn lora_adapters_name_their_base_model_or_take_the_routers() {
    let with = |adapters: &[&str]| {
        ServeArgs {
            model: Some("llama".into()),
            workers: vec!["http://127.0.0.1:8001".into()],
            lora_adapters: adapters.iter().map(|s| s.to_string()).collect(),
            ..Default::default()
        }
        .resolve()
    };
    let c = with(&["sql", "chat=qwen"]).unwrap();
    assert_eq!(c.gateway.served_by("sql"), ("llama", Some("sql")));
    assert_eq!(c.gateway.served_by("chat"), ("qwen", Some("chat")));
    assert_eq!(c.gateway.served_by("llama"), ("llama", None));
    for (bad, why) in [
        (&["llama"][..], "its own base"),
        (&["a", "a"][..], "named twice"),
        (&["=llama"][..], "no name"),
        (&["a=b", "b=c"][..], "an adapter as a base"),
    ] {
        assert!(with(bad).is_err(), "{why}");
    }
    let f = file(
        r#"
        model = "llama"
        workers = ["http://127.0.0.1:8001"]
        lora_adapters = ["sql"]
        "#,
    );
    let c = ServeArgs {
        config: Some(f.path().into()),
        ..Default::default()
    }
    .resolve()
    .unwrap();
    assert_eq!(c.gateway.served_by("sql"), ("llama", Some("sql")));
}
