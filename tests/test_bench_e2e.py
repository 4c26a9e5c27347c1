"""`pdserve bench` against a real `pdserve serve` process: the server counts exactly the
prompt tokens the workload made, generates exactly the asked-for tokens, reports its
phase timings; the JSON and the PNG plots are written."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from helpers.server import KEY, Server

from pdserve.bench.cli import main

pytestmark = pytest.mark.slow


@pytest.fixture
def server_url(keyed_server: Server) -> str:
    """The session's shared keyed server (tests/conftest.py); `bench` sends its key."""
    return keyed_server.url


def bench(tmp_path: Path, *argv: str) -> dict[str, Any]:
    out = tmp_path / "res.json"
    # SLOs far above the request timeout: every completed request meets them
    code = main(
        [
            *argv,
            "--result-file",
            str(out),
            "--disable-tqdm",
            "--slo",
            "ttft:900000",
            "tpot:900000",
            "--request-timeout",
            "300",
            "--api-key",
            KEY,
        ]
    )
    assert code == 0
    return json.loads(out.read_text())


def test_completions_run_writes_json_and_plots(server_url: str, tmp_path: Path) -> None:
    doc = bench(
        tmp_path,
        "run",
        "--base-url",
        server_url,
        "--workload",
        "random",
        "--random-input-len",
        "24",
        "--random-output-len",
        "4",
        "--random-range-ratio",
        "0.5",
        "--num-prompts",
        "3",
        "--request-rate",
        "4",
        "--slo-scales",
        "0.5,1",
    )
    assert doc["targets"][0]["model"] == "SmolLM2-135M-Instruct.Q4_1"
    recs = doc["runs"][0]["records"]
    assert len(recs) == 3 and all(r["success"] for r in recs)
    for r in recs:
        assert r["server_prompt_tokens"] == r["prompt_len"]  # exact after the server's tokenizer
        assert r["output_tokens"] == r["output_len"]  # ignore_eos + max_tokens
        assert len(r["itl_s"]) == r["output_tokens"] - 1
        assert set(r["server_timings"]) >= {"queue", "prefill", "decode", "ttft", "e2e"}
        assert r["server_timings"]["e2e"] <= r["e2e_s"]  # the server's part of what we saw
    assert len({r["prompt_len"] for r in recs}) > 1  # range ratio 0.5
    s = doc["aggregates"][0]["summary"]
    assert s["attainment"] == 1.0 and s["mean_server_prefill_ms"] > 0
    plots = sorted(p.name for p in (tmp_path / "res-plots").iterdir())
    assert plots == [
        "attainment_vs_rate.png",
        "attainment_vs_slo_scale.png",
        "latency_breakdown.png",
        "tpot_cdf.png",
        "ttft_cdf.png",
    ]


def test_chat_prompt_length_counts_the_chat_template(server_url: str, tmp_path: Path) -> None:
    doc = bench(
        tmp_path,
        "run",
        "--base-url",
        server_url,
        "--endpoint",
        "/v1/chat/completions",
        "--workload",
        "random",
        "--random-input-len",
        "12",
        "--random-output-len",
        "3",
        "--num-prompts",
        "2",
        "--no-plots",
    )
    for r in doc["runs"][0]["records"]:
        assert r["success"] and r["output_tokens"] == 3
        assert r["server_prompt_tokens"] == r["prompt_len"] > 12  # template tokens included
