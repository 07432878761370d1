"""Runs under torchrun: ``run_dir.agree`` with per-rank inputs, as ranks on different nodes would
see them.

python -m torch.distributed.run --nproc_per_node 2 tests/dist/run_dir_worker.py MODEL OUT

One launch, every case in turn. 'start': the ranks took different decisions (rank 0 'resume',
rank 1 'new'). 'model': rank 1 reads another model.path. 'dir': each rank has a run directory of
its own. 'same': one directory, one decision. Each rank writes OUT/CASE/rank<N>.json: 'ok' or its
error.
"""

import json
import sys
from pathlib import Path

import torch.distributed as dist

from mugrpo_megatron import run_dir
from mugrpo_megatron.config.loader import load_config
from mugrpo_megatron.models.tiny import make_tiny_checkpoint


CASES = ("same", "dir", "start", "model")


def main() -> None:
    model, out = Path(sys.argv[1]), Path(sys.argv[2])
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    other = make_tiny_checkpoint(out / f"other_model{rank}", "llama", seed=9, num_layers=2)
    for case in CASES:
        where = out / case
        directory = where / ("shared" if case != "dir" else f"own{rank}") / "run"
        path = other if case == "model" and rank == 1 else model
        cfg = load_config(None, [f"model.path={path}", f"logging.run_dir={directory}",
                                 "logging.run_dir_wait_s=1"])
        start = "resume" if case == "start" and rank == 0 else "new"
        try:
            result = {"ok": run_dir.agree(cfg, start)}
        except ValueError as e:
            result = {"error": str(e)}
        dist.barrier()  # rank 0's clean-up is done
        result["exists"] = directory.exists()
        where.mkdir(parents=True, exist_ok=True)
        (where / f"rank{rank}.json").write_text(json.dumps(result))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
