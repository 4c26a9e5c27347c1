"""Everything one command runs: every server at every rate, interleaved, then the search.

Order: for each rate, for each repeat, each server in turn (A, B, A, B ...), so that
drift of a shared machine hits all servers alike; then the goodput searches advance
one run per server per step. The results document is handed to `save` after every
run, so a run cut short still leaves everything measured so far.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np
from tqdm import tqdm

from pdserve.bench import client, results
from pdserve.bench.config import (
    SLO,
    ArrivalConfig,
    BenchInputError,
    PlanConfig,
    RequestOptions,
    SearchConfig,
    Target,
)
from pdserve.bench.metrics import attainment
from pdserve.bench.records import RequestRecord
from pdserve.bench.runner import RunSettings, run_workload
from pdserve.bench.search import GoodputSearch
from pdserve.bench.tokens import PromptFactory
from pdserve.bench.workloads.spec import Session, Workload, single_turn_order
from pdserve.workload import arrivals


@dataclass(frozen=True)
class Experiment:
    targets: tuple[Target, ...]
    workload: Workload
    arrival: ArrivalConfig
    options: RequestOptions
    plan: PlanConfig
    slo: SLO
    search: SearchConfig
    seed: int = 0
    settings: dict[str, Any] = field(default_factory=dict)
    """The command's settings, echoed into the results file."""

    def rates(self) -> tuple[float | None, ...]:
        """The sweep's rates; none given: a trace's own rate, else all at once."""
        if self.plan.rates:
            return self.plan.rates
        return (self.workload.trace_rate,)


@dataclass
class _Target:
    target: Target
    model: str | None
    num_instances: int
    card: dict[str, Any] | None


async def run_experiment(
    exp: Experiment,
    factory: PromptFactory,
    save: Callable[[dict[str, Any]], None],
    progress: bool = True,
) -> dict[str, Any]:
    rates = exp.rates()
    if exp.plan.search_goodput and (not exp.slo.is_set or any(r is None for r in rates)):
        raise BenchInputError("--search-goodput needs an SLO (--slo) and finite request rates")
    doc = results.new_document(exp.settings, exp.workload, exp.slo, exp.search)
    infos = [await _probe(t) for t in exp.targets]
    doc["targets"] = [
        results.target_json(i.target, i.model, i.num_instances, i.card) for i in infos
    ]
    save(doc)
    for info in infos:
        await _warmup(exp, info, factory)
    unit = _unit_offsets(exp)
    runner = _PointRunner(exp, factory, unit, doc, save, progress)
    for rate in rates:
        for rep in range(exp.plan.repeats):
            for info in infos:
                await runner.run(info, rate, rep, "sweep")
    if exp.plan.search_goodput:
        await _search(exp, infos, runner)
    results.finish(doc, exp.slo, exp.search, exp.plan.slo_scales)
    doc["complete"] = True
    save(doc)
    return doc


async def _probe(t: Target) -> _Target:
    async with client.new_session(None) as http:
        card = await client.model_card(http, t)
    model = t.model or (str(card["id"]) if card and "id" in card else None)
    reported = card.get("num_instances") if card else None
    n = t.num_instances or (int(reported) if isinstance(reported, int) and reported > 0 else 1)
    return _Target(t, model, n, card)


def _unit_offsets(exp: Experiment) -> np.ndarray:
    w = exp.workload
    if w.unit_offsets is not None:
        return np.asarray(w.unit_offsets, dtype=float)
    return arrivals.unit_offsets(w.num_requests, exp.arrival, exp.seed)


async def _warmup(exp: Experiment, info: _Target, factory: PromptFactory) -> None:
    """A few requests one at a time before measuring (records discarded)."""
    n = min(exp.plan.num_warmups, len(exp.workload.sessions))
    if n <= 0:
        return
    firsts = tuple(
        Session(i, s.turns[:1], s.context, s.context_tokens)
        for i, s in enumerate(exp.workload.sessions[:n])
    )
    w = Workload("warmup", firsts, single_turn_order(n))
    settings = RunSettings(info.target, info.model, exp.options, 1, exp.seed)
    await run_workload(w, np.zeros(n), settings, factory)


class _PointRunner:
    def __init__(
        self,
        exp: Experiment,
        factory: PromptFactory,
        unit: np.ndarray,
        doc: dict[str, Any],
        save: Callable[[dict[str, Any]], None],
        progress: bool,
    ) -> None:
        self.exp, self.factory, self.unit = exp, factory, unit
        self.doc, self.save, self.progress = doc, save, progress
        self.records: dict[tuple[str, float | None], list[RequestRecord]] = {}

    async def run(self, info: _Target, rate: float | None, repeat: int, phase: str) -> float:
        """One run; returns the attainment over every run so far at this (server, rate)."""
        exp = self.exp
        settings = RunSettings(
            info.target, info.model, exp.options, exp.arrival.max_concurrency, exp.seed
        )
        offsets = arrivals.offsets_at(self.unit, rate)
        desc = f"{info.target.label} @ {results.rate_text(rate)} req/s"
        total = exp.workload.num_requests
        with tqdm(total=total, desc=desc, disable=not self.progress, unit="req") as bar:
            outcome = await run_workload(
                exp.workload, offsets, settings, self.factory, lambda r: bar.update(1)
            )
        results.add_run(self.doc, info.target.label, rate, repeat, phase, outcome, exp.slo)
        self.save(self.doc)
        pooled = self.records.setdefault((info.target.label, rate), [])
        pooled.extend(outcome.records)
        return attainment(pooled, exp.slo)


async def _search(exp: Experiment, infos: list[_Target], runner: _PointRunner) -> None:
    searches = {i.target.label: GoodputSearch(exp.search) for i in infos}
    for (label, rate), recs in runner.records.items():
        if rate is not None:
            searches[label].observe(rate, attainment(recs, exp.slo))
    active = list(infos)
    while active:
        for info in list(active):
            search = searches[info.target.label]
            rate = search.next_rate()
            if rate is None:
                active.remove(info)
                continue
            search.observe(rate, await runner.run(info, rate, 0, "search"))
    for info in infos:
        results.add_goodput(
            runner.doc,
            info.target.label,
            searches[info.target.label].result(),
            info.num_instances,
            exp.search,
        )
