"""Learner checkpoints: resume in another TP/PP/DP layout gives the update the uninterrupted run
takes, and a checkpoint saved before any update (no optimizer state yet) resumes too."""

import json

import pytest
import torch
from safetensors.torch import load_file

from helpers import ROOT, make_batch, torchrun
from mugrpo_megatron.tiny import make_tiny_checkpoint

pytestmark = pytest.mark.slow
WORKER = ROOT / "tests" / "dist" / "ckpt_worker.py"
# Adam's eps = 1.0 makes an update proportional to the gradient, so a lost or wrong moment shows
COMMON = ["parallel.micro_batch_size=2", "algo.samples_per_update=8", "algo.total_updates=8",
          "algo.updates_per_phase=4", "optim.lr=0.1", "optim.adam_eps=1.0", "optim.grad_clip=1.0",
          "optim.warmup_updates=2"]
LAYOUTS = {"tp1": (1, []), "tp2": (2, ["parallel.tensor=2"]), "pp2": (2, ["parallel.pipeline=2"]),
           "dp2": (2, [])}


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    d = tmp_path_factory.mktemp("ckpt")
    make_batch(d / "batch.safetensors")
    hf = make_tiny_checkpoint(d / "hf", "qwen2", seed=2, tie_embeddings=True)
    return d, hf


def run(setup, mode, layout, name, steps, ckpt):
    d, hf = setup
    nproc, overrides = LAYOUTS[layout]
    out = d / name
    torchrun(nproc, WORKER, mode, str(hf), str(d / "batch.safetensors"), str(d / ckpt), str(out),
             str(steps), *COMMON, *overrides)
    return load_file(str(out / "weights.safetensors")), json.loads((out / "result.json").read_text())


@pytest.mark.parametrize("steps", [2, 0])
def test_resume_in_another_layout(setup, steps):
    ref_w, ref = run(setup, "save", "tp2", f"saved_{steps}", steps, f"ckpt_{steps}")
    for layout in ("tp1", "pp2", "dp2"):
        got_w, got = run(setup, "resume", layout, f"resumed_{steps}_{layout}", steps, f"ckpt_{steps}")
        assert got["losses"][-1] == pytest.approx(ref["losses"][-1], abs=1e-6), layout
        assert got["lr"] == pytest.approx(ref["lr"]), layout  # the LR schedule resumed too
        for name, w in ref_w.items():
            assert torch.allclose(got_w[name], w, atol=1e-5), (layout, name)
