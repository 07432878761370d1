"""Batches for the learner from rollout rows, and the train/inference log-prob gap.

A phase's rollouts live on disk (``phase_store``); ``Sample`` is one response as a Python object,
for tests, benchmarks and the engine contract checks, never a whole phase. No engine, no learner.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from mugrpo_megatron.types import TrainBatch


@dataclass(frozen=True)
class Sample:
    """One response to one prompt, as generated and scored in a phase."""

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


def padded_batch(rows: Sequence[tuple[Sequence[int], Sequence[int], Sequence[float]]],
                 advantages: Sequence[float], pad_id: int = 0, multiple_of: int = 1) -> TrainBatch:
    """Right-padded prompt+response rows from (prompt ids, response ids, behaviour log-probs)
    (tuples or numpy views of a mapped shard); the length is rounded up to ``multiple_of``.
    Memory and time: the batch."""
    lengths = [len(p) + len(r) for p, r, _ in rows]
    seq = -(-max(lengths) // multiple_of) * multiple_of
    tokens = np.full((len(rows), seq), pad_id, dtype=np.int64)
    mask = np.zeros((len(rows), seq), dtype=bool)
    behav = np.zeros((len(rows), seq), dtype=np.float32)
    for k, (p, r, lp) in enumerate(rows):
        a, b = len(p), len(p) + len(r)
        tokens[k, :a] = p
        tokens[k, a:b] = r
        behav[k, a:b] = lp
        mask[k, a:b] = True
    return TrainBatch(torch.from_numpy(tokens), torch.from_numpy(mask), torch.from_numpy(behav),
                      torch.as_tensor(np.asarray(advantages, dtype=np.float32)))


def to_batch(samples: Sequence[Sample], pad_id: int = 0, multiple_of: int = 1) -> TrainBatch:
    """``padded_batch`` of ``Sample`` objects (tests, benchmarks, the engine contract checks)."""
    return padded_batch([(s.prompt_ids, s.response_ids, s.behav_logprobs) for s in samples],
                        [s.advantage for s in samples], pad_id, multiple_of)


@dataclass(frozen=True)
class LogprobGap:
    """Train/inference mismatch: |learner log-prob - engine log-prob| over response tokens."""

    mean: float
    max: float
    num_tokens: int


def logprob_gap(learner_logp: torch.Tensor, batch: TrainBatch) -> LogprobGap:
    diff = (learner_logp - batch.behav_logp).abs()[batch.response_mask]
    if diff.numel() == 0:
        return LogprobGap(0.0, 0.0, 0)
    return LogprobGap(float(diff.mean()), float(diff.max()), int(diff.numel()))
