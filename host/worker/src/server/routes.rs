//! The mock worker's routes, but for completions (`generate`).

use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use http_body_util::{BodyExt, Limited, StreamBody};
use hyper::body::{Frame, Incoming};
use hyper::{Method, Request, Response, StatusCode};
use serde_json::json;
use tokio::sync::mpsc;

use switchyard_kv::events::KvEvent;
use switchyard_tokens::openai::{self, Api, Prompt};

use super::generate::completion;
use super::reply::{error, full, json_response, read_body};
use super::{Body, Fault, FaultConfig, Shared};

pub(super) async fn route(shared: Arc<Shared>, req: Request<Incoming>) -> Response<Body> {
    if let Some(key) = &shared.api_key
        && matches!(req.uri().path(), "/v1/completions" | "/v1/chat/completions")
        && req
            .headers()
            .get(hyper::header::AUTHORIZATION)
            .and_then(|v| v.to_str().ok())
            .and_then(|v| v.strip_prefix("Bearer "))
            != Some(key.as_str())
    {
        // vLLM's answer to a missing or wrong key.
        return json_response(StatusCode::UNAUTHORIZED, json!({"error": "Unauthorized"}));
    }
    match (req.method(), req.uri().path()) {
        (&Method::POST, "/v1/completions") => completion(shared, Api::Completions, req).await,
        (&Method::POST, "/v1/chat/completions") => completion(shared, Api::Chat, req).await,
        (&Method::GET, "/v1/models") => {
            // Its context is what its cache holds, as the engine refuses longer requests;
            // an adapter is listed with its base model as `parent`, as vLLM lists it.
            let context = shared.engine.config().max_model_len();
            let owner = shared.pd.engine_name();
            let mut data = vec![
                json!({"id": shared.model, "object": "model", "created": 0, "owned_by": owner, "max_model_len": context}),
            ];
            for adapter in &shared.lora_adapters {
                data.push(json!({"id": adapter, "object": "model", "created": 0, "owned_by": owner, "max_model_len": context, "parent": shared.model}));
            }
            json_response(StatusCode::OK, json!({"object": "list", "data": data}))
        }
        (&Method::GET, "/health") => match shared.active_fault() {
            _ if shared.fault.lock().health_lies => {
                json_response(StatusCode::OK, json!({"status": "ok"}))
            }
            Fault::None | Fault::CutStream | Fault::Stall => {
                json_response(StatusCode::OK, json!({"status": "ok"}))
            }
            // Shedding load (429/503) is not being unhealthy.
            Fault::Status if matches!(shared.fault.lock().status, Some(429 | 503)) => {
                json_response(StatusCode::OK, json!({"status": "ok", "shedding": true}))
            }
            Fault::Hang => std::future::pending().await,
            f => json_response(
                StatusCode::SERVICE_UNAVAILABLE,
                json!({"status": "faulty", "fault": format!("{f:?}")}),
            ),
        },
        (&Method::GET, "/v1/kv_events") => kv_events(&shared),
        (&Method::GET, path) if path.starts_with("/handoff/") => handoff(&shared, &req).await,
        (&Method::GET, "/metrics") => engine_metrics(&shared),
        (&Method::POST, "/reset_prefix_cache") => reset_prefix_cache(&shared),
        (&Method::GET, "/get_server_info" | "/server_info") => {
            json_response(StatusCode::OK, server_info(&shared))
        }
        (&Method::GET, "/get_model_info" | "/model_info") => json_response(
            StatusCode::OK,
            json!({"model_path": shared.model, "tokenizer_path": null, "is_generation": true}),
        ),
        (&Method::GET, "/version") => json_response(
            StatusCode::OK,
            json!({"version": env!("CARGO_PKG_VERSION")}),
        ),
        (&Method::GET, "/v1/loads") => json_response(StatusCode::OK, v1_loads(&shared)),
        (&Method::GET, "/get_load") => json_response(StatusCode::OK, get_load(&shared)),
        (&Method::POST, "/tokenize") => tokenize(&shared, req, false).await,
        (&Method::POST, "/v1/chat/completions/render") => tokenize(&shared, req, true).await,
        (&Method::GET, "/stats") => json_response(
            StatusCode::OK,
            serde_json::to_value(shared.engine.stats()).expect("stats serialise"),
        ),
        (&Method::POST, "/admin/fault") => {
            let body = match Limited::new(req.into_body(), 4096).collect().await {
                Ok(b) => b.to_bytes(),
                Err(_) => {
                    return error(
                        StatusCode::BAD_REQUEST,
                        "body too large",
                        "invalid_request_error",
                        None,
                    );
                }
            };
            match serde_json::from_slice::<FaultConfig>(&body) {
                Ok(f) => {
                    let answer = json!({"fault": format!("{:?}", f.fault), "after": f.after});
                    shared.set_fault(f);
                    json_response(StatusCode::OK, answer)
                }
                Err(e) => error(
                    StatusCode::BAD_REQUEST,
                    &format!("bad fault: {e}"),
                    "invalid_request_error",
                    None,
                ),
            }
        }
        _ => {
            // Read the body before answering: a client that is still sending it would
            // otherwise see its connection closed unannounced, and a pooled client's next
            // request on it would fail.
            let path = req.uri().path().to_string();
            let drained = read_body(req).await.is_ok();
            let mut answer = error(
                StatusCode::NOT_FOUND,
                &format!("no such route: {path}"),
                "invalid_request_error",
                None,
            );
            if !drained {
                answer.headers_mut().insert(
                    hyper::header::CONNECTION,
                    hyper::header::HeaderValue::from_static("close"),
                );
            }
            answer
        }
    }
}

