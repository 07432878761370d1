"""The paper miniature's tables, curves and RESULTS.md section (``paper_miniature.py`` runs it).

A run's numbers come from its metrics.jsonl (``read_run``); runs of one setting (row, mu,
uniform-group policy) are summarised over their seeds (``summarize``). A per-update mean over no
token (E[rho | A < 0] in an update without an A < 0 token) is absent from the run's records and
stays absent here: averages are over the updates that have it.
"""

from __future__ import annotations

import json
import math
import os
import statistics
from dataclasses import asdict
from pathlib import Path

CURVES = [("clip_frac", "clip fraction"), ("clip_frac_low", "clip fraction, low side"),
          ("clip_frac_high", "clip fraction, high side"), ("veto_frac", "vetoed token fraction"),
          ("veto_response_frac", "vetoed A < 0 response fraction"),
          ("rho_neg_mean", "E[rho | A < 0]"), ("log_rho_neg_mean", "mean log rho | A < 0"),
          ("rho_neg_below_half_frac", "A < 0 tokens with rho < 0.5"),
          ("abs_log_ratio_mean", "mean |log rho|"), ("entropy_mean", "policy entropy"),
          ("grad_norm", "gradient norm"), ("clip_high", "eps_high (algo.clip_high: auto)")]
"""The per-update numbers each run keeps (the miniature's JSON)."""
PLOTTED = ("clip_frac_low", "clip_frac_high", "veto_response_frac", "rho_neg_mean",
           "abs_log_ratio_mean", "entropy_mean", "grad_norm")
"""The curves of the plot, under held-out accuracy."""


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
    length = {p["phase"]: p["updates"] for p in phases}
    late: dict[int, list[float]] = {}
    for u in updates:
        if u["staleness"] >= 3 * length.get(u["phase"], 1) / 4 and "abs_log_ratio_mean" in u:
            late.setdefault(u["phase"], []).append(u["abs_log_ratio_mean"])
    return {**parts, "rollout": parts["generate"] + parts["score"], "total": sum(parts.values()),
            "syncs": len(phases), "evals": evals,
            "phase_updates": [p["updates"] for p in phases],
            "phase_ends": [p["end"] for p in phases],
            "phase_reward": [p["reward_mean"] for p in phases],
            "phase_tool_call_frac": [p.get("tool_call_response_frac", 0.0) for p in phases],
            "passes": statistics.mean(p.get("passes", 0.0) for p in phases),
            "unused_frac": statistics.mean(p.get("unused_frac", 0.0) for p in phases),
            "uniform_frac": statistics.mean(p["uniform_group_frac"] for p in phases),
            "late_phase_abs_log_ratio": max((statistics.mean(v) for v in late.values()),
                                            default=0.0),
            "phase_end_clip_frac": _phase_end(updates, length, "clip_frac"),
            "curves": {k: [(u["update"], u[k]) for u in updates if k in u] for k, _ in CURVES},
            "skipped_updates": sum(p["skipped_updates"] for p in phases)}


def _phase_end(updates: list[dict], length: dict[int, int], key: str) -> float:
    """Mean of ``key`` over the last eighth of each phase's updates (at least its last one):
    the paper's clip rate 'at the end of a phase'."""
    vals = [u[key] for u in updates if key in u
            and u["staleness"] >= min(7 * length.get(u["phase"], 1) / 8,
                                      length.get(u["phase"], 1) - 1)]
    return statistics.mean(vals) if vals else float("nan")


def summarize(runs: list[dict]) -> dict:
    """One setting over its seeds."""
    before = [r["evals"][0][1] for r in runs]
    after = [r["evals"][-1][1] for r in runs]
    mean = statistics.mean

    def late(key):  # mean over the last quarter of updates: where a collapse shows
        vals = [v for r in runs for u, v in r["curves"][key]
                if r["curves"][key] and u >= 3 * r["curves"][key][-1][0] / 4]
        return mean(vals) if vals else float("nan")

    def run_mean(key):  # the mean of each run's updates, then over the seeds
        vals = [mean(v for _, v in r["curves"][key]) for r in runs if r["curves"][key]]
        return mean(vals) if vals else float("nan")

    syncs = [r["syncs"] for r in runs]
    return {"seeds": len(runs), "before": mean(before), "after": mean(after),
            "after_std": statistics.stdev(after) if len(after) > 1 else 0.0,
            "after_min": min(after), "after_max": max(after),
            "peak": mean(max(a for _, a in r["evals"]) for r in runs),
            "rollout": mean(r["rollout"] for r in runs), "total": mean(r["total"] for r in runs),
            "wall": mean(r["wall"] for r in runs), "syncs": mean(syncs),
            "syncs_min": min(syncs), "syncs_max": max(syncs),
            "passes": mean(r["passes"] for r in runs),
            "unused_frac": mean(r["unused_frac"] for r in runs),
            "uniform_frac": mean(r["uniform_frac"] for r in runs),
            "late_phase_abs_log_ratio": mean(r["late_phase_abs_log_ratio"] for r in runs),
            "phase_end_clip_frac": mean(r["phase_end_clip_frac"] for r in runs),
            "run_clip_frac": run_mean("clip_frac"), "run_clip_high": run_mean("clip_high"),
            **{f"late_{k}": late(k) for k, _ in CURVES}}


