"""Prometheus metrics of the HTTP frontend (prometheus-client, one registry per app).

Request outcomes and latencies are observed here when a request ends; the front end's
counters (faults, caching, predictions, flips) are read from their objects at scrape
time; engine gauges
(running / waiting requests, KV usage, prefix-cache hit rate) are read from the
engine process at scrape time, so they are never stale.
"""

from __future__ import annotations

from collections.abc import Iterator

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from pdserve.cluster.faults import FaultCounters
from pdserve.cluster.routing import Router
from pdserve.cluster.watcher import Watcher
from pdserve.predictor.confusion import PredictionCounters
from pdserve.protocol.core import EngineStats, WeightsInfo
from pdserve.protocol.prediction import LengthPrediction
from pdserve.text.outputs import RequestOutput

_LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120)


class ServerMetrics:
    def __init__(self) -> None:
        self.registry = r = CollectorRegistry()
        self.requests = Counter(
            "pdserve_requests", "Finished requests by outcome", ["outcome"], registry=r
        )
        self.prompt_tokens = Counter("pdserve_prompt_tokens", "Prompt tokens", registry=r)
        self.generation_tokens = Counter(
            "pdserve_generation_tokens", "Generated tokens", registry=r
        )
        self.ttft = self._hist("pdserve_time_to_first_token_seconds", "Time to first token")
        self.tpot = self._hist(
            "pdserve_time_per_output_token_seconds", "Mean inter-token time of a request"
        )
        self.e2e = self._hist("pdserve_e2e_request_latency_seconds", "End-to-end latency")
        self.queue = self._hist("pdserve_queue_time_seconds", "Time waiting to be scheduled")
        self.running = Gauge("pdserve_num_requests_running", "Requests holding KV", registry=r)
        self.waiting = Gauge("pdserve_num_requests_waiting", "Queued requests", registry=r)
        self.kv_usage = Gauge(
            "pdserve_kv_cache_usage_ratio", "Used / total device KV blocks", registry=r
        )
        self.hit_rate = Gauge(
            "pdserve_prefix_cache_hit_rate",
            "Prompt tokens served from the prefix cache / prompt tokens",
            registry=r,
        )
        self.engine_stats: EngineStats | None = None  # the last scrape's, for the counters
        r.register(_StepCollector(self))

    def _hist(self, name: str, doc: str) -> Histogram:
        return Histogram(name, doc, buckets=_LATENCY_BUCKETS, registry=self.registry)

    def finished(self, out: RequestOutput) -> None:
        self.requests.labels(out.finish_reason or "unknown").inc()
        self.prompt_tokens.inc(len(out.prompt_token_ids))
        self.generation_tokens.inc(len(out.token_ids))
        m = out.metrics
        if m is None:
            return
        for hist, value in ((self.ttft, m.ttft), (self.e2e, m.e2e), (self.queue, m.queue_time)):
            if value is not None:
                hist.observe(value)
        if m.decode_time is not None and len(out.token_ids) > 1:
            self.tpot.observe(m.decode_time / (len(out.token_ids) - 1))

    def describe_weights(self, weights: WeightsInfo) -> None:
        """pdserve_model_weights_info{quantization, formats, activations, kv_cache_dtype}
        1: what the engine reads, how its projections take activations, and what its KV
        pool holds."""
        Gauge(
            "pdserve_model_weights_info",
            "How the served weights are held (formats: what the projections read; "
            "activations: how they take them; kv_cache_dtype: what the KV cache holds)",
            ["quantization", "formats", "activations", "kv_cache_dtype"],
            registry=self.registry,
        ).labels(
            weights.quantization,
            ",".join(weights.formats),
            ",".join(weights.activations),
            weights.kv_cache_dtype,
        ).set(1)

    def watch_faults(self, faults: FaultCounters) -> None:
        """Export the front end's failure counters (read at every scrape)."""
        self.registry.register(_FaultCollector(faults))

    def watch_cache(self, router: Router) -> None:
        """Export routing, prompt-tree and KV-return counters (read at every scrape)."""
        self.registry.register(_CacheCollector(router))

    def watch_elastic(self, watcher: Watcher) -> None:
        """Export instance flips, the watcher's decisions and each instance's role (read
        at every scrape; docs/elastic.md)."""
        self.registry.register(_ElasticCollector(watcher))

    def watch_predictions(self, predictions: PredictionCounters) -> None:
        """Export the length predictions' confusion counts (read at every scrape)."""
        self.registry.register(_PredictionCollector(predictions))

    def render(self, stats: EngineStats | None) -> bytes:
        self.engine_stats = stats
        if stats is not None:
            self.running.set(stats.num_running)
            self.waiting.set(stats.num_waiting + stats.num_swapped)
            total = stats.num_free_blocks + stats.num_used_blocks + stats.num_cached_blocks
            self.kv_usage.set(stats.num_used_blocks / total if total else 0.0)
            queries = stats.prefix_cache_queries
            self.hit_rate.set(stats.prefix_cache_hits / queries if queries else 0.0)
        return generate_latest(self.registry)


