"""A weight sync that sends each engine rank only the slices it keeps, where vLLM runs spmd at a
tensor-parallel size k times the learner's (k >= 2: Qwen3-235B's engine at TP16 beside a
learner at TP4, DeepSeek-V3's at TP16 beside TP8).

Who needs what. vLLM spmd makes rank r engine TP rank e = r mod T_e (its replicas are
consecutive ranks); megatron makes it learner TP rank r mod T_l (TP fastest in its order, checked
at start: ``handoff.sync_engine_tp``). vLLM's loaders narrow every HF projection to rank e's equal
part of its split dimension (read in vLLM 0.32 and 0.33 ``linear.py`` and ``fused_moe/layer.py``):
- QKV: query heads; KV heads too, or, with fewer KV heads than ranks, KV head e // (T_e / kv)
  on T_e / kv ranks each (``QKVParallelLinear``: ``shard_id = tp_rank // num_kv_head_replicas``);
- merged gate/up (``MergedColumnParallelLinear``) and the experts' w1/w3 (``FusedMoE``, without
  expert parallelism in the engine): rows of the intermediate size;
- row-parallel layers (o_proj, down_proj, the experts' w2): input columns.
Megatron splits the same dimensions T_l ways, so engine part e lies inside learner TP rank
e // k's shard. Each rank therefore needs, of each projection, one piece of 1/T_e of it, from
the member of its TP group whose TP rank is e // k; of each expert, one piece from each
expert-parallel rank, from the member of its expert-tensor-and-expert-parallel group (megatron's
``get_expert_tensor_and_model_parallel_group``) at that expert TP rank. Those members send the
pieces point to point (``batch_isend_irecv`` in the group). A rank receives 1/T_e of the
projections and experts instead of every one whole (the stream without this): at Qwen3-235B
~30 GiB a sync instead of 438. Stages other than the owning one get the pieces by the stream's
pipeline broadcast, from the rank at their own position, whose engine rank is theirs where T_e
divides a stage's ranks (``layout.shapes.engine_slices_problem`` checks it, with the heads and
MLP sizes these rules need).
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist

from mugrpo_megatron import distributed
from mugrpo_megatron.models.hf_config import ModelSpec
from mugrpo_megatron.models.mapping import ParamMap, shard_pieces

Index = tuple[slice, ...]


def engine_part(pm: ParamMap, j: int, full: tuple[int, ...], e: int, engine_tp: int,
                spec: ModelSpec) -> Index:
    """The index of HF tensor ``j`` of ``pm`` (of shape ``full``) that vLLM's TP rank ``e`` of
    ``engine_tp`` loads (the module docstring's rules)."""
    if pm.kind == "row":
        n = full[1] // engine_tp
        return slice(None), slice(e * n, (e + 1) * n)
    if pm.kind == "gate_up":
        n = full[0] // engine_tp
        return (slice(e * n, (e + 1) * n),)
    if pm.kind != "qkv":
        raise ValueError(f"{pm.hf_names}: a {pm.kind} parameter is not split by an engine's TP")
    hd, kv = spec.head_dim, spec.num_kv_heads
    if j == 0:  # the query heads
        n = spec.num_heads // engine_tp * hd
        return (slice(e * n, (e + 1) * n),)
    if kv >= engine_tp:
        n = kv // engine_tp * hd
        return (slice(e * n, (e + 1) * n),)
    head = e // (engine_tp // kv)  # a KV head kept by engine_tp / kv ranks
    return (slice(head * hd, (head + 1) * hd),)


def bounds(index: Index, full: tuple[int, ...]) -> list[tuple[int, int]]:
    """(start, stop) of ``index`` in each dimension of a tensor of shape ``full``."""
    return [index[d].indices(n)[:2] if d < len(index) else (0, n) for d, n in enumerate(full)]


def _within(part: Index, place: Index, full: tuple[int, ...]) -> Index:
    """``part`` (an index into the full tensor) relative to ``place`` (the shard's index)."""
    rel = []
    for (a, b), (p, q) in zip(bounds(part, full), bounds(place, full)):
        if a < p or b > q:
            raise ValueError(f"engine slice {part} is not inside the learner's shard {place}")
        rel.append(slice(a - p, b - p))
    return tuple(rel)


class EngineSlices:
    """Collective over the learner's TP group (and, for experts, its expert-tensor-and-expert-
    parallel group): built once a stream, by every rank of the owning stage."""

    def __init__(self, spec: ModelSpec, engine_tp: int, tp_group, expert_group=None,
                 expert_coords: tuple[int, int] = (0, 0)):
        """``expert_group``: megatron's expert TP x EP group where the experts stream as slices
        (their TP group is the learner's), with this rank's (expert TP rank, expert-parallel
        rank) in ``expert_coords``; None: no experts here."""
        self.spec, self.engine_tp = spec, engine_tp
        self.rank = dist.get_rank()
        self.tp_ranks = dist.get_process_group_ranks(tp_group)  # in TP rank order
        self.tp_size = len(self.tp_ranks)
        self.tp_rank = self.tp_ranks.index(self.rank)
        self.k = engine_tp // self.tp_size
        self.tp_group = tp_group
        self.engine_rank = self.rank % engine_tp
        self.source = self.engine_rank // self.k
        """The learner TP rank whose shard holds this rank's engine slice."""
        self.expert_group = expert_group
        self.members: list[tuple[int, int, int]] = []
        """(global rank, expert TP rank, expert-parallel rank) of each member of the expert
        group, in its order."""
        if expert_group is not None:
            mine = torch.tensor([self.rank, *expert_coords], dtype=torch.int64,
                                device=distributed.device())
            every = torch.empty(dist.get_world_size(expert_group) * 3, dtype=torch.int64,
                                device=mine.device)
            dist.all_gather_into_tensor(every, mine, group=expert_group)
            self.members = [tuple(x) for x in every.view(-1, 3).tolist()]

    def _needs(self, rank: int) -> int:
        """The learner TP rank whose shard holds ``rank``'s engine slice."""
        return rank % self.engine_tp // self.k

    def received(self, owners: list[ParamMap], shard_meta: torch.Tensor
                 ) -> list[tuple[str, tuple[int, ...], Index]]:
        """What this rank gets of one of its parameters, ``owners`` (the parameter; an expert's:
        the same local expert on every expert-parallel rank, in rank order, as
        ``export._ExpertGroups.same_expert`` lists them): (HF name, full shape, the engine
        slice's index), in the order ``exchange`` yields them."""
        return [(name, full, engine_part(owner, j, full, self.engine_rank, self.engine_tp,
                                         self.spec))
                for owner in owners for j, (name, full, _, _) in
                enumerate(shard_pieces(owner, shard_meta, self.spec, self.source,
                                       self.tp_size))]

    def _pieces_for(self, pm: ParamMap, shard: torch.Tensor, rank: int) -> torch.Tensor:
        """This rank's shard of ``pm`` cut to what engine rank ``rank % engine_tp`` keeps, the
        pieces laid end to end."""
        e = rank % self.engine_tp
        parts = [part[_within(engine_part(pm, j, full, e, self.engine_tp, self.spec), place,
                              full)]
                 for j, (_, full, place, part) in
                 enumerate(shard_pieces(pm, shard, self.spec, self.tp_rank, self.tp_size))]
        return torch.cat([p.reshape(-1) for p in parts])

    def exchange(self, pm: ParamMap, owners: list[ParamMap], shard: torch.Tensor
                 ) -> list[tuple[str, torch.Tensor]]:
        """This rank's engine slices of ``owners`` (``received``'s order), sent by the members
        that hold them; this rank sends the pieces of its own ``shard`` of ``pm`` to the members
        that need them. One batch a parameter, whatever the rows or lengths of a phase (its
        members: the TP group, or for an expert the expert TP x EP group, each issuing it once
        a parameter); beyond the stream it holds one parameter's pieces at a time, about one
        copy of this rank's shard sent and 1/(engine TP) of it (of each EP rank's) received."""
        meta = self.received(owners, shard.to("meta"))
        sizes = [math.prod(b - a for a, b in bounds(index, full)) for _, full, index in meta]
        if pm.expert is None:  # from the TP group's member at the source's TP rank
            peers, sources, group = self.tp_ranks, [self.tp_ranks[self.source]], self.tp_group
        else:  # from the member at that expert TP rank of every expert-parallel rank
            peers = [r for r, _, _ in self.members]
            sources = [r for r, etp, _ in sorted(self.members, key=lambda m: m[2])
                       if etp == self.source]
            group = self.expert_group
        ops, own = [], None
        for rank in peers:  # the expert TP group is the TP group (``export._expert_tp_is_tp``)
            if self._needs(rank) != self.tp_rank:
                continue
            if rank == self.rank:
                own = self._pieces_for(pm, shard, rank)
            else:
                ops.append(dist.P2POp(dist.isend, self._pieces_for(pm, shard, rank).contiguous(),
                                      rank, group))
        per_source = len(sizes) // len(sources)
        got = []
        for n, rank in enumerate(sources):
            numel = sum(sizes[n * per_source:(n + 1) * per_source])
            if rank == self.rank:
                got.append(own)
            else:
                buf = torch.empty(numel, dtype=shard.dtype, device=shard.device)
                ops.append(dist.P2POp(dist.irecv, buf, rank, group))
                got.append(buf)
        if ops:
            for req in dist.batch_isend_irecv(ops):
                req.wait()
        flat = torch.cat(got) if len(got) > 1 else got[0]
        out, at = [], 0
        for (name, full, index), size in zip(meta, sizes):
            shape = [b - a for a, b in bounds(index, full)]
            out.append((name, flat[at:at + size].view(shape)))
            at += size
        return out
