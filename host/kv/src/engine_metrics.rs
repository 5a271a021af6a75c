//! Load as engines report it on their Prometheus `/metrics`: vLLM's and SGLang's gauge
//! names, read from the text exposition format. Pure parsing.
//!
//! | | vLLM | SGLang |
//! | --- | --- | --- |
//! | running | `vllm:num_requests_running` | `sglang:num_running_reqs` |
//! | waiting | `vllm:num_requests_waiting` | `sglang:num_queue_reqs` |
//! | KV usage (0–1) | `vllm:kv_cache_usage_perc` (older: `vllm:gpu_cache_usage_perc`) | `sglang:token_usage` |
//! | KV size | `vllm:cache_config_info{num_gpu_blocks="N"}` | `sglang:max_total_num_tokens` ÷ block size |
//! | inter-token latency (histogram) | `vllm:inter_token_latency_seconds` (older: `vllm:time_per_output_token_seconds`) | `sglang:inter_token_latency_seconds` (older: `sglang:time_per_output_token_seconds`) |
//!
//! Series of one name are summed (running, waiting) or averaged (usage) over their
//! labels (one per engine or rank); a histogram's `_sum` and `_count` are summed (the
//! current name's where a page has both).

use super::latency::EngineLatency;
use super::load::ReportedLoad;

/// What a scrape found.
#[derive(Debug, Clone, Copy, PartialEq, Default)]
struct Found {
    running: Option<f64>,
    waiting: Option<f64>,
    usage_sum: f64,
    usage_n: u32,
    total_blocks: Option<f64>,
    total_tokens: Option<f64>,
    /// Inter-token latency sum and count, under the current name and the older one.
    itl: [(Option<f64>, Option<f64>); 2],
}

/// What a page says about the engine's load.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct EngineLoad {
    /// The load.
    pub load: ReportedLoad,
    /// The page gave the cache size in blocks (otherwise `load` holds the usage as parts
    /// per million of an unknown total).
    pub size_known: bool,
}

/// What an engine's `/v1/models` answer says of the model a router routes to.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct Models {
    /// Its context length in tokens (vLLM's and SGLang's `max_model_len`).
    pub context: Option<u64>,
    /// The engine is vLLM (`owned_by: "vllm"`): it streams token IDs when a request asks
    /// for them (`return_token_ids`), which makes a migrated stream exact.
    pub vllm: bool,
}

/// What an engine's `/v1/models` answer gives for `model` (the first entry that gives a
/// context length, when none is named `model`); `None` when it is no model list.
pub fn models(body: &[u8], model: &str) -> Option<Models> {
    let v: serde_json::Value = serde_json::from_slice(body).ok()?;
    let data = v.get("data")?.as_array()?;
    let len = |e: &serde_json::Value| e.get("max_model_len")?.as_u64().filter(|n| *n > 0);
    let named = data
        .iter()
        .find(|e| e.get("id").and_then(serde_json::Value::as_str) == Some(model));
    let entry = named
        .or_else(|| data.iter().find(|e| len(e).is_some()))
        .or(data.first())?;
    Some(Models {
        context: named.and_then(len).or_else(|| data.iter().find_map(len)),
        vllm: entry.get("owned_by").and_then(serde_json::Value::as_str) == Some("vllm"),
    })
}

/// Parses a `/metrics` page; `None` when it has none of the engines' load gauges.
/// `block_size` converts SGLang's token capacity into blocks.
pub fn parse(text: &str, block_size: u32) -> Option<EngineLoad> {
    let mut f = Found::default();
    for line in text.lines() {
        let line = line.trim();
        if line.is_empty() || line.starts_with('#') {
            continue;
        }
        let (name, labels, value) = match split(line) {
            Some(x) => x,
            None => continue,
        };
        let add = |slot: &mut Option<f64>| *slot = Some(slot.unwrap_or(0.0) + value);
        match name {
            "vllm:num_requests_running" | "sglang:num_running_reqs" => add(&mut f.running),
            "vllm:num_requests_waiting" | "sglang:num_queue_reqs" => add(&mut f.waiting),
            "vllm:kv_cache_usage_perc" | "vllm:gpu_cache_usage_perc" | "sglang:token_usage" => {
                f.usage_sum += value;
                f.usage_n += 1;
            }
            "vllm:cache_config_info" => {
                if let Some(n) = label(labels, "num_gpu_blocks").and_then(|v| v.parse().ok()) {
                    f.total_blocks = Some(n);
                }
            }
            "sglang:max_total_num_tokens" => add(&mut f.total_tokens),
            "vllm:inter_token_latency_seconds_sum" | "sglang:inter_token_latency_seconds_sum" => {
                add(&mut f.itl[0].0)
            }
            "vllm:inter_token_latency_seconds_count"
            | "sglang:inter_token_latency_seconds_count" => add(&mut f.itl[0].1),
            "vllm:time_per_output_token_seconds_sum"
            | "sglang:time_per_output_token_seconds_sum" => add(&mut f.itl[1].0),
            "vllm:time_per_output_token_seconds_count"
            | "sglang:time_per_output_token_seconds_count" => add(&mut f.itl[1].1),
            _ => {}
        }
    }
    if f.running.is_none() && f.waiting.is_none() && f.usage_n == 0 {
        return None;
    }
    let total = f
        .total_blocks
        .or(f.total_tokens.map(|t| t / f64::from(block_size.max(1))))
        .filter(|t| t.is_finite() && *t >= 1.0);
    let usage = (f.usage_n > 0).then(|| (f.usage_sum / f64::from(f.usage_n)).clamp(0.0, 1.0));
    let size_known = total.is_some();
    // Without the cache size, usage is kept as parts per million of an unknown total.
    let (used, total) = match (usage, total) {
        (Some(u), Some(t)) => ((u * t).round() as u64, t as u64),
        (Some(u), None) => ((u * 1e6).round() as u64, 1_000_000),
        (None, Some(t)) => (0, t as u64),
        (None, None) => (0, 0),
    };
    let count = |v: Option<f64>| v.unwrap_or(0.0).clamp(0.0, f64::from(u32::MAX)) as u32;
    let latency = f.itl.iter().find_map(|(sum, n)| {
        let (itl_sum, itl_count) = ((*sum)?, (*n)?);
        (itl_sum >= 0.0 && itl_count >= 0.0).then_some(EngineLatency { itl_sum, itl_count })
    });
    Some(EngineLoad {
        load: ReportedLoad {
            kv_used_blocks: used,
            kv_total_blocks: total,
            running: count(f.running),
            waiting: count(f.waiting),
            latency,
        },
        size_known,
    })
}

