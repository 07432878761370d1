"""Mu-GRPO's claims in miniature: the paper's grid through the real trainer, on 2 CPU cores.

1. Make a policy with a learning signal (``miniature_task``): a tiny Llama, SFT'd on chained
   single-digit arithmetic until its sampled pass rate reaches ``--sft-target``.
2. Run each row of the grid through ``python -m mugrpo_megatron train`` (the megatron-core
   learner and the vLLM engine users get; ``paper_miniature.yaml`` plus the row's overrides),
   all rows with the same total updates (``--phases`` x M) and samples per update:
     GRPO mu=4 [0.8, 1.2] | GRPO mu=M [0.8, 1.2] | mu=M [0, 5] no veto |
     mu=M [0, 5] veto on triggers | Mu-GRPO: mu=M [0, 5] suffix veto |
     suffix without triggers | whole sequence.
   The two headline rows (GRPO mu=4, Mu-GRPO) run with ``--seeds`` seeds, and with
   ``--uniform-compare`` under the other two uniform-group policies as well
   (``algo.uniform_groups``, ``--uniform-seeds`` seeds). ``--phase-sweep 2,4,8,16`` adds
   Mu-GRPO at those phase counts, equal total updates (the paper's first open question).
3. Write the Table-1-shaped table, the other two tables and the curves of Figures 2-3 (PNG), and
   with ``--results-md`` replace this benchmark's section of benchmarks/RESULTS.md.

    python benchmarks/paper_miniature.py                  # the full grid (~60 min on 2 cores)
    python benchmarks/paper_miniature.py --quick          # ~1 min: the signal is there (CI)
    python benchmarks/paper_miniature.py --make-policy benchmarks/miniature_policy --eval-size 128

``--quick`` runs only Mu-GRPO, with two seeds and one phase, from the SFT policy committed in
``benchmarks/miniature_policy`` (made by the last command: 1,000 SFT steps, 3 minutes on two
threads and over 10 on one beside another test, which the suite would otherwise spend at every
run; 1.5 MB), and exits non-zero unless the initial held-out pass rate is in [0.2, 0.6] and
Mu-GRPO improves it by more than the spread of its two seeds. A policy
records a fingerprint of what made it (the task's and the SFT's code, the split sizes and the
target); one whose fingerprint differs from this script's is refused, with the command that makes
it again.
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
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
import miniature_report as report  # noqa: E402
import miniature_task  # noqa: E402
from common import write_json  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
BASE_CONFIG = Path(__file__).with_suffix(".yaml")
QUICK_POLICY = ROOT / "benchmarks" / "miniature_policy"
GRID_POLICY = ROOT / "benchmarks" / "miniature_policy_grid"
"""The committed SFT policies every grid starts from (``--quick``: made for 128 held-out
problems; the grids: 256). SFT on a CPU does not reproduce across machines to the step at which
the probe first crosses its target (float sums differ, the probe samples), so a grid made its
own policy anew each time would start from a different model; these are fingerprinted and
committed instead, and ``--make-policy`` makes a new one on purpose."""
PASS_RANGE = (0.2, 0.6)
NUM_TRAIN, NUM_PROBE = 8000, 128


@dataclass(frozen=True)
class Row:
    name: str
    label: str
    large_mu: bool
    clip: tuple[float, float]
    """(clip_low, clip_high): [1 - low, 1 + high]."""
    veto: str | None
    """veto scope, None for no veto"""
    headline: bool = False


GRID = [
    Row("grpo_mu4", "GRPO mu=4, [0.8, 1.2]", False, (0.2, 0.2), None, headline=True),
    Row("grpo_muM", "GRPO mu=M, [0.8, 1.2]", True, (0.2, 0.2), None),
    Row("relaxed_noveto", "mu=M, [0, 5], no veto", True, (1.0, 4.0), None),
    Row("veto_trigger", "mu=M, [0, 5], veto on triggers", True, (1.0, 4.0), "trigger"),
    Row("mugrpo", "Mu-GRPO: mu=M, [0, 5], suffix veto", True, (1.0, 4.0), "suffix", headline=True),
    Row("veto_suffix_no_trigger", "mu=M, [0, 5], suffix minus triggers", True, (1.0, 4.0),
        "suffix_no_trigger"),
    Row("veto_sequence", "mu=M, [0, 5], whole sequence", True, (1.0, 4.0), "sequence"),
]
DEFAULT_ROWS = ",".join(r.name for r in GRID)
POLICIES = ("keep", "drop", "drop_once")
"""algo.uniform_groups' choices."""


