"""device_check.py's MoE section: a mixture of experts' grouped GEMM, which only a GPU with
Transformer Engine runs.

``moe_grouped``: a tiny GLM-4.5 MoE (sigmoid routing with its correction bias, a shared expert, a
dense first layer) in the learner at world size 1, whose experts must be megatron-core's
TEGroupedMLP (one grouped GEMM a layer, ``linear_fc1.weight{i}``: the names
``models/mapping.py`` maps), loaded from the HF checkpoint through that mapping; its log-probs of
random tokens against transformers' in fp32 on the same GPU, and a train step. A mapping that
misplaced an expert's grouped weights would show as a gap of order 1. Then the same for a tiny
DeepSeek-V3, whose multi-latent attention runs TE's MLA spec there (its latents' down
projections ``TELinear`` whole on the rank, its latent norms fused into the up projections as
``linear_q_up_proj.layer_norm_weight``: names only TE's spec has, which the CPU never builds).
"""

from __future__ import annotations

import tempfile
from pathlib import Path

import torch


def moe_grouped(args, skip: type[Exception]) -> dict:
    import importlib.util

    if not torch.cuda.is_available() or importlib.util.find_spec("transformer_engine") is None:
        raise skip("grouped GEMM needs a GPU with Transformer Engine")
    out: dict = {"checked": [], "not_checked": []}
    for family in ("glm4_moe", "deepseek_v3"):
        got = _one_family(family)
        out[family] = {k: v for k, v in got.items() if k not in ("checked", "not_checked")}
        out["checked"] += [f"{family}: {line}" for line in got["checked"]]
        out["not_checked"] += [f"{family}: {line}" for line in got["not_checked"]]
    return out


def _one_family(family: str) -> dict:
    from transformers import AutoModelForCausalLM

    from mugrpo_megatron.config.loader import load_config
    from mugrpo_megatron.learner.learner import Learner
    from mugrpo_megatron.models.tiny import make_tiny_checkpoint
    from mugrpo_megatron.types import TokenBatch

    path = Path(tempfile.gettempdir()) / f"mugrpo_device_check_{family}"
    if not (path / "config.json").exists():
        make_tiny_checkpoint(path, family, seed=7)
    cfg = load_config(None, [f"model.path={path}", "model.dtype=float32",
                             "parallel.micro_batch_size=2", "algo.samples_per_update=4",
                             "algo.total_updates=4", "algo.updates_per_phase=4", "optim.lr=1e-5",
                             "rollout.max_new_tokens=32", "parallel.pack_tokens=0"])
    learner = Learner.from_config(cfg)
    kinds = sorted({type(m).__name__ for c in learner.chunks() for n, m in c.named_modules()
                    if n.endswith("mlp.experts")})
    names = [n for c in learner.chunks() for n, _ in c.named_parameters() if ".experts." in n]
    g = torch.Generator().manual_seed(0)
    tokens = torch.randint(5, 380, (4, 48), generator=g)
    mask = torch.zeros_like(tokens, dtype=torch.bool)
    mask[:, 16:] = True
    logp, _ = learner.logprobs(TokenBatch(tokens, mask))
    hf = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32).cuda().eval()
    with torch.no_grad():
        logits = hf(tokens.cuda()).logits.float()
    want = torch.log_softmax(logits, -1)[:, :-1].gather(-1, tokens.cuda()[:, 1:, None])[..., 0]
    gap = (logp[:, 1:] - want.cpu()).abs().max().item()
    grouped = kinds == ["TEGroupedMLP"] and any(".weight0" in n for n in names)
    attention = sorted({n.split("self_attention.")[1] for c in learner.chunks()
                        for n, _ in c.named_parameters() if "layers.0.self_attention." in n})
    return {"experts_module": kinds, "expert_param_example": names[:2],
            "attention_params": attention,
            "logprob_max_gap_vs_transformers": gap,
            "checked": [f"experts run as {kinds}; log-probs vs transformers max gap {gap:.2e} "
                        f"(fp32: expect < 1e-4)"],
            "not_checked": [] if grouped and gap < 1e-4 else
            [f"grouped GEMM mapping: experts {kinds}, gap {gap:.2e}"]}
