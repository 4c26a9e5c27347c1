"""A prefill core and a decode core over one model in one process, and the tiny
synchronous router that plays the controller between them (the cluster controller's job,
tested with real processes in the server tests). Shared by the engine-level tests of
disaggregation, cluster-wide caching and length-aware scheduling.
"""

from __future__ import annotations

import time
from pathlib import Path

import torch

from pdserve.config import CacheConfig, EngineConfig, Role, SchedulerConfig, TransferConfig
from pdserve.engine.core import EngineCore
from pdserve.engine.engine import build_core
from pdserve.engine.roles import DecodeRole, PrefillRole
from pdserve.kv.transfer import gather
from pdserve.model.base import CausalLM
from pdserve.protocol.handoff import (
    AddPrefilled,
    Handoff,
    HandoffFailed,
    KVHandedOff,
    KVReceived,
    KVReserved,
    ReserveKV,
    TransferMode,
)
from pdserve.protocol.prediction import LengthPrediction
from pdserve.protocol.sampling_params import SamplingParams
from pdserve.protocol.wire import EngineMessage


def make_core(
    model_dir: Path,
    model: CausalLM,
    role: Role,
    mode: str = "pull",
    transport: str = "inproc",
    block_size: int = 16,
    num_blocks: int = 256,
    chunk: int = 64,
    scheduler: SchedulerConfig | None = None,
    length_predictor: str | None = None,
    **transfer: object,
) -> EngineCore:
    """A core of `role`; `scheduler` replaces the default (chunk = its token budget)."""
    config = EngineConfig(
        model=str(model_dir),
        role=role,
        instance_name=f"{role.value}-{transport}-{block_size}-{id(object())}",
        num_threads=1,
        scheduler=scheduler or SchedulerConfig(max_num_batched_tokens=chunk, max_num_seqs=64),
        cache=CacheConfig(block_size=block_size, num_blocks=num_blocks, num_host_blocks=64),
        length_predictor=length_predictor,
        transfer=TransferConfig(mode=mode, transport=transport, **transfer),  # type: ignore[arg-type]
    )
    return build_core(config, model, [])