class _StepCollector(Collector):
    """The engines' step counters from the stats of the scrape (none when no engine
    answered): forward steps, and those run inside decode bursts (engine/core.py)."""

    def __init__(self, metrics: ServerMetrics) -> None:
        self.metrics = metrics

    def collect(self) -> Iterator[Metric]:
        stats = self.metrics.engine_stats
        if stats is None:
            return
        yield CounterMetricFamily(
            "pdserve_engine_steps",
            "Forward steps the engines ran (a decode burst's steps one by one)",
            value=stats.num_steps,
        )
        yield CounterMetricFamily(
            "pdserve_decode_burst_steps",
            "Steps that ran inside decode bursts (several greedy steps in one call)",
            value=stats.num_burst_steps,
        )


class _FaultCollector(Collector):
    """The front end's failure counters (`FaultCounters`), read at scrape: Prometheus
    counters over the live object, so nothing is copied per event."""

    def __init__(self, faults: FaultCounters) -> None:
        self.faults = faults

    def collect(self) -> Iterator[Metric]:
        f = self.faults
        for name, doc, value in (
            ("pdserve_migrations", "Requests moved off a failed instance", f.migrations),
            (
                "pdserve_resumed_from_replica",
                "Migrations that continued from replicated KV",
                f.resumed_from_replica,
            ),
            (
                "pdserve_recomputed_on_prefill",
                "Moves whose tokens a prefill instance recomputed and handed off",
                f.recomputed_on_prefill,
            ),
            (
                "pdserve_recomputed_tokens",
                "Tokens whose KV a migration or retry computed again",
                f.recomputed_tokens,
            ),
            ("pdserve_handoff_retries", "Requests run again after a failed KV hand-off", f.retries),
            (
                "pdserve_failed_requests",
                "Requests ended by an instance or transfer failure",
                f.failed,
            ),
        ):
            yield CounterMetricFamily(name, doc, value=value)
        by_role = CounterMetricFamily(
            "pdserve_instance_failures", "Instances that failed, by role", labels=["role"]
        )
        for role, count in sorted(f.instance_failures.items()):
            by_role.add_metric([role], count)
        yield by_role
        restarts = CounterMetricFamily(
            "pdserve_instance_restarts",
            "Failed instances started again (--ray-restart), by role",
            labels=["role"],
        )
        for role, count in sorted(f.instance_restarts.items()):
            restarts.add_metric([role], count)
        yield restarts


class _ElasticCollector(Collector):
    """Flips by direction, the last flip's phases, the watcher's decisions by outcome,
    instances added and removed, and the role each instance holds now (cluster/flip.py,
    cluster/scaling.py, cluster/watcher.py)."""

    def __init__(self, watcher: Watcher) -> None:
        self.watcher = watcher

    def collect(self) -> Iterator[Metric]:
        reports = self.watcher.flip.reports
        flips = CounterMetricFamily(
            "pdserve_instance_flips", "Instance flips done, by direction", labels=["from", "to"]
        )
        directions: dict[tuple[str, str], int] = {}
        for r in reports:
            key = (str(r.previous_role), str(r.role))
            directions[key] = directions.get(key, 0) + 1
        for (old, new), count in sorted(directions.items()):
            flips.add_metric([old, new], count)
        yield flips
        last = GaugeMetricFamily(
            "pdserve_last_flip_seconds",
            "The last flip's phases: drain (front end), wait (instance idle), switch, total",
            labels=["phase"],
        )
        if reports:
            r = reports[-1]
            for phase, value in (
                ("drain", r.drain_s),
                ("wait", r.waited_s),
                ("switch", r.switch_s),
                ("total", r.total_s),
            ):
                last.add_metric([phase], value)
        yield last
        decisions = CounterMetricFamily(
            "pdserve_flip_decisions",
            "The transition watcher's decisions, by outcome",
            labels=["policy", "outcome"],
        )
        outcomes = {"flipped": 0, "refused": 0, "kept": self.watcher.kept}
        for d in self.watcher.decisions:
            outcomes["flipped" if d.flipped else "refused"] += 1
        for outcome, count in outcomes.items():
            decisions.add_metric([self.watcher.policy.name, outcome], count)
        yield decisions
        attainment = GaugeMetricFamily(
            "pdserve_replan_attainment",
            "The distserve policy's last look: the running split's SLO attainment as the "
            "planner predicts it for the window's workload, and as the window observed it",
            labels=["kind"],
        )
        numbers = self.watcher.last_numbers
        for kind in ("predicted", "observed"):
            share = numbers.get(f"{kind}_attainment")
            if share is not None and share == share:  # not NaN
                attainment.add_metric([kind], share)
        yield attainment
        scaled = CounterMetricFamily(
            "pdserve_instances_scaled",
            "Instances added and removed while serving (cluster/scaling.py), by action",
            labels=["action"],
        )
        for action in ("add", "remove"):
            done = sum(1 for r in self.watcher.scaling.reports if r.action == action)
            scaled.add_metric([action], done)
        yield scaled
        roles = GaugeMetricFamily(
            "pdserve_instance_role",
            "1 for the role each instance holds now",
            labels=["instance", "role"],
        )
        for inst in self.watcher.hub.instances:
            roles.add_metric([inst.name, str(inst.role)], 1)
        yield roles


