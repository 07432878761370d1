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
