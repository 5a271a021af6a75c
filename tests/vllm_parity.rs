//! Block-key parity with real vLLM engines (CPU, `tools/vllm.sh`): for each block size
//! the engine takes, each API (`/v1/completions` and `/v1/chat/completions` through the
//! engine's chat template), a `cache_salt` or none and a LoRA adapter or the base model,
//! with prompts of multibyte text, the router's predicted overlap for a prompt's
//! extension equals the cached tokens the engine then reports; the engines' KV events
//! land in the router's view with nothing refused (no unknown parents, no bad token
//! counts, no foreign block sizes); and a prompt matches no other salt's blocks and no
//! other model's (adapter or base), in the router's view as in the engine's.

mod common;

use std::time::Duration;

use hyper::StatusCode;
use serde_json::{Value, json};

use common::http::{self, HttpClient, post_json};
use common::procs::{free_port, serve, switchyard, wait_ok};
use common::router::{admin_post, eventually, instances_of};
use common::vllm::{ADAPTER, MODEL, Vllm, model_dir};

/// Block sizes vLLM on CPU takes (multiples of 32).
const BLOCKS: [u32; 3] = [32, 64, 128];

/// Text of multibyte characters (accents, CJK, emoji) and ASCII, about `tokens` long
/// (the model's tokenizer takes ~2.5 tokens a word of these).
fn multibyte(tag: &str, tokens: usize) -> String {
    let words = [
        "naïve",
        "café",
        "日本語",
        "中文字符",
        "🚀",
        "Ünïcödé",
        "ß",
        "Ωμέγα",
        "русский",
        "😀",
        "façade",
        "한국어",
        "crème",
        "brûlée",
    ];
    let mut s = format!("{tag}: ");
    for i in 0..tokens * 2 / 5 {
        s.push_str(words[(i * 5 + tag.len()) % words.len()]);
        s.push(' ');
    }
    s
}

/// What a case varies.
#[derive(Clone, Copy)]
struct Keys<'a> {
    api: &'a str,
    salt: Option<&'a str>,
    /// The adapter rather than the base model.
    lora: bool,
}

/// A request of `keys.api` for `text`, for the adapter or the base model, with the
/// salt if any.
fn request(keys: Keys<'_>, text: &str) -> Value {
    let model = if keys.lora { ADAPTER } else { MODEL };
    let mut v = if keys.api == "chat" {
        json!({"model": model, "messages": [{"role": "user", "content": text}], "max_tokens": 1, "temperature": 0})
    } else {
        json!({"model": model, "prompt": text, "max_tokens": 1, "temperature": 0})
    };
    let salt = keys.salt;
    if let Some(s) = salt {
        v["cache_salt"] = json!(s);
    }
    v
}

fn path(api: &str) -> &'static str {
    if api == "chat" {
        "/v1/chat/completions"
    } else {
        "/v1/completions"
    }
}

/// The router's `explain` of `body`.
async fn explain(c: &HttpClient, url: &str, body: &Value) -> Value {
    let at = format!("{url}/admin/endpoints/default/{MODEL}/generate/explain");
    let (status, v, bytes) = admin_post(c, &at, body).await;
    assert!(status.is_success(), "{}", String::from_utf8_lossy(&bytes));
    v
}

/// The most blocks any candidate holds in the router's view (all views from events).
fn most_blocks(e: &Value) -> u64 {
    let candidates = e["candidates"].as_array().unwrap();
    assert!(
        candidates.iter().all(|c| c["cache_view"] == "events"),
        "every engine seen through its events: {e}"
    );
    candidates
        .iter()
        .map(|c| c["overlap_blocks"].as_u64().unwrap())
        .max()
        .unwrap_or(0)
}

/// The cached tokens an answer reports.
fn cached(v: &Value) -> u64 {
    v["usage"]["prompt_tokens_details"]["cached_tokens"]
        .as_u64()
        .unwrap_or(0)
}

