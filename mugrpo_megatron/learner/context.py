"""Context parallelism (``parallel.context``): a sequence cut into 2 x CP chunks, rank r of the
CP group keeping chunks r and 2 x CP - 1 - r, so that every rank has as much of causal
attention's work (megatron-core's ``get_batch_on_this_cp_rank`` split, which its rotary embedding
(``get_pos_emb_on_this_cp_rank``) and Transformer Engine's context-parallel attention both
assume for BSHD rows).

- ``ChunkSplit``: which columns of a row this rank keeps, their global positions, and the
  reductions over the CP group that the loss needs of a whole response (the veto's first trigger,
  per-response counts): one small all-reduce each, the same number on every rank whatever the
  lengths.
- ``PackedChunkSplit``: the same for a packed row (THD): every sequence of the row (padded to a
  multiple of 2 x CP) cut into 2 x CP chunks of its own, as Transformer Engine's
  ``thd_get_partitioned_indices`` cuts it (``packing.thd_partition``).
- ``ContextParallelAttention``: core attention for megatron's local layer spec (CPU, and GPUs
  without Transformer Engine), whose own ``DotProductAttention`` refuses CP: each rank gathers
  the keys and values of the whole sequence over the CP group (an all-gather forward, a
  reduce-scatter of their gradients backward) and attends from its two chunks under the causal
  mask of their global positions (packed rows: of their columns in the row, within their own
  sequence, from ``cu_seqlens_q_padded``; megatron's THD RoPE has rotated them by their
  positions within it; the mask is T / CP x T booleans a layer, as large as the scores: a CPU
  path only). Exact, and simple; its cost is the whole sequence's K and V on
  every rank (2 x s x heads_kv x head_dim a layer, as without CP) and s/CP x s scores: it saves
  no attention memory, only the rest of the layer's. On GPUs Transformer Engine's attention does
  CP itself (ring exchange of K/V chunks, ``cp_comm_type`` p2p: megatron-core's default, overlaps
  the exchange with the attention of the chunk in hand).
"""

from __future__ import annotations

import dataclasses
import math

import torch
import torch.distributed as dist
from megatron.core import parallel_state as mpu
from megatron.core.packed_seq_params import PackedSeqParams
from megatron.core.transformer.module import MegatronModule

from mugrpo_megatron.learner.packing import PackedRow, split_packed, thd_partition


class ChunkSplit:
    """This CP rank's share of rows ``seq`` tokens long (a multiple of 2 x CP)."""

    def __init__(self, seq: int, cp_size: int, cp_rank: int, group=None):
        if seq % (2 * cp_size):
            raise ValueError(f"a row of {seq} tokens does not cut into 2 x {cp_size} chunks")
        self.seq, self.cp_size, self.cp_rank, self.group = seq, cp_size, cp_rank, group
        chunk = seq // (2 * cp_size)
        first, second = cp_rank, 2 * cp_size - 1 - cp_rank
        self.chunk_index = (first, second)
        self.num_chunks = 2 * cp_size
        self.positions = torch.cat([torch.arange(first * chunk, (first + 1) * chunk),
                                    torch.arange(second * chunk, (second + 1) * chunk)])
        """Global column of each of this rank's columns, in order."""

    def take(self, x: torch.Tensor) -> torch.Tensor:
        """This rank's columns of ``x`` ``[b, seq, ...]``."""
        return x[:, self.positions.to(x.device)]

    def reduce(self, x: torch.Tensor, op=dist.ReduceOp.SUM) -> torch.Tensor:
        """``x`` reduced over the CP group (in place; returned)."""
        dist.all_reduce(x, op=op, group=self.group)
        return x


class PackedChunkSplit:
    """This CP rank's share of a packed row (``packing.split_packed``), as a ``SequenceSplit``
    of the per-sequence ``[n, 2 W]`` columns (positions per sequence)."""

    def __init__(self, whole: PackedRow, cp_size: int, cp_rank: int, group=None):
        self.whole = whole
        """The whole row: its ``cu_seqlens`` are what THD attention and RoPE take."""
        self.share = split_packed(whole, cp_size, cp_rank)
        self.positions = self.share.positions
        self.chunk_index = (cp_rank, 2 * cp_size - 1 - cp_rank)
        self.num_chunks = 2 * cp_size
        self.cp_size, self.cp_rank, self.group = cp_size, cp_rank, group

    reduce = ChunkSplit.reduce


