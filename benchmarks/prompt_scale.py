"""The training prompt set at 10^4 to 10^6 prompts: peak memory per rank and start-up time, on CPU
with 2 gloo ranks, through the package's own code.

For each size a JSON-lines file of synthetic prompts (~100 tokens each after the chat template,
with a real HF tokenizer: the tiny byte-level BPE of ``mugrpo_megatron.models.tiny``) is written once;
then two fresh processes form a gloo world and, as the trainer does at start,

- **new** (``data.prompt_store.open_prompt_set``): rank 0 tokenizes the file into the run
  directory's prompt file, the other rank waits; both open it; each then reads the token ids of
  one phase's prompts (16,384, the 70B config's ``algo.prompts_per_phase``, drawn as the
  scheduler draws them) through ``ids_view`` as a replica's engine does, and prompts as the
  leader's shard writer does;
- **reuse**: the same at the largest size, started again in the same run directory (a resume:
  the file is opened, not written);
- **old** (``--old-path N``): every rank calls ``load_prompts`` (each prompt's ids a tuple of
  Python ints); with ``--old-tree DIR`` the package is imported from DIR, e.g. a worktree of the
  commit before the prompt file (``git worktree add /tmp/old 40b28f8``), so that what is measured
  is what the trainer then did.

Reported per rank: peak RSS (the kernel's VmHWM), the peak of anonymous RSS (sampled every 10 ms;
the process's own memory without file-backed pages), the RSS after the imports (the baseline both
paths share), seconds until the prompts are ready, and seconds to read a phase's prompts.

    python benchmarks/prompt_scale.py                        # 10^4, 10^5, 10^6 (new path)
    python benchmarks/prompt_scale.py --old-path 100000 --old-tree /tmp/old
    python benchmarks/prompt_scale.py --quick                # 2x10^3 and 8x10^3 (the suite's)
"""

from __future__ import annotations

import argparse
import json
import os
import random
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))
from common import table, write_json  # noqa: E402

PHASE_PROMPTS = 16_384
WORDS = ("what is the answer to add numbers trees grove workers plant today there are how many "
         "system assistant helpful").split()


def write_data(path: Path, n: int, seed: int = 0) -> None:
    """``n`` synthetic problems, ~100 tokens each after the chat template and instruction."""
    rng = random.Random(seed)
    with path.open("w") as f:
        for i in range(n):
            words = " ".join(rng.choices(WORDS, k=rng.randrange(30, 50)))
            f.write(json.dumps({"question": f"{words} {i} + {rng.randrange(100)}?",
                                "answer": str(i)}) + "\n")


def rss() -> dict[str, float]:
    out = {}
    for line in Path("/proc/self/status").read_text().splitlines():
        key, _, value = line.partition(":")
        if key in ("VmHWM", "VmRSS", "RssAnon"):
            out[key] = int(value.split()[0]) / 1024
    return out


def rank_main(spec: str) -> None:
    """One of the two ranks (``torchrun``, ``--rank-spec``): open the prompt set as ``mode`` says
    and read a phase's prompts; writes its numbers into the spec's directory."""
    args = json.loads(Path(spec).read_text())
    out = args["out"]
    if args["old_tree"]:
        sys.path.insert(0, args["old_tree"])
    import numpy as np
    import torch.distributed as dist
    from phase_scale import PeakMemory
    from transformers import AutoTokenizer

    from mugrpo_megatron.config.loader import load_config
    from mugrpo_megatron.data import load_prompts

    dist.init_process_group("gloo")
    rank = dist.get_rank()
    cfg = load_config(None, [f"model.path={args['model']}", f"data.path={args['data']}",
                             f"logging.run_dir={args['run_dir']}", "logging.progress=false"])
    tok = AutoTokenizer.from_pretrained(args["model"])
    dist.barrier()
    base = rss()
    peak = PeakMemory()
    t0 = time.perf_counter()
    if args["mode"] != "old":
        from mugrpo_megatron.data.prompt_store import open_prompt_set

        prompts = open_prompt_set(cfg, Path(args["run_dir"]), tok)
    else:
        prompts, _ = load_prompts(cfg.data, tok)
    ready = time.perf_counter() - t0
    n = len(prompts)
    # one phase's prompts, drawn as the scheduler draws them (a seeded permutation)
    picks = np.random.default_rng(0).permutation(n)[:min(n, PHASE_PROMPTS)].tolist()
    t1 = time.perf_counter()
    if args["mode"] != "old":
        view = prompts.ids_view(picks)
        tokens = sum(len(view[i]) for i in range(len(view)))
        answers = sum(len(prompts[i].answer) for i in picks[:2048])
    else:
        tokens = sum(len(prompts[i].token_ids) for i in picks)
        answers = sum(len(prompts[i].answer) for i in picks[:2048])
    read = time.perf_counter() - t1
    mem = peak.stop()
    dist.barrier()
    result = {"rank": rank, "prompts": n, "ready_s": ready, "read_phase_s": read,
              "phase_tokens": tokens, "answers_chars": answers, "base_rss_mib": base["VmRSS"],
              **mem}
    Path(out, f"rank{rank}.json").write_text(json.dumps(result))
    dist.destroy_process_group()


