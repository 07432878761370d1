"""Megatron shards -> full Hugging Face tensors, streamed one parameter at a time.

``iter_hf_tensors`` is collective: every rank of the learner calls it and every rank receives every
HF tensor, in the same order. Each parameter is all-gathered over its TP group on the pipeline stage
that holds it, converted by the mapping table, and broadcast over the PP group, so each rank holds
at most one full tensor beyond its own shards. An MoE expert's parameter is gathered over the
expert tensor-parallel group, then over the expert-parallel group (every rank gets the same
parameter of every expert-parallel rank's expert). The same stream feeds HF export and the rollout
engine's weight update (resharding), so both use one mapping.

For an engine whose tensor-parallel ranks are the learner's (``engine_tp`` = TP: vLLM placed
spmd at the learner's TP size, engine TP rank r in the process of learner TP rank r), each rank
keeps only its shard of the attention and MLP projections, so they are not gathered: each rank
streams its own shard of each as a ``types.Shard`` (the values, the whole's shape, where they
lie), which the engine pads to full shape after any work on the slice alone (vLLM's
checkpoint-format loaders narrow every tensor to the rank's slice and read nothing else), and
the PP broadcast
carries the shards. A rank then sends and receives 1/TP of those bytes (at 70B, TP 8: ~17 GB of
the 137 GB of projections a sync, not 137 GB); the vocabulary (megatron and vLLM pad and split it
differently) and norms travel whole. An MoE's experts likewise, where the learner's expert
tensor-parallel group is its TP group (megatron's default): vLLM's FusedMoE without expert
parallelism keeps TP rank r's slice of every expert (its moe_intermediate_size split as a dense
MLP's), so each rank gathers only that slice of the other expert-parallel ranks' experts (an
all-gather over the EP group, none over TP) instead of every expert whole: 1/TP of the experts'
bytes, which are ~95% of an MoE's.

Where the engine's TP is k >= 2 times the learner's (a replica over more ranks than a learner's
TP group: Qwen3-235B, DeepSeek-V3), each rank likewise streams only its engine rank's slice of
each projection and expert, which the learner ranks holding it send it (``engine_slices``).
"""

from __future__ import annotations

import json
import math
import shutil
from collections.abc import Callable, Iterator
from pathlib import Path

import mugrpo_megatron.learner.compat_megatron  # noqa: F401 - before megatron-core (its part 6)

import torch
import torch.distributed as dist
from megatron.core import parallel_state as mpu
from safetensors.torch import save_file

from mugrpo_megatron import distributed, outputs
from mugrpo_megatron.learner.engine_slices import EngineSlices, bounds
from mugrpo_megatron.learner.hf_weights import expert_offset, named_hf_params
from mugrpo_megatron.models.hf_config import TOKENIZER_FILES, ModelSpec
from mugrpo_megatron.models.mapping import (
    ENGINE_SHARDED,
    ParamMap,
    hf_from_shards,
    shard_pieces,
    tp_split_dim,
)
from mugrpo_megatron.models.released import dequantized_config
from mugrpo_megatron.types import Shard


def _stage_entries(chunks: list[torch.nn.Module], spec: ModelSpec
                   ) -> list[tuple[torch.nn.Parameter, ParamMap]]:
    entries = []
    for chunk in chunks:
        for name, param, pm in named_hf_params(chunk, spec):
            if name.endswith("output_layer.weight") and spec.tie_embeddings:
                continue  # tied: the last stage's copy of the embedding; emitted once, by stage 0
            entries.append((param, pm))
    return entries


