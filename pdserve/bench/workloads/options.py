"""The workload knobs from the command line, in one frozen dataclass."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class WorkloadOptions:
    name: str = "random"
    num_prompts: int = 200
    """Requests in the workload (for sessions: turns in all, the last session cut short)."""
    seed: int = 0
    random_input_len: int = 1024
    """random: prompt tokens after the shared prefix (vLLM's meaning)."""
    random_output_len: int = 128
    random_range_ratio: float = 0.0
    """random: lengths uniform in [len * (1 - r), len * (1 + r)]."""
    random_prefix_len: int = 0
    """random: tokens of one prefix shared by every prompt."""
    session_style: str = "chat"
    """sessions: chat (ShareGPT), docqa (LooGLE) or react (ReAct)."""
    share_ratio: int = 1
    """sessions: each drawn session is sent this many times, as distinct sessions with the
    same context and turns (MemServe Fig. 14's share ratio: K sessions per document)."""
    session_turns: int | None = None
    """sessions: exactly this many turns per session instead of the style's count (a
    session still ends early at the context budget)."""
    dataset_path: str | None = None
    """file: a JSONL trace or a ShareGPT JSON file."""
    multi_turn: bool = False
    """file (ShareGPT): every conversation as a session instead of its first turn only."""
    sharegpt_output_len: int | None = None
    """file (ShareGPT): fixed output length instead of the recorded answer's."""
