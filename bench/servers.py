"""Servers that a benchmark starts alone and stops: a free port, a process answering
`/health`, and its stop. pdserve's own (`pdserve_cmd`) or any other command (a peer's
server) started the same way."""

from __future__ import annotations

import contextlib
import os
import shlex
import signal
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


def start(
    cmd: list[str],
    port: int,
    timeout_s: float = 600.0,
    env: dict[str, str] | None = None,
    log: str | None = None,
) -> subprocess.Popen[bytes]:
    """`cmd` running and answering 200 on `/health` at `port`, in a process group of its
    own (`stop` ends what it started: a peer's engine processes too); its output goes to
    the file `log`, else nowhere; `env` is set over this process's environment."""
    out = open(log, "wb") if log else subprocess.DEVNULL  # noqa: SIM115 (the child's)
    proc = subprocess.Popen(
        cmd,
        stdout=out,
        stderr=subprocess.STDOUT if log else subprocess.DEVNULL,
        env={**os.environ, **(env or {})},
        start_new_session=True,
    )
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
    """SIGTERM to the server (a pdserve server drains), SIGKILL after 60 s; then SIGKILL
    to whatever is left of its process group."""
    proc.terminate()
    try:
        proc.wait(60)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGKILL)
