"""The HF <-> Megatron layout table: shards and back, per TP size, against naive constructions."""

import pytest
import torch

from mugrpo_megatron.learner.export import _buckets
from mugrpo_megatron.models.hf_config import model_spec_from_dict
from mugrpo_megatron.models.mapping import hf_from_shards, map_param, shard_from_hf

CFG = {"architectures": ["Qwen2ForCausalLM"], "num_hidden_layers": 2, "hidden_size": 32,
       "intermediate_size": 48, "num_attention_heads": 8, "num_key_value_heads": 4, "head_dim": 4,
       "vocab_size": 100}


def hf_tensors(spec):
    g = torch.Generator().manual_seed(0)
    h, hd = spec.hidden_size, spec.head_dim
    shapes = {
        "model.embed_tokens.weight": (spec.vocab_size, h),
        "lm_head.weight": (spec.vocab_size, h),
        "model.layers.1.self_attn.q_proj.weight": (spec.num_heads * hd, h),
        "model.layers.1.self_attn.k_proj.weight": (spec.num_kv_heads * hd, h),
        "model.layers.1.self_attn.v_proj.weight": (spec.num_kv_heads * hd, h),
        "model.layers.1.self_attn.q_proj.bias": (spec.num_heads * hd,),
        "model.layers.1.self_attn.k_proj.bias": (spec.num_kv_heads * hd,),
        "model.layers.1.self_attn.v_proj.bias": (spec.num_kv_heads * hd,),
        "model.layers.1.self_attn.o_proj.weight": (h, spec.num_heads * hd),
        "model.layers.1.mlp.gate_proj.weight": (spec.ffn_hidden_size, h),
        "model.layers.1.mlp.up_proj.weight": (spec.ffn_hidden_size, h),
        "model.layers.1.mlp.down_proj.weight": (h, spec.ffn_hidden_size),
        "model.layers.1.input_layernorm.weight": (h,),
    }
    return {k: torch.randn(s, generator=g) for k, s in shapes.items()}


MEGATRON = ["embedding.word_embeddings.weight", "output_layer.weight",
            "decoder.layers.0.self_attention.linear_qkv.weight",
            "decoder.layers.0.self_attention.linear_qkv.bias",
            "decoder.layers.0.self_attention.linear_proj.weight",
            "decoder.layers.0.mlp.linear_fc1.weight", "decoder.layers.0.mlp.linear_fc2.weight",
            "decoder.layers.0.input_layernorm.weight"]


@pytest.mark.parametrize("tp", [1, 2, 4])
def test_shards_round_trip_bit_exact(tp):
    spec = model_spec_from_dict(CFG)
    hf = hf_tensors(spec)
    read = lambda name, index: hf[name] if index is None else hf[name][index]  # noqa: E731
    padded = spec.padded_vocab_size(tp)
    for name in MEGATRON:
        pm = map_param(name, spec, global_layer=1)
        shards = [shard_from_hf(pm, read, spec, r, tp, padded) for r in range(tp)]
        for hf_name, t in hf_from_shards(pm, shards, spec):
            assert torch.equal(t, hf[hf_name]), (name, hf_name)


def test_qkv_layout_is_grouped_per_query_group():
    spec = model_spec_from_dict(CFG)  # 8 heads, 4 groups: 2 q heads per group
    hf = hf_tensors(spec)
    read = lambda name, index: hf[name] if index is None else hf[name][index]  # noqa: E731
    pm = map_param("decoder.layers.0.self_attention.linear_qkv.weight", spec, 1)
    shard = shard_from_hf(pm, read, spec, 1, 2, 128)  # rank 1 of TP2: groups 2 and 3
    hd, q, k, v = 4, *(hf[f"model.layers.1.self_attn.{x}_proj.weight"] for x in "qkv")
    expected = []
    for g in (2, 3):  # naive: per group, its 2 query heads, then its k head, then its v head
        expected += [q[(2 * g) * hd:(2 * g + 2) * hd], k[g * hd:(g + 1) * hd], v[g * hd:(g + 1) * hd]]
    assert torch.equal(shard, torch.cat(expected))


