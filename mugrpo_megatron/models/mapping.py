"""The one table of names and layouts between megatron-core's GPTModel and Hugging Face checkpoints.

Pure torch. Used to load HF weights into TP shards, to export HF checkpoints, and by the resharding
that streams weights into the rollout engine, so names and layouts have a single source of truth.

Layouts (per tensor-parallel rank ``r`` of ``tp``):

- ``vocab``: word embeddings and output layer, padded with zero rows to the padded vocabulary,
  split along dim 0. The padding is dropped on export.
- ``qkv``: ``linear_qkv`` rows are grouped per query group as [q heads of the group, k, v], each
  ``head_dim`` rows; rank r holds groups [r G/tp, (r+1) G/tp). Weight and bias alike.
- ``gate_up``: ``linear_fc1`` is [gate_r; up_r] on rank r (each split along dim 0 first).
- ``row``: ``linear_proj`` and ``linear_fc2`` split along dim 1.
- ``column``: multi-latent attention's per-head projections (DeepSeek-V3:
  ``linear_q_up_proj``, ``linear_kv_up_proj``, ``linear_q_proj``), split along dim 0: each
  head's rows together, rank r the heads [r H/tp, (r+1) H/tp). Its latents' down projections
  (``linear_q_down_proj``, ``linear_kv_down_proj``) are whole on every rank, as TE's spec
  keeps them (``TELinear`` duplicated) and ``learner/model.py`` builds them on the local one.
- ``replicated``: norms (input, pre-MLP, final, q/k norms) and MoE routers are whole on every rank.

MoE experts (megatron's SequentialMLP, or TEGroupedMLP's grouped GEMM: ``_EXPERT``):
expert-parallel rank ``e`` holds experts [e E/ep, (e+1) E/ep) as ``local_experts.{i}``, each
with the ``gate_up`` / ``row`` layouts above over the expert tensor-parallel group (the TP
size), in HF's per-expert names. Shared experts
(GLM-4.5, DeepSeek-V3: ``mlp.shared_experts``) are a dense SwiGLU over the TP group; the
router's expert bias (megatron's ``expert_bias`` buffer, HF's ``e_score_correction_bias``) is
replicated like the router.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal

import torch

from mugrpo_megatron.models.hf_config import ModelSpec

Kind = Literal["vocab", "qkv", "gate_up", "row", "column", "replicated"]
# read(hf_name, index) -> tensor[index]: only the requested rows/columns are read from disk;
# index None reads the whole tensor.
Reader = Callable[[str, "tuple[slice, ...] | None"], torch.Tensor]

_LAYER = re.compile(r"^(?:module\.)*decoder\.layers\.(\d+)\.(.+)$")
_EXPERT = re.compile(r"^mlp\.experts\.(?:local_experts\.(?P<seq>\d+)\.(?P<fc>linear_fc[12])\.weight"
                     r"|(?P<gfc>linear_fc[12])\.weight(?P<gemm>\d+))$")
"""A local expert's weights: megatron's SequentialMLP (``local_experts.{i}.linear_fc1.weight``,
CPU and GPUs without TE) or TEGroupedMLP, grouped GEMM (``linear_fc1.weight{i}``: TE's
GroupedLinear registers one ``weight{i}`` a local expert, [out / expert TP, in], TE 2.9-2.11
``pytorch/module/grouped_linear.py``, built by megatron-core 0.16.1 ``transformer/moe/
experts.py`` TEGroupedMLP with fc1's output 2 x moe_ffn_hidden_size, [gate; up] as
SequentialMLP's, and fc2's input divided over the expert TP group,
``extensions/transformer_engine.py`` TEGroupedLinear). Both name and shape one expert's
weights alike; their checkpoints are interchangeable (TEGroupedMLP.sharded_state_dict)."""
_HF_EXPERT = re.compile(r"\.experts\.(\d+)\.")

# megatron suffix within a layer -> (kind, HF suffixes within "model.layers.{i}.")
_LAYER_TABLE: dict[str, tuple[Kind, tuple[str, ...]]] = {
    "input_layernorm.weight": ("replicated", ("input_layernorm.weight",)),
    "self_attention.linear_qkv.layer_norm_weight": ("replicated", ("input_layernorm.weight",)),
    "self_attention.linear_qkv.weight": (
        "qkv", ("self_attn.q_proj.weight", "self_attn.k_proj.weight", "self_attn.v_proj.weight")),
    "self_attention.linear_qkv.bias": (
        "qkv", ("self_attn.q_proj.bias", "self_attn.k_proj.bias", "self_attn.v_proj.bias")),
    "self_attention.q_layernorm.weight": ("replicated", ("self_attn.q_norm.weight",)),
    "self_attention.k_layernorm.weight": ("replicated", ("self_attn.k_norm.weight",)),
    "self_attention.linear_proj.weight": ("row", ("self_attn.o_proj.weight",)),
    "pre_mlp_layernorm.weight": ("replicated", ("post_attention_layernorm.weight",)),
    "mlp.linear_fc1.layer_norm_weight": ("replicated", ("post_attention_layernorm.weight",)),
    "mlp.linear_fc1.weight": ("gate_up", ("mlp.gate_proj.weight", "mlp.up_proj.weight")),
    "mlp.linear_fc2.weight": ("row", ("mlp.down_proj.weight",)),
    "mlp.shared_experts.linear_fc1.weight": (
        "gate_up", ("mlp.shared_experts.gate_proj.weight", "mlp.shared_experts.up_proj.weight")),
    "mlp.shared_experts.linear_fc2.weight": ("row", ("mlp.shared_experts.down_proj.weight",)),
}
_MLA_TABLE: dict[str, tuple[Kind, tuple[str, ...]]] = {
    "self_attention.linear_q_proj.weight": ("column", ("self_attn.q_proj.weight",)),
    "self_attention.linear_q_down_proj.weight": ("replicated", ("self_attn.q_a_proj.weight",)),
    "self_attention.linear_q_up_proj.weight": ("column", ("self_attn.q_b_proj.weight",)),
    "self_attention.linear_kv_down_proj.weight": (
        "replicated", ("self_attn.kv_a_proj_with_mqa.weight",)),
    "self_attention.linear_kv_up_proj.weight": ("column", ("self_attn.kv_b_proj.weight",)),
    # the latents' norms: megatron's local spec (q_layernorm, kv_layernorm), or fused into the
    # up projections by Transformer Engine's spec (TELayerNormColumnParallelLinear)
    "self_attention.q_layernorm.weight": ("replicated", ("self_attn.q_a_layernorm.weight",)),
    "self_attention.linear_q_up_proj.layer_norm_weight": (
        "replicated", ("self_attn.q_a_layernorm.weight",)),
    "self_attention.kv_layernorm.weight": ("replicated", ("self_attn.kv_a_layernorm.weight",)),
    "self_attention.linear_kv_up_proj.layer_norm_weight": (
        "replicated", ("self_attn.kv_a_layernorm.weight",)),
}
"""Multi-latent attention's parameters (megatron-core 0.16.1 ``multi_latent_attention.py``
``MLASelfAttention``), in place of ``_LAYER_TABLE``'s attention entries."""
_MLA_LAYER_TABLE = {**_LAYER_TABLE, **_MLA_TABLE}
_TOP_TABLE: dict[str, tuple[Kind, tuple[str, ...]]] = {
    "embedding.word_embeddings.weight": ("vocab", ("model.embed_tokens.weight",)),
    "decoder.final_layernorm.weight": ("replicated", ("model.norm.weight",)),
    "output_layer.weight": ("vocab", ("lm_head.weight",)),
}


