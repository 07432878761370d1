"""The paper's headline, measured cleanly in miniature: wall time to GRPO's accuracy.

GRPO mu=4 and Mu-GRPO (mu = M, [0, 5], suffix veto) in the paper-calibrated regime
(``miniature_grids.CALIBRATION``: lr 1e-5, M = 32, 4 phases, 128 updates of 32), from the committed
SFT policy, run one at a time as interleaved pairs (GRPO, Mu-GRPO, GRPO, ...; pair i at seed i),
each through ``python -m mugrpo_megatron train`` with its threads pinned (``--threads``, the
rest of the machine left alone: run nothing else meanwhile).

For each run, a training clock: from the end of its 'before' evaluation, less every evaluation
and checkpoint since (their seconds are in the run's records: cadence, not the algorithm's
cost). For each pair: the clock when each run's held-out curve (mean@4 on 256 problems, every
16 updates) first reaches the GRPO run's final accuracy, and their ratio (GRPO / Mu-GRPO: > 1 is
Mu-GRPO faster); where each run's time went (generate, score, sync, switch, the reference and
check passes, optimize, and the phase's own overhead: opening, writing and indexing its files,
plans); min / median / max of the ratio over pairs. JSON of every run and the table, and with
``--results-md`` a section of benchmarks/RESULTS.md.

    python benchmarks/time_to_accuracy.py --pairs 3 --results-md benchmarks/RESULTS.md
    python benchmarks/time_to_accuracy.py --quick   # one small pair: the script works (CI)
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
import miniature_report as report  # noqa: E402
import paper_miniature  # noqa: E402
from miniature_grids import CALIBRATION, GRPO4, MUGRPO, Grid, Job  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
PARTS = ("generate", "score", "sync", "switch", "reference", "check", "optimize", "overhead")
"""Where a run's training clock went (score: the leader blocked on its reward pool, inside
generate; overhead: the phase's wall less the other parts)."""


def clock(run_dir: Path) -> dict:
    """A run's training clock at each held-out point, its accuracy there, and its parts."""
    recs = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    evals = [r for r in recs if r["kind"] == "eval"]
    phases = [r for r in recs if r["kind"] == "phase"]
    t0 = evals[0]["time"]  # the 'before' evaluation ends: training starts
    points, excluded = [], 0.0
    saves = sorted((r["time"], r.get("save_seconds", 0.0)) for r in phases)
    for e in evals[1:]:
        excluded += e["seconds"]
        saved = sum(s for t, s in saves if t <= e["time"])
        points.append((e["update"], e["time"] - t0 - excluded - saved, e["eval_mean_at_k"]))
    parts = {k: sum(p.get(f"{k}_seconds") or 0.0 for p in phases) for k in PARTS[:-1]}
    parts["overhead"] = sum(p["wall_seconds"] - sum(p.get(f"{k}_seconds") or 0.0 for k in
                                                    ("generate", "sync", "switch", "reference",
                                                     "check", "optimize", "save"))
                            for p in phases)
    updates = sum(p["updates"] for p in phases)
    return {"points": points, "before": evals[0]["eval_mean_at_k"], "parts": parts,
            "phases": len(phases), "updates": updates,
            "optimize_per_update": parts["optimize"] / max(updates, 1),
            "save_seconds": sum(s for _, s in saves),
            "train_seconds": points[-1][1] if points else 0.0}


