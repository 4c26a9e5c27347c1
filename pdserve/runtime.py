"""Process-level tuning shared by pdserve's long-running processes."""

from __future__ import annotations

import gc
import os


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


def pin_process(cpus: tuple[int, ...]) -> None:
    """Run this process on `cpus` only; a CPU it may not use is a ValueError naming
    the CPUs it may (the engine reports it as a start failure)."""
    count = os.cpu_count() or 1
    missing = sorted(c for c in set(cpus) if c >= count)
    if missing:
        raise ValueError(f"CPUs {missing} do not exist: this machine has CPUs 0-{count - 1}")
    try:
        os.sched_setaffinity(0, cpus)
    except OSError as e:
        raise ValueError(
            f"cannot run on CPUs {sorted(set(cpus))} ({e.strerror}); "
            f"this process may use {sorted(os.sched_getaffinity(0))}"
        ) from None
