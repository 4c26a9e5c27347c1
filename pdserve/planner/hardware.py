"""Hardware profiles (latency coefficients of one device) and cluster descriptions.

A profile is a JSON file:

    {"name": "a100-80gb", "kind": "estimate" | "measured",
     "coefficients": {"c1": ..., ..., "c6": ...},
     "device_memory_gb": 80, "tp_bandwidth_gbps": ..., "tp_latency_s": ...,
     "source": "how the numbers were obtained", "fit": {...} (measured only)}

`measured` profiles come from `pdserve profile` (engine steps timed on this machine
and fitted by least squares). `estimate` profiles are derived from a datasheet's
peak FLOP/s and memory bandwidth with the efficiency factors stated in
`DATASHEETS`; every planner output that uses one says so.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from pdserve.planner.latency import Coefficients, Interconnect
from pdserve.planner.model_spec import PlanInputError

GB = 1e9


@dataclass(frozen=True)
class Datasheet:
    peak_flops: float  # dense fp16/bf16 tensor FLOP/s
    memory_bandwidth: float  # bytes/s
    memory_bytes: float
    link_bandwidth: float  # intra-node (NVLink) bytes/s per direction
    source: str


# Vendor datasheets (SXM parts, dense fp16 tensor-core peak, no sparsity).
DATASHEETS: dict[str, Datasheet] = {
    "v100-32gb": Datasheet(125e12, 900e9, 32 * GB, 150e9, "NVIDIA V100 SXM2 datasheet"),
    "a100-40gb": Datasheet(312e12, 1555e9, 40 * GB, 300e9, "NVIDIA A100 datasheet (SXM4 40GB)"),
    "a100-80gb": Datasheet(312e12, 2039e9, 80 * GB, 300e9, "NVIDIA A100 datasheet (SXM4 80GB)"),
    "h100-80gb": Datasheet(989e12, 3350e9, 80 * GB, 450e9, "NVIDIA H100 datasheet (SXM5)"),
    "h200-141gb": Datasheet(989e12, 4800e9, 141 * GB, 450e9, "NVIDIA H200 datasheet (SXM)"),
}
ALIASES = {"a100": "a100-80gb", "h100": "h100-80gb", "h200": "h200-141gb", "v100": "v100-32gb"}

# Efficiency factors applied to datasheet peaks (estimates, stated in every output):
GEMM_EFFICIENCY = 0.6  # prefill GEMMs reach ~60% of tensor peak (typical measured MFU)
ATTENTION_EFFICIENCY = 0.4  # FlashAttention-2 prefill reaches ~40% of peak at fp16
WEIGHT_READ_EFFICIENCY = 0.8  # decode weight streaming reaches ~80% of HBM bandwidth
KV_READ_EFFICIENCY = 0.5  # paged-attention KV reads (small, scattered blocks) ~50%
STEP_OVERHEAD_S = 0.002  # scheduling, kernel launches, sampling per step (estimate)
LINK_EFFICIENCY = 0.7  # NCCL ring all-reduce bus bandwidth vs link peak
ALLREDUCE_LATENCY_S = 10e-6


@dataclass(frozen=True)
class HardwareProfile:
    name: str
    kind: str  # "measured" or "estimate"
    coefficients: Coefficients
    device_memory_bytes: float
    tp_bandwidth: float = 0.0  # bytes/s for all-reduce inside a node
    tp_latency_s: float = 0.0
    pp_latency_s: float = 0.0  # fixed cost of a stage-to-stage hand-off
    source: str = ""
    fit: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.kind not in ("measured", "estimate"):
            raise PlanInputError(f"profile {self.name!r}: kind must be measured or estimate")
        if not self.device_memory_bytes > 0:
            raise PlanInputError(f"profile {self.name!r}: device memory must be > 0")

    @property
    def is_estimate(self) -> bool:
        return self.kind == "estimate"

    @property
    def label(self) -> str:
        return f"{self.name} ({'datasheet estimate' if self.is_estimate else 'measured'})"

    @property
    def node_link(self) -> float:
        """Bytes/s between the devices of a node when a cluster description gives none:
        the profile's all-reduce link, else its memory bandwidth (1 / c4: one host)."""
        return self.tp_bandwidth or 1.0 / max(self.coefficients.c4, 1e-30)

    def interconnect(self, pp_bandwidth: float) -> Interconnect:
        return Interconnect(self.tp_bandwidth, self.tp_latency_s, pp_bandwidth, self.pp_latency_s)

    def to_dict(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "kind": self.kind,
            "coefficients": self.coefficients.to_dict(),
            "device_memory_gb": self.device_memory_bytes / GB,
            "tp_bandwidth_gbps": self.tp_bandwidth / GB,
            "tp_latency_s": self.tp_latency_s,
            "pp_latency_s": self.pp_latency_s,
            "source": self.source,
            "fit": self.fit,
        }

    @classmethod
    def from_dict(cls, d: Any, source: str) -> HardwareProfile:
        if not isinstance(d, dict):
            raise PlanInputError(f"{source}: a profile must be a JSON object")
        for key in ("name", "kind", "coefficients", "device_memory_gb"):
            if key not in d:
                raise PlanInputError(f"{source}: profile has no {key!r}")
        try:
            return cls(
                name=str(d["name"]),
                kind=str(d["kind"]),
                coefficients=Coefficients.from_dict(d["coefficients"], source),
                device_memory_bytes=float(d["device_memory_gb"]) * GB,
                tp_bandwidth=float(d.get("tp_bandwidth_gbps", 0.0)) * GB,
                tp_latency_s=float(d.get("tp_latency_s", 0.0)),
                pp_latency_s=float(d.get("pp_latency_s", 0.0)),
                source=str(d.get("source", "")),
                fit=dict(d.get("fit") or {}),
            )
        except (TypeError, ValueError) as e:
            if isinstance(e, PlanInputError):
                raise
            raise PlanInputError(f"{source}: malformed profile ({e})") from None

    def save(self, path: Path) -> None:
        path.write_text(json.dumps(self.to_dict(), indent=2) + "\n")


