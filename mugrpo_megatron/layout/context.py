"""Context parallelism's exchange (``parallel.cp_comm_type``): which one megatron-core hands to
Transformer Engine, and TE's rules for it, checked before any process group exists.

megatron-core passes ``TransformerConfig.cp_comm_type`` to TE's ``DotProductAttention``
(``TEDotProductAttention``: None becomes "p2p"; 0.16.1-0.19.2). TE's
``attn_forward_func_with_cp`` and its exchanges (``context_parallel.py``) then assert, at the
first attention of the first microbatch, on the GPU only. Read at every tag from 2.9 to 2.18
(``TE_RULES``: where a rule loosens, by version):

- a sliding window needs "a2a" or "all_gather" (p2p and a2a+p2p refuse it), throughout;
- multi-latent attention (keys and values of different widths) needs "p2p" or "a2a+p2p" up
  to 2.14 (``attn_forward_func_with_cp``'s ``enable_mla`` assert); from 2.15 every exchange
  takes it;
- "a2a" scatters heads over the CP group: each TP rank's query heads and key/value groups must
  divide by the CP size;
- packed rows (THD): "p2p" throughout; "a2a" from 2.10 (2.9's ``AttnFuncWithCPAndQKVOA2A``
  refuses them); "all_gather" from 2.18 (up to 2.17 ``AttnFuncWithCPAndKVAllGather`` asserts
  ``qkv_format != "thd"``); "a2a+p2p" refuses them throughout;
- "a2a+p2p" takes two groups (megatron's ``hierarchical_context_parallel_sizes``), which this
  stack does not build.

Which TE: the installed one (a GPU install has it); where none is (a CPU, a dry run on a laptop)
the rules of our range's low end, 2.9, which every version we pin meets.

The CPU's context-parallel attention (``learner/context.py``) computes the same attention
whatever the exchange, so only these checks stand between a config and the GPU's assertion.
"""

from __future__ import annotations

import functools
from importlib import metadata

from mugrpo_megatron.config import ParallelConfig
from mugrpo_megatron.models.hf_config import ModelSpec

TE_LOW = (2, 9)
"""The low end of the TE range we pin (``pyproject.toml``): its rules where TE is not here."""
TE_RULES = {"mla_any_exchange": (2, 15), "thd_a2a": (2, 10), "thd_all_gather": (2, 18)}
"""The TE version from which each rule of the module docstring loosens."""
THD_SINCE = {"a2a": TE_RULES["thd_a2a"], "all_gather": TE_RULES["thd_all_gather"]}
"""The exchanges beside p2p that take packed rows, and the TE version from which they do."""


@functools.cache
def te_version() -> tuple[int, int]:
    """The installed Transformer Engine's (major, minor), or ``TE_LOW`` where it is not
    installed (read from the distribution's metadata: TE itself is not imported)."""
    for dist in ("transformer_engine", "transformer-engine", "transformer_engine_torch"):
        try:
            major, minor = metadata.version(dist).split(".")[:2]
            return int(major), int("".join(c for c in minor if c.isdigit()) or 0)
        except (metadata.PackageNotFoundError, ValueError):
            continue
    return TE_LOW


def _te(te: tuple[int, int] | None) -> tuple[int, int]:
    return te_version() if te is None else te


def context_comm_type(spec: ModelSpec, parallel: ParallelConfig,
                      te: tuple[int, int] | None = None) -> str | None:
    """The exchange for ``parallel.cp_comm_type`` (None without CP). 'auto': megatron's default
    "p2p" (its ring overlaps the exchange with the attention), or "all_gather" for a sliding
    window (which p2p refuses; a2a would need heads divisible by CP). ValueError, naming the key,
    where TE (``te``: the installed version by default) would refuse the pair."""
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
    if spec.mla is not None and kind != "p2p" and _te(te) < TE_RULES["mla_any_exchange"]:
        raise ValueError(f"{said}: multi-latent attention under context parallelism takes p2p "
                         f"only before Transformer Engine "
                         f"{'.'.join(map(str, TE_RULES['mla_any_exchange']))} (here: "
                         f"{'.'.join(map(str, _te(te)))})")
    if kind == "a2a":
        heads, groups = spec.num_heads // parallel.tensor, spec.num_kv_heads // parallel.tensor
        if heads % parallel.context or groups % parallel.context:
            raise ValueError(f"{said} scatters heads over the CP group: {heads} query heads and "
                             f"{groups} key/value groups a TP rank do not divide by "
                             f"parallel.context = {parallel.context}; use p2p or all_gather")
    return kind


def packs_with(kind: str | None, te: tuple[int, int] | None = None) -> bool:
    """Whether packed (THD) rows pass Transformer Engine's context-parallel attention with this
    exchange at TE ``te`` (the installed version by default; module docstring): without CP, with
    p2p, with a2a from 2.10, with all_gather from 2.18."""
    if kind in (None, "p2p"):
        return True
    return kind in THD_SINCE and _te(te) >= THD_SINCE[kind]


def check_packing(spec: ModelSpec, parallel: ParallelConfig) -> None:
    """ValueError where ``parallel.pack_tokens`` asks for packed rows that the exchange refuses
    ('auto' then pads instead: ``layout.pack_capacity``)."""
    kind = context_comm_type(spec, parallel)
    if parallel.pack_tokens not in ("auto", 0) and not packs_with(kind):
        since = THD_SINCE.get(kind)
        raise ValueError(f"parallel.pack_tokens: packed rows under context parallelism go "
                         f"through Transformer Engine's THD attention, which the {kind} exchange "
                         f"(parallel.cp_comm_type) refuses at TE {'.'.join(map(str, te_version()))}"
                         + (f" (it takes them from {'.'.join(map(str, since))})" if since else "")
                         + "; set parallel.pack_tokens: 0, or parallel.cp_comm_type: p2p where "
                           "the model allows it")
