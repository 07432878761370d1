"""The paper miniature's tables, curves and RESULTS.md section (``paper_miniature.py`` runs it).

A run's numbers come from its metrics.jsonl (``read_run``); runs of one setting (row, mu,
uniform-group policy) are summarised over their seeds (``summarize``).
"""

from __future__ import annotations

import json
import os
import statistics
from pathlib import Path

CURVES = [("clip_frac", "clip fraction"), ("veto_frac", "vetoed token fraction"),
          ("rho_neg_mean", "E[rho | A < 0]"), ("abs_log_ratio_mean", "mean |log rho|")]


def read_run(run_dir: Path) -> dict:
    """What the tables and plots need, from a run's metrics.jsonl."""
    recs = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    phases = [r for r in recs if r["kind"] == "phase"]
    parts = {k: sum(p[f"{k}_seconds"] for p in phases)
             for k in ("generate", "score", "sync", "switch", "optimize")}
    evals = [(r["update"], r["eval_mean_at_k"]) for r in recs if r["kind"] == "eval"]
    updates = [r for r in recs if r["kind"] == "update" and not r.get("skipped")]
    # drift late in a phase: mean |log rho| over the last quarter of each phase's updates, the
    # largest over the phases (where the behaviour policy is stalest)
    mu = max((u["staleness"] for u in updates), default=0) + 1
    late = {}
    for u in updates:
        if u["staleness"] >= 3 * mu / 4:
            late.setdefault(u["phase"], []).append(u.get("abs_log_ratio_mean", 0.0))
    return {**parts, "rollout": parts["generate"] + parts["score"], "total": sum(parts.values()),
            "syncs": len(phases), "evals": evals,
            "phase_reward": [p["reward_mean"] for p in phases],
            "passes": statistics.mean(p.get("passes", 0.0) for p in phases),
            "uniform_frac": statistics.mean(p["uniform_group_frac"] for p in phases),
            "late_phase_abs_log_ratio": max((statistics.mean(v) for v in late.values()),
                                            default=0.0),
            "curves": {k: [(u["update"], u.get(k, 0.0)) for u in updates] for k, _ in CURVES},
            "skipped_updates": sum(p["skipped_updates"] for p in phases)}


def summarize(runs: list[dict]) -> dict:
    """One setting over its seeds."""
    before = [r["evals"][0][1] for r in runs]
    after = [r["evals"][-1][1] for r in runs]
    mean = statistics.mean

    def late(key):  # mean over the last quarter of updates: where a collapse shows
        vals = [v for r in runs for u, v in r["curves"][key] if u >= 3 * r["curves"][key][-1][0] / 4]
        return mean(vals) if vals else float("nan")

    return {"seeds": len(runs), "before": mean(before), "after": mean(after),
            "after_std": statistics.stdev(after) if len(after) > 1 else 0.0,
            "after_min": min(after), "after_max": max(after),
            "peak": mean(max(a for _, a in r["evals"]) for r in runs),
            "rollout": mean(r["rollout"] for r in runs), "total": mean(r["total"] for r in runs),
            "wall": mean(r["wall"] for r in runs), "syncs": runs[0]["syncs"],
            "passes": mean(r["passes"] for r in runs),
            "uniform_frac": mean(r["uniform_frac"] for r in runs),
            "late_phase_abs_log_ratio": mean(r["late_phase_abs_log_ratio"] for r in runs),
            **{f"late_{k}": late(k) for k, _ in CURVES}}


def _after(s: dict) -> str:
    spread = (f" ± {s['after_std']:.3f} ({s['after_min']:.3f}-{s['after_max']:.3f})"
              if s["seeds"] > 1 else "")
    return f"{s['after']:.3f}{spread}"


def _markdown(headers: list[str], rows: list[list[str]]) -> str:
    lines = ["| " + " | ".join(headers) + " |", "|" + "---|" * len(headers)]
    return "\n".join(lines + ["| " + " | ".join(r) + " |" for r in rows])


def grid_table(summary: dict[str, dict], keys: list[tuple[str, str]]) -> str:
    """The Table-1-shaped table: (setting key, label) in order."""
    rows = []
    for key, label in keys:
        s = summary[key]
        rows.append([label, str(s["seeds"]), f"{s['before']:.3f}", _after(s), f"{s['peak']:.3f}",
                     f"{s['rollout']:.1f}", f"{s['total']:.1f}", str(s["syncs"]),
                     f"{s['late_clip_frac']:.4f}", f"{s['late_veto_frac']:.4f}",
                     f"{s['late_rho_neg_mean']:.3f}", f"{s['late_abs_log_ratio_mean']:.3f}",
                     f"{s['late_phase_abs_log_ratio']:.3f}"])
    return _markdown(["run", "seeds", "held-out before", "held-out after", "peak", "T_roll s",
                      "T_total s", "syncs", "clip frac", "veto frac", "E[rho \\| A<0]",
                      "mean \\|log rho\\|", "late in a phase"], rows)


def uniform_table(summary: dict[str, dict], keys: list[tuple[str, str, str]]) -> str:
    """(setting key, label, policy): the headline rows under each uniform-group policy."""
    rows = [[label, policy, str(summary[key]["seeds"]), f"{summary[key]['uniform_frac']:.2f}",
             f"{summary[key]['passes']:.2f}", _after(summary[key]), f"{summary[key]['peak']:.3f}",
             f"{summary[key]['late_phase_abs_log_ratio']:.3f}"] for key, label, policy in keys]
    return _markdown(["run", "uniform groups", "seeds", "uniform fraction", "passes a phase",
                      "held-out after", "peak", "late in a phase"], rows)


