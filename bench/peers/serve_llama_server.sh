#!/usr/bin/env bash
# llama.cpp's C++ server on 127.0.0.1:PORT (default 8200) over the shipped Q4_1 GGUF as
# it is: 2 threads, parallel slots with continuous batching, served name `smollm2`.
# Foreground (exec). Build it first: bench/peers/setup_llama_server.sh.
#   LLAMA_SERVER_SLOTS  parallel slots (default 16)
#   LLAMA_SERVER_CTX    context of all slots together (default 1,024 a slot)
# vLLM's bench client must drop its `x-request-id` header for this server
# (PDSERVE_BENCH_NO_REQUEST_ID=1 with bench/peers/vllm_bench.py).
set -euo pipefail
HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
REPO="$(cd "$HERE/../.." && pwd)"
PORT="${1:-8200}"
SLOTS="${LLAMA_SERVER_SLOTS:-16}"
CTX="${LLAMA_SERVER_CTX:-$((SLOTS * 1024))}"
BIN="$(bash "$HERE/setup_llama_server.sh")"
GGUF="$("$REPO/.venv/bin/python" -c 'from pdserve.model.default import default_model_path; print(default_model_path())')"
exec "$BIN" -m "$GGUF" --host 127.0.0.1 --port "$PORT" -t 2 -c "$CTX" -np "$SLOTS" \
  --alias smollm2
