"""Runs under torchrun: save learner checkpoints in one layout, resume or save them again in
another; several jobs one after the other in one launch (start-up is most of a job's cost here).

python -m torch.distributed.run --nproc_per_node N tests/dist/ckpt_worker.py BATCH JOBS

JOBS is a JSON file: a list of {"mode", "ckpt", "out", "steps", "overrides": [KEY=VALUE, ...]},
each a layout of N ranks (its overrides name the tiny checkpoint, ``model.path``). Between jobs
megatron's parallel state is torn down and made again (the default process group stays).

MODE save: take STEPS updates, save CKPT, take one more update and write OUT/weights.safetensors
(the uninterrupted run). MODE resume: load CKPT, take one update and write OUT/weights.safetensors.
Both also write OUT/result.json with the losses. MODE resave: load CKPT and save it again, without
an update, as OUT/ckpt (in this layout).
"""

import gc
import json
import sys
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from mugrpo_megatron.config.loader import load_config
from mugrpo_megatron.learner.checkpoint import load_learner, save_learner
from mugrpo_megatron.learner.export import iter_hf_tensors
from mugrpo_megatron.learner.learner import Learner
from mugrpo_megatron.types import TrainBatch


def run_job(batch_path: str, mode: str, ckpt: str, out: str, steps: int,
            overrides: list[str]) -> None:
    cfg = load_config(None, ["model.dtype=float32", *overrides])
    learner = Learner.from_config(cfg)
    if mode == "resave":
        counters = load_learner(learner, Path(ckpt))
        save_learner(learner, Path(out) / "ckpt", counters)
        return
    b = load_file(batch_path)
    batch = TrainBatch(b["tokens"], b["response_mask"].bool(), b["behav_logp"], b["advantages"])
    losses = []
    if mode == "save":
        losses = [learner.train_step(batch).loss for _ in range(steps)]
        save_learner(learner, Path(ckpt), {"update": steps, "phase": 0})
    else:
        counters = load_learner(learner, Path(ckpt))
        assert counters["update"] == steps and learner.num_updates == steps, counters
    losses.append(learner.train_step(batch).loss)
    weights = {n: t.cpu().clone() for n, t in iter_hf_tensors(learner.chunks(), learner.spec)}
    if torch.distributed.get_rank() == 0:
        Path(out).mkdir(parents=True, exist_ok=True)
        save_file(weights, str(Path(out) / "weights.safetensors"))
        (Path(out) / "result.json").write_text(json.dumps({
            "losses": losses, "lr": learner.optimizer.param_groups[0]["lr"]}))


def main() -> None:
    from megatron.core import parallel_state as mpu  # after the learner's own import of it

    batch_path, jobs = sys.argv[1], json.loads(Path(sys.argv[2]).read_text())
    for job in jobs:
        run_job(batch_path, job["mode"], job["ckpt"], job["out"], job["steps"], job["overrides"])
        gc.collect()
        mpu.destroy_model_parallel()  # the next layout makes its own groups
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
