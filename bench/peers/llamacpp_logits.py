"""llama.cpp's own computation of given token ids, for bench/bench_quant_accuracy.py: run
with the python of the llama-cpp-python venv (bench/peers/setup_llamacpp.sh), which
pdserve's venv does not have.

    $LLAMACPP_VENV/bin/python bench/peers/llamacpp_logits.py < request.json > answer.json

request: {"gguf": PATH, "ppl_ids": [ids], "prompts": [[ids], ...], "num_tokens": N}
answer:  {"perplexity": float, "greedy": [[N ids], ...], "version": str}

The ids go in as they are (no BOS added, no tokenization here), so llama.cpp sees exactly
the tokens pdserve saw. Perplexity: one evaluation of `ppl_ids` with every position's
logits kept, exp(mean NLL of each token given those before it). Greedy: the argmax of
each step's logits, N tokens, end-of-sequence not stopping it (pdserve's ignore_eos).
The KV cache is llama.cpp's default, fp16, as pdserve's under quantized weights.
"""

from __future__ import annotations

import json
import sys

import llama_cpp
import numpy as np


def main() -> None:
    req = json.load(sys.stdin)
    ppl_ids: list[int] = req["ppl_ids"]
    n_ctx = max(len(ppl_ids), max(len(p) for p in req["prompts"]) + req["num_tokens"]) + 16
    llm = llama_cpp.Llama(
        model_path=req["gguf"], n_ctx=n_ctx, n_batch=512, n_threads=2, logits_all=True,
        verbose=False,
    )  # fmt: skip
    llm.reset()
    llm.eval(ppl_ids)
    logits = np.asarray(llm.scores[: len(ppl_ids) - 1], dtype=np.float64)
    top = logits.max(axis=1, keepdims=True)
    lse = np.log(np.exp(logits - top).sum(axis=1)) + top[:, 0]
    nll = lse - logits[np.arange(len(ppl_ids) - 1), ppl_ids[1:]]
    greedy = []
    for prompt in req["prompts"]:
        llm.reset()
        llm.eval(prompt)
        out: list[int] = []
        while len(out) < req["num_tokens"]:
            token = int(np.argmax(llm.scores[llm.n_tokens - 1]))
            out.append(token)
            llm.eval([token])
        greedy.append(out)
    answer = {"perplexity": float(np.exp(nll.mean())), "greedy": greedy}
    json.dump({**answer, "version": llama_cpp.__version__}, sys.stdout)


if __name__ == "__main__":
    main()
