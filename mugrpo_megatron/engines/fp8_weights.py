"""Block FP8 weights for the rollout engine (``rollout.quantization: fp8``), made at each sync.

The layout is the one DeepSeek-V3's and Qwen3's own FP8 checkpoints ship and vLLM's block-FP8
linear method loads (``Fp8Config`` with ``weight_block_size``): each linear weight of the
decoder layers as ``float8_e4m3fn``, and beside it ``<module>.weight_scale_inv``, one float32 per
128 x 128 block, such that the weight is ``q * scale_inv`` block by block. The embedding, the
output layer, norms, biases and the MoE router stay in the model's dtype (vLLM builds the router
and the embeddings without a quantization method, the FP8 checkpoints keep them in bf16).

The scale of a block is its largest magnitude over e4m3's largest finite value (448), so the
block's largest element maps to +-448 and the rest round to the nearest e4m3 value; an all-zero
block gets the scale 1 and stays zero, as do the blocks outside a ``Shard`` (a sync's slice for
one engine rank, quantized alone and then padded).

**UE8M0 scales** (``ue8m0``): vLLM 0.32/0.33 on Hopper and Blackwell runs block FP8 through
DeepGEMM and, where ``vllm.utils.deep_gemm.is_deep_gemm_e8m0_used()`` (``VLLM_USE_DEEP_GEMM_E8M0``
at its default, on), re-quantizes every block after each load to a power-of-two scale
(``quantization/utils/fp8_utils.py`` ``requant_weight_ue8m0_inplace`` ->
``utils/deep_gemm.py`` ``per_block_cast_to_fp8(use_ue8m0=True)``: the block's largest magnitude,
at least 1e-4, over 448, rounded up to a power of two). Weights quantized with our float32
scales would be rounded a second time there. With ``ue8m0`` the scales are chosen by that same
rule, so vLLM's requantization finds each block already as it would make it and changes no
value (``engines.compat_vllm.engine_scales_ue8m0`` asks vLLM's own function, in the engine's
process). A
block that straddles two TP shards would mix them, so the engine's shard sizes must be multiples
of the block (vLLM refuses them otherwise: ``layout.shapes.engine_fp8_problem``).

No vLLM import here: the quantizer is plain torch, checked in tests against a dequantization
written element by element.
"""

from __future__ import annotations

import math
from collections.abc import Collection, Iterable, Iterator
from pathlib import Path

import torch

from mugrpo_megatron.layout.shapes import ENGINE_FP8_BLOCK
from mugrpo_megatron.types import Shard

FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = float(torch.finfo(FP8_DTYPE).max)
"""448: the largest finite e4m3 value; a block's largest magnitude maps to it."""
UE8M0_MIN_AMAX = 1e-4
"""vLLM's floor on a block's largest magnitude before its power-of-two scale is taken
(``per_block_cast_to_fp8``'s ``clamp(1e-4)``)."""
BLOCK = ENGINE_FP8_BLOCK
SCALE_SUFFIX = "weight_scale_inv"
"""The scale's name beside ``<module>.weight``, as the FP8 checkpoints and vLLM name it."""
_KEPT = ("embed_tokens", "lm_head", "norm", "e_score_correction_bias")
"""Name parts of tensors that stay in the model's dtype (norms, embeddings, the output layer,
the router's correction bias); the routers themselves are ``routers``'."""


def routers(spec) -> tuple[str, ...]:
    """The MoE routers of ``spec`` (a ``models.hf_config.ModelSpec``) as HF modules, one a layer
    with experts (Mixtral's ``block_sparse_moe.gate``, the others' ``mlp.gate``): kept in the
    model's dtype, and named to vLLM as ``ignored_layers`` (``quantization_config``). vLLM 0.32
    and 0.33 build Mixtral's, DeepSeek-V3's and GLM-4.5's ``GateLinear`` without a quantization
    config but hand Qwen3-MoE's the model's (``models/qwen3_moe.py``), which would make it FP8
    unless it is listed: one rule, the router in bf16, for every family."""
    if not spec.is_moe:
        return ()
    return tuple(f"model.layers.{i}.{spec.family.moe.module}.gate"
                 for i in range(spec.num_layers) if spec.is_moe_layer(i))


def quantization_config(block: tuple[int, int] = BLOCK, kept: tuple[str, ...] = ()) -> dict:
    """The ``quantization_config`` of an FP8 checkpoint's config.json (DeepSeek-V3's and
    Qwen3-*-FP8's keys), which makes vLLM build block-FP8 linear layers, but for the modules
    ``kept`` (``routers``; vLLM's ``Fp8Config`` reads ``ignored_layers``, exact names)."""
    return {"quant_method": "fp8", "activation_scheme": "dynamic", "fmt": "e4m3",
            "weight_block_size": list(block), **({"ignored_layers": list(kept)} if kept else {})}


def is_quantized(name: str, tensor: torch.Tensor, kept: Collection[str] = ()) -> bool:
    """Whether the HF tensor ``name`` is one of the engine's FP8 linear weights: a 2-D
    ``.weight`` inside the decoder layers that is not a norm, nor of a module ``kept``."""
    return (tensor.dim() == 2 and name.endswith(".weight") and ".layers." in name
            and not any(part in name for part in _KEPT)
            and name.removesuffix(".weight") not in kept)


