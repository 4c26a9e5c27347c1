"""Resume from replica vs recompute, extrapolated with the planner's latency model.

For a request holding `--context` tokens when its decode instance dies, DéjàVu's two
ways back cost (`pdserve/cluster/replication.py` `RecoveryCost`, here priced from the
planner instead of live measurements):

- recompute: the prefill of every token on the new instance (`StepCost.prefill_time`
  of the model on the device's datasheet profile, `pdserve/planner/hardware.py`);
- replica: copying the KV from the holder's host memory into device memory over
  `--copy-gbps` (PCIe 4 x16 ~ 25 GB/s reached; DéjàVu keeps replicas in CPU memory),
  plus one decode step that recomputes the last token.

    .venv/bin/python bench/recovery_model.py --context 1100 --context 4096

Only the planner's estimates: no device is used. The figures measured on this machine
are bench/bench_recovery.py's.
"""

from __future__ import annotations

import argparse

from pdserve.planner.hardware import datasheet_profile
from pdserve.planner.latency import step_cost
from pdserve.planner.model_spec import ModelSpec, resolve_model_spec

GB = 1e9


def row(spec: ModelSpec, device: str, context: int, copy_bps: float) -> tuple[float, float]:
    cost = step_cost(spec, datasheet_profile(device).coefficients)
    recompute = cost.prefill_time([context])
    replica = context * spec.kv_bytes_per_token / copy_bps + cost.decode_time(1, context)
    return recompute, replica


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--context", type=int, action="append", help="tokens held (repeatable)")
    p.add_argument("--models", default="llama-2-7b,opt-13b,smollm2")
    p.add_argument("--devices", default="a100,h100")
    p.add_argument("--copy-gbps", type=float, default=25.0)
    args = p.parse_args()
    contexts = args.context or [1100, 4096]
    print("| model | device | context | recompute (ms) | replica copy + 1 step (ms) | ratio |")
    print("|---|---|---:|---:|---:|---:|")
    for name in args.models.split(","):
        spec = resolve_model_spec(None if name == "smollm2" else name, dtype_bytes=2)
        for device in args.devices.split(","):
            for n in contexts:
                recompute, replica = row(spec, device, n, args.copy_gbps * GB)
                print(
                    f"| {spec.name} | {device} | {n} | {recompute * 1e3:.1f} | "
                    f"{replica * 1e3:.1f} | {recompute / replica:.1f}x |"
                )


if __name__ == "__main__":
    main()
