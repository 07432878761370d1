"""The contract every rollout engine meets: generate with behaviour log-probs, take new weights,
release and reclaim accelerator memory, shut down."""

from __future__ import annotations

import abc
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, replace

import torch

from mugrpo_megatron.types import Generation, SamplingSpec


@dataclass(frozen=True)
class TurnRequest:
    """One model turn of a trajectory (``trajectory.engine``): one sample from ``token_ids``."""

    key: int
    """The caller's name for it, given back with its turn."""
    token_ids: Sequence[int]
    """The prompt and the trajectory so far."""
    max_new_tokens: int
    seed: int | None


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

    streams: bool = False
    """Whether ``generate_stream`` refills the batch as groups finish (a step API); without it
    the trainer streams in windows of ``rollout.shard_prompts``, so shards keep landing."""
    supports_sleep: bool = False
    """Whether sleep() really frees accelerator memory (False on CPU: it is a no-op there)."""
    sleep_discards_weights: bool = False
    """Whether sleep() drops the weights instead of keeping a copy (vLLM's sleep level 2, SGLang
    without a CPU backup): after it the engine holds no weights until ``update_weights``, and
    must not generate before. A sync overwrites them right after every wake in this loop, so
    a copy kept to the host and back would be moved for nothing."""
    takes_rows: bool = False
    """Whether ``generate`` and ``generate_stream`` take ``rows=`` (each prompt's settings for
    the tools of a trajectory engine, ``trajectory.engine.ToolEngine``)."""
    max_running_sequences: int | None = None
    """The most sequences the engine runs at once (None: not known), which sizes the queue a
    replica keeps in it (``fleet.inflight_prompts``)."""
    weight_format: str = ""
    """How a sync's weights reach the engine, where it is not the model's dtype as sent (said
    once at start: an FP8 engine's scales, UE8M0 or float32)."""

    @abc.abstractmethod
    def generate(self, prompts: Sequence[Sequence[int]], sampling: SamplingSpec
                 ) -> list[list[Generation]]:
        """``sampling.n`` responses for each prompt (token ids), in prompt order."""

    def generate_stream(self, prompts: Sequence[Sequence[int]], sampling: SamplingSpec,
                        positions: Sequence[int], max_in_flight: int = 0
                        ) -> Iterator[tuple[int, list[Generation]]]:
        """``sampling.n`` responses for each prompt, yielded as ``(i, responses)`` as each
        prompt's group finishes, in any order.

        Prompt ``i`` is sampled as if it stood at index ``positions[i]`` of one ``generate``
        call (seed ``sampling.seed + positions[i] * n``): its samples depend on its position in
        the phase, not on which replica serves it or what else is in flight. At most
        ``max_in_flight`` prompts are in the engine at once (0: all of them).

        This default calls ``generate`` on windows of ``max_in_flight`` prompts, one call per run
        of consecutive positions, so each window waits for its slowest response; engines with a
        step API (vLLM) override it to refill the batch as each group finishes."""
        window = max_in_flight or len(prompts)
        for lo in range(0, len(prompts), window):
            hi = min(lo + window, len(prompts))
            start = lo
            while start < hi:
                end = start + 1
                while end < hi and positions[end] == positions[end - 1] + 1:
                    end += 1
                spec = sampling.from_position(positions[start])
                for k, group in enumerate(self.generate(prompts[start:end], spec)):
                    yield start + k, group
                start = end

    _turns: list[TurnRequest] | None = None
    """Turns queued and not yet run (the default turn API below)."""

    def submit_turns(self, requests: Sequence[TurnRequest], sampling: SamplingSpec) -> None:
        """Queue model turns, one sample each (``sampling`` with n = 1; each request's own
        length and seed), while others run. ``step_turns`` gives them back as they finish.

        This default keeps them for the next ``step_turns``, which generates every queued turn
        in ``generate`` calls (one per distinct length; engines without per-request seeds);
        engines with a step API (vLLM) add them to the running batch at once."""
        self._turn_sampling = sampling
        self._turns = (self._turns or []) + list(requests)

    def step_turns(self) -> list[tuple[int, Generation]]:
        """Advance the engine; the turns that finished, as (key, the turn)."""
        todo, self._turns = self._turns or [], []
        out = []
        for length in sorted({r.max_new_tokens for r in todo}):
            batch = [r for r in todo if r.max_new_tokens == length]
            spec = replace(self._turn_sampling, n=1, max_new_tokens=length, seed=None)
            groups = self.generate([r.token_ids for r in batch], spec)
            out += [(r.key, group[0]) for r, group in zip(batch, groups)]
        return out

    def abort_turns(self) -> None:
        """Drop every turn queued or running (a stream that stopped early)."""
        self._turns = []

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
