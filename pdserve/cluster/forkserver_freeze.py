"""Imported by the fork server only, after everything it preloads (cluster/forkserver.py):
its import moves what the server imported out of the garbage collector's reach.

An instance forked from the server shares those objects' pages with it until it writes
them, and a full collection writes every object it scans (its GC header): the engine's
`freeze_startup_heap` made each instance copy ~50 MB of inherited pages and spend ~0.3 s
on them. Frozen here, before any fork, they are never scanned in an instance.
"""

from pdserve.runtime import freeze_startup_heap

freeze_startup_heap()