class _CacheCollector(Collector):
    """The router's counters and its prompt trees' sizes (cluster/routing.py)."""

    def __init__(self, router: Router) -> None:
        self.router = router

    def collect(self) -> Iterator[Metric]:
        c = self.router.counters
        for name, doc, value in (
            (
                "pdserve_prefix_routed",
                "Requests routed to an instance holding a prefix",
                c.cache_routed,
            ),
            (
                "pdserve_prefix_tree_misses",
                "Routed requests whose instance held less than its prompt tree said",
                c.misses,
            ),
            (
                "pdserve_prefix_tree_missed_tokens",
                "Tokens the prompt tree overstated",
                c.missed_tokens,
            ),
            (
                "pdserve_kv_returned_tokens",
                "Tokens whose KV decode instances returned",
                c.returned_tokens,
            ),
        ):
            yield CounterMetricFamily(name, doc, value=value)
        returns = CounterMetricFamily(
            "pdserve_kv_returns",
            "PD-Caching-3 returns of finished KV, by outcome",
            labels=["outcome"],
        )
        for outcome, value in (
            ("fetched", c.returns_fetched),
            ("held", c.returns_held),
            ("dropped", c.returns_dropped),
            ("failed", c.returns_failed),
        ):
            returns.add_metric([outcome], value)
        yield returns
        fetches = CounterMetricFamily(
            "pdserve_prefix_fetches",
            "Prefixes copied from another instance before a prefill, by outcome",
            labels=["outcome"],
        )
        fetches.add_metric(["fetched"], c.prefetches)
        fetches.add_metric(["failed"], c.prefetches_failed)
        yield fetches
        yield CounterMetricFamily(
            "pdserve_prefix_fetched_tokens",
            "Tokens whose KV prefix fetches copied",
            value=c.prefetched_tokens,
        )
        entries = GaugeMetricFamily(
            "pdserve_prefix_tree_entries",
            "(block, instance) entries of a prompt tree",
            labels=["role"],
        )
        removed = CounterMetricFamily(
            "pdserve_prefix_tree_removed",
            "Prompt-tree entries dropped by TTL or the size cap",
            labels=["role", "reason"],
        )
        memory = GaugeMetricFamily(
            "pdserve_prefix_tree_bytes", "Estimated memory of a prompt tree", labels=["role"]
        )
        for role, tree in self.router.trees.items():
            entries.add_metric([role.value], tree.num_entries)
            memory.add_metric([role.value], tree.approx_bytes)
            removed.add_metric([role.value, "ttl"], tree.expired_total)
            removed.add_metric([role.value, "cap"], tree.evicted_total)
        yield entries
        yield memory
        yield removed
        yield GaugeMetricFamily(
            "pdserve_sessions", "Sessions session routing remembers", value=self.router.num_sessions
        )


class _PredictionCollector(Collector):
    """Length predictions against the real output lengths (predictor/confusion.py): the
    confusion matrix as one counter per (predicted, actual) bucket pair, with buckets
    named by their token range."""

    def __init__(self, predictions: PredictionCounters) -> None:
        self.predictions = predictions

    def collect(self) -> Iterator[Metric]:
        p = self.predictions
        if p.spec is None:
            return
        confusion = CounterMetricFamily(
            "pdserve_length_predictions",
            "Finished requests by predicted and actual output-length bucket",
            labels=["predicted", "actual"],
        )
        names = [_bucket_name(p.spec.prediction(b)) for b in range(p.spec.num_buckets)]
        for i, row in enumerate(p.confusion):
            for j, n in enumerate(row):
                if n:
                    confusion.add_metric([names[i], names[j]], n)
        yield confusion
        yield CounterMetricFamily(
            "pdserve_length_predictions_truncated",
            "Predicted requests cut by max_tokens (true length unknown; not in the matrix)",
            value=p.truncated,
        )
        accuracy = p.accuracy
        if accuracy is not None:
            yield GaugeMetricFamily(
                "pdserve_length_prediction_accuracy",
                "Fraction of counted requests predicted in their actual bucket",
                value=accuracy,
            )


def _bucket_name(p: LengthPrediction) -> str:
    return f"{p.low}-{p.high}" if p.high is not None else f"{p.low}+"
