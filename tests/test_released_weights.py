"""Checkpoints as released: block FP8 (DeepSeek-V3, Qwen3 -FP8) and MXFP4 (gpt-oss's experts) read
dequantized, any other quantization refused by name before anything is loaded."""

import json
import os
import subprocess
import sys

import pytest
import torch
from helpers import ROOT, block_fp8_release, cli_under_torchrun
from safetensors.torch import load_file, save_file

from mugrpo_megatron.engines.fp8_weights import dequantize_blocks, quantize_blocks
from mugrpo_megatron.models.hf_config import model_spec_from_dict
from mugrpo_megatron.models.released import (
    CheckpointQuantization,
    SafetensorsReader,
    dequantize_mxfp4,
    read_block_fp8,
    read_checkpoint_quantization,
    read_mxfp4,
)
from mugrpo_megatron.models.tiny import make_tiny_checkpoint

FP8 = {"quant_method": "fp8", "activation_scheme": "dynamic", "fmt": "e4m3",
       "weight_block_size": [128, 128]}


def test_the_quantization_is_read_from_the_config_and_unknown_methods_refused_by_name():
    assert read_checkpoint_quantization({}, "c") is None
    assert read_checkpoint_quantization({"quantization_config": FP8}, "c") == \
        CheckpointQuantization("fp8", (128, 128))
    assert read_checkpoint_quantization(
        {"quantization_config": {"quant_method": "mxfp4"}}, "c").method == "mxfp4"
    for method in ("awq", "gptq", "compressed-tensors", "modelopt", "bitsandbytes"):
        with pytest.raises(ValueError, match=f"c: quantization_config.quant_method '{method}'"):
            read_checkpoint_quantization({"quantization_config": {"quant_method": method}}, "c")
    per_tensor = {k: v for k, v in FP8.items() if k != "weight_block_size"}
    with pytest.raises(ValueError, match="per-tensor or per-channel FP8"):
        read_checkpoint_quantization({"quantization_config": per_tensor}, "c")
    with pytest.raises(ValueError, match="fmt 'e5m2'"):
        read_checkpoint_quantization({"quantization_config": {**FP8, "fmt": "e5m2"}}, "c")
    # the architecture's reading refuses it too (convert, train, --dry-run all start there)
    cfg = json.loads((ROOT / "configs/models/qwen3-8b.json").read_text())
    with pytest.raises(ValueError, match="quant_method 'awq'"):
        model_spec_from_dict({**cfg, "quantization_config": {"quant_method": "awq"}}, "x.json")
    assert model_spec_from_dict({**cfg, "quantization_config": FP8}).stored.block == (128, 128)


def _recording(tensors):
    """A raw reader over ``tensors`` that records each index it was asked for."""
    asked = []

    def read(name, index):
        asked.append((name, index))
        return tensors[name] if index is None else tensors[name][index]
    return read, asked


@pytest.mark.parametrize("shape, block", [((100, 70), (32, 48)), ((256, 128), (128, 128)),
                                          ((64, 200), (128, 128))])
