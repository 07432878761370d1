"""A Hugging Face ``config.json`` as the numbers the learner and the weight mapping need.

``ModelSpec`` is plain data (no megatron import) so that the mapping tables, the engines, the
dry-run memory estimate and the resharding code can all use it; ``learner/model.py`` turns it
into megatron-core's arguments, in one place.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from mugrpo_megatron.models.released import CheckpointQuantization, read_checkpoint_quantization
from mugrpo_megatron.models.rope import read_rope_scaling


def _qwen3_moe(cfg: dict[str, Any], source: str) -> dict[str, Any]:
    if int(cfg.get("decoder_sparse_step", 1)) != 1 or cfg.get("mlp_only_layers"):
        raise ValueError(f"{source}: dense layers among the MoE layers (decoder_sparse_step, "
                         f"mlp_only_layers) are not supported")
    # hub configs say num_experts; transformers 5 writes num_local_experts
    return dict(num_experts=int(cfg.get("num_experts") or cfg["num_local_experts"]),
                moe_ffn_hidden_size=int(cfg["moe_intermediate_size"]),
                router_pre_softmax=not cfg.get("norm_topk_prob", False))


def _glm4_moe(cfg: dict[str, Any], source: str) -> dict[str, Any]:
    """GLM-4.5's MoE (DeepSeek-V3's too): sigmoid scores with a correction bias that only
    chooses the experts, the chosen scores renormalised and scaled, shared experts beside them,
    group-limited choice, the first layers dense."""
    if not cfg.get("norm_topk_prob", True) and int(cfg["num_experts_per_tok"]) > 1:
        raise ValueError(f"{source}: norm_topk_prob=false is not supported (megatron-core "
                         f"renormalises sigmoid top-k scores whenever top-k > 1)")
    groups, group_topk = int(cfg.get("n_group") or 1), int(cfg.get("topk_group") or 1)
    topk = int(cfg["num_experts_per_tok"])
    if groups > 1 and topk // group_topk != 2:
        raise ValueError(f"{source}: n_group={groups} with topk_group={group_topk} and "
                         f"num_experts_per_tok={topk}: HF scores a group by its top 2 experts, "
                         f"megatron-core by its top num_experts_per_tok / topk_group = "
                         f"{topk // group_topk}; they agree only when that is 2")
    return dict(num_experts=int(cfg.get("n_routed_experts") or cfg["num_local_experts"]),
                moe_ffn_hidden_size=int(cfg["moe_intermediate_size"]), router_pre_softmax=False,
                shared_ffn_hidden_size=int(cfg["moe_intermediate_size"])
                * int(cfg.get("n_shared_experts") or 0),
                router_score="sigmoid", router_expert_bias=True,
                router_scaling=float(cfg.get("routed_scaling_factor") or 1.0),
                router_groups=(groups, group_topk) if groups > 1 else None,
                dense_layers=int(cfg.get("first_k_dense_replace") or 0),
                mtp_layers=int(cfg.get("num_nextn_predict_layers") or 0))


def _deepseek_v3_moe(cfg: dict[str, Any], source: str) -> dict[str, Any]:
    """DeepSeek-V3's MoE is GLM-4.5's; its config says how vLLM routes, which transformers
    assumes: vLLM 0.32 (``models/deepseek_v2.py``) scores by ``scoring_func`` (softmax where
    absent) and keeps the correction bias only where ``topk_method`` is ``noaux_tc``."""
    got = (cfg.get("scoring_func"), cfg.get("topk_method"))
    if got != ("sigmoid", "noaux_tc"):
        raise ValueError(f"{source}: scoring_func={got[0]!r}, topk_method={got[1]!r}: only "
                         f"DeepSeek-V3's routing is supported (scoring_func 'sigmoid', "
                         f"topk_method 'noaux_tc', as its config.json says): transformers "
                         f"routes so whatever the config says, vLLM reads these two fields")
    return _glm4_moe(cfg, source)


def _mixtral_moe(cfg: dict[str, Any], source: str) -> dict[str, Any]:
    return dict(num_experts=int(cfg["num_local_experts"]),
                moe_ffn_hidden_size=int(cfg["intermediate_size"]), router_pre_softmax=False)


HF_CONFIG_DIR = "hf_config"
"""Where a Megatron checkpoint of ours keeps the HF config and tokenizer files it was made from,
so that it knows its architecture (``convert --to hf``, ``eval`` of a checkpoint)."""
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
                   "chat_template.jinja", "vocab.json", "merges.txt", "tokenizer.model",
                   "generation_config.json")
"""The files of an HF model directory besides config.json and the weights that shape what the
engine is given or the export carries: tokenizer, chat template, generation settings."""

@dataclass(frozen=True)
class LatentAttention:
    """DeepSeek's multi-latent attention (MLA): queries through a low-rank latent (or one
    projection where ``q_lora_rank`` is None), keys and values from one shared latent of
    ``kv_lora_rank`` plus a rotary key of ``qk_rope_head_dim`` shared by every head; each
    latent RMS-normed."""

    q_lora_rank: int | None
    kv_lora_rank: int
    qk_nope_head_dim: int
    """Each head's query/key dimensions without rotation."""
    qk_rope_head_dim: int
    """Each head's rotated query dimensions, and the shared rotary key's."""
    v_head_dim: int
    DOWN = ("q_a_proj", "kv_a_proj_with_mqa")
    """The latents' down projections: whole on every TP rank (megatron's TE spec and ours, vLLM)."""

    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    def projections(self, heads: int, hidden: int) -> dict[str, tuple[int, int]]:
        """HF projection (``self_attn.<name>.weight``) -> its [out, in] shape."""
        qk, v = self.qk_head_dim, self.v_head_dim
        q = ({"q_proj": (heads * qk, hidden)} if self.q_lora_rank is None else
             {"q_a_proj": (self.q_lora_rank, hidden), "q_b_proj": (heads * qk, self.q_lora_rank)})
        return {**q, "kv_a_proj_with_mqa": (self.kv_lora_rank + self.qk_rope_head_dim, hidden),
                "kv_b_proj": (heads * (self.qk_nope_head_dim + v), self.kv_lora_rank),
                "o_proj": (hidden, heads * v)}


