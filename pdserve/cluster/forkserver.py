"""The fork server that local instance processes start from.

A spawned instance is a fresh interpreter that imports the engine (torch, the model
code: ~4 s on a 2-core machine) before it loads anything: once per instance, and only
once the front end, after its own imports (~4.5 s), asks for it. Instead `pdserve serve`
starts multiprocessing's fork server as soon as its flags are checked (`start`); the
server imports the engine's modules while the front end imports its own, and each
instance is then forked from it with them imported (2P2D: one import, not four).

Contract:
- The server only imports (`PRELOAD`), then freezes its heap (`FREEZE`); no torch op
  runs there, so no OpenMP thread pool exists to be lost across a fork (libgomp's does
  not survive one). Each instance sets its own threads after the fork, as a spawned
  one did.
- An instance takes the front end's environment as it is when the instance starts
  (`adopt_environment`, first thing), as a spawned one would have it. Libraries set
  variables in the front end meanwhile (torch's TORCHINDUCTOR_CACHE_DIR); what the
  preloaded modules read from the environment at import, they read in the server,
  from the front end's environment at `start`, right after the flags were checked.
- The server's OpenMP threads sleep when they wait (`runtime.quiet_openmp_waits`, set in
  the environment it starts with): libgomp reads it once, when torch loads, in the
  server; an instance's libgomp is the server's, forked.
- `call` runs a function in a child of the server (with the front end's environment),
  for work that needs the instances' modules: whether the compiled kernels load here
  (server/launch.py resolves `--quantization` so) and a GGUF tokenizer's first
  conversion, both of which import torch; so the front end's own process never does
  (where no fork server runs, `--ray`, it does them itself).
- Instances are children of the server, not of the front end (`pstree`: front end ->
  fork server -> instances); multiprocessing's process handle (pid, exit code, kill,
  join) works as for a spawned child. An instance watches the front end's pid, not its
  parent's (`runtime.ended`), and exits when the front end does, killed or not; the
  server lives while any instance does (each holds its liveness pipe, multiprocessing's
  way) and exits after the last.
"""

from __future__ import annotations

import multiprocessing
import os
import sys
from collections.abc import Callable
from concurrent.futures import ProcessPoolExecutor
from multiprocessing import forkserver
from multiprocessing.context import ForkServerContext, SpawnContext
from typing import TypeVar

from pdserve.runtime import quiet_openmp_waits

# What an instance imports: its entry point's module and the engine.
PRELOAD = ("pdserve.cluster.instance", "pdserve.engine.engine_process")
# Imported last: freezes the server's heap before any fork (its docstring says why).
FREEZE = "pdserve.cluster.forkserver_freeze"

_started = False


def start() -> bool:
    """Start the fork server now, its imports beside this process's; idempotent. False
    where there is no fork server (not POSIX) or it could not start (then `context()`
    gives spawn)."""
    global _started
    if _started:
        return True
    if "forkserver" not in multiprocessing.get_all_start_methods():
        return False
    quiet_openmp_waits()
    forkserver.set_forkserver_preload([*PRELOAD, *_main_imports(), FREEZE])
    try:
        forkserver.ensure_running()
    except OSError:
        return False
    _started = True
    return True


def context() -> ForkServerContext | SpawnContext:
    """Where the next instance process comes from: the fork server once `start` has run
    in this process, else spawn (an embedded cluster, e.g. a test's, that did not ask
    for the server)."""
    if _started:
        return multiprocessing.get_context("forkserver")
    return multiprocessing.get_context("spawn")


T = TypeVar("T")


def call(fn: Callable[..., T], *args: object) -> T:
    """`fn(*args)` in a process forked from the fork server (its preloaded modules
    imported, this process's environment adopted), and its result here, or its exception
    raised here; both must pickle. Where no fork server was started, in this process."""
    if not _started:
        return fn(*args)
    context = multiprocessing.get_context("forkserver")
    with ProcessPoolExecutor(1, mp_context=context) as pool:
        return pool.submit(_in_environment, dict(os.environ), fn, *args).result()


def _in_environment(environ: dict[str, str], fn: Callable[..., T], *args: object) -> T:
    adopt_environment(environ)
    return fn(*args)


def adopt_environment(environ: dict[str, str]) -> None:
    """In an instance process, before anything else: the environment of the process that
    asked for it, as it was then (what a spawned child has), not the fork server's."""
    if os.environ != environ:
        os.environ.clear()
        os.environ.update(environ)


def _main_imports() -> list[str]:
    """The pdserve modules this process has imported, but its main module: a child runs
    the main module again (as __mp_main__, multiprocessing's way), so what it imports is
    preloaded too; the module itself is not, as runpy warns when it was imported before."""
    main = getattr(sys.modules["__main__"].__spec__, "name", None)
    return [m for m in list(sys.modules) if m.startswith("pdserve.") and m != main]
