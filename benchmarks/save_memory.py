"""Host memory of a learner checkpoint save: what a save adds to each rank's resident set.

    python benchmarks/save_memory.py            # ~100M parameters, 2 gloo ranks, DP2, ~3 min
    python benchmarks/save_memory.py --quick    # ~10M parameters (the test suite runs it)

Each optimizer layout is measured in a fresh launch of 2 CPU ranks (torchrun, gloo) at data
parallel 2 with the distributed optimizer, fp32: one update (so Adam has its moments), then one
checkpoint save. Per rank: the resident set just before the save and its peak during the save
(``VmHWM`` after a reset through ``/proc/self/clear_refs``), against the size of the rank's own
optimizer shard (fp32 master weights and two moments of its 1/DP of the parameters) and of the
state the old layout gathers (the same for the whole TP x PP shard, on every rank).

- ``fully_reshardable``: megatron-core's layout that this project used before: every DP rank
  gathers the whole TP x PP shard's optimizer state (world tensors) and copies what it writes.
- ``fully_sharded_model_space``: what saves now (``compat_megatron`` part 5): each rank writes
  its own slices, staged in host memory by megatron's writer.

At 70B on TP8 x PP4 x DP2 a rank's TP x PP shard has 2.27e9 parameters: 27 GB of fp32 optimizer
state, which the old layout held on every rank at every save (plus the copy it writes); the new
one stages the rank's own ~14 GB (its half of the state) and its bf16 weights.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(Path(__file__).parent))
from common import table  # noqa: E402

SIZES = {  # llama-shaped models: ~100M and ~10M parameters
    "full": dict(hidden_size=768, ffn_hidden_size=2048, num_heads=12, num_kv_heads=4,
                 num_layers=12, vocab_size=16000),
    "quick": dict(hidden_size=256, ffn_hidden_size=704, num_heads=4, num_kv_heads=2,
                  num_layers=4, vocab_size=8000),
}
FORMATS = ("fully_reshardable", "fully_sharded_model_space")


def _status() -> dict[str, int]:
    """VmRSS and VmHWM of this process, in bytes."""
    text = Path("/proc/self/status").read_text()
    return {k: int(v) * 1024 for k, v in re.findall(r"(VmRSS|VmHWM):\s+(\d+) kB", text)}


def worker(model: Path, fmt: str, out: Path) -> None:
    """One rank (under torchrun): an update, then a save in ``fmt``; writes OUT/rank<N>.json."""
    import torch

    torch.set_num_threads(1)
    sys.path.insert(0, str(Path(__file__).parent))
    from common import random_batch

    from mugrpo_megatron.config.loader import load_config
    from mugrpo_megatron.learner.checkpoint import save_learner
    from mugrpo_megatron.learner.learner import Learner

    cfg = load_config(None, [f"model.path={model}", "model.dtype=float32",
                             "parallel.distributed_optimizer=true", "parallel.micro_batch_size=2",
                             "algo.samples_per_update=4", "algo.total_updates=4",
                             "algo.updates_per_phase=4"])
    learner = Learner.from_config(cfg)
    learner.train_step(random_batch(4, 16, 16, learner.spec.vocab_size))
    params = sum(p.numel() for c in learner.chunks() for p in c.parameters())
    dp = learner.layout.dp_size
    import gc

    gc.collect()
    before = _status()["VmRSS"]
    Path("/proc/self/clear_refs").write_text("5")  # VmHWM := VmRSS
    save_learner(learner, out / "ckpt", {"update": 1, "phase": 0}, optimizer_format=fmt)
    peak = _status()["VmHWM"]
    rank = torch.distributed.get_rank()
    (out / f"rank{rank}.json").write_text(json.dumps({
        "rss_before": before, "peak_during_save": peak, "extra": peak - before,
        "params": params, "own_optimizer_shard": 12 * params // dp,
        "tp_pp_optimizer_state": 12 * params}))
    torch.distributed.destroy_process_group()


def measure(model: Path, fmt: str, work: Path) -> list[dict]:
    out = work / fmt
    out.mkdir(parents=True)
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
           __file__, "--worker", fmt, "--model", str(model), "--out", str(out)]
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=1200)
    if proc.returncode:
        raise SystemExit(f"{fmt}: the workers failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}")
    return [json.loads((out / f"rank{r}.json").read_text()) for r in range(2)]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="a ~10M-parameter model")
    ap.add_argument("--worker", choices=FORMATS, help=argparse.SUPPRESS)
    ap.add_argument("--model", help=argparse.SUPPRESS)
    ap.add_argument("--out", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        worker(Path(args.model), args.worker, Path(args.out))
        return
    from mugrpo_megatron.models.tiny import make_tiny_checkpoint

    mib = lambda b: b / 2**20  # noqa: E731
    with tempfile.TemporaryDirectory() as tmp:
        model = make_tiny_checkpoint(Path(tmp) / "hf", "llama", seed=1,
                                     **SIZES["quick" if args.quick else "full"])
        rows, ratios = [], {}
        for fmt in FORMATS:
            for rank, r in enumerate(measure(model, fmt, Path(tmp))):
                rows.append([fmt, rank, f"{r['params'] / 1e6:.1f}M", f"{mib(r['rss_before']):.0f}",
                             f"{mib(r['peak_during_save']):.0f}", f"{mib(r['extra']):.0f}",
                             f"{mib(r['own_optimizer_shard']):.0f}",
                             f"{r['extra'] / r['own_optimizer_shard']:.2f}"])
                ratios.setdefault(fmt, []).append(r["extra"] / r["own_optimizer_shard"])
    print(table(["optimizer layout", "rank", "parameters", "RSS before (MiB)",
                 "peak in save (MiB)", "extra (MiB)", "own optimizer shard (MiB)",
                 "extra / own shard"], rows))
    old, new = (max(ratios[f]) for f in FORMATS)
    print(f"largest extra over the rank's own optimizer shard: {old:.2f}x before "
          f"(fully_reshardable), {new:.2f}x now (fully_sharded_model_space)")


if __name__ == "__main__":
    main()