def quantize_blocks(weight: torch.Tensor, block: tuple[int, int] = BLOCK,
                    rows_at_once: int = 1024, ue8m0: bool = False
                    ) -> tuple[torch.Tensor, torch.Tensor]:
    """``weight`` [m, n] as (e4m3 [m, n], float32 scales [ceil(m / bm), ceil(n / bn)]), each
    block scaled by its largest magnitude / 448 (edge blocks: what of them there is), or with
    ``ue8m0`` by that rounded up to a power of two, as vLLM's DeepGEMM path makes them (the
    module docstring). Worked
    on ``rows_at_once`` rows at a time (rounded to whole blocks), so that what it holds beyond
    its output is a few float32 copies of those rows, not of the weight (70B's down projection
    is 0.94 GB in float32)."""
    if weight.dim() != 2:
        raise ValueError(f"block FP8 quantizes 2-D weights; got shape {tuple(weight.shape)}")
    bm, bn = block
    m, n = weight.shape
    cols = math.ceil(n / bn)
    step = max(1, rows_at_once // bm) * bm
    q = torch.empty(m, n, dtype=FP8_DTYPE, device=weight.device)
    scales = []
    for start in range(0, m, step):
        part = weight[start:start + step].float()
        rows = math.ceil(part.shape[0] / bm)
        padded = torch.nn.functional.pad(part, (0, cols * bn - n, 0, rows * bm - part.shape[0]))
        blocks = padded.view(rows, bm, cols, bn)
        amax = blocks.abs().amax(dim=(1, 3))
        if ue8m0:
            scale_inv = torch.exp2(torch.ceil(torch.log2(amax.clamp(min=UE8M0_MIN_AMAX) / FP8_MAX)))
        else:
            scale_inv = torch.where(amax > 0, amax / FP8_MAX, torch.ones_like(amax))
        blocks = (blocks / scale_inv[:, None, :, None]).clamp_(-FP8_MAX, FP8_MAX)
        q[start:start + step] = blocks.view(rows * bm, cols * bn)[:part.shape[0], :n].to(FP8_DTYPE)
        scales.append(scale_inv)
    return q, torch.cat(scales)


def dequantize_blocks(q: torch.Tensor, scale_inv: torch.Tensor, block: tuple[int, int] = BLOCK,
                      dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """The weight an FP8 checkpoint's tensors stand for: ``q * scale_inv`` block by block."""
    bm, bn = block
    scale = scale_inv.repeat_interleave(bm, 0).repeat_interleave(bn, 1)[:q.shape[0], :q.shape[1]]
    return (q.float() * scale).to(dtype)


def quantize_stream(weights: Iterable[tuple[str, torch.Tensor | Shard]],
                    block: tuple[int, int] = BLOCK, ue8m0: bool = False,
                    kept: tuple[str, ...] = ()) -> Iterator[tuple[str, torch.Tensor]]:
    """The export stream as the engine's FP8 checkpoint holds it: each linear weight of the
    layers (``is_quantized``) as its e4m3 tensor followed by ``<module>.weight_scale_inv``, the
    rest as it came, full-shape. One tensor at a time: what it holds beyond the stream is
    ``rows_at_once`` rows of one weight in float32 while it is quantized. A ``Shard`` (where the
    sync sends each engine rank its slices) is quantized alone, then padded to full shape, its
    scales likewise (1 outside the slice's blocks; the engine reads only the slice's): 1/TP of
    the elements, where quantizing the padded tensor would take every one (671B a rank a sync at
    DeepSeek-V3). ``kept``: modules sent as they are (``routers``)."""
    kept_set = frozenset(kept)
    for name, tensor in weights:
        values = tensor.values if isinstance(tensor, Shard) else tensor
        if is_quantized(name, values, kept_set):
            q, scale_inv = quantize_blocks(values, block, ue8m0=ue8m0)
            if isinstance(tensor, Shard):
                scale_inv = tensor.with_values(scale_inv, block).whole(fill=1.0)
                q = tensor.with_values(q).whole()
            yield name, q
            yield name.removesuffix("weight") + SCALE_SUFFIX, scale_inv
        else:
            yield name, whole(tensor)


def whole(tensor: torch.Tensor | Shard) -> torch.Tensor:
    """A stream's tensor full-shape (a ``Shard`` padded, anything else as it is)."""
    return tensor.whole() if isinstance(tensor, Shard) else tensor


def checkpoint_tensors(model_dir: str | Path) -> Iterator[tuple[str, torch.Tensor]]:
    """Every tensor of the HF checkpoint in ``model_dir``, one at a time (a release stored
    quantized: dequantized, ``models.released``): what an FP8 engine asked to load the checkpoint
    is sent through ``quantize_stream``."""
    import json

    from mugrpo_megatron.models.released import SafetensorsReader, read_checkpoint_quantization

    config = Path(model_dir) / "config.json"
    stored = read_checkpoint_quantization(json.loads(config.read_text()), str(config)) \
        if config.is_file() else None
    yield from SafetensorsReader(model_dir, stored).tensors()
