"""The JSONL trace format, one request per line, parsed once for the bench and the planner:

    {"prompt": "text" | "input_len": 512, "output_len": 128,
     "arrival_time": 0.25, "session_id": "s1"}

exactly one of `prompt` (a non-empty string) and `input_len` (tokens, >= 1);
`output_len` (tokens, >= 1) required; `arrival_time` (seconds, >= 0) on every line
or on none; `session_id` (a string or an integer) optional.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from pdserve.workload.errors import WorkloadInputError


@dataclass(frozen=True)
class TraceRow:
    where: str
    """`path:line`, for messages."""
    output_len: int
    input_len: int | None = None
    """None: the line gives `prompt` instead."""
    prompt: str | None = None
    arrival_time: float | None = None
    session_id: str | int | None = None


def parse_jsonl(path: Path, text: str) -> list[TraceRow]:
    """Every non-blank line of a JSONL trace; WorkloadInputError naming the line."""
    rows = [parse_row(f"{path}:{i}", line) for i, line in enumerate(text.splitlines(), 1)]
    found = [r for r in rows if r is not None]
    if not found:
        raise WorkloadInputError(f"{path}: no requests in the trace")
    return found


def parse_row(where: str, line: str) -> TraceRow | None:
    """One line (None if blank)."""
    if not line.strip():
        return None
    try:
        row = json.loads(line)
    except json.JSONDecodeError as e:
        raise WorkloadInputError(f"{where}: not JSON ({e.msg})") from None
    if not isinstance(row, dict):
        raise WorkloadInputError(f"{where}: expected a JSON object")
    if ("prompt" in row) == ("input_len" in row):
        raise WorkloadInputError(f"{where}: give exactly one of 'prompt' and 'input_len'")
    prompt = row.get("prompt")
    if "prompt" in row and not (isinstance(prompt, str) and prompt):
        raise WorkloadInputError(f"{where}: 'prompt' must be a non-empty string")
    if "output_len" not in row:
        raise WorkloadInputError(
            f"{where}: 'output_len' is required ('output_len' must be an integer >= 1)"
        )
    for key in ("input_len", "output_len"):
        v = row.get(key)
        if key in row and (isinstance(v, bool) or not isinstance(v, int) or v < 1):
            raise WorkloadInputError(f"{where}: {key!r} must be an integer >= 1, got {v!r}")
    t = row.get("arrival_time")
    if t is not None and (isinstance(t, bool) or not isinstance(t, int | float) or t < 0):
        raise WorkloadInputError(f"{where}: 'arrival_time' must be a number >= 0, got {t!r}")
    sid = row.get("session_id")
    if sid is not None and (isinstance(sid, bool) or not isinstance(sid, str | int)):
        raise WorkloadInputError(f"{where}: 'session_id' must be a string or an integer")
    return TraceRow(
        where, row["output_len"], row.get("input_len"), prompt, None if t is None else float(t), sid
    )


def arrival_times(path: Path, rows: list[TraceRow]) -> list[float] | None:
    """The rows' arrival times in row order; None if the trace has none."""
    times = [r.arrival_time for r in rows]
    stamped = [t for t in times if t is not None]
    if not stamped:
        return None
    if len(stamped) < len(times):
        raise WorkloadInputError(f"{path}: arrival_time must be on every line or on none")
    return stamped


def natural_rate(times: list[float]) -> float | None:
    """A trace's own mean rate (requests/s); None if every request arrives at once."""
    span = max(times) - min(times)
    return None if span == 0 else (len(times) - 1) / span
