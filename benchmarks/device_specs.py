"""device_check.py's first section, ``te_specs``: every supported family's Transformer Engine
layer spec built, its model made and its HF checkpoint loaded, in seconds, before any longer
section, so that the first GPU minute finds what reading missed (issue 52: GLM-4.5 and
DeepSeek-V3's block spec died on a keyword, and MLA's latent norms would have been identities).

For each family of ``models.tiny.TINY_FAMILIES`` a tiny checkpoint (2 layers, 64 wide) goes
through the learner's own path at world size 1: ``learner.model.transformer_config`` and
``layer_spec`` (TE's spec there), ``build_chunks`` (TE's modules, with their real parameters) and
``hf_weights.load_hf_weights``, which refuses a checkpoint tensor no parameter takes. Recorded: the
classes of the attention's norms and projections and of the experts, and the parameter count.
The CPU builds the same specs through megatron's functions (``tests/test_te_specs.py``) but not
TE's modules.
"""

from __future__ import annotations

import importlib.util
import tempfile
from pathlib import Path

import torch


def te_specs(skip: type[Exception]) -> dict:
    if not torch.cuda.is_available() or importlib.util.find_spec("transformer_engine") is None:
        raise skip("TE's layer specs build only with a GPU and Transformer Engine (the CPU "
                   "builds them through megatron's functions: tests/test_te_specs.py)")
    from mugrpo_megatron.config import ModelConfig, ParallelConfig
    from mugrpo_megatron.learner.hf_weights import load_hf_weights
    from mugrpo_megatron.learner.model import build_chunks, init_parallel, uses_transformer_engine
    from mugrpo_megatron.models.hf_config import read_model_spec
    from mugrpo_megatron.models.tiny import TINY_FAMILIES, make_tiny_checkpoint

    out: dict = {"checked": [], "not_checked": [], "families": {}}
    init_parallel(ParallelConfig(), seed=0)
    for family in TINY_FAMILIES:
        path = Path(tempfile.gettempdir()) / f"mugrpo_te_specs_{family}"
        if not (path / "config.json").exists():
            make_tiny_checkpoint(path, family, num_layers=2, hidden_size=64, ffn_hidden_size=64)
        spec, model = read_model_spec(path), ModelConfig(path=str(path), dtype="bfloat16")
        try:
            assert uses_transformer_engine(model)
            chunks = build_chunks(spec, model, ParallelConfig())
            load_hf_weights(chunks, spec, path, 0, 1)
        except Exception as e:  # noqa: BLE001 - each family on its own; the others still run
            out["families"][family] = f"failed: {type(e).__name__}: {e}"[:600]
            out["not_checked"].append(f"{family}: {type(e).__name__}: {str(e)[:300]}")
            continue
        attention = chunks[0].decoder.layers[0].self_attention
        kinds = {name: type(getattr(attention, name)).__name__ for name in (
            "linear_qkv", "q_layernorm", "k_layernorm", "linear_q_up_proj", "linear_kv_up_proj",
            "linear_q_down_proj", "core_attention") if hasattr(attention, name)}
        experts = sorted({type(m).__name__ for n, m in chunks[0].named_modules()
                          if n.endswith("mlp.experts")})
        params = sum(p.numel() for c in chunks for p in c.parameters())
        out["families"][family] = {"attention": kinds, "experts": experts, "parameters": params}
        out["checked"].append(f"{family}: TE spec built, model made, checkpoint loaded whole "
                              f"({params} parameters; experts {experts or 'none'})")
        del chunks
        torch.cuda.empty_cache()
    return out