def packed_split_for(whole: PackedRow) -> PackedChunkSplit:
    return PackedChunkSplit(whole, mpu.get_context_parallel_world_size(),
                            mpu.get_context_parallel_rank(), mpu.get_context_parallel_group())


def thd_params(row: PackedRow, device) -> PackedSeqParams:
    """megatron's THD parameters of a packed row (the whole row's, also under CP): offsets of
    the real tokens, and of the slots where sequences are padded to 2 x CP
    (``cu_seqlens_q_padded``: TE's CP attention and megatron's THD RoPE cut by them).

    ``pad_between_seqs`` from the host's offsets (``pad_between_seqs``) where megatron's
    ``PackedSeqParams`` has the field (0.19): left None, TE works it out in every attention
    layer with ``torch.equal`` on the device offsets (TE 2.9-2.20 ``DotProductAttention.
    forward``), a host synchronisation a layer and microbatch, 80 a forward pass at 70B.
    megatron-core 0.16.1 has no such field and TE then pays that cost."""
    cu = row.cu_seqlens(device)
    padded = row.cu_seqlens(device, padded=True) if row.slots is not None else None
    extra = {"pad_between_seqs": pad_between_seqs(row)} if _HAS_PAD_FIELD else {}
    return PackedSeqParams(qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu,
                           cu_seqlens_q_padded=padded, cu_seqlens_kv_padded=padded,
                           max_seqlen_q=row.max_seqlen, max_seqlen_kv=row.max_seqlen, **extra)


_HAS_PAD_FIELD = "pad_between_seqs" in {f.name for f in dataclasses.fields(PackedSeqParams)}
UPSTREAM_VERSIONED: dict[str, str] = {  # scripts/check_upstream.py: present exactly there
    "megatron.core.packed_seq_params:PackedSeqParams.pad_between_seqs": ">=0.19"}


def pad_between_seqs(row: PackedRow) -> bool:
    """TE's ``pad_between_seqs`` of a row, on the host: whether a sequence's padded start differs
    from its real start (TE: ``not torch.equal(cu_seqlens_q_padded[:-1], cu_seqlens_q[:-1])``,
    False without padded offsets)."""
    return row.slots is not None and row.offsets(True)[:-1] != row.offsets()[:-1]


def split_for(seq: int) -> ChunkSplit | None:
    """The split of rows ``seq`` tokens long for this rank, None without context parallelism."""
    cp = mpu.get_context_parallel_world_size()
    if cp == 1:
        return None
    return ChunkSplit(seq, cp, mpu.get_context_parallel_rank(), mpu.get_context_parallel_group())


class _AllGather(torch.autograd.Function):
    """Every rank's ``x`` concatenated in group-rank order; backward, each rank's share of the
    summed gradient. (torch 2.13's ``torch.distributed.nn.functional.all_gather`` goes back
    through a scatter that takes a group rank for a global one: it fails in any group that is
    not ranks 0..n-1, as the CP groups at TP > 1 are.) The backward all-reduces the whole
    gradient where a reduce-scatter would do: gloo has none; this module runs on CPUs."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, group) -> torch.Tensor:
        ctx.group, ctx.rows = group, x.shape[0]
        parts = [torch.empty_like(x) for _ in range(dist.get_world_size(group))]
        dist.all_gather(parts, x.contiguous(), group=group)
        return torch.cat(parts)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        grad = grad.contiguous()
        dist.all_reduce(grad, group=ctx.group)
        rank = dist.get_rank(ctx.group)
        return grad[rank * ctx.rows:(rank + 1) * ctx.rows], None


def _gather_sequence(x: torch.Tensor, split: ChunkSplit) -> torch.Tensor:
    """``x`` ``[s_local, b, ...]`` of every CP rank as the whole sequence ``[s, b, ...]`` in
    global order, with the gradient flowing back to each rank's own chunks."""
    parts = _AllGather.apply(x, split.group).chunk(split.cp_size)
    half = x.shape[0] // 2
    first = [p[:half] for p in parts]
    second = [p[half:] for p in reversed(parts)]  # chunk 2CP-1-r of rank r, in global order
    return torch.cat(first + second, dim=0)


