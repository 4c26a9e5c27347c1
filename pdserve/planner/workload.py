"""What the simulator serves: arrival times and token lengths, one entry per request.

`sample_workload` draws exactly what `pdserve bench run --workload NAME --seed S
--num-prompts N --request-rate R` sends (same generators, same order of draws), so
a simulation can be compared request for request with a measured run. A trace file
(the bench's JSONL: `input_len`, `output_len`, optional `arrival_time`) is fitted by
its empirical distribution: new traces resample its (input, output) pairs, and its
own mean rate is kept unless a rate is given (DistServe §4.1: "fits a distribution
from the history request traces and resamples new traces from the distribution").
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from pdserve.bench.arrivals import unit_offsets
from pdserve.bench.config import ArrivalConfig, BenchInputError
from pdserve.bench.workloads.synthetic import PROFILES, TETRI_CLASSES, LengthProfile, tetri_profile
from pdserve.planner.model_spec import PlanInputError


@dataclass(frozen=True, eq=False)
class SimWorkload:
    arrivals: np.ndarray  # seconds from the start, non-decreasing
    input_lens: np.ndarray  # prompt tokens, >= 1
    output_lens: np.ndarray  # generated tokens, >= 1 (the first comes from the prefill)
    name: str = "workload"
    rate: float = 1.0  # the rate `arrivals` are drawn at; `with_rate` rescales from it

    def __post_init__(self) -> None:
        n = len(self.arrivals)
        if n == 0:
            raise PlanInputError(f"workload {self.name!r} has no requests")
        if len(self.input_lens) != n or len(self.output_lens) != n:
            raise PlanInputError(f"workload {self.name!r}: arrivals and lengths differ in count")
        if np.any(np.diff(self.arrivals) < 0):
            raise PlanInputError(f"workload {self.name!r}: arrival times must not decrease")
        if self.input_lens.min() < 1 or self.output_lens.min() < 1:
            raise PlanInputError(f"workload {self.name!r}: every length must be >= 1 token")

    def __len__(self) -> int:
        return len(self.arrivals)

    def with_rate(self, rate: float) -> SimWorkload:
        """The same arrival pattern stretched to `rate` requests/s."""
        if not rate > 0:
            raise PlanInputError(f"rate must be > 0, got {rate}")
        return dataclasses.replace(self, arrivals=self.arrivals * (self.rate / rate), rate=rate)


def profile_of(name: str) -> LengthProfile:
    if name in PROFILES:
        return PROFILES[name]
    upper = {k.lower(): k for k in TETRI_CLASSES}
    if name.lower() in upper:
        return tetri_profile(upper[name.lower()])
    known = ", ".join([*PROFILES, *TETRI_CLASSES])
    raise PlanInputError(f"unknown workload {name!r}: choose from {known}, or a JSONL trace file")


def sample_workload(
    name_or_file: str,
    num_requests: int,
    rate: float,
    seed: int = 0,
    burstiness: float | None = None,
) -> SimWorkload:
    """`num_requests` requests of a bench workload (or resampled from a trace) at `rate`."""
    if num_requests < 1:
        raise PlanInputError(f"number of requests must be >= 1, got {num_requests}")
    path = Path(name_or_file)
    if path.suffix in (".jsonl", ".json") or path.is_file():
        return fit_trace(path).sample(num_requests, seed, rate, burstiness)
    profile = profile_of(name_or_file)
    rng = np.random.default_rng(seed)  # as pdserve.bench's profile_workload draws
    inputs = np.asarray(profile.input.sample(rng, num_requests), dtype=np.int64)
    outputs = np.asarray(profile.output.sample(rng, num_requests), dtype=np.int64)
    arrivals = _unit_arrivals(num_requests, seed, burstiness)
    return SimWorkload(arrivals, inputs, outputs, name_or_file).with_rate(rate)


def _unit_arrivals(n: int, seed: int, burstiness: float | None) -> np.ndarray:
    try:
        config = (
            ArrivalConfig("poisson") if burstiness is None else ArrivalConfig("gamma", burstiness)
        )
    except BenchInputError as e:
        raise PlanInputError(str(e)) from None
    return np.asarray(unit_offsets(n, config, seed), dtype=np.float64)


@dataclass(frozen=True)
class TraceFit:
    """A trace's empirical (input, output) pairs and its mean arrival rate."""

    path: str
    input_lens: np.ndarray
    output_lens: np.ndarray
    rate: float | None

    def sample(
        self, n: int, seed: int, rate: float | None = None, burstiness: float | None = None
    ) -> SimWorkload:
        rng = np.random.default_rng([seed, 0x7ACE])
        pick = rng.integers(0, len(self.input_lens), size=n)
        target = rate if rate is not None else self.rate
        if target is None:
            raise PlanInputError(f"{self.path}: the trace has no arrival_time; give a rate")
        w = SimWorkload(
            _unit_arrivals(n, seed, burstiness),
            self.input_lens[pick],
            self.output_lens[pick],
            f"trace {Path(self.path).name}",
        )
        return w.with_rate(target)


def fit_trace(path: Path) -> TraceFit:
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as e:
        raise PlanInputError(f"{path}: cannot read trace ({e})") from None
    inputs, outputs, times = [], [], []
    for lineno, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        i, o, t = _trace_row(path, lineno, line)
        inputs.append(i)
        outputs.append(o)
        times.append(t)
    if not inputs:
        raise PlanInputError(f"{path}: no requests in the trace")
    if any(t is None for t in times) and any(t is not None for t in times):
        raise PlanInputError(f"{path}: arrival_time must be on every line or on none")
    rate = None
    stamps = sorted(t for t in times if t is not None)
    if len(stamps) >= 2 and stamps[-1] > stamps[0]:
        rate = (len(stamps) - 1) / (stamps[-1] - stamps[0])
    return TraceFit(
        str(path), np.asarray(inputs, dtype=np.int64), np.asarray(outputs, dtype=np.int64), rate
    )


def _trace_row(path: Path, lineno: int, line: str) -> tuple[int, int, float | None]:
    where = f"{path}:{lineno}"
    try:
        row = json.loads(line)
    except json.JSONDecodeError as e:
        raise PlanInputError(f"{where}: not JSON ({e.msg})") from None
    if not isinstance(row, dict):
        raise PlanInputError(f"{where}: expected a JSON object")
    if "input_len" not in row:
        raise PlanInputError(f"{where}: the planner needs 'input_len' (token count) on every line")
    values = []
    for key in ("input_len", "output_len"):
        v = row.get(key)
        if isinstance(v, bool) or not isinstance(v, int) or v < 1:
            raise PlanInputError(f"{where}: {key!r} must be an integer >= 1, got {v!r}")
        values.append(v)
    t = row.get("arrival_time")
    if t is not None and (isinstance(t, bool) or not isinstance(t, int | float) or t < 0):
        raise PlanInputError(f"{where}: 'arrival_time' must be a number >= 0, got {t!r}")
    return values[0], values[1], None if t is None else float(t)
