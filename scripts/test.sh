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
PYTHONPATH="tests/plugins${PYTHONPATH:+:$PYTHONPATH}" .venv/bin/python -m pytest -p no_skips -q --durations=25 "$@"
