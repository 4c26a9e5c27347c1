#!/usr/bin/env bash
# Install everything (see setup.sh), then lint, type-check and run the test suite.
# Every test must run: a skipped, xfailed or xpassed test fails the run
# (tests/plugins/no_skips.py); a test that hangs fails after the per-test timeout in
# pyproject.toml, printing every thread's stack.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh --dev
.venv/bin/ruff check pdserve tests bench
.venv/bin/ruff format --check pdserve tests bench
.venv/bin/mypy
export PYTHONPATH="tests/plugins${PYTHONPATH:+:$PYTHONPATH}"
.venv/bin/python -m pytest -p no_skips -q --durations=25 "$@"
if [ $# -eq 0 ]; then
    # The fallback path, as on a machine where the kernels could not be built: the engine
    # and server tests again with them turned off (a quantized GGUF is then served as
    # fp32; the tests of the compiled path itself, marked `kernels`, are deselected by
    # tests/conftest.py). `PDSERVE_NO_KERNELS=1 bash .ci/run` runs the whole suite so.
    PDSERVE_NO_KERNELS=1 .venv/bin/python -m pytest -p no_skips -q \
        tests/test_engine_tiny.py tests/test_engine_schedules.py tests/test_engine_process.py \
        tests/test_server.py tests/test_quant_model.py
fi
