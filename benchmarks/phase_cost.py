"""The phase-cost model (``mugrpo_megatron.dryrun.cost``) on the configs users run, and against
the step times peers published for the same models on the same GPUs.

1. GRPO at mu = 4 beside Mu-GRPO for the 70B, Qwen3-235B and DeepSeek-V3 configs (what ``plan
   --hf-config`` prints for each).
2. Anchors: NeMo-RL v0.6's published GRPO steps on DGX-H100 (``docs/about/performance-summary.md``
   at r0.6.0, BF16, on-policy: one generation of G-GBS responses, one update of T-GBS, the
   policy's log-probs recomputed, a refit), run through the same model at their model, GPU count,
   batch, lengths and generation TP, with the model's rates unchanged. Their measured mean
   sequence length sets the mean response (a measured input, not a fitted one); the prompt is
   taken at 150 tokens (OpenMathInstruct-2 problems with a chat template: stated, not measured).
   Their training layout is kept where ours accepts it, else ours is used and said so (the
   learner's term reads FLOPs at the stated MFU; the layout changes only the pipeline's idle
   share).

No GPU: arithmetic only, a few seconds. ``--quick`` is the same (CI runs it).

    python benchmarks/phase_cost.py [--results-md benchmarks/RESULTS.md]
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

from mugrpo_megatron.config.loader import load_config  # noqa: E402
from mugrpo_megatron.dryrun import cost  # noqa: E402
from mugrpo_megatron.layout import check_layout  # noqa: E402
from mugrpo_megatron.models.hf_config import read_model_spec  # noqa: E402

CONFIGS = [("llama-3.1-70b_16x8xh100_32k", 128, "llama-3.1-70b-instruct"),
           ("llama-3.1-70b_8x8xh100_fp8", 64, "llama-3.1-70b-instruct"),
           ("qwen3-235b-a22b_16x8xh100_8k", 128, "qwen3-235b-a22b"),
           ("deepseek-v3_32x8xh100_8k", 256, "deepseek-v3")]

PROMPT_TOKENS = 150
"""The anchors' mean prompt (stated: not in the published table)."""


@dataclasses.dataclass(frozen=True)
class Anchor:
    """One published step: its setup and its measured seconds."""

    name: str
    config: str
    model: str
    gpus: int
    max_sequence: int
    mean_sequence: int
    generation_tp: int
    training: dict
    step_seconds: float
    responses: int = 512


ANCHORS = [
    Anchor("NeMo-RL v0.6 DeepSeek-V3, 1.5k, on policy", "deepseek-v3_32x8xh100_8k", "deepseek-v3",
           256, 1536, 701, 32, {"tensor": 1, "pipeline": 16, "expert": 16}, 134.0),
    Anchor("NeMo-RL v0.6 Qwen3-235B, 8k, on policy", "qwen3-235b-a22b_16x8xh100_8k",
           "qwen3-235b-a22b", 128, 8192, 5698, 16,
           {"tensor": 2, "context": 2, "expert": 16, "pipeline": 8}, 395.0),
    Anchor("NeMo-RL v0.6 Qwen3-235B, 8k, on policy", "qwen3-235b-a22b_16x8xh100_8k",
           "qwen3-235b-a22b", 256, 8192, 5713, 16,
           {"tensor": 2, "context": 2, "expert": 16, "pipeline": 8}, 312.0),
]


def anchor_config(a: Anchor):
    """The anchor's step as one of our configs: a phase of one update of all its responses, in
    bf16, with their training layout where our checks accept it (returns the config and the
    layout used, in words)."""
    prompt_cap = 256 if a.max_sequence <= 2048 else 1024
    base = [f"rollout.tensor_parallel={a.generation_tp}", "rollout.group_size=8",
            f"rollout.max_new_tokens={a.max_sequence - prompt_cap}",
            f"data.max_prompt_tokens={prompt_cap}", "rollout.quantization=none",
            "rollout.kv_cache_dtype=auto", "algo.total_updates=1", "algo.updates_per_phase=1",
            f"algo.prompts_per_phase={a.responses // 8}",
            f"algo.samples_per_update={a.responses}", "model.fp8_format=null"]
    path = ROOT / "configs" / f"{a.config}.yaml"
    spec = read_model_spec(ROOT / "configs" / "models" / f"{a.model}.json")
    training = {"tensor": 1, "context": 1, "expert": 1, "pipeline": 1, **a.training}
    theirs = [f"parallel.{k}={v}" for k, v in training.items()] + [
        f"parallel.sequence_parallel={str(training['tensor'] > 1).lower()}"]
    words = "theirs: TP {tensor} CP {context} EP {expert} PP {pipeline}".format(**training)
    try:
        cfg = load_config(path, base + theirs)
        check_layout(cfg, a.gpus, 8, spec)
        return cfg, spec, words
    except ValueError as e:  # ours, and why
        refused = str(e).splitlines()[0][:100]
    cfg = load_config(path, base)
    check_layout(cfg, a.gpus, 8, spec)
    p = cfg.parallel
    return cfg, spec, (f"ours: TP {p.tensor} EP {p.expert} PP {p.pipeline} ({words} refused: "
                       f"{refused})")


