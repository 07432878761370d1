"""Shared helpers for the benchmark scripts (and the tests): a response as a Python object and
batches of them, repeats, medians and spread, tables, JSON output."""

from __future__ import annotations

import json
import platform
import statistics
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

from mugrpo_megatron.phase.batches import padded_batch
from mugrpo_megatron.types import TrainBatch


@dataclass(frozen=True)
class Sample:
    """One response to one prompt as a Python object: for tests, benchmarks and the engine
    contract checks (a phase keeps its responses as arrays in shards, never as these)."""

    phase: int
    """Phase that generated it (the behaviour policy's phase)."""
    prompt_index: int
    """Row of the prompt in the training set."""
    group: int
    """Position of the prompt within the phase; the G samples of a prompt share it."""
    prompt_ids: tuple[int, ...]
    response_ids: tuple[int, ...]
    behav_logprobs: tuple[float, ...]
    """The engine's log-prob of each response token when it sampled it."""
    finish_reason: str
    reward: float = 0.0
    advantage: float = 0.0


def to_batch(samples: Sequence[Sample], pad_id: int = 0, multiple_of: int = 1) -> TrainBatch:
    """``padded_batch`` of ``Sample`` objects (tests, benchmarks, the engine contract checks)."""
    return padded_batch([(s.prompt_ids, s.response_ids, s.behav_logprobs) for s in samples],
                        [s.advantage for s in samples], pad_id, multiple_of)




def random_batch(n: int, prompt_len: int, response_len: int, vocab: int, seed: int = 0):
    """A training batch of ``n`` random prompt + response sequences with fixed behaviour
    log-probs and advantages in {-1, 0, 1}: a workload for timing, not for learning."""
    g = torch.Generator().manual_seed(seed)
    samples = [Sample(0, i, i // 4,
                      tuple(torch.randint(5, vocab, (prompt_len,), generator=g).tolist()),
                      tuple(torch.randint(5, vocab, (response_len,), generator=g).tolist()),
                      tuple([-3.0] * response_len), "length", advantage=float(i % 3 - 1))
               for i in range(n)]
    return to_batch(samples)


def spawn_ranks(target, *args, ranks: int = 2, timeout: float = 600) -> list[int | None]:
    """``target(rank, *args)`` in ``ranks`` fresh processes (spawned: no state of this one),
    each killed past ``timeout`` seconds; their exit codes. The targets form their gloo world
    themselves, through a file rendezvous (``gloo_world``), so no port is raced for."""
    import multiprocessing

    ctx = multiprocessing.get_context("spawn")
    procs = [ctx.Process(target=target, args=(r, *args), daemon=True) for r in range(ranks)]
    for proc in procs:
        proc.start()
    for proc in procs:
        proc.join(timeout=timeout)
    for proc in procs:
        if proc.is_alive():
            proc.kill()
            proc.join()
    return [proc.exitcode for proc in procs]


def gloo_world(rank: int, ranks: int, directory: str | Path, minutes: float = 60) -> None:
    """Join a gloo world of ``ranks`` through a rendezvous file in ``directory``."""
    import datetime

    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"file://{directory}/rendezvous", rank=rank,
                            world_size=ranks, timeout=datetime.timedelta(minutes=minutes))


def summarize(values: list[float]) -> dict[str, float]:
    return {"median": statistics.median(values), "min": min(values), "max": max(values),
            "n": len(values)}


def machine() -> dict[str, str]:
    return {"date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
            "cpu": platform.processor() or platform.machine(),
            "threads": str(torch.get_num_threads()),
            "gpu": torch.cuda.get_device_name() if torch.cuda.is_available() else "none",
            "torch": torch.__version__}


def table(headers: list[str], rows: list[list]) -> str:
    cells = [[str(h) for h in headers]] + [[_fmt(c) for c in r] for r in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(headers))]
    lines = [" | ".join(c.ljust(w) for c, w in zip(r, widths)) for r in cells]
    lines.insert(1, "-+-".join("-" * w for w in widths))
    return "\n".join(lines)


def _fmt(x) -> str:
    if isinstance(x, float):
        return f"{x:.4g}"
    return str(x)


def write_json(path: str | Path, payload: dict) -> None:
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    Path(path).write_text(json.dumps({"machine": machine(), **payload}, indent=1))