@dataclass(frozen=True)
class Job:
    """One training run: a row of the grid at one mu, uniform-group policy and seed."""

    row: Row
    mu: int
    uniform: str
    seed: int

    @property
    def key(self) -> str:
        """The setting (what the seeds of one table line share)."""
        return f"{self.row.name}_mu{self.mu}_{self.uniform}"

    @property
    def label(self) -> str:
        return self.row.label.replace("mu=M", f"mu={self.mu}")


def jobs_for(args, rows: list[Row]) -> tuple[list[Job], dict[str, list]]:
    """Every run, and what each table shows: {'grid': [(key, label)], 'uniform': [(key, label,
    policy)], 'phases': [(key, phases, mu)]}."""
    jobs: dict[str, Job] = {}
    tables: dict[str, list] = {"grid": [], "uniform": [], "phases": []}

    def add(row: Row, mu: int, uniform: str, seeds: int) -> str:
        for seed in range(1, seeds + 1):
            job = Job(row, mu, uniform, seed)
            jobs.setdefault(f"{job.key}_s{seed}", job)
        return Job(row, mu, uniform, 1).key

    for row in rows:
        mu = args.mu if row.large_mu else 4
        key = add(row, mu, args.uniform, args.seeds if row.headline else 1)
        tables["grid"].append((key, Job(row, mu, args.uniform, 1).label))
    if args.uniform_compare:
        for row in (r for r in rows if r.headline):
            mu = args.mu if row.large_mu else 4
            for policy in POLICIES:
                seeds = args.seeds if policy == args.uniform else args.uniform_seeds
                key = add(row, mu, policy, seeds)
                tables["uniform"].append((key, Job(row, mu, policy, 1).label, policy))
    mugrpo = next(r for r in GRID if r.name == "mugrpo")
    for phases in args.phase_sweep:
        key = add(mugrpo, args.updates // phases, args.uniform,
                  args.seeds if args.updates // phases == args.mu else 1)
        tables["phases"].append((key, phases, args.updates // phases))
    return list(jobs.values()), {k: v for k, v in tables.items() if v}


def run_job(job: Job, model: Path, data: Path, run_dir: Path, args) -> dict:
    """One training run through the package's CLI; its metrics, read back from metrics.jsonl."""
    row, seed, mu = job.row, job.seed, job.mu
    sets = {
        "model.path": model, "data.path": data / "train.jsonl", "data.eval_path": data / "eval.jsonl",
        "data.eval_size": args.eval_size, "rollout.eval_samples": args.eval_samples,
        "rollout.group_size": args.group_size, "algo.total_updates": args.updates,
        "algo.updates_per_phase": mu, "algo.samples_per_update": args.samples_per_update,
        "algo.prompts_per_phase": mu * args.samples_per_update // args.group_size,
        "algo.clip_low": row.clip[0], "algo.clip_high": row.clip[1],
        "algo.veto_threshold": "null" if row.veto is None else args.veto_threshold,
        "algo.veto_scope": row.veto or "none", "algo.uniform_groups": job.uniform,
        "algo.seed": seed, "rollout.seed": seed,
        "optim.lr": args.lr, "logging.eval_every_updates": args.eval_every,
        "logging.run_dir": run_dir,
    }
    cmd = [sys.executable, "-m", "mugrpo_megatron", "train", "--config", str(BASE_CONFIG)]
    cmd += [a for k, v in sets.items() for a in ("--set", f"{k}={v}")]
    env = dict(os.environ, PYTHONWARNINGS="ignore")
    if args.jobs > 1:  # runs side by side share the cores: one thread each
        env["OMP_NUM_THREADS"] = "1"
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True)
    wall = time.perf_counter() - t0
    if proc.returncode:
        raise SystemExit(f"{row.name} seed {seed} failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")
    return {"row": row.name, "key": job.key, "seed": seed, "mu": mu, "uniform": job.uniform,
            "wall": wall, **report.read_run(run_dir)}


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true",
                    help="Mu-GRPO only, 2 seeds, one phase, from the committed SFT policy: "
                         "checks the signal in about a minute")
    ap.add_argument("--rows", default=DEFAULT_ROWS,
                    help=f"comma-separated rows of: {', '.join(r.name for r in GRID)}")
    ap.add_argument("--seeds", type=int, default=3, help="seeds of the headline rows")
    ap.add_argument("--phases", type=int, default=4,
                    help="phases of the large-mu rows; every row makes phases x M updates")
    ap.add_argument("--mu", type=int, default=64, help="M: updates per phase of the large-mu rows")
    ap.add_argument("--uniform", default="keep", choices=POLICIES,
                    help="algo.uniform_groups of the grid")
    ap.add_argument("--no-uniform-compare", dest="uniform_compare", action="store_false",
                    help="skip the headline rows under the other uniform-group policies")
    ap.add_argument("--uniform-seeds", type=int, default=2,
                    help="seeds of the headline rows under the other uniform-group policies")
    ap.add_argument("--phase-sweep", default="2,4,8,16",
                    help="phase counts of Mu-GRPO at equal total updates ('' for none)")
    ap.add_argument("--samples-per-update", type=int, default=32)
    ap.add_argument("--group-size", type=int, default=8)
    ap.add_argument("--lr", type=float, default=1.5e-4,
                    help="the drift regime: no veto drifts (|log rho| > 0.2), GRPO mu=4 improves")
    ap.add_argument("--veto-threshold", type=float, default=1e-4)
    ap.add_argument("--jobs", type=int, default=1,
                    help="training runs side by side (times are comparable only with 1)")
    ap.add_argument("--eval-every", type=int, default=32, help="held-out curve resolution, updates")
    ap.add_argument("--eval-size", type=int, default=256)
    ap.add_argument("--eval-samples", type=int, default=4)
    ap.add_argument("--sft-target", type=float, default=0.3,
                    help="sampled probe pass rate at which SFT stops")
    ap.add_argument("--policy", help="start from this SFT policy (a directory --make-policy or "
                                     "--work-dir left) instead of making one; --quick's default: "
                                     "benchmarks/miniature_policy")
    ap.add_argument("--make-policy", metavar="DIR",
                    help="only make the SFT policy, into DIR (new, or one this script made)")
    ap.add_argument("--work-dir", help="keep the model, data and run directories here "
                                       "(default: a temporary directory, removed at the end)")
    ap.add_argument("--tag", default="", help="a suffix naming this grid's run directories, "
                                                "output files and RESULTS.md section (e.g. _lr3e-4)")
    ap.add_argument("--out", help="JSON of every run (default: results/paper_miniature{tag}.json)")
    ap.add_argument("--plot", help="PNG of the curves (default: results/paper_miniature{tag}.png)")
    ap.add_argument("--results-md", help="replace this benchmark's section of this Markdown file "
                                         "(benchmarks/RESULTS.md) with the table and plot")
    args = ap.parse_args(argv)
    results = ROOT / "benchmarks" / "results"
    args.out = args.out or str(results / f"paper_miniature{args.tag}.json")
    args.plot = args.plot or str(results / f"paper_miniature{args.tag}.png")
    if args.quick:
        args.rows, args.seeds, args.mu, args.phases, args.eval_every = "mugrpo", 2, 32, 1, 0
        args.lr, args.samples_per_update = 1e-4, 64  # what the committed policy was checked at
        args.eval_size, args.jobs, args.uniform_compare = min(args.eval_size, 128), 2, False
        args.phase_sweep, args.policy = "", args.policy or str(QUICK_POLICY)
    args.policy = args.policy or str(GRID_POLICY)
    args.updates = args.phases * args.mu
    args.phase_sweep = [int(x) for x in args.phase_sweep.split(",") if x]
    rows = [r for r in GRID if r.name in args.rows.split(",")]
    unknown = set(args.rows.split(",")) - {r.name for r in GRID}
    if unknown:
        ap.error(f"--rows: unknown {sorted(unknown)}")
    if args.mu % 4 or (args.mu * args.samples_per_update) % args.group_size:
        ap.error("--mu must be a multiple of 4 (GRPO's mu), and --mu x --samples-per-update of "
                 "--group-size")
    if any(args.updates % n or (args.updates // n) % 4 for n in args.phase_sweep):
        ap.error(f"--phase-sweep: each count must split the {args.updates} updates into phases "
                 f"of a multiple of 4")
    return args, rows


def main(argv=None) -> int:
    args, rows = parse_args(argv)
    t_start = time.perf_counter()
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(args.work_dir or tmp)
        data = work / "data"
        data.mkdir(parents=True, exist_ok=True)
        splits = miniature_task.write_splits(data, seed=0, num_train=NUM_TRAIN,
                                             num_eval=args.eval_size, num_probe=NUM_PROBE)
        import torch

        # --quick runs in the test suite beside another test file: one thread, so that a busy
        # machine slows it in proportion (two threads stalled on each other's preempted core:
        # 5x slower beside another process)
        torch.set_num_threads(1 if args.quick else 2)
        if args.make_policy:
            make_policy(Path(args.make_policy), args, splits)
            return 0
        policy, sft_info = starting_policy(args, work, splits)
        print(f"SFT: {sft_info['steps']} steps in {sft_info['seconds']:.0f}s, probe pass rate "
              f"{sft_info['probe_pass_rate']:.3f}, by operand count "
              f"{sft_info['probe_by_operands']}", flush=True)
        jobs, tables = jobs_for(args, rows)
        print(f"{len(jobs)} runs of {args.updates} updates", flush=True)

        def one(job: Job):
            r = run_job(job, policy, data, work / "runs" / f"{job.key}{args.tag}_s{job.seed}", args)
            print(f"[{job.key} seed {job.seed}] held-out {r['evals'][0][1]:.3f} -> "
                  f"{r['evals'][-1][1]:.3f}, total {r['total']:.0f}s (wall {r['wall']:.0f}s), "
                  f"late-in-phase |log rho| {r['late_phase_abs_log_ratio']:.3f}", flush=True)
            return r

        with ThreadPoolExecutor(max_workers=args.jobs) as pool:  # each job is a subprocess
            results = list(pool.map(one, jobs))
        runs: dict[str, list[dict]] = {}
        for job, r in zip(jobs, results):
            runs.setdefault(job.key, []).append(r)
    grid_seconds = time.perf_counter() - t_start
    summary = {key: report.summarize(rs) for key, rs in runs.items()}
    texts = {"grid": report.grid_table(summary, tables["grid"])}
    if "uniform" in tables:
        texts["uniform"] = report.uniform_table(summary, tables["uniform"])
    if "phases" in tables:
        texts["phases"] = report.phases_table(summary, tables["phases"])
    print("\n\n".join(texts.values()))
    print(f"grid time {grid_seconds / 60:.1f} min (SFT {sft_info['seconds']:.0f}s)")
    write_json(args.out, {"args": vars(args), "sft": sft_info, "grid_seconds": grid_seconds,
                          "tables": tables, "summary": summary, "runs": runs})
    if not args.quick:
        report.plot(runs, tables["grid"], Path(args.plot))
    if args.results_md:
        cmd = "python benchmarks/paper_miniature.py " + " ".join(argv if argv is not None else sys.argv[1:])
        report.update_results_md(Path(args.results_md), report.markdown_section(
            args, sft_info, texts, grid_seconds, cmd.strip(), ROOT), args.tag)
    if args.quick:
        return quick_checks(summary[tables["grid"][0][0]])
    return 0


def policy_fingerprint(args) -> str:
    """A digest of what the SFT policy depends on: the task's and the SFT's code, the split sizes
    (the train split is drawn after the held-out and probe ones, so it moves with --eval-size),
    the seed and the target."""
    mt = miniature_task
    code = [inspect.getsource(f) for f in (mt.make_problem, mt.write_splits, mt.make_tokenizer,
                                           mt.sft_policy, mt.sft_loss, mt.probe_pass_rate)]
    setting = json.dumps({"prompt": mt.PROMPT_TEMPLATE, "specials": mt.SPECIAL_TOKENS, "seed": 0,
                          "train": NUM_TRAIN, "eval": args.eval_size, "probe": NUM_PROBE,
                          "target": args.sft_target})
    return hashlib.sha256("\n".join([*code, setting]).encode()).hexdigest()[:16]


def starting_policy(args, work: Path, splits) -> tuple[Path, dict]:
    """The SFT policy the grid starts from and what its SFT reported: --policy's (refused unless
    made for this data and code), the one an earlier run left in --work-dir, or a new one."""
    want = policy_fingerprint(args)
    path = Path(args.policy) if args.policy else work / "policy"
    made = path / "sft.json"
    info = json.loads(made.read_text()) if made.exists() else {}
    if info.get("fingerprint") == want:
        print(f"starting from the SFT policy in {path}", flush=True)
        return path, info
    if args.policy:
        raise SystemExit(
            f"--policy {path}: made for other data or SFT code (fingerprint "
            f"{info.get('fingerprint', f'none: no {made}')}, this script's {want}); make it again "
            f"with: python benchmarks/paper_miniature.py --make-policy {path} --eval-size "
            f"{args.eval_size} --sft-target {args.sft_target}")
    return path, make_policy(path, args, splits)


def make_policy(path: Path, args, splits, **sft_options) -> dict:
    """SFT a new policy into ``path`` (an empty or new directory, or a policy this script made,
    which it replaces) and record what made it in ``sft.json``. ``sft_options`` go to
    ``sft_policy`` (the tests' smaller batches, not in the fingerprint; the script passes none)."""
    import torch
    import transformers

    if path.exists() and any(path.iterdir()) and not (path / "sft.json").exists():
        raise SystemExit(f"{path} holds files this script did not make; choose a new directory")
    sft = miniature_task.sft_policy(path, splits["train"], splits["probe"],
                                    target=args.sft_target, log=lambda m: print(m, flush=True),
                                    **sft_options)
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
