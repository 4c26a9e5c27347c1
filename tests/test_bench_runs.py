"""`pdserve bench` runs against stub servers: faults end as recorded failures and the
results are still written; `compare` interleaves servers over identical requests;
sessions obey the causal rule; `plot` rebuilds the PNGs from the JSON."""

from __future__ import annotations

import itertools
import json
import socket
from collections.abc import Iterator
from contextlib import ExitStack
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from pdserve.bench.cli import main
from pdserve.bench.stub_server import StubConfig, StubServer

SMALL = [
    "--workload",
    "random",
    "--random-input-len",
    "8",
    "--random-output-len",
    "4",
    "--disable-tqdm",
]


@pytest.fixture
def stubs() -> Iterator[Any]:
    with ExitStack() as stack:

        def start(**kw: Any) -> StubServer:
            return stack.enter_context(StubServer(StubConfig(**kw)).in_thread())

        yield start


def run(tmp_path: Path, *argv: str, plots: bool = False) -> tuple[int, dict[str, Any]]:
    out = tmp_path / "res.json"
    extra = [] if plots else ["--no-plots"]
    code = main([*argv, "--result-file", str(out), *extra])
    return code, json.loads(out.read_text())


def records(doc: dict[str, Any], target: str = "A") -> list[dict[str, Any]]:
    return [r for run in doc["runs"] if run["target"] == target for r in run["records"]]


def closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def test_instant_stub_request_is_parsed_completely(
    stubs: Any, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    stub = stubs(num_instances=2, prompt_tokens=8, cached_tokens=6)
    code, doc = run(
        tmp_path,
        "run",
        "--base-url",
        stub.url,
        *SMALL,
        "--num-prompts",
        "5",
        "--request-rate",
        "100",
        "--seed",
        "3",
    )
    assert code == 0 and doc["complete"]
    assert doc["targets"][0]["model"] == "stub" and doc["targets"][0]["num_instances"] == 2
    for r in records(doc):
        assert r["success"] and r["error"] is None
        assert r["output_tokens"] == 4 and len(r["itl_s"]) == 3
        assert r["prompt_len"] == 8 and r["ttft_s"] <= r["e2e_s"]
        assert set(r["server_timings"]) >= {"queue", "prefill", "decode", "stub_sent_at"}
        assert (r["server_prompt_tokens"], r["cached_tokens"]) == (8, 6)
    assert records(doc)[0]["scheduled_at_s"] == 0.0
    assert doc["aggregates"][0]["summary"]["prefix_cache_hit_rate"] == 0.75
    printed = capsys.readouterr().out
    assert "cache hit" in printed and "75.0%" in printed  # the table's hit-rate column
    # one request per session: each carried its own X-Session-Id, seed included
    assert sorted(stub.session_ids) == [f"bench-3-{i}" for i in range(5)]


@pytest.mark.parametrize(
    ("fault", "reason"),
    [
        ("status", "http 500: stub: injected failure"),
        ("midstream", "stream: error event: stub: injected mid-stream error"),
        ("drop", "connection: ClientPayloadError"),
        ("hang", "timeout: no complete response within 0.5 s"),
    ],
)
def test_faults_are_recorded_failures_and_results_are_written(
    stubs: Any, tmp_path: Path, fault: str, reason: str
) -> None:
    stub = stubs(fault=fault, fault_after=2)
    code, doc = run(
        tmp_path,
        "run",
        "--base-url",
        stub.url,
        *SMALL,
        "--num-prompts",
        "3",
        "--request-timeout",
        "0.5",
        "--slo",
        "ttft:10000",
        "tpot:10000",
        plots=True,
    )
    assert code == 1  # nothing succeeded
    assert doc["complete"]
    recs = records(doc)
    assert len(recs) == 3 and all(not r["success"] for r in recs)
    assert all(r["error"].startswith(reason) for r in recs), recs[0]["error"]
    summary = doc["aggregates"][0]["summary"]
    assert summary["failed"] == 3 and summary["attainment"] == 0.0
    assert (tmp_path / "res-plots" / "latency_breakdown.png").exists() is False  # nothing to draw
    assert (tmp_path / "res-plots" / "attainment_vs_rate.png").exists() is False  # rate inf


def test_only_request_timeout_limits_a_request(
    stubs: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A request runs as long as `--request-timeout` allows, not aiohttp's session-wide
    default (300 s, which cut long-context runs short): with that default shrunk to 0.3 s,
    4 tokens 0.2 s apart (0.6-0.8 s) complete under `--request-timeout 5`."""
    monkeypatch.setattr(aiohttp.client, "DEFAULT_TIMEOUT", aiohttp.ClientTimeout(total=0.3))
    stub = stubs(token_delay_s=0.2)
    code, doc = run(
        tmp_path, "run", "--base-url", stub.url, *SMALL, "--num-prompts", "1",
        "--request-timeout", "5",
    )  # fmt: skip
    assert code == 0, records(doc)
    [rec] = records(doc)
    assert rec["success"] and rec["e2e_s"] >= 0.6, rec


def test_server_down_ends_the_run_with_reasons(tmp_path: Path) -> None:
    url = f"http://127.0.0.1:{closed_port()}"
    code, doc = run(
        tmp_path,
        "run",
        "--base-url",
        url,
        *SMALL,
        "--num-prompts",
        "3",
        "--request-rates",
        "50,100",
        "--slo",
        "ttft:1000",
        "--search-goodput",
        "--search-iters",
        "2",
    )
    assert code == 1 and doc["complete"]
    assert doc["targets"][0]["model"] is None and doc["targets"][0]["model_card"] is None
    assert all(r["error"].startswith("connect: ") for r in records(doc))
    # the search halved twice below the sweep, every point failing
    assert [run["rate"] for run in doc["runs"]] == [50, 100, 25, 12.5]
    assert doc["goodput"]["A"]["goodput_rps"] == 0.0
    assert doc["goodput"]["A"]["status"] == "below-range"


def test_partial_failures_never_count_as_slo_success(stubs: Any, tmp_path: Path) -> None:
    stub = stubs(fault="midstream", fault_every=2)
    code, doc = run(
        tmp_path,
        "run",
        "--base-url",
        stub.url,
        *SMALL,
        "--num-prompts",
        "10",
        "--max-concurrency",
        "1",
        "--slo",
        "ttft:100000",
        "tpot:100000",
    )
    assert code == 0
    summary = doc["aggregates"][0]["summary"]
    assert (summary["completed"], summary["failed"]) == (5, 5)
    assert summary["attainment"] == 0.5
    assert summary["errors"] == {"stream": 5}
    assert summary["prefix_cache_hit_rate"] is None  # the stub reports no cached tokens
    assert all(r["cached_tokens"] is None for r in records(doc))


def test_compare_interleaves_identical_requests_and_reports_ratios(
    stubs: Any, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    a, b = stubs(), stubs(token_delay_s=0.001, num_instances=2)
    code, doc = run(
        tmp_path,
        "compare",
        a.url,
        b.url,
        *SMALL,
        "--num-prompts",
        "6",
        "--request-rates",
        "200,400",
        "--repeats",
        "2",
        "--slo",
        "ttft:60000",
        "tpot:60000",
        "--search-goodput",
        "--search-iters",
        "1",
        "--slo-scales",
        "0.5,1",
        plots=True,
    )
    assert code == 0
    order = [(r["target"], r["rate"], r["repeat"], r["phase"]) for r in doc["runs"]]
    assert order == [
        ("A", 200, 0, "sweep"),
        ("B", 200, 0, "sweep"),
        ("A", 200, 1, "sweep"),
        ("B", 200, 1, "sweep"),
        ("A", 400, 0, "sweep"),
        ("B", 400, 0, "sweep"),
        ("A", 400, 1, "sweep"),
        ("B", 400, 1, "sweep"),
        ("A", 800, 0, "search"),
        ("B", 800, 0, "search"),
    ]
    # the same prompts, lengths and arrival times went to both servers
    key = [(r["prompt_len"], r["output_len"], r["scheduled_at_s"]) for r in records(doc, "A")]
    assert key == [
        (r["prompt_len"], r["output_len"], r["scheduled_at_s"]) for r in records(doc, "B")
    ]
    assert (
        doc["goodput"]["A"]["goodput_rps"] == 800 and doc["goodput"]["A"]["status"] == "above-range"
    )
    assert doc["goodput"]["B"]["per_instance_rps"] == doc["goodput"]["B"]["goodput_rps"] / 2
    cmp = doc["comparison"]
    assert cmp["baseline"] == "A" and {r["rate"] for r in cmp["rows"]} == {200, 400}
    row = next(r for r in cmp["rows"] if r["metric"] == "median_tpot_ms" and r["rate"] == 200)
    assert row["ratios"]["B"] == row["values"]["B"] / row["values"]["A"]
    assert cmp["goodput"]["ratios"] == {"B": 1.0}
    assert [c["scales"] for c in doc["slo_scale"]["A"]] == [[0.5, 1.0], [0.5, 1.0]]
    printed = capsys.readouterr().out
    assert "B/A" in printed and "goodput A: 800 req/s" in printed
    plots = tmp_path / "res-plots"
    made = sorted(p.name for p in plots.iterdir())
    assert made == [
        "attainment_vs_rate.png",
        "attainment_vs_slo_scale.png",
        "latency_breakdown.png",
        "tpot_cdf.png",
        "ttft_cdf.png",
    ]
    # `plot` rebuilds them from the JSON alone
    for p in plots.iterdir():
        p.unlink()
    assert main(["plot", str(tmp_path / "res.json"), "--out-dir", str(plots)]) == 0
    assert sorted(p.name for p in plots.iterdir()) == made
    assert all(p.stat().st_size > 10_000 for p in plots.iterdir())


@pytest.mark.parametrize("endpoint", ["/v1/completions", "/v1/chat/completions"])
def test_sessions_send_each_turn_after_the_previous_answer(
    stubs: Any, tmp_path: Path, endpoint: str
) -> None:
    stub = stubs(token_delay_s=0.0005)
    code, doc = run(
        tmp_path,
        "run",
        "--base-url",
        stub.url,
        "--workload",
        "sessions",
        "--session-style",
        "react",
        "--num-prompts",
        "12",
        "--endpoint",
        endpoint,
        "--disable-tqdm",
    )
    assert code == 0
    by_session: dict[int, list[dict[str, Any]]] = {}
    for r in sorted(records(doc), key=lambda r: (r["session"], r["turn"])):
        by_session.setdefault(r["session"], []).append(r)
    assert any(len(turns) > 1 for turns in by_session.values())
    for turns in by_session.values():
        for prev, nxt in itertools.pairwise(turns):
            assert nxt["sent_at_s"] >= prev["sent_at_s"] + prev["e2e_s"]  # causal rule
            # the history (earlier turns and their answers) is in the next prompt
            assert nxt["prompt_len"] > prev["prompt_len"] + prev["output_tokens"]
    assert all(r["success"] for r in records(doc))
    # every turn of a session carried the session's id
    assert sorted(stub.session_ids) == sorted(f"bench-0-{r['session']}" for r in records(doc))


def test_plot_summarizes_an_interrupted_results_file(
    stubs: Any, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    stub = stubs()
    code, doc = run(
        tmp_path,
        "run",
        "--base-url",
        stub.url,
        *SMALL,
        "--num-prompts",
        "4",
        "--request-rates",
        "100,200",
        "--slo",
        "ttft:60000",
    )
    assert code == 0
    cut = {**doc, "runs": doc["runs"][:1], "aggregates": [], "slo_scale": {}, "complete": False}
    path = tmp_path / "cut.json"
    path.write_text(json.dumps(cut))
    capsys.readouterr()
    assert main(["plot", str(path)]) == 0
    printed = capsys.readouterr()
    assert "interrupted" in printed.err
    assert "4/4" in printed.out  # the one finished run, summarized
    assert (tmp_path / "cut-plots" / "attainment_vs_rate.png").exists()
