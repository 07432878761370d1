"""The shapes the learner's tensors must have on a GPU: rounding, the FP8 GEMM shape rules, the
token multiple a microbatch row is padded to, and the tokens of a packed row. Pure arithmetic (no
Transformer Engine, no megatron): the learner and the dry run use it on any machine.

The FP8 rules, read in Transformer Engine 2.0, 2.4, 2.8, 2.12 and 2.18:

- ``transformer_engine/pytorch/utils.py: assert_dim_for_fp8_exec``, called by ``Linear``,
  ``LayerNormLinear`` and ``LayerNormMLP`` on their input and weight before an FP8 GEMM: the
  product of all dimensions but the last must be divisible by 8, the last by 16. For an input
  that is the tokens: (tokens this TP rank holds) % 8. With sequence parallel a column-parallel
  layer's input is this rank's slice of the sequence, ``[seq / tp, micro_batch, hidden]``.
- ``assert_dim_for_all_gather`` (2.8 to 2.12; the same quantizers in 2.18), where sequence
  parallel all-gathers a quantized input: ``Quantizer.is_quantizable``, which for
  ``Float8BlockQuantizer`` (recipe 'blockwise') needs the leading product divisible by its
  block length, 128, and for ``MXFP8Quantizer`` by 32 (``MXFP8_BLOCK_SCALING_SIZE``).
- megatron-core aligns FP8 token counts to 16 (32 for mxfp8) where it pads them itself
  (``fp8_utils.get_fp8_align_size``, used for the MoE experts' inputs, which it pads: the dense
  layers' token counts are ours to meet).

So each microbatch row is padded (at the right, with tokens that are no response token: no loss,
metric or log-prob sees them) until the tokens of each TP rank are a multiple of
``RECIPE_TOKEN_MULTIPLE``; a packed row (THD) is sized the same way. The model's own dimensions
(hidden size, the MLP and attention widths per TP rank) must meet the rule too:
``check_model_dims`` refuses a layout that would fail in TE's first forward.

The engine's block FP8 (``rollout.quantization: fp8``) has rules of its own, vLLM's
(``engine_fp8_problem``); so does a sync that sends each engine rank only its slices
(``engine_slices_problem``).
"""

from __future__ import annotations

import math

from mugrpo_megatron.config import ModelConfig, ParallelConfig
from mugrpo_megatron.models.hf_config import LatentAttention, ModelSpec

GEMM_ROWS, GEMM_COLS = 8, 16
"""``assert_dim_for_fp8_exec``: leading product % 8, last dimension % 16."""
RECIPE_TOKEN_MULTIPLE = {"delayed": 16, "tensorwise": 16, "mxfp8": 32, "blockwise": 128}
"""Tokens per TP rank that each recipe's FP8 GEMM inputs (and quantized all-gathers) accept:
TE's 8, raised to megatron-core's own FP8 alignment (16, mxfp8 32) and to the blockwise
quantizer's block of 128."""


