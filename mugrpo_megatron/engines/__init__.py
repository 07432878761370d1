"""Rollout engines behind one narrow interface; each backend is imported only when chosen."""

from __future__ import annotations

import json
from pathlib import Path

from mugrpo_megatron.config import RolloutConfig
from mugrpo_megatron.engines.base import Generation, RolloutEngine, SamplingSpec, WeightSyncStats

__all__ = ["Generation", "RolloutEngine", "SamplingSpec", "WeightSyncStats", "make_engine"]


def make_engine(cfg: RolloutConfig, model_dir: str | Path, *, dtype: str, max_model_len: int,
                trust_remote_code: bool = False, spmd: bool = False) -> RolloutEngine:
    """Start the engine named by ``rollout.engine`` on the HF checkpoint in ``model_dir``.

    ``max_model_len`` (prompt + response) is capped at the model's ``max_position_embeddings``:
    engines refuse a longer context than the model was built for. With ``spmd`` (vLLM only) the
    engine is one tensor-parallel rank of a replica, and every rank of the job must call this;
    ``engines.fleet.EngineFleet`` drives that."""
    config = Path(model_dir) / "config.json"
    if config.is_file():
        positions = json.loads(config.read_text()).get("max_position_embeddings")
        if positions:
            max_model_len = min(max_model_len, int(positions))
    if cfg.engine == "vllm":
        from mugrpo_megatron.engines.vllm_engine import VLLMEngine

        return VLLMEngine(cfg, model_dir, dtype=dtype, max_model_len=max_model_len,
                          trust_remote_code=trust_remote_code, spmd=spmd)
    if cfg.engine == "sglang":
        if spmd:
            raise ValueError("rollout.placement: spmd is for vLLM; SGLang runs as one engine "
                             "per node (placement node) or on rank 0")
        from mugrpo_megatron.engines.sglang_engine import SGLangEngine

        return SGLangEngine(cfg, model_dir, dtype=dtype, max_model_len=max_model_len,
                            trust_remote_code=trust_remote_code)
    raise ValueError(f"rollout.engine: unknown engine {cfg.engine!r}")
