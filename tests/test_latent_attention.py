"""DeepSeek-V3's multi-latent attention (MLA): its config as read, its weights between HF and
megatron-core's MLA per TP rank, its YaRN numbers against transformers', and the layouts refused.
The learner itself (against transformers, every layout against TP1), the HF round trip and the
gap with vLLM: tests/test_learner.py, test_convert.py, test_engine_contract.py (family
deepseek_v3)."""

import math

import pytest
import torch

from mugrpo_megatron.config import ModelConfig, ParallelConfig
from mugrpo_megatron.layout import check_model
from mugrpo_megatron.models.hf_config import model_spec_from_dict
from mugrpo_megatron.models.mapping import hf_from_shards, map_param, shard_from_hf
from mugrpo_megatron.models.rope import latent_yarn_mscales, read_rope_scaling

V3 = {  # DeepSeek-V3's config.json (the hub's), as far as the learner reads it
    "architectures": ["DeepseekV3ForCausalLM"], "hidden_size": 7168, "intermediate_size": 18432,
    "moe_intermediate_size": 2048, "num_hidden_layers": 61, "num_attention_heads": 128,
    "num_key_value_heads": 128, "n_shared_experts": 1, "n_routed_experts": 256,
    "routed_scaling_factor": 2.5, "kv_lora_rank": 512, "q_lora_rank": 1536,
    "qk_rope_head_dim": 64, "v_head_dim": 128, "qk_nope_head_dim": 128, "topk_method": "noaux_tc",
    "n_group": 8, "topk_group": 4, "num_experts_per_tok": 8, "first_k_dense_replace": 3,
    "norm_topk_prob": True, "scoring_func": "sigmoid", "vocab_size": 129280,
    "max_position_embeddings": 163840, "num_nextn_predict_layers": 1, "rope_theta": 10000,
    "rope_scaling": {"beta_fast": 32, "beta_slow": 1, "factor": 40, "mscale": 1.0,
                     "mscale_all_dim": 1.0, "original_max_position_embeddings": 4096,
                     "type": "yarn"}, "tie_word_embeddings": False, "hidden_act": "silu"}


def test_deepseek_v3_as_read():
    spec = model_spec_from_dict(V3)
    mla = spec.mla
    assert (mla.q_lora_rank, mla.kv_lora_rank, mla.qk_head_dim, mla.v_head_dim) == (1536, 512, 192, 128)
    assert (spec.head_dim, spec.v_head_dim) == (192, 128)
    assert (spec.router_score, spec.router_expert_bias, spec.router_groups) == ("sigmoid", True, (8, 4))
    assert (spec.dense_layers, spec.mtp_layers, spec.shared_ffn_hidden_size) == (3, 1, 2048)
    # DeepSeek's count of the main model: 671B (685B on the hub with the 14B MTP module)
    assert spec.num_parameters() / 1e9 == pytest.approx(671, abs=1)
    # the engine caches the 512 + 64 latent a token and layer on every TP rank
    assert spec.kv_cache_values(8) == 576 and spec.kv_cache_values(1) == 576


@pytest.mark.parametrize("change, match", [
    ({"scoring_func": "softmax"}, "scoring_func"), ({"topk_method": "greedy"}, "topk_method"),
    ({"rope_interleave": False}, "rope_interleave"), ({"attention_bias": True}, "attention_bias"),
])
def test_what_megatron_or_vllm_would_read_otherwise_is_refused(change, match):
    with pytest.raises(ValueError, match=match):
        model_spec_from_dict({**V3, **change})


def test_layouts_megatron_gets_wrong_are_refused():
    """megatron-core (0.16.1-0.19.2) sums the shared rotary key's gradient over TP only through
    sequence parallel's gather (tests/test_learner.py's deepseek_v3 tp2_sp layout fails without
    it); MLA under context parallelism is not wired here."""
    spec = model_spec_from_dict(V3)
    with pytest.raises(ValueError, match="sequence_parallel"):
        check_model(spec, ModelConfig(path="x"), ParallelConfig(tensor=8, expert=8))
    check_model(spec, ModelConfig(path="x"),
                ParallelConfig(tensor=8, expert=8, sequence_parallel=True))
    with pytest.raises(ValueError, match="parallel.context"):
        check_model(spec, ModelConfig(path="x"), ParallelConfig(context=2))