def iter_hf_tensors(chunks: list[torch.nn.Module], spec: ModelSpec,
                    dtype: torch.dtype | None = None,
                    tensor_of: Callable[[torch.nn.Parameter], torch.Tensor] = lambda p: p.detach(),
                    bucket_bytes: int = 512 << 20, engine_tp: int = 0,
                    ) -> Iterator[tuple[str, torch.Tensor | Shard]]:
    """Yield (HF name, full tensor) for the whole model on every rank (collective); with
    ``engine_tp`` (the TP size of an engine placed spmd on these ranks, where
    ``handoff.sync_engine_tp`` allows it) the attention and MLP projections come as a
    ``Shard``, the slice this rank's engine rank keeps (see the module docstring): for a weight
    sync, never for an export. 0: every tensor whole.

    Tensors cross pipeline stages in buckets of at most ``bucket_bytes`` (one flat broadcast per
    bucket); a tensor larger than a bucket travels alone. ``tensor_of`` picks what is streamed for
    each parameter: its value (default), the learner's host copy of it while the learner is
    offloaded (``Learner.host_tensor``: moved to the device one parameter at a time, as it is
    streamed), or, for tests and diagnostics, e.g. ``lambda p: p.main_grad``.

    Device memory beyond the model: one bucket, or the one tensor larger than a bucket that
    travels alone (the vocabulary's: 2.1 GB at 70B in bf16), held once: a TP gather of a
    parameter split along its first dimension lands in one tensor, a tensor that travels alone
    is broadcast as it is, and only a tensor that is a live parameter (TP 1, or replicated) is
    copied before it is handed out. The vocabulary used to be held four times over (the gathered
    shards, their concatenation, the broadcast's flat copy and a last copy), 8.4 GB at 70B.
    """
    tp_group = mpu.get_tensor_model_parallel_group()
    tp_size = mpu.get_tensor_model_parallel_world_size()
    pp_group = mpu.get_pipeline_model_parallel_group()
    pp_size = mpu.get_pipeline_model_parallel_world_size()
    pp_rank = mpu.get_pipeline_model_parallel_rank()
    pp_ranks = dist.get_process_group_ranks(pp_group)
    device = distributed.device()
    mine = _stage_entries(chunks, spec)
    ep = _ExpertGroups(spec)
    tp_rank = mpu.get_tensor_model_parallel_rank()
    sharded = engine_tp == tp_size > 1  # each rank's own shards are its engine rank's
    targets = None  # or each rank's engine slices come from the ranks that hold them
    if engine_tp > tp_size:
        experts = spec.is_moe and _expert_tp_is_tp(tp_group)
        targets = EngineSlices(
            spec, engine_tp, tp_group,
            mpu.get_expert_tensor_and_model_parallel_group() if experts else None,
            (mpu.get_expert_tensor_parallel_rank(), mpu.get_expert_model_parallel_rank())
            if experts else (0, 0))
        sharded = True
    ep.sharded = sharded and spec.is_moe and _expert_tp_is_tp(tp_group)
    for stage in range(pp_size):
        owner = stage == pp_rank
        # the owning stage tells the others what it will send: per tensor (name, shape, dtype,
        # and where a shard lies in its full tensor: None for a full one)
        meta = None
        if owner:
            meta = [(name, tuple(shape), str(tensor_of(p).dtype).removeprefix("torch."), place)
                    for p, pm in mine
                    for name, shape, place in _sent(tensor_of(p), pm, spec, tp_size, tp_rank, ep,
                                                    sharded, targets)]
        if pp_size > 1:
            box = [meta]
            dist.broadcast_object_list(box, src=pp_ranks[stage], group=pp_group)
            meta = box[0]
        produced = _produce(mine, lambda p: tensor_of(p).to(device), spec, tp_size, tp_group,
                            ep, tp_rank if sharded else None, targets) if owner else None
        for bucket in _buckets(meta, bucket_bytes):
            if owner:
                tensors = [next(produced) for _ in bucket]
            if pp_size > 1:
                dt = getattr(torch, bucket[0][2])
                numels = [math.prod(shape) for _, shape, _, _ in bucket]
                alone = owner and len(bucket) == 1 and tensors[0][1].is_contiguous()
                if alone:  # broadcast as it is: no flat copy of the largest tensors
                    flat = tensors[0][1].to(device).reshape(-1)
                elif owner:
                    flat = torch.cat([t.reshape(-1).to(device) for _, t, _ in tensors])
                else:
                    flat = torch.empty(sum(numels), dtype=dt, device=device)
                dist.broadcast(flat, src=pp_ranks[stage], group=pp_group)
                if not alone:
                    tensors = [(name, part.view(shape), True) for (name, shape, _, _), part in
                               zip(bucket, flat.split(numels))]
                del flat
            for (name, t, fresh), (_, _, _, place) in zip(tensors, bucket):
                # never hand out a view of a live parameter: a consumer may keep it (vLLM can)
                # and see later optimizer steps, or write into it
                if dtype is not None and t.dtype != dtype:
                    t = t.to(dtype)
                elif not fresh:
                    t = t.clone()
                # this rank's shard, with where it lies: the engine pads it to full shape
                yield name, Shard(t, tuple(place[0]), tuple(tuple(i) for i in place[1])) \
                    if place is not None else t
            tensors = t = None  # the last tensor handed out is not held while the next is made