def anchors() -> tuple[list[str], list[dict]]:
    """The anchors' table, and each anchor's figures (its implied decode step over the
    model's: ``implied_step_scale``)."""
    found = []
    rows = ["| published step | GPUs | mean / max sequence | measured s | model s | model / "
            "measured | sync | switch | generate | log-probs | learner | decode step ms: model, "
            "implied | training layout |", "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for a in ANCHORS:
        cfg, spec, layout = anchor_config(a)
        prompt_cap = cfg.data.max_prompt_tokens
        rates = cost.Rates(prompt_fraction=PROMPT_TOKENS / prompt_cap,
                           mean_length_fraction=(a.mean_sequence - PROMPT_TOKENS)
                           / cfg.rollout.max_new_tokens, logprob_passes=1)
        p = cost.phase_cost(cfg, spec, a.gpus, 8, rates)
        # the decode step that would close the gap, were every other term right
        implied = p.step_seconds + (a.step_seconds - p.total) / p.decode_steps
        found.append({"name": a.name, "gpus": a.gpus, "measured_s": a.step_seconds,
                      "model_s": p.total, "implied_step_scale": implied / p.step_seconds})
        rows.append(f"| {a.name} | {a.gpus} | {a.mean_sequence:,} / {a.max_sequence:,} | "
                    f"{a.step_seconds:.0f} | {p.total:.0f} | {p.total / a.step_seconds:.2f} | "
                    f"{p.sync:.1f} | {p.switch:.1f} | {p.generate:.0f} | {p.reference:.0f} | "
                    f"{p.learner:.0f} | {p.step_seconds * 1e3:.0f}, {implied * 1e3:.0f} | "
                    f"{layout} |")
    return rows, found


def configs(scales: list[float]) -> tuple[list[str], dict]:
    """Each config's comparison, then its ratio with the decode step ``scales`` times the
    roofline's (the least and the most the anchors imply); and each config's figures."""
    out, found = [], {}
    for name, world, model in CONFIGS:
        cfg = load_config(ROOT / "configs" / f"{name}.yaml")
        spec = read_model_spec(ROOT / "configs" / "models" / f"{model}.json")
        out += [f"`{name}` on {world} GPUs:", "```", *cost.describe(cfg, spec, world, 8)]
        grpo, mu = cost.compare(cfg, spec, world, 8)
        low, high = cost.ratio_range(cfg, spec, world, 8)
        found[name] = {"grpo_s": grpo.seconds, "mugrpo_s": mu.seconds,
                       "ratio": grpo.seconds / mu.seconds, "low": low, "high": high}
        for scale in (min(scales), max(scales)):
            grpo, mu = cost.compare(cfg, spec, world, 8, cost.Rates(decode_step_scale=scale))
            out.append(f"  with decode steps {scale:.1f}x the roofline (an anchor's implied): "
                       f"{grpo.seconds / mu.seconds:.2f}x ({grpo.seconds / 3600:,.0f} h against "
                       f"{mu.seconds / 3600:,.0f} h)")
        out.append("```")
    return out, found


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="the same (arithmetic only): for CI")
    ap.add_argument("--results-md", help="replace this script's section of this Markdown file")
    ap.add_argument("--out", help="write the figures as JSON here")
    args = ap.parse_args()
    against, anchored = anchors()
    by_config, figures = configs([a["implied_step_scale"] for a in anchored])
    text = "\n".join(["### GRPO mu=4 beside Mu-GRPO, by config", *by_config, "",
                      "### The model against NeMo-RL v0.6's published step times (DGX-H100, "
                      "BF16)", *against])
    print(text)
    if args.out:
        Path(args.out).write_text(json.dumps({"anchors": anchored, "configs": figures},
                                             indent=1))
    if args.results_md:
        import miniature_report

        miniature_report.update_results_md(Path(args.results_md), text, name="phase_cost")


if __name__ == "__main__":
    main()
