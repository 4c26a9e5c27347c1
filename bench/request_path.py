"""Which pdserve source files ONE chat completion crosses, and in which processes.

    .venv/bin/python bench/request_path.py [--prefill 1 --decode 1] [--repo PATH] [--json out.json]

Starts `python -m pdserve.cli serve --port P --max-model-len 512 [--prefill N --decode M]`
(127.0.0.1, the shipped SmolLM2 GGUF unless `--server-args` names a model) with a
`sitecustomize.py` written to a temp dir in front of PYTHONPATH. The spawned engine
processes inherit the environment, so every Python process of the server tree runs
it at startup. It installs a `sys.setprofile` + `threading.setprofile` hook that
counts the `co_filename` of every Python call ("call" events: a function entered, a
generator or coroutine resumed, a module body run) while recording is on, and off
otherwise; recording is toggled by signals:

* SIGUSR1: clear the counts and start recording (the process then writes
  `on-<pid>`, so the request is sent only once every process records);
* SIGUSR2: stop and write `dump-<pid>.json` (the pdserve files called and how often,
  `pdserve.__file__`, the multiprocessing process name, argv) to $PDSERVE_REQPATH_DIR.

A process is signalled only once it has written `ready-<pid>` (hook and handlers
installed), so no process of the tree is killed by a signal it does not handle.

Procedure: wait for /health 200, send one warm-up chat completion (lazy imports and
first-call work are then done), SIGUSR1 to every process of the tree (psutil),
~0.5 s, ONE chat completion ("What is the capital of France?", 16 tokens,
temperature 0, a fresh HTTP connection), ~0.5 s, SIGUSR2, collect. Then the same
window again with no request (the idle baseline): files seen there are marked `*`.
Finally SIGTERM and wait (SIGKILL for the tree past the timeout).

What counts: only what runs in the recording window, not startup. The window also
holds whatever the processes do while idle - the HTTP process's event loop and
timers, the engines' polling loops (waiting on their input socket, load reports,
liveness checks) - for ~1 s plus the request's own duration. Those are part of the
processes the request runs in, so they are counted; the `*` marks (also seen with no
request in an equally long window) tell them apart. Threads started with
`_thread.start_new_thread` directly, or Python called from foreign (C) threads, are
not seen (threading's threads, executors included, are).

`--repo PATH` runs the server from another checkout (e.g. a git worktree of an older
commit): cwd and PYTHONPATH point there, and each process reports the
`pdserve.__file__` it imported, which the script checks lies under PATH. The script
only runs processes and speaks HTTP, so one copy of it measures old and new code.

Output: per process (role: `http` for the server process, else the multiprocessing
process name of the engine, e.g. `pdserve-prefill-0`), the sorted pdserve files
(relative to the repo) with call counts; totals: distinct files, distinct packages
(`pdserve/<pkg>/`; modules directly under `pdserve/` are counted apart), and
processes that ran pdserve code. `--json PATH` writes the same data.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shlex
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx
import psutil

DEFAULT_REPO = Path(__file__).resolve().parent.parent
PROMPT = "What is the capital of France?"

# Runs at the startup of every Python process of the server tree (PYTHONPATH).
SITECUSTOMIZE = r"""
import json as _json
import os as _os
import signal as _signal
import sys as _sys
import threading as _threading

