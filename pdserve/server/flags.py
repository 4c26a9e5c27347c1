"""`pdserve serve`'s flags -> the configs they name, checked before the server is imported.

Importing the server (`launch`: the front end, FastAPI, the model loader and torch) takes
~5 s. A flag that is wrong by itself (a device torch cannot use, a timeout of 0, a Ray
flag without --ray, a decode burst of 0) is a usage error that need not wait for that:
`check_serve_flags` raises it first, and so does a parallel instance's layout that cannot
split the model or has fewer threads than ranks (the model's config is read from its file
without torch: model/source.py). What needs the instances' modules (does --quantization
fit the model, a pipeline stage's staging) is checked after, by `launch.engine_config`.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import socket

from pdserve.cluster.config import ClusterConfig, DecodePolicy, Routing, instance_configs
from pdserve.cluster.placement import PlacedInstance, counts, in_launch_order, read_placement
from pdserve.config import (
    SHARED_TRANSPORTS,
    CacheConfig,
    DecodeAdmission,
    EngineConfig,
    PrefillPolicy,
    Role,
    SchedulerConfig,
    TransferConfig,
    check_device,
    parse_stub,
)
from pdserve.protocol.handoff import TransferMode


def check_serve_flags(args: argparse.Namespace) -> tuple[EngineConfig, ClusterConfig]:
    """The instances' config from the flags alone (no predictor head yet) and the
    cluster's; ValueError (a usage error) naming the first flag that is wrong."""
    _check_server_flags(args)
    check_device(args.device)
    rate = _take_stub(args)
    engine, cluster = engine_flags(args), cluster_config(args)
    _check_parallel(engine, cluster, args)
    _check_layouts(engine, cluster, args)
    if rate is not None:
        _check_stub(cluster, engine, args)
        engine = dataclasses.replace(engine, stub_rate=rate)
    return engine, cluster


def _take_stub(args: argparse.Namespace) -> float | None:
    """`serve stub:RATE --allow-stub`: stub instances (engine/stub.py), a benchmark tool
    for the front end, never served by default. The front end then reads the shipped
    model (its tokenizer, context limit and KV geometry, which the stubs report too):
    `args.model` becomes None and the served name "stub". None for a real model."""
    rate = parse_stub(args.model)
    if rate is None:
        if args.allow_stub:
            raise ValueError("--allow-stub serves stub instances: name the model stub:RATE")
        return None
    if not args.allow_stub:
        raise ValueError(
            f"{args.model} names stub instances (a token source for benchmarking the front "
            "end, no model: docs/bench.md), never served by default; add --allow-stub"
        )
    args.model = None
    args.served_model_name = args.served_model_name or "stub"
    return rate


def _check_stub(cluster: ClusterConfig, engine: EngineConfig, args: argparse.Namespace) -> None:
    """Stub instances are colocated instances of one rank on this machine: they answer a
    colocated instance's messages only (engine/stub.py)."""
    if cluster.num_prefill or cluster.num_decode or cluster.placement:
        raise ValueError("stub instances are colocated: use --colocated N, not --prefill/--decode")
    if engine.world_size > 1 or cluster.prefill_parallel or cluster.decode_parallel:
        raise ValueError("a stub instance has one rank: no tensor or pipeline parallelism")
    if args.ray or cluster.replicate or cluster.flip_policy != "none":
        raise ValueError("stub instances run without --ray, --kv-replication or a flip policy")


def _check_parallel(engine: EngineConfig, cluster: ClusterConfig, args: argparse.Namespace) -> None:
    """Microbatch swapping needs a pipeline instance, and parallel instances in a cluster
    move KV through shared memory (whether each instance's layout splits the model and
    fits its threads needs the model file: `launch.engine_config`)."""
    instances = instance_configs(cluster, engine)  # each checked by its dataclass
    if cluster.microbatch_swap_blocks and not any(c.microbatch_swap_blocks for c in instances):
        raise ValueError(
            "--microbatch-swap-blocks swaps a pipeline stage's micro-batches: no instance "
            "has more than one stage (--pipeline-parallel-size, --prefill-pp, --decode-pp "
            "or a placement's pp)"
        )
    if cluster.num_instances == 1 or not any(c.world_size > 1 for c in instances):
        return
    if engine.transfer.transport not in SHARED_TRANSPORTS:
        raise ValueError(
            f"--kv-transport {engine.transfer.transport}: a parallel instance's ranks keep "
            f"their KV in shared memory; use {' or '.join(SHARED_TRANSPORTS)}"
        )


