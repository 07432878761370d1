"""GRPO (mu = 4) against Mu-GRPO (a few phases) on the same model, prompts, updates and seed.

Both runs make the same number of updates over the same number of freshly generated responses
(one epoch of each phase's data); only how often the behaviour policy is refreshed differs. The
ratio of total wall times is the project's own speedup figure. Each configuration is run
``--repeats`` times; medians and the spread are reported.

    python benchmarks/grpo_vs_mugrpo.py [--model tiny|DIR] [--updates 32] [--mu 16] [--repeats 3]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from common import summarize, table, write_json  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]


def run(model: Path, run_dir: Path, mu: int, args) -> dict:
    g, per_update = args.group_size, args.samples_per_update
    sets = {
        "model.path": model, "model.dtype": "float32", "parallel.micro_batch_size": 8,
        "parallel.distributed_optimizer": "false",
        "rollout.group_size": g, "rollout.max_new_tokens": args.max_new_tokens,
        "rollout.shard_prompts": 1024, "rollout.mismatch_check_samples": 0,
        "algo.total_updates": args.updates, "algo.updates_per_phase": mu,
        "algo.prompts_per_phase": per_update * mu // g, "algo.samples_per_update": per_update,
        "algo.uniform_groups": "keep", "algo.seed": args.seed, "optim.lr": args.lr,
        "data.num_arithmetic_problems": 4096, "data.eval_path": "builtin:arithmetic",
        "data.eval_size": args.eval_size, "checkpoint.save_every_updates": 0,
        "checkpoint.keep_last": 1, "logging.run_dir": run_dir, "logging.progress": "false",
        "logging.tensorboard": "false",
    }
    if args.config:
        cmd = [sys.executable, "-m", "mugrpo_megatron", "train", "--config", args.config]
    else:
        cmd = [sys.executable, "-m", "mugrpo_megatron", "train"]
    cmd += [a for k, v in sets.items() for a in ("--set", f"{k}={v}")]
    env = dict(os.environ, PYTHONWARNINGS="ignore")
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True)
    if proc.returncode:
        raise SystemExit(f"run failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")
    recs = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    phases = [r for r in recs if r["kind"] == "phase"]
    evals = {r["label"]: r for r in recs if r["kind"] == "eval"}
    parts = {k: sum(p[f"{k}_seconds"] for p in phases)
             for k in ("generate", "score", "sync", "switch", "optimize")}
    return {**parts, "total": sum(parts.values()), "syncs": len(phases),
            "final_reward": phases[-1]["reward_mean"],
            "eval_before": evals["before"]["eval_mean_at_k"],
            "eval_after": evals["after"]["eval_mean_at_k"]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="tiny", help="'tiny' (random Llama made here) or an HF dir")
    ap.add_argument("--config", help="base YAML config (e.g. configs/demo_cpu.yaml for the demo model)")
    ap.add_argument("--updates", type=int, default=32)
    ap.add_argument("--mu", type=int, default=16, help="Mu-GRPO's updates per phase")
    ap.add_argument("--samples-per-update", type=int, default=32)
    ap.add_argument("--group-size", type=int, default=8)
    ap.add_argument("--max-new-tokens", type=int, default=24)
    ap.add_argument("--eval-size", type=int, default=32)
    ap.add_argument("--lr", type=float, default=1e-4)
    ap.add_argument("--seed", type=int, default=1234)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "grpo_vs_mugrpo.json"))
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        model = Path(args.model)
        if args.model == "tiny":
            from mugrpo_megatron.models.tiny import make_tiny_checkpoint

            model = make_tiny_checkpoint(Path(tmp) / "model", "llama", seed=0)
        results = {"grpo_mu4": [], f"mugrpo_mu{args.mu}": []}
        for rep in range(args.repeats):  # interleaved so machine noise hits both alike
            for name, mu in (("grpo_mu4", 4), (f"mugrpo_mu{args.mu}", args.mu)):
                r = run(model, Path(tmp) / f"{name}_{rep}", mu, args)
                results[name].append(r)
                print(f"[{name} #{rep}] total {r['total']:.1f}s", flush=True)
    keys = ["total", "generate", "score", "sync", "switch", "optimize"]
    med = {n: {k: summarize([r[k] for r in rs]) for k in keys} for n, rs in results.items()}
    rows = []
    for n, rs in results.items():
        rows.append([n, rs[0]["syncs"]] + [med[n][k]["median"] for k in keys]
                    + [f"{med[n]['total']['min']:.1f}-{med[n]['total']['max']:.1f}",
                       summarize([r["final_reward"] for r in rs])["median"],
                       summarize([r["eval_after"] for r in rs])["median"]])
    print(table(["run", "syncs", "total s", "gen s", "score s", "sync s", "switch s", "opt s",
                 "total range", "final reward", "held-out after"], rows))
    a, b = results["grpo_mu4"], results[f"mugrpo_mu{args.mu}"]
    speedup = med["grpo_mu4"]["total"]["median"] / med[f"mugrpo_mu{args.mu}"]["total"]["median"]
    per_rep = [x["total"] / y["total"] for x, y in zip(a, b)]
    print(f"speedup of Mu-GRPO over GRPO in total time: {speedup:.2f}x "
          f"(per repeat {', '.join(f'{s:.2f}' for s in per_rep)})")
    write_json(args.out, {"args": vars(args), "runs": results, "medians": med,
                          "speedup_total": speedup, "speedup_per_repeat": per_rep})


if __name__ == "__main__":
    main()
