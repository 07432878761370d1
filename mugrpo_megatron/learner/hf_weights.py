"""An HF checkpoint's tensors into megatron-core's chunks: which HF tensors each parameter takes
(``models.mapping``), only this rank's rows and columns read from the safetensors files, and every
tensor of a layer this rank holds taken by some parameter (``unread_layer_tensors``)."""

from __future__ import annotations

import re
from pathlib import Path

from mugrpo_megatron.learner.compat_megatron import megatron_on_cpu  # noqa: F401 (first)

import torch
import torch.distributed as dist
from megatron.core import parallel_state as mpu

from mugrpo_megatron.models.hf_config import ModelSpec
from mugrpo_megatron.models.mapping import map_param, shard_from_hf
from mugrpo_megatron.models.released import SafetensorsReader


def global_layer_numbers(chunk: torch.nn.Module) -> dict[int, int]:
    """Local layer index within this chunk -> global 0-based layer number (PP and virtual PP)."""
    return {i: layer.layer_number - 1 for i, layer in enumerate(chunk.decoder.layers)}


def expert_offset(spec: ModelSpec) -> int:
    """Global index of this expert-parallel rank's first expert."""
    if not spec.is_moe:
        return 0
    ep = mpu.get_expert_model_parallel_world_size()
    return mpu.get_expert_model_parallel_rank() * (spec.num_experts // ep)


def named_hf_params(chunk: torch.nn.Module, spec: ModelSpec):
    """(megatron name, parameter, ParamMap) for every parameter of a chunk, and the routers'
    expert bias (a buffer: HF's ``e_score_correction_bias``, loaded, exported and synced)."""
    layers = global_layer_numbers(chunk)
    offset = expert_offset(spec)
    biases = [(n, b) for n, b in chunk.named_buffers() if n.endswith("router.expert_bias")]
    for name, param in [*chunk.named_parameters(), *biases]:
        parts = name.split(".")
        layer = None
        if "layers" in parts:
            layer = layers[int(parts[parts.index("layers") + 1])]
        yield name, param, map_param(name, spec, layer, offset)


@torch.no_grad()
def load_hf_weights(chunks: list[torch.nn.Module], spec: ModelSpec, hf_dir: str | Path,
                    tp_rank: int, tp_size: int) -> None:
    """Copy this rank's shards of an HF checkpoint into its chunks; every parameter is checked."""
    read = SafetensorsReader(hf_dir, spec.stored)
    padded = spec.padded_vocab_size(tp_size)
    if spec.stored is not None and dist.get_rank() == 0:
        dtype = next(chunks[0].parameters()).dtype
        print(f"note: {hf_dir} ships its weights in {spec.stored.describe()}: read dequantized "
              f"into {str(dtype).removeprefix('torch.')}, the dtype the learner trains, syncs "
              f"and exports", flush=True)
    if spec.mtp_layers and dist.get_rank() == 0:
        print(f"note: {hf_dir} has {spec.mtp_layers} multi-token-prediction layer(s) "
              f"(num_nextn_predict_layers): not loaded, trained or exported; the engine does not "
              f"use them for sampling either", flush=True)
    for chunk in chunks:
        for name, param, pm in named_hf_params(chunk, spec):
            if pm.expert is not None:  # experts are split over the expert tensor-parallel group
                shard = shard_from_hf(pm, read, spec, mpu.get_expert_tensor_parallel_rank(),
                                      mpu.get_expert_tensor_parallel_world_size(), padded)
            else:
                shard = shard_from_hf(pm, read, spec, tp_rank, tp_size, padded)
            if shard.shape != param.shape:
                raise ValueError(f"{name}: shard from {pm.hf_names} has shape {tuple(shard.shape)}, "
                                 f"parameter has {tuple(param.shape)}")
            param.copy_(shard.to(param.dtype))
    held = {n for chunk in chunks for n in global_layer_numbers(chunk).values()}
    first = expert_offset(spec)
    experts = range(first, first + spec.num_experts // mpu.get_expert_model_parallel_world_size()) \
        if spec.is_moe else None
    unread = unread_layer_tensors(read.files, read.read, held, experts)
    # agreed on by every rank (one MAX all-reduce of one number, every rank once a load), so
    # that no rank raises while the others go on into the next collective and wait there for
    # parallel.timeout_minutes
    found = torch.tensor([len(unread)], device=next(chunks[0].parameters()).device)
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.all_reduce(found, op=dist.ReduceOp.MAX)
    if found.item() and not unread:
        raise ValueError(f"{hf_dir}: another rank's layers have checkpoint tensors that went "
                         f"into no parameter (that rank names them)")
    if unread:
        raise ValueError(
            f"{hf_dir}: {len(unread)} tensor(s) of this rank's layers went into no parameter of "
            f"the model megatron-core built, e.g. {', '.join(sorted(unread)[:4])}: its layer spec "
            f"lacks their modules (a norm built as an identity, say), which would train and "
            f"export the model without them")


_HF_LAYER = re.compile(r"^model\.layers\.(\d+)\.(.+)$")
_HF_EXPERT_INDEX = re.compile(r"\.experts\.(\d+)\.")


def unread_layer_tensors(names, read: set[str], layers: set[int], experts: range | None
                         ) -> list[str]:
    """The checkpoint's tensors of ``layers`` (global numbers this rank holds) that nothing read:
    every such tensor has a parameter on the rank that holds its layer (all TP ranks read a
    slice), except other expert-parallel ranks' experts. Layers past the model's (DeepSeek-V3's
    multi-token-prediction layers) are in no rank's ``layers``."""
    out = []
    for name in names:
        m = _HF_LAYER.match(name)
        if m is None or int(m[1]) not in layers or name in read or name.endswith("inv_freq"):
            continue
        e = _HF_EXPERT_INDEX.search("." + m[2])
        if e is not None and experts is not None and int(e[1]) not in experts:
            continue
        out.append(name)
    return out
