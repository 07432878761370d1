"""No process of a run outlives it, however the run ends.

A run's process starts others: the reward workers (``rewards.scorer``), megatron-core's
checkpoint writers and the manager process that collects their results (``learner.
compat_megatron`` part 7), and through them Python's multiprocessing resource tracker. A
``kill -9`` of the run (a user ending a stuck run, an OOM killer) gives none of them a chance to
be told, so each asks Linux, as its first act, to SIGKILL it when its parent dies
(``prctl(PR_SET_PDEATHSIG)``, as SGLang's and vLLM's workers do: ``kill_itself_when_parent_died``
there). The resource tracker then ends by itself: it lives while any process holds its pipe.

Linux sends the signal when the *thread* that started the child ends, not the process: whatever
starts such children must do it from a thread that lives as long as they should (the scorer
starts its pool from the thread that makes it; pebble replaces workers from its own manager
thread, which lives with the pool).
"""

from __future__ import annotations

import ctypes
import os
import signal

PR_SET_PDEATHSIG = 1
"""prctl(2) option: the signal the calling process gets when its parent (thread) dies
(linux/prctl.h)."""


def die_with_parent(parent: int | None = None) -> None:
    """Ask Linux to SIGKILL this process when its parent dies. ``parent``: the pid that started
    it; if the parent is already another (it died before this call, and the process was handed
    to init or a subreaper), exit at once. A no-op where prctl is missing (not Linux)."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        prctl = libc.prctl
    except (OSError, AttributeError):
        return
    prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    if parent is not None and os.getppid() != parent:
        os._exit(1)
