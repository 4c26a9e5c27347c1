"""A single engine: the core in its own process behind the front end (`Cluster` of one
instance): real spawn, real ZeroMQ IPC sockets, real signals. Outputs equal the
in-process engine's."""

from __future__ import annotations

import asyncio
import multiprocessing
import os
import re
import signal
import subprocess
import sys
from collections.abc import AsyncGenerator

import pytest
from helpers.tiny_models import make_tiny_model

from pdserve.cluster.controller import Cluster
from pdserve.config import CacheConfig, EngineConfig
from pdserve.errors import EngineDeadError, InvalidRequestError, ModelLoadError
from pdserve.protocol.sampling_params import SamplingParams
from pdserve.text.outputs import RequestOutput

FRANCE = [{"role": "user", "content": "What is the capital of France?"}]
GREEDY = SamplingParams(max_tokens=64, temperature=0)


async def collect(client: Cluster, prompt, params: SamplingParams) -> tuple[str, list]:
    deltas, last = [], None
    async for out in client.generate(prompt, params):
        deltas.append(out.delta_text)
        last = out
    assert last is not None and last.finished
    assert "".join(deltas) == last.text
    return last.text, last.token_ids


def test_served_from_a_separate_process(make_engine) -> None:
    reference = make_engine()  # in-process engine over the same weights

    async def scenario() -> None:
        client = await Cluster.start(  # fp32, as the in-process reference
            EngineConfig(quantization="none", cache=CacheConfig(num_blocks=256, num_host_blocks=64))
        )
        try:
            assert client.instances[0].process.pid != os.getpid() and client.max_model_len == 4096
            tok = client.tokenizer
            assert tok is not None
            ids = tok.encode(tok.apply_chat_template(FRANCE), add_special_tokens=False)
            text, token_ids = await collect(client, ids, GREEDY)
            rid = reference.add_request(ids, GREEDY)
            while reference.has_unfinished():
                ref = [o for o in reference.step() if o.request_id == rid]
            assert text == "The capital of France is Paris." == ref[0].text
            assert token_ids == ref[0].token_ids

            stop = SamplingParams(max_tokens=64, temperature=0, stop=["Paris"])
            assert (await collect(client, ids, stop))[0] == "The capital of France is "

            with pytest.raises(InvalidRequestError) as exc:
                await collect(client, [1, 99999], GREEDY)
            assert exc.value.param == "prompt"
            assert exc.value.message == "prompt token id 99999 is outside the vocabulary [0, 49152)"

            prompts = [
                tok.encode(
                    tok.apply_chat_template([{"role": "user", "content": f"Count to {n}."}]),
                    add_special_tokens=False,
                )
                for n in range(8)
            ]
            params = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
            together = await asyncio.gather(*(collect(client, p, params) for p in prompts))
            alone = [await collect(client, p, params) for p in prompts[:2]]
            assert [t for t, _ in together[:2]] == [t for t, _ in alone]

            gen = client.generate(ids, SamplingParams(max_tokens=300, ignore_eos=True))
            await gen.__anext__()
            await gen.aclose()  # the consumer leaves: the request is aborted
            stats = await client.stats(check_integrity=True)
            for _ in range(100):
                if stats.num_running == 0:
                    break
                await asyncio.sleep(0.02)
                stats = await client.stats(check_integrity=True)
            assert (stats.num_running, stats.num_waiting, stats.num_used_blocks) == (0, 0, 0)
            assert stats.integrity_error is None
            assert stats.num_free_blocks + stats.num_cached_blocks == 256
        finally:
            await client.shutdown()
        (engine,) = client.instances
        assert engine.process.exitcode == 0 and not engine.process.is_alive()

    asyncio.run(scenario())


