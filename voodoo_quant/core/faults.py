"""Fault injection for the reliability tests: SIGKILL this process at a named point.

Production runs never set ``VOODOO_FAULT_AT`` (read in ``envs.py`` only), and then :func:`hit`
is one dictionary lookup. The tests set it to prove that a run killed at that exact point —
mid-step, mid-write of a journal / cache entry / output, mid-bake, mid-export — resumes to the
same result and leaves no partial file under a final name. SIGKILL, not an exception: nothing
(no ``finally``, no atexit) gets to clean up, as with the OOM killer or a power cut.
"""

from __future__ import annotations

import os
import signal

from . import envs

_hits: dict[str, int] = {}  # per process: a forked or spawned child starts counting again


def hit(point: str) -> None:
    spec = envs.fault_at()
    if spec is None or spec[0] != point:
        return
    _hits[point] = _hits.get(point, 0) + 1
    if _hits[point] == spec[1]:
        os.kill(os.getpid(), signal.SIGKILL)