class ContextParallelAttention(MegatronModule):
    """Core attention under context parallelism for megatron's local spec (see the module
    docstring); the same arguments and layouts as megatron's ``DotProductAttention``."""

    def __init__(self, config, layer_number: int, attn_mask_type, attention_type: str,
                 attention_dropout: float | None = None, softmax_scale: float | None = None,
                 cp_comm_type: str | None = None, pg_collection=None):
        super().__init__(config=config)
        tp = mpu.get_tensor_model_parallel_world_size()
        self.heads = config.num_attention_heads // tp
        self.groups = config.num_query_groups // tp
        self.head_dim = config.kv_channels
        self.scale = softmax_scale if softmax_scale is not None else (
            config.softmax_scale if config.softmax_scale is not None
            else 1.0 / math.sqrt(self.head_dim))
        window = config.window_size
        self.window = window[0] if window is not None and window[0] >= 0 else None

    def forward(self, query, key, value, attention_mask, attn_mask_type=None,
                attention_bias=None, packed_seq_params=None):
        if attention_bias is not None:
            raise NotImplementedError("context parallel attention takes no attention bias")
        cp, rank = mpu.get_context_parallel_world_size(), mpu.get_context_parallel_rank()
        if packed_seq_params is not None:  # THD: [t, heads, d], this rank's columns of a row
            cu = (packed_seq_params.cu_seqlens_q_padded
                  if packed_seq_params.cu_seqlens_q_padded is not None
                  else packed_seq_params.cu_seqlens_q).to(query.device)
            cols = [thd_partition(cu, query.shape[0] * cp, cp, r) for r in range(cp)]
            keys = _AllGather.apply(key, mpu.get_context_parallel_group())
            values = _AllGather.apply(value, mpu.get_context_parallel_group())
            qcol, kcol = cols[rank], torch.cat(cols)  # the keys in the ranks' order
            edges = cu[1:-1].long()
            same = (torch.bucketize(qcol, edges, right=True)[:, None]
                    == torch.bucketize(kcol, edges, right=True)[None, :])
            out = self._attend(query[:, None], keys[:, None], values[:, None],
                               qcol[:, None], kcol[None, :], same)
            return out.reshape(query.shape[0], self.heads * self.head_dim)
        split = split_for(query.shape[0] * cp)
        keys = _gather_sequence(key, split)
        values = _gather_sequence(value, split)
        qpos = split.positions.to(query.device)[:, None]
        kpos = torch.arange(keys.shape[0], device=query.device)[None, :]
        out = self._attend(query, keys, values, qpos, kpos, None)
        return out.reshape(query.shape[0], query.shape[1], self.heads * self.head_dim)

    def _attend(self, query, keys, values, qpos, kpos, same):
        """softmax(q k^T scale) v of queries ``[s_q, b, h, d]`` over keys and values
        ``[s_k, b, h_kv, d]``, a query at column ``qpos`` seeing keys at ``kpos`` up to it (and
        within the window; ``same``: only its own sequence's); ``[s_q, b, h, d]``."""
        if self.heads != self.groups:  # GQA: each KV head serves heads / groups query heads
            keys = keys.repeat_interleave(self.heads // self.groups, dim=2)
            values = values.repeat_interleave(self.heads // self.groups, dim=2)
        q = query.permute(1, 2, 0, 3).float()   # [b, h, s_q, d]
        k = keys.permute(1, 2, 3, 0).float()    # [b, h, d, s_k]
        scores = torch.matmul(q, k) * self.scale
        allowed = kpos <= qpos
        if self.window is not None:
            allowed = allowed & (kpos >= qpos - self.window)
        if same is not None:
            allowed = allowed & same
        scores = scores.masked_fill(~allowed, float("-inf"))
        probs = torch.softmax(scores, dim=-1).to(values.dtype)
        return torch.matmul(probs, values.permute(1, 2, 0, 3)).permute(2, 0, 1, 3)
