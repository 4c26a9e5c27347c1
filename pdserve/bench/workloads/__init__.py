"""Workloads by name: `build_workload(options, factory)`."""

from __future__ import annotations

from collections.abc import Callable

from pdserve.bench.config import BenchInputError
from pdserve.bench.tokens import PromptFactory
from pdserve.bench.workloads.options import WorkloadOptions
from pdserve.bench.workloads.sessions import sessions_workload
from pdserve.bench.workloads.spec import Session, Turn, Workload
from pdserve.bench.workloads.synthetic import profile_workload, random_workload
from pdserve.bench.workloads.trace import file_workload
from pdserve.workload.errors import WorkloadInputError
from pdserve.workload.profiles import PROFILES, TETRI_CLASSES, tetri_profile

Builder = Callable[[WorkloadOptions, PromptFactory], Workload]


def _profile(name: str) -> Builder:
    return lambda opts, factory: profile_workload(name, PROFILES[name], opts, factory)


def _tetri(name: str) -> Builder:
    return lambda opts, factory: profile_workload(name, tetri_profile(name), opts, factory)


WORKLOADS: dict[str, Builder] = {
    "random": random_workload,
    **{name: _profile(name) for name in PROFILES},
    **{name: _tetri(name) for name in TETRI_CLASSES},
    "sessions": sessions_workload,
    "file": file_workload,
}
_ALIASES = {"sharegpt": "file", **{n.lower(): n for n in TETRI_CLASSES}}


def canonical_name(name: str) -> str:
    """The workload's registered name; BenchInputError naming the choices otherwise."""
    found = name if name in WORKLOADS else _ALIASES.get(name.lower())
    if found is None:
        raise BenchInputError(f"unknown workload {name!r}; choose from {', '.join(WORKLOADS)}")
    return found


def build_workload(opts: WorkloadOptions, factory: PromptFactory) -> Workload:
    if opts.num_prompts < 1:
        raise BenchInputError(f"--num-prompts must be >= 1, got {opts.num_prompts}")
    try:
        return WORKLOADS[canonical_name(opts.name)](opts, factory)
    except BenchInputError:
        raise
    except WorkloadInputError as e:  # from pdserve.workload: a trace line, a length range
        raise BenchInputError(str(e)) from None


__all__ = [
    "WORKLOADS",
    "Session",
    "Turn",
    "Workload",
    "WorkloadOptions",
    "build_workload",
    "canonical_name",
]
