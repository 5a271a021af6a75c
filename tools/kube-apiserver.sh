#!/usr/bin/env bash
# A real Kubernetes API server for the Kubernetes discovery tests. No package ships
# one, so it is built from Debian's source package `kubernetes` (bookworm) with Debian's
# Go, `cmd/kube-apiserver` only, and cached by version under HOME (default
# $SWITCHYARD_KUBE_HOME, else ~/.cache/switchyard/kube-apiserver): built on first use
# (~3-10 minutes on 2 cores), then only checked. The source comes through a private
# sources list (deb-src, Debian's own mirror), so the system's apt configuration is
# left as it is. One fix: the vendored modern-go/reflect2 1.0.1 crashes under Go >= 1.18
# (`fatal error: fault` in UnsafeIterate); Debian's 1.0.2 replaces it. Prints the
# binary's path.
#
#   tools/kube-apiserver.sh [HOME]
set -euo pipefail
home=${1:-${SWITCHYARD_KUBE_HOME:-$HOME/.cache/switchyard/kube-apiserver}}
link=$home/kube-apiserver
if [ -x "$link" ] && "$link" --version >/dev/null 2>&1; then
    readlink -f "$link"
    exit 0
fi

as_root() { if [ "$(id -u)" = 0 ]; then "$@"; else sudo "$@"; fi; }
need=()
command -v go >/dev/null || need+=(golang-go)
[ -f /usr/share/gocode/src/github.com/modern-go/reflect2/reflect2.go ] ||
    need+=(golang-github-modern-go-reflect2-dev)
if [ "${#need[@]}" -gt 0 ]; then
    export DEBIAN_FRONTEND=noninteractive
    as_root apt-get update -q >&2
    as_root apt-get install -y -q --no-install-recommends "${need[@]}" >&2
fi

work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
mkdir -p "$work/lists/partial" "$work/src"
echo "deb-src http://deb.debian.org/debian bookworm main" > "$work/sources.list"
apt_src=(-o "Dir::Etc::sourcelist=$work/sources.list" -o Dir::Etc::sourceparts=-
    -o "Dir::State::Lists=$work/lists" -o APT::Get::List-Cleanup=0)
apt-get "${apt_src[@]}" -q update >&2
(cd "$work/src" && apt-get "${apt_src[@]}" -q --download-only source kubernetes >&2)
dsc=$(ls "$work"/src/kubernetes_*.dsc)
version=$(sed -n 's/^Version: //p' "$dsc")
echo "building kube-apiserver from Debian's kubernetes $version into $home" >&2
tar xzf "$work"/src/kubernetes_*.orig.tar.gz -C "$work/src"
tree=$(ls -d "$work"/src/kubernetes-*/)
tree=${tree%/}
rm -rf "$tree/vendor/github.com/modern-go/reflect2"
cp -r /usr/share/gocode/src/github.com/modern-go/reflect2 "$tree/vendor/github.com/modern-go/"
# GOPATH mode, as the release's own build (hack/) does: the staging repositories are
# reached through vendor/'s links.
mkdir -p "$work/gopath/src/k8s.io" "$home/$version"
ln -s "$tree" "$work/gopath/src/k8s.io/kubernetes"
cd "$work/gopath/src/k8s.io/kubernetes"
export GOPATH="$work/gopath" GO111MODULE=off GOCACHE="$work/gocache" CGO_ENABLED=0
# The release's `make generated_files` writes pkg/generated/openapi, the one generated
# file the source leaves out: openapi-gen over every package tagged +k8s:openapi-gen
# (staging's under their vendor/ names; code-generator's and sample-apiserver's left
# out, as build/root/Makefile.generated_files does).
go build -o "$work/openapi-gen" ./vendor/k8s.io/kube-openapi/cmd/openapi-gen
inputs=$(find -H . \( -path './_*' -o -path './.*' -o -path ./vendor \) -prune -o \
        -type f -name '*.go' -print |
    sed 's|^./staging/src|vendor|; s|/[^/]*$||; s|^./||' | LC_ALL=C sort -u |
    while read -r dir; do find "$dir" -maxdepth 1 -type f -name '*.go'; done |
    xargs grep -l '^// *+k8s:' |
    grep -v '^vendor/k8s.io/code-generator/\|^vendor/k8s.io/sample-apiserver/' |
    xargs grep -l '+k8s:openapi-gen=' | xargs -n1 dirname | LC_ALL=C sort -u |
    sed 's|^|k8s.io/kubernetes/|' | paste -sd, -)
"$work/openapi-gen" -i "$inputs" -p k8s.io/kubernetes/pkg/generated/openapi \
    -O zz_generated.openapi -h hack/boilerplate/boilerplate.generatego.txt \
    -r "$work/api-rule-violations" >&2
go build -o "$home/$version/kube-apiserver" ./cmd/kube-apiserver
cd - >/dev/null
ln -sfn "$version/kube-apiserver" "$link"
"$link" --version >&2
readlink -f "$link"
