#!/usr/bin/env bash
# Build llama.cpp's Python server (`llama-cpp-python[server]` from PyPI, compiled here
# from its source distribution: ~5 min on 2 cores) in its own venv. Idempotent.
#   LLAMACPP_VENV     venv to create (default /tmp/pdserve-peers/llamacpp-venv)
#   LLAMACPP_VERSION  pinned version (default 0.3.36, the one in shared/PEERS.md)
set -euo pipefail

VENV="${LLAMACPP_VENV:-/tmp/pdserve-peers/llamacpp-venv}"
VERSION="${LLAMACPP_VERSION:-0.3.36}"
if [[ ! -x "$VENV/bin/python" ]]; then
  python3 -m venv "$VENV"
fi
PY="$VENV/bin/python"
if [[ "$("$PY" -c 'import importlib.metadata as m; print(m.version("llama_cpp_python"))' 2>/dev/null)" != "$VERSION" ]]; then
  start=$(date +%s)
  # GGML_NATIVE (the default) builds for this CPU (AVX2/FMA/F16C here), as a user would.
  "$PY" -m pip install -q "llama-cpp-python[server]==$VERSION"
  echo "llama-cpp-python $VERSION built in $(( $(date +%s) - start )) s"
fi
"$PY" -c 'import llama_cpp; print("llama_cpp", llama_cpp.__version__)'
