"""`file`: a JSONL trace the user brings, or a ShareGPT JSON file.

JSONL, one request per line, parsed by `pdserve.workload.trace`:
    {"prompt": "text" | "input_len": 512, "output_len": 128,
     "arrival_time": 0.25, "session_id": "s1"}
`prompt` or `input_len` (a word prompt of exactly that many tokens is made);
`output_len` is required; `arrival_time` (seconds) on every line or on none;
lines with the same `session_id` are sent one after another, each after the
previous response (their prompts are taken as written: they already hold the
history).

ShareGPT (a JSON list of {"conversations": [{"from": "human"|"gpt", "value": ...}]}):
the first human turn with the length of the answer that follows it, filtered as
vLLM's benchmark does; with --multi-turn every conversation is a session whose
later prompts carry the generated answers (MemServe §8.2).
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from pdserve.bench.config import BenchInputError
from pdserve.bench.tokens import PromptFactory
from pdserve.bench.workloads.options import WorkloadOptions
from pdserve.bench.workloads.spec import Session, Turn, Workload, interleave, single_turn_order
from pdserve.workload.trace import TraceRow, arrival_times, natural_rate, parse_jsonl

# vLLM's ShareGPT filter: drop tiny and overlong samples (2,048-token context).
MIN_LEN, MAX_PROMPT, MAX_TOTAL = 4, 1024, 2048


def file_workload(opts: WorkloadOptions, factory: PromptFactory) -> Workload:
    if not opts.dataset_path:
        raise BenchInputError("--workload file needs --dataset-path (a JSONL trace or ShareGPT)")
    path = Path(opts.dataset_path)
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as e:
        raise BenchInputError(f"{path}: cannot read ({e})") from None
    if text.lstrip().startswith("["):
        return _sharegpt(path, text, opts, factory)
    return _jsonl(path, text, opts, factory)


# ---- JSONL traces -------------------------------------------------------------------


def _jsonl(path: Path, text: str, opts: WorkloadOptions, factory: PromptFactory) -> Workload:
    rng = np.random.default_rng(opts.seed)
    rows = parse_jsonl(path, text)[: opts.num_prompts]
    times = arrival_times(path, rows)
    unit, rate = None, None
    if times is not None:
        by_time = sorted(range(len(rows)), key=times.__getitem__)  # stable: ties keep file order
        rows = [rows[i] for i in by_time]
        sorted_times = [times[i] for i in by_time]
        unit, rate = _unit_offsets(sorted_times), natural_rate(sorted_times)
    turns = [_turn(r, factory, rng) for r in rows]
    sessions, order = _group(rows, turns)
    params = {"path": str(path), "format": "jsonl", "requests": len(rows)}
    return Workload("file", sessions, order, unit, params, trace_rate=rate)


def _turn(row: TraceRow, factory: PromptFactory, rng: np.random.Generator) -> Turn:
    if row.prompt is not None:
        return Turn(row.prompt, factory.count(row.prompt), row.output_len)
    assert row.input_len is not None  # a row has exactly one of the two
    p = factory.prompt(rng, row.input_len)
    return Turn(p.text, p.num_tokens, row.output_len)


def _group(
    rows: list[TraceRow], turns: list[Turn]
) -> tuple[tuple[Session, ...], tuple[tuple[int, int], ...]]:
    """Lines with one session_id become one session, in file order; the arrival order
    stays the file's."""
    index: dict[object, int] = {}
    members: list[list[Turn]] = []
    order: list[tuple[int, int]] = []
    for i, (row, turn) in enumerate(zip(rows, turns, strict=True)):
        key = ("line", i) if row.session_id is None else row.session_id
        if key not in index:
            index[key] = len(members)
            members.append([])
        s = index[key]
        order.append((s, len(members[s])))
        members[s].append(turn)
    sessions = tuple(Session(i, tuple(ts)) for i, ts in enumerate(members))
    return sessions, tuple(order)


def _unit_offsets(times: list[float]) -> tuple[float, ...]:
    """The trace's arrival pattern rescaled to 1 request/s (the rate flags rescale it;
    without them it is replayed at its own rate, see `natural_rate`)."""
    t0 = min(times)
    span = max(times) - t0
    if span == 0:
        return tuple(0.0 for _ in times)
    rate = (len(times) - 1) / span
    return tuple((t - t0) * rate for t in times)


# ---- ShareGPT ---------------------------------------------------------------------


def _sharegpt(path: Path, text: str, opts: WorkloadOptions, factory: PromptFactory) -> Workload:
    try:
        data = json.loads(text)
    except json.JSONDecodeError as e:
        raise BenchInputError(f"{path}: not JSON ({e.msg} at line {e.lineno})") from None
    convs = [_conversation(path, i, d) for i, d in enumerate(data)]
    rng = np.random.default_rng(opts.seed)
    rng.shuffle(convs)
    sessions: list[Session] = []
    count = 0
    for conv in convs:
        if count >= opts.num_prompts:
            break
        turns = _sharegpt_turns(conv, opts, factory)
        if turns:
            turns = turns[: opts.num_prompts - count]
            sessions.append(Session(len(sessions), tuple(turns)))
            count += len(turns)
    if not sessions:
        raise BenchInputError(f"{path}: no conversation passes the length filter")
    frozen = tuple(sessions)
    order = interleave(frozen, rng) if opts.multi_turn else single_turn_order(len(frozen))
    params = {"path": str(path), "format": "sharegpt", "multi_turn": opts.multi_turn}
    return Workload("file", frozen, order, None, params)


def _conversation(path: Path, i: int, item: object) -> list[tuple[str, str]]:
    where = f"{path}: conversation {i}"
    if not isinstance(item, dict) or not isinstance(item.get("conversations"), list):
        raise BenchInputError(f"{where}: expected an object with a 'conversations' list")
    turns = []
    for t in item["conversations"]:
        if not (isinstance(t, dict) and isinstance(t.get("from"), str)):
            raise BenchInputError(f"{where}: each turn needs 'from' and 'value'")
        if not isinstance(t.get("value"), str):
            raise BenchInputError(f"{where}: each turn needs 'from' and 'value'")
        turns.append((t["from"], t["value"]))
    return turns


def _sharegpt_turns(
    conv: list[tuple[str, str]], opts: WorkloadOptions, factory: PromptFactory
) -> list[Turn]:
    """(human, gpt) pairs from the start; first pair only unless --multi-turn."""
    turns: list[Turn] = []
    total = 0
    for k in range(0, len(conv) - 1, 2):
        (who, ask), (who2, answer) = conv[k], conv[k + 1]
        if who != "human" or who2 != "gpt":
            break
        n_in = factory.count(ask)
        n_out = opts.sharegpt_output_len or factory.count(answer) - factory.special
        total += n_in + n_out
        if n_in < MIN_LEN or n_out < MIN_LEN or n_in > MAX_PROMPT or total > MAX_TOTAL:
            break
        turns.append(Turn(ask, n_in, n_out))
        if not opts.multi_turn:
            break
    return turns
