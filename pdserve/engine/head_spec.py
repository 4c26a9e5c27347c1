"""The length head's file without torch: what a head predicts (`HeadSpec`) and the file
read as plain arrays, its names and shapes checked against its spec (`read_head_file`).

The front end reads a head's spec to count its predictions (predictor/confusion.py) and
reads the whole file once before any instance starts, so a missing or corrupt file stops
a start naming it; the instances load it as a module (`length_head.read_head`, from these
arrays) and check it against the served model. The file's layout is in length_head.py.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import numpy.typing as npt
from safetensors import SafetensorError, safe_open

from pdserve.errors import ModelLoadError
from pdserve.protocol.prediction import LengthPrediction

FORMAT = "pdserve-length-head/1"
NUM_PROBES = 16


@dataclass(frozen=True)
class HeadSpec:
    """What a head predicts and which model it reads."""

    granularity: int  # bucket width in output tokens
    num_buckets: int  # the last bucket is open-ended: >= (num_buckets - 1) * granularity
    hidden_size: int
    vocab_size: int
    architecture: str
    mlp_hidden: int = 0  # 0: a linear head (softmax regression); else one hidden layer
    model_name: str = ""

    def __post_init__(self) -> None:
        if self.granularity < 1 or self.num_buckets < 2:
            raise ValueError(
                f"a head needs granularity >= 1 and >= 2 buckets, got {self.granularity} "
                f"and {self.num_buckets}"
            )

    def bucket(self, num_tokens: int) -> int:
        return min(num_tokens // self.granularity, self.num_buckets - 1)

    def prediction(self, bucket: int) -> LengthPrediction:
        low = bucket * self.granularity
        high = None if bucket == self.num_buckets - 1 else low + self.granularity
        return LengthPrediction(bucket, low, high)


def head_shapes(spec: HeadSpec) -> dict[str, tuple[int, ...]]:
    """Every tensor a head of `spec` holds, by its `LengthHead.state_dict()` name: the
    feature standardization, the model probe, and one linear layer or two."""
    n_in = spec.hidden_size + 1
    shapes: dict[str, tuple[int, ...]] = {
        "mean": (n_in,),
        "std": (n_in,),
        "probe": (NUM_PROBES, spec.hidden_size),
    }
    if spec.mlp_hidden:
        layers = {"net.0": (spec.mlp_hidden, n_in), "net.2": (spec.num_buckets, spec.mlp_hidden)}
    else:
        layers = {"net": (spec.num_buckets, n_in)}
    for name, (rows, cols) in layers.items():
        shapes[f"{name}.weight"] = (rows, cols)
        shapes[f"{name}.bias"] = (rows,)
    return shapes


def read_head_file(path: str | Path) -> tuple[HeadSpec, dict[str, npt.NDArray[np.float32]]]:
    """The head in `path` as its spec and its tensors, unchecked against any model.
    ModelLoadError names the file and what is wrong with it."""
    p = Path(path)
    if not p.is_file():
        raise ModelLoadError(f"length predictor file {p} does not exist")
    try:
        with safe_open(str(p), framework="numpy") as f:
            meta = f.metadata() or {}
            arrays = {k: f.get_tensor(k) for k in f.keys()}  # noqa: SIM118 (not a dict)
    except (SafetensorError, OSError, ValueError) as e:
        raise ModelLoadError(f"length predictor file {p} is not a safetensors file: {e}") from e
    if meta.get("format") != FORMAT:
        raise ModelLoadError(
            f"length predictor file {p} has format {meta.get('format')!r}, expected {FORMAT!r}"
        )
    try:
        spec = HeadSpec(**json.loads(meta["spec"]))
    except (KeyError, TypeError, ValueError) as e:
        raise ModelLoadError(f"length predictor file {p} is corrupt: {e}") from e
    found = {k: tuple(v.shape) for k, v in arrays.items()}
    want = head_shapes(spec)
    if found != want or any(v.dtype != np.float32 for v in arrays.values()):
        dtypes = sorted({str(v.dtype) for v in arrays.values()})
        raise ModelLoadError(
            f"length predictor file {p} is corrupt: it holds {found} in {dtypes}, a head of "
            f"its spec holds {want} in float32"
        )
    return spec, arrays
