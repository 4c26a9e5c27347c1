"""Process-level tuning shared by pdserve's long-running processes."""

from __future__ import annotations

import gc
import os
import select
from collections.abc import Callable


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


# How long an OpenMP thread that waits (at a barrier, or for the next parallel region)
# spins before it sleeps, unless the user chose (see `quiet_openmp_waits`): 10,000
# PAUSEs, ~1 ms on an Intel Xeon whose PAUSE takes ~100 ns (family 6 model 207). libgomp's
# default, 300,000 (~30 ms there), is far longer than a scheduler time slice; none at all
# (OMP_WAIT_POLICY=PASSIVE) wakes sleeping threads for every parallel region, which cost
# an idle machine's b=1 decode 1.1x (quantized) to 1.4x (fp32) (docs/benchmarks.md).
OPENMP_WAIT_ENV = {"GOMP_SPINCOUNT": "10000"}


def quiet_openmp_waits() -> None:
    """Make the OpenMP threads of this process (and of the processes it starts) spin ~1
    ms when they wait, then sleep - unless OMP_WAIT_POLICY or GOMP_SPINCOUNT is set
    already: that is the user's choice (OMP_WAIT_POLICY=PASSIVE sleeps at once,
    OMP_WAIT_POLICY=ACTIVE spins for good).

    Why: torch's intra-op threads and the compiled kernels share one libgomp team, and
    a decode step meets a few hundred of its barriers (~6 per layer). While another
    process takes a core, the thread that shares it runs only part of the time; a thread
    spinning at a barrier holds its own core without doing anything, where a sleeping
    one lets the scheduler move the late thread onto it. Spinning ~1 ms keeps the team
    awake between the regions of a step on an idle machine (as fast as libgomp's
    default there) and gives the core up within a millisecond when another process
    needs one (docs/engine.md).

    libgomp reads the environment once, when it loads (with torch), so this must run
    before `import torch`: pdserve/engine/__init__.py calls it, which every engine module
    import runs first, and so do the fork server's start and `pdserve generate` (whose
    device check may load torch before the engine). A process that loaded torch
    already keeps its waits but still passes the setting on to the processes it starts."""
    if "OMP_WAIT_POLICY" in os.environ or "GOMP_SPINCOUNT" in os.environ:
        return
    os.environ.update(OPENMP_WAIT_ENV)


def ended(pid: int) -> Callable[[], bool]:
    """A check, cheap enough for every step, that process `pid` has ended: the one an
    engine serves (the front end), which need not be its parent (a forked instance's is
    the fork server, which lives as long as any instance does). A pidfd where the
    kernel has them (Linux 5.3+: no pid reuse to mistake), else the parent changing,
    which holds where `pid` is the parent."""
    try:
        fd = os.pidfd_open(pid)
    except ProcessLookupError:
        return lambda: True
    except (AttributeError, OSError):
        return lambda: os.getppid() != pid
    watch = select.poll()
    watch.register(fd, select.POLLIN)  # readable once the process has exited
    return lambda: bool(watch.poll(0))
