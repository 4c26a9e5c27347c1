"""`pdserve generate` as a user runs it: a real process on the shipped model."""

from __future__ import annotations

import json
import socket
import subprocess
import sys
from pathlib import Path

from helpers.reference import FRANCE_ANSWERS, resolved_activations

from pdserve.config import EngineConfig


def pdserve(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "pdserve.cli", *args],
        capture_output=True,
        text=True,
        timeout=300,
    )


def test_generate_prints_the_greedy_answer() -> None:
    """The default (int8 activations where they run) answers as llama.cpp does from the
    same file; `--activations fp32` as HF transformers does (helpers/reference.py)."""
    question = ("generate", "What is the capital of France?", "--max-tokens", "32")
    default = resolved_activations(EngineConfig.activations)
    for flags, activations in (((), default), (("--activations", "fp32"), "fp32")):
        proc = pdserve(*question, *flags)
        assert proc.returncode == 0, proc.stderr
        assert proc.stdout == FRANCE_ANSWERS[activations] + "\n", flags


def test_generate_reports_a_missing_model_cleanly(tmp_path) -> None:
    missing = tmp_path / "nope"
    proc = pdserve("generate", "hi", "--model", str(missing))
    assert proc.returncode == 2
    assert proc.stdout == ""
    assert proc.stderr.startswith("pdserve: error: ")
    assert str(missing) in proc.stderr and "Traceback" not in proc.stderr


def test_generate_reports_bad_sampling_values_cleanly() -> None:
    proc = pdserve("generate", "hi", "--temperature", "-1")
    assert proc.returncode == 2
    assert proc.stderr == "pdserve: error: temperature must be at least 0, got -1.0\n"


def test_a_decode_burst_below_one_step_is_a_usage_error() -> None:
    for command in ("generate", "serve"):
        args = ["hi"] if command == "generate" else []
        proc = pdserve(command, *args, "--decode-burst", "0")
        assert proc.returncode == 2, proc.stderr
        assert proc.stderr == "pdserve: error: decode_burst must be an integer >= 1, got 0\n"


def test_engine_cpu_lists_parse_and_bad_ones_are_usage_errors() -> None:
    from pdserve.cli import cpu_list

    assert cpu_list("0") == (0,)
    assert cpu_list("2-4,0, 3") == (0, 2, 3, 4)
    proc = pdserve("serve", "--engine-cpus", "1-x")
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    assert proc.stderr.endswith(
        "error: argument --engine-cpus: '1-x' is not a CPU list like 0 or 0-3,6\n"
    )
    proc = pdserve("serve", "--engine-cpus", "3-1")
    assert proc.stderr.endswith("error: argument --engine-cpus: CPU range '3-1' runs backwards\n")


def test_a_device_torch_cannot_use_is_a_usage_error() -> None:
    """Spelled wrong, or CUDA on this CPU-only build: exit 2 before any model loads,
    naming the flag's value (bench/bench_cuda.py runs --device cuda where there is one)."""
    import torch

    for command in (["generate", "hi"], ["serve"]):
        proc = pdserve(*command, "--device", "tpu")
        assert proc.returncode == 2 and proc.stdout == ""
        assert proc.stderr == "pdserve: error: device must be cpu, cuda or cuda:N, got 'tpu'\n"
    for command in (["generate", "hi"], ["serve"]):
        proc = pdserve(*command, "--device", "cuda:1")
        assert proc.returncode == 2 and proc.stdout == ""
        assert proc.stderr == (
            f"pdserve: error: --device cuda:1: torch {torch.__version__} sees no CUDA device "
            "(a CPU-only build of torch, or no GPU visible to this process)\n"
        )


