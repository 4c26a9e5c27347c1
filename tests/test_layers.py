"""Layers that only point down: a module of `pdserve/` imports modules of its own layer or
of layers below it, never above (docs/structure.md).

`LAYERS` is the order, bottom-up, each with why it sits where it does: the stack of
../shared/DESIGN.md (model, kv, engine, cluster, server, planner, bench) with the parts it
does not name placed where their imports put them, and `kv/` below `model/` (the model
reads `config.py`, which reads kv's dtype table; no model module imports kv).

A module belongs to the entry that names it or its closest package (`pdserve.kv` holds
`pdserve.kv.transfer.shm`); the package `pdserve` itself (its `__init__`) is named on its
own, so a new top-level module belongs to no layer until it is placed, and the test says
so.

The arrows are tests/helpers/imports.py's, every kind counted: top-level imports, lazy
ones in functions (a run-time dependency all the same) and those under `if
TYPE_CHECKING:` (an annotation that names a higher layer's type still ties the lower
layer's meaning to it).
"""

from __future__ import annotations

from helpers.imports import ROOT, Arrow, arrows, module_names

Layers = list[tuple[tuple[str, ...], str]]  # (modules, why they sit there), bottom-up

LAYERS: Layers = [
    (
        ("pdserve.errors", "pdserve.runtime", "pdserve.memory", "pdserve.version"),
        "leaves, importing no pdserve module: exceptions, process tuning, 2 MB pages, version",
    ),
    (
        ("pdserve.kv",),
        "one instance's KV memory: blocks, prefix index, pool, descriptors, moving KV out and in",
    ),
    (
        ("pdserve.protocol",),
        "typed messages between processes (a request's parameters too, and their checks "
        "against a model's limits): plain data over kv's",
    ),
    (
        ("pdserve.text",),
        "a request's token ids to text, stop strings, RequestOutput: over protocol's messages",
    ),
    (
        ("pdserve.grammar",),
        "a request's output constraint (llguidance grammars, checked and matched) and tool "
        "calls in and out of text: over the leaves only",
    ),
    (
        ("pdserve.config",),
        "what an instance is built from (EngineConfig and its parts), sized by kv's dtype table",
    ),
    (
        ("pdserve.kernels",),
        "the compiled CPU kernels and their loader: plain addresses and sizes, torch only",
    ),
    (
        ("pdserve.quant",),
        "GGUF block formats and the ops over them that the model calls, by the kernels",
    ),
    (
        ("pdserve.model",),
        "architectures over the paged KV pool, weight loading, the tokenizer: one forward",
    ),
    (
        ("pdserve.parallel",),
        "how a model splits across the ranks of an instance: shard layouts, a rank's config "
        "and weights, the process group",
    ),
    (
        ("pdserve.engine",),
        "one instance: scheduler, model runner, sampler, length head, roles; speaks protocol",
    ),
    (
        ("pdserve.predictor",),
        "making a length head: prompts, data collected by running the engine, training, CLI",
    ),
    (
        ("pdserve.cluster",),
        "the one front end: instances (engines in their processes), routing, recovery",
    ),
    (
        ("pdserve.server",),
        "the OpenAI-compatible HTTP API over the front end",
    ),
    (
        ("pdserve.workload",),
        "request lengths and arrivals, shared by bench and planner and importing neither",
    ),
    (
        ("pdserve.planner",),
        "sizes a deployment: latency model, simulation, placement; profiles the engine",
    ),
    (
        ("pdserve.bench",),
        "measures servers (over HTTP, never imported) with workloads",
    ),
    (
        ("pdserve", "pdserve.cli"),
        "entry points: `pdserve.LLM`, `pdserve.SamplingParams`, the `pdserve` command: any layer",
    ),
]


def layer_of(module: str, layers: Layers = LAYERS) -> int | None:
    """The index in `layers` of `module`'s entry: its own name or its closest package's
    (never the root package's, which is named only for itself); None if unplaced."""
    index = {name: i for i, (names, _) in enumerate(layers) for name in names}
    name = module
    while name:
        if name in index and (name == module or name != "pdserve"):
            return index[name]
        name = name.rpartition(".")[0]
    return None


def upward(found: list[Arrow], layers: Layers = LAYERS) -> list[str]:
    """Each arrow from a module to one of a higher layer: `file:line: a -> b (layer i -> j)`."""
    lines = []
    for arrow in found:
        low, high = layer_of(arrow.source, layers), layer_of(arrow.target, layers)
        if low is not None and high is not None and high > low:
            lines.append(f"{arrow.where}: {arrow.source} -> {arrow.target} (layer {low} -> {high})")
    return lines


def test_every_module_has_a_layer_and_every_entry_a_module() -> None:
    modules = module_names()
    unplaced = [m for m in modules if layer_of(m) is None]
    assert unplaced == [], f"modules in no layer (add them to LAYERS): {unplaced}"
    stale = [name for names, _ in LAYERS for name in names if name not in modules]
    assert stale == [], f"LAYERS names modules that do not exist: {stale}"


def test_imports_only_point_down() -> None:
    found = upward(arrows(type_checking=True))
    legend = [f"  {i}: {', '.join(names)}" for i, (names, _) in enumerate(LAYERS)]
    assert not found, "\n".join(
        ["imports from a higher layer:", *(f"  {x}" for x in found), "the layers:", *legend]
    )


def test_an_import_back_up_is_reported_with_its_place() -> None:
    layers: Layers = [
        (("pdserve.a",), ""),
        (("pdserve.b", "pdserve.c"), ""),
        (("pdserve",), ""),
    ]
    path = ROOT / "a" / "x.py"
    found = [
        Arrow("pdserve.a.x", "pdserve.a.y", path, 1),  # its own layer
        Arrow("pdserve.b", "pdserve.a.x", path, 2),  # down
        Arrow("pdserve.b", "pdserve.c.z", path, 3),  # beside, the same layer
        Arrow("pdserve.a.x", "pdserve.c.z", path, 4),  # up
        Arrow("pdserve.b", "pdserve", path, 5),  # up: the root package is the top
    ]
    assert upward(found, layers) == [
        "pdserve/a/x.py:4: pdserve.a.x -> pdserve.c.z (layer 0 -> 1)",
        "pdserve/a/x.py:5: pdserve.b -> pdserve (layer 1 -> 2)",
    ]
    assert layer_of("pdserve.d", layers) is None  # not under the root's entry
