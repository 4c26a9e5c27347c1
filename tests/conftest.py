"""Shared fixtures: the shipped SmolLM2 loaded once per session, engines over it."""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import torch
from helpers.server import KEY, TEST_KV_GIB, Server, pdkv_segments, segments_left, stop

from pdserve.config import CacheConfig, EngineConfig, PreemptionMode, SchedulerConfig
from pdserve.engine.engine import Engine
from pdserve.model.base import CausalLM
from pdserve.model.loader import iter_weights
from pdserve.model.registry import build_model
from pdserve.model.source import load_config, resolve_model
from pdserve.model.tokenizer import CACHE_ENV, Tokenizer

torch.set_num_threads(2)


def pytest_configure(config: pytest.Config) -> None:
    """The suite's own tokenizer cache (pdserve/model/tokenizer.py), fresh each run and
    shared by every process the tests start: no test depends on the user's, or fills it."""
    os.environ[CACHE_ENV] = tempfile.mkdtemp(prefix="pdserve-test-cache-")


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter) -> None:
    """The order's seed, printed under -q too (pytest-randomly's header line is not):
    `-p randomly --randomly-seed=N` runs the same order again."""
    seed = getattr(terminalreporter.config.option, "randomly_seed", None)
    if seed is not None and terminalreporter.config.pluginmanager.hasplugin("randomly"):
        terminalreporter.write_line(f"test order: -p randomly --randomly-seed={seed}")


def pytest_unconfigure(config: pytest.Config) -> None:
    shutil.rmtree(os.environ.pop(CACHE_ENV, ""), ignore_errors=True)


