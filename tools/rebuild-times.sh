#!/usr/bin/env bash
# Incremental rebuild time of the `switchyard` binary (debug) after a one-line change in
# each given source file: the line is added, the binary rebuilt and timed, the line taken
# out again and the binary rebuilt untimed. Run it on a quiet machine: builds share cores.
#
#   tools/rebuild-times.sh host/server/src/proxy.rs host/policy/src/engine.rs ...
set -euo pipefail
cd "$(dirname "$0")/.."
cargo build --quiet --bin switchyard
for file in "$@"; do
    cp "$file" "$file.orig"
    trap 'mv "$file.orig" "$file"' EXIT
    echo "const _REBUILD_PROBE: u32 = $RANDOM;" >>"$file"
    start=$(date +%s.%N)
    cargo build --quiet --bin switchyard
    end=$(date +%s.%N)
    mv "$file.orig" "$file"
    trap - EXIT
    printf '%-45s %6.1f s\n' "$file" "$(awk "BEGIN{print $end - $start}")"
    cargo build --quiet --bin switchyard
done
