"""`Engine`: the synchronous API of one instance (add_request / abort / step).

Builds the model, tokenizer, KV manager and core from an `EngineConfig`, and turns
the core's token outputs into `RequestOutput`s with text.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence

import torch

from pdserve.config import EngineConfig, check_device
from pdserve.engine.core import EngineCore
from pdserve.engine.mb_swap import check_staging
from pdserve.engine.ranks import RankGroup, Spawn, rank_threads
from pdserve.kv.config import KVCacheConfig
from pdserve.kv.layout import DTYPE_SIZES
from pdserve.model.base import CausalLM
from pdserve.model.config import ModelConfig
from pdserve.model.loader import iter_weights
from pdserve.model.quantization import instance_quantization
from pdserve.model.registry import build_model
from pdserve.model.source import load_config, resolve_model
from pdserve.model.tokenizer import Tokenizer
from pdserve.parallel import group
from pdserve.parallel.layout import Shard, check_ranks_fit, split_model
from pdserve.parallel.shard import load_shard
from pdserve.protocol.sampling_params import SamplingParams
from pdserve.text.output_processor import OutputProcessor
from pdserve.text.outputs import RequestOutput

Prompt = str | Sequence[int]


class Engine:
    def __init__(
        self,
        config: EngineConfig,
        model: CausalLM,
        tokenizer: Tokenizer,
        ranks: RankGroup | None = None,
    ) -> None:
        self.config = config
        self.tokenizer = tokenizer
        self.core = build_core(config, model, tokenizer.stop_token_ids, ranks)
        self.processor = OutputProcessor(tokenizer)
        self._ids = itertools.count()

    @classmethod
    def from_config(cls, config: EngineConfig) -> Engine:
        ranks = start_ranks(config)
        model = load_model(config, None if ranks is None else ranks.shard)
        return cls(config, model, Tokenizer.from_model_path(resolve_model(config.model)), ranks)

    @property
    def max_model_len(self) -> int:
        return self.core.max_model_len

    def add_request(
        self, prompt: Prompt, params: SamplingParams, request_id: str | None = None
    ) -> str:
        """Tokenize (if text), validate and queue. Raises InvalidRequestError."""
        token_ids = self.tokenizer.prompt_ids(prompt)
        rid = request_id if request_id is not None else f"req-{next(self._ids)}"
        req = self.core.add_request(rid, token_ids, params)
        self.processor.add(rid, req.prompt_token_ids, params)
        return rid

    def abort(self, request_id: str) -> RequestOutput | None:
        """Cancel a request; its final output (finish_reason 'abort'), or None."""
        out = self.core.abort(request_id)
        return None if out is None else self.processor.process(out)[0]

    def has_unfinished(self) -> bool:
        return self.core.has_unfinished()

    def step(self) -> list[RequestOutput]:
        results = []
        for out in self.core.step():
            result, stop_string = self.processor.process(out)
            if stop_string is not None:
                # The processor made the final output; the core's abort output is not news.
                self.core.abort(out.request_id)
            if result is not None:
                results.append(result)
        return results


def start_ranks(config: EngineConfig, spawn: Spawn | None = None) -> RankGroup | None:
    """A parallel instance's other ranks, started with `spawn` (default: subprocesses;
    they load their shards while this process loads rank 0's: `load_model`); this process
    joins their group. None for one rank."""
    if config.world_size == 1:
        return None
    path = resolve_model(config.model)
    # A split that cannot be made is refused before any process starts.
    shards = split_model(
        load_config(path), config.tensor_parallel_size, config.pipeline_parallel_size
    )
    if spawn is None:  # a placement group (`spawn_in_group`) reserved a device a rank
        check_ranks_fit(config)
    port = group.free_port()
    ranks = RankGroup.start(config, port, shards, spawn)
    group.join(0, config.world_size, port, config.device, tp=config.tensor_parallel_size)
    group.watch(ranks.check)
    return ranks


def load_model(config: EngineConfig, shard: Shard | None = None) -> CausalLM:
    """Build the configured model with its weights, ready to serve (threads set). A
    parallel instance's driver passes its `shard` (`RankGroup.shard`): its layers, summing
    over the group `start_ranks` joined under tensor parallelism."""
    torch.set_num_threads(rank_threads(config))
    path = resolve_model(config.model)
    check_device(config.device)
    quant = instance_quantization(config, path)
    if shard is not None:
        model = load_shard(path, shard, config.torch_dtype, quant)
        model.to(config.device)
        if config.tensor_parallel_size > 1:
            model.set_reduce(group.all_reduce_sum)
        return model
    model = build_model(load_config(path), config.torch_dtype, quant.quantized)
    model.quantization = quant  # finalize reads it (the activations)
    model.load_weights(iter_weights(path, config.torch_dtype, quant))
    model.to(config.device)
    model.finalize()
    return model


def build_core(
    config: EngineConfig,
    model: CausalLM,
    stop_token_ids: Sequence[int],
    ranks: RankGroup | None = None,
) -> EngineCore:
    """The token-level engine over a loaded model (the driver's shard, with its `ranks`,
    for a parallel instance); KV pool sized from the config."""
    kv_config = kv_config_for(config, model.config, model.quantization.quantized)
    max_len = max_model_len_for(config, model.config, kv_config)
    eos = set(stop_token_ids) | set(model.config.eos_token_ids)
    return EngineCore(config, model, kv_config, max_len, sorted(eos), ranks)


def check_staging_fits(config: EngineConfig, model: ModelConfig, quantized: bool) -> None:
    """A pipeline instance's --microbatch-swap-blocks against the context limit its core
    will have (ValueError, as `stage_swap` would raise once the instance started)."""
    kv = kv_config_for(config, model, quantized)
    check_staging(config, kv.block_size, max_model_len_for(config, model, kv))


def kv_config_for(config: EngineConfig, model: ModelConfig, quantized: bool) -> KVCacheConfig:
    """The pool's block counts: the configured memory over a block's bytes in the pool's
    dtype (`config.kv_dtype(quantized)`)."""
    c = config.cache
    elem = DTYPE_SIZES[config.kv_dtype(quantized)]
    block_bytes = c.block_size * model.kv_bytes_per_token(elem)
    num_blocks = c.num_blocks or max(1, int(c.kv_cache_memory_gib * 2**30) // block_bytes)
    num_host = c.num_host_blocks
    if num_host is None:
        num_host = int(c.swap_space_gib * 2**30) // block_bytes
    return KVCacheConfig(
        block_size=c.block_size,
        num_blocks=num_blocks,
        num_host_blocks=num_host,
        enable_prefix_cache=c.enable_prefix_cache,
    )


def max_model_len_for(config: EngineConfig, model: ModelConfig, kv: KVCacheConfig) -> int:
    """The context limit: the user's, else the model's, never more than the pool holds."""
    limit = model.max_position_embeddings
    if config.max_model_len is not None:
        if config.max_model_len > limit:
            raise ValueError(
                f"max_model_len={config.max_model_len} exceeds the model's "
                f"max_position_embeddings={limit}"
            )
        limit = config.max_model_len
    return min(limit, kv.num_blocks * kv.block_size)
