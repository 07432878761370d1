"""What block-FP8 weights (``rollout.quantization: fp8``) do to a policy's log-probs, on CPU.

vLLM-CPU runs block FP8 only on CPUs with AMX tiles, so the engine's FP8 gap cannot be measured
on this machine. This is the part of it that can: the weights' rounding alone. A tiny model
(transformers, float32 arithmetic) samples responses; they are scored with its float32 weights,
with the weights rounded to bf16, and with the weights through ``engines.fp8_weights``'s block
quantizer and back (``quantize_blocks`` of the bf16 weights, ``dequantize_blocks``). The
activations' FP8 (vLLM quantizes each GEMM's input in 1 x 128 groups) is not modelled. Prints
the mean and largest |log-prob difference| of each against float32, and their ratio.

    python benchmarks/fp8_weight_gap.py            # llama and qwen3_moe, 16 x 64 tokens each
    python benchmarks/fp8_weight_gap.py --quick    # llama, 4 x 16 tokens
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from mugrpo_megatron.engines.fp8_weights import dequantize_blocks, is_quantized, quantize_blocks  # noqa: E402
from mugrpo_megatron.models.tiny import make_tiny_checkpoint  # noqa: E402


def rounded(model, how: str):
    """``model`` with every weight as the engine would hold it: 'bf16', or 'fp8' for the linear
    weights of the layers (the rest bf16, as the FP8 checkpoints keep them)."""
    with torch.no_grad():
        for name, p in model.named_parameters():
            bf16 = p.to(torch.bfloat16)
            if how == "fp8" and is_quantized(name, p):
                p.copy_(dequantize_blocks(*quantize_blocks(bf16)))
            else:
                p.copy_(bf16.float())
    return model


def gap(family: str, rows: int, new_tokens: int, root: Path) -> dict:
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    hf = make_tiny_checkpoint(root / family, family, seed=3, hidden_size=256, num_heads=4,
                              num_kv_heads=2, ffn_hidden_size=512)
    load = lambda: AutoModelForCausalLM.from_pretrained(hf, dtype=torch.float32).eval()  # noqa: E731
    ref = load()
    with torch.no_grad():
        prompts = torch.randint(3, 390, (rows, 16))
        seqs = ref.generate(prompts, max_new_tokens=new_tokens, do_sample=True, pad_token_id=0,
                            eos_token_id=None)

        def logp(model):
            logits = model(seqs).logits[:, 15:-1].float()
            return torch.log_softmax(logits, -1).gather(-1, seqs[:, 16:, None])[..., 0]

        base = logp(ref)
        out = {"family": family, "tokens": base.numel()}
        for how in ("bf16", "fp8"):
            d = (logp(rounded(load(), how)) - base).abs()
            out[how] = {"mean": d.mean().item(), "max": d.max().item()}
    out["fp8_over_bf16_mean"] = out["fp8"]["mean"] / out["bf16"]["mean"]
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="llama only, 4 responses of 16 tokens")
    ap.add_argument("--out", help="write the results as JSON here too")
    args = ap.parse_args()
    torch.set_num_threads(1)
    families = ["llama"] if args.quick else ["llama", "qwen3_moe"]
    rows, tokens = (4, 16) if args.quick else (16, 64)
    with tempfile.TemporaryDirectory() as tmp:
        results = [gap(f, rows, tokens, Path(tmp)) for f in families]
    for r in results:
        print(f"{r['family']}: {r['tokens']} tokens; |log p - float32's|: bf16 weights mean "
              f"{r['bf16']['mean']:.2e} (max {r['bf16']['max']:.2e}), block-FP8 weights mean "
              f"{r['fp8']['mean']:.2e} (max {r['fp8']['max']:.2e}): {r['fp8_over_bf16_mean']:.1f}x")
    if args.out:
        Path(args.out).write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
