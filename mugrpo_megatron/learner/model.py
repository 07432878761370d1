"""Process groups, megatron-core GPTModel chunks from an HF config, and HF weights loaded into them.

The one place where our config and a ``ModelSpec`` become megatron-core's arguments: the
TransformerConfig, GPTModel's, DDP's, the optimizer's and the learning-rate schedule's.

Each rank builds only its own pipeline stage(s) (one chunk per virtual stage) and reads only the
rows and columns of the safetensors files that its tensor-parallel shards hold.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from mugrpo_megatron.learner.compat_megatron import (
    groups_time_out_after,
    megatron_on_cpu,
    without_transformer_engine,
    yarn_config,
)

import torch
import torch.distributed as dist
import torch.nn.functional as F
from megatron.core import parallel_state as mpu
from megatron.core import tensor_parallel
from megatron.core.distributed import DistributedDataParallelConfig
from megatron.core.models.gpt import GPTModel
from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
from megatron.core.optimizer import OptimizerConfig
from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler
from megatron.core.transformer import TransformerConfig
from megatron.core.transformer.dot_product_attention import DotProductAttention
from megatron.core.transformer.spec_utils import ModuleSpec
from megatron.core.transformer.transformer_block import (
    TransformerBlockSubmodules,
    get_num_layers_to_build,
)
from megatron.core.transformer.transformer_config import MLATransformerConfig
from megatron.core.transformer.transformer_layer import get_transformer_layer_offset

from mugrpo_megatron.config import ModelConfig, OptimConfig, ParallelConfig
from mugrpo_megatron.distributed import init_default_group
from mugrpo_megatron.layout import check_model, context_comm_type
from mugrpo_megatron.learner.fp8 import transformer_engine_ready
from mugrpo_megatron.models.hf_config import ModelSpec
from mugrpo_megatron.models.rope import latent_yarn_mscales

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass(frozen=True)
class Layout:
    """This process's place in the learner's parallel layout (what the learner reads of it;
    megatron's ``parallel_state`` has the rest)."""

    tp_size: int
    tp_rank: int
    dp_size: int
    dp_rank: int
    cp_size: int = 1
    cp_rank: int = 0


def init_parallel(parallel: ParallelConfig, seed: int) -> Layout:
    """Start torch.distributed (``distributed.init_default_group``: NCCL on GPUs, gloo on CPU) and
    megatron-core's parallel groups, every one of them with ``parallel.timeout_minutes`` (megatron
    would give its own 30 minutes to the TP, PP, DP and EP groups and the gloo groups it makes,
    and a replica that finishes its share of a phase first waits in one of them for the slowest).

    Works under torchrun and in a plain single process (world size 1).
    """
    init_default_group(parallel.timeout_minutes)
    world = dist.get_world_size()
    dp = parallel.data_parallel(world)
    if not mpu.model_parallel_is_initialized():
        with megatron_on_cpu(), groups_time_out_after(parallel.timeout_minutes):
            mpu.initialize_model_parallel(
                tensor_model_parallel_size=parallel.tensor,
                pipeline_model_parallel_size=parallel.pipeline,
                virtual_pipeline_model_parallel_size=parallel.virtual_pipeline,
                expert_model_parallel_size=parallel.expert,
                context_parallel_size=parallel.context,
                distributed_timeout_minutes=parallel.timeout_minutes,
            )
            tensor_parallel.model_parallel_cuda_manual_seed(seed)
    return Layout(tp_size=mpu.get_tensor_model_parallel_world_size(),
                  tp_rank=mpu.get_tensor_model_parallel_rank(),
                  dp_size=dp, dp_rank=mpu.get_data_parallel_rank(),
                  cp_size=mpu.get_context_parallel_world_size(),
                  cp_rank=mpu.get_context_parallel_rank())


def transformer_config(spec: ModelSpec, model: ModelConfig, parallel: ParallelConfig
                       ) -> TransformerConfig:
    """The one place where our config and the HF architecture become megatron-core's."""
    dtype = DTYPES[model.dtype]
    kw = dict(
        num_layers=spec.num_layers, hidden_size=spec.hidden_size,
        ffn_hidden_size=spec.ffn_hidden_size, num_attention_heads=spec.num_heads,
        num_query_groups=spec.num_kv_heads, kv_channels=spec.head_dim,
        gated_linear_unit=True, activation_func=F.silu, normalization="RMSNorm",
        layernorm_epsilon=spec.norm_eps, add_bias_linear=False, add_qkv_bias=spec.qkv_bias,
        # q/k norms (MLA: the latents' norms q_a_layernorm / kv_a_layernorm) exist where this
        # is set: megatron-core's block spec builds every layer from it, and 0.19's attention
        # refuses a spec whose norms disagree with it (the one source: layer_spec reads it)
        qk_layernorm=spec.qk_norm or spec.mla is not None, hidden_dropout=0.0, attention_dropout=0.0,
        init_method_std=spec.init_std, attention_softmax_in_fp32=True,
        # fusions need apex/TE kernels; on GPUs with TE the TE spec brings its own
        bias_activation_fusion=False, bias_dropout_fusion=False, masked_softmax_fusion=False,
        persist_layer_norm=False, gradient_accumulation_fusion=False,
        **rope_fusion(uses_transformer_engine(model)),
        tensor_model_parallel_size=parallel.tensor, pipeline_model_parallel_size=parallel.pipeline,
        virtual_pipeline_model_parallel_size=parallel.virtual_pipeline,
        sequence_parallel=parallel.sequence_parallel, expert_model_parallel_size=parallel.expert,
        context_parallel_size=parallel.context, cp_comm_type=context_comm_type(spec, parallel),
        params_dtype=dtype, pipeline_dtype=dtype, bf16=dtype == torch.bfloat16,
        fp16=dtype == torch.float16, use_cpu_initialization=not torch.cuda.is_available(),
        # True even though the checkpoint overwrites the values: megatron only tags TP-sharded
        # weights (tensor_model_parallel, partition_dim) inside its init functions.
        perform_initialization=True,
        # full: every layer from its input (uniform, one layer a chunk); selective: megatron's
        # default module set, core attention
        recompute_granularity=None if model.recompute == "none" else model.recompute,
        recompute_method="uniform" if model.recompute == "full" else None,
        recompute_num_layers=1 if model.recompute == "full" else None,
        window_size=(spec.sliding_window - 1, 0) if spec.sliding_window else None,
        # gloo matches messages between two ranks by order only; with PP=2 a stage's previous and
        # next rank are the same, and a batched send/recv of an activation and a gradient can be
        # paired the wrong way round (seen with the interleaved schedule). Unbatched p2p pairs
        # them by megatron's even/odd ordering. NCCL keeps the faster batched path.
        batch_p2p_comm=torch.cuda.is_available(),
    )
    if spec.is_moe:
        kw.update(
            num_moe_experts=spec.num_experts, moe_router_topk=spec.experts_per_token,
            moe_ffn_hidden_size=spec.moe_ffn_hidden_size,
            moe_router_pre_softmax=spec.router_pre_softmax,
            # routing in fp32 as HF and the engines route (model.router_dtype); no
            # load-balancing loss in RL unless asked (model.router_load_balancing)
            moe_router_dtype=model.router_dtype,
            moe_router_load_balancing_type=model.router_load_balancing,
            moe_aux_loss_coeff=model.router_aux_loss_coeff,
            # all-to-all needs CUDA streams; all-gather works on gloo
            moe_token_dispatcher_type="alltoall" if torch.cuda.is_available() else "allgather",
            # experts as one grouped GEMM where TE is (TEGroupedMLP), one at a time elsewhere
            moe_grouped_gemm=uses_transformer_engine(model), **moe_family_kwargs(spec, model))
    rope = spec.rope_scaling
    latent = latent_attention_kwargs(spec) if spec.mla is not None else None
    if latent is not None:
        if uses_transformer_engine(model) and latent["rope_type"] != "yarn":
            kw["apply_rope_fusion"] = False  # megatron's fused MLA RoPE is YaRN's only
    elif rope is not None and rope["rope_type"] == "yarn":
        # HF and vLLM multiply cos and sin by the attention factor m, so q.k by m^2: the same
        # scores as megatron's rotation without it and a softmax scale of m^2 / sqrt(head_dim)
        # (compat_megatron part 8: why not megatron's own mscale)
        kw["softmax_scale"] = rope["attention_factor"] ** 2 / math.sqrt(spec.head_dim)
    if model.fp8_format is not None:
        from mugrpo_megatron.learner.fp8 import fp8_kwargs

        kw.update(fp8_kwargs(model))
    # two calls, so that scripts/check_upstream.py binds each class's keywords on their own
    config = MLATransformerConfig(**{**kw, **latent}) if latent is not None \
        else TransformerConfig(**kw)
    if spec.mla is None and rope is not None and rope["rope_type"] == "yarn":
        yarn_config(config, rope)
    return config


def latent_attention_kwargs(spec: ModelSpec) -> dict[str, Any]:
    """megatron-core's ``MLATransformerConfig`` fields for DeepSeek-V3's attention: its own
    rotary embedding of the rope dimensions (plain, or YaRN with HF's magnitude factors:
    ``models.rope.latent_yarn_mscales``), its own softmax scale; ``kv_channels`` is the value
    head (the core attention's output width)."""
    mla, rope = spec.mla, spec.rope_scaling
    kw: dict[str, Any] = dict(
        q_lora_rank=mla.q_lora_rank, kv_lora_rank=mla.kv_lora_rank,
        qk_head_dim=mla.qk_nope_head_dim, qk_pos_emb_head_dim=mla.qk_rope_head_dim,
        v_head_dim=mla.v_head_dim, kv_channels=mla.v_head_dim, rotary_base=spec.rope_theta,
        rope_type="rope", rotary_scaling_factor=1.0)
    if rope is None:
        return kw
    if rope["rope_type"] != "yarn" or not rope["truncate"]:
        raise ValueError(f"{spec.architecture}: multi-latent attention with rope_scaling "
                         f"{rope['rope_type']!r}{'' if rope['truncate'] else ' (truncate false)'}"
                         f" is not supported (megatron-core's MLA has plain RoPE and YaRN with "
                         f"its correction range rounded)")
    mscale, all_dim = latent_yarn_mscales(rope)
    kw.update(rope_type="yarn", rotary_scaling_factor=rope["factor"],
              original_max_position_embeddings=rope["original_max_position_embeddings"],
              beta_fast=rope["beta_fast"], beta_slow=rope["beta_slow"], mscale=mscale,
              mscale_all_dim=all_dim)
    return kw


def moe_family_kwargs(spec: ModelSpec, model: ModelConfig) -> dict[str, Any]:
    """megatron-core's names for GLM-4.5 / DeepSeek-V3's MoE pieces (``ModelSpec``): sigmoid
    scores, the expert bias that only chooses (its update rate ``model.router_bias_update_rate``,
    0 under RL: the checkpoint's bias kept), the scaling of the chosen weights, group-limited
    choice, shared experts, the first layers dense."""
    kw: dict[str, Any] = {}
    if spec.router_score != "softmax":
        kw["moe_router_score_function"] = spec.router_score
    if spec.router_expert_bias:
        kw.update(moe_router_enable_expert_bias=True,
                  moe_router_bias_update_rate=model.router_bias_update_rate)
    if spec.router_scaling is not None and spec.router_scaling != 1.0:
        kw["moe_router_topk_scaling_factor"] = spec.router_scaling
    if spec.router_groups is not None:
        kw["moe_router_num_groups"], kw["moe_router_group_topk"] = spec.router_groups
    if spec.shared_ffn_hidden_size:
        kw["moe_shared_expert_intermediate_size"] = spec.shared_ffn_hidden_size
    if spec.dense_layers:
        kw["moe_layer_freq"] = [int(spec.is_moe_layer(i)) for i in range(spec.num_layers)]
    return kw


def rope_fusion(te: bool) -> dict[str, bool]:
    """TE's fused RoPE wherever Transformer Engine runs. Packed (THD) rows need it: megatron's
    unfused THD RoPE (``rope_utils._apply_rotary_pos_emb_thd``, megatron-core 0.16.1) reads each
    row's sequence lengths to the host (``.tolist()``) in every attention layer, two device syncs
    a layer and microbatch; TE's kernel (``fused_apply_rotary_pos_emb_thd``, TE >= 1.12; the
    range pyproject admits) takes ``cu_seqlens`` on the device and starts every sequence at
    position 0. Without TE there is no kernel to fuse with (megatron refuses the flag)."""
    return {"apply_rope_fusion": te}


def gpt_model_kwargs(spec: ModelSpec) -> dict[str, Any]:
    """``GPTModel`` arguments for the positional embedding."""
    kw: dict[str, Any] = {"position_embedding_type": "rope", "rotary_base": spec.rope_theta,
                          "max_sequence_length": spec.max_position_embeddings,
                          "rotary_percent": spec.rotary_fraction}
    if spec.rope_scaling is not None and spec.mla is None:  # MLA: its own (the config's)
        kind = spec.rope_scaling["rope_type"]
        factor = float(spec.rope_scaling["factor"])
        if kind == "yarn":  # its numbers go on the config (transformer_config)
            kw["position_embedding_type"] = "yarn"
        elif kind == "linear":
            kw["seq_len_interpolation_factor"] = factor
        else:  # llama3: megatron-core applies Llama 3.1's fixed low/high frequency factors
            expected = {"low_freq_factor": 1.0, "high_freq_factor": 4.0,
                        "original_max_position_embeddings": 8192}
            for key, value in expected.items():
                if float(spec.rope_scaling.get(key, value)) != value:
                    raise ValueError(f"rope_scaling.{key}={spec.rope_scaling[key]} is not supported "
                                     f"(megatron-core's llama3 scaling uses {value})")
            kw["rope_scaling"] = True
            kw["rope_scaling_factor"] = factor
    return kw


def ddp_config(parallel: ParallelConfig) -> DistributedDataParallelConfig:
    """megatron-core DDP: gradients reduced in fp32, sharded with the distributed optimizer."""
    return DistributedDataParallelConfig(
        grad_reduce_in_fp32=True, overlap_grad_reduce=False,
        use_distributed_optimizer=parallel.distributed_optimizer, check_for_nan_in_grad=False)


def optimizer_config(optim: OptimConfig, model: ModelConfig, parallel: ParallelConfig
                     ) -> OptimizerConfig:
    """megatron-core's Adam for ``optim`` (fp32 master weights kept for bf16/fp16 training)."""
    dtype = DTYPES[model.dtype]
    o = optim
    return OptimizerConfig(optimizer="adam", lr=o.lr, min_lr=o.min_lr, weight_decay=o.weight_decay,
                           adam_beta1=o.adam_beta1, adam_beta2=o.adam_beta2, adam_eps=o.adam_eps,
                           clip_grad=o.grad_clip, bf16=dtype == torch.bfloat16,
                           fp16=dtype == torch.float16, params_dtype=dtype,
                           use_distributed_optimizer=parallel.distributed_optimizer)


def lr_schedule(optimizer, optim: OptimConfig, total_updates: int) -> OptimizerParamScheduler:
    """megatron-core's schedule: linear warm-up, then ``optim.lr_schedule`` over the run."""
    o = optim
    return OptimizerParamScheduler(
        optimizer, init_lr=0.0 if o.warmup_updates else o.lr, max_lr=o.lr, min_lr=o.min_lr,
        lr_warmup_steps=o.warmup_updates, lr_decay_steps=max(total_updates, o.warmup_updates + 1),
        lr_decay_style=o.lr_schedule, start_wd=o.weight_decay, end_wd=o.weight_decay,
        wd_incr_steps=total_updates, wd_incr_style="constant")


def uses_transformer_engine(model: ModelConfig) -> bool:
    """Whether the learner runs Transformer Engine's layer spec (``fp8.transformer_engine_ready``:
    on a GPU where TE's PyTorch part imports; a broken TE is an error, not a fallback)."""
    return transformer_engine_ready()


class SequenceParallelRMSNorm(torch.nn.RMSNorm):
    """torch's RMSNorm for megatron's local (non-TE) spec, usable with sequence parallel.

    megatron-core's ``WrappedTorchNorm`` refuses sequence parallel outright. The norm itself needs
    nothing for it (each TP rank normalises its own slice of the sequence); what it needs is that
    its weight's gradient, which is then a partial sum over that slice, is all-reduced over the TP
    group: ``finalize_model_grads`` does that for parameters tagged ``sequence_parallel``, as
    Transformer Engine's norms are. This class is that tag, written here because no library norm
    for megatron's local spec carries it.
    """

    def __init__(self, config: TransformerConfig, hidden_size: int, eps: float = 1e-5, **_):
        super().__init__(hidden_size, eps=eps, dtype=config.params_dtype)
        self.weight.sequence_parallel = config.sequence_parallel


class LatentCoreAttention(DotProductAttention):
    """megatron's local core attention for multi-latent attention. 0.16.1's ``MLASelfAttention``
    builds its core attention with ``k_channels`` (nope + rope) and ``v_channels`` (the value
    head), which TE's attention takes and the local ``DotProductAttention`` refuses (TypeError);
    its products need neither (q.k over the key width, p.v over the value width, the output
    ``kv_channels`` = v_head_dim wide, the softmax scale given). Checked that they are what
    the config says, then dropped (``Attention.__init__`` builds a first one without them,
    which MLA's replaces)."""

    def __init__(self, config: MLATransformerConfig, *args, k_channels: int | None = None,
                 v_channels: int | None = None, **kwargs):
        expected = (config.qk_head_dim + config.qk_pos_emb_head_dim, config.v_head_dim)
        given = k_channels is not None or v_channels is not None
        if (given and (k_channels, v_channels) != expected) or config.kv_channels != config.v_head_dim:
            raise ValueError(f"MLA core attention: k/v channels {(k_channels, v_channels)}, "
                             f"kv_channels {config.kv_channels}; expected {expected}")
        super().__init__(config, *args, **kwargs)


def layer_spec(spec: ModelSpec, model: ModelConfig, config: TransformerConfig,
               vp_stage: int | None = None):
    """Transformer Engine's layer spec where TE and a GPU are present (``te_layer_spec``),
    megatron's local one else.

    With sequence parallel on the local spec, or dense layers before the experts (GLM-4.5's
    first_k_dense_replace), the whole block's spec: this stage's layers, each dense or MoE,
    and the final norm, with ``SequenceParallelRMSNorm`` in place of megatron's torch norms."""
    if uses_transformer_engine(model):
        return te_layer_spec(spec, config, vp_stage)
    if model.fp8_format is not None and torch.cuda.is_available():
        raise ValueError("model.fp8_format: FP8 needs Transformer Engine, which is not "
                         "importable here")
    sp = config.sequence_parallel
    moe = _local_layer(spec, config, spec.num_experts or None)
    if not (sp or spec.dense_layers):
        return moe
    dense = _local_layer(spec, config, None) if spec.dense_layers else moe
    first = get_transformer_layer_offset(config, vp_stage=vp_stage)
    layers = [moe if spec.is_moe_layer(first + i) else dense
              for i in range(get_num_layers_to_build(config, vp_stage=vp_stage))]
    norm = ModuleSpec(module=SequenceParallelRMSNorm) if sp else moe.submodules.input_layernorm
    return TransformerBlockSubmodules(layer_specs=layers, layer_norm=norm)


def te_layer_spec(spec: ModelSpec, config: TransformerConfig, vp_stage: int | None = None):
    """megatron-core's Transformer Engine spec: the block's (this stage's layers, dense or MoE by
    ``config.moe_layer_freq``) where the first layers are dense, one layer's else; experts as
    TEGroupedMLP. Whether q/k norms (MLA: the latents' norms, fused into the up projections as
    ``linear_q_up_proj.layer_norm_weight``) exist is ``config.qk_layernorm``, which the block
    spec reads for every layer (``get_gpt_decoder_block_spec`` takes no ``qk_layernorm``:
    0.16.1-0.19.2). Built on CPU by tests/test_te_specs.py through these very calls."""
    from megatron.core.models.gpt.gpt_layer_specs import (
        get_gpt_decoder_block_spec,
        get_gpt_layer_with_transformer_engine_spec,
    )

    if spec.dense_layers:
        return get_gpt_decoder_block_spec(config, use_transformer_engine=True, vp_stage=vp_stage)
    return get_gpt_layer_with_transformer_engine_spec(
        num_experts=spec.num_experts or None, moe_grouped_gemm=spec.is_moe,
        qk_layernorm=config.qk_layernorm, multi_latent_attention=spec.mla is not None)


def _local_layer(spec: ModelSpec, config: TransformerConfig, experts: int | None):
    """megatron's local layer spec, dense (``experts`` None) or MoE, with our core attention
    under CP (megatron's own refuses it) and, with sequence parallel, our norms (MLA: its
    latents' norms, which megatron builds where ``qk_layernorm`` is set)."""
    mla = spec.mla is not None
    local = get_gpt_layer_local_spec(num_experts=experts, moe_grouped_gemm=False,
                                     qk_layernorm=config.qk_layernorm,
                                     multi_latent_attention=mla, normalization="RMSNorm")
    if mla:
        # the latents' down projections whole on every TP rank, as TE's spec has them (its
        # TELinear, duplicated), with megatron's torch Linear (the one MLASelfAttention takes
        # besides TE's): the local spec's ColumnParallelLinear sends them through
        # gather_from_tensor_model_parallel_region, whose backward keeps each rank's slice of
        # the rotary key's gradient from its own heads only (0.16.1-0.19.2), never summed
        from megatron.core.post_training.modelopt.layers import Linear

        attention = local.submodules.self_attention.submodules
        attention.linear_q_down_proj = attention.linear_kv_down_proj = Linear
        attention.core_attention = LatentCoreAttention
    elif config.context_parallel_size > 1:
        from mugrpo_megatron.learner.context import ContextParallelAttention

        local.submodules.self_attention.submodules.core_attention = ContextParallelAttention
    if not config.sequence_parallel:
        return local
    norm = ModuleSpec(module=SequenceParallelRMSNorm)
    local.submodules.input_layernorm = norm
    local.submodules.pre_mlp_layernorm = norm
    attention = local.submodules.self_attention.submodules
    if mla:  # the latents are split over the sequence there, as the layer's input
        attention.q_layernorm = attention.kv_layernorm = norm
    elif spec.qk_norm:  # megatron's torch norm refuses any model with sequence parallel on
        attention.q_layernorm = attention.k_layernorm = norm
    return local


def build_chunks(spec: ModelSpec, model: ModelConfig, parallel: ParallelConfig) -> list[GPTModel]:
    """This rank's model chunks (one per virtual pipeline stage), weights uninitialised; the
    layout checked as ``train``, the dry run and ``convert`` check it (``layout.check_model``)."""
    check_model(spec, model, parallel)
    without_transformer_engine()
    config = transformer_config(spec, model, parallel)
    chunks = []
    vp = parallel.virtual_pipeline
    with megatron_on_cpu():
        for vp_stage in range(vp or 1):
            stage = vp_stage if vp else None
            chunk = GPTModel(
                config=config, transformer_layer_spec=layer_spec(spec, model, config, stage),
                vocab_size=spec.padded_vocab_size(parallel.tensor),
                pre_process=mpu.is_pipeline_first_stage(ignore_virtual=False, vp_stage=stage),
                post_process=mpu.is_pipeline_last_stage(ignore_virtual=False, vp_stage=stage),
                share_embeddings_and_output_weights=spec.tie_embeddings, parallel_output=True,
                vp_stage=stage, **gpt_model_kwargs(spec))
            if torch.cuda.is_available():
                chunk.cuda(torch.cuda.current_device())
            if model.freeze_router:  # before DDP and the optimizer: no grad buffer, no state
                for name, param in chunk.named_parameters():
                    if ".router." in name:
                        param.requires_grad_(False)
            chunks.append(chunk)
    return chunks
