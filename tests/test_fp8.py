"""FP8 requests fail clearly where they cannot run; the GPU check runs only on a GPU with TE."""

import pytest
import torch

from mugrpo_megatron.config import ModelConfig
from mugrpo_megatron.learner.fp8 import fp8_kwargs


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU-only refusal")
def test_fp8_without_gpu_is_refused():
    with pytest.raises(ValueError, match=r"model\.fp8_format: FP8 training needs a CUDA GPU"):
        fp8_kwargs(ModelConfig(dtype="bfloat16", fp8_format="hybrid"))


def test_fp8_needs_16_bit_training():
    with pytest.raises(ValueError, match=r"model\.dtype: FP8 training needs dtype bfloat16"):
        ModelConfig(dtype="float32", fp8_format="e4m3")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_fp8_kwargs_on_gpu():
    pytest.importorskip("transformer_engine.pytorch")
    kw = fp8_kwargs(ModelConfig(dtype="bfloat16", fp8_format="hybrid", fp8_recipe="delayed"))
    assert kw["fp8"] == "hybrid" and kw["fp8_recipe"] == "delayed"


@pytest.mark.parametrize("recipe", ["delayed", "tensorwise", "mxfp8", "blockwise"])
@pytest.mark.parametrize("tp, sp", [(1, False), (2, False), (2, True), (8, True)])
def test_padded_rows_meet_transformer_engines_fp8_rules(recipe, tp, sp):
    """For any row length and micro-batch, the rows the learner pads (``token_multiple``) give
    every dense FP8 GEMM an input TE accepts: the column-parallel layers' input is this rank's
    slice of the sequence with sequence parallel ([s / tp, b, hidden], all-gathered quantized,
    so it must be quantizable too), the row-parallel layers' the whole sequence. Rules read in
    TE 2.0-2.18 (layout/shapes.py)."""
    from mugrpo_megatron.config import ParallelConfig
    from mugrpo_megatron.layout.shapes import gemm_inputs_ok, round_up, token_multiple

    quantizable = {"delayed": 1, "tensorwise": 1, "mxfp8": 32, "blockwise": 128}[recipe]
    model = ModelConfig(dtype="bfloat16", fp8_format="hybrid", fp8_recipe=recipe)
    parallel = ParallelConfig(tensor=tp, sequence_parallel=sp)
    multiple = token_multiple(model, parallel)
    hidden, mlp = 8192, 28672
    for seq in [1, 7, 15, 17, 24, 1021, 3071, 4096]:
        padded = round_up(seq, multiple)
        assert padded >= seq and padded - seq < multiple
        for micro in (1, 2, 3):
            column = ((padded // tp if sp else padded) * micro, hidden)
            row = (padded * micro, mlp // tp)
            assert gemm_inputs_ok(column) and gemm_inputs_ok(row), (seq, micro)
            assert column[0] % quantizable == 0, (seq, micro)
    # without FP8 only sequence parallel asks for a multiple (of TP)
    assert token_multiple(ModelConfig(), parallel) == (tp if sp else 1)
    assert token_multiple(ModelConfig(), ParallelConfig(pad_tokens_to=16)) == 16


def test_model_dims_are_checked_against_the_fp8_rule():
    from mugrpo_megatron.config import ParallelConfig
    from mugrpo_megatron.layout.shapes import check_model_dims
    from mugrpo_megatron.models.hf_config import model_spec_from_dict, read_model_spec

    root = __import__("pathlib").Path(__file__).resolve().parents[1]
    check_model_dims(read_model_spec(root / "configs" / "models" / "llama-3.1-70b-instruct.json"),
                     ParallelConfig(tensor=8, sequence_parallel=True))
    odd = model_spec_from_dict({"architectures": ["LlamaForCausalLM"], "hidden_size": 96,
                                "intermediate_size": 200, "num_attention_heads": 4,
                                "num_key_value_heads": 2, "num_hidden_layers": 2,
                                "vocab_size": 256})
    with pytest.raises(ValueError, match=r"linear_fc2 .* weight shape \[96, 100\]"):
        check_model_dims(odd, ParallelConfig(tensor=2))


def _fake_te(root, pytorch_part: str):
    """A ``transformer_engine`` package like TE 2.x's: its top level swallows an ImportError of
    its PyTorch part (``transformer_engine/__init__.py``, TE 2.0-2.20)."""
    pkg = root / "transformer_engine"
    (pkg / "pytorch").mkdir(parents=True)
    (pkg / "__init__.py").write_text("try:\n    from . import pytorch\nexcept ImportError:\n"
                                     "    pass\n")
    (pkg / "pytorch" / "__init__.py").write_text(pytorch_part)
    return root


@pytest.mark.parametrize("part, want", [
    ("", True),  # TE that imports: the learner runs it
    ("raise ImportError('transformer_engine_torch.so: undefined symbol: _ZN3c1017SymbolA')",
     "does not import"),
])
def test_transformer_engine_is_used_only_when_its_pytorch_part_imports(tmp_path, monkeypatch,
                                                                       part, want):
    """A TE built against another torch (pip's isolated build) imports at the top and fails in
    its PyTorch part; the check used to import only the top and say yes, and the 7B and 30B
    configs then died in megatron's spec builder (NameError: TESpecProvider). Now it proves
    ``transformer_engine.pytorch`` imports, and says how to fix a broken one. No GPU: no TE."""
    import sys

    from mugrpo_megatron.learner.fp8 import transformer_engine_ready

    monkeypatch.syspath_prepend(str(_fake_te(tmp_path, part)))
    for name in [m for m in sys.modules if m.startswith("transformer_engine")]:
        monkeypatch.delitem(sys.modules, name)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    import transformer_engine  # noqa: F401 - the top level imports either way

    if want is True:
        assert transformer_engine_ready() is True
    else:
        with pytest.raises(ValueError, match=want) as e:
            transformer_engine_ready()
        assert "--no-build-isolation" in str(e.value) and "undefined symbol" in str(e.value)
        with pytest.raises(ValueError, match=want):
            fp8_kwargs(ModelConfig(dtype="bfloat16", fp8_format="hybrid"))
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert transformer_engine_ready() is False  # no GPU: megatron's local layers
    for name in [m for m in sys.modules if m.startswith("transformer_engine")]:
        monkeypatch.delitem(sys.modules, name)
