"""Block FP8 rollout weights (``rollout.quantization: fp8``, issue 51 item 3): the quantizer
against a block-by-block reference, the names and tensors the engine is sent, the layouts vLLM
fuses and shards, vLLM's own block-shape rules and parameters, and the dry run's FP8 figures."""

import importlib.util
import json
import subprocess
import sys

import pytest
import torch
from helpers import ROOT

from mugrpo_megatron.config.loader import load_config
from mugrpo_megatron.engines.fp8_weights import (
    BLOCK,
    FP8_DTYPE,
    FP8_MAX,
    SCALE_SUFFIX,
    checkpoint_tensors,
    dequantize_blocks,
    is_quantized,
    quantization_config,
    quantize_blocks,
    quantize_stream,
)
from mugrpo_megatron.layout.shapes import engine_fp8_problem
from mugrpo_megatron.models.hf_config import read_model_spec
from mugrpo_megatron.models.tiny import make_tiny_checkpoint

MODELS = ROOT / "configs" / "models"


def reference_quantize(w: torch.Tensor, block=BLOCK):
    """Block by block, written out: the scale is the block's largest magnitude over 448 (1 for
    an all-zero block), each element w / scale rounded to e4m3."""
    bm, bn = block
    m, n = w.shape
    rows, cols = -(-m // bm), -(-n // bn)
    q = torch.empty(m, n, dtype=FP8_DTYPE)
    s = torch.empty(rows, cols)
    for i in range(rows):
        for j in range(cols):
            b = w[i * bm:(i + 1) * bm, j * bn:(j + 1) * bn].float()
            amax = b.abs().max().item()
            scale = amax / 448.0 if amax > 0 else 1.0
            s[i, j] = scale
            q[i * bm:(i + 1) * bm, j * bn:(j + 1) * bn] = (b / torch.tensor(scale)).to(FP8_DTYPE)
    return q, s


@pytest.mark.parametrize("shape, dtype, rows_at_once", [
    ((300, 260), torch.float32, 1024), ((300, 260), torch.bfloat16, 128),
    ((256, 384), torch.bfloat16, 100), ((1, 5), torch.float32, 1024)])
def test_quantizer_matches_the_blockwise_reference(shape, dtype, rows_at_once):
    g = torch.Generator().manual_seed(0)
    w = (torch.randn(*shape, generator=g) * torch.logspace(-3, 0, shape[1])).to(dtype)
    if shape[0] >= 128 and shape[1] >= 128:
        w[:128, :128] = 0  # an all-zero block: a sharded stream's zeros outside a rank's shard
    q, s = quantize_blocks(w, rows_at_once=rows_at_once)
    q_ref, s_ref = reference_quantize(w)
    assert q.dtype == FP8_DTYPE and s.dtype == torch.float32
    assert s.shape == (-(-shape[0] // 128), -(-shape[1] // 128))
    assert torch.allclose(s, s_ref, rtol=1e-6, atol=0)
    assert torch.equal(q.view(torch.uint8), q_ref.view(torch.uint8))
    # what the engine computes with: within e4m3's rounding of each element (3 mantissa bits:
    # half a step is 2^-4 of the value in the normal range, half of 2^-9 x scale below it)
    deq = dequantize_blocks(q, s)
    scale = s.repeat_interleave(128, 0).repeat_interleave(128, 1)[:shape[0], :shape[1]]
    bound = torch.maximum(w.float().abs() * 2**-4, scale * 2**-10)
    assert ((deq - w.float()).abs() <= bound * (1 + 1e-6)).all()
    # each block's largest magnitude maps to +-448 exactly
    assert (q.float().abs().amax() == FP8_MAX) or w.abs().max() == 0


@pytest.mark.parametrize("ue8m0", [False, True])
@pytest.mark.parametrize("dim, rank", [(0, 0), (0, 1), (1, 1)])
def test_a_shard_is_quantized_alone_as_its_slice_of_the_padded_whole(dim, rank, ue8m0):
    """A sync's ``Shard`` (an engine rank's slice, issue 63) quantized on its own, then padded:
    the e4m3 values equal the padded tensor's quantization everywhere (zeros outside), the
    scales in the slice's blocks (what vLLM narrows to) too, 1 outside; its count is the
    slice's bytes, not the padding's. A slice that is not whole blocks is refused."""
    from mugrpo_megatron.types import Shard

    torch.manual_seed(dim * 2 + rank)
    shape = (512, 384) if dim == 0 else (256, 512)  # the last dimension 384: 3 blocks
    w = torch.randn(*shape, dtype=torch.bfloat16) * 0.05
    n = shape[dim] // 2
    region = tuple((rank * n, (rank + 1) * n) if d == dim else (0, shape[d]) for d in range(2))
    part = w[tuple(slice(a, b) for a, b in region)].clone()
    padded = torch.zeros_like(w)
    padded[tuple(slice(a, b) for a, b in region)] = part
    name = "model.layers.0.mlp.up_proj.weight"
    (_, q_ref), (_, s_ref) = list(quantize_stream([(name, padded)], ue8m0=ue8m0))
    shard = Shard(part, shape, region)
    assert shard.nbytes == part.numel() * 2 == padded.numel()  # half of the whole's bf16 bytes
    (got_name, q), (scale_name, s) = list(quantize_stream([(name, shard)], ue8m0=ue8m0))
    assert (got_name, scale_name) == (name, name.removesuffix("weight") + SCALE_SUFFIX)
    assert q.shape == shape and torch.equal(q.view(torch.uint8), q_ref.view(torch.uint8))
    blocks = tuple(slice(a // 128, -(-b // 128)) for a, b in region)
    assert s.shape == s_ref.shape and torch.equal(s[blocks], s_ref[blocks])
    outside = torch.ones_like(s, dtype=torch.bool)
    outside[blocks] = False
    assert outside.any() and (s[outside] == 1).all()
    # a tensor that is not quantized comes padded as it is
    norm = Shard(torch.ones(3), (6,), ((3, 6),))
    assert torch.equal(list(quantize_stream([("model.layers.0.bias", norm)]))[0][1],
                       torch.tensor([0.0, 0, 0, 1, 1, 1]))
    with pytest.raises(ValueError, match="not whole blocks of 128"):
        list(quantize_stream([(name, Shard(part[:, :64], shape, ((0, 256), (64, 128))))]))


def test_stream_quantizes_the_linear_weights_of_the_layers_only(tmp_path):
    """Every 2-D weight of the decoder layers except norms and the router goes out as e4m3 and
    its ``weight_scale_inv`` right after; the embedding, output layer, norms, router and its
    correction bias go out as they came (DeepSeek-V3's MLA and shared experts included)."""
    from mugrpo_megatron.engines.fp8_weights import routers
    from mugrpo_megatron.models.hf_config import read_model_spec

    hf = make_tiny_checkpoint(tmp_path / "dsv3", "deepseek_v3", seed=1)
    kept = routers(read_model_spec(hf))  # as the engine gives them
    tensors = dict(checkpoint_tensors(hf))
    sent = list(quantize_stream(tensors.items(), kept=kept))
    names = [n for n, _ in sent]
    quantized = {n for n, t in tensors.items() if is_quantized(n, t, kept)}
    assert quantized and len(sent) == len(tensors) + len(quantized)
    for name in tensors:
        assert name in names
    for i, (name, t) in enumerate(sent):
        if name in quantized:
            assert t.dtype == FP8_DTYPE
            scale_name, scale = sent[i + 1]
            assert scale_name == name.removesuffix("weight") + SCALE_SUFFIX
            assert scale.shape == (-(-t.shape[0] // 128), -(-t.shape[1] // 128))
        elif not name.endswith(SCALE_SUFFIX):
            assert t is tensors[name]
    kept = set(tensors) - quantized
    for part in ("embed_tokens", "lm_head", "input_layernorm", "kv_a_layernorm", "mlp.gate.weight",
                 "e_score_correction_bias"):
        assert any(part in n for n in kept), part
    for part in ("q_a_proj", "q_b_proj", "kv_a_proj_with_mqa", "kv_b_proj", "o_proj",
                 "experts.0.gate_proj", "shared_experts.down_proj", "mlp.down_proj"):
        assert any(part in n for n in quantized), part


def test_fused_and_sharded_layouts_get_the_scales_of_the_whole():
    """vLLM fuses q/k/v (gate/up, an MoE layer's experts) into one parameter and each rank
    keeps its TP slice; quantizing each HF tensor, or a sharded stream's tensor that holds only
    a rank's shard (zeros elsewhere), gives exactly the e4m3 values and scales of the fused or
    whole tensor where the parts are whole blocks, which vLLM requires of them."""
    g = torch.Generator().manual_seed(1)
    q_w, k_w, v_w = (torch.randn(r, 384, generator=g) for r in (512, 128, 128))
    fused_q, fused_s = quantize_blocks(torch.cat([q_w, k_w, v_w]))
    parts = [quantize_blocks(t) for t in (q_w, k_w, v_w)]
    assert torch.equal(torch.cat([p[0] for p in parts]).view(torch.uint8), fused_q.view(torch.uint8))
    assert torch.equal(torch.cat([p[1] for p in parts]), fused_s)
    whole = torch.randn(512, 768, generator=g)
    full_q, full_s = quantize_blocks(whole)
    for dim in (0, 1):  # column-parallel rows, row-parallel columns; rank 1 of 2
        own = [slice(None), slice(None)]
        own[dim] = slice(whole.shape[dim] // 2, None)
        sharded = torch.zeros_like(whole)
        sharded[tuple(own)] = whole[tuple(own)]
        q, s = quantize_blocks(sharded)
        assert torch.equal(q[tuple(own)].view(torch.uint8), full_q[tuple(own)].view(torch.uint8))
        blocks = [slice(None), slice(None)]
        blocks[dim] = slice(whole.shape[dim] // 256, None)
        assert torch.equal(s[tuple(blocks)], full_s[tuple(blocks)])


VLLM_SIDE = r"""
import json, sys, torch
from unittest import mock
from vllm.distributed import init_distributed_environment, initialize_model_parallel
from vllm.config import ModelConfig, VllmConfig, set_current_vllm_config
import vllm.model_executor.layers.quantization.fp8 as fp8
from vllm.model_executor.layers.quantization.utils.fp8_utils import (
    validate_fp8_block_shape, validate_fp8_block_shape_moe)
from mugrpo_megatron.engines.fp8_weights import quantization_config
from mugrpo_megatron.models.hf_config import read_model_spec

hf, models = sys.argv[1], json.loads(sys.argv[2])
cfg = fp8.Fp8Config.from_config(quantization_config())
out = {"config": [cfg.is_checkpoint_fp8_serialized, cfg.weight_block_size, cfg.activation_scheme]}
with set_current_vllm_config(VllmConfig(model_config=ModelConfig(model=hf, dtype="bfloat16"))), \
        mock.patch.object(fp8, "init_fp8_linear_kernel", lambda **kw: None):  # no CPU FP8 GEMM here
    init_distributed_environment(1, 0, "tcp://127.0.0.1:" + sys.argv[3], 0, "gloo")
    initialize_model_parallel(1)
    layer = torch.nn.Module()
    fp8.Fp8LinearMethod(cfg).create_weights(
        layer, input_size_per_partition=384, output_partition_sizes=[512, 128, 128],
        input_size=384, output_size=768, params_dtype=torch.bfloat16, weight_loader=None)
    out["params"] = {n: [str(p.dtype), list(p.shape)] for n, p in layer.named_parameters()}

def refused(check, *args):
    try:
        check(*args)
        return False
    except ValueError:
        return True

class Layer:  # vLLM reads the TP size from the layer where it has one
    def __init__(self, tp): self.tp_size = tp

verdicts = {}
for name, path in models.items():
    s = read_model_spec(path)
    for tp in (1, 2, 4, 8, 16, 32):
        checks = []
        if s.mla is None:
            kv = max(1, s.num_kv_heads // tp) * s.head_dim
            qkv = [s.num_heads * s.head_dim // tp, kv, kv]
            checks.append((validate_fp8_block_shape, Layer(tp), s.hidden_size,
                           sum(qkv) * tp, s.hidden_size, qkv, [128, 128]))
            checks.append((validate_fp8_block_shape, Layer(tp), s.num_heads * s.head_dim,
                           s.hidden_size * tp, s.num_heads * s.head_dim // tp, [s.hidden_size],
                           [128, 128]))
        else:
            for proj, (o, i) in s.mla.projections(s.num_heads, s.hidden_size).items():
                if proj in ("q_b_proj", "kv_b_proj"):
                    checks.append((validate_fp8_block_shape, Layer(tp), i, o, i, [o // tp],
                                   [128, 128]))
                elif proj == "o_proj":
                    checks.append((validate_fp8_block_shape, Layer(tp), i, o * tp, i // tp, [o],
                                   [128, 128]))
        mlps = [s.ffn_hidden_size] if any(not s.is_moe_layer(i) for i in range(s.num_layers)) else []
        mlps += [s.shared_ffn_hidden_size] if s.shared_ffn_hidden_size else []
        for size in mlps:
            checks.append((validate_fp8_block_shape, Layer(tp), s.hidden_size,
                           2 * size, s.hidden_size, [size // tp, size // tp], [128, 128]))
            checks.append((validate_fp8_block_shape, Layer(tp), size, s.hidden_size * tp,
                           size // tp, [s.hidden_size], [128, 128]))
        if s.is_moe:
            checks.append((validate_fp8_block_shape_moe, s.moe_ffn_hidden_size // tp, [128, 128]))
        verdicts[f"{name}@{tp}"] = any(refused(c[0], *c[1:]) for c in checks)
out["refused"] = verdicts
print("RESULT " + json.dumps(out))
"""


@pytest.mark.slow
@pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="vllm is not installed here")
def test_vllm_takes_the_config_and_refuses_the_shapes_we_refuse(tmp_path):
    """Against vLLM itself (in a process of its own: it makes a world of one rank): its
    ``Fp8Config`` parses our ``quantization_config`` as a serialized block-FP8 checkpoint; its
    ``Fp8LinearMethod`` builds a fused q/k/v layer's ``weight`` in e4m3 and its
    ``weight_scale_inv`` with the shapes ``quantize_stream`` sends (the GEMM kernel, which needs
    AMX tiles on CPU, left out); and its block-shape checks refuse exactly the (model, TP) pairs
    ``engine_fp8_problem`` refuses, for every model of configs/models at TP 1 to 32."""
    import socket

    hf = make_tiny_checkpoint(tmp_path / "hf", "llama", seed=0)
    models = {p.stem: str(p) for p in sorted(MODELS.glob("*.json"))}
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    proc = subprocess.run([sys.executable, "-c", VLLM_SIDE, str(hf), json.dumps(models), str(port)],
                          cwd=ROOT, capture_output=True, text=True, timeout=600)
    lines = [x for x in proc.stdout.splitlines() if x.startswith("RESULT ")]
    assert proc.returncode == 0 and lines, proc.stdout[-3000:] + proc.stderr[-6000:]
    out = json.loads(lines[0].removeprefix("RESULT "))
    assert out["config"] == [True, [128, 128], "dynamic"]
    q, s = quantize_blocks(torch.randn(768, 384))  # q, k and v together, as vLLM fuses them
    assert out["params"] == {"weight": ["torch.float8_e4m3fn", list(q.shape)],
                             "weight_scale_inv": ["torch.float32", list(s.shape)]}
    ours = {f"{name}@{tp}": bool(engine_fp8_problem(read_model_spec(path), tp))
            for name, path in models.items() for tp in (1, 2, 4, 8, 16, 32)}
    assert out["refused"] == ours
    assert ours["qwen3-235b-a22b@16"] and not ours["deepseek-v3@16"]  # the configs' choices


def test_fp8_settings_are_checked_and_counted():
    with pytest.raises(ValueError, match=r"rollout\.quantization: is wired for vLLM only"):
        load_config(None, ["rollout.engine=sglang", "rollout.quantization=fp8"])
    with pytest.raises(ValueError, match=r"rollout\.kv_cache_dtype: is wired for vLLM only"):
        load_config(None, ["rollout.engine=sglang", "rollout.kv_cache_dtype=fp8"])
    assert quantization_config()["weight_block_size"] == [128, 128]
    from mugrpo_megatron.dryrun.memory import EngineTensors

    spec = read_model_spec(MODELS / "llama-3.1-70b-instruct.json")
    bf16, fp8 = (EngineTensors.of(spec, 8, "bfloat16", fp8=f).total for f in (False, True))
    # the linear weights halve; the vocabulary (2 x 128256 x 8192 bf16, 4.2 GB) stays
    vocab = 2 * 128256 * 8192 * 2 / 8
    assert abs((fp8 - vocab) / (bf16 - vocab) - 0.5) < 0.001


def test_dry_run_counts_fp8_weights_and_kv_cache():
    """The 70B config with the engine's weights in FP8 and its KV cache in fp8: the engine's
    weights a GPU about halve, the KV cache's sequences at least double; Qwen3-235B in FP8 at
    TP 16 is refused with vLLM's reason."""
    from mugrpo_megatron.dryrun import dry_run

    cfg_path = ROOT / "configs" / "llama-3.1-70b_8x8xh100_fp8.yaml"
    model = MODELS / "llama-3.1-70b-instruct.json"

    def figures(*sets):
        text = dry_run(load_config(cfg_path, list(sets)), 64, model)
        pick = lambda key: next(x for x in text.splitlines() if x.strip().startswith(key))  # noqa: E731
        return pick("engine weights"), pick("engine KV cache"), text

    base_w, base_kv, _ = figures()
    w, kv, text = figures("rollout.quantization=fp8", "rollout.kv_cache_dtype=fp8")
    gib = lambda line: float(line.split()[2])  # noqa: E731
    tokens = lambda line: int(line.split("(")[1].split()[0].replace(",", ""))  # noqa: E731
    assert 0.5 < gib(w) / gib(base_w) < 0.6 and "block FP8" in w
    assert tokens(kv) > 2 * tokens(base_kv) and "fp8" in kv
    with pytest.raises(ValueError, match=r"rollout\.quantization: fp8: Qwen3MoeForCausalLM's block "
                                         r"FP8 at engine TP 16: an expert's intermediate size a "
                                         r"rank is 96"):
        dry_run(load_config(None, ["rollout.quantization=fp8", "rollout.tensor_parallel=16",
                                   "parallel.tensor=4", "parallel.expert=8",
                                   "parallel.sequence_parallel=true"]), 128,
                MODELS / "qwen3-235b-a22b.json", gpus_per_node=8)


def test_ue8m0_scales_are_the_ones_the_engine_keeps():
    """vLLM on H100/B200 (DeepGEMM, VLLM_USE_DEEP_GEMM_E8M0 on) re-quantizes every block to a
    power-of-two scale after each load (``requant_weight_ue8m0_inplace``): weights quantized
    with float32 scales are rounded a second time there (most values move, the error about
    doubles). Quantized with the scales vLLM's rule chooses, its re-quantization changes no
    weight's value, zero and tiny blocks (its 1e-4 floor) and edge blocks included (a block
    whose largest value rounded down to 224 may be written again at half the scale, twice the
    values: the same weights)."""
    pytest.importorskip("vllm")
    from vllm.model_executor.layers.quantization.utils.fp8_utils import (
        requant_weight_ue8m0_inplace,
    )

    g = torch.Generator().manual_seed(0)
    w = (torch.randn(300, 700, generator=g) * torch.logspace(-7, 0, 700)).to(torch.bfloat16)
    w[:128, :128] = 0
    for ue8m0 in (False, True):
        q, scale = quantize_blocks(w, ue8m0=ue8m0)
        q2, scale2 = q.clone(), scale.clone()
        requant_weight_ue8m0_inplace(q2, scale2, BLOCK)
        moved = dequantize_blocks(q2, scale2) != dequantize_blocks(q, scale)
        if ue8m0:
            assert not moved.any()
            assert torch.equal(scale, torch.exp2(torch.log2(scale).round()))  # powers of two
        else:
            assert moved.float().mean() > 0.5
    from mugrpo_megatron.engines.compat_vllm import engine_scales_ue8m0

    assert engine_scales_ue8m0() is False  # vLLM's own answer on a CPU: no DeepGEMM here


MOE_FAMILIES = {"qwen3_moe": "qwen3_moe:Qwen3MoeForCausalLM",
                "mixtral": "mixtral:MixtralForCausalLM",
                "glm4_moe": "glm4_moe:Glm4MoeForCausalLM",
                "deepseek_v3": "deepseek_v2:DeepseekV3ForCausalLM"}
"""Each MoE family of ours, and vLLM's model class for it."""


@pytest.mark.parametrize("family", sorted(MOE_FAMILIES))
def test_the_router_stays_in_the_models_dtype_for_every_family(tmp_path, family):
    """Mixtral's router (block_sparse_moe.gate) went out in FP8 while vLLM builds it unquantized;
    vLLM builds Qwen3-MoE's with the model's quantization config (FP8 unless listed). One rule:
    each family's routers are sent as they are and named to vLLM as ignored_layers, which its
    own Fp8Config, after the model class's name mapping, skips; every expert is quantized."""
    pytest.importorskip("vllm")
    import importlib

    from vllm.model_executor.layers.quantization.fp8 import Fp8Config
    from vllm.model_executor.layers.quantization.utils.quant_utils import is_layer_skipped

    from mugrpo_megatron.engines.fp8_weights import routers
    from mugrpo_megatron.models.hf_config import read_model_spec

    hf = make_tiny_checkpoint(tmp_path / family, family, seed=1)
    kept = routers(read_model_spec(hf))
    assert kept and all(k.endswith(".gate") for k in kept)
    tensors = dict(checkpoint_tensors(hf))
    sent = dict(quantize_stream(tensors.items(), kept=kept))
    for module in kept:
        assert sent[module + ".weight"].dtype == tensors[module + ".weight"].dtype
        assert module + "." + SCALE_SUFFIX not in sent
    experts = [n for n in tensors if ".experts." in n and n.endswith(".weight")]
    assert experts and all(sent[n].dtype == FP8_DTYPE for n in experts)
    module, cls = MOE_FAMILIES[family].split(":")
    model = getattr(importlib.import_module(f"vllm.model_executor.models.{module}"), cls)
    cfg = Fp8Config.from_config(quantization_config(kept=kept))
    mapper = getattr(model, "hf_to_vllm_mapper", None)  # as model_loader/utils.py applies it
    if mapper is not None:
        cfg.apply_vllm_mapper(mapper.get_rename_mapper())
    skipped = lambda prefix: is_layer_skipped(  # noqa: E731
        prefix, cfg.ignored_layers, getattr(model, "packed_modules_mapping", {}),
        match_mode=cfg.ignored_layers_match_mode)
    assert all(skipped(k) for k in kept)
    assert not any(skipped(n.removesuffix(".weight")) for n in experts[:4])
