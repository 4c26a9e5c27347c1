"""Instance flip through the operator's route, on real clusters (cluster/flip.py,
docs/elastic.md): `POST /admin/instances/{name}/role`.

Under load (`--prefill 1 --decode 2`, the fault-tolerance workload: 16 requests of 64
tokens, half streamed, a quarter seeded at temperature 0.8): decode-1 becomes a prefill
instance while every stream is mid-way (its requests move to decode-0 with their KV), then
prefill-0 becomes a decode instance while the workload runs again. Every text equals an
undisturbed colocated run's; every pool is clean after; the flipped instances keep their
names and serve in their new roles; what decode-1 cached as a decode instance (the answers
it generated) is a prefix-cache hit when it prefills the conversations' next turns.

Colocated instances (`--colocated 3`) flip to prefill and decode under the same load,
through a cluster that mixes a colocated instance with a prefill and decode pair.

Refusals and faults (`--prefill 1 --decode 2`, an API key): each refused flip's status and
exact body, nothing changed; a flip of a stopped instance (SIGSTOP) waits, a second flip of
it is refused meanwhile, and past `--flip-timeout` the flip is given up with the instance
serving in its old role again once it runs.
"""

from __future__ import annotations

import json
import os
import signal
import threading
from collections.abc import Callable

from helpers.reference import run
from helpers.server import (
    KEY,
    Server,
    cluster,
    cluster_rows,
    prometheus,
    row_of,
    wait_clean,
    wait_for,
)
from helpers.streams import Streams
from test_fault_tolerance import MAX_TOKENS, assert_identical, bodies

from pdserve.engine.engine import Engine


def flip(server: Server, name: str, role: object, key: str | None = KEY) -> tuple[int, dict]:
    raw = json.dumps({"role": role}).encode()
    return server.post(f"/admin/instances/{name}/role", raw, key=key)


def status_row(server: Server, name: str) -> dict:
    """Instance `name`'s row of /cluster/status (which asks no instance: it answers while
    one is stopped)."""
    status, reply = server.get("/cluster/status", key=KEY)
    assert status == 200, reply
    return next(r for r in reply["instances"] if r["name"] == name)


def roles(server: Server) -> dict[str, str]:
    return {r["name"]: r["role"] for r in cluster(server)["instances"]}


def error(status: int, message: str, param: str | None = None) -> dict:
    kinds = {400: "invalid_request_error", 404: "not_found_error", 409: "conflict_error"}
    kind = kinds.get(status, "service_unavailable_error")
    return {"error": {"message": message, "type": kind, "param": param, "code": status}}


def first_turns() -> list[dict]:
    """Eight greedy conversations' first turns, 40 tokens each."""
    return [
        {"prompt": b["prompt"], "max_tokens": 40, "ignore_eos": True, "temperature": 0}
        for b in bodies()[:16:2]
    ]


