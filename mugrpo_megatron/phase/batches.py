"""Batches for the learner from rollout rows, and the train/inference log-prob gap.

A phase's rollouts live on disk (``phase.store``) and reach the learner as rows of numpy arrays,
never as Python objects per response. No engine, no learner.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from mugrpo_megatron.layout import round_up
from mugrpo_megatron.types import TrainBatch


def padded_batch(rows: Sequence[tuple[Sequence[int], Sequence[int], Sequence[float]]],
                 advantages: Sequence[float], pad_id: int = 0, multiple_of: int = 1,
                 ref_logprobs: Sequence[Sequence[float]] | None = None,
                 tool_spans: Sequence[Sequence[int]] | None = None) -> TrainBatch:
    """Right-padded prompt+response rows from (prompt ids, response ids, behaviour log-probs)
    (tuples or numpy views of a mapped shard), with each response's reference log-probs when
    given; the length is rounded up to ``multiple_of``. ``tool_spans``: each response's tool
    messages ([start, end) pairs in it, flattened), which stay out of ``response_mask``: the
    loss, its counts, the veto and the log-prob gap see the model's tokens only. Memory and
    time: the batch."""
    lengths = [len(p) + len(r) for p, r, _ in rows]
    seq = round_up(max(lengths), multiple_of)
    tokens = np.full((len(rows), seq), pad_id, dtype=np.int64)
    mask = np.zeros((len(rows), seq), dtype=bool)
    behav = np.zeros((len(rows), seq), dtype=np.float32)
    ref = np.zeros((len(rows), seq), dtype=np.float32) if ref_logprobs is not None else None
    for k, (p, r, lp) in enumerate(rows):
        a, b = len(p), len(p) + len(r)
        tokens[k, :a] = p
        tokens[k, a:b] = r
        behav[k, a:b] = lp
        mask[k, a:b] = True
        if tool_spans is not None:
            for start, end in zip(tool_spans[k][0::2], tool_spans[k][1::2]):
                mask[k, a + start:a + end] = False
        if ref is not None:
            ref[k, a:b] = ref_logprobs[k]
    return TrainBatch(torch.from_numpy(tokens), torch.from_numpy(mask), torch.from_numpy(behav),
                      torch.as_tensor(np.asarray(advantages, dtype=np.float32)),
                      torch.from_numpy(ref) if ref is not None else None)


@dataclass(frozen=True)
class LogprobGap:
    """|learner log-prob - the batch's behaviour log-prob| over response tokens: the
    train/inference mismatch (the engine's log-probs), or two learner paths against each other.
    Gaps of several batches add up (``+``) to the gap over all their tokens."""

    total: float = 0.0
    """Sum of the differences."""
    max: float = 0.0
    num_tokens: int = 0

    @property
    def mean(self) -> float:
        return self.total / self.num_tokens if self.num_tokens else 0.0

    def __add__(self, other: LogprobGap) -> LogprobGap:
        return LogprobGap(self.total + other.total, max(self.max, other.max),
                          self.num_tokens + other.num_tokens)


def response_span(mask_row: torch.Tensor) -> slice:
    """The columns of a row's response, from its first to its last token in ``response_mask``:
    a trajectory's tool messages inside it too (it starts and ends with model tokens)."""
    at = torch.nonzero(mask_row).flatten()
    return slice(int(at[0]), int(at[-1]) + 1) if at.numel() else slice(0, 0)


def logprob_gap(learner_logp: torch.Tensor, batch: TrainBatch, rows: int | None = None
                ) -> LogprobGap:
    """The gap over the response tokens of the batch's first ``rows`` rows (default: all)."""
    n = batch.size if rows is None else rows
    diff = (learner_logp[:n] - batch.behav_logp[:n]).abs()[batch.response_mask[:n]]
    if diff.numel() == 0:
        return LogprobGap()
    return LogprobGap(float(diff.double().sum()), float(diff.max()), int(diff.numel()))