def datasheet_profile(device: str) -> HardwareProfile:
    """An estimated profile from a datasheet (see the efficiency factors above)."""
    key = ALIASES.get(device.lower(), device.lower())
    if key not in DATASHEETS:
        raise PlanInputError(
            f"unknown device {device!r}: datasheet profiles exist for "
            f"{', '.join(sorted(DATASHEETS))}; or pass a profile JSON from `pdserve profile`"
        )
    ds = DATASHEETS[key]
    coeffs = Coefficients(
        c1=1.0 / (ds.peak_flops * GEMM_EFFICIENCY),
        # prompt attention: 2 * q_size * units FLOPs (QK^T and PV, causal half of l^2 each)
        c2=2.0 / (ds.peak_flops * ATTENTION_EFFICIENCY),
        c3=STEP_OVERHEAD_S,
        c4=1.0 / (ds.memory_bandwidth * WEIGHT_READ_EFFICIENCY),
        c5=1.0 / (ds.memory_bandwidth * KV_READ_EFFICIENCY),
        c6=1.0 / (ds.peak_flops * GEMM_EFFICIENCY),
    )
    return HardwareProfile(
        name=key,
        kind="estimate",
        coefficients=coeffs,
        device_memory_bytes=ds.memory_bytes,
        tp_bandwidth=ds.link_bandwidth * LINK_EFFICIENCY,
        tp_latency_s=ALLREDUCE_LATENCY_S,
        source=(
            f"{ds.source}: {ds.peak_flops / 1e12:g} TFLOP/s, {ds.memory_bandwidth / GB:g} GB/s; "
            f"efficiency GEMM {GEMM_EFFICIENCY}, attention {ATTENTION_EFFICIENCY}, weight "
            f"reads {WEIGHT_READ_EFFICIENCY}, KV reads {KV_READ_EFFICIENCY}, step overhead "
            f"{STEP_OVERHEAD_S * 1e3:g} ms, links {LINK_EFFICIENCY}"
        ),
    )


def load_profile(name_or_path: str) -> HardwareProfile:
    """A datasheet device name (a100, h100, ...) or a profile JSON file."""
    path = Path(name_or_path)
    if path.suffix == ".json" or path.exists():
        try:
            d = json.loads(path.read_text())
        except OSError as e:
            raise PlanInputError(f"{path}: cannot read profile ({e.strerror})") from None
        except json.JSONDecodeError as e:
            raise PlanInputError(f"{path}: not valid JSON ({e})") from None
        return HardwareProfile.from_dict(d, str(path))
    return datasheet_profile(name_or_path)


# What a cluster description may leave out (`pdserve plan`'s defaults).
INTER_NODE_GBPS = 3.125  # 25 Gbps
MEMORY_UTILIZATION = 0.9


@dataclass(frozen=True)
class ClusterSpec:
    """Where instances can be placed (DistServe §4: nodes of M devices)."""

    nodes: int
    devices_per_node: int
    device_memory_bytes: float
    intra_node_bandwidth: float  # bytes/s between devices of a node (NVLink)
    inter_node_bandwidth: float  # bytes/s between nodes
    memory_utilization: float = MEMORY_UTILIZATION  # share of device memory the engine may use

    def __post_init__(self) -> None:
        if self.nodes < 1 or self.devices_per_node < 1:
            raise PlanInputError(
                f"cluster needs >= 1 node and >= 1 device per node, got {self.nodes} x "
                f"{self.devices_per_node}"
            )
        if not 0 < self.memory_utilization <= 1:
            raise PlanInputError("memory utilisation must be in (0, 1]")
        if self.intra_node_bandwidth <= 0 or self.inter_node_bandwidth <= 0:
            raise PlanInputError("link bandwidths must be > 0")

    @classmethod
    def one_node(cls, hw: HardwareProfile, devices: int) -> ClusterSpec:
        """One node of `devices` devices described from the profile alone, as `pdserve
        plan --nodes 1 --devices-per-node DEVICES` describes it."""
        return cls(1, devices, hw.device_memory_bytes, hw.node_link, INTER_NODE_GBPS * GB)

    @property
    def num_devices(self) -> int:
        return self.nodes * self.devices_per_node

    @property
    def usable_memory(self) -> float:
        return self.device_memory_bytes * self.memory_utilization
