"""What a model of given sizes can be split into, as plain numbers: the one rule the
engine splits by (`parallel.layout.split_model`) and the planner searches and prices
under (planner/candidates.py, planner/latency.py). Imports nothing, so the planner (and
the server's flag checks before the model loads) can use it without the model's modules.
"""

from __future__ import annotations

# A quantized weight's rows are cut only between blocks of this many values.
COLUMN_BLOCK = 32


def largest_part(n: int, parts: int) -> int:
    """The largest of `parts` contiguous runs `n` items are dealt into (the first ones,
    one larger where they do not divide): what the slowest rank or stage holds."""
    return -(-n // parts)


def split_problem(kv_heads: int, intermediate: int, layers: int, tp: int, pp: int) -> str | None:
    """Why a model of `kv_heads` KV heads, `intermediate` MLP columns and `layers` layers
    cannot be split into `pp` stages of `tp` tensor ranks; None when it can. The one rule
    `split_model` applies and the planner searches under (planner/candidates.py)."""
    if pp > layers:
        return (
            f"--pipeline-parallel-size {pp} is more than the model's {layers} layers: each "
            "stage holds at least one"
        )
    if tp > kv_heads:
        return (
            f"--tensor-parallel-size {tp} is more than the model's {kv_heads} KV heads: each "
            "rank holds whole GQA groups (a KV head and its query heads)"
        )
    if intermediate % COLUMN_BLOCK or intermediate // COLUMN_BLOCK < tp:
        return (
            f"--tensor-parallel-size {tp}: the MLP's {intermediate} intermediate columns do "
            f"not split into {tp} runs of whole {COLUMN_BLOCK}-column blocks"
        )
    return None