def test_a_block_fp8_read_of_any_rows_and_columns_equals_the_whole_weight_dequantized(shape, block):
    """Edge blocks cut short, slices that start and end inside a block; only the scales of the
    blocks under the slice are read."""
    g = torch.Generator().manual_seed(0)
    w = torch.randn(shape, generator=g) * torch.logspace(-3, 1, shape[1])
    q, s = quantize_blocks(w, block)
    whole = dequantize_blocks(q, s, block)
    read, asked = _recording({"w": q, "w_scale_inv": s})
    rows, cols = shape
    for r0, r1, c0, c1 in [(0, rows, 0, cols), (rows // 3, rows - 5, 0, cols),
                           (0, rows, cols // 2 + 1, cols), (7, 9, 3, cols - 1)]:
        asked.clear()
        got = read_block_fp8(read, "w", shape, tuple(s.shape),
                             (slice(r0, r1), slice(c0, c1)), block)
        assert torch.equal(got, whole[r0:r1, c0:c1])
        scale_index = dict(asked)["w_scale_inv"]
        assert scale_index[0].start == r0 // block[0] and scale_index[1].start == c0 // block[1]
        assert scale_index[0].stop == -(-r1 // block[0]) and scale_index[1].stop == -(-c1 // block[1])
    assert torch.equal(read_block_fp8(read, "w", shape, tuple(s.shape), (slice(2, 9),), block),
                       whole[2:9])
    with pytest.raises(ValueError, match=r"w_scale_inv: shape .* expected"):
        read_block_fp8(read, "w", shape, (1, 1), None, block)


def test_mxfp4_is_dequantized_as_transformers_does():
    """gpt-oss's expert blocks and scales against transformers' own dequantization
    (``integrations/mxfp4.py``: the values in bf16, the last two dimensions transposed)."""
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    g = torch.Generator().manual_seed(1)
    blocks = torch.randint(0, 256, (3, 40, 4, 16), generator=g, dtype=torch.uint8)
    scales = torch.randint(110, 140, (3, 40, 4), generator=g, dtype=torch.uint8)
    theirs = convert_moe_packed_tensors(blocks, scales, dtype=torch.bfloat16)  # [3, 128, 40]
    values = dequantize_mxfp4(blocks, scales)
    assert torch.equal(values.transpose(1, 2).to(torch.bfloat16), theirs)
    # a byte's low nibble first: 0x21 is (0.5, 1.0) at scale 2^0
    one = dequantize_mxfp4(torch.full((1, 16), 0x21, dtype=torch.uint8),
                           torch.tensor([127], dtype=torch.uint8))
    assert one[:2].tolist() == [0.5, 1.0]
    read, asked = _recording({"e_blocks": blocks, "e_scales": scales})
    full = theirs.float()
    assert torch.equal(read_mxfp4(read, "e", tuple(blocks.shape), None).to(torch.bfloat16), theirs)
    for index in [(slice(1, 3), slice(33, 90), slice(5, 21)), (slice(None), slice(0, 64))]:
        asked.clear()
        got = read_mxfp4(read, "e", tuple(blocks.shape), index)
        assert torch.equal(got, full[index])
    assert dict(asked)["e_blocks"][-1] == slice(0, 2)  # columns 0-63: two groups of 32


def test_a_float8_tensor_without_its_scale_is_refused_by_name(tmp_path):
    q, _ = quantize_blocks(torch.randn(4, 4))
    save_file({"model.layers.0.mlp.down_proj.weight": q}, str(tmp_path / "model.safetensors"))
    read = SafetensorsReader(tmp_path, CheckpointQuantization("fp8", (128, 128)))
    with pytest.raises(ValueError, match="'model.layers.0.mlp.down_proj.weight' is stored as "
                                         "F8_E4M3 with no .*weight_scale_inv beside it"):
        read("model.layers.0.mlp.down_proj.weight", None)
    with pytest.raises(ValueError, match="has no quantization_config"):
        SafetensorsReader(tmp_path)("model.layers.0.mlp.down_proj.weight", None)


# ---------------------------------------------------------------- through the commands


def _run(cmd, timeout=600):
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore")
    return subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)


def _convert(nproc, *args):
    proc = _run(cli_under_torchrun(nproc, "convert", *args))
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    return proc.stdout + proc.stderr


def _tensors(path):
    out = {}
    for f in sorted(path.glob("*.safetensors")):
        out.update(load_file(str(f)))
    return out


def _dequantized(release, block, dtype):
    """The release's weights as its own blocks and scales say, element by element of a block."""
    stored = _tensors(release)
    out = {}
    for name, t in stored.items():
        if name.endswith("_scale_inv"):
            continue
        scale = stored.get(name + "_scale_inv")
        out[name] = t if scale is None else dequantize_blocks(t, scale, block).to(dtype)
    return out


@pytest.mark.slow
def test_a_block_fp8_release_converts_and_exports_its_dequantized_weights(tmp_path):
    """DeepSeek-V3 (MLA, shared and routed experts) released in block FP8 with blocks that cut
    every TP shard and the weights' edges (48 x 80 on 64-576 rows and 64-512 columns), through
    ``convert`` at TP2 and back: the bf16 export holds q x scale block by block, bit for bit,
    its config.json no quantization_config, and both commands say so."""
    hf = make_tiny_checkpoint(tmp_path / "hf", "deepseek_v3", seed=3, dtype="bfloat16")
    block = (48, 80)
    release = block_fp8_release(hf, tmp_path / "fp8", block)
    said = _convert(2, "--to", "megatron", "--hf-dir", str(release), "--out",
                    str(tmp_path / "meg"), "--tp", "2", "--dtype", "bfloat16")
    assert "ships its weights in block FP8 (e4m3, 48 x 80 blocks): read dequantized into " \
           "bfloat16" in said
    kept = json.loads((tmp_path / "meg/hf_config/config.json").read_text())
    assert kept["quantization_config"]["weight_block_size"] == [48, 80]  # what it came from
    said = _convert(1, "--to", "hf", "--checkpoint", str(tmp_path / "meg"), "--out",
                    str(tmp_path / "back"), "--dtype", "bfloat16")
    assert "the export writes bfloat16 weights; quantization_config (quant_method 'fp8') " \
           "dropped" in said
    want, got = _dequantized(release, block, torch.bfloat16), _tensors(tmp_path / "back")
    assert set(got) == set(want)
    assert sum(n.endswith("proj.weight") and "experts" in n for n in want) > 8
    for name, t in want.items():
        assert got[name].dtype == torch.bfloat16 and torch.equal(got[name], t), name
    assert "quantization_config" not in json.loads((tmp_path / "back/config.json").read_text())


@pytest.mark.slow
def test_the_learner_reads_a_block_fp8_release_as_transformers_does(tmp_path):
    """A Llama released in 128 x 128 block FP8: the export of its conversion at TP2 equals what
    transformers loads from the release (it dequantizes FP8 on a machine without a GPU:
    ``quantizer_finegrained_fp8.py``, ``Fp8Dequantize``), tensor for tensor."""
    from transformers import AutoModelForCausalLM

    hf = make_tiny_checkpoint(tmp_path / "hf", "llama", seed=4, dtype="bfloat16")
    release = block_fp8_release(hf, tmp_path / "fp8")
    _convert(2, "--to", "megatron", "--hf-dir", str(release), "--out", str(tmp_path / "meg"),
             "--tp", "2", "--dtype", "bfloat16")
    _convert(1, "--to", "hf", "--checkpoint", str(tmp_path / "meg"), "--out",
             str(tmp_path / "back"), "--dtype", "bfloat16")
    theirs = AutoModelForCausalLM.from_pretrained(release, dtype=torch.bfloat16).state_dict()
    ours = _tensors(tmp_path / "back")
    assert sum(n.endswith("proj.weight") for n in ours) == 4 * 7
    for name, t in ours.items():
        assert torch.equal(theirs[name], t), name
    # the export loads in transformers as a bf16 model
    AutoModelForCausalLM.from_pretrained(tmp_path / "back")


def test_unknown_quantization_is_refused_before_any_process_group(tmp_path):
    hf = make_tiny_checkpoint(tmp_path / "hf", "llama", seed=2)
    config = json.loads((hf / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "gptq", "bits": 4}
    (hf / "config.json").write_text(json.dumps(config))
    proc = _run([sys.executable, "-m", "mugrpo_megatron", "convert", "--to", "megatron",
                 "--hf-dir", str(hf), "--out", str(tmp_path / "meg")], timeout=300)
    assert proc.returncode == 2 and "quant_method 'gptq'" in proc.stderr, proc.stderr
    assert not (tmp_path / "meg").exists()


def test_sglang_on_a_quantized_release_is_refused_before_anything_starts():
    """SGLang would build the release's FP8 layers from its config and take the dequantized
    syncs into them: refused with the way out, where the layout is checked."""
    from mugrpo_megatron.config.loader import load_config
    from mugrpo_megatron.layout import check_layout

    cfg = json.loads((ROOT / "configs/models/qwen3-8b.json").read_text())
    spec = model_spec_from_dict({**cfg, "quantization_config": FP8})
    path = ROOT / "configs/recipes/qwen3-8b_mugrpo_nothink.yaml"
    check_layout(load_config(path), 8, spec=spec)  # vLLM serves it dequantized
    with pytest.raises(ValueError, match="rollout.engine: sglang: model.path is stored in block "
                                         "FP8 .* use rollout.engine: vllm"):
        check_layout(load_config(path, ["rollout.engine=sglang"]), 8, spec=spec)