_DIR = _os.environ.get("PDSERVE_REQPATH_DIR")
if _DIR:
    _on = False
    _counts = {}

    def _prof(frame, event, arg):
        if _on and event == "call":
            fn = frame.f_code.co_filename
            _counts[fn] = _counts.get(fn, 0) + 1

    def _write(name, data):
        path = _os.path.join(_DIR, name)
        with open(path + ".tmp", "w") as f:
            _json.dump(data, f)
        _os.replace(path + ".tmp", path)

    def _start(signum, frame):
        global _on
        _counts.clear()
        _on = True
        _write("on-%d" % _os.getpid(), {})

    def _stop(signum, frame):
        global _on
        _on = False
        counts = dict(_counts)
        mod = _sys.modules.get("pdserve")
        init = getattr(mod, "__file__", None) if mod is not None else None
        pkg = _os.path.dirname(init) + _os.sep if init else None
        mp = _sys.modules.get("multiprocessing.process")
        _write(
            "dump-%d.json" % _os.getpid(),
            {
                "pid": _os.getpid(),
                "ppid": _os.getppid(),
                "argv": list(getattr(_sys, "orig_argv", _sys.argv)),
                "mp_name": mp.current_process().name if mp is not None else None,
                "pdserve_file": init,
                "files": {f: n for f, n in counts.items() if pkg and f.startswith(pkg)},
                "other_files": sum(1 for f in counts if not (pkg and f.startswith(pkg))),
                "threads": sorted(t.name for t in _threading.enumerate()),
            },
        )

    def _ready():
        _write("ready-%d" % _os.getpid(), {})

    _sys.setprofile(_prof)
    _threading.setprofile(_prof)
    _signal.signal(_signal.SIGUSR1, _start)
    _signal.signal(_signal.SIGUSR2, _stop)
    _os.register_at_fork(after_in_child=_ready)
    _ready()
"""


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def chat(url: str, model: str, timeout: float) -> dict[str, Any]:
    body = {
        "model": model,
        "messages": [{"role": "user", "content": PROMPT}],
        "max_tokens": 16,
        "temperature": 0,
    }
    r = httpx.post(f"{url}/v1/chat/completions", json=body, timeout=timeout)
    r.raise_for_status()
    return dict(r.json())


def tree(pid: int) -> list[psutil.Process]:
    root = psutil.Process(pid)
    return [root, *root.children(recursive=True)]


def hooked(pid: int, rec: Path) -> list[int]:
    """The live processes of the tree that installed the hook (wrote ready-<pid>)."""
    out = []
    for p in tree(pid):
        with contextlib.suppress(psutil.NoSuchProcess):
            if (rec / f"ready-{p.pid}").exists() and p.is_running():
                out.append(p.pid)
    return out


def wait_files(paths: list[Path], timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not all(p.exists() for p in paths):
        if time.monotonic() > deadline:
            missing = [p.name for p in paths if not p.exists()]
            raise RuntimeError(f"no {what} from {missing} within {timeout:g} s")
        time.sleep(0.02)


def record(
    server: int, rec: Path, window: float, action: Any, timeout: float
) -> tuple[dict[int, dict[str, Any]], float]:
    """Record the tree around `action()` (None: nothing): SIGUSR1, window, action,
    window, SIGUSR2. Returns the per-pid dumps and the recording's length."""
    for f in rec.glob("on-*"):
        f.unlink()
    for f in rec.glob("dump-*"):
        f.unlink()
    pids = hooked(server, rec)
    for pid in pids:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGUSR1)
    wait_files([rec / f"on-{pid}" for pid in pids], timeout, "recording start")
    t0 = time.monotonic()
    time.sleep(window)
    if action is not None:
        action()
    time.sleep(window)
    for pid in pids:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGUSR2)
    length = time.monotonic() - t0
    wait_files([rec / f"dump-{pid}.json" for pid in pids], timeout, "dump")
    dumps = {pid: json.loads((rec / f"dump-{pid}.json").read_text()) for pid in pids}
    return dumps, length


def role(dump: dict[str, Any], server: int) -> str:
    if dump["pid"] == server:
        return "http"
    name = dump.get("mp_name")
    if name and name != "MainProcess":
        return str(name)
    argv = " ".join(dump.get("argv") or [])
    if "resource_tracker" in argv:
        return "resource-tracker"
    return f"pid-{dump['pid']}"


def package(rel: str) -> str | None:
    """'pdserve/kv/transfer/shm.py' -> 'pdserve/kv/'; a module directly under pdserve/ -> None."""
    parts = rel.split("/")
    return f"{parts[0]}/{parts[1]}/" if len(parts) > 2 else None