# A test that uses one of these loads or serves the shipped model: what it asserts depends
# on how the model computes, the compiled kernels or the fp32 fallback (marked `fallback`).
FALLBACK_FIXTURES = frozenset({"smollm2", "served_engine", "exact_engine", "keyed_server"})


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Tests that use the shipped model through a fixture (FALLBACK_FIXTURES) are marked
    `fallback`: scripts/test.sh runs them again with the kernels off.

    With the kernels turned off on purpose (PDSERVE_NO_KERNELS=1) the tests of the
    compiled path itself (marked `kernels`) are deselected, and the header says so: the
    rest of the suite then runs the fallback path. Kernels missing for any other reason
    (a failed build) fail those tests instead: CI must not pass without them.

    Likewise the tests of `--activations int8` (marked `int8`) where `int8_blocker` says
    they cannot run (a CPU without AVX2, or a stubbed answer), and the comparison of the
    int8 kernels' two builds (marked `vnni`) on a CPU that has only one of them; the
    header says so."""
    from pdserve.kernels import DISABLE_ENV, unavailable_reason
    from pdserve.quant.linear import int8_blocker, int8_build

    for item in items:
        if FALLBACK_FIXTURES & set(getattr(item, "fixturenames", ())):
            item.add_marker(pytest.mark.fallback)
    why = unavailable_reason()
    if why is None:
        if blocker := int8_blocker():
            _deselect(config, items, "int8", f"int8 kernels off ({blocker})")
        elif (build := int8_build()) != "avx512-vnni":
            _deselect(config, items, "vnni", f"one int8 build here ({build}; no AVX-512 VNNI)")
        return
    if os.environ.get(DISABLE_ENV, "") not in ("", "0"):
        _deselect(config, items, "kernels", f"kernels off ({why})")


def _deselect(config: pytest.Config, items: list[pytest.Item], marker: str, why: str) -> None:
    out = [item for item in items if item.get_closest_marker(marker)]
    if out:
        config.hook.pytest_deselected(items=out)
        items[:] = [item for item in items if not item.get_closest_marker(marker)]
        print(f"\n{why}: {len(out)} tests deselected")


@pytest.fixture(scope="session")
def smollm2_path() -> Path:
    return resolve_model(None)


@pytest.fixture(scope="session")
def smollm2(smollm2_path: Path) -> tuple[CausalLM, Tokenizer]:
    model = build_model(load_config(smollm2_path))
    model.load_weights(iter_weights(smollm2_path))
    model.finalize()
    return model, Tokenizer.from_model_path(smollm2_path)


@pytest.fixture(scope="session")
def keyed_server() -> Iterator[Server]:
    """One colocated `pdserve serve` of the shipped model with its defaults but for
    `--activations fp32` (the exact path: its texts are HF transformers', which the
    OpenAI surface's tests spell out), an API key (`helpers.server.KEY`) and the debug
    endpoints, shared by every test that only sends it requests and leaves it as it
    found it (nothing running, queued or held): the OpenAI surface (test_server), the
    hardening tests, the benchmark tool's runs. A test that stops, kills or reconfigures
    a server starts its own. It waits for OpenMP as a user's server does (not as
    scripts/test.sh sets for the rest of the suite), and libgomp prints its settings
    where it loads (OMP_DISPLAY_ENV), for test_server to read."""
    env = {"OMP_DISPLAY_ENV": "VERBOSE", "OMP_WAIT_POLICY": None}
    # 0.5 GiB: the model's whole 8,192-token context fits its pool in fp32 too (the
    # fallback path's KV), as the context-limit tests expect.
    kv = ("--kv-cache-memory-gib", "0.5")
    exact = ("--activations", "fp32")
    server = Server("--api-key", KEY, "--enable-debug-endpoints", *exact, *kv, env=env)
    yield server
    stop(server)


@pytest.fixture(scope="session")
def served_engine() -> Engine:
    """An in-process engine with `pdserve serve`'s defaults over the shipped model: the
    independent reference the server tests compare texts with (helpers/reference.py).
    Each use must leave it idle (every request it added run to its end). Its KV pool is
    the test servers' (helpers/server.py): the pool's size changes no text."""
    cache = CacheConfig(kv_cache_memory_gib=float(TEST_KV_GIB))
    return Engine.from_config(EngineConfig(num_threads=2, cache=cache))


@pytest.fixture(scope="session")
def exact_engine() -> Engine:
    """`served_engine` with fp32 activations (`--activations fp32`): the reference of a
    deployment that serves them - any with a tensor-parallel instance, under the default
    `auto` (config.py `deployment_activations`). The same contract as `served_engine`."""
    cache = CacheConfig(kv_cache_memory_gib=float(TEST_KV_GIB))
    return Engine.from_config(EngineConfig(num_threads=2, activations="fp32", cache=cache))


EngineFactory = Callable[..., Engine]


@pytest.fixture
def make_engine(smollm2: tuple[CausalLM, Tokenizer]) -> EngineFactory:
    """Engine over the shared SmolLM2 weights with the given knobs.

    Every engine it made is checked at teardown: pool integrity holds and no block is
    left referenced."""
    model, tokenizer = smollm2
    made: list[Engine] = []

    def factory(
        *,
        max_num_batched_tokens: int = 2048,
        max_num_seqs: int = 64,
        num_blocks: int = 512,
        num_host_blocks: int = 512,
        block_size: int = 16,
        enable_prefix_cache: bool = True,
        preemption_mode: PreemptionMode = PreemptionMode.SWAP,
        max_model_len: int | None = None,
    ) -> Engine:
        config = EngineConfig(
            max_model_len=max_model_len,
            scheduler=SchedulerConfig(
                max_num_batched_tokens=max_num_batched_tokens,
                max_num_seqs=max_num_seqs,
                preemption_mode=preemption_mode,
            ),
            cache=CacheConfig(
                block_size=block_size,
                num_blocks=num_blocks,
                num_host_blocks=num_host_blocks,
                enable_prefix_cache=enable_prefix_cache,
            ),
        )
        engine = Engine(config, model, tokenizer)
        made.append(engine)
        return engine

    yield factory
    for engine in made:
        kv = engine.core.kv
        kv.check_integrity()
        if not engine.has_unfinished():
            assert kv.num_used_blocks == 0


@pytest.fixture
def start() -> Iterator[Callable[..., Server]]:
    """Starts clusters of the test's own with the given flags (the debug endpoints, KV as
    `Server` sets it); at teardown each is stopped and no shared-memory segment may be left."""
    before, started = pdkv_segments(), []

    def go(*args: str) -> Server:
        started.append(Server(*args, "--enable-debug-endpoints"))
        return started[-1]

    yield go
    for server in started:
        stop(server)
    leaked = segments_left(before)
    assert not leaked, f"shared-memory segments left behind: {sorted(leaked)}"
