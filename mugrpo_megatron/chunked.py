"""The loss's whole-response quantities when each rank holds only some columns of a response
(context parallelism): the veto's first trigger (or the prefix ratio's first crossing), the
per-response token counts and which responses have a property anywhere. Each is a small
reduction over the ranks that share the rows, through ``SequenceSplit``: one all-reduce of
[B] or [B, 2 x CP] numbers a quantity, the same number of them on every rank whatever the
lengths or the triggers. Pure torch; the learner gives the split (``learner.context``).
"""

from __future__ import annotations

import math
from typing import Protocol

import torch

NO_POSITION = 1 << 40
"""A position beyond any row: the first trigger of a row without one."""


class SequenceSplit(Protocol):
    """This rank's columns of rows split over a group (``learner.context.ChunkSplit``)."""

    positions: torch.Tensor
    """``[T_local]``: the global column of each local column, increasing within each chunk."""
    chunk_index: tuple[int, int]
    """The global chunk index of the local columns' first and second half."""
    num_chunks: int
    cp_rank: int

    def reduce(self, x: torch.Tensor, op=...) -> torch.Tensor: ...


def first_position(flags_bt: torch.Tensor, split: SequenceSplit) -> torch.Tensor:
    """``[B]``: each row's first global position where ``flags_bt`` holds, over every rank
    (``NO_POSITION`` where none does)."""
    import torch.distributed as dist

    pos = split.positions.to(flags_bt.device)
    big = torch.full_like(flags_bt, NO_POSITION, dtype=torch.long)
    local = torch.where(flags_bt, pos.expand_as(flags_bt), big).min(dim=1).values \
        if flags_bt.shape[1] else torch.full((flags_bt.shape[0],), NO_POSITION,
                                             dtype=torch.long, device=flags_bt.device)
    return split.reduce(local.contiguous(), dist.ReduceOp.MIN)


def global_prefix_sum(values_bt: torch.Tensor, split: SequenceSplit) -> torch.Tensor:
    """``[B, T_local]``: the running sum along each whole row, at this rank's columns (each
    local chunk's own running sum plus the totals of every earlier chunk, from one all-reduce
    of the [B, 2 x CP] chunk totals)."""
    half = values_bt.shape[1] // 2
    totals = values_bt.new_zeros(values_bt.shape[0], split.num_chunks)
    first, second = split.chunk_index
    totals[:, first] = values_bt[:, :half].sum(dim=1)
    totals[:, second] = values_bt[:, half:].sum(dim=1)
    totals = split.reduce(totals)
    before = torch.cumsum(totals, dim=1) - totals  # exclusive: the chunks before each one
    local = torch.cat([torch.cumsum(values_bt[:, :half], dim=1) + before[:, first:first + 1],
                       torch.cumsum(values_bt[:, half:], dim=1) + before[:, second:second + 1]],
                      dim=1)
    return local


def row_any(flags_b: torch.Tensor, split: SequenceSplit) -> torch.Tensor:
    """``[B]`` bool: the flag on any rank."""
    import torch.distributed as dist

    return split.reduce(flags_b.to(torch.int32).contiguous(), dist.ReduceOp.MAX) > 0


def row_counts(mask_bt: torch.Tensor, split: SequenceSplit) -> torch.Tensor:
    """``[B, 1]`` float64: each row's count of ``mask_bt`` over every rank."""
    return split.reduce(mask_bt.sum(dim=1, keepdim=True).to(torch.float64))


def veto_mask_split(log_ratio: torch.Tensor, negative_b1: torch.Tensor,
                    response_bt: torch.Tensor, threshold: float, scope: str,
                    prefix_bound: float | None, split: SequenceSplit) -> torch.Tensor:
    """``objective.veto_mask`` (its arguments already checked) for this rank's columns of rows
    split over ranks: the same tokens kept as the whole rows would keep."""
    pos_bt = split.positions.to(log_ratio.device).expand_as(response_bt)
    if scope == "prefix":
        values = torch.where(response_bt, log_ratio.detach().double(),
                             torch.zeros((), dtype=torch.float64, device=log_ratio.device))
        crossed_bt = response_bt & negative_b1 & (global_prefix_sum(values, split) < -prefix_bound)
        kappa_b1 = first_position(crossed_bt, split)[:, None]
        return response_bt & ~(pos_bt > kappa_b1)
    trigger_bt = response_bt & negative_b1 & (log_ratio.detach() < math.log(threshold))
    kappa_b1 = first_position(trigger_bt, split)[:, None]
    # strictly after the first trigger; a row with one anywhere
    return response_bt & ~scope_masked(scope, trigger_bt, pos_bt > kappa_b1,
                                       kappa_b1 < NO_POSITION)


def scope_masked(scope: str, trigger_bt: torch.Tensor, after_kappa_bt: torch.Tensor,
                 has_trigger_b1: torch.Tensor) -> torch.Tensor:
    """The tokens a trigger-based veto scope masks, from the triggers, the tokens strictly after
    each row's first one and whether a row has one (``objective.veto_mask`` and
    ``veto_mask_split`` find these their own ways)."""
    if scope == "trigger":
        return trigger_bt
    if scope == "suffix":
        return after_kappa_bt
    if scope == "suffix_no_trigger":
        return after_kappa_bt & ~trigger_bt
    return has_trigger_b1.expand_as(trigger_bt)  # "sequence"
