"""A learner microbatch: b sequences padded into [b, S] rows or packed into one [1, T] row, and
the helpers that build and read them (the empty microbatch that keeps data-parallel ranks in
step, right padding, per-sequence values of a packed row)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace
from functools import partial

import torch

from mugrpo_megatron.chunked import SequenceSplit
from mugrpo_megatron.learner.packing import (
    PackedRow,
    pack_row,
    plan_bins,
    sequence_lengths,
    slot,
)
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
    ref_logp: torch.Tensor | None = None  # [b, L]: a reference policy's (algo.kl_target)
    is_weight: torch.Tensor | None = None  # [b, L]: importance weights (algo.rollout_is)
    advantages: torch.Tensor | None = None  # [b]
    packed: PackedRow | None = None
    split: SequenceSplit | None = None  # context parallel: these are this rank's columns


PER_TOKEN = ("loss_mask", "behav_logp", "ref_logp", "is_weight")
"""A microbatch's per-token tensors besides its inputs: cut alike by a context-parallel split."""


def split_columns(mb: MicroBatch, split: SequenceSplit) -> MicroBatch:
    """This context-parallel rank's columns of a padded microbatch: every per-token tensor cut
    alike (``learner.context.ChunkSplit``), the labels and masks next-aligned before the cut."""
    take = split.take  # type: ignore[attr-defined]
    cut = {name: take(getattr(mb, name)) for name in ("tokens", "position_ids", "labels",
                                                       *PER_TOKEN) if getattr(mb, name) is not None}
    return replace(mb, **cut, split=split)


def split_packed_columns(mb: MicroBatch, split) -> MicroBatch:
    """This context-parallel rank's share of a packed microbatch (``learner.context.
    PackedChunkSplit``): the row's tensors at its columns, the per-sequence ones in the share's
    ``[n, 2 W]`` layout."""
    share = split.share
    cut = {name: share.take(getattr(mb, name)) for name in PER_TOKEN
           if getattr(mb, name) is not None}
    cut["loss_mask"] = cut["loss_mask"] & share.row.valid
    return replace(mb, **cut, tokens=share.row.tokens, position_ids=share.row.position_ids,
                   labels=share.row.labels, packed=share.row, split=split)


def next_aligned(x: torch.Tensor) -> torch.Tensor:
    """[B, S] aligned with tokens -> aligned with the prediction of the next token."""
    out = torch.zeros_like(x)
    out[:, :-1] = x[:, 1:]
    return out


def filler(capacity: int, train: bool, ref: bool = False) -> MicroBatch:
    """A packed microbatch of padding only: no sequence of the batch, no loss, no result row (it
    keeps ranks that must step together in step; see ``Learner._equal_count``)."""
    zeros = torch.zeros(1, capacity, dtype=torch.long)
    packed = PackedRow(tokens=zeros, position_ids=torch.arange(capacity)[None], labels=zeros,
                       lengths=[capacity], unpack=torch.arange(capacity)[None],
                       valid=torch.zeros(1, capacity, dtype=torch.bool))
    return MicroBatch(rows=torch.zeros(0, dtype=torch.long), tokens=zeros,
                       position_ids=packed.position_ids, labels=zeros, loss_mask=packed.valid,
                       behav_logp=torch.zeros(1, capacity) if train else None,
                       ref_logp=torch.zeros(1, capacity) if train and ref else None,
                       advantages=torch.zeros(1) if train else None, packed=packed)


def right_padded(batch: TokenBatch, seq: int) -> TokenBatch:
    """``batch`` right-padded to ``seq`` positions (padding is no response token: no loss and no
    log-prob sees it)."""
    pad = partial(torch.nn.functional.pad, pad=(0, seq - batch.tokens.shape[1]))
    extra = {}
    if isinstance(batch, TrainBatch):
        extra["behav_logp"] = pad(batch.behav_logp)
        if batch.ref_logp is not None:
            extra["ref_logp"] = pad(batch.ref_logp)
        if batch.is_weight is not None:
            extra["is_weight"] = pad(batch.is_weight, value=1.0)
    return replace(batch, tokens=pad(batch.tokens), response_mask=pad(batch.response_mask),
                   **extra)


def per_sequence(mb: MicroBatch, values: torch.Tensor) -> torch.Tensor:
    """Per-position values of the model's rows -> ``[b, L]`` per sequence (unpacked if packed)."""
    return mb.packed.unpack_values(values) if mb.packed is not None else values


def build_microbatches(batch: TokenBatch, rows: slice, *, micro_batch_size: int, capacity: int,
                       train: bool, with_ref: bool, equal_count: Callable[[int], int],
                       align: int = 1) -> list[MicroBatch]:
    """``batch``'s ``rows`` as microbatches: ``micro_batch_size`` rows padded to the batch's
    width, or (``capacity`` > 0) packed into rows of ``capacity`` tokens, one a microbatch, and
    ``equal_count(bins)`` of them at least (empty ``filler`` ones after: the learner's
    ``_equal_count``, the most any rank of the data-parallel group packed), each sequence
    starting at a multiple of ``align`` (context parallelism: 2 x CP). ``train`` adds the
    behaviour log-probs, advantages and importance weights, ``with_ref`` the reference log-probs."""
    seq = batch.tokens.shape[1]
    labels = next_aligned(batch.tokens)
    loss_mask = next_aligned(batch.response_mask.bool())
    behav = next_aligned(batch.behav_logp.float()) if train else None
    ref = next_aligned(batch.ref_logp.float()) if with_ref else None
    weight = next_aligned(batch.is_weight.float()) \
        if train and batch.is_weight is not None else None  # a filler has none: no loss

    def per_row(idx, width: int | None = None) -> dict:
        """The per-sequence fields of rows ``idx`` (cut to ``width`` columns when packed)."""
        cut = (lambda t: t[idx]) if width is None else (lambda t: t[idx, :width])
        return dict(rows=idx, behav_logp=cut(behav) if behav is not None else None,
                    ref_logp=cut(ref) if ref is not None else None,
                    is_weight=cut(weight) if weight is not None else None,
                    advantages=batch.advantages[idx].float() if train else None)

    if not capacity:
        out = []
        for start in range(rows.start, rows.stop, micro_batch_size):
            idx = slice(start, min(start + micro_batch_size, rows.stop))
            n = idx.stop - idx.start
            out.append(MicroBatch(**per_row(idx), tokens=batch.tokens[idx],
                                  position_ids=torch.arange(seq).expand(n, seq),
                                  labels=labels[idx], loss_mask=loss_mask[idx]))
        return out
    mine = list(range(rows.start, rows.stop))
    lengths = sequence_lengths(batch.response_mask[mine])
    bins = plan_bins([slot(n, align) for n in lengths], capacity)
    out = [filler(capacity, train, with_ref) for _ in range(equal_count(len(bins)) - len(bins))]
    for members in bins:
        idx = torch.tensor([mine[i] for i in members])
        lens = [lengths[i] for i in members]
        p = pack_row(batch.tokens[idx], lens, capacity, align)
        out.append(MicroBatch(**per_row(idx, max(lens)), packed=p, tokens=p.tokens,
                              position_ids=p.position_ids, labels=p.labels,
                              loss_mask=loss_mask[idx, :max(lens)] & p.valid))
    return out