def start_server(args: argparse.Namespace, repo: Path, rec: Path, log: Any) -> tuple[Any, int]:
    port = free_port()
    cmd = [args.python, "-m", "pdserve.cli", "serve", "--host", "127.0.0.1", "--port", str(port)]
    cmd += ["--max-model-len", str(args.max_model_len)]
    if args.prefill or args.decode:
        cmd += ["--prefill", str(args.prefill), "--decode", str(args.decode)]
    cmd += shlex.split(args.server_args)
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(
        [str(rec.parent / "site"), str(repo), *filter(None, [env.get("PYTHONPATH")])]
    )
    env["PDSERVE_REQPATH_DIR"] = str(rec)
    print("server:", shlex.join(cmd), f"(cwd {repo})", file=sys.stderr)
    proc = subprocess.Popen(cmd, cwd=repo, env=env, stdout=log, stderr=subprocess.STDOUT)
    return proc, port


def wait_healthy(proc: Any, url: str, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"server exited with status {proc.returncode} before /health 200")
        with contextlib.suppress(httpx.HTTPError):
            if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                return
        time.sleep(0.25)
    raise RuntimeError(f"server not healthy within {timeout:g} s")


def stop_server(proc: Any, timeout: float) -> None:
    if proc.poll() is not None:
        return
    try:
        procs = tree(proc.pid)
    except psutil.NoSuchProcess:
        procs = []
    proc.send_signal(signal.SIGTERM)
    try:
        proc.wait(timeout)
    except subprocess.TimeoutExpired:
        print("server ignored SIGTERM; killing its tree", file=sys.stderr)
        for p in procs:
            with contextlib.suppress(psutil.NoSuchProcess):
                p.kill()
        proc.wait(10)
    _, alive = psutil.wait_procs(procs[1:], timeout=timeout)
    for p in alive:  # children of the server this script started
        with contextlib.suppress(psutil.NoSuchProcess):
            p.kill()


def measure(args: argparse.Namespace) -> dict[str, Any]:
    repo = Path(args.repo).resolve()
    with tempfile.TemporaryDirectory(prefix="pdserve-reqpath-") as tmp:
        site = Path(tmp) / "site"
        rec = Path(tmp) / "rec"
        site.mkdir()
        rec.mkdir()
        (site / "sitecustomize.py").write_text(SITECUSTOMIZE)
        log_path = Path(tmp) / "server.log"
        with open(log_path, "wb") as log:
            proc, port = start_server(args, repo, rec, log)
            url = f"http://127.0.0.1:{port}"
            try:
                wait_healthy(proc, url, args.startup_timeout)
                models = httpx.get(f"{url}/v1/models", timeout=10).json()
                model = models["data"][0]["id"]
                warm = chat(url, model, args.request_timeout)
                reply: dict[str, Any] = {}

                def one() -> None:
                    reply.update(chat(url, model, args.request_timeout))

                dumps, length = record(proc.pid, rec, args.window, one, args.request_timeout)
                idle_window = max(args.window, length / 2)
                idle, _ = record(proc.pid, rec, idle_window, None, args.request_timeout)
            except BaseException:
                log.flush()
                tail = log_path.read_text(errors="replace")[-4000:]
                print(f"--- server log (tail) ---\n{tail}", file=sys.stderr)
                raise
            finally:
                stop_server(proc, args.stop_timeout)
    return summarize(args, repo, proc.pid, model, warm, reply, dumps, idle, length)


