"""The dry run's time of one learner update, from stated rates (no GPU has run it here).

An update's work is the model's FLOPs over ``algo.samples_per_update`` sequences, each taken at
the longest a phase allows (data.max_prompt_tokens + rollout.max_new_tokens: an upper bound,
since most responses end sooner): the weight GEMMs (2 FLOPs a multiply-add, the active experts
only for a mixture of experts) and causal attention's two products (QK^T and PV, half the
square of a sequence each), three times a forward for the forward and backward, plus one more
forward with full recomputation or core attention's forward with selective recomputation; and
the pipeline's idle share (1F1B: (PP - 1) / (VPP x microbatches) of a rank's run). Context
parallelism splits the same work over more ranks; its ring exchange is taken as hidden behind
the attention it overlaps (TE's p2p). The rate: ``ASSUMED_MFU`` of ``DATASHEET_BF16`` on every
GPU of the world (FP8's GEMMs run faster: the figure is then conservative).
"""

from __future__ import annotations

from mugrpo_megatron.config import Config
from mugrpo_megatron.dryrun.memory import ASSUMED_MFU, DATASHEET_BF16, microbatch_tokens
from mugrpo_megatron.models.hf_config import ModelSpec


def forward_flops(spec: ModelSpec, seq: int) -> tuple[float, float]:
    """FLOPs of one forward over a sequence of ``seq`` tokens: (the weight GEMMs, causal core
    attention)."""
    h = spec.hidden_size
    attention = spec.attention_weights()
    moe = (3 * h * (spec.moe_ffn_hidden_size * spec.experts_per_token
                    + spec.shared_ffn_hidden_size) + h * spec.num_experts)
    mlp = sum(moe if spec.is_moe_layer(i) else 3 * h * spec.ffn_hidden_size
              for i in range(spec.num_layers))
    gemm = 2 * seq * (spec.num_layers * attention + mlp + h * spec.vocab_size)
    # q.k and p.v over seq^2 / 2 pairs, 2 FLOPs each
    core = spec.num_layers * seq * seq * spec.num_heads * (spec.head_dim + spec.v_head_dim)
    return float(gemm), float(core)


def update_seconds(cfg: Config, spec: ModelSpec, dp: int, world: int, seq: int | None = None,
                   mfu: float = ASSUMED_MFU, peak: float = DATASHEET_BF16) -> dict:
    """One update's FLOPs, the pipeline's idle share and seconds at the stated rate, every
    sequence ``seq`` tokens long (default: the longest a phase allows)."""
    p, seq = cfg.parallel, seq or cfg.max_sequence_tokens
    gemm, core = forward_flops(spec, seq)
    extra = {"none": 0.0, "selective": core, "full": gemm + core}[cfg.model.recompute]
    flops = cfg.algo.samples_per_update * (3 * (gemm + core) + extra)
    rank_tokens = cfg.algo.samples_per_update * seq / dp  # a DP rank's share, over its CP ranks
    microbatches = max(1, round(rank_tokens / (microbatch_tokens(cfg, spec)[0] * p.context)))
    bubble = (p.pipeline - 1) / ((p.virtual_pipeline or 1) * microbatches)
    seconds = flops * (1 + bubble) / (world * mfu * peak)
    return {"flops": flops, "attention_share": core / (gemm + core), "bubble": bubble,
            "microbatches": microbatches, "seconds": seconds}