class _ExpertGroups:
    """Expert parallelism as the export sees it: which experts another rank holds, and the groups
    an expert's parameter is gathered over."""

    def __init__(self, spec: ModelSpec):
        self.size = mpu.get_expert_model_parallel_world_size() if spec.is_moe else 1
        self.local = spec.num_experts // self.size if spec.is_moe else 0
        self.offset = expert_offset(spec)

    def names(self, pm: ParamMap) -> list[tuple[str, ...]]:
        """HF names of ``pm`` on every expert-parallel rank, in rank order (just its own for a
        parameter that is not an expert's)."""
        if pm.expert is None or self.size == 1:
            return [pm.hf_names]
        return [other.hf_names for other in self.same_expert(pm)]

    def tp_size(self, pm: ParamMap, tp_size: int) -> int:
        return mpu.get_expert_tensor_parallel_world_size() if pm.expert is not None else tp_size

    def same_expert(self, pm: ParamMap) -> list[ParamMap]:
        """``pm`` for the expert at the same local index on every expert-parallel rank."""
        i = pm.expert - self.offset
        return [pm.for_expert(r * self.local + i) for r in range(self.size)]

    sharded: bool = False
    """Experts stream as this rank's TP slices (``_expert_tp_is_tp``)."""


def _expert_tp_is_tp(tp_group) -> bool:
    """Whether the learner's expert tensor-parallel group is its TP group, so that a rank's
    expert shards are the slices its engine TP rank keeps."""
    etp = mpu.get_expert_tensor_parallel_group()
    return dist.get_process_group_ranks(etp) == dist.get_process_group_ranks(tp_group)


def _engine_sharded(pm: ParamMap, tp_rank: int | None, ep: _ExpertGroups) -> bool:
    """Whether ``pm`` streams as this rank's engine slice (``iter_hf_tensors(engine_tp=...)``)."""
    return tp_rank is not None and pm.kind in ENGINE_SHARDED and (pm.expert is None or ep.sharded)


def _sent(param: torch.Tensor, pm: ParamMap, spec: ModelSpec, tp_size: int, tp_rank: int,
          ep: _ExpertGroups, sharded: bool, targets: EngineSlices | None = None
          ) -> list[tuple[str, tuple[int, ...], tuple | None]]:
    """What the owning stage sends of one parameter: (HF name, shape sent, place), ``place``
    the full tensor's shape and the index of the shard in it where only the shard is sent."""
    if targets is not None and _engine_sharded(pm, tp_rank, ep):
        return [(name, tuple(b - a for a, b in bounds(index, full)),
                 (full, tuple(bounds(index, full))))
                for name, full, index in targets.received(_owners(pm, ep), param.to("meta"))]
    if _engine_sharded(pm, tp_rank if sharded else None, ep):
        owners = _owners(pm, ep)
        return [(name, tuple(part.shape), (full, tuple((i.start, i.stop) for i in index)))
                for owner in owners for name, full, index, part in
                shard_pieces(owner, param.to("meta"), spec, tp_rank, tp_size)]
    return [(name, tuple(shape), None) for names in ep.names(pm)
            for name, shape in zip(names, _hf_shapes(param, pm, ep.tp_size(pm, tp_size), spec))]


def _owners(pm: ParamMap, ep: _ExpertGroups) -> list[ParamMap]:
    """``pm``, or for an expert's parameter the same local expert of every expert-parallel rank."""
    return [pm] if pm.expert is None else ep.same_expert(pm)


