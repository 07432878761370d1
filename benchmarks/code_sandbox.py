"""The code reward's throughput: programs scored a second through the scorer's workers, every test
case in the OS sandbox, at ``reward.num_workers`` 2 and 8 (and the same work without isolation,
``reward.sandbox: unsafe``, to price the sandbox).

    python benchmarks/code_sandbox.py [--programs 96] [--cases 5] [--quick]

The workload is what a phase of code RL scores: responses with a fenced program each, a third
correct, a third wrong on some cases, a sixth raising, a sixth with no program; each row has
``--cases`` test cases, in both layouts of verl's code parquet: standard input (APPS/TACO: one
sandboxed run a case, a failing case does not stop the others, as verl's prime_code runs them
all) and function calls (``fn_name``: one sandboxed run a program). Programs a second =
responses scored / wall seconds; runs a second = sandboxed interpreter starts / wall seconds.
"""

from __future__ import annotations

import argparse
import json
import random
import shutil
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from common import table, write_json  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]

SOLVE = {"stdin": "import sys\nnums = list(map(int, sys.stdin.read().split()))\nprint({expr})\n",
         "calls": "def solve(nums):\n    return {expr}\n"}
RIGHT = "sum(nums) * 2"
WRONG = "sum(nums) * 2 if len(nums) < 3 else 0"
RAISE = {"stdin": "import sys\nraise SystemExit(sys.stdin.read()[99])\n",
         "calls": "def solve(nums):\n    return nums[99]\n"}


def workload(n: int, cases: int, layout: str, seed: int = 0
             ) -> tuple[list[str], list[str], int]:
    """``n`` completions, their rows' test cases in ``layout``, and the sandboxed runs they
    cost."""
    rng = random.Random(seed)
    completions, answers, runs = [], [], 0
    for i in range(n):
        inputs = [[rng.randint(1, 99) for _ in range(rng.randint(1, 5))] for _ in range(cases)]
        if layout == "stdin":
            answers.append(json.dumps({"inputs": [" ".join(map(str, x)) + "\n" for x in inputs],
                                       "outputs": [f"{2 * sum(x)}\n" for x in inputs]}))
        else:
            answers.append(json.dumps({"fn_name": "solve", "inputs": [[x] for x in inputs],
                                       "outputs": [2 * sum(x) for x in inputs]}))
        kind = i % 6
        if kind in (0, 1):
            body = SOLVE[layout].format(expr=RIGHT)
        elif kind in (2, 3):
            body = SOLVE[layout].format(expr=WRONG)
        elif kind == 4:
            body = RAISE[layout]
        else:
            completions.append("I cannot write this program.")
            continue
        completions.append(f"Reasoning first.\n```python\n{body}```\n")
        runs += cases if layout == "stdin" else 1
    return completions, answers, runs


def measure(mode: str, workers: int, completions, answers, batch: int) -> dict:
    from mugrpo_megatron.config import RewardConfig
    from mugrpo_megatron.rewards import RewardScorer

    cfg = RewardConfig(name="code", sandbox=mode, num_workers=workers, batch_responses=batch)
    with RewardScorer(cfg) as scorer:
        scorer.score(completions[:workers], answers[:workers])  # workers started and warm
        start = time.perf_counter()
        out = scorer.score(completions, answers)
        seconds = time.perf_counter() - start
    assert out.num_failed == 0, out.errors
    return {"mode": mode, "workers": workers, "seconds": seconds,
            "mean_reward": sum(out.rewards) / len(out.rewards)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--programs", type=int, default=96)
    ap.add_argument("--cases", type=int, default=5)
    ap.add_argument("--batch-responses", type=int, default=1,
                    help="reward.batch_responses (1, the advice for the code reward: each "
                         "response its own task, so one slow program holds up no other)")
    ap.add_argument("--quick", action="store_true",
                    help="12 programs of 2 cases, 2 workers a mode (CI)")
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "code_sandbox.json"))
    args = ap.parse_args()
    if args.quick:
        args.programs, args.cases = 12, 2
    # --quick leaves out the 8-worker pools (16 worker starts, a third of its time in CI)
    settings = [("unsafe", 2), ("bwrap", 2)] + ([] if args.quick else [("bwrap", 8)])
    if shutil.which("bwrap") is None:
        print("bubblewrap is not installed (scripts/setup_env.sh installs it): unsafe only")
        settings = [("unsafe", 2)]
    results = []
    for layout in ("stdin", "calls"):
        completions, answers, runs = workload(args.programs, args.cases, layout)
        mine = []
        for mode, workers in settings:
            r = measure(mode, workers, completions, answers, args.batch_responses)
            r.update(layout=layout, programs_per_s=len(completions) / r["seconds"],
                     runs_per_s=runs / r["seconds"], runs=runs)
            mine.append(r)
            print(f"  {layout}, {mode} x{workers}: {r['seconds']:.1f} s", flush=True)
        rewards = {round(r["mean_reward"], 6) for r in mine}
        assert len(rewards) == 1, f"the modes scored the same work differently: {rewards}"
        results += mine
    print(f"{len(completions)} responses a layout, {args.cases} cases a program, mean reward "
          f"{results[0]['mean_reward']:.3f}, batch_responses {args.batch_responses}")
    base = {r["layout"]: r["programs_per_s"] for r in results if r["mode"] == "unsafe"}
    print(table(["layout", "sandbox", "num_workers", "seconds", "programs/s", "sandboxed runs/s",
                 "vs unsafe x2"],
                [[r["layout"], r["mode"], r["workers"], r["seconds"], r["programs_per_s"],
                  r["runs_per_s"], r["programs_per_s"] / base[r["layout"]]] for r in results]))
    write_json(args.out, {"programs": len(completions), "cases": args.cases,
                          "batch_responses": args.batch_responses, "results": results})

if __name__ == "__main__":
    main()