def test_serve_reports_a_wrong_flag_before_importing_the_server(tmp_path: Path) -> None:
    """Flags wrong by themselves, a placement this machine cannot start or that its flags
    contradict, and a port already in use, are usage errors before
    `pdserve.server.launch` (the front end, FastAPI, the loader and torch: ~5 s) is
    imported (server/flags.py)."""
    code = (
        "import sys\n"
        "from pdserve.cli import main\n"
        "code = main(sys.argv[1:])\n"
        "print(code, 'pdserve.server.launch' in sys.modules, 'torch' in sys.modules)\n"
    )
    cases = {
        ("--device", "tpu"): "device must be cpu, cuda or cuda:N, got 'tpu'",
        ("--decode-burst", "0"): "decode_burst must be an integer >= 1, got 0",
        ("--shutdown-timeout", "-1"): "--shutdown-timeout must be at least 0, got -1.0",
        ("--ray-address", "auto"): "--ray-address needs --ray",
        ("--kv-lease", "1"): "lease_s (1.0) must exceed timeout_s (30.0): a fetch must "
        "never outlive the lease of the KV it reads",
    }
    two_nodes, few_devices = tmp_path / "two_nodes.json", tmp_path / "few_devices.json"
    prefill = {"role": "prefill", "node": 0, "devices": 2, "tp": 2}
    two_nodes.write_text(
        json.dumps({"instances": [prefill, {**prefill, "role": "decode", "node": 1}]})
    )
    few_devices.write_text(json.dumps({"instances": [{**prefill, "devices": 1}]}))
    cases[("--placement", str(two_nodes))] = (
        f"--placement {two_nodes}: instances[1] is on node 1; without --ray every instance "
        "runs on this machine (node 0)"
    )
    cases[("--placement", str(few_devices))] = (
        f"--placement {few_devices}: instances[0]: 2 x 1 ranks need at least 2 devices (one "
        "each), it names 1"
    )
    cases[("--placement", str(two_nodes), "--ray", "--decode-tp", "2")] = (
        "--decode-tp with --placement: the placement names each instance's tp and pp"
    )
    with socket.create_server(("127.0.0.1", 0)) as taken:  # a port someone listens on
        port = str(taken.getsockname()[1])
        cases[("--port", port)] = f"cannot listen on 127.0.0.1:{port}: Address already in use"
        for flags, message in cases.items():
            proc = subprocess.run(
                [sys.executable, "-c", code, "serve", *flags],
                capture_output=True,
                text=True,
                timeout=120,
            )
            assert proc.stdout == "2 False False\n", proc.stderr
            assert proc.stderr == f"pdserve: error: {message}\n"


def test_dtype_serves_fp_weights_and_refuses_quantized_ones() -> None:
    """--dtype bfloat16: `auto` serves the GGUF dequantized to bf16, and the command's
    text is that engine's greedy text, token for token; `gguf` (blocks, computed in fp32)
    is a usage error naming the dtype.

    The reference is the same engine built here, not a fixed string: bf16 products round
    differently on different CPUs (torch takes AVX-512 BF16 or AMX kernels where the CPU
    has them), and this question's first two tokens are near-tied - an Intel Xeon's bf16
    answered "L'Étoile, la Mar" where the AMD machine's answered as fp32 does."""
    import torch

    from pdserve.engine.llm import LLM
    from pdserve.protocol.sampling_params import SamplingParams

    question = "What is the capital of France?"
    proc = pdserve("generate", question, "--dtype", "bfloat16", "--max-tokens", "8")
    assert proc.returncode == 0, proc.stderr
    llm = LLM(dtype="bfloat16")
    weights = {p.dtype for p in llm.engine.core.model.parameters() if p.is_floating_point()}
    assert weights == {torch.bfloat16}
    out = llm.chat(
        [{"role": "user", "content": question}], SamplingParams(max_tokens=8, temperature=0.0)
    )
    assert out.token_ids and proc.stdout == out.text + "\n"
    proc = pdserve("generate", "hi", "--dtype", "bfloat16", "--quantization", "gguf")
    assert proc.returncode == 2
    assert proc.stderr == (
        "pdserve: error: --quantization gguf: the quantized kernels compute in float32 "
        "(dtype bfloat16)\n"
    )


def test_serves_listening_socket_gives_connections_without_nagle() -> None:
    """`serve` binds its socket itself (server/flags.py `listen`); asyncio turns Nagle's
    algorithm off only on sockets that name TCP as their protocol. With it on, every
    streamed reply waited ~40 ms for a delayed ACK (bench/bench_server.py's added TTFT
    went 4 -> 50 ms)."""
    import asyncio

    from pdserve.server.flags import listen

    async def accepted_nodelay() -> int:
        seen: asyncio.Future[int] = asyncio.get_running_loop().create_future()

        def on_connect(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            sock = writer.get_extra_info("socket")
            seen.set_result(sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY))
            writer.close()

        sock = listen("127.0.0.1", 0)
        server = await asyncio.start_server(on_connect, sock=sock)
        async with server:
            _, writer = await asyncio.open_connection(*sock.getsockname()[:2])
            value = await asyncio.wait_for(seen, 10)
            writer.close()
        return value

    assert asyncio.run(accepted_nodelay()) == 1