@dataclass(frozen=True)
class ParamMap:
    """Where one megatron parameter comes from in an HF checkpoint."""

    kind: Kind
    hf_names: tuple[str, ...]
    expert: int | None = None
    """The global expert index of an MoE expert's parameter."""

    def for_expert(self, expert: int) -> ParamMap:
        """The same parameter of another expert (what another expert-parallel rank holds)."""
        names = tuple(_HF_EXPERT.sub(f".experts.{expert}.", n) for n in self.hf_names)
        return ParamMap(self.kind, names, expert)


def strip_wrappers(name: str) -> str:
    """Drop DDP / Float16Module prefixes ('module.module.decoder...' -> 'decoder...')."""
    while name.startswith("module."):
        name = name[len("module."):]
    return name


def map_param(name: str, spec: ModelSpec, global_layer: int | None = None,
              expert_offset: int = 0) -> ParamMap:
    """The HF source of megatron parameter ``name``; ``global_layer`` (0-based) for layer params,
    ``expert_offset`` the global index of this expert-parallel rank's first expert.

    The output layer of a model with tied embeddings maps to the HF input embedding.
    """
    name = strip_wrappers(name)
    m = _LAYER.match(name)
    if m:
        if global_layer is None:
            raise ValueError(f"{name}: a layer parameter needs its global layer number")
        suffix = m.group(2)
        layer = f"model.layers.{global_layer}"
        if spec.is_moe and (suffix in ("mlp.router.weight", "mlp.router.expert_bias")
                            or _EXPERT.match(suffix)):
            moe = spec.family.moe
            module, gate, up, down = moe.module, moe.gate, moe.up, moe.down
            if suffix == "mlp.router.weight":
                return ParamMap("replicated", (f"{layer}.{module}.gate.weight",))
            if suffix == "mlp.router.expert_bias":
                return ParamMap("replicated", (f"{layer}.{module}.gate.e_score_correction_bias",))
            m = _EXPERT.match(suffix)
            local, fc = (m["seq"], m["fc"]) if m["seq"] is not None else (m["gemm"], m["gfc"])
            e = expert_offset + int(local)
            base = f"{layer}.{module}.experts.{e}"
            if fc == "linear_fc1":
                return ParamMap("gate_up", (f"{base}.{gate}.weight", f"{base}.{up}.weight"), e)
            return ParamMap("row", (f"{base}.{down}.weight",), e)
        table = _MLA_LAYER_TABLE if spec.mla is not None else _LAYER_TABLE
        if suffix not in table:
            raise ValueError(f"no HF mapping for megatron parameter {name!r}")
        kind, hf = table[suffix]
        return ParamMap(kind, tuple(f"{layer}.{s}" for s in hf))
    if name not in _TOP_TABLE:
        raise ValueError(f"no HF mapping for megatron parameter {name!r}")
    kind, hf = _TOP_TABLE[name]
    if name == "output_layer.weight" and spec.tie_embeddings:
        hf = ("model.embed_tokens.weight",)
    return ParamMap(kind, hf)


