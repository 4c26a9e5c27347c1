"""Import structure of `pdserve`: no import cycles; the KV descriptors import no torch.

The graph is tests/helpers/imports.py's: one node per module, one edge per import of a
`pdserve` module, lazy ones in functions included (a cycle through a lazy import still
means the two modules cannot be understood, tested or split apart one without the
other), those under `if TYPE_CHECKING:` left out (they never run, they exist for
annotations only, so they cannot form a run-time cycle).
"""

from __future__ import annotations

import ast
import json
import subprocess
import sys
from pathlib import Path

from helpers.imports import ROOT, import_graph, imports
from helpers.server import Server


def find_cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """One cycle (a path that returns to its start) per strongly connected component of more
    than one module (Tarjan), so every tangle is reported once."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    components: list[set[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = set()
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.add(w)
                if w == v:
                    break
            if len(component) > 1:
                components.append(component)

    limit = sys.getrecursionlimit()
    sys.setrecursionlimit(max(limit, 10 * len(graph)))
    try:
        for v in sorted(graph):
            if v not in index:
                visit(v)
    finally:
        sys.setrecursionlimit(limit)
    return [_cycle_in(sorted(c), graph) for c in components]


def _cycle_in(component: list[str], graph: dict[str, set[str]]) -> list[str]:
    """A shortest cycle through the component's first module (breadth-first within it)."""
    start = component[0]
    members = set(component)
    parent: dict[str, str] = {}
    frontier = [start]
    while frontier:
        nxt: list[str] = []
        for v in frontier:
            for w in sorted(graph[v] & members):
                if w == start:
                    path = [v]
                    while path[-1] != start:
                        path.append(parent[path[-1]])
                    return [start, *reversed(path[:-1]), start]
                if w not in parent:
                    parent[w] = v
                    nxt.append(w)
        frontier = nxt
    raise AssertionError(f"no cycle in component {component}")


def test_imports_skip_type_checking_and_count_lazy_ones() -> None:
    source = (
        "import typing\n"
        "from typing import TYPE_CHECKING\n"
        "if TYPE_CHECKING:\n"
        "    import a\n"
        "else:\n"
        "    import b\n"
        "if typing.TYPE_CHECKING:\n"
        "    import c\n"
        "def f():\n"
        "    from d import e\n"
    )

    def found(type_checking: bool) -> list[str | None]:
        return [
            n.module if isinstance(n, ast.ImportFrom) else n.names[0].name
            for n in imports(ast.parse(source), type_checking)
        ]

    assert found(False) == ["typing", "typing", "b", "d"]
    assert found(True) == ["typing", "typing", "a", "b", "c", "d"]  # tests/test_layers.py's


def test_graph_resolves_the_import_forms() -> None:
    graph = import_graph()
    assert "pdserve.kv.layout" in graph["pdserve.kv.transfer"]  # `from m import name`
    assert "pdserve.kv.manager" in graph["pdserve.kv"]  # a package is its __init__
    assert "pdserve.workload.arrivals" in graph["pdserve.bench.experiment"]  # a module of a package
    assert "pdserve.kv.transfer.layout" in graph["pdserve.config"]  # lazy, in a method
    assert "pdserve.engine.llm" in graph["pdserve"]  # lazy, in a function


def test_find_cycles_reports_one_path_per_tangle() -> None:
    graph = {
        "a": {"b"},
        "b": {"c"},
        "c": {"a", "d", "b"},
        "d": set(),
        "x": {"y", "a"},
        "y": {"x"},
    }
    assert find_cycles(graph) == [["a", "b", "c", "a"], ["x", "y", "x"]]


def test_no_import_cycles() -> None:
    cycles = find_cycles(import_graph())
    assert not cycles, "import cycles in pdserve:\n" + "\n".join(
        "  " + " -> ".join(cycle) for cycle in cycles
    )


def test_kv_layout_imports_no_torch_and_no_transport() -> None:
    code = (
        "import sys, pdserve.kv.layout\n"
        "print('torch' in sys.modules)\n"
        "print(sorted(m for m in sys.modules if m.startswith('pdserve.kv.transfer')))\n"
    )
    out = _python(code)
    assert out.splitlines() == ["False", "[]"]