/// `name{labels} value [timestamp]` → (name, labels, value).
fn split(line: &str) -> Option<(&str, &str, f64)> {
    let (name, rest) = match line.find(['{', ' ']) {
        Some(i) => line.split_at(i),
        None => return None,
    };
    let (labels, rest) = if let Some(body) = rest.strip_prefix('{') {
        let end = body.rfind('}')?;
        (&body[..end], &body[end + 1..])
    } else {
        ("", rest)
    };
    let value = rest.split_whitespace().next()?;
    let value: f64 = value.parse().ok()?;
    value.is_finite().then_some((name, labels, value))
}

/// The value of label `key` in `a="x",b="y"`.
fn label<'a>(labels: &'a str, key: &str) -> Option<&'a str> {
    let mut rest = labels;
    while !rest.is_empty() {
        let eq = rest.find('=')?;
        let k = rest[..eq].trim().trim_start_matches(',').trim();
        let after = rest[eq + 1..].strip_prefix('"')?;
        let end = after.find('"')?;
        if k == key {
            return Some(&after[..end]);
        }
        rest = &after[end + 1..];
    }
    None
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn vllm_metrics() {
        let page = r#"
# HELP vllm:num_requests_running Number of requests in model execution batches.
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{engine="0",model_name="m"} 3.0
vllm:num_requests_running{engine="1",model_name="m"} 2.0
vllm:num_requests_waiting{engine="0",model_name="m"} 7.0
vllm:kv_cache_usage_perc{engine="0",model_name="m"} 0.5
vllm:kv_cache_usage_perc{engine="1",model_name="m"} 0.25
vllm:cache_config_info{block_size="16",cache_dtype="auto",num_gpu_blocks="4000",prefix_caching="True"} 1.0
vllm:prompt_tokens_total{model_name="m"} 1.2e6
vllm:inter_token_latency_seconds_bucket{engine="0",le="+Inf",model_name="m"} 100.0
vllm:inter_token_latency_seconds_count{engine="0",model_name="m"} 100.0
vllm:inter_token_latency_seconds_sum{engine="0",model_name="m"} 1.5
vllm:inter_token_latency_seconds_count{engine="1",model_name="m"} 50.0
vllm:inter_token_latency_seconds_sum{engine="1",model_name="m"} 0.5
vllm:time_per_output_token_seconds_count{engine="0",model_name="m"} 9.0
vllm:time_per_output_token_seconds_sum{engine="0",model_name="m"} 9.0
"#;
        assert_eq!(
            parse(page, 16),
            Some(EngineLoad {
                load: ReportedLoad {
                    kv_used_blocks: 1500,
                    kv_total_blocks: 4000,
                    running: 5,
                    waiting: 7,
                    latency: Some(EngineLatency {
                        itl_sum: 2.0,
                        itl_count: 150.0
                    }),
                },
                size_known: true
            })
        );
    }

    #[test]
    fn sglang_metrics_and_pages_without_them() {
        let page = "sglang:num_running_reqs{model_name=\"m\"} 4\nsglang:num_queue_reqs{model_name=\"m\"} 1\nsglang:token_usage{model_name=\"m\"} 0.1\nsglang:max_total_num_tokens{model_name=\"m\"} 16000\n";
        assert_eq!(
            parse(page, 16),
            Some(EngineLoad {
                load: ReportedLoad {
                    kv_used_blocks: 100,
                    kv_total_blocks: 1000,
                    running: 4,
                    waiting: 1,
                    latency: None,
                },
                size_known: true
            })
        );
        assert_eq!(parse("process_cpu_seconds_total 12\n", 16), None);
        assert_eq!(
            parse("garbage {{{ \n vllm:num_requests_running nan\n", 16),
            None
        );
        // Usage without a size: parts per million.
        let r = parse("vllm:gpu_cache_usage_perc 0.75\n", 16).unwrap();
        assert_eq!(r.load.kv_usage(), Some(0.75));
        assert!(!r.size_known);
        // SGLang's older name alone; a sum without its count is no latency.
        let r = parse("sglang:num_running_reqs 1\nsglang:time_per_output_token_seconds_sum 3\nsglang:time_per_output_token_seconds_count 4\n", 16).unwrap();
        let l = r.load.latency.unwrap();
        assert_eq!((l.itl_sum, l.itl_count), (3.0, 4.0));
        let r = parse(
            "vllm:num_requests_running 1\nvllm:inter_token_latency_seconds_sum 3\n",
            16,
        )
        .unwrap();
        assert_eq!(r.load.latency, None);
    }
}