@pytest.mark.parametrize("q_lora", [16, None])
def test_latent_weights_per_tp_rank_and_back(q_lora):
    """Each megatron MLA parameter (the local spec's names and TE's fused latent norms) reads its
    rank's part of the HF tensor: the down projections and norms whole, the per-head projections
    by heads (rank r: heads [r H/tp, (r+1) H/tp), each head's rows together), o_proj by its
    heads' value columns; the ranks' parts give the HF tensors back bit for bit."""
    cfg = {**V3, "hidden_size": 32, "num_attention_heads": 4, "num_key_value_heads": 4,
           "q_lora_rank": q_lora, "kv_lora_rank": 24, "qk_rope_head_dim": 8,
           "qk_nope_head_dim": 6, "v_head_dim": 5, "num_hidden_layers": 2}
    spec = model_spec_from_dict(cfg)
    shapes = spec.mla.projections(4, 32)
    g = torch.Generator().manual_seed(0)
    hf = {f"model.layers.1.self_attn.{n}.weight": torch.randn(s, generator=g)
          for n, s in shapes.items()}
    hf["model.layers.1.self_attn.kv_a_layernorm.weight"] = torch.randn(24, generator=g)
    if q_lora:
        hf["model.layers.1.self_attn.q_a_layernorm.weight"] = torch.randn(q_lora, generator=g)
    read = lambda name, index: hf[name] if index is None else hf[name][index]  # noqa: E731
    names = {"linear_kv_down_proj": ("kv_a_proj_with_mqa", None),
             "linear_kv_up_proj": ("kv_b_proj", 0), "linear_proj": ("o_proj", 1),
             "kv_layernorm": ("kv_a_layernorm", None),
             "linear_kv_up_proj.layer_norm_weight": ("kv_a_layernorm", None)}
    names |= {"linear_q_down_proj": ("q_a_proj", None), "linear_q_up_proj": ("q_b_proj", 0),
              "q_layernorm": ("q_a_layernorm", None),
              "linear_q_up_proj.layer_norm_weight": ("q_a_layernorm", None)} if q_lora \
        else {"linear_q_proj": ("q_proj", 0)}
    for megatron, (hf_name, split) in names.items():
        suffix = megatron if megatron.endswith("layer_norm_weight") else f"{megatron}.weight"
        pm = map_param(f"decoder.layers.0.self_attention.{suffix}", spec, 1)
        full = hf[f"model.layers.1.self_attn.{hf_name}.weight"]
        assert pm.hf_names == (f"model.layers.1.self_attn.{hf_name}.weight",)
        shards = [shard_from_hf(pm, read, spec, r, 2, 128) for r in range(2)]
        for r, shard in enumerate(shards):
            naive = full if split is None else full.chunk(2, dim=split)[r]
            assert torch.equal(shard, naive), (megatron, r)
        if split == 0:  # whole heads: rank 1's first row is head 2's first
            rows = full.shape[0] // 4
            assert torch.equal(shards[1][0], full[2 * rows])
        back = hf_from_shards(pm, shards if split is not None else shards[:1], spec)
        assert [(n, torch.equal(t, full)) for n, t in back] == [(pm.hf_names[0], True)]


@pytest.mark.parametrize("scaling", [
    {"factor": 40, "mscale": 1.0, "mscale_all_dim": 1.0},  # DeepSeek-V3
    {"factor": 40, "mscale": 0.707, "mscale_all_dim": 0.707},  # DeepSeek-V2
    {"factor": 4, "mscale": 1.0},  # mscale alone: transformers ignores it
    {"factor": 4, "mscale_all_dim": 0.8},
    {"factor": 8},
    {"factor": 8, "mscale": 1.0, "mscale_all_dim": 0.5, "attention_factor": 1.3},
])
def test_latent_yarn_gives_transformers_numbers(scaling):
    """megatron's MLA multiplies cos and sin by mscale(f, mscale) / mscale(f, mscale_all_dim)
    and the softmax scale by mscale(f, mscale_all_dim)^2 (its ``_yarn_get_mscale``);
    transformers' DeepSeek-V3 by its YaRN attention factor and ``yarn_apply_mscale``. The pair
    ``latent_yarn_mscales`` gives megatron makes both the same as transformers'."""
    from megatron.core.models.common.embeddings.yarn_rotary_pos_embedding import _yarn_get_mscale
    from transformers import DeepseekV3Config
    from transformers.modeling_rope_utils import _compute_yarn_parameters
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import yarn_apply_mscale

    rope = {"rope_type": "yarn", "original_max_position_embeddings": 4096, **scaling}
    hf_config = DeepseekV3Config(rope_scaling=dict(rope), max_position_embeddings=4096 * 40,
                                 qk_rope_head_dim=64)
    _, hf_attention = _compute_yarn_parameters(hf_config)
    hf_softmax = yarn_apply_mscale(hf_config.rope_parameters, 1.0)
    ours = read_rope_scaling({"rope_scaling": rope, "max_position_embeddings": 4096 * 40}, "t")
    mscale, all_dim = latent_yarn_mscales(ours)
    f = float(scaling["factor"])
    assert _yarn_get_mscale(f, mscale) / _yarn_get_mscale(f, all_dim) == pytest.approx(
        hf_attention, rel=1e-12)
    assert _yarn_get_mscale(f, all_dim) ** 2 == pytest.approx(hf_softmax, rel=1e-12)
    if scaling.get("mscale") and scaling.get("mscale_all_dim") and "attention_factor" not in scaling:
        assert mscale == pytest.approx(scaling["mscale"]) and all_dim == scaling["mscale_all_dim"]
    assert not math.isnan(mscale)