/// `GET /handoff/{key}?have=N`: a decode worker takes the KV of prefill `key`.
async fn handoff(shared: &Shared, req: &Request<Incoming>) -> Response<Body> {
    let key = req.uri().path().trim_start_matches("/handoff/");
    let param = |name: &str| {
        req.uri()
            .query()?
            .split('&')
            .find_map(|kv| kv.strip_prefix(name)?.strip_prefix('='))
            .and_then(|n| n.parse::<usize>().ok())
    };
    let have = param("have").unwrap_or(0);
    let wait = if param("wait") == Some(1) {
        super::pd::HANDOFF_WAIT
    } else {
        Duration::ZERO
    };
    if key.is_empty() || key.len() > 128 {
        return error(
            StatusCode::BAD_REQUEST,
            "a handoff key is 1 to 128 characters",
            "invalid_request_error",
            None,
        );
    }
    match shared
        .handoffs
        .hand_over(
            &shared.engine,
            key,
            have,
            shared.pd.transfer_us_per_token,
            wait,
        )
        .await
    {
        Ok(blocks) => json_response(StatusCode::OK, json!({ "blocks": blocks })),
        Err((status, why)) => error(status, &why, "invalid_request_error", None),
    }
}

/// What SGLang's `/get_server_info` and vLLM-style routers read: the model, the KV block
/// size under the names each uses, the cache size and the batch limit.
pub(super) fn server_info(shared: &Shared) -> serde_json::Value {
    let c = shared.engine.config();
    json!({
        "model_path": shared.model,
        "served_model_name": shared.model,
        "page_size": c.block_size,
        "block_size": c.block_size,
        "kv_block_size": c.block_size,
        "max_total_num_tokens": c.capacity_tokens(),
        "max_running_requests": c.max_batch,
        "tp_size": 1,
        "dp_size": 1,
        "version": env!("CARGO_PKG_VERSION"),
        // SGLang's names: `null` mode for an aggregated worker.
        "disaggregation_mode": match shared.pd.role {
            switchyard_ids::Role::Both => "null",
            r => r.as_str(),
        },
        "disaggregation_bootstrap_port": shared.pd.bootstrap_port,
    })
}

/// vLLM's `/tokenize` (a `prompt` or chat `messages`) and `/v1/chat/completions/render`
/// (chat `messages`, answered with the rendered prompt and its tokens), with the same
/// tokenizer and chat rendering the engine uses, so a router that asks gets exactly the
/// worker's token IDs.
pub(super) async fn tokenize(
    shared: &Shared,
    req: Request<Incoming>,
    render: bool,
) -> Response<Body> {
    let bad = |m: &str| error(StatusCode::BAD_REQUEST, m, "invalid_request_error", None);
    let body = match read_body(req).await {
        Ok(b) => b,
        Err(too_large) => return too_large,
    };
    let Ok(serde_json::Value::Object(mut obj)) = serde_json::from_slice(&body) else {
        return bad("request body must be a JSON object");
    };
    obj.entry("model")
        .or_insert_with(|| serde_json::Value::String(shared.model.clone()));
    let api = if obj.contains_key("messages") {
        Api::Chat
    } else {
        Api::Completions
    };
    if render && api != Api::Chat {
        return bad("`messages` is required");
    }
    let body = serde_json::Value::Object(obj).to_string();
    let parsed = match openai::parse(api, body.as_bytes()) {
        Ok(p) => p,
        Err(e) => return bad(&e.message),
    };
    let (text, tokens) = match &parsed.prompt {
        Prompt::Tokens(t) => (None, Ok(t.clone())),
        Prompt::Text(t) => (Some(t.clone()), shared.tokenizer.encode(t)),
        Prompt::Chat(m) => match shared.tokenizer.render_chat(m) {
            Ok(text) => {
                let tokens = shared.tokenizer.encode(&text);
                (Some(text), tokens)
            }
            Err(e) => (None, Err(e)),
        },
    };
    let tokens = match tokens {
        Ok(t) => t,
        Err(e) => return bad(&e.to_string()),
    };
    let max_model_len = shared.engine.config().max_model_len();
    if render {
        json_response(
            StatusCode::OK,
            json!({"prompt": text, "prompt_token_ids": tokens, "count": tokens.len()}),
        )
    } else {
        json_response(
            StatusCode::OK,
            json!({"count": tokens.len(), "max_model_len": max_model_len, "tokens": tokens}),
        )
    }
}