def round_up(n: int, multiple: int) -> int:
    """The smallest multiple of ``multiple`` that is at least ``n`` (the one rounding helper)."""
    return -(-n // multiple) * multiple


def token_multiple(model: ModelConfig, parallel: ParallelConfig) -> int:
    """What a microbatch row's length (or a packed row's capacity) must be a multiple of: every
    TP rank's share of its tokens is a multiple of what the FP8 recipe needs
    (``parallel.pad_tokens_to`` overrides it, also without FP8), and with sequence parallel the
    row splits evenly over the TP ranks."""
    per_rank = parallel.pad_tokens_to or (
        RECIPE_TOKEN_MULTIPLE[model.fp8_recipe] if model.fp8_format is not None else 1)
    per_rank = per_rank * parallel.tensor if parallel.sequence_parallel else per_rank
    # context parallel: the row is cut into 2 x context chunks, each rank's two a whole share
    return per_rank * 2 * parallel.context if parallel.context > 1 else per_rank


def pack_capacity(parallel: ParallelConfig, max_sequence_tokens: int, thd: bool,
                  multiple: int, exchange_packs: bool = True) -> int:
    """Tokens of a packed microbatch row (0: pad): ``parallel.pack_tokens``, where 'auto' packs
    through Transformer Engine's THD attention (``thd``) into rows of micro_batch_size x the
    longest sequence (``max_sequence_tokens``: data.max_prompt_tokens + rollout.max_new_tokens),
    the most a padded microbatch could hold, and pads without TE or where the context-parallel
    exchange refuses THD (``exchange_packs``: ``layout.context.packs_with``); rounded up to
    ``multiple`` (FP8, sequence parallel, 2 x context)."""
    tokens = parallel.pack_tokens
    if tokens == "auto":
        tokens = parallel.micro_batch_size * max_sequence_tokens if thd and exchange_packs else 0
    return round_up(tokens, multiple) if tokens else 0


def gemm_inputs_ok(shape: tuple[int, ...]) -> bool:
    """TE's ``assert_dim_for_fp8_exec`` for one tensor."""
    return math.prod(shape[:-1]) % GEMM_ROWS == 0 and shape[-1] % GEMM_COLS == 0


def check_model_dims(spec: ModelSpec, parallel: ParallelConfig) -> None:
    """ValueError, naming the dimension, when a dense FP8 GEMM of this model at this TP size
    would fail TE's rule whatever the tokens: the weights ``[out / tp, in]`` or ``[out, in / tp]``
    of the four projections of a layer, and the inputs' last dimensions (MoE experts are padded
    by megatron-core; their widths are checked the same way)."""
    tp = parallel.tensor
    mlp = spec.moe_ffn_hidden_size if spec.is_moe else spec.ffn_hidden_size
    q, kv = spec.num_heads * spec.head_dim, spec.num_kv_heads * spec.head_dim
    weights = {  # name: per-rank weight shape [out, in]
        "linear_qkv (query, key and value heads x head_dim / TP, hidden)": ((q + 2 * kv) // tp,
                                                                            spec.hidden_size),
        "linear_proj (hidden, query heads x head_dim / TP)": (spec.hidden_size, q // tp),
    } if spec.mla is None else {  # MLA: down projections whole, o_proj by inputs, the rest by outputs
        f"{name} of multi-latent attention": (o, i) if name in LatentAttention.DOWN
        else (o, i // tp) if name == "o_proj" else (o // tp, i)
        for name, (o, i) in spec.mla.projections(spec.num_heads, spec.hidden_size).items()}
    weights |= {
        "linear_fc1 (2 x MLP size / TP, hidden)": (2 * mlp // tp, spec.hidden_size),
        "linear_fc2 (hidden, MLP size / TP)": (spec.hidden_size, mlp // tp),
    }
    for name, shape in weights.items():
        if not gemm_inputs_ok(shape):
            raise ValueError(
                f"model.fp8_format: the FP8 GEMM of {name} would have the weight shape "
                f"{list(shape)} at parallel.tensor = {tp}; Transformer Engine needs the first "
                f"dimension divisible by {GEMM_ROWS} and the last by {GEMM_COLS}. Choose another "
                f"parallel.tensor, or train this model without FP8.")


ENGINE_FP8_BLOCK = (128, 128)
"""(rows, columns) of one scale's block in the engine's FP8 weights: DeepSeek-V3's and Qwen3's
FP8 checkpoints' ``weight_block_size`` (``engines.fp8_weights``)."""


def engine_fp8_problem(spec: ModelSpec, tp: int,
                       block: tuple[int, int] = ENGINE_FP8_BLOCK) -> str:
    """Why vLLM would refuse ``spec``'s linear layers in block FP8 at engine TP ``tp`` ('' if it
    would not): vLLM 0.32-0.33 ``validate_fp8_block_shape`` wants every TP-split output size
    (each part of a merged q/k/v or gate/up) and every row-parallel input size a multiple of the
    block, and ``validate_fp8_block_shape_moe`` each expert's intermediate size a rank (with
    expert parallelism, which this stack does not start, the experts would stay whole).
    Qwen3-235B's experts (1536) split into 192 columns at TP 8: refused (checked against
    vLLM's own validators in tests/test_fp8_rollout.py)."""
    bn, bk = block
    parts: list[tuple[str, float, int]] = []  # (what, size a rank, the block it must divide)
    if spec.mla is None:
        heads, kv = spec.num_heads / tp, max(1, spec.num_kv_heads // tp)
        parts += [("a rank's query heads", heads * spec.head_dim, bn),
                  ("a rank's key/value heads", kv * spec.head_dim, bn)]
        if tp > 1:
            parts.append(("o_proj's input a rank", heads * spec.head_dim, bk))
    else:
        for name, (out, inp) in spec.mla.projections(spec.num_heads, spec.hidden_size).items():
            split = name not in LatentAttention.DOWN
            if split and tp > 1:
                parts.append((f"{name} a rank", (inp if name == "o_proj" else out) / tp,
                              bk if name == "o_proj" else bn))
    dense = any(not spec.is_moe_layer(i) for i in range(spec.num_layers))
    mlps = [("the MLP's intermediate size a rank", spec.ffn_hidden_size)] if dense else []
    if spec.is_moe:
        mlps.append(("an expert's intermediate size a rank", spec.moe_ffn_hidden_size))
        if spec.shared_ffn_hidden_size:
            mlps.append(("the shared expert's intermediate size a rank",
                         spec.shared_ffn_hidden_size))
    parts += [(what, size / tp, bn) for what, size in mlps]
    bad = [f"{what} is {size:g}" for what, size, b in parts if size % b]
    if not bad:
        return ""
    return (f"block FP8 at engine TP {tp}: " + ", ".join(bad) + f", not a multiple of the "
            f"{bn} x {bk} block (vLLM's validate_fp8_block_shape refuses it); choose a "
            f"rollout.tensor_parallel where these divide, or quantization: none")


def engine_slices_problem(spec: ModelSpec, learner_tp: int, engine_tp: int,
                          stage_ranks: int) -> str | None:
    """Why a weight sync cannot send each engine rank only its slices from the learner ranks
    that hold them (``learner.engine_slices``), where vLLM runs spmd at ``engine_tp`` beside a
    learner at ``learner_tp`` with ``stage_ranks`` ranks a pipeline stage; None: it can."""
    if engine_tp < 2 * learner_tp or engine_tp % learner_tp:
        return f"the engine's TP {engine_tp} is not a multiple (>= 2) of the learner's {learner_tp}"
    if stage_ranks % engine_tp:
        return f"the engine's TP {engine_tp} does not divide a pipeline stage's {stage_ranks} ranks"
    kv = spec.num_kv_heads
    sizes = {"attention heads": spec.num_heads, "MLP size": spec.ffn_hidden_size,
             "experts' MLP size": spec.moe_ffn_hidden_size,
             "shared experts' MLP size": spec.shared_ffn_hidden_size}
    for what, n in sizes.items():
        if n % engine_tp:
            return f"the {what} ({n}) is not split evenly over the engine's TP {engine_tp}"
    if kv % engine_tp and engine_tp % kv:
        return f"{kv} KV heads over the engine's TP {engine_tp}"
    return None