def reached(points: list[tuple[int, float, float]], target: float) -> float | None:
    """The clock at the first held-out point at or above ``target`` (None: never)."""
    return next((t for _, t, acc in points if acc >= target - 1e-12), None)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--pairs", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2, help="OMP threads of each run")
    ap.add_argument("--quick", action="store_true", help="one small pair (CI): the script works")
    ap.add_argument("--work-dir", help="keep the runs here (default: a temporary directory)")
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "time_to_accuracy.json"))
    ap.add_argument("--results-md", help="replace this script's section of this Markdown file")
    args = ap.parse_args(argv)
    regime = dict(CALIBRATION)
    eval_every = 16
    if args.quick:
        regime.update(mu=8, phases=1, samples_per_update=16)
        args.pairs, eval_every = 1, 4
    grid = Grid("time", "GRPO mu=4 against Mu-GRPO", ((GRPO4, args.pairs), (MUGRPO, args.pairs)),
                eval_every=eval_every, **regime)
    # the committed policy's held-out set (its fingerprint covers the split sizes)
    margs = paper_miniature.parse_args(["--grid", "custom", "--eval-size", "256"])
    margs.grid, margs.jobs = grid, 1
    import torch

    torch.set_num_threads(args.threads)
    t_start = time.perf_counter()
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(args.work_dir or tmp)
        data = work / "data"
        data.mkdir(parents=True, exist_ok=True)
        paper_miniature.miniature_task.write_splits(
            data, seed=0, num_train=paper_miniature.NUM_TRAIN, num_eval=margs.eval_size,
            num_probe=paper_miniature.NUM_PROBE)
        policy, _ = paper_miniature.starting_policy(margs)
        os.environ["OMP_NUM_THREADS"] = str(args.threads)
        pairs = []
        for seed in range(1, args.pairs + 1):
            pair = {}
            for row in (GRPO4, MUGRPO):  # interleaved: GRPO, Mu-GRPO, GRPO, ...
                mu = grid.mu if row.large_mu else 4
                job = Job(row, mu, "keep", seed)
                run_dir = work / "runs" / f"{job.key}_s{seed}"
                r = paper_miniature.run_job(job, policy, data, run_dir, margs)
                pair[row.name] = {"wall": r["wall"], **clock(run_dir)}
                print(f"[{row.name} seed {seed}] train clock {pair[row.name]['train_seconds']:.0f}s,"
                      f" held-out {pair[row.name]['before']:.3f} -> "
                      f"{pair[row.name]['points'][-1][2]:.3f}", flush=True)
            g, m = pair[GRPO4.name], pair[MUGRPO.name]
            target = g["points"][-1][2]
            pair.update(target=target, t_grpo=reached(g["points"], target),
                        t_mugrpo=reached(m["points"], target))
            pair["ratio"] = pair["t_grpo"] / pair["t_mugrpo"] if pair["t_mugrpo"] else None
            pairs.append(pair)
    table = render(pairs)
    print(table)
    ratios = [p["ratio"] for p in pairs if p["ratio"] is not None]
    out = {"regime": regime, "eval_every": eval_every, "threads": args.threads, "pairs": pairs,
           "ratio": {"min": min(ratios), "median": statistics.median(ratios), "max": max(ratios)}
           if ratios else None, "seconds": time.perf_counter() - t_start}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(out, indent=1))
    if args.results_md:
        cmd = "python benchmarks/time_to_accuracy.py " + " ".join(argv if argv is not None
                                                                   else sys.argv[1:])
        section = (f"## Time to GRPO's accuracy (`benchmarks/time_to_accuracy.py`)\n\n`{cmd.strip()}`"
                   f" ({out['seconds'] / 60:.1f} minutes, runs one at a time, "
                   f"{args.threads} threads each, nothing else running).\n\n{table}\n")
        report.update_results_md(Path(args.results_md), section, "_time_to_accuracy")
    return 0


def render(pairs: list[dict]) -> str:
    """The pairs' table and the parts of each run's clock."""
    rows = []
    for i, p in enumerate(pairs, 1):
        g, m = p[GRPO4.name], p[MUGRPO.name]

        def fmt(t):
            return f"{t:.0f}" if t is not None else "not reached"

        rows.append([str(i), f"{p['target']:.3f}", fmt(p["t_grpo"]), fmt(p["t_mugrpo"]),
                     f"{p['ratio']:.2f}" if p["ratio"] else "-",
                     f"{g['train_seconds']:.0f} / {m['train_seconds']:.0f}",
                     f"{g['points'][-1][2]:.3f} / {m['points'][-1][2]:.3f}",
                     f"{g['optimize_per_update']:.3f} / {m['optimize_per_update']:.3f}"])
    text = report._markdown(["pair (seed)", "GRPO's final accuracy", "GRPO s to it",
                             "Mu-GRPO s to it", "ratio", "whole run s (GRPO / Mu-GRPO)",
                             "final accuracy (GRPO / Mu-GRPO)", "optimize s an update"], rows)
    ratios = [p["ratio"] for p in pairs if p["ratio"] is not None]
    if ratios:
        text += (f"\n\nratio over {len(ratios)} pair(s): min {min(ratios):.2f}, median "
                 f"{statistics.median(ratios):.2f}, max {max(ratios):.2f}")
    split = []
    for i, p in enumerate(pairs, 1):
        for name in (GRPO4.name, MUGRPO.name):
            r = p[name]
            split.append([f"{i} {name}", str(r["phases"]), *(f"{r['parts'][k]:.1f}" for k in PARTS),
                          f"{r['save_seconds']:.1f}"])
    return text + "\n\nWhere each run's clock went, seconds over the whole run (checkpoints apart: " \
        "not on the clock):\n\n" + report._markdown(
            ["run", "phases", *PARTS, "checkpoints"], split)


if __name__ == "__main__":
    raise SystemExit(main())