def phases_table(summary: dict[str, dict], keys: list[tuple[str, int, int]]) -> str:
    """(setting key, phases, mu): Mu-GRPO at equal total updates."""
    rows = [[str(phases), str(mu), str(summary[key]["seeds"]), _after(summary[key]),
             f"{summary[key]['peak']:.3f}", f"{summary[key]['rollout']:.1f}",
             f"{summary[key]['total']:.1f}", f"{summary[key]['late_phase_abs_log_ratio']:.3f}",
             f"{summary[key]['late_rho_neg_mean']:.3f}"] for key, phases, mu in keys]
    return _markdown(["phases", "mu", "seeds", "held-out after", "peak", "T_roll s", "T_total s",
                      "late in a phase", "E[rho \\| A<0]"], rows)


def plot(runs: dict[str, list[dict]], keys: list[tuple[str, str]], path: Path) -> None:
    """Figures 2-3 of the paper: held-out accuracy and the four curves, one line a setting."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(len(CURVES) + 1, 1, figsize=(8, 2.4 * (len(CURVES) + 1)), sharex=True)
    for key, label in keys:
        rs = runs[key]
        xs = [u for u, _ in rs[0]["evals"]]
        ys = [statistics.mean(r["evals"][i][1] for r in rs) for i in range(len(xs))]
        (line,) = axes[0].plot(xs, ys, "o-", ms=3, lw=1.2, label=label)
        for ax, (curve, _) in zip(axes[1:], CURVES):
            pts = rs[0]["curves"][curve]
            w = max(1, len(pts) // 32)  # a moving average over ~1/32 of the run, first seed
            vals = [v for _, v in pts]
            sm = [statistics.mean(vals[max(0, i - w + 1):i + 1]) for i in range(len(vals))]
            ax.plot([u for u, _ in pts], sm, lw=1, color=line.get_color())
    axes[0].set_title("held-out accuracy (mean@k, seed mean)", fontsize=9)
    axes[0].legend(fontsize=7)
    for ax, (curve, title) in zip(axes[1:], CURVES):
        ax.set_title(title + " (first seed, moving average)", fontsize=9)
        if curve in ("clip_frac", "veto_frac"):
            ax.set_yscale("symlog", linthresh=1e-4)
    axes[-1].set_xlabel("update")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=100)
    plt.close(fig)


def update_results_md(path: Path, section: str, tag: str = "") -> None:
    """Replace this benchmark's marked section (one per ``--tag``) of RESULTS.md; appended the
    first time."""
    begin, end = f"<!-- paper_miniature{tag}:begin -->", f"<!-- paper_miniature{tag}:end -->"
    text = path.read_text() if path.exists() else "# Benchmark results\n"
    block = f"{begin}\n{section.strip()}\n{end}"
    if begin in text and end in text:
        head, rest = text.split(begin, 1)
        text = head + block + rest.split(end, 1)[1]
    else:
        text = text.rstrip("\n") + "\n\n" + block + "\n"
    path.write_text(text)


def markdown_section(args, sft: dict, tables: dict[str, str], grid_seconds: float, cmd: str,
                     root: Path) -> str:
    by_k = ", ".join(f"{k} operands {v:.2f}" for k, v in sft["probe_by_operands"].items())
    plot_rel = os.path.relpath(args.plot, root / "benchmarks")
    out_rel = os.path.relpath(args.out, root)
    title = f"lr {args.lr:g}, {args.updates // args.mu} phases"
    if args.tag and args.tag.strip("_") != f"{args.updates // args.mu}phases":
        title += f", {args.tag.strip('_')}"
    extra = ""
    if "uniform" in tables:
        extra += f"\n\nThe headline rows under each uniform-group policy:\n\n{tables['uniform']}"
    if "phases" in tables:
        extra += (f"\n\nMu-GRPO with the phase count changed at equal total updates "
                  f"({args.updates}):\n\n{tables['phases']}")
    return f"""## Mu-GRPO's claims in miniature: {title} (`benchmarks/paper_miniature.py`)

`{cmd}` ({grid_seconds / 60:.1f} minutes on this machine, SFT included unless reused; raw numbers
in `{out_rel}`).

Policy: the tiny Llama of `benchmarks/miniature_task.py` (2 layers, hidden 128), SFT'd for
{sft['steps']} steps ({sft['seconds']:.0f} s) on chained single-digit arithmetic, half of the
examples worked step by step and half answered at once, to a sampled probe pass rate of
{sft['probe_pass_rate']:.2f} ({by_k}). Every row: {args.updates} updates of
{args.samples_per_update} responses (G = {args.group_size}), phases sized for one pass over their
data before any uniform group is dropped, uniform groups {args.uniform}, lr {args.lr}, veto
threshold {args.veto_threshold}, M = {args.mu}, through `python -m mugrpo_megatron train`
(megatron-core learner, vLLM engine, fp32, one process). Held-out: mean@{args.eval_samples} at
temperature 1 on {args.eval_size} unseen problems, every {args.eval_every} updates (an extra weight
sync, not counted in the times). Seeds differ in prompt order, minibatches and sampling; the SFT
policy is the same. T_roll = generation + scoring, T_total = T_roll + sync + switch + optimization
(start-up and evaluation excluded), seconds, seed mean. Clip, veto, E[rho | A<0] and |log rho|:
means over the last quarter of updates; "late in a phase": mean |log rho| over the last quarter
of each phase's updates, the largest over the phases (seed mean).

{tables['grid']}

![curves]({plot_rel}){extra}
"""
