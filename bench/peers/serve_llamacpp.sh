#!/usr/bin/env bash
# llama.cpp's OpenAI server on 127.0.0.1:PORT (default 8200) over the shipped Q4_1 GGUF
# (read as it is), 2 threads, context 2048. Foreground (exec). The flags: the defaults
# cancel a running request when another arrives, and the SSE pings confuse vLLM's
# bench client (shared/PEERS.md).
set -euo pipefail
HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
REPO="$(cd "$HERE/../.." && pwd)"
PORT="${1:-8200}"
VENV="${LLAMACPP_VENV:-/tmp/pdserve-peers/llamacpp-venv}"
GGUF="$("$REPO/.venv/bin/python" -c 'from pdserve.model.default import default_model_path; print(default_model_path())')"
exec "$VENV/bin/python" -m llama_cpp.server --model "$GGUF" --host 127.0.0.1 --port "$PORT" \
  --n_threads 2 --n_ctx 2048 --interrupt_requests False --disable_ping_events True \
  --model_alias smollm2
