"""Context parallelism's exchange (``parallel.cp_comm_type``): which one megatron-core hands to
Transformer Engine, and TE's rules for it, checked before any process group exists.

megatron-core passes ``TransformerConfig.cp_comm_type`` to TE's ``DotProductAttention``
(``TEDotProductAttention``: None becomes "p2p"; 0.16.1-0.19.2). TE's
``attn_forward_func_with_cp`` and its exchanges (``context_parallel.py``) then assert, at the
first attention of the first microbatch, on the GPU only (TE 2.9, 2.11 and 2.20 read):

- a sliding window needs "a2a" or "all_gather" (p2p and a2a+p2p refuse it);
- multi-latent attention (keys and values of different widths) needs "p2p" or "a2a+p2p";
- "a2a" scatters heads over the CP group: each TP rank's query heads and key/value groups must
  divide by the CP size;
- packed rows (THD) go through "p2p" only at the low end of our range: "all_gather" refuses THD
  up to 2.11 and "a2a" at 2.9 ("a2a+p2p" refuses it throughout);
- "a2a+p2p" takes two groups (megatron's ``hierarchical_context_parallel_sizes``), which this
  stack does not build.

The CPU's context-parallel attention (``learner/context.py``) computes the same attention
whatever the exchange, so only these checks stand between a config and the GPU's assertion.
"""

from __future__ import annotations

from mugrpo_megatron.config import ParallelConfig
from mugrpo_megatron.models.hf_config import ModelSpec


def context_comm_type(spec: ModelSpec, parallel: ParallelConfig) -> str | None:
    """The exchange for ``parallel.cp_comm_type`` (None without CP). 'auto': megatron's default
    "p2p" (its ring overlaps the exchange with the attention), or "all_gather" for a sliding
    window (which p2p refuses; a2a would need heads divisible by CP). ValueError, naming the key,
    where TE would refuse the pair."""
    if parallel.context == 1:
        return None
    kind = parallel.cp_comm_type
    if kind == "auto":
        kind = "all_gather" if spec.sliding_window else "p2p"
    key = "parallel.cp_comm_type"
    said = f"{key}: {kind!r}" + (" (auto)" if parallel.cp_comm_type == "auto" else "")
    if kind == "a2a+p2p":
        raise ValueError(f"{said} needs megatron's hierarchical context-parallel groups "
                         f"(hierarchical_context_parallel_sizes), which this stack does not "
                         f"build; use p2p, a2a or all_gather")
    if spec.sliding_window and kind not in ("a2a", "all_gather"):
        raise ValueError(f"{said}: {spec.architecture} has a sliding window "
                         f"({spec.sliding_window} tokens), which Transformer Engine's "
                         f"context-parallel attention takes only with a2a or all_gather")
    if spec.mla is not None and kind != "p2p":
        raise ValueError(f"{said}: multi-latent attention under context parallelism takes p2p "
                         f"only (Transformer Engine)")
    if kind == "a2a":
        heads, groups = spec.num_heads // parallel.tensor, spec.num_kv_heads // parallel.tensor
        if heads % parallel.context or groups % parallel.context:
            raise ValueError(f"{said} scatters heads over the CP group: {heads} query heads and "
                             f"{groups} key/value groups a TP rank do not divide by "
                             f"parallel.context = {parallel.context}; use p2p or all_gather")
    return kind


def packs_with(kind: str | None) -> bool:
    """Whether packed (THD) rows pass Transformer Engine's context-parallel attention with this
    exchange across our TE range (module docstring): without CP, or with p2p."""
    return kind in (None, "p2p")


def check_packing(spec: ModelSpec, parallel: ParallelConfig) -> None:
    """ValueError where ``parallel.pack_tokens`` asks for packed rows that the exchange refuses
    ('auto' then pads instead: ``layout.pack_capacity``)."""
    kind = context_comm_type(spec, parallel)
    if parallel.pack_tokens not in ("auto", 0) and not packs_with(kind):
        raise ValueError(f"parallel.pack_tokens: packed rows under context parallelism go "
                         f"through Transformer Engine's THD attention, which the {kind} exchange "
                         f"(parallel.cp_comm_type) refuses at TE 2.9; set parallel.pack_tokens: "
                         f"0, or parallel.cp_comm_type: p2p where the model allows it")
