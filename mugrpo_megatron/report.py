"""The end-of-run report: a short Markdown summary and PNG plots, built from ``metrics.jsonl``.

Every number in it is read from what the run logged; nothing is computed from assumptions.
"""

from __future__ import annotations

import math
from pathlib import Path

from mugrpo_megatron.metrics import read_metrics

PLOTTED = [
    (("reward",), "reward (minibatch mean)"),
    (("grad_norm",), "gradient norm (before clipping)"),
    (("clip_frac_low", "clip_frac_high", "clip_frac_dual"),
     "clipped token fraction: low, high, dual (algo.clip_ratio_c)"),
    (("clip_high",), "upper clip eps_high (algo.clip_high: auto)"),
    (("veto_frac", "veto_response_frac"), "vetoed: token fraction, A < 0 response fraction"),
    (("rho_neg_mean",), "E[rho | A < 0]"),
    (("log_rho_neg_mean",), "mean log rho over A < 0 tokens"),
    (("rho_neg_below_half_frac",), "A < 0 tokens with rho < 0.5 (fraction)"),
    (("abs_log_ratio_mean",), "|log pi_theta - log pi_behav| (mean): the drift"),
    (("entropy_mean",), "policy entropy (mean over response tokens)"),
    (("turns", "tool_calls"), "tools: model turns and tool calls a response (rollout.tools)"),
    (("tool_token_frac",), "tools: share of a trajectory's tokens that are tool messages"),
]
"""The per-update curves: keys of an update record, one line each (a mean over no token is
absent from its record and leaves a gap, not a 0)."""


def write_report(run_dir: Path) -> Path:
    records = read_metrics(run_dir / "metrics.jsonl")
    updates = [r for r in records if r["kind"] == "update" and not r.get("reason")]
    phases = [r for r in records if r["kind"] == "phase"]
    evals = {r["label"]: r for r in records if r["kind"] == "eval"}
    plots = _plot(run_dir / "plots", updates, phases)
    lines = [f"# Run report: {run_dir}", ""]
    if evals:
        lines += ["## Held-out accuracy", "", "Each set's mean reward (mean@k, the same for every "
                  "k) and pass@k (the unbiased estimator) from n samples a prompt; a set with "
                  "several sources also by source.", "",
                  "| set | when | n | prompts | mean@k | pass@k |", "|---|---|---|---|---|---|"]
        for label in ("before", "after"):
            if label in evals:
                lines += _eval_rows(label, evals[label])
        lines.append("")
    if phases:
        lines += ["## Phases", "",
                  "| phase | updates (ended) | reward | uniform groups | unused | gen s | sync s | "
                  "switch s | optimize s | train/infer gap (mean / max) |",
                  "|---|---|---|---|---|---|---|---|---|---|"]
        sources = sorted({s for p in phases for s in p.get("reward_by_source", {})})
        if len(sources) > 1:
            lines[-2] += " reward by source |"
            lines[-1] += "---|"
        for p in phases:
            gap = (f"{p['logprob_gap_mean']:.2e} / {p['logprob_gap_max']:.2e}"
                   if "logprob_gap_mean" in p else "-")
            lines.append(f"| {p['phase']} | {p.get('updates', '-')} ({p.get('end', '-')}) | "
                         f"{p['reward_mean']:.3f} | {p['uniform_groups']} | "
                         f"{p.get('unused_frac', 0.0):.0%} | {p['generate_seconds']:.1f} | "
                         f"{p['sync_seconds']:.2f} | {p['switch_seconds']:.2f} | "
                         f"{p['optimize_seconds']:.1f} | {gap} |"
                         + (" " + ", ".join(f"{k} {v:.3f}" for k, v in
                                            sorted(p.get("reward_by_source", {}).items())) + " |"
                            if len(sources) > 1 else ""))
        tot = {k: sum(p[k] for p in phases) for k in
               ("generate_seconds", "score_seconds", "sync_seconds", "switch_seconds",
                "optimize_seconds")}
        total = sum(tot.values())
        if any("tool_calls" in p for p in phases):  # sampled with tools: each phase, 0s too
            lines += ["", "| phase | tool calls a response | failed | responses that called | "
                      "turns a response | tool tokens |", "|---|---|---|---|---|---|"]
            lines += [f"| {p['phase']} | {p.get('tool_calls', 0):.2f} | "
                      f"{p.get('tool_error_frac', 0):.0%} | "
                      f"{p.get('tool_call_response_frac', 0):.0%} | {p.get('turns', 1):.2f} | "
                      f"{p.get('tool_token_frac', 0):.0%} |" for p in phases]
        lines += ["", "Time split over all phases: " + ", ".join(
            f"{k.removesuffix('_seconds')} {v:.1f}s ({100 * v / total:.0f}%)"
            for k, v in tot.items()) if total else "", ""]
    lines += _failure_rows(phases, list(evals.values()))
    skipped = [r for r in records if r["kind"] == "update" and r.get("skipped")]
    lines += [f"Updates: {len(updates)} applied, {len(skipped)} skipped.", ""]
    if plots:
        lines += ["## Plots", ""] + [f"![{p.stem}](plots/{p.name})" for p in plots]
    out = run_dir / "report.md"
    out.write_text("\n".join(lines) + "\n")
    return out


