#!/usr/bin/env bash
# Screenshots of the admin page (docs/admin-ui*.png) from a live fleet: three mock
# workers, one router, chat traffic from eight sessions for a minute, a policy swap, a
# shadow policy compared on live traffic, then a shadow promoted. Needs Debian's
# chromium (tools/test.sh installs it) and a built switchyard (release by default).
#
#   tools/ui-screenshots.sh [path/to/switchyard]
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
bin=${1:-$root/target/release/switchyard}
out=$root/docs
mkdir -p "$out"
tmp=$(mktemp -d)
pids=()
cleanup() { kill "${pids[@]}" 2>/dev/null || true; rm -rf "$tmp"; }
trap cleanup EXIT

free_port() { python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])'; }
workers=()
for _ in 1 2 3; do
    p=$(free_port)
    "$bin" mock-worker --listen "127.0.0.1:$p" --model mock --speedup 20 >"$tmp/w$p.log" 2>&1 &
    pids+=($!)
    workers+=(--worker "http://127.0.0.1:$p")
done
port=$(free_port)
token=screenshot-admin-token
SWITCHYARD_ADMIN_TOKEN="$token" "$bin" serve --listen "127.0.0.1:$port" "${workers[@]}" --model mock >"$tmp/router.log" 2>&1 &
pids+=($!)
url=http://127.0.0.1:$port
for _ in $(seq 100); do curl -fs "$url/ready" >/dev/null && break; sleep 0.1; done
ep=$url/admin/endpoints/default/mock/generate
auth=(-H "authorization: Bearer $token")

# Bounded traffic: 48 sessions of growing chats, four requests at a time, for $1 seconds.
traffic() {
    local until=$((SECONDS + $1))
    while [ $SECONDS -lt $until ]; do
        local batch=()
        for s in 1 2 3 4; do
            turns=$((RANDOM % 6 + 1)); session=$((RANDOM % 48))
            text=$(printf "session %s (%s): tell me more about routing and caches, turn %%s. " "$session" "$(printf '%s' "$session" | sha256sum | cut -c1-48)")
            msgs=$(for t in $(seq "$turns"); do printf '{"role":"user","content":"'"$text"'"},' "$t"; done)
            curl -fs -o /dev/null "$url/v1/chat/completions" -H 'content-type: application/json' \
                -d '{"model":"mock","max_tokens":16,"messages":['"${msgs%,}"']}' &
            batch+=($!)
        done
        wait "${batch[@]}" || true
    done
}

traffic 20
curl -fs -X PUT "$ep/policy?builtin=round-robin" "${auth[@]}" >/dev/null
traffic 15
curl -fs -X PUT "$ep/policy?builtin=kv-cost" "${auth[@]}" >/dev/null
curl -fs -X PUT "$ep/shadow?builtin=round-robin" "${auth[@]}" >/dev/null
traffic 30
shot() {
    chromium --headless --no-sandbox --disable-gpu --disable-dev-shm-usage --hide-scrollbars \
        --window-size=1400,"$2" --virtual-time-budget=3000 --screenshot="$out/$1" \
        "$url/admin/ui?token=$token" 2>/dev/null
    echo "wrote docs/$1"
}
shot admin-ui.png 900
curl -fs -X POST "$ep/shadow/promote" "${auth[@]}" >/dev/null
traffic 10
shot admin-ui-promoted.png 900