def _produce(entries, tensor_of, spec, tp_size, tp_group, ep: _ExpertGroups,
             tp_rank: int | None = None, targets: EngineSlices | None = None
             ) -> Iterator[tuple[str, torch.Tensor, bool]]:
    """(HF name, full tensor, fresh) of each entry in order; ``fresh``: a tensor of its own, not
    a live parameter or a view of one. With ``tp_rank`` (an engine-sharded stream) the
    parameters of ``ENGINE_SHARDED`` kinds yield this rank's pieces of their HF tensors instead
    (views of the parameter: the stream copies them into full-shape tensors); with ``targets``,
    the pieces of them this rank's engine rank keeps, from the ranks that hold them."""
    for param, pm in entries:
        if targets is not None and _engine_sharded(pm, tp_rank, ep):
            yield from ((name, t, True) for name, t in
                        targets.exchange(pm, _owners(pm, ep), tensor_of(param)))
            continue
        if _engine_sharded(pm, tp_rank, ep):
            items = [(name, part, False) for name, _, _, part in
                     shard_pieces(pm, tensor_of(param), spec, tp_rank, tp_size)]
        elif pm.expert is None:
            yield from _gather_tp(tensor_of(param), pm, spec, tp_size, tp_group)
            continue
        else:
            items = _gather_tp(tensor_of(param), pm, spec, ep.tp_size(pm, tp_size),
                               mpu.get_expert_tensor_parallel_group())
        if pm.expert is None or ep.size == 1:
            yield from items
            continue
        # the same expert of every expert-parallel rank: whole, or this rank's TP slice of it
        yield from _gather_experts([t for _, t, _ in items], pm, ep)


def _gather_experts(parts: list[torch.Tensor], pm: ParamMap, ep: _ExpertGroups
                    ) -> Iterator[tuple[str, torch.Tensor, bool]]:
    """``parts`` (this rank's expert's HF tensors, whole or this rank's TP slices of them) of
    the same local expert on every expert-parallel rank, in rank order: one all-gather over the
    EP group a tensor, every member of it issuing as many (each holds as many local experts)."""
    group = mpu.get_expert_model_parallel_group()
    gathered = []
    for t in parts:
        out = [torch.empty_like(t) for _ in range(ep.size)]
        dist.all_gather(out, t.contiguous(), group=group)
        gathered.append(out)
    for r, names in enumerate(ep.names(pm)):
        for j, name in enumerate(names):
            yield name, gathered[j][r], True


def _buckets(meta: list[tuple[str, tuple, str, tuple | None]], bucket_bytes: int
             ) -> Iterator[list]:
    """Consecutive tensors of one dtype, up to ``bucket_bytes`` together (a larger one alone)."""
    bucket: list = []
    size = 0
    for entry in meta:
        nbytes = math.prod(entry[1]) * torch.empty(0, dtype=getattr(torch, entry[2])).element_size()
        if bucket and (size + nbytes > bucket_bytes or entry[2] != bucket[0][2]):
            yield bucket
            bucket, size = [], 0
        bucket.append(entry)
        size += nbytes
    if bucket:
        yield bucket


