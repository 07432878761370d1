"""Mu-GRPO's claims in miniature: the paper's grid through the real trainer, on 2 CPU cores.

1. The policy: a tiny Llama SFT'd on chained single-digit arithmetic (``miniature_task``) to a
   sampled probe pass rate of ``--sft-target``, committed and fingerprinted
   (``benchmarks/miniature_policy_grid``; ``--quick``: ``benchmarks/miniature_policy``), so that
   every grid starts from the same model on any machine.
2. A sub-grid (``--grid``, ``miniature_grids.GRIDS``): rows of settings at a regime, each row at
   its number of seeds, all with the same total updates (phases x M) and update size, each run
   through ``python -m mugrpo_megatron train`` (the megatron-core learner and the vLLM engine
   users get; ``paper_miniature.yaml`` plus the row's overrides). Every sub-grid runs alone in
   under an hour on 2 cores.
3. Its table (held-out accuracy as a seed mean with its spread, syncs, times, the drift numbers)
   and curves (PNG), and with ``--results-md`` its own section of benchmarks/RESULTS.md.

    python benchmarks/paper_miniature.py --grid today --results-md benchmarks/RESULTS.md
    python benchmarks/paper_miniature.py --quick        # ~1 min: the signal is there (CI)
    python benchmarks/paper_miniature.py --grid custom --rows grpo_mu4,grpo_muM --seeds 1 \
        --lr 3e-5 --mu 64 --phases 4                  # an ad-hoc grid (a calibration run)
    python benchmarks/paper_miniature.py --make-policy DIR --eval-size 256

``--task code`` runs the same on the code task (``code_task``: a Python function written from
three of its values, scored on hidden cases by ``reward.name: code`` with every program in the
OS sandbox) from ``benchmarks/code_policy`` (remade by ``--task code --make-policy
benchmarks/code_policy``), its grids ``miniature_grids.CODE_GRIDS``:

    python benchmarks/paper_miniature.py --task code --grid code --results-md benchmarks/RESULTS.md

``--quick`` runs only Mu-GRPO, with two seeds and one phase, from the committed quick policy
(1,000 SFT steps, 3 minutes on two threads and over 10 on one beside another test, which the
suite would otherwise spend at every run; 1.5 MB), and exits non-zero unless the initial held-out
pass rate is in [0.2, 0.6] and Mu-GRPO improves it by more than the spread of its two seeds. A
policy records a fingerprint of what made it (the task's and the SFT's code, the split sizes and
the target); one whose fingerprint differs from this script's is refused, with the command that
makes it again.
"""

from __future__ import annotations

import argparse
import hashlib
import inspect
import json
import os
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
import code_task  # noqa: E402
import miniature_report as report  # noqa: E402
import miniature_task  # noqa: E402
import tool_task  # noqa: E402
from common import write_json  # noqa: E402
from miniature_grids import (  # noqa: E402
    CODE_GRIDS,
    GRIDS,
    MUGRPO,
    TOOL_GRIDS,
    Grid,
    Job,
    jobs_for,
    row,
)

ROOT = Path(__file__).resolve().parents[1]
BASE_CONFIG = Path(__file__).with_suffix(".yaml")
QUICK_POLICY = ROOT / "benchmarks" / "miniature_policy"
GRID_POLICY = ROOT / "benchmarks" / "miniature_policy_grid"
"""The committed SFT policies every grid starts from (``--quick``: made for 128 held-out
problems; the grids: 256). SFT on a CPU does not reproduce across machines to the step at which
the probe first crosses its target (float sums differ, the probe samples), so a grid that made
its own policy anew each time would start from a different model; these are fingerprinted and
committed instead, and ``--make-policy`` makes a new one on purpose."""
CODE_POLICY = ROOT / "benchmarks" / "code_policy"
"""The code task's committed SFT policy (``--task code``; ``code_task``)."""
CODE_SETS = {"reward.name": "code", "reward.batch_responses": 1,
             "rollout.max_new_tokens": code_task.MAX_NEW_TOKENS, "data.max_prompt_tokens": 40}
