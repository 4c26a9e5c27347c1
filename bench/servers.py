"""Servers that a benchmark starts alone and stops: a free port, a process answering
`/health`, and its stop. pdserve's own (`pdserve_cmd`) or any other command (a peer's
server) started the same way."""

from __future__ import annotations

import shlex
import socket
import subprocess
import sys
import time

import httpx


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def pdserve_cmd(port: int, *args: str) -> list[str]:
    return [sys.executable, "-m", "pdserve.cli", "serve", "--port", str(port), *args]


def start(cmd: list[str], port: int, timeout_s: float = 600.0) -> subprocess.Popen[bytes]:
    """`cmd` running and answering 200 on `/health` at `port` (output discarded)."""
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"{shlex.join(cmd)} exited with {proc.returncode}")
        try:
            if httpx.get(f"http://127.0.0.1:{port}/health").status_code == 200:
                return proc
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    proc.kill()
    raise RuntimeError(f"{shlex.join(cmd)} did not answer /health in {timeout_s:g} s")


def stop(proc: subprocess.Popen[bytes]) -> None:
    """SIGTERM (a pdserve server drains), SIGKILL after 60 s."""
    proc.terminate()
    try:
        proc.wait(60)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
