"""FP8 training through Transformer Engine: the checks and megatron-core ``TransformerConfig``
fields of ``model.fp8_format`` / ``fp8_recipe``.

TE is imported here only, and only when FP8 is asked for. Formats: 'e4m3' everywhere, or
'hybrid' (e4m3 forward, e5m2 gradients). Recipes: 'delayed' (amax history), 'tensorwise'
(current per-tensor scaling), 'blockwise' and 'mxfp8' (need a TE that has them; mxfp8 needs
Blackwell). The shapes an FP8 GEMM accepts are the layout's rules (``layout.shapes``).
"""

from __future__ import annotations

from typing import Any

import torch

from mugrpo_megatron.config import ModelConfig

_MIN_CAPABILITY = {"delayed": (8, 9), "tensorwise": (8, 9), "blockwise": (9, 0), "mxfp8": (10, 0)}


def fp8_kwargs(model: ModelConfig) -> dict[str, Any]:
    """megatron-core FP8 options for ``model.fp8_format``/``fp8_recipe``; ValueError when the
    machine cannot run them."""
    if not torch.cuda.is_available():
        raise ValueError(f"model.fp8_format: FP8 training needs a CUDA GPU, and none is visible "
                         f"(got {model.fp8_format!r})")
    try:
        import transformer_engine  # noqa: F401
        import transformer_engine.pytorch  # noqa: F401
    except ImportError as e:
        raise ValueError(f"model.fp8_format: FP8 training needs Transformer Engine "
                         f"(pip install 'transformer-engine[pytorch]'): {e}") from None
    need = _MIN_CAPABILITY[model.fp8_recipe]
    have = torch.cuda.get_device_capability()
    if have < need:
        raise ValueError(f"model.fp8_recipe: {model.fp8_recipe!r} needs compute capability "
                         f"{need[0]}.{need[1]} or newer; this GPU has {have[0]}.{have[1]}")
    return {"fp8": model.fp8_format, "fp8_recipe": model.fp8_recipe, "fp8_margin": 0,
            "fp8_amax_history_len": 1024 if model.fp8_recipe == "delayed" else 1,
            "fp8_amax_compute_algo": "max"}
