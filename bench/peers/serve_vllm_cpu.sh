#!/usr/bin/env bash
# Serve the HF folder with vLLM CPU's OpenAI server (foreground; Ctrl-C or kill
# the process group to stop). Usage: serve_vllm_cpu.sh [PORT]  (default 8100)
# Ready after ~2 min (torch.compile + warm-up): poll http://127.0.0.1:PORT/health.
set -euo pipefail

PORT="${1:-8100}"
VENV="${VLLM_VENV:-/tmp/pdserve-peers/vllm-venv}"
HF_DIR="${VLLM_HF_DIR:-/tmp/pdserve-peers/smollm2-hf}"

# 4 GiB of KV cache is plenty for a 135M model (fp32 KV = 45 KiB/token).
export VLLM_CPU_KVCACHE_SPACE="${VLLM_CPU_KVCACHE_SPACE:-4}"
# Left alone vLLM CPU gives torch one thread; bind both cores.
export VLLM_CPU_OMP_THREADS_BIND="${VLLM_CPU_OMP_THREADS_BIND:-0-1}"
export OMP_NUM_THREADS="${OMP_NUM_THREADS:-2}"
# No hub access here: everything comes from the local folder.
export HF_HUB_OFFLINE=1

# `python -m ...api_server` rather than `vllm serve`: the `vllm` entry point
# fails because the distribution is named vllm-cpu (see vllm_bench.py).
exec "$VENV/bin/python" -m vllm.entrypoints.openai.api_server \
  --model "$HF_DIR" --served-model-name smollm2 \
  --host 127.0.0.1 --port "$PORT" \
  --max-model-len 2048 --dtype float32