def _after(s: dict) -> str:
    spread = (f" ± {s['after_std']:.3f} ({s['after_min']:.3f}-{s['after_max']:.3f})"
              if s["seeds"] > 1 else "")
    return f"{s['after']:.3f}{spread}"


def _syncs(s: dict) -> str:
    if s["syncs_min"] == s["syncs_max"]:
        return str(s["syncs_min"])
    return f"{s['syncs']:.1f} ({s['syncs_min']}-{s['syncs_max']})"


def _markdown(headers: list[str], rows: list[list[str]]) -> str:
    lines = ["| " + " | ".join(headers) + " |", "|" + "---|" * len(headers)]
    return "\n".join(lines + ["| " + " | ".join(r) + " |" for r in rows])


def grid_table(summary: dict[str, dict], lines: list) -> str:
    """The Table-1-shaped table: one line a setting (key, label, uniform policy, phases)."""
    policies = {line[2] for line in lines}
    rows = []
    for key, label, uniform, _ in lines:
        s = summary[key]
        name = f"{label} ({uniform} uniform groups)" if len(policies) > 1 else label
        if not math.isnan(s["late_clip_high"]):  # the automatic clip's: its mean, late
            name += f" (eps_high {s['run_clip_high']:.2f}, late {s['late_clip_high']:.2f})"
        rows.append([name, str(s["seeds"]), _syncs(s), f"{s['before']:.3f}", _after(s),
                     f"{s['peak']:.3f}", f"{s['rollout']:.1f}", f"{s['total']:.1f}",
                     f"{100 * s['run_clip_frac']:.3f}%", f"{100 * s['phase_end_clip_frac']:.3f}%",
                     f"{s['late_clip_frac_low']:.4f} / {s['late_clip_frac_high']:.4f}",
                     f"{s['late_veto_response_frac']:.3f}", f"{s['late_rho_neg_mean']:.3f}",
                     f"{s['late_abs_log_ratio_mean']:.3f}", f"{s['late_phase_abs_log_ratio']:.3f}",
                     f"{s['late_entropy_mean']:.3f}", f"{s['unused_frac']:.2f}"])
    return _markdown(["run", "seeds", "syncs", "held-out before", "held-out after", "peak",
                      "T_roll s", "T_total s", "clip (run)", "clip (phase end)",
                      "clip low / high (late)", "vetoed A<0 responses", "E[rho \\| A<0]",
                      "mean \\|log rho\\|", "late in a phase", "entropy", "unused"], rows)


def as_json(grid) -> dict:
    """A grid's settings as plain data (its rows by name)."""
    out = asdict(grid)
    out["rows"] = [[r["name"], seeds] for r, seeds in out["rows"]]
    return out