def prompts(n: int, vocab: int, seed: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    lengths = [int(x) for x in torch.randint(3, 90, (n,), generator=g)]
    return [torch.randint(5, vocab, (n_,), generator=g).tolist() for n_ in lengths]


def colocated_outputs(core: EngineCore, batch: list[list[int]], params: SamplingParams) -> dict:
    for i, p in enumerate(batch):
        core.add_request(f"r{i}", p, params)
    return drain(core)


def drain(core: EngineCore) -> dict[str, list[int]]:
    out: dict[str, list[int]] = {}
    while core.has_unfinished():
        for o in core.step():
            out.setdefault(o.request_id, []).extend(t.token_id for t in o.new_tokens)
    return out


class Router:
    """Plays the controller between one prefill and one decode core, synchronously.

    A spy on the prefill role's `hand_off` snapshots each prompt's KV at the moment it
    leaves the batch; at `KVReceived` the decode pool must hold exactly that."""

    def __init__(
        self,
        prefill: EngineCore,
        decode: EngineCore,
        mode: str,
        batch: list[list[int]],
        params: SamplingParams,
    ) -> None:
        self.prefill, self.decode, self.mode = prefill, decode, mode
        self.batch, self.params = batch, params
        self.tokens: dict[str, list[int]] = {}
        self.finished: set[str] = set()
        self.failures: dict[str, str] = {}
        self.kv_equal: dict[str, bool] = {}
        self.snapshots: dict[str, torch.Tensor] = {}
        self.return_to: str | None = None  # PD-Caching-3 (see ReturningRouter)
        # Each request's prediction, from its first output, passed on at the hand-off.
        self.predictions: dict[str, LengthPrediction] = {}
        role = prefill.role
        assert isinstance(role, PrefillRole)
        original = role.hand_off

        def spy(req):  # type: ignore[no-untyped-def]
            blocks = prefill.kv.block_table(req.request_id)
            n = len(req.prompt_token_ids)
            self.snapshots[req.request_id] = instance_kv(prefill, blocks, n)
            original(req)

        role.hand_off = spy  # type: ignore[method-assign]

    def run(self, timeout_s: float = 60.0) -> None:
        for i, p in enumerate(self.batch):
            if self.mode == "pull":
                handoff = Handoff(TransferMode.PULL)
                self.prefill.add_request(f"r{i}", p, self.params, handoff=handoff)
            else:
                self.decode.handle(ReserveKV(f"r{i}", p))
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            self.tick(self.prefill)
            self.tick(self.decode)
            if len(self.finished) + len(self.failures) == len(self.batch) and self.idle():
                return
            if not (self.prefill.has_unfinished() or self.decode.has_unfinished()):
                time.sleep(0.0002)  # only transfers run: leave the GIL to their thread
        raise AssertionError("the pair did not finish")

    def idle(self) -> bool:
        cores = (self.prefill, self.decode)
        return not any(c.has_unfinished() or c.transfers_in_flight() for c in cores)

    def tick(self, core: EngineCore) -> None:
        core.poll_transfers()
        if core.has_unfinished():
            for o in core.step():
                self.tokens.setdefault(o.request_id, []).extend(t.token_id for t in o.new_tokens)
                if o.prediction is not None:
                    self.predictions[o.request_id] = o.prediction
                if o.finish_reason is not None:
                    self.finished.add(o.request_id)
        for msg in core.take_messages():
            self.route(msg)

    def route(self, msg: EngineMessage) -> None:
        if isinstance(msg, KVReserved):
            p = self.batch[int(msg.request_id[1:])]
            handoff = Handoff(TransferMode(self.mode), msg.target)
            self.prefill.add_request(msg.request_id, p, self.params, handoff=handoff)
        elif isinstance(msg, KVHandedOff):
            p = self.batch[int(msg.request_id[1:])]
            first = list(self.tokens[msg.request_id])
            self.decode.handle(
                AddPrefilled(
                    msg.request_id,
                    p,
                    first,
                    self.params,
                    0.0,
                    msg.source,
                    msg.generator_state,
                    return_to=self.return_to,
                    prediction=self.predictions.get(msg.request_id),
                )
            )
        elif isinstance(msg, KVReceived):
            rid = msg.request_id
            kv = self.decode.kv
            if rid in kv and not kv.is_swapped(rid):  # a tight pool may swap it out at once
                self.kv_equal[rid] = self.same_kv(rid)
            self.prefill.release([msg.request_id])
        elif isinstance(msg, HandoffFailed):
            self.failures[msg.request_id] = msg.message
            self.prefill.release([msg.request_id])
            self.decode.release([msg.request_id])

    def same_kv(self, rid: str) -> bool:
        want = self.snapshots[rid]
        got = instance_kv(self.decode, self.decode.kv.block_table(rid), want.shape[2])
        return bool(torch.equal(want, got))


def instance_kv(core: EngineCore, blocks: list[int], n: int) -> torch.Tensor:
    """Tokens [0, n) of the request whose block table is `blocks`, as one `[layers, 2, n,
    KV heads, head_dim]` tensor of the whole model: each rank's pool (a parallel instance's,
    mapped by its driver) gathered into its layers and heads, every element from exactly
    one rank."""
    if core.link is None:
        return gather(core.runner.cache.device_tensor, core.runner.cache.layout, blocks, 0, n)
    whole = core.kv_layout
    shape = (whole.num_layers, 2, n, whole.num_kv_heads, whole.head_dim)
    out = torch.zeros(shape, dtype=core.runner.cache.device_tensor.dtype)
    held = torch.zeros(shape, dtype=torch.int32)
    for pool, layout in zip(core.link.tensors, core.link.layouts, strict=True):
        layers, heads = layout.layers, layout.kv_heads
        part = gather(pool, layout, blocks, 0, n)
        out[layers.start : layers.stop, :, :, heads.start : heads.stop] = part
        held[layers.start : layers.stop, :, :, heads.start : heads.stop] += 1
    assert bool((held == 1).all()), "the ranks' pools do not cover the model exactly once"
    return out


def assert_clean(*cores: EngineCore) -> None:
    for core in cores:
        core.kv.check_integrity()
        assert core.kv.num_used_blocks == 0
        assert not core.requests and not core.has_unfinished()
        role = core.role
        if isinstance(role, PrefillRole):
            assert not role.outgoing
        if isinstance(role, DecodeRole):
            assert not (role.queue or role.fetching or role.reservations)


def run_pair(
    model_dir: Path,
    model: CausalLM,
    mode: str,
    params: SamplingParams,
    batch: list[list[int]],
    transport: str = "inproc",
    p_block: int = 16,
    d_block: int = 16,
    **transfer: object,
) -> tuple[Router, EngineCore, EngineCore]:
    p = make_core(model_dir, model, Role.PREFILL, mode, transport, p_block, **transfer)
    d = make_core(model_dir, model, Role.DECODE, mode, transport, d_block, **transfer)
    router = Router(p, d, mode, batch, params)
    router.run()
    return router, p, d