def _latent_attention(cfg: dict[str, Any], source: str) -> LatentAttention:
    if cfg.get("rope_interleave", True) is False:
        raise ValueError(f"{source}: rope_interleave=false is not supported (megatron-core's "
                         f"MLA reads the rotary dimensions as interleaved pairs, as DeepSeek's "
                         f"checkpoints and vLLM do)")
    if cfg.get("attention_bias"):
        raise ValueError(f"{source}: attention_bias=true is not supported with MLA")
    q_lora = cfg.get("q_lora_rank")
    return LatentAttention(q_lora_rank=int(q_lora) if q_lora else None,
                           kv_lora_rank=int(cfg["kv_lora_rank"]),
                           qk_nope_head_dim=int(cfg["qk_nope_head_dim"]),
                           qk_rope_head_dim=int(cfg["qk_rope_head_dim"]),
                           v_head_dim=int(cfg["v_head_dim"]))


@dataclass(frozen=True)
class MoeLayout:
    """Where an MoE family keeps its router and experts in HF checkpoints, and how its config
    counts them."""

    module: str
    """HF module of the router (``.gate``) and experts (``.experts.<e>``) in each layer."""
    gate: str
    up: str
    down: str
    """Names of one expert's gate, up and down projections."""
    read: Callable[[dict[str, Any], str], dict[str, Any]]
    """config.json -> num_experts, moe_ffn_hidden_size, router_pre_softmax and any other MoE
    field of ``ModelSpec`` (ValueError naming the source for what is unsupported)."""


@dataclass(frozen=True)
class Family:
    """One HF architecture: every fact about it that its config.json does not carry. All are
    RMSNorm + SwiGLU + RoPE decoders (``model_spec_from_dict`` refuses other activations); MoE
    families have a mixture of SwiGLU experts in place of the MLP in every layer. A new family of
    that shape is one entry in ``FAMILIES`` (plus a tiny config in ``tiny.py`` for the tests)."""

    qkv_bias: bool = False
    """Biases on the query, key and value projections (else as the config's attention_bias)."""
    qk_norm: bool = False
    """RMSNorm on each head's queries and keys."""
    qk_norm_flag: str | None = None
    """Config key that turns the q/k norm on (GLM-4.5's use_qk_norm); None: ``qk_norm``."""
    rotary_fraction: float = 1.0
    """partial_rotary_factor where the config does not say (transformers' default for it)."""
    sliding_window_flag: str | None = None
    """Config key that must be true for ``sliding_window`` to apply (Qwen's use_sliding_window);
    None: ``sliding_window`` applies whenever it is set."""
    latent_attention: bool = False
    """Multi-latent attention (DeepSeek-V3) in place of grouped-query attention."""
    moe: MoeLayout | None = None


