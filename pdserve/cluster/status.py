"""`pdserve cluster status`: a running server's nodes, instances, roles and load.

It reads the server's `/cluster/status` (the controller's own records: no instance is
asked, so it answers while instances are busy or dying) and prints two tables, or the
JSON with `--json`. Exit 1 when the server cannot be reached, with the reason.
"""

from __future__ import annotations

import argparse
import json
import sys
import urllib.error
import urllib.request
from typing import Any


def add_cluster_parser(sub: Any) -> None:
    p = sub.add_parser("cluster", help="a running server's cluster: nodes, instances, load")
    cmds = p.add_subparsers(dest="cluster_command", required=True)
    s = cmds.add_parser("status", help="nodes, instances, roles and load of a running server")
    s.add_argument("--url", default="http://127.0.0.1:8000", help="the server (%(default)s)")
    s.add_argument("--api-key", default=None, help="the server's --api-key, if it has one")
    s.add_argument("--timeout", type=float, default=10.0, help="seconds to wait for the answer")
    s.add_argument("--json", action="store_true", help="print the JSON as the server sends it")
    s.set_defaults(func=run_status)


def run_status(args: argparse.Namespace) -> int:
    try:
        status = fetch_status(args.url, args.api_key, args.timeout)
    except (OSError, ValueError) as e:  # URLError is an OSError
        print(f"pdserve: error: cannot read {args.url}/cluster/status: {e}", file=sys.stderr)
        return 1
    print(json.dumps(status, indent=2) if args.json else render(status))
    return 0


def fetch_status(url: str, api_key: str | None, timeout: float) -> dict[str, Any]:
    request = urllib.request.Request(url.rstrip("/") + "/cluster/status")
    if api_key is not None:
        request.add_header("Authorization", f"Bearer {api_key}")
    try:
        with urllib.request.urlopen(request, timeout=timeout) as reply:
            status: dict[str, Any] = json.load(reply)
    except urllib.error.HTTPError as e:
        body = e.read().decode(errors="replace")
        raise ValueError(f"HTTP {e.code}: {body}") from None
    return status


def render(status: dict[str, Any]) -> str:
    nodes = [
        [
            _short(n["node"]),
            n["address"],
            "alive" if n["alive"] else "DEAD",
            f"{n['cpus']:g}",
            f"{n['gpus']:g}",
            ", ".join(n["instances"]) or "-",
        ]
        for n in status["nodes"]
    ]
    instances = [
        [
            i["name"],
            i["role"],
            _short(i["node"]),
            "alive" if i["alive"] else f"DEAD: {i['dead_reason']}",
            _num(i["running"]),
            _num(i["waiting"]),
            str(i["assigned_requests"]),
            _blocks(i),
        ]
        for i in status["instances"]
    ]
    return "\n".join(
        [
            f"launcher: {status['launcher']}",
            "",
            _table(["node", "address", "state", "cpus", "gpus", "instances"], nodes),
            "",
            _table(
                ["instance", "role", "node", "state", "running", "waiting", "assigned", "free KV"],
                instances,
            ),
        ]
    )


def _short(node: str) -> str:
    return node[:12]


def _num(value: int | None) -> str:
    return "-" if value is None else str(value)


def _blocks(row: dict[str, Any]) -> str:
    if row["free_blocks"] is None:
        return "-"
    return f"{row['free_blocks']}/{row['blocks']} blocks"


def _table(header: list[str], rows: list[list[str]]) -> str:
    widths = [max(len(r[c]) for r in [header, *rows]) for c in range(len(header))]
    lines = ["  ".join(cell.ljust(w) for cell, w in zip(r, widths, strict=True)) for r in rows]
    head = "  ".join(h.ljust(w) for h, w in zip(header, widths, strict=True))
    return "\n".join([head, *lines]).rstrip()
