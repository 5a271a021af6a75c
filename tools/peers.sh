#!/usr/bin/env bash
# The routers Switchyard is compared with, from PyPI, into a virtualenv outside the
# repository (installed only when missing): sglang-router, SMG and vllm-router.
#
#   tools/peers.sh [VENV]      VENV: $SWITCHYARD_PEERS_VENV, else ~/.cache/switchyard/peers
set -euo pipefail

venv=${1:-${SWITCHYARD_PEERS_VENV:-$HOME/.cache/switchyard/peers}}
if [ ! -x "$venv/bin/smg" ] || [ ! -x "$venv/bin/vllm-router" ] \
    || ! "$venv/bin/python" -c 'import sglang_router' 2>/dev/null; then
    echo "installing the peers into $venv" >&2
    python3 -m venv "$venv"
    "$venv/bin/pip" install --quiet sglang-router==0.3.2 smg==1.13.0 vllm-router==0.1.17
fi
