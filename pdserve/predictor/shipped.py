"""The length heads shipped with the package (`heads/`), by the model file each was
trained for, and `resolve_predictor`: the head file `--predictor` names."""

from __future__ import annotations

from pathlib import Path

SHIPPED_DIR = Path(__file__).parent / "heads"
SHIPPED_HEADS = {"SmolLM2-135M-Instruct.Q4_1.gguf": "smollm2-135m-instruct.safetensors"}


def resolve_predictor(choice: str, model: str | None) -> str | None:
    """The head file `--predictor` names: "none" -> None; "auto" -> the head shipped for
    the model's file, None when none is; anything else is a path (checked at load)."""
    if choice == "none":
        return None
    if choice != "auto":
        return choice
    from pdserve.model.source import resolve_model

    name = SHIPPED_HEADS.get(resolve_model(model).name)
    path = SHIPPED_DIR / name if name is not None else None
    return str(path) if path is not None and path.is_file() else None
