#!/usr/bin/env bash
# Build llama.cpp's Python server (`llama-cpp-python[server]` from PyPI, compiled here
# from its source distribution: ~5 min on 2 cores) in its own venv. Idempotent.
#   LLAMACPP_VENV     venv to create (default /tmp/pdserve-peers/llamacpp-venv)
#   LLAMACPP_VERSION  pinned version (default 0.3.36, the one in shared/PEERS.md)
#   LLAMACPP_CMAKE_ARGS  extra CMake options for llama.cpp (default none; AMX is off, below)
set -euo pipefail

VENV="${LLAMACPP_VENV:-/tmp/pdserve-peers/llamacpp-venv}"
VERSION="${LLAMACPP_VERSION:-0.3.36}"
if [[ ! -x "$VENV/bin/python" ]]; then
  python3 -m venv "$VENV"
fi
PY="$VENV/bin/python"
# GGML_NATIVE (the default) builds for this CPU, as a user would, but without AMX: on an
# Intel Xeon VM here (stop 48) the native build's AMX matmul died at its first
# `ldtilecfg` (a general protection fault, at the first prompt), so the server answered
# nothing. GGML_NATIVE compiles with -march=native, which turns AMX on whatever the
# GGML_AMX_* options say; gcc's explicit -mno-amx-* flags win over -march, so they go in
# CFLAGS / CXXFLAGS where the CPU has AMX. Its AVX-512 VNNI kernels stay.
NO_AMX=""
if grep -q amx_tile /proc/cpuinfo 2>/dev/null; then
  NO_AMX="-mno-amx-tile -mno-amx-int8 -mno-amx-bf16"
fi
CMAKE_ARGS="${LLAMACPP_CMAKE_ARGS:-}"
STAMP="$VENV/.pdserve-build"
if [[ "$("$PY" -c 'import importlib.metadata as m; print(m.version("llama_cpp_python"))' 2>/dev/null)" != "$VERSION" ]] \
   || [[ "$(cat "$STAMP" 2>/dev/null)" != "$VERSION $CMAKE_ARGS $NO_AMX" ]]; then
  start=$(date +%s)
  CMAKE_ARGS="$CMAKE_ARGS" CFLAGS="${CFLAGS:-} $NO_AMX" CXXFLAGS="${CXXFLAGS:-} $NO_AMX" \
    "$PY" -m pip install -q --no-cache-dir --force-reinstall \
    "llama-cpp-python[server]==$VERSION"
  echo "$VERSION $CMAKE_ARGS $NO_AMX" > "$STAMP"
  echo "llama-cpp-python $VERSION built in $(( $(date +%s) - start )) s (flags: $CMAKE_ARGS $NO_AMX)"
fi
"$PY" -c 'import llama_cpp; print("llama_cpp", llama_cpp.__version__)'