def _check_layouts(engine: EngineConfig, cluster: ClusterConfig, args: argparse.Namespace) -> None:
    """Each parallel instance's layout splits the model (whole GQA groups per rank, whole
    layers per stage) and, on this machine, has a thread per rank; under Ray its node's
    devices are checked instead (cluster/ray_launch.check_fits)."""
    parallel = [c for c in instance_configs(cluster, engine) if c.world_size > 1]
    if parallel:
        # Here, not at the top: without a parallel instance the fork server starts before
        # any model module loads (tests/test_imports.py).
        from pdserve.model.source import load_config, resolve_model
        from pdserve.parallel.layout import check_layout

        model = load_config(resolve_model(engine.model))
        for instance in parallel:
            check_layout(instance, model, here=not args.ray)


def _check_placement_flags(args: argparse.Namespace, placement: list[PlacedInstance]) -> None:
    """A placement names each instance's node and ranks: without --ray every instance
    runs here (node 0), and the parallel flags would say it twice."""
    if not args.ray:
        away = [(i, p.node) for i, p in enumerate(placement) if p.node != 0]
        if away:
            i, node = away[0]
            raise ValueError(
                f"--placement {args.placement}: instances[{i}] is on node {node}; without "
                "--ray every instance runs on this machine (node 0)"
            )
    given = [
        flag
        for flag, value, unset in (
            ("--tensor-parallel-size", args.tensor_parallel_size, 1),
            ("--pipeline-parallel-size", args.pipeline_parallel_size, 1),
            ("--prefill-tp", args.prefill_tp, None),
            ("--prefill-pp", args.prefill_pp, None),
            ("--decode-tp", args.decode_tp, None),
            ("--decode-pp", args.decode_pp, None),
        )
        if value != unset
    ]
    if given:
        raise ValueError(
            f"{given[0]} with --placement: the placement names each instance's tp and pp"
        )


def _role_parallel(args: argparse.Namespace, role: str) -> tuple[int, int] | None:
    """(tensor, pipeline) sizes of `role`'s instances: --{role}-tp/--{role}-pp, each
    defaulting to --tensor-parallel-size/--pipeline-parallel-size; None if neither given."""
    tp, pp = getattr(args, f"{role}_tp"), getattr(args, f"{role}_pp")
    if tp is None and pp is None:
        return None
    for flag, value in ((f"--{role}-tp", tp), (f"--{role}-pp", pp)):
        if value is not None and value < 1:
            raise ValueError(f"{flag} must be at least 1, got {value}")
    if not (args.prefill or args.decode):
        raise ValueError(f"--{role}-tp/--{role}-pp need --prefill and --decode instances")
    return (
        args.tensor_parallel_size if tp is None else tp,
        args.pipeline_parallel_size if pp is None else pp,
    )


def listen(host: str, port: int) -> socket.socket:
    """The server's listening socket, bound before the model loads: a port in use is a
    usage error at once, not after the instances started (and the port cannot be taken
    meanwhile). `--port 0` takes a free port; the "serving ... at" line names it."""
    try:
        family, kind, proto, _, address = socket.getaddrinfo(
            host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE
        )[0]
        # The protocol named (IPPROTO_TCP), not 0 as socket.create_server leaves it:
        # asyncio turns Nagle's algorithm off only on sockets that say they are TCP, and
        # with it on every streamed response waited ~40 ms for a delayed ACK.
        sock = socket.socket(family, kind, proto)
        try:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            sock.bind(address)
            sock.listen(2048)
        except OSError:
            sock.close()
            raise
        return sock
    except OSError as e:  # gaierror too: a host that does not resolve
        why = os.strerror(e.errno) if e.errno and e.errno > 0 else str(e.strerror or e)
        raise ValueError(f"cannot listen on {host}:{port}: {why}") from None


def _check_server_flags(args: argparse.Namespace) -> None:
    """The HTTP server's own flags, and the Ray flags that mean nothing without --ray."""
    if args.shutdown_timeout < 0:
        raise ValueError(f"--shutdown-timeout must be at least 0, got {args.shutdown_timeout}")
    if args.max_body_bytes < 1:
        raise ValueError(f"--max-body-bytes must be at least 1, got {args.max_body_bytes}")
    for flag in ("header_timeout", "body_timeout", "grammar_timeout"):
        if getattr(args, flag) <= 0:
            name = "--" + flag.replace("_", "-")
            raise ValueError(f"{name} must be greater than 0, got {getattr(args, flag)}")
    if not args.ray:
        for flag in ("ray_address", "ray_restart"):
            if getattr(args, flag) not in (None, False):
                raise ValueError(f"--{flag.replace('_', '-')} needs --ray")
    elif args.engine_cpus is not None:
        raise ValueError("--engine-cpus cannot be combined with --ray (Ray places the instances)")