def _hf_shapes(param: torch.Tensor, pm: ParamMap, tp_size: int, spec: ModelSpec):
    full = list(param.shape)
    dim = tp_split_dim(pm.kind)
    if dim is not None:
        full[dim] *= tp_size
    if pm.kind == "vocab":
        return [(spec.vocab_size, *full[1:])]
    if pm.kind == "gate_up":
        return [(full[0] // 2, *full[1:])] * 2
    if pm.kind == "qkv":
        hd = spec.head_dim
        rest = full[1:]
        return [(spec.num_heads * hd, *rest), (spec.num_kv_heads * hd, *rest),
                (spec.num_kv_heads * hd, *rest)]
    return [tuple(full)]


def _gather_tp(param: torch.Tensor, pm: ParamMap, spec: ModelSpec, tp_size: int, group
               ) -> list[tuple[str, torch.Tensor, bool]]:
    """The HF tensors of one parameter, gathered over its TP group, each with whether it is a
    tensor of its own (``fresh``) rather than the live parameter or a view of it. A parameter
    split along its first dimension is gathered into one tensor of the full shape (no list of
    shards beside a concatenation of them)."""
    if pm.kind == "replicated" or tp_size == 1:
        return [(name, t, t.untyped_storage().data_ptr() != param.untyped_storage().data_ptr())
                for name, t in hf_from_shards(pm, [param], spec)]
    if tp_split_dim(pm.kind) == 0:
        full = torch.empty((tp_size * param.shape[0], *param.shape[1:]), dtype=param.dtype,
                           device=param.device)
        dist.all_gather_into_tensor(full, param.contiguous(), group=group)
        return [(name, t, True) for name, t in
                hf_from_shards(pm, list(full.chunk(tp_size)), spec, gathered=full)]
    shards = [torch.empty_like(param) for _ in range(tp_size)]
    dist.all_gather(shards, param.contiguous(), group=group)
    return [(name, t, True) for name, t in hf_from_shards(pm, shards, spec)]


def save_hf_checkpoint(tensors: Iterator[tuple[str, torch.Tensor]], out_dir: str | Path,
                       source_dir: str | Path, *, write: bool, dtype: str,
                       max_shard_bytes: int = 2 << 30, then: str = outputs.RESUME) -> None:
    """Write streamed tensors as safetensors shards with an index, plus config and tokenizer files
    copied from ``source_dir``. Collective: every rank consumes the stream; only ``write`` ranks
    touch the disk. The checkpoint is written whole beside ``out_dir`` and renamed into place
    (``outputs.commit``), replacing what is there: callers check the destination first
    (``outputs.check_destination``). A writer that runs out of space stops writing, removes its
    partial directory and goes on consuming the stream (the other ranks are in its
    collectives); then every rank raises its ``DiskFull`` (``then`` says what to do)."""
    final_out = Path(out_dir)
    what, kept = "Hugging Face export", f"{outputs.KEPT}; the partial export was removed"
    error = ""
    try:
        with outputs.guard(final_out, what, kept=kept, then=then):
            out = outputs.begin(final_out) if write else final_out
            _write_shards(tensors, out, write, max_shard_bytes)
            if write:
                _write_config(out, Path(source_dir), dtype)
                outputs.commit(final_out, out)
    except outputs.DiskFull as e:
        error = str(e)
        shutil.rmtree(outputs.staging_path(final_out), ignore_errors=True)
        for _ in tensors:  # the rest of the collective stream
            pass
    error = distributed.agree(error)
    if error:
        raise outputs.DiskFull(error)


def _write_shards(tensors: Iterator[tuple[str, torch.Tensor]], out: Path, write: bool,
                  max_shard_bytes: int) -> None:
    shard: dict[str, torch.Tensor] = {}
    size = 0
    files: list[list[str]] = []

    def flush() -> None:
        nonlocal shard, size
        if shard:
            files.append(list(shard))
            if write:
                save_file(shard, str(out / f"part-{len(files):05d}.safetensors"),
                          metadata={"format": "pt"})
        shard, size = {}, 0

    for name, t in tensors:
        nbytes = t.numel() * t.element_size()
        if shard and size + nbytes > max_shard_bytes:
            flush()
        if write:
            shard[name] = t.detach().cpu().clone()
        else:
            shard[name] = torch.empty(0)
        size += nbytes
    flush()
    if not write:
        return
    total = len(files)
    weight_map = {}
    for i, names in enumerate(files, 1):
        final = f"model-{i:05d}-of-{total:05d}.safetensors"
        (out / f"part-{i:05d}.safetensors").rename(out / final)
        weight_map.update({n: final for n in names})
    (out / "model.safetensors.index.json").write_text(json.dumps(
        {"metadata": {}, "weight_map": dict(sorted(weight_map.items()))}, indent=2))


def _write_config(out: Path, src: Path, dtype: str) -> None:
    """config.json for the exported weights: in ``dtype``, and dequantized where the model was
    released quantized (its ``quantization_config`` dropped, and the user told)."""
    config, dropped = dequantized_config(json.loads((src / "config.json").read_text()))
    if dropped:
        print(f"note: the export writes {dtype} weights; {dropped}", flush=True)
    config["torch_dtype"] = config["dtype"] = dtype
    (out / "config.json").write_text(json.dumps(config, indent=2))
    copy_tokenizer(src, out)


def copy_tokenizer(source: Path, out: Path) -> None:
    """The tokenizer files of the HF checkpoint ``source`` that exist, copied into ``out``."""
    for name in TOKENIZER_FILES:
        if (source / name).is_file():
            shutil.copy2(source / name, out / name)
