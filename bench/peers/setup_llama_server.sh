#!/usr/bin/env bash
# Build llama.cpp's own C++ server, `llama-server` (continuous batching over parallel
# slots: what llama.cpp users run), from the llama.cpp source that the `llama-cpp-python`
# sdist carries (no registry ships the binary; shared/PEERS.md). 10-20 min on 2 cores the
# first time; idempotent (a built binary of the same version and flags is kept).
#   LLAMA_SERVER_DIR   where the source and the build go (default /tmp/pdserve-peers/llama-server)
#   LLAMACPP_VERSION   the llama-cpp-python sdist (default 0.3.36, the one in shared/PEERS.md)
# Prints the binary's path last.
set -euo pipefail

ROOT="${LLAMA_SERVER_DIR:-/tmp/pdserve-peers/llama-server}"
VERSION="${LLAMACPP_VERSION:-0.3.36}"
SRC="$ROOT/llama_cpp_python-$VERSION/vendor/llama.cpp"
BIN="$SRC/build/bin/llama-server"
# As setup_llamacpp.sh: the native build, but without AMX (its matmul died at its first
# `ldtilecfg` on an Intel Xeon VM here); gcc's -mno-amx-* win over -march=native.
NO_AMX=""
if grep -q amx_tile /proc/cpuinfo 2>/dev/null; then
  NO_AMX="-mno-amx-tile -mno-amx-int8 -mno-amx-bf16"
fi
STAMP="$ROOT/.pdserve-build"
if [[ ! -x "$BIN" ]] || [[ "$(cat "$STAMP" 2>/dev/null)" != "$VERSION $NO_AMX" ]]; then
  start=$(date +%s)
  mkdir -p "$ROOT"
  if [[ ! -d "$SRC" ]]; then
    python3 -m pip download -q --no-deps --no-binary :all: "llama-cpp-python==$VERSION" -d "$ROOT"
    tar xzf "$ROOT/llama_cpp_python-$VERSION.tar.gz" -C "$ROOT"
  fi
  CFLAGS="${CFLAGS:-} $NO_AMX" CXXFLAGS="${CXXFLAGS:-} $NO_AMX" cmake -S "$SRC" -B "$SRC/build" \
    -G Ninja -DCMAKE_BUILD_TYPE=Release -DLLAMA_CURL=OFF -DGGML_NATIVE=ON \
    -DLLAMA_BUILD_SERVER=ON -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF > /dev/null
  cmake --build "$SRC/build" --target llama-server -j2 > "$ROOT/build.log"
  echo "$VERSION $NO_AMX" > "$STAMP"
  echo "llama-server (llama-cpp-python $VERSION's llama.cpp) built in $(( $(date +%s) - start )) s" >&2
fi
echo "$BIN"
