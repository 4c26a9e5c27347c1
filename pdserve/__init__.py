"""pdserve: disaggregated prefill/decode LLM serving."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from pdserve.version import __version__

if TYPE_CHECKING:
    from pdserve.engine.llm import LLM
    from pdserve.protocol.sampling_params import SamplingParams

__all__ = ["LLM", "SamplingParams", "__version__"]


def __getattr__(name: str) -> Any:
    # Lazy so that `import pdserve` stays cheap (torch is imported on first use).
    if name == "LLM":
        from pdserve.engine.llm import LLM

        return LLM
    if name == "SamplingParams":
        from pdserve.protocol.sampling_params import SamplingParams

        return SamplingParams
    raise AttributeError(name)