"""``--task code``'s settings over the base config: the code reward (each response its own
scoring task, so a slow program holds up no other), room for the longest worked program."""
TOOL_POLICY = ROOT / "benchmarks" / "tool_policy"
"""The tool task's committed SFT policy (``--task tools``; ``tool_task``)."""
TOOL_SETS = {"rollout.tools": "[python]", "rollout.max_turns": 2, "rollout.tool_workers": 2,
             "rollout.max_new_tokens": tool_task.MAX_NEW_TOKENS, "data.chat_template": "true",
             "data.prompt_template": "{prompt}", "data.max_prompt_tokens": 48}
"""``--task tools``'s settings over the base config: the python tool (two turns: a call, then
the answer), the chat template that renders its messages, room for both turns."""
TASK_SETS = {"code": CODE_SETS, "tools": TOOL_SETS, "math": {}}
TASK_POLICIES = {"code": CODE_POLICY, "tools": TOOL_POLICY, "math": GRID_POLICY}
TASK_GRIDS = {"code": CODE_GRIDS, "tools": TOOL_GRIDS, "math": GRIDS}
PASS_RANGE = (0.2, 0.6)
NUM_TRAIN, NUM_PROBE = 8000, 128
QUICK = Grid("quick", "the signal is there: Mu-GRPO, one phase", ((MUGRPO, 2),), lr=1e-4, mu=32,
             phases=1, samples_per_update=64, eval_every=0)
"""--quick's grid (the lr and update size the committed quick policy was checked at)."""


