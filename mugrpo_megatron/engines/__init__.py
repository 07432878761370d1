"""Rollout engines behind one narrow interface; each backend is imported only when chosen."""

from __future__ import annotations

from pathlib import Path

from mugrpo_megatron.config import RolloutConfig
from mugrpo_megatron.engines.base import Generation, RolloutEngine, SamplingSpec, WeightSyncStats
from mugrpo_megatron.models import read_model_spec

__all__ = ["Generation", "RolloutEngine", "SamplingSpec", "WeightSyncStats", "make_engine"]


def make_engine(cfg: RolloutConfig, model_dir: str | Path, *, dtype: str, max_model_len: int,
                trust_remote_code: bool = False, spmd: bool = False, load_weights: bool = True,
                timeout_minutes: float | None = None,
                start_timeout_minutes: float | None = None) -> RolloutEngine:
    """Start the engine named by ``rollout.engine`` on the HF checkpoint in ``model_dir``.

    ``max_model_len`` (prompt + response) is capped at the model's ``max_position_embeddings``:
    engines refuse a longer context than the model was built for. With ``spmd`` (vLLM only) the
    engine is one tensor-parallel rank of a replica, and every rank of the job must call this;
    ``engines.fleet.EngineFleet`` drives that. Without ``load_weights`` the engine reads only
    the config and tokenizer from ``model_dir`` and starts with placeholder weights (the engines'
    'dummy' load format), which the first ``update_weights`` replaces: at 70B that saves reading
    141 GB per node from shared storage at every start. ``timeout_minutes`` is given to the
    engine's own process groups (None: torch's defaults, 10 minutes for NCCL); with
    ``start_timeout_minutes`` (vLLM) they start with that one, for the collectives of the start,
    and take ``timeout_minutes`` once it is done."""
    spec = read_model_spec(model_dir)
    if spec.max_position_embeddings:
        max_model_len = min(max_model_len, spec.max_position_embeddings)
    common = dict(dtype=dtype, max_model_len=max_model_len, trust_remote_code=trust_remote_code,
                  load_weights=load_weights, timeout_minutes=timeout_minutes)
    if cfg.engine == "vllm":
        from mugrpo_megatron.engines.vllm_engine import VLLMEngine

        return VLLMEngine(cfg, model_dir, spmd=spmd, start_timeout_minutes=start_timeout_minutes,
                          **common)
    if cfg.engine == "sglang":
        if spmd:
            raise ValueError("rollout.placement: spmd is for vLLM; SGLang runs as one engine "
                             "per node (placement node) or on rank 0")
        from mugrpo_megatron.engines.sglang_engine import SGLangEngine

        return SGLangEngine(cfg, model_dir, **common)
    raise ValueError(f"rollout.engine: unknown engine {cfg.engine!r}")
