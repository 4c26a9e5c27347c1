"""Process-level tuning shared by pdserve's long-running processes."""

from __future__ import annotations

import gc


def freeze_startup_heap() -> None:
    """Move everything allocated so far (torch, transformers, the model: ~10^6
    objects) out of the garbage collector's reach.

    Without it, a full collection scans those objects whenever the young
    generations overflow, a ~300 ms stall of the event loop or the step loop that
    showed up as a TTFT spike on the first burst of requests (bench/bench_server.py).
    They live as long as the process, so nothing is lost by never scanning them.
    """
    gc.collect()
    gc.freeze()