def shard_from_hf(pm: ParamMap, read: Reader, spec: ModelSpec, tp_rank: int, tp_size: int,
                  padded_vocab: int) -> torch.Tensor:
    """Rank ``tp_rank``'s shard of a parameter, reading only the rows it needs."""
    if pm.kind == "replicated":
        return read(pm.hf_names[0], None)
    if pm.kind == "row":
        cols = _row_input_size(pm, spec) // tp_size
        return read(pm.hf_names[0], (slice(None), slice(tp_rank * cols, (tp_rank + 1) * cols)))
    if pm.kind == "column":
        rows = _latent_shape(pm, spec)[0] // tp_size
        return read(pm.hf_names[0], (slice(tp_rank * rows, (tp_rank + 1) * rows),))
    if pm.kind == "vocab":
        rows = padded_vocab // tp_size
        lo, hi = tp_rank * rows, (tp_rank + 1) * rows
        real = read(pm.hf_names[0], (slice(lo, min(hi, spec.vocab_size)),)) \
            if lo < spec.vocab_size else None
        shard = torch.zeros((rows, spec.hidden_size),
                            dtype=real.dtype if real is not None else torch.float32)
        if real is not None:
            shard[:real.shape[0]] = real
        return shard
    if pm.kind == "gate_up":
        rows = _mlp_size(pm, spec) // tp_size
        rs = (slice(tp_rank * rows, (tp_rank + 1) * rows),)
        return torch.cat([read(pm.hf_names[0], rs), read(pm.hf_names[1], rs)], dim=0)
    # qkv: whole query groups [g0, g1) of this rank, interleaved as [q of group, k, v]
    hd, hpg = spec.head_dim, spec.heads_per_group
    groups = spec.num_kv_heads // tp_size
    g0, g1 = tp_rank * groups, (tp_rank + 1) * groups
    q = read(pm.hf_names[0], (slice(g0 * hpg * hd, g1 * hpg * hd),))
    k = read(pm.hf_names[1], (slice(g0 * hd, g1 * hd),))
    v = read(pm.hf_names[2], (slice(g0 * hd, g1 * hd),))
    tail = q.shape[1:]
    fused = torch.cat([q.reshape(groups, hpg * hd, *tail), k.reshape(groups, hd, *tail),
                       v.reshape(groups, hd, *tail)], dim=1)
    return fused.reshape(groups * (hpg + 2) * hd, *tail)