def run_job(job: Job, model: Path, data: Path, run_dir: Path, args) -> dict:
    """One training run through the package's CLI; its metrics, read back from metrics.jsonl."""
    r, seed, mu, grid = job.row, job.seed, job.mu, args.grid
    sets = {
        "model.path": model, "data.path": data / "train.jsonl", "data.eval_path": data / "eval.jsonl",
        "data.eval_size": args.eval_size, "eval.samples": args.eval_samples,
        "rollout.group_size": args.group_size, "algo.total_updates": grid.updates,
        "algo.updates_per_phase": mu, "algo.samples_per_update": grid.samples_per_update,
        "algo.prompts_per_phase": mu * grid.samples_per_update // args.group_size,
        "algo.clip_low": r.clip[0], "algo.clip_high": r.clip[1],
        "algo.veto_threshold": "null" if r.veto is None else args.veto_threshold,
        "algo.veto_scope": r.veto or "none", "algo.uniform_groups": job.uniform,
        "algo.seed": seed, "rollout.seed": seed,
        "optim.lr": grid.lr, "logging.eval_every_updates": grid.eval_every,
        "logging.run_dir": run_dir,
        **TASK_SETS[args.task],
    }
    if r.max_drift is not None:
        sets["algo.max_drift"] = r.max_drift
    if r.prefix_bound is not None:
        sets["algo.veto_prefix_bound"] = r.prefix_bound
    sets.update(r.extra)
    cmd = [sys.executable, "-m", "mugrpo_megatron", "train", "--config", str(BASE_CONFIG)]
    cmd += [a for k, v in sets.items() for a in ("--set", f"{k}={v}")]
    env = dict(os.environ, PYTHONWARNINGS="ignore")
    if args.jobs > 1:  # runs side by side share the cores: one thread each
        env["OMP_NUM_THREADS"] = "1"
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True)
    wall = time.perf_counter() - t0
    if proc.returncode:
        raise SystemExit(f"{r.name} seed {seed} failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")
    return {"row": r.name, "key": job.key, "seed": seed, "mu": mu, "uniform": job.uniform,
            "wall": wall, **report.read_run(run_dir)}


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--task", default="math", choices=["math", "code", "tools"],
                    help="the arithmetic miniature (miniature_task), the code one (code_task: "
                         "programs run in the sandbox by reward.name: code) or the tool one "
                         "(tool_task: multiplication with the python tool)")
    ap.add_argument("--grid", choices=[*GRIDS, *CODE_GRIDS, *TOOL_GRIDS, "custom"],
                    help="the sub-grid to run (miniature_grids.py); 'custom': --rows at --seeds "
                         "with the regime flags")
    ap.add_argument("--quick", action="store_true",
                    help="Mu-GRPO only, 2 seeds, one phase, from the committed SFT policy: "
                         "checks the signal in about a minute")
    ap.add_argument("--rows", default="grpo_mu4,mugrpo",
                    help="--grid custom: comma-separated rows (miniature_grids.row)")
    ap.add_argument("--seeds", type=int, default=1, help="--grid custom: seeds of every row")
    # the regime: a named grid's own, unless given
    ap.add_argument("--lr", type=float)
    ap.add_argument("--mu", type=int, help="M: updates per phase of the large-mu rows")
    ap.add_argument("--phases", type=int,
                    help="phases of the large-mu rows; every row makes phases x M updates")
    ap.add_argument("--samples-per-update", type=int)
    ap.add_argument("--eval-every", type=int, help="held-out curve resolution, updates")
    ap.add_argument("--group-size", type=int, default=8)
    ap.add_argument("--veto-threshold", type=float, default=1e-4)
    ap.add_argument("--jobs", type=int, default=1,
                    help="training runs side by side (times are comparable only with 1)")
    ap.add_argument("--eval-size", type=int,
                    help="held-out problems (default: 256; --task code: 128, each program run "
                         "on 4 cases in the sandbox)")
    ap.add_argument("--eval-samples", type=int, default=4)
    ap.add_argument("--sft-target", type=float, default=0.3,
                    help="sampled probe pass rate at which SFT stops")
    ap.add_argument("--policy", help="start from this SFT policy (default: the committed one, "
                                     "benchmarks/miniature_policy_grid; --quick's: "
                                     "benchmarks/miniature_policy)")
    ap.add_argument("--make-policy", metavar="DIR",
                    help="only make the SFT policy, into DIR (new, or one this script made)")
    ap.add_argument("--work-dir", help="keep the data and run directories here "
                                       "(default: a temporary directory, removed at the end)")
    ap.add_argument("--tag", help="names this grid's output files and RESULTS.md section "
                                  "(default: the grid's name)")
    ap.add_argument("--out", help="JSON of every run (default: results/paper_miniature_{tag}.json)")
    ap.add_argument("--plot", help="PNG of the curves (default: results/paper_miniature_{tag}.png)")
    ap.add_argument("--results-md", help="replace this grid's section of this Markdown file "
                                         "(benchmarks/RESULTS.md) with its table and plot")
    args = ap.parse_args(argv)
    if args.grid is None:
        args.grid = {"code": "code", "tools": "tools"}.get(args.task, "today")
    if args.eval_size is None:
        args.eval_size = {"code": 128, "tools": 64}.get(args.task, 256)
    if args.quick:
        grid, args.grid_name = QUICK, "quick"
        args.eval_size, args.jobs = min(args.eval_size, 128), 2
        args.policy = args.policy or str(QUICK_POLICY)
    elif args.grid == "custom":
        try:
            rows = tuple((row(n), args.seeds) for n in args.rows.split(","))
        except ValueError as e:
            ap.error(f"--rows: {e}")
        grid, args.grid_name = Grid("custom", f"rows {args.rows}", rows), "custom"
    else:
        grids = TASK_GRIDS[args.task]
        if args.grid not in grids:
            ap.error(f"--grid {args.grid} is not a grid of --task {args.task}: {', '.join(grids)}")
        grid, args.grid_name = grids[args.grid], args.grid
    given = {k: getattr(args, k) for k in ("lr", "mu", "phases", "samples_per_update",
                                           "eval_every") if getattr(args, k) is not None}
    args.grid = replace(grid, **given)
    args.policy = args.policy or str(TASK_POLICIES[args.task])
    args.tag = args.tag if args.tag is not None else f"_{args.grid_name.replace('-', '_')}"
    results = ROOT / "benchmarks" / "results"
    args.out = args.out or str(results / f"paper_miniature{args.tag}.json")
    args.plot = args.plot or str(results / f"paper_miniature{args.tag}.png")
    g = args.grid
    if g.mu % 4 or (g.mu * g.samples_per_update) % args.group_size:
        ap.error("--mu must be a multiple of 4 (GRPO's mu), and --mu x --samples-per-update of "
                 "--group-size")
    if any(g.updates % n or (g.updates // n) % 4 for n in g.phase_sweep):
        ap.error(f"the phase sweep must split the {g.updates} updates into phases of a multiple "
                 f"of 4")
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    t_start = time.perf_counter()
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(args.work_dir or tmp)
        data = work / "data"
        data.mkdir(parents=True, exist_ok=True)
        splits = task_module(args).write_splits(data, seed=0, num_train=NUM_TRAIN,
                                                num_eval=args.eval_size, num_probe=NUM_PROBE)
        import torch

        # --quick runs in the test suite beside another test file: one thread, so that a busy
        # machine slows it in proportion (two threads stalled on each other's preempted core:
        # 5x slower beside another process)
        torch.set_num_threads(1 if args.quick else 2)
        if args.make_policy:
            make_policy(Path(args.make_policy), args, splits)
            return 0
        policy, sft_info = starting_policy(args)
        jobs, lines = jobs_for(args.grid)
        print(f"grid {args.grid_name}: {len(jobs)} runs of {args.grid.updates} updates, from "
              f"{policy}", flush=True)

        def one(job: Job):
            r = run_job(job, policy, data, work / "runs" / f"{job.key}{args.tag}_s{job.seed}", args)
            print(f"[{job.key} seed {job.seed}] held-out {r['evals'][0][1]:.3f} -> "
                  f"{r['evals'][-1][1]:.3f}, {r['syncs']} syncs, total {r['total']:.0f}s (wall "
                  f"{r['wall']:.0f}s), late-in-phase |log rho| {r['late_phase_abs_log_ratio']:.3f}",
                  flush=True)
            return r

        with ThreadPoolExecutor(max_workers=args.jobs) as pool:  # each job is a subprocess
            results = list(pool.map(one, jobs))
        runs: dict[str, list[dict]] = {}
        for job, r in zip(jobs, results):
            runs.setdefault(job.key, []).append(r)
    grid_seconds = time.perf_counter() - t_start
    summary = {key: report.summarize(rs) for key, rs in runs.items()}
    table = report.grid_table(summary, lines)
    print(table)
    print(f"grid time {grid_seconds / 60:.1f} min")
    write_json(args.out, {"args": {k: v for k, v in vars(args).items() if k != "grid"},
                          "grid": report.as_json(args.grid), "sft": sft_info,
                          "grid_seconds": grid_seconds, "lines": lines, "summary": summary,
                          "runs": runs}, compact=True)
    if not args.quick:
        report.plot(runs, lines, Path(args.plot))
    if args.results_md:
        cmd = "python benchmarks/paper_miniature.py " + " ".join(argv if argv is not None else sys.argv[1:])
        report.update_results_md(Path(args.results_md), report.markdown_section(
            args, sft_info, table, grid_seconds, cmd.strip(), ROOT), args.tag)
    if args.quick:
        return quick_checks(summary[lines[0][0]])
    return 0


def task_module(args):
    return {"code": code_task, "tools": tool_task}.get(args.task, miniature_task)


def policy_fingerprint(args) -> str:
    """A digest of what the SFT policy depends on: the task's and the SFT's code, the split sizes
    (the train split is drawn after the held-out and probe ones, so it moves with --eval-size),
    the seed and the target."""
    mt = miniature_task
    code = [inspect.getsource(f) for f in (mt.make_problem, mt.write_splits, mt.make_tokenizer,
                                           mt.sft_policy, mt.sft_loss, mt.probe_pass_rate)]
    if args.task == "code":
        ct = code_task
        code = [inspect.getsource(f) for f in (ct.program, ct.make_problem, ct.write_splits,
                                               ct.sft_policy, ct.probe_score, mt.make_tokenizer,
                                               mt.sft_loss)]
        code.append(repr((ct.SHOWN, ct.HIDDEN, ct.MAX_NEW_TOKENS)))
    if args.task == "tools":
        tt = tool_task
        code = [inspect.getsource(f) for f in (tt.make_problem, tt.write_splits, tt.make_tokenizer,
                                               tt.sft_policy, tt.probe_score, tt._sample,
                                               mt.make_tokenizer)]
        code.append(repr((tt.LAYERS, tt.MAX_NEW_TOKENS, tt.CALL)))
    setting = json.dumps({"prompt": mt.PROMPT_TEMPLATE, "specials": mt.SPECIAL_TOKENS, "seed": 0,
                          "train": NUM_TRAIN, "eval": args.eval_size, "probe": NUM_PROBE,
                          "target": args.sft_target})
    return hashlib.sha256("\n".join([*code, setting]).encode()).hexdigest()[:16]


def starting_policy(args) -> tuple[Path, dict]:
    """The SFT policy the grid starts from (``--policy``, the committed one by default) and what
    its SFT reported; SystemExit, with the command that makes it again, unless it was made for
    this script's data and code."""
    want = policy_fingerprint(args)
    path = Path(args.policy)
    made = path / "sft.json"
    info = json.loads(made.read_text()) if made.exists() else {}
    if info.get("fingerprint") != want:
        raise SystemExit(
            f"--policy {path}: made for other data or SFT code (fingerprint "
            f"{info.get('fingerprint', f'none: no {made}')}, this script's {want}); make it again "
            f"with: python benchmarks/paper_miniature.py --task {args.task} --make-policy {path} "
            f"--eval-size "
            f"{args.eval_size} --sft-target {args.sft_target}")
    print(f"starting from the SFT policy in {path}", flush=True)
    return path, info


def make_policy(path: Path, args, splits, **sft_options) -> dict:
    """SFT a new policy into ``path`` (an empty or new directory, or a policy this script made,
    which it replaces) and record what made it in ``sft.json``. ``sft_options`` go to
    ``sft_policy`` (the tests' smaller batches, not in the fingerprint; the script passes none)."""
    import torch
    import transformers

    if path.exists() and any(path.iterdir()) and not (path / "sft.json").exists():
        raise SystemExit(f"{path} holds files this script did not make; choose a new directory")
    sft = task_module(args).sft_policy(path, splits["train"], splits["probe"],
                                       target=args.sft_target,
                                       log=lambda m: print(m, flush=True), **sft_options)
    info = {"fingerprint": policy_fingerprint(args), "steps": sft.steps, "seconds": sft.seconds,
            "probe_pass_rate": sft.probe_pass_rate, "probe_by_operands": sft.probe_by_operands,
            "made_with": {"torch": torch.__version__, "transformers": transformers.__version__,
                          "threads": torch.get_num_threads(), "eval_size": args.eval_size}}
    (path / "sft.json").write_text(json.dumps(info, indent=1) + "\n")
    return info


def quick_checks(s: dict) -> int:
    failures = []
    if not PASS_RANGE[0] <= s["before"] <= PASS_RANGE[1]:
        failures.append(f"initial held-out pass rate {s['before']:.3f} is outside {PASS_RANGE}")
    gain, spread = s["after"] - s["before"], s["after_max"] - s["after_min"]
    if not gain > spread:
        failures.append(f"Mu-GRPO's gain {gain:.3f} is not above the seed-to-seed spread {spread:.3f}")
    for f in failures:
        print(f"CHECK FAILED: {f}")
    if not failures:
        print(f"checks passed: start {s['before']:.3f} in {PASS_RANGE}; gain {gain:.3f} > spread "
              f"{spread:.3f}")
    return 1 if failures else 0


if __name__ == "__main__":
    raise SystemExit(main())
