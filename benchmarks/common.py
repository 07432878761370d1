"""Shared helpers for the benchmark scripts: a random training batch, medians and spread, tables,
JSON output."""

from __future__ import annotations

import json
import platform
import statistics
import time
from pathlib import Path

import torch

from mugrpo_megatron.phase.batches import padded_batch


def random_batch(n: int, prompt_len: int, response_len: int, vocab: int, seed: int = 0):
    """A training batch of ``n`` random prompt + response sequences with fixed behaviour
    log-probs and advantages in {-1, 0, 1}: a workload for timing, not for learning."""
    g = torch.Generator().manual_seed(seed)
    rows = [(torch.randint(5, vocab, (prompt_len,), generator=g).tolist(),
             torch.randint(5, vocab, (response_len,), generator=g).tolist(),
             [-3.0] * response_len) for _ in range(n)]
    return padded_batch(rows, [float(i % 3 - 1) for i in range(n)])


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


def write_json(path: str | Path, payload: dict, compact: bool = False) -> None:
    """``payload`` with the machine's description; ``compact``: no indentation (per-update
    curves of many runs: half the size)."""
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    text = json.dumps({"machine": machine(), **payload}, indent=None if compact else 1,
                      separators=(",", ":") if compact else None)
    Path(path).write_text(text)