def hf_from_shards(pm: ParamMap, shards: list[torch.Tensor], spec: ModelSpec,
                   gathered: torch.Tensor | None = None) -> list[tuple[str, torch.Tensor]]:
    """Full HF tensors from the TP shards of one parameter (in TP rank order). ``gathered``: the
    shards of a first-dimension split already laid end to end in one tensor (their
    concatenation along dimension 0, of which ``shards`` are the views), used instead of
    concatenating them again. One shard (TP 1) is the parameter itself: vocab, row and
    replicated kinds then return it (or a view of it), the others new tensors."""
    def along0(parts: list[torch.Tensor]) -> torch.Tensor:
        if gathered is not None:
            return gathered
        return parts[0] if len(parts) == 1 else torch.cat(parts, dim=0)

    if pm.kind == "replicated":
        return [(pm.hf_names[0], shards[0])]
    if pm.kind == "row":
        return [(pm.hf_names[0], shards[0] if len(shards) == 1 else torch.cat(shards, dim=1))]
    if pm.kind == "vocab":
        return [(pm.hf_names[0], along0(shards)[:spec.vocab_size])]
    if pm.kind == "column":
        return [(pm.hf_names[0], along0(shards))]
    if pm.kind == "gate_up":
        halves = [s.chunk(2, dim=0) for s in shards]
        return [(pm.hf_names[0], torch.cat([h[0] for h in halves], dim=0)),
                (pm.hf_names[1], torch.cat([h[1] for h in halves], dim=0))]
    hd, hpg, groups = spec.head_dim, spec.heads_per_group, spec.num_kv_heads
    fused = along0(shards)
    tail = fused.shape[1:]
    per_group = fused.reshape(groups, (hpg + 2) * hd, *tail)
    q = per_group[:, :hpg * hd].reshape(groups * hpg * hd, *tail)
    k = per_group[:, hpg * hd:(hpg + 1) * hd].reshape(groups * hd, *tail)
    v = per_group[:, (hpg + 1) * hd:].reshape(groups * hd, *tail)
    return [(pm.hf_names[0], q.contiguous()), (pm.hf_names[1], k.contiguous()),
            (pm.hf_names[2], v.contiguous())]


ENGINE_SHARDED: tuple[Kind, ...] = ("qkv", "gate_up", "row")
"""Kinds whose TP shard is exactly what an engine rank at the same TP size keeps of the HF
tensors (vLLM's QKV/merged-column/row-parallel loaders narrow each HF tensor to rank r's
heads, rows or columns: megatron's rank r holds the same ones). The vocabulary is not one:
megatron pads it to a multiple of 128 x TP, vLLM to one of 64, so their shards' rows differ.
``column`` (MLA's up projections) would be one (vLLM 0.32 ``deepseek_v2.py`` splits
``q_b_proj`` and ``kv_b_proj`` by heads as megatron does) but is sent whole: a few percent of
an MoE's bytes, and vLLM derives its absorbed weights from the whole ``kv_b_proj``."""


