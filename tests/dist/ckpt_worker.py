"""Runs under torchrun: save a learner checkpoint in one layout, resume it in another.

python -m torch.distributed.run --nproc_per_node N tests/dist/ckpt_worker.py MODE HF_DIR BATCH CKPT OUT STEPS KEY=VALUE...

MODE save: take STEPS updates, save CKPT, take one more update and write OUT/weights.safetensors
(the uninterrupted run). MODE resume: load CKPT, take one update and write OUT/weights.safetensors.
Both also write OUT/result.json with the losses. MODE resave: load CKPT and save it again, without
an update, as OUT/ckpt (in this layout).
"""

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


def main() -> None:
    mode, hf_dir, batch_path, ckpt, out, steps = sys.argv[1:7]
    cfg = load_config(None, [f"model.path={hf_dir}", "model.dtype=float32", *sys.argv[7:]])
    learner = Learner.from_config(cfg)
    b = load_file(batch_path)
    batch = TrainBatch(b["tokens"], b["response_mask"].bool(), b["behav_logp"], b["advantages"])
    losses = []
    if mode == "resave":
        counters = load_learner(learner, Path(ckpt))
        save_learner(learner, Path(out) / "ckpt", counters)
        torch.distributed.destroy_process_group()
        return
    if mode == "save":
        losses = [learner.train_step(batch).loss for _ in range(int(steps))]
        save_learner(learner, Path(ckpt), {"update": int(steps), "phase": 0})
    else:
        counters = load_learner(learner, Path(ckpt))
        assert counters["update"] == int(steps) and learner.num_updates == int(steps), counters
    losses.append(learner.train_step(batch).loss)
    weights = {n: t.cpu().clone() for n, t in iter_hf_tensors(learner.chunks(), learner.spec)}
    if torch.distributed.get_rank() == 0:
        Path(out).mkdir(parents=True, exist_ok=True)
        save_file(weights, str(Path(out) / "weights.safetensors"))
        (Path(out) / "result.json").write_text(json.dumps({
            "losses": losses, "lr": learner.optimizer.param_groups[0]["lr"]}))
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
