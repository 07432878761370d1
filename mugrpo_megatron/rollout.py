"""Rollout data: samples from the engine, their rewards and advantages, and batches for the learner.

Pure torch: no engine, no learner.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace

import torch

from mugrpo_megatron.objective import group_advantages
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


def with_advantages(samples: Sequence[Sample], group_size: int, eps: float) -> list[Sample]:
    """Group-normalised advantages, computed once per phase (samples ordered by group)."""
    rewards = torch.tensor([s.reward for s in samples], dtype=torch.float64)
    adv = group_advantages(rewards, group_size, eps)
    return [replace(s, advantage=float(a)) for s, a in zip(samples, adv)]


def uniform_groups(samples: Sequence[Sample], group_size: int) -> set[int]:
    """Groups whose G rewards are all equal: they carry no learning signal."""
    out = set()
    for start in range(0, len(samples), group_size):
        rewards = {s.reward for s in samples[start:start + group_size]}
        if len(rewards) == 1:
            out.add(samples[start].group)
    return out


def to_batch(samples: Sequence[Sample], pad_id: int = 0, multiple_of: int = 1) -> TrainBatch:
    """Right-padded prompt+response rows; the sequence length is rounded up to ``multiple_of``."""
    lengths = [len(s.prompt_ids) + len(s.response_ids) for s in samples]
    seq = -(-max(lengths) // multiple_of) * multiple_of
    tokens = torch.full((len(samples), seq), pad_id, dtype=torch.long)
    mask = torch.zeros((len(samples), seq), dtype=torch.bool)
    behav = torch.zeros((len(samples), seq), dtype=torch.float32)
    for i, s in enumerate(samples):
        p, r = len(s.prompt_ids), len(s.response_ids)
        tokens[i, :p] = torch.tensor(s.prompt_ids)
        if r:
            tokens[i, p:p + r] = torch.tensor(s.response_ids)
            behav[i, p:p + r] = torch.tensor(s.behav_logprobs)
            mask[i, p:p + r] = True
    adv = torch.tensor([s.advantage for s in samples], dtype=torch.float32)
    return TrainBatch(tokens, mask, behav, adv)


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
