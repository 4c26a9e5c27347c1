"""What the simulator serves: arrival times and token lengths, one entry per request.

`sample_workload` draws what `pdserve bench run --workload NAME --seed S
--num-prompts N --request-rate R` sends: both draw lengths through
`pdserve.workload.profiles.draw_lengths` and arrival times through
`pdserve.workload.arrivals.unit_offsets`, so a simulation can be compared request
for request with a measured run. A trace file (the bench's JSONL, parsed by
`pdserve.workload.trace`; the planner needs `input_len` on every line) is fitted by
its empirical distribution: new traces resample its (input, output) pairs, and its
own mean rate is kept unless a rate is given (DistServe §4.1: "fits a distribution
from the history request traces and resamples new traces from the distribution").
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from pdserve.planner.model_spec import PlanInputError
from pdserve.workload.arrivals import ArrivalProcess, unit_offsets
from pdserve.workload.errors import WorkloadInputError
from pdserve.workload.profiles import PROFILE_NAMES, draw_lengths, find_profile
from pdserve.workload.trace import arrival_times, natural_rate, parse_jsonl


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
    profile = find_profile(name_or_file)
    if profile is None:
        raise PlanInputError(
            f"unknown workload {name_or_file!r}: choose from {', '.join(PROFILE_NAMES)}, "
            "or a JSONL trace file"
        )
    drawn = draw_lengths(profile, num_requests, seed)
    inputs = np.asarray(drawn.inputs, dtype=np.int64)
    outputs = np.asarray(drawn.outputs, dtype=np.int64)
    arrivals = _unit_arrivals(num_requests, seed, burstiness)
    return SimWorkload(arrivals, inputs, outputs, name_or_file).with_rate(rate)


def _unit_arrivals(n: int, seed: int, burstiness: float | None) -> np.ndarray:
    try:
        process = (
            ArrivalProcess("poisson") if burstiness is None else ArrivalProcess("gamma", burstiness)
        )
    except WorkloadInputError as e:
        raise PlanInputError(str(e)) from None
    return np.asarray(unit_offsets(n, process, seed), dtype=np.float64)


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
    try:
        rows = parse_jsonl(path, text)
        times = arrival_times(path, rows)
    except WorkloadInputError as e:
        raise PlanInputError(str(e)) from None
    inputs = []
    for row in rows:
        if row.input_len is None:
            raise PlanInputError(
                f"{row.where}: the planner needs 'input_len' (token count) on every line"
            )
        inputs.append(row.input_len)
    outputs = [row.output_len for row in rows]
    rate = None if times is None else natural_rate(times)
    return TraceFit(
        str(path), np.asarray(inputs, dtype=np.int64), np.asarray(outputs, dtype=np.int64), rate
    )
