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

from mugrpo_megatron.chunked import NO_POSITION


def slot(n: int, align: int) -> int:
    """Tokens a sequence of ``n`` takes in a packed row whose sequences start at multiples of
    ``align`` (context parallelism: 2 x CP, TE's THD rule; else 1)."""
    return -(-n // align) * align


def plan_bins(lengths: list[int], capacity: int) -> list[list[int]]:
    """Indices of ``lengths`` grouped into bins whose lengths sum to at most ``capacity``
    (first-fit decreasing); each bin lists its indices in ascending order."""
    for i, n in enumerate(lengths):
        if n > capacity:
            raise ValueError(f"parallel.pack_tokens: sequence {i} takes {n} tokens, more than a "
                             f"packed row of {capacity}; raise parallel.pack_tokens to at least the "
                             f"longest prompt + response (rounded up to 2 x parallel.context)")
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
    slots: list[int] | None = None
    """Tokens each sequence takes, its padding included (``slot``); None: its length."""

    @property
    def taken(self) -> list[int]:
        return self.slots if self.slots is not None else self.lengths

    @property
    def capacity(self) -> int:
        return int(self.tokens.shape[1])

    def segment_ids(self) -> torch.Tensor:
        """[T]: which sequence each position belongs to; the padding tail is its own segment."""
        ids = torch.full((self.capacity,), len(self.lengths), dtype=torch.long)
        start = 0
        for i, n in enumerate(self.taken):
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

    def cu_seqlens(self, device=None, padded: bool = False) -> torch.Tensor:
        """int32 [n + 2] (THD): cumulative lengths, with the padding tail as a last sequence so
        that the offsets end at the row's length as TE's THD attention expects (``[n + 1]``
        when there is no tail: no sequence of length 0). TE's rules (``DotProductAttention.
        forward``, TE 2.0-2.20): int32, one dimension, [batch + 1]; megatron-core turns the
        causal mask into TE's ``padding_causal``, which THD requires. ``padded``: the slots'
        offsets (``cu_seqlens_q_padded``, where sequences are padded to 2 x CP): the same when
        nothing is."""
        return torch.tensor(self.offsets(padded), dtype=torch.int32, device=device)

    def offsets(self, padded: bool = False) -> list[int]:
        """``cu_seqlens`` as a list."""
        bounds = [0]
        for n, t in zip(self.lengths, self.taken):
            bounds.append(bounds[-1] + (t if padded else n))
        tail = self.capacity - sum(self.taken)
        if tail:
            bounds.append(bounds[-1] + tail)
        return bounds

    @property
    def max_seqlen(self) -> int:
        """The longest segment of ``cu_seqlens`` (padded; the padding tail included), for THD's
        ``max_seqlen_q``/``kv``: TE sizes its kernels by it and megatron its RoPE table
        (``get_rotary_seq_len``). Below the row's length whenever the row holds two segments:
        megatron's unfused THD RoPE, given a table as long as the row, places each sequence at
        its offset in the row instead of at position 0."""
        return max(self.taken + [self.capacity - sum(self.taken)])

    def unpack_values(self, row_values: torch.Tensor) -> torch.Tensor:
        """``[1, T]`` or ``[T]`` next-aligned values (about predicting the next token) -> ``[n, L]``
        per sequence; 0 where there is no next token in the sequence (differentiable)."""
        flat = row_values.reshape(-1)
        out = flat[self.unpack.to(flat.device)]
        return torch.where(self.valid.to(flat.device), out, torch.zeros((), dtype=out.dtype,
                                                                         device=out.device))


def pack_row(tokens: torch.Tensor, lengths: list[int], capacity: int, align: int = 1
             ) -> PackedRow:
    """Pack the first ``lengths[i]`` tokens of each row of ``tokens`` ([n, S]) into one row, each
    sequence starting at a multiple of ``align`` (``slot``: its padding token 0, positions
    running on, no label)."""
    slots = [slot(n, align) for n in lengths]
    if sum(slots) > capacity:
        raise ValueError(f"{sum(slots)} tokens do not fit a packed row of {capacity}")
    row = torch.zeros(1, capacity, dtype=tokens.dtype)
    pos = torch.zeros(1, capacity, dtype=torch.long)
    labels = torch.zeros(1, capacity, dtype=tokens.dtype)
    width = max(lengths)
    unpack = torch.zeros(len(lengths), width, dtype=torch.long)
    valid = torch.zeros(len(lengths), width, dtype=torch.bool)
    start = 0
    for i, n in enumerate(lengths):
        row[0, start:start + n] = tokens[i, :n]
        pos[0, start:start + slots[i]] = torch.arange(slots[i])
        labels[0, start:start + n - 1] = tokens[i, 1:n]
        unpack[i, :n] = torch.arange(start, start + n)
        valid[i, :n - 1] = True
        start += slots[i]
    return PackedRow(row, pos, labels, list(lengths), unpack, valid,
                     slots if align > 1 else None)


def sequence_lengths(response_mask: torch.Tensor) -> list[int]:
    """Tokens of each right-padded row that matter: through its last response token (the whole
    row when it has none)."""
    seq = response_mask.shape[1]
    idx = torch.arange(1, seq + 1).expand_as(response_mask)
    last = torch.where(response_mask.bool(), idx, torch.zeros_like(idx)).amax(dim=1)
    return [n if n > 0 else seq for n in last.tolist()]  # one read, not two a row


NO_COLUMN = NO_POSITION
"""The position recorded for a column of ``PackedShare`` that holds no token of its sequence:
beyond any row, as ``chunked`` reads it."""


def thd_partition(cu_seqlens: torch.Tensor, total: int, cp: int, rank: int) -> torch.Tensor:
    """The columns of a packed row of ``total`` tokens that context-parallel rank ``rank`` of
    ``cp`` keeps: of each segment of ``cu_seqlens`` (padded offsets, each a multiple of
    2 x cp) its chunk ``rank`` then its chunk ``2 cp - 1 - rank``, segment after segment; on
    ``cu_seqlens``' device, with no read back to the host. This is Transformer Engine's
    ``thd_get_partitioned_indices`` (the formula of ``thd_partition_indices_kernel``, TE 2.9-2.11
    ``common/fused_attn/context_parallel.cu``, which asserts every offset divisible by 2 x cp and
    its wrapper the row's length), with which megatron-core cuts a THD batch
    (``utils.get_thd_batch_on_this_cp_rank``, 0.16.1); TE's context-parallel THD attention and
    megatron's THD RoPE (``rope_utils._apply_rotary_pos_emb_thd``: each segment's share its
    padded length / cp, chunks ``rank`` and ``2 cp - 1 - rank``) take the same split."""
    share = torch.div(cu_seqlens.long(), cp, rounding_mode="floor")  # each segment's share here
    token = torch.arange(total // cp, device=cu_seqlens.device)
    seq = torch.searchsorted(share, token, right=True) - 1
    start, half = share[seq], (share[seq + 1] - share[seq]) // 2
    index = token - start
    offset = torch.where(index < half, rank, 2 * cp - 2 - rank)
    return index + start * cp + half * offset


@dataclass
class PackedShare:
    """A context-parallel rank's share of a packed row (``thd_partition``): its columns as a
    row, and each sequence's part of them laid out as ``[n, 2 W]`` per-sequence columns (the
    first half its chunk ``rank``, the second its chunk ``2 cp - 1 - rank``; W the longest
    sequence's chunk), the layout the loss's split quantities read (``chunked``)."""

    row: PackedRow
    """tokens, position_ids, labels: ``[1, T / cp]`` (this rank's columns of the whole row);
    unpack and valid: ``[n, 2 W]``, into those columns."""
    positions: torch.Tensor
    """``[n, 2 W]``: the position within its sequence of each column (``NO_COLUMN`` where the
    sequence's chunk is shorter than W)."""

    def take(self, x: torch.Tensor) -> torch.Tensor:
        """The whole row's per-sequence ``[n, L]`` values at this share's columns (0 where a
        column holds none)."""
        width = x.shape[1]
        pos = self.positions.to(x.device)
        there = pos < width
        got = torch.gather(x, 1, torch.where(there, pos, torch.zeros_like(pos)))
        return torch.where(there, got, torch.zeros((), dtype=x.dtype, device=x.device))


def split_packed(p: PackedRow, cp: int, rank: int) -> PackedShare:
    """Rank ``rank`` of ``cp``'s share of packed row ``p`` (``thd_partition``). Host-side, once
    a microbatch: index tensors of T / CP columns and [n, 2 W] (n: the row's sequences, a few
    to a few dozen), against the row's activations of T / CP x hidden x layers: nothing at any
    scale; a loop over the row's sequences, never over tokens."""
    bounds = p.offsets(padded=True)
    for a, b in zip(bounds[:-1], bounds[1:]):
        if (b - a) % (2 * cp):
            raise ValueError(f"a packed segment of {b - a} tokens does not cut into 2 x {cp} "
                             f"chunks (Transformer Engine's THD rule)")
    cols = thd_partition(torch.tensor(bounds), p.capacity, cp, rank)
    chunks = [t // (2 * cp) for t in p.taken]
    n, half = len(p.lengths), max(chunks)
    unpack = torch.zeros(n, 2 * half, dtype=torch.long)
    positions = torch.full((n, 2 * half), NO_COLUMN, dtype=torch.long)
    for i, c in enumerate(chunks):
        local = bounds[i] // cp  # each segment before it left 1/cp of its tokens here
        for h, chunk in ((0, rank), (1, 2 * cp - 1 - rank)):
            unpack[i, h * half:h * half + c] = torch.arange(local + h * c, local + (h + 1) * c)
            positions[i, h * half:h * half + c] = torch.arange(chunk * c, (chunk + 1) * c)
    valid = positions < torch.tensor(p.lengths)[:, None] - 1
    row = PackedRow(p.tokens[:, cols], p.position_ids[:, cols], p.labels[:, cols],
                    list(p.lengths), unpack, valid, p.slots)
    return PackedShare(row, positions)