def test_killed_engine_fails_open_requests_quickly(tmp_path) -> None:
    folder = make_tiny_model(tmp_path, "LlamaForCausalLM")

    async def drain(gen: AsyncGenerator[RequestOutput, None]) -> None:
        async for _ in gen:
            pass

    async def scenario() -> None:
        client = await Cluster.start(EngineConfig(model=str(folder)))
        try:
            gen = client.generate([5, 6, 7], SamplingParams(max_tokens=200, ignore_eos=True))
            await gen.__anext__()
            os.kill(client.instances[0].process.pid, signal.SIGKILL)
            # The watchdog ends the stream with the death, not a normal finish.
            with pytest.raises(EngineDeadError, match=r"exit code -9"):
                await asyncio.wait_for(drain(gen), timeout=60)
            assert not client.is_alive
            with pytest.raises(EngineDeadError):
                await collect(client, [5, 6], GREEDY)
        finally:
            await client.shutdown()

    asyncio.run(scenario())


def test_engine_runs_on_the_cpus_it_is_given(tmp_path) -> None:
    folder = make_tiny_model(tmp_path, "LlamaForCausalLM")
    last = os.cpu_count() - 1  # type: ignore[operator]

    async def scenario() -> None:
        client = await Cluster.start(EngineConfig(model=str(folder), cpus=(last,)))
        try:
            assert os.sched_getaffinity(client.instances[0].process.pid) == {last}
            assert len((await collect(client, [5, 6, 7], GREEDY))[1]) == 64
        finally:
            await client.shutdown()

    asyncio.run(scenario())


# The spawned engine process's first imports, as `cluster/instance.py` `_run_engine` makes
# them; torch (and libgomp) loads with the second.
_ENGINE_IMPORTS = (
    "import pdserve.cluster.instance; from pdserve.engine.engine_process import run_engine_process"
)


def openmp_env_seen(**env: str) -> dict[str, str]:
    """The wait settings libgomp itself reports (OMP_DISPLAY_ENV) in a process that
    imports the engine as a spawned engine does, with only `env` of the two set."""
    base = {k: v for k, v in os.environ.items() if k not in ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT")}
    run = subprocess.run(
        [sys.executable, "-c", _ENGINE_IMPORTS],
        env={**base, **env, "OMP_DISPLAY_ENV": "VERBOSE"},
        capture_output=True,
        text=True,
        check=True,
    )
    found = re.findall(r"^\s*(OMP_WAIT_POLICY|GOMP_SPINCOUNT) = '(\w+)'", run.stderr, re.M)
    return dict(found)


def test_engine_openmp_threads_sleep_soon_when_they_wait() -> None:
    """A thread that spins at a barrier holds its core while the thread it waits for
    shares another with a busy process (pdserve/runtime.py quiet_openmp_waits): the
    engine process's libgomp spins ~1 ms, not ~30; what the user set is kept."""
    assert openmp_env_seen() == {"OMP_WAIT_POLICY": "PASSIVE", "GOMP_SPINCOUNT": "10000"}
    assert openmp_env_seen(OMP_WAIT_POLICY="active")["OMP_WAIT_POLICY"] == "ACTIVE"
    assert openmp_env_seen(GOMP_SPINCOUNT="300000")["GOMP_SPINCOUNT"] == "300000"


def test_engine_on_a_cpu_the_machine_lacks_fails_start_clearly(tmp_path) -> None:
    folder = make_tiny_model(tmp_path, "LlamaForCausalLM")
    count = os.cpu_count()

    async def scenario() -> None:
        await Cluster.start(EngineConfig(model=str(folder), cpus=(0, count)))  # type: ignore[arg-type]

    with pytest.raises(EngineDeadError) as exc:
        asyncio.run(scenario())
    assert str(exc.value) == (
        f"engine failed to start: CPUs [{count}] do not exist: this machine has CPUs 0-{count - 1}"  # type: ignore[operator]
    )
    assert multiprocessing.active_children() == []
    with pytest.raises(ValueError, match="cpus must name at least one CPU"):
        EngineConfig(cpus=())


def test_missing_model_fails_start_and_leaves_no_process(tmp_path) -> None:
    async def scenario() -> None:
        await Cluster.start(EngineConfig(model=str(tmp_path / "nope")))

    with pytest.raises(ModelLoadError, match="nope"):
        asyncio.run(scenario())
    assert multiprocessing.active_children() == []