/// SGLang's `GET /v1/loads` (`sglang/srt/entrypoints/v1_loads.py`, the `core` section of
/// `SchedulerMetricsMixin.get_loads`), for one data-parallel rank. Tokens are KV slots:
/// `num_used_tokens` are those held by running requests (evictable radix-cache tokens
/// left out), `num_total_tokens` adds the waiting requests' prompts.
pub(super) fn v1_loads(shared: &Shared) -> serde_json::Value {
    let s = shared.engine.stats();
    let bs = u64::from(shared.hasher.block_size());
    let used = s.kv_used_blocks.saturating_mul(bs);
    let total = used.saturating_add(s.waiting_prompt_tokens);
    let capacity = s.kv_total_blocks.saturating_mul(bs);
    let usage = round4(s.kv_usage());
    let now = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0.0, |d| d.as_secs_f64());
    let load = json!({
        "dp_rank": 0,
        "timestamp": now,
        "num_running_reqs": s.running,
        "num_waiting_reqs": s.waiting,
        "num_total_reqs": s.running + s.waiting,
        "num_used_tokens": used,
        "num_total_tokens": total,
        "max_total_num_tokens": capacity,
        "token_usage": usage,
        "gen_throughput": 0.0,
        "cache_hit_rate": round4(s.last_batch_hit_rate()),
        "utilization": usage,
        "max_running_requests": shared.engine.config().max_batch,
    });
    json!({
        "timestamp": now,
        "version": env!("CARGO_PKG_VERSION"),
        "dp_rank_count": 1,
        "loads": [load],
        "aggregate": {
            "total_running_reqs": s.running,
            "total_waiting_reqs": s.waiting,
            "total_reqs": s.running + s.waiting,
            "total_used_tokens": used,
            "total_tokens": total,
            "avg_token_usage": usage,
            "avg_throughput": 0.0,
            "avg_utilization": usage,
        },
    })
}

/// SGLang's older `GET /get_load` (`Scheduler.get_load`): one entry per data-parallel
/// rank, `num_tokens` the KV slots held by running requests plus the waiting prompts.
pub(super) fn get_load(shared: &Shared) -> serde_json::Value {
    let s = shared.engine.stats();
    let used = s
        .kv_used_blocks
        .saturating_mul(u64::from(shared.hasher.block_size()));
    json!([{
        "dp_rank": 0,
        "num_reqs": s.running + s.waiting,
        "num_waiting_reqs": s.waiting,
        "num_tokens": used.saturating_add(s.waiting_prompt_tokens),
    }])
}

fn round4(x: f64) -> f64 {
    (x * 1e4).round() / 1e4
}

