"""Packing whole sequences into fixed-length rows, and reading per-sequence values back out.

A batch of prompt + response sequences of very different lengths wastes most of a padded
microbatch on padding. Packing puts several sequences end to end in one row of ``capacity`` tokens
(first-fit, longest first); attention must then not cross from one sequence into another: on
megatron's local attention this is a block-diagonal causal mask, on Transformer Engine the THD
layout with cumulative sequence lengths (``cu_seqlens``). RoPE needs nothing: within one sequence
only position differences enter attention, and no attention crosses sequences.

Loss and metrics are computed per sequence on values unpacked to ``[n, L]`` (L: the longest
sequence of the row), so the veto's "every token after the trigger" stays within its own response.
Pure torch: no megatron here. How many tokens a packed row holds is the layout's rule
(``layout.shapes.pack_capacity``).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


def plan_bins(lengths: list[int], capacity: int) -> list[list[int]]:
    """Indices of ``lengths`` grouped into bins whose lengths sum to at most ``capacity``
    (first-fit decreasing); each bin lists its indices in ascending order."""
    for i, n in enumerate(lengths):
        if n > capacity:
            raise ValueError(f"parallel.pack_tokens: sequence {i} has {n} tokens, more than a packed "
                             f"row of {capacity}; raise parallel.pack_tokens to at least the longest "
                             f"prompt + response")
    bins: list[list[int]] = []
    room: list[int] = []
    for i in sorted(range(len(lengths)), key=lambda k: (-lengths[k], k)):
        for b, free in enumerate(room):
            if lengths[i] <= free:
                bins[b].append(i)
                room[b] -= lengths[i]
                break
        else:
            bins.append([i])
            room.append(capacity - lengths[i])
    return [sorted(b) for b in bins]


@dataclass
class PackedRow:
    """Sequences laid end to end in one row of ``capacity`` tokens (the tail is padding)."""

    tokens: torch.Tensor        # [1, T]
    position_ids: torch.Tensor  # [1, T]: 0.. within each sequence
    labels: torch.Tensor        # [1, T]: the next token within the same sequence (0 at its end)
    lengths: list[int]          # tokens of each sequence, in row order
    unpack: torch.Tensor        # [n, L] long: position in the row of sequence i's token j
    valid: torch.Tensor         # [n, L] bool: token j + 1 of sequence i exists (j < lengths[i] - 1)

    @property
    def capacity(self) -> int:
        return int(self.tokens.shape[1])

    def segment_ids(self) -> torch.Tensor:
        """[T]: which sequence each position belongs to; the padding tail is its own segment."""
        ids = torch.full((self.capacity,), len(self.lengths), dtype=torch.long)
        start = 0
        for i, n in enumerate(self.lengths):
            ids[start:start + n] = i
            start += n
        return ids

    def attention_mask(self, device=None) -> torch.Tensor:
        """[1, 1, T, T] bool, True where attention is not allowed (megatron's convention): a later
        position, or another sequence."""
        seg = self.segment_ids().to(device)
        t = torch.arange(self.capacity, device=device)
        allowed = (seg[:, None] == seg[None, :]) & (t[None, :] <= t[:, None])
        return (~allowed)[None, None]

    def cu_seqlens(self, device=None) -> torch.Tensor:
        """int32 [n + 2] (THD): cumulative lengths, with the padding tail as a last sequence so
        that the offsets end at the row's length as TE's THD attention expects (``[n + 1]``
        when there is no tail: no sequence of length 0). TE's rules (``DotProductAttention.
        forward``, TE 2.0-2.20): int32, one dimension, [batch + 1]; megatron-core turns the
        causal mask into TE's ``padding_causal``, which THD requires."""
        bounds = [0]
        for n in self.lengths:
            bounds.append(bounds[-1] + n)
        if bounds[-1] < self.capacity:
            bounds.append(self.capacity)
        return torch.tensor(bounds, dtype=torch.int32, device=device)

    @property
    def max_seqlen(self) -> int:
        """The longest segment of ``cu_seqlens`` (the padding tail included), for THD's
        ``max_seqlen_q``/``kv``: TE sizes its kernels by it and megatron its RoPE table
        (``get_rotary_seq_len``). Below the row's length whenever the row holds two segments:
        megatron's unfused THD RoPE, given a table as long as the row, places each sequence at
        its offset in the row instead of at position 0."""
        return max(self.lengths + [self.capacity - sum(self.lengths)])

    def unpack_values(self, row_values: torch.Tensor) -> torch.Tensor:
        """``[1, T]`` or ``[T]`` next-aligned values (about predicting the next token) -> ``[n, L]``
        per sequence; 0 where there is no next token in the sequence (differentiable)."""
        flat = row_values.reshape(-1)
        out = flat[self.unpack.to(flat.device)]
        return torch.where(self.valid.to(flat.device), out, torch.zeros((), dtype=out.dtype,
                                                                         device=out.device))


def pack_row(tokens: torch.Tensor, lengths: list[int], capacity: int) -> PackedRow:
    """Pack the first ``lengths[i]`` tokens of each row of ``tokens`` ([n, S]) into one row."""
    if sum(lengths) > capacity:
        raise ValueError(f"{sum(lengths)} tokens do not fit a packed row of {capacity}")
    row = torch.zeros(1, capacity, dtype=tokens.dtype)
    pos = torch.zeros(1, capacity, dtype=torch.long)
    labels = torch.zeros(1, capacity, dtype=tokens.dtype)
    width = max(lengths)
    unpack = torch.zeros(len(lengths), width, dtype=torch.long)
    valid = torch.zeros(len(lengths), width, dtype=torch.bool)
    start = 0
    for i, n in enumerate(lengths):
        row[0, start:start + n] = tokens[i, :n]
        pos[0, start:start + n] = torch.arange(n)
        labels[0, start:start + n - 1] = tokens[i, 1:n]
        unpack[i, :n] = torch.arange(start, start + n)
        valid[i, :n - 1] = True
        start += n
    return PackedRow(row, pos, labels, list(lengths), unpack, valid)


def sequence_lengths(response_mask: torch.Tensor) -> list[int]:
    """Tokens of each right-padded row that matter: through its last response token (the whole
    row when it has none)."""
    seq = response_mask.shape[1]
    idx = torch.arange(1, seq + 1).expand_as(response_mask)
    last = torch.where(response_mask.bool(), idx, torch.zeros_like(idx)).amax(dim=1)
    return [n if n > 0 else seq for n in last.tolist()]  # one read, not two a row