def plot(runs: dict[str, list[dict]], lines: list, path: Path) -> None:
    """Figures 2-3 of the paper: held-out accuracy (seed mean) and the drift curves (first
    seed, moving average), one line a setting."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    titles = dict(CURVES)
    fig, axes = plt.subplots(len(PLOTTED) + 1, 1, figsize=(8, 2.2 * (len(PLOTTED) + 1)),
                             sharex=True)
    for key, label, _, _ in lines:
        rs = runs[key]
        n = min(len(r["evals"]) for r in rs)
        xs = [u for u, _ in rs[0]["evals"][:n]]
        ys = [statistics.mean(r["evals"][i][1] for r in rs) for i in range(n)]
        (line,) = axes[0].plot(xs, ys, "o-", ms=3, lw=1.2, label=label)
        for ax, curve in zip(axes[1:], PLOTTED):
            pts = rs[0]["curves"][curve]
            if not pts:
                continue
            w = max(1, len(pts) // 32)  # a moving average over ~1/32 of the run
            vals = [v for _, v in pts]
            sm = [statistics.mean(vals[max(0, i - w + 1):i + 1]) for i in range(len(vals))]
            ax.plot([u for u, _ in pts], sm, lw=1, color=line.get_color())
    axes[0].set_title("held-out accuracy (mean@k, seed mean)", fontsize=9)
    axes[0].legend(fontsize=6)
    for ax, curve in zip(axes[1:], PLOTTED):
        ax.set_title(titles[curve] + " (first seed, moving average)", fontsize=9)
        if curve.startswith(("clip", "veto")):
            ax.set_yscale("symlog", linthresh=1e-4)
    axes[-1].set_xlabel("update")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=90)
    plt.close(fig)


def update_results_md(path: Path, section: str, tag: str = "", name: str = "paper_miniature"
                      ) -> None:
    """Replace a benchmark's marked section (``name``, one per ``--tag``) of RESULTS.md;
    appended the first time. ValueError where the markers enclose more than one section."""
    begin, end = f"<!-- {name}{tag}:begin -->", f"<!-- {name}{tag}:end -->"
    text = path.read_text() if path.exists() else "# Benchmark results\n"
    block = f"{begin}\n{section.strip()}\n{end}"
    if begin in text and end in text:
        head, rest = text.split(begin, 1)
        old, tail = rest.split(end, 1)
        headers = [line for line in old.splitlines() if line.startswith("## ")]
        if len(headers) > 1:  # a misplaced marker: what lies between is others' work
            raise ValueError(f"{path}: the markers {begin} .. {end} enclose {len(headers)} "
                             f"sections ({headers[0]!r}, {headers[1]!r}, ...), not this "
                             f"benchmark's one: move the markers around its own section")
        text = head + block + tail
    else:
        text = text.rstrip("\n") + "\n\n" + block + "\n"
    path.write_text(text)


def markdown_section(args, sft: dict, table: str, grid_seconds: float, cmd: str,
                     root: Path) -> str:
    g = args.grid
    by_k = ", ".join(f"{k} operands {v:.2f}" for k, v in sft.get("probe_by_operands", {}).items())
    kind = getattr(args, "task", "math")
    task = {"code": "`benchmarks/code_task.py` (programs run in the sandbox by `reward.name: code`)",
            "tools": "`benchmarks/tool_task.py` (the python tool runs in the code reward's sandbox)",
            }.get(kind, "`benchmarks/miniature_task.py`")
    probe = {"code": f"probe score {sft['probe_pass_rate']:.2f} (mean share of hidden cases "
                     "passed)",
             "tools": f"sampled probe accuracy {sft['probe_pass_rate']:.2f} with the tool",
             }.get(kind, f"probe pass rate {sft['probe_pass_rate']:.2f}: {by_k}")
    plot_rel = os.path.relpath(args.plot, root / "benchmarks")
    out_rel = os.path.relpath(args.out, root)
    return f"""## Mu-GRPO in miniature, grid `{args.grid_name}`: {g.what} (`benchmarks/paper_miniature.py`)

`{cmd}` ({grid_seconds / 60:.1f} minutes on this machine; raw numbers in `{out_rel}`).

Regime: lr {g.lr:g}, M = {g.mu}, {g.phases} phases of the large-mu rows, {g.updates} updates of
{g.samples_per_update} responses (G = {args.group_size}) in every row, phases sized for one pass
over their data, veto threshold {args.veto_threshold:g}. Policy: the committed SFT policy
(`{os.path.relpath(args.policy, root)}`, fingerprint {sft['fingerprint']}: the tiny Llama of
{task}, {sft['steps']} SFT steps, {probe}). Each run through `python -m mugrpo_megatron train`
(megatron-core learner, vLLM engine, fp32, one process). Held-out: mean@{args.eval_samples} at
temperature 1 on {args.eval_size} unseen problems, every {g.eval_every} updates (an extra weight
sync, not counted in the times). Seeds differ in prompt order, minibatches and sampling; the
policy is the same. "held-out after": seed mean ± standard deviation (min-max); syncs: weight
syncs for generation (seed mean and range where they differ: the drift-bounded rows); T_roll =
generation + scoring, T_total = T_roll + sync + switch + optimization (start-up and evaluation
excluded), seconds, seed mean. Clip (run): tokens clipped over all updates; clip (phase end):
over the last eighth of each phase's updates. Low / high clip, vetoed responses, E[rho | A<0],
|log rho| and entropy: means over the last quarter of updates; "late in a phase": mean |log rho|
over the last quarter of each phase's updates, the largest over the phases; unused: the share of
generated responses no update drew.

{table}

![curves]({plot_rel})
"""