def shard_pieces(pm: ParamMap, shard: torch.Tensor, spec: ModelSpec, tp_rank: int,
                 tp_size: int) -> list[tuple[str, tuple[int, ...], tuple[slice, ...],
                                             torch.Tensor]]:
    """Where TP rank ``tp_rank``'s ``shard`` of a parameter of an ``ENGINE_SHARDED`` kind lies in
    each of its full HF tensors: (HF name, the full tensor's shape, the index of this rank's
    part in it, the part: a view of ``shard``). The inverse of ``shard_from_hf`` for one rank,
    and of ``hf_from_shards`` without the other ranks' shards."""
    if pm.kind == "row":
        cols = shard.shape[1]
        return [(pm.hf_names[0], (shard.shape[0], cols * tp_size),
                 (slice(None), slice(tp_rank * cols, (tp_rank + 1) * cols)), shard)]
    if pm.kind == "gate_up":
        gate, up = shard.chunk(2, dim=0)
        rows = gate.shape[0]
        full = (rows * tp_size, *gate.shape[1:])
        at = (slice(tp_rank * rows, (tp_rank + 1) * rows),)
        return [(pm.hf_names[0], full, at, gate), (pm.hf_names[1], full, at, up)]
    if pm.kind != "qkv":
        raise ValueError(f"{pm.hf_names}: a {pm.kind} parameter is not split as an engine keeps it")
    hd, hpg = spec.head_dim, spec.heads_per_group
    groups = spec.num_kv_heads // tp_size
    g0 = tp_rank * groups
    tail = tuple(shard.shape[1:])
    per_group = shard.reshape(groups, (hpg + 2) * hd, *tail)
    q = per_group[:, :hpg * hd].reshape(groups * hpg * hd, *tail)
    k = per_group[:, hpg * hd:(hpg + 1) * hd].reshape(groups * hd, *tail)
    v = per_group[:, (hpg + 1) * hd:].reshape(groups * hd, *tail)
    return [(pm.hf_names[0], (spec.num_heads * hd, *tail),
             (slice(g0 * hpg * hd, (g0 + groups) * hpg * hd),), q),
            (pm.hf_names[1], (spec.num_kv_heads * hd, *tail),
             (slice(g0 * hd, (g0 + groups) * hd),), k),
            (pm.hf_names[2], (spec.num_kv_heads * hd, *tail),
             (slice(g0 * hd, (g0 + groups) * hd),), v)]


def _mlp_size(pm: ParamMap, spec: ModelSpec) -> int:
    if pm.expert is not None:
        return spec.moe_ffn_hidden_size
    return spec.shared_ffn_hidden_size if ".shared_experts." in pm.hf_names[0] \
        else spec.ffn_hidden_size


def _latent_shape(pm: ParamMap, spec: ModelSpec) -> tuple[int, int]:
    """The full HF [out, in] shape of a multi-latent attention projection."""
    projection = pm.hf_names[0].split(".self_attn.")[1].removesuffix(".weight")
    return spec.mla.projections(spec.num_heads, spec.hidden_size)[projection]


def _row_input_size(pm: ParamMap, spec: ModelSpec) -> int:
    """Input width of a row-parallel linear: heads x head_dim (o_proj; MLA: heads x v_head_dim)
    or the MLP size (down_proj)."""
    if "o_proj" in pm.hf_names[0]:
        return spec.num_heads * (spec.mla.v_head_dim if spec.mla else spec.head_dim)
    return _mlp_size(pm, spec)


def tp_split_dim(kind: Kind) -> int | None:
    """The dimension a kind is split along over TP ranks (None: replicated)."""
    return {"vocab": 0, "qkv": 0, "gate_up": 0, "row": 1, "column": 0, "replicated": None}[kind]
