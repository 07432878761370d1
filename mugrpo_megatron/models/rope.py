"""RoPE scaling from an HF config: which kinds the learner expresses, and their numbers as
transformers and vLLM read them (so the learner can be given exactly those).

Plain data, no torch or megatron import: ``learner/model.py`` turns the result into megatron-core's
arguments.
"""

from __future__ import annotations

import math
from typing import Any

SUPPORTED = ("llama3", "linear", "yarn")

YARN_KEYS = frozenset({"rope_type", "type", "rope_theta", "factor", "original_max_position_embeddings",
                       "beta_fast", "beta_slow", "mscale", "mscale_all_dim", "attention_factor",
                       "truncate", "partial_rotary_factor"})
"""The fields of a YaRN ``rope_scaling`` that transformers (``_compute_yarn_parameters``) and vLLM
(``get_rope``'s yarn branch) read; any other is refused, naming it."""


def yarn_mscale(factor: float, mscale: float = 1.0) -> float:
    """YaRN's magnitude correction 0.1 x mscale x ln(factor) + 1 (1 for factor <= 1), as
    transformers 5.19 ``get_mscale`` and vLLM 0.32 ``yarn_get_mscale`` compute it."""
    return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0


def yarn_attention_factor(factor: float, mscale: float | None, mscale_all_dim: float | None) -> float:
    """The factor HF and vLLM multiply cos and sin by (so q.k by its square) when the config has
    no ``attention_factor``: mscale(factor, mscale) / mscale(factor, mscale_all_dim) where both
    are set and non-zero, else mscale(factor)."""
    if mscale and mscale_all_dim:
        return yarn_mscale(factor, mscale) / yarn_mscale(factor, mscale_all_dim)
    return yarn_mscale(factor)


def read_rope_scaling(cfg: dict[str, Any], source: str) -> dict[str, Any] | None:
    """The config's RoPE scaling (``rope_scaling``, or transformers 5's ``rope_parameters``) as a
    dict with ``rope_type`` one of ``SUPPORTED``, or None for plain RoPE. A YaRN dict comes back
    complete, with the defaults transformers fills in: ``original_max_position_embeddings``
    (a top-level one first, as transformers' ``standardize_rope_params``, else the config's
    ``max_position_embeddings``), ``beta_fast`` 32, ``beta_slow`` 1, ``truncate`` true, and
    ``attention_factor`` computed where absent.
    """
    scaling = cfg.get("rope_scaling")
    params = cfg.get("rope_parameters")  # transformers 5 keeps theta and scaling here
    if isinstance(params, dict) and params.get("rope_type", params.get("type", "default")) != "default":
        scaling = params
    if scaling is None:
        return None
    kind = scaling.get("rope_type", scaling.get("type"))
    if kind == "default":
        return None
    if kind not in SUPPORTED:
        raise ValueError(f"{source}: rope_scaling type {kind!r} is not supported "
                         f"(supported: {', '.join(SUPPORTED)})")
    if kind != "yarn":
        return dict(scaling, rope_type=kind)
    unknown = sorted(set(scaling) - YARN_KEYS)
    if unknown:
        raise ValueError(f"{source}: rope_scaling.{unknown[0]} is not a YaRN field that "
                         f"transformers or vLLM read; refusing to guess what it means")
    if float(scaling.get("partial_rotary_factor", cfg.get("partial_rotary_factor", 1.0))) != 1.0:
        raise ValueError(f"{source}: partial_rotary_factor is not supported (rotary over the "
                         f"whole head only)")
    if scaling.get("factor") is None:  # vLLM needs it, and megatron-core's YaRN takes it as given
        raise ValueError(f"{source}: rope_scaling.factor is required for YaRN")
    factor = float(scaling["factor"])
    if factor < 1:
        raise ValueError(f"{source}: rope_scaling.factor {factor} is below 1")
    original = cfg.get("original_max_position_embeddings",
                       scaling.get("original_max_position_embeddings",
                                   cfg.get("max_position_embeddings")))
    if original is None:
        raise ValueError(f"{source}: YaRN needs rope_scaling.original_max_position_embeddings "
                         f"(or max_position_embeddings)")

    def opt(key: str) -> float | None:
        return None if scaling.get(key) is None else float(scaling[key])

    mscale, mscale_all_dim = opt("mscale"), opt("mscale_all_dim")
    attention = opt("attention_factor")
    return {
        "rope_type": "yarn", "factor": factor, "original_max_position_embeddings": int(original),
        # transformers: `get("beta_fast") or 32` (0 or None fall back to the paper's values)
        "beta_fast": float(scaling.get("beta_fast") or 32), "beta_slow": float(scaling.get("beta_slow") or 1),
        "mscale": mscale, "mscale_all_dim": mscale_all_dim,
        "truncate": bool(scaling.get("truncate", True)),
        "attention_factor": attention if attention is not None
        else yarn_attention_factor(factor, mscale, mscale_all_dim),
    }


def latent_yarn_mscales(rope: dict[str, Any]) -> tuple[float, float]:
    """(mscale, mscale_all_dim) for megatron-core's MLA YaRN (0.16.1 ``multi_latent_attention.
    py``, ``yarn_rotary_pos_embedding.py``) that give HF's numbers for a YaRN dict of
    ``read_rope_scaling``: megatron multiplies cos and sin by mscale(f, mscale) /
    mscale(f, mscale_all_dim) and the softmax scale by mscale(f, mscale_all_dim)^2; transformers
    (DeepSeek-V3's ``yarn_apply_mscale`` and rotary embedding) by ``attention_factor`` and by
    mscale(f, mscale_all_dim)^2 where mscale_all_dim is set, else 1. So mscale_all_dim is HF's
    (0 where unset) and mscale solves mscale(f, mscale) = attention_factor x mscale(f,
    mscale_all_dim): HF's own mscale where both are set and no attention_factor overrides."""
    factor = rope["factor"]
    all_dim = rope["mscale_all_dim"] or 0.0
    if factor <= 1:
        return 1.0, all_dim
    target = rope["attention_factor"] * yarn_mscale(factor, all_dim)
    return (target - 1.0) / (0.1 * math.log(factor)), all_dim