def test_vocab_padding_and_tied_output():
    spec = model_spec_from_dict({**CFG, "tie_word_embeddings": True})
    assert spec.padded_vocab_size(1) == 128 and spec.padded_vocab_size(2) == 256
    assert map_param("output_layer.weight", spec).hf_names == ("model.embed_tokens.weight",)
    hf = hf_tensors(spec)
    read = lambda name, index: hf[name] if index is None else hf[name][index]  # noqa: E731
    pm = map_param("embedding.word_embeddings.weight", spec)
    last = shard_from_hf(pm, read, spec, 1, 2, 256)  # rows 128..255: all padding
    assert last.shape == (128, 32) and not last.any()


def test_unsupported_and_layout_errors():
    with pytest.raises(ValueError, match="architecture 'GPT2LMHeadModel' is not supported"):
        model_spec_from_dict({**CFG, "architectures": ["GPT2LMHeadModel"]})
    spec = model_spec_from_dict(CFG)
    with pytest.raises(ValueError, match=r"parallel\.tensor: 8 is more than or does not divide the 4 KV"):
        spec.check_tensor_parallel(8)
    spec.check_tensor_parallel(4)
    with pytest.raises(ValueError, match="no HF mapping"):
        map_param("decoder.layers.0.mlp.router.weight", spec, 0)
    with pytest.raises(ValueError, match="rope_scaling type 'longrope' is not supported"):
        model_spec_from_dict({**CFG, "rope_scaling": {"rope_type": "longrope", "factor": 4.0}})


def test_yarn_is_read_as_transformers_and_vllm_read_it():
    """Qwen3's long-context YaRN block, as its model card has users add it, comes back complete
    with transformers' defaults; the attention factor as HF and vLLM compute it; what neither
    reads, or what the learner cannot express, is refused by name."""
    import math

    from mugrpo_megatron.models.rope import yarn_attention_factor

    qwen = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32768}
    spec = model_spec_from_dict({**CFG, "max_position_embeddings": 131072, "rope_scaling": qwen})
    assert spec.rope_scaling == {
        "rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32768,
        "beta_fast": 32.0, "beta_slow": 1.0, "mscale": None, "mscale_all_dim": None,
        "truncate": True, "attention_factor": pytest.approx(0.1 * math.log(4.0) + 1)}
    # transformers 5's spelling; without original_max_position_embeddings, the config's maximum
    spec = model_spec_from_dict({**CFG, "max_position_embeddings": 4096, "rope_parameters": {
        "rope_type": "yarn", "factor": 2.0, "rope_theta": 5e5, "truncate": False}})
    assert spec.rope_theta == 5e5 and spec.rope_scaling["original_max_position_embeddings"] == 4096
    assert spec.rope_scaling["truncate"] is False
    # DeepSeek's mscale pair; a given attention_factor wins (transformers and vLLM alike)
    assert yarn_attention_factor(40.0, 1.0, 1.0) == 1.0
    assert yarn_attention_factor(40.0, 0.707, None) == pytest.approx(0.1 * math.log(40) + 1)
    spec = model_spec_from_dict({**CFG, "rope_scaling": {**qwen, "attention_factor": 1.5}})
    assert spec.rope_scaling["attention_factor"] == 1.5
    for bad, match in (({**qwen, "low_freq_factor": 1.0}, r"rope_scaling\.low_freq_factor is not a YaRN"),
                       ({**qwen, "factor": None}, r"rope_scaling\.factor is required"),
                       ({**qwen, "partial_rotary_factor": 0.5}, "partial_rotary_factor")):
        with pytest.raises(ValueError, match=match):
            model_spec_from_dict({**CFG, "rope_scaling": bad}, source="x/config.json")


def test_buckets_bound_size_and_big_tensor_alone():
    meta = [("a", (10,), "float32"), ("b", (10,), "float32"), ("big", (100,), "float32"),
            ("c", (5,), "float32"), ("d", (5,), "bfloat16")]
    buckets = [[name for name, _, _ in b] for b in _buckets(meta, bucket_bytes=80)]
    assert buckets == [["a", "b"], ["big"], ["c"], ["d"]]