def engine_flags(args: argparse.Namespace) -> EngineConfig:
    """`EngineConfig` as the flags give it, each value checked by its dataclass."""
    return EngineConfig(
        model=args.model,
        device=args.device,
        dtype=args.dtype,
        quantization=args.quantization,
        activations=args.activations,
        kv_cache_dtype=args.kv_cache_dtype,
        max_model_len=args.max_model_len,
        num_threads=args.num_threads,
        tensor_parallel_size=args.tensor_parallel_size,
        pipeline_parallel_size=args.pipeline_parallel_size,
        cpus=args.engine_cpus,
        scheduler=SchedulerConfig(
            max_num_batched_tokens=args.max_num_batched_tokens,
            max_prefill_tokens_with_decodes=args.max_prefill_tokens_with_decodes,
            max_num_seqs=args.max_num_seqs,
            max_waiting_requests=args.max_queued_requests,
            prefill_policy=PrefillPolicy(args.prefill_policy),
            prefill_sched_batch=args.prefill_sched_batch,
            decode_admission=DecodeAdmission(args.decode_admission),
            decode_burst=args.decode_burst,
        ),
        cache=CacheConfig(
            kv_cache_memory_gib=args.kv_cache_memory_gib,
            enable_prefix_cache=not args.no_prefix_cache,
        ),
        transfer=TransferConfig(
            mode=TransferMode(args.transfer_mode),
            transport=args.kv_transport or ("auto" if args.ray else "shm"),
            timeout_s=args.kv_transfer_timeout,
            lease_s=args.kv_lease,
            verify_checksum=args.kv_verify_checksum,
            fault_failure_rate=args.kv_fault_rate,
            fault_delay_s=args.kv_fault_delay,
            fault_bandwidth=args.kv_fault_bandwidth,
            fault_seed=args.kv_fault_seed,
            fault_scope=args.kv_fault_scope,
        ),
    )


def cluster_config(args: argparse.Namespace) -> ClusterConfig:
    """The instances to run: by default one engine (no --prefill/--decode/--colocated);
    with --placement, the instances it names (flags given too must agree with it)."""
    placement = read_placement(args.placement) if args.placement else []
    if placement:
        _check_placement_flags(args, placement)
    flags = bool(args.prefill or args.decode or args.colocated is not None)
    if placement and not flags:
        n = counts(placement)
        prefill, decode, colocated = n[Role.PREFILL], n[Role.DECODE], n[Role.COLOCATED]
    else:
        disaggregated = bool(args.prefill or args.decode)
        prefill, decode = args.prefill, args.decode
        colocated = args.colocated if args.colocated is not None else (0 if disaggregated else 1)
    return ClusterConfig(
        num_prefill=prefill,
        num_decode=decode,
        num_colocated=colocated,
        placement=tuple(in_launch_order(placement)),
        restart_dead=args.ray_restart,
        decode_policy=DecodePolicy(args.decode_policy),
        instance_timeout_s=args.instance_timeout,
        flip_timeout_s=args.flip_timeout,
        kv_wait_s=args.kv_wait,
        flip_policy=args.flip_policy,
        replan_interval_s=args.replan_interval,
        flip_idle_load=args.flip_idle_load,
        flip_idle_s=args.flip_idle_seconds,
        flip_busy_load=args.flip_busy_load,
        replan_window_s=args.replan_window,
        replan_gain=args.replan_gain,
        replan_min_requests=args.replan_min_requests,
        min_instances=args.min_instances,
        max_instances=args.max_instances,
        max_migrations=args.max_migrations,
        replicate=args.kv_replication,
        prefill_chunk_size=args.chunk_size,
        prefill_parallel=_role_parallel(args, "prefill"),
        decode_parallel=_role_parallel(args, "decode"),
        microbatch_swap_blocks=args.microbatch_swap_blocks,
        routing=Routing(args.routing),
        pd_caching=args.pd_caching,
        prefix_ttl_s=args.prefix_ttl,
        prefix_tree_max_entries=args.prefix_tree_max_entries,
        decode_balance=args.decode_balance,
        prefix_fetch=not args.no_prefix_fetch,
        heavy_decode_tokens=args.heavy_decode_tokens,
    )
