"""Where numbers go: the console, ``metrics.jsonl`` in the run directory, TensorBoard, wandb.

Only the logging rank (global rank 0) writes. Each record has a ``kind`` ("update", "phase",
"event") and the global update it belongs to.
"""

from __future__ import annotations

import json
import math
import os
import sys
import time
from pathlib import Path
from typing import Any

from mugrpo_megatron import outputs
from mugrpo_megatron.config import LoggingConfig


class MetricsLogger:
    def __init__(self, cfg: LoggingConfig, run_dir: Path, enabled: bool, run_config: dict | None = None):
        self.cfg = cfg
        self.enabled = enabled
        self.path = run_dir / "metrics.jsonl"
        self._tb = None
        self._wandb = None
        if not enabled:
            return
        run_dir.mkdir(parents=True, exist_ok=True)
        if cfg.tensorboard:
            try:
                from torch.utils.tensorboard import SummaryWriter
            except ImportError:
                print("[metrics] tensorboard is not installed; logging.tensorboard ignored",
                      file=sys.stderr)
            else:
                self._tb = SummaryWriter(str(run_dir / "tensorboard"))
        if cfg.wandb:
            import wandb  # the user asked for it: a missing package is an error

            self._wandb = wandb.init(project=cfg.wandb_project, dir=str(run_dir), config=run_config)

    def log(self, kind: str, update: int, values: dict[str, Any]) -> None:
        if not self.enabled:
            return
        record = {"kind": kind, "update": update, "time": time.time(), **values}
        line = (json.dumps(record, default=str) + "\n").encode()
        fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        try:
            end = os.fstat(fd).st_size
            with outputs.guard(self.path, "metrics", kept=outputs.KEPT, then=outputs.RESUME):
                try:
                    view = memoryview(line)
                    while view:
                        view = view[os.write(fd, view):]
                except OSError:
                    os.ftruncate(fd, end)  # no half line: the file stays one record a line
                    raise
        finally:
            os.close(fd)
        scalars = dict(_scalars(kind, values))
        if self._tb is not None:
            for k, v in scalars.items():
                self._tb.add_scalar(k, v, update)
            self._tb.flush()
        if self._wandb is not None:
            self._wandb.log(scalars, step=update)

    def close(self) -> None:
        if self._tb is not None:
            self._tb.close()
        if self._wandb is not None:
            self._wandb.finish()


def _scalars(prefix: str, values: dict[str, Any]):
    """(name, value) of every finite number in ``values``, nested mappings (a held-out set's
    numbers, the reward by source) named by their path: ``eval/sets/math500/pass@1``."""
    for k, v in values.items():
        if isinstance(v, dict):
            yield from _scalars(f"{prefix}/{k}", v)
        elif isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v):
            yield f"{prefix}/{k}", float(v)


def read_metrics(path: Path) -> list[dict]:
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
