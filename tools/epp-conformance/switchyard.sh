#!/usr/bin/env bash
# The endpoint-picker conformance suite's adapter for Switchyard (tests/epp_conformance.rs,
# run by tools/epp-conformance.sh): serves the ext_proc service and gRPC health on
# 127.0.0.1:PORT, picking among the ENDPOINTs (host:port) for the model `mock`.
#
#   switchyard.sh PORT ENDPOINT...
#
# The suite sets: EPP_CONFORMANCE_FALLBACKS (other endpoints to name after each pick: 0
# for a gateway reading one endpoint), EPP_CONFORMANCE_SHED=1 (shed what a one-endpoint
# pool cannot take: here one request running and one waiting, then 429). SWITCHYARD_BIN
# is the binary (default: this checkout's debug build). An adapter for another picker
# takes the same arguments and serves the same port; it must exec the picker (the suite
# stops it by its PID).
set -euo pipefail

port=$1
shift
bin=${SWITCHYARD_BIN:-$(cd "$(dirname "$0")/../.." && pwd)/target/debug/switchyard}
args=(serve --model mock --listen 127.0.0.1:0 --epp-listen "127.0.0.1:$port"
    --epp-fallbacks "${EPP_CONFORMANCE_FALLBACKS:-0}" --epp-report-served true)
for endpoint in "$@"; do
    args+=(--worker "http://$endpoint")
done
if [ "${EPP_CONFORMANCE_SHED:-0}" = 1 ]; then
    args+=(--saturation-max-in-flight 1 --queue-max 1)
fi
exec "$bin" "${args[@]}"