/// One case: a prompt, then its extension; the router's prediction against the engine.
async fn case(c: &HttpClient, url: &str, block: u32, keys: Keys<'_>) {
    let tag = format!(
        "{block} {} {} {}",
        keys.api,
        keys.salt.unwrap_or("unsalted"),
        if keys.lora { ADAPTER } else { MODEL }
    );
    let at = format!("{url}{}", path(keys.api));
    // About 4.5 blocks, then 1.5 more (within the 1,024-token context at 128).
    let base = multibyte(&tag, 9 * block as usize / 2);
    let extension = format!("{base}{}", multibyte("and more", 3 * block as usize / 2));
    let (status, v, _) = post_json(c, &at, &request(keys, &base)).await;
    assert_eq!(status, StatusCode::OK, "{tag}: {v}");
    let next = request(keys, &extension);
    let prompt_blocks = explain(c, url, &next).await["prompt_blocks"]
        .as_u64()
        .unwrap();
    // The engine's events for the first prompt reach the router.
    let mut predicted = 0;
    for _ in 0..200 {
        predicted = most_blocks(&explain(c, url, &next).await);
        if predicted > 0 {
            break;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    assert!(
        predicted >= 3 && predicted < prompt_blocks,
        "{tag}: the router sees {predicted} of {prompt_blocks} blocks cached"
    );
    let (status, v, _) = post_json(c, &at, &next).await;
    assert_eq!(status, StatusCode::OK, "{tag}: {v}");
    assert_eq!(
        predicted * u64::from(block),
        cached(&v),
        "{tag}: the router predicted {predicted} blocks of {block}; the engine: {v}"
    );
    // Another salt (or none where there was one), and the other model (the base for
    // the adapter, the adapter for the base), match nothing: in the router's view, and
    // in the engine's, which would have used them.
    let other_salt = Keys {
        salt: if keys.salt.is_some() {
            None
        } else {
            Some("another tenant")
        },
        ..keys
    };
    let other_model = Keys {
        lora: !keys.lora,
        ..keys
    };
    for (what, foreign) in [("salt", other_salt), ("model", other_model)] {
        let body = request(foreign, &extension);
        assert_eq!(
            most_blocks(&explain(c, url, &body).await),
            0,
            "{tag}: another {what}'s prompt matched in the router's view"
        );
        let (status, v, _) = post_json(c, &at, &body).await;
        assert_eq!(status, StatusCode::OK, "{tag}: {v}");
        assert_eq!(
            cached(&v),
            0,
            "{tag}: the engine shared blocks across {what}s: {v}"
        );
    }
}

/// A router in front of `workers` (`--worker` arguments) at `block` tokens a block, with
/// the adapter named; every case of the matrix through it; then what the workers'
/// events did in the router's view.
async fn matrix(c: &HttpClient, block: u32, workers: &[String]) {
    let tokenizer = model_dir().join("tokenizer.json");
    let block_arg = block.to_string();
    let mut args = vec![
        "--model",
        MODEL,
        "--block-size",
        &block_arg,
        "--tokenizer",
        tokenizer.to_str().unwrap(),
        "--lora-adapter",
        ADAPTER,
        "--admin-token",
        common::router::TOKEN,
    ];
    for w in workers {
        args.extend(["--worker", w.as_str()]);
    }
    let (_router, url) = serve(&args).await;
    // The adapter is listed with its base; one the router was not told of is an
    // unknown model, never routed on the base model's blocks.
    let (_, models) = http::get(c, &format!("{url}/v1/models")).await;
    let models: Value = serde_json::from_slice(&models).unwrap();
    assert!(
        models["data"]
            .as_array()
            .unwrap()
            .iter()
            .any(|m| m["id"] == ADAPTER && m["parent"] == MODEL),
        "{models}"
    );
    let unlisted = json!({"model": "unlisted-adapter", "prompt": "hi", "max_tokens": 1});
    let (status, v, _) = post_json(c, &format!("{url}/v1/completions"), &unlisted).await;
    assert_eq!(status, StatusCode::NOT_FOUND, "{v}");
    eventually("both workers' events", || async {
        instances_of(c, &url, MODEL).await["instances"]
            .as_array()
            .unwrap()
            .iter()
            .all(|i| i["cache_view"] == "events")
    })
    .await;
    for api in ["completions", "chat"] {
        for salt in [None, Some("tenant-1")] {
            for lora in [false, true] {
                case(c, &url, block, Keys { api, salt, lora }).await;
            }
        }
    }
    // Every stored event the workers sent was applied: none refused.
    for i in instances_of(c, &url, MODEL).await["instances"]
        .as_array()
        .unwrap()
    {
        let counts = &i["cache_view_counts"];
        assert!(counts["stored_blocks"].as_u64().unwrap() > 0, "{i}");
        for refused in [
            "unknown_parent",
            "bad_tokens",
            "wrong_block_size",
            "malformed",
        ] {
            assert_eq!(counts[refused], 0, "block size {block}: {refused}: {i}");
        }
    }
}

/// Two mock workers shaped as the engines (the model's tokenizer and chat template,
/// `block`, the adapter, vLLM's ZMQ events): their `--worker` arguments.
async fn mocks(block: u32) -> (Vec<common::procs::Proc>, Vec<String>) {
    let tokenizer = model_dir().join("tokenizer.json");
    let block_arg = block.to_string();
    let (mut procs, mut args) = (Vec::new(), Vec::new());
    for _ in 0..2 {
        let listen = format!("127.0.0.1:{}", free_port());
        // The mock's PUB socket on `events`, its replay socket on the port after.
        let events = loop {
            let p = free_port();
            if p < u16::MAX && std::net::TcpListener::bind(("127.0.0.1", p + 1)).is_ok() {
                break p;
            }
        };
        let events_arg = events.to_string();
        procs.push(switchyard(&[
            "mock-worker",
            "--listen",
            &listen,
            "--model",
            MODEL,
            "--tokenizer",
            tokenizer.to_str().unwrap(),
            "--block-size",
            &block_arg,
            "--lora-adapter",
            ADAPTER,
            "--zmq-events",
            &events_arg,
            "--speedup",
            "100",
        ]));
        wait_ok(&format!("http://{listen}/v1/models")).await;
        args.push(format!(
            "http://{listen}#kv_events=tcp://127.0.0.1:{events}&kv_replay=tcp://127.0.0.1:{}&topic=kv-events",
            events + 1
        ));
    }
    (procs, args)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_routers_blocks_are_the_engines_across_block_sizes_salts_and_apis() {
    if common::vllm::no_vllm() {
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let c = http::client();
    for block in BLOCKS {
        // The mock first: it keys and publishes blocks as the engine does.
        eprintln!("--- block size {block}: mock workers");
        let (_mocks, workers) = mocks(block).await;
        matrix(&c, block, &workers).await;
        eprintln!("--- block size {block}: vLLM");
        let mut a = Vllm::spawn_with(0, dir.path(), block, true);
        let mut b = Vllm::spawn_with(1, dir.path(), block, true);
        a.ready(&c).await;
        b.ready(&c).await;
        matrix(&c, block, &[a.worker_arg(), b.worker_arg()]).await;
    }
}