def _eval_rows(label: str, e: dict) -> list[str]:
    """An eval record's table rows: each set, and each source of a set with several (a record of
    a run before named sets has the first set's numbers only)."""
    sets = e.get("sets") or {"held-out": {"samples": e["eval_k"], "prompts": e["eval_prompts"],
                                          f"mean@{e['eval_k']}": e["eval_mean_at_k"],
                                          f"pass@{e['eval_k']}": e["eval_pass_at_k"]}}
    rows = []
    for name, r in sets.items():
        for sub, numbers in [(name, r), *((f"{name} / {src}", v)
                                          for src, v in r.get("by_source", {}).items())]:
            ks = sorted(int(k.split("@")[1]) for k in numbers if k.startswith("pass@"))
            mean = numbers[f"mean@{ks[0]}"] if ks else float("nan")
            rows.append(f"| {sub} | {label} | {numbers['samples']} | {numbers['prompts']} | "
                        f"{mean:.3f} | " + ", ".join(f"@{k} {numbers[f'pass@{k}']:.3f}" for k in ks)
                        + " |")
    return rows


def _failure_rows(phases: list[dict], evals: list[dict]) -> list[str]:
    """A section on the responses whose reward failed (each scored 0), by phase and held-out
    evaluation, with their sources and first rows; none when every reward was computed."""
    rows = []
    for p in phases:
        failed = p.get("reward_errors", 0) + p.get("reward_timeouts", 0)
        if failed:
            rows.append((f"phase {p['phase']}", failed, p.get("reward_timeouts", 0),
                         p.get("reward_failures_by_source", {}),
                         p.get("reward_failure_examples", [])))
    for e in evals:
        for name, r in (e.get("sets") or {}).items():
            failed = r.get("reward_errors", 0) + r.get("reward_timeouts", 0)
            if failed:
                rows.append((f"held-out {name} ({e['label']})", failed, r.get("reward_timeouts", 0),
                             r.get("reward_failures_by_source", {}),
                             r.get("reward_failure_examples", [])))
    if not rows:
        return []
    out = ["## Reward failures", "",
           "Responses whose reward function raised, returned no valid number or ran past "
           "reward.timeout_s: each scored 0 (reward.on_error: zero).", "",
           "| where | failed | of them timed out | by source | first failures |",
           "|---|---|---|---|---|"]
    for where, failed, timeouts, by_source, examples in rows:
        sources = ", ".join(f"{s} {n}" for s, n in sorted(by_source.items()))
        first = "; ".join(examples[:3]).replace("|", "\\|")
        out.append(f"| {where} | {failed} | {timeouts} | {sources or '-'} | {first or '-'} |")
    return out + [""]


def _plot(out_dir: Path, updates: list[dict], phases: list[dict]) -> list[Path]:
    if not updates:
        return []
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out_dir.mkdir(parents=True, exist_ok=True)
    shown = [(keys, title) for keys, title in PLOTTED  # a curve the run has: no empty panels
             if any(key in r for r in updates for key in keys)]
    fig, axes = plt.subplots(len(shown) + 1, 1, figsize=(8, 2.2 * (len(shown) + 1)),
                             sharex=True)
    xs = [r["update"] for r in updates]
    for ax, (keys, title) in zip(axes, shown):
        for key in keys:
            ax.plot(xs, [r.get(key, math.nan) for r in updates], lw=1, label=key)
        if len(keys) > 1:
            ax.legend(fontsize=6)
        ax.set_title(title, fontsize=9)
        for p in phases:  # phase boundaries: where the behaviour policy is refreshed
            ax.axvline(p["update"], color="grey", lw=0.5, ls=":")
    gap_x = [p.get("first_update", p["update"]) for p in phases if "logprob_gap_mean" in p]
    axes[-1].plot(gap_x, [p["logprob_gap_mean"] for p in phases if "logprob_gap_mean" in p],
                  "o-", label="mean")
    axes[-1].plot(gap_x, [p["logprob_gap_max"] for p in phases if "logprob_gap_max" in p],
                  "s--", label="max")
    axes[-1].set_title("train/inference log-prob gap after each weight sync", fontsize=9)
    axes[-1].set_yscale("log")
    axes[-1].legend(fontsize=7)
    axes[-1].set_xlabel("update")
    fig.tight_layout()
    path = out_dir / "training.png"
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return [path]