def summarize(
    args: argparse.Namespace,
    repo: Path,
    server: int,
    model: str,
    warm: dict[str, Any],
    reply: dict[str, Any],
    dumps: dict[int, dict[str, Any]],
    idle: dict[int, dict[str, Any]],
    length: float,
) -> dict[str, Any]:
    commit = subprocess.run(
        ["git", "-C", str(repo), "rev-parse", "HEAD"], capture_output=True, text=True
    ).stdout.strip()
    procs = []
    all_files: set[str] = set()
    for pid in sorted(dumps, key=lambda p: (p != server, role(dumps[p], server))):
        d = dumps[pid]
        init = d.get("pdserve_file")
        root = Path(init).resolve().parent.parent if init else repo
        if init and not Path(init).resolve().is_relative_to(repo):
            raise RuntimeError(f"pid {pid} imported pdserve from {init}, not from {repo}")
        files = {Path(f).resolve().relative_to(root).as_posix(): n for f, n in d["files"].items()}
        idle_files = {
            Path(f).resolve().relative_to(root).as_posix()
            for f in idle.get(pid, {}).get("files", {})
        }
        all_files |= set(files)
        procs.append(
            {
                "pid": pid,
                "role": role(d, server),
                "argv": d.get("argv"),
                "pdserve_file": init,
                "threads": d.get("threads"),
                "files": dict(sorted(files.items())),
                "also_idle": sorted(set(files) & idle_files),
                "other_python_files": d.get("other_files"),
            }
        )
    packages = sorted({p for f in all_files if (p := package(f))})
    top = sorted(f for f in all_files if package(f) is None)
    usage = reply.get("usage", {})
    return {
        "repo": str(repo),
        "commit": commit,
        "config": {"prefill": args.prefill, "decode": args.decode},
        "model": model,
        "completion": (reply.get("choices") or [{}])[0].get("message", {}).get("content"),
        "warmup_completion": (warm.get("choices") or [{}])[0].get("message", {}).get("content"),
        "usage": usage,
        "window_s": round(length, 3),
        "processes": procs,
        "totals": {
            "files": len(all_files),
            "packages": len(packages),
            "package_list": packages,
            "top_level_modules": top,
            "processes": sum(1 for p in procs if p["files"]),
            "processes_hooked": len(procs),
        },
    }


def print_report(res: dict[str, Any]) -> None:
    cfg = res["config"]
    mode = (
        "single engine"
        if not (cfg["prefill"] or cfg["decode"])
        else (f"--prefill {cfg['prefill']} --decode {cfg['decode']}")
    )
    print(f"repo {res['repo']} @ {res['commit'][:10]}  ({mode}, model {res['model']})")
    print(f"completion: {res['completion']!r}  usage: {res['usage']}")
    print(f"recording window: {res['window_s']} s  (* = also called in an idle window)")
    for p in res["processes"]:
        files = p["files"]
        pk = {q for f in files if (q := package(f))}
        print()
        print(
            f"[{p['role']}] pid {p['pid']}: {len(files)} files, {len(pk)} packages"
            f"  (pdserve from {p['pdserve_file']})"
        )
        if not files:
            print("    (no pdserve code)")
        idle = set(p["also_idle"])
        for f, n in files.items():
            print(f"  {'*' if f in idle else ' '} {f:<52} {n:>8}")
    t = res["totals"]
    print()
    print(
        f"totals: {t['files']} distinct files, {t['packages']} packages"
        f" + {len(t['top_level_modules'])} top-level modules, "
        f"{t['processes']} processes ({t['processes_hooked']} hooked)"
    )
    print("packages:", " ".join(t["package_list"]))
    print("top-level modules:", " ".join(t["top_level_modules"]))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--prefill", type=int, default=1, help="prefill instances (0/0: one engine)")
    ap.add_argument("--decode", type=int, default=1, help="decode instances (0/0: one engine)")
    ap.add_argument("--repo", default=str(DEFAULT_REPO), help="checkout to run the server from")
    ap.add_argument("--python", default=sys.executable, help="interpreter for the server")
    ap.add_argument("--max-model-len", type=int, default=512)
    ap.add_argument("--server-args", default="", help="more `pdserve serve` arguments (shlex)")
    ap.add_argument("--window", type=float, default=0.5, help="seconds before / after the request")
    ap.add_argument("--startup-timeout", type=float, default=300.0)
    ap.add_argument("--request-timeout", type=float, default=120.0)
    ap.add_argument("--stop-timeout", type=float, default=60.0)
    ap.add_argument("--json", default=None, metavar="PATH", help="also write the results here")
    args = ap.parse_args()
    if (args.prefill == 0) != (args.decode == 0):
        ap.error("--prefill and --decode are both 0 (one engine) or both > 0")
    res = measure(args)
    print_report(res)
    if args.json:
        Path(args.json).write_text(json.dumps(res, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