FAMILIES: dict[str, Family] = {
    "LlamaForCausalLM": Family(),
    "MistralForCausalLM": Family(),
    "Qwen2ForCausalLM": Family(qkv_bias=True, sliding_window_flag="use_sliding_window"),
    "Qwen3ForCausalLM": Family(qk_norm=True, sliding_window_flag="use_sliding_window"),
    "Qwen3MoeForCausalLM": Family(qk_norm=True, sliding_window_flag="use_sliding_window",
                                  moe=MoeLayout("mlp", "gate_proj", "up_proj", "down_proj",
                                                _qwen3_moe)),
    "MixtralForCausalLM": Family(moe=MoeLayout("block_sparse_moe", "w1", "w3", "w2", _mixtral_moe)),
    "Glm4MoeForCausalLM": Family(qk_norm_flag="use_qk_norm", rotary_fraction=0.5,
                                 moe=MoeLayout("mlp", "gate_proj", "up_proj", "down_proj",
                                               _glm4_moe)),
    "DeepseekV3ForCausalLM": Family(latent_attention=True,
                                    moe=MoeLayout("mlp", "gate_proj", "up_proj", "down_proj",
                                                  _deepseek_v3_moe)),
}
"""The supported HF architectures."""


@dataclass(frozen=True)
class ModelSpec:
    """The architecture of a supported decoder, read from an HF config."""

    architecture: str
    """HF architecture name, e.g. 'Qwen2ForCausalLM'."""
    num_layers: int
    hidden_size: int
    ffn_hidden_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    """Each head's query and key dimensions (with MLA: nope + rope)."""
    vocab_size: int
    """The tokenizer's vocabulary as the HF checkpoint stores it (unpadded)."""
    tie_embeddings: bool
    qkv_bias: bool
    qk_norm: bool
    norm_eps: float
    rope_theta: float
    rope_scaling: dict[str, Any] | None
    """None (plain RoPE), or ``models.rope.read_rope_scaling``'s dict: llama3, linear or yarn."""
    max_position_embeddings: int
    sliding_window: int | None
    init_std: float
    num_experts: int = 0
    """Experts per MoE layer (0: a dense model)."""
    experts_per_token: int = 0
    """Top-k: experts each token is routed to."""
    moe_ffn_hidden_size: int = 0
    """Hidden size of one expert's SwiGLU."""
    router_pre_softmax: bool = False
    """True: the top-k probabilities are the softmax over all experts (not renormalised); False:
    renormalised over the chosen k (Qwen3-MoE's norm_topk_prob, Mixtral)."""
    shared_ffn_hidden_size: int = 0
    """Hidden size of the shared experts' SwiGLU beside the routed ones (0: none)."""
    router_score: str = "softmax"
    """'softmax', or 'sigmoid' (GLM-4.5, DeepSeek-V3: each expert's score on its own)."""
    router_expert_bias: bool = False
    """A per-expert bias added to the scores to choose the experts only (HF
    ``e_score_correction_bias``; megatron ``router.expert_bias``)."""
    router_scaling: float | None = None
    """Factor on the chosen experts' weights (routed_scaling_factor)."""
    router_groups: tuple[int, int] | None = None
    """Group-limited routing: (groups, groups chosen a token)."""
    dense_layers: int = 0
    """The first layers have a dense MLP (ffn_hidden_size) instead of experts."""
    mtp_layers: int = 0
    """Multi-token-prediction layers in the checkpoint: not loaded, trained or exported."""
    rotary_fraction: float = 1.0
    """Share of each head's dimensions rotated by RoPE (partial_rotary_factor)."""
    mla: LatentAttention | None = None
    """Multi-latent attention's dimensions (DeepSeek-V3); None: grouped-query attention."""
    stored: CheckpointQuantization | None = None
    """How the checkpoint's weights are stored where it ships them quantized (block FP8, MXFP4:
    ``models.released``); the learner holds them dequantized in ``model.dtype``. None: as they
    are."""

    @property
    def family(self) -> Family:
        return FAMILIES[self.architecture]

    @property
    def is_moe(self) -> bool:
        return self.num_experts > 0

    def is_moe_layer(self, layer: int) -> bool:
        """Whether 0-based ``layer`` has experts (the first ``dense_layers`` do not)."""
        return self.is_moe and layer >= self.dense_layers

    @property
    def heads_per_group(self) -> int:
        return self.num_heads // self.num_kv_heads

    def padded_vocab_size(self, tensor_parallel: int, divisible_by: int = 128) -> int:
        """Megatron's padded vocabulary: a multiple of ``divisible_by x tensor_parallel``."""
        multiple = divisible_by * tensor_parallel
        return int(math.ceil(self.vocab_size / multiple) * multiple)

    def num_parameters(self) -> int:
        """Parameters of the unpadded HF model."""
        h, f = self.hidden_size, self.ffn_hidden_size
        attn = self.attention_weights() + self.attention_norms()
        moe = (self.num_experts * 3 * h * self.moe_ffn_hidden_size + self.num_experts * h
               + 3 * h * self.shared_ffn_hidden_size
               + (self.num_experts if self.router_expert_bias else 0))
        dense = self.dense_layers if self.is_moe else self.num_layers
        layers = dense * (attn + 3 * h * f + 2 * h) + (self.num_layers - dense) * (attn + moe + 2 * h)
        embed = self.vocab_size * h * (1 if self.tie_embeddings else 2)
        return layers + embed + h

    @property
    def v_head_dim(self) -> int:
        """Each head's value dimensions (MLA: its own; else head_dim)."""
        return self.mla.v_head_dim if self.mla is not None else self.head_dim

    def attention_tensors(self, tp: int) -> list[tuple[str, float]]:
        """One layer's attention weights as a TP rank of the engine or the learner holds them:
        (name, elements). Multi-latent attention's down projections are whole on every rank
        (vLLM and megatron alike), its per-head projections split over TP."""
        h, hd = self.hidden_size, self.head_dim
        if self.mla is not None:
            return [(name, o * i / (1 if name in LatentAttention.DOWN else tp))
                    for name, (o, i) in self.mla.projections(self.num_heads, h).items()]
        return [("qkv_proj", (self.num_heads + 2 * self.num_kv_heads) * hd * h / tp),
                ("o_proj", h * self.num_heads * hd / tp)]

    def attention_weights(self) -> int:
        """Weights of one layer's attention projections (no norms)."""
        weights = int(sum(n for _, n in self.attention_tensors(1)))
        if self.qkv_bias and self.mla is None:
            weights += self.head_dim * (self.num_heads + 2 * self.num_kv_heads)
        return weights

    def attention_norms(self) -> int:
        """Weights of one layer's q/k norms (MLA: its latents' norms)."""
        if self.mla is not None:
            return (self.mla.q_lora_rank or 0) + self.mla.kv_lora_rank
        return 2 * self.head_dim if self.qk_norm else 0

    def kv_cache_values(self, tp: int) -> float:
        """Values one engine rank at TP ``tp`` caches a token and layer: K and V of its heads,
        or, with MLA, the shared latent and rotary key, whole on every rank (vLLM's MLA)."""
        if self.mla is not None:
            return float(self.mla.kv_lora_rank + self.mla.qk_rope_head_dim)
        return 2 * self.num_kv_heads * self.head_dim / tp

    def check_tensor_parallel(self, tp: int) -> None:
        """Megatron splits whole query groups over TP ranks; refuse layouts it cannot represent."""
        if self.num_heads % tp:
            raise ValueError(f"parallel.tensor: {tp} does not divide the {self.num_heads} attention "
                             f"heads of {self.architecture}")
        if self.num_kv_heads % tp:
            raise ValueError(
                f"parallel.tensor: {tp} is more than or does not divide the {self.num_kv_heads} KV "
                f"heads (query groups) of {self.architecture}; megatron-core would need KV heads "
                f"replicated across TP ranks, which this learner does not do. Use a TP size that "
                f"divides {self.num_kv_heads}.")
        sizes = ([self.moe_ffn_hidden_size, self.shared_ffn_hidden_size] if self.is_moe else [])
        if not self.is_moe or self.dense_layers:
            sizes.append(self.ffn_hidden_size)
        for mlp in sizes:
            if mlp % tp:
                raise ValueError(f"parallel.tensor: {tp} does not divide the MLP size {mlp}")

    def check_expert_parallel(self, ep: int) -> None:
        if ep > 1 and not self.is_moe:
            raise ValueError(f"parallel.expert: {ep} > 1 needs a mixture-of-experts model; "
                             f"{self.architecture} is dense")
        if self.is_moe and self.num_experts % ep:
            raise ValueError(f"parallel.expert: {ep} does not divide the {self.num_experts} experts "
                             f"of {self.architecture}")