def test_every_architecture_has_a_tiny_family():
    """Adding a family is one models.FAMILIES entry and one tiny.TINY_FAMILIES entry; the tests
    take their family list from the second, so an architecture without one would go untested."""
    from mugrpo_megatron.models import FAMILIES
    from mugrpo_megatron.models.tiny import TINY_FAMILIES

    tiny = {t["architectures"][0] for t in TINY_FAMILIES.values()}
    assert tiny == set(FAMILIES), set(FAMILIES) ^ tiny


def test_grouped_gemm_experts_map_as_sequential_ones():
    """TEGroupedMLP (grouped GEMM, the GPU default where TE is) names a layer's local experts
    ``mlp.experts.linear_fc1.weight{i}`` / ``linear_fc2.weight{i}``, TE GroupedLinear's one
    ``weight{i}`` a GEMM of [out / expert TP, in] (TE 2.9-2.11 ``module/grouped_linear.py``);
    megatron's SequentialMLP ``mlp.experts.local_experts.{i}.linear_fc1.weight``. At expert TP
    2 and EP rank 1 of 2 (experts 2, 3 of 4) both map to the same HF experts, and each shard read
    has the shape TE's weight{i} has; megatron-core's source still builds TEGroupedMLP that way
    (the test breaks where it moves)."""
    import inspect

    from megatron.core.transformer.moe import experts

    spec = model_spec_from_dict({
        "architectures": ["Glm4MoeForCausalLM"], "num_hidden_layers": 2, "hidden_size": 32,
        "intermediate_size": 48, "num_attention_heads": 4, "num_key_value_heads": 2,
        "head_dim": 8, "vocab_size": 100, "n_routed_experts": 4, "num_experts_per_tok": 2,
        "moe_intermediate_size": 16, "n_shared_experts": 1, "first_k_dense_replace": 1,
        "num_nextn_predict_layers": 1})
    # GLM-4.5's config as read: the MTP layer counted (not loaded), RoPE on half of each head
    # by transformers' default, one dense layer, a shared expert of the routed size
    assert (spec.mtp_layers, spec.rotary_fraction, spec.dense_layers) == (1, 0.5, 1)
    assert spec.shared_ffn_hidden_size == 16 and not spec.is_moe_layer(0) and spec.is_moe_layer(1)
    g = torch.Generator().manual_seed(1)
    hf = {}
    for e in range(4):
        base = f"model.layers.1.mlp.experts.{e}"
        hf[f"{base}.gate_proj.weight"] = torch.randn(16, 32, generator=g)
        hf[f"{base}.up_proj.weight"] = torch.randn(16, 32, generator=g)
        hf[f"{base}.down_proj.weight"] = torch.randn(32, 16, generator=g)
    read = lambda name, index: hf[name] if index is None else hf[name][index]  # noqa: E731
    te_shapes = {"linear_fc1": (2 * 16 // 2, 32), "linear_fc2": (32, 16 // 2)}  # ETP 2
    for i in range(2):
        for fc in ("linear_fc1", "linear_fc2"):
            grouped = map_param(f"decoder.layers.0.mlp.experts.{fc}.weight{i}", spec, 1, 2)
            sequential = map_param(f"decoder.layers.0.mlp.experts.local_experts.{i}.{fc}.weight",
                                   spec, 1, 2)
            assert grouped == sequential and grouped.expert == 2 + i, (grouped, sequential)
            for etp_rank in range(2):
                shard = shard_from_hf(grouped, read, spec, etp_rank, 2, 128)
                assert tuple(shard.shape) == te_shapes[fc], (fc, shard.shape)
            back = hf_from_shards(grouped, [shard_from_hf(grouped, read, spec, r, 2, 128)
                                            for r in range(2)], spec)
            assert all(torch.equal(t, hf[n]) for n, t in back)
    source = inspect.getsource(experts.TEGroupedMLP.__init__)
    assert "self.linear_fc1 = build_module(" in source and "self.linear_fc2 = build_module(" in source
    assert "ffn_hidden_size *= 2" in source  # fc1 holds [gate; up] of each expert, as sequential's
    assert "interchangable with SequentialMLP" in inspect.getsource(
        experts.TEGroupedMLP.sharded_state_dict)  # checkpoints move between the two