/// Load in vLLM's own Prometheus names (vLLM 0.11's V1 engine, `vllm/v1/metrics/loggers.py`),
/// as a router scrapes them from a vLLM server. `kv_cache_usage_perc` is the share of
/// blocks held by running requests (vLLM's block pool: `1 - free / total`, where cached
/// blocks no request uses are in the free queue); the prefix-cache counters are in
/// tokens, queried and hit, as vLLM counts them. The inter-token latency is a histogram
/// with its `+Inf` bucket alone (its sum and count are what routers read).
pub(super) fn engine_metrics(shared: &Shared) -> Response<Body> {
    let s = shared.engine.stats();
    let m = &shared.model;
    let usage = s.kv_usage();
    let (itl_count, itl_sum) = (s.itl_count, s.itl_sum_us as f64 / 1e6);
    let page = format!(
        "# HELP vllm:num_requests_running Number of requests in model execution batches.\n\
         # TYPE vllm:num_requests_running gauge\n\
         vllm:num_requests_running{{engine=\"0\",model_name=\"{m}\"}} {}\n\
         # HELP vllm:num_requests_waiting Number of requests waiting to be processed.\n\
         # TYPE vllm:num_requests_waiting gauge\n\
         vllm:num_requests_waiting{{engine=\"0\",model_name=\"{m}\"}} {}\n\
         # HELP vllm:kv_cache_usage_perc KV-cache usage. 1 means 100 percent usage.\n\
         # TYPE vllm:kv_cache_usage_perc gauge\n\
         vllm:kv_cache_usage_perc{{engine=\"0\",model_name=\"{m}\"}} {usage}\n\
         # HELP vllm:prefix_cache_queries_total Prefix cache queries, in terms of number of queried tokens.\n\
         # TYPE vllm:prefix_cache_queries_total counter\n\
         vllm:prefix_cache_queries_total{{engine=\"0\",model_name=\"{m}\"}} {}\n\
         # HELP vllm:prefix_cache_hits_total Prefix cache hits, in terms of number of cached tokens.\n\
         # TYPE vllm:prefix_cache_hits_total counter\n\
         vllm:prefix_cache_hits_total{{engine=\"0\",model_name=\"{m}\"}} {}\n\
         # HELP vllm:request_success_total Count of successfully processed requests.\n\
         # TYPE vllm:request_success_total counter\n\
         vllm:request_success_total{{engine=\"0\",model_name=\"{m}\"}} {}\n\
         # HELP vllm:cache_config_info Information of the LLMEngine CacheConfig\n\
         # TYPE vllm:cache_config_info gauge\n\
         vllm:cache_config_info{{block_size=\"{}\",engine=\"0\",num_gpu_blocks=\"{}\",enable_prefix_caching=\"True\"}} 1.0\n\
         # HELP vllm:inter_token_latency_seconds Histogram of inter-token latency in seconds.\n\
         # TYPE vllm:inter_token_latency_seconds histogram\n\
         vllm:inter_token_latency_seconds_bucket{{engine=\"0\",le=\"+Inf\",model_name=\"{m}\"}} {itl_count}\n\
         vllm:inter_token_latency_seconds_count{{engine=\"0\",model_name=\"{m}\"}} {itl_count}\n\
         vllm:inter_token_latency_seconds_sum{{engine=\"0\",model_name=\"{m}\"}} {itl_sum}\n",
        s.running,
        s.waiting,
        s.prefill_tokens.saturating_add(s.cached_tokens),
        s.cached_tokens,
        s.finished,
        shared.hasher.block_size(),
        s.kv_total_blocks,
    );
    full(StatusCode::OK, "text/plain; version=0.0.4", page)
}

/// vLLM's `POST /reset_prefix_cache` (served in its dev mode): every cached block
/// dropped, `{"success": false}` while requests run (vLLM refuses while blocks are held;
/// callers retry).
fn reset_prefix_cache(shared: &Shared) -> Response<Body> {
    let s = shared.engine.stats();
    let success = s.running == 0 && s.waiting == 0;
    if success {
        shared.engine.clear_cache();
    }
    json_response(StatusCode::OK, serde_json::json!({ "success": success }))
}

/// The KV event stream: snapshot, then every event, plus a load report each second (of
/// the engine's time, at its speedup).
pub(super) fn kv_events(shared: &Arc<Shared>) -> Response<Body> {
    let (snapshot, mut events) = shared.engine.subscribe();
    let (tx, rx) = mpsc::channel::<Result<Frame<Bytes>, std::io::Error>>(64);
    let engine = shared.engine.clone();
    tokio::spawn(async move {
        if tx
            .send(Ok(Frame::data(Bytes::from(snapshot.to_line()))))
            .await
            .is_err()
        {
            return;
        }
        // A second of the engine's time: the router reads a sped-up engine's load as
        // often, in its time, as a real engine's.
        let every = Duration::from_secs(1)
            .div_f64(engine.config().speedup.max(1.0))
            .max(Duration::from_millis(10));
        let mut tick = tokio::time::interval(every);
        loop {
            let line = tokio::select! {
                e = events.recv() => match e {
                    Ok(e) => e.to_wire().to_line(),
                    // Lagged or closed: end the stream; the subscriber resubscribes and
                    // gets a fresh snapshot.
                    Err(_) => return,
                },
                _ = tick.tick() => {
                    let s = engine.stats();
                    KvEvent::Load {
                        kv_used_blocks: s.kv_used_blocks,
                        kv_total_blocks: s.kv_total_blocks,
                        running: s.running as u32,
                        waiting: s.waiting as u32,
                        itl_sum_us: Some(s.itl_sum_us),
                        itl_count: Some(s.itl_count),
                    }
                    .to_line()
                }
            };
            if tx.send(Ok(Frame::data(Bytes::from(line)))).await.is_err() {
                return;
            }
        }
    });
    Response::builder()
        .header("content-type", "application/x-ndjson")
        .body(StreamBody::new(tokio_stream::wrappers::ReceiverStream::new(rx)).boxed())
        .expect("valid response")
}