def run_size(n: int, mode: str, args, work: Path, model: str) -> list[dict]:
    data = work / f"prompts_{n}.jsonl"
    if not data.exists():
        write_data(data, n)
    out = Path(tempfile.mkdtemp(dir=work))
    # reuse: a second start in the run directory of the last 'new' start (a resume)
    run_dir = work / f"run_{n}"
    spec = {"mode": mode, "model": model, "data": str(data),
            "run_dir": str(run_dir if mode != "old" else out / "run"),
            "old_tree": args.old_tree if mode == "old" else None, "out": str(out)}
    (out / "spec.json").write_text(json.dumps(spec))
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
           __file__, "--rank-spec", str(out / "spec.json")]
    proc = subprocess.run(cmd, env=dict(os.environ, OMP_NUM_THREADS="1"), timeout=3600)
    if proc.returncode:
        raise RuntimeError(f"{mode} at {n} prompts: a rank failed (exit code {proc.returncode})")
    return [json.loads((out / f"rank{r}.json").read_text()) for r in range(2)]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--sizes", default="10000,100000,1000000")
    ap.add_argument("--old-path", type=int, default=0, help="also run the old path at this size")
    ap.add_argument("--old-tree", default=None, help="import the old path's package from here")
    ap.add_argument("--work-dir", default=None, help="where the data files go (default: a tmp dir)")
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "prompt_scale.json"))
    ap.add_argument("--quick", action="store_true", help="2x10^3 and 8x10^3 prompts")
    ap.add_argument("--rank-spec", help=argparse.SUPPRESS)  # one rank of a run (under torchrun)
    args = ap.parse_args()
    if args.rank_spec:
        rank_main(args.rank_spec)
        return 0
    if args.quick:
        args.sizes = "2000,8000"
        args.out = str(Path(tempfile.gettempdir()) / "prompt_scale_quick.json")
    os.environ.update(OMP_NUM_THREADS="1", TOKENIZERS_PARALLELISM="false",
                      HF_HUB_OFFLINE="1", PYTHONWARNINGS="ignore")
    sizes = [int(s) for s in args.sizes.split(",")]
    with tempfile.TemporaryDirectory(dir=args.work_dir) as tmp:
        work = Path(tmp)
        from mugrpo_megatron.models.tiny import make_tokenizer

        model = work / "model"
        make_tokenizer(model)
        runs = [("new", n) for n in sizes] + [("reuse", sizes[-1])] + \
            ([("old", args.old_path)] if args.old_path else [])
        results = {f"{mode}_{n}": run_size(n, mode, args, work, str(model)) for mode, n in runs}
    rows = []
    for key, (r0, r1) in results.items():
        mode, n = key.split("_")
        rows.append([mode, f"{int(n):,}", f"{r0['peak_rss_mib']:.0f} / {r1['peak_rss_mib']:.0f}",
                     f"{r0['peak_anon_mib']:.0f} / {r1['peak_anon_mib']:.0f}",
                     f"{r0['base_rss_mib']:.0f} / {r1['base_rss_mib']:.0f}",
                     f"{r0['ready_s']:.1f} / {r1['ready_s']:.1f}",
                     f"{r0['read_phase_s']:.2f} / {r1['read_phase_s']:.2f}"])
    print(table(["path", "prompts", "peak RSS r0 / r1 MiB", "peak anon MiB", "RSS after imports",
                 "ready s", "read a phase s"], rows))
    new = [results[f"new_{n}"] for n in sizes]
    growth = [max(b[r]["peak_rss_mib"] / a[r]["peak_rss_mib"] - 1 for r in range(2))
              for a, b in [(new[0], new[-1])]][0]
    tokens = new[-1][0]["phase_tokens"] / min(sizes[-1], PHASE_PROMPTS)
    print(f"peak RSS per rank grows {growth:.1%} from {sizes[0]:,} to {sizes[-1]:,} prompts "
          f"(goal < 20%); {tokens:.0f} tokens a prompt")
    write_json(args.out, {"args": vars(args), "results": results, "rss_growth": growth})
    same = all(r[0]["prompts"] == r[1]["prompts"] == int(k.split("_")[1]) and
               r[0]["phase_tokens"] == r[1]["phase_tokens"] for k, r in results.items())
    return 0 if same else 1


if __name__ == "__main__":
    sys.exit(main())
