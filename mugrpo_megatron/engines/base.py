"""The contract every rollout engine meets: generate with behaviour log-probs, take new weights,
release and reclaim accelerator memory, shut down."""

from __future__ import annotations

import abc
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class SamplingSpec:
    """How to sample: G responses per prompt."""

    n: int
    """Responses per prompt (G)."""
    max_new_tokens: int
    """Longest response."""
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    seed: int | None = None
    """Sampling seed (None: the engine's own stream). Engines that seed per request sample the
    j-th response to prompt i with seed + i * n + j, so no two samples of a call share a seed."""


@dataclass(frozen=True)
class Generation:
    """One sampled response."""

    token_ids: tuple[int, ...]
    """The generated tokens (the prompt excluded)."""
    logprobs: tuple[float, ...]
    """The behaviour policy's log-prob of each generated token, as the engine sampled it."""
    finish_reason: str
    """'stop' (EOS or a stop token) or 'length' (max_new_tokens reached)."""


@dataclass(frozen=True)
class WeightSyncStats:
    """What one weight update moved and how long it took."""

    num_tensors: int
    num_bytes: int
    seconds: float

    @property
    def gb_per_s(self) -> float:
        return self.num_bytes / 1e9 / self.seconds if self.seconds > 0 else float("inf")


class RolloutEngine(abc.ABC):
    """A rollout engine holding a copy of the policy in HF layout."""

    supports_sleep: bool = False
    """Whether sleep() really frees accelerator memory (False on CPU: it is a no-op there)."""

    @abc.abstractmethod
    def generate(self, prompts: Sequence[Sequence[int]], sampling: SamplingSpec
                 ) -> list[list[Generation]]:
        """``sampling.n`` responses for each prompt (token ids), in prompt order."""

    @abc.abstractmethod
    def update_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> WeightSyncStats:
        """Load new weights, given as (HF name, full tensor), consumed lazily in one pass; the
        engine's prefix cache is invalidated."""

    _asleep: frozenset[str] = frozenset()
    """The memory types (engine tags) that sleep() released and wake() has not brought back."""

    def sleep(self) -> None:
        """Release accelerator memory (weights and KV cache) until wake(); a no-op without
        ``supports_sleep`` or when already asleep."""
        if self.supports_sleep and not self._asleep:
            self._asleep = frozenset(self._release_memory())

    def wake(self, weights_only: bool = False) -> None:
        """Reclaim accelerator memory released by sleep(). With ``weights_only``, only the
        weights' (to take new weights while the learner still holds its memory); a later
        ``wake()`` brings back the rest (KV cache) once the learner has stepped aside. Each type
        is resumed once (engines refuse to resume one that is not released)."""
        tags = sorted(self._asleep & {"weights"} if weights_only else self._asleep)
        if tags:
            self._resume_memory(tags)
            self._asleep = self._asleep - set(tags)

    def _release_memory(self) -> set[str]:
        """Release every type of accelerator memory; returns the tags wake() resumes them by.
        Engines with ``supports_sleep`` implement it."""
        raise NotImplementedError

    def _resume_memory(self, tags: list[str]) -> None:
        """Take back the memory types ``tags``."""
        raise NotImplementedError

    @abc.abstractmethod
    def shutdown(self) -> None:
        """Free every resource of the engine."""
