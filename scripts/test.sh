#!/usr/bin/env bash
# Install everything (see setup.sh), then lint, type-check and run the test suite.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh --dev
.venv/bin/ruff check pdserve tests bench
.venv/bin/ruff format --check pdserve tests bench
.venv/bin/mypy
.venv/bin/python -m pytest -q "$@"
