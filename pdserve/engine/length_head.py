"""The output-length head: a small classifier on the served model's own prompt state.

TetriInfer (§3.3.2) fine-tunes a separate 125M model to predict the bucket of a
request's output length. Here the predictor reads what the instance computes anyway: the
final-norm hidden state of the prompt's last token (the row whose logits give the first
token), plus log(1 + prompt length). So a prediction costs one small matmul per first
token and no extra forward pass (TetriInfer's "parallel mode", for free).

The head file (safetensors) holds the head's tensors and, in its metadata, what it was
trained for: the bucket width (`granularity`) and count, the model's architecture, hidden
size and vocabulary size, and a probe: the model's embeddings of a few fixed token ids.
Loading checks all of it against the served model (`load_length_head`): a head trained
for another model reads a meaningless state, so it is refused with the file and the
mismatch named. The probe tolerates another quantization of the same weights (the cosine
similarity of the probe rows, taken together, >= PROBE_MIN_COSINE; a padding row of zeros
does not count), not another model.

The head lives here, beside the engine that loads and calls it (`EngineCore`); making
one (its data, training, the `pdserve predictor` command, the shipped heads) is
`pdserve/predictor/`, which runs the engine.
"""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from dataclasses import asdict
from pathlib import Path
from typing import TYPE_CHECKING

import torch
from torch import nn

from pdserve.engine.head_spec import FORMAT, NUM_PROBES, HeadSpec, read_head_file
from pdserve.errors import ModelLoadError
from pdserve.protocol.prediction import LengthPrediction

if TYPE_CHECKING:  # the front end reads head files without loading the model code
    from pdserve.model.base import CausalLM
    from pdserve.quant.linear import QuantEmbedding

PROBE_MIN_COSINE = 0.95


def probe_ids(vocab_size: int) -> list[int]:
    """Token ids whose embeddings identify a model (spread over the vocabulary)."""
    return sorted({round(i * (vocab_size - 1) / (NUM_PROBES - 1)) for i in range(NUM_PROBES)})


def features(hidden: torch.Tensor, prompt_lens: Sequence[int]) -> torch.Tensor:
    """[n, H] final hidden states + prompt lengths -> [n, H + 1] head inputs (float32)."""
    lens = torch.tensor([math.log1p(n) for n in prompt_lens], dtype=torch.float32)
    return torch.cat([hidden.float(), lens[:, None]], dim=1)


class LengthHead(nn.Module):
    """Standardized features -> (one hidden layer ->) bucket logits."""

    mean: torch.Tensor  # buffers: feature standardization, and the model probe
    std: torch.Tensor
    probe: torch.Tensor

    def __init__(self, spec: HeadSpec) -> None:
        super().__init__()
        self.spec = spec
        n_in = spec.hidden_size + 1
        self.register_buffer("mean", torch.zeros(n_in))
        self.register_buffer("std", torch.ones(n_in))
        self.register_buffer("probe", torch.zeros(NUM_PROBES, spec.hidden_size))
        if spec.mlp_hidden:
            self.net: nn.Module = nn.Sequential(
                nn.Linear(n_in, spec.mlp_hidden),
                nn.GELU(),
                nn.Linear(spec.mlp_hidden, spec.num_buckets),
            )
        else:
            self.net = nn.Linear(n_in, spec.num_buckets)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net((x - self.mean) / self.std)

    @torch.inference_mode()
    def predict(self, hidden: torch.Tensor, prompt_lens: Sequence[int]) -> list[LengthPrediction]:
        buckets = self(features(hidden, prompt_lens)).argmax(dim=1).tolist()
        return [self.spec.prediction(b) for b in buckets]

    def save(self, path: str | Path, trained: dict[str, object] | None = None) -> None:
        from safetensors.torch import save_file

        tensors = {k: v.detach().contiguous() for k, v in self.state_dict().items()}
        meta = {"format": FORMAT, "spec": json.dumps(asdict(self.spec))}
        if trained is not None:
            meta["trained"] = json.dumps(trained)
        save_file(tensors, str(path), metadata=meta)


def set_probe(head: LengthHead, embeddings: torch.Tensor | QuantEmbedding) -> None:
    """Record the model's identity: its embeddings of `probe_ids`."""
    ids = probe_ids(head.spec.vocab_size)
    probe = torch.zeros(NUM_PROBES, head.spec.hidden_size)
    probe[: len(ids)] = embeddings[ids].float()
    head.probe.copy_(probe)


def read_head(path: str | Path) -> LengthHead:
    """The head in `path`, unchecked against any model. ModelLoadError names the file and
    what is wrong with it (`read_head_file`)."""
    spec, arrays = read_head_file(path)
    head = LengthHead(spec)
    head.load_state_dict({k: torch.from_numpy(v) for k, v in arrays.items()})
    return head.eval()


def check_matches(
    head: LengthHead, path: str | Path, architecture: str, embeddings: torch.Tensor | QuantEmbedding
) -> None:
    """ModelLoadError unless `head` was trained for the model whose token embeddings are
    `embeddings` ([vocab, hidden]) and whose architecture is `architecture`."""
    spec = head.spec
    vocab, hidden = embeddings.shape
    where = f"length predictor file {path}"
    if (spec.vocab_size, spec.hidden_size) != (vocab, hidden):
        raise ModelLoadError(
            f"{where} was trained for a model with vocabulary {spec.vocab_size} and hidden "
            f"size {spec.hidden_size}; the served model has {vocab} and {hidden}"
        )
    if spec.architecture != architecture:
        raise ModelLoadError(
            f"{where} was trained for {spec.architecture}, the served model is {architecture}"
        )
    ids = probe_ids(vocab)
    probe = head.probe[: len(ids)].flatten()
    cos = nn.functional.cosine_similarity(probe, embeddings[ids].float().flatten(), dim=0)
    if float(cos) < PROBE_MIN_COSINE:
        raise ModelLoadError(
            f"{where} was trained for another model ({spec.model_name or 'unnamed'}): its "
            f"embedding probe matches the served model's with cosine {float(cos):.3f} "
            f"(at least {PROBE_MIN_COSINE} needed); train one with `pdserve predictor train`"
        )


def load_length_head(path: str | Path, model: CausalLM) -> LengthHead:
    """The head in `path`, checked against the served `model` (ModelLoadError if it is
    missing, corrupt, or trained for another model or vocabulary)."""
    head = read_head(path)
    check_matches(head, path, model.config.architecture, model.embed_tokens)
    return head
