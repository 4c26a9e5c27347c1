"""`pdserve serve`'s fork server (cluster/forkserver.py): a process forked from it finds
the engine imported (and frozen, out of the garbage collector's reach) when its target
starts, and takes the environment its parent has when it asks for the process, not the
one the server started with; before `start`, processes are spawned.

The checks run in a fresh interpreter: starting the server changes how that process
makes instances from then on, which the rest of a test session must not inherit."""

from __future__ import annotations

import subprocess
import sys

SCRIPT = """
import os
from pdserve.cluster import forkserver

# A child's target, as an instance's entry point does: adopt the parent's environment.
# Its exit code: +1 when the engine was not imported before it ran, +2 when it does not
# see the variable the parent set after the server started, +4 when the objects it
# inherited are not frozen (a collection would scan, and so copy, their pages).
PROBE = '''
import gc, os, sys
code = 0 if {{'torch', 'pdserve.engine.engine_process'}} <= set(sys.modules) else 1
code += 0 if gc.get_freeze_count() > 100_000 else 4
from pdserve.cluster.forkserver import adopt_environment
adopt_environment({environ!r})
os._exit(code + (0 if os.environ.get('PDSERVE_FORKSERVER_TEST') == 'set later' else 2))
'''

def run():
    ctx = forkserver.context()
    p = ctx.Process(target=exec, args=(PROBE.format(environ=dict(os.environ)),))
    p.start()
    p.join(300)
    return f"{ctx.get_start_method()} {p.exitcode}"

print(run())
print(forkserver.start(), forkserver.start())
print(run())
os.environ["PDSERVE_FORKSERVER_TEST"] = "set later"
print(run())
"""


def test_instances_fork_from_a_preloaded_server_in_their_parents_environment() -> None:
    out = subprocess.run(
        [sys.executable, "-c", SCRIPT], capture_output=True, text=True, timeout=600, check=True
    )
    assert out.stdout.splitlines() == ["spawn 7", "True True", "forkserver 2", "forkserver 0"]
    assert out.stderr == ""
