#!/usr/bin/env bash
# Fetch llama.cpp from PyPI (the llama-cpp-python sdist vendors it), verify its checksum,
# build libggml-base and the stock tools CPU-only, and link the result at third_party/llama.cpp.
#
# The download and the build live in a cache outside the clone
# (${VOODOO_CACHE_DIR:-${XDG_CACHE_HOME:-$HOME/.cache}/voodoo_quant}), keyed by the pinned version
# and checksum, so a fresh clone reuses a finished build in seconds.
#
# Usage: scripts/bootstrap-llama.sh [PYTHON]   (PYTHON: the interpreter whose pip downloads)
set -euo pipefail

here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
root="$(dirname "$here")"
# shellcheck source=llama_cpp.pin
source "$here/llama_cpp.pin"
py="${1:-python3}"
jobs="${JOBS:-$(nproc 2>/dev/null || echo 2)}"

cache_root="${VOODOO_CACHE_DIR:-${XDG_CACHE_HOME:-$HOME/.cache}/voodoo_quant}"
key="llama.cpp-${LLAMA_CPP_PY_VERSION}-${LLAMA_CPP_PY_SHA256:0:12}"
cache="$cache_root/$key"
tarball="$cache_root/downloads/llama_cpp_python-${LLAMA_CPP_PY_VERSION}.tar.gz"
tools=(llama-quantize llama-perplexity llama-imatrix llama-completion)
stamp="$cache/.built"
stamp_text="version=$LLAMA_CPP_PY_VERSION sha256=$LLAMA_CPP_PY_SHA256 targets=ggml-base ${tools[*]}"

say()  { printf '[bootstrap] %s\n' "$*"; }
fail() { printf '[bootstrap] ERROR: %s\n' "$*" >&2; exit 1; }

# Run a noisy step with its output in a log; show only the tail of the log when it fails.
step() {
  local log="$1"; shift
  if ! "$@" >"$log" 2>&1; then
    printf '[bootstrap] ERROR: step failed: %s\n' "$*" >&2
    printf '[bootstrap] last lines of %s:\n' "$log" >&2
    tail -n 20 "$log" | sed 's/^/    /' >&2
    exit 1
  fi
}

sha_ok() { [ -f "$1" ] && [ "$(sha256sum "$1" | cut -d' ' -f1)" = "$LLAMA_CPP_PY_SHA256" ]; }

link_third_party() {
  mkdir -p "$root/third_party"
  ln -sfn "$cache/llama.cpp" "$root/third_party/llama.cpp"
}

if [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$stamp_text" ] && [ -d "$cache/llama.cpp/build/bin" ]; then
  link_third_party
  say "llama.cpp $LLAMA_CPP_PY_VERSION already built in $cache (cached); linked at third_party/llama.cpp"
  exit 0
fi

mkdir -p "$cache_root/downloads"
if sha_ok "$tarball"; then
  say "using cached download $tarball (sha256 ok)"
else
  say "downloading llama-cpp-python==$LLAMA_CPP_PY_VERSION sdist from PyPI (~77 MB)"
  tmpdl="$(mktemp -d "$cache_root/downloads/tmp.XXXXXX")"
  step "$cache_root/downloads/pip.log" "$py" -m pip download --no-deps --no-binary :all: \
        -d "$tmpdl" "llama-cpp-python==$LLAMA_CPP_PY_VERSION"
  got="$tmpdl/llama_cpp_python-${LLAMA_CPP_PY_VERSION}.tar.gz"
  sha_ok "$got" || fail "checksum mismatch for $got (expected $LLAMA_CPP_PY_SHA256); refusing to build it"
  mv -f "$got" "$tarball"
  rm -rf "$tmpdl"
fi

say "extracting vendor/llama.cpp into $cache"
rm -rf "$cache"
mkdir -p "$cache/tmp"
step "$cache/extract.log" tar -xzf "$tarball" -C "$cache/tmp" "llama_cpp_python-${LLAMA_CPP_PY_VERSION}/vendor/llama.cpp"
mv "$cache/tmp/llama_cpp_python-${LLAMA_CPP_PY_VERSION}/vendor/llama.cpp" "$cache/llama.cpp"
rm -rf "$cache/tmp"

src="$cache/llama.cpp"
say "configuring (CPU only, shared libs, no -march): log in $cache/cmake-configure.log"
step "$cache/cmake-configure.log" cmake -S "$src" -B "$src/build" \
  -DBUILD_SHARED_LIBS=ON -DGGML_NATIVE=OFF -DLLAMA_CURL=OFF -DGGML_CUDA=OFF \
  -DCMAKE_BUILD_TYPE=Release -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_SERVER=OFF
say "building libggml-base (~15 s)"
step "$cache/cmake-build-ggml.log" cmake --build "$src/build" --target ggml-base -j "$jobs"
say "building ${tools[*]} (~5 min at -j2): log in $cache/cmake-build-tools.log"
step "$cache/cmake-build-tools.log" cmake --build "$src/build" --target "${tools[@]}" -j "$jobs"
for t in "${tools[@]}"; do
  [ -x "$src/build/bin/$t" ] || fail "build finished but $src/build/bin/$t is missing"
done
printf '%s' "$stamp_text" > "$stamp"
link_third_party
say "llama.cpp $LLAMA_CPP_PY_VERSION built; linked at third_party/llama.cpp"