def read_model_spec(hf_dir: str | Path) -> ModelSpec:
    """Read ``config.json`` from an HF checkpoint directory; clear errors for what is unsupported."""
    path = Path(hf_dir)
    if path.is_dir() or not path.suffix == ".json":
        path = path / "config.json"
    if not path.is_file():
        raise ValueError(f"model.path: no config.json in {hf_dir}")
    return model_spec_from_dict(json.loads(path.read_text()), source=str(path))


def model_spec_from_dict(cfg: dict[str, Any], source: str = "config") -> ModelSpec:
    archs = cfg.get("architectures") or []
    arch = archs[0] if archs else "(none)"
    if arch not in FAMILIES:
        raise ValueError(f"{source}: architecture {arch!r} is not supported; supported: "
                         f"{', '.join(FAMILIES)}")
    family = FAMILIES[arch]
    if cfg.get("mlp_bias"):
        raise ValueError(f"{source}: mlp_bias=true is not supported")
    act = cfg.get("hidden_act", "silu")
    if act != "silu":
        raise ValueError(f"{source}: hidden_act {act!r} is not supported (SwiGLU needs 'silu')")
    heads = int(cfg["num_attention_heads"])
    hidden = int(cfg["hidden_size"])
    sliding = cfg.get("sliding_window")
    if family.sliding_window_flag and not cfg.get(family.sliding_window_flag, False):
        sliding = None
    rope_theta = cfg.get("rope_theta")
    rope_params = cfg.get("rope_parameters")  # transformers 5 keeps theta and scaling here
    if isinstance(rope_params, dict):
        rope_theta = rope_params.get("rope_theta", rope_theta)
    rope_scaling = read_rope_scaling(cfg, source)
    moe: dict[str, Any] = {}
    if family.moe is not None:
        moe = family.moe.read(cfg, source)
        moe["experts_per_token"] = int(cfg["num_experts_per_tok"])
    mla = _latent_attention(cfg, source) if family.latent_attention else None
    stored = read_checkpoint_quantization(cfg, source)
    rotary = cfg.get("partial_rotary_factor")
    if isinstance(rope_params, dict):  # transformers 5 may keep it with the rope parameters
        rotary = rope_params.get("partial_rotary_factor", rotary)
    return ModelSpec(
        architecture=arch,
        num_layers=int(cfg["num_hidden_layers"]),
        hidden_size=hidden,
        ffn_hidden_size=int(cfg["intermediate_size"]),
        num_heads=heads,
        num_kv_heads=int(cfg.get("num_key_value_heads") or heads),
        head_dim=mla.qk_head_dim if mla else int(cfg.get("head_dim") or hidden // heads),
        vocab_size=int(cfg["vocab_size"]),
        tie_embeddings=bool(cfg.get("tie_word_embeddings", False)),
        qkv_bias=family.qkv_bias or bool(cfg.get("attention_bias")),
        qk_norm=bool(cfg.get(family.qk_norm_flag)) if family.qk_norm_flag else family.qk_norm,
        norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
        rope_theta=float(rope_theta or 10000.0),
        rope_scaling=rope_scaling,
        max_position_embeddings=int(cfg.get("max_position_embeddings", 4096)),
        sliding_window=int(sliding) if sliding else None,
        init_std=float(cfg.get("initializer_range", 0.02)),
        rotary_fraction=float(rotary or family.rotary_fraction),
        mla=mla,
        stored=stored,
        **moe,
    )