def test_decoding_what_instances_send_loads_no_torch_and_no_transport() -> None:
    """The HTTP process decodes every instance message, hand-off descriptors included,
    with the protocol package alone (issue 16)."""
    code = """
import sys
import msgspec
from pdserve.kv.layout import KVLayout, RegionHandle
from pdserve.protocol.handoff import KVHandedOff, KVSource
from pdserve.protocol.wire import EngineMessage

layout = KVLayout(2, 8, 4, 1, 8, "float32")
rank = KVLayout(2, 8, 4, 1, 8, "float32", first_kv_head=1)
regions = (
    RegionHandle("shm", "seg", "prefill-0", layout),
    RegionHandle("shm", "seg1", "prefill-0-rank1", rank),
)
source = KVSource(regions, [3, 1], 6, 12.5)
sent = KVHandedOff("r1", source, None, 1.0, 2.0)
got = msgspec.msgpack.Decoder(EngineMessage).decode(msgspec.msgpack.encode(sent))
assert got == sent, got
heavy = [m for m in sys.modules if m.split(".")[0] == "torch"
         or m.startswith(("pdserve.kv.transfer", "pdserve.engine.core", "pdserve.model"))]
print(sorted(heavy))
"""
    out = _python(code)
    assert out.splitlines() == ["[]"]


def test_the_server_never_probes_its_backend() -> None:
    """Routes use the `ServingBackend` protocol only: no getattr / hasattr in server/."""
    probes = []
    for path in sorted((ROOT / "server").glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if _is_probe(node):
                probes.append(f"{path.name}:{node.lineno}")
    assert probes == []


def _is_probe(node: ast.AST) -> bool:
    """`getattr(self.client, ...)` / `hasattr(backend, ...)` and the like."""
    if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Name)):
        return False
    if node.func.id not in ("getattr", "hasattr") or not node.args:
        return False
    target = ast.unparse(node.args[0])
    return "client" in target or "backend" in target


def test_the_http_process_loads_no_engine_and_no_transport() -> None:
    """`pdserve serve`'s own process: the engine and the KV transports live in the
    instance processes it spawns (their entry point imports them there)."""
    code = (
        "import sys, pdserve.server.launch\n"
        "print(sorted(m for m in sys.modules if m.startswith(("
        "'pdserve.kv.transfer', 'pdserve.engine.core', 'pdserve.engine.engine_process',"
        " 'pdserve.model.base'))))\n"
    )
    out = _python(code)
    assert out.splitlines() == ["[]"]


def test_the_front_end_loads_no_torch() -> None:
    """`pdserve serve`'s own process: the HTTP app, the controller and what they read of
    a model (its config, tokenizer, length head's spec and quantization: model/source.py,
    gguf_header.py, quantization.py, engine/head_spec.py) import no torch (~2.5 CPU-s a
    process here); the kernels' verdict comes from a child of the fork server."""
    code = (
        "import sys, pdserve.cli, pdserve.server.launch, pdserve.model.quantization\n"
        "print(sorted(m for m in sys.modules if m.split('.')[0] == 'torch'))\n"
    )
    out = _python(code)
    assert out.splitlines() == ["[]"]


def test_a_serving_front_end_has_no_torch_mapped(keyed_server: Server) -> None:
    """What it imports while it serves, not only at start: a structured-output request
    (llguidance's tokenizer, transformers) leaves no libtorch in the process."""
    body = {"prompt": "Hi", "max_tokens": 2, "response_format": {"type": "json_object"}}
    status, reply = keyed_server.post("/v1/completions", json.dumps(body).encode())
    assert status == 200, reply
    maps = Path(f"/proc/{keyed_server.proc.pid}/maps").read_text()
    assert "libtorch" not in maps


def _python(code: str) -> str:
    """What `code` prints, run by a fresh interpreter (its own sys.modules)."""
    return subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=60
    ).stdout


def test_the_fork_server_starts_before_the_server_and_torch_load() -> None:
    """`pdserve serve` starts its instances' fork server once its flags are checked
    (cluster/forkserver.py), so the instances' imports run beside the server's: what the
    command has imported by then loads no torch, no engine, no model and no server."""
    code = (
        "import sys, pdserve.cli, pdserve.server.flags, pdserve.cluster.forkserver\n"
        "print(sorted(m for m in sys.modules if m.split('.')[0] in ('torch', 'transformers',"
        " 'fastapi') or m.startswith(('pdserve.engine.core', 'pdserve.engine.engine',"
        " 'pdserve.model.', 'pdserve.server.launch'))))\n"
    )
    out = _python(code)
    assert out.splitlines() == ["[]"]


def test_an_instance_imports_no_compiler() -> None:
    """What every instance imports (the fork server imports it once a server; a Ray actor
    or a spawned rank imports it each) loads neither torch's compiler stack nor a module
    that compiles at import: llguidance.torch applies `torch.compile` to a function as it
    loads, ~6.6 CPU-s on this machine's cores (structured_output.py takes its numpy
    helpers instead)."""
    code = (
        "import sys, pdserve.engine.engine_process, pdserve.engine.engine\n"
        "print(sorted(m for m in sys.modules if m.startswith(("
        "'torch._dynamo', 'torch._inductor', 'llguidance.torch'))))\n"
    )
    out = _python(code)
    assert out.splitlines() == ["[]"]