def test_flips_under_load_lose_nothing_and_the_cache_stays(
    start: Callable[..., Server], served_engine: Engine
) -> None:
    # --kv-wait 30: a move's copy is waited for even when a loaded machine answers slowly
    # (past the default 2 s the request is computed instead: right for users, but this
    # test shows the copies).
    server = start("--prefill", "1", "--decode", "2", "--pd-caching", "2", "--kv-wait", "30")
    turns = first_turns()
    first = Streams(server.url, turns).results()
    assert_identical(first, run(served_engine, turns))
    reference = run(served_engine, bodies())
    assert all(r.completion_tokens == MAX_TOKENS for r in reference)

    # D -> P while every stream is mid-way: decode-1's requests move with their KV.
    streams = Streams(server.url, bodies())
    streams.wait_tokens(8)
    held = row_of(server, "decode-1")["assigned_requests"]
    assert held > 0
    status, report = flip(server, "decode-1", "prefill")
    assert status == 200, report
    assert (report["instance"], report["previous_role"], report["role"]) == (
        "decode-1",
        "decode",
        "prefill",
    )
    assert report["moved"] == held, (report, held)
    assert 0 <= report["drain_s"] <= report["total_s"] and report["switch_s"] >= 0
    assert roles(server) == {"prefill-0": "prefill", "decode-0": "decode", "decode-1": "prefill"}
    moved = cluster(server)["controller"]
    # Every move with a whole block of KV copied it, none failed (a request with fewer
    # tokens than a block goes on at once): decode-0 recomputes under a block each.
    caching = moved["caching"]
    assert 0 < report["copied"] <= held, report
    assert (caching["kv_moves"], caching["kv_moves_failed"]) == (report["copied"], 0), caching
    assert caching["kv_moved_tokens"] > 0, caching
    assert moved["recomputed_tokens"] < 16 * held, moved
    assert (moved["migrations"], moved["retries"], moved["failed"]) == (0, 0, 0), moved
    assert_identical(streams.results(), reference)

    # The next turns: decode-1, a prefill instance now, holds the first turns' answers it
    # decoded (--pd-caching 2: no return to prefill-0), so those are routed to it and hit.
    hits_before = row_of(server, "decode-1")["stats"]["prefix_cache_hits"]
    nexts = [
        {**t, "prompt": t["prompt"] + o.text, "max_tokens": 8}
        for t, o in zip(turns, first, strict=True)
    ]
    replies = [server.post("/v1/completions", json.dumps(b).encode(), key=None)[1] for b in nexts]
    want = run(served_engine, nexts)
    assert [r["choices"][0]["text"] for r in replies] == [w.text for w in want]
    beyond = [
        r["usage"]["prompt_tokens_details"]["cached_tokens"] > len_prompt
        for r, len_prompt in zip(
            replies, [prompt_tokens(served_engine, t) for t in turns], strict=True
        )
    ]
    assert any(beyond), [r["usage"] for r in replies]
    assert row_of(server, "decode-1")["stats"]["prefix_cache_hits"] > hits_before

    # P -> D while the workload runs again: prefill-0 finishes its prompts, then decodes.
    streams = Streams(server.url, bodies())
    wait_for(lambda: row_of(server, "prefill-0")["assigned_prefill_tokens"] > 0)
    status, report = flip(server, "prefill-0", "decode")
    assert status == 200, report
    assert (report["previous_role"], report["role"]) == ("prefill", "decode")
    assert (report["moved"], report["copied"]) == (0, 0)
    assert roles(server) == {"prefill-0": "decode", "decode-0": "decode", "decode-1": "prefill"}
    assert_identical(streams.results(), reference)
    after = cluster(server)["controller"]
    assert (after["migrations"], after["retries"], after["failed"]) == (0, 0, 0), after
    wait_clean(server)
    switches = {r["name"]: r["stats"]["num_role_switches"] for r in cluster(server)["instances"]}
    assert switches == {"prefill-0": 1, "decode-0": 0, "decode-1": 1}
    metrics = prometheus(server)
    assert metrics['pdserve_instance_flips_total{from="decode",to="prefill"}'] == 1
    assert metrics['pdserve_instance_flips_total{from="prefill",to="decode"}'] == 1
    assert metrics['pdserve_last_flip_seconds{phase="total"}'] == report["total_s"]
    held_roles = {"prefill-0": "decode", "decode-0": "decode", "decode-1": "prefill"}
    for name, role in held_roles.items():
        assert metrics[f'pdserve_instance_role{{instance="{name}",role="{role}"}}'] == 1


def test_colocated_instances_flip_to_prefill_and_decode_under_load(
    start: Callable[..., Server], served_engine: Engine
) -> None:
    """`--colocated 3` becomes disaggregated one flip at a time, the first two under load
    (16 requests of the fault-tolerance workload): the instance holding the most requests
    -> prefill (its requests that streamed move to the others with their KV), the busier
    of the other two -> decode - the cluster now mixes a colocated instance with a prefill
    and decode pair, and the workload runs through both, an even share each - then the
    last colocated instance -> decode (a pair remains: allowed). Every text equals the
    undisturbed colocated run's; nothing retried, migrated or failed; pools clean. (The
    instance running the most requests, by its own count, not a fixed one: routing by
    prefill load may leave one idle a moment.)"""
    server = start("--colocated", "3", "--kv-wait", "30")
    load = bodies()[:16]
    reference = run(served_engine, load)

    def flip_under_load(names: list[str], role: str) -> tuple[str, dict]:
        streams = Streams(server.url, load)
        streams.wait_tokens(8)
        rows = {r["name"]: r for r in cluster_rows(server)}
        running = {n: rows[n]["stats"]["num_running"] for n in names}
        name = max(names, key=lambda n: running[n])
        status, report = flip(server, name, role)
        assert status == 200, report
        assert (report["previous_role"], report["role"]) == ("colocated", role), report
        assert_identical(streams.results(), reference)
        return name, report

    names = ["colocated-0", "colocated-1", "colocated-2"]
    pre, report = flip_under_load(names, "prefill")
    assert report["moved"] > 0 and 0 < report["copied"] <= report["moved"], report
    dec, _ = flip_under_load([n for n in names if n != pre], "decode")
    (colo,) = [n for n in names if n not in (pre, dec)]
    assert roles(server) == {colo: "colocated", dec: "decode", pre: "prefill"}
    # the mixed cluster: requests run whole on the colocated instance and through the
    # pair, an even share of the instances each (16 requests at once: a third, at least 4,
    # on the colocated one)
    before = {r["name"]: r["stats"] for r in cluster(server)["instances"]}
    assert_identical(Streams(server.url, load).results(), reference)
    after = {r["name"]: r["stats"] for r in cluster(server)["instances"]}

    def grew(name: str, counter: str) -> int:
        return int(after[name][counter] - before[name][counter])

    through_pair = grew(dec, "num_predicted_decodes")  # a decode instance's count
    assert 4 <= len(load) - through_pair <= through_pair, through_pair
    assert grew(colo, "prefix_cache_queries") > 0 and grew(pre, "num_steps") > 0
    assert flip(server, colo, "decode")[0] == 200
    assert sorted(roles(server).values()) == ["decode", "decode", "prefill"]
    assert_identical(Streams(server.url, load[:4]).results(), reference[:4])
    assert flip(server, pre, "decode") == (
        409,
        error(409, f"{pre} is the last live prefill instance: the cluster needs one"),
    )
    counters = cluster(server)["controller"]
    assert (counters["migrations"], counters["retries"], counters["failed"]) == (0, 0, 0)
    assert counters["caching"]["kv_moves_failed"] == 0, counters["caching"]
    wait_clean(server)


