"""A learner microbatch: b sequences padded into [b, S] rows or packed into one [1, T] row, and
the helpers that build and read them (the empty microbatch that keeps data-parallel ranks in
step, right padding, per-sequence values of a packed row)."""

from __future__ import annotations

from dataclasses import dataclass, replace
from functools import partial

import torch

from mugrpo_megatron.learner.packing import PackedRow
from mugrpo_megatron.types import TokenBatch, TrainBatch


@dataclass
class MicroBatch:
    """b sequences, padded ([b, S] inputs) or packed into one row ([1, T] inputs, ``packed``).

    The per-sequence tensors are ``[b, L]`` and next-aligned (L = S padded, the longest sequence
    packed): position j is about predicting token j + 1 of that sequence."""

    rows: slice | torch.Tensor  # rows of the batch given
    tokens: torch.Tensor        # [b, S] or [1, T]
    position_ids: torch.Tensor  # like tokens
    labels: torch.Tensor        # like tokens: the next token (0 at each sequence's end)
    loss_mask: torch.Tensor     # [b, L] next token is a response token
    behav_logp: torch.Tensor | None = None  # [b, L]
    advantages: torch.Tensor | None = None  # [b]
    packed: PackedRow | None = None


def next_aligned(x: torch.Tensor) -> torch.Tensor:
    """[B, S] aligned with tokens -> aligned with the prediction of the next token."""
    out = torch.zeros_like(x)
    out[:, :-1] = x[:, 1:]
    return out


def filler(capacity: int, train: bool) -> MicroBatch:
    """A packed microbatch of padding only: no sequence of the batch, no loss, no result row (it
    keeps ranks that must step together in step; see ``Learner._equal_count``)."""
    zeros = torch.zeros(1, capacity, dtype=torch.long)
    packed = PackedRow(tokens=zeros, position_ids=torch.arange(capacity)[None], labels=zeros,
                       lengths=[capacity], unpack=torch.arange(capacity)[None],
                       valid=torch.zeros(1, capacity, dtype=torch.bool))
    return MicroBatch(rows=torch.zeros(0, dtype=torch.long), tokens=zeros,
                       position_ids=packed.position_ids, labels=zeros, loss_mask=packed.valid,
                       behav_logp=torch.zeros(1, capacity) if train else None,
                       advantages=torch.zeros(1) if train else None, packed=packed)


def right_padded(batch: TokenBatch, seq: int) -> TokenBatch:
    """``batch`` right-padded to ``seq`` positions (padding is no response token: no loss and no
    log-prob sees it)."""
    pad = partial(torch.nn.functional.pad, pad=(0, seq - batch.tokens.shape[1]))
    extra = {"behav_logp": pad(batch.behav_logp)} if isinstance(batch, TrainBatch) else {}
    return replace(batch, tokens=pad(batch.tokens), response_mask=pad(batch.response_mask),
                   **extra)


def per_sequence(mb: MicroBatch, values: torch.Tensor) -> torch.Tensor:
    """Per-position values of the model's rows -> ``[b, L]`` per sequence (unpacked if packed)."""
    return mb.packed.unpack_values(values) if mb.packed is not None else values