def prompt_tokens(engine: Engine, body: dict) -> int:
    return len(engine.tokenizer.prompt_ids(body["prompt"]))


def test_refused_flips_change_nothing_and_a_stuck_one_is_given_up(
    start: Callable[..., Server],
) -> None:
    server = start(
        "--prefill", "1", "--decode", "2", "--api-key", KEY,
        "--flip-timeout", "3", "--instance-timeout", "600",
    )  # fmt: skip
    before = roles(server)
    assert flip(server, "decode-0", "prefill", key=None)[0] == 401
    assert flip(server, "decode-7", "prefill") == (
        404,
        error(404, "no instance named 'decode-7' (the instances: prefill-0, decode-0, decode-1)"),
    )
    assert flip(server, "decode-0", "bogus") == (
        400,
        error(400, "role: Input should be 'colocated', 'prefill' or 'decode'", "role"),
    )
    raw = json.dumps({"role": "prefill", "now": True}).encode()
    assert server.post("/admin/instances/decode-0/role", raw) == (
        400,
        error(400, "unknown field 'now'", "now"),
    )
    assert flip(server, "decode-0", "decode") == (
        409,
        error(409, "decode-0 is a decode instance already"),
    )
    assert flip(server, "prefill-0", "decode") == (
        409,
        error(409, "prefill-0 is the last live prefill instance: the cluster needs one"),
    )
    assert roles(server) == before

    # A stopped instance: drained at once (it holds nothing), its switch waits.
    pid = row_of(server, "decode-1")["pid"]
    os.kill(pid, signal.SIGSTOP)
    try:
        # /debug/cluster answers within its deadline whatever an instance does: the
        # stopped one's counters are missing, and say why
        status, reply = server.get("/debug/cluster", key=KEY)
        assert status == 200, reply
        stopped = next(r for r in reply["instances"] if r["name"] == "decode-1")
        assert stopped["alive"] and "stats" not in stopped, stopped
        assert stopped["stats_error"] == "no answer within 0.08 s"
        for bad in ("0", "31", "nan"):
            assert server.get(f"/debug/cluster?stats_timeout={bad}", key=KEY) == (
                400,
                error(400, f"stats_timeout must be in (0, 30] seconds, got {bad}", "stats_timeout"),
            )
        answer: list[tuple[int, dict]] = []
        waiter = threading.Thread(target=lambda: answer.append(flip(server, "decode-1", "prefill")))
        waiter.start()
        wait_for(lambda: status_row(server, "decode-1")["flipping_to"] == "prefill")
        assert flip(server, "decode-1", "prefill") == (
            409,
            error(409, "decode-1 is flipping already (to prefill)"),
        )
        # decode-1 left its role: decode-0 is the last live decode instance.
        assert flip(server, "decode-0", "prefill") == (
            409,
            error(409, "decode-0 is the last live decode instance: the cluster needs one"),
        )
        waiter.join(30)
    finally:
        os.kill(pid, signal.SIGCONT)
    assert answer == [
        (
            503,
            error(
                503,
                "the flip of decode-1 to prefill did not finish within 3 s (0 requests still "
                "held there); it serves as decode again",
            ),
        )
    ]
    wait_for(lambda: status_row(server, "decode-1")["flipping_to"] is None)
    assert roles(server) == before
    reply = server.post(
        "/v1/completions",
        json.dumps({"prompt": "hello there", "max_tokens": 4, "temperature": 0}).encode(),
    )
    assert reply[0] == 200, reply
    wait_clean(server)
    assert row_of(server, "decode-1")["stats"]["num_role_switches"] == 2  # there and back
